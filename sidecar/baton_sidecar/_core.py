"""The sidecar's state, without HTTP: checkpoint requests in, the SDK's status out.

The HTTP handlers and the cloud pollers both call :meth:`Sidecar.request_checkpoint`; a
background task (:meth:`Sidecar.watch_status`) follows ``status.json`` so that metrics and the
Azure acknowledgement see every save that ends.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any, Final

from baton_sidecar._config import SidecarConfig
from baton_sidecar._metrics import SidecarMetrics
from trainer_sdk.control import (
    STATUS_FILE,
    ControlChannel,
    ControlError,
    Request,
    Status,
    trainer_liveness,
    utcnow,
)
from trainer_sdk.wire import Liveness, State, Tier

__all__ = ["Sidecar", "StatusListener"]

log = logging.getLogger("baton_sidecar")

StatusListener = Callable[[Status], None]
"""Called with each status that ends a save (committed, failed, skipped), once per save."""

_ENDED: Final = frozenset({State.COMMITTED, State.FAILED, State.SKIPPED})
_IN_FLIGHT: Final = frozenset({State.REQUESTED, State.SAVING})

FINAL_REPORT_KEYS: Final = (
    "state", "step", "uri", "seconds", "error", "request_id", "trigger", "last_committed_step",
    "restored_step", "restored_tier", "train_step", "step_seconds", "heartbeat", "tier",
)  # fmt: skip
"""The fields of ``GET /v1/status`` the operator reads (its ``reports.SidecarStatus``)."""
MAX_TERMINATION_MESSAGE: Final = 4096
"""The kubelet keeps this many bytes of a container's termination message."""


