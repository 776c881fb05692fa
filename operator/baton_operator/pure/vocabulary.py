"""The operator's words: the SDK's as it reads them off a sidecar, and its own restart kinds.

The operator never imports the SDK (it talks HTTP, and its image has no torch), so the values
it compares are mirrored here from ``trainer_sdk.wire`` (``State``, ``Trigger``, ``Tier``).
``tests/operator/test_wire_vocabulary.py`` fails when either side has a value the other lacks
(and the CRD's enum of ``status.lastCheckpoint.tier`` is built from :class:`Tier`);
``tests/operator/test_sidecar_client.py`` checks the same through the real sidecar. The SDK's
save phases and liveness values are not mirrored: the operator does not read them.

:class:`RestartKind` and :class:`InterruptionSource` are the operator's own: they end up in
``status`` (``reason``, ``interruptions[].source``) and in metric labels.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final

__all__ = [
    "EMERGENCY_TRIGGERS",
    "NOTICE_SOURCES",
    "InterruptionSource",
    "RestartKind",
    "SaveState",
    "Tier",
    "Trigger",
]


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


class Tier(StrEnum):
    """Where a save committed (``status.json``'s ``tier``, ``trainer_sdk.wire.Tier``)."""

    DURABLE = "durable"
    MEMORY = "memory"
    """A notice committed to the ranks' memory tier, replicated to peers; not durable yet."""
    PROMOTED = "memory+promoted"
    """A memory commit whose promotion to the checkpoint uri has committed too."""


class RestartKind(StrEnum):
    """Why an attempt is replaced (``lifecycle.plan_restart``): the ``reason`` of the
    restart, and the ``reason`` label of ``baton_restarts_total`` (a suspend is not counted)."""

    PREEMPTION = "preemption"
    FAILURE = "failure"
    ELASTIC = "elastic"
    SUSPEND = "suspend"


class InterruptionSource(StrEnum):
    """What ended an attempt (``economics.Cause.source``, ``status.interruptions[].source``).

    The first seven are the node notices the operator reads (``notices.py``), most specific
    first; then the operator's own causes.
    """

    AWS = "aws"
    KARPENTER = "karpenter"
    GKE = "gke"
    AUTOSCALER = "autoscaler"
    CORDON = "cordon"
    OUT_OF_SERVICE = "out-of-service"
    DISRUPTION_TARGET = "disruption-target"
    SUSPEND = "suspend"
    """The save the operator asks for because ``spec.suspend`` is true."""
    NOTICE = "notice"
    """A notice whose source is unknown (the rank's own sidecar saw it)."""
    NODE_LOST = "node-lost"
    """A node gone without notice."""
    EVICTION = "eviction"
    """A rank saved on its own after a SIGTERM or a notice its sidecar saw."""
    FAILURE = "failure"


NOTICE_SOURCES: Final = (
    InterruptionSource.AWS,
    InterruptionSource.KARPENTER,
    InterruptionSource.GKE,
    InterruptionSource.AUTOSCALER,
    InterruptionSource.CORDON,
    InterruptionSource.OUT_OF_SERVICE,
    InterruptionSource.DISRUPTION_TARGET,
)
"""Values of ``Notice.source`` (and of the ``source`` label of ``baton_notices_total``), most
specific first."""
