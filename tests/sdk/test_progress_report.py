"""The training progress the SDK reports to its sidecar (``train_step``, ``step_seconds``).

The operator counts the steps an interruption lost, and prices them, from these two fields
(docs/operator.md, "Interruption history and goodput").
"""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer_sdk import _notices
from trainer_sdk._notices import HEARTBEAT_EVERY_S, StatusReporter
from trainer_sdk.control import ControlChannel, Status


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_heartbeats_report_the_step_and_the_mean_step_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = _Clock()
    monkeypatch.setattr(_notices.time, "monotonic", clock)
    channel = ControlChannel(tmp_path)
    reporter = StatusReporter(channel, local_rank=0, local_world_size=1)

    reporter.heartbeat(3)
    first = channel.read_status()
    assert first is not None
    assert first.train_step == 3
    assert first.step_seconds is None, "one point gives no rate"

    # Steps 4..9 within the throttle: nothing is written.
    for step in range(4, 10):
        clock.now += 0.5
        reporter.heartbeat(step)
    held = channel.read_status()
    assert held is not None
    assert held.train_step == 3

    # 20 steps of 0.5 s since the last written step: 0.5 s per step.
    clock.now = 1000.0 + 20 * 0.5
    assert clock.now - 1000.0 >= HEARTBEAT_EVERY_S
    reporter.heartbeat(23)
    second = channel.read_status()
    assert second is not None
    assert second.train_step == 23
    assert second.step_seconds == pytest.approx(0.5)

    # A heartbeat without a step (a save's wait) keeps both fields.
    clock.now += HEARTBEAT_EVERY_S
    reporter.heartbeat()
    third = channel.read_status()
    assert third is not None
    assert (third.train_step, third.step_seconds) == (23, 0.5)


def test_the_fields_round_trip_and_are_optional() -> None:
    status = Status(train_step=41, step_seconds=0.25)
    back = Status.from_json(status.to_json())
    assert (back.train_step, back.step_seconds) == (41, 0.25)
    old = {k: v for k, v in status.to_json().items() if k not in ("train_step", "step_seconds")}
    legacy = Status.from_json(old)
    assert (legacy.train_step, legacy.step_seconds) == (None, None)
