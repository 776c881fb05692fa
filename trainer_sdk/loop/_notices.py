"""Serving a checkpoint notice: :class:`NoticeServer`, the Checkpointer's notice path.

The :class:`~trainer_sdk.checkpointer.Checkpointer` decides *when* (its policies and the notice
agreement); once every rank agreed that a notice arrived, :class:`NoticeServer` drains a save
in flight, plans the emergency save, agrees on the slowest rank's estimate against rank 0's
clock, skips the save if it cannot end before the deadline minus the margin, else saves inside
the deadline scope, and reports each state (``requested``, ``saving``, ``committed``,
``skipped``, ``failed``) to the sidecar as it goes (through
:class:`~trainer_sdk.loop._status.StatusReporter`). With the memory tier on, the same agreement also
picks the tier (:func:`~trainer_sdk.loop._deadline.choose_tier`): a durable save when it fits, else
a replicated memory snapshot promoted afterwards in the background. The writing is the save
engine's (:mod:`trainer_sdk.loop._save_engine`), which it is handed, one layer below.

Log records go to the ``trainer_sdk.checkpointer`` logger, where users (and tests) already
listen for the Checkpointer's notices.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from trainer_sdk.errors import CheckpointError
from trainer_sdk.loop._deadline import SaveEstimator, choose_tier, deadline_scope
from trainer_sdk.loop._save_engine import SaveEngine
from trainer_sdk.loop._status import StatusReporter
from trainer_sdk.loop.signals import Agreement, LocalNotice, NoticeBoard
from trainer_sdk.saveload._collectives import all_reduce_max
from trainer_sdk.wire import SavePhase, State, Tier

__all__ = ["NoticeServer", "announce_notice"]

log = logging.getLogger("trainer_sdk.checkpointer")


@dataclass(kw_only=True)
class NoticeServer:
    """Serves an agreed notice on this rank (every rank serves it at the same step).

    The Checkpointer builds it once, with its save engine: ``engine`` drains a save in flight
    (raising its failure), prepares the step, probes the storage before a first save, saves,
    and, with the memory tier on, commits to it and promotes; it also knows the newest
    committed step and where a step lives.
    """

    rank: int
    group: Any | None
    """The Checkpointer's gloo group for the estimate agreement; None: a single process."""
    deadline_margin: float
    board: NoticeBoard
    status: StatusReporter
    estimator: SaveEstimator
    engine: SaveEngine

    def serve(self, step: int, local: LocalNotice, agreement: Agreement) -> bool:
        """Save ``step`` for the notice in ``agreement``, or skip it if it cannot finish in
        time; returns True (the caller stops training). A background save that failed before
        it is raised after the notice was served."""
        notice_t = time.perf_counter()
        trigger = agreement.trigger
        announce_notice(self.status, rank=self.rank, step=step, local=local, agreement=agreement)
        bg_error: BaseException | None = None
        try:
            # An async save in flight finishes first: it is an older, consistent step and
            # commits normally. If it failed, the emergency save still goes ahead, and the
            # failure is raised after it.
            try:
                self.engine.drain()
            except Exception as e:
                bg_error = e
                log.error("the background save before the emergency save failed: %s", e)
            drain_s = time.perf_counter() - notice_t
            if step == self.engine.last_committed:
                # Already committed at this very step (a periodic save just before): done.
                self._finish(local, step, notice_t, {SavePhase.DRAIN: drain_s}, None)
                return self._after(step, bg_error)
            t = time.perf_counter()
            prepared = self.engine.prepare(step)
            nbytes = prepared[1].nbytes
            if not self.estimator.measured:
                self.engine.probe()
            estimate = self.estimator.estimate(nbytes) or 0.0
            fast = self.engine.fast
            memory = math.inf if fast is None else self.engine.memory_estimate(nbytes)
            # The slowest rank's estimates against rank 0's clock: the same verdict everywhere.
            est_max, mem_max, now0 = all_reduce_max(
                [estimate, memory, time.time() if self.rank == 0 else 0.0], group=self.group
            )
            plan_s = time.perf_counter() - t
            left = (
                None
                if agreement.deadline is None
                else agreement.deadline - self.deadline_margin - now0
            )
            tier = choose_tier(durable_s=est_max, memory_s=mem_max, left=left)
            if tier is Tier.MEMORY and fast is not None:
                log.warning(
                    "rank %d: a durable save of step %d is estimated at %.2fs, the memory tier "
                    "with its replication at %.2fs, and %.2fs are left before the deadline "
                    "minus the margin: committing to the memory tier, then promoting it",
                    self.rank,
                    step,
                    est_max,
                    mem_max,
                    left,
                )
                self.status.update(state=State.SAVING)
                perf = time.perf_counter()
                replicated = self.engine.commit_memory(step, prepared)
                write_s = time.perf_counter() - perf
                if not replicated:
                    # Promoted all the same: until the node goes, it may still become durable.
                    self.engine.promote(step)
                    raise CheckpointError(
                        f"the memory snapshot of step {step} committed but was not replicated "
                        "to a peer (see the replication warning above): it would be lost with "
                        "this node, so it is no commit a restart can rely on. Its promotion to "
                        "durable storage runs until the process ends"
                    )
                phases: dict[str, float] = {
                    SavePhase.DRAIN: drain_s,
                    SavePhase.PLAN: plan_s,
                    SavePhase.WRITE: write_s,
                }
                self._finish(
                    local, step, notice_t, phases, None, tier=Tier.MEMORY,
                    uri=self.engine.snapshot_uri(step),
                )  # fmt: skip
                self.engine.promote(step)  # reported committed first: this may wait
                return self._after(step, bg_error)
            if tier is None:
                assert left is not None  # without a deadline the durable tier is chosen
                last = self.engine.last_committed
                reason = (
                    f"skipped: a save of step {step} is estimated at {est_max:.2f}s but only "
                    f"{max(left, 0.0):.2f}s are left before the deadline minus the "
                    f"{self.deadline_margin:g}s margin"
                    + (
                        ""
                        if math.isinf(mem_max)
                        else f" (the memory tier with its replication at {mem_max:.2f}s)"
                    )
                    + "; the job will resume from "
                    + (f"step {last}" if last is not None else "the start (no checkpoint yet)")
                )
                log.error("%s", reason)
                self.status.update(
                    state=State.SKIPPED,
                    error=reason,
                    seconds=time.perf_counter() - notice_t,
                    phases={SavePhase.DRAIN: drain_s, SavePhase.PLAN: plan_s},
                    **self._served(local),
                )
                return self._after(step, bg_error)
            self.status.update(state=State.SAVING)
            # Storage retries (S3) never start one that could not end before the margin.
            with deadline_scope(
                None if agreement.deadline is None else agreement.deadline - self.deadline_margin
            ):
                info = self.engine.save_prepared(step, trigger, prepared)
            phases = {SavePhase.DRAIN: drain_s, SavePhase.PLAN: plan_s, **info.phases}
            self._finish(local, step, notice_t, phases, info.bytes)
        except BaseException as e:
            self.status.update(
                state=State.FAILED, error=f"{type(e).__name__}: {e}", **self._served(local)
            )
            raise
        return self._after(step, bg_error)

    def _finish(
        self,
        local: LocalNotice,
        step: int,
        notice_t: float,
        phases: dict[str, float],
        total_bytes: int | None,
        *,
        tier: Tier = Tier.DURABLE,
        uri: str | None = None,
    ) -> None:
        total = time.perf_counter() - notice_t
        self.status.update(
            state=State.COMMITTED,
            seconds=total,
            uri=uri or self.engine.step_uri(step),
            phases=phases,
            bytes=total_bytes,
            # A memory commit is not durable yet: its promotion moves this when it commits.
            last_committed_step=step if tier is Tier.DURABLE else self.engine.last_committed,
            tier=tier.value,
            **self._served(local),
        )
        log.warning(
            "rank %d: emergency checkpoint of step %d committed to the %s tier in %.2fs",
            self.rank,
            step,
            tier.value,
            total,
        )

    def _served(self, local: LocalNotice) -> dict[str, Any]:
        """Forget ``local``'s notices; a control request that arrived during the save is
        answered by its outcome, as the one it took would have been: returns the status field
        that names it, for the outcome's one status write (a second write would count the
        outcome twice in the sidecar's metrics)."""
        self.board.served(local)
        late = self.board.late_request(local)
        if late is None:
            return {}
        log.warning(
            "rank %d: checkpoint request %s (%s) arrived during this notice's save: its "
            "outcome answers it",
            self.rank,
            late.id,
            late.reason,
        )
        return {"request_id": late.id}

    def _after(self, step: int, bg_error: BaseException | None) -> bool:
        if bg_error is not None:
            raise CheckpointError(
                f"the notice at step {step} was served, but the background save before it "
                f"failed: {bg_error}"
            ) from bg_error
        return True


def announce_notice(
    status: StatusReporter, *, rank: int, step: int, local: LocalNotice, agreement: Agreement
) -> datetime | None:
    """Log an agreed notice and report it to the sidecar as ``requested`` (every saver that
    serves notices: :class:`NoticeServer`, the DCP loop's ``BatonNotices``); returns its
    deadline, if any."""
    deadline = (
        None if agreement.deadline is None else datetime.fromtimestamp(agreement.deadline, tz=UTC)
    )
    log.warning(
        "rank %d: checkpoint notice (%s) at step %d%s",
        rank,
        ", ".join(sorted(agreement.sources)),
        step,
        "" if deadline is None else f", deadline {deadline.isoformat()}",
    )
    status.update(
        state=State.REQUESTED,
        request_id=local.control.id if local.control is not None else None,
        step=step, trigger=agreement.trigger, deadline=deadline, error=None,
        seconds=None, phases={}, bytes=None, uri=None,
    )  # fmt: skip
    return deadline
