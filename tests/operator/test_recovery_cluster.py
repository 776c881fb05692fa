"""A node lost without notice, with the memory tier on: only the lost pod is replaced.

A 2-pod job snapshots every step into its pods' memory (``fastEverySteps: 1``) and each pod's
sidecar copies its snapshot to the other pod; there is no durable save at all during the run
(``everySteps`` beyond its last step), so whatever the ranks resume from came from memory.
The node of one rank is killed (no notice, its processes gone at once). The survivor's broken
trainer makes the operator suspect the node, and its Lease, no longer renewed, makes it lost
within seconds (long before NotReady). The operator replaces only that pod, under the same
name and in the same attempt; the survivor's pod (same UID) keeps its sidecar and memory, and
its trainer, whose process group broke, is restarted in place by the kubelet (the trainer's
container restart rules). Every rank restores the newest snapshot every rank can load (the
replacement's from the survivor's replica), the status and Events say so, and the job ends
bitwise equal to an uninterrupted run. The same job then loses rank 0's node, which also
checks the rendezvous: the ranks reach rank 0 by its DNS name, which follows the replacement
(one job for both losses: one start and one reference). A node frozen for less than the
window (a network blip) is suspected and cleared, and nothing restarts.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from baton_operator.pure import manifests
from baton_operator.pure.nodes import ZONE_LABEL, node_pool
from baton_testing import trainer
from baton_testing.operator_harness import NAMESPACE, Baton, unique
from kubernetes import client

pytestmark = pytest.mark.cluster

SHARED_OPERATOR = True

STEPS = 40
REPLICAS = 2
NO_DURABLE = 1000
"""``everySteps`` past the last step: no durable save before the job's end."""
OPERATOR_ARGS = ["--node-lost-seconds", "60", "--sidecar-timeout-seconds", "1.5"]
"""The operator judges a killed node by its Lease (suspecting.py: the default window, two
renew intervals of the local agents' 8 s Lease, is 4 s), long before the NotReady path would
(the local node-monitor grace of 8 s plus these 60 s): a recovery that waited for NotReady
fails the Event checks. A sidecar that does not answer within 1.5 s (the harness's polls come
every 0.5 s) makes its node suspected, which the frozen node of the blip test needs."""


def _trainer_status(pod: dict[str, Any]) -> dict[str, Any]:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs["name"] == "trainer":
            return dict(cs)
    raise AssertionError(f"pod {pod['metadata']['name']} has no trainer status")


def _pods_by_rank(baton: Baton, job: str) -> dict[int, dict[str, Any]]:
    return {int(p["metadata"]["labels"]["baton.dev/rank"]): p for p in baton.pods(job)}


def _a_snapshot_and_its_replica(baton: Baton, pods: dict[int, dict[str, Any]]) -> tuple[int, int]:
    """Ranks a and b (neither 0) such that a's sidecar copies its snapshot to b's pod: the
    operator orders each sidecar's peers by the nodes' zones and pools (manifests.peer_ring),
    which earlier tests may have labelled, so the order is read from the same labels."""
    core = client.CoreV1Api(baton.cluster.api)
    placed: dict[int, tuple[str | None, str | None]] = {}
    for rank, pod in pods.items():
        labels = core.read_node(pod["spec"]["nodeName"]).metadata.labels or {}
        placed[rank] = (labels.get(ZONE_LABEL), node_pool(labels))
    ring = manifests.peer_ring(placed)
    pairs = [(ring[i], ring[(i + 1) % len(ring)]) for i in range(len(ring))]
    return next((a, b) for a, b in pairs if 0 not in (a, b))


def _taint_manager_evictions(baton: Baton, job: str) -> list[str]:
    """The taint manager's eviction Events on the job's pods. The pods tolerate the node
    lifecycle's NoExecute taints without end, so that only the operator removes a lost node's
    pods: with a timed toleration the taint manager's eviction (by pod name, no UID
    precondition) also fired after the operator had replaced the lost pod under the same name,
    deleted the healthy replacement, and the job restarted from scratch (#26)."""
    core = client.CoreV1Api(baton.cluster.api)
    events = core.list_namespaced_event(NAMESPACE, field_selector="reason=TaintManagerEviction")
    return [
        f"{e.involved_object.name}: {e.message}"
        for e in events.items
        if (e.involved_object.name or "").startswith(f"{job}-")
    ]


