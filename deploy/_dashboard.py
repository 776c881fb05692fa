"""Baton's Grafana dashboard, built from a short list of panels (deploy/generate.py writes it).

Written as code rather than 600 lines of hand-edited JSON so that every query is in one
readable place, the layout stays consistent, and tests/deploy/ can run each query against a
real Prometheus. Only metric names from docs/contracts.md appear here.

Label conventions (docs/observability.md): per-job series carry ``namespace`` and ``job`` (the
TrainingJob's namespace and name); the operator sets them itself, the sidecars get them from the
scrape configuration.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Final

__all__ = ["UID", "dashboard"]

UID: Final = "baton-overview"

# Dashboard variables: the datasource, then the TrainingJob namespace and name. Both are
# multi-value with "All" = ".*", so every per-job query filters with =~.
_SEL: Final = 'namespace=~"$namespace", job=~"$job"'
_RATE: Final = "$__rate_interval"
# The operator and the sidecars both export baton_checkpoint_deadline_margin_seconds and
# baton_notices_total (docs/contracts.md), with different buckets and sources. Summing the two
# would double-count and, for histograms, mix bucket boundaries. Every sidecar exports
# baton_checkpoint_phase_seconds from its start, so "unless" on the scrape target's instance
# keeps the operator's series whatever the scrape configuration calls its jobs.
_OPERATOR_ONLY: Final = "unless on (instance) baton_checkpoint_phase_seconds_count"


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Target:
    expr: str
    """The PromQL expression (Grafana variables allowed)."""
    legend: str
    """Grafana legend format, e.g. ``p95 {{trigger}}``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Panel:
    title: str
    description: str
    """Shown as the panel's (i) tooltip: what the panel answers and how to read it."""
    targets: tuple[_Target, ...]
    unit: str
    """A Grafana unit id: ``s``, ``Bps``, ``short``, ..."""
    kind: str = "timeseries"
    width: int = 12
    stacked: bool = False
    bars: bool = False
    thresholds: tuple[tuple[float, str], ...] = ()
    """Extra (value, color) steps above the base green, drawn as lines/areas on the panel."""


def _quantiles(
    metric: str, by: str, qs: tuple[float, ...], legend: str, *, operator_only: bool = False
) -> tuple[_Target, ...]:
    only = f" {_OPERATOR_ONLY}" if operator_only else ""
    return tuple(
        _Target(
            expr=(
                f"histogram_quantile({q}, sum by (le, {by}) "
                f"(rate({metric}_bucket{{{_SEL}}}[{_RATE}]){only}))"
            ),
            legend=f"p{round(q * 100):02d} {legend}",
        )
        for q in qs
    )


