"""This local rank's status file for the sidecar: :class:`StatusReporter`.

Every part of the Checkpointer that finishes something reports here (a routine commit, a
promotion, each state of a notice, the step restore loaded), and so do the integrations that
serve notices themselves (Lightning, the DCP loop). It sits below all of them, so that each
imports it instead of being handed a callback.

Log records go to the ``trainer_sdk.checkpointer`` logger, where users (and tests) already
listen for the Checkpointer's messages.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from datetime import UTC, datetime
from typing import Any, Final

from trainer_sdk.control import ControlChannel, Status
from trainer_sdk.wire import State

__all__ = ["HEARTBEAT_EVERY_S", "StatusReporter"]

log = logging.getLogger("trainer_sdk.checkpointer")

HEARTBEAT_EVERY_S: Final = 5.0
"""Seconds between heartbeats of the status file while training runs (the sidecar's liveness
reads its age)."""


class StatusReporter:
    """This local rank's status file: every local rank reports in its own, and the sidecar
    folds them into one pod status. Without a control channel it only keeps the status."""

    def __init__(
        self, channel: ControlChannel | None, *, local_rank: int, local_world_size: int
    ) -> None:
        self._channel = channel
        self._lock = threading.Lock()
        self._last_beat = 0.0
        self._progress: tuple[float, int] | None = None
        """(monotonic time, step) of the first training step this process reported."""
        self._status = Status(
            state=State.IDLE, local_rank=local_rank, local_world_size=local_world_size
        )
        self._write(self._status)

    @property
    def status(self) -> Status:
        """The status last written."""
        return self._status

    def update(self, **changes: Any) -> None:
        """Change fields of the status and write it (a state change also stamps ``updated``)."""
        with self._lock:
            status = dataclasses.replace(self._status, **changes) if changes else self._status
            if changes and "updated" not in changes and "state" in changes:
                status = dataclasses.replace(status, updated=datetime.now(UTC))
            status = status.beat()
            self._status = status
            self._write(status)

    def heartbeat(self, step: int | None = None) -> None:
        """Rewrite the status with a fresh heartbeat, at most every ``HEARTBEAT_EVERY_S``.

        ``step``: the training step just finished, reported as ``train_step``, with the mean
        wall seconds per step since the first step this process reported (``step_seconds``).
        The first step and the first one after it are written at once, whatever the
        throttle, so that the operator learns a new attempt's progress and step time from
        its first steps (restart time, goodput).
        """
        now = time.monotonic()
        eager = False
        if step is not None:
            if self._progress is None:
                self._progress = (now, step)
                eager = True
            elif self._status.step_seconds is None and step > self._progress[1]:
                eager = True
        if not eager and now - self._last_beat < HEARTBEAT_EVERY_S:
            return
        self._last_beat = now
        if step is None or self._progress is None:
            self.update()
            return
        changes: dict[str, Any] = {"train_step": step}
        first_at, first_step = self._progress
        if step > first_step:
            changes["step_seconds"] = round((now - first_at) / (step - first_step), 6)
        self.update(**changes)

    def _write(self, status: Status) -> None:
        if self._channel is None:
            return
        try:
            self._channel.write_status(status)
        except OSError as e:
            log.warning("could not write a status file in %s: %s", self._channel.directory, e)
