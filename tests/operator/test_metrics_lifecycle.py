"""Per-job operator series follow the job's life: seeded, dropped when finished or deleted.

Without this, a Succeeded job kept ``baton_last_checkpoint_timestamp_seconds`` at its last
commit forever and ``BatonNoRecentCheckpoint`` fired an hour later; a job's first preemption
was invisible to ``increase()`` because its counter series appeared at 1, not 0.
"""

from __future__ import annotations

from baton_operator.client.metrics import Metrics
from prometheus_client.parser import text_string_to_metric_families


def _samples(m: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _job_series(m: Metrics, name: str) -> set[str]:
    return {n for n, labels in _samples(m) if ("job", name) in labels}


JOB = (("job", "a"), ("namespace", "ns"))


def test_a_running_job_has_zeroed_counters_and_seeded_gauges() -> None:
    m = Metrics()
    m.job_running("ns", "a", failures_left=3, last_checkpoint=1000.0)
    s = _samples(m)
    assert s[("baton_preemptions_total", JOB)] == 0
    assert s[("baton_steps_lost_total", JOB)] == 0
    assert s[("baton_failure_budget_remaining", JOB)] == 3
    assert s[("baton_last_checkpoint_timestamp_seconds", JOB)] == 1000.0
    # later reconciles do not reset what commits and restarts set since
    m.last_checkpoint.labels("ns", "a").set(2000.0)
    m.job_running("ns", "a", failures_left=3, last_checkpoint=1000.0)
    assert _samples(m)[("baton_last_checkpoint_timestamp_seconds", JOB)] == 2000.0


def test_a_finished_job_loses_its_gauges_and_a_deleted_one_everything() -> None:
    m = Metrics()
    m.job_running("ns", "a", failures_left=1, last_checkpoint=1.0)
    m.job_running("ns", "b", failures_left=1, last_checkpoint=1.0)
    m.preemptions.labels("ns", "a").inc()
    m.count_restart("ns", "a", "preemption")
    m.count_restart("ns", "a", "failure")
    m.notice_to_commit.labels("ns", "a").observe(3.0)
    m.checkpoint_interval.labels("ns", "a").set(600)
    m.job_finished("ns", "a")
    left = _job_series(m, "a")
    assert "baton_checkpoint_interval_seconds" not in left
    assert "baton_last_checkpoint_timestamp_seconds" not in left
    assert "baton_failure_budget_remaining" not in left
    assert "baton_preemptions_total" in left  # counters stay while the job object exists
    assert "baton_restarts_total" in left
    m.job_deleted("ns", "a")
    assert _job_series(m, "a") == set()
    # the other job is untouched, and forgetting an unknown job is harmless
    assert "baton_last_checkpoint_timestamp_seconds" in _job_series(m, "b")
    m.job_deleted("ns", "never-seen")
    m.job_finished("ns", "never-seen")
