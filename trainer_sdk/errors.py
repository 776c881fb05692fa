"""The SDK's errors: one base class, so callers can catch everything Baton raises at once.

The split that matters to a caller is *what to do next*:

* :class:`CheckpointError` and its subclasses: this checkpoint (or this save) is unusable.
  :class:`CorruptCheckpointError` and :class:`IncompleteCheckpointError` mean "fall back to an
  older step"; :class:`ManifestError` means the manifest is malformed or hostile and nothing
  it names was read.
* :class:`CollectiveTimeoutError` and :class:`RankFailedError`: a multi-rank save could not be
  agreed on. Every rank raises the same error, naming the rank(s) that failed and why. No
  manifest was written, so the previous step is still the newest complete one.
* :class:`UnreadableCheckpointError`: a committed step exists but cannot be read *now* (a
  permission or I/O error, throttling after every retry) or *by this version* of Baton
  (:class:`UnsupportedFormatError`: a newer format version, an unknown dtype). The step may
  well be good, so nothing falls back past it and nothing deletes it: the error names the
  step, the cause and the fix.
* :class:`SupersededError`: a newer attempt of the job has committed under the same URI; this
  (stale) writer may neither commit nor delete there any more.
* :class:`StorageError`: the storage backend failed for good (after its own retries).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "BatonError",
    "CheckpointError",
    "CollectiveTimeoutError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "ManifestError",
    "RankFailedError",
    "StorageError",
    "SupersededError",
    "UnreadableCheckpointError",
    "UnsupportedFormatError",
]


class BatonError(Exception):
    """Base class of every error the SDK raises on purpose."""

    def __reduce__(self) -> tuple[Any, ...]:
        # DCP hands a rank's failure to every rank pickled (its all_gather of each rank's
        # result), and Exception's own reduction calls ``cls(*args)``, which fails with a
        # TypeError for the subclasses' keyword-only arguments: the others would see that
        # TypeError, not the failure (a corrupt step would not fall back). Rebuilt here
        # without calling ``__init__``: the message and the attributes as they were.
        return (_rebuild, (type(self), self.args, self.__dict__))


def _rebuild(cls: type[BatonError], args: tuple[Any, ...], attrs: dict[str, Any]) -> BatonError:
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(attrs)
    return error


class StorageError(BatonError):
    """The storage backend failed for good (retries, if any, are exhausted)."""


class CheckpointError(BatonError):
    """A checkpoint could not be saved or loaded. The message says why and what to do."""


class ManifestError(CheckpointError):
    """A manifest (or a per-rank JSON file or a shard header) is malformed or unsafe.

    Raised before anything the manifest names is read, so a hostile manifest can never make
    the SDK read outside the checkpoint.
    """

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path


class CorruptCheckpointError(CheckpointError):
    """A file's bytes do not match the manifest (checksum or size): ``path`` names the file."""

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path


class IncompleteCheckpointError(CheckpointError):
    """The step directory has no valid manifest: the save never committed (for readers it does
    not exist). Load an older step, or ``cleanup_incomplete`` to remove it."""


class UnreadableCheckpointError(CheckpointError):
    """A committed step cannot be read now, or not by this version: it is *not* known to be bad.

    ``restore()`` raises it instead of falling back to an older step (which would lose every
    step since) and never deletes the step. ``step`` is the step (None when not yet known),
    ``cause`` the underlying problem.
    """

    def __init__(self, message: str, *, step: int | None = None, path: str | None = None) -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.step = step
        self.path = path


class UnsupportedFormatError(UnreadableCheckpointError):
    """The checkpoint was written by a newer Baton (a newer format version, a dtype this
    version does not know): upgrade trainer_sdk to read it."""


class SupersededError(CheckpointError):
    """A newer attempt of this job has committed under the same URI: this writer is stale.

    Raised instead of committing (and retention is skipped), so that a trainer left running
    on a partitioned node can never overwrite or delete the newer attempt's checkpoints.
    ``attempt`` is this writer's attempt, ``newer`` the newest attempt seen under the URI.
    """

    def __init__(self, message: str, *, attempt: int, newer: int) -> None:
        super().__init__(message)
        self.attempt = attempt
        self.newer = newer


class CollectiveTimeoutError(CheckpointError):
    """A collective in the save path did not finish in time; ``ranks`` are the ones missing
    (empty when the local rank cannot tell which)."""

    def __init__(self, message: str, *, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)


class RankFailedError(CheckpointError):
    """One or more ranks failed during a multi-rank save.

    ``rank`` is the first failing rank and ``cause`` its error message; ``failures`` maps every
    failing rank to its message. Every rank of the save raises this same error.
    """

    def __init__(
        self,
        *,
        rank: int,
        cause: str,
        failures: Mapping[int, str] | None = None,
        what: str = "save",
    ) -> None:
        merged = dict(failures or {})
        merged.setdefault(rank, cause)
        ranks = sorted(merged)
        self.failures = {r: merged[r] for r in ranks}
        self.rank = rank
        self.cause = cause
        detail = "; ".join(f"rank {r}: {merged[r]}" for r in ranks)
        super().__init__(
            f"{what} failed on rank(s) {', '.join(map(str, ranks))}: {detail}. No manifest "
            "was written; the previous complete step is still the newest."
        )
