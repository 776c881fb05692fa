"""Notices of a coming preemption, and one agreed decision per step boundary across ranks.

A notice may reach only one rank: SIGTERM to one process, a request file in one pod's control
directory, or ``Checkpointer.request_checkpoint`` called on one rank. Every rank must still save
*the same* step, so at a step boundary the ranks share what each has heard with one small
collective (an ``all_reduce(MAX)`` of a few ``int64``) and all act on the result.

Who calls what, on which rank, in which order (``trainer_sdk.checkpointer`` is the caller):

* at start-up, every rank: :meth:`SigtermListener.install` (main thread only);
  ``LOCAL_RANK=0`` also builds a :class:`ControlPoller` on ``$BATON_CONTROL_DIR``;
* at each step boundary, every rank: :meth:`NoticeBoard.local` (a flag read, and for the
  control directory one ``stat``), then :func:`agree` on the checkpoint process group (a gloo
  group created at start-up, used only from the training thread). The same vector carries
  rank 0's clocks, so that time-based decisions (``every_seconds``, whether to overlap) are
  made identically;
* or, when steps are short, overlapped: :func:`start_agreement` at the end of one boundary
  (the ``all_reduce`` runs in gloo's own thread while the next step computes) and
  :meth:`PendingAgreement.wait` at the next boundary, which then acts on it. Every rank starts
  and waits the same agreements at the same boundaries, so all still act at the same step;
  a notice is served one boundary later, and ``step()`` no longer waits for the slowest rank;
* at shut-down: :meth:`SigtermListener.uninstall` restores the previous handler.

The SIGTERM handler itself only sets a flag: a handler runs between two bytecodes of whatever
the main thread was doing (maybe inside a collective or an allocator), so heavy work there
would be unsafe. The previous handler, if it was a Python function, is chained.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from types import FrameType
from typing import Any, Final

import torch

from trainer_sdk.control import ControlChannel, ControlError, Request, parse_rfc3339
from trainer_sdk.saveload._collectives import all_reduce_max_, mark_failed, start_all_reduce_max_
from trainer_sdk.wire import Trigger

__all__ = [
    "Agreement",
    "ControlPoller",
    "LocalNotice",
    "NoticeBoard",
    "PendingAgreement",
    "SigtermListener",
    "agree",
    "agreement_buffer",
    "start_agreement",
]

log = logging.getLogger("trainer_sdk.signals")

# Layout of the agreement vector. MAX is the only reduction, so "earliest deadline wins" is
# encoded as the largest negated deadline, and "rank 0's clock" as rank 0's value against
# everybody else's zero.
_SIGTERM: Final = 0
_CONTROL: Final = 1
_API: Final = 2
_BG_FAILED: Final = 3
_PERIODIC: Final = 4
_NEG_DEADLINE: Final = 5
_RANK0_CLOCK: Final = 6
_RANK0_MONOTONIC: Final = 7
_LEN: Final = 8
_NO_DEADLINE: Final = -(1 << 62)


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalNotice:
    """What one rank knows at a step boundary."""

    sigterm: bool = False
    """This process received SIGTERM."""
    control: Request | None = None
    """A pending request in this pod's control directory (only ``LOCAL_RANK=0`` polls)."""
    api: bool = False
    """``request_checkpoint`` was called on this rank."""
    deadline: float | None = None
    """The earliest deadline this rank knows of, as a UNIX time in seconds."""
    reason: str = ""
    """Why, for the logs and the status file."""
    background_failed: bool = False
    """This rank's background (async) save has failed and must be raised by everyone."""
    periodic_due: bool = False
    """Rank 0 only: its clock says an ``every_seconds`` save is due."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Agreement:
    """What all ranks agree on at a step boundary (identical on every rank)."""

    sources: frozenset[str] = field(default_factory=frozenset)
    """Which kinds of notice some rank heard: ``signal``, ``control``, ``api``."""
    deadline: float | None = None
    """The earliest deadline any rank knows of (UNIX seconds), or ``None``."""
    rank0_time: float = 0.0
    """Rank 0's wall clock (UNIX seconds) at this boundary."""
    rank0_monotonic: float = 0.0
    """Rank 0's ``time.monotonic()`` when this boundary began (for the intervals between
    boundaries; an overlapped agreement is sent at the end of its boundary)."""
    background_failed: bool = False
    """Some rank's background save failed: every rank raises now."""
    periodic_due: bool = False
    """A time-based periodic save is due (decided by rank 0's clock)."""

    @property
    def notice(self) -> bool:
        """Whether an emergency save was asked for."""
        return bool(self.sources)

    @property
    def trigger(self) -> Trigger:
        """The checkpoint trigger recorded in the manifest and status: ``signal`` or ``notice``."""
        return Trigger.SIGNAL if self.sources == {"signal"} else Trigger.NOTICE