def _newest_step(out: Path) -> int:
    """The newest step rank 0 logged (steps run again after a recovery are logged twice)."""
    return max((step for step, _ in trainer.read_loss_log(out / "loss.log")), default=0)


def _start_memory_tier_job(
    baton: Baton, job: str, *, replicas: int, steps: int, every: int, max_failures: int = 1
) -> None:
    """Apply a job with the memory tier (a snapshot every step) and wait until it runs."""
    manifest = baton.job_manifest(
        job, steps=steps, every_steps=every, sleep=0.3, replicas=replicas,
        failure_policy={"maxFailures": max_failures, "backoffSeconds": 1},
    )  # fmt: skip
    manifest["spec"]["checkpoint"].update({"fastEverySteps": 1, "fastSizeLimit": "64Mi"})
    trainer_c = manifest["spec"]["template"]["spec"]["containers"][0]
    # A survivor's restarted trainer waits in the rendezvous for the replacement: give the
    # process group time.
    trainer_c["command"][trainer_c["command"].index("--timeout") + 1] = "120"
    applied = baton.apply(manifest)
    assert applied.returncode == 0, applied.stderr
    baton.wait_phase(job, "Running", timeout=180)


def _lose_and_recover(baton: Baton, job: str, lost_rank: int, *, failures: int) -> dict[str, Any]:
    """Kill ``lost_rank``'s node and check the recovery that follows: only that pod replaced
    (same name, new UID), the survivor's pod kept (same UID) with its trainer restarted in
    place, the newest memory snapshot restored, and status and Events that say so. Returns
    the status at the recovery's end."""
    out = baton.workdir / job
    before = _pods_by_rank(baton, job)
    survivor = 1 - lost_rank
    kept_uid = before[survivor]["metadata"]["uid"]
    lost_uid = before[lost_rank]["metadata"]["uid"]
    restarts = _trainer_status(before[survivor]).get("restartCount", 0)
    trained = _newest_step(out)
    baton.cluster.kill_node(before[lost_rank]["spec"]["nodeName"])

    def this_recovery(s: dict[str, Any]) -> bool:
        replaced = (s.get("lastRecovery") or {}).get("replaced") or []
        return [e["rank"] for e in replaced] == [lost_rank] and len(
            s.get("interruptions") or []
        ) == failures

    recovered = baton.wait_for(
        job, this_recovery, timeout=180, what=f"the recovery of rank {lost_rank} to end"
    )
    diag = baton.diagnostics(job)
    last = recovered["lastRecovery"]
    assert last["tier"] == "memory", diag
    # No durable save ran: the step came from memory, at most a snapshot or two behind.
    assert last["restoredStep"] >= trained - 2, diag
    assert last["kept"] == [f"{job}-a0-r{survivor}"], diag
    assert (recovered["attempt"], recovered["failures"]) == (0, failures), diag
    assert recovered["resumedFromStep"] == last["restoredStep"], diag
    entry = recovered["interruptions"][-1]
    assert (entry["source"], entry["attempt"]) == ("node-lost", 0), diag
    assert entry["resumeStep"] == last["restoredStep"], diag
    events = baton.events(job)
    lost_node = before[lost_rank]["spec"]["nodeName"]
    # Judged by its Lease, not by NotReady (OPERATOR_ARGS), once the ranks stopped hearing
    # from it: whichever the operator saw first, the lost rank's sidecar refusing its poll or
    # the survivor's trainer restarted on the broken process group.
    reasons = (f"rank {lost_rank}'s sidecar", f"pod {job}-a0-r{survivor}'s trainer")
    assert any(
        e.startswith(tuple(f"NodeSuspected: node {lost_node}: {r}" for r in reasons))
        for e in events
    ), diag
    assert any(
        e.startswith(f"NodeLost: node {lost_node} is lost: its kubelet did not renew its Lease")
        for e in events
    ), diag
    lost_pod = f"{job}-a0-r{lost_rank}"
    assert any(e.startswith("Recovering: ") and lost_pod in e for e in events), diag
    assert any(
        e.startswith("Recovered: ") and lost_pod in e and "memory tier" in e for e in events
    ), diag

    after = _pods_by_rank(baton, job)
    assert after[survivor]["metadata"]["uid"] == kept_uid, "the survivor's pod was replaced"
    assert _trainer_status(after[survivor])["restartCount"] > restarts, diag
    assert after[lost_rank]["metadata"]["uid"] != lost_uid, diag
    assert after[lost_rank]["metadata"]["name"] == lost_pod, diag
    assert _taint_manager_evictions(baton, job) == [], diag
    return recovered


