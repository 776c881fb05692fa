"""The reconciler's decisions, tick by tick, against a fake of the client layer (no cluster).

The fakes and the harness are in ``baton_testing.reconciler_fakes``. This module holds the core
decisions: a notice's checkpoint and the move, fallbacks, refusals, guarded writes and their
conflicts, the loaded step in the status, a new leader's reading of ended sidecars. The other
``test_reconciler_*.py`` modules hold one feature each (disruption hints and the adaptive
interval, ``spec.suspend`` and Kueue, the interruption history, gang scheduling, the memory
tier's recovery). The same paths run for real in the cluster tests
(test_preemption_cluster.py, test_lifecycle_cluster.py); these say which decision is taken,
and why, in milliseconds.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest
from baton_operator.pure import manifests
from baton_operator.pure.errors import KubeConflictError, KubeError
from baton_operator.pure.pods import PodView
from baton_operator.pure.reports import SidecarStatus
from baton_operator.reconcile.controller import JobMemory
from baton_testing.reconciler_fakes import JOB, NS, REPLICAS, FakeKube, Harness, merge_patch


def test_a_spot_notice_checkpoints_every_rank_then_moves_the_job() -> None:
    h = Harness()
    h.running()
    h.spot_notice("n1")
    before = datetime.now(tz=UTC)
    h.tick()
    status = h.kube.status
    assert status["phase"] == "Checkpointing"
    assert "n1" in status["avoidNodes"]
    assert status["notice"]["source"] == "aws"
    # The deadline is clamped to at least the operator's minimum window.
    deadline = datetime.fromisoformat(status["notice"]["deadline"].replace("Z", "+00:00"))
    assert deadline >= before.replace(microsecond=0) + timedelta(
        seconds=h.config.min_checkpoint_window_seconds
    )

    h.report_all(state="requested")
    h.tick()
    assert sorted(ip for ip, _, _ in h.sidecars.requests) == ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    assert all("aws: AWS Node Termination Handler" in r for _, _, r in h.sidecars.requests)
    assert h.kube.status["notice"]["requestIds"] == ["req-10.0.0.1", "req-10.0.0.2", "req-10.0.0.3"]
    assert h.kube.status["phase"] == "Checkpointing", "nothing committed yet: wait"

    h.report_all(state="committed", step=40, trigger="notice", uri="s3://bucket/tj", seconds=1.5)
    h.tick()
    status = h.kube.status
    assert status["phase"] == "Restarting"
    assert (status["attempt"], status["preemptions"], status["failures"]) == (1, 1, 0)
    assert status["resumedFromStep"] == 40
    assert status["lastCheckpoint"]["step"] == 40
    assert status["lastCheckpoint"]["trigger"] == "notice"
    assert "notice" not in status
    assert sorted(h.kube.deleted) == [
        (h.pod(0, r), h.config.delete_grace_seconds) for r in range(3)
    ]
    assert any(reason == "CheckpointCommitted" for _, reason, _ in h.events)

    h.tick()  # Restarting -> Pending, the new attempt's rank 0 resumes at the committed step
    assert h.kube.status["phase"] == "Pending"
    pod = h.kube.pods[h.pod(1, 0)]
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["BATON_RESUME_STEP"] == "40"
    assert "n1" in str(pod["spec"]["affinity"])
    assert h.kube.phases() == ["Pending", "Running", "Checkpointing", "Restarting", "Pending"]


def test_a_commit_seen_on_one_rank_settles_every_ranks_request_before_the_pods_go() -> None:
    # One rank's committed proves the checkpoint: the verdict comes while the other ranks are
    # still writing theirs. Their sidecars hear that the request is decided, or each would
    # keep its pod for its linger waiting for an outcome that nobody will read, and the
    # next attempt would wait for those pods (seen: 16 s in Restarting in bench/goodput.py).
    h = Harness()
    h.running()
    h.spot_notice("n1")
    h.tick()
    h.report_all(state="saving", step=40, trigger="notice")
    h.tick()
    assert h.kube.status["phase"] == "Checkpointing"
    assert h.sidecars.settled == [], "nothing is decided before a commit"
    ip0 = "10.0.0.1"
    h.sidecars.reports[ip0] = SidecarStatus(
        request_id=f"req-{ip0}", state="committed", step=40, trigger="notice",
        uri="s3://bucket/tj", seconds=1.5, tier="durable",
    )  # fmt: skip
    h.sidecars.reports["10.0.0.3"] = None  # this rank's sidecar no longer answers
    phases_seen: list[str] = []
    settle = h.sidecars.settle

    async def settle_after_the_decision(ip: str, token: str, request_id: str) -> None:
        phases_seen.append(h.kube.status["phase"])
        await settle(ip, token, request_id)

    h.sidecars.settle = settle_after_the_decision  # type: ignore[method-assign]
    h.tick()
    assert h.kube.status["phase"] == "Restarting"
    assert set(phases_seen) == {"Restarting"}, "settled only once the decision is written"
    assert sorted(h.sidecars.settled) == [
        ("10.0.0.1", "req-10.0.0.1"),
        ("10.0.0.2", "req-10.0.0.2"),
    ]
    assert sorted(h.kube.deleted) == [
        (h.pod(0, r), h.config.delete_grace_seconds) for r in range(3)
    ], "an unanswered settle holds nothing up"


def test_a_failed_save_falls_back_to_the_newest_step_any_rank_committed() -> None:
    h = Harness()
    h.running()
    # A periodic save committed step 30 (rank 2 knows it), newer than status.lastCheckpoint.
    h.kube.status["lastCheckpoint"] = {"step": 20, "trigger": "periodic"}
    h.spot_notice("n0")
    h.tick()
    assert h.kube.status["phase"] == "Checkpointing"
    h.report_all(state="saving", trigger="notice", last_committed_step=30)
    h.tick()
    h.report_all(state="failed", trigger="notice", error="disk full", last_committed_step=30)
    h.tick()
    status = h.kube.status
    assert status["phase"] == "Restarting"
    assert status["resumedFromStep"] == 30
    assert status["lastCheckpoint"] == {
        "step": 30,
        "uri": "s3://bucket/tj",
        "trigger": "periodic",
        "completedAt": status["lastCheckpoint"]["completedAt"],
    }
    assert (status["preemptions"], status["failures"]) == (1, 0), "a preemption, not a failure"
    fallback = [m for _, reason, m in h.events if reason == "CheckpointFallback"]
    assert len(fallback) == 1
    assert "disk full" in fallback[0]
    assert "the last step known to be committed is 30" in fallback[0]


def test_a_checkpoint_request_without_a_recorded_notice_says_why_it_was_sent() -> None:
    # The job is Checkpointing but status.notice is empty (an edit by hand, or a status
    # written by an older operator): the ranks are still asked, and the reason they log
    # ("control request <id> (operator: <reason>)") says what happened, not "None: None".
    h = Harness()
    h.running()
    h.kube.status["phase"] = "Checkpointing"
    h.tick()
    reasons = [r for _, _, r in h.sidecars.requests]
    assert len(reasons) == REPLICAS, h.sidecars.requests
    assert all("None" not in r for r in reasons), reasons
    assert all("no notice" in r for r in reasons), reasons


def test_a_partly_recorded_notice_gives_the_part_it_has_as_the_reason() -> None:
    h = Harness()
    h.running()
    h.kube.status["phase"] = "Checkpointing"
    h.kube.status["notice"] = {"reason": "maintenance window"}
    h.tick()
    assert [r for _, _, r in h.sidecars.requests] == ["maintenance window"] * REPLICAS


def test_a_notice_before_the_attempt_runs_moves_it_without_asking_for_a_save() -> None:
    h = Harness()
    for i in range(REPLICAS):
        h.node(f"n{i}")
    h.tick()
    h.tick()
    h.kube.run(h.pod(0, 0), node="n0", ip="10.0.0.1")
    h.spot_notice("n0")
    h.tick()
    status = h.kube.status
    assert status["phase"] == "Restarting"
    assert status["avoidNodes"] == ["n0"]
    assert status.get("resumedFromStep") is None
    assert h.sidecars.requests == [], "nothing trained since the last commit: nothing to save"


def test_a_disruption_target_on_a_node_that_is_not_ready_is_no_notice() -> None:
    h = Harness()
    h.running()
    pod = h.kube.pods[h.pod(0, 1)]
    pod["status"]["conditions"] = [
        {"type": "DisruptionTarget", "status": "True", "reason": "DeletionByTaintManager"}
    ]
    # Not Ready for a moment (not yet lost): the taint manager cleaning up a node that went
    # down is not an advance notice, so no save is asked.
    h.node("n1", ready=False, for_seconds=1)
    h.tick()
    assert h.kube.status["phase"] == "Running"
    assert h.sidecars.requests == []
    # Once the node counts as lost, it is a failure (no notice came), not a preemption.
    h.node("n1", ready=False, for_seconds=h.config.node_lost_seconds + 1)
    h.tick()
    status = h.kube.status
    assert (status["phase"], status["failures"], status["preemptions"]) == ("Restarting", 1, 0)
    assert (h.pod(0, 1), 0) in h.kube.deleted, "a pod on a lost node is deleted at once"
    assert h.sidecars.requests == []


def test_a_disruption_target_on_a_ready_node_is_a_notice() -> None:
    h = Harness()
    h.running()
    pod = h.kube.pods[h.pod(0, 1)]
    pod["status"]["conditions"] = [
        {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}
    ]
    h.tick()
    assert h.kube.status["phase"] == "Checkpointing"
    assert h.kube.status["notice"]["source"] == "disruption-target"


def test_a_finished_pod_on_a_noticed_node_is_no_notice() -> None:
    h = Harness()
    h.running()
    pod = h.kube.pods[h.pod(0, 1)]
    pod["status"]["phase"] = "Succeeded"
    pod["status"]["containerStatuses"] = [
        {"name": manifests.TRAINER_NAME, "state": {"terminated": {"exitCode": 0}}}
    ]
    h.spot_notice("n1")
    h.tick()
    assert h.kube.status["phase"] == "Running", "a rank that finished has nothing to save"
    assert h.sidecars.requests == []


def test_a_rejected_pod_fails_the_job_once_naming_the_field() -> None:
    h = Harness()
    h.tick()
    h.kube.create_errors.append(
        KubeError.from_answer(
            f"creating pod {NS}/{h.pod(0, 0)}: HTTP 422: Pod is invalid",
            status=422,
            fields=("spec.containers[0].image",),
        )
    )
    h.tick()
    status = h.kube.status
    assert status["phase"] == "Failed"
    failed = h.kube.condition("Failed")
    assert failed["reason"] == "PodRejected"
    assert "spec.template.spec.containers[0].image" in failed["message"]
    assert "fix spec.template" in failed["message"]
    assert [r for _, r, _ in h.events].count("PodRejected") == 1
    assert h.tick() is None, "a failed job's daemon stops: nothing is retried"
    assert h.kube.created == []


def test_a_failed_jobs_service_is_deleted_and_a_users_service_is_kept() -> None:
    h = Harness()
    h.tick()
    assert list(h.kube.services) == [JOB], "the job starts with its headless Service"
    h.kube.create_errors.append(
        KubeError.from_answer(
            f"creating pod {NS}/{h.pod(0, 0)}: HTTP 422: Pod is invalid",
            status=422,
            fields=("spec.containers[0].image",),
        )
    )
    h.tick()
    assert h.kube.status["phase"] == "Failed"
    assert h.tick() is None
    assert h.kube.services == {}, "no rank of a Failed job runs again: its Service goes"

    # A Service of the job's name that the job does not own (the create found it there)
    # is the user's: the failed job leaves it alone.
    other = Harness()
    users = {"metadata": {"name": JOB, "namespace": NS}, "spec": {"clusterIP": "None"}}
    other.kube.services[JOB] = users
    other.tick()
    other.kube.create_errors.append(
        KubeError.from_answer(f"creating pod {NS}/x: HTTP 422: Pod is invalid", status=422)
    )
    other.tick()
    assert other.kube.status["phase"] == "Failed"
    assert other.tick() is None
    assert other.kube.services == {JOB: users}


def test_a_forbidden_create_is_retried_with_backoff_not_every_tick() -> None:
    h = Harness()
    h.tick()
    h.kube.create_errors.append(
        KubeError.from_answer(
            f"creating pod {NS}/{h.pod(0, 0)}: HTTP 403: pods is forbidden: exceeded quota: gpu",
            status=403,
        )
    )
    h.tick()
    assert h.kube.status["phase"] == "Pending"
    degraded = h.kube.condition("Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "PodCreateFailed")
    assert "exceeded quota" in degraded["message"]
    assert "retrying in 1s" in degraded["message"]
    assert h.memory.create_retry_at is not None
    h.tick()
    assert h.kube.created == [], "inside the backoff nothing is created"
    h.memory.create_retry_at = datetime.now(tz=UTC) - timedelta(seconds=1)  # the backoff passed
    h.tick()
    assert h.kube.created == [h.pod(0, 0)]
    degraded = h.kube.condition("Degraded")
    assert (degraded["status"], degraded["reason"]) == ("False", "Created")


def test_a_conflicting_write_is_detected_and_the_tick_decides_again_from_a_fresh_read() -> None:
    h = Harness()
    h.running()
    h.spot_notice("n1")

    def other_writer(kube: FakeKube) -> None:
        # Someone else changes the job between this tick's read and its write.
        kube.job["status"]["stepsLost"] = 7
        kube.bump()

    h.kube.before_write = other_writer
    h.tick()
    assert h.kube.conflicts == 1
    status = h.kube.status
    assert status["phase"] == "Checkpointing", "decided again and written"
    assert status["stepsLost"] == 7, "the other writer's change is kept, not overwritten"
    assert h.kube.phases().count("Checkpointing") == 1


def test_a_restart_another_writer_already_made_is_not_made_twice() -> None:
    h = Harness()
    h.running()
    h.spot_notice("n1")
    h.tick()
    h.tick()  # requests sent
    h.report_all(state="committed", step=40, trigger="notice")

    def other_operator(kube: FakeKube) -> None:
        # A second operator (a fail-over) took the same decision first.
        merge_patch(kube.job["status"], {"phase": "Restarting", "attempt": 1, "preemptions": 1,
                                    "resumedFromStep": 40, "notice": None})  # fmt: skip
        kube.bump()

    h.kube.before_write = other_operator
    h.tick()
    assert h.kube.conflicts == 1
    status = h.kube.status
    assert (status["phase"], status["attempt"], status["preemptions"]) == ("Restarting", 1, 1)


def test_a_write_that_keeps_losing_gives_up_to_the_daemons_backoff() -> None:
    h = Harness()
    h.running()
    h.spot_notice("n1")

    async def always_conflict(*args: Any, **kwargs: Any) -> str | None:
        raise KubeError.from_answer("patching: HTTP 409: modified", status=409)

    h.kube.patch_job_status = always_conflict  # type: ignore[method-assign]
    with pytest.raises(KubeConflictError):
        h.tick()
    assert h.kube.status["phase"] == "Running"


@pytest.mark.parametrize(
    ("status", "message", "kind"),
    [
        (422, "HTTP 422: invalid", "permanent"),
        (400, "HTTP 400: bad request", "permanent"),
        (403, "HTTP 403: pods is forbidden: violates PodSecurity restricted", "permanent"),
        (403, "HTTP 403: pods is forbidden: User cannot create pods", "temporary"),
        (409, "HTTP 409: modified", "conflict"),
        (410, "HTTP 410: too old", "temporary"),
        (503, "HTTP 503: unavailable", "temporary"),
        (0, "no answer (TimeoutError)", "temporary"),
    ],
)
def test_the_client_layer_says_which_errors_are_permanent(
    status: int, message: str, kind: str
) -> None:
    from baton_operator.pure.errors import PermanentError, TemporaryError

    error = KubeError.from_answer(message, status=status)
    assert error.permanent is (kind == "permanent")
    assert isinstance(error, PermanentError if kind == "permanent" else TemporaryError)
    assert isinstance(error, KubeConflictError) is (kind == "conflict")
    if kind == "conflict":
        assert cast(KubeConflictError, error).delay == 0.0


def test_jobs_by_phase_follow_each_jobs_phase_changes() -> None:
    h = Harness()

    def jobs(phase: str) -> float | None:
        return h.registry.get_sample_value("baton_jobs", {"phase": phase})

    h.tick()
    assert (jobs("Pending"), jobs("Running"), jobs("Failed")) == (1, 0, 0)
    h.running()
    h.tick()  # a tick counts the phase it reads
    assert (jobs("Pending"), jobs("Running")) == (0, 1)
    h.reconciler.forget(NS, JOB)
    assert (jobs("Pending"), jobs("Running")) == (0, 0)


def test_the_status_reports_the_step_the_ranks_actually_loaded() -> None:
    # An operator restarted mid-checkpoint found every rank gone and fell back to step 20,
    # while the ranks' notice save of step 24 had committed: the new attempt's ranks load
    # 24 (the newest complete step) and say so; the status must say it too.
    h = Harness()
    h.running()
    h.spot_notice("n1")
    h.tick()
    h.memory = JobMemory()  # the restarted operator remembers nothing
    h.kube.status["lastCheckpoint"] = {"step": 20, "trigger": "periodic"}
    h.kube.status["notice"]["requestedAt"] = h.kube.status["notice"]["receivedAt"]
    for name in list(h.kube.pods):
        pod = h.kube.pods[name]
        pod["status"]["phase"] = "Succeeded"
        pod["status"]["containerStatuses"][0]["state"] = {"terminated": {"exitCode": 75}}
    h.sidecars.reports.clear()
    h.tick()
    status = h.kube.status
    assert (status["phase"], status["resumedFromStep"]) == ("Restarting", 20)
    h.tick()  # Pending: rank 0 of attempt 1
    h.kube.run(h.pod(1, 0), node="n0", ip="10.0.1.1")
    h.tick()
    for rank in range(1, REPLICAS):
        h.kube.run(h.pod(1, rank), node=f"n{rank + 2}", ip=f"10.0.1.{rank + 1}")
    for rank in range(REPLICAS):
        idle = SidecarStatus(state="idle", last_committed_step=24)
        h.sidecars.reports[f"10.0.1.{rank + 1}"] = idle
    h.memory.next_progress_poll = None
    h.tick()
    status = h.kube.status
    assert status["resumedFromStep"] == 24
    assert status["lastCheckpoint"]["step"] == 24
    # The interruption that led here says so too (its steps lost are unknown: the restarted
    # operator never heard a step before it).
    (entry,) = status["interruptions"]
    assert (entry["attempt"], entry["resumeStep"]) == (0, 24), entry
    assert "stepsLost" not in entry
    corrected = [m for _, reason, m in h.events if reason == "ResumeStepCorrected"]
    assert len(corrected) == 1
    assert "loaded step 24, not the recorded step 20" in corrected[0]
    h.memory.next_progress_poll = None
    h.tick()
    assert len([r for _, r, _ in h.events if r == "ResumeStepCorrected"]) == 1, "said once"


def test_a_new_leader_reads_a_signal_save_from_the_ended_sidecars_and_records_it_once() -> None:
    # The active operator stopped (SIGSTOP) after it began the notice; the drain's SIGTERM made
    # every rank save step 24 (trigger signal, no request id, so no sidecar lingered) and exit
    # 75. The new leader has nobody to poll: each sidecar's last report is in its termination
    # message, which the kubelet keeps in the pod's status. No false fallback, one record.
    h = Harness()
    h.running()
    h.kube.status["lastCheckpoint"] = {"step": 20, "trigger": "periodic"}
    h.spot_notice("n1")
    h.tick()
    h.memory = JobMemory()  # the new leader remembers nothing
    h.build()
    beat = datetime.now(tz=UTC).isoformat()
    final = {
        "state": "committed", "step": 24, "trigger": "signal", "request_id": None,
        "uri": "s3://bucket/tj/step-000000000024", "seconds": 1.25, "last_committed_step": 24,
        "train_step": 24, "step_seconds": 0.5, "heartbeat": beat, "tier": "durable",
    }  # fmt: skip
    for name in list(h.kube.pods):
        pod = h.kube.pods[name]
        pod["status"]["phase"] = "Failed"
        pod["status"]["containerStatuses"][0]["state"] = {"terminated": {"exitCode": 75}}
        pod["status"]["initContainerStatuses"] = [
            {
                "name": manifests.SIDECAR_NAME,
                "state": {"terminated": {"exitCode": 0, "message": json.dumps(final)}},
            }
        ]
    h.sidecars.reports.clear()
    h.tick()
    status = h.kube.status
    assert (status["phase"], status["resumedFromStep"]) == ("Restarting", 24), status
    assert (status["lastCheckpoint"]["step"], status["lastCheckpoint"]["trigger"]) == (
        24,
        "notice",
    )
    assert (status["preemptions"], status["failures"]) == (1, 0)
    reasons = h.reasons()
    assert "CheckpointFallback" not in reasons, h.events
    assert "CheckpointCommitted" in reasons
    (entry,) = status["interruptions"]
    assert (entry["lastGoodStep"], entry["resumeStep"], entry["stepsLost"]) == (24, 24, 0), entry
    assert entry["noticeToDurableSeconds"] is not None, entry
    h.tick()  # Pending: the new attempt resumes from the signal save, nothing to correct
    assert h.env_of(1, 0)["BATON_RESUME_STEP"] == "24"
    assert "ResumeStepCorrected" not in h.reasons()


def test_a_sidecar_termination_message_that_is_not_a_report_is_ignored() -> None:
    def pod(message: str | None) -> PodView:
        state: dict[str, Any] = {"terminated": {"exitCode": 0}}
        if message is not None:
            state["terminated"]["message"] = message
        return PodView.from_body(
            {
                "status": {
                    "initContainerStatuses": [{"name": manifests.SIDECAR_NAME, "state": state}]
                }
            }
        )

    assert pod(None).sidecar_final is None
    assert pod("not json {").sidecar_final is None, "cut off at 4096 bytes, or an old sidecar"
    assert pod("[1, 2]").sidecar_final is None
    report = pod('{"state": "committed", "step": 7, "trigger": "notice"}').sidecar_final
    assert report is not None
    assert (report.state, report.step, report.committed_step) == ("committed", 7, 7)
    running = PodView.from_body(
        {"status": {"initContainerStatuses": [{"name": manifests.SIDECAR_NAME,
                                               "state": {"running": {}}}]}}
    )  # fmt: skip
    assert running.sidecar_final is None


def test_ranks_that_disagree_or_have_saved_since_claim_no_loaded_step() -> None:
    from baton_operator.pure.reports import loaded_step

    assert loaded_step([SidecarStatus(state="idle", last_committed_step=24)] * 2) == 24
    assert loaded_step([SidecarStatus(state="idle")]) is None, "not restored yet, or scratch"
    assert loaded_step([SidecarStatus(state="committed", step=30, last_committed_step=30)]) is None
    # The SDK's restored_step outlives the first save: a resume one step before a periodic
    # save was missed when only an idle report could say it (an API outage test in CI).
    saved_since = SidecarStatus(
        state="committed", step=25, last_committed_step=25, restored_step=24
    )
    assert loaded_step([saved_since, SidecarStatus(state="saving", restored_step=24)]) == 24
    assert loaded_step([saved_since, SidecarStatus(state="idle", restored_step=20)]) is None
    assert (
        loaded_step(
            [
                SidecarStatus(state="idle", last_committed_step=24),
                SidecarStatus(state="idle", last_committed_step=20),
            ]
        )
        is None
    )


def test_messages_count_ranks_as_pods_times_processes_and_name_the_pods() -> None:
    """A job of 3 pods of 2 processes each has 6 ranks: no message says "all 3 ranks"
    (issue 31, section 3)."""
    h = Harness()
    h.kube.job["spec"]["procsPerReplica"] = 2
    h.running()
    h.spot_notice("n1")
    h.tick()
    h.report_all(state="requested")
    h.tick()
    h.report_all(state="committed", step=40, trigger="notice", uri="s3://bucket/tj", seconds=1.5)
    h.tick()
    assert h.kube.status["phase"] == "Restarting"
    h.tick()  # Restarting -> Pending: rank 0
    h.node("n3")  # in place of the noticed n1
    h.kube.run(h.pod(1, 0), node="n0", ip="10.0.1.1")
    h.tick()  # the other ranks
    for rank in range(1, REPLICAS):
        h.kube.run(h.pod(1, rank), node=("n3", "n2")[rank - 1], ip=f"10.0.1.{rank + 1}")
    for rank in range(REPLICAS):
        h.sidecars.reports[f"10.0.1.{rank + 1}"] = SidecarStatus(state="idle")
    h.tick()
    assert h.kube.status["phase"] == "Running"
    for rank in range(REPLICAS):
        pod = h.kube.pods[h.pod(1, rank)]
        pod["status"]["containerStatuses"][0]["state"] = {"terminated": {"exitCode": 0}}
    h.tick()
    assert h.kube.status["phase"] == "Succeeded"
    texts = [message for _, _, message in h.events] + [
        c["message"] for c in h.kube.status["conditions"]
    ]
    assert not [m for m in texts if "all 3 ranks" in m], texts
    by_reason = {reason: message for _, reason, message in h.events}
    assert by_reason["CheckpointCommitted"].startswith("all 6 ranks (3 pods) committed step 40")
    assert "asking all 6 ranks (3 pods) to checkpoint" in by_reason["EvictionNotice"]
    assert by_reason["Succeeded"] == "all 6 ranks (3 pods) finished training"
    assert "all 3 pods are running" in by_reason["Running"]
