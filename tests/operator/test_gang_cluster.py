"""Gang scheduling on the real control plane (Kubernetes 1.37's PodGroup, served here).

One 2-replica job whose pods each take a whole node's GPUs (``nvidia.com/gpu`` written as an
integer) and may only go to nodes with this test's label, one rank per node: with one such
node the job does not fit. The operator creates the attempt's PodGroup and both pods at once,
both with rank 0's DNS name as the master address, before rank 0 has an IP; the scheduler binds
neither (its ``Unschedulable`` verdict on the group). A second labelled node makes the job fit:
both bind, rank 1 finds rank 0 through the cluster DNS, and the job Succeeds with every loss
and the final state equal bit for bit to an uninterrupted run. The reference runs while no pod
is bound, so it adds no load to the job's run. The PodGroup goes with the finished job.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import pytest
from baton_testing import trainer
from baton_testing.cluster import DEFAULT_CONFIG
from baton_testing.operator_harness import (
    NAMESPACE,
    Baton,
    PodWatcher,
    unique,
)
from kubernetes import client
from kubernetes.client.exceptions import ApiException

pytestmark = pytest.mark.cluster

STEPS = 12
EVERY = 4
REPLICAS = 2


# One operator for the module, with gang scheduling on whatever its default.
SHARED_OPERATOR = True
OPERATOR_ARGS = ("--gang-scheduling",)


def _pod_group(baton: Baton, name: str) -> dict[str, Any] | None:
    custom = client.CustomObjectsApi(baton.cluster.api)
    try:
        group = custom.get_namespaced_custom_object(
            "scheduling.k8s.io", "v1beta1", NAMESPACE, "podgroups", name
        )
    except ApiException as e:
        if e.status == 404:
            return None
        raise
    return cast(dict[str, Any], group)


def _unschedulable(group: dict[str, Any] | None) -> str | None:
    for c in ((group or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == "PodGroupInitiallyScheduled" and c["reason"] == "Unschedulable":
            return str(c["message"])
    return None


def test_a_gang_job_binds_no_pod_until_every_rank_fits_then_trains_bitwise(
    baton: Baton, tmp_path: Path
) -> None:
    core = client.CoreV1Api(baton.cluster.api)
    job = unique("tj-gang")
    group_name = f"{job}-a0"
    out = baton.workdir / job
    label = {"baton-test/gang": job}
    node_a = baton.cluster.add_node()
    core.patch_node(node_a, {"metadata": {"labels": label}})
    manifest = baton.job_manifest(
        job, steps=STEPS, every_steps=EVERY, sleep=0.05, replicas=REPLICAS, node_selector=label,
    )  # fmt: skip
    containers = manifest["spec"]["template"]["spec"]["containers"]
    trainer_c = next(c for c in containers if c["name"] == "trainer")
    trainer_c["resources"] = {"limits": {"nvidia.com/gpu": DEFAULT_CONFIG.gpus_per_node}}
    applied = baton.apply(manifest)
    assert applied.returncode == 0, applied.stderr
    watcher = PodWatcher(baton, job)

    # The scheduler's verdict on the whole gang, with both ranks created. The operator records
    # masterAddr after its last pod create, so the scheduler may judge the gang before that
    # status write lands: wait for both, in either order.
    master = f"{job}-a0-r0.{job}.{NAMESPACE}.svc.cluster.local"
    baton.wait_for(
        job,
        lambda status: (
            _unschedulable(_pod_group(baton, group_name)) is not None
            and status.get("masterAddr") == master
        ),
        timeout=180,
        what="the scheduler to find the job's PodGroup unschedulable, and masterAddr recorded",
    )
    group = _pod_group(baton, group_name)
    assert group is not None
    message = _unschedulable(group)
    assert message is not None, group
    assert "minCount (2) cannot be satisfied" in message, group
    assert group["spec"]["schedulingPolicy"] == {"gang": {"minCount": REPLICAS}}
    owner = group["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"]) == ("TrainingJob", job)
    assert baton.status(job)["masterAddr"] == master

    ref_result, ref_logs = trainer.reference(
        tmp_path / "reference", REPLICAS, ["--steps", str(STEPS), "--every-steps", str(EVERY)]
    )
    # While the reference ran, the job waited whole: both ranks exist, neither is bound.
    pods = baton.pods(job)
    diag = baton.diagnostics(job)
    assert sorted(p["metadata"]["name"] for p in pods) == [f"{job}-a0-r{r}" for r in range(2)]
    for pod in pods:
        assert pod["spec"]["schedulingGroup"] == {"podGroupName": group_name}, diag
        assert pod["spec"].get("nodeName") is None, f"{pod['metadata']['name']} bound{diag}"
        gpus = next(c for c in pod["spec"]["containers"] if c["name"] == "trainer")
        assert gpus["resources"]["limits"]["nvidia.com/gpu"] == str(DEFAULT_CONFIG.gpus_per_node)
    for pod in pods:
        trainer_c = next(c for c in pod["spec"]["containers"] if c["name"] == "trainer")
        env = {e["name"]: e.get("value") for e in trainer_c["env"]}
        assert env["MASTER_ADDR"] == env["PET_MASTER_ADDR"] == master, diag
    assert baton.status(job)["phase"] == "Pending"

    node_b = baton.cluster.add_node()
    core.patch_node(node_b, {"metadata": {"labels": label}})
    final = baton.wait_phase(job, "Succeeded", timeout=300)
    watcher.stop()
    diag = baton.diagnostics(job)
    assert (final["attempt"], final["preemptions"], final["failures"]) == (0, 0, 0), diag
    assert sorted(baton.node_of(job, r) for r in range(2)) == sorted([node_a, node_b]), diag
    assert watcher.violations(replicas=REPLICAS) == []

    got = trainer.loss_logs(out, REPLICAS)
    for rank in range(REPLICAS):
        assert sorted(got.get(rank, {})) == list(range(1, STEPS + 1)), f"rank {rank}{diag}"
        for s, losses in got[rank].items():
            assert losses == ref_logs[rank][s], f"rank {rank} step {s}: {losses}"
    result = json.loads((out / "result.json").read_text())
    for key in ("params_sha256", "optimizer_sha256", "scheduler_sha256", "scaler_sha256"):
        assert result[key] == ref_result[key], f"{key} differs from the uninterrupted run"

    # The finished attempt's gang goes with it (its finalizer may hold it a moment).
    baton.wait_for(
        job,
        lambda _: (g := _pod_group(baton, group_name)) is None
        or bool(g["metadata"].get("deletionTimestamp")),
        timeout=60, what="the finished attempt's PodGroup to be deleted",
    )  # fmt: skip
    baton.delete(job)
