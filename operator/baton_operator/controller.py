"""One reconcile step of a TrainingJob: observe, ask the pure layer what to do, do it.

The kopf daemon of each job calls :meth:`Reconciler.tick` about once a second. A tick is
level-triggered and idempotent: it reads the job and its pods fresh, and every decision is
written to ``status`` *before* it is carried out (the status says "attempt 3, Restarting";
then attempt 2's pods are deleted; then attempt 3's are created under deterministic names). An
operator killed at any point and started again reads the same status and the same pods, and
continues where it stopped, with no duplicate pod and no lost step.

Every status write is guarded by the ``resourceVersion`` the tick read (or its own last write
returned): if anyone else changed the job in between (another operator, a user), the write
fails with a conflict and the tick starts again from a fresh read, deciding anew, instead of
overwriting what it never saw.

This module only sequences: the decisions are pure functions in ``lifecycle`` (phases,
budgets, verdicts, deadlines), ``pods`` (notices, deletes, rank views), ``reports`` (what a
sidecar's answer means) and ``jobstatus`` (status parsing and patches). The Node watch's
state comes through :class:`ClusterView`; starting a job and creating its objects is
``creating.py``, carrying out ``spec.suspend`` is ``suspending.py``, and the guarded writes are
``writing.py``.

At about 600 lines it is one state machine's sequencing (one method per phase, the notice
path, the sidecar polls); splitting it further would scatter a tick across files.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from . import disruption, economics, interval, lifecycle, manifests, podpolicy, reports
from .creating import Creator
from .errors import KubeConflictError, KubeError, SidecarUnreachableError
from .jobstatus import JobStatus, NoticeRecord, iso
from .kube import Kube
from .lifecycle import SUSPEND_SOURCE, Outcome, Phase, RankView, VerdictKind
from .metrics import Metrics
from .model import JobSpec, LastCheckpoint
from .nodes import UNSEEN_DELETION, ClusterView
from .notices import Notice, parse_time
from .pods import PodView, delete_grace, notice_for, noticed_nodes, rank_view, restarted
from .replicating import PeerWiring
from .reports import SidecarStatus
from .settings import EMERGENCY_EXIT_CODE, OperatorConfig
from .sidecars import SidecarClient
from .suspending import Suspender
from .tick import JobMemory, Tick
from .vocabulary import Trigger
from .watchcache import WatchCache
from .writing import EventPoster, StatusWriter

__all__ = ["ClusterView", "EventPoster", "JobMemory", "Reconciler"]

_log = logging.getLogger(__name__)

_OVERDUE: Final = timedelta(seconds=5)
"""A graceful pod deletion this long past its ``deletionTimestamp`` has no kubelet behind it."""
_NODE_CHECK_SECONDS: Final = 10.0

_CONFLICT_RETRIES: Final = 3
"""Fresh reads a tick makes after its guarded write lost a race, before it gives up (the
daemon then backs off and tries again)."""

_RESYNC_SECONDS: Final = 30.0
"""How often a job's tick reads the job and its pods through the API although the watch cache
holds them: a watch that reconnected after a gap re-lists what exists but reports no deletion
that happened in the gap (kopf does not), and this bounds how long such a ghost can last."""


def _now() -> datetime:
    return datetime.now(tz=UTC)


def _is_dns_name(address: str | None) -> bool:
    """Whether ``masterAddr`` is a name (gang path), which follows rank 0's pod replaced under
    the same name, rather than a pod IP, which does not."""
    if not address:
        return False
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return True
    return False


def _lost_pod(t: Tick, rank: int) -> dict[str, Any]:
    """A lost pod as a recovery records it: rank, name, UID and node (empty when already gone)."""
    pod = t.current.get(rank)
    return {
        "rank": rank,
        "pod": manifests.pod_name(t.spec.name, t.status.attempt, rank),
        "uid": pod.uid if pod else "",
        "node": pod.node if pod else None,
    }


def _interruption(t: Tick, cause: economics.Cause, *, resume_step: int | None) -> dict[str, Any]:
    """The interruption-history entry of an interruption of this tick's attempt."""
    return economics.entry(
        cause, attempt=t.status.attempt, resume_step=resume_step,
        progress=economics.progress(t.memory.reports.values()),
        gpus=economics.gpus(t.current.values()), now=t.now,
    )  # fmt: skip


def _last_commit_time(job: Mapping[str, Any], status: JobStatus) -> float:
    """Unix time of the job's newest known commit; its creation time when it has none.

    An attempt started by an unsuspend counts from its start when that is newer: the time the
    job was suspended is no time without a checkpoint (``BatonNoRecentCheckpoint``).
    """
    last = status.last_checkpoint
    when = parse_time(last.completed_at if last else None) or parse_time(
        (job.get("metadata") or {}).get("creationTimestamp")
    )
    raw: Mapping[str, Any] = job.get("status") or {}
    resumed = parse_time(raw.get("attemptStartedAt"))
    if raw.get("restartReason") == "suspend" and resumed and (when is None or resumed > when):
        when = resumed
    return (when or _now()).timestamp()


