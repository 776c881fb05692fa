"""Prometheus metrics of one pod's checkpoints, derived from the SDK's status transitions.

The SDK does the work and writes ``status.json``; the sidecar turns each *new* terminal status
(committed, failed, skipped) into observations. Names and labels are contracts
(``docs/contracts.md``). Every label takes values from a small fixed set, so that a pod's series
count is bounded whatever the trainer writes: unknown triggers and phases are folded or dropped.
"""

from __future__ import annotations

from typing import Final

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from trainer_sdk.control import Status
from trainer_sdk.wire import ROUTINE_TRIGGERS, SavePhase, State, Trigger

__all__ = ["NOTICE_SOURCES", "PHASES", "TRIGGERS", "SidecarMetrics"]

NOTICE_SOURCES: Final = ("operator", "aws", "gce", "azure")
PHASES: Final = tuple(p.value for p in SavePhase)
"""Exactly the phases the SDK reports (its own vocabulary, so the two cannot drift)."""
TRIGGERS: Final = tuple(t.value for t in Trigger)
"""Exactly the triggers the SDK produces; a caller's own trigger word is counted as ``other``."""
RESULTS: Final = (State.COMMITTED.value, State.FAILED.value, State.SKIPPED.value)

# Saves take from well under a second (small models, local disk) to many minutes (large
# sharded models to S3).
_SECONDS_BUCKETS: Final = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1800)
# The margin is negative when a save committed after its deadline; those are the ones to see.
_MARGIN_BUCKETS: Final = (-60, -30, -10, -5, -1, 0, 1, 5, 10, 20, 30, 60, 120, 300)


class SidecarMetrics:
    """The sidecar's metrics in a registry of their own (no global state between tests)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # the sidecar's own RSS and CPU, to watch its footprint
        self.checkpoint_seconds = Histogram(
            "baton_checkpoint_seconds",
            "Total save time as the SDK reported it, from the agreed step to the commit.",
            ["trigger"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.phase_seconds = Histogram(
            "baton_checkpoint_phase_seconds",
            f"Save time per phase ({', '.join(PHASES)}), as the SDK reported.",
            ["phase"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.bytes_total = Counter(
            "baton_checkpoint_bytes_total",
            "Bytes written by committed saves, as the SDK reported them.",
            registry=r,
        )
        self.last_committed_step = Gauge(
            "baton_checkpoint_last_committed_step",
            "The newest committed step the SDK reported.",
            registry=r,
        )
        self.deadline_margin = Histogram(
            "baton_checkpoint_deadline_margin_seconds",
            "Deadline minus commit time for saves that had a deadline (negative: too late).",
            buckets=_MARGIN_BUCKETS,
            registry=r,
        )
        self.notices_total = Counter(
            "baton_notices_total",
            "Checkpoint requests received, by who sent them.",
            ["source"],
            registry=r,
        )
        self.requests_total = Counter(
            "baton_checkpoint_requests_total",
            "Saves that ended, by how they ended.",
            ["result"],
            registry=r,
        )
        self.poll_errors_total = Counter(
            "baton_sidecar_poll_errors_total",
            "Failed cloud metadata requests (each is retried with backoff).",
            ["source"],
            registry=r,
        )
        self.replication_bytes = Counter(
            "baton_replication_bytes_total",
            "Memory-tier bytes copied between sidecars: sent to peers, received from them, "
            "fetched from them before a restore.",
            ["direction"],
            registry=r,
        )
        self.replication_failures = Counter(
            "baton_replication_failures_total",
            "Failed replications (a snapshot to a peer), refused receptions (a peer's file "
            "that failed its digest) and failed fills before a restore.",
            ["op"],
            registry=r,
        )
        self.replication_last_step = Gauge(
            "baton_replication_last_step",
            "The newest memory snapshot of this pod copied to all of its replica peers.",
            registry=r,
        )
        for direction in ("sent", "received", "fetched"):
            self.replication_bytes.labels(direction=direction)
        for op in ("replicate", "receive", "fill"):
            self.replication_failures.labels(op=op)
        # Zero-valued series from the start, so that rate() and alerts see them before the
        # first event.
        for source in NOTICE_SOURCES:
            self.notices_total.labels(source=source)
        for source in NOTICE_SOURCES[1:]:
            self.poll_errors_total.labels(source=source)
        for result in RESULTS:
            self.requests_total.labels(result=result)
        for phase in PHASES:
            self.phase_seconds.labels(phase=phase)

    def notice(self, source: str) -> None:
        """Count one checkpoint request from ``source`` (folded to ``operator`` if unknown)."""
        self.notices_total.labels(source=source if source in NOTICE_SOURCES else "operator").inc()

    def poll_error(self, source: str) -> None:
        """Count one failed metadata request of a cloud poller."""
        self.poll_errors_total.labels(source=source).inc()

    def observe(self, status: Status) -> None:
        """Record a status the SDK has just reached (called once per new terminal status)."""
        if status.last_committed_step is not None:
            self.last_committed_step.set(status.last_committed_step)
        if status.state not in RESULTS:
            return
        if status.request_id is not None or status.trigger not in ROUTINE_TRIGGERS:
            # Periodic saves also end in `committed`, but they answer no request.
            self.requests_total.labels(result=status.state.value).inc()
        if status.state is not State.COMMITTED:
            return
        if status.last_committed_step is None and status.step is not None:
            self.last_committed_step.set(status.step)
        if status.seconds is not None:
            trigger = status.trigger if status.trigger in TRIGGERS else "other"
            self.checkpoint_seconds.labels(trigger=trigger).observe(status.seconds)
        for phase, seconds in status.phases.items():
            if phase in PHASES:
                self.phase_seconds.labels(phase=phase).observe(seconds)
        if status.bytes:
            self.bytes_total.inc(status.bytes)
        if status.deadline is not None:
            self.deadline_margin.observe((status.deadline - status.updated).total_seconds())

    def exposition(self) -> bytes:
        """The metrics in the Prometheus text format."""
        return generate_latest(self.registry)
