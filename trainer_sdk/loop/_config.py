"""The Checkpointer's settings: one frozen config object, resolved from arguments, the
environment the operator injects (:data:`ENV_VARS`) and defaults, in that order.

Torch-free. :class:`CheckpointerConfig` is public from :mod:`trainer_sdk.checkpointer`; the
table of settings is in ``docs/checkpointer.md``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Final, TypeVar

from trainer_sdk.errors import CheckpointError

__all__ = ["ENV_VARS", "CheckpointerConfig", "env_number"]

_DEFAULT_URI: Final = "./checkpoints"
_N = TypeVar("_N", int, float)
_V = TypeVar("_V", str, int, float)


def env_number(name: str, kind: type[_N]) -> _N | None:
    """``$name`` parsed as ``kind`` (int or float); None when it is unset or blank."""
    return _env_value(os.environ, name, kind)


def _env_value(env: Mapping[str, str], name: str, kind: type[_V]) -> _V | None:
    """``env[name]`` parsed as ``kind`` (str, int, float, or bool: 1 or 0); None when it is
    unset or blank."""
    raw = env.get(name, "").strip()
    if not raw:
        return None
    if kind is bool:
        if raw not in ("0", "1"):
            raise CheckpointError(f"${name}={raw}: set it to 1 (on) or 0 (off)")
        return kind(raw == "1")
    try:
        return kind(raw)
    except ValueError as e:
        fix = (
            "an integer: set it to a whole number" if kind is int else "a number: set it to seconds"
        )
        raise CheckpointError(f"${name}={raw!r} is not {fix}") from e


ENV_VARS: Final[dict[str, tuple[str, type[Any]]]] = {
    "BATON_CHECKPOINT_URI": ("uri", str),
    "BATON_EVERY_STEPS": ("every_steps", int),
    "BATON_EVERY_SECONDS": ("every_seconds", float),
    "BATON_KEEP_LAST": ("keep_last", int),
    "BATON_CONTROL_DIR": ("control_dir", str),
    "BATON_FAST_EVERY_STEPS": ("fast_every_steps", int),
    "BATON_FAST_DIR": ("fast_dir", str),
    "BATON_FULL_EVERY_STEPS": ("full_every_steps", int),
    "BATON_STAGE_IN_BACKGROUND": ("stage_in_background", bool),
    "BATON_WRITER_PROCESS": ("writer_process", bool),
}
"""Environment overrides of :class:`CheckpointerConfig` fields: variable -> (field, type)."""


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class CheckpointerConfig:
    """The resolved policy of a :class:`Checkpointer`: arguments first, then the environment
    (:data:`ENV_VARS`, which the operator injects), then these defaults (see
    :meth:`from_env`)."""

    uri: str = _DEFAULT_URI
    """Checkpoint root: a path, ``file://...`` or ``s3://...``."""
    every_steps: int | None = None
    """Save when ``step % every_steps == 0``; ``None``: no step-based saves."""
    every_seconds: float | None = None
    """Save when this many seconds passed since the last save, by rank 0's clock."""
    keep_last: int = 3
    """Complete checkpoints to keep (>= 1). Older ones are deleted after a newer commit."""
    async_save: bool = False
    """Periodic saves stage on the caller's thread and write in the background."""
    stage_in_background: bool = False
    """For background saves (``async_save``) and memory-tier snapshots: the copy of what only
    the optimizer's step changes (its parameters and state) runs on a staging thread while
    the next forward and backward run, and the optimizer's step waits for it (a step
    pre-hook), so such a save costs the training thread almost nothing.
    ``$BATON_STAGE_IN_BACKGROUND``: 1 or 0. Off by default: a loop that changes parameters in
    place outside ``optimizer.step()`` (weight clipping after the step, an in-place re-init)
    between ``step()`` and the next optimizer step would race the copy (version counters
    catch an in-place change and fail that save; a change through ``.data`` they cannot
    see)."""
    writer_process: bool = False
    """For background saves (``async_save``) of more than 16 MiB a rank to a local
    filesystem: the shard file is streamed, hashed and made durable by a child process that
    reads the staged copy from shared memory (memfds), not by a thread of the trainer; the
    commit stays in the trainer. A writer thread takes the GIL back after each 512 KiB piece,
    which cost a Python-bound training loop 2-5 % of the steps beside the write alone here
    (``bench/writer_place.py``); in a whole save the effect was within the runs' spread
    (docs/performance.md, "The writer process"). ``$BATON_WRITER_PROCESS``: 1 or 0. Off by
    default; the staged copy then lives in memfds (not pinned: a GPU state's copies go through
    pageable memory)."""
    control_dir: str | None = None
    """The sidecar's control directory; ``None``: no control channel."""
    handle_sigterm: bool = True
    """Turn SIGTERM into an emergency save at the next step boundary."""
    notice_every: int = 1
    """Run the notice collective every this many steps (1: every step)."""
    notice_overlap_below: float = 1.0
    """While step boundaries come less than this many seconds apart, the notice collective
    is overlapped with the next step instead of waited for: a notice is then served one
    boundary later (so at most this much later) and ``step()`` costs microseconds, not a
    round trip to every rank. 1 s: a blocking collective is then under 0.2% of a step, and
    one boundary of delay is small against the shortest notice windows (15-30 s). 0: never
    overlap (a notice is served at the very boundary where it is heard); ``inf``: always."""
    deadline_margin: float = 5.0
    """Seconds kept free before a deadline; a save that would end later is skipped."""
    timeout: timedelta = timedelta(minutes=10)
    """Bound on every collective the Checkpointer runs; a rank that does not answer fails
    the save with an error instead of hanging."""
    accumulation_steps: int | None = None
    """Declared gradient-accumulation steps; a resume with another value is refused."""
    resume_fallback: bool = True
    """When ``BATON_RESUME_STEP`` cannot be loaded: fall back to the newest complete older step
    (True, logged as an error) or raise :class:`ResumeError` (False)."""
    probe_bytes: int = 8 << 20
    """Size of the probe write that calibrates the save-time estimate before the first save."""
    fast_every_steps: int | None = None
    """Snapshot the whole state into ``fast_dir`` (the memory tier) when
    ``step % fast_every_steps == 0``; ``None``: no snapshots. 1 loses at most one step to a
    node lost without notice; each snapshot costs the step one copy of the state."""
    fast_dir: str | None = None
    """The memory tier's directory: an ``emptyDir`` with ``medium: Memory``, one per pod.
    Restore considers its snapshots even when ``fast_every_steps`` is ``None``."""
    full_every_steps: int = 0
    """Incremental steps (format v3): a durable save references a frozen, unchanged tensor
    in the step that wrote it instead of writing it again, unless that step is this many
    steps old or more; then it is written again (a full rewrite), so reference chains reach
    at most this far back and the old step's files can go. 0 (the default): never forced,
    the frozen weights are written once per run and kept while a kept step references them
    (a 70B LoRA run should not rewrite 140 GB to bound a chain); 1: never reference (every
    save writes everything, as before v3). Off while the memory tier is on (``fast_dir``)."""

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, **overrides: Any
    ) -> CheckpointerConfig:
        """The defaults, overridden by the :data:`ENV_VARS` that are set (blank counts as
        unset), overridden by ``overrides`` that are not None (or empty, for the uri and the
        control directory). ``timeout`` may be given in seconds. A variable that does not
        parse raises :class:`CheckpointError` naming it and the fix."""
        env = os.environ if environ is None else environ
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise TypeError(f"CheckpointerConfig has no setting {unknown}; use {sorted(fields)}")
        kwargs: dict[str, Any] = {}
        for var, (name, kind) in ENV_VARS.items():
            value = _env_value(env, var, kind)
            if value is not None:
                kwargs[name] = value
        for name, value in overrides.items():
            if value is None or (name in ("uri", "control_dir", "fast_dir") and not value):
                continue
            kwargs[name] = value
        timeout = kwargs.get("timeout")
        if timeout is not None and not isinstance(timeout, timedelta):
            kwargs["timeout"] = timedelta(seconds=timeout)
        return cls(**kwargs)

    def __post_init__(self) -> None:
        if self.every_steps is not None and self.every_steps < 1:
            raise CheckpointError(
                f"every_steps={self.every_steps}: use a positive number or None for no step policy"
            )
        if self.every_seconds is not None and self.every_seconds <= 0:
            raise CheckpointError(
                f"every_seconds={self.every_seconds}: use a positive number or None"
            )
        if self.keep_last < 1:
            raise CheckpointError(
                f"keep_last={self.keep_last}: keep at least 1 (the newest complete checkpoint "
                "is never deleted)"
            )
        if self.notice_every < 1:
            raise CheckpointError(f"notice_every={self.notice_every}: use 1 or more")
        if not self.notice_overlap_below >= 0:  # also refuses NaN
            raise CheckpointError(
                f"notice_overlap_below={self.notice_overlap_below}: use seconds >= 0 "
                "(0 turns the overlap off, float('inf') always overlaps)"
            )
        if self.deadline_margin < 0:
            raise CheckpointError("deadline_margin must be >= 0 seconds")
        if self.full_every_steps < 0:
            raise CheckpointError(
                f"full_every_steps={self.full_every_steps}: use 0 (never force a full rewrite), "
                "1 (always write everything) or a larger number of steps"
            )
        if self.fast_every_steps is not None and self.fast_every_steps < 1:
            raise CheckpointError(
                f"fast_every_steps={self.fast_every_steps}: use a positive number, or None for "
                "no memory-tier snapshots"
            )
        if self.fast_every_steps is not None and not self.fast_dir:
            raise CheckpointError(
                f"fast_every_steps={self.fast_every_steps} needs fast_dir (or $BATON_FAST_DIR): "
                "the directory of the memory tier, an emptyDir with medium: Memory"
            )
        if self.accumulation_steps is not None and self.accumulation_steps < 1:
            raise CheckpointError("accumulation_steps must be >= 1 (or None if not declared)")
