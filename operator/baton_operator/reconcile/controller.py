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

This module dispatches: it reads the job and its pods, and switches on the phase. What each
phase does is in the modules beside it, one per concern, each one object per operator that
every job's ticks share (docs/contributing.md, "Operator"):

- ``noticing.py``: the notice path (a notice recorded, the checkpoint requests, the verdict,
  notice recovery); a suspend's save ends in ``suspending.py``;
- ``recovering.py``: recovery with the memory tier (begin, carry on, extend, end) and a
  trainer crashed in place;
- ``progress.py``: what the sidecars' reports prove while the job trains (commits, the loaded
  step, restart time, goodput, pod-deletion-cost);
- ``actions.py``: the steps every phase takes (restart, start the next attempt, hints, pod
  deletes, sidecar polls);
- ``creating.py`` (a job's objects), ``replicating.py`` (the memory tier's peers) and
  ``writing.py`` (the guarded writes).

Each room gets what they all use (API client, sidecar client, Node view, metrics, config,
status writer) as one ``services.Services``, built here once.

The decisions are pure functions in ``lifecycle`` (phases, budgets, verdicts, deadlines),
``pods`` (notices, deletes, rank views), ``reports`` (what a sidecar's answer means) and
``jobstatus`` (status parsing and patches); the Node watch's state comes through
:class:`ClusterView`. Here stay the tick, its phase switch and the outcomes of a running
attempt (running, succeeded, failed, preempted, unschedulable: shrink); about 480 lines, its
:class:`Reconciler` under 400. A new capability belongs in the pure layer or in a module
beside this one, not in this class.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from baton_operator.client.kube import Kube
from baton_operator.client.metrics import Metrics
from baton_operator.client.sidecars import SidecarClient
from baton_operator.pure import economics, interval, lifecycle, manifests, podpolicy
from baton_operator.pure.errors import KubeConflictError
from baton_operator.pure.jobstatus import JobStatus, iso
from baton_operator.pure.lifecycle import Outcome, Phase, RankView
from baton_operator.pure.model import JobSpec
from baton_operator.pure.nodes import ClusterView
from baton_operator.pure.notices import parse_time
from baton_operator.pure.pods import PodView, notice_for, rank_view
from baton_operator.pure.settings import EMERGENCY_EXIT_CODE, OperatorConfig
from baton_operator.pure.tick import JobMemory, Tick
from baton_operator.pure.vocabulary import InterruptionSource, RestartKind, Trigger
from baton_operator.pure.watchcache import WatchCache

from .actions import Actions
from .creating import Creator
from .noticing import NoticePath
from .progress import ProgressTracker
from .recovering import Recovery
from .replicating import PeerWiring
from .services import Room, Services
from .suspecting import PeerWatch
from .suspending import Suspender
from .writing import EventPoster, StatusWriter

__all__ = ["ClusterView", "EventPoster", "JobMemory", "Reconciler"]

_log = logging.getLogger("baton_operator.controller")

_CONFLICT_RETRIES: Final = 3
"""Fresh reads a tick makes after its guarded write lost a race, before it gives up (the
daemon then backs off and tries again)."""

_RESYNC_SECONDS: Final = 30.0
"""How often a job's tick reads the job and its pods through the API although the watch cache
holds them: a watch that reconnected after a gap re-lists what exists but reports no deletion
that happened in the gap (kopf does not), and this bounds how long such a ghost can last."""


def _now() -> datetime:
    return datetime.now(tz=UTC)


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
    if (
        raw.get("restartReason") == RestartKind.SUSPEND
        and resumed
        and (when is None or resumed > when)
    ):
        when = resumed
    return (when or _now()).timestamp()


class Reconciler(Room):
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
        services = Services(
            kube=kube, sidecars=sidecars, cluster=cluster, metrics=metrics, config=config,
            writer=StatusWriter(kube, post_event),
        )  # fmt: skip
        super().__init__(services)
        self._cache = cache
        """The watch cache the ticks read from; None: every tick reads through the API."""
        self._token_for = token_for
        """The sidecar token of a job (tokens.derive under the operator's key): the operator
        never reads a job's Secret back (docs/operator.md, Security policy)."""
        self._pools = interval.PoolLedger()
        """Every job's node time and interruptions per pool, for ``everySeconds: auto``."""
        self._creator = Creator(services, token_for=token_for, pools=self._pools)
        self._peers = PeerWiring(services)
        """What each memory-tier job's sidecars were told of their peers (replicating.py)."""
        self._actions = Actions(services, creator=self._creator)
        self._progress = ProgressTracker(services, actions=self._actions)
        self._suspender = Suspender(services, actions=self._actions)
        self._notices = NoticePath(services, actions=self._actions, suspender=self._suspender)
        self._recovery = Recovery(
            services, creator=self._creator, actions=self._actions, notices=self._notices
        )
        self._peer_watch = PeerWatch(services)
        """Nodes the ranks stopped hearing from, judged by their Lease (suspecting.py)."""

    def forget(self, namespace: str, name: str) -> None:
        """The job was deleted: stop counting it and drop its metric series."""
        self._metrics.job_phase(namespace, name, None)
        self._metrics.job_deleted(namespace, name)
        if self._cache is not None:
            self._cache.forget_job(namespace, name)
        self._pools.forget((namespace, name))
        self._progress.forget(namespace, name)
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
        await self._actions.hint(t, pods, phase)
        if phase in (Phase.SUCCEEDED, Phase.FAILED):
            self._metrics.job_finished(namespace, name)
            if phase is Phase.FAILED:
                await self._actions.delete_pods(spec, [p for p in pods if not p.finished], now)
                await self._creator.drop_service(t)
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
            await self._actions.delete_pods(spec, stale, now)
        replicas = status.replicas_or(spec.replicas)
        memory.remember_final(t.current)
        t.views = [self._view(t, rank) for rank in range(replicas)]
        if phase is Phase.CHECKPOINTING:
            await self._notices.checkpointing(t)
            # A sidecar lives only a moment after its trainer stops: poll it often.
            return min(tick, 0.25)
        if spec.suspend:
            await self._suspender.begin(t, phase)
            return 0.0 if phase is Phase.RUNNING else tick
        recovery = (t.job.get("status") or {}).get("recovery")
        if recovery:
            await self._recovery.carry_on(t, recovery)
            return tick
        await self._creator.ensure_pods(t, status, replicas=replicas)
        notice = notice_for(t.current.values(), self._cluster, now=now,
                            graces=self._config.graces)  # fmt: skip
        if notice is not None:
            await self._notices.begin(t, phase, notice)
            # The requests go out in the next tick, which reads the status just written: at
            # once, not a quarter second later (a notice's seconds are the scarce ones).
            return 0.0
        await self._progress.poll(t)
        await self._peers.sync(t, replicas=replicas)
        if await self._peer_watch.watch(t):
            # A node was judged lost by its Lease: its ranks' views say so now.
            t.views = [self._view(t, rank) for rank in range(replicas)]
        outcome, detail = lifecycle.classify(t.views, replicas)
        if outcome is Outcome.FAILED and any(
            v.exit_code not in (None, 0, EMERGENCY_EXIT_CODE) and not v.committed_notice
            for v in t.views
        ):
            # The exit code is not the whole truth: torchrun reports a worker's 75 ("stopped
            # after a committed notice save") as 1. The sidecar lingers until that save's
            # outcome is read; read it now, before a failure is counted.
            await self._actions.poll_ranks(t.views, memory)
            t.views = [
                replace(
                    v,
                    served_notice=memory.served_notice(v.rank),
                    committed_notice=memory.committed_notice(v.rank),
                )
                for v in t.views
            ]
            outcome, detail = lifecycle.classify(t.views, replicas)
        training = outcome in (Outcome.RUNNING, Outcome.PENDING)
        if training and await self._recovery.crashed_in_place(t):
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

    async def _restarting(self, t: Tick, stale: Sequence[PodView]) -> None:
        spec, status, now = t.spec, t.status, t.now
        if stale:
            # The old attempt's pods must be fully gone before the new ones start: two
            # generations of ranks must never share a checkpoint directory or a rendezvous.
            # One on a node the ranks stopped hearing from never confirms its graceful
            # delete: judged lost by its Lease, it goes at once, and the next attempt avoids
            # the node, which still looks Ready to the scheduler.
            lost = await self._peer_watch.judge(t, {p.node for p in stale if p.node})
            if lost - set(status.avoid_nodes):
                avoid = sorted(set(status.avoid_nodes) | lost)
                await self._patch(t, t.patch().set({"avoidNodes": avoid}))
                t.status = status = replace(status, avoid_nodes=tuple(avoid))
            await self._actions.delete_pods(spec, stale, now)
            return
        if status.restart_after is not None and now < status.restart_after:
            return
        replicas = status.replicas_or(spec.replicas)
        resume = status.resumed_from_step
        message = f"attempt {status.attempt}: starting {replicas} replicas " + (
            "from scratch" if resume is None else f"from step {resume}"
        )
        await self._actions.start_attempt(t, message)

    # ----------------------------------------------------------------- outcomes

    async def _succeed(self, t: Tick) -> None:
        # The last word: the newest commit any rank reported (a notice's or a SIGTERM's
        # save too, not only the periodic one the last poll saw) and the goodput at the
        # final step, not at the last throttled write.
        await self._progress.learn_commit(t)
        await self._progress.account(t, final=True)
        message = (
            f"{lifecycle.every_rank(len(t.current), t.spec.procs_per_replica)} finished training"
        )
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
            if await self._recovery.begin(t, detail):
                return
            lost = tuple(sorted({v.node for v in t.views if v.node_lost and v.node}))
            source = (
                InterruptionSource.NODE_LOST
                if outcome is Outcome.NODE_LOST
                else InterruptionSource.FAILURE
            )
            await self._actions.restart(
                t, kind=RestartKind.FAILURE, resume_step=resume, detail=detail,
                cause=economics.Cause(source=source, nodes=lost),
            )  # fmt: skip
        elif outcome is Outcome.PREEMPTED:
            # The rank saved on its own (SIGTERM or a cloud notice its sidecar saw): ask the
            # survivors' rank 0 what it committed, then resume there.
            learned = await self._progress.learn_commit(t)
            # The nodes taken away: a pod being deleted or disrupted, or on a noticed node. A
            # rank that saved only because its peers agreed is not one: after a drain (the
            # ranks' trigger is "signal") a new leader may see only such a survivor, and then
            # names no node. A cloud notice a sidecar saw itself leaves no such sign: then the
            # ranks that served it stand for it, as before.
            taken = {
                v.node for v in t.views
                if v.node and (v.disrupted or self._cluster.notices_on(v.node))
            }  # fmt: skip
            if not taken and not any(
                r.trigger == Trigger.SIGNAL for r in t.memory.reports.values()
            ):
                taken = {v.node for v in t.views if v.served_notice and v.node}
            nodes = tuple(sorted(taken))
            await self._actions.restart(
                t, kind=RestartKind.PREEMPTION,
                resume_step=learned if learned is not None else resume, detail=detail,
                cause=economics.eviction_cause(nodes, t.memory.reports.values(), learned),
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
        await self._actions.restart(
            t, kind=RestartKind.ELASTIC, resume_step=status.resume_step,
            detail=f"{detail} for {spec.elastic_wait_seconds:.0f}s; shrinking from {replicas} "
            f"to {target} replicas ({why})",
            replicas=target,
            # Noticed nodes are gone or going; a shrunk job may use any node that is left.
            extra={"avoidNodes": []},
        )  # fmt: skip
