"""The training-loop face of the SDK: restore, save by policy, and save at once on a notice.

A training script needs three calls::

    ckpt = Checkpointer(model=model, optimizer=opt, scheduler=sched, dataloader=loader,
                        extra={"scaler": scaler}, every_steps=100)
    start = ckpt.restore()                 # 0 when there is no checkpoint
    for step in range(start, total):
        train_one_optimizer_step()
        if ckpt.step(step + 1):            # True: a notice was served, stop now
            break
    ckpt.close()

Every rank makes the same calls with the same step numbers. At each step boundary the ranks
exchange, in one small collective on a gloo group of their own, what they have heard (SIGTERM,
a request in the control directory, ``request_checkpoint``, a failed background save) and
rank 0's clock. So every decision (save now, save for a notice, raise a background failure) is
taken identically on every rank, and every rank saves the same step.

What is saved: model and optimizer state through ``torch.distributed.checkpoint.state_dict``
(plain modules, DDP, FSDP2), the scheduler, the dataloader's sampler (any Stateful, e.g.
:class:`~trainer_sdk.ResumableSampler`), ``extra`` objects, every RNG stream of each rank, and
the step. See ``docs/checkpointer.md`` for the policies, the resume rules and the guarantees.

The Checkpointer holds the training-loop face (``restore``, ``step``, ``save``,
``request_checkpoint``, ``close``) and the policies, and wires the parts that do the work (all
in ``loop/`` unless named): the notice agreement at each step boundary, overlapped when steps
are short, in ``_agreeing.py``; restore's agreement on the step and its fallback between the
memory tier and the durable one in ``_restoring.py``; the save engine (prepare, save, snapshot,
commit to the memory tier, promote, after-commit, drain) in ``_save_engine.py``; serving a
notice in ``_notices.py``; the status file in ``_status.py``; its settings in ``_config.py``;
the state dict and its application in ``_training_state.py``; the agreement's collective and
the notice sources in ``signals.py``; async saves in ``staging.py``; the protocol behind
``api.py``; every collective in ``saveload/_collectives.py``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

import torch
import torch.distributed as dist

from trainer_sdk import api
from trainer_sdk.control import ControlChannel
from trainer_sdk.errors import CheckpointError
from trainer_sdk.loop._agreeing import NoticeAgreement
from trainer_sdk.loop._config import CheckpointerConfig, env_number
from trainer_sdk.loop._deadline import SaveEstimator
from trainer_sdk.loop._memory_tier import MemoryTier, RestoreInfo
from trainer_sdk.loop._notices import NoticeServer
from trainer_sdk.loop._restoring import Restorer
from trainer_sdk.loop._reuse import Reuse
from trainer_sdk.loop._save_engine import RankParts, SaveEngine
from trainer_sdk.loop._status import StatusReporter
from trainer_sdk.loop._training_state import ResumeError, TrainingState
from trainer_sdk.loop.signals import (
    ControlPoller,
    NoticeBoard,
    SigtermListener,
)
from trainer_sdk.saveload._collectives import backend_timeout, release_group
from trainer_sdk.staging import NORMAL_PRIORITY_BYTES, AsyncSaveHandle, AsyncSaver
from trainer_sdk.storage import Location, Storage, open_storage
from trainer_sdk.wire import (
    EXIT_RESTART_IN_PLACE,
    EXIT_STOPPED_AFTER_NOTICE,
    State,
    Tier,
    Trigger,
)

__all__ = ["Checkpointer", "CheckpointerConfig", "RestoreInfo", "ResumeError"]

log = logging.getLogger("trainer_sdk.checkpointer")


class Checkpointer:
    """Saves and restores the whole training state; see the module docstring.

    Build it on every rank, on the main thread, after ``init_process_group`` (if any) and
    after building the model, optimizer, scheduler and dataloader.

    It is the public face of the SDK (the constructor's options, ``step``, ``save``,
    ``restore``, ``wait``, ``close`` and the properties), each with its argument checks and
    documentation; the work is in :class:`~trainer_sdk.loop._save_engine.SaveEngine`,
    :class:`~trainer_sdk.loop._restoring.Restorer`,
    :class:`~trainer_sdk.loop._agreeing.NoticeAgreement`, the memory tier and the notice
    server.
    """

    def __init__(
        self,
        uri: Location | None = None,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any | None = None,
        dataloader: Any | None = None,
        extra: Mapping[str, Any] | None = None,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        keep_last: int | None = None,
        async_save: bool = False,
        stage_in_background: bool | None = None,
        writer_process: bool | None = None,
        control_dir: str | None = None,
        handle_sigterm: bool = True,
        notice_every: int = 1,
        notice_overlap_below: float = 1.0,
        deadline_margin: float = 5.0,
        timeout: timedelta | float = timedelta(minutes=10),
        accumulation_steps: int | None = None,
        resume_fallback: bool = True,
        probe_bytes: int = 8 << 20,
        fast_every_steps: int | None = None,
        fast_dir: str | os.PathLike[str] | None = None,
        full_every_steps: int | None = None,
    ) -> None:
        storage: Storage | None = None
        given: str | None = None
        if isinstance(uri, Storage):
            storage = uri
            given = uri.uri
        elif uri:
            given = os.fspath(uri)
        self.config = CheckpointerConfig.from_env(
            uri=given,
            every_steps=every_steps,
            every_seconds=every_seconds,
            keep_last=keep_last,
            async_save=async_save,
            stage_in_background=stage_in_background,
            writer_process=writer_process,
            control_dir=control_dir,
            handle_sigterm=handle_sigterm,
            notice_every=notice_every,
            notice_overlap_below=notice_overlap_below,
            deadline_margin=deadline_margin,
            timeout=timeout,
            accumulation_steps=accumulation_steps,
            resume_fallback=resume_fallback,
            probe_bytes=probe_bytes,
            fast_every_steps=fast_every_steps,
            fast_dir=os.fspath(fast_dir) if fast_dir else None,
            full_every_steps=full_every_steps,
        )
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        # Checked now, so that a wrong dataloader fails at start-up, not at the first save.
        self._objects = TrainingState(
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            dataloader=dataloader,
            extra=extra,
            rank=self.rank,
            world_size=self.world_size,
            accumulation_steps=self.config.accumulation_steps,
        )
        self.storage: Storage = storage if storage is not None else open_storage(self.config.uri)
        # Main-thread checkpoint collectives (agreement, sync saves, restore) get a gloo group
        # of their own: the training group may be NCCL, and must not see extra collectives.
        self._group: Any | None = None
        if self.distributed and self.world_size > 1:
            self._group = dist.new_group(
                backend="gloo", timeout=backend_timeout(self.config.timeout)
            )
        # Built by every rank in the same order: it creates the background save group.
        self._saver: AsyncSaver | None = (
            AsyncSaver(
                timeout=self.config.timeout,
                normal_priority_below=NORMAL_PRIORITY_BYTES,
                writer_process=self.config.writer_process,
            )
            if self.config.async_save
            else None
        )
        # The memory tier has its own writer, buffers and group (built next, by every rank in
        # the same order), so that it never waits for the durable saver or delays it.
        self._fast: MemoryTier | None = (
            MemoryTier(
                self.config.fast_dir,
                every_steps=self.config.fast_every_steps,
                local_rank=self.local_rank,
                timeout=self.config.timeout,
                control_dir=self.config.control_dir,
            )
            if self.config.fast_dir
            else None
        )
        # Incremental steps: what committed steps hold, to reference instead of rewrite.
        reuse = Reuse(full_every_steps=self.config.full_every_steps, group=self._group,
                      timeout=self.config.timeout.total_seconds())  # fmt: skip

        self._sigterm = SigtermListener() if handle_sigterm else None
        if self._sigterm is not None:
            self._sigterm.install()
        self._channel = ControlChannel(self.config.control_dir) if self.config.control_dir else None
        poller = (
            ControlPoller(self._channel)
            if self._channel is not None and self.local_rank == 0
            else None
        )
        self._board = NoticeBoard(sigterm=self._sigterm, poller=poller)
        self._estimator = SaveEstimator()
        # Every local rank reports in its own file; the sidecar folds them into one pod status.
        self._reporter = StatusReporter(
            self._channel,
            local_rank=self.local_rank,
            local_world_size=max(env_number("LOCAL_WORLD_SIZE", int) or 1, 1),
        )
        # The parts, each built once and handed what it uses. None of them holds a reference
        # back to the Checkpointer: one that goes out of scope is freed at once, with its
        # process groups (a cycle would keep them alive until interpreter shutdown, where
        # tearing down a gloo group aborts the process).
        parts = RankParts(
            config=self.config, rank=self.rank, world_size=self.world_size,
            storage=self.storage, group=self._group, objects=self._objects, fast=self._fast,
            reuse=reuse, estimator=self._estimator, reporter=self._reporter,
        )  # fmt: skip
        self._engine = SaveEngine(parts, saver=self._saver)
        staged_later = self.config.async_save or self._fast is not None
        self._unguard = (
            self._engine.guard_optimizer()
            if self.config.stage_in_background and staged_later
            else None
        )
        self._restorer = Restorer(parts, engine=self._engine)
        self._agreement = NoticeAgreement(
            rank=self.rank, group=self._group, config=self.config, board=self._board,
            saver=self._saver, engine=self._engine,
        )  # fmt: skip
        self._notices = NoticeServer(
            rank=self.rank,
            group=self._group,
            deadline_margin=self.config.deadline_margin,
            board=self._board,
            status=self._reporter,
            estimator=self._estimator,
            engine=self._engine,
        )
        self._closed = False

    # ---- public API -----------------------------------------------------------------------

    def restore(self) -> int:
        """Load the newest complete checkpoint into the objects; return the step to continue
        from (0 when there is none).

        Nothing is ever deleted here. A step that is *bad* (a checksum or size mismatch, a
        manifest that fails validation) is skipped with a WARNING naming the file and the
        reason, and the next older complete one is tried; a step that *cannot be read now or
        by this version* (permissions, I/O, throttling after every retry, a newer format
        version, an unknown dtype) raises :class:`~trainer_sdk.errors.UnreadableCheckpointError`
        naming the step, the cause and the fix. Every rank loads the same step, and every
        collective is bounded by ``timeout`` (a rank that never calls restore is named).
        ``BATON_RESUME_STEP`` (set by the operator) is checked against the step loaded: see
        ``resume_fallback``.
        """
        self._check_open()
        return self._restorer.restore()

    def step(self, step: int) -> bool:
        """Call after each optimizer step with the number of optimizer steps done.

        Saves when the policy says so, serves a pending notice with a synchronous save of this
        step on every rank, and raises a background save's failure. Returns True after a
        notice was served (committed or skipped): the caller should stop training.
        """
        self._check_open()
        agreement, local = self._agreement.agree(step)
        self._reporter.heartbeat(step)
        if agreement is not None and agreement.background_failed:
            self._engine.raise_background_failure()
        if agreement is not None and local is not None and agreement.notice:
            return self._notices.serve(step, local, agreement)
        periodic = (
            self.config.every_steps is not None and step % self.config.every_steps == 0
        ) or (agreement is not None and agreement.periodic_due)
        snapshot = self._fast is not None and self._fast.due(step)
        prepared = self._engine.prepare(step) if periodic and snapshot else None
        if periodic and step != self._engine.last_saved_step:
            self._save(
                step,
                trigger=Trigger.PERIODIC,
                background=self.config.async_save,
                prepared=prepared,
            )
        if snapshot:
            # After the durable save of the same step, so that it never waits for this one.
            self._engine.snapshot(step, prepared)
        self._agreement.overlap_next(step)  # last, after any save
        return False

    def save(self, step: int, *, trigger: str = Trigger.MANUAL) -> None:
        """Save ``step`` now, synchronously, on every rank (e.g. a final save)."""
        self._check_open()
        self._save(step, trigger=trigger, background=False)

    def request_checkpoint(
        self, *, deadline: datetime | float | str | None = None, reason: str = ""
    ) -> None:
        """Ask for an emergency save at the next step boundary (this rank is enough; the one
        after, when the notice agreement is overlapped: see ``notice_overlap_below``).

        ``deadline``: an aware datetime, a UNIX time in seconds or an RFC 3339 string; the
        save is skipped, not started, if it is estimated to end after ``deadline - margin``.
        """
        self._board.request(deadline=deadline, reason=reason or "request_checkpoint")

    @property
    def last_save(self) -> AsyncSaveHandle[Any] | None:
        """The handle of the last background save, if any."""
        return self._saver.in_flight if self._saver is not None else None

    @property
    def last_committed_step(self) -> int | None:
        """The newest step this Checkpointer loaded or committed."""
        return self._engine.last_committed

    @property
    def exit_code(self) -> int:
        """The code a training script exits with once ``step()`` returned True.

        ``EXIT_RESTART_IN_PLACE`` (76) when the notice's save committed to the memory tier:
        the operator replaces only the noticed node's pods and the others' trainers restart
        in place (the memory survives in the kept pods and the peers' replicas). Otherwise
        ``EXIT_STOPPED_AFTER_NOTICE`` (75): the pods are replaced. A SIGTERM's save is always
        75: the process is being stopped."""
        status = self._reporter.status
        if (
            status.state == State.COMMITTED
            and status.trigger == Trigger.NOTICE.value
            and status.tier in (Tier.MEMORY.value, Tier.PROMOTED.value)
        ):
            return EXIT_RESTART_IN_PLACE
        return EXIT_STOPPED_AFTER_NOTICE

    def wait(self) -> None:
        """Wait for a background save, a memory-tier snapshot and a promotion in flight;
        raise a failure."""
        self._engine.wait()

    @property
    def restored(self) -> RestoreInfo:
        """What the last ``restore()`` loaded: the step, and the tier it came from
        (``"memory"``: the snapshot in ``fast_dir``; ``"durable"``: the checkpoint uri)."""
        return self._restorer.restored

    def close(self) -> None:
        """Drain the background save (raising its failure) and restore the SIGTERM handler."""
        if self._closed:
            return
        self._closed = True
        try:
            self._agreement.settle(on_close=True)
            if self._saver is not None:
                try:
                    self._engine.drain()
                finally:
                    self._saver.close()
        finally:
            if self._fast is not None:
                self._fast.close()
            if self._sigterm is not None:
                self._sigterm.uninstall()
            if self._unguard is not None:
                self._unguard()
            # Last: nothing of this Checkpointer runs a collective after this.
            group, self._group = self._group, None
            release_group(group)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- state ----------------------------------------------------------------------------

    @property
    def model(self) -> torch.nn.Module | None:
        """The model this Checkpointer saves and restores."""
        return self._objects.model

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer this Checkpointer saves and restores."""
        return self._objects.optimizer

    @property
    def scheduler(self) -> Any | None:
        """The LR scheduler this Checkpointer saves and restores."""
        return self._objects.scheduler

    @property
    def dataloader(self) -> Any | None:
        """The dataloader whose position this Checkpointer saves and restores."""
        return self._objects.dataloader

    @property
    def extra(self) -> Mapping[str, Any] | None:
        """The extra objects this Checkpointer saves and restores."""
        return self._objects.extra

    # ---- saving ---------------------------------------------------------------------------

    def _save(
        self,
        step: int,
        *,
        trigger: str,
        background: bool,
        prepared: tuple[api.FlatState, api.SavePlan] | None = None,
    ) -> None:
        # An overlapped agreement finishes before the save's collectives use the same group;
        # its answer is kept and acted on at the next boundary, as planned.
        self._agreement.settle()
        self._engine.save(step, trigger=trigger, background=background, prepared=prepared)

    # ---- helpers --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed: build a new one")
