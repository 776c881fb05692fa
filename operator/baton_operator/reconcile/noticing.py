"""The notice path: a notice seen, every rank asked for a checkpoint, the verdict carried out.

A notice on a running attempt (``pods.notice_for``: a node's taint, label or cordon, a pod's
``DisruptionTarget``) moves the job to ``Checkpointing``: every rank's sidecar is sent a
checkpoint request at once, then one status write records the notice (``status.notice``:
source, nodes, reason, the clamped deadline, the request ids) and the nodes to avoid
(:meth:`NoticePath.begin`, through ``Actions.ask_checkpoint`` as a suspend's save does). The
ticks after poll the sidecars until ``lifecycle.checkpoint_verdict`` decides
(:meth:`NoticePath.checkpointing`): the save committed (a preemption restarts from it), or it
failed or ran out of time (a preemption restarts from the newest step known to be committed). A
suspend's save takes the same path and ends in ``suspending.py``. With the memory tier, a
commit of every rank to memory ends the notice at once as a recovery that replaces only the
noticed node's pods (notice recovery; ``recovering.py`` carries it on). Before the attempt runs
there is nothing to save: the job moves at once. One :class:`NoticePath` per operator, shared
by every job's ticks.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from baton_operator.pure import economics, lifecycle, reports
from baton_operator.pure.jobstatus import NO_NOTICE_REASON, NoticeRecord, iso
from baton_operator.pure.lifecycle import SUSPEND_SOURCE, Phase, VerdictKind
from baton_operator.pure.model import LastCheckpoint
from baton_operator.pure.notices import Notice
from baton_operator.pure.pods import noticed_nodes
from baton_operator.pure.reports import SidecarStatus
from baton_operator.pure.tick import Tick
from baton_operator.pure.vocabulary import InterruptionSource, RestartKind, Tier, Trigger

from .actions import Actions, interruption, is_dns_name, lost_pod, requested_checkpoint
from .services import Room, Services
from .suspending import Suspender

__all__ = ["NoticePath"]

_log = logging.getLogger("baton_operator.noticing")


def _notice_cause(notice: NoticeRecord | None, *, durable_at: datetime | None) -> economics.Cause:
    """The interruption a notice's save ended (``durable_at``: when it committed)."""
    if notice is None:
        return economics.Cause(source=InterruptionSource.NOTICE, durable_at=durable_at)
    return economics.Cause(
        source=notice.source or InterruptionSource.NOTICE, nodes=notice.nodes,
        notice_at=notice.received_at,
        deadline=notice.deadline, durable_at=durable_at,
    )  # fmt: skip


