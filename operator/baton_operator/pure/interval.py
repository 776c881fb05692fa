"""The adaptive checkpoint interval (``spec.checkpoint.everySeconds: auto``).

Checkpointing too often wastes the time the saves take; too rarely, the work an interruption
throws away. Young's first-order optimum (Young 1974; Daly 2006 refines it) balances the two:
an interval of about ``sqrt(2 x save cost x mean time between interruptions)``. The save cost
is the SDK's own timing of its latest commit (``status.lastCheckpoint.seconds``). The
interruption rate is a rate over time: interruptions per second of node time, where node time
is the wall time of an attempt's nodes (Running to its end, times its nodes). Spot capacity is
reclaimed per node pool, so when the job's pool is known (a pool label on its nodes, or in its
``nodeSelector``: ``nodes.POOL_LABELS``) the rate is that pool's, over every Baton job the
operator has seen there; otherwise the job's own. A prior of :data:`PRIOR_MTBI_SECONDS` of node
time per interruption (the operator's ``--interval-prior-seconds``), counted as one observed
interval, gives a new job a sane default and fades as node time accumulates. The job's mean
time between interruptions is the per-node one divided by its nodes: a job on 8 nodes is
interrupted 8 times as often as one on 1.

The state the rate needs is in each job's ``status.exposure`` (totals over the job's whole
life, not the bounded history, which would undercount a long job): node seconds and
interruptions, per pool, and the attempt that is running (since when, on how many nodes of
which pool). :func:`opened` starts an attempt's clock when it is Running, :func:`closed` stops
it at the attempt's end (a restart, a suspend, success) and counts the interruption, in the
same status write as the decision. :class:`PoolLedger` sums the jobs' exposures per pool.

Pure. The creator chooses once per attempt, before the attempt's first pod, and records the
choice in ``status.checkpointInterval`` (with the attempt it is for); every later pod of the
attempt, and an operator restarted mid-creation, reads it from there, so all ranks get the
same value. A new attempt (after a preemption) chooses afresh from what was learnt.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

from .crd import POOLS_KEPT
from .jobstatus import iso
from .nodes import node_pool
from .notices import parse_time

__all__ = [
    "DEFAULT_SAVE_SECONDS",
    "MAX_SECONDS",
    "MIN_SECONDS",
    "POOLS_KEPT",
    "PRIOR_MTBI_SECONDS",
    "Exposure",
    "IntervalChoice",
    "PoolLedger",
    "choose",
    "closed",
    "for_job",
    "job_exposure",
    "job_pool",
    "opened",
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
"""The mean node time between interruptions of one node assumed before any is observed, and
counted as one pseudo-interval in the estimate: spot GPU capacity is commonly reclaimed every
few hours to a day. It keeps a young job from reading "no interruption in 5 minutes" as
"interrupted every 5 minutes", and fades as the observed node time grows. The default of the
operator's ``interval_prior_seconds`` setting (``--interval-prior-seconds``)."""


@dataclass(frozen=True, kw_only=True)
class Exposure:
    """Node time observed and the interruptions in it: of one job, or of one pool."""

    node_seconds: float = 0.0
    """Seconds of node time: each attempt's Running time times its nodes."""
    interruptions: int = 0
    """Interruptions (preemptions and failures) in that time."""

    def __add__(self, other: Exposure) -> Exposure:
        return Exposure(
            node_seconds=self.node_seconds + other.node_seconds,
            interruptions=self.interruptions + other.interruptions,
        )

    @property
    def empty(self) -> bool:
        return self.node_seconds <= 0 and self.interruptions == 0


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
    """The job's mean time between interruptions used (the per-node one over ``nodes``)."""
    source: str
    """Where the rate came from: ``pool`` (every job seen on ``pool``), ``job`` (the job's
    own), or ``prior`` (nothing observed yet)."""
    pool: str | None
    """The job's pool (``label=value``), when known."""
    interruptions: int
    """Interruptions observed in the window (pool or job)."""
    node_seconds: float
    """The window: node seconds observed (pool or job)."""
    nodes: int
    """The job's nodes (its replicas: one pod per node)."""
    bounded: str | None
    """``"min"`` or ``"max"`` when a bound overrode the formula, else None."""
    prior_seconds: float = PRIOR_MTBI_SECONDS
    """The prior used: node seconds per interruption, counted as one pseudo-interval."""

    def to_status(self, attempt: int) -> dict[str, Any]:
        out = {
            "seconds": self.seconds,
            "attempt": attempt,
            "saveSeconds": round(self.save_seconds, 3),
            "saveMeasured": self.save_measured,
            "mtbiSeconds": round(self.mtbi_seconds, 1),
            "source": self.source,
            "pool": self.pool,
            "interruptions": self.interruptions,
            "nodeSeconds": round(self.node_seconds, 1),
            "nodes": self.nodes,
            "priorSeconds": round(self.prior_seconds),
            "bounded": self.bounded,
        }
        return {k: v for k, v in out.items() if v is not None}


