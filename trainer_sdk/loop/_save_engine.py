"""The Checkpointer's save engine: every way a step of the training state gets written.

The :class:`~trainer_sdk.checkpointer.Checkpointer` decides *when* (its policies and the notice
agreement), :class:`~trainer_sdk.loop._notices.NoticeServer` serves a notice and
:class:`~trainer_sdk.loop._restoring.Restorer` loads a step; :class:`SaveEngine` does the writing
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
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from trainer_sdk import api
from trainer_sdk.errors import BatonError, CheckpointError
from trainer_sdk.format import _catalog
from trainer_sdk.format.layout import step_dir
from trainer_sdk.format.planning import PlanCache
from trainer_sdk.loop._config import CheckpointerConfig, env_number
from trainer_sdk.loop._deadline import SaveEstimator, probe_write
from trainer_sdk.loop._memory_tier import MemoryTier
from trainer_sdk.loop._reuse import Reuse, frozen_storages, optimizer_storages, storage_ptr
from trainer_sdk.loop._status import StatusReporter
from trainer_sdk.loop._training_state import TrainingState
from trainer_sdk.saveload._collectives import broadcast_json
from trainer_sdk.staging import AsyncSaver, stage_and_commit
from trainer_sdk.storage import Storage
from trainer_sdk.wire import ROUTINE_TRIGGERS, State, Tier

__all__ = ["RankParts", "SaveEngine", "hooked_optimizer"]

log = logging.getLogger("trainer_sdk.checkpointer")


@dataclass(frozen=True, kw_only=True)
class RankParts:
    """What the Checkpointer builds once on each rank and hands to both the save engine and
    the restorer (:class:`~trainer_sdk.loop._restoring.Restorer`): one object, so that a part added
    reaches both, and neither holds the Checkpointer."""

    config: CheckpointerConfig
    rank: int
    world_size: int
    storage: Storage
    group: Any | None
    """The Checkpointer's gloo group for main-thread collectives; None: one process."""
    objects: TrainingState
    fast: MemoryTier | None
    """The memory tier; None when it is off."""
    reuse: Reuse
    estimator: SaveEstimator
    reporter: StatusReporter


