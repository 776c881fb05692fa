"""The steps every phase takes: ask for a checkpoint, restart, start the next attempt, hint,
delete pods, poll ranks.

The notice path (``noticing.py``), recovery (``recovering.py``), the outcomes (``controller.py``)
and ``spec.suspend`` (``suspending.py``) all end an attempt the same way
(:meth:`Actions.restart`: the decision written first, then the hints, then the pods) and start
the next one the same way (:meth:`Actions.start_attempt`); a notice and a suspend ask a running
attempt for its checkpoint the same way (:meth:`Actions.ask_checkpoint`). Actions also keeps the
pods' disruption hints in line with the phase, deletes pods with the grace their node allows,
and asks the sidecars what they did. One :class:`Actions` per operator, shared by every job's
ticks; the only state it keeps is when it last looked each node up (bounded: see
:meth:`Actions._gone_unseen`).

Also the records the rooms above build alike: a lost pod's entry (:func:`lost_pod`), an
interruption's history entry (:func:`interruption`), the ``status.lastCheckpoint`` of a save
asked for and committed (:func:`requested_checkpoint`), and whether ``masterAddr`` is a name
(:func:`is_dns_name`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any, Final

from baton_operator.pure import disruption, economics, interval, lifecycle, manifests
from baton_operator.pure.errors import KubeError, SidecarUnreachableError
from baton_operator.pure.jobstatus import NoticeRecord, StatusPatch, iso
from baton_operator.pure.lifecycle import Phase, RankView, Verdict
from baton_operator.pure.model import JobSpec, LastCheckpoint
from baton_operator.pure.nodes import UNSEEN_DELETION
from baton_operator.pure.notices import parse_time
from baton_operator.pure.pods import PodView, delete_grace
from baton_operator.pure.reports import SidecarStatus
from baton_operator.pure.tick import JobMemory, Tick
from baton_operator.pure.vocabulary import RestartKind, Trigger

from .creating import Creator
from .services import Room, Services

__all__ = ["Actions", "interruption", "is_dns_name", "lost_pod", "requested_checkpoint"]

_log = logging.getLogger("baton_operator.actions")

_OVERDUE: Final = timedelta(seconds=5)
"""A graceful pod deletion this long past its ``deletionTimestamp`` has no kubelet behind it."""
_NODE_CHECK_SECONDS: Final = 10.0
"""A node under an overdue pod deletion is looked up at most this often."""
_SETTLE_SECONDS: Final = 1.0
"""How long a restart waits for the sidecars to hear that their requests are decided (they
answer in milliseconds; one on a dying node must not hold the restart up)."""


def is_dns_name(address: str | None) -> bool:
    """Whether ``masterAddr`` is a name (gang path), which follows rank 0's pod replaced under
    the same name, rather than a pod IP, which does not."""
    if not address:
        return False
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return True
    return False


def lost_pod(t: Tick, rank: int) -> dict[str, Any]:
    """A lost pod as a recovery records it: rank, name, UID and node (empty when already gone)."""
    pod = t.current.get(rank)
    return {
        "rank": rank,
        "pod": manifests.pod_name(t.spec.name, t.status.attempt, rank),
        "uid": pod.uid if pod else "",
        "node": pod.node if pod else None,
    }


def interruption(t: Tick, cause: economics.Cause, *, resume_step: int | None) -> dict[str, Any]:
    """The interruption-history entry of an interruption of this tick's attempt."""
    return economics.entry(
        cause, attempt=t.status.attempt, resume_step=resume_step,
        progress=economics.progress(t.memory.reports.values()),
        gpus=economics.gpus(t.current.values()), now=t.now,
    )  # fmt: skip


def requested_checkpoint(
    t: Tick, step: int, verdict: Verdict, *, tier: str | None = None
) -> LastCheckpoint:
    """``status.lastCheckpoint`` for the save a notice or a suspend asked for, which
    ``verdict`` found committed at ``step`` (``tier``: as the ranks reported it; None: none
    recorded)."""
    return LastCheckpoint(
        step=step, uri=verdict.uri or t.spec.checkpoint_uri, trigger=Trigger.NOTICE.value,
        completed_at=iso(t.now), seconds=verdict.seconds, tier=tier,
    )  # fmt: skip


