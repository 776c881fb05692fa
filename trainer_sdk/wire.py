"""The words and numbers the SDK, the sidecar and the operator exchange: one definition each.

Every value here crosses a process boundary: the SDK writes it in ``status.json`` or a manifest,
or exits with it; the sidecar reads it, counts it in metrics and serves it on ``GET /v1/status``;
the operator compares it when it decides what a job's save, restore or exit meant. The control
channel's file I/O (``trainer_sdk.control``) is kept apart from these values, so a reader of the
protocol finds the vocabulary in one short module.

This module must stay torch-free and import nothing of the SDK: the sidecar imports it. The
operator, which may not import the SDK, mirrors these values in ``baton_operator.pure.vocabulary``;
``tests/operator/test_wire_vocabulary.py`` fails when either side has a value the other lacks.
"""

from __future__ import annotations

import enum
from typing import Final

__all__ = [
    "EXIT_RESTART_IN_PLACE",
    "EXIT_STOPPED_AFTER_NOTICE",
    "ROUTINE_TRIGGERS",
    "Liveness",
    "SavePhase",
    "State",
    "Tier",
    "Trigger",
]

EXIT_STOPPED_AFTER_NOTICE: Final = 75
"""Exit code of a trainer that stopped because ``Checkpointer.step()`` returned True
(``EX_TEMPFAIL``: try again later). Launchers may replace it (torchrun exits 1 when a worker
exits 75), so the operator takes the status of the save, not the exit code, as the truth."""

EXIT_RESTART_IN_PLACE: Final = 76
"""Exit code of a trainer that stopped because ``Checkpointer.step()`` returned True after a
notice's save committed to the memory tier (``Checkpointer.exit_code``). The operator keeps
the pods that are not on the noticed node (their sidecar and memory), and the trainer
container's restart rule, which restarts every code but 0 and 75, restarts it in place: it
restores the committed step from memory. Like 75, a launcher may replace it (torchrun's 1
is restarted all the same)."""


class State(enum.StrEnum):
    """What the SDK is doing about checkpoints, as written in ``status.json``."""

    IDLE = "idle"
    """No save reported yet since start-up."""
    REQUESTED = "requested"
    """The SDK has taken a request and the ranks are agreeing on the step to save at."""
    SAVING = "saving"
    """A save is being written."""
    COMMITTED = "committed"
    """The last save finished and its manifest is written."""
    FAILED = "failed"
    """The last save failed; ``error`` says why."""
    SKIPPED = "skipped"
    """The SDK declined the request (for example, the deadline left too little time)."""


class Trigger(enum.StrEnum):
    """What caused a save, as the SDK writes it in the manifest and in ``status.json``.

    These are the triggers the SDK itself produces. ``trainer_sdk.save(trigger=...)`` and
    ``Checkpointer.save(trigger=...)`` also accept a caller's own word (the manifest keeps it);
    the sidecar's metrics count such saves under ``other``.
    """

    PERIODIC = "periodic"
    """A save by the Checkpointer's policy (every N steps or seconds), or the integrations'."""
    MANUAL = "manual"
    """An explicit ``Checkpointer.save()`` (for example the final save of a run)."""
    NOTICE = "notice"
    """An emergency save for a notice: a request from the sidecar or the API, maybe with a
    SIGTERM as well."""
    SIGNAL = "signal"
    """An emergency save for a SIGTERM alone (no request, no API notice)."""


ROUTINE_TRIGGERS: Final = frozenset({Trigger.PERIODIC, Trigger.MANUAL})
"""Saves made by policy or by an explicit save(): they answer no request."""


class Tier(enum.StrEnum):
    """Where a commit (or a restore) went, as written in ``status.json`` (``tier``,
    ``restored_tier``): the SDK, the sidecar and the operator read the same words."""

    DURABLE = "durable"
    """The checkpoint uri (object storage or a shared filesystem): survives anything."""
    MEMORY = "memory"
    """The memory tier (``fast_dir``) of every pod, replicated to a peer on another node:
    survives the loss of any one node; made durable later by its promotion."""
    PROMOTED = "memory+promoted"
    """A memory commit whose promotion to the checkpoint uri has since committed too."""


class SavePhase(enum.StrEnum):
    """The phases a save reports in ``status.json`` (``phases``: seconds per phase, this rank).

    A save reports the phases it went through: ``trainer_sdk.save`` flatten, plan, write,
    hash, commit; a Checkpointer's periodic save write, hash, commit (it flattens and plans
    before the step is staged); an emergency save drain, plan, write, hash, commit.
    """

    DRAIN = "drain"
    """Waiting for an async save in flight to finish (emergency saves only)."""
    FLATTEN = "flatten"
    """Taking the state dict apart into tensors and a JSON tree."""
    PLAN = "plan"
    """Deciding which rank writes what (for an emergency save: also the time estimate and the
    ranks' agreement on it)."""
    WRITE = "write"
    """Writing this rank's files."""
    HASH = "hash"
    """Hashing this rank's shards: part of ``write`` (the writing thread hashes what it writes;
    not added to it)."""
    COMMIT = "commit"
    """Gathering every rank's record and writing the manifest."""


class Liveness(enum.StrEnum):
    """How the sidecar sees the trainer, from the age of the status heartbeat."""

    ALIVE = "alive"
    SILENT = "silent"
    ABSENT = "absent"
