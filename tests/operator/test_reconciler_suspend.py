"""``spec.suspend`` (Kueue's preemption and the user's pause) and the Kueue metadata of pods,
tick by tick against the fakes of ``baton_testing.reconciler_fakes`` (for real:
test_kueue_cluster.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from baton_operator.reconcile.controller import JobMemory
from baton_testing.reconciler_fakes import JOB, NS, REPLICAS, Harness


def _budgets(h: Harness) -> tuple[int, int]:
    return h.kube.status["preemptions"], h.kube.status["failures"]


def test_suspend_checkpoints_every_rank_first_then_stops_the_pods_and_resumes_there() -> None:
    h = Harness(maxFailures=3)
    h.running()
    # Budgets already spent stay exactly as they are across the suspend.
    h.kube.status.update(preemptions=2, failures=1)
    h.suspend(True)
    h.tick()
    status = h.kube.status
    assert status["phase"] == "Checkpointing"
    assert status["notice"]["source"] == "suspend"
    assert h.kube.condition("Checkpointing")["reason"] == "Suspend"
    assert h.kube.deleted == []
    # asked in the same tick, before the status was written
    assert sorted(ip for ip, _, _ in h.sidecars.requests) == ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    assert all(reason.startswith("suspend:") for _, _, reason in h.sidecars.requests)
    h.report_all(state="requested")
    h.tick()
    assert len(h.sidecars.requests) == REPLICAS, "asked once"
    deadline = h.sidecars.requests[0][1]
    assert deadline >= datetime.now(tz=UTC) + timedelta(
        seconds=h.config.suspend_save_seconds - 5
    ), "the suspend's own window, not a notice's"
    h.report_all(state="saving", trigger="notice")
    h.tick()
    h.tick()
    assert h.kube.deleted == [], "no pod goes before the save has an outcome"
    assert h.kube.status["phase"] == "Checkpointing"

    h.report_all(state="committed", step=40, trigger="notice", uri="s3://bucket/tj", seconds=1.5)
    h.tick()
    status = h.kube.status
    assert status["phase"] == "Suspended"
    assert sorted(h.kube.deleted) == [
        (h.pod(0, r), h.config.delete_grace_seconds) for r in range(REPLICAS)
    ]
    # decided: no sidecar keeps its pod waiting for its own outcome to be read
    assert sorted(h.sidecars.settled) == [
        (f"10.0.0.{r + 1}", f"req-10.0.0.{r + 1}") for r in range(3)
    ]
    assert (status["attempt"], status["resumedFromStep"]) == (1, 40)
    assert status["lastCheckpoint"]["step"] == 40
    assert status["restartReason"] == "suspend"
    assert _budgets(h) == (2, 1), "a suspend is neither a preemption nor a failure"
    assert "notice" not in status
    suspended = h.kube.condition("Suspended")
    assert (suspended["status"], suspended["reason"]) == ("True", "Suspended")
    assert "stopped at step 40" in suspended["message"]
    assert h.kube.condition("Ready")["status"] == "False"
    event = next(m for _, r, m in h.events if r == "Suspended")
    assert "stopped at step 40" in event
    assert "resumes from step 40" in event
    sample = h.registry.get_sample_value
    assert sample("baton_jobs", {"phase": "Suspended"}) == 0  # the phase is read next tick
    for _ in range(3):
        h.tick()
    assert sample("baton_jobs", {"phase": "Suspended"}) == 1
    assert (
        sample("baton_restarts_total", {"namespace": NS, "job": JOB, "reason": "suspend"}) is None
    )
    assert sample("baton_preemptions_total", {"namespace": NS, "job": JOB}) == 0
    assert h.kube.pods == {}, "a suspended job creates no pods"
    key = {"namespace": NS, "job": JOB}
    # Nothing runs, so no checkpoint is overdue (BatonNoRecentCheckpoint) and no budget is
    # being spent: the gauges go while the job is suspended.
    assert sample("baton_last_checkpoint_timestamp_seconds", key) is None
    assert sample("baton_failure_budget_remaining", key) is None

    h.suspend(False)
    resumed = datetime.now(tz=UTC).replace(microsecond=0)
    h.tick()
    h.kube.status["lastCheckpoint"]["completedAt"] = "2026-01-01T00:00:00Z"  # long ago
    h.reconciler.forget(NS, JOB)  # an operator that starts now seeds the gauges afresh
    h.tick()
    # The suspended hours are no time without a checkpoint: it counts from the resume.
    assert sample("baton_last_checkpoint_timestamp_seconds", key) >= resumed.timestamp()
    assert sample("baton_failure_budget_remaining", key) == 2
    status = h.kube.status
    assert status["phase"] == "Pending"
    assert (status["attempt"], status["resumedFromStep"]) == (1, 40)
    assert _budgets(h) == (2, 1)
    assert h.kube.condition("Suspended")["status"] == "False"
    assert "Resumed" in h.reasons()
    assert list(h.kube.pods) == [h.pod(1, 0)]
    assert h.env_of(1, 0)["BATON_RESUME_STEP"] == "40"
    assert h.kube.phases()[-4:] == ["Running", "Checkpointing", "Suspended", "Pending"]


def test_a_suspend_whose_save_times_out_still_stops_the_pods_at_the_last_committed_step() -> None:
    h = Harness()
    h.running()
    h.kube.status["lastCheckpoint"] = {"step": 20, "trigger": "periodic"}
    h.suspend(True)
    h.tick()
    h.report_all(state="saving", trigger="notice")
    h.tick()
    assert h.kube.status["phase"] == "Checkpointing"
    # The deadline passes with the save still in flight (a stuck object store).
    h.kube.status["notice"]["deadline"] = "2026-01-01T00:00:00Z"
    h.tick()
    status = h.kube.status
    assert status["phase"] == "Suspended", "Kueue wants the quota back: the pods stop anyway"
    assert sorted(name for name, _ in h.kube.deleted) == [h.pod(0, r) for r in range(REPLICAS)]
    assert (status["attempt"], status["resumedFromStep"]) == (1, 20)
    assert (status["preemptions"], status["failures"]) == (0, 0)
    condition = h.kube.condition("Suspended")
    assert condition["reason"] == "SuspendedWithoutCheckpoint"
    assert "the last committed step is 20" in condition["message"]
    fallback = next(m for _, r, m in h.events if r == "CheckpointFallback")
    assert "deadline passed" in fallback
    assert "the last committed step is 20" in fallback
    assert "SuspendedWithoutCheckpoint" in h.reasons()


def _memory_tier_job_suspended(last_checkpoint: dict[str, Any], **report: Any) -> Harness:
    """A running job with the memory tier and ``last_checkpoint`` recorded, suspended; every
    rank then answers the suspend's save with ``report``, and the operator ticks once."""
    h = Harness()
    h.kube.job["spec"]["checkpoint"].update({"fastEverySteps": 1, "fastSizeLimit": "64Mi"})
    h.running()
    h.kube.status["lastCheckpoint"] = last_checkpoint
    h.suspend(True)
    h.tick()
    h.report_all(**report)
    h.tick()
    return h