class Actions(Room):
    """Carries out what every phase does to a job's pods and status (one per operator)."""

    def __init__(self, services: Services, *, creator: Creator) -> None:
        super().__init__(services)
        self._creator = creator
        self._node_checked: dict[str, datetime] = {}
        """When a node under an overdue pod deletion was last looked up (_gone_unseen); only
        the lookups of the last ``_NODE_CHECK_SECONDS`` are kept, so it stays small."""

    async def hint(self, t: Tick, pods: Sequence[PodView], phase: Phase | None) -> None:
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

    async def ask_checkpoint(
        self,
        t: Tick,
        *,
        deadline: datetime,
        why: str,
        then: str = "",
        source: str,
        nodes: Sequence[str],
        reason: str,
        condition: str,
        event: tuple[str, str],
        fields: Mapping[str, Any] | None = None,
    ) -> None:
        """Move a running attempt to ``Checkpointing``: a notice's save and a suspend's.

        The requests go first: every rank's sidecar is asked at once (the deadline's critical
        path: at 100 jobs under one tainted node, the status writes of the jobs before this one
        queue at the API server for seconds). Then one status write records the notice in
        ``status.notice`` (``source``, ``nodes``, ``reason`` and ``deadline``, given at least
        ``minCheckpointWindowSeconds``, and the requests: ``requestedAt``, ``requestIds``) with
        the caller's other ``fields``; the hints follow, then an Event (``event``: its type and
        reason) with the message "<why>: asking all N ranks to checkpoint before <deadline>
        <then>". An operator stopped between the requests and the write sees the notice again
        and asks again: a sidecar merges a request into the one it is serving (one save).
        """
        deadline = lifecycle.clamp_deadline(
            deadline, now=t.now,
            least=timedelta(seconds=self._config.min_checkpoint_window_seconds),
        )  # fmt: skip
        message = (
            f"{why}: asking "
            f"{lifecycle.every_rank(len(t.current), t.spec.procs_per_replica)} to checkpoint "
            f"before {iso(deadline)}{then}"
        )
        record = NoticeRecord.render(
            source=source, nodes=nodes, reason=reason, deadline=deadline, received_at=t.now
        )
        described = NoticeRecord.from_status(record)
        assert described is not None
        ids = await self.request_checkpoints(t, deadline=deadline, reason=described.describe())
        record = {**record, "requestedAt": iso(t.now), "requestIds": ids}
        await self._patch(
            t,
            t.patch()
            .phase(Phase.CHECKPOINTING)
            .condition("Checkpointing", True, condition, message)
            .set({**(fields or {}), "notice": record, "message": message}),
        )
        await self.hint(t, list(t.current.values()), Phase.CHECKPOINTING)
        await self._event(t.job, *event, message)

    async def request_checkpoints(self, t: Tick, *, deadline: datetime, reason: str) -> list[str]:
        """Ask every running rank's sidecar for a checkpoint before ``deadline``, all at once;
        returns the request ids by rank ("" for a rank not asked or not answering)."""

        async def ask(v: RankView) -> str:
            if not v.ip or v.exit_code is not None:
                return ""
            try:
                return await self._sidecars.request_checkpoint(
                    v.ip, t.memory.token or "", deadline=deadline, reason=reason
                )
            except SidecarUnreachableError as e:
                _log.warning("checkpoint request to rank %d failed: %s", v.rank, e)
                return ""

        return list(await asyncio.gather(*(ask(v) for v in t.views)))

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
        # A lookup older than the period holds nothing back: forget it, or on a spot cluster
        # (new node names, none ever back) the map grows for the operator's whole life.
        self._node_checked = {
            name: at
            for name, at in self._node_checked.items()
            if (now - at).total_seconds() < _NODE_CHECK_SECONDS
        }
        self._node_checked[node] = now
        if node not in await self._kube.list_node_names(only=node):
            self._cluster.remove_node(node)
            self._node_checked.pop(node, None)
            _log.warning(
                "%s", UNSEEN_DELETION.format(node=node, when=f"pod {pod.name} was overdue")
            )

    async def delete_pods(self, spec: JobSpec, pods: Sequence[PodView], now: datetime) -> None:
        """Delete ``pods`` with the grace their node allows (none on a lost node)."""
        for pod in pods:
            if pod.deleting:
                await self._gone_unseen(pod, now)
            grace = delete_grace(pod, self._cluster, now=now,
                                 grace_seconds=self._config.delete_grace_seconds)  # fmt: skip
            if grace is not None:
                await self._kube.delete_pod(spec.namespace, pod.name, grace_seconds=grace)

    async def restart(
        self,
        t: Tick,
        *,
        kind: RestartKind,
        resume_step: int | None,
        detail: str,
        replicas: int | None = None,
        extra: Mapping[str, Any] | None = None,
        suspend_reason: str = "Suspended",
        cause: economics.Cause | None = None,
    ) -> None:
        """End this attempt: write the decision first (the next attempt, or the job suspended
        or failed, as ``lifecycle.plan_restart`` plans it for ``kind``; the interruption
        ``cause`` names), then take the hints off, then delete the pods."""
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
            raw_status.get("exposure"), now=now,
            interrupted=kind in (RestartKind.PREEMPTION, RestartKind.FAILURE),
            noticed_pools=[p for p in noticed if p],
        )  # fmt: skip
        # An interruption (not a suspend, not an elastic shrink) goes into the history in the
        # same write as the decision, so that a restarted operator never records it twice.
        record = None
        costs: dict[str, Any] = {}
        if cause is not None and kind in (RestartKind.PREEMPTION, RestartKind.FAILURE):
            record = interruption(t, cause, resume_step=plan.resume_step)
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
            reason = (
                "FailureBudgetExhausted"
                if kind == RestartKind.FAILURE
                else "PreemptionBudgetExhausted"
            )
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
        await self.hint(t, list(t.current.values()), plan.phase)
        if plan.exhausted:
            await self._event(t.job, "Warning", "Failed", plan.message)
        elif suspended:
            # Neither a failure nor a preemption: no budget and no restart is counted.
            await self._event(t.job, "Normal", suspend_reason, plan.message)
        else:
            self._metrics.count_restart(spec.namespace, spec.name, plan.reason)
            if kind == RestartKind.PREEMPTION:
                self._metrics.preemptions.labels(spec.namespace, spec.name).inc()
            await self._event(
                t.job,
                "Warning" if kind == RestartKind.FAILURE else "Normal",
                "Restarting",
                plan.message,
            )
        await self.settle_requests(t)
        await self.delete_pods(spec, list(t.current.values()), now)
        await self._creator.drop_pod_groups(t, [status.attempt])

    async def settle_requests(self, t: Tick) -> None:
        """Tell each rank's sidecar that its notice request is decided (the decision is
        written): one rank's ``committed`` proves the checkpoint, so the verdict can come
        before a slower rank has reported, and that rank's sidecar would otherwise keep its
        pod for its whole linger (15 s) waiting for its outcome to be read, and the next
        attempt with it. Best effort and bounded: a sidecar that does not answer at once
        lingers as before."""
        notice = t.status.notice
        if notice is None or not notice.request_ids or t.memory.token is None:
            return
        token = t.memory.token

        async def settle(v: RankView, request_id: str) -> None:
            try:
                await asyncio.wait_for(
                    self._sidecars.settle(v.ip or "", token, request_id), _SETTLE_SECONDS
                )
            except (SidecarUnreachableError, TimeoutError) as e:
                _log.debug("settling rank %d's request %s: %s", v.rank, request_id, e)

        calls = [
            settle(v, notice.request_ids[v.rank])
            for v in t.views
            if v.ip and not v.node_lost and v.rank < len(notice.request_ids)
            and notice.request_ids[v.rank]
        ]  # fmt: skip
        await asyncio.gather(*calls)

    async def start_attempt(
        self,
        t: Tick,
        message: str,
        *,
        patch: StatusPatch | None = None,
        fields: Mapping[str, Any] | None = None,
        reason: str | None = None,
    ) -> None:
        """Start the attempt ``status.attempt`` names: Pending from now, then its pods (rank
        0 first, or the whole gang), under a master address of their own.

        ``patch`` carries the caller's conditions and ``fields`` its other status fields, in
        the same write; ``reason``: a Normal Event with ``message`` follows that write.
        """
        status = t.status
        write = (patch or t.patch()).phase(Phase.PENDING)
        write.set(
            {"attemptStartedAt": iso(t.now), "restartAfter": None, **(fields or {}),
             "message": message}
        )  # fmt: skip
        await self._patch(t, write)
        if reason is not None:
            await self._event(t.job, "Normal", reason, message)
        replicas = status.replicas_or(t.spec.replicas)
        await self._creator.ensure_pods(t, replace(status, master_addr=None), replicas=replicas)

    async def poll_ranks(
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
                if v.rank in memory.reports:
                    # It answered before: a reason to suspect its node (suspecting.py).
                    memory.silent.add(v.rank)
                continue
            memory.reports[v.rank] = live[v.rank]
            if v.rank in memory.silent:
                memory.silent.discard(v.rank)
                memory.suspected = {
                    k for k in memory.suspected if not k.startswith(f"{v.pod}:silent@")
                }
        return live
