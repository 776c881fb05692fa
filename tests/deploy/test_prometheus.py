"""Every dashboard and alert query runs on a real Prometheus that scraped real Baton endpoints.

Two real ``baton-sidecar`` processes serve /metrics; a fake trainer (this test) writes the SDK's
status file into their control directories with :mod:`trainer_sdk.control`, so the sidecars
observe committed saves exactly as they would from the SDK. The operator's real metrics server
(``baton_operator.client.metrics.serve``) runs in a thread, fed through its ``Metrics`` object as
the reconciler feeds it. Debian's Prometheus scrapes all three with the label conventions of
docs/observability.md, loads the alert rules, and then every PromQL expression of the dashboard
and of the rules is executed through the HTTP API.

The end-to-end version (the same queries during a real preemption in the local cluster) reuses
the ``prometheus_server`` fixture and ``dashboard_queries``/``rule_queries``/``substitute``
from :mod:`baton_testing.prometheus`.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import requests
from baton_operator.client.metrics import Metrics, serve
from baton_testing import prometheus
from baton_testing.ports import free_port
from baton_testing.prometheus import (
    PrometheusError,
    PrometheusServer,
    ScrapeTarget,
    substitute,
)
from baton_testing.sidecar_process import SidecarProcess

from trainer_sdk.control import ControlChannel, State, Status, format_rfc3339, utcnow

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "baton-dashboard.json"
RULES = ROOT / "deploy" / "prometheus" / "baton-rules.yaml"


def dashboard_queries() -> list[tuple[str, str]]:
    return prometheus.dashboard_queries(DASHBOARD)


def rule_queries() -> list[tuple[str, str]]:
    return prometheus.rule_queries(RULES)


class _OperatorMetricsServer:
    """``baton_operator.client.metrics.serve`` on its own event loop in a thread."""

    def __init__(self) -> None:
        self.metrics = Metrics()
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._runner = asyncio.run_coroutine_threadsafe(
            serve(self.metrics, port=self.port, host="127.0.0.1"), self._loop
        ).result(timeout=10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


@pytest.fixture
def operator_metrics() -> Iterator[_OperatorMetricsServer]:
    server = _OperatorMetricsServer()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def sidecars(tmp_path: Path) -> Iterator[list[SidecarProcess]]:
    procs = []
    try:
        for i in range(2):
            (tmp_path / f"pod{i}").mkdir()
            procs.append(SidecarProcess(tmp_path / f"pod{i}").start())
        # The sidecar takes the first status it sees as history from before its own restart
        # and does not count it. Give it an idle one to see first, as a starting trainer does.
        for proc in procs:
            ControlChannel(proc.control_dir).write_status(Status(state=State.IDLE))
        time.sleep(1.0)  # ten of the sidecar's 0.1 s status polls (SidecarProcess sets it)
        yield procs
    finally:
        for proc in procs:
            proc.stop()


def _last_committed_step(sidecar: SidecarProcess) -> float:
    for line in sidecar.metrics().splitlines():
        if line.startswith("baton_checkpoint_last_committed_step "):
            return float(line.split()[-1])
    return -1.0


def _wait(predicate: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


# Saves the fake trainer reports: (trigger, seconds, margin before the deadline or None).
SAVES = [
    ("periodic", 1.8, None),
    ("periodic", 2.2, None),
    ("notice", 4.5, 25.0),
    ("periodic", 1.9, None),
    ("notice", 6.0, 12.0),
]


def _report_saves(
    sidecar: SidecarProcess,
    rank_offset: int,
    saves: list[tuple[str, float, float | None]],
    first_step: int,
) -> None:
    """Write SDK statuses for ``saves``, one by one, as LOCAL_RANK=0 of a pod would."""
    channel = ControlChannel(sidecar.control_dir)
    for i, (trigger, seconds, margin) in enumerate(saves):
        step = first_step + 100 * i
        # Notice saves answer a request (periodic ones have none), as the SDK reports them.
        request_id = None if trigger == "periodic" else f"req-{step}"
        channel.write_status(
            Status(state=State.SAVING, step=step, trigger=trigger, request_id=request_id)
        )
        now = utcnow()
        channel.write_status(
            Status(
                state=State.COMMITTED,
                request_id=request_id,
                step=step,
                uri=f"file:///ckpt/step-{step:012d}",
                seconds=seconds + 0.1 * rank_offset,
                trigger=trigger,
                deadline=None if margin is None else now + timedelta(seconds=margin),
                phases={"plan": 0.2, "write": seconds - 0.4, "commit": 0.2},
                bytes=256 * 2**20,
                last_committed_step=step,
                updated=now,
            )
        )
        _wait(
            lambda step=step: _last_committed_step(sidecar) == step,  # type: ignore[misc]
            f"the sidecar to count step {step}",
        )


def _create_operator_series(m: Metrics) -> None:
    """Create the job's series at zero before anything happens, as the operator should.

    A counter or histogram series that appears with its first increment already counted shows
    no increase to rate(): Prometheus never saw it at zero.
    """
    job = {"namespace": "ml", "job": "demo"}
    for metric in (m.notice_to_commit, m.deadline_margin, m.preemptions, m.steps_lost):
        metric.labels(**job)
    m.steps_lost_total.labels(**job)
    for metric in (m.gpu_seconds_lost_total, m.notice_lead, m.restart_seconds):
        metric.labels(**job)
    for reason in ("preemption", "failure"):
        m.restarts.labels(**job, reason=reason)
    for source in ("aws", "karpenter"):
        m.notices.labels(source=source)


def _record_operator_events(m: Metrics) -> None:
    """What the operator records over a job's life: two preemptions, a crash, a resume."""
    job = {"namespace": "ml", "job": "demo"}
    for phase, count in (("Running", 1), ("Pending", 0), ("Succeeded", 2), ("Failed", 0)):
        m.jobs.labels(phase=phase).set(count)
    for source in ("aws", "karpenter"):
        m.notices.labels(source=source).inc()
    for notice_to_commit, margin in ((8.0, 22.0), (11.0, 19.0)):
        m.notice_to_commit.labels(**job).observe(notice_to_commit)
        m.deadline_margin.labels(**job).observe(margin)
        m.preemptions.labels(**job).inc()
        m.restarts.labels(**job, reason="preemption").inc()
        m.steps_lost.labels(**job).observe(0)
    m.restarts.labels(**job, reason="failure").inc()
    m.steps_lost.labels(**job).observe(37)
    m.steps_lost_total.labels(**job).inc(37)
    for lead in (120.0, 30.0):
        m.notice_lead.labels(**job).observe(lead)
    m.gpu_seconds_lost_total.labels(**job).inc(37 * 0.5 * 8)
    m.restart_seconds.labels(**job).observe(95.0)
    m.goodput.labels(**job).set(0.91)
    m.failure_budget.labels(**job).set(2)
    m.last_checkpoint.labels(**job).set(time.time())