def agree(local: LocalNotice, *, rank: int, group: Any | None) -> Agreement:
    """Share ``local`` with every rank of ``group`` (one ``all_reduce``), or just adopt it.

    Every rank of ``group`` must call this at the same step boundary. ``group`` ``None`` means
    a single process.
    """
    vec = _vector(local, rank, time.monotonic())
    if group is not None:
        all_reduce_max_(vec, group=group)
    return _decode(vec)


class PendingAgreement:
    """An agreement whose ``all_reduce`` is in flight; :meth:`wait` gives the result.

    Made by :func:`start_agreement`. Waiting more than once returns the same answer, so the
    caller may settle it early (before another collective on the same group) and act on it
    later.
    """

    def __init__(
        self,
        *,
        step: int,
        local: LocalNotice,
        vec: torch.Tensor,
        work: Any,
        group: Any | None = None,
    ) -> None:
        self.step = step
        """The step boundary that started it."""
        self.local = local
        """What this rank contributed (marked served once a notice in it is acted on)."""
        self._vec = vec
        self._work = work
        self._group = group
        self._result: Agreement | None = None

    def wait(self, timeout: timedelta) -> Agreement:
        """Block until every rank has contributed (at most ``timeout``) and decode."""
        if self._result is None:
            try:
                finished = self._work is None or self._work.wait(timeout)
            except Exception:
                mark_failed(self._group)
                raise
            if not finished:
                mark_failed(self._group)
                raise TimeoutError(f"the notice agreement started at step {self.step} timed out")
            self._result = _decode(self._vec)
        return self._result


def start_agreement(
    local: LocalNotice,
    *,
    step: int,
    rank: int,
    group: Any | None,
    boundary: float,
    buffer: torch.Tensor | None = None,
) -> PendingAgreement:
    """Start sharing ``local`` like :func:`agree`, without waiting for the other ranks.

    Every rank of ``group`` must start it at the same step boundary and wait for it before
    acting on anything it says. ``boundary``: the ``time.monotonic()`` at which this boundary
    began (what :attr:`Agreement.rank0_monotonic` reports, as for :func:`agree`).
    ``buffer``: a tensor from :func:`agreement_buffer` to reuse (the previous agreement that
    used it must have been waited for); saves an allocation on every step.
    """
    vec = _vector(local, rank, boundary, out=buffer)
    work = start_all_reduce_max_(vec, group=group) if group is not None else None
    return PendingAgreement(step=step, local=local, vec=vec, work=work, group=group)


def agreement_buffer() -> torch.Tensor:
    """A vector for :func:`start_agreement` to fill and reuse."""
    return torch.zeros(_LEN, dtype=torch.int64)


