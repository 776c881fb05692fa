"""The training progress the SDK reports to its sidecar (``train_step``, ``step_seconds``).

The operator counts the steps an interruption lost, and prices them, from these two fields
(docs/operator.md, "Interruption history and goodput").
"""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer_sdk.control import ControlChannel, Status
from trainer_sdk.loop import _status
from trainer_sdk.loop._status import HEARTBEAT_EVERY_S, StatusReporter


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _read(channel: ControlChannel) -> Status:
    status = channel.read_status()
    assert status is not None
    return status


def test_heartbeats_report_the_step_and_the_mean_step_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = _Clock()
    monkeypatch.setattr(_status.time, "monotonic", clock)
    channel = ControlChannel(tmp_path)
    reporter = StatusReporter(channel, local_rank=0, local_world_size=1)

    reporter.heartbeat(3)  # a resumed attempt's first step
    first = _read(channel)
    assert first.train_step == 3
    assert first.step_seconds is None, "one point gives no rate"

    # The next step is written at once, throttle or not: the operator learns the step time
    # from an attempt's first two steps.
    clock.now += 0.5
    reporter.heartbeat(4)
    second = _read(channel)
    assert (second.train_step, second.step_seconds) == (4, 0.5)

    # Then the throttle holds: steps 5..9 within HEARTBEAT_EVERY_S write nothing.
    for step in range(5, 10):
        clock.now += 0.5
        reporter.heartbeat(step)
    assert _read(channel).train_step == 4

    # The mean since the first reported step: 20 steps in 12 s.
    clock.now = 1000.0 + 12.0
    assert clock.now - 1000.5 >= HEARTBEAT_EVERY_S
    reporter.heartbeat(23)
    third = _read(channel)
    assert third.train_step == 23
    assert third.step_seconds == pytest.approx(0.6)

    # A heartbeat without a step (a save's wait) keeps both fields.
    clock.now += HEARTBEAT_EVERY_S
    reporter.heartbeat()
    fourth = _read(channel)
    assert (fourth.train_step, fourth.step_seconds) == (23, pytest.approx(0.6))


def test_the_same_step_again_is_not_written_eagerly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = _Clock()
    monkeypatch.setattr(_status.time, "monotonic", clock)
    channel = ControlChannel(tmp_path)
    reporter = StatusReporter(channel, local_rank=0, local_world_size=1)
    reporter.heartbeat(7)
    written = _read(channel).heartbeat
    clock.now += 0.1
    reporter.heartbeat(7)
    assert _read(channel).heartbeat == written, "no rate to learn from the same step"


def test_the_fields_round_trip_and_are_optional() -> None:
    status = Status(train_step=41, step_seconds=0.25)
    back = Status.from_json(status.to_json())
    assert (back.train_step, back.step_seconds) == (41, 0.25)
    old = {k: v for k, v in status.to_json().items() if k not in ("train_step", "step_seconds")}
    legacy = Status.from_json(old)
    assert (legacy.train_step, legacy.step_seconds) == (None, None)