_PANELS: Final[tuple[_Panel, ...]] = (
    _Panel(
        title="Checkpoint duration by trigger (p50, p95)",
        description=(
            "Total save time as the SDK reports it, from the agreed step to the commit of the "
            "manifest, split by what triggered the save (periodic, notice, signal). Notice "
            "saves must fit in the preemption window: compare with the deadline panel."
        ),
        targets=_quantiles("baton_checkpoint_seconds", "trigger", (0.5, 0.95), "{{trigger}}"),
        unit="s",
    ),
    _Panel(
        title="Notice to commit against the deadline",
        description=(
            "From the moment the operator saw a preemption notice to the commit of the "
            "checkpoint it asked for (p50, p95), with the margin that was left before the "
            "deadline (p05: the slimmest saves). The deadline itself is notice-to-commit plus "
            "margin; a margin near zero means the next notice may be missed."
        ),
        targets=(
            *_quantiles(
                "baton_checkpoint_notice_to_commit_seconds",
                "namespace, job",
                (0.5, 0.95),
                "notice→commit {{namespace}}/{{job}}",
            ),
            *_quantiles(
                "baton_checkpoint_deadline_margin_seconds",
                "namespace, job",
                (0.05,),
                "margin left {{namespace}}/{{job}}",
                operator_only=True,
            ),
        ),
        unit="s",
    ),
    _Panel(
        title="Deadline margin (p05, p50)",
        description=(
            "Deadline minus commit time of notice checkpoints, as the operator saw every rank "
            "commit. Below zero the save missed the deadline and the job resumes from an "
            "older checkpoint; the alert BatonCheckpointNearDeadline fires when p05 falls "
            "under 10 s."
        ),
        targets=_quantiles(
            "baton_checkpoint_deadline_margin_seconds",
            "namespace, job",
            (0.05, 0.5),
            "{{namespace}}/{{job}}",
            operator_only=True,
        ),
        unit="s",
        thresholds=((-1e9, "red"), (0, "orange"), (10, "green")),
    ),
    _Panel(
        title="Preemptions and restarts",
        description=(
            "Preemptions handled by the operator, and restarts by reason (preemption, failure, "
            "elastic), per interval. Three restarts in 30 minutes raise BatonRestartLoop."
        ),
        targets=(
            _Target(
                expr=(
                    "sum by (namespace, job) "
                    f"(increase(baton_preemptions_total{{{_SEL}}}[{_RATE}]))"
                ),
                legend="preemptions {{namespace}}/{{job}}",
            ),
            _Target(
                expr=f"sum by (reason) (increase(baton_restarts_total{{{_SEL}}}[{_RATE}]))",
                legend="restarts: {{reason}}",
            ),
        ),
        unit="short",
        bars=True,
    ),
    _Panel(
        title="Steps lost",
        description=(
            "Training steps redone after restarts: the steps between the last committed "
            "checkpoint and the step where the job stopped. A preemption handled in time "
            "loses none; a crash loses up to one checkpoint period."
        ),
        targets=(
            _Target(
                expr=(
                    f"sum by (namespace, job) (increase(baton_steps_lost_total{{{_SEL}}}[{_RATE}]))"
                ),
                legend="lost {{namespace}}/{{job}}",
            ),
            *_quantiles(
                "baton_steps_lost_per_restart", "namespace, job", (0.95,), "per restart {{job}}"
            ),
        ),
        unit="short",
        bars=True,
    ),
    _Panel(
        title="Goodput",
        description=(
            "Productive step time over wall time since the job was created (time suspended "
            "not counted): the job's current step times its measured step time. An estimate "
            "from the ranks' reports (docs/observability.md). BatonLowGoodput fires below "
            "0.8 for 30 minutes; status.interruptions says where the rest went."
        ),
        targets=(
            _Target(
                expr=f"max by (namespace, job) (baton_goodput_ratio{{{_SEL}}})",
                legend="{{namespace}}/{{job}}",
            ),
        ),
        unit="percentunit",
        thresholds=((0, "red"), (0.8, "green")),
    ),
    _Panel(
        title="GPU-seconds lost",
        description=(
            "What the steps lost cost: steps lost x the measured step time x the attempt's "
            "GPUs (its pods' nvidia.com/gpu requests), per interval. Zero for jobs without "
            "GPUs; an estimate, like the steps it prices."
        ),
        targets=(
            _Target(
                expr=(
                    "sum by (namespace, job) "
                    f"(increase(baton_gpu_seconds_lost_total{{{_SEL}}}[{_RATE}]))"
                ),
                legend="lost {{namespace}}/{{job}}",
            ),
        ),
        unit="s",
        bars=True,
    ),
    _Panel(
        title="Notice lead time against notice to durable",
        description=(
            "How much time the notices gave (notice to deadline, p05 and p50) against how "
            "long the saves took to become durable (notice to every rank's commit, p50 and "
            "p95). When the second approaches the first, the next notice may be missed."
        ),
        targets=(
            *_quantiles(
                "baton_notice_lead_seconds",
                "namespace, job",
                (0.05, 0.5),
                "lead {{namespace}}/{{job}}",
            ),
            *_quantiles(
                "baton_checkpoint_notice_to_commit_seconds",
                "namespace, job",
                (0.5, 0.95),
                "durable {{namespace}}/{{job}}",
            ),
        ),
        unit="s",
    ),
    _Panel(
        title="Restart time (p50, p95)",
        description=(
            "From the last good step before an interruption to the first step of the next "
            "attempt: the save, the pods' scheduling and start, and the restore."
        ),
        targets=_quantiles(
            "baton_restart_seconds", "namespace, job", (0.5, 0.95), "{{namespace}}/{{job}}"
        ),
        unit="s",
    ),
    _Panel(
        title="Save throughput",
        description=(
            "Checkpoint bytes written per second of save time (bytes over the summed save "
            "durations), and the average write rate over wall time. A falling save "
            "throughput with steady sizes points at the storage."
        ),
        targets=(
            _Target(
                expr=(
                    "sum by (namespace, job) "
                    f"(rate(baton_checkpoint_bytes_total{{{_SEL}}}[{_RATE}]))"
                    " / sum by (namespace, job) "
                    f"(rate(baton_checkpoint_seconds_sum{{{_SEL}}}[{_RATE}]))"
                ),
                legend="while saving {{namespace}}/{{job}}",
            ),
            _Target(
                expr=(
                    "sum by (namespace, job) "
                    f"(rate(baton_checkpoint_bytes_total{{{_SEL}}}[{_RATE}]))"
                ),
                legend="average {{namespace}}/{{job}}",
            ),
        ),
        unit="Bps",
    ),
    _Panel(
        title="Checkpoint phases (p95)",
        description=(
            "Where save time goes, per rank: drain (an async save in flight, before an "
            "emergency save), flatten, plan, write, hash (overlaps write), commit."
        ),
        targets=_quantiles("baton_checkpoint_phase_seconds", "phase", (0.95,), "{{phase}}"),
        unit="s",
    ),
    _Panel(
        title="Checkpoint requests and notices",
        description=(
            "Checkpoint requests served by the sidecars by result (committed, failed, "
            "skipped: too little time left to finish), and the preemption notices the "
            "operator saw, by source (aws, karpenter, gke, ..., disruption-target)."
        ),
        targets=(
            _Target(
                expr=(
                    "sum by (result) "
                    f"(increase(baton_checkpoint_requests_total{{{_SEL}}}[{_RATE}]))"
                ),
                legend="requests: {{result}}",
            ),
            _Target(
                expr=(f"sum by (source) (increase(baton_notices_total[{_RATE}]) {_OPERATOR_ONLY})"),
                legend="notices: {{source}}",
            ),
        ),
        unit="short",
        bars=True,
    ),
    _Panel(
        title="Jobs by phase",
        description="TrainingJobs the operator runs, by status.phase.",
        targets=(_Target(expr="sum by (phase) (baton_jobs)", legend="{{phase}}"),),
        unit="short",
        stacked=True,
    ),
    _Panel(
        title="Time since last checkpoint",
        description=(
            "Age of each job's newest committed checkpoint: what a hard node loss would cost "
            "now. BatonNoRecentCheckpoint fires above one hour."
        ),
        targets=(
            _Target(
                expr=(
                    "time() - max by (namespace, job) "
                    f"(baton_last_checkpoint_timestamp_seconds{{{_SEL}}})"
                ),
                legend="{{namespace}}/{{job}}",
            ),
        ),
        unit="s",
        thresholds=((1800, "orange"), (3600, "red")),
    ),
    _Panel(
        title="Last committed step",
        description="The newest committed step each job's ranks report.",
        targets=(
            _Target(
                expr=(f"max by (namespace, job) (baton_checkpoint_last_committed_step{{{_SEL}}})"),
                legend="{{namespace}}/{{job}}",
            ),
        ),
        unit="short",
        kind="stat",
        width=6,
    ),
    _Panel(
        title="Failure budget remaining",
        description=(
            "Failures (not preemptions) a job may still have before it is marked Failed. "
            "BatonFailureBudgetNearlySpent fires at one."
        ),
        targets=(
            _Target(
                expr=f"min by (namespace, job) (baton_failure_budget_remaining{{{_SEL}}})",
                legend="{{namespace}}/{{job}}",
            ),
        ),
        unit="short",
        kind="stat",
        width=6,
        thresholds=((0, "red"), (1, "orange"), (2, "green")),
    ),
)