def test_a_suspend_with_the_memory_tier_stops_no_pod_before_the_promotion_commits() -> None:
    # The SDK may commit a suspend's save to the memory tier (``choose_tier``: the request
    # has a deadline), replicated to peer pods. Every pod goes at the suspend, and with them
    # every copy: the save is its answer only once promoted to durable storage.
    h = _memory_tier_job_suspended(
        {"step": 20, "trigger": "periodic", "tier": "durable"}, state="requested"
    )
    memory = {"state": "committed", "step": 40, "trigger": "notice", "tier": "memory",
              "uri": "file:///fast/tj/step-40", "last_committed_step": 20}  # fmt: skip
    h.report_all(**memory)
    for _ in range(3):
        h.tick()
    assert h.kube.deleted == [], "a memory-only commit is no answer: its copies are in the pods"
    assert h.kube.status["phase"] == "Checkpointing"
    assert "Recovering" not in h.reasons(), "a suspend is never answered by a notice recovery"
    h.report_all(**{**memory, "tier": "memory+promoted", "uri": "s3://bucket/tj/step-40",
                    "last_committed_step": 40})  # fmt: skip
    h.tick()
    status = h.kube.status
    assert status["phase"] == "Suspended"
    assert sorted(name for name, _ in h.kube.deleted) == [h.pod(0, r) for r in range(REPLICAS)]
    assert status["resumedFromStep"] == 40
    assert status["lastCheckpoint"]["step"] == 40
    assert status["lastCheckpoint"]["tier"] == "memory+promoted", "recorded as a notice's is"


