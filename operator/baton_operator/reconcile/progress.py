"""What a running attempt's sidecars say, learned every few seconds, and what it is worth.

While an attempt trains, the controller calls :meth:`ProgressTracker.poll` on each tick;
every ``progressPollSeconds`` it asks the sidecars for their reports and records what they
prove: a newer committed step (``status.lastCheckpoint``; a memory-tier commit once it is
promoted), the step the ranks actually loaded when it differs from the recorded one
(``status.resumedFromStep``, ``ResumeStepCorrected``), the interruption history's restart time
and the job's goodput (``economics.py``), and the pods' pod-deletion-cost (``disruption.py``).
The outcomes use :meth:`ProgressTracker.learn_commit` and :meth:`ProgressTracker.account` too
(the final word at success; the step a preemption's ranks saved). One
:class:`ProgressTracker` per operator, shared by every job's ticks.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from baton_operator.pure import disruption, economics, reports
from baton_operator.pure.errors import KubeError
from baton_operator.pure.jobstatus import iso
from baton_operator.pure.model import LastCheckpoint
from baton_operator.pure.notices import parse_time
from baton_operator.pure.tick import Tick
from baton_operator.pure.vocabulary import Tier, Trigger

from .actions import Actions
from .services import Room, Services

__all__ = ["ProgressTracker"]

_log = logging.getLogger("baton_operator.progress")


class ProgressTracker(Room):
    """Learns commits, restores, restart times and goodput from the sidecars' reports."""

    def __init__(self, services: Services, *, actions: Actions) -> None:
        super().__init__(services)
        self._actions = actions
        self._cost_written: dict[tuple[str, str], datetime] = {}
        """When each job's pod-deletion-cost was last written (disruption.cost_patches)."""

    def forget(self, namespace: str, name: str) -> None:
        """The job was deleted: drop what is kept of it."""
        self._cost_written.pop((namespace, name), None)

    async def poll(self, t: Tick) -> None:
        """Learn periodic commits (and served notices) from the sidecars, every few seconds."""
        if t.memory.next_progress_poll is not None and t.now < t.memory.next_progress_poll:
            return
        t.memory.next_progress_poll = t.now + timedelta(seconds=self._config.progress_poll_seconds)
        await self.learn_commit(t)
        await self._check_resume(t)
        await self.account(t)
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

    async def account(self, t: Tick, *, final: bool = False) -> None:
        """Keep the interruption history's restart time and the job's goodput up to date
        from the sidecars' reports (economics.py; polled with the progress). ``final``: the
        job succeeded; the goodput is written now, at the last step known (the newest report
        or commit), whatever the write period."""
        spec, now = t.spec, t.now
        raw: Mapping[str, Any] = t.job.get("status") or {}
        now_progress = economics.progress(t.memory.reports.values())
        last = t.status.last_checkpoint
        if final and last is not None and (now_progress.step or 0) < last.step:
            now_progress = replace(now_progress, step=last.step)
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
            if final or due is None or now >= due:
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

    async def learn_commit(self, t: Tick) -> int | None:
        """Poll the sidecars and record a newer committed step in ``status.lastCheckpoint``.

        Any rank's ``committed`` proves the manifest is written; returns the newest known step.
        """
        await self._actions.poll_ranks(t.views, t.memory)
        last = t.status.last_checkpoint
        best = reports.fallback_step(last, t.memory.reports.values())
        if (
            last is not None
            and last.tier == Tier.MEMORY
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
        checkpoint = replace(last, tier=Tier.PROMOTED.value)
        await self._patch(t, t.patch().set({"lastCheckpoint": checkpoint.to_status()}))
        t.status = replace(t.status, last_checkpoint=checkpoint)
        self._metrics.checkpoint_committed(t.spec.namespace, t.spec.name, checkpoint.tier)
        await self._event(
            t.job, "Normal", "CheckpointPromoted",
            f"step {last.step}, committed to the memory tier, is promoted to durable storage "
            f"under {t.spec.checkpoint_uri}",
        )  # fmt: skip
