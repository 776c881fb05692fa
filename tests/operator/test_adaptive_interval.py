"""``checkpoint.everySeconds: auto``: Young's interval from the measured save cost and the
job's interruption rate, within bounds (interval.py), and how the ranks receive it.

The reconciler's use of it (recorded before the attempt's first pod, the same on every rank,
chosen afresh after a preemption) is in test_reconciler.py.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from baton_operator import interval, manifests
from baton_operator.interval import (
    DEFAULT_SAVE_SECONDS,
    MAX_SECONDS,
    MIN_SECONDS,
    PRIOR_MTBI_SECONDS,
    choose,
    young_daly,
)
from baton_operator.model import JobSpec
from baton_operator.settings import OperatorConfig

HOUR = 3600.0


def test_the_formula_is_youngs_square_root() -> None:
    assert young_daly(30, 6 * HOUR) == pytest.approx(math.sqrt(2 * 30 * 6 * HOUR))
    assert young_daly(30, 6 * HOUR) == pytest.approx(1138.42, abs=0.01)
    # Four times the save cost or four times the MTBI: twice the interval.
    assert young_daly(120, 6 * HOUR) == pytest.approx(2 * young_daly(30, 6 * HOUR))
    assert young_daly(30, 24 * HOUR) == pytest.approx(2 * young_daly(30, 6 * HOUR))


@pytest.mark.parametrize(("save", "mtbi"), [(0, HOUR), (-1, HOUR), (10, 0), (10, -5)])
def test_the_formula_refuses_inputs_without_meaning(save: float, mtbi: float) -> None:
    with pytest.raises(ValueError, match="must both be > 0"):
        young_daly(save, mtbi)


def test_a_new_job_uses_the_default_save_cost_and_the_prior() -> None:
    choice = choose(save_seconds=None, interruptions=0, observed_seconds=0)
    assert choice.save_seconds == DEFAULT_SAVE_SECONDS
    assert not choice.save_measured
    assert choice.mtbi_seconds == PRIOR_MTBI_SECONDS
    assert choice.seconds == round(young_daly(DEFAULT_SAVE_SECONDS, PRIOR_MTBI_SECONDS))
    assert choice.bounded is None


def test_repeated_preemptions_shorten_the_interval_and_a_quiet_pool_lengthens_it() -> None:
    measured = 20.0
    after = [
        choose(save_seconds=measured, interruptions=n, observed_seconds=2 * HOUR).seconds
        for n in range(5)
    ]
    assert after == sorted(after, reverse=True)
    assert len(set(after)) == 5, after
    quiet = [
        choose(save_seconds=measured, interruptions=0, observed_seconds=h * HOUR).seconds
        for h in (0, 12, 48, 96)
    ]
    assert quiet == sorted(quiet)
    assert len(set(quiet)) == 4, quiet
    # The MTBI is the job's observed life plus the prior, shared among its interruptions.
    c = choose(save_seconds=measured, interruptions=3, observed_seconds=2 * HOUR)
    assert c.mtbi_seconds == pytest.approx((2 * HOUR + PRIOR_MTBI_SECONDS) / 4)
    assert c.seconds == round(young_daly(measured, c.mtbi_seconds))


def test_the_bounds_hold_and_say_which_one_applied() -> None:
    fast = choose(save_seconds=0.5, interruptions=50, observed_seconds=HOUR)
    assert young_daly(0.5, fast.mtbi_seconds) < MIN_SECONDS
    assert (fast.seconds, fast.bounded) == (MIN_SECONDS, "min")
    slow = choose(save_seconds=600, interruptions=0, observed_seconds=30 * 24 * HOUR)
    assert young_daly(600, slow.mtbi_seconds) > MAX_SECONDS
    assert (slow.seconds, slow.bounded) == (MAX_SECONDS, "max")
    for save in (0.01, 1, 10, 100, 1000, 10000):
        for n in (0, 1, 10, 1000):
            for observed in (0, HOUR, 1000 * HOUR):
                s = choose(save_seconds=save, interruptions=n, observed_seconds=observed).seconds
                assert MIN_SECONDS <= s <= MAX_SECONDS


def test_a_zero_or_missing_save_time_is_not_a_measurement() -> None:
    assert not choose(save_seconds=0, interruptions=0, observed_seconds=0).save_measured
    with pytest.raises(ValueError, match="interruptions"):
        choose(save_seconds=1, interruptions=-1, observed_seconds=0)


def _job(**status: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "tj",
            "namespace": "team",
            "creationTimestamp": "2026-01-01T00:00:00Z",
        },
        "spec": {
            "replicas": 2,
            "template": {"spec": {"containers": [{"name": "trainer", "image": "t:1"}]}},
            "checkpoint": {"uri": "s3://b/tj", "everySeconds": "auto", "everySteps": 50},
        },
        "status": status,
    }


def test_the_choice_reads_the_jobs_status_and_its_life() -> None:
    job = _job(preemptions=2, failures=1, lastCheckpoint={"step": 40, "seconds": 12.5})
    at = datetime(2026, 1, 1, 3, tzinfo=UTC)
    choice = interval.for_job(job, at=at)
    assert (choice.save_seconds, choice.save_measured) == (12.5, True)
    assert (choice.interruptions, choice.observed_seconds) == (3, 3 * HOUR)
    assert (
        choice.seconds
        == choose(save_seconds=12.5, interruptions=3, observed_seconds=3 * HOUR).seconds
    )
    status = choice.to_status(attempt=3)
    assert status["attempt"] == 3
    assert status["seconds"] == choice.seconds
    job["status"]["checkpointInterval"] = status
    assert interval.recorded(job, 3) == choice.seconds
    assert interval.recorded(job, 4) is None, "a new attempt chooses afresh"
    assert interval.for_job(job, at=at + timedelta(hours=21)).seconds > choice.seconds


def test_auto_gives_the_ranks_the_chosen_interval_and_keeps_every_steps() -> None:
    spec = JobSpec.from_body(_job())
    assert spec.auto_interval
    assert spec.every_seconds is None
    kw: dict[str, Any] = {
        "attempt": 0,
        "rank": 0,
        "replicas": 2,
        "master_addr": None,
        "resume_step": None,
    }
    with pytest.raises(ValueError, match="everySeconds is auto: pass the interval"):
        manifests.pod_manifest(spec, OperatorConfig(), **kw)
    pod = manifests.pod_manifest(spec, OperatorConfig(), every_seconds=321, **kw)
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["BATON_EVERY_SECONDS"] == "321"
    assert env["BATON_EVERY_STEPS"] == "50"
    fixed = JobSpec.from_body(
        {**_job(), "spec": {**_job()["spec"], "checkpoint": {"uri": "s3://b", "everySeconds": 90}}}
    )
    assert not fixed.auto_interval
    pod = manifests.pod_manifest(fixed, OperatorConfig(), **kw)
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["BATON_EVERY_SECONDS"] == "90"