def test_a_lost_node_costs_one_pod_and_a_snapshot_interval(baton: Baton, tmp_path: Path) -> None:
    # One job loses rank 1's node, recovers, then loses rank 0's node (whose DNS name the
    # ranks rendezvous at) and recovers again: each loss costs one pod and a snapshot
    # interval, and the job still ends bitwise equal to the uninterrupted run.
    baton.cluster.add_node()  # for rank 1's replacement
    baton.cluster.add_node()  # for rank 0's
    job = unique("tj-recover")
    out = baton.workdir / job
    _start_memory_tier_job(baton, job, replicas=REPLICAS, steps=STEPS, every=NO_DURABLE,
                           max_failures=2)  # fmt: skip
    baton.wait_steps(job, 8)
    # The same training run as local processes, never interrupted: trained while the cluster
    # finds the first node lost (when only the survivor's trainer is left, waiting).
    with ThreadPoolExecutor(max_workers=1) as pool:
        uninterrupted = pool.submit(
            trainer.reference, tmp_path / "reference", REPLICAS,
            ["--steps", str(STEPS), "--every-steps", str(NO_DURABLE)],
        )  # fmt: skip
        first = _lose_and_recover(baton, job, 1, failures=1)

        # A few steps trained after the first recovery, then rank 0's node goes.
        again = first["lastRecovery"]["restoredStep"] + 4
        baton.wait_for(
            job, lambda _: _newest_step(out) >= again, timeout=120,
            what=f"step {again} after the first recovery",
        )  # fmt: skip
        _lose_and_recover(baton, job, 0, failures=2)

        final = baton.wait_phase(job, "Succeeded", timeout=240)
        diag = baton.diagnostics(job)
        assert (final["attempt"], final["failures"], final["preemptions"]) == (0, 2, 0), diag
        ref_result, ref_logs = uninterrupted.result()
    got = trainer.loss_logs(out, REPLICAS)
    for rank in range(REPLICAS):
        assert sorted(got.get(rank, {})) == list(range(1, STEPS + 1)), f"rank {rank}{diag}"
        for s, losses in got[rank].items():
            # Steps after each snapshot ran twice (the survivor's); each time bitwise the same.
            assert set(losses) == {ref_logs[rank][s][0]}, f"rank {rank} step {s}: {losses}"
    result = json.loads((out / "result.json").read_text())
    for key in ("params_sha256", "optimizer_sha256", "scheduler_sha256", "scaler_sha256"):
        assert result[key] == ref_result[key], f"{key} differs from the uninterrupted run"
    baton.delete(job)


