"""The adaptive checkpoint interval (``spec.checkpoint.everySeconds: auto``).

Checkpointing too often wastes the time the saves take; too rarely, the work an interruption
throws away. Young's first-order optimum (Young 1974; Daly 2006 refines it) balances the two:
an interval of about ``sqrt(2 x save cost x mean time between interruptions)``. Both inputs
are measured on the job itself: the save cost is the SDK's own timing of its latest commit
(``status.lastCheckpoint.seconds``), and the interruption rate is the job's own count of
preemptions and failures over its life, i.e. on the nodes it actually ran on.

Pure. The creator chooses once per attempt, before the attempt's first pod, and records the
choice in ``status.checkpointInterval`` (with the attempt it is for); every later pod of the
attempt, and an operator restarted mid-creation, reads it from there, so all ranks get the
same value. A new attempt (after a preemption) chooses afresh from what was learnt.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from .notices import parse_time

__all__ = [
    "DEFAULT_SAVE_SECONDS",
    "MAX_SECONDS",
    "MIN_SECONDS",
    "PRIOR_MTBI_SECONDS",
    "IntervalChoice",
    "choose",
    "for_job",
    "recorded",
    "young_daly",
]

MIN_SECONDS: Final = 60
"""The shortest interval chosen: below a minute the saves of a large model would overlap and
the store would see a write storm, whatever the formula says."""
MAX_SECONDS: Final = 3600
"""The longest interval chosen, however quiet the pool: an hour of work is the most an
unannounced loss (a crash, a node lost without notice, which no notice save covers) may cost,
and the ``BatonNoRecentCheckpoint`` alert pages after an hour (and 10 min) without a commit."""
DEFAULT_SAVE_SECONDS: Final = 30.0
"""The save cost assumed before the job has measured one (its first attempt): a sharded save
of a multi-GB model to object storage typically takes tens of seconds."""
PRIOR_MTBI_SECONDS: Final = 6 * 3600
"""The mean time between interruptions assumed before any is observed, and counted as one
pseudo-interval in the estimate: spot GPU capacity is commonly reclaimed every few hours to a
day. It keeps a young job from reading "no interruption in 5 minutes" as "interrupted every 5
minutes", and fades as the job's own observed time grows."""


@dataclass(frozen=True, kw_only=True)
class IntervalChoice:
    """An interval and what it was chosen from (written to ``status.checkpointInterval``)."""

    seconds: int
    """The interval handed to the ranks (``BATON_EVERY_SECONDS``)."""
    save_seconds: float
    """The save cost used: the latest measured commit, or :data:`DEFAULT_SAVE_SECONDS`."""
    save_measured: bool
    """Whether ``save_seconds`` was measured (False: the default)."""
    mtbi_seconds: float
    """The mean time between interruptions used."""
    interruptions: int
    """Preemptions plus failures so far."""
    observed_seconds: float
    """The job's life so far (creation to this attempt's start)."""
    bounded: str | None
    """``"min"`` or ``"max"`` when a bound overrode the formula, else None."""

    def to_status(self, attempt: int) -> dict[str, Any]:
        return {
            "seconds": self.seconds,
            "attempt": attempt,
            "saveSeconds": round(self.save_seconds, 3),
            "saveMeasured": self.save_measured,
            "mtbiSeconds": round(self.mtbi_seconds, 1),
            "interruptions": self.interruptions,
            "observedSeconds": round(self.observed_seconds, 1),
            "bounded": self.bounded,
        }


def young_daly(save_seconds: float, mtbi_seconds: float) -> float:
    """Young's optimal interval, ``sqrt(2 x save x MTBI)``, in seconds (unbounded)."""
    if save_seconds <= 0 or mtbi_seconds <= 0:
        raise ValueError(
            f"save_seconds={save_seconds} and mtbi_seconds={mtbi_seconds} must both be > 0"
        )
    return math.sqrt(2.0 * save_seconds * mtbi_seconds)


def choose(
    *, save_seconds: float | None, interruptions: int, observed_seconds: float
) -> IntervalChoice:
    """The interval for the next attempt, within [:data:`MIN_SECONDS`, :data:`MAX_SECONDS`].

    MTBI = (observed time + :data:`PRIOR_MTBI_SECONDS`) / (interruptions + 1): more
    interruptions in the same time give a shorter interval, a long quiet life a longer one.
    """
    if interruptions < 0:
        raise ValueError(f"interruptions={interruptions} must be >= 0")
    measured = save_seconds is not None and save_seconds > 0
    save = float(save_seconds) if measured and save_seconds is not None else DEFAULT_SAVE_SECONDS
    observed = max(0.0, observed_seconds)
    mtbi = (observed + PRIOR_MTBI_SECONDS) / (interruptions + 1)
    raw = young_daly(save, mtbi)
    bounded = "min" if raw < MIN_SECONDS else "max" if raw > MAX_SECONDS else None
    seconds = min(MAX_SECONDS, max(MIN_SECONDS, round(raw)))
    return IntervalChoice(
        seconds=seconds, save_seconds=save, save_measured=measured, mtbi_seconds=mtbi,
        interruptions=interruptions, observed_seconds=observed, bounded=bounded,
    )  # fmt: skip


def for_job(job: Mapping[str, Any], *, at: datetime) -> IntervalChoice:
    """:func:`choose` from a TrainingJob as the API returns it, its life measured from its
    creation to ``at`` (the start of the attempt the interval is for)."""
    status: Mapping[str, Any] = job.get("status") or {}
    meta: Mapping[str, Any] = job.get("metadata") or {}
    created = parse_time(meta.get("creationTimestamp"))
    observed = (at - created).total_seconds() if created else 0.0
    seconds = (status.get("lastCheckpoint") or {}).get("seconds")
    interruptions = int(status.get("preemptions", 0)) + int(status.get("failures", 0))
    return choose(
        save_seconds=None if seconds is None else float(seconds),
        interruptions=interruptions,
        observed_seconds=observed,
    )


def recorded(job: Mapping[str, Any], attempt: int) -> int | None:
    """The interval already chosen for ``attempt`` (``status.checkpointInterval``), if any."""
    raw: Mapping[str, Any] = (job.get("status") or {}).get("checkpointInterval") or {}
    if raw.get("attempt") != attempt or raw.get("seconds") is None:
        return None
    return int(raw["seconds"])