def test_a_suspend_whose_promotion_misses_the_deadline_resumes_from_the_durable_step() -> None:
    h = _memory_tier_job_suspended(
        {"step": 20, "trigger": "periodic", "tier": "durable"},
        state="committed",
        step=40,
        trigger="notice",
        tier="memory",
        last_committed_step=20,
    )
    h.kube.status["notice"]["deadline"] = "2026-01-01T00:00:00Z"
    h.tick()
    status = h.kube.status
    assert status["phase"] == "Suspended"
    assert (status["resumedFromStep"], status["lastCheckpoint"]["step"]) == (20, 20)
    assert h.kube.condition("Suspended")["reason"] == "SuspendedWithoutCheckpoint"


def test_a_suspend_after_a_memory_commit_not_yet_promoted_never_resumes_from_it() -> None:
    # A notice's recovery recorded step 30 on the memory tier (``lastCheckpoint.tier``); its
    # promotion is not seen yet when the suspend comes, and the suspend's own save fails.
    # The pods go with the only copies of step 30: the job resumes from step 20, the newest
    # step a rank reports durable, never from 30, which would exist nowhere.
    h = _memory_tier_job_suspended(
        {"step": 30, "trigger": "notice", "tier": "memory"},
        state="failed",
        step=35,
        trigger="notice",
        error="disk full",
        last_committed_step=20,
    )
    status = h.kube.status
    assert status["phase"] == "Suspended"
    assert status["resumedFromStep"] == 20
    assert status["lastCheckpoint"]["step"] == 20
    assert "the last committed step is 20" in h.kube.condition("Suspended")["message"]
    h.suspend(False)
    h.tick()
    assert h.env_of(1, 0)["BATON_RESUME_STEP"] == "20"


def test_a_suspend_after_a_memory_commit_a_rank_proves_promoted_resumes_from_it() -> None:
    h = _memory_tier_job_suspended(
        {"step": 30, "trigger": "notice", "tier": "memory"},
        state="failed",
        step=35,
        trigger="notice",
        error="disk full",
        last_committed_step=30,
    )
    status = h.kube.status
    assert (status["phase"], status["resumedFromStep"]) == ("Suspended", 30)


def test_a_suspend_with_no_durable_step_behind_a_memory_commit_resumes_from_the_start() -> None:
    h = _memory_tier_job_suspended(
        {"step": 30, "trigger": "notice", "tier": "memory"},
        state="failed",
        step=35,
        trigger="notice",
        error="disk full",
    )
    status = h.kube.status
    assert status["phase"] == "Suspended"
    assert status.get("resumedFromStep") is None
    assert "lastCheckpoint" not in status, "its step is in no pod after the suspend"
    h.suspend(False)
    h.tick()
    assert "BATON_RESUME_STEP" not in h.env_of(1, 0)


def test_a_job_created_suspended_creates_no_pods_until_unsuspended() -> None:
    h = Harness()
    h.kube.job["spec"]["suspend"] = True
    for i in range(REPLICAS):
        h.node(f"n{i}")
    for _ in range(4):
        h.tick()
    status = h.kube.status
    assert status["phase"] == "Suspended"
    assert h.kube.created == []
    assert h.kube.deleted == []
    assert status["attempt"] == 0, "nothing ran: no attempt is used up"
    assert h.kube.condition("Suspended")["status"] == "True"
    h.suspend(False)
    h.tick()
    assert h.kube.status["phase"] == "Pending"
    assert h.kube.created == [h.pod(0, 0)]
    assert "BATON_RESUME_STEP" not in h.env_of(0, 0)
    h.kube.run(h.pod(0, 0), node="n0", ip="10.0.0.1")
    h.tick()
    assert h.kube.created == [h.pod(0, r) for r in range(REPLICAS)]


def test_a_suspend_before_the_attempt_runs_stops_its_pods_without_asking_for_a_save() -> None:
    h = Harness()
    for i in range(REPLICAS):
        h.node(f"n{i}")
    h.tick()
    h.tick()
    h.kube.run(h.pod(0, 0), node="n0", ip="10.0.0.1")
    h.kube.status["lastCheckpoint"] = {"step": 10, "trigger": "periodic"}
    h.suspend(True)
    h.tick()
    status = h.kube.status
    assert status["phase"] == "Suspended"
    assert h.sidecars.requests == [], "nothing trained since the last commit: nothing to save"
    assert h.kube.deleted == [(h.pod(0, 0), h.config.delete_grace_seconds)]
    assert (status["attempt"], status["resumedFromStep"]) == (1, 10)
    assert (status["preemptions"], status["failures"]) == (0, 0)


