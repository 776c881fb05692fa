"""The control channel between the sidecar and the SDK: two small JSON files in a shared directory.

The sidecar (or anything else that wants a checkpoint) writes ``request.json``; the SDK polls it at
step boundaries, takes the request and reports progress in ``status.json``, which the sidecar
reads. The directory is an ``emptyDir`` mounted in both containers (``$BATON_CONTROL_DIR``), so
plain files are the whole protocol: no sockets, no shared process namespace, and it works the
same way without Kubernetes. The values written in these files (states, triggers, tiers, save
phases, liveness, exit codes) are defined in :mod:`trainer_sdk.wire` and re-exported here, so
``control.State`` and the like keep working. (Why one module of this size: it is the whole file
protocol with the sidecar, both sides' reading and writing of it, in the module the sidecar
imports for it.)

Rules that keep the two sides honest:

* Every file is written atomically: a temp file in the same directory, fsync, ``os.replace``,
  then an fsync of the directory. A reader sees the old file or the new one, never half a file.
* Only one request is pending at a time. A second one is *merged* into it (the earliest deadline
  wins and the id stays the same), so a burst of notices never queues several saves.
* Request updates (merge, clear) are read-modify-write cycles by two processes, so they hold an
  ``flock`` on ``.lock`` in the directory. Without it the SDK could clear a request just
  before the sidecar writes the merged copy back, and the same request would be served twice.
* Reads are tolerant: unknown fields are ignored (a newer writer may add some) and optional
  fields may be absent. A file that is not valid JSON or carries a wrong type raises
  :class:`ControlFormatError`, which names the file.

How the SDK reports a save in ``status.json`` (the sidecar's metrics rely on it):

1. ``idle`` at start-up; ``last_committed_step`` is set after a restore and after every commit.
2. For a save it reports: ``requested`` (for a request: ranks agreeing on the step), then
   ``saving``, then exactly one of ``committed``, ``failed`` or ``skipped`` with ``seconds``,
   ``phases``, ``bytes``, ``trigger`` and ``deadline`` describing *that* save.
3. The final state stays until the next reported save starts; in between only ``heartbeat``
   is refreshed. The sidecar counts each new final state once (by state, request id, step and
   ``updated``), so a heartbeat never counts as a second save.

Several processes per pod (``torchrun --nproc-per-node N``) share one directory. Each local
rank writes its own status file: ``status.json`` for ``LOCAL_RANK=0`` (the same file as with one
process), ``status.local-<k>.json`` for the others, each naming ``local_rank`` and
``local_world_size``. :meth:`ControlChannel.read_status` folds them into one status for the
whole pod (:func:`aggregate`): ``committed`` (or ``skipped``) only when every local rank reports
that final state for the same save, ``failed`` as soon as one local rank failed, otherwise the
least advanced state; the heartbeat is the oldest, so one silent process makes the pod silent.
Only ``LOCAL_RANK=0`` takes requests: the ranks' per-step agreement carries a request to every
rank of the job.

This module must stay torch-free: the sidecar imports it and must stay small.

Who calls what:

* sidecar: :meth:`ControlChannel.merge_request`, :meth:`ControlChannel.read_status`,
  :func:`trainer_liveness`;
* SDK (``LOCAL_RANK=0``): :meth:`ControlChannel.read_request` at step boundaries,
  :meth:`ControlChannel.clear_request` once it has taken the request;
* SDK (every local rank): :meth:`ControlChannel.write_status` on each transition and as a
  heartbeat, to its own file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import re
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from trainer_sdk.wire import (
    EXIT_RESTART_IN_PLACE,
    EXIT_STOPPED_AFTER_NOTICE,
    ROUTINE_TRIGGERS,
    Liveness,
    SavePhase,
    State,
    Tier,
    Trigger,
)

__all__ = [
    "EXIT_RESTART_IN_PLACE",
    "EXIT_STOPPED_AFTER_NOTICE",
    "LOCK_FILE",
    "REQUEST_FILE",
    "ROUTINE_TRIGGERS",
    "STATUS_FILE",
    "ControlChannel",
    "ControlError",
    "ControlFormatError",
    "Liveness",
    "Request",
    "SavePhase",
    "State",
    "Status",
    "Tier",
    "Trigger",
    "aggregate",
    "format_rfc3339",
    "local_status_file",
    "parse_rfc3339",
    "trainer_liveness",
    "utcnow",
]

REQUEST_FILE: Final = "request.json"
STATUS_FILE: Final = "status.json"
"""Local rank 0's status; with one process per pod, the only one."""
_LOCAL_STATUS: Final = "status.local-{}.json"
LOCK_FILE: Final = ".lock"

