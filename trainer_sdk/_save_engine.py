"""The Checkpointer's save engine: every way a step of the training state gets written.

The :class:`~trainer_sdk.checkpointer.Checkpointer` decides *when* (its policies and the notice
agreement), :class:`~trainer_sdk._notices.NoticeServer` serves a notice and
:class:`~trainer_sdk._restoring.Restorer` loads a step; :class:`SaveEngine` does the writing
for all three: flatten and plan a step (``prepare``, with incremental references), a durable
save in the foreground or the background (``save``), a memory-tier snapshot (``snapshot``),
a notice's commit to the memory tier (``commit_memory``), its promotion to durable storage and
the follow-up (``promote``), what every commit is followed by (the estimator, retention, the
status), waiting for and raising a background save (``drain``, ``wait``,
``raise_background_failure``), this writer's attempt in the fence (``register_attempt``) and
the write probe that calibrates the estimate (``probe``).

It also keeps the record the policies read: the step and time of the last save, the newest
committed step, the attempt, the resume note for the next manifest.

It holds no reference to the Checkpointer, the restorer or the notice server (they hold it),
so a Checkpointer that goes out of scope is freed at once, with its process groups. The callbacks
it hands to the background writers (``on_commit``, ``on_done``) are its own methods.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from trainer_sdk import _catalog, api
from trainer_sdk._collectives import broadcast_json
from trainer_sdk._config import CheckpointerConfig, env_number
from trainer_sdk._deadline import SaveEstimator, probe_write
from trainer_sdk._memory_tier import MemoryTier
from trainer_sdk._reuse import Reuse, frozen_storages
from trainer_sdk._status import StatusReporter
from trainer_sdk._training_state import TrainingState
from trainer_sdk.errors import BatonError, CheckpointError
from trainer_sdk.layout import step_dir
from trainer_sdk.planning import PlanCache
from trainer_sdk.staging import AsyncSaver, stage_and_commit
from trainer_sdk.storage import Storage
from trainer_sdk.wire import ROUTINE_TRIGGERS, State, Tier

__all__ = ["SaveEngine"]

log = logging.getLogger("trainer_sdk.checkpointer")


class SaveEngine:
    """Writes steps for the Checkpointer, on this rank; see the module docstring.

    Built once by the Checkpointer, on every rank, with the parts it built (in the order that
    creates their process groups identically everywhere). Every method that runs a collective
    is called by every rank at the same point, as the Checkpointer's own methods were.
    """

    def __init__(
        self,
        *,
        config: CheckpointerConfig,
        rank: int,
        world_size: int,
        storage: Storage,
        group: Any | None,
        objects: TrainingState,
        saver: AsyncSaver | None,
        fast: MemoryTier | None,
        reuse: Reuse,
        estimator: SaveEstimator,
        reporter: StatusReporter,
    ) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.storage = storage
        self._group = group
        """The Checkpointer's gloo group for main-thread collectives; None: one process."""
        self._objects = objects
        self._saver = saver
        self._fast = fast
        self._plans = PlanCache()  # the same tensors at every save: planned once
        self._whole_bytes = 0  # this rank's bytes of the whole state, at the last prepare
        self._reuse = reuse
        self._estimator = estimator
        self._reporter = reporter
        self.clock: Callable[[], float] = time.monotonic
        """The clock of the every_seconds policy (only rank 0's reading counts); replaceable
        so that tests can drive time."""
        self.last_save_time = self.clock()
        self.last_saved_step: int | None = None
        self.last_committed: int | None = None
        """The newest step loaded durable, committed or promoted."""
        self.attempt: int | None = None
        """This writer's attempt (set by restore() or the first save)."""
        self.resume_note: dict[str, Any] | None = None
        """What the manifest of the next save records about the resume (world size change)."""

    @property
    def fast(self) -> MemoryTier | None:
        """The memory tier; None when it is off."""
        return self._fast

    # ---- durable saves ----------------------------------------------------------------------

    def prepare(self, step: int) -> tuple[api.FlatState, api.SavePlan]:
        """Flatten and plan ``step`` for a durable save (every rank: the reuse decision is a
        collective): the plan leaves out the tensors it references in earlier durable steps.
        The memory tier plans the whole state of the same flat state (:meth:`_whole`)."""
        flat = api.flatten(self._objects.for_save(step))
        whole = self._whole(flat)
        self._whole_bytes = whole.nbytes
        return flat, self._reuse.plan(flat, whole, step, self._frozen())

    def _whole(self, flat: api.FlatState) -> api.SavePlan:
        """The plan of every tensor of ``flat``: what a memory snapshot writes. Snapshots carry
        the frozen base, so that a recovering pod restores from a snapshot alone (planned
        once for a loop's layout)."""
        return self._plans.plan(flat, self.rank, self.world_size)

    def memory_estimate(self, nbytes: int) -> float:
        """The notice's estimate of a memory commit: of the whole state's bytes, not of the
        durable save's ``nbytes`` (which leaves out what it references)."""
        assert self._fast is not None
        return self._fast.notice_estimate(max(nbytes, self._whole_bytes))

    def _frozen(self) -> set[int]:
        return frozen_storages(self._objects.model)

    def save(
        self,
        step: int,
        *,
        trigger: str,
        background: bool,
        prepared: tuple[api.FlatState, api.SavePlan] | None = None,
    ) -> api.SaveInfo | None:
        """Save ``step``; returns what the save did, or None when it runs in the background.

        The caller settles an overlapped notice agreement first (its collectives use the same
        group as this save's)."""
        start = time.perf_counter()
        self.last_save_time = self.clock()
        self.last_saved_step = step
        self.register_attempt()
        extra = {"baton": {"resume": self.resume_note}} if self.resume_note else None
        if background:
            assert self._saver is not None
            # At most one save in flight: wait for (and raise the failure of) the previous.
            self._saver.wait_previous()
            flat, plan = prepared or self.prepare(step)
            refs, on_manifest = self._reuse.for_save(plan)
            handle = stage_and_commit(
                self._saver,
                flat,
                plan,
                self.storage,
                step=step,
                trigger=trigger,
                on_commit=self._after_commit,
                attempt=self.attempt,
                extra=extra,
                references=refs,
                on_manifest=on_manifest,
            )
            self.resume_note = None
            log.debug("step %d staged in %.3fs", step, handle.stage_seconds)
            return None
        self.drain()
        flat, plan = prepared or self.prepare(step)
        refs, on_manifest = self._reuse.for_save(plan)
        info = api.write_and_commit(
            self.storage, plan, flat.tensors(), flat.tree, step=step, flat=flat, trigger=trigger,
            process_group=self._group, timeout=self.config.timeout.total_seconds(),
            started=start, attempt=self.attempt, extra=extra, references=refs,
            on_manifest=on_manifest,
        )  # fmt: skip
        self.resume_note = None
        self._after_commit(info, plan.nbytes)
        return info

    def save_prepared(
        self, step: int, trigger: str, prepared: tuple[api.FlatState, api.SavePlan]
    ) -> api.SaveInfo:
        """A synchronous save of an already prepared step (the notice path)."""
        info = self.save(step, trigger=trigger, background=False, prepared=prepared)
        assert info is not None  # a synchronous save always returns what it did
        return info

    def _after_commit(self, info: api.SaveInfo, rank_bytes: int) -> None:
        # Runs on the training thread (sync saves) or the worker thread (async saves), after
        # the manifest is written: only now may older checkpoints go.
        self._estimator.record(rank_bytes, info.seconds)
        self.last_committed = info.step
        if self._fast is not None and self._fast.promoting is not None:
            # Retention deletes incomplete directories older than the commit: not the one a
            # promotion is filling. The next commit's retention catches up.
            log.debug("retention skipped: step %d is being promoted", self._fast.promoting)
        elif self.rank == 0:
            try:
                _catalog.retain(
                    self.storage,
                    committed=info.step,
                    keep_last=self.config.keep_last,
                    attempt=self.attempt,
                )
            except Exception as e:  # the step is committed; retention is tidying up only
                log.warning(
                    "step %d is committed, but deleting old checkpoints under %s failed "
                    "(%s: %s); they are kept and retried after the next save",
                    info.step,
                    self.config.uri,
                    type(e).__name__,
                    e,
                )
        if info.trigger in ROUTINE_TRIGGERS:
            # A routine save is a finished save too: the sidecar's duration, phase and bytes
            # metrics (and the dashboards built on them) come from this status. No request
            # id, so neither the sidecar nor the operator takes it for a served notice.
            self._reporter.update(
                state=State.COMMITTED,
                request_id=None,
                step=info.step,
                tier=Tier.DURABLE.value,
                trigger=info.trigger,
                deadline=None,
                error=None,
                seconds=info.seconds,
                phases=info.phases,
                bytes=info.bytes,
                uri=self.step_uri(info.step),
                last_committed_step=info.step,
            )
        else:  # emergency saves report through the NoticeServer, with their notice's details
            self._reporter.update(last_committed_step=info.step)

    def drain(self) -> None:
        """Wait for the background save in flight, if any; raise its failure."""
        if self._saver is None:
            return
        self._saver.wait_previous()

    def wait(self) -> None:
        """Wait for a background save, a memory-tier snapshot and a promotion in flight;
        raise a failure."""
        if self._saver is not None:
            self.drain()
        if self._fast is not None:
            self._fast.wait()
            self._fast.wait_promotion()

    def raise_background_failure(self) -> None:
        """Raise the failure of a background save that failed on this rank or another."""
        try:
            self.drain()
        except BaseException as e:
            raise CheckpointError(
                f"a background save failed: {e}. The previous complete checkpoint is "
                "unaffected; fix the cause (see the chained error) and restart"
            ) from e
        raise CheckpointError(
            "a background save failed on another rank (see that rank's log); the previous "
            "complete checkpoint is unaffected"
        )

    # ---- the memory tier --------------------------------------------------------------------

    def snapshot(self, step: int, prepared: tuple[api.FlatState, api.SavePlan] | None) -> None:
        """Stage ``step`` into the memory tier; its write and commit run in the background."""
        assert self._fast is not None
        self.register_attempt()
        flat = prepared[0] if prepared else api.flatten(self._objects.for_save(step))
        handle = self._fast.snapshot(step, flat, self._whole(flat), attempt=self.attempt)
        log.debug("memory snapshot of step %d staged in %.3fs", step, handle.stage_seconds)

    def commit_memory(self, step: int, prepared: tuple[api.FlatState, api.SavePlan]) -> bool:
        """A notice's commit to the memory tier (every rank; waits for the replication)."""
        assert self._fast is not None
        self.register_attempt()
        flat = prepared[0]
        return self._fast.commit(step, flat, self._whole(flat), attempt=self.attempt)

    def promote(self, step: int) -> None:
        """Promote the memory snapshot of ``step`` to the checkpoint uri in the background
        (every rank at the same point); reported and retained like a commit when it ends."""
        assert self._fast is not None
        self._fast.promote_in_background(
            step, self.storage, attempt=self.attempt, on_done=self._after_promotion
        )

    def snapshot_uri(self, step: int) -> str:
        assert self._fast is not None
        return f"{self._fast.uri.rstrip('/')}/{step_dir(step)}"

    def _after_promotion(self, step: int, error: BaseException | None) -> None:
        # On the promotion's thread, on every rank.
        if error is not None:
            log.error(
                "rank %d: promoting the memory snapshot of step %d to %s failed: %s. The "
                "snapshot stays in the memory tier (and its replicas) until a newer one; the "
                "next durable save makes a later step durable",
                self.rank,
                step,
                self.config.uri,
                error,
            )
            return
        self.last_committed = max(self.last_committed or 0, step)
        if self.rank == 0:
            try:
                _catalog.retain(
                    self.storage,
                    committed=step,
                    keep_last=self.config.keep_last,
                    attempt=self.attempt,
                )
            except Exception as e:  # committed; retention is tidying up only
                log.warning("step %d is promoted, but retention under %s failed: %s", step,
                            self.config.uri, e)  # fmt: skip
        status = self._reporter.status
        if status.step == step and status.tier == Tier.MEMORY.value:
            self._reporter.update(
                tier=Tier.PROMOTED.value, uri=self.step_uri(step), last_committed_step=step
            )
        else:
            self._reporter.update(last_committed_step=self.last_committed)
        log.info("rank %d: step %d is durable under %s (promoted)", self.rank, step,
                 self.config.uri)  # fmt: skip

    # ---- the record ---------------------------------------------------------------------------

    def restored(self, step: int, *, durable: bool) -> None:
        """After a restore of ``step``: the policies count from it; a durable step is the
        newest committed one."""
        self.last_saved_step = step
        self.last_save_time = self.clock()
        if durable:
            self.last_committed = step

    def register_attempt(self) -> None:
        """Record this writer's attempt in the fence, once (``BATON_ATTEMPT``, or a generation
        derived from the uri's history outside Kubernetes). Rank 0 registers it and every
        rank learns it (bounded), so that every rank can refuse to write once superseded."""
        if self.attempt is not None:
            return
        attempt: Any = None
        error: str | None = None
        if self.rank == 0:
            try:
                attempt = api.register_attempt(self.storage, env_number("BATON_ATTEMPT", int))
            except Exception as e:
                if self._group is None:
                    raise
                error = f"{type(e).__name__}: {e}"
        if self._group is not None:
            attempt, error = broadcast_json(
                [attempt, error],
                group=self._group,
                timeout=self.config.timeout.total_seconds(),
                what="registering the attempt",
            )
        if error is not None:
            raise CheckpointError(f"rank 0 could not register this run's attempt: {error}")
        self.attempt = int(attempt)
        if self.rank == 0:
            log.info("writing under %s as attempt %d", self.config.uri, self.attempt)

    def probe(self) -> None:
        """Calibrate the save-time estimate with a small write (before a first save)."""
        try:
            nbytes, seconds = probe_write(
                self.storage, rank=self.rank, nbytes=self.config.probe_bytes
            )
        except (OSError, BatonError) as e:
            log.warning(
                "probe write to %s failed (%s): no save-time estimate yet", self.config.uri, e
            )
            return
        self._estimator.record(nbytes, seconds, probe=True)

    def step_uri(self, step: int) -> str:
        return f"{self.storage.uri.rstrip('/')}/{step_dir(step)}"