def young_daly(save_seconds: float, mtbi_seconds: float) -> float:
    """Young's optimal interval, ``sqrt(2 x save x MTBI)``, in seconds (unbounded)."""
    if save_seconds <= 0 or mtbi_seconds <= 0:
        raise ValueError(
            f"save_seconds={save_seconds} and mtbi_seconds={mtbi_seconds} must both be > 0"
        )
    return math.sqrt(2.0 * save_seconds * mtbi_seconds)


def choose(
    *,
    save_seconds: float | None,
    seen: Exposure,
    nodes: int = 1,
    source: str = "job",
    pool: str | None = None,
    prior_seconds: float = PRIOR_MTBI_SECONDS,
) -> IntervalChoice:
    """The interval for the next attempt, within [:data:`MIN_SECONDS`, :data:`MAX_SECONDS`].

    Per-node MTBI = (node seconds seen + ``prior_seconds``) / (interruptions + 1);
    the job's MTBI is that over its ``nodes``. More interruptions in the same time give a
    shorter interval, a long quiet time a longer one.
    """
    if seen.interruptions < 0 or seen.node_seconds < 0:
        raise ValueError(f"{seen}: interruptions and node seconds must be >= 0")
    if nodes < 1:
        raise ValueError(f"nodes={nodes} must be >= 1")
    if prior_seconds <= 0:
        raise ValueError(f"prior_seconds={prior_seconds} must be > 0")
    measured = save_seconds is not None and save_seconds > 0
    save = float(save_seconds) if measured and save_seconds is not None else DEFAULT_SAVE_SECONDS
    per_node = (seen.node_seconds + prior_seconds) / (seen.interruptions + 1)
    mtbi = per_node / nodes
    raw = young_daly(save, mtbi)
    bounded = "min" if raw < MIN_SECONDS else "max" if raw > MAX_SECONDS else None
    seconds = min(MAX_SECONDS, max(MIN_SECONDS, round(raw)))
    return IntervalChoice(
        seconds=seconds, save_seconds=save, save_measured=measured, mtbi_seconds=mtbi,
        source="prior" if seen.empty else source, pool=pool,
        interruptions=seen.interruptions, node_seconds=seen.node_seconds, nodes=nodes,
        bounded=bounded, prior_seconds=prior_seconds,
    )  # fmt: skip


# ------------------------------------------------------------------ status.exposure


def _exposure(raw: Mapping[str, Any] | None) -> Exposure:
    raw = raw or {}
    return Exposure(
        node_seconds=float(raw.get("nodeSeconds") or 0.0),
        interruptions=int(raw.get("interruptions") or 0),
    )


def _pool_counts(raw: Mapping[str, Any] | None) -> dict[str, Exposure]:
    return {str(p["pool"]): _exposure(p) for p in (raw or {}).get("pools") or [] if p.get("pool")}


def _render(total: Exposure, pools: Mapping[str, Exposure], **extra: Any) -> dict[str, Any]:
    kept = sorted(pools, key=lambda p: (-pools[p].node_seconds, p))[:POOLS_KEPT]
    pools = {p: pools[p] for p in kept}
    return {
        "nodeSeconds": round(total.node_seconds, 1),
        "interruptions": total.interruptions,
        "pools": [
            {"pool": p, "nodeSeconds": round(e.node_seconds, 1), "interruptions": e.interruptions}
            for p, e in sorted(pools.items())
        ],
        **extra,
    }


def opened(
    raw: Mapping[str, Any] | None, *, since: datetime, node_pools: Iterable[str | None]
) -> dict[str, Any]:
    """``status.exposure`` with the running attempt's clock started at ``since``, on the
    given nodes (one pool, or None, per distinct node)."""
    pools = list(node_pools)
    counts = Counter(p for p in pools if p)
    current = {
        "since": iso(since),
        "nodes": len(pools),
        "pools": [{"pool": p, "nodes": n} for p, n in sorted(counts.items())],
    }
    pool = _main_pool(raw, counts)
    return _render(
        _exposure(raw), _pool_counts(raw), current=current, **({"pool": pool} if pool else {})
    )


def _main_pool(raw: Mapping[str, Any] | None, counts: Mapping[str, int]) -> str | None:
    if counts:
        return max(sorted(counts), key=lambda p: counts[p])
    value = (raw or {}).get("pool")
    return str(value) if value else None


def closed(
    raw: Mapping[str, Any] | None,
    *,
    now: datetime,
    interrupted: bool,
    noticed_pools: Iterable[str] = (),
) -> dict[str, Any]:
    """``status.exposure`` with the running attempt's node time added and its clock stopped
    (``current: None``); with ``interrupted``, one interruption counted for the job and for
    each pool the attempt ran on (the noticed nodes' pools when it never ran)."""
    total, pools = _exposure(raw), _pool_counts(raw)
    current: Mapping[str, Any] = (raw or {}).get("current") or {}
    since = parse_time(current.get("since"))
    seconds = max(0.0, (now - since).total_seconds()) if since else 0.0
    total += Exposure(node_seconds=seconds * int(current.get("nodes") or 0))
    ran: list[str] = []
    for p in current.get("pools") or []:
        name = str(p.get("pool") or "")
        if not name:
            continue
        ran.append(name)
        add = Exposure(node_seconds=seconds * int(p.get("nodes") or 0))
        pools[name] = pools.get(name, Exposure()) + add
    if interrupted:
        total += Exposure(interruptions=1)
        for name in sorted(set(ran or noticed_pools)):
            pools[name] = pools.get(name, Exposure()) + Exposure(interruptions=1)
    pool = (raw or {}).get("pool")
    # None, not absent: the status is written as a JSON merge patch, where null deletes.
    return _render(total, pools, current=None, **({"pool": pool} if pool else {}))


