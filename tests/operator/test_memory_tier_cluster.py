"""The operator's wiring of the memory tier on the local cluster (issue 17): a 2-pod job with
``fastEverySteps: 1`` gets a ``medium: Memory`` emptyDir per pod (a directory on the host's
tmpfs, removed with the pod), its trainers snapshot into it, and each pod's sidecar copies the
snapshots to the other pod's sidecar, which it reaches by the DNS name the operator put in its
peer list; once both pods are placed the operator tells each sidecar its peer's node. Nothing
is interrupted: the job ends bitwise equal to a run without the tier.

(The recovery that uses these snapshots is tests/operator/test_recovery_cluster.py.)
"""

from __future__ import annotations

import base64
import json
import urllib.request
from pathlib import Path
from typing import Any

import kubernetes.client
import pytest
from baton_testing import trainer
from baton_testing.operator_harness import NAMESPACE, Baton, poll, unique

pytestmark = pytest.mark.cluster

SHARED_OPERATOR = True

STEPS = 24
REPLICAS = 2
NO_DURABLE = 1000
"""``everySteps`` past the last step: only the final save is durable."""
MEMORY_ROOT = Path("/dev/shm/localcluster")
"""Where the node agents put a pod's memory-backed emptyDirs (tests/cluster/README.md)."""


def _memory_dir(pod: dict[str, Any]) -> Path:
    return MEMORY_ROOT / pod["metadata"]["uid"] / "baton-fast"


def _committed(root: Path) -> list[Path]:
    """Steps with a manifest (a complete snapshot or replica) directly under ``root``."""
    return sorted(root.glob("step-*/manifest.json")) if root.is_dir() else []


def _sidecar_status(pod: dict[str, Any], token: str) -> dict[str, Any]:
    req = urllib.request.Request(
        f"http://{pod['status']['podIP']}:9440/v1/status",
        headers={"Authorization": f"Bearer {token}"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return dict(json.load(resp))


def test_pods_snapshot_into_memory_and_replicate_to_the_other_node(
    baton: Baton, tmp_path: Path
) -> None:
    ref_result, ref_logs = trainer.reference(
        tmp_path / "reference", REPLICAS, ["--steps", str(STEPS), "--every-steps", str(NO_DURABLE)]
    )
    baton.cluster.add_node()
    job = unique("tj-memtier")
    out = baton.workdir / job
    manifest = baton.job_manifest(
        job, steps=STEPS, every_steps=NO_DURABLE, sleep=0.3, replicas=REPLICAS
    )
    manifest["spec"]["checkpoint"].update({"fastEverySteps": 1, "fastSizeLimit": "64Mi"})
    applied = baton.apply(manifest)
    assert applied.returncode == 0, applied.stderr
    baton.wait_phase(job, "Running", timeout=180)
    baton.wait_steps(job, 2)
    pods = {int(p["metadata"]["labels"]["baton.dev/rank"]): p for p in baton.pods(job)}
    assert sorted(pods) == [0, 1]
    assert pods[0]["spec"]["nodeName"] != pods[1]["spec"]["nodeName"]
    core = kubernetes.client.CoreV1Api(baton.cluster.api)
    secret = core.read_namespaced_secret(f"{job}-sidecar-token", NAMESPACE)
    token = base64.b64decode(secret.data["token"]).decode()
    seen: dict[int, dict[str, Any]] = {}

    def replicated() -> bool:
        for rank, pod in pods.items():
            other = pods[1 - rank]
            mem = _memory_dir(pod)
            if not _committed(mem) or not any(_committed(d) for d in (mem / "replicas").glob("*")):
                return False
            status = _sidecar_status(pod, token)["replication"]
            peers = status["peers"]
            if not status.get("last_replicated_step") or not peers[0].get("last_step"):
                return False
            if peers[0]["domain"] != other["spec"]["nodeName"]:
                return False  # the operator's PUT of the peers' nodes has not landed yet
            seen[rank] = {"status": status, "other": other["metadata"]["name"]}
        return True

    poll(replicated, timeout=90, what="a snapshot and a replica in every pod's memory",
         diag=lambda: baton.diagnostics(job))  # fmt: skip
    for rank, found in seen.items():
        status = found["status"]
        assert status["fast_dir"].startswith(str(MEMORY_ROOT)), status
        assert status["domain"] == pods[rank]["spec"]["nodeName"], status
        assert status["replicas"] == 1, status
        # The one peer is the other pod, by its DNS name, with its node as its domain (the
        # operator's PUT /v1/replication/peers once both pods were placed).
        assert [p["address"].split("//")[1].split(".")[0] for p in status["peers"]] == [
            found["other"]
        ], status

    final = baton.wait_phase(job, "Succeeded", timeout=240)
    diag = baton.diagnostics(job)
    assert (final["attempt"], final["failures"]) == (0, 0), diag
    got = trainer.loss_logs(out, REPLICAS)
    for rank in range(REPLICAS):
        assert sorted(got[rank]) == list(range(1, STEPS + 1)), f"rank {rank}{diag}"
        for s, losses in got[rank].items():
            assert losses == [ref_logs[rank][s][0]], f"rank {rank} step {s}: {losses}"
    result = json.loads((out / "result.json").read_text())
    for key in ("params_sha256", "optimizer_sha256", "scheduler_sha256", "scaler_sha256"):
        assert result[key] == ref_result[key], f"{key} differs from the run without the tier"

    baton.delete(job)
    # The memory goes with the pods (garbage-collected with the job).
    poll(
        lambda: not any(_memory_dir(p).exists() for p in pods.values()),
        timeout=90,
        what="the pods' memory volumes to be removed",
        diag=lambda: baton.diagnostics(job),
    )
