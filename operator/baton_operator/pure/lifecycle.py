"""The TrainingJob state machine and its budgets, as pure functions.

The controller observes (pods, sidecar reports, notices) and asks this module what to do; it
never decides itself. Nothing here does I/O, so every transition and budget is unit-tested.

Phases::

    Pending ──all ranks running──▶ Running ──notice──▶ Checkpointing
       ▲                             │  │                  │ committed / fallback
       │                             │  └─crash, node lost─┤
       └──── new attempt created ◀── Restarting ◀──────────┘
    Running ──every rank exited 0──▶ Succeeded
    any ──budget exhausted──▶ Failed
    (new) ──template refused, or the API server rejects its objects──▶ Failed
    Running ──spec.suspend──▶ Checkpointing ──committed / fallback──▶ Suspended
    Pending, Restarting ──spec.suspend──▶ Suspended ──spec.suspend false──▶ Pending

A preemption (a notice the operator acted on, or a rank that exited after an emergency save)
and a failure (a crash, an unannounced node loss) are counted separately, against
``maxPreemptions`` and ``maxFailures``; only failures back off. A suspend (``spec.suspend``,
as Kueue sets it) is neither: it counts against no budget.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Final

from .model import JobSpec
from .reports import SidecarStatus
from .settings import EMERGENCY_EXIT_CODE
from .vocabulary import InterruptionSource, RestartKind, SaveState

__all__ = [
    "ALLOWED",
    "NODE_NOT_READY_SECONDS",
    "RECOVERY_RESTARTS",
    "RECOVERY_SECONDS",
    "SUSPEND_SOURCE",
    "Outcome",
    "Phase",
    "RankView",
    "RecoveryPlan",
    "RestartPlan",
    "Verdict",
    "VerdictKind",
    "backoff_seconds",
    "check_transition",
    "checkpoint_verdict",
    "clamp_deadline",
    "classify",
    "elastic_replicas",
    "every_rank",
    "moves_at_once",
    "plan_notice_recovery",
    "plan_recovery",
    "plan_restart",
    "restart_grace_seconds",
]


SUSPEND_SOURCE: Final = InterruptionSource.SUSPEND
"""``status.notice.source`` of the save the operator asks for because ``spec.suspend`` is
true (a suspend is served like a notice, without a node going away)."""


class Phase(StrEnum):
    """``status.phase``."""

    PENDING = "Pending"
    RUNNING = "Running"
    CHECKPOINTING = "Checkpointing"
    RESTARTING = "Restarting"
    SUSPENDED = "Suspended"
    """``spec.suspend`` is true: the job has no running pods and waits to be unsuspended."""
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


ALLOWED: Final[Mapping[Phase, frozenset[Phase]]] = {
    Phase.PENDING: frozenset(
        {
            Phase.RUNNING,
            Phase.CHECKPOINTING,
            Phase.RESTARTING,
            Phase.SUSPENDED,
            Phase.SUCCEEDED,
            Phase.FAILED,
        }
    ),
    Phase.RUNNING: frozenset(
        {Phase.CHECKPOINTING, Phase.RESTARTING, Phase.SUCCEEDED, Phase.FAILED}
    ),
    # Running again: a notice whose save committed to the memory tier is answered by a
    # recovery that keeps the pods off the noticed node (noticing.NoticePath).
    Phase.CHECKPOINTING: frozenset(
        {Phase.RUNNING, Phase.RESTARTING, Phase.SUSPENDED, Phase.SUCCEEDED, Phase.FAILED}
    ),
    Phase.RESTARTING: frozenset({Phase.PENDING, Phase.SUSPENDED, Phase.FAILED}),
    Phase.SUSPENDED: frozenset({Phase.PENDING, Phase.FAILED}),
    Phase.SUCCEEDED: frozenset(),
    Phase.FAILED: frozenset(),
}
"""Every legal phase change. Succeeded and Failed are final."""


def check_transition(current: Phase | None, new: Phase) -> Phase:
    """Return ``new`` if the machine allows ``current -> new``; raise ValueError otherwise.

    A new job (no phase yet) starts Pending, or fails at once when its pod template is refused
    or the API server rejects its objects before anything ran.
    """
    if current is None:
        if new not in (Phase.PENDING, Phase.FAILED):
            raise ValueError(f"a new TrainingJob starts Pending (or Failed), not {new}")
        return new
    if new is current:
        return new
    if new not in ALLOWED[current]:
        raise ValueError(f"illegal phase change {current} -> {new}")
    return new


class Outcome(StrEnum):
    """What the current attempt's pods say, most urgent first."""

    FAILED = "failed"
    """A rank exited non-zero (not the emergency code), or its pod failed or vanished."""
    NODE_LOST = "node-lost"
    """A rank's node is gone or unready without any notice."""
    PREEMPTED = "preempted"
    """A rank exited after an emergency save (exit code 75): a preemption, not a failure."""
    SUCCEEDED = "succeeded"
    """Every rank's trainer exited 0."""
    UNSCHEDULABLE = "unschedulable"
    """Some rank cannot be placed (for elastic shrink)."""
    RUNNING = "running"
    """Every rank is running."""
    PENDING = "pending"
    """Still starting."""


