"""PyTorch Lightning runs whose checkpoints are Baton checkpoints.

A stock ``LightningModule`` script changes only its ``Trainer(...)`` arguments
(``docs/integrations.md`` has the whole diff)::

    from trainer_sdk.integrations.lightning import BatonCallback, BatonCheckpointIO
    trainer = Trainer(..., enable_checkpointing=False,
                      plugins=[BatonCheckpointIO()], callbacks=[BatonCallback(every_n_steps=100)])
    trainer.fit(model, loader)     # resumes by itself from the newest complete Baton step

Two parts, each one of Lightning's own extension points (``lightning`` is pinned; the hooks
below were read from its source):

* :class:`BatonCheckpointIO`, a ``CheckpointIO`` plugin: Lightning's checkpoint dict (weights,
  optimizer and scheduler states, loop progress, callback states, hyper-parameters) becomes a
  Baton step: tensors in safetensors, everything else tagged JSON in the manifest's tree
  (``docs/format.md``), never pickle. A value that is not JSON (an ``argparse.Namespace`` in
  the hyper-parameters, a ``Path``) is refused with the key and the fix. The path it is given
  names the step: ``<uri>/step-000000000012``. Lightning calls it on global rank 0 only (its
  ``Strategy.save_checkpoint``), so rank 0 writes the whole dict, as a one-rank save; every
  rank reads it back (``trainer.fit(ckpt_path="<uri>/step-000000000012")`` works with the
  plugin alone). Wrapped in Lightning's ``AsyncCheckpointIO``, periodic saves commit in its
  writer thread, which reports the commit; a notice's save waits for it on every rank.
* :class:`BatonCallback`: restores the newest complete step when ``fit`` starts (rank 0
  chooses, every rank loads the same one, through Lightning's own restore path), saves every
  ``every_n_steps`` optimizer steps, and serves SIGTERM and the sidecar's control-directory
  requests at batch ends with :class:`~trainer_sdk.integrations.dcp.BatonNotices` (one
  agreement per optimizer step, so every rank saves the same step), then exits with 75
  (``EXIT_STOPPED_AFTER_NOTICE``) and reports status to the sidecar.

**SIGTERM has one owner.** Lightning's ``_SignalConnector`` installs its SIGTERM handler when
``fit`` runs (after the callbacks' ``setup``), wrapping the one it finds; its handler runs a
``dist.broadcast`` inside the signal handler, which hangs when only one rank got the signal,
and its loops then raise ``SIGTERMException`` at a step no other rank agreed on. At
``on_train_start`` the callback puts Baton's handler back alone
(:meth:`~trainer_sdk.loop.signals.SigtermListener.reclaim`): Lightning's flag is never set, its
per-batch broadcast of the flag stays 0. Baton's handler is off from the callback's ``setup``
until then, so that the handler Lightning records and puts back at its teardown is the one from
before Baton (a SIGTERM during the restore stops the process: there is nothing new to save).

**Data position.** Lightning 2.6 resumes a mid-epoch checkpoint with its progress counters
where they were, but a ``DataLoader`` that is not stateful (any stock one, on Lightning's
``DistributedSampler``) starts the epoch's data again: it warns, trains the epoch's first
batches a second time and never sees the last ones. The callback saves where the epoch stood
(epoch, batches consumed) in its own state, and on resume has the loader's sampler pass over
exactly the consumed samples for that one epoch (sampler level: no batch is loaded to be
dropped), with the sampler's epoch set before the first index is drawn. Exact: a map-style
dataset with Lightning's (or the user's) sampler under a ``BatchSampler`` (``batch_size=``
given), same world size and batch size. Refused: a loader without a ``BatchSampler``
(``batch_size=None``, a custom ``batch_sampler``), an ``IterableDataset``, more than one
training loader. DDP's gradient bucket layout is saved in the callback's state and put back
before the first step after a resume (at 3+ ranks the all-reduce's sums depend on it:
``trainer_sdk/loop/_ddp.py``). Lightning does not checkpoint RNG streams: a model that draws
random numbers (dropout) while training resumes with fresh streams, not bitwise.

**No memory tier.** Nothing here takes memory-tier snapshots (Lightning's checkpoint dict is
written by rank 0 alone), so the callback builds its ``BatonNotices`` with
``memory_tier=False`` (no tier thread or gloo group) and, when ``$BATON_FAST_DIR`` or
``$BATON_FAST_EVERY_STEPS`` is set (a TrainingJob's ``fastEverySteps``), logs one warning that
the setting has no effect and how to fix that.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any, Final, NoReturn

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler

from trainer_sdk import api
from trainer_sdk.format import _catalog
from trainer_sdk.format.layout import parse_step_dir, step_dir
from trainer_sdk.integrations import IntegrationError
from trainer_sdk.integrations.dcp.notices import BatonNotices
from trainer_sdk.loop import _ddp
from trainer_sdk.loop._config import env_number
from trainer_sdk.loop._status import StatusReporter
from trainer_sdk.saveload._collectives import all_reduce_max, broadcast_json
from trainer_sdk.wire import EXIT_STOPPED_AFTER_NOTICE, State, Tier, Trigger

__all__ = ["BatonCallback", "BatonCheckpointIO"]

log = logging.getLogger("trainer_sdk.integrations.lightning")

_OPTIONS: Final = frozenset({"trigger", "attempt", "report"})
"""The ``storage_options`` keys :meth:`BatonCheckpointIO.save_checkpoint` takes (the callback
passes them through ``trainer.save_checkpoint``); ``report``: the write itself tells the
sidecar it committed (an async save, whose commit only the writer thread sees)."""


_NO_SNAPSHOTS: Final = (
    "%s %s set (the operator sets them for a TrainingJob's spec.checkpoint.fastEverySteps), "
    "but the Lightning integration takes no memory-tier snapshots: fastEverySteps has no effect "
    "for this job (no snapshots, no restart in place; notices and resumes use durable steps "
    "only): unset spec.checkpoint.fastEverySteps (and its fastSizeLimit), or save through the "
    "Checkpointer or a DCP loop with BatonNotices.snapshot to have snapshots"
)
"""The warning ``BatonCallback`` logs when the memory tier's variables are set."""


