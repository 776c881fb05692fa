"""The arithmetic of the interruption history and goodput (economics.py), without a cluster.

The reconciler's use of it (an entry appended in the restart's own write, the restart time
filled when the next attempt trains) is tested in test_reconciler_history.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from baton_operator.pure import economics
from baton_operator.pure.crd import crd_manifest
from baton_operator.pure.economics import Cause, Progress
from baton_operator.pure.reports import SidecarStatus

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)


@dataclass
class _Pod:
    body: dict[str, Any]


def _pod(*containers: dict[str, Any]) -> _Pod:
    return _Pod({"spec": {"containers": list(containers)}})


def test_progress_is_the_newest_step_any_rank_reported_and_the_median_step_time() -> None:
    reports = [
        SidecarStatus(state="idle", train_step=40, step_seconds=0.4, heartbeat=T0),
        SidecarStatus(
            state="saving", train_step=42, step_seconds=0.5, heartbeat=T0 + timedelta(seconds=3)
        ),
        SidecarStatus(state="idle", train_step=41, step_seconds=0.9, heartbeat=T0),
        SidecarStatus(state="idle"),  # an SDK that reports no progress
    ]
    p = economics.progress(reports)
    assert (p.step, p.at, p.step_seconds) == (42, T0 + timedelta(seconds=3), 0.5)
    assert economics.progress([SidecarStatus(state="idle")]) == Progress()


def test_a_committed_save_proves_its_step_though_the_train_step_beat_is_older() -> None:
    # The SDK writes train_step at most every few seconds; a rank that stopped after its
    # notice save of step 10 last beat at step 2. Its progress is step 10, not 2.
    stopped = SidecarStatus(
        state="committed", step=10, trigger="signal", train_step=2, last_committed_step=10,
        heartbeat=T0,
    )  # fmt: skip
    assert (economics.progress([stopped]).step, economics.progress([stopped]).at) == (10, T0)
    # A new attempt's idle report names the step it restored, which is not a step trained.
    restored = SidecarStatus(state="idle", last_committed_step=10, restored_step=10)
    assert economics.progress([restored]).step is None


def test_an_eviction_save_gives_its_own_notice_time_and_durability() -> None:
    # The ranks saved step 10 on a SIGTERM that no operator saw: the commit's heartbeat is when
    # it became durable, and its seconds (counted by the SDK from the notice) say when the
    # notice came.
    saved = SidecarStatus(state="committed", step=10, trigger="signal", seconds=1.5, heartbeat=T0)
    cause = economics.eviction_cause(("n1",), [SidecarStatus(state="idle"), saved], 10)
    assert (cause.source, cause.nodes) == ("eviction", ("n1",))
    assert (cause.notice_at, cause.durable_at) == (T0 - timedelta(seconds=1.5), T0)
    # Another step's commit says nothing about this one.
    assert economics.eviction_cause((), [saved], 9).notice_at is None
    assert economics.eviction_cause((), [], None).durable_at is None


def test_gpus_are_the_pods_integer_gpu_requests() -> None:
    gpu = "nvidia.com/gpu"
    pods = [
        _pod({"resources": {"requests": {gpu: "8"}, "limits": {gpu: "8"}}}, {"name": "x"}),
        _pod({"resources": {"limits": {gpu: 4}}}),  # requests default to limits
        _pod({"resources": {"requests": {"cpu": "2"}}}),
        _pod({"resources": {"limits": {gpu: "1.5"}}}),  # not an integer: not counted
    ]
    assert economics.gpus(pods) == 12
    assert economics.gpus([]) == 0


def test_an_entry_prices_the_steps_lost() -> None:
    cause = Cause(
        source="karpenter",
        nodes=("n1",),
        notice_at=T0,
        deadline=T0 + timedelta(seconds=120),
        durable_at=T0 + timedelta(seconds=9.5),
    )
    progress = Progress(step=130, at=T0 - timedelta(seconds=1), step_seconds=0.25)
    e = economics.entry(
        cause,
        attempt=3,
        resume_step=100,
        progress=progress,
        gpus=16,
        now=T0 + timedelta(seconds=10),
    )
    assert e == {
        "attempt": 3,
        "source": "karpenter",
        "nodes": ["n1"],
        "at": "2026-03-01T12:00:10Z",
        "noticeAt": "2026-03-01T12:00:00Z",
        "deadline": "2026-03-01T12:02:00Z",
        "leadSeconds": 120.0,
        "noticeToDurableSeconds": 9.5,
        "lastGoodStep": 130,
        "lastGoodStepAt": "2026-03-01T11:59:59Z",
        "resumeStep": 100,
        "stepsLost": 30,
        "stepSeconds": 0.25,
        "gpus": 16,
        "gpuSecondsLost": 30 * 0.25 * 16,
    }
    # No checkpoint yet: everything reported is lost. No step time: no price.
    bare = economics.entry(
        Cause(source="failure"),
        attempt=0,
        resume_step=None,
        progress=Progress(step=7),
        gpus=8,
        now=T0,
    )
    assert bare["stepsLost"] == 7
    assert "gpuSecondsLost" not in bare
    assert "noticeToDurableSeconds" not in bare


def test_the_history_is_bounded_to_the_newest_twenty() -> None:
    history: list[Any] = []
    for i in range(25):
        history = economics.appended(history, {"attempt": i})
    assert economics.HISTORY_LIMIT == 20
    assert [e["attempt"] for e in history] == list(range(5, 25))
    schema = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert schema["properties"]["status"]["properties"]["interruptions"]["maxItems"] == 20


def test_a_corrected_resume_step_reprices_the_interruption_that_led_to_it() -> None:
    """ResumeStepCorrected: the ranks of attempt 4 loaded step 120, not the 100 decided at
    the restart (a save that committed unseen): the entry's resumeStep, stepsLost and
    gpuSecondsLost follow, and the change goes into status.stepsLost."""
    older = {"attempt": 1, "resumeStep": 10, "stepsLost": 5}
    last = {
        "attempt": 3, "source": "aws", "lastGoodStep": 130, "resumeStep": 100, "stepsLost": 30,
        "stepSeconds": 0.25, "gpus": 16, "gpuSecondsLost": 120.0,
    }  # fmt: skip
    fixed = economics.resume_corrected([older, last], attempt=4, loaded=120)
    assert fixed is not None
    history, delta = fixed
    assert history[0] == older
    assert history[-1] == {**last, "resumeStep": 120, "stepsLost": 10, "gpuSecondsLost": 40.0}
    assert delta == -20
    assert last["resumeStep"] == 100, "the input is not changed"
    # Loaded beyond the last step seen (the poll missed the last steps): nothing lost.
    beyond = economics.resume_corrected([last], attempt=4, loaded=131)
    assert beyond is not None
    assert (beyond[0][-1]["stepsLost"], beyond[0][-1]["gpuSecondsLost"], beyond[1]) == (
        0, 0.0, -30,
    )  # fmt: skip
    # Unknown last step (no report before the interruption): the resume step only.
    bare = {"attempt": 3, "source": "failure", "resumeStep": 100}
    unknown = economics.resume_corrected([bare], attempt=4, loaded=90)
    assert unknown == ([{**bare, "resumeStep": 90}], 0)
    # Not the interruption that led to this attempt (a suspend came between), or no change.
    assert economics.resume_corrected([last], attempt=5, loaded=120) is None
    assert economics.resume_corrected([last], attempt=4, loaded=100) is None
    assert economics.resume_corrected([], attempt=4, loaded=100) is None


def test_restart_seconds_are_filled_once_by_a_later_attempt() -> None:
    history = [
        {"attempt": 2, "at": "2026-03-01T12:00:10Z", "lastGoodStepAt": "2026-03-01T12:00:00Z"}
    ]
    first = Progress(step=101, at=T0 + timedelta(seconds=75), step_seconds=0.25)
    assert economics.filled_restart(history, attempt=2, now_progress=first) is None, "same attempt"
    assert economics.filled_restart(history, attempt=3, now_progress=Progress()) is None
    filled = economics.filled_restart(history, attempt=3, now_progress=first)
    assert filled is not None
    assert filled[-1]["restartSeconds"] == 75.0
    assert economics.filled_restart(filled, attempt=3, now_progress=first) is None, "once"
    # No step was reported before the interruption: from the time it was recorded.
    unknown = [{"attempt": 0, "at": "2026-03-01T12:00:10Z"}]
    again = economics.filled_restart(unknown, attempt=1, now_progress=first)
    assert again is not None
    assert again[-1]["restartSeconds"] == 65.0


def test_goodput_is_productive_step_time_over_wall_time_less_suspended_time() -> None:
    g = economics.goodput(
        step=600,
        step_seconds=0.5,
        created=T0,
        suspended_seconds=200,
        now=T0 + timedelta(seconds=600),
    )
    assert g is not None
    assert (g.productive_seconds, g.wall_seconds) == (300.0, 400.0)
    assert g.ratio == pytest.approx(0.75)
    assert g.to_status(T0)["ratio"] == 0.75
    capped = economics.goodput(
        step=10_000,
        step_seconds=1.0,
        created=T0,
        suspended_seconds=0,
        now=T0 + timedelta(seconds=60),
    )
    assert capped is not None
    assert capped.ratio == 1.0, "a resumed job's step counts its earlier life's steps"
    assert (
        economics.goodput(
            step=None,
            step_seconds=0.5,
            created=T0,
            suspended_seconds=0,
            now=T0 + timedelta(seconds=60),
        )
        is None
    )
    assert (
        economics.goodput(
            step=5,
            step_seconds=None,
            created=T0,
            suspended_seconds=0,
            now=T0 + timedelta(seconds=60),
        )
        is None
    )


def test_a_new_attempt_is_polled_eagerly_until_its_step_time_and_restart_are_known() -> None:
    pending = [{"attempt": 0, "at": "2026-03-01T12:00:00Z"}]
    filled = [{**pending[0], "restartSeconds": 30.0}]
    started = T0
    soon = T0 + timedelta(seconds=10)
    known = Progress(step=12, at=soon, step_seconds=0.3)

    def eager(history: list[Any], progress: Progress, now: datetime = soon) -> bool:
        return economics.eager(history, attempt=1, now_progress=progress, started=started, now=now)

    assert eager(pending, known), "the restart time is still to fill"
    assert eager(filled, Progress(step=11, at=soon)), "no step time yet"
    assert not eager(filled, known), "both known: back to the progress period"
    assert not eager([], known)
    late = T0 + timedelta(seconds=economics.EAGER_SECONDS + 1)
    assert not eager(pending, Progress(), late), "bounded: an SDK that never reports"