@dataclass(frozen=True, kw_only=True)
class RankView:
    """What the controller saw of one rank's pod (None fields: not known yet)."""

    rank: int
    pod: str
    exists: bool = True
    phase: str = "Pending"
    node: str | None = None
    ip: str | None = None
    exit_code: int | None = None
    """The trainer container's exit code once it terminated."""
    running: bool = False
    """The trainer container is running."""
    unschedulable: bool = False
    node_lost: bool = False
    deleting: bool = False
    disrupted: bool = False
    """The pod is being deleted or carries a DisruptionTarget condition."""
    served_notice: bool = False
    """The rank's sidecar last reported a save for a notice or a signal (committed or
    skipped): the SDK stops training after serving one, so its exit 0 is not success."""
    committed_notice: bool = False
    """The rank's sidecar last reported that save *committed*. The checkpoint is then the
    truth, not the exit code: torchrun turns a worker's 75 into 1, and that exit is still a
    stop after a checkpoint."""


def every_rank(pods: int, procs_per_replica: int) -> str:
    """The "all N ranks" of a message, counting ranks as torchrun does (pods x processes per
    pod) and naming the pods when they are not the same number ("all 4 ranks (2 pods)")."""
    if procs_per_replica <= 1:
        return f"all {pods} ranks"
    return f"all {pods * procs_per_replica} ranks ({pods} pods)"


def classify(ranks: Sequence[RankView], replicas: int) -> tuple[Outcome, str]:
    """The attempt's outcome and a sentence for the on-call engineer.

    A trainer stops after the SDK serves a notice (``Checkpointer.step`` returns True on every
    rank), so an exit 0 is success only when no rank of the attempt was disrupted, none
    reported a served notice, and none exited with the emergency code. Any exit of a rank
    whose sidecar reported the notice save committed is a stop after a checkpoint, not a
    failure (a launcher such as torchrun reports its workers' 75 as 1).
    """
    ordered = sorted(ranks, key=lambda r: r.rank)
    stopped_by_notice = [
        r.rank
        for r in ordered
        if r.exit_code == EMERGENCY_EXIT_CODE or r.disrupted or r.served_notice
    ]
    for r in ordered:
        if (
            r.exit_code is not None
            and r.exit_code not in (0, EMERGENCY_EXIT_CODE)
            and not r.committed_notice
        ):
            return Outcome.FAILED, f"rank {r.rank} (pod {r.pod}) exited with code {r.exit_code}"
        if r.exists and r.phase == "Failed" and r.exit_code is None and not r.disrupted:
            return Outcome.FAILED, f"rank {r.rank} (pod {r.pod}) failed before its trainer ran"
    for r in ordered:
        if r.node_lost and r.exit_code is None:
            return Outcome.NODE_LOST, f"rank {r.rank}'s node {r.node} was lost without notice"
    for r in ordered:
        if not r.exists and not stopped_by_notice:
            return Outcome.FAILED, f"rank {r.rank}'s pod {r.pod} disappeared"
    finished = all(r.exit_code is not None or not r.exists for r in ordered)
    if stopped_by_notice and (finished or any(r.exit_code is not None for r in ordered)):
        if finished:
            ranks_txt = ", ".join(map(str, stopped_by_notice))
            return Outcome.PREEMPTED, (
                f"rank(s) {ranks_txt} stopped after an emergency save (eviction or notice)"
            )
        return Outcome.PENDING, "waiting for the ranks to stop after an emergency save"
    if len(ordered) == replicas and all(r.exit_code == 0 for r in ordered):
        return Outcome.SUCCEEDED, f"all {replicas} pods finished training"
    stuck = [r.rank for r in ordered if r.unschedulable]
    if stuck:
        return Outcome.UNSCHEDULABLE, (
            f"rank(s) {', '.join(map(str, stuck))} cannot be scheduled on any node"
        )
    if len(ordered) == replicas and all(r.running or r.exit_code == 0 for r in ordered):
        return Outcome.RUNNING, f"all {replicas} pods are running"
    return Outcome.PENDING, "waiting for pods to start"