class NoticePath(Room):
    """Serves notices (and a suspend's save): request, poll, verdict, restart or recovery."""

    def __init__(self, services: Services, *, actions: Actions, suspender: Suspender) -> None:
        super().__init__(services)
        self._actions = actions
        self._suspender = suspender

    async def begin(self, t: Tick, phase: Phase, notice: Notice) -> None:
        """``notice`` is served: before the attempt runs the job moves at once (a
        preemption, no save); else it goes ``Checkpointing`` with the notice recorded."""
        status, now = t.status, t.now
        noticed = noticed_nodes(t.current.values(), self._cluster, now=now,
                                graces=self._config.graces)  # fmt: skip
        avoid = [n for n in sorted(set(status.avoid_nodes) | set(noticed) | {notice.node}) if n]
        if notice.source == InterruptionSource.DISRUPTION_TARGET:
            self._metrics.notices.labels(notice.source).inc()
        if lifecycle.moves_at_once(phase):
            await self._event(
                t.job, "Normal", "EvictionNotice",
                f"{notice.reason} on node {notice.node} before the attempt was running; "
                "moving the job to other nodes",
            )  # fmt: skip
            await self._actions.restart(
                t, kind=RestartKind.PREEMPTION, resume_step=status.resume_step,
                detail=f"{notice.source} notice on {notice.node} before start",
                extra={"avoidNodes": avoid},
                cause=economics.Cause(
                    source=notice.source, nodes=tuple(noticed or [notice.node]), notice_at=now,
                    deadline=notice.deadline,
                ),
            )  # fmt: skip
            return
        await self._actions.ask_checkpoint(
            t, deadline=notice.deadline, why=f"{notice.reason} on node {notice.node}",
            source=notice.source, nodes=noticed or [notice.node], reason=notice.reason,
            condition="EvictionNotice", event=("Warning", "EvictionNotice"),
            fields={"avoidNodes": avoid},
        )  # fmt: skip

    async def checkpointing(self, t: Tick) -> None:
        """A ``Checkpointing`` tick: ask every rank (once), poll them, carry the verdict out."""
        spec, status, now, memory, views = t.spec, t.status, t.now, t.memory, t.views
        notice = status.notice
        deadline = (notice.deadline if notice else None) or now
        received = (notice.received_at if notice else None) or now
        source = notice.source if notice else None
        replicas = len(views)
        ids = list(notice.request_ids) if notice else []
        if notice is None or notice.requested_at is None:
            # Not asked yet: a status written by hand or by an older operator (``begin`` asks
            # before it records the notice).
            reason = notice.describe() if notice else NO_NOTICE_REASON
            ids = await self._actions.request_checkpoints(t, deadline=deadline, reason=reason)
            await self._patch(
                t, t.patch().set({"notice": {"requestedAt": iso(now), "requestIds": ids}})
            )
        live = await self._actions.poll_ranks(views, memory)
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
            if step is not None and await self._recover(t, step):
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
        tier = None if verdict.step is None else reports.commit_tier(answers.values(), verdict.step)
        if suspending:
            await self._suspender.end_save(t, verdict, tier=tier)
            return
        if verdict.kind is VerdictKind.COMMITTED and verdict.step is not None:
            checkpoint = requested_checkpoint(t, verdict.step, verdict, tier=tier)
            key = (spec.namespace, spec.name)
            self._metrics.checkpoint_committed(*key, checkpoint.tier)
            self._metrics.notice_to_commit.labels(*key).observe((now - received).total_seconds())
            self._metrics.deadline_margin.labels(*key).observe((deadline - now).total_seconds())
            self._metrics.last_checkpoint.labels(*key).set(now.timestamp())
            await self._event(
                t.job, "Normal", "CheckpointCommitted",
                f"{lifecycle.every_rank(replicas, spec.procs_per_replica)} committed step "
                f"{verdict.step} "
                f"{(now - received).total_seconds():.1f}s after the notice; "
                f"moving off node(s) {nodes}",
            )  # fmt: skip
            await self._actions.restart(
                t, kind=RestartKind.PREEMPTION, resume_step=verdict.step,
                detail=f"{source} notice, checkpoint at step {verdict.step}",
                extra={"lastCheckpoint": checkpoint.to_status()},
                cause=_notice_cause(notice, durable_at=now),
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
        await self._actions.restart(
            t, kind=RestartKind.PREEMPTION, resume_step=best,
            detail=f"{source} notice, {verdict.reason}",
            extra=extra, cause=_notice_cause(notice, durable_at=None),
        )  # fmt: skip

    async def _recover(self, t: Tick, step: int) -> bool:
        """Every rank committed the notice's save of ``step`` to the memory tier: replace only
        the pods on the noticed node(s) and keep the others (a recovery, as after a node lost
        without notice, but counted as a preemption).

        The kept pods' trainers exit ``EXIT_RESTART_IN_PLACE`` and are restarted in place;
        every rank restores ``step`` from memory (the replacements' files from the peers'
        replicas) and promotes it to durable storage (``ProgressTracker.learn_commit`` records the
        promotion).
        Returns False when the job takes today's path instead (a new attempt once the
        snapshot is promoted; ``lifecycle.plan_notice_recovery`` says why).
        """
        spec, status, now, memory = t.spec, t.status, t.now, t.memory
        notice = status.notice
        nodes = notice.nodes if notice else ()
        plan, why = lifecycle.plan_notice_recovery(
            t.views, nodes=nodes, master_is_name=is_dns_name(status.master_addr)
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
            tier=reports.commit_tier(reps, step) or Tier.MEMORY.value,
        )  # fmt: skip
        replaced = [lost_pod(t, rank) for rank in plan.replace]
        kept = [t.current[r].name for r in plan.keep if r in t.current]
        record = interruption(t, _notice_cause(notice, durable_at=now), resume_step=step)
        raw: Mapping[str, Any] = t.job.get("status") or {}
        names = ", ".join(e["pod"] for e in replaced)
        after = (now - received).total_seconds()
        source = (notice.source if notice else None) or InterruptionSource.NOTICE
        message = (
            f"{source} notice on node(s) {', '.join(plan.nodes)}: "
            f"{lifecycle.every_rank(len(t.views), spec.procs_per_replica)} committed step "
            f"{step} to the memory tier {after:.1f}s after the notice; "
            f"replacing only pod(s) {names}, keeping {', '.join(kept)}, whose trainers "
            "restart in place and restore it from memory"
        )
        last = status.last_checkpoint
        durable = last.step if last is not None and last.tier != Tier.MEMORY else None
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
        self._metrics.count_restart(spec.namespace, spec.name, RestartKind.PREEMPTION)
        self._metrics.preemptions.labels(*key).inc()
        await self._event(
            t.job, "Normal", "CheckpointCommitted",
            f"{lifecycle.every_rank(len(t.views), spec.procs_per_replica)} committed step "
            f"{step} to the memory tier {after:.1f}s "
            f"after the notice; it is promoted to durable storage after the recovery",
        )  # fmt: skip
        await self._event(t.job, "Normal", "Recovering", message)
        # The save is over: the hints go before the pods do (as at a restart).
        await self._actions.hint(t, list(t.current.values()), Phase.RUNNING)
        for entry in replaced:
            if entry["uid"]:
                # Force: the noticed trainer must not start another save (its SIGTERM's)
                # that the kept ranks would join; the replacement takes the same name.
                await self._kube.delete_pod(spec.namespace, entry["pod"], grace_seconds=0)
        return True
