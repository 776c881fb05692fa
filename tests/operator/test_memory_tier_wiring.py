"""The memory tier's wiring (issue 17): ``spec.checkpoint.fastEverySteps`` and its sizing, the
pods' ``medium: Memory`` emptyDir, the env of the trainer and the sidecar, the replication
peers, and the sidecar's memory sized from ``fastSizeLimit`` and ``fastReplicas``."""

from __future__ import annotations

import json
from typing import Any

import pytest
from baton_operator import manifests
from baton_operator.model import JobSpec, parse_bytes
from baton_operator.settings import OperatorConfig

from .test_crd_schema import _violations, valid_job

CONFIG = OperatorConfig(sidecar_image="baton:test", cluster_domain="example.local")
MI = 1 << 20


def job(replicas: int = 3, **checkpoint: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "tiny", "namespace": "ml", "uid": "u-1", "generation": 1},
        "spec": {
            "replicas": replicas,
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "trainer",
                            "command": ["python", "train.py"],
                            "env": [
                                {"name": "BATON_FAST_DIR", "value": "/elsewhere"},
                                {"name": "BATON_FAST_EVERY_STEPS", "value": "99"},
                                {"name": "LR", "value": "1"},
                            ],
                            "volumeMounts": [{"name": "baton-fast", "mountPath": "/mine"}],
                        }
                    ],
                    "volumes": [{"name": "baton-fast", "emptyDir": {}}],
                }
            },
            "checkpoint": {"uri": "s3://b/p", **checkpoint},
        },
    }


def pod(rank: int = 1, replicas: int = 3, **checkpoint: Any) -> dict[str, Any]:
    spec = JobSpec.from_body(job(replicas, **checkpoint))
    assert spec.spec_error is None, spec.spec_error
    return manifests.pod_manifest(
        spec, CONFIG, attempt=2, rank=rank, replicas=replicas, master_addr="m", resume_step=None
    )


def container(p: dict[str, Any], name: str) -> dict[str, Any]:
    return next(
        c for c in p["spec"]["containers"] + p["spec"]["initContainers"] if c["name"] == name
    )


def env(c: dict[str, Any]) -> dict[str, Any]:
    names = [e["name"] for e in c["env"]]
    assert len(names) == len(set(names)), f"duplicate env in {c['name']}: {names}"
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


TIER = {"fastEverySteps": 1, "fastSizeLimit": "4Gi"}


@pytest.mark.parametrize(
    ("value", "expected"),
    [("4Gi", 4 << 30), ("1.5G", 1_500_000_000), ("512Mi", 512 * MI), ("100k", 100_000),
     (1 << 30, 1 << 30), ("0.5Ki", 512), ("0", None), ("0Gi", None), ("-1Gi", None),
     ("4GB", None), ("4 Gi", None), ("1e9", None), (0, None), (True, None), ("", None)],
)  # fmt: skip
def test_size_limits_parse_as_byte_quantities(value: object, expected: int | None) -> None:
    assert parse_bytes(value) == expected


def test_the_spec_parses_the_tier_with_one_replica_by_default() -> None:
    spec = JobSpec.from_body(job(**TIER))
    assert spec.spec_error is None
    assert spec.fast is not None
    assert (spec.fast.every_steps, spec.fast.size_limit, spec.fast.size_bytes) == (
        1,
        "4Gi",
        4 << 30,
    )
    assert spec.fast.replicas == 1
    off = JobSpec.from_body(job())
    assert (off.fast, off.spec_error) == (None, None)


@pytest.mark.parametrize(
    ("checkpoint", "replicas", "says"),
    [
        ({"fastEverySteps": 0, "fastSizeLimit": "1Gi"}, 3, "fastEverySteps=0: use an integer"),
        ({"fastEverySteps": "2", "fastSizeLimit": "1Gi"}, 3, "fastEverySteps='2'"),
        ({"fastEverySteps": 1}, 3, "fastSizeLimit is required with fastEverySteps"),
        ({"fastEverySteps": 1, "fastSizeLimit": "4GB"}, 3, "write it like 4Gi"),
        ({"fastEverySteps": 1, "fastSizeLimit": "0"}, 3, "not a positive byte quantity"),
        ({**TIER, "fastReplicas": 0}, 3, "fastReplicas=0: use an integer of 1 or more"),
        ({**TIER, "fastReplicas": 3}, 3, "must be less than spec.replicas=3"),
    ],
)
def test_a_bad_tier_is_a_spec_error_that_names_the_fix(
    checkpoint: dict[str, Any], replicas: int, says: str
) -> None:
    spec = JobSpec.from_body(job(replicas, **checkpoint))
    assert spec.fast is None
    assert spec.spec_error is not None
    assert says in spec.spec_error
    assert spec.spec_error.startswith("spec.checkpoint.fast")