def _vector(
    local: LocalNotice, rank: int, monotonic: float, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    # Built as a list and converted once: eight tensor item assignments cost ~10x more.
    v = [0] * _LEN
    v[_SIGTERM] = int(local.sigterm)
    v[_CONTROL] = int(local.control is not None)
    v[_API] = int(local.api)
    v[_BG_FAILED] = int(local.background_failed)
    v[_PERIODIC] = int(local.periodic_due and rank == 0)
    v[_NEG_DEADLINE] = _NO_DEADLINE if local.deadline is None else -round(local.deadline * 1000)
    v[_RANK0_CLOCK] = round(time.time() * 1000) if rank == 0 else 0
    v[_RANK0_MONOTONIC] = round(monotonic * 1e6) if rank == 0 else 0
    if out is None:
        return torch.tensor(v, dtype=torch.int64)
    out.numpy()[:] = v
    return out


def _decode(vec: torch.Tensor) -> Agreement:
    v = vec.tolist()
    sources = frozenset(
        name for name, idx in (("signal", _SIGTERM), ("control", _CONTROL), ("api", _API)) if v[idx]
    )
    return Agreement(
        sources=sources,
        deadline=None if v[_NEG_DEADLINE] == _NO_DEADLINE else -v[_NEG_DEADLINE] / 1000.0,
        rank0_time=v[_RANK0_CLOCK] / 1000.0,
        rank0_monotonic=v[_RANK0_MONOTONIC] / 1e6,
        background_failed=bool(v[_BG_FAILED]),
        periodic_due=bool(v[_PERIODIC]),
    )


class SigtermListener:
    """Turns SIGTERM into a flag, chaining whatever Python handler was installed before."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._previous: Any = None
        self._installed = False
        self._captured = False

    @property
    def received(self) -> bool:
        """Whether SIGTERM arrived since :meth:`install` (or the last :meth:`reset`)."""
        return self._event.is_set()

    def reset(self) -> None:
        """Forget a received signal (after it has been served)."""
        self._event.clear()

    def install(self) -> bool:
        """Install the handler; returns False (and logs) when not on the main thread."""
        if self._installed:
            return True
        if threading.current_thread() is not threading.main_thread():
            log.warning(
                "SIGTERM handling is off: the Checkpointer was built outside the main thread, "
                "where Python cannot install signal handlers; build it on the main thread"
            )
            return False
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        self._installed = True
        self._captured = True
        return True

    def reclaim(self) -> bool:
        """Install the handler again, on top of whatever handler is there now, which is
        dropped (not chained): Baton owns SIGTERM, once. The handler found by the first
        :meth:`install` stays the one chained and put back by :meth:`uninstall`. For a
        framework that installs its own SIGTERM handler after Baton's was built: Lightning's
        ``Trainer`` wraps the handler it finds in one that runs a collective inside the signal
        handler, and puts the one it found back at its teardown (so the caller uninstalls
        before the framework installs, and reclaims after). Returns False when not on the
        main thread."""
        if not self._captured:
            return self.install()
        if threading.current_thread() is not threading.main_thread():
            return False
        signal.signal(signal.SIGTERM, self._handle)
        self._installed = True
        return True

    def uninstall(self) -> None:
        """Put the previous handler back, if ours is still the one installed."""
        if not self._installed:
            return
        self._installed = False
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) == self._handle:
            signal.signal(signal.SIGTERM, self._previous)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Only set a flag here; see the module docstring.
        self._event.set()
        previous = self._previous
        # SIG_DFL would terminate the process before the save: that is exactly what we replace.
        if callable(previous) and previous not in (signal.SIG_DFL, signal.SIG_IGN):
            previous(signum, frame)


class ControlPoller:
    """Watches ``request.json`` in the control directory for a pending request, cheaply.

    Each poll costs one ``stat``; the file is read and parsed only when its identity (mtime,
    size, inode) changed. Requests already served are remembered by id and ignored.
    """

    def __init__(self, channel: ControlChannel) -> None:
        self.channel = channel
        self._seen: tuple[int, int, int] | None = None
        self._pending: Request | None = None
        self._served: set[str] = set()

    def poll(self) -> Request | None:
        """The pending, not yet served request, or ``None``."""
        try:
            st = os.stat(self.channel.request_path)
        except FileNotFoundError:
            self._seen, self._pending = None, None
            return None
        ident = (st.st_mtime_ns, st.st_size, st.st_ino)
        if ident != self._seen:
            self._seen = ident
            try:
                self._pending = self.channel.read_request()
            except ControlError as e:
                log.error("ignoring unreadable checkpoint request: %s", e)
                self._pending = None
        if self._pending is not None and self._pending.id in self._served:
            return None
        return self._pending

    def served(self, request: Request) -> None:
        """Mark ``request`` served and remove it from the directory if it is still pending."""
        self._served.add(request.id)
        try:
            self.channel.clear_request(request.id)
        except OSError as e:
            log.warning("could not clear served request %s: %s", request.id, e)


@dataclass(kw_only=True, slots=True)
class _ApiRequest:
    deadline: float | None
    reason: str


class NoticeBoard:
    """Collects this rank's notices from all sources into one :class:`LocalNotice`."""

    def __init__(self, *, sigterm: SigtermListener | None, poller: ControlPoller | None) -> None:
        self.sigterm = sigterm
        self.poller = poller
        self._api: _ApiRequest | None = None
        self._lock = threading.Lock()

    def request(self, *, deadline: datetime | float | str | None, reason: str) -> None:
        """Record an in-process request (``Checkpointer.request_checkpoint``); thread-safe."""
        when = _as_unix(deadline)
        with self._lock:
            if self._api is not None and self._api.deadline is not None:
                when = self._api.deadline if when is None else min(when, self._api.deadline)
            self._api = _ApiRequest(deadline=when, reason=reason)

    def local(self, *, background_failed: bool = False, periodic_due: bool = False) -> LocalNotice:
        """Everything this rank has heard, without blocking."""
        sig = self.sigterm is not None and self.sigterm.received
        req = self.poller.poll() if self.poller is not None else None
        with self._lock:
            api = self._api
        deadlines = [
            d for d in (api.deadline if api else None, _req_deadline(req)) if d is not None
        ]
        reasons = [
            r
            for r in (
                "SIGTERM" if sig else "",
                f"control request {req.id} ({req.source}: {req.reason})" if req else "",
                f"request_checkpoint ({api.reason})" if api else "",
            )
            if r
        ]
        return LocalNotice(
            sigterm=sig,
            control=req,
            api=api is not None,
            deadline=min(deadlines) if deadlines else None,
            reason="; ".join(reasons),
            background_failed=background_failed,
            periodic_due=periodic_due,
        )

    def late_request(self, local: LocalNotice) -> Request | None:
        """A control request that arrived while the notice in ``local`` was being served
        (another id than the one it took, if any), taken: the caller answers it with that
        notice's outcome. A node drain's SIGTERM often starts the save a moment before the
        operator's request lands; left pending, the sidecar would wait out its linger for an
        answer that never comes, and the next attempt with it."""
        if self.poller is None:
            return None
        req = self.poller.poll()
        if req is None or (local.control is not None and req.id == local.control.id):
            return None
        self.poller.served(req)
        return req

    def served(self, local: LocalNotice) -> None:
        """Forget the notices in ``local`` once they have been acted on."""
        if local.sigterm and self.sigterm is not None:
            self.sigterm.reset()
        if local.control is not None and self.poller is not None:
            self.poller.served(local.control)
        if local.api:
            with self._lock:
                self._api = None


def _req_deadline(req: Request | None) -> float | None:
    if req is None or req.deadline is None:
        return None
    return req.deadline.timestamp()


def _as_unix(deadline: datetime | float | str | None) -> float | None:
    if deadline is None:
        return None
    if isinstance(deadline, str):
        return parse_rfc3339(deadline).timestamp()
    if isinstance(deadline, datetime):
        if deadline.tzinfo is None:
            raise ValueError(
                f"deadline {deadline!r} has no time zone: pass an aware datetime (tzinfo=UTC)"
            )
        return deadline.timestamp()
    return float(deadline)
