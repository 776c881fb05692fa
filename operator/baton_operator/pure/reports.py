"""What a sidecar reports (``GET /v1/status``), as data, and what the operator reads into it.

Pure: the HTTP client (``sidecars.py``) parses answers into :class:`SidecarStatus`; the state
machine (``lifecycle.py``) and the controller judge them with the functions here. Kept apart
from the client so that the pure layer never imports the code that talks to a sidecar.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from .model import LastCheckpoint
from .notices import parse_time
from .vocabulary import EMERGENCY_TRIGGERS, SaveState, Tier, Trigger

__all__ = [
    "SidecarStatus",
    "answers",
    "commit_tier",
    "committed_notice",
    "fallback_fields",
    "fallback_step",
    "loaded_step",
    "memory_commit",
    "served_notice",
]


_TIERS: Final = frozenset(Tier)


@dataclass(frozen=True, kw_only=True)
class SidecarStatus:
    """``GET /v1/status`` of one sidecar (the SDK's report, relayed)."""

    state: str
    """idle, requested, saving, committed, failed or skipped."""
    step: int | None = None
    """The step of the current request's save (when committed: the committed step)."""
    uri: str | None = None
    seconds: float | None = None
    error: str | None = None
    request_id: str | None = None
    trigger: str | None = None
    last_committed_step: int | None = None
    """The newest step this rank knows committed (periodic saves included)."""
    restored_step: int | None = None
    """The step this rank's trainer restored at start-up (SDKs before it: None)."""
    restored_tier: str | None = None
    """Where ``restored_step`` came from: ``memory`` or ``durable`` (SDKs before it: None)."""
    train_step: int | None = None
    """The last training step the rank's loop finished, as of ``heartbeat``."""
    step_seconds: float | None = None
    """The rank's measured mean wall seconds per step."""
    heartbeat: datetime | None = None
    """When the SDK last wrote its status (a step boundary, or a save's state change)."""
    tier: str | None = None
    """The tier the save of ``step`` committed to (``durable``, ``memory``,
    ``memory+promoted``); None from SDKs before tiers, which save durably only."""

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> SidecarStatus:
        """Parse the sidecar's JSON; missing optional fields become None."""

        def opt_int(key: str) -> int | None:
            value = raw.get(key)
            return None if value is None else int(value)

        seconds = raw.get("seconds")
        step_seconds = raw.get("step_seconds")
        return cls(
            state=str(raw.get("state", SaveState.IDLE)),
            step=opt_int("step"),
            uri=raw.get("uri"),
            seconds=None if seconds is None else float(seconds),
            error=raw.get("error"),
            request_id=raw.get("request_id"),
            trigger=raw.get("trigger"),
            last_committed_step=opt_int("last_committed_step"),
            restored_step=opt_int("restored_step"),
            restored_tier=raw.get("restored_tier"),
            train_step=opt_int("train_step"),
            step_seconds=None if step_seconds is None else float(step_seconds),
            heartbeat=parse_time(raw.get("heartbeat")),
            tier=_tier(raw.get("tier")),
        )

    @property
    def durable(self) -> bool:
        """Whether the save of ``step`` is in durable storage (every tier but a memory commit
        whose promotion has not committed yet)."""
        return self.tier != Tier.MEMORY

    @property
    def committed_step(self) -> int | None:
        """The newest committed step this status proves, if any."""
        steps = [s for s in (self.last_committed_step,) if s is not None]
        if self.state == SaveState.COMMITTED and self.step is not None and self.durable:
            steps.append(self.step)
        return max(steps) if steps else None


def _for_a_notice(report: SidecarStatus) -> bool:
    return report.trigger in EMERGENCY_TRIGGERS or bool(report.request_id)


def committed_notice(report: SidecarStatus | None) -> bool:
    """The rank's sidecar reported a *committed* save for a notice or a signal: the
    checkpoint holds every rank's shards, whatever exit code the trainer (or torchrun, which
    turns a worker's 75 into 1) ends with. A memory commit counts once it is promoted."""
    return (
        report is not None
        and report.state == SaveState.COMMITTED
        and report.durable
        and _for_a_notice(report)
    )


def served_notice(report: SidecarStatus | None) -> bool:
    """The rank's SDK reported serving a notice (a save for a request or a signal)."""
    return (
        report is not None
        and report.state in (SaveState.COMMITTED, SaveState.SKIPPED)
        and _for_a_notice(report)
    )


def answers(report: SidecarStatus, request_id: str) -> bool:
    """Whether a sidecar report is about the save serving this notice.

    Our request's id, or an emergency save (a signal or another notice: the SDK serves all
    pending notices with one save). A periodic save's report is never the answer, nor is a
    memory-tier commit until its promotion has committed: the pods (and their memory) are
    deleted by the restart that follows the answer, so until then the operator waits, bounded
    by the notice's deadline, as for a save still running.
    """
    if report.state in (SaveState.IDLE, SaveState.REQUESTED):
        return False
    if report.state == SaveState.COMMITTED and not report.durable:
        return False
    if request_id and report.request_id == request_id:
        return True
    return report.trigger in EMERGENCY_TRIGGERS


def memory_commit(
    reports: Sequence[SidecarStatus | None], request_ids: Sequence[str]
) -> int | None:
    """The step every rank committed to the memory tier for this notice (promoted or not), or
    None while some rank has not (or committed durably, or to another step).

    Such a commit survives the loss of any one node (every rank's snapshot is replicated to a
    peer on another node), so the operator may answer the notice by replacing only the
    noticed node's pods, whose memory goes with them, and keeping the others.
    """
    steps: set[int | None] = set()
    for rank, report in enumerate(reports):
        expected = request_ids[rank] if rank < len(request_ids) else ""
        if (
            report is None
            or report.state != SaveState.COMMITTED
            or report.tier not in (Tier.MEMORY, Tier.PROMOTED)
            or not (
                (expected and report.request_id == expected) or report.trigger in EMERGENCY_TRIGGERS
            )
        ):
            return None
        steps.add(report.step)
    if len(steps) != 1:
        return None
    return steps.pop()


def commit_tier(reports: Iterable[SidecarStatus | None], step: int) -> str | None:
    """The tier of the commit of ``step`` as the ranks report it: ``memory+promoted`` when a
    rank says so (the promotion commits the whole step), else the first tier reported for
    that step; None when no rank reports one (an SDK before tiers)."""
    tiers = [
        r.tier
        for r in reports
        if r is not None and r.tier in _TIERS and step in (r.step, r.last_committed_step)
    ]
    if Tier.PROMOTED in tiers:
        return Tier.PROMOTED.value
    return tiers[0] if tiers else None


def _tier(value: Any) -> str | None:
    return value if isinstance(value, str) and value in _TIERS else None


def fallback_step(last: LastCheckpoint | None, reports: Iterable[SidecarStatus]) -> int | None:
    """The newest step known committed: the job's ``lastCheckpoint`` or any rank's report.

    Any rank's ``committed`` proves the manifest is written (the manifest is the commit of
    every rank's shards), so this is the step a restart resumes from when a notice's own save
    did not complete; None when nothing was ever committed (start from scratch).

    A ``lastCheckpoint`` on the memory tier (a notice's recovery committed it there; its
    promotion not seen yet) counts only once a rank proves it durable: the restart that
    follows deletes every pod, and with them the snapshot's only copies.
    """
    steps = [last.step] if last is not None and last.tier != Tier.MEMORY else []
    steps.extend(s for r in reports if (s := r.committed_step) is not None)
    return max(steps) if steps else None


def fallback_fields(
    last: LastCheckpoint | None, reports: Iterable[SidecarStatus], *, uri: str, now: str
) -> tuple[int | None, dict[str, Any]]:
    """A save that did not complete: the step the restart resumes from (:func:`fallback_step`)
    and the status fields to write with it (a ``lastCheckpoint`` when a rank reported a newer
    commit than the job's status knew, or than a memory-tier ``lastCheckpoint`` that is not
    proven durable, which goes; ``now`` is its ISO completion time)."""
    best = fallback_step(last, reports)
    fields: dict[str, Any] = {}
    if last is not None and last.tier == Tier.MEMORY and best != last.step:
        fields["lastCheckpoint"] = None  # its step is in no pod's memory after the restart
    if best is not None and (last is None or best > last.step or "lastCheckpoint" in fields):
        fields["lastCheckpoint"] = LastCheckpoint(
            step=best, uri=uri, trigger=Trigger.PERIODIC.value, completed_at=now
        ).to_status()
    return best, fields


def loaded_step(reports: Iterable[SidecarStatus]) -> int | None:
    """The step an attempt's ranks restored, as their sidecars report it; None when unknown.

    The SDK reports ``restored_step`` for the life of the process. The ranks load the newest
    complete step (newer than ``BATON_RESUME_STEP`` if one committed that the operator never
    heard of, as when the operator fell back while the ranks' notice save had in fact
    committed during an API outage). An SDK without ``restored_step`` says it only until its
    first save: ``idle`` with ``last_committed_step`` set at the restore (a save one step
    after the resume could hide it). None when no rank says yet, or when the ranks that say
    disagree (then nothing is claimed).
    """
    reports = list(reports)
    steps = {r.restored_step for r in reports if r.restored_step is not None}
    if not steps:
        steps = {
            r.last_committed_step
            for r in reports
            if r.state == SaveState.IDLE and r.last_committed_step is not None
        }
    return steps.pop() if len(steps) == 1 else None
