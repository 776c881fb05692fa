"""Will a full save fit before a deadline? An honest estimate from measured throughput.

The operator has to decide whether a node's notice leaves time for a checkpoint. Starting a
save that cannot finish wastes the last seconds and, worse, looks like progress. So before an
emergency save every rank estimates how long its part will take, from the throughput of its
own earlier saves to the same storage (or, before the first save, from a small probe write),
and the ranks agree on the slowest estimate. If ``now + estimate`` is past
``deadline - margin`` the save is reported ``skipped`` and never started.

The estimate is deliberately pessimistic: it uses the slowest of the recent observations and
multiplies by a safety factor, because a skipped save costs the steps since the last
checkpoint while a save cut off by the node's end costs the same *and* the deadline.

A save's time is a fixed cost (agreement, fsync, manifest) plus its bytes at the storage's
throughput. Saves of at least :data:`LARGE_SAVE_BYTES` measure the throughput; smaller ones (an
incremental save of a LoRA adapter writes kilobytes beside a frozen base it references)
measure only the fixed cost, and are kept apart: dividing their few bytes by their seconds
would read as a throughput thousands of times too low, and a notice save that must write much
more (the periodic full rewrite, a changed buffer) would be skipped on that false estimate.

With the memory tier on, a notice has a second way to commit: a snapshot into every pod's
memory replicated to a peer on another node, measured likewise (:func:`choose_tier`); it is
then promoted to durable storage in the background.

Once a save has started, :func:`deadline_scope` carries its deadline down to the storage, whose
retries (S3's) never start an attempt that could not finish before it.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from dataclasses import dataclass

from trainer_sdk.storage._save_deadline import deadline_scope
from trainer_sdk.storage.base import Storage
from trainer_sdk.wire import Tier

__all__ = [
    "LARGE_SAVE_BYTES",
    "PROBE_PREFIX",
    "SaveEstimator",
    "choose_tier",
    "deadline_scope",
    "probe_write",
]

LARGE_SAVE_BYTES = 8 << 20
"""A save (or probe) of at least this many bytes per rank measures throughput; a smaller one
measures the fixed cost of a save (the probe's default size is this)."""

PROBE_PREFIX = ".baton-probe"
"""Directory (under the checkpoint root) for probe objects; not a step directory, so readers
and retention ignore it."""


@dataclass(kw_only=True, slots=True)
class _Observation:
    nbytes: int
    seconds: float


class SaveEstimator:
    """Keeps this rank's last few saves, large and small apart, and predicts the next one."""

    def __init__(self, *, history: int = 5, safety: float = 1.5, fixed_s: float = 0.25) -> None:
        if history < 1:
            raise ValueError("history must be >= 1: the estimator needs one observation to use")
        if safety < 1.0:
            raise ValueError("safety must be >= 1.0: a factor below one promises saves too fast")
        # Two histories, so a run of small incremental saves never pushes the last large
        # saves (the only measure of throughput) out.
        self._large: deque[_Observation] = deque(maxlen=history)
        self._small: deque[_Observation] = deque(maxlen=history)
        self._probe: _Observation | None = None
        self.safety = safety
        """Multiplier on the raw estimate (unitless)."""
        self.fixed_s = fixed_s
        """Seconds added for the agreement, commit collective and manifest, which do not
        scale with bytes."""

    def record(self, nbytes: int, seconds: float, *, probe: bool = False) -> None:
        """Record that ``nbytes`` took ``seconds`` to write and commit (ignores empty saves).

        A ``probe`` observation is used only until a real save has been measured: a small
        probe is dominated by fsync latency and would understate a large save's throughput.
        """
        if nbytes <= 0 or seconds <= 0:
            return
        obs = _Observation(nbytes=nbytes, seconds=seconds)
        if probe:
            self._probe = obs
        elif nbytes >= LARGE_SAVE_BYTES:
            self._large.append(obs)
        else:
            self._small.append(obs)

    @property
    def measured(self) -> bool:
        """Whether there is anything (a save or a probe) to estimate from."""
        return bool(self._large or self._small) or self._probe is not None

    @property
    def throughput(self) -> float | None:
        """Bytes per second of the slowest recent large save; without one, of the slowest
        recent save, else of the probe; ``None`` when nothing was measured."""
        saves = self._large or self._small
        if saves:
            return min(o.nbytes / o.seconds for o in saves)
        if self._probe is not None:
            return self._probe.nbytes / self._probe.seconds
        return None

    def estimate(self, nbytes: int) -> float | None:
        """Predicted seconds to save ``nbytes``; ``None`` when nothing was measured yet.

        With a large save measured: the slowest recent small save's seconds (the fixed cost)
        plus ``nbytes`` at the large saves' slowest throughput. Without one: ``nbytes`` at
        the slowest throughput seen, fixed costs included (pessimistic until measured).
        """
        tput = self.throughput
        if tput is None:
            return None
        latency = max((o.seconds for o in self._small), default=0.0) if self._large else 0.0
        return self.fixed_s + self.safety * (latency + nbytes / tput)


def choose_tier(*, durable_s: float, memory_s: float, left: float | None) -> Tier | None:
    """Where a notice's save commits: ``"durable"``, ``"memory"``, or None (skip it).

    ``durable_s`` and ``memory_s`` are the slowest rank's estimates (seconds) of a durable
    save and of a memory snapshot plus its replication to a peer; ``math.inf`` when a tier
    cannot be used or was never measured (the memory tier is never chosen on a guess: a
    snapshot whose replication does not finish before the node goes is lost with it).
    ``left``: the seconds left before the deadline minus the margin, None without a deadline.
    The durable tier whenever it fits (nothing to promote afterwards), else the memory tier
    when it fits, else nothing. Called on every rank with the same agreed values, so every
    rank takes the same decision.
    """
    if left is None or durable_s <= left:
        return Tier.DURABLE
    if math.isfinite(memory_s) and memory_s <= left:
        return Tier.MEMORY
    return None


def probe_write(storage: Storage, *, rank: int, nbytes: int = 8 << 20) -> tuple[int, float]:
    """Write, commit and delete ``nbytes`` of incompressible data; return (bytes, seconds).

    The object goes through the same :class:`~trainer_sdk.storage.base.Writer` path as a shard
    (temp name, fsync, rename; or a multipart upload), so it measures what a save would see.
    """
    chunk = os.urandom(min(nbytes, 1 << 20))
    path = f"{PROBE_PREFIX}/rank-{rank:05d}.bin"
    start = time.perf_counter()
    writer = storage.open_writer(path, size_hint=nbytes)
    try:
        left = nbytes
        while left > 0:
            piece = chunk[: min(left, len(chunk))]
            writer.write(piece)
            left -= len(piece)
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    seconds = time.perf_counter() - start
    storage.delete(path)
    return nbytes, seconds