@pytest.mark.parametrize(
    ("checkpoint", "field"),
    [
        ({"fastEverySteps": 0, "fastSizeLimit": "1Gi"}, "spec.checkpoint.fastEverySteps"),
        ({"fastEverySteps": 1}, "spec.checkpoint.fastSizeLimit is required"),
        ({"fastEverySteps": 1, "fastSizeLimit": "4GB"}, "spec.checkpoint.fastSizeLimit must"),
        ({"fastEverySteps": 1, "fastSizeLimit": "0.0Mi"}, "spec.checkpoint.fastSizeLimit must"),
        ({"fastEverySteps": 1, "fastSizeLimit": 0}, "spec.checkpoint.fastSizeLimit must"),
        ({**TIER, "fastReplicas": 2}, "spec.checkpoint.fastReplicas must be less"),
    ],
)
def test_the_crd_refuses_the_same_at_admission(checkpoint: dict[str, Any], field: str) -> None:
    body = valid_job()
    body["spec"]["checkpoint"].update(checkpoint)
    messages = _violations(body)
    assert len(messages) == 1, messages
    assert messages[0].startswith(field)


@pytest.mark.parametrize("size", ["4Gi", "1.5G", 1 << 30, "512Mi"])
def test_the_crd_accepts_a_tier(size: object) -> None:
    body = valid_job()
    body["spec"]["checkpoint"].update(fastEverySteps=5, fastSizeLimit=size, fastReplicas=1)
    assert _violations(body) == []
    body["spec"]["replicas"] = 1  # one pod: no copy to make, and no error either
    body["spec"].pop("minReplicas")
    assert _violations(body) == []


def test_without_the_tier_nothing_changes() -> None:
    p = pod()
    assert all(v["name"] != "baton-fast" for v in p["spec"]["volumes"])
    trainer = container(p, "trainer")
    assert "BATON_FAST_DIR" not in env(trainer), "the operator's names are dropped from user env"
    assert all(m["name"] != "baton-fast" for m in trainer["volumeMounts"])
    sidecar = container(p, "baton-sidecar")
    assert not {"BATON_FAST_DIR", "BATON_REPLICATION_PEERS"} & set(env(sidecar))
    assert sidecar["resources"] == {"requests": {"cpu": "10m", "memory": "48Mi"}}


def test_the_memory_emptydir_is_mounted_in_the_trainer_and_the_sidecar_at_one_path() -> None:
    p = pod(**TIER)
    fast = [v for v in p["spec"]["volumes"] if v["name"] == "baton-fast"]
    assert fast == [{"name": "baton-fast", "emptyDir": {"medium": "Memory", "sizeLimit": "4Gi"}}]
    for name in ("trainer", "baton-sidecar"):
        mounts = [m for m in container(p, name)["volumeMounts"] if m["name"] == "baton-fast"]
        assert mounts == [{"name": "baton-fast", "mountPath": manifests.FAST_DIR}], name
    trainer = env(container(p, "trainer"))
    assert trainer["BATON_FAST_EVERY_STEPS"] == "1"
    assert trainer["BATON_FAST_DIR"] == manifests.FAST_DIR
    assert trainer["LR"] == "1", "the user's other env stays"


