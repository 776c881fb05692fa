"""What one job's daemon carries: its memory between ticks, and what one tick observed.

No I/O. :class:`JobMemory` lives as long as the job's kopf daemon (nothing in it must survive
an operator restart: the job's status and the cluster hold the truth). :class:`Tick` is built
by ``Reconciler.tick`` from one fresh read and handed to the code that acts on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from . import reports
from .jobstatus import JobStatus, StatusPatch
from .lifecycle import RankView
from .model import JobSpec
from .pods import PodView
from .reports import SidecarStatus

__all__ = ["JobMemory", "Tick"]


@dataclass
class JobMemory:
    """What a job's daemon remembers between ticks (nothing that must survive a restart)."""

    token: str | None = None
    next_progress_poll: datetime | None = None
    attempt: int | None = None
    """The attempt ``reports`` belong to."""
    reports: dict[int, SidecarStatus] = field(default_factory=dict)
    """The last answer of each rank's sidecar in this attempt. A sidecar stops soon after its
    trainer (native sidecar), so its last word is kept here for the decision after."""
    create_failures: int = 0
    """Creates of pods or the Service that failed in a row (temporary errors)."""
    create_retry_at: datetime | None = None
    """No create is tried before this time (backoff after a temporary error)."""
    next_goodput_write: datetime | None = None
    """``status.goodput`` is written again no sooner than this (economics.py)."""
    written_version: str | None = None
    """The resourceVersion this daemon's last status write returned: a tick reads the job
    from the watch cache only once the cache holds this version or a newer one."""
    restart_seen_at: datetime | None = None
    """When a trainer restarted in place was first seen unexplained (no recovery open): it
    counts as a crash once no recovery explained it for a while (recovering.py). Lost with
    the daemon, which only delays that count."""
    suspected: set[str] = field(default_factory=set)
    """The evidence and node (``pod:restart:2@node``) that already made this job suspect a
    node (suspecting.py): each piece suspects each node once, so a cleared suspicion is not
    raised again every tick by the same restart."""
    silent: set[int] = field(default_factory=set)
    """Ranks whose sidecar answered this attempt and then did not (actions.poll_ranks)."""
    synced_at: datetime | None = None
    """When the job and its pods were last read through the API rather than the watch cache
    (the daemon's first tick, every resync period, and after a lost write race)."""

    def for_attempt(self, attempt: int) -> None:
        """Forget the reports of an earlier attempt."""
        if self.attempt != attempt:
            self.attempt = attempt
            self.reports = {}
            self.silent = set()

    def remember_final(self, pods: Mapping[int, PodView]) -> None:
        """Take each ended sidecar's last report (its termination message) as its answer,
        unless a newer one was polled: a sidecar that stopped before this daemon could poll
        it (a new leader, an API outage) still tells what its save did."""
        for rank, pod in pods.items():
            final = pod.sidecar_final
            if final is None:
                continue
            known = self.reports.get(rank)
            if known is None or (
                final.heartbeat is not None
                and (known.heartbeat is None or final.heartbeat > known.heartbeat)
            ):
                self.reports[rank] = final

    def committed_notice(self, rank: int) -> bool:
        """The rank's sidecar reported a committed save for a notice or a signal."""
        return reports.committed_notice(self.reports.get(rank))

    def served_notice(self, rank: int) -> bool:
        """The rank's SDK reported serving a notice (a save for a request or a signal)."""
        return reports.served_notice(self.reports.get(rank))

    def may_create(self, now: datetime) -> bool:
        """Whether a create may be tried now (no backoff pending)."""
        return self.create_retry_at is None or now >= self.create_retry_at


@dataclass
class Tick:
    """Everything one tick of one job has observed."""

    job: Mapping[str, Any]
    spec: JobSpec
    status: JobStatus
    memory: JobMemory
    now: datetime
    version: str | None
    """The job's resourceVersion that this tick's next status write is guarded by."""
    current: Mapping[int, PodView] = field(default_factory=dict)
    """The current attempt's pods by rank."""
    views: list[RankView] = field(default_factory=list)

    def patch(self) -> StatusPatch:
        """A new status write against what this tick read."""
        return self.patch_of(self.status)

    def patch_of(self, status: JobStatus) -> StatusPatch:
        """A new status write against ``status`` (its phase and conditions)."""
        return StatusPatch(status, now=self.now, generation=self.spec.generation)
