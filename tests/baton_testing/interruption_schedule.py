"""A seeded schedule of spot interruptions, replayed identically for every method of a benchmark.

``bench/goodput.py`` puts Baton beside a plain ``torch.save`` checkpoint-restart job on the same
interruptions. The schedule is drawn from a stated model: arrivals are a Poisson process at a
stated mean time between interruptions (exponential gaps), each interruption is an AWS
2-minute notice, a GKE 30-second notice or a node lost without notice in stated proportions,
and the lost capacity comes back as a replacement node a stated delay later (as a node pool or
Karpenter would add one). Times are seconds of training (from the job's first step), drawn over
the uninterrupted run's length, so the same seed gives the same schedule whatever the machine.

The schedule is a JSON file (:func:`save_schedule`, :func:`load_schedule`), so that a real
trace (SkyPilot's published spot traces, converted to offsets and kinds) replays the same way.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

__all__ = [
    "KINDS",
    "NOTICE_SECONDS",
    "Interruption",
    "Schedule",
    "ScheduleModel",
    "draw_schedule",
    "load_schedule",
    "save_schedule",
]

Kind = Literal["aws", "gke", "kill"]
KINDS: Final[tuple[Kind, ...]] = ("aws", "gke", "kill")
NOTICE_SECONDS: Final[dict[Kind, int]] = {"aws": 120, "gke": 30, "kill": 0}
"""The window from the notice until the machine is gone (what the clouds give); 0: no notice."""


@dataclass(kw_only=True, frozen=True)
class ScheduleModel:
    """The model the schedule is drawn from (the benchmark's options)."""

    seed: int = 30
    mean_seconds_between: float = 60.0
    """Mean time between interruptions, seconds of training (the Poisson process's 1/rate)."""
    proportions: tuple[float, float, float] = (0.4, 0.3, 0.3)
    """Shares of AWS notices, GKE notices and losses without notice; they must sum to 1."""
    replace_after_seconds: float = 20.0
    """Seconds from an interruption until its replacement spot node is added."""
    horizon_seconds: float = 300.0
    """Length of the uninterrupted run: arrivals are drawn over [0, horizon)."""
    ranks: int = 2
    """Ranks of the job; each interruption takes the node of one rank, drawn uniformly."""
    max_interruptions: int | None = None
    """Keep at most this many arrivals (a smoke run's fixed count); None: all in the horizon."""
    min_gap_seconds: float = 0.0
    """Arrivals closer than this to the previous one move to it (a local cluster needs time to
    start the pods again; the benchmark says what it used)."""

    def __post_init__(self) -> None:
        if self.mean_seconds_between <= 0 or self.horizon_seconds <= 0:
            raise ValueError("mean_seconds_between and horizon_seconds must be positive")
        if len(self.proportions) != 3 or any(p < 0 for p in self.proportions):
            raise ValueError("proportions are three shares (aws, gke, kill), each >= 0")
        if abs(sum(self.proportions) - 1.0) > 1e-9:
            raise ValueError(f"proportions {self.proportions} must sum to 1")
        if self.ranks < 1:
            raise ValueError("ranks must be at least 1")


@dataclass(kw_only=True, frozen=True)
class Interruption:
    """One interruption: when (seconds of training), what, whose node, when it is replaced."""

    at_seconds: float
    kind: Kind
    rank: int
    replace_after_seconds: float

    @property
    def notice_seconds(self) -> int:
        return NOTICE_SECONDS[self.kind]


@dataclass(kw_only=True, frozen=True)
class Schedule:
    model: dict[str, Any]
    """The model it was drawn from (or what a converted trace says about itself)."""
    interruptions: list[Interruption] = field(default_factory=list)


def draw_schedule(model: ScheduleModel) -> Schedule:
    """The schedule for ``model``: the same model (seed included) always gives the same one."""
    rng = random.Random(model.seed)
    events: list[Interruption] = []
    at = 0.0
    while True:
        at += rng.expovariate(1.0 / model.mean_seconds_between)
        kind = rng.choices(KINDS, weights=model.proportions)[0]
        rank = rng.randrange(model.ranks)
        if at >= model.horizon_seconds:
            break
        if model.max_interruptions is not None and len(events) >= model.max_interruptions:
            break
        if events and at - events[-1].at_seconds < model.min_gap_seconds:
            at = events[-1].at_seconds + model.min_gap_seconds
        events.append(
            Interruption(
                at_seconds=round(at, 3),
                kind=kind,
                rank=rank,
                replace_after_seconds=model.replace_after_seconds,
            )
        )
    return Schedule(model=asdict(model), interruptions=events)


def save_schedule(schedule: Schedule, path: Path) -> None:
    path.write_text(json.dumps(asdict(schedule), indent=1) + "\n")


def load_schedule(path: Path) -> Schedule:
    """Read a schedule file; a malformed one is rejected with what to fix."""
    raw = json.loads(path.read_text())
    try:
        events = [
            Interruption(
                at_seconds=float(e["at_seconds"]),
                kind=e["kind"],
                rank=int(e["rank"]),
                replace_after_seconds=float(e["replace_after_seconds"]),
            )
            for e in raw["interruptions"]
        ]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"{path}: each interruption needs at_seconds, kind (aws, gke or kill), rank and "
            f"replace_after_seconds ({e!r})"
        ) from e
    for e in events:
        if e.kind not in KINDS:
            raise ValueError(f"{path}: kind {e.kind!r} is not one of {', '.join(KINDS)}")
    if [e.at_seconds for e in events] != sorted(e.at_seconds for e in events):
        raise ValueError(f"{path}: interruptions must be in order of at_seconds")
    return Schedule(model=dict(raw.get("model") or {}), interruptions=events)
