"""The memory tier's wiring (issue 17): ``spec.checkpoint.fastEverySteps`` and its sizing, the
pods' ``medium: Memory`` emptyDir, the env of the trainer and the sidecar, the replication
peers, and the sidecar's memory sized from ``fastSizeLimit`` and ``fastReplicas``."""

from __future__ import annotations

import itertools
import json
from datetime import UTC, datetime
from typing import Any

import pytest
from baton_operator.pure import manifests
from baton_operator.pure.model import JobSpec, parse_bytes
from baton_operator.pure.settings import OperatorConfig

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
    # the reconciler's fakes (baton_testing.reconciler_fakes), with fastSizeLimit missing.
    from baton_testing.reconciler_fakes import Harness

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


def test_the_ring_puts_successors_in_other_zones_then_other_pools() -> None:
    # Two zones, a (4 ranks in two pools) and b (2 ranks). Each of b's ranks sits between two
    # of a's (4 zone changes, the most 2 ranks in b allow), and zone a's pools alternate.
    placed = {
        0: ("a", "p1"), 1: ("a", "p1"), 2: ("a", "p2"), 3: ("b", "p3"), 4: ("b", "p3"),
        5: ("a", "p2"),
    }  # fmt: skip
    ring = manifests.peer_ring(placed)
    assert sorted(ring) == list(range(6))
    zones = [placed[r][0] for r in ring]
    assert sum(zones[i] != zones[(i + 1) % 6] for i in range(6)) == 4, ring
    in_a = [placed[r][1] for r in ring if placed[r][0] == "a"]
    assert all(x != y for x, y in itertools.pairwise(in_a)), ring
    # Without labels the ring is rank order.
    assert manifests.peer_ring(dict.fromkeys((2, 0, 1), (None, None))) == [0, 1, 2]


def test_the_peers_update_names_each_peers_node_and_keeps_copies_balanced() -> None:
    spec = JobSpec.from_body(job(4, **TIER, fastReplicas=2))
    placed = {0: ("n0", "a", None), 1: ("n1", "a", None), 2: ("n2", "b", None),
              3: ("n3", "b", None)}  # fmt: skip
    bodies = manifests.peers_update(spec, CONFIG, attempt=1, placed=placed)
    assert sorted(bodies) == [0, 1, 2, 3]
    received = dict.fromkeys(range(4), 0)
    for rank, body in bodies.items():
        assert body["replicas"] == 2
        peers = body["peers"]
        assert len(peers) == 3
        first = peers[0]["address"].split("//")[1].split(".")[0]
        target = int(first.rsplit("-r", 1)[1])
        assert placed[target][1] != placed[rank][1], "the first target is in the other zone"
        for p in peers:
            r = int(p["address"].split("//")[1].split(".")[0].rsplit("-r", 1)[1])
            assert p["domain"] == f"n{r}"
            assert p["address"] == manifests.sidecar_address(spec, CONFIG, 1, r)
        for p in peers[:2]:
            received[int(p["address"].split("//")[1].split(".")[0].rsplit("-r", 1)[1])] += 1
    assert set(received.values()) == {2}, "every pod receives as many copies as it sends"
    assert manifests.peers_update(JobSpec.from_body(job(4)), CONFIG, attempt=1, placed=placed) == {}


def test_the_operator_sends_each_sidecar_its_peers_once_placed_and_again_only_on_change() -> None:
    from baton_testing.reconciler_fakes import Harness

    h = Harness()
    h.kube.job["spec"]["checkpoint"].update(TIER)
    fake = h.sidecars
    fake.peers_down = {"10.0.0.1", "10.0.0.2", "10.0.0.3"}
    h.running()
    assert fake.peer_puts == [], "nothing reaches a sidecar that does not answer"
    for i, zone in enumerate(("a", "a", "b")):
        h.cluster.update_node(
            {"metadata": {"name": f"n{i}", "labels": {"topology.kubernetes.io/zone": zone}},
             "status": {"conditions": [{"type": "Ready", "status": "True"}]}},
            now=datetime.now(tz=UTC),
        )  # fmt: skip
    fake.peers_down = {"10.0.0.2"}  # rank 1's sidecar still does not answer
    h.reconciler._peers._retry_at.clear()  # the retry delay passed
    h.tick()
    by_ip = dict(fake.peer_puts)
    assert sorted(by_ip) == ["10.0.0.1", "10.0.0.3"], fake.peer_puts
    # The ring: zone a's ranks 0 and 1 interleaved with zone b's rank 2: 0, 2, 1.
    assert [p["domain"] for p in by_ip["10.0.0.1"]["peers"]] == ["n2", "n1"], by_ip
    assert [p["domain"] for p in by_ip["10.0.0.3"]["peers"]] == ["n1", "n0"], by_ip
    assert by_ip["10.0.0.1"]["replicas"] == 1
    h.tick()
    assert len(fake.peer_puts) == 2, "no PUT to a told sidecar, none before the retry delay"
    fake.peers_down.clear()
    h.reconciler._peers._retry_at.clear()
    h.tick()
    assert [ip for ip, _ in fake.peer_puts[2:]] == ["10.0.0.2"]
    assert [p["domain"] for p in fake.peer_puts[2][1]["peers"]] == ["n0", "n2"]
    h.tick()
    assert len(fake.peer_puts) == 3, "nothing changed: nothing is sent"