# Both containers may run as different users that share only the volume's group, so the files
# are world-readable (they hold no secrets) and the lock file is world-writable.
_FILE_MODE: Final = 0o644
_LOCK_MODE: Final = 0o666

# RFC 3339 section 5.6 date-time: a full date, 'T', a full time, and a zone that is 'Z' or an
# offset. datetime.fromisoformat alone also accepts dates without a time or a zone.
_RFC3339 = re.compile(
    r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$",
)


class ControlError(Exception):
    """Base class for control-channel errors."""


class ControlFormatError(ControlError):
    """A control file or value is not in the documented format."""


def utcnow() -> datetime:
    """The current time as an aware UTC datetime."""
    return datetime.now(UTC)


def format_rfc3339(value: datetime) -> str:
    """Format an aware datetime as RFC 3339 in UTC with millisecond precision (``...Z``)."""
    if value.tzinfo is None:
        raise ControlFormatError(
            f"datetime {value!r} has no time zone: pass an aware datetime (tzinfo=UTC)"
        )
    text = value.astimezone(UTC).isoformat(timespec="milliseconds")
    return text.removesuffix("+00:00") + "Z"


def parse_rfc3339(text: str) -> datetime:
    """Parse an RFC 3339 date-time (``2026-01-02T03:04:05Z`` or with an offset) to aware UTC."""
    if not isinstance(text, str) or not _RFC3339.match(text):
        raise ControlFormatError(
            f"{text!r} is not an RFC 3339 date-time: write it like '2026-01-02T03:04:05Z' "
            "or '2026-01-02T03:04:05+01:00' (a time zone is required)"
        )
    try:
        value = datetime.fromisoformat(text.upper())
    except ValueError as e:
        raise ControlFormatError(f"{text!r} is not a valid date-time: {e}") from e
    return value.astimezone(UTC)