def test_both_copies_of_a_snapshot_lost_falls_back_to_the_durable_tier(
    baton: Baton, tmp_path: Path
) -> None:
    # Three pods; each sidecar copies its pod's snapshot to the next pod of the ring, so
    # some rank a's snapshot lives in its pod and the next one's (b) only. Both their nodes are
    # killed: the memory tier cannot cover rank a, the ranks restore the last durable step,
    # and status and Events say so. The job still ends bitwise equal to an uninterrupted run
    # of three ranks (the checkpoint carries DDP's bucket layout, docs/operator.md
    # "Determinism at scale"), and every step run twice gives each rank the same loss.
    replicas, steps, every = 3, 30, 5
    baton.cluster.add_node()
    baton.cluster.add_node()
    job = unique("tj-durable")
    _start_memory_tier_job(baton, job, replicas=replicas, steps=steps, every=every)
    baton.wait_for(
        job, lambda s: (s.get("lastCheckpoint") or {}).get("step", 0) >= every, timeout=120,
        what="a durable checkpoint",
    )  # fmt: skip
    baton.wait_steps(job, 2 * every + 2)
    before = _pods_by_rank(baton, job)
    a, b = _a_snapshot_and_its_replica(baton, before)
    # The uninterrupted 3-rank run is trained while the cluster notices the nodes are lost
    # (when only rank 0's trainer is left, waiting for its peers).
    for rank in (a, b):
        baton.cluster.kill_node(before[rank]["spec"]["nodeName"])
    with ThreadPoolExecutor(max_workers=1) as pool:
        reference = pool.submit(
            trainer.reference, tmp_path / "reference", replicas,
            ["--steps", str(steps), "--every-steps", str(every)],
        )  # fmt: skip

        recovered = baton.wait_for(
            job, lambda s: bool(s.get("lastRecovery")), timeout=180, what="the recovery to end"
        )
        diag = baton.diagnostics(job)
        last = recovered["lastRecovery"]
        assert last["tier"] == "durable", diag
        assert last["restoredStep"] % every == 0, diag
        assert last["restoredStep"] >= every, diag
        assert sorted(e["rank"] for e in last["replaced"]) == [1, 2], diag  # a, b: not rank 0
        assert last["kept"] == [f"{job}-a0-r0"], diag
        assert (recovered["attempt"], recovered["failures"]) == (0, 1), diag
        assert any(
            e.startswith("RecoveredFromDurable: ") and "durable tier" in e
            for e in baton.events(job)
        ), diag
        conditions = {c["type"]: c for c in recovered["conditions"]}
        assert conditions["Recovering"]["reason"] == "RecoveredFromDurable", diag
        assert _pods_by_rank(baton, job)[0]["metadata"]["uid"] == before[0]["metadata"]["uid"]
        assert _taint_manager_evictions(baton, job) == [], diag

        final = baton.wait_phase(job, "Succeeded", timeout=240)
        diag = baton.diagnostics(job)
        assert (final["attempt"], final["failures"]) == (0, 1), diag
        ref_result, ref_logs = reference.result()
    got = trainer.loss_logs(baton.workdir / job, replicas)
    for rank in range(replicas):
        assert sorted(got.get(rank, {})) == list(range(1, steps + 1)), f"rank {rank}{diag}"
        for s, losses in got[rank].items():
            # Steps after the durable step ran twice; each time bitwise the reference's loss.
            assert set(losses) == {ref_logs[rank][s][0]}, f"rank {rank} step {s}: {losses}"
    result = json.loads((baton.workdir / job / "result.json").read_text())
    for key in ("params_sha256", "optimizer_sha256", "scheduler_sha256", "scaler_sha256"):
        assert result[key] == ref_result[key], f"{key} differs from the uninterrupted run"
    baton.delete(job)


def test_a_node_frozen_shorter_than_the_window_restarts_nothing(baton: Baton) -> None:
    # A network blip: rank 1's node stops for 3.5 s (its processes stopped, its kubelet not
    # renewing its Lease: LocalCluster.freeze_node), shorter than the 4 s window. Rank 1's
    # sidecar times out (1.5 s), so the operator suspects the node and reads its Lease, which
    # is renewed at the thaw: the node is cleared, no pod is replaced, no trainer restarts, and
    # the job finishes with every rank exiting 0 and every step trained once.
    replicas, steps = 3, 40
    job = unique("tj-blip")
    _start_memory_tier_job(baton, job, replicas=replicas, steps=steps, every=NO_DURABLE)
    baton.wait_steps(job, 8)
    before = _pods_by_rank(baton, job)
    frozen = before[1]["spec"]["nodeName"]
    baton.cluster.freeze_node(frozen, 3.5, wait=True)
    final = baton.wait_phase(job, "Succeeded", timeout=240)
    diag = baton.diagnostics(job)
    events = baton.events(job)
    assert any(e.startswith(f"NodeSuspected: node {frozen}: rank 1's sidecar") for e in events), (
        diag
    )
    assert any(e.startswith(f"NodeReachable: node {frozen} renewed its Lease") for e in events), (
        diag
    )
    assert not any(e.startswith(("NodeLost:", "Recovering:")) for e in events), diag
    assert (final["attempt"], final["failures"], final["preemptions"]) == (0, 0, 0), diag
    assert not final.get("interruptions"), diag
    after = _pods_by_rank(baton, job)
    for rank in range(replicas):
        assert after[rank]["metadata"]["uid"] == before[rank]["metadata"]["uid"], diag
        trainer_status = _trainer_status(after[rank])
        assert trainer_status.get("restartCount", 0) == 0, diag
        assert trainer_status["state"]["terminated"]["exitCode"] == 0, diag
    got = trainer.loss_logs(baton.workdir / job, replicas)
    for rank in range(replicas):
        steps_logged = [s for s, losses in sorted(got.get(rank, {}).items()) for _ in losses]
        assert steps_logged == list(range(1, steps + 1)), f"rank {rank}{diag}"
    baton.delete(job)
