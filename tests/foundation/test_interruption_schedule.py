"""The goodput benchmark's interruption schedule: seeded, drawn from its stated model, replayable.

``bench/goodput.py`` runs every method on one schedule; these pin down that a seed gives one
schedule, that the model's parameters are what the draw follows, and that a file round-trips.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from baton_testing.interruption_schedule import (
    ScheduleModel,
    draw_schedule,
    load_schedule,
    save_schedule,
)


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another() -> None:
    model = ScheduleModel(seed=7, mean_seconds_between=30, horizon_seconds=600)
    first, again = draw_schedule(model), draw_schedule(model)
    assert first == again
    assert len(first.interruptions) > 5
    other = draw_schedule(ScheduleModel(seed=8, mean_seconds_between=30, horizon_seconds=600))
    assert other.interruptions != first.interruptions


def test_arrivals_follow_the_mean_gap_and_kinds_the_proportions() -> None:
    model = ScheduleModel(
        seed=1, mean_seconds_between=10, horizon_seconds=200_000, proportions=(0.5, 0.3, 0.2)
    )
    events = draw_schedule(model).interruptions
    times = [e.at_seconds for e in events]
    assert times == sorted(times)
    assert all(0 < t < 200_000 for t in times)
    mean_gap = times[-1] / len(times)
    assert 9.5 < mean_gap < 10.5
    kinds = Counter(e.kind for e in events)
    assert abs(kinds["aws"] / len(events) - 0.5) < 0.02
    assert abs(kinds["kill"] / len(events) - 0.2) < 0.02
    assert {e.rank for e in events} == {0, 1}
    assert {e.notice_seconds for e in events} == {120, 30, 0}


def test_a_fixed_count_and_a_minimum_gap() -> None:
    model = ScheduleModel(
        seed=3, mean_seconds_between=5, horizon_seconds=1000, max_interruptions=2,
        min_gap_seconds=40,
    )  # fmt: skip
    events = draw_schedule(model).interruptions
    assert len(events) == 2
    assert events[1].at_seconds - events[0].at_seconds >= 40


def test_a_schedule_file_round_trips_and_a_bad_one_names_the_fix(tmp_path: Path) -> None:
    schedule = draw_schedule(ScheduleModel(seed=5, horizon_seconds=900))
    path = tmp_path / "schedule.json"
    save_schedule(schedule, path)
    assert load_schedule(path).interruptions == schedule.interruptions
    raw = json.loads(path.read_text())
    raw["interruptions"][0]["kind"] = "azure"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="one of aws, gke, kill"):
        load_schedule(path)
    del raw["interruptions"][0]["rank"]
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="needs at_seconds, kind"):
        load_schedule(path)


def test_proportions_must_sum_to_one() -> None:
    with pytest.raises(ValueError, match="must sum to 1"):
        ScheduleModel(proportions=(0.5, 0.5, 0.5))