class Sidecar:
    """Request checkpoints through the control channel and follow what the SDK reports."""

    def __init__(self, config: SidecarConfig, *, metrics: SidecarMetrics | None = None) -> None:
        self.config = config
        self.channel = ControlChannel(config.control_dir)
        self.metrics = metrics if metrics is not None else SidecarMetrics()
        self._listeners: list[StatusListener] = []
        # One request at a time within this process; the file lock covers the SDK's side.
        self._request_lock = asyncio.Lock()
        self._seen_ident: tuple[tuple[str, int, int, int], ...] | None = None
        self._seen_end: tuple[Any, ...] | None = None
        self._seen_committed_step: int | None = None
        self._bad_status: str | None = None
        self._answered: str | None = None
        """The request id whose ended status ``GET /v1/status`` last returned."""
        self._settled: collections.deque[str] = collections.deque(maxlen=16)
        """Request ids the operator has decided on (:meth:`settle`): none is waited for."""
        self.clouds: list[str] | None = None
        """The clouds whose notices are watched; ``None`` while auto-detection runs."""
        self.replication: Callable[[], dict[str, Any]] | None = None
        """The replication state for ``GET /v1/status`` (set when the memory tier is on)."""

    def add_listener(self, listener: StatusListener) -> None:
        """Call ``listener`` for every save that ends from now on."""
        self._listeners.append(listener)

    # ---- requests -------------------------------------------------------------------------

    async def request_checkpoint(
        self, *, deadline: datetime | None, reason: str, source: str
    ) -> tuple[Request, bool]:
        """Ask the trainer for a checkpoint; returns the request and whether it was merged."""
        self.metrics.notice(source)
        async with self._request_lock:
            request, merged = await asyncio.to_thread(self._request, deadline, reason, source)
        log.info(
            "checkpoint request %s from %s (deadline %s, %s): %r",
            request.id,
            source,
            "none" if request.deadline is None else request.deadline.isoformat(),
            "merged" if merged else "new",
            reason,
        )
        return request, merged

    def _request(self, deadline: datetime | None, reason: str, source: str) -> tuple[Request, bool]:
        if not self.channel.request_path.exists():
            # A save for an earlier request may already be running (the SDK removed the file
            # when it took the request). Queueing another would save twice for one notice, so
            # the new request joins that save, unless the trainer has stopped beating.
            status = self._status_or_none()
            if (
                status is not None
                and status.state in _IN_FLIGHT
                and status.request_id
                and self.liveness(status) is Liveness.ALIVE
            ):
                return (
                    Request(
                        id=status.request_id,
                        deadline=status.deadline,
                        reason=reason,
                        source=source,
                        created=status.updated,
                    ),
                    True,
                )
        return self.channel.merge_request(deadline=deadline, reason=reason, source=source)

    # ---- status ---------------------------------------------------------------------------

    def liveness(self, status: Status | None) -> Liveness:
        """How the trainer looks from its heartbeat, with the configured thresholds."""
        return trainer_liveness(
            status,
            silent_after=self.config.silent_after,
            absent_after=self.config.absent_after,
        )

    def status_view(self) -> dict[str, Any]:
        """The body of ``GET /v1/status``: the SDK's status as written, plus the trainer's
        liveness and the pending request. Raises :class:`ControlError` for a corrupt file."""
        status = self.channel.read_status()
        try:
            pending = self.channel.read_request()
        except ControlError:
            pending = None
        body: dict[str, Any] = (
            status.to_json()
            if status is not None
            else {
                "state": State.IDLE.value,
                "request_id": None,
                "step": None,
                "uri": None,
                "seconds": None,
                "error": None,
                "trigger": None,
                "deadline": None,
                "phases": {},
                "bytes": None,
                "last_committed_step": None,
                "tier": None,
                "restored_tier": None,
                "updated": None,
                "pid": None,
                "heartbeat": None,
                "local_rank": 0,
                "local_world_size": None,
                "ranks": [],
            }
        )
        if (
            status is not None
            and status.state in _ENDED
            and status.request_id
            and status.tier != Tier.MEMORY
        ):
            # A notice committed to the memory tier is answered once its promotion is seen
            # too: the operator waits for that, so the sidecar lingers for it.
            self._answered = status.request_id
        body["trainer"] = self.liveness(status).value
        body["heartbeat_age_seconds"] = (
            None if status is None else round((utcnow() - status.heartbeat).total_seconds(), 3)
        )
        body["pending_request"] = None if pending is None else pending.to_json()
        body["clouds"] = self.clouds
        body["replication"] = None if self.replication is None else self.replication()
        return body

    def final_report(self) -> str | None:
        """The save's outcome as the operator parses it from ``GET /v1/status`` (the
        SDK's fields only, compact JSON within the kubelet's 4096 bytes), for the
        container's termination message; None when the status cannot be read."""
        try:
            body = self.status_view()
        except ControlError:
            return None
        report = {k: body.get(k) for k in FINAL_REPORT_KEYS}
        text = json.dumps(report, separators=(",", ":"))
        if len(text.encode()) > MAX_TERMINATION_MESSAGE:
            report["error"] = None  # the one unbounded field
            text = json.dumps(report, separators=(",", ":"))
        return text if len(text.encode()) <= MAX_TERMINATION_MESSAGE else None

    def settle(self, request_id: str) -> None:
        """The operator has decided on request ``request_id`` (``POST
        /v1/checkpoint/{id}/settled``): one rank's ``committed`` proves the whole checkpoint,
        so it may restart the job without reading this rank's outcome. Nothing is waited for
        on its account at shutdown; an id this sidecar never saw is remembered all the same
        (the request may have come before a restart of the sidecar)."""
        if request_id not in self._settled:
            self._settled.append(request_id)

    def unanswered(self) -> str | None:
        """What is still unanswered: a checkpoint request pending, its save running, or its
        outcome ended but not served by ``GET /v1/status`` yet (see
        ``SidecarConfig.linger_seconds``), in words for the log; None when nothing is."""
        try:
            pending = self.channel.read_request()
        except ControlError:
            pending = None
        if pending is not None and pending.id not in self._settled:
            return f"request {pending.id} not taken by the trainer yet"
        if pending is None and self.channel.request_path.exists():
            return "a request that cannot be read is pending"
        status = self._status_or_none()
        if status is None or not status.request_id or status.request_id in self._settled:
            return None
        if status.state in _IN_FLIGHT:
            return f"the save for request {status.request_id} is {status.state.value}"
        if status.state in _ENDED and status.request_id != self._answered:
            tier = f", tier {status.tier}" if status.tier else ""
            return (
                f"the outcome of request {status.request_id} ({status.state.value}{tier}) not "
                "read yet"
            )
        return None

    def _status_or_none(self) -> Status | None:
        try:
            return self.channel.read_status()
        except ControlError:
            return None

    async def watch_status(self) -> None:
        """Follow ``status.json`` forever: feed metrics and listeners once per ended save."""
        first = True
        while True:
            try:
                self.check_status(first=first)
                first = False
            except Exception:
                # Never let the watcher die: metrics and Azure acks depend on it.
                log.exception("could not follow the SDK status in %s", self.channel.status_path)
            await asyncio.sleep(self.config.status_interval)

    def check_status(self, *, first: bool = False) -> None:
        """Look at the status files once (a directory listing and ``stat`` s unless one changed).

        With several processes per pod each local rank writes its own file; the channel folds
        them into one status, so a save ends here only once every local rank reported it.
        """
        ident = self.channel.status_ident()
        if not any(name == STATUS_FILE for name, *_ in ident):
            return
        if ident == self._seen_ident:
            return
        self._seen_ident = ident
        try:
            status = self.channel.read_status()
        except ControlError as e:
            if str(e) != self._bad_status:
                log.error("the SDK status cannot be read: %s", e)
                self._bad_status = str(e)
            return
        self._bad_status = None
        if status is None:
            return
        end_key = (status.state, status.request_id, status.step, status.updated)
        committed_step = status.last_committed_step
        if first:
            # A restarted sidecar must not count the save it saw before its restart again,
            # nor wait at shutdown for someone to read that old outcome.
            self._seen_end = end_key
            if status.state in _ENDED:
                self._answered = status.request_id
            self._seen_committed_step = committed_step
            if committed_step is not None:
                self.metrics.last_committed_step.set(committed_step)
            return
        if status.state in _ENDED and end_key != self._seen_end:
            self._seen_end = end_key
            self._seen_committed_step = committed_step
            self.metrics.observe(status)
            for listener in self._listeners:
                try:
                    listener(status)
                except Exception:
                    log.exception("a status listener failed on %s", status.state)
        elif committed_step is not None and committed_step != self._seen_committed_step:
            # Periodic saves and restores move only last_committed_step: a new step to show,
            # but no request that ended.
            self._seen_committed_step = committed_step
            self.metrics.last_committed_step.set(committed_step)
