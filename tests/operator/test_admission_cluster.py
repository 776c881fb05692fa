"""What would fail a job later is refused where the user applies it, on the local cluster.

A job's name reaches a Service, pod hostnames and label values; its ``masterPort`` reaches the
Service's port. The API server must refuse a name or a port that cannot work, naming the
TrainingJob's own field and the fix; and the longest name it admits must give pods that the
API server accepts at any attempt and rank (checked with server-side dry runs of the very
manifests the operator would create, at attempt 1000 and rank 10).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from baton_operator.pure import manifests
from baton_operator.pure.model import JobSpec
from baton_operator.pure.settings import OperatorConfig
from baton_testing.cluster import LocalCluster
from baton_testing.jobs import training_job
from baton_testing.operator_harness import NAMESPACE, OperatorInstall

pytestmark = pytest.mark.cluster

DRY = ("apply", "--dry-run=server", "-f", "-")


def _job(name: str) -> dict[str, Any]:
    return training_job(
        name, NAMESPACE, command=["true"], checkpoint={"uri": "/tmp/ckpt", "everySteps": 5},
        failure_policy={"maxFailures": 0},
    )  # fmt: skip


def _dry_run(cluster: LocalCluster, manifest: dict[str, Any]) -> tuple[int, str]:
    result = cluster.kubectl(*DRY, input=yaml.safe_dump(manifest), check=False)
    return result.returncode, result.stderr


@pytest.fixture(scope="module")
def cluster(operator_install: OperatorInstall) -> LocalCluster:
    cluster = operator_install.cluster
    cluster.kubectl("create", "namespace", NAMESPACE, check=False)
    return cluster


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("my.job", "must be a DNS-1035 label"),
        ("My-job", "must be a DNS-1035 label"),
        ("job-" + "x" * 60, "must have at most 63 characters"),
    ],
)
def test_a_name_that_cannot_name_a_service_is_refused(
    cluster: LocalCluster, name: str, expected: str
) -> None:
    rc, err = _dry_run(cluster, _job(name))
    assert rc != 0, f"{name!r} admitted"
    assert "metadata.name: Invalid value" in err, err
    assert expected in err, err


def test_a_master_port_that_is_not_a_port_is_refused_naming_spec_master_port(
    cluster: LocalCluster,
) -> None:
    job = _job("tj-port")
    job["spec"]["masterPort"] = 70000
    rc, err = _dry_run(cluster, job)
    assert rc != 0, "masterPort 70000 admitted"
    assert "spec.masterPort: Invalid value: 70000" in err, err
    assert "65535" in err, err


@pytest.mark.parametrize("missing", ["template", "replicas", "checkpoint"])
def test_a_missing_required_field_is_one_line_naming_it(
    cluster: LocalCluster, missing: str
) -> None:
    job = _job("tj-missing")
    del job["spec"][missing]
    rc, err = _dry_run(cluster, job)
    assert rc != 0, f"a job without spec.{missing} admitted"
    assert f"spec.{missing}: Required value" in err, err
    assert "<nil>" not in err, err
    assert "Invalid value: null" not in err, err


def _admitted_with_valid_objects(
    cluster: LocalCluster, name: str, replicas: int, at: tuple[tuple[int, int], ...]
) -> None:
    """The job is admitted, and its Service, Secret and pods at each (attempt, rank) of
    ``at`` are accepted by the API server (server-side dry runs)."""
    job = _job(name)
    job["spec"]["replicas"] = replicas
    rc, err = _dry_run(cluster, job)
    assert rc == 0, f"a {len(name)}-character DNS-1035 name must be admitted: {err}"
    body = copy.deepcopy(job)
    body["metadata"]["uid"] = "00000000-0000-0000-0000-000000000000"
    spec = JobSpec.from_body(body)
    config = OperatorConfig(sidecar_image="baton-sidecar:dev", sidecar_command=("baton-sidecar",))
    service = manifests.service_manifest(spec)
    secret = manifests.token_secret_manifest(spec, "t")
    for attempt, rank in at:
        pod = manifests.pod_manifest(
            spec, config, attempt=attempt, rank=rank, replicas=replicas, master_addr="10.0.0.1",
            resume_step=None,
        )  # fmt: skip
        # An owner that does not exist is fine for a dry run: only the names are judged.
        for manifest in (pod, service, secret):
            rc, err = _dry_run(cluster, manifest)
            assert rc == 0, (manifest["kind"], manifest["metadata"]["name"], err)


def test_the_longest_admitted_name_gives_valid_pods_at_attempt_1000_rank_10(
    cluster: LocalCluster,
) -> None:
    name = "job-" + "x" * 59  # 63 characters
    _admitted_with_valid_objects(cluster, name, 11, ((0, 0), (10, 1), (1000, 10)))


def test_a_57_character_name_with_2_replicas_survives_its_tenth_attempt(
    cluster: LocalCluster,
) -> None:
    # Issue 31's case: '<name>-a10-r1' would be 64 characters, an invalid hostname, which
    # once failed the job for good at its tenth attempt; it is now cut with a digest, while
    # '<name>-a9-r1' (63) is kept as it is.
    name = "job-" + "x" * 53
    assert len(name) == 57
    assert len(f"{name}-a10-r1") == 64
    _admitted_with_valid_objects(cluster, name, 2, ((9, 1), (10, 0), (10, 1), (99, 1)))


def test_explain_and_describe_say_what_a_field_takes(cluster: LocalCluster) -> None:
    explain = cluster.kubectl("explain", "trainingjob.spec.checkpoint.everySeconds").stdout
    assert "A number of seconds or the string `auto`" in " ".join(explain.split()), explain
    keep = cluster.kubectl("explain", "trainingjob.spec.checkpoint.keepLast").stdout
    assert "Default: 3" in " ".join(keep.split()), keep
    name = "tj-no-tier"
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(_job(name)))
    try:
        stored = yaml.safe_load(
            cluster.kubectl("get", "trainingjob", name, "-n", NAMESPACE, "-o", "yaml").stdout
        )
        assert "fastReplicas" not in stored["spec"]["checkpoint"], stored["spec"]["checkpoint"]
        described = cluster.kubectl("describe", "trainingjob", name, "-n", NAMESPACE).stdout
        assert "Fast Replicas" not in described, described
    finally:
        cluster.kubectl("delete", "trainingjob", name, "-n", NAMESPACE, "--wait=false")