def test_a_restarted_operator_finishes_a_suspend_decided_before_it_died() -> None:
    h = Harness()
    h.running()
    h.suspend(True)
    h.tick()  # Checkpointing (suspend), written; the operator dies before asking the ranks
    h.memory = JobMemory()
    h.report_all(state="requested")
    h.tick()  # the next operator reads the status and asks them itself
    assert len(h.sidecars.requests) == REPLICAS
    h.report_all(state="committed", step=40, trigger="notice", uri="s3://bucket/tj", seconds=1.0)
    real_delete = h.kube.delete_pod

    async def killed(namespace: str, name: str, *, grace_seconds: int | None) -> None:
        raise RuntimeError("operator killed between its status write and the deletes")

    h.kube.delete_pod = killed  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="operator killed"):
        h.tick()
    assert h.kube.status["phase"] == "Suspended", "the decision is written before it is done"
    assert len(h.kube.pods) == REPLICAS
    h.kube.delete_pod = real_delete  # type: ignore[method-assign]
    h.memory = JobMemory()
    h.tick()
    assert h.kube.pods == {}, "the next operator deletes what the suspend left"
    status = h.kube.status
    assert (status["phase"], status["attempt"], status["resumedFromStep"]) == ("Suspended", 1, 40)
    assert h.kube.created.count(h.pod(1, 0)) == 0


def test_a_notice_save_in_flight_when_the_job_is_suspended_ends_suspended() -> None:
    h = Harness()
    h.running()
    h.spot_notice("n1")
    h.tick()
    h.report_all(state="saving", trigger="notice")
    h.tick()
    h.suspend(True)
    h.report_all(state="committed", step=40, trigger="notice", uri="s3://bucket/tj", seconds=1.5)
    h.tick()
    status = h.kube.status
    assert (status["phase"], status["resumedFromStep"], status["preemptions"]) == (
        "Suspended",
        40,
        0,
    )
    assert "n1" in status["avoidNodes"], "the resumed attempt still keeps off the noticed node"
    h.suspend(False)
    h.tick()
    assert "n1" in str(h.kube.pods[h.pod(1, 0)]["spec"]["affinity"])


def _kueue_metadata(h: Harness, attempt: int) -> list[tuple[dict[str, str], dict[str, str]]]:
    pods = [h.kube.pods[h.pod(attempt, r)]["metadata"] for r in range(REPLICAS)]
    return [(m["labels"], m.get("annotations") or {}) for m in pods]


def test_pods_carry_the_jobs_kueue_queue_and_one_pod_group_per_attempt() -> None:
    h = Harness()
    h.kube.job["metadata"]["labels"] = {
        "kueue.x-k8s.io/queue-name": "team-a",
        "kueue.x-k8s.io/priority-class": "high",
        "other": "x",
    }
    h.running()
    seen = {0: _kueue_metadata(h, 0)}
    h.spot_notice("n1")
    h.tick()
    h.report_all(state="committed", step=40, trigger="notice", uri="s3://bucket/tj", seconds=1.5)
    h.tick()
    h.tick()
    h.kube.run(h.pod(1, 0), node="n0", ip="10.0.0.1")
    h.tick()
    seen[1] = _kueue_metadata(h, 1)
    for attempt, pods in seen.items():
        for labels, notes in pods:
            assert labels["kueue.x-k8s.io/queue-name"] == "team-a"
            assert labels["kueue.x-k8s.io/priority-class"] == "high"
            assert labels["kueue.x-k8s.io/pod-group-name"] == f"{JOB}-a{attempt}"
            assert notes["kueue.x-k8s.io/pod-group-total-count"] == str(REPLICAS)
            assert "other" not in labels, "only Kueue's labels pass from the job to its pods"


def test_a_job_without_a_queue_gets_no_kueue_metadata() -> None:
    h = Harness()
    h.kube.job["metadata"]["labels"] = {"kueue.x-k8s.io/priority-class": "high"}
    h.running()
    for labels, notes in _kueue_metadata(h, 0):
        assert not [k for k in (*labels, *notes) if k.startswith("kueue.x-k8s.io/")]