def _split(path: Any) -> tuple[str, int]:
    """(checkpoint root, step) of a path that ends in a step directory."""
    text = os.fspath(path) if not isinstance(path, str) else path
    root, _, name = text.rstrip("/").rpartition("/")
    step = parse_step_dir(name)
    if step is None or not root:
        raise IntegrationError(
            f"{text!r} is not a Baton step: BatonCheckpointIO saves and loads paths that end "
            f"in a step directory ('<uri>/{step_dir(12)}'); a ModelCheckpoint's *.ckpt files "
            "are not Baton steps: set Trainer(enable_checkpointing=False) and let BatonCallback "
            "save, or pass ckpt_path='<uri>/step-...'"
        )
    return root, step


def _refuse_non_json(value: Any, path: str) -> None:
    """Raise, naming the key and the fix, at the first value Baton's tagged JSON would not
    give back as it was (it would pickle it, or take it apart as Stateful)."""
    if value is None or isinstance(value, (str, int, float, bool, torch.Tensor, torch.dtype)):
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            _refuse_non_json(v, f"{path}.{k}" if path else str(k))
        return
    if type(value) in (list, tuple):
        for i, v in enumerate(value):
            _refuse_non_json(v, f"{path}[{i}]")
        return
    where = path.split(".", 1)[0].split("[", 1)[0]
    hint = {
        "hyper_parameters": "save only JSON values with self.save_hyperparameters() (numbers, "
        "strings, lists, dicts: str(path), vars(namespace)), or leave it out with "
        "save_hyperparameters(ignore=[...])",
        "datamodule_hyper_parameters": "save only JSON values with the datamodule's "
        "save_hyperparameters(), or leave it out with ignore=[...]",
    }.get(
        where,
        "make the state_dict() (or on_save_checkpoint) that put it there return tensors and "
        "JSON values (numbers, strings, lists, dicts)",
    )
    raise IntegrationError(
        f"checkpoint value {path!r} is a {type(value).__qualname__}, which a Baton checkpoint "
        f"cannot hold (it is JSON and tensors, never pickle): {hint}"
    )