def test_the_sidecar_replicates_to_the_other_pods_in_ring_order_by_dns_name() -> None:
    p = pod(rank=1, replicas=3, **TIER)
    sidecar = env(container(p, "baton-sidecar"))
    assert sidecar["BATON_FAST_DIR"] == manifests.FAST_DIR
    assert sidecar["BATON_REPLICATION_REPLICAS"] == "1"
    assert sidecar["BATON_FAILURE_DOMAIN"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    peers = json.loads(sidecar["BATON_REPLICATION_PEERS"])
    assert peers == [
        {"address": "http://tiny-a2-r2.tiny.ml.svc.example.local:9440", "domain": ""},
        {"address": "http://tiny-a2-r0.tiny.ml.svc.example.local:9440", "domain": ""},
    ]
    # The pod's own DNS name is what the peers' lists name (hostname.subdomain).
    assert (p["spec"]["hostname"], p["spec"]["subdomain"]) == ("tiny-a2-r1", "tiny")


def test_the_sidecars_peer_list_parses_as_the_sidecar_reads_it() -> None:
    from baton_sidecar._config import parse_config

    p = pod(rank=0, replicas=3, **TIER, fastReplicas=2)
    values = {k: v for k, v in env(container(p, "baton-sidecar")).items() if isinstance(v, str)}
    config = parse_config([], {**values, "BATON_FAILURE_DOMAIN": "node-a"})
    assert str(config.fast_dir) == manifests.FAST_DIR
    assert config.replicas == 2
    assert [peer.address for peer in config.peers] == [
        "http://tiny-a2-r1.tiny.ml.svc.example.local:9440",
        "http://tiny-a2-r2.tiny.ml.svc.example.local:9440",
    ]


@pytest.mark.parametrize(
    ("size", "copies", "request_mi", "limit_mi"),
    [
        # request: 64 MiB + copies / (1 + copies) of sizeLimit; limit: 64 MiB + sizeLimit
        ("4Gi", 1, 64 + 2048, 64 + 4096),
        ("4Gi", 3, 64 + 3072, 64 + 4096),
        ("1G", 1, 64 + 477, 64 + 954),  # 500,000,000 B = 476.84 MiB, rounded up
    ],
)
def test_the_sidecars_memory_grows_with_the_replicas_it_holds(
    size: str, copies: int, request_mi: int, limit_mi: int
) -> None:
    p = pod(replicas=4, fastEverySteps=2, fastSizeLimit=size, fastReplicas=copies)
    resources = container(p, "baton-sidecar")["resources"]
    assert resources == {
        "requests": {"cpu": "10m", "memory": f"{request_mi}Mi"},
        "limits": {"memory": f"{limit_mi}Mi"},
    }


def test_a_single_pod_snapshots_but_has_nothing_to_replicate() -> None:
    p = pod(rank=0, replicas=1, **TIER)
    assert env(container(p, "trainer"))["BATON_FAST_DIR"] == manifests.FAST_DIR
    sidecar = container(p, "baton-sidecar")
    assert "BATON_FAST_DIR" not in env(sidecar)
    assert sidecar["resources"]["requests"]["memory"] == "48Mi"


def test_a_shrunken_attempt_copies_to_at_most_its_other_pods() -> None:
    spec = JobSpec.from_body(job(4, **TIER, fastReplicas=3))
    p = manifests.pod_manifest(
        spec, CONFIG, attempt=5, rank=0, replicas=2, master_addr=None, resume_step=7
    )
    sidecar = env(container(p, "baton-sidecar"))
    assert sidecar["BATON_REPLICATION_REPLICAS"] == "1"
    assert len(json.loads(sidecar["BATON_REPLICATION_PEERS"])) == 1


def test_restricted_pod_security_still_holds() -> None:
    p = pod(**TIER)
    assert p["spec"]["securityContext"]["runAsNonRoot"] is True
    for c in p["spec"]["containers"] + p["spec"]["initContainers"]:
        ctx = c["securityContext"]
        assert ctx["allowPrivilegeEscalation"] is False
        assert ctx["capabilities"] == {"drop": ["ALL"]}
        assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}
    # restricted allows these volume kinds only; no hostPath sneaks in for the tier.
    allowed = {"emptyDir", "secret", "configMap", "projected", "downwardAPI",
               "persistentVolumeClaim", "ephemeral", "csi"}  # fmt: skip
    for v in p["spec"]["volumes"]:
        assert set(v) - {"name"} <= allowed, v
    assert container(p, "baton-sidecar")["securityContext"]["readOnlyRootFilesystem"] is True


def test_the_operator_fails_a_bad_tier_before_creating_anything_naming_the_fix() -> None:
    # The backstop of the CRD's rules (an old CRD, a server without CEL): the reconciler over
    # the fakes of test_reconciler.py, with fastSizeLimit missing.
    from .test_reconciler import Harness

    h = Harness()
    h.kube.job["spec"]["checkpoint"].update({"fastEverySteps": 1})
    h.tick()
    status = h.kube.status
    assert status["phase"] == "Failed"
    failed = h.kube.condition("Failed")
    assert failed["reason"] == "InvalidSpec"
    assert failed["message"].startswith("spec.checkpoint.fastSizeLimit is required")
    assert "e.g. 4Gi" in status["message"]
    assert [(kind, reason) for kind, reason, _ in h.events] == [("Warning", "InvalidSpec")]
    assert h.kube.created == [], "nothing is created for a spec that cannot run"
    assert h.tick() is None, "a failed job's daemon stops"
