"""The interruption history and goodput in the status and the metrics, tick by tick against
the fakes of ``baton_testing.reconciler_fakes`` (the pure economics: test_economics.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from baton_operator.pure.reports import SidecarStatus
from baton_testing.reconciler_fakes import JOB, NS, REPLICAS, Harness


def _gpu_job(h: Harness, gpus_per_pod: int, *, age_seconds: float) -> datetime:
    """Give the trainer ``gpus_per_pod`` GPUs and make the job ``age_seconds`` old."""
    container = h.kube.job["spec"]["template"]["spec"]["containers"][0]
    container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus_per_pod)}}
    created = datetime.now(tz=UTC) - timedelta(seconds=age_seconds)
    h.kube.job["metadata"]["creationTimestamp"] = created.isoformat()
    return created


def _sample(h: Harness, name: str) -> float | None:
    return h.registry.get_sample_value(name, {"namespace": NS, "job": JOB})


def test_a_notice_preemption_is_recorded_with_its_lead_time_and_notice_to_durable() -> None:
    h = Harness()
    _gpu_job(h, 2, age_seconds=100)
    h.running()
    h.training("10.0.0.", step=57, at=datetime.now(tz=UTC), last_committed_step=50)
    h.tick()
    goodput = h.kube.status["goodput"]
    assert goodput["step"] == 57
    assert goodput["productiveSeconds"] == pytest.approx(57 * 0.5)
    assert 100 <= goodput["wallSeconds"] < 100 + 60
    assert goodput["ratio"] == pytest.approx(57 * 0.5 / goodput["wallSeconds"], rel=1e-3)
    assert _sample(h, "baton_goodput_ratio") == pytest.approx(goodput["ratio"], rel=1e-3)

    h.spot_notice("n1")
    h.tick()
    h.report_all(state="committed", step=60, trigger="notice", uri="s3://bucket/tj", seconds=1.5,
                 train_step=60, step_seconds=0.5, heartbeat=datetime.now(tz=UTC))  # fmt: skip
    h.tick()
    status = h.kube.status
    assert status["phase"] == "Restarting"
    (entry,) = status["interruptions"]
    assert (entry["attempt"], entry["source"], entry["nodes"]) == (0, "aws", ["n1"])
    assert (entry["lastGoodStep"], entry["resumeStep"], entry["stepsLost"]) == (60, 60, 0)
    assert (entry["gpus"], entry["gpuSecondsLost"], entry["stepSeconds"]) == (6, 0.0, 0.5)
    notice_at = datetime.fromisoformat(entry["noticeAt"].replace("Z", "+00:00"))
    deadline = datetime.fromisoformat(entry["deadline"].replace("Z", "+00:00"))
    assert entry["leadSeconds"] == (deadline - notice_at).total_seconds()
    assert entry["leadSeconds"] >= h.config.min_checkpoint_window_seconds
    assert 0 <= entry["noticeToDurableSeconds"] <= entry["leadSeconds"]
    assert "restartSeconds" not in entry, "known once the next attempt trains"
    assert status["stepsLost"] == 0
    assert _sample(h, "baton_notice_lead_seconds_count") == 1
    assert _sample(h, "baton_steps_lost_per_restart_count") == 1


def test_a_failure_records_the_steps_and_gpu_seconds_lost_then_the_restart_time() -> None:
    h = Harness(maxFailures=3)
    _gpu_job(h, 2, age_seconds=300)
    h.running()
    h.kube.status["lastCheckpoint"] = {"step": 50, "trigger": "periodic"}
    last_good = datetime.now(tz=UTC) - timedelta(seconds=30)
    h.training("10.0.0.", step=57, at=last_good, last_committed_step=50)
    h.tick()
    pod = h.kube.pods[h.pod(0, 2)]
    pod["status"]["phase"] = "Failed"
    pod["status"]["containerStatuses"][0]["state"] = {"terminated": {"exitCode": 1}}
    h.tick()
    status = h.kube.status
    assert (status["phase"], status["failures"], status["resumedFromStep"]) == (
        "Restarting", 1, 50,
    )  # fmt: skip
    (entry,) = status["interruptions"]
    assert entry["source"] == "failure"
    assert "noticeAt" not in entry
    assert "noticeToDurableSeconds" not in entry
    assert (entry["lastGoodStep"], entry["resumeStep"], entry["stepsLost"]) == (57, 50, 7)
    assert entry["gpus"] == REPLICAS * 2
    assert entry["gpuSecondsLost"] == pytest.approx(7 * 0.5 * REPLICAS * 2)
    assert status["stepsLost"] == 7
    assert _sample(h, "baton_steps_lost_total") == 7
    assert _sample(h, "baton_gpu_seconds_lost_total") == pytest.approx(21.0)

    h.kube.status.pop("restartAfter")  # the failure's backoff is over
    h.tick()  # Pending: attempt 1
    h.kube.run(h.pod(1, 0), node="n0", ip="10.0.1.1")
    h.tick()
    for rank in range(1, REPLICAS):
        h.kube.run(h.pod(1, rank), node=f"n{rank}", ip=f"10.0.1.{rank + 1}")
    # The new attempt's ranks restored step 50 and have not stepped yet: nothing to fill.
    for rank in range(REPLICAS):
        h.sidecars.reports[f"10.0.1.{rank + 1}"] = SidecarStatus(
            state="idle", last_committed_step=50
        )
    h.memory.next_progress_poll = None
    h.tick()
    assert "restartSeconds" not in h.kube.status["interruptions"][-1]
    first = last_good.replace(microsecond=0) + timedelta(seconds=42)
    h.training("10.0.1.", step=51, at=first, last_committed_step=50)
    h.tick()
    (entry,) = h.kube.status["interruptions"]
    last_good_at = datetime.fromisoformat(entry["lastGoodStepAt"].replace("Z", "+00:00"))
    assert entry["restartSeconds"] == (first - last_good_at).total_seconds()
    assert 42 <= entry["restartSeconds"] < 43
    assert _sample(h, "baton_restart_seconds_count") == 1
    h.memory.next_progress_poll = None
    h.tick()
    assert _sample(h, "baton_restart_seconds_count") == 1, "filled once"


def test_a_node_lost_without_notice_is_recorded_as_node_lost() -> None:
    h = Harness(maxFailures=3)
    h.running()
    h.training("10.0.0.", step=12, at=datetime.now(tz=UTC))
    h.tick()
    h.node("n2", ready=False, for_seconds=3600)
    h.tick()
    status = h.kube.status
    assert status["phase"] == "Restarting", status
    (entry,) = status["interruptions"]
    assert (entry["source"], entry["nodes"]) == ("node-lost", ["n2"])
    assert (entry["lastGoodStep"], entry["stepsLost"]) == (12, 12), "no checkpoint: all lost"
    assert (entry["gpus"], entry["gpuSecondsLost"]) == (0, 0.0), "a job without GPUs"


def test_the_history_keeps_the_newest_twenty() -> None:
    h = Harness(maxFailures=3)
    h.running()
    old = [{"attempt": -100 + i, "source": "failure", "at": "2026-01-01T00:00:00Z"}
           for i in range(20)]  # fmt: skip
    h.kube.status["interruptions"] = old
    pod = h.kube.pods[h.pod(0, 0)]
    pod["status"]["containerStatuses"][0]["state"] = {"terminated": {"exitCode": 1}}
    h.tick()
    history = h.kube.status["interruptions"]
    assert len(history) == 20
    assert history[0] == old[1], "the oldest went"
    assert history[-1]["attempt"] == 0
    assert "stepsLost" not in history[-1], "no step was ever reported: unknown, not 0"


def test_a_succeeded_job_reports_its_final_goodput_and_newest_commit() -> None:
    """Goodput is written at the final step, not left at the last throttled write, and
    ``lastCheckpoint`` is the newest commit a rank reported, not the periodic one polled
    before (issue 31, section 3)."""
    h = Harness()
    h.running()
    h.memory.next_progress_poll = None
    for rank in range(REPLICAS):
        h.sidecars.reports[f"10.0.0.{rank + 1}"] = SidecarStatus(
            state="idle", train_step=41, step_seconds=1.0, last_committed_step=40,
            trigger="periodic",
        )  # fmt: skip
    h.tick()
    assert h.kube.status["goodput"]["step"] == 41
    assert h.kube.status["lastCheckpoint"]["step"] == 40
    # The ranks train on to step 80, commit it on a manual request, and finish before the
    # next progress poll is due.
    for rank in range(REPLICAS):
        h.sidecars.reports[f"10.0.0.{rank + 1}"] = SidecarStatus(
            state="committed", step=80, train_step=80, step_seconds=1.0,
            last_committed_step=80, trigger="manual", uri="s3://bucket/tj",
        )  # fmt: skip
        pod = h.kube.pods[h.pod(0, rank)]
        pod["status"]["containerStatuses"][0]["state"] = {"terminated": {"exitCode": 0}}
    h.tick()
    status = h.kube.status
    assert status["phase"] == "Succeeded", status
    assert status["goodput"]["step"] == 80, status["goodput"]
    assert status["lastCheckpoint"]["step"] == 80
    assert status["lastCheckpoint"]["trigger"] == "manual"
