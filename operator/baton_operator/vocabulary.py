"""The SDK's save vocabulary, as the operator reads it off a sidecar's ``GET /v1/status``.

The operator never imports the SDK (it talks HTTP, and its image has no torch), so the values
it compares are mirrored here from ``trainer_sdk.control`` (``State`` and ``Trigger``).
``tests/operator/test_sidecar_client.py`` checks, against the SDK's own enums and through the
real sidecar, that the two agree value for value. The SDK's save phases are not mirrored: the
operator does not read them.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final

__all__ = ["EMERGENCY_TRIGGERS", "SaveState", "Trigger"]


class SaveState(StrEnum):
    """What the SDK reports about its last save (``trainer_sdk.control.State``)."""

    IDLE = "idle"
    REQUESTED = "requested"
    SAVING = "saving"
    COMMITTED = "committed"
    FAILED = "failed"
    SKIPPED = "skipped"


class Trigger(StrEnum):
    """What caused a save (``trainer_sdk.control.Trigger``)."""

    PERIODIC = "periodic"
    MANUAL = "manual"
    NOTICE = "notice"
    SIGNAL = "signal"


EMERGENCY_TRIGGERS: Final = frozenset({Trigger.NOTICE, Trigger.SIGNAL})
"""Saves for a notice or a SIGTERM: the ones that can answer a checkpoint request."""
