"""The state machine, outcomes, budgets, backoff, checkpoint verdicts and elastic shrink."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from baton_operator.client.sidecars import SidecarStatus
from baton_operator.pure import lifecycle
from baton_operator.pure.lifecycle import Outcome, Phase, RankView, VerdictKind
from baton_operator.pure.model import JobSpec
from baton_operator.pure.settings import EMERGENCY_EXIT_CODE

NOW = datetime(2026, 11, 30, 4, 0, tzinfo=UTC)


def spec(**policy: Any) -> JobSpec:
    return JobSpec.from_body(
        {
            "metadata": {"name": "j", "namespace": "ns"},
            "spec": {
                "replicas": 4,
                "minReplicas": policy.pop("minReplicas", None),
                "template": {"spec": {"containers": [{"name": "trainer"}]}},
                "checkpoint": {"uri": "/ckpt"},
                "failurePolicy": {
                    "maxFailures": 2,
                    "maxPreemptions": 3,
                    "backoffSeconds": 10,
                    "maxBackoffSeconds": 35,
                    **policy,
                },
            },
        }
    )


def test_transitions() -> None:
    assert lifecycle.check_transition(None, Phase.PENDING) is Phase.PENDING
    with pytest.raises(ValueError, match="starts Pending"):
        lifecycle.check_transition(None, Phase.RUNNING)
    assert lifecycle.check_transition(Phase.RUNNING, Phase.CHECKPOINTING) is Phase.CHECKPOINTING
    assert lifecycle.check_transition(Phase.CHECKPOINTING, Phase.RESTARTING) is Phase.RESTARTING
    assert lifecycle.check_transition(Phase.RESTARTING, Phase.PENDING) is Phase.PENDING
    for final in (Phase.SUCCEEDED, Phase.FAILED):
        for other in Phase:
            if other is not final:
                with pytest.raises(ValueError, match="illegal"):
                    lifecycle.check_transition(final, other)
    with pytest.raises(ValueError, match="illegal"):
        lifecycle.check_transition(Phase.RESTARTING, Phase.RUNNING)


def view(rank: int, **kw: Any) -> RankView:
    return RankView(rank=rank, pod=f"j-a0-r{rank}", **kw)


def test_classify_outcomes() -> None:
    running = [view(0, running=True), view(1, running=True)]
    assert lifecycle.classify(running, 2)[0] is Outcome.RUNNING
    assert lifecycle.classify([view(0, running=True)], 2)[0] is Outcome.PENDING
    done = [view(0, exit_code=0), view(1, exit_code=0)]
    assert lifecycle.classify(done, 2)[0] is Outcome.SUCCEEDED
    half = [view(0, exit_code=0), view(1, running=True)]
    assert lifecycle.classify(half, 2)[0] is Outcome.RUNNING
    outcome, detail = lifecycle.classify([view(0, running=True), view(1, exit_code=3)], 2)
    assert outcome is Outcome.FAILED
    assert detail == "rank 1 (pod j-a0-r1) exited with code 3"
    lost = [view(0, running=True), view(1, running=True, node="n1", node_lost=True)]
    outcome, detail = lifecycle.classify(lost, 2)
    assert outcome is Outcome.NODE_LOST
    assert "n1" in detail
    gone = [view(0, running=True), view(1, exists=False)]
    assert lifecycle.classify(gone, 2)[0] is Outcome.FAILED
    stuck = [view(0, running=True), view(1, unschedulable=True)]
    assert lifecycle.classify(stuck, 2)[0] is Outcome.UNSCHEDULABLE


def test_an_emergency_exit_is_neither_success_nor_failure() -> None:
    ranks = [view(0, exit_code=EMERGENCY_EXIT_CODE), view(1, exit_code=0)]
    outcome, detail = lifecycle.classify(ranks, 2)
    assert outcome is Outcome.PREEMPTED
    assert "emergency save" in detail
    all_emergency = [view(0, exit_code=EMERGENCY_EXIT_CODE), view(1, exit_code=EMERGENCY_EXIT_CODE)]
    assert lifecycle.classify(all_emergency, 2)[0] is Outcome.PREEMPTED


def test_exit_zero_after_an_eviction_or_a_served_notice_is_not_success() -> None:
    # The SDK stops training after serving a notice, on every rank, and the trainer exits 0.
    evicted = [view(0, exit_code=0, disrupted=True), view(1, exit_code=0)]
    assert lifecycle.classify(evicted, 2)[0] is Outcome.PREEMPTED
    served = [view(0, exit_code=0, served_notice=True), view(1, exit_code=0)]
    assert lifecycle.classify(served, 2)[0] is Outcome.PREEMPTED
    vanished = [view(0, exists=False, served_notice=True), view(1, exit_code=0)]
    assert lifecycle.classify(vanished, 2)[0] is Outcome.PREEMPTED
    stopping = [view(0, exit_code=0, disrupted=True), view(1, running=True)]
    assert lifecycle.classify(stopping, 2)[0] is Outcome.PENDING
    crashed = [view(0, exit_code=0, disrupted=True), view(1, exit_code=137)]
    assert lifecycle.classify(crashed, 2)[0] is Outcome.FAILED


def test_backoff_doubles_up_to_the_ceiling() -> None:
    got = [lifecycle.backoff_seconds(n, base=10, ceiling=35) for n in range(5)]
    assert got == [0.0, 10.0, 20.0, 35.0, 35.0]
    assert lifecycle.backoff_seconds(3, base=0, ceiling=35) == 0.0


def test_preemptions_never_consume_the_failure_budget() -> None:
    s = spec()
    failures = 0
    preemptions = 0
    for _ in range(3):
        plan = lifecycle.plan_restart(
            s,
            kind="preemption",
            attempt=0,
            preemptions=preemptions,
            failures=failures,
            resume_step=10,
            now=NOW,
        )
        preemptions, failures = plan.preemptions, plan.failures
        assert plan.phase is Phase.RESTARTING
        assert plan.restart_after is None, "preemptions restart at once"
    assert (preemptions, failures) == (3, 0)
    plan = lifecycle.plan_restart(
        s,
        kind="failure",
        attempt=3,
        preemptions=3,
        failures=0,
        resume_step=10,
        now=NOW,
        detail="rank 1 exited with code 1",
    )
    assert plan.phase is Phase.RESTARTING
    assert plan.failures == 1
    assert plan.preemptions == 3
    assert plan.attempt == 4
    assert plan.restart_after == NOW + timedelta(seconds=10)
    assert plan.message == (
        "restarting (failure: rank 1 exited with code 1) from step 10 after a 10s backoff"
    )


def test_exhausting_max_failures_fails_the_job_with_a_clear_message() -> None:
    s = spec()
    plan = lifecycle.plan_restart(
        s,
        kind="failure",
        attempt=5,
        preemptions=0,
        failures=2,
        resume_step=None,
        now=NOW,
        detail="rank 0 exited with code 1",
    )
    assert plan.phase is Phase.FAILED
    assert plan.exhausted
    assert plan.message.startswith("failure budget exhausted: 3 failures > maxFailures 2")
    assert "maxFailures" in plan.message


def test_exhausting_max_preemptions() -> None:
    plan = lifecycle.plan_restart(
        spec(), kind="preemption", attempt=1, preemptions=3, failures=0, resume_step=4, now=NOW
    )
    assert plan.phase is Phase.FAILED
    assert "maxPreemptions" in plan.message


def test_elastic_restart_counts_nothing_and_keeps_replicas() -> None:
    plan = lifecycle.plan_restart(
        spec(),
        kind="elastic",
        attempt=1,
        preemptions=1,
        failures=1,
        resume_step=4,
        now=NOW,
        replicas=2,
    )
    assert (plan.preemptions, plan.failures, plan.replicas) == (1, 1, 2)
    grow = lifecycle.plan_restart(
        spec(), kind="preemption", attempt=2, preemptions=1, failures=1, resume_step=6, now=NOW
    )
    assert grow.replicas == 4, "the next restart grows back to spec.replicas"
    with pytest.raises(ValueError, match="unknown restart kind"):
        lifecycle.plan_restart(
            spec(), kind="oops", attempt=0, preemptions=0, failures=0, resume_step=None, now=NOW
        )


def test_elastic_replicas() -> None:
    assert lifecycle.elastic_replicas(spec(), current=4, placeable=1) is None
    s = spec(minReplicas=2)
    assert lifecycle.elastic_replicas(s, current=4, placeable=4) is None
    assert lifecycle.elastic_replicas(s, current=4, placeable=3) == 3
    assert lifecycle.elastic_replicas(s, current=4, placeable=1) == 2
    assert lifecycle.elastic_replicas(s, current=2, placeable=0) is None


def st(state: str, step: int | None = None, **kw: Any) -> SidecarStatus:
    return SidecarStatus(state=state, step=step, **kw)


def test_verdict_committed_at_one_step() -> None:
    reports = {
        0: st("committed", 40, seconds=1.5, uri="/ckpt"),
        1: st("committed", 40, seconds=2.0),
    }
    v = lifecycle.checkpoint_verdict(reports, replicas=2, now=NOW, deadline=NOW)
    assert v.kind is VerdictKind.COMMITTED
    assert v.step == 40
    assert v.seconds == 2.0
    assert v.uri == "/ckpt"


def test_verdict_waits_then_falls_back_at_the_deadline() -> None:
    reports = {0: st("saving"), 1: st("requested")}
    deadline = NOW + timedelta(seconds=5)
    wait = lifecycle.checkpoint_verdict(reports, replicas=2, now=NOW, deadline=deadline)
    assert wait.kind is VerdictKind.WAIT
    late = lifecycle.checkpoint_verdict(
        {0: st("saving"), 1: None},
        replicas=2,
        now=deadline + timedelta(seconds=1),
        deadline=deadline,
    )
    assert late.kind is VerdictKind.FALLBACK
    assert late.reason == (
        "the deadline passed before the ranks reported a commit (no answer from rank(s) [1])"
    )


def test_one_committed_report_proves_the_commit() -> None:
    # The manifest (written last, by rank 0) commits every rank's shards; a rank whose pod
    # already stopped after the save does not need to answer.
    v = lifecycle.checkpoint_verdict(
        {0: None, 1: st("committed", 12)},
        replicas=2,
        now=NOW,
        deadline=NOW,
        unreachable_is_final=[0],
    )
    assert v.kind is VerdictKind.COMMITTED
    assert v.step == 12


@pytest.mark.parametrize("state", ["failed", "skipped"])
def test_verdict_failed_or_skipped_falls_back_and_says_why(state: str) -> None:
    reports = {0: st("committed", 40), 1: st(state, error="not enough time")}
    v = lifecycle.checkpoint_verdict(reports, replicas=2, now=NOW, deadline=NOW)
    assert v.kind is VerdictKind.FALLBACK
    assert v.reason == f"rank 1 reported the save {state}: not enough time"


def test_verdict_gone_ranks_and_split_steps() -> None:
    later = NOW + timedelta(seconds=60)
    one_gone = lifecycle.checkpoint_verdict(
        {0: st("saving"), 1: None}, replicas=2, now=NOW, deadline=later, unreachable_is_final=[1]
    )
    assert one_gone.kind is VerdictKind.WAIT, "rank 0 may still commit for everyone"
    all_gone = lifecycle.checkpoint_verdict(
        {0: None, 1: None}, replicas=2, now=NOW, deadline=later, unreachable_is_final=[0, 1]
    )
    assert all_gone.kind is VerdictKind.FALLBACK
    assert "went away" in all_gone.reason
    split = lifecycle.checkpoint_verdict(
        {0: st("committed", 40), 1: st("committed", 41)}, replicas=2, now=NOW, deadline=NOW
    )
    assert split.kind is VerdictKind.FALLBACK


def test_sidecar_status_parsing() -> None:
    s = SidecarStatus.from_json({"state": "idle", "last_committed_step": 30, "trainer": "alive"})
    assert s.committed_step == 30
    c = SidecarStatus.from_json(
        {"state": "committed", "step": "50", "seconds": 1, "last_committed_step": 30}
    )
    assert c.committed_step == 50
    assert SidecarStatus.from_json({"state": "saving"}).committed_step is None


def test_a_suspend_counts_against_no_budget_even_a_spent_one() -> None:
    plan = lifecycle.plan_restart(
        spec(), kind="suspend", attempt=3, preemptions=3, failures=2, resume_step=40, now=NOW,
        detail="stopped at step 40",
    )  # fmt: skip
    assert plan.phase is Phase.SUSPENDED
    assert not plan.exhausted, "both budgets are at their limit: a suspend spends neither"
    assert (plan.attempt, plan.preemptions, plan.failures) == (4, 3, 2)
    assert (plan.resume_step, plan.restart_after, plan.reason) == (40, None, "suspend")
    assert plan.message == "suspended (stopped at step 40); unsuspending resumes from step 40"


def test_suspended_is_entered_from_the_phases_with_no_training_in_flight() -> None:
    for before in (Phase.PENDING, Phase.CHECKPOINTING, Phase.RESTARTING):
        assert lifecycle.check_transition(before, Phase.SUSPENDED) is Phase.SUSPENDED
    with pytest.raises(ValueError, match="illegal"):
        # A running attempt is checkpointed first (Checkpointing), never dropped.
        lifecycle.check_transition(Phase.RUNNING, Phase.SUSPENDED)
    assert lifecycle.check_transition(Phase.SUSPENDED, Phase.PENDING) is Phase.PENDING
    with pytest.raises(ValueError, match="illegal"):
        lifecycle.check_transition(Phase.SUSPENDED, Phase.RUNNING)
