"""What interruptions cost a job: its interruption history and its goodput.

Pure. The controller records one :class:`Cause` per interruption (a notice-driven preemption,
a node lost without notice, a failure restart) when it decides the restart, and this module
turns it, with the sidecars' last reports, into the entry appended to
``status.interruptions`` (newest :data:`HISTORY_LIMIT`). Every number comes from what the
ranks reported (``train_step``, ``step_seconds`` and the heartbeat time of the SDK's status,
relayed by the sidecars) and the notice record already in status; docs/operator.md says
which are estimates:

- ``stepsLost`` is the last step any rank reported minus the step the next attempt resumes
  from. The SDK refreshes ``train_step`` with its heartbeat (every few seconds) and the
  operator polls every few seconds, so it can miss the last few steps: a lower bound.
- ``gpuSecondsLost`` prices those steps at the measured mean step time and the attempt's GPUs
  (its pods' integer ``nvidia.com/gpu`` requests; 0 without GPUs).
- ``restartSeconds`` runs from the last good step's report to the first step the new
  attempt's sidecars report, so it includes the save, the pods' start and the restore.

Goodput is productive step time over wall time: the job's current step (every step up to it
was trained once and kept; recomputed steps are not counted twice) times the measured step
time, over the time since the job was created less the time it spent suspended.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final

from .crd import GPU_RESOURCE, HISTORY_LIMIT
from .jobstatus import iso
from .notices import parse_time
from .reports import SidecarStatus
from .vocabulary import InterruptionSource, SaveState

__all__ = [
    "EAGER_SECONDS",
    "GOODPUT_WRITE_SECONDS",
    "HISTORY_LIMIT",
    "Cause",
    "Goodput",
    "Progress",
    "appended",
    "eager",
    "entry",
    "filled_restart",
    "goodput",
    "gpus",
    "progress",
    "resume_corrected",
]

EAGER_SECONDS: Final = 120.0
"""Seconds from an attempt's start during which its first progress reports are polled every
tick (an attempt's pods usually start and restore well within it)."""
GOODPUT_WRITE_SECONDS: Final = 30.0
"""Seconds between writes of ``status.goodput`` while a job trains (the gauge follows every
poll; the status need not cost a write every few seconds per job)."""


@dataclass(frozen=True, kw_only=True)
class Cause:
    """Why an attempt ended, as the controller knows it when it decides the restart."""

    source: str
    """The notice's source (``aws``, ``karpenter``, ``gke``, ``disruption-target``...), or
    ``node-lost`` (a node gone without notice), ``eviction`` (a rank saved on its own after
    a SIGTERM or a notice its sidecar saw), or ``failure``."""
    nodes: tuple[str, ...] = ()
    notice_at: datetime | None = None
    """When the operator received the notice (None without one)."""
    deadline: datetime | None = None
    """The notice's deadline, as clamped when it was recorded."""
    durable_at: datetime | None = None
    """When every rank's save for the notice was seen committed (None: it was not)."""


def eviction_cause(
    nodes: Sequence[str], reports: Iterable[SidecarStatus], step: int | None
) -> Cause:
    """The cause of an attempt whose ranks saved ``step`` on their own (a SIGTERM, or a notice
    a sidecar saw) without the operator serving a notice: its notice time and durability are
    the ranks' own, from a report of that save committed (its heartbeat at the commit, less
    the save's seconds, which the SDK counts from the notice); None without such a report."""
    saved = next(
        (
            r for r in reports
            if step is not None and r.state == SaveState.COMMITTED and r.step == step
            and r.heartbeat is not None and r.seconds is not None
        ),
        None,
    )  # fmt: skip
    if saved is None or saved.heartbeat is None or saved.seconds is None:
        return Cause(source=InterruptionSource.EVICTION, nodes=tuple(nodes))
    return Cause(
        source=InterruptionSource.EVICTION, nodes=tuple(nodes),
        notice_at=saved.heartbeat - timedelta(seconds=saved.seconds),
        durable_at=saved.heartbeat,
    )  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Progress:
    """How far an attempt's ranks got, from their sidecars' last reports."""

    step: int | None = None
    """The last training step any rank reported."""
    at: datetime | None = None
    """When that rank reported it (its heartbeat)."""
    step_seconds: float | None = None
    """The median of the ranks' measured mean step times."""


def progress(reports: Iterable[SidecarStatus]) -> Progress:
    """The newest training step the reports show, when, and the step time they measured.

    A rank's step is its ``train_step`` or, when newer, the step of the save it reports
    committed: the SDK writes ``train_step`` at most every few seconds, but a save of step S
    comes after step S (a rank that stopped after its notice save reports the save's step, not
    an older beat). ``last_committed_step`` alone does not count: a new attempt reports the step
    it restored there before it trains one (its first step starts the restart clock).
    """
    latest: tuple[int, SidecarStatus] | None = None
    times: list[float] = []
    for r in reports:
        if r.step_seconds is not None and r.step_seconds > 0:
            times.append(r.step_seconds)
        saved = r.step if r.state == SaveState.COMMITTED else None
        known = [s for s in (r.train_step, saved) if s is not None]
        if not known:
            continue
        step = max(known)
        if latest is None or step > latest[0]:
            latest = (step, r)
    return Progress(
        step=None if latest is None else latest[0],
        at=None if latest is None else latest[1].heartbeat,
        step_seconds=statistics.median(times) if times else None,
    )


def gpus(pods: Iterable[Any]) -> int:
    """The GPUs of an attempt: the sum of its pods' integer ``nvidia.com/gpu`` requests
    (limits where a container has no request: the API server copies them for extended
    resources). Takes anything with a ``body`` (a ``PodView``); a non-integer quantity,
    which the CRD refuses anyway, counts 0."""
    total = 0
    for pod in pods:
        spec: Mapping[str, Any] = (pod.body or {}).get("spec") or {}
        for c in spec.get("containers") or []:
            res: Mapping[str, Any] = c.get("resources") or {}
            value = (res.get("requests") or {}).get(GPU_RESOURCE)
            if value is None:
                value = (res.get("limits") or {}).get(GPU_RESOURCE)
            try:
                total += max(0, int(str(value))) if value is not None else 0
            except ValueError:
                continue
    return total


def _seconds(later: datetime | None, earlier: datetime | None) -> float | None:
    if later is None or earlier is None:
        return None
    return round((later - earlier).total_seconds(), 3)


def entry(
    cause: Cause,
    *,
    attempt: int,
    resume_step: int | None,
    progress: Progress,
    gpus: int,
    now: datetime,
) -> dict[str, Any]:
    """The ``status.interruptions`` entry of one interruption of ``attempt``."""
    resume = resume_step or 0
    lost = None if progress.step is None else max(0, progress.step - resume)
    gpu_seconds = (
        None
        if lost is None or progress.step_seconds is None
        else round(lost * progress.step_seconds * gpus, 3)
    )
    record = {
        "attempt": attempt,
        "source": cause.source,
        "nodes": list(cause.nodes),
        "at": iso(now),
        "noticeAt": None if cause.notice_at is None else iso(cause.notice_at),
        "deadline": None if cause.deadline is None else iso(cause.deadline),
        "leadSeconds": _seconds(cause.deadline, cause.notice_at),
        "noticeToDurableSeconds": _seconds(cause.durable_at, cause.notice_at),
        "lastGoodStep": progress.step,
        "lastGoodStepAt": None if progress.at is None else iso(progress.at),
        "resumeStep": resume_step,
        "stepsLost": lost,
        "stepSeconds": progress.step_seconds,
        "gpus": gpus,
        "gpuSecondsLost": gpu_seconds,
    }
    # Unknown values are left out (a structural schema prunes nulls anyway); restartSeconds
    # is added by filled_restart once the next attempt trains.
    return {k: v for k, v in record.items() if v is not None}


def appended(history: Sequence[Mapping[str, Any]], new: Mapping[str, Any]) -> list[Any]:
    """``history`` with ``new`` at the end, the oldest dropped beyond :data:`HISTORY_LIMIT`."""
    out = [dict(e) for e in history]
    out.append(dict(new))
    return out[-HISTORY_LIMIT:]


def filled_restart(
    history: Sequence[Mapping[str, Any]], *, attempt: int, now_progress: Progress
) -> list[Any] | None:
    """The history with the newest entry's ``restartSeconds`` filled, once ``attempt`` (a
    later one) reported its first training step; None when there is nothing to fill.

    Measured from the entry's ``lastGoodStepAt`` (from its ``at`` when no step was reported
    before the interruption) to the heartbeat of the new attempt's first reported step.
    """
    if not history or now_progress.step is None or now_progress.at is None:
        return None
    last = history[-1]
    if last.get("restartSeconds") is not None or int(last.get("attempt", attempt)) >= attempt:
        return None
    start = parse_time(last.get("lastGoodStepAt")) or parse_time(last.get("at"))
    if start is None:
        return None
    out = [dict(e) for e in history]
    out[-1]["restartSeconds"] = max(0.0, round((now_progress.at - start).total_seconds(), 3))
    return out


def resume_corrected(
    history: Sequence[Mapping[str, Any]], *, attempt: int, loaded: int
) -> tuple[list[Any], int] | None:
    """The history with the newest entry made to say that ``attempt`` resumed from
    ``loaded`` (the step its ranks restored: ``ResumeStepCorrected``), and the change of its
    ``stepsLost`` (to add to ``status.stepsLost``); None when the newest entry is not the
    interruption that ended the attempt before ``attempt``, or already says ``loaded``.

    ``stepsLost`` and ``gpuSecondsLost`` follow from the entry's own ``lastGoodStep``,
    ``stepSeconds`` and ``gpus`` (left out, as before, when those are unknown).
    """
    if not history:
        return None
    last = history[-1]
    if int(last.get("attempt", -1)) != attempt - 1 or last.get("resumeStep") == loaded:
        return None
    fixed = dict(last)
    fixed["resumeStep"] = loaded
    before = int(last.get("stepsLost") or 0)
    good = last.get("lastGoodStep")
    if good is None:
        fixed.pop("stepsLost", None)
        fixed.pop("gpuSecondsLost", None)
    else:
        lost = max(0, int(good) - loaded)
        fixed["stepsLost"] = lost
        step_seconds = last.get("stepSeconds")
        if step_seconds is not None:
            gpus = int(last.get("gpus") or 0)
            fixed["gpuSecondsLost"] = round(lost * float(step_seconds) * gpus, 3)
    out = [dict(e) for e in history[:-1]]
    out.append(fixed)
    return out, int(fixed.get("stepsLost") or 0) - before


def eager(
    history: Sequence[Mapping[str, Any]],
    *,
    attempt: int,
    now_progress: Progress,
    started: datetime | None,
    now: datetime,
) -> bool:
    """Whether to poll the sidecars every tick rather than every progress period: in the
    first :data:`EAGER_SECONDS` of an attempt, until its step time is known and the last
    interruption's restart time is filled (the SDK writes its first two steps at once)."""
    if started is None or (now - started).total_seconds() > EAGER_SECONDS:
        return False
    pending = bool(history) and (
        history[-1].get("restartSeconds") is None
        and int(history[-1].get("attempt", attempt)) < attempt
    )
    return pending or now_progress.step_seconds is None


@dataclass(frozen=True, kw_only=True)
class Goodput:
    """Goodput and its inputs (``status.goodput``)."""

    ratio: float
    productive_seconds: float
    wall_seconds: float
    step: int
    step_seconds: float
    suspended_seconds: float

    def to_status(self, now: datetime) -> dict[str, Any]:
        return {
            "ratio": round(self.ratio, 4),
            "productiveSeconds": round(self.productive_seconds, 1),
            "wallSeconds": round(self.wall_seconds, 1),
            "step": self.step,
            "stepSeconds": self.step_seconds,
            "suspendedSeconds": round(self.suspended_seconds, 1),
            "updatedAt": iso(now),
        }


def goodput(
    *,
    step: int | None,
    step_seconds: float | None,
    created: datetime | None,
    suspended_seconds: float,
    now: datetime,
) -> Goodput | None:
    """``step x step_seconds / (now - created - suspended_seconds)``, capped at 1; None while
    an input is unknown (no step reported yet, or no step time measured)."""
    if step is None or step_seconds is None or created is None or step_seconds <= 0:
        return None
    wall = (now - created).total_seconds() - max(0.0, suspended_seconds)
    if wall <= 0:
        return None
    productive = step * step_seconds
    return Goodput(
        ratio=min(1.0, productive / wall), productive_seconds=productive, wall_seconds=wall,
        step=step, step_seconds=step_seconds, suspended_seconds=max(0.0, suspended_seconds),
    )  # fmt: skip