def test_every_dashboard_and_alert_query_runs_on_scraped_data(
    prometheus_server: Callable[..., PrometheusServer],
    sidecars: list[SidecarProcess],
    operator_metrics: _OperatorMetricsServer,
) -> None:
    job = {"namespace": "ml", "job": "demo"}
    targets = [
        ScrapeTarget(name=f"sidecar-{i}", address=f"127.0.0.1:{s.port}", labels=job)
        for i, s in enumerate(sidecars)
    ]
    targets.append(
        ScrapeTarget(
            name="baton-operator",
            address=f"127.0.0.1:{operator_metrics.port}",
            honor_labels=True,
        )
    )
    # The job has been running for a while: its series exist before the scrapes begin (a
    # series born with its first increment already counted shows no increase to rate()).
    _create_operator_series(operator_metrics.metrics)
    for offset, sidecar in enumerate(sidecars):
        _report_saves(sidecar, offset, [SAVES[0], SAVES[2]], first_step=100)
    prom = prometheus_server(targets, rule_files=[RULES])
    prom.wait_for_targets(scrapes=2)

    # The events happen while Prometheus scrapes, so rate() sees them as increases.
    for offset, sidecar in enumerate(sidecars):
        _report_saves(sidecar, offset, SAVES, first_step=1000)
        deadline = format_rfc3339(utcnow() + timedelta(seconds=120))
        sidecar.post_checkpoint({"deadline": deadline, "reason": "test"}).raise_for_status()
    _record_operator_events(operator_metrics.metrics)
    prom.wait_for_targets(scrapes=3)

    # The sidecars' series carry the TrainingJob's labels; the operator's keep their own.
    sidecar_series = prom.series("baton_checkpoint_seconds_count")
    assert {(s["namespace"], s["job"]) for s in sidecar_series} == {("ml", "demo")}
    assert {s["trigger"] for s in sidecar_series} >= {"periodic", "notice"}
    assert {(s["namespace"], s["job"]) for s in prom.series("baton_preemptions_total")} == {
        ("ml", "demo")
    }

    queries = dashboard_queries() + rule_queries()
    assert len(queries) >= 20
    failures = []
    results: dict[str, list[dict[str, Any]]] = {}
    for where, expr in queries:
        try:
            results[where] = prom.query(substitute(expr))
        except Exception as e:  # collect all failures, not just the first
            failures.append(f"{where}: {e}")
    assert failures == []

    # Every dashboard query finds data: each metric it uses was exported and scraped.
    empty = [where for where, _ in dashboard_queries() if not results[where]]
    assert empty == []

    # The checkpoint-latency panel answers with real numbers in the range the trainer reported.
    latency = [w for w, e in dashboard_queries() if "baton_checkpoint_seconds_bucket" in e]
    assert len(latency) == 2
    for where in latency:
        by_trigger = {r["metric"]["trigger"]: float(r["value"][1]) for r in results[where]}
        assert set(by_trigger) == {"periodic", "notice"}, where
        for trigger, value in by_trigger.items():
            assert math.isfinite(value), (where, trigger)
            assert 1.0 <= value <= 10.0, (where, trigger, value)

    # The margin queries see only the operator's histogram (the sidecars' has other buckets):
    # the operator observed margins of 19 s and 22 s, inside its (10, 30] bucket.
    margins = [w for w, e in dashboard_queries() if "baton_checkpoint_deadline_margin_seconds" in e]
    assert len(margins) == 3
    for where in margins:
        (series,) = results[where]
        assert 10.0 < float(series["value"][1]) <= 30.0, (where, series)

    # The rules loaded into the server and evaluated without error.
    def rules_evaluated() -> bool:
        rules = [r for g in prom.rules() for r in g["rules"]]
        return len(rules) == 5 and all(r.get("lastEvaluation", "").startswith("2") for r in rules)

    _wait(rules_evaluated, "the alert rules to be evaluated", timeout=30)
    unhealthy = [
        (r["name"], r.get("lastError"))
        for g in prom.rules()
        for r in g["rules"]
        if r["health"] != "ok"
    ]
    assert unhealthy == []


def test_a_broken_query_is_reported_not_swallowed(
    prometheus_server: Callable[..., PrometheusServer],
) -> None:
    # The assertions above rest on query() raising for bad PromQL with Prometheus' message.
    prom = prometheus_server([])
    with pytest.raises(PrometheusError, match=r"bad_data: .*parse error"):
        prom.query(
            "histogram_quantile(0.5, sum by (le) (rate(baton_checkpoint_seconds_bucket[1m]))"
        )
    assert prom.query("vector(1)")[0]["value"][1] == "1"
    assert requests.get(f"{prom.url}/-/healthy", timeout=5).ok
