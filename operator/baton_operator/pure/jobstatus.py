"""A TrainingJob's ``status`` as a typed value, and the one way a status write is built.

Pure. :class:`JobStatus` is parsed once per tick from the job the API server returned, so the
controller reads ``status.attempt`` instead of ``int(status.get("attempt", 0))``. Every write
is a :class:`StatusPatch`: fields to merge, conditions to set (each keeps its
``lastTransitionTime`` unless its value changes) and at most one phase change, which goes
through :func:`lifecycle.check_transition`, so an illegal change is a bug that is caught, not
a state that is written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from .lifecycle import Phase, check_transition
from .model import LastCheckpoint
from .notices import parse_time

__all__ = ["NO_NOTICE_REASON", "JobStatus", "NoticeRecord", "StatusPatch", "iso", "set_condition"]

NO_NOTICE_REASON: Final = (
    "checkpoint before the job moves: it is Checkpointing with no notice recorded in its status"
)
"""A checkpoint request's reason when ``status.notice`` records neither source nor reason
(or is empty: a status edited by hand or written by an older operator); the SDK logs the
reason of the control request it serves."""


def iso(t: datetime) -> str:
    """RFC 3339 in UTC, to the second, as status timestamps are written."""
    return t.astimezone(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


@dataclass(frozen=True, kw_only=True)
class NoticeRecord:
    """``status.notice``: the notice being served while the job is Checkpointing."""

    source: str | None = None
    nodes: tuple[str, ...] = ()
    reason: str | None = None
    deadline: datetime | None = None
    """When the save must be committed (already clamped when it was written)."""
    received_at: datetime | None = None
    requested_at: datetime | None = None
    """When the sidecars were asked (None: not yet; a restarted operator asks then)."""
    request_ids: tuple[str, ...] = ()
    """Each rank's request id, by rank ("" where the request failed)."""

    @classmethod
    def from_status(cls, raw: Mapping[str, Any] | None) -> NoticeRecord | None:
        """Parse ``status.notice``; None when there is none."""
        if not raw:
            return None
        return cls(
            source=raw.get("source"),
            nodes=tuple(str(n) for n in raw.get("nodes") or []),
            reason=raw.get("reason"),
            deadline=parse_time(raw.get("deadline")),
            received_at=parse_time(raw.get("receivedAt")),
            requested_at=parse_time(raw.get("requestedAt")),
            request_ids=tuple(str(i) for i in raw.get("requestIds") or []),
        )

    @staticmethod
    def render(
        *, source: str, nodes: Sequence[str], reason: str, deadline: datetime, received_at: datetime
    ) -> dict[str, Any]:
        """``status.notice`` as it is first written, when a notice's (or a suspend's) save
        begins; :meth:`from_status` reads it back. ``deadline`` is already clamped
        (``lifecycle.clamp_deadline``); ``requestedAt`` and ``requestIds`` come later, with
        the requests."""
        return {
            "source": source,
            "nodes": list(nodes),
            "reason": reason,
            "deadline": iso(deadline),
            "receivedAt": iso(received_at),
        }

    def describe(self) -> str:
        """``source: reason``, as a checkpoint request's reason (the trainer logs it): the
        parts recorded, or :data:`NO_NOTICE_REASON` when neither is."""
        return ": ".join(part for part in (self.source, self.reason) if part) or NO_NOTICE_REASON