def moves_at_once(phase: Phase) -> bool:
    """Whether a notice moves the job without a checkpoint request first.

    Before the attempt is Running nothing has trained since the last commit, so there is
    nothing to save: the job moves to other nodes at once, resuming from that commit.
    """
    return phase is not Phase.RUNNING


def clamp_deadline(deadline: datetime, *, now: datetime, least: timedelta) -> datetime:
    """``deadline``, moved to ``now + least`` when it is closer (or already past).

    The one place a deadline is clamped: the controller gives a notice at least the
    operator's ``minCheckpointWindowSeconds``; the sidecar client gives every request at least
    ``sidecars.MIN_LEAD`` (the sidecar refuses deadlines in the past).
    """
    return max(deadline, now + least)


def backoff_seconds(failures: int, *, base: float, ceiling: float) -> float:
    """Delay before the restart that follows the ``failures``-th failure (1-based)."""
    if failures <= 0 or base <= 0:
        return 0.0
    return float(min(ceiling, base * 2 ** (failures - 1)))


class VerdictKind(StrEnum):
    """What a checkpoint request has come to."""

    WAIT = "wait"
    COMMITTED = "committed"
    FALLBACK = "fallback"


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """The result of :func:`checkpoint_verdict`."""

    kind: VerdictKind
    step: int | None = None
    seconds: float | None = None
    uri: str | None = None
    reason: str = ""


def checkpoint_verdict(
    reports: Mapping[int, SidecarStatus | None],
    *,
    replicas: int,
    now: datetime,
    deadline: datetime,
    unreachable_is_final: Iterable[int] = (),
) -> Verdict:
    """Has the requested checkpoint committed, or is it time to fall back?

    ``reports`` maps rank -> the last answer of its sidecar to this request (None: none).
    A ``committed`` report means the manifest is written (docs/contracts.md), and the manifest
    is the commit of every rank's shards: one such report proves the whole checkpoint, even if
    the other ranks' pods are already gone (the SDK stops training after a notice, and a
    native sidecar stops with its trainer). ``unreachable_is_final`` lists ranks whose pod,
    node or sidecar is gone for good, so waiting for them is pointless.
    """
    gone = set(unreachable_is_final)
    for rank in range(replicas):
        report = reports.get(rank)
        if report is not None and report.state in (SaveState.FAILED, SaveState.SKIPPED):
            detail = f": {report.error}" if report.error else ""
            return Verdict(
                kind=VerdictKind.FALLBACK,
                reason=f"rank {rank} reported the save {report.state}{detail}",
            )
    committed = [r for r in reports.values() if r is not None and r.state == SaveState.COMMITTED]
    steps = {r.step for r in committed}
    if len(steps) > 1 or None in steps:
        return Verdict(
            kind=VerdictKind.FALLBACK,
            reason=f"ranks reported different committed steps {sorted(map(str, steps))}",
        )
    if committed:
        step = steps.pop()
        assert step is not None
        seconds = max((r.seconds or 0.0) for r in committed)
        uri = next((r.uri for r in committed if r.uri), None)
        return Verdict(kind=VerdictKind.COMMITTED, step=step, seconds=seconds, uri=uri)
    if gone >= set(range(replicas)):
        return Verdict(
            kind=VerdictKind.FALLBACK,
            reason="every rank's pod or sidecar went away before reporting a commit",
        )
    if now > deadline:
        silent = [r for r in range(replicas) if reports.get(r) is None]
        return Verdict(
            kind=VerdictKind.FALLBACK,
            reason="the deadline passed before the ranks reported a commit"
            + (f" (no answer from rank(s) {silent})" if silent else ""),
        )
    return Verdict(kind=VerdictKind.WAIT)


