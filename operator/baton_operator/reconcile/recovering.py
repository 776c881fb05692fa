"""Recovery: replacing only the lost pods of an attempt while the others keep their memory.

With the memory tier on, a loss without notice (a node lost, a rank failed) need not restart
every pod: the survivors' trainers restart in place and every rank restores the newest step
from the memory tier, the replacements' files from their peers' replicas. :meth:`Recovery.begin`
decides (``lifecycle.plan_recovery``; False: a new attempt instead) and writes
``status.recovery`` before any pod is deleted; :meth:`Recovery.carry_on` carries an open
recovery on at every tick (a notice recovery too, which ``noticing.py`` begins): the lost pods
go, their replacements come, more losses extend it, and once every rank reports its restore it
ends (or, stuck or failed, becomes a new attempt). Outside a recovery, a trainer restarted in
place that no recovery explains is a crash (:meth:`Recovery.crashed_in_place`). One
:class:`Recovery` per operator, shared by every job's ticks.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any

from baton_operator.pure import economics, lifecycle, reports
from baton_operator.pure.jobstatus import iso
from baton_operator.pure.lifecycle import Phase, RankView
from baton_operator.pure.notices import parse_time
from baton_operator.pure.pods import PodView, notice_for, restarted
from baton_operator.pure.reports import SidecarStatus
from baton_operator.pure.settings import EMERGENCY_EXIT_CODE
from baton_operator.pure.tick import Tick
from baton_operator.pure.vocabulary import InterruptionSource, RestartKind, Tier

from .actions import Actions, interruption, is_dns_name, lost_pod
from .creating import Creator
from .noticing import NoticePath
from .services import Room, Services

__all__ = ["Recovery"]

_log = logging.getLogger("baton_operator.recovering")


class Recovery(Room):
    """Begins, carries on, extends and ends recoveries; counts crashes in place."""

    def __init__(
        self, services: Services, *, creator: Creator, actions: Actions, notices: NoticePath
    ) -> None:
        super().__init__(services)
        self._creator = creator
        self._actions = actions
        self._notices = notices

    async def begin(self, t: Tick, detail: str) -> bool:
        """A loss without notice, with the memory tier on: replace only the lost pods.

        Returns False when the job restarts as a new attempt instead (lifecycle.plan_recovery
        says why; the failure budget is spent: the restart path fails the job). The decision
        (``status.recovery``, the failure, the interruption) is written before any pod is
        deleted, so a restarted operator carries it on (:meth:`carry_on`).
        """
        spec, status, now = t.spec, t.status, t.now
        plan, why = lifecycle.plan_recovery(
            t.views, memory_tier=spec.fast is not None,
            master_is_name=is_dns_name(status.master_addr),
        )  # fmt: skip
        if plan is None:
            if spec.fast is not None:
                _log.info("%s: a new attempt, not a recovery: %s", spec.key, why)
            return False
        failures = status.failures + 1
        if failures > spec.max_failures:
            return False
        replaced = [lost_pod(t, rank) for rank in plan.replace]
        kept = [t.current[r].name for r in plan.keep if r in t.current]
        cause = economics.Cause(
            source=InterruptionSource.NODE_LOST if plan.nodes else InterruptionSource.FAILURE,
            nodes=plan.nodes,
        )
        record = interruption(t, cause, resume_step=status.resume_step)
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
        self._metrics.count_restart(spec.namespace, spec.name, RestartKind.FAILURE)
        await self._event(t.job, "Warning", "Recovering", message)
        for entry in replaced:
            if entry["uid"]:
                # Force: the node is gone, no kubelet will confirm a graceful delete, and the
                # replacement takes the same name.
                await self._kube.delete_pod(spec.namespace, entry["pod"], grace_seconds=0)
        return True

    async def carry_on(self, t: Tick, recovery: Mapping[str, Any]) -> None:
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
            await self._notices.begin(t, Phase.PENDING, notice)
            return
        replicas = status.replicas_or(spec.replicas)
        more = [
            v for v in t.views
            if v.rank not in replaced and (not v.exists or (v.node_lost and v.exit_code is None))
        ]  # fmt: skip
        if more and len(replaced) + len(more) < replicas:
            await self._extend(t, recovery, more)
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
            if last is not None and last.tier == Tier.MEMORY:
                # A notice's memory commit not promoted yet goes with the pods: the new
                # attempt resumes from the last durable step (or a newer one it finds).
                resume = recovery.get("durableStep")
            # Counted as its own failure: the recovery's was counted when it began.
            await self._actions.restart(
                t, kind=RestartKind.FAILURE, resume_step=resume, detail=message,
                cause=economics.Cause(source=InterruptionSource.FAILURE),
            )  # fmt: skip
            return
        await self._actions.poll_ranks(t.views, t.memory)
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
        await self._end(t, recovery, started, restored)

    async def _extend(self, t: Tick, recovery: Mapping[str, Any], more: Sequence[RankView]) -> None:
        """More pods were lost before the recovery ended (nodes seldom die one at a time, and
        each is seen lost on its own): they are replaced by the same recovery, which was
        counted once, while a survivor remains; the restore has not ended (it needs every
        rank), so it simply waits for these too."""
        spec, status = t.spec, t.status
        added = [lost_pod(t, v.rank) for v in sorted(more, key=lambda v: v.rank)]
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

    async def _end(
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
        tier = Tier.DURABLE.value if Tier.DURABLE in tiers else (tiers[0] if tiers else None)
        seconds = round((now - started).total_seconds(), 3)
        names = ", ".join(str(e.get("pod")) for e in recovery.get("replaced") or [])
        where = "from scratch" if loaded is None else f"from step {loaded}"
        if tier == Tier.DURABLE:
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

    async def crashed_in_place(self, t: Tick) -> bool:
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
        await self._actions.restart(
            t, kind=RestartKind.FAILURE, resume_step=t.status.resume_step, detail=detail,
            cause=economics.Cause(source=InterruptionSource.FAILURE),
        )  # fmt: skip
        return True