def job_exposure(job: Mapping[str, Any]) -> Exposure:
    """The job's own exposure (``status.exposure``). A job an older operator ran has none: its
    life times its replicas and its preemption and failure counts stand in."""
    status: Mapping[str, Any] = job.get("status") or {}
    raw = status.get("exposure")
    if raw is not None:
        return _exposure(raw)
    count = int(status.get("preemptions") or 0) + int(status.get("failures") or 0)
    created = parse_time((job.get("metadata") or {}).get("creationTimestamp"))
    started = parse_time(status.get("attemptStartedAt"))
    if count == 0 or created is None or started is None:
        return Exposure(interruptions=count)
    replicas = int(status.get("replicas") or (job.get("spec") or {}).get("replicas") or 1)
    life = max(0.0, (started - created).total_seconds())
    return Exposure(node_seconds=life * replicas, interruptions=count)


def job_pool(job: Mapping[str, Any]) -> str | None:
    """The job's pool: the one its template's ``nodeSelector`` names, else the one most of
    its latest running attempt's nodes were in (``status.exposure.pool``)."""
    spec: Mapping[str, Any] = job.get("spec") or {}
    template: Mapping[str, Any] = spec.get("template") or {}
    selected = node_pool((template.get("spec") or {}).get("nodeSelector"))
    if selected:
        return selected
    value = ((job.get("status") or {}).get("exposure") or {}).get("pool")
    return str(value) if value else None


@dataclass
class PoolLedger:
    """Every job's ``status.exposure`` as the operator last read it, summed per pool.

    Fed by each job's tick (which reads the job fresh anyway); a deleted job is forgotten,
    and with it its node time. After an operator restart it fills as the jobs' daemons start.
    """

    jobs: dict[tuple[str, str], Mapping[str, Any]] = field(default_factory=dict)

    def observe(self, key: tuple[str, str], job: Mapping[str, Any]) -> None:
        raw = (job.get("status") or {}).get("exposure")
        if raw:
            self.jobs[key] = raw
        else:
            self.jobs.pop(key, None)

    def forget(self, key: tuple[str, str]) -> None:
        self.jobs.pop(key, None)

    def totals(self, pool: str, *, now: datetime) -> Exposure:
        """The pool's node time and interruptions over every job seen, running attempts'
        node time up to ``now`` included."""
        out = Exposure()
        for raw in self.jobs.values():
            out += _pool_counts(raw).get(pool, Exposure())
            current: Mapping[str, Any] = raw.get("current") or {}
            since = parse_time(current.get("since"))
            if since is None:
                continue
            seconds = max(0.0, (now - since).total_seconds())
            for p in current.get("pools") or []:
                if p.get("pool") == pool:
                    out += Exposure(node_seconds=seconds * int(p.get("nodes") or 0))
        return out


def for_job(
    job: Mapping[str, Any],
    *,
    at: datetime,
    pools: PoolLedger | None = None,
    prior_seconds: float = PRIOR_MTBI_SECONDS,
) -> IntervalChoice:
    """:func:`choose` for a TrainingJob as the API returns it, at ``at`` (the start of the
    attempt the interval is for): from its pool's rate when its pool is known and anything
    was seen there, else from its own."""
    status: Mapping[str, Any] = job.get("status") or {}
    seconds = (status.get("lastCheckpoint") or {}).get("seconds")
    save = None if seconds is None else float(seconds)
    nodes = max(1, int(status.get("replicas") or (job.get("spec") or {}).get("replicas") or 1))
    pool = job_pool(job)
    if pool is not None and pools is not None:
        seen = pools.totals(pool, now=at)
        if not seen.empty:
            return choose(
                save_seconds=save, seen=seen, nodes=nodes, source="pool", pool=pool,
                prior_seconds=prior_seconds,
            )  # fmt: skip
    return choose(
        save_seconds=save, seen=job_exposure(job), nodes=nodes, source="job", pool=pool,
        prior_seconds=prior_seconds,
    )  # fmt: skip


def recorded(job: Mapping[str, Any], attempt: int) -> int | None:
    """The interval already chosen for ``attempt`` (``status.checkpointInterval``), if any."""
    raw: Mapping[str, Any] = (job.get("status") or {}).get("checkpointInterval") or {}
    if raw.get("attempt") != attempt or raw.get("seconds") is None:
        return None
    return int(raw["seconds"])
