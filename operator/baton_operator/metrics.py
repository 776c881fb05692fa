"""The operator's Prometheus metrics (names in docs/contracts.md) and its HTTP endpoint.

Labels are small bounded sets (namespace, job, phase, reason, source): never pod names or
steps. ``/healthz`` answers 200 while the event loop is alive.
"""

from __future__ import annotations

from typing import Final

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

__all__ = ["Metrics", "serve"]

_JOB: Final = ("namespace", "job")
_LATENCY_BUCKETS: Final = (0.5, 1, 2, 5, 10, 15, 30, 60, 90, 120, 180, 300, 600)
_STEPS_BUCKETS: Final = (0, 1, 5, 10, 50, 100, 500, 1000, 5000, 10000)


class Metrics:
    """All operator metrics, on their own registry (so tests can make fresh ones)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.notice_to_commit = Histogram(
            "baton_checkpoint_notice_to_commit_seconds",
            "Seconds from a notice to every rank's committed checkpoint.",
            _JOB, buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.deadline_margin = Histogram(
            "baton_checkpoint_deadline_margin_seconds",
            "Notice deadline minus commit time (negative: too late).",
            _JOB, buckets=(-60, -10, 0, 5, 10, 30, 60, 120, 300, 600), registry=r,
        )  # fmt: skip
        self.preemptions = Counter("baton_preemptions", "Preemptions acted on.", _JOB, registry=r)
        self.restarts = Counter(
            "baton_restarts", "Restarts by reason.", (*_JOB, "reason"), registry=r
        )
        # The per-restart histogram and the running total cannot share the family name
        # baton_steps_lost (the text format allows one TYPE per family), hence the suffix.
        self.steps_lost = Histogram(
            "baton_steps_lost_per_restart", "Steps recomputed per restart.", _JOB,
            buckets=_STEPS_BUCKETS, registry=r,
        )  # fmt: skip
        self.steps_lost_total = Counter(
            "baton_steps_lost", "Steps recomputed after restarts.", _JOB, registry=r
        )
        self.jobs = Gauge("baton_jobs", "TrainingJobs by phase.", ("phase",), registry=r)
        self.notices = Counter(
            "baton_notices", "Eviction notices seen, by source.", ("source",), registry=r
        )
        self.failure_budget = Gauge(
            "baton_failure_budget_remaining", "Failures left before Failed.", _JOB, registry=r
        )
        self.last_checkpoint = Gauge(
            "baton_last_checkpoint_timestamp_seconds",
            "Unix time of the last committed checkpoint the operator saw.", _JOB, registry=r,
        )  # fmt: skip

    def render(self) -> bytes:
        """The text exposition of every metric."""
        return generate_latest(self.registry)


async def serve(metrics: Metrics, *, port: int, host: str = "0.0.0.0") -> web.AppRunner:  # noqa: S104
    """Serve ``/metrics`` and ``/healthz`` on ``port``; returns the runner to clean up."""

    async def metrics_handler(_: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