def _panel_json(panel: _Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    steps: list[dict[str, Any]] = [{"color": "green", "value": None}]
    steps += [{"color": color, "value": value} for value, color in panel.thresholds]
    custom: dict[str, Any] = {}
    if panel.kind == "timeseries":
        custom = {
            "drawStyle": "bars" if panel.bars else "line",
            "fillOpacity": 30 if (panel.bars or panel.stacked) else 0,
            "stacking": {"mode": "normal" if panel.stacked else "none", "group": "A"},
            "thresholdsStyle": {"mode": "line" if panel.thresholds else "off"},
        }
    return {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {
            "defaults": {
                "unit": panel.unit,
                "custom": custom,
                "thresholds": {"mode": "absolute", "steps": steps},
            },
            "overrides": [],
        },
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}}
        if panel.kind == "timeseries"
        else {"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "value"},
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "expr": target.expr,
                "legendFormat": target.legend,
            }
            for i, target in enumerate(panel.targets)
        ],
    }


def _variable(name: str, label: str, metric: str) -> dict[str, Any]:
    query = f"label_values({metric}, {name})"
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "definition": query,
        "query": {"query": query, "refId": f"{name}-values"},
        "refresh": 2,
        "multi": True,
        "includeAll": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
    }


def dashboard() -> dict[str, Any]:
    """The dashboard JSON (a fresh dict), ready for Grafana's import or its sidecar."""
    panels: list[dict[str, Any]] = []
    x = y = 0
    for panel_id, panel in enumerate(_PANELS, start=1):
        if x + panel.width > 24:
            x, y = 0, y + 8
        panels.append(_panel_json(panel, panel_id, x, y))
        x += panel.width
    return {
        "uid": UID,
        "title": "Baton: checkpoints and preemptions",
        "description": (
            "How long checkpoints take, how close they come to the preemption deadline, and "
            "what preemptions cost. docs/observability.md explains each panel."
        ),
        "tags": ["baton", "training", "spot"],
        "timezone": "utc",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "time": {"from": "now-24h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                },
                # The operator exports the budget gauge for every job it runs, so these list
                # exactly the TrainingJobs it knows.
                _variable("namespace", "Namespace", "baton_failure_budget_remaining"),
                _variable(
                    "job",
                    "TrainingJob",
                    'baton_failure_budget_remaining{namespace=~"$namespace"}',
                ),
            ]
        },
        "annotations": {"list": []},
        "panels": panels,
    }