def elastic_replicas(spec: JobSpec, *, current: int, placeable: int) -> int | None:
    """How many replicas to shrink to, or None when the job may not (or need not) shrink.

    ``placeable`` is how many of the current attempt's ranks the scheduler could place.
    """
    if spec.min_replicas is None or placeable >= current:
        return None
    target = max(spec.min_replicas, placeable)
    return target if target < current else None


@dataclass(frozen=True, kw_only=True)
class RestartPlan:
    """The status changes of a restart (or of the end of the job when a budget ran out)."""

    phase: Phase
    attempt: int
    replicas: int
    preemptions: int
    failures: int
    resume_step: int | None
    restart_after: datetime | None
    reason: str
    """preemption, failure, elastic or suspend (the ``reason`` label of
    ``baton_restarts_total``; a suspend is not counted there)."""
    message: str
    exhausted: bool


def plan_restart(
    spec: JobSpec,
    *,
    kind: RestartKind,
    attempt: int,
    preemptions: int,
    failures: int,
    resume_step: int | None,
    now: datetime,
    replicas: int | None = None,
    detail: str = "",
) -> RestartPlan:
    """Count the restart against its budget and say what the next attempt is.

    ``kind`` is preemption, failure, elastic or suspend. A new attempt uses ``spec.replicas``
    (grow back) unless ``replicas`` is given (an elastic shrink). A suspend counts against no
    budget and ends in ``Suspended``: its next attempt starts when ``spec.suspend`` is false.
    """
    if kind not in tuple(RestartKind):
        raise ValueError(
            f"unknown restart kind {kind!r}: use preemption, failure, elastic or suspend"
        )
    resume = "from scratch" if resume_step is None else f"from step {resume_step}"

    def plan(phase: Phase, message: str, *, after: datetime | None = None) -> RestartPlan:
        # The budgets as counted below; a job that Failed keeps its attempt number.
        return RestartPlan(
            phase=phase,
            attempt=attempt if phase is Phase.FAILED else attempt + 1,
            replicas=replicas or spec.replicas,
            preemptions=preemptions,
            failures=failures,
            resume_step=resume_step,
            restart_after=after,
            reason=kind,
            message=message,
            exhausted=phase is Phase.FAILED,
        )

    if kind == RestartKind.SUSPEND:
        return plan(Phase.SUSPENDED, f"suspended ({detail}); unsuspending resumes {resume}")
    if kind == RestartKind.PREEMPTION:
        preemptions += 1
    elif kind == RestartKind.FAILURE:
        failures += 1
    if failures > spec.max_failures:
        return plan(
            Phase.FAILED,
            f"failure budget exhausted: {failures} failures > maxFailures "
            f"{spec.max_failures} (last: {detail}); fix the cause, then raise "
            "spec.failurePolicy.maxFailures or re-create the job",
        )
    if preemptions > spec.max_preemptions:
        return plan(
            Phase.FAILED,
            f"preemption budget exhausted: {preemptions} preemptions > maxPreemptions "
            f"{spec.max_preemptions}; consider on-demand nodes or raise "
            "spec.failurePolicy.maxPreemptions",
        )
    delay = (
        backoff_seconds(failures, base=spec.backoff_seconds, ceiling=spec.max_backoff_seconds)
        if kind == RestartKind.FAILURE
        else 0.0
    )
    after = now + timedelta(seconds=delay) if delay > 0 else None
    wait = f" after a {delay:.0f}s backoff" if delay > 0 else ""
    return plan(Phase.RESTARTING, f"restarting ({kind}: {detail}) {resume}{wait}", after=after)


RECOVERY_SECONDS: Final = 600.0
"""How long a recovery that keeps the survivors may take (from the decision to every rank
reporting its restore) before the operator gives up on it and starts a new attempt, as
without the memory tier. Generous: the replacement pod must be scheduled and started and
every rank must restore; a stuck recovery is what it bounds."""
RECOVERY_RESTARTS: Final = 3
"""In-place restarts of one pod's trainer that a recovery excuses (the broken process group,
then perhaps a rendezvous that timed out while the replacement started). More is a crash
loop: the operator counts a failure and starts a new attempt."""
NODE_NOT_READY_SECONDS: Final = 60.0
"""An upper bound of Kubernetes' node-monitor grace period (50 s by default since 1.32): how
long a node that died without notice may still look Ready."""