class BatonCheckpointIO(CheckpointIO):
    """Lightning's checkpoint dict as a Baton step (see the module doc).

    Args:
        timeout: bound on each collective of a save or load, in seconds.

    ``save_checkpoint(checkpoint, "<uri>/step-000000000012")`` commits step 12 under
    ``<uri>`` (a path, ``file://`` or ``s3://``) from this rank alone; ``load_checkpoint`` of the
    same path gives the dict back on every rank that calls it (all of them, under a
    process group); ``remove_checkpoint`` deletes the step.
    """

    def __init__(self, *, timeout: float = 600.0) -> None:
        self.timeout = timeout
        self._solo: Any | None = None
        self.reporter: StatusReporter | None = None
        """Where a save with ``storage_options["report"]`` reports its commit (the
        callback's status file; set by :class:`BatonCallback` under ``AsyncCheckpointIO``)."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        root, step = _split(path)
        options = dict(storage_options or {})
        unknown = sorted(set(options) - _OPTIONS)
        if unknown:
            raise IntegrationError(
                f"storage_options {unknown} mean nothing to BatonCheckpointIO: pass only "
                f"{sorted(_OPTIONS)}"
            )
        _refuse_non_json(checkpoint, "")
        reporter = self.reporter if options.get("report") else None
        t0 = time.perf_counter()
        try:
            api.save(
                checkpoint, root, step=step,
                trigger=str(options.get("trigger", Trigger.PERIODIC)),
                process_group=self._solo_group(), timeout=self.timeout,
                attempt=options.get("attempt"),
            )  # fmt: skip
        except BaseException as e:
            if reporter is not None:
                reporter.update(state=State.FAILED, step=step, error=f"{type(e).__name__}: {e}")
            raise
        if reporter is not None:
            reporter.update(
                state=State.COMMITTED, step=step, seconds=time.perf_counter() - t0,
                uri=f"{root}/{step_dir(step)}", last_committed_step=step,
                tier=Tier.DURABLE.value,
            )  # fmt: skip
        log.info("saved Lightning's checkpoint as step %d under %s", step, root)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        root, step = _split(path)
        state: dict[str, Any] = {}
        api.load(state, root, step=step, strict=False, timeout=self.timeout)
        return state

    def remove_checkpoint(self, path: Any) -> None:
        root, step = _split(path)
        api.delete_step(root, step)

    def _solo_group(self) -> Any | None:
        """A process group of this rank alone, under torch.distributed (Lightning saves from
        global rank 0 only, so the save must not wait for the others); None without it."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        if self._solo is None:
            self._solo = dist.new_group(
                [dist.get_rank()], backend="gloo", use_local_synchronization=True
            )
        return self._solo


class _ResumedSampler(Sampler[Any]):
    """The loader's sampler, passing over the samples a checkpoint's epoch had consumed, on
    the first pass only; its length, ``set_epoch`` and later passes are the sampler's."""

    def __init__(self, inner: Any, skip: int) -> None:
        self.inner = inner
        self.skip = skip

    def __iter__(self) -> Iterator[Any]:
        skip, self.skip = self.skip, 0
        return itertools.islice(iter(self.inner), skip, None)

    def __len__(self) -> int:
        return len(self.inner)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.inner, "set_epoch"):
            self.inner.set_epoch(epoch)


