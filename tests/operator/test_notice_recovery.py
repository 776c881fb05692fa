"""A notice answered by the memory tier: when every rank's commit is one, which pods the
recovery replaces, and the reconciler's ticks from the commit to the promotion (the real
thing on the local cluster is test_notice_recovery_cluster.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from baton_operator.pure import lifecycle, reports
from baton_operator.pure.lifecycle import Phase
from baton_operator.pure.reports import SidecarStatus
from baton_testing.reconciler_fakes import Harness

from .test_recovery import _views


def _report(**raw: Any) -> SidecarStatus:
    base: dict[str, Any] = {
        "state": "committed", "step": 16, "request_id": "r0", "trigger": "notice",
        "tier": "memory", "last_committed_step": 10,
    }  # fmt: skip
    return SidecarStatus.from_json({**base, **raw})


def test_every_rank_committing_the_notice_to_memory_is_a_memory_commit() -> None:
    ids = ["r0", "r1"]
    both = [_report(), _report(request_id="r1")]
    assert reports.memory_commit(both, ids) == 16
    # promoted meanwhile: still the memory tier's commit, answered the same way
    assert reports.memory_commit([_report(tier="memory+promoted"), both[1]], ids) == 16
    # a SIGTERM's save (no request id) answers every request
    assert reports.memory_commit([_report(request_id=None, trigger="signal")] * 2, ids) == 16


def test_anything_less_is_not_a_memory_commit() -> None:
    ids = ["r0", "r1"]
    ok = _report(request_id="r1")
    cases = {
        "a rank not answered yet": [_report(), None],
        "a rank still saving": [_report(), _report(request_id="r1", state="saving")],
        "a durable commit": [_report(), _report(request_id="r1", tier="durable")],
        "an SDK before tiers": [_report(), _report(request_id="r1", tier=None)],
        "another request's commit": [_report(request_id="old", trigger="periodic"), ok],
        "split steps": [_report(), _report(request_id="r1", step=17)],
    }
    for what, reps in cases.items():
        assert reports.memory_commit(reps, ids) is None, what


def test_the_noticed_nodes_pods_are_replaced_and_the_others_kept() -> None:
    plan, why = lifecycle.plan_notice_recovery(
        _views(r2={"node": "n1"}), nodes=["n1"], master_is_name=False
    )
    assert plan is not None, why
    assert (plan.replace, plan.keep, plan.nodes) == ((1, 2), (0,), ("n1",))
    plan, why = lifecycle.plan_notice_recovery(_views(), nodes=["n0"], master_is_name=True)
    assert plan is not None, why
    assert plan.replace == (0,)  # rank 0 by its DNS name: the rendezvous follows it


def test_a_notice_recovery_is_declined_with_the_reason() -> None:
    cases = [
        (_views(), ["n9"], True, "no pod runs on the noticed node"),
        (_views(), ["n0", "n1", "n2"], True, "no survivor"),
        (_views(r2={"deleting": True}), ["n1"], True, "rank 2's pod j-a0-r2 is gone"),
        (_views(r2={"node_lost": True}), ["n1"], True, "lost"),
        (_views(r2={"exit_code": 75}), ["n1"], True, "ended with code 75"),
        (_views(), ["n0"], False, "pod IP"),
    ]
    for views, nodes, named, reason in cases:
        plan, why = lifecycle.plan_notice_recovery(views, nodes=nodes, master_is_name=named)
        assert plan is None, reason
        assert reason in why, (reason, why)


def test_a_memory_commit_puts_a_checkpointing_job_back_to_running() -> None:
    assert lifecycle.check_transition(Phase.CHECKPOINTING, Phase.RUNNING) is Phase.RUNNING


def _commit_to_memory(h: Harness, node: str, step: int) -> None:
    h.spot_notice(node)
    h.tick()
    assert h.kube.status["phase"] == "Checkpointing"
    h.report_all(state="requested")
    h.tick()
    h.report_all(state="committed", step=step, trigger="notice", tier="memory",
                 uri=f"file:///var/run/baton/fast/step-{step}", seconds=0.4)  # fmt: skip


def test_a_memory_commit_replaces_only_the_noticed_pod_then_records_the_promotion() -> None:
    h = Harness()
    h.use_memory_tier()
    h.running()
    kept_uids = {r: h.kube.pods[h.pod(0, r)]["metadata"]["uid"] for r in (0, 2)}
    _commit_to_memory(h, "n1", 40)
    h.tick()
    status = h.kube.status
    assert status["phase"] == "Running", status
    assert (status["attempt"], status["preemptions"], status["failures"]) == (0, 1, 0)
    assert "notice" not in status
    assert status["lastCheckpoint"]["step"] == 40
    assert status["lastCheckpoint"]["tier"] == "memory"
    recovery = status["recovery"]
    assert (recovery["cause"], recovery["noticeSource"], recovery["step"]) == ("notice", "aws", 40)
    assert [(e["rank"], e["node"]) for e in recovery["replaced"]] == [(1, "n1")]
    assert recovery["kept"] == [h.pod(0, 0), h.pod(0, 2)]
    assert h.kube.deleted == [(h.pod(0, 1), 0)], "only the noticed pod goes, forced"
    assert h.kube.condition("Checkpointing")["status"] == "False"
    assert h.kube.condition("Recovering")["reason"] == "Notice"
    assert status["interruptions"][-1]["source"] == "aws"
    reasons = [r for _, r, _ in h.events]
    assert "CheckpointCommitted" in reasons
    assert "Recovering" in reasons

    # The kept trainers exit 76 and restart in place; the replacement comes off n1.
    h.restarted_in_place(h.pod(0, 0), 1, last_exit=76)
    h.restarted_in_place(h.pod(0, 2), 1, last_exit=76)
    h.tick()
    assert h.kube.created.count(h.pod(0, 1)) == 2
    assert "n1" in str(h.kube.pods[h.pod(0, 1)]["spec"]["affinity"])
    h.kube.run(h.pod(0, 1), node="n3", ip="10.0.0.9")
    h.node("n3")
    # A kept trainer's old report, refreshed after the decision, is not its restore.
    beat = datetime.now(tz=UTC) + timedelta(seconds=1)
    for ip in ("10.0.0.1", "10.0.0.9", "10.0.0.3"):
        h.sidecars.reports[ip] = SidecarStatus(
            state="committed", step=40, restored_step=5, train_step=40, heartbeat=beat
        )
    h.tick()
    assert h.kube.status.get("recovery"), "an old process's report ended the recovery"
    h.restored(["10.0.0.1", "10.0.0.9", "10.0.0.3"], step=40, tier="memory")
    h.tick()
    status = h.kube.status
    assert "recovery" not in status
    last = status["lastRecovery"]
    assert (last["cause"], last["tier"], last["restoredStep"]) == ("notice", "memory", 40)
    assert {r: h.kube.pods[h.pod(0, r)]["metadata"]["uid"] for r in (0, 2)} == kept_uids
    assert any(r == "Recovered" and "after the aws notice" in m for _, r, m in h.events)

    # The restore promotes the step: a rank reports it committed durably.
    for ip in ("10.0.0.1", "10.0.0.9", "10.0.0.3"):
        h.sidecars.reports[ip] = SidecarStatus(
            state="idle", restored_step=40, restored_tier="memory", last_committed_step=40,
            train_step=41, heartbeat=datetime.now(tz=UTC),
        )  # fmt: skip
    h.memory.next_progress_poll = None
    h.tick()
    assert h.kube.status["lastCheckpoint"]["tier"] == "memory+promoted"
    assert h.kube.status["lastCheckpoint"]["step"] == 40
    h.memory.next_progress_poll = None
    h.tick()
    promoted = [m for _, r, m in h.events if r == "CheckpointPromoted"]
    assert len(promoted) == 1, promoted
    assert "step 40" in promoted[0]
    assert (h.kube.status["attempt"], h.kube.status["failures"]) == (0, 0)


def test_a_memory_commit_the_recovery_cannot_keep_waits_for_its_promotion() -> None:
    h = Harness()
    h.use_memory_tier()
    h.running()
    # Rank 0 is noticed and the ranks reach it at its pod IP: today's path.
    _commit_to_memory(h, "n0", 40)
    h.tick()
    assert h.kube.status["phase"] == "Checkpointing", "not the answer until promoted"
    assert h.kube.deleted == []
    h.report_all(state="committed", step=40, trigger="notice", tier="memory+promoted",
                 last_committed_step=40)  # fmt: skip
    h.tick()
    status = h.kube.status
    assert (status["phase"], status["attempt"], status["preemptions"]) == ("Restarting", 1, 1)
    assert status["lastCheckpoint"]["tier"] == "memory+promoted"