def _new_id() -> str:
    return uuid.uuid4().hex


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Request:
    """A pending checkpoint request (``request.json``)."""

    id: str = dataclasses.field(default_factory=_new_id)
    """Stays the same when later requests are merged into this one."""
    deadline: datetime | None = None
    """When the checkpoint must be committed by; ``None`` means as soon as convenient."""
    reason: str = ""
    """Free text for people, e.g. the notice that caused the request."""
    source: str = "operator"
    """Who asked: ``operator``, ``aws``, ``gce``, ``azure`` or a tool's name."""
    created: datetime = dataclasses.field(default_factory=utcnow)
    """When the first request of a merged group was made."""

    def __post_init__(self) -> None:
        if not self.id:
            raise ControlFormatError("request id is empty: leave it out to get a fresh one")
        for name in ("deadline", "created"):
            value = getattr(self, name)
            if value is not None and value.tzinfo is None:
                raise ControlFormatError(
                    f"request {name} {value!r} has no time zone: use an aware datetime"
                )

    def to_json(self) -> dict[str, Any]:
        """The JSON object written to ``request.json``."""
        return {
            "id": self.id,
            "deadline": None if self.deadline is None else format_rfc3339(self.deadline),
            "reason": self.reason,
            "source": self.source,
            "created": format_rfc3339(self.created),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Request:
        """Read a request object; unknown fields are ignored."""
        if not isinstance(data, Mapping):
            raise ControlFormatError(f"a request must be a JSON object, got {type(data).__name__}")
        request_id = _get(data, "id", str)
        if request_id is None:
            raise ControlFormatError("request has no 'id': every request needs a string id")
        created = _get_time(data, "created")
        return cls(
            id=request_id,
            deadline=_get_time(data, "deadline"),
            reason=_get(data, "reason", str) or "",
            source=_get(data, "source", str) or "operator",
            created=created if created is not None else utcnow(),
        )

    def merged_with(self, other: Request) -> Request:
        """This request with ``other`` folded in: the earliest deadline wins, the id stays.

        ``None`` (no deadline) counts as later than any time. The reason and source follow the
        deadline that wins, so that the pending request says why it is as urgent as it is.
        """
        if other.deadline is not None and (self.deadline is None or other.deadline < self.deadline):
            return dataclasses.replace(
                self, deadline=other.deadline, reason=other.reason, source=other.source
            )
        return self


def local_status_file(local_rank: int) -> str:
    """The status file of one local rank: ``status.json`` for 0, else ``status.local-<k>.json``."""
    if local_rank < 0:
        raise ControlFormatError(f"local rank {local_rank} is negative: check $LOCAL_RANK")
    return STATUS_FILE if local_rank == 0 else _LOCAL_STATUS.format(local_rank)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Status:
    """What the SDK reports: one file per local rank, folded into one by :func:`aggregate`."""

    state: State = State.IDLE
    """See :class:`State`."""
    request_id: str | None = None
    """The id of the request being served or last served; ``None`` for periodic saves."""
    step: int | None = None
    """The step being saved or last saved."""
    uri: str | None = None
    """Where the checkpoint of ``step`` lives (its step directory)."""
    seconds: float | None = None
    """Wall time of the last save, from the agreed step to the commit."""
    error: str | None = None
    """Why the last save failed or was skipped."""
    trigger: str | None = None
    """What caused the last save: a :class:`Trigger` value (or a caller's own word)."""
    deadline: datetime | None = None
    """The deadline of the request being served, if it had one."""
    phases: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """Seconds per phase of the last save, keyed by :class:`SavePhase` values."""
    bytes: int | None = None
    """Bytes the last save wrote (all ranks together, as far as rank 0 knows)."""
    last_committed_step: int | None = None
    """The newest step known to be committed, whatever the state is now."""
    restored_step: int | None = None
    """The step this process restored at start-up (from either tier), kept for its whole
    life: the operator checks the attempt's resume step against it whenever it polls, also
    after the first save (``None``: it started from scratch, or has not restored yet)."""
    train_step: int | None = None
    """The last training step the loop finished, as of ``heartbeat`` (the operator's count of
    steps an interruption lost; refreshed with the heartbeat, so it may lag a few seconds)."""
    step_seconds: float | None = None
    """Mean wall seconds per training step since the first step this process reported (saves
    in between included): the operator's estimate of what a lost step cost."""
    tier: str | None = None
    """The :class:`Tier` the save of ``step`` committed to (``None`` before a commit, or from
    an SDK before tiers): ``durable``, ``memory`` (a notice committed to the replicated memory
    tier; its promotion runs in the background) or ``memory+promoted`` (that promotion
    committed too)."""
    restored_tier: str | None = None
    """The :class:`Tier` ``restored_step`` was loaded from (``durable`` or ``memory``)."""
    updated: datetime = dataclasses.field(default_factory=utcnow)
    """When ``state`` last changed."""
    pid: int = dataclasses.field(default_factory=os.getpid)
    """The writer's process id (for people; PID namespaces differ between containers)."""
    heartbeat: datetime = dataclasses.field(default_factory=utcnow)
    """Refreshed at step boundaries, so that the sidecar can tell a silent or dead trainer."""
    local_rank: int = 0
    """The writer's ``LOCAL_RANK``."""
    local_world_size: int = 1
    """The writer's ``LOCAL_WORLD_SIZE``: how many status files make up the pod's status."""
    ranks: tuple[Mapping[str, Any], ...] = ()
    """Filled in by :func:`aggregate` only: each local rank's ``local_rank``, ``state``,
    ``step``, ``trigger``, ``error`` and ``heartbeat`` (``state`` ``absent`` if it has not
    written a status yet)."""

    def __post_init__(self) -> None:
        # Accept the state as a plain string too, so that callers may write state="saving".
        object.__setattr__(self, "state", _state(self.state))

    def to_json(self) -> dict[str, Any]:
        """The JSON object written to ``status.json``."""
        return {
            "state": self.state.value,
            "request_id": self.request_id,
            "step": self.step,
            "uri": self.uri,
            "seconds": self.seconds,
            "error": self.error,
            "trigger": self.trigger,
            "deadline": None if self.deadline is None else format_rfc3339(self.deadline),
            "phases": {str(k): float(v) for k, v in self.phases.items()},
            "bytes": self.bytes,
            "last_committed_step": self.last_committed_step,
            "restored_step": self.restored_step,
            "train_step": self.train_step,
            "step_seconds": self.step_seconds,
            "tier": self.tier,
            "restored_tier": self.restored_tier,
            "updated": format_rfc3339(self.updated),
            "pid": self.pid,
            "heartbeat": format_rfc3339(self.heartbeat),
            "local_rank": self.local_rank,
            "local_world_size": self.local_world_size,
            "ranks": [dict(r) for r in self.ranks],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Status:
        """Read a status object; unknown fields are ignored, missing ones take defaults."""
        if not isinstance(data, Mapping):
            raise ControlFormatError(f"a status must be a JSON object, got {type(data).__name__}")
        raw_phases = data.get("phases") or {}
        if not isinstance(raw_phases, Mapping) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in raw_phases.values()
        ):
            raise ControlFormatError(
                f"status 'phases' must map phase names to seconds, got {raw_phases!r}"
            )
        updated = _get_time(data, "updated")
        heartbeat = _get_time(data, "heartbeat")
        # A status without a heartbeat counts as beating when it was last updated.
        heartbeat = heartbeat if heartbeat is not None else updated
        now = utcnow()
        seconds = _get(data, "seconds", float)
        step_seconds = _get(data, "step_seconds", float)
        return cls(
            state=_state(data.get("state", State.IDLE.value)),
            request_id=_get(data, "request_id", str),
            step=_get(data, "step", int),
            uri=_get(data, "uri", str),
            seconds=None if seconds is None else float(seconds),
            error=_get(data, "error", str),
            trigger=_get(data, "trigger", str),
            deadline=_get_time(data, "deadline"),
            phases={str(k): float(v) for k, v in raw_phases.items()},
            bytes=_get(data, "bytes", int),
            last_committed_step=_get(data, "last_committed_step", int),
            restored_step=_get(data, "restored_step", int),
            train_step=_get(data, "train_step", int),
            step_seconds=None if step_seconds is None else float(step_seconds),
            tier=_get(data, "tier", str),
            restored_tier=_get(data, "restored_tier", str),
            updated=updated if updated is not None else now,
            pid=_get(data, "pid", int) or 0,
            heartbeat=heartbeat if heartbeat is not None else now,
            local_rank=_get(data, "local_rank", int) or 0,
            local_world_size=max(_get(data, "local_world_size", int) or 1, 1),
            ranks=tuple(_get_ranks(data)),
        )

    def beat(self, now: datetime | None = None) -> Status:
        """This status with a fresh heartbeat (the state and its ``updated`` time unchanged)."""
        return dataclasses.replace(self, heartbeat=now or utcnow(), pid=os.getpid())


def trainer_liveness(
    status: Status | None,
    *,
    now: datetime | None = None,
    silent_after: float = 60.0,
    absent_after: float = 300.0,
) -> Liveness:
    """Classify the trainer from its heartbeat age.

    ``absent``: no status file, or no heartbeat for ``absent_after`` seconds; ``silent``: no
    heartbeat for ``silent_after`` seconds (a long step, a hang, or a stopped process); otherwise
    ``alive``.
    """
    if status is None:
        return Liveness.ABSENT
    age = ((now or utcnow()) - status.heartbeat).total_seconds()
    if age >= absent_after:
        return Liveness.ABSENT
    if age >= silent_after:
        return Liveness.SILENT
    return Liveness.ALIVE


class ControlChannel:
    """The control directory: atomic writes, tolerant reads, locked request updates."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.request_path = self.directory / REQUEST_FILE
        self.status_path = self.directory / STATUS_FILE
        self.lock_path = self.directory / LOCK_FILE

    def __repr__(self) -> str:
        return f"ControlChannel({str(self.directory)!r})"

    # ---- requests -------------------------------------------------------------------------

    def read_request(self) -> Request | None:
        """The pending request, or ``None`` when there is none."""
        data = self._read_json(self.request_path)
        return None if data is None else Request.from_json(data)

    def write_request(self, request: Request) -> None:
        """Replace the pending request with ``request`` (no merge; see :meth:`merge_request`)."""
        with self._locked():
            self._write_json(self.request_path, request.to_json())

    def merge_request(
        self,
        *,
        deadline: datetime | None,
        reason: str = "",
        source: str = "operator",
        now: datetime | None = None,
    ) -> tuple[Request, bool]:
        """Ask for a checkpoint, merging into the pending request if there is one.

        Returns the request as it now stands and whether it was merged into an existing one.
        """
        # Round-trip through JSON so that the caller gets exactly what a reader will see
        # (times at millisecond precision).
        fresh = Request(deadline=deadline, reason=reason, source=source, created=now or utcnow())
        incoming = Request.from_json(fresh.to_json())
        with self._locked():
            pending = self._read_request_unlocked()
            if pending is None:
                self._write_json(self.request_path, incoming.to_json())
                return incoming, False
            merged = pending.merged_with(incoming)
            if merged != pending:
                self._write_json(self.request_path, merged.to_json())
            return merged, True

    def clear_request(self, request_id: str) -> bool:
        """Remove the pending request if it is still ``request_id``.

        The SDK calls this once it has taken the request. A request that was replaced
        meanwhile (another id) stays. Returns whether a file was removed.
        """
        with self._locked():
            pending = self._read_request_unlocked()
            if pending is None or pending.id != request_id:
                return False
            self.request_path.unlink(missing_ok=True)
            _fsync_dir(self.directory)
            return True

    # ---- status ---------------------------------------------------------------------------

    def read_status(self) -> Status | None:
        """The pod's status: local rank 0's, folded with the other local ranks' (see
        :func:`aggregate`), or ``None`` when local rank 0 has not written one yet."""
        primary = self.read_local_status(0)
        if primary is None or primary.local_world_size <= 1:
            return primary
        others = {k: self.read_local_status(k) for k in range(1, primary.local_world_size)}
        return aggregate(primary, others)

    def read_local_status(self, local_rank: int) -> Status | None:
        """One local rank's own status as written, or ``None``."""
        data = self._read_json(self.directory / local_status_file(local_rank))
        return None if data is None else Status.from_json(data)

    def write_status(self, status: Status) -> None:
        """Write ``status`` atomically to the file of its ``local_rank``."""
        self._write_json(self.directory / local_status_file(status.local_rank), status.to_json())

    def status_ident(self) -> tuple[tuple[str, int, int, int], ...]:
        """Names, mtimes, sizes and inodes of the status files: changes when any is rewritten."""
        idents = []
        for path in sorted(self.directory.glob("status*.json")):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            idents.append((path.name, st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(idents)

    # ---- files ----------------------------------------------------------------------------

    def _read_request_unlocked(self) -> Request | None:
        try:
            return self.read_request()
        except ControlFormatError:
            # A request that cannot be read cannot be served either: replace it rather than
            # wedging every later request behind it.
            return None

    def _read_json(self, path: Path) -> Any:
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ControlFormatError(
                f"{path} is not valid JSON ({e}); it is written atomically, so something else "
                "wrote it: delete it and let the sidecar or the SDK write it again"
            ) from e

    def _write_json(self, path: Path, data: Mapping[str, Any]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        payload = (json.dumps(data, sort_keys=True) + "\n").encode()
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(payload)
                f.flush()
                os.fchmod(f.fileno(), _FILE_MODE)
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        _fsync_dir(self.directory)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, _LOCK_MODE)
        except PermissionError:
            # Created by the other container's user without write access for us: a read-only
            # descriptor can still hold an flock.
            fd = os.open(self.lock_path, os.O_RDONLY)
        else:
            with contextlib.suppress(PermissionError):
                os.fchmod(fd, _LOCK_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock


_ENDED: Final = frozenset({State.COMMITTED, State.FAILED, State.SKIPPED})
_PROGRESS: Final = {
    State.IDLE: 0,
    State.COMMITTED: 3,
    State.SKIPPED: 3,
    State.FAILED: 3,
    State.REQUESTED: 1,
    State.SAVING: 2,
}


def aggregate(primary: Status, others: Mapping[int, Status | None]) -> Status:
    """One status for a pod of several local ranks: ``primary`` (local rank 0's) with its
    ``state``, ``error``, ``heartbeat`` and ``updated`` folded over ``others``.

    A save is identified by its ``trigger`` and ``step``, which every rank agrees on (only local
    rank 0 knows the request id). ``failed`` if any local rank reports ``failed``; otherwise
    the primary's final state only when every local rank reports it for the same save;
    otherwise the least advanced state of that save (a rank still on an older save, or without
    a status yet, counts as ``requested``).
    """
    everyone: dict[int, Status | None] = {0: primary, **dict(others)}
    count = max(primary.local_world_size, len(everyone))
    ranks = []
    for k in range(count):
        s = everyone.get(k)
        ranks.append(
            {"local_rank": k, "state": "absent", "step": None, "trigger": None, "error": None,
             "heartbeat": None}
            if s is None
            else {"local_rank": k, "state": s.state.value, "step": s.step, "trigger": s.trigger,
                  "error": s.error, "heartbeat": format_rfc3339(s.heartbeat)}
        )  # fmt: skip
    present = [s for s in everyone.values() if s is not None]
    heartbeat = min(s.heartbeat for s in present)
    failed = [
        (k, s) for k, s in sorted(everyone.items()) if s is not None and s.state is State.FAILED
    ]
    if failed:
        error = "; ".join(f"local rank {k}: {s.error or 'failed'}" for k, s in failed)
        return dataclasses.replace(
            primary,
            state=State.FAILED,
            error=error,
            heartbeat=heartbeat,
            updated=max(s.updated for _, s in failed),
            ranks=tuple(ranks),
        )
    if primary.state is State.IDLE:
        return dataclasses.replace(primary, heartbeat=heartbeat, ranks=tuple(ranks))
    save = (primary.trigger, primary.step)

    def progress(s: Status | None) -> int:
        if s is None or (s.trigger, s.step) != save or s.state is State.IDLE:
            return _PROGRESS[State.REQUESTED]
        return _PROGRESS[s.state]

    least = min(progress(everyone.get(k)) for k in range(count))
    if primary.state in _ENDED and least == _PROGRESS[primary.state]:
        same = all(
            (s := everyone.get(k)) is not None and s.state is primary.state for k in range(count)
        )
        if same:
            return dataclasses.replace(
                primary,
                heartbeat=heartbeat,
                updated=max(s.updated for s in present),
                ranks=tuple(ranks),
            )
        least = _PROGRESS[State.SAVING]
    state = State.REQUESTED if least <= _PROGRESS[State.REQUESTED] else State.SAVING
    return dataclasses.replace(primary, state=state, heartbeat=heartbeat, ranks=tuple(ranks))


def _get_ranks(data: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    value = data.get("ranks") or []
    if not isinstance(value, list) or not all(isinstance(r, Mapping) for r in value):
        raise ControlFormatError(f"status 'ranks' must be a list of objects, got {value!r}")
    return [dict(r) for r in value]


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _state(value: object) -> State:
    try:
        if not isinstance(value, str):
            raise ValueError(value)
        return State(value)
    except ValueError as e:
        raise ControlFormatError(
            f"status state {value!r} is unknown: use one of {', '.join(s.value for s in State)}"
        ) from e


def _get(data: Mapping[str, Any], key: str, kind: type) -> Any:
    value = data.get(key)
    if value is None:
        return None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return value
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ControlFormatError(
            f"field {key!r} must be {kind.__name__} or null, got {type(value).__name__} {value!r}"
        )
    return value


def _get_time(data: Mapping[str, Any], key: str) -> datetime | None:
    value = data.get(key)
    if value is None:
        return None
    return parse_rfc3339(value)