class BatonCallback(Callback):
    """Restore, periodic saves and preemption notices for ``Trainer.fit`` (see the module doc).

    Needs ``plugins=[BatonCheckpointIO()]`` and ``enable_checkpointing=False`` (no
    ``ModelCheckpoint``: its ``*.ckpt`` files and top-k bookkeeping are not Baton steps).

    Args:
        uri: checkpoint root (path, ``file://``, ``s3://``); default ``$BATON_CHECKPOINT_URI``.
        every_n_steps: save every that many optimizer steps (``trainer.global_step``); default
            ``$BATON_EVERY_STEPS``, else only on notices.
        resume: restore the newest complete step under ``uri`` when ``fit`` starts. Leave
            ``trainer.fit(ckpt_path=...)`` unset with it: an explicit path would be loaded
            instead.
        exit_on_notice: after a notice's save, exit with 75 once every rank has committed.
        deadline_margin: seconds kept free before a notice's deadline (storage retries stop
            there).
        timeout: bound on each collective, in seconds.
    """

    def __init__(
        self,
        uri: str | os.PathLike[str] | None = None,
        *,
        every_n_steps: int | None = None,
        resume: bool = True,
        exit_on_notice: bool = True,
        deadline_margin: float = 5.0,
        timeout: float = 600.0,
    ) -> None:
        self.uri = os.fspath(uri) if uri is not None else None
        every = every_n_steps if every_n_steps is not None else env_number("BATON_EVERY_STEPS", int)
        if every is not None and every < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every}")
        self.every_n_steps = every
        self.resume = resume
        self.exit_on_notice = exit_on_notice
        self.deadline_margin = deadline_margin
        self.timeout = timeout
        self.notices: BatonNotices | None = None
        """The run's notice server, from ``setup`` to ``teardown``."""
        self.restored_step: int | None = None
        """The step ``fit`` resumed from, or None."""
        self._root = ""
        self._last_step = -1
        self._position: tuple[int, int] = (0, 0)
        self._loaded_position: tuple[int, int] | None = None
        self._buckets: list[list[int]] | None = None
        self._loaded_buckets: list[list[int]] | None = None
        self._async: AsyncCheckpointIO | None = None
        """Lightning's ``AsyncCheckpointIO`` around the plugin: periodic saves in its thread."""

    # ---- Lightning's hooks, in the order fit calls them ------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        _check_trainer(trainer)
        where = self.uri if self.uri is not None else os.environ.get("BATON_CHECKPOINT_URI")
        if where is None:
            raise IntegrationError(
                "BatonCallback needs a checkpoint uri: pass BatonCallback(uri=...), or set "
                "BATON_CHECKPOINT_URI"
            )
        # After the strategy's setup_environment (the process group exists), before Lightning
        # restores a checkpoint and installs its own SIGTERM handler.
        notices = BatonNotices(
            where, exit_on_notice=False,  # the exit is _exit_after_notice's
            deadline_margin=self.deadline_margin, timeout=self.timeout,
            memory_tier=False,  # nothing here snapshots: no tier thread, no gloo group for it
        )  # fmt: skip
        self.notices = notices
        if notices.fast_ignored and trainer.local_rank == 0:  # once per pod
            ignored = notices.fast_ignored
            log.warning(_NO_SNAPSHOTS, " and ".join(ignored), "are" if len(ignored) > 1 else "is")
        if notices.board.sigterm is not None:
            # Off until on_train_start: Lightning installs its handler in between and puts
            # back what it found at its teardown, which must be the handler from before Baton.
            notices.board.sigterm.uninstall()
        self._root = notices.storage.uri.rstrip("/")
        self._last_step = -1
        io = trainer.strategy.checkpoint_io
        self._async = io if isinstance(io, AsyncCheckpointIO) else None
        if self._async is not None:
            assert isinstance(self._async.checkpoint_io, BatonCheckpointIO)  # _check_trainer
            self._async.checkpoint_io.reporter = notices.status
        if not self.resume:
            return
        chosen = _catalog.newest_complete(notices.storage) if notices.rank == 0 else None
        if notices.group is not None:
            chosen = broadcast_json(
                chosen, group=notices.group, timeout=self.timeout, what="choosing the step to load"
            )
        if chosen is None:
            return
        step = int(chosen)
        # Lightning's own restore path: its _run then restores the module, callbacks (ours:
        # the data position), optimizers, schedulers and loops from this dict, as for a
        # ckpt_path (whose resume_start, called with None, keeps what is loaded here).
        trainer._checkpoint_connector.resume_start(f"{self._root}/{step_dir(step)}")
        self.restored_step = step
        self._last_step = step
        notices.status.update(
            last_committed_step=step, restored_step=step, restored_tier=Tier.DURABLE.value
        )
        log.info("rank %d: resuming from step %d of %s", notices.rank, step, self._root)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        notices = self.notices
        if notices is None:
            return
        # Lightning's _SignalConnector has just installed its own handler: Baton's replaces it.
        if notices.board.sigterm is not None:
            notices.board.sigterm.reclaim()
        buckets, self._loaded_buckets = self._loaded_buckets, None
        if buckets:  # before the first step: DDP's layout as the saved run had it (_ddp.py)
            _ddp.apply_bucket_layout(trainer.strategy.model, buckets)
        loader = _train_loader(trainer)
        position, self._loaded_position = self._loaded_position, None
        if position is None:
            return
        epoch, batches = position
        if trainer.current_epoch != epoch or batches >= len(loader):
            return  # saved at an epoch's end: the next epoch starts afresh
        batch_sampler = loader.batch_sampler
        assert isinstance(batch_sampler, BatchSampler)  # _train_loader checked it
        inner = batch_sampler.sampler
        if isinstance(inner, _ResumedSampler):
            inner = inner.inner
        if hasattr(inner, "set_epoch"):
            inner.set_epoch(epoch)  # before the first index is drawn
        batch_sampler.sampler = _ResumedSampler(inner, batches * batch_sampler.batch_size)
        # The epoch's iterator was made in setup_data; a loader with workers may already have
        # drawn indices from the old sampler: make it again, from the resumed one.
        fetcher = trainer.fit_loop._data_fetcher
        if fetcher is not None:
            iter(fetcher)
        log.info("epoch %d resumes after %d batches (no sample replayed)", epoch, batches)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        notices = self.notices
        step = trainer.global_step
        if notices is None or step == self._last_step:
            return  # mid-accumulation: not an optimizer step boundary
        self._last_step = step
        self._position = (trainer.current_epoch, batch_idx + 1)
        every = self.every_n_steps
        if not notices.should_save(step, periodic=every is not None and step % every == 0):
            return
        path = f"{self._root}/{step_dir(step)}"
        # Every rank, at the same step: it may run DDP's pending bucket rebuild (a collective).
        self._buckets = _ddp.bucket_layout(trainer.strategy.model)

        notice = notices.notice_agreed
        if self._async is not None:
            if not notice:
                self._save_async(trainer, notices, path, step)
                return
            self._drain(notices)  # an earlier periodic save still in the thread goes first

        def write(trigger: Trigger) -> None:
            trainer.save_checkpoint(
                path, storage_options={"trigger": str(trigger), "attempt": notices.attempt}
            )
            if self._async is not None:
                self._committed_everywhere(notices)

        notices.save_with(write, step)
        if notice and self.exit_on_notice:
            self._exit_after_notice(trainer, notices)

    def _save_async(self, trainer: pl.Trainer, notices: BatonNotices, path: str, step: int) -> None:
        """A periodic save under ``AsyncCheckpointIO``: Lightning snapshots the dict on the
        training thread and rank 0's writer thread commits it; that thread reports the commit
        (only rank 0 writes, and only it knows when the step is committed: the other ranks
        report nothing for it, rather than a commit they cannot see)."""
        if notices.rank == 0:
            notices.status.update(state=State.SAVING, step=step, trigger=Trigger.PERIODIC)
        trainer.save_checkpoint(
            path,
            storage_options={
                "trigger": str(Trigger.PERIODIC), "attempt": notices.attempt, "report": True,
            },
        )  # fmt: skip

    def _drain(self, notices: BatonNotices) -> None:
        """Rank 0 waits for the writes still in ``AsyncCheckpointIO``'s thread before a notice
        save; a failed one is logged (its own status said so), not allowed to stop the notice
        save."""
        if notices.rank != 0 or self._async is None:
            return
        try:
            self._async.teardown()  # waits; raises a queued save's error (it makes a new pool)
        except Exception as e:
            log.warning("an earlier async save failed (%s); saving the notice's step anyway", e)
            self._async._error = None

    def _committed_everywhere(self, notices: BatonNotices) -> None:
        """After a notice save went to ``AsyncCheckpointIO``: rank 0 waits for its thread to
        commit, and every rank learns whether it did before any reports the commit."""
        error: BaseException | None = None
        if notices.rank == 0 and self._async is not None:
            try:
                self._async.teardown()
            except Exception as e:
                error = e
                self._async._error = None
        failed = all_reduce_max([1.0 if error else 0.0], group=notices.group)[0]
        if error is not None:
            raise error
        if failed:
            raise IntegrationError("rank 0 could not commit the notice's save (see its log)")

    def _exit_after_notice(self, trainer: pl.Trainer, notices: BatonNotices) -> NoReturn:
        """Exit with 75 once every rank has committed and reported (as ``BatonNotices`` does
        with ``exit_on_notice``), with SIGTERM ignored from here on: under torchrun the first
        worker to exit makes the agent SIGTERM the others, which must not turn their 75 into
        -15 while Lightning tears down. Lightning puts back the handler it found at fit start
        during that teardown, so it is told to put back the ignoring one."""
        if notices.group is not None:
            all_reduce_max([0.0], group=notices.group)
        self._close()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        originals = getattr(trainer._signal_connector, "_original_handlers", None)
        if isinstance(originals, dict) and signal.SIGTERM in originals:
            originals[signal.SIGTERM] = signal.SIG_IGN
        sys.exit(EXIT_STOPPED_AFTER_NOTICE)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._close()  # Lightning skips the teardown hooks when fit raises

    def _close(self) -> None:
        notices, self.notices = self.notices, None
        if notices is not None:
            notices.close()

    # ---- the callback's own state: where the epoch stood -----------------------------------------

    def state_dict(self) -> dict[str, Any]:
        epoch, batches = self._position
        # DDP's gradient bucket layout: with 3+ ranks the all-reduce's sums depend on it, and a
        # resumed DDP would reduce its first step with the initial one (trainer_sdk/loop/_ddp.py).
        return {"epoch": epoch, "batches": batches, "ddp_buckets": self._buckets}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded_position = (int(state_dict["epoch"]), int(state_dict["batches"]))
        buckets = state_dict.get("ddp_buckets")
        self._loaded_buckets = [[int(i) for i in b] for b in buckets] if buckets else None