class Reconciler:
    """Drives TrainingJobs; shared by every job's daemon."""

    def __init__(
        self,
        *,
        kube: Kube,
        sidecars: SidecarClient,
        cluster: ClusterView,
        metrics: Metrics,
        config: OperatorConfig,
        post_event: EventPoster,
        token_for: Callable[[JobSpec], str],
        cache: WatchCache | None = None,
    ) -> None:
        self._kube = kube
        self._cache = cache
        """The watch cache the ticks read from; None: every tick reads through the API."""
        self._token_for = token_for
        """The sidecar token of a job (tokens.derive under the operator's key): the operator
        never reads a job's Secret back (docs/operator.md, Security policy)."""
        self._sidecars = sidecars
        self._cluster = cluster
        self._metrics = metrics
        self._config = config
        writer = StatusWriter(kube, post_event)
        self._patch = writer.patch
        self._event = writer.event
        self._pools = interval.PoolLedger()
        """Every job's node time and interruptions per pool, for ``everySeconds: auto``."""
        self._cost_written: dict[tuple[str, str], datetime] = {}
        """When each job's pod-deletion-cost was last written (disruption.cost_patches)."""
        self._node_checked: dict[str, datetime] = {}
        """When a node under an overdue pod deletion was last looked up (_gone_unseen)."""
        self._creator = Creator(
            kube=kube, config=config, token_for=token_for, writer=writer, pools=self._pools
        )
        self._peers = PeerWiring(sidecars=sidecars, cluster=cluster, config=config)
        """What each memory-tier job's sidecars were told of their peers (replicating.py)."""
        self._suspender = Suspender(
            config=config, metrics=metrics, writer=writer, creator=self._creator,
            restart=self._restart, hint=self._hint, delete_pods=self._delete_pods,
        )  # fmt: skip

    def forget(self, namespace: str, name: str) -> None:
        """The job was deleted: stop counting it and drop its metric series."""
        self._metrics.job_phase(namespace, name, None)
        self._metrics.job_deleted(namespace, name)
        if self._cache is not None:
            self._cache.forget_job(namespace, name)
        self._pools.forget((namespace, name))
        self._cost_written.pop((namespace, name), None)
        self._peers.forget(namespace, name)

    # ----------------------------------------------------------------- entry point

    async def tick(self, namespace: str, name: str, memory: JobMemory) -> float | None:
        """Reconcile once. Returns seconds until the next tick, or None when the job is gone
        or finished (the daemon may stop).

        A status write that lost a race (:class:`KubeConflictError`) starts the tick again
        from a fresh read through the API (not the watch cache), at most
        ``_CONFLICT_RETRIES`` times.
        """
        for retry in range(_CONFLICT_RETRIES + 1):
            try:
                return await self._tick(namespace, name, memory, fresh=retry > 0)
            except KubeConflictError as e:
                if retry == _CONFLICT_RETRIES:
                    raise
                _log.info("%s/%s: %s; deciding again from a fresh read", namespace, name, e)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _read_job(
        self, namespace: str, name: str, memory: JobMemory, *, fresh: bool
    ) -> Mapping[str, Any] | None:
        """The job (None: gone), from the watch cache when it is known to be at least as new
        as this daemon's last write, else through the API (which refreshes the cache)."""
        cache = self._cache
        if cache is not None and not fresh:
            body = cache.job(namespace, name)
            if body is not None and cache.job_at_least(namespace, name, memory.written_version):
                return body
        job = await self._kube.get_job(namespace, name)
        if job is not None and cache is not None:
            cache.put_job(job)
        return job

    async def _read_pods(self, spec: JobSpec, *, fresh: bool) -> list[Mapping[str, Any]]:
        """The job's pods, from the watch cache once a LIST has covered them, else (and when
        ``fresh``) through a LIST that is merged into the cache."""
        cache = self._cache
        selector = manifests.job_selector(spec.name)
        if cache is None:
            return list(await self._kube.list_pods(spec.namespace, selector))
        if not fresh and cache.pods_known(spec.namespace, spec.name):
            return cache.pods(spec.namespace, spec.name)
        since = cache.seq
        items = await self._kube.list_pods(spec.namespace, selector)
        cache.merge_pods(spec.namespace, spec.name, items, since=since)
        return list(items)

    async def _tick(
        self, namespace: str, name: str, memory: JobMemory, *, fresh: bool = False
    ) -> float | None:
        # The daemon's first tick reads through the API: after an operator restart or a
        # failover the other replica's last writes may not have reached this watch yet, and
        # this daemon is then the status's only writer (its writes set written_version).
        started = _now()
        fresh = (
            fresh
            or memory.synced_at is None
            or ((started - memory.synced_at).total_seconds() >= _RESYNC_SECONDS)
        )
        job = await self._read_job(namespace, name, memory, fresh=fresh)
        if job is None:
            self.forget(namespace, name)
            return None
        self._pools.observe((namespace, name), job)
        spec = JobSpec.from_body(job)
        status = JobStatus.from_body(job)
        phase = status.phase
        self._metrics.job_phase(namespace, name, (phase or Phase.PENDING).value)
        now = _now()
        tick = self._config.tick_seconds
        t = Tick(job=job, spec=spec, status=status, current={}, memory=memory, now=now,
                  version=status.resource_version)  # fmt: skip
        if phase not in (Phase.SUCCEEDED, Phase.FAILED):
            refused = podpolicy.refusals(spec.template, self._config.pod_policy)
            if refused:
                # Before anything is created: the operator's right to create pods is not
                # lent to a template that asks for the node's privileges.
                await self._creator.refuse(t, refused)
                return tick
            if spec.spec_error is not None:
                await self._creator.reject(t, "InvalidSpec", spec.spec_error)
                return tick
        if phase is None:
            await self._creator.start(t)
            return tick
        pods = [PodView.from_body(p) for p in await self._read_pods(spec, fresh=fresh)]
        if fresh:
            memory.synced_at = started
        # Derived from the phase on every tick, so no hint outlives its save (restarts too).
        await self._hint(t, pods, phase)
        if phase in (Phase.SUCCEEDED, Phase.FAILED):
            self._metrics.job_finished(namespace, name)
            if phase is Phase.FAILED:
                await self._delete_pods(spec, [p for p in pods if not p.finished], now)
            # A finished attempt's gang goes with it (its pods are kept, finished).
            await self._creator.drop_pod_groups(t, [status.attempt])
            return None
        if phase is Phase.SUSPENDED:
            # Nothing runs: no checkpoint is due and no budget is being spent, so the job's
            # gauges go as for a finished job (and are seeded again when it resumes).
            self._metrics.job_finished(namespace, name)
        else:
            self._metrics.job_running(
                namespace,
                name,
                failures_left=max(0, spec.max_failures - status.failures),
                last_checkpoint=_last_commit_time(job, status),
            )
        chosen = interval.recorded(job, status.attempt) if spec.auto_interval else None
        if chosen is not None:
            self._metrics.checkpoint_interval.labels(namespace, name).set(chosen)
        if memory.token is None:
            memory.token = self._token_for(spec)
        memory.for_attempt(status.attempt)
        t.current = {p.rank: p for p in pods if p.attempt == status.attempt}
        stale = [p for p in pods if p.attempt != status.attempt]
        if stale:
            # An old attempt's PodGroup goes with its pods (dropped at its restart already;
            # again here for an operator that stopped in between).
            await self._creator.drop_pod_groups(t, {p.attempt for p in stale})
        if phase is Phase.SUSPENDED:
            await self._suspender.suspended(t, pods)
            return tick
        if phase is Phase.RESTARTING:
            if spec.suspend:
                await self._suspender.idle(t, "spec.suspend is true before the attempt started")
                return tick
            await self._restarting(t, stale)
            return tick
        if stale:
            await self._delete_pods(spec, stale, now)
        replicas = status.replicas_or(spec.replicas)
        t.views = [self._view(t, rank) for rank in range(replicas)]
        if phase is Phase.CHECKPOINTING:
            await self._checkpointing(t)
            # A sidecar lives only a moment after its trainer stops: poll it often.
            return min(tick, 0.25)
        if spec.suspend:
            await self._suspender.begin(t, phase)
            return 0.0 if phase is Phase.RUNNING else tick
        recovery = (t.job.get("status") or {}).get("recovery")
        if recovery:
            await self._recovering(t, recovery)
            return tick
        await self._creator.ensure_pods(t, status, replicas=replicas)
        notice = notice_for(t.current.values(), self._cluster, now=now,
                            graces=self._config.graces)  # fmt: skip
        if notice is not None:
            await self._begin_checkpoint(t, phase, notice)
            # The requests go out in the next tick, which reads the status just written: at
            # once, not a quarter second later (a notice's seconds are the scarce ones).
            return 0.0
        await self._progress(t)
        await self._peers.sync(t, replicas=replicas)
        outcome, detail = lifecycle.classify(t.views, replicas)
        if outcome is Outcome.FAILED and any(
            v.exit_code not in (None, 0, EMERGENCY_EXIT_CODE) and not v.committed_notice
            for v in t.views
        ):
            # The exit code is not the whole truth: torchrun reports a worker's 75 ("stopped
            # after a committed notice save") as 1. The sidecar lingers until that save's
            # outcome is read; read it now, before a failure is counted.
            await self._poll_ranks(t.views, memory)
            t.views = [
                replace(
                    v,
                    served_notice=memory.served_notice(v.rank),
                    committed_notice=memory.committed_notice(v.rank),
                )
                for v in t.views
            ]
            outcome, detail = lifecycle.classify(t.views, replicas)
        if outcome in (Outcome.RUNNING, Outcome.PENDING) and await self._crashed_in_place(t):
            return tick
        await self._act(t, phase, outcome, detail)
        return tick

    def _view(self, t: Tick, rank: int) -> RankView:
        return rank_view(
            rank, t.current.get(rank), job=t.spec.name, status=t.status, cluster=self._cluster,
            now=t.now, graces=self._config.graces,
            served_notice=t.memory.served_notice(rank),
            committed_notice=t.memory.committed_notice(rank),
        )  # fmt: skip

    # ----------------------------------------------------------------- pods

    async def _hint(self, t: Tick, pods: Sequence[PodView], phase: Phase | None) -> None:
        """Bring the pods' disruption hints in line with ``phase`` (disruption.py).

        A hint is advice to the node removers: a refused patch is logged and tried again at
        the next tick, and never holds up the save or the restart it is about.
        """
        patches = disruption.hint_patches(
            pods, phase=phase, attempt=t.status.attempt, template=t.spec.template
        )
        for name, hints in patches.items():
            try:
                await self._kube.patch_pod_annotations(t.spec.namespace, name, hints)
            except KubeError as e:
                _log.warning("disruption hints on pod %s not updated: %s", name, e)

    async def _gone_unseen(self, pod: PodView, now: datetime) -> None:
        """A pod whose graceful deletion is overdue, on a node thought alive: if the Node no
        longer exists (deleted while the Node watch was down or refused: it never says so),
        the node is lost, so the pod is removed at once instead of waiting minutes for the
        pod garbage collector. One lookup per node every ``_NODE_CHECK_SECONDS`` at most."""
        node = pod.node
        deadline = parse_time(pod.body.get("metadata", {}).get("deletionTimestamp"))
        if node is None or deadline is None or now < deadline + _OVERDUE:
            return
        if self._cluster.node_lost(node, now=now):
            return
        checked = self._node_checked.get(node)
        if checked is not None and (now - checked).total_seconds() < _NODE_CHECK_SECONDS:
            return
        self._node_checked[node] = now
        if node not in await self._kube.list_node_names(only=node):
            self._cluster.remove_node(node)
            self._node_checked.pop(node, None)
            _log.warning(
                "%s", UNSEEN_DELETION.format(node=node, when=f"pod {pod.name} was overdue")
            )

    async def _delete_pods(self, spec: JobSpec, pods: Sequence[PodView], now: datetime) -> None:
        for pod in pods:
            if pod.deleting:
                await self._gone_unseen(pod, now)
            grace = delete_grace(pod, self._cluster, now=now,
                                 grace_seconds=self._config.delete_grace_seconds)  # fmt: skip
            if grace is not None:
                await self._kube.delete_pod(spec.namespace, pod.name, grace_seconds=grace)

    # ----------------------------------------------------------------- restarts

    async def _restart(
        self,
        t: Tick,
        *,
        kind: str,
        resume_step: int | None,
        detail: str,
        replicas: int | None = None,
        extra: Mapping[str, Any] | None = None,
        suspend_reason: str = "Suspended",
        cause: economics.Cause | None = None,
    ) -> None:
        spec, status, now = t.spec, t.status, t.now
        plan = lifecycle.plan_restart(
            spec, kind=kind, attempt=status.attempt, preemptions=status.preemptions,
            failures=status.failures, resume_step=resume_step, now=now, replicas=replicas,
            detail=detail,
        )  # fmt: skip
        suspended = plan.phase is Phase.SUSPENDED
        raw_status: Mapping[str, Any] = t.job.get("status") or {}
        # The attempt's node time ends here, whatever ends it (interval.py).
        noticed = [self._cluster.pool_of(n) for n in (cause.nodes if cause else ())]
        exposure = interval.closed(
            raw_status.get("exposure"), now=now, interrupted=kind in ("preemption", "failure"),
            noticed_pools=[p for p in noticed if p],
        )  # fmt: skip
        # An interruption (not a suspend, not an elastic shrink) goes into the history in the
        # same write as the decision, so that a restarted operator never records it twice.
        record = None
        costs: dict[str, Any] = {}
        if cause is not None and kind in ("preemption", "failure"):
            record = _interruption(t, cause, resume_step=plan.resume_step)
            raw: Mapping[str, Any] = t.job.get("status") or {}
            costs = {
                "interruptions": economics.appended(raw.get("interruptions") or [], record),
                "stepsLost": int(raw.get("stepsLost") or 0) + int(record.get("stepsLost") or 0),
            }
        patch = (
            t.patch()
            .phase(plan.phase)
            .condition("Checkpointing", False, "Done", plan.message)
            .condition("Ready", False, "Suspended" if suspended else "Restarting", plan.message)
            .set(
                {
                    "attempt": plan.attempt,
                    "replicas": plan.replicas,
                    "worldSize": plan.replicas * spec.procs_per_replica,
                    "preemptions": plan.preemptions,
                    "failures": plan.failures,
                    "resumedFromStep": plan.resume_step,
                    "restartReason": plan.reason,
                    "restartAfter": None if plan.restart_after is None else iso(plan.restart_after),
                    "masterAddr": None,
                    "notice": None,
                    # A new attempt has new pods: no recovery of the old one goes on.
                    "recovery": None,
                    "trainerRestarts": None,
                    "unschedulableSince": None,
                    "message": plan.message,
                    "exposure": exposure,
                    **costs,
                    **(extra or {}),
                }
            )
        )
        if plan.exhausted:
            reason = "FailureBudgetExhausted" if kind == "failure" else "PreemptionBudgetExhausted"
            patch.condition("Failed", True, reason, plan.message)
        if suspended:
            patch.condition("Suspended", True, suspend_reason, plan.message)
            patch.set({"suspendedAt": iso(now)})
        # The decision is durable before anything is deleted: a restarted operator resumes it.
        await self._patch(t, patch)
        self._metrics.failure_budget.labels(spec.namespace, spec.name).set(
            max(0, spec.max_failures - plan.failures)
        )
        if record is not None:
            self._metrics.interruption(spec.namespace, spec.name, record)
        # The save (if any) is over: the hints go before the pods do.
        await self._hint(t, list(t.current.values()), plan.phase)
        if plan.exhausted:
            await self._event(t.job, "Warning", "Failed", plan.message)
        elif suspended:
            # Neither a failure nor a preemption: no budget and no restart is counted.
            await self._event(t.job, "Normal", suspend_reason, plan.message)
        else:
            self._metrics.count_restart(spec.namespace, spec.name, plan.reason)
            if kind == "preemption":
                self._metrics.preemptions.labels(spec.namespace, spec.name).inc()
            await self._event(
                t.job, "Warning" if kind == "failure" else "Normal", "Restarting", plan.message
            )
        await self._delete_pods(spec, list(t.current.values()), now)
        await self._creator.drop_pod_groups(t, [status.attempt])

    async def _restarting(self, t: Tick, stale: Sequence[PodView]) -> None:
        spec, status, now = t.spec, t.status, t.now
        if stale:
            # The old attempt's pods must be fully gone before the new ones start: two
            # generations of ranks must never share a checkpoint directory or a rendezvous.
            await self._delete_pods(spec, stale, now)
            return
        if status.restart_after is not None and now < status.restart_after:
            return
        replicas = status.replicas_or(spec.replicas)
        resume = status.resumed_from_step
        message = f"attempt {status.attempt}: starting {replicas} replicas " + (
            "from scratch" if resume is None else f"from step {resume}"
        )
        await self._patch(
            t,
            t.patch()
            .phase(Phase.PENDING)
            .set({"attemptStartedAt": iso(now), "restartAfter": None, "message": message}),
        )
        await self._creator.ensure_pods(t, replace(status, master_addr=None), replicas=replicas)

    # ----------------------------------------------------------------- recovery

    async def _begin_recovery(self, t: Tick, detail: str) -> bool:
        """A loss without notice, with the memory tier on: replace only the lost pods.

        Returns False when the job restarts as a new attempt instead (lifecycle.plan_recovery
        says why; the failure budget is spent: the restart path fails the job). The decision
        (``status.recovery``, the failure, the interruption) is written before any pod is
        deleted, so a restarted operator carries it on (:meth:`_recovering`).
        """
        spec, status, now = t.spec, t.status, t.now
        plan, why = lifecycle.plan_recovery(
            t.views, memory_tier=spec.fast is not None,
            master_is_name=_is_dns_name(status.master_addr),
        )  # fmt: skip
        if plan is None:
            if spec.fast is not None:
                _log.info("%s: a new attempt, not a recovery: %s", spec.key, why)
            return False
        failures = status.failures + 1
        if failures > spec.max_failures:
            return False
        replaced = [_lost_pod(t, rank) for rank in plan.replace]
        kept = [t.current[r].name for r in plan.keep if r in t.current]
        cause = economics.Cause(source="node-lost" if plan.nodes else "failure", nodes=plan.nodes)
        record = _interruption(t, cause, resume_step=status.resume_step)
        raw: Mapping[str, Any] = t.job.get("status") or {}
        names = ", ".join(e["pod"] for e in replaced)
        message = (
            f"{detail}: replacing only pod(s) {names}; keeping {', '.join(kept)}, whose "
            "trainers restart in place and restore from the memory tier"
        )
        patch = (
            t.patch()
            .condition("Recovering", True, "PodsLost", message)
            .set(
                {
                    "failures": failures,
                    "message": message,
                    "avoidNodes": sorted(set(status.avoid_nodes) | set(plan.nodes)),
                    "recovery": {
                        "startedAt": iso(now), "replaced": replaced, "kept": kept,
                        "nodes": list(plan.nodes),
                    },
                    "interruptions": economics.appended(raw.get("interruptions") or [], record),
                    "stepsLost": int(raw.get("stepsLost") or 0) + int(record.get("stepsLost") or 0),
                }
            )
        )  # fmt: skip
        await self._patch(t, patch)
        key = (spec.namespace, spec.name)
        self._metrics.failure_budget.labels(*key).set(max(0, spec.max_failures - failures))
        self._metrics.interruption(spec.namespace, spec.name, record)
        self._metrics.count_restart(spec.namespace, spec.name, "failure")
        await self._event(t.job, "Warning", "Recovering", message)
        for entry in replaced:
            if entry["uid"]:
                # Force: the node is gone, no kubelet will confirm a graceful delete, and the
                # replacement takes the same name.
                await self._kube.delete_pod(spec.namespace, entry["pod"], grace_seconds=0)
        return True

    async def _recovering(self, t: Tick, recovery: Mapping[str, Any]) -> None:
        """Carry a recovery on: the lost pods go, their replacements come, and once every rank
        reports its restore the recovery ends (or, stuck, becomes a new attempt)."""
        spec, status, now = t.spec, t.status, t.now
        started = parse_time(recovery.get("startedAt")) or now
        replaced = {int(e["rank"]): e for e in recovery.get("replaced") or []}

        def old(pod: PodView | None) -> bool:
            """A replaced pod not gone yet (a noticed one is still on its node)."""
            entry = replaced.get(pod.rank) if pod is not None else None
            return pod is not None and entry is not None and pod.uid == entry.get("uid")

        pods = [p for p in t.current.values() if not old(p)]
        notice = notice_for(pods, self._cluster, now=now, graces=self._config.graces)
        if notice is not None:
            # Nothing trains until the recovery ends: move at once, as before a start.
            await self._begin_checkpoint(t, Phase.PENDING, notice)
            return
        replicas = status.replicas_or(spec.replicas)
        more = [
            v for v in t.views
            if v.rank not in replaced and (not v.exists or (v.node_lost and v.exit_code is None))
        ]  # fmt: skip
        if more and len(replaced) + len(more) < replicas:
            await self._extend_recovery(t, recovery, more)
            return
        for rank, entry in sorted(replaced.items()):
            pod = t.current.get(rank)
            if pod is not None and entry.get("uid") and pod.uid == entry["uid"]:
                await self._kube.delete_pod(spec.namespace, pod.name, grace_seconds=0)
            elif pod is None and t.memory.may_create(now):
                await self._creator.replace_pod(t, status, rank=rank, replicas=replicas)
        accounted: Mapping[str, Any] = (t.job.get("status") or {}).get("trainerRestarts") or {}
        why = ""
        for v in t.views:
            pod = t.current.get(v.rank)
            if old(pod):
                continue  # its end (a noticed pod's trainer killed) is the recovery's doing
            new = pod is not None and pod.uid != (replaced.get(v.rank) or {}).get("uid")
            if v.node_lost and (v.rank not in replaced or new):
                why = f"rank {v.rank}'s node {v.node} was lost during the recovery"
            elif v.exit_code == EMERGENCY_EXIT_CODE and recovery.get("cause") == "notice":
                why = (
                    f"rank {v.rank}'s trainer (pod {v.pod}) exited {EMERGENCY_EXIT_CODE} after "
                    "the memory-tier save, which its restart rule does not restart: exit "
                    "with ckpt.exit_code (76, EXIT_RESTART_IN_PLACE, after such a save)"
                )
            elif v.exit_code not in (None, 0):
                why = f"rank {v.rank} (pod {v.pod}) exited with code {v.exit_code}"
            elif pod is not None and pod.trainer_restarts > (
                int(accounted.get(pod.name) or 0) + lifecycle.RECOVERY_RESTARTS
            ):
                why = (
                    f"rank {v.rank}'s trainer restarted {pod.trainer_restarts} times (last "
                    f"exit code {pod.trainer_last_exit}): a crash loop"
                )
            if why:
                break
        if not why and (now - started).total_seconds() > lifecycle.RECOVERY_SECONDS:
            why = f"not every rank restored within {lifecycle.RECOVERY_SECONDS:.0f}s"
        if why:
            message = f"the recovery that kept the survivors failed: {why}"
            await self._event(t.job, "Warning", "RecoveryFailed", message)
            resume = status.resume_step
            last = status.last_checkpoint
            if last is not None and last.tier == reports.MEMORY_TIER:
                # A notice's memory commit not promoted yet goes with the pods: the new
                # attempt resumes from the last durable step (or a newer one it finds).
                resume = recovery.get("durableStep")
            # Counted as its own failure: the recovery's was counted when it began.
            await self._restart(
                t, kind="failure", resume_step=resume, detail=message,
                cause=economics.Cause(source="failure"),
            )  # fmt: skip
            return
        await self._poll_ranks(t.views, t.memory)
        fresh = [t.memory.reports.get(r) for r in range(replicas)]
        # A notice's recovery begins while the kept trainers still run (their stop after
        # the save): only a restore of the committed step (or newer) is the new process's.
        least = recovery.get("step") if recovery.get("cause") == "notice" else None
        restored = [
            r for r in fresh
            if r is not None and r.heartbeat is not None and r.heartbeat >= started
            and (r.restored_step is not None or (r.train_step is not None and least is None))
            and (least is None or (r.restored_step or 0) >= int(least))
        ]  # fmt: skip
        if len(restored) < replicas or len(t.current) < replicas:
            return
        await self._end_recovery(t, recovery, started, restored)

    async def _extend_recovery(
        self, t: Tick, recovery: Mapping[str, Any], more: Sequence[RankView]
    ) -> None:
        """More pods were lost before the recovery ended (nodes seldom die one at a time, and
        each is seen lost on its own): they are replaced by the same recovery, which was
        counted once, while a survivor remains; the restore has not ended (it needs every
        rank), so it simply waits for these too."""
        spec, status = t.spec, t.status
        added = [_lost_pod(t, v.rank) for v in sorted(more, key=lambda v: v.rank)]
        gone = {e["pod"] for e in added}
        nodes = sorted(
            set(recovery.get("nodes") or []) | {str(e["node"]) for e in added if e["node"]}
        )
        replaced = [*(recovery.get("replaced") or []), *added]
        kept = [k for k in recovery.get("kept") or [] if k not in gone]
        message = (
            f"also lost: pod(s) {', '.join(sorted(gone))}; replacing "
            f"{', '.join(str(e['pod']) for e in replaced)}, keeping {', '.join(kept)}"
        )
        raw: Mapping[str, Any] = t.job.get("status") or {}
        fields: dict[str, Any] = {
            "recovery": {**dict(recovery), "replaced": replaced, "kept": kept, "nodes": nodes},
            "avoidNodes": sorted(set(status.avoid_nodes) | set(nodes)),
            "message": message,
        }
        history = [dict(e) for e in raw.get("interruptions") or []]
        if history and int(history[-1].get("attempt", -1)) == status.attempt:
            history[-1]["nodes"] = nodes
            fields["interruptions"] = history
        await self._patch(
            t, t.patch().condition("Recovering", True, "PodsLost", message).set(fields)
        )
        await self._event(t.job, "Warning", "Recovering", message)
        for entry in added:
            if entry["uid"]:
                await self._kube.delete_pod(spec.namespace, entry["pod"], grace_seconds=0)

    async def _end_recovery(
        self,
        t: Tick,
        recovery: Mapping[str, Any],
        started: datetime,
        restored: Sequence[SidecarStatus],
    ) -> None:
        """Every rank restored: record from where and which tier, and what it cost."""
        spec, status, now = t.spec, t.status, t.now
        loaded = reports.loaded_step(restored)
        tiers = sorted({r.restored_tier for r in restored if r.restored_tier})
        tier = "durable" if "durable" in tiers else (tiers[0] if tiers else None)
        seconds = round((now - started).total_seconds(), 3)
        names = ", ".join(str(e.get("pod")) for e in recovery.get("replaced") or [])
        where = "from scratch" if loaded is None else f"from step {loaded}"
        if tier == "durable":
            reason, kind = "RecoveredFromDurable", "Warning"
            message = (
                f"replaced pod(s) {names}; the memory tier could not cover every rank (a pod "
                f"and the holder of its replica both lost?): the ranks restored {where} of "
                "the durable tier, and the steps since are lost"
            )
        else:
            reason, kind = "Recovered", "Normal"
            message = (
                f"replaced pod(s) {names}, kept {', '.join(recovery.get('kept') or [])}; "
                f"the ranks restored {where} of the {tier or 'unknown'} tier in {seconds:.1f}s"
            )
        if recovery.get("cause") == "notice":
            message = f"after the {recovery.get('noticeSource') or 'eviction'} notice: {message}"
        raw: Mapping[str, Any] = t.job.get("status") or {}
        fields: dict[str, Any] = {
            "recovery": None,
            "message": message,
            "trainerRestarts": {p.name: p.trainer_restarts for p in t.current.values()},
            "lastRecovery": {
                **dict(recovery), "finishedAt": iso(now), "seconds": seconds,
                "restoredStep": loaded, "tier": tier,
            },
        }  # fmt: skip
        if loaded is not None:
            fields["resumedFromStep"] = loaded
            # The interruption this recovery began with (same attempt): it resumed here.
            fixed = economics.resume_corrected(
                raw.get("interruptions") or [], attempt=status.attempt + 1, loaded=loaded
            )
            if fixed is not None:
                history, delta = fixed
                history[-1]["restartSeconds"] = seconds
                fields["interruptions"] = history
                fields["stepsLost"] = max(0, int(raw.get("stepsLost") or 0) + delta)
        await self._patch(t, t.patch().condition("Recovering", False, reason, message).set(fields))
        t.status = replace(t.status, resumed_from_step=loaded)
        self._metrics.restart_seconds.labels(spec.namespace, spec.name).observe(seconds)
        await self._event(t.job, kind, reason, message)

    async def _crashed_in_place(self, t: Tick) -> bool:
        """A trainer the kubelet restarted in place outside a recovery: a crash, counted as a
        failure (a new attempt, as without the memory tier) once no recovery has explained it
        within :func:`lifecycle.restart_grace_seconds` (a survivor's trainer restarts before
        its peer's node looks lost). Returns True when it restarted the job."""
        accounted: Mapping[str, Any] = (t.job.get("status") or {}).get("trainerRestarts") or {}
        crashed = restarted(t.current.values(), accounted)
        memory = t.memory
        if not crashed:
            memory.restart_seen_at = None
            return False
        if memory.restart_seen_at is None:
            memory.restart_seen_at = t.now
        grace = lifecycle.restart_grace_seconds(self._config.node_lost_seconds)
        if (t.now - memory.restart_seen_at).total_seconds() < grace:
            return False
        first = crashed[0]
        detail = (
            f"rank {first.rank}'s trainer (pod {first.name}) exited with code "
            f"{first.trainer_last_exit} and was restarted in place "
            f"{first.trainer_restarts} time(s) without a node loss"
        )
        memory.restart_seen_at = None
        await self._restart(
            t, kind="failure", resume_step=t.status.resume_step, detail=detail,
            cause=economics.Cause(source="failure"),
        )  # fmt: skip
        return True

    # ----------------------------------------------------------------- notices

    async def _begin_checkpoint(self, t: Tick, phase: Phase, notice: Notice) -> None:
        status, now = t.status, t.now
        noticed = noticed_nodes(t.current.values(), self._cluster, now=now,
                                graces=self._config.graces)  # fmt: skip
        avoid = [n for n in sorted(set(status.avoid_nodes) | set(noticed) | {notice.node}) if n]
        if notice.source == "disruption-target":
            self._metrics.notices.labels(notice.source).inc()
        if lifecycle.moves_at_once(phase):
            await self._event(
                t.job, "Normal", "EvictionNotice",
                f"{notice.reason} on node {notice.node} before the attempt was running; "
                "moving the job to other nodes",
            )  # fmt: skip
            await self._restart(
                t, kind="preemption", resume_step=status.resume_step,
                detail=f"{notice.source} notice on {notice.node} before start",
                extra={"avoidNodes": avoid},
                cause=economics.Cause(
                    source=notice.source, nodes=tuple(noticed or [notice.node]), notice_at=now,
                    deadline=notice.deadline,
                ),
            )  # fmt: skip
            return
        deadline = lifecycle.clamp_deadline(
            notice.deadline, now=now,
            least=timedelta(seconds=self._config.min_checkpoint_window_seconds),
        )  # fmt: skip
        message = (
            f"{notice.reason} on node {notice.node}: asking all "
            f"{len(t.current)} ranks to checkpoint before {iso(deadline)}"
        )
        notice_status = {
            "source": notice.source,
            "nodes": noticed or [notice.node],
            "reason": notice.reason,
            "deadline": iso(deadline),
            "receivedAt": iso(now),
        }
        await self._patch(
            t,
            t.patch()
            .phase(Phase.CHECKPOINTING)
            .condition("Checkpointing", True, "EvictionNotice", message)
            .set({"avoidNodes": avoid, "notice": notice_status, "message": message}),
        )
        await self._hint(t, list(t.current.values()), Phase.CHECKPOINTING)
        await self._event(t.job, "Warning", "EvictionNotice", message)

    @staticmethod
    def _notice_cause(
        notice: NoticeRecord | None, *, durable_at: datetime | None
    ) -> economics.Cause:
        """The interruption a notice's save ended (``durable_at``: when it committed)."""
        if notice is None:
            return economics.Cause(source="notice", durable_at=durable_at)
        return economics.Cause(
            source=notice.source or "notice", nodes=notice.nodes, notice_at=notice.received_at,
            deadline=notice.deadline, durable_at=durable_at,
        )  # fmt: skip

    async def _checkpointing(self, t: Tick) -> None:
        spec, status, now, memory, views = t.spec, t.status, t.now, t.memory, t.views
        notice = status.notice
        deadline = (notice.deadline if notice else None) or now
        received = (notice.received_at if notice else None) or now
        source = notice.source if notice else None
        replicas = len(views)
        ids = list(notice.request_ids) if notice else []
        if notice is None or notice.requested_at is None:
            ids = []
            reason = notice.describe() if notice else "None: None"
            for v in views:
                rid = ""
                if v.ip and v.exit_code is None:
                    try:
                        rid = await self._sidecars.request_checkpoint(
                            v.ip, memory.token or "", deadline=deadline, reason=reason
                        )
                    except SidecarUnreachableError as e:
                        _log.warning("checkpoint request to rank %d failed: %s", v.rank, e)
                ids.append(rid)
            await self._patch(
                t, t.patch().set({"notice": {"requestedAt": iso(now), "requestIds": ids}})
            )
        live = await self._poll_ranks(views, memory)
        answers: dict[int, SidecarStatus | None] = {}
        gone: list[int] = []
        for v in views:
            report = memory.reports.get(v.rank)
            expected = ids[v.rank] if v.rank < len(ids) else ""
            if report is not None and not reports.answers(report, expected):
                report = None  # e.g. the last periodic save: not the answer to this notice
            answers[v.rank] = report
            finished = v.exit_code is not None or v.phase in ("Succeeded", "Failed")
            if v.node_lost or not v.exists or (live.get(v.rank) is None and finished):
                gone.append(v.rank)
        if spec.fast is not None and source != SUSPEND_SOURCE and not spec.suspend:
            # Every rank's snapshot is in its memory and a peer's on another node: answered
            # by replacing only the noticed node's pods, without waiting for the promotion.
            step = reports.memory_commit([memory.reports.get(v.rank) for v in views], ids)
            if step is not None and await self._begin_notice_recovery(t, step):
                return
        verdict = lifecycle.checkpoint_verdict(
            answers, replicas=replicas, now=now, deadline=deadline, unreachable_is_final=gone
        )
        if verdict.kind is VerdictKind.WAIT:
            return
        nodes = ", ".join(notice.nodes if notice else ())
        # A suspend's save, or a notice's save while the job is being suspended: either way
        # the pods stop and stay stopped (no preemption is counted).
        suspending = source == SUSPEND_SOURCE or spec.suspend
        if suspending:
            await self._suspender.end_save(t, verdict)
            return
        if verdict.kind is VerdictKind.COMMITTED and verdict.step is not None:
            checkpoint = LastCheckpoint(
                step=verdict.step,
                uri=verdict.uri or spec.checkpoint_uri,
                trigger=Trigger.NOTICE.value,
                completed_at=iso(now),
                seconds=verdict.seconds,
                tier=reports.commit_tier(answers.values(), verdict.step),
            )
            key = (spec.namespace, spec.name)
            self._metrics.checkpoint_committed(*key, checkpoint.tier)
            self._metrics.notice_to_commit.labels(*key).observe((now - received).total_seconds())
            self._metrics.deadline_margin.labels(*key).observe((deadline - now).total_seconds())
            self._metrics.last_checkpoint.labels(*key).set(now.timestamp())
            await self._event(
                t.job, "Normal", "CheckpointCommitted",
                f"all {replicas} ranks committed step {verdict.step} "
                f"{(now - received).total_seconds():.1f}s after the notice; "
                f"moving off node(s) {nodes}",
            )  # fmt: skip
            await self._restart(
                t, kind="preemption", resume_step=verdict.step,
                detail=f"{source} notice, checkpoint at step {verdict.step}",
                extra={"lastCheckpoint": checkpoint.to_status()},
                cause=self._notice_cause(notice, durable_at=now),
            )  # fmt: skip
            return
        # Fall back to the newest step every rank is known to have committed.
        best, extra = reports.fallback_fields(
            status.last_checkpoint, memory.reports.values(), uri=spec.checkpoint_uri, now=iso(now)
        )
        # Not "work after it is lost": the ranks load the newest committed step, and a notice
        # save that committed unseen (its sidecars gone during an API outage) is then reported
        # as ResumeStepCorrected.
        message = f"checkpoint before the notice did not complete ({verdict.reason}); " + (
            "resuming from the start (no checkpoint was committed yet)" if best is None else
            f"the last step known to be committed is {best}: the ranks resume from it, or "
            "from a newer step committed unseen"
        )  # fmt: skip
        await self._event(t.job, "Warning", "CheckpointFallback", message)
        await self._restart(
            t, kind="preemption", resume_step=best, detail=f"{source} notice, {verdict.reason}",
            extra=extra, cause=self._notice_cause(notice, durable_at=None),
        )  # fmt: skip

    async def _begin_notice_recovery(self, t: Tick, step: int) -> bool:
        """Every rank committed the notice's save of ``step`` to the memory tier: replace only
        the pods on the noticed node(s) and keep the others (a recovery, as after a node lost
        without notice, but counted as a preemption).

        The kept pods' trainers exit ``EXIT_RESTART_IN_PLACE`` and are restarted in place;
        every rank restores ``step`` from memory (the replacements' files from the peers'
        replicas) and promotes it to durable storage (``_learn_commit`` records the promotion).
        Returns False when the job takes today's path instead (a new attempt once the
        snapshot is promoted; ``lifecycle.plan_notice_recovery`` says why).
        """
        spec, status, now, memory = t.spec, t.status, t.now, t.memory
        notice = status.notice
        nodes = notice.nodes if notice else ()
        plan, why = lifecycle.plan_notice_recovery(
            t.views, nodes=nodes, master_is_name=_is_dns_name(status.master_addr)
        )
        if plan is None:
            _log.info("%s: the memory-tier commit of step %d waits for its promotion and a "
                      "new attempt: %s", spec.key, step, why)  # fmt: skip
            return False
        preemptions = status.preemptions + 1
        if preemptions > spec.max_preemptions:
            return False  # the restart path fails the job, naming the budget
        reps = [memory.reports.get(v.rank) for v in t.views]
        received = (notice.received_at if notice else None) or now
        deadline = (notice.deadline if notice else None) or now
        seconds = [r.seconds for r in reps if r is not None and r.seconds is not None]
        checkpoint = LastCheckpoint(
            step=step, uri=spec.checkpoint_uri, trigger=Trigger.NOTICE.value,
            completed_at=iso(now), seconds=max(seconds) if seconds else None,
            tier=reports.commit_tier(reps, step) or reports.MEMORY_TIER,
        )  # fmt: skip
        replaced = [_lost_pod(t, rank) for rank in plan.replace]
        kept = [t.current[r].name for r in plan.keep if r in t.current]
        record = _interruption(t, self._notice_cause(notice, durable_at=now), resume_step=step)
        raw: Mapping[str, Any] = t.job.get("status") or {}
        names = ", ".join(e["pod"] for e in replaced)
        after = (now - received).total_seconds()
        source = (notice.source if notice else None) or "notice"
        message = (
            f"{source} notice on node(s) {', '.join(plan.nodes)}: all {len(t.views)} ranks "
            f"committed step {step} to the memory tier {after:.1f}s after the notice; "
            f"replacing only pod(s) {names}, keeping {', '.join(kept)}, whose trainers "
            "restart in place and restore it from memory"
        )
        last = status.last_checkpoint
        durable = last.step if last is not None and last.tier != reports.MEMORY_TIER else None
        patch = (
            t.patch()
            .phase(Phase.RUNNING)
            .condition("Checkpointing", False, "Done", message)
            .condition("Recovering", True, "Notice", message)
            .set(
                {
                    "preemptions": preemptions,
                    "message": message,
                    "notice": None,
                    "lastCheckpoint": checkpoint.to_status(),
                    "recovery": {
                        "startedAt": iso(now), "cause": "notice", "noticeSource": source,
                        "step": step, "durableStep": durable, "replaced": replaced,
                        "kept": kept, "nodes": list(plan.nodes),
                    },
                    "interruptions": economics.appended(raw.get("interruptions") or [], record),
                    "stepsLost": int(raw.get("stepsLost") or 0) + int(record.get("stepsLost") or 0),
                }
            )
        )  # fmt: skip
        await self._patch(t, patch)
        key = (spec.namespace, spec.name)
        self._metrics.checkpoint_committed(*key, checkpoint.tier)
        self._metrics.notice_to_commit.labels(*key).observe(after)
        self._metrics.deadline_margin.labels(*key).observe((deadline - now).total_seconds())
        self._metrics.last_checkpoint.labels(*key).set(now.timestamp())
        self._metrics.interruption(spec.namespace, spec.name, record)
        self._metrics.count_restart(spec.namespace, spec.name, "preemption")
        self._metrics.preemptions.labels(*key).inc()
        await self._event(
            t.job, "Normal", "CheckpointCommitted",
            f"all {len(t.views)} ranks committed step {step} to the memory tier {after:.1f}s "
            f"after the notice; it is promoted to durable storage after the recovery",
        )  # fmt: skip
        await self._event(t.job, "Normal", "Recovering", message)
        # The save is over: the hints go before the pods do (as at a restart).
        await self._hint(t, list(t.current.values()), Phase.RUNNING)
        for entry in replaced:
            if entry["uid"]:
                # Force: the noticed trainer must not start another save (its SIGTERM's)
                # that the kept ranks would join; the replacement takes the same name.
                await self._kube.delete_pod(spec.namespace, entry["pod"], grace_seconds=0)
        return True

    # ----------------------------------------------------------------- sidecars

    async def _poll_ranks(
        self, views: Sequence[RankView], memory: JobMemory
    ) -> dict[int, SidecarStatus]:
        """Ask every reachable sidecar for its status; remember each answer in ``memory``."""
        live: dict[int, SidecarStatus] = {}
        if memory.token is None:
            return live
        for v in views:
            if not v.ip or v.node_lost:
                continue
            try:
                live[v.rank] = await self._sidecars.status(v.ip, memory.token)
            except SidecarUnreachableError as e:
                _log.debug("rank %d status: %s", v.rank, e)
                continue
            memory.reports[v.rank] = live[v.rank]
        return live

    async def _progress(self, t: Tick) -> None:
        """Learn periodic commits (and served notices) from the sidecars, every few seconds."""
        if t.memory.next_progress_poll is not None and t.now < t.memory.next_progress_poll:
            return
        t.memory.next_progress_poll = t.now + timedelta(seconds=self._config.progress_poll_seconds)
        await self._learn_commit(t)
        await self._check_resume(t)
        await self._account(t)
        await self._deletion_cost(t)

    async def _deletion_cost(self, t: Tick) -> None:
        """Keep the pods' pod-deletion-cost in step with the work since the last commit
        (``spec.disruption.deletionCost``; off: take it off). Advice, like the hints: a
        refused patch is logged and tried again at the next poll."""
        spec, status = t.spec, t.status
        pods = list(t.current.values())
        cost = None
        if spec.deletion_cost:
            now_progress = economics.progress(t.memory.reports.values())
            last = status.last_checkpoint
            committed = max(last.step if last else 0, status.resumed_from_step or 0)
            cost = disruption.work_at_risk(
                step=now_progress.step, committed_step=committed,
                step_seconds=now_progress.step_seconds, gpus=economics.gpus(pods),
            )  # fmt: skip
        key = (spec.namespace, spec.name)
        patches = disruption.cost_patches(
            pods, enabled=spec.deletion_cost, attempt=status.attempt, template=spec.template,
            cost=cost, last_write=self._cost_written.get(key), now=t.now,
        )  # fmt: skip
        for name, patch in patches.items():
            try:
                await self._kube.patch_pod_annotations(spec.namespace, name, patch)
            except KubeError as e:
                _log.warning("pod-deletion-cost on pod %s not updated: %s", name, e)
                return
        if patches and spec.deletion_cost:
            self._cost_written[key] = t.now

    async def _account(self, t: Tick) -> None:
        """Keep the interruption history's restart time and the job's goodput up to date
        from the sidecars' reports (economics.py; polled with the progress)."""
        spec, now = t.spec, t.now
        raw: Mapping[str, Any] = t.job.get("status") or {}
        now_progress = economics.progress(t.memory.reports.values())
        fields: dict[str, Any] = {}
        filled = economics.filled_restart(
            raw.get("interruptions") or [], attempt=t.status.attempt, now_progress=now_progress
        )
        if filled is not None:
            fields["interruptions"] = filled
            seconds = filled[-1]["restartSeconds"]
            self._metrics.restart_seconds.labels(spec.namespace, spec.name).observe(seconds)
        created = parse_time((t.job.get("metadata") or {}).get("creationTimestamp"))
        good = economics.goodput(
            step=now_progress.step, step_seconds=now_progress.step_seconds, created=created,
            suspended_seconds=float(raw.get("suspendedSeconds") or 0.0), now=now,
        )  # fmt: skip
        if good is not None:
            self._metrics.goodput.labels(spec.namespace, spec.name).set(good.ratio)
            due = t.memory.next_goodput_write
            if due is None or now >= due:
                fields["goodput"] = good.to_status(now)
                t.memory.next_goodput_write = now + timedelta(
                    seconds=economics.GOODPUT_WRITE_SECONDS
                )
        if fields:
            await self._patch(t, t.patch().set(fields))
        history = fields.get("interruptions") or raw.get("interruptions") or []
        started = parse_time(raw.get("attemptStartedAt"))
        if economics.eager(history, attempt=t.status.attempt, now_progress=now_progress,
                           started=started, now=now):  # fmt: skip
            # A new attempt's first steps say when training resumed and what a step costs:
            # read them at the next tick, not a progress period later.
            t.memory.next_progress_poll = now + timedelta(seconds=self._config.tick_seconds)

    async def _check_resume(self, t: Tick) -> None:
        """Make ``status.resumedFromStep`` the step the ranks actually loaded.

        The checkpoint store is the truth, and the ranks' sidecars report what they restored
        from it (``reports.loaded_step``). An operator that restarted while the ranks'
        notice save was committing may have recorded an older step; the SDK still loads the
        newest complete one, and the status says so from then on.
        """
        loaded = reports.loaded_step(t.memory.reports.values())
        recorded = t.status.resumed_from_step
        if loaded is None or loaded == recorded:
            return
        message = (
            f"attempt {t.status.attempt}: the ranks loaded step {loaded}, not the recorded "
            + ("start" if recorded is None else f"step {recorded}")
            + " (the checkpoint store holds a newer complete step than the operator knew of); "
            "status.resumedFromStep now says so"
        )
        fields: dict[str, Any] = {"resumedFromStep": loaded, "message": message}
        raw: Mapping[str, Any] = t.job.get("status") or {}
        # The interruption that led here resumed from the loaded step: its cost follows.
        fixed = economics.resume_corrected(
            raw.get("interruptions") or [], attempt=t.status.attempt, loaded=loaded
        )
        if fixed is not None:
            history, delta = fixed
            fields["interruptions"] = history
            fields["stepsLost"] = max(0, int(raw.get("stepsLost") or 0) + delta)
        await self._patch(t, t.patch().set(fields))
        t.status = replace(t.status, resumed_from_step=loaded)
        await self._event(t.job, "Warning", "ResumeStepCorrected", message)

    async def _learn_commit(self, t: Tick) -> int | None:
        """Poll the sidecars and record a newer committed step in ``status.lastCheckpoint``.

        Any rank's ``committed`` proves the manifest is written; returns the newest known step.
        """
        await self._poll_ranks(t.views, t.memory)
        last = t.status.last_checkpoint
        best = reports.fallback_step(last, t.memory.reports.values())
        if (
            last is not None
            and last.tier == reports.MEMORY_TIER
            and best == last.step
            and any(r.committed_step == last.step for r in t.memory.reports.values())
        ):
            # A rank proves the step durable: the memory commit's promotion committed.
            await self._promoted(t, last)
            return best
        if best is None or (last is not None and best <= last.step):
            return best
        source = next((r for r in t.memory.reports.values() if r.committed_step == best), None)
        checkpoint = LastCheckpoint(
            step=best,
            uri=(source.uri if source else None) or t.spec.checkpoint_uri,
            trigger=(source.trigger if source else None) or Trigger.PERIODIC.value,
            completed_at=iso(t.now),
            seconds=source.seconds if source else None,
            tier=reports.commit_tier(t.memory.reports.values(), best),
        )
        await self._patch(t, t.patch().set({"lastCheckpoint": checkpoint.to_status()}))
        t.status = replace(t.status, last_checkpoint=checkpoint)
        self._metrics.checkpoint_committed(t.spec.namespace, t.spec.name, checkpoint.tier)
        self._metrics.last_checkpoint.labels(t.spec.namespace, t.spec.name).set(t.now.timestamp())
        return best

    async def _promoted(self, t: Tick, last: LastCheckpoint) -> None:
        """The memory commit ``last`` is durable now (its promotion committed, at the notice
        or at the restore that followed): say so in status, metrics and an Event."""
        checkpoint = replace(last, tier=reports.PROMOTED_TIER)
        await self._patch(t, t.patch().set({"lastCheckpoint": checkpoint.to_status()}))
        t.status = replace(t.status, last_checkpoint=checkpoint)
        self._metrics.checkpoint_committed(t.spec.namespace, t.spec.name, checkpoint.tier)
        await self._event(
            t.job, "Normal", "CheckpointPromoted",
            f"step {last.step}, committed to the memory tier, is promoted to durable storage "
            f"under {t.spec.checkpoint_uri}",
        )  # fmt: skip

    # ----------------------------------------------------------------- outcomes

    async def _succeed(self, t: Tick) -> None:
        message = f"all {len(t.current)} ranks finished training"
        await self._patch(
            t,
            t.patch()
            .phase(Phase.SUCCEEDED)
            .condition("Ready", False, "Succeeded", message)
            .condition("Succeeded", True, "Succeeded", message)
            .condition("Checkpointing", False, "Done", message)
            .set(
                {
                    "message": message,
                    "notice": None,
                    "exposure": interval.closed(
                        (t.job.get("status") or {}).get("exposure"), now=t.now, interrupted=False
                    ),
                }
            ),
        )
        await self._event(t.job, "Normal", "Succeeded", message)

    async def _act(self, t: Tick, phase: Phase, outcome: Outcome, detail: str) -> None:
        status = t.status
        resume = status.resume_step
        if outcome is Outcome.SUCCEEDED:
            await self._succeed(t)
        elif outcome in (Outcome.FAILED, Outcome.NODE_LOST):
            if await self._begin_recovery(t, detail):
                return
            lost = tuple(sorted({v.node for v in t.views if v.node_lost and v.node}))
            source = "node-lost" if outcome is Outcome.NODE_LOST else "failure"
            await self._restart(
                t, kind="failure", resume_step=resume, detail=detail,
                cause=economics.Cause(source=source, nodes=lost),
            )  # fmt: skip
        elif outcome is Outcome.PREEMPTED:
            # The rank saved on its own (SIGTERM or a cloud notice its sidecar saw): ask the
            # survivors' rank 0 what it committed, then resume there.
            learned = await self._learn_commit(t)
            nodes = tuple(sorted({v.node for v in t.views if v.served_notice and v.node}))
            await self._restart(
                t, kind="preemption", resume_step=learned if learned is not None else resume,
                detail=detail, cause=economics.Cause(source="eviction", nodes=nodes),
            )  # fmt: skip
        elif outcome is Outcome.UNSCHEDULABLE:
            await self._maybe_shrink(t, detail)
        elif outcome is Outcome.RUNNING and phase is Phase.PENDING:
            resume_txt = "" if status.resumed_from_step is None else (
                f", resumed from step {status.resumed_from_step}"
            )  # fmt: skip
            message = f"attempt {status.attempt}: {detail}{resume_txt}"
            # The attempt's node time starts now, on the pools of its nodes (interval.py).
            on = {p.node for p in t.current.values() if p.node}
            exposure = interval.opened(
                (t.job.get("status") or {}).get("exposure"), since=t.now,
                node_pools=[self._cluster.pool_of(n) for n in sorted(on)],
            )  # fmt: skip
            await self._patch(
                t,
                t.patch()
                .phase(Phase.RUNNING)
                .condition("Ready", True, "Running", message)
                .set({"message": message, "unschedulableSince": None, "exposure": exposure}),
            )
            await self._event(t.job, "Normal", "Running", message)

    async def _maybe_shrink(self, t: Tick, detail: str) -> None:
        spec, status, now = t.spec, t.status, t.now
        since = status.unschedulable_since
        if since is None:
            await self._patch(t, t.patch().set({"unschedulableSince": iso(now), "message": detail}))
            return
        replicas = status.replicas_or(spec.replicas)
        if now - since < timedelta(seconds=spec.elastic_wait_seconds):
            return
        # The scheduler is the judge of capacity (node selectors, taints, resources, one rank
        # per node): the ranks it could place are what the job can have now.
        placed = sum(1 for p in t.current.values() if p.node)
        placeable, why = placed, f"{placed} could be placed"
        if not placed and any(
            (p.body.get("spec") or {}).get("schedulingGroup") for p in t.current.values()
        ):
            # A gang binds all of its pods or none, so how many would fit is not known: one
            # replica fewer each time, down to minReplicas (the largest size that fits wins).
            placeable, why = replicas - 1, "a gang: none is bound until all fit; one fewer"
        target = lifecycle.elastic_replicas(spec, current=replicas, placeable=placeable)
        if target is None:
            return
        await self._restart(
            t, kind="elastic", resume_step=status.resume_step,
            detail=f"{detail} for {spec.elastic_wait_seconds:.0f}s; shrinking from {replicas} "
            f"to {target} replicas ({why})",
            replicas=target,
            # Noticed nodes are gone or going; a shrunk job may use any node that is left.
            extra={"avoidNodes": []},
        )  # fmt: skip