def restart_grace_seconds(node_lost_seconds: float) -> float:
    """How long an in-place trainer restart outside a recovery waits before it is counted as
    a crash: a survivor's trainer restarts within a second of its peer's loss (the process
    group breaks), while the node only looks lost after the node-monitor grace period and
    ``node_lost_seconds``. A restart that a recovery follows within this time is part of it."""
    return float(node_lost_seconds) + NODE_NOT_READY_SECONDS


@dataclass(frozen=True, kw_only=True)
class RecoveryPlan:
    """Which ranks' pods a recovery that keeps the survivors replaces, and which it keeps."""

    replace: tuple[int, ...]
    keep: tuple[int, ...]
    nodes: tuple[str, ...]
    """The lost nodes (the replacements avoid them)."""


def plan_recovery(
    ranks: Sequence[RankView], *, memory_tier: bool, master_is_name: bool
) -> tuple[RecoveryPlan | None, str]:
    """Whether a loss without notice can be recovered by replacing only the lost pods.

    The lost ranks are those whose node is lost or whose pod is gone. Returns the plan, or
    None and the reason the job restarts as a new attempt instead (the durable path): no
    memory tier, nothing lost, nothing left to keep, a rank that exited (a crash or the end of
    training is not a loss), a pod being deleted or given notice, or rank 0 lost while the
    ranks reach it at its pod IP (``masterAddr`` without gang scheduling), which a
    replacement cannot keep.
    """
    if not memory_tier:
        return None, "the job has no memory tier (spec.checkpoint.fastEverySteps)"
    ordered = sorted(ranks, key=lambda r: r.rank)
    lost = [r for r in ordered if not r.exists or (r.node_lost and r.exit_code is None)]
    keep = [r for r in ordered if r not in lost]
    if not lost:
        return None, "no pod was lost"
    if not keep:
        return None, "every pod was lost: there is no survivor to keep"
    for r in keep:
        if r.exit_code is not None:
            return None, f"rank {r.rank} (pod {r.pod}) exited with code {r.exit_code}"
        if r.disrupted:
            return None, f"rank {r.rank}'s pod {r.pod} is being deleted or was given notice"
    if any(r.rank == 0 for r in lost) and not master_is_name:
        return None, (
            "rank 0's pod was lost and the ranks reach it at its pod IP; a replacement gets "
            "another (gang scheduling gives the ranks rank 0's DNS name instead)"
        )
    nodes = tuple(sorted({r.node for r in lost if r.node and r.node_lost}))
    return RecoveryPlan(
        replace=tuple(r.rank for r in lost), keep=tuple(r.rank for r in keep), nodes=nodes
    ), ""


def plan_notice_recovery(
    ranks: Sequence[RankView], *, nodes: Sequence[str], master_is_name: bool
) -> tuple[RecoveryPlan | None, str]:
    """Whether a notice whose save committed to the memory tier can be answered by replacing
    only the pods on the noticed ``nodes`` (the others keep their sidecar and memory, and
    their trainers restart in place: ``EXIT_RESTART_IN_PLACE``).

    Returns the plan, or None and the reason the job restarts as a new attempt instead
    (today's path: it waits for the promotion to durable storage): no pod on a noticed node
    (nothing to replace), every pod on one (no survivor to keep), a kept pod that is being
    deleted, was lost or whose trainer ended for good, or rank 0 replaced while the ranks
    reach it at its pod IP (as :func:`plan_recovery`).
    """
    noticed = set(nodes)
    ordered = sorted(ranks, key=lambda r: r.rank)
    replace = [r for r in ordered if r.node in noticed]
    keep = [r for r in ordered if r not in replace]
    if not replace:
        return None, "no pod runs on the noticed node(s)"
    if not keep:
        return None, "every pod runs on a noticed node: there is no survivor to keep"
    for r in keep:
        if not r.exists or r.node_lost or r.deleting:
            return None, f"rank {r.rank}'s pod {r.pod} is gone, lost or being deleted"
        if r.exit_code is not None:
            return None, f"rank {r.rank}'s trainer (pod {r.pod}) ended with code {r.exit_code}"
    if any(r.rank == 0 for r in replace) and not master_is_name:
        return None, (
            "rank 0's pod is on the noticed node and the ranks reach it at its pod IP; a "
            "replacement gets another (gang scheduling gives the ranks rank 0's DNS name)"
        )
    return RecoveryPlan(
        replace=tuple(r.rank for r in replace),
        keep=tuple(r.rank for r in keep),
        nodes=tuple(sorted(noticed)),
    ), ""