@dataclass(frozen=True, kw_only=True)
class JobStatus:
    """The parts of ``status`` the operator acts on (docs/operator.md lists every field)."""

    phase: Phase | None = None
    """None: the operator has not started the job yet."""
    attempt: int = 0
    replicas: int | None = None
    """The current attempt's replicas (an elastic shrink makes it less than the spec's)."""
    preemptions: int = 0
    failures: int = 0
    resumed_from_step: int | None = None
    last_checkpoint: LastCheckpoint | None = None
    avoid_nodes: tuple[str, ...] = ()
    master_addr: str | None = None
    """Rank 0's pod IP, written once every pod of the attempt was created."""
    notice: NoticeRecord | None = None
    restart_after: datetime | None = None
    unschedulable_since: datetime | None = None
    conditions: tuple[Mapping[str, Any], ...] = ()
    resource_version: str | None = None
    """``metadata.resourceVersion`` of the object this was read from (guards writes)."""

    @classmethod
    def from_body(cls, job: Mapping[str, Any]) -> JobStatus:
        """Parse a TrainingJob object's status (as the API returns it)."""
        raw: Mapping[str, Any] = job.get("status") or {}
        meta: Mapping[str, Any] = job.get("metadata") or {}
        phase = raw.get("phase")
        version = meta.get("resourceVersion")
        return cls(
            phase=Phase(phase) if phase else None,
            attempt=int(raw.get("attempt", 0)),
            replicas=_opt_int(raw.get("replicas")),
            preemptions=int(raw.get("preemptions", 0)),
            failures=int(raw.get("failures", 0)),
            resumed_from_step=_opt_int(raw.get("resumedFromStep")),
            last_checkpoint=LastCheckpoint.from_status(raw.get("lastCheckpoint")),
            avoid_nodes=tuple(str(n) for n in raw.get("avoidNodes") or []),
            master_addr=raw.get("masterAddr") or None,
            notice=NoticeRecord.from_status(raw.get("notice")),
            restart_after=parse_time(raw.get("restartAfter")),
            unschedulable_since=parse_time(raw.get("unschedulableSince")),
            conditions=tuple(raw.get("conditions") or ()),
            resource_version=None if version is None else str(version),
        )

    def replicas_or(self, spec_replicas: int) -> int:
        """The current attempt's replicas; the spec's before the first attempt."""
        return self.replicas or spec_replicas

    @property
    def resume_step(self) -> int | None:
        """The step a restart resumes from when it learns nothing newer: the last commit."""
        return None if self.last_checkpoint is None else self.last_checkpoint.step


def set_condition(
    conditions: Sequence[Mapping[str, Any]],
    ctype: str,
    status: bool,
    reason: str,
    message: str,
    *,
    now: datetime,
    generation: int,
) -> list[dict[str, Any]]:
    """``conditions`` with ``ctype`` set; its ``lastTransitionTime`` moves only on a change."""
    value = "True" if status else "False"
    out = [dict(c) for c in conditions if c.get("type") != ctype]
    old = next((c for c in conditions if c.get("type") == ctype), None)
    changed = old is None or old.get("status") != value
    out.append(
        {
            "type": ctype,
            "status": value,
            "reason": reason,
            "message": message,
            "lastTransitionTime": iso(now)
            if changed or old is None
            else old.get("lastTransitionTime"),
            "observedGeneration": generation,
        }
    )
    return sorted(out, key=lambda c: str(c["type"]))


class StatusPatch:
    """One merge patch of ``status``, built against the status it changes.

    ``phase()`` is the only way to change the phase (it checks the transition); ``condition()``
    sets a condition on top of the status's own; ``render()`` gives the patch body, with
    ``observedGeneration``.
    """

    def __init__(self, status: JobStatus, *, now: datetime, generation: int) -> None:
        self._status = status
        self._now = now
        self._generation = generation
        self._fields: dict[str, Any] = {}
        self._conditions: list[dict[str, Any]] | None = None

    @property
    def new_phase(self) -> Phase | None:
        """The phase this patch moves to (None: it leaves the phase alone)."""
        value = self._fields.get("phase")
        return None if value is None else Phase(value)

    def phase(self, new: Phase) -> StatusPatch:
        """Change the phase; ValueError when the state machine does not allow it."""
        check_transition(self._status.phase, new)
        self._fields["phase"] = new.value
        return self

    def set(self, fields: Mapping[str, Any]) -> StatusPatch:
        """Merge ``fields`` (camelCase status keys; None deletes a key)."""
        for reserved, method in (("phase", "phase"), ("conditions", "condition")):
            if reserved in fields:
                raise ValueError(f"set {reserved!r} with StatusPatch.{method}()")
        self._fields.update(fields)
        return self

    def condition(self, ctype: str, value: bool, reason: str, message: str) -> StatusPatch:
        """Set one condition (on top of those already set in this patch); a true one's reason
        becomes ``status.reason``, the job's REASON column."""
        if value:
            self._fields["reason"] = reason
        base = self._status.conditions if self._conditions is None else self._conditions
        self._conditions = set_condition(
            base, ctype, value, reason, message, now=self._now, generation=self._generation
        )
        return self

    def render(self) -> dict[str, Any]:
        """The body under ``status`` of the merge patch."""
        out = dict(self._fields)
        if self._conditions is not None:
            out["conditions"] = self._conditions
        out.setdefault("observedGeneration", self._generation)
        return out
