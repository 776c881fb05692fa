"""Suspending and unsuspending a job (``spec.suspend``, as Kueue drives it).

A running attempt is asked for a checkpoint first (the notice path's record, requests,
deadline and verdict, in ``noticing.py``), then its pods stop; a pending
one stops at once; a suspended job keeps no pod, and when ``spec.suspend`` is false again the
next attempt starts from the step recorded when it stopped. No budget is spent and no restart
is counted. The controller decides *when* (it reads ``spec.suspend`` on every tick); this
module carries the suspend out with the steps every phase uses (``actions.py``: ask for a
checkpoint, restart, hint, delete pods, start the next attempt), the same ones the notice path
uses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from baton_operator.pure import lifecycle, reports
from baton_operator.pure.jobstatus import iso
from baton_operator.pure.lifecycle import SUSPEND_SOURCE, Phase, Verdict, VerdictKind
from baton_operator.pure.notices import parse_time
from baton_operator.pure.pods import PodView
from baton_operator.pure.tick import Tick
from baton_operator.pure.vocabulary import RestartKind

from .actions import Actions, requested_checkpoint
from .services import Room, Services

__all__ = ["Suspender"]


def _suspended_seconds(t: Tick) -> float:
    """The job's time suspended so far, this suspension (ending now) included."""
    raw: Mapping[str, Any] = t.job.get("status") or {}
    total = float(raw.get("suspendedSeconds") or 0.0)
    since = parse_time(raw.get("suspendedAt"))
    if since is not None and t.now > since:
        total += (t.now - since).total_seconds()
    return round(total, 1)


class Suspender(Room):
    """Carries out ``spec.suspend`` for the controller (one per operator, shared by jobs)."""

    def __init__(self, services: Services, *, actions: Actions) -> None:
        super().__init__(services)
        self._actions = actions

    async def begin(self, t: Tick, phase: Phase) -> None:
        """``spec.suspend`` is true on a Pending or Running attempt.

        Running: every rank is asked for a checkpoint first, as for a notice (the same status
        record, requests, deadline and verdict: ``noticing.py``), and the pods stop after
        it. Pending: nothing has trained since the last commit, so the pods stop at once.
        """
        status, now = t.status, t.now
        if phase is not Phase.RUNNING:
            if not t.current:
                await self.idle(t, "spec.suspend is true before any pod was created")
                return
            await self._actions.restart(
                t, kind=RestartKind.SUSPEND, resume_step=status.resume_step,
                detail="spec.suspend is true before the attempt was running",
            )  # fmt: skip
            return
        await self._actions.ask_checkpoint(
            t, deadline=now + timedelta(seconds=self._config.suspend_save_seconds),
            why="spec.suspend is true", then=", then stopping the pods", source=SUSPEND_SOURCE,
            nodes=(), reason="spec.suspend is true", condition="Suspend",
            event=("Normal", "Suspending"),
        )  # fmt: skip

    async def end_save(self, t: Tick, verdict: Verdict, *, tier: str | None = None) -> None:
        """The suspend's save committed or failed: stop the pods either way (the queue wants
        its quota back), recording the step the job will resume from.

        ``tier``: where a committed save went (``reports.commit_tier``). Never ``memory``
        alone: the notice path does not take a memory-tier commit for the answer until its
        promotion committed (``reports.answers``), since the pods deleted here hold its only
        copies."""
        spec, status, now = t.spec, t.status, t.now
        if verdict.kind is VerdictKind.COMMITTED and verdict.step is not None:
            checkpoint = requested_checkpoint(t, verdict.step, verdict, tier=tier)
            self._metrics.last_checkpoint.labels(spec.namespace, spec.name).set(now.timestamp())
            await self._event(
                t.job, "Normal", "CheckpointCommitted",
                f"{lifecycle.every_rank(len(t.views), spec.procs_per_replica)} committed "
                f"step {verdict.step}; suspending",
            )  # fmt: skip
            await self._actions.restart(
                t, kind=RestartKind.SUSPEND, resume_step=verdict.step,
                detail=f"stopped at step {verdict.step}, its checkpoint committed",
                extra={"lastCheckpoint": checkpoint.to_status()},
            )  # fmt: skip
            return
        best, extra = reports.fallback_fields(
            status.last_checkpoint, t.memory.reports.values(), uri=spec.checkpoint_uri,
            now=iso(now),
        )  # fmt: skip
        step = "no step was committed yet" if best is None else f"the last committed step is {best}"
        message = (
            f"the suspend's checkpoint did not complete ({verdict.reason}); the pods are "
            f"stopped anyway and {step}: the job resumes from "
            + ("the start" if best is None else "it (or from a newer step committed unseen)")
        )
        await self._event(t.job, "Warning", "CheckpointFallback", message)
        await self._actions.restart(
            t, kind=RestartKind.SUSPEND, resume_step=best,
            detail=f"its checkpoint did not complete ({verdict.reason}); {step}",
            extra=extra, suspend_reason="SuspendedWithoutCheckpoint",
        )  # fmt: skip

    async def idle(self, t: Tick, detail: str) -> None:
        """Suspend an attempt that has no pod yet: no save, no new attempt."""
        status = t.status
        resume = status.resumed_from_step
        message = f"suspended ({detail}); unsuspending resumes " + (
            "from scratch" if resume is None else f"from step {resume}"
        )
        await self._patch(
            t,
            t.patch()
            .phase(Phase.SUSPENDED)
            .condition("Ready", False, "Suspended", message)
            .condition("Suspended", True, "Suspended", message)
            .set(
                {
                    "message": message,
                    "masterAddr": None,
                    "restartReason": RestartKind.SUSPEND.value,
                    "suspendedAt": iso(t.now),
                }
            ),
        )
        await self._event(t.job, "Normal", "Suspended", message)

    async def suspended(self, t: Tick, pods: Sequence[PodView]) -> None:
        """Keep a suspended job without pods; when ``spec.suspend`` is false again, start the
        next attempt from the step recorded when it stopped (after any backoff it was in)."""
        spec, status, now = t.spec, t.status, t.now
        if pods:
            # Every pod of a suspended job goes, the last attempt's included (a restarted
            # operator finishes a suspend it had decided but not carried out).
            await self._actions.delete_pods(spec, pods, now)
            return
        if spec.suspend or (status.restart_after is not None and now < status.restart_after):
            return
        replicas = status.replicas_or(spec.replicas)
        resume = status.resumed_from_step
        message = f"unsuspended: attempt {status.attempt} starts {replicas} replicas " + (
            "from scratch" if resume is None else f"from step {resume}"
        )
        await self._actions.start_attempt(
            t, message,
            patch=t.patch()
            .condition("Suspended", False, "Resumed", message)
            .condition("Ready", False, "Starting", message),
            fields={
                "suspendedAt": None,
                # Goodput counts wall time less the time the job was held (economics.py).
                "suspendedSeconds": _suspended_seconds(t),
            },
            reason="Resumed",
        )  # fmt: skip
