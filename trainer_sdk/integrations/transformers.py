"""Hugging Face ``Trainer`` runs whose checkpoints are Baton checkpoints.

A stock script changes two lines (``docs/integrations.md`` has the whole diff)::

    from trainer_sdk.integrations.transformers import BatonTrainer
    trainer = BatonTrainer(model=model, args=args, train_dataset=ds)   # was: Trainer(...)
    trainer.train()                       # resumes by itself from the newest Baton checkpoint
    if trainer.preempted:
        sys.exit(trainer.exit_code)       # a notice was served: 75 (76 after a memory-tier save)

What changes underneath, hook by hook (``transformers`` is pinned; these are the Trainer's own
extension points, read from its source):

* ``get_train_dataloader`` builds the loader on a :class:`~trainer_sdk.ResumableSampler`
  (shuffled by ``data_seed``/``seed``, split over the ranks), iterated through
  :meth:`~trainer_sdk.ResumableSampler.track` so the saved position is what the loop consumed,
  and not passed through ``accelerator.prepare`` (whose batch sharding would split it again).
* ``_prepare_for_training`` (after the model, optimizer and scheduler exist) builds a
  :class:`~trainer_sdk.Checkpointer` over model, optimizer, LR scheduler, grad scaler, sampler,
  the ``TrainerState`` and the loss accumulators, and restores the newest complete step.
* ``_run_epoch``: the resumed epoch runs as the Trainer's own resume does (same step counters,
  same gradient-accumulation boundaries) except that no batch is skipped by iterating: the
  sampler is already at the next sample. Epochs finished before the checkpoint are passed over.
* ``_load_rng_state``: where the Trainer reloads ``rng_state.pth`` after fetching the first
  resumed batch, the RNG streams captured at restore are put back instead.
* ``_save_checkpoint`` (called by the Trainer for ``save_strategy``/``save_steps``) saves a
  Baton step instead of ``checkpoint-N/`` with pickled ``optimizer.pt`` and ``rng_state.pth``.
  ``save_total_limit`` becomes ``keep_last``.
* ``_maybe_log_save_evaluate`` (after each optimizer step's logging) calls
  :meth:`~trainer_sdk.Checkpointer.step`, which serves SIGTERM and the sidecar's requests with
  a save at a step every rank agrees on, then stops training (``preempted`` is True).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator, Mapping
from functools import partial
from typing import Any, Final

import torch
import transformers.trainer as hf_trainer
from torch.utils.data import DataLoader, IterableDataset
from transformers import Trainer
from transformers.trainer_utils import seed_worker

from trainer_sdk import rng
from trainer_sdk._types import RankLocal
from trainer_sdk.checkpointer import Checkpointer
from trainer_sdk.control import Trigger
from trainer_sdk.integrations import IntegrationError
from trainer_sdk.sampler import ResumableSampler

__all__ = ["BatonTrainer"]

log = logging.getLogger("trainer_sdk.integrations.transformers")

_RESUMED: Final = "baton-resumed-checkpoint"
"""Stands for ``resume_from_checkpoint`` inside the Trainer's resumed-epoch code path: it makes
the Trainer keep its counters where the checkpoint left them, and it reaches
:meth:`BatonTrainer._load_rng_state`, which recognises it. No file is read from it."""
_SUBDIR: Final = "baton"


class BatonTrainer(Trainer):  # type: ignore[misc]  # transformers' Trainer is untyped (Any)
    """A ``transformers.Trainer`` whose checkpoints, resumes and preemptions go through Baton.

    Keyword arguments beyond the Trainer's:

    Args:
        baton_uri: checkpoint root (path, ``file://``, ``s3://``); default
            ``$BATON_CHECKPOINT_URI``, else ``<output_dir>/baton``.
        baton_options: more :class:`~trainer_sdk.Checkpointer` keyword arguments
            (``async_save``, ``every_seconds``, ``control_dir``, ``deadline_margin``,
            ``timeout``...). ``model``, ``optimizer``, ``scheduler``, ``dataloader``,
            ``extra``, ``keep_last`` and ``accumulation_steps`` come from the Trainer.

    Saves happen where the Trainer would save (``save_strategy``, ``save_steps``), plus
    ``$BATON_EVERY_STEPS``/``every_seconds`` when set, plus one for every notice.
    ``save_total_limit`` is the number of complete checkpoints kept (default: Baton's, 3).
    After ``train()`` returns, :attr:`preempted` says whether it stopped for a notice.
    """

    def __init__(
        self,
        *args: Any,
        baton_uri: str | os.PathLike[str] | None = None,
        baton_options: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        options = dict(baton_options or {})
        owned = {"model", "optimizer", "scheduler", "dataloader", "extra"} | {
            "keep_last",
            "accumulation_steps",
            "uri",
        }
        clash = sorted(owned & options.keys())
        if clash:
            raise IntegrationError(
                f"baton_options sets {clash}, which BatonTrainer takes from the Trainer: drop "
                "them (keep_last comes from args.save_total_limit, the uri from baton_uri)"
            )
        _check_args(self.args)
        self.baton_uri = (
            os.fspath(baton_uri)
            if baton_uri is not None
            else os.environ.get("BATON_CHECKPOINT_URI")
            or os.path.join(self.args.output_dir or ".", _SUBDIR)
        )
        self.baton_options = options
        self.baton: Checkpointer | None = None
        """The run's Checkpointer, from the start of ``train()`` to its end."""
        self.preempted = False
        """True after ``train()`` stopped because a notice was served (exit with
        :attr:`exit_code` then)."""
        self.exit_code = 0
        """What the script exits with after ``train()``: the Checkpointer's ``exit_code``
        when a notice was served (75, ``EXIT_STOPPED_AFTER_NOTICE``; 76,
        ``EXIT_RESTART_IN_PLACE``, when its save committed to the memory tier), else 0."""
        self._baton_resume: _Resume | None = None
        self._baton_stepped: int | None = None
        self._baton_rng: dict[str, Any] | None = None

    # ---- the run ------------------------------------------------------------------------------

    def train(
        self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any
    ) -> Any:
        """Train, resuming from the newest complete Baton checkpoint under ``baton_uri``.

        ``resume_from_checkpoint`` is refused: the Checkpointer picks the step (and checks the
        operator's ``BATON_RESUME_STEP``), every rank the same one.
        """
        if resume_from_checkpoint not in (None, False):
            raise IntegrationError(
                f"resume_from_checkpoint={resume_from_checkpoint!r}: BatonTrainer resumes by "
                f"itself from the newest complete checkpoint under {self.baton_uri}; call "
                "train() without it (Trainer's checkpoint-N/ folders are not Baton checkpoints)"
            )
        self.preempted = False
        self.exit_code = 0
        try:
            return super().train(None, *args, **kwargs)
        finally:
            baton, self.baton = self.baton, None
            if baton is not None:
                if self.preempted:
                    self.exit_code = baton.exit_code
                baton.close()

    def get_train_dataloader(self) -> _TrackedLoader:
        """The training loader on a :class:`~trainer_sdk.ResumableSampler` (see module doc)."""
        dataset = self.train_dataset
        if dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise IntegrationError(
                "BatonTrainer needs a map-style train_dataset (with __len__ and __getitem__): "
                "an IterableDataset has no position to save, so a resume would replay or skip "
                "data; use a map-style dataset (datasets.Dataset is one)"
            )
        collator = self.data_collator
        if _is_hf_dataset(dataset):
            dataset = self._remove_unused_columns(dataset, description="Training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="Training")
        args = self.args
        sampler = ResumableSampler(
            len(dataset),
            shuffle=args.train_sampling_strategy != "sequential",
            seed=args.data_seed if args.data_seed is not None else args.seed,
            num_replicas=max(1, args.world_size),
            rank=args.process_index,
        )
        loader: DataLoader[Any] = DataLoader(
            dataset,
            batch_size=self._train_batch_size,
            sampler=sampler,
            collate_fn=collator,
            num_workers=args.dataloader_num_workers,
            pin_memory=args.dataloader_pin_memory,
            persistent_workers=args.dataloader_persistent_workers,
            multiprocessing_context=args.dataloader_multiprocessing_context,
            prefetch_factor=args.dataloader_prefetch_factor,
            drop_last=args.dataloader_drop_last,
            worker_init_fn=partial(
                seed_worker, num_workers=args.dataloader_num_workers, rank=args.process_index
            ),
        )
        return _TrackedLoader(loader, sampler)

    def _prepare_for_training(
        self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: Any
    ) -> tuple[Any, Any]:
        model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, None)
        if not isinstance(train_dataloader, _TrackedLoader):
            raise IntegrationError(
                f"the training loader is a {type(train_dataloader).__name__}, not BatonTrainer's: "
                "a subclass that overrides get_train_dataloader must return "
                "BatonTrainer.get_train_dataloader(self)'s loader (or one built the same way)"
            )
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's wrapper
        extra: dict[str, Any] = {"trainer": _TrainerProgress(self)}
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None:
            extra["scaler"] = scaler
        self.baton = Checkpointer(
            self.baton_uri,
            model=self.model,
            optimizer=optimizer,
            scheduler=self.lr_scheduler,
            dataloader=train_dataloader.loader,
            extra=extra,
            keep_last=self.args.save_total_limit,
            accumulation_steps=self.args.gradient_accumulation_steps,
            **self.baton_options,
        )
        self._baton_stepped = None
        step = self.baton.restore()
        if step > 0:
            progress = extra["trainer"]
            self._apply_state(progress.loaded_state, step)
            # The streams as restored: put back again where the Trainer would reload its
            # rng_state.pth, so nothing drawn between here and that point counts.
            self._baton_resume = _Resume(
                global_step=step, rng=rng.capture(), accumulators=progress.loaded_accumulators
            )
        return model, train_dataloader

    def _apply_state(self, saved: Mapping[str, Any], step: int) -> None:
        names = {f.name for f in dataclasses.fields(self.state)}
        for name, value in saved.items():
            if name in names and name not in ("is_local_process_zero", "is_world_process_zero"):
                setattr(self.state, name, value)
        if self.state.global_step != step:
            raise IntegrationError(
                f"checkpoint step {step} holds a TrainerState at global_step "
                f"{self.state.global_step}: the checkpoint was not written by BatonTrainer; "
                "start a new run under another baton_uri"
            )
        self._load_callback_state()

    def _run_epoch(
        self,
        model: Any,
        epoch: int,
        train_dataloader: Any,
        steps_in_epoch: int,
        num_update_steps_per_epoch: int,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        resume = self._baton_resume
        sampler = train_dataloader.sampler
        if resume is None:
            sampler.set_epoch(epoch)  # raises rather than replay an epoch
            return super()._run_epoch(
                model, epoch, train_dataloader, steps_in_epoch, num_update_steps_per_epoch,
                *args, **kwargs,
            )  # fmt: skip
        first_epoch, done = divmod(resume.global_step, num_update_steps_per_epoch)
        if epoch < first_epoch:
            return None  # trained before the checkpoint
        self._baton_resume = None
        batches = done * self.args.gradient_accumulation_steps
        expected = batches * self._train_batch_size * sampler.num_replicas
        if sampler.epoch != epoch or sampler.position != min(expected, len(sampler.global_order())):
            raise IntegrationError(
                f"checkpoint step {resume.global_step} left the sampler at epoch {sampler.epoch}, "
                f"position {sampler.position}, but this run's settings put step "
                f"{resume.global_step} at epoch {epoch}, position {expected}: resume with the "
                "saving run's per_device_train_batch_size, gradient_accumulation_steps, "
                "dataset and world size, or start a new run under another baton_uri"
            )
        tr_loss, total_loss, last_logged, flos = resume.accumulators
        if tr_loss is not None:
            self._tr_loss = tr_loss.to(self.args.device)
            self._total_loss_scalar = total_loss
            self._globalstep_last_logged = last_logged
            self.current_flos = flos
        self._baton_rng = resume.rng
        # The Trainer's own resumed-epoch path, told where the epoch stands, keeps its step
        # counters and accumulation boundaries as the uninterrupted run's; only its skip, which
        # iterates the consumed batches, is left out: the sampler already starts after them.
        kwargs.update(
            resume_from_checkpoint=_RESUMED,
            epochs_trained=epoch,
            steps_trained_in_current_epoch=batches,
        )
        with _no_batch_skipping():
            return super()._run_epoch(
                model, epoch, train_dataloader, steps_in_epoch, num_update_steps_per_epoch,
                *args, **kwargs,
            )  # fmt: skip

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        if checkpoint != _RESUMED:
            raise IntegrationError(
                f"asked to load the Trainer's RNG files from {checkpoint!r}: BatonTrainer "
                "restores RNG streams from its own checkpoints only"
            )
        state, self._baton_rng = self._baton_rng, None
        if state is not None:
            rng.restore(state)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """The Trainer's save (``save_strategy``/``save_steps``), as a Baton step."""
        baton = self.baton
        step = self.state.global_step
        if baton is None or self.preempted or baton.last_committed_step == step:
            return
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        baton.save(step, trigger=Trigger.PERIODIC)

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        super()._maybe_log_save_evaluate(*args, **kwargs)
        baton = self.baton
        step = self.state.global_step
        # Also called at each epoch's end with the step just served: one boundary per step.
        if baton is None or self.preempted or step == self._baton_stepped:
            return
        self._baton_stepped = step
        if baton.step(step):
            log.warning("step %d: checkpoint notice served; stopping training", step)
            self.preempted = True
            self.control.should_training_stop = True


# ---- helpers ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _Resume:
    global_step: int
    rng: dict[str, Any]
    accumulators: tuple[torch.Tensor | None, float, int, float]


class _TrackedLoader:
    """The training DataLoader, iterated through its sampler's ``track`` (which counts what the
    loop consumed, and starts each pass without a draw from the global RNG). Everything else
    is the DataLoader's."""

    def __init__(self, loader: DataLoader[Any], sampler: ResumableSampler) -> None:
        self.loader = loader
        self.sampler = sampler

    def __iter__(self) -> Iterator[Any]:
        return self.sampler.track(self.loader)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


class _TrainerProgress:
    """The Trainer's own progress as Stateful: ``TrainerState`` (JSON) and, per rank, the loss
    and FLOP accumulators that the next log line is computed from."""

    def __init__(self, trainer: BatonTrainer) -> None:
        self._trainer = trainer
        self.loaded_state: dict[str, Any] = {}
        self.loaded_accumulators: tuple[torch.Tensor | None, float, int, float] = (None, 0, 0, 0)

    def state_dict(self) -> dict[str, Any]:
        trainer = self._trainer
        state = trainer.state
        # As the Trainer's own save does: callbacks with state (early stopping...) are kept in
        # TrainerState.stateful_callbacks.
        for cb in [*trainer.callback_handler.callbacks, trainer.control]:
            if isinstance(cb, hf_trainer.ExportableState):
                name = cb.__class__.__name__
                if isinstance(state.stateful_callbacks.get(name), list):
                    state.stateful_callbacks[name].append(cb.state())
                else:
                    state.stateful_callbacks[name] = cb.state()
        tr_loss = getattr(trainer, "_tr_loss", None)
        return {
            "state": dataclasses.asdict(state),
            "accumulators": RankLocal(
                {
                    "tr_loss": tr_loss.detach().cpu().clone()
                    if tr_loss is not None
                    else torch.zeros(()),
                    "total_loss": float(getattr(trainer, "_total_loss_scalar", 0.0)),
                    "last_logged": int(getattr(trainer, "_globalstep_last_logged", 0)),
                    "flos": float(trainer.current_flos),
                }
            ),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.loaded_state = dict(state_dict["state"])
        acc = state_dict.get("accumulators")
        if isinstance(acc, RankLocal):
            acc = acc.value
        if isinstance(acc, Mapping) and isinstance(acc.get("tr_loss"), torch.Tensor):
            self.loaded_accumulators = (
                acc["tr_loss"],
                float(acc["total_loss"]),
                int(acc["last_logged"]),
                float(acc["flos"]),
            )


@contextlib.contextmanager
def _no_batch_skipping() -> Iterator[None]:
    """Make the Trainer's ``skip_first_batches`` (imported into ``transformers.trainer``) hand
    the loader back unchanged, for the one resumed epoch: the sampler already starts after the
    consumed samples, and skipping would iterate (and drop) more."""
    original = hf_trainer.skip_first_batches

    def keep(dataloader: Any, num_batches: int = 0) -> Any:
        return dataloader

    hf_trainer.skip_first_batches = keep
    try:
        yield
    finally:
        hf_trainer.skip_first_batches = original


def _is_hf_dataset(dataset: Any) -> bool:
    try:
        import datasets
    except ImportError:
        return False
    return isinstance(dataset, datasets.Dataset)


def _check_args(args: Any) -> None:
    """Refuse the TrainingArguments whose meaning Baton's checkpoints cannot keep."""
    problems: list[str] = []
    if args.load_best_model_at_end:
        problems.append(
            "load_best_model_at_end=True reloads a Trainer checkpoint-N/ folder at the end: "
            "set it False and export the step you want with trainer_sdk.export_hf"
        )
    if args.deepspeed:
        problems.append(
            "deepspeed: its engine keeps optimizer and ZeRO state outside the module and "
            "optimizer that Baton saves; use DDP or FSDP2 (fsdp='full_shard' with version 2)"
        )
    if args.auto_find_batch_size:
        problems.append(
            "auto_find_batch_size=True changes the batch size after a failure, and with it "
            "what a saved data position means: set per_device_train_batch_size instead"
        )
    if args.train_sampling_strategy not in ("random", "sequential"):
        problems.append(
            f"train_sampling_strategy={args.train_sampling_strategy!r} has no resumable "
            "sampler: use 'random' or 'sequential'"
        )
    if args.save_only_model:
        problems.append(
            "save_only_model=True cannot resume exactly (no optimizer, scheduler or RNG "
            "state): leave it False; export weights alone with trainer_sdk.export_hf"
        )
    if args.ignore_data_skip:
        problems.append(
            "ignore_data_skip=True would restart the epoch's data: leave it False (BatonTrainer "
            "resumes at the next sample without skipping through batches)"
        )
    if problems:
        raise IntegrationError(
            "BatonTrainer cannot honour these TrainingArguments: " + "; ".join(problems)
        )