def _check_trainer(trainer: pl.Trainer) -> None:
    problems: list[str] = []
    io: Any = trainer.strategy.checkpoint_io
    if isinstance(io, AsyncCheckpointIO):
        io = io.checkpoint_io  # periodic saves in its thread (BatonCallback._save_async)
    if not isinstance(io, BatonCheckpointIO):
        problems.append(
            "its checkpoints are not Baton's: add plugins=[BatonCheckpointIO()] to Trainer(...)"
        )
    if any(isinstance(cb, ModelCheckpoint) for cb in trainer.checkpoint_callbacks):
        problems.append(
            "a ModelCheckpoint writes *.ckpt files beside Baton's steps (and Lightning adds one "
            "by default): set Trainer(enable_checkpointing=False); BatonCallback saves "
            "(every_n_steps) and keeps the steps"
        )
    if problems:
        raise IntegrationError("BatonCallback cannot run this Trainer: " + "; ".join(problems))


def _train_loader(trainer: pl.Trainer) -> DataLoader[Any]:
    """The one training DataLoader, refused when its position cannot be resumed exactly."""
    loader = trainer.train_dataloader
    if isinstance(loader, (list, tuple)) and len(loader) == 1:
        loader = loader[0]
    if not isinstance(loader, DataLoader):
        raise IntegrationError(
            f"the training data is a {type(loader).__name__}, not one DataLoader: BatonCallback "
            "resumes the position of a single torch DataLoader; combine the datasets into one"
        )
    if isinstance(loader.dataset, IterableDataset):
        raise IntegrationError(
            "the training DataLoader reads an IterableDataset, which has no position to save: "
            "a resume would replay or skip samples; use a map-style dataset"
        )
    batch_sampler = loader.batch_sampler
    if type(batch_sampler) is not BatchSampler or not isinstance(batch_sampler.batch_size, int):
        raise IntegrationError(
            "the training DataLoader has no plain BatchSampler (batch_size=None or a custom "
            "batch_sampler): BatonCallback resumes mid-epoch by passing over whole batches of "
            "the sampler; build the loader with batch_size= and a sampler"
        )
    return loader