def hooked_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer whose ``step()`` runs step pre-hooks: ``optimizer`` itself, or the
    one a wrapper holds (accelerate's ``AcceleratedOptimizer.optimizer``, Lightning's
    ``LightningOptimizer._optimizer``). A wrapper's own ``step()`` does not run the hooks
    registered on it when it never called ``Optimizer.__init__`` (accelerate's does not), so
    the hook goes on the optimizer that really steps."""
    seen = optimizer
    for _ in range(4):  # wrappers of wrappers, not a cycle
        if (
            isinstance(seen, torch.optim.Optimizer)
            and "_optimizer_step_pre_hooks" in vars(seen)
            and getattr(type(seen).step, "hooked", False)
        ):
            return seen
        inner = getattr(seen, "optimizer", None) or getattr(seen, "_optimizer", None)
        if inner is None or inner is seen:
            break
        seen = inner
    raise CheckpointError(
        f"stage_in_background needs an optimizer whose step() runs torch's step pre-hooks; "
        f"{type(optimizer).__name__} does not, and holds none that does (as .optimizer or "
        "._optimizer): pass the torch.optim.Optimizer it wraps, or leave stage_in_background "
        "off"
    )


class SaveEngine:
    """Writes steps for the Checkpointer, on this rank; see the module docstring.

    Built once by the Checkpointer, on every rank, with the parts it built (in the order that
    creates their process groups identically everywhere). Every method that runs a collective
    is called by every rank at the same point, as the Checkpointer's own methods were.
    """

    def __init__(self, parts: RankParts, *, saver: AsyncSaver | None) -> None:
        self.parts = parts
        self._saver = saver
        self._plans = PlanCache()  # the same tensors at every save: planned once
        self._whole_bytes = 0  # this rank's bytes of the whole state, at the last prepare
        self._hooked: torch.optim.Optimizer | None = None
        """The optimizer whose step waits for a background copy (:meth:`guard_optimizer`); its
        storages are what ``stage_in_background`` copies beside the next steps."""
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
        return self.parts.fast

    # ---- durable saves ----------------------------------------------------------------------

    def prepare(self, step: int) -> tuple[api.FlatState, api.SavePlan]:
        """Flatten and plan ``step`` for a durable save (every rank: the reuse decision is a
        collective): the plan leaves out the tensors it references in earlier durable steps.
        The memory tier plans the whole state of the same flat state (:meth:`_whole`)."""
        flat = api.flatten(self.parts.objects.for_save(step))
        whole = self._whole(flat)
        self._whole_bytes = whole.nbytes
        return flat, self.parts.reuse.plan(flat, whole, step, self._frozen())

    def _whole(self, flat: api.FlatState) -> api.SavePlan:
        """The plan of every tensor of ``flat``: what a memory snapshot writes. Snapshots carry
        the frozen base, so that a recovering pod restores from a snapshot alone (planned
        once for a loop's layout)."""
        return self._plans.plan(flat, self.parts.rank, self.parts.world_size)

    def memory_estimate(self, nbytes: int) -> float:
        """The notice's estimate of a memory commit: of the whole state's bytes, not of the
        durable save's ``nbytes`` (which leaves out what it references)."""
        assert self.parts.fast is not None
        return self.parts.fast.notice_estimate(max(nbytes, self._whole_bytes))

    def _frozen(self) -> set[int]:
        return frozen_storages(self.parts.objects.model)

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
            refs, on_manifest = self.parts.reuse.for_save(plan)
            handle = stage_and_commit(
                self._saver,
                flat,
                plan,
                self.parts.storage,
                step=step,
                trigger=trigger,
                on_commit=self._after_commit,
                attempt=self.attempt,
                extra=extra,
                references=refs,
                on_manifest=on_manifest,
                defer=self._stepped_by_optimizer if self.parts.config.stage_in_background else None,
            )
            self.resume_note = None
            log.debug("step %d staged in %.3fs", step, handle.stage_seconds)
            return None
        self.drain()
        flat, plan = prepared or self.prepare(step)
        refs, on_manifest = self.parts.reuse.for_save(plan)
        info = api.write_and_commit(
            self.parts.storage, plan, flat.tensors(), flat.tree, step=step, flat=flat,
            trigger=trigger, process_group=self.parts.group,
            timeout=self.parts.config.timeout.total_seconds(), started=start,
            attempt=self.attempt, extra=extra, references=refs, on_manifest=on_manifest,
        )  # fmt: skip
        self.resume_note = None
        self._after_commit(info, plan.nbytes)
        return info

    def _stepped_by_optimizer(self, tensors: Mapping[str, torch.Tensor]) -> set[str]:
        """The tensors whose copy may run after the save call returns (``stage_in_background``):
        those only the optimizer's step changes, which waits for the copy
        (:meth:`guard_optimizer`). The rest (buffers, the scaler, extra state) copy at once."""
        stepped = optimizer_storages(self._hooked)
        return {name for name, t in tensors.items() if storage_ptr(t) in stepped}

    def guard_optimizer(self) -> Callable[[], None]:
        """Make the optimizer's step wait for the background staging copies of a durable save
        and a memory-tier snapshot (``stage_in_background``); returns what removes the hook.
        The hook holds the savers weakly: an optimizer that outlives its Checkpointer must not
        keep their process groups alive until interpreter exit."""
        optimizer = self.parts.objects.optimizer
        savers = [s for s in (self._saver, self.parts.fast and self.parts.fast.saver) if s]
        if optimizer is None or not savers:
            return lambda: None
        refs = [weakref.ref(s) for s in savers]

        def wait_for_copy(*_: Any) -> None:
            for ref in refs:
                live = ref()
                if live is not None:
                    live.wait_staged()

        self._hooked = hooked_optimizer(optimizer)
        return self._hooked.register_step_pre_hook(wait_for_copy).remove

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
        self.parts.estimator.record(rank_bytes, info.seconds)
        self.last_committed = info.step
        if self.parts.fast is not None and self.parts.fast.promotion.step is not None:
            # Retention deletes incomplete directories older than the commit: not the one a
            # promotion is filling. The next commit's retention catches up.
            log.debug(
                "retention skipped: step %d is being promoted", self.parts.fast.promotion.step
            )
        elif self.parts.rank == 0:
            try:
                _catalog.retain(
                    self.parts.storage,
                    committed=info.step,
                    keep_last=self.parts.config.keep_last,
                    attempt=self.attempt,
                )
            except Exception as e:  # the step is committed; retention is tidying up only
                log.warning(
                    "step %d is committed, but deleting old checkpoints under %s failed "
                    "(%s: %s); they are kept and retried after the next save",
                    info.step,
                    self.parts.config.uri,
                    type(e).__name__,
                    e,
                )
        if info.trigger in ROUTINE_TRIGGERS:
            # A routine save is a finished save too: the sidecar's duration, phase and bytes
            # metrics (and the dashboards built on them) come from this status. No request
            # id, so neither the sidecar nor the operator takes it for a served notice.
            self.parts.reporter.update(
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
            self.parts.reporter.update(last_committed_step=info.step)

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
        if self.parts.fast is not None:
            self.parts.fast.wait()
            self.parts.fast.promotion.wait()

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
        assert self.parts.fast is not None
        self.register_attempt()
        flat = prepared[0] if prepared else api.flatten(self.parts.objects.for_save(step))
        handle = self.parts.fast.snapshot(
            step, flat, self._whole(flat), attempt=self.attempt,
            defer=self._stepped_by_optimizer if self.parts.config.stage_in_background else None,
        )  # fmt: skip
        log.debug("memory snapshot of step %d staged in %.3fs", step, handle.stage_seconds)

    def commit_memory(self, step: int, prepared: tuple[api.FlatState, api.SavePlan]) -> bool:
        """A notice's commit to the memory tier (every rank; waits for the replication)."""
        assert self.parts.fast is not None
        self.register_attempt()
        flat = prepared[0]
        return self.parts.fast.commit(step, flat, self._whole(flat), attempt=self.attempt)

    def promote(self, step: int) -> None:
        """Promote the memory snapshot of ``step`` to the checkpoint uri in the background
        (every rank at the same point); reported and retained like a commit when it ends."""
        assert self.parts.fast is not None
        self.parts.fast.promotion.start(
            step, self.parts.storage, attempt=self.attempt, on_done=self._after_promotion
        )

    def snapshot_uri(self, step: int) -> str:
        assert self.parts.fast is not None
        return f"{self.parts.fast.uri.rstrip('/')}/{step_dir(step)}"

    def _after_promotion(self, step: int, error: BaseException | None) -> None:
        # On the promotion's thread, on every rank.
        if error is not None:
            log.error(
                "rank %d: promoting the memory snapshot of step %d to %s failed: %s. The "
                "snapshot stays in the memory tier (and its replicas) until a newer one; the "
                "next durable save makes a later step durable",
                self.parts.rank,
                step,
                self.parts.config.uri,
                error,
            )
            return
        self.last_committed = max(self.last_committed or 0, step)
        if self.parts.rank == 0:
            try:
                _catalog.retain(
                    self.parts.storage,
                    committed=step,
                    keep_last=self.parts.config.keep_last,
                    attempt=self.attempt,
                )
            except Exception as e:  # committed; retention is tidying up only
                log.warning("step %d is promoted, but retention under %s failed: %s", step,
                            self.parts.config.uri, e)  # fmt: skip
        status = self.parts.reporter.status
        if status.step == step and status.tier == Tier.MEMORY.value:
            self.parts.reporter.update(
                tier=Tier.PROMOTED.value, uri=self.step_uri(step), last_committed_step=step
            )
        else:
            self.parts.reporter.update(last_committed_step=self.last_committed)
        log.info("rank %d: step %d is durable under %s (promoted)", self.parts.rank, step,
                 self.parts.config.uri)  # fmt: skip

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
        if self.parts.rank == 0:
            try:
                attempt = api.register_attempt(self.parts.storage, env_number("BATON_ATTEMPT", int))
            except Exception as e:
                if self.parts.group is None:
                    raise
                error = f"{type(e).__name__}: {e}"
        if self.parts.group is not None:
            attempt, error = broadcast_json(
                [attempt, error],
                group=self.parts.group,
                timeout=self.parts.config.timeout.total_seconds(),
                what="registering the attempt",
            )
        if error is not None:
            raise CheckpointError(f"rank 0 could not register this run's attempt: {error}")
        self.attempt = int(attempt)
        if self.parts.rank == 0:
            log.info("writing under %s as attempt %d", self.parts.config.uri, self.attempt)

    def probe(self) -> None:
        """Calibrate the save-time estimate with a small write (before a first save)."""
        try:
            nbytes, seconds = probe_write(
                self.parts.storage, rank=self.parts.rank, nbytes=self.parts.config.probe_bytes
            )
        except (OSError, BatonError) as e:
            log.warning(
                "probe write to %s failed (%s): no save-time estimate yet", self.parts.config.uri, e
            )
            return
        self.parts.estimator.record(nbytes, seconds, probe=True)

    def step_uri(self, step: int) -> str:
        return f"{self.parts.storage.uri.rstrip('/')}/{step_dir(step)}"
