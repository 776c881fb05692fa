"""The operator's Prometheus metrics (names in docs/contracts.md) and its HTTP endpoint.

Labels are small bounded sets (namespace, job, phase, reason, source): never pod names or
steps. ``/healthz`` answers 200 while the operator can work: 503, with the cause, once every
Kubernetes API call has failed for :attr:`Health.grace_seconds` (RBAC removed, API server
down), so that the kubelet restarts it and the alerting sees it.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, Final, TypeVar

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from baton_operator.pure.lifecycle import Phase
from baton_operator.pure.vocabulary import Tier

__all__ = ["Health", "Metrics", "serve"]

_JOB: Final = ("namespace", "job")
_LATENCY_BUCKETS: Final = (0.5, 1, 2, 5, 10, 15, 30, 60, 90, 120, 180, 300, 600)
_STEPS_BUCKETS: Final = (0, 1, 5, 10, 50, 100, 500, 1000, 5000, 10000)


_M = TypeVar("_M", Counter, Gauge, Histogram)


def _family(
    kind: type[_M],
    name: str,
    documentation: str,
    *,
    registry: CollectorRegistry,
    labels: tuple[str, ...] = _JOB,
    buckets: tuple[float, ...] | None = None,
) -> _M:
    """One metric family on ``registry``, labelled per job unless ``labels`` says otherwise
    (``buckets``: a histogram's)."""
    histogram: dict[str, Any] = {} if buckets is None else {"buckets": buckets}
    return kind(name, documentation, labels, registry=registry, **histogram)


class Metrics:
    """All operator metrics, on their own registry (so tests can make fresh ones)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        family = functools.partial(_family, registry=self.registry)
        self.notice_to_commit = family(
            Histogram, "baton_checkpoint_notice_to_commit_seconds",
            "Seconds from a notice to every rank's committed checkpoint.",
            buckets=_LATENCY_BUCKETS,
        )  # fmt: skip
        self.deadline_margin = family(
            Histogram, "baton_checkpoint_deadline_margin_seconds",
            "Notice deadline minus commit time (negative: too late).",
            buckets=(-60, -10, 0, 5, 10, 30, 60, 120, 300, 600),
        )  # fmt: skip
        self.preemptions = family(Counter, "baton_preemptions", "Preemptions acted on.")
        self.restarts = family(
            Counter, "baton_restarts", "Restarts by reason.", labels=(*_JOB, "reason")
        )
        # The per-restart histogram and the running total cannot share the family name
        # baton_steps_lost (the text format allows one TYPE per family), hence the suffix.
        self.steps_lost = family(
            Histogram, "baton_steps_lost_per_restart", "Steps recomputed per restart.",
            buckets=_STEPS_BUCKETS,
        )  # fmt: skip
        self.steps_lost_total = family(
            Counter, "baton_steps_lost", "Steps recomputed after restarts."
        )
        self.gpu_seconds_lost_total = family(
            Counter, "baton_gpu_seconds_lost",
            "GPU-seconds of recomputed steps (steps lost x measured step time x GPUs).",
        )  # fmt: skip
        self.notice_lead = family(
            Histogram, "baton_notice_lead_seconds",
            "Seconds between a notice's arrival and its deadline (what the cloud gave).",
            buckets=_LATENCY_BUCKETS,
        )  # fmt: skip
        self.restart_seconds = family(
            Histogram, "baton_restart_seconds",
            "Seconds from the last good step before an interruption to the first step after.",
            buckets=_LATENCY_BUCKETS,
        )  # fmt: skip
        self.goodput = family(
            Gauge, "baton_goodput_ratio",
            "Productive step time over wall time since the job was created (less suspended "
            "time); an estimate from the ranks' reported step and step time.",
        )  # fmt: skip
        self.checkpoints = family(
            Counter, "baton_checkpoints",
            "Commits the operator recorded in status.lastCheckpoint, by the tier they went to "
            "(durable, memory, memory+promoted: a memory commit's promotion counts again).",
            labels=(*_JOB, "tier"),
        )  # fmt: skip
        self.jobs = family(Gauge, "baton_jobs", "TrainingJobs by phase.", labels=("phase",))
        self.notices = family(
            Counter, "baton_notices", "Eviction notices seen, by source.", labels=("source",)
        )
        self.failure_budget = family(
            Gauge, "baton_failure_budget_remaining", "Failures left before Failed."
        )
        self.last_checkpoint = family(
            Gauge, "baton_last_checkpoint_timestamp_seconds",
            "Unix time of the last committed checkpoint the operator saw (until the first: "
            "the job's creation time).",
        )  # fmt: skip
        self.checkpoint_interval = family(
            Gauge, "baton_checkpoint_interval_seconds",
            "With checkpoint.everySeconds: auto, the interval chosen for the current attempt.",
        )  # fmt: skip
        self.api_errors = family(
            Counter, "baton_operator_api_errors",
            "Kubernetes API calls that failed, by verb and HTTP code (0: no answer, a timeout).",
            labels=("verb", "code"),
        )  # fmt: skip
        self.leader = family(
            Gauge, "baton_operator_leader",
            "1 while this operator replica holds the Lease and acts; 0 while it stands by.",
            labels=(),
        )  # fmt: skip
        self._live: set[tuple[str, str]] = set()
        self._restart_reasons: dict[tuple[str, str], set[str]] = {}
        self._phases: dict[tuple[str, str], str] = {}
        self._phase_counts: dict[str, int] = {}

    # Per-job series follow the job's life, so that dashboards and alerts see the truth:
    # they exist from the job's first reconcile (counters at 0, so increase() counts the
    # first preemption), the gauges go when the job finishes (a Succeeded job is not "a
    # job without a recent checkpoint"), and everything goes when the job is deleted.

    def job_running(
        self, namespace: str, name: str, *, failures_left: int, last_checkpoint: float
    ) -> None:
        """Called on each reconcile of a live job; seeds its series the first time.

        ``last_checkpoint``: Unix time of the newest commit known from the job's status, or
        the job's creation time when there is none (so a job that never checkpoints is
        noticed by ``BatonNoRecentCheckpoint``). Later commits set the gauge directly.
        """
        key = (namespace, name)
        if key in self._live:
            return
        self._live.add(key)
        self.preemptions.labels(*key)
        self.steps_lost_total.labels(*key)
        self.gpu_seconds_lost_total.labels(*key)
        for tier in Tier:
            self.checkpoints.labels(*key, tier.value)
        self.failure_budget.labels(*key).set(failures_left)
        self.last_checkpoint.labels(*key).set(last_checkpoint)

    def interruption(self, namespace: str, name: str, record: Mapping[str, Any]) -> None:
        """Count one ``status.interruptions`` entry (economics.entry): steps and GPU-seconds
        lost, and the notice's lead time when it had one."""
        key = (namespace, name)
        steps = record.get("stepsLost")
        if steps is not None:
            self.steps_lost.labels(*key).observe(steps)
            self.steps_lost_total.labels(*key).inc(steps)
        self.gpu_seconds_lost_total.labels(*key).inc(record.get("gpuSecondsLost") or 0)
        lead = record.get("leadSeconds")
        if lead is not None:
            self.notice_lead.labels(*key).observe(lead)

    def job_phase(self, namespace: str, name: str, phase: str | None) -> None:
        """Keep ``baton_jobs{phase}`` equal to the number of jobs in each phase (None: the job
        is gone).

        Only a job whose phase changed touches the counts (a reconcile costs the same with 1
        job or 1,000); the first call sets every phase's series, so each reads 0, not absent.
        """
        key = (namespace, name)
        old = self._phases.pop(key, None)
        if phase is not None:
            self._phases[key] = phase
        if not self._phase_counts:
            self._phase_counts = {p.value: 0 for p in Phase}
            for p in Phase:
                self.jobs.labels(p.value).set(0)
        elif old == phase:
            return
        changes: tuple[tuple[str | None, int], ...] = ((old, -1), (phase, 1))
        for value, delta in changes:
            if value is not None and value in self._phase_counts:
                self._phase_counts[value] += delta
                self.jobs.labels(value).set(self._phase_counts[value])

    def checkpoint_committed(self, namespace: str, name: str, tier: str | None) -> None:
        """Count a commit recorded in ``status.lastCheckpoint`` (no tier: an SDK before tiers,
        whose saves are durable; an unknown word is not counted, the label stays bounded)."""
        tier = tier or Tier.DURABLE.value
        if tier in frozenset(Tier):
            self.checkpoints.labels(namespace, name, tier).inc()

    def count_restart(self, namespace: str, name: str, reason: str) -> None:
        self._restart_reasons.setdefault((namespace, name), set()).add(reason)
        self.restarts.labels(namespace, name, reason).inc()

    def job_finished(self, namespace: str, name: str) -> None:
        """Drop the gauges of a Succeeded or Failed job; its counters stay until deletion."""
        key = (namespace, name)
        self._live.discard(key)
        for gauge in (
            self.failure_budget, self.last_checkpoint, self.checkpoint_interval, self.goodput,
        ):  # fmt: skip
            _remove(gauge, key)

    def job_deleted(self, namespace: str, name: str) -> None:
        """Drop every series of a deleted job."""
        key = (namespace, name)
        self.job_finished(namespace, name)
        for metric in (
            self.notice_to_commit, self.deadline_margin, self.preemptions, self.steps_lost,
            self.steps_lost_total, self.gpu_seconds_lost_total, self.notice_lead,
            self.restart_seconds,
        ):  # fmt: skip
            _remove(metric, key)
        for reason in self._restart_reasons.pop(key, set()):
            _remove(self.restarts, (*key, reason))
        for tier in Tier:
            _remove(self.checkpoints, (*key, tier.value))

    def render(self) -> bytes:
        """The text exposition of every metric."""
        return generate_latest(self.registry)


