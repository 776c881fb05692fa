"""Every name the operator derives from a job stays valid at any attempt and rank.

A pod's name is its hostname (a DNS label, at most 63 characters), and the attempt counter
grows with every preemption: a name that fits at attempt 0 must still fit at attempt 1000.
The job's own name is checked at admission (test_crd_schema.py; the API server in
test_admission_cluster.py); these tests build the manifests at the edges of what it admits.
"""

from __future__ import annotations

import itertools
import re
from typing import Any

import pytest
from baton_operator.pure import manifests
from baton_operator.pure.model import JobSpec
from baton_operator.pure.settings import OperatorConfig

CONFIG = OperatorConfig(sidecar_image="baton:test", sidecar_command=("baton-sidecar",))
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
ATTEMPTS = (0, 10, 1000)
RANKS = (0, 1, 10)


def job_name(length: int) -> str:
    return ("job-" + "x" * length)[:length]


def body(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "ml", "uid": "u-1", "generation": 1},
        "spec": {
            "replicas": 11,
            "template": {"spec": {"containers": [{"name": "trainer", "image": "t:1"}]}},
            "checkpoint": {"uri": "s3://b/p"},
            **spec,
        },
    }


def derived(spec: JobSpec, attempt: int, rank: int) -> dict[str, str]:
    """Every name and label value the operator writes for one rank of one attempt."""
    pod = manifests.pod_manifest(
        spec, CONFIG, attempt=attempt, rank=rank, replicas=11, master_addr="10.0.0.1",
        resume_step=None, pod_group=manifests.pod_group_name(spec.name, attempt),
    )  # fmt: skip
    group = manifests.pod_group_manifest(spec, attempt=attempt, replicas=11)
    names = {
        "pod": pod["metadata"]["name"],
        "hostname": pod["spec"]["hostname"],
        "subdomain": pod["spec"]["subdomain"],
        "service": manifests.service_manifest(spec)["metadata"]["name"],
        "pod group": group["metadata"]["name"],
        "kueue group": manifests.kueue_group(spec.name, attempt),
    }
    for owner, meta in (("pod", pod["metadata"]), ("pod group", group["metadata"])):
        for key, value in meta["labels"].items():
            names[f"{owner} label {key}"] = value
    return names


@pytest.mark.parametrize("length", [57, 63])
@pytest.mark.parametrize(("attempt", "rank"), list(itertools.product(ATTEMPTS, RANKS)))
def test_every_derived_name_is_a_dns_label_at_any_attempt_and_rank(
    length: int, attempt: int, rank: int
) -> None:
    spec = JobSpec.from_body(body(job_name(length)))
    assert spec.spec_error is None
    for what, name in derived(spec, attempt, rank).items():
        assert len(name) <= manifests.MAX_DNS_LABEL, (what, name)
        assert DNS_LABEL.match(name), (what, name)
    secret = manifests.token_secret_manifest(spec, "t")["metadata"]["name"]
    assert len(secret) <= 253
    assert DNS_LABEL.match(secret)


@pytest.mark.parametrize("length", [57, 63])
def test_derived_pod_names_are_unique_and_stable(length: int) -> None:
    name = job_name(length)
    grid = [(a, r) for a in range(0, 1001, 7) for r in range(16)]
    pods = [manifests.pod_name(name, a, r) for a, r in grid]
    assert len(set(pods)) == len(pods)
    assert pods == [manifests.pod_name(name, a, r) for a, r in grid]  # deterministic
    groups = {manifests.pod_group_name(name, a) for a in range(1001)}
    assert len(groups) == 1001


def test_a_name_that_fits_keeps_the_readable_form() -> None:
    assert manifests.pod_name("tiny", 3, 1) == "tiny-a3-r1"
    name = job_name(57)
    assert manifests.pod_name(name, 9, 1) == f"{name}-a9-r1"  # 63 characters: unchanged
    cut = manifests.pod_name(name, 10, 1)  # 64 characters: the head and a digest
    assert len(cut) == 63
    assert cut.startswith(name[:50])
    assert cut != manifests.pod_name(name, 1, 10)


def test_the_master_and_sidecar_dns_names_use_the_bounded_hostname() -> None:
    spec = JobSpec.from_body(body(job_name(63)))
    master = manifests.master_dns_name(spec, CONFIG, 1000)
    assert master.split(".")[0] == manifests.pod_name(spec.name, 1000, 0)
    assert all(len(label) <= 63 for label in master.split("."))
    address = manifests.sidecar_address(spec, CONFIG, 1000, 10)
    assert f"//{manifests.pod_name(spec.name, 1000, 10)}.{spec.name}.ml.svc." in address


@pytest.mark.parametrize("name", ["my.job", "My-job", "1job", "job-", "a_b", job_name(64)])
def test_the_operator_fails_a_name_the_crd_would_refuse(name: str) -> None:
    """The backstop for a job admitted under an older CRD: a clear InvalidSpec, no pod."""
    error = JobSpec.from_body(body(name)).spec_error
    assert error is not None
    assert "metadata.name" in error
    assert "DNS-1035" in error


@pytest.mark.parametrize("port", [0, 65536, 70000])
def test_the_operator_fails_a_master_port_that_is_not_a_port(port: int) -> None:
    error = JobSpec.from_body(body("ok", masterPort=port)).spec_error
    assert error is not None
    assert f"spec.masterPort={port}" in error
    assert "65535" in error


@pytest.mark.parametrize("port", [1, 29500, 65535])
def test_a_master_port_in_range_is_run(port: int) -> None:
    assert JobSpec.from_body(body("ok", masterPort=port)).spec_error is None