def _remove(metric: Counter | Gauge | Histogram, labels: tuple[str, ...]) -> None:
    # KeyError: never created (e.g. a job that finished before this operator started)
    with contextlib.suppress(KeyError):
        metric.remove(*labels)


DENIED_GRACE_SECONDS: Final = 10.0
"""/healthz fails this soon when every call is refused for want of RBAC (401/403)."""


class Health:
    """Whether the operator can do its work, judged from its Kubernetes API calls."""

    def __init__(
        self, *, grace_seconds: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.grace_seconds = grace_seconds
        """Failures for this long with no success in between make /healthz fail: longer
        than a brief API-server restart, shorter than the kubelet's patience."""
        self._clock = clock
        self._failing_since: float | None = None
        self._failing_since_wall: datetime | None = None
        self._last_error = ""
        self._denied = False
        self._on_recovered: list[Callable[[float], None]] = []
        self.last_outage: tuple[datetime, float, str] | None = None
        """The latest run of failed calls that ended: (when it began, seconds, last error)."""

    def on_recovered(self, callback: Callable[[float], None]) -> None:
        """Call ``callback(seconds)`` whenever calls work again after failing that long."""
        self._on_recovered.append(callback)

    def ok(self) -> None:
        """An API call succeeded."""
        if self._failing_since is not None:
            lasted = self._clock() - self._failing_since
            self._failing_since = None
            began = self._failing_since_wall or datetime.now(tz=UTC)
            self.last_outage = (began, lasted, self._last_error)
            for callback in self._on_recovered:
                callback(lasted)

    def failed(self, error: str, *, status: int | None = None) -> None:
        """An API call failed (``error`` names the call and the HTTP status, never a token;
        ``status`` 401 or 403: the operator lacks the credentials or RBAC for its work)."""
        self._denied = status in (401, 403)
        if self._failing_since is None:
            self._failing_since = self._clock()
            self._failing_since_wall = datetime.now(tz=UTC)
        self._last_error = error

    def failing_for(self) -> float:
        """Seconds since API calls started failing without a success (0 when healthy)."""
        if self._failing_since is None:
            return 0.0
        return self._clock() - self._failing_since

    def problem(self) -> str | None:
        """Why the operator cannot work, or None."""
        grace = self.grace_seconds
        if self._denied:
            # Lost RBAC does not come back by itself as a restarting API server does.
            grace = min(grace, DENIED_GRACE_SECONDS)
        if self._failing_since is None or self.failing_for() < grace:
            return None
        return (
            f"every Kubernetes API call has failed for {self.failing_for():.0f}s; last: "
            f"{self._last_error}"
        )


async def serve(
    metrics: Metrics,
    *,
    port: int,
    host: str = "0.0.0.0",  # noqa: S104
    health: Health | None = None,
) -> web.AppRunner:
    """Serve ``/metrics`` and ``/healthz`` on ``port``; returns the runner to clean up."""

    async def metrics_handler(_: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        problem = None if health is None else health.problem()
        if problem is not None:
            return web.Response(status=503, text=problem)
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
