"""Hugging Face ``Trainer`` runs whose checkpoints are Baton checkpoints.

A stock script changes two lines (``docs/integrations.md`` has the whole diff)::

    from trainer_sdk.integrations.transformers import BatonTrainer
    trainer = BatonTrainer(model=model, args=args, train_dataset=ds)   # was: Trainer(...)
    trainer.train()                       # resumes by itself from the newest Baton checkpoint
    if trainer.preempted:
        sys.exit(trainer.exit_code)       # a notice was served: 75 (76 after a memory-tier save)

Any ``Trainer`` subclass (TRL's ``SFTTrainer``, ``DPOTrainer``; Axolotl's trainer) gets the
same through :func:`baton_trainer` (``baton_trainer(SFTTrainer)(...)``), which puts
:class:`BatonTrainerMixin` first among its bases; :class:`BatonTrainer` is the plain case.
SIGTERM has one owner: ``TrainingArguments(enable_jit_checkpoint=True)`` (transformers' own
SIGTERM save) is refused before the Trainer could install its handler.

What changes underneath, hook by hook (``transformers`` is pinned; these are the Trainer's own
extension points, read from its source):

* ``get_train_dataloader`` builds the loader on a :class:`~trainer_sdk.ResumableSampler`
  (shuffled by ``data_seed``/``seed``, split over the ranks), iterated through
  :meth:`~trainer_sdk.ResumableSampler.track` so the saved position is what the loop consumed,
  and not passed through ``accelerator.prepare`` (whose batch sharding would split it again).
* ``_prepare_for_training`` (after the model, optimizer and scheduler exist) builds a
  :class:`~trainer_sdk.Checkpointer` over model, optimizer, LR scheduler, grad scaler, sampler,
  the ``TrainerState`` and the loss accumulators (and a PEFT model's ``peft_config``, written
  for ``export-hf --adapter`` and never read back), and restores the newest complete step.
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

Why one module of this size: the hooks above, the refusals of settings and subclasses that
would break them, and the progress state they save only make sense read together, against
one pinned ``transformers``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from collections.abc import Iterator, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any, Final

import torch
import transformers.trainer as hf_trainer
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler
from transformers import Trainer
from transformers.trainer_utils import seed_worker

from trainer_sdk import rng
from trainer_sdk.checkpointer import Checkpointer
from trainer_sdk.format._types import RankLocal
from trainer_sdk.hf import PEFT_CONFIG_KEY as _PEFT_CONFIG
from trainer_sdk.hf import peft_config_doc
from trainer_sdk.integrations import IntegrationError
from trainer_sdk.sampler import ResumableSampler
from trainer_sdk.wire import Trigger

__all__ = ["BatonTrainer", "BatonTrainerMixin", "baton_trainer"]

log = logging.getLogger("trainer_sdk.integrations.transformers")

_RESUMED: Final = "baton-resumed-checkpoint"
"""Stands for ``resume_from_checkpoint`` inside the Trainer's resumed-epoch code path: it makes
the Trainer keep its counters where the checkpoint left them, and it reaches
:meth:`BatonTrainer._load_rng_state`, which recognises it. No file is read from it."""
_SUBDIR: Final = "baton"
_THIS_RUN: Final = frozenset(
    {"max_steps", "num_train_epochs", "trial_params", "is_local_process_zero",
     "is_world_process_zero"}
)  # fmt: skip
"""``TrainerState`` fields the restored state does not overwrite: the Trainer's own resume sets
them from this run after loading ``trainer_state.json`` (``init_training_references``), so a
resumed run with a larger ``max_steps`` trains up to it."""


if TYPE_CHECKING:
    _TrainerBase = Trainer  # the mixin's super() calls are the Trainer's
else:
    _TrainerBase = object


class BatonTrainerMixin(_TrainerBase):  # type: ignore[misc,valid-type]  # Trainer is Any
    """Baton's checkpoints, resumes and preemptions for any ``transformers.Trainer`` subclass.

    Put it first among the bases (``class MyTrainer(BatonTrainerMixin, SFTTrainer)``), or let
    :func:`baton_trainer` build that class; :class:`BatonTrainer` is the plain ``Trainer`` case.
    Its methods are the Trainer hooks listed in the module doc: placed first in the MRO, they
    run instead of the subclass's versions of the same hooks (TRL's ``_save_checkpoint``, which
    writes a model card into ``checkpoint-N/``, is one), and call the subclass's for
    everything else (its ``compute_loss``, ``training_step``, ``log``, dataset preparation).

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

    baton_progress_attributes: tuple[str, ...] = ("_total_train_tokens", "_metrics")
    """Attributes of a Trainer subclass that carry training progress from step to step, saved
    per rank (as JSON) when the trainer has them and put back on resume, so that the logs of a
    resumed run are the uninterrupted run's. The defaults are TRL's: the running token count
    (logged as ``num_tokens``) and the metrics averaged at the next log. Extend it for a
    subclass with more; values must be JSON (numbers, strings, lists, dicts of those)."""

    def __init__(
        self,
        *args: Any,
        baton_uri: str | os.PathLike[str] | None = None,
        baton_options: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        # Before the Trainer's __init__, which would install the JIT checkpoint's SIGTERM
        # handler (transformers/trainer.py, "8. Callbacks": JITCheckpointCallback.set_trainer).
        _refuse_jit_checkpoint(kwargs["args"] if "args" in kwargs else args[1:2])
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
                f"baton_options sets {clash}, which {type(self).__name__} takes from the "
                "Trainer: drop "
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
        _check_own_sampler(self, dataset)
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
                "BatonTrainerMixin.get_train_dataloader(self)'s loader (or one built the same way)"
            )
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's wrapper
        progress = _TrainerProgress(self)
        extra: dict[str, Any] = {"trainer": progress}
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
        progress.restoring = True
        try:
            step = self.baton.restore()
        finally:
            progress.restoring = False
        if step > 0:
            self._apply_state(progress.loaded_state, step)
            # The streams as restored: put back again where the Trainer would reload its
            # rng_state.pth, so nothing drawn between here and that point counts.
            self._baton_resume = _Resume(
                global_step=step,
                rng=rng.capture(),
                accumulators=progress.loaded_accumulators,
                attributes=progress.loaded_attributes,
            )
        return model, train_dataloader

    def _apply_state(self, saved: Mapping[str, Any], step: int) -> None:
        names = {f.name for f in dataclasses.fields(self.state)}
        for name, value in saved.items():
            if name in names and name not in _THIS_RUN:
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
        for name, value in resume.attributes.items():
            _set_progress(self, name, value)
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


class BatonTrainer(BatonTrainerMixin, Trainer):  # type: ignore[misc]  # Trainer is Any
    """A ``transformers.Trainer`` whose checkpoints, resumes and preemptions go through Baton
    (:class:`BatonTrainerMixin` on the plain ``Trainer``; its arguments are the mixin's)."""


_combined: dict[type, type] = {}


def baton_trainer(base: type[Any]) -> type[Any]:
    """``base`` (a ``transformers.Trainer`` subclass: TRL's ``SFTTrainer``, ``DPOTrainer``, an
    Axolotl trainer...) with Baton's checkpoints, resumes and preemptions.

    Returns the class ``Baton<Name>(BatonTrainerMixin, base)``, built once per ``base``, so
    ``baton_trainer(SFTTrainer)(model=..., args=..., train_dataset=..., baton_uri=...)`` takes
    ``base``'s arguments plus the mixin's. A class that already has the mixin is returned as is.

    Refused: a ``base`` that builds its own training loader (it overrides
    ``get_train_dataloader``, as TRL's ``GRPOTrainer``, ``RLOOTrainer`` and
    ``DistillationTrainer`` do): Baton's resumable loader would replace it without a word, and
    the run would train on other batches than the stock one. A ``base`` that overrides only
    ``_get_train_sampler`` is accepted, and checked when training starts (see
    :meth:`BatonTrainerMixin.get_train_dataloader`).
    """
    if not isinstance(base, type) or not issubclass(base, Trainer):
        raise IntegrationError(
            f"baton_trainer({base!r}): pass a transformers.Trainer subclass (the class, such "
            "as trl.SFTTrainer, not an instance)"
        )
    if issubclass(base, BatonTrainerMixin):
        return base
    combined = _combined.get(base)
    if combined is not None:
        return combined
    if base.get_train_dataloader is not Trainer.get_train_dataloader:
        raise IntegrationError(
            f"{base.__qualname__} overrides get_train_dataloader: it builds its own training "
            "batches, which Baton's resumable loader would replace (the run would train on "
            "other data than without Baton), so Baton cannot resume it exactly; train it with "
            "its own checkpoints, or subclass it so that its batches come from "
            "BatonTrainerMixin.get_train_dataloader"
        )
    combined = type(
        f"Baton{base.__name__}",
        (BatonTrainerMixin, base),
        {
            "__module__": __name__,
            "__qualname__": f"Baton{base.__name__}",
            "__doc__": f"{base.__module__}.{base.__qualname__} with BatonTrainerMixin.",
        },
    )
    _combined[base] = combined
    return combined


# ---- helpers ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _Resume:
    global_step: int
    rng: dict[str, Any]
    accumulators: tuple[torch.Tensor | None, float, int, float]
    attributes: dict[str, Any]


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

    def __init__(self, trainer: BatonTrainerMixin) -> None:
        self._trainer = trainer
        self.loaded_state: dict[str, Any] = {}
        self.loaded_accumulators: tuple[torch.Tensor | None, float, int, float] = (None, 0, 0, 0)
        self.loaded_attributes: dict[str, Any] = {}
        self.restoring = False
        """True while the Checkpointer restores: the PEFT config is left out of the live
        state then (see :func:`_peft_configs`)."""

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
        peft = None if self.restoring else _peft_configs(trainer.model)
        return {
            **({_PEFT_CONFIG: peft} if peft else {}),
            "state": dataclasses.asdict(state),
            "accumulators": RankLocal(
                {
                    "tr_loss": tr_loss.detach().cpu().clone()
                    if tr_loss is not None
                    else torch.zeros(()),
                    "total_loss": float(getattr(trainer, "_total_loss_scalar", 0.0)),
                    "last_logged": int(getattr(trainer, "_globalstep_last_logged", 0)),
                    "flos": float(trainer.current_flos),
                    "attributes": json.dumps(
                        {
                            name: getattr(trainer, name)
                            for name in trainer.baton_progress_attributes
                            if hasattr(trainer, name)
                        }
                    ),
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
            self.loaded_attributes = json.loads(acc.get("attributes", "{}"))


def _peft_configs(model: Any) -> dict[str, Any] | None:
    """``model.peft_config`` of a PEFT model (a ``peft.PeftModel``, or a transformers model
    with adapters loaded), each adapter's config as the JSON of its ``adapter_config.json``;
    None for any other model.

    Saved so that ``export_peft_adapter`` (``export-hf --adapter``) can write the adapter's
    ``adapter_config.json`` from the checkpoint alone. Written for tools and never read back:
    while restoring it is left out of the live state, so a step saved without it (by an older
    Baton, or before the model was wrapped) still restores under strict loading."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, Mapping) or not configs:
        return None
    return {str(name): peft_config_doc(config) for name, config in configs.items()}


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


def _check_own_sampler(trainer: Any, dataset: Any) -> None:
    """Refuse a subclass's own training sampler (Axolotl's multipack for ``sample_packing``,
    KTO's...): the ``ResumableSampler`` takes its place, and would silently change the batches.
    A subclass whose override hands back the Trainer's own choice (a random or sequential
    sampler; Axolotl does without packing or curriculum) is fine: that is what Baton
    replaces with its resumable equivalent."""
    if type(trainer)._get_train_sampler is Trainer._get_train_sampler:
        return
    sampler = trainer._get_train_sampler(dataset)
    if sampler is None or isinstance(sampler, (RandomSampler, SequentialSampler)):
        return
    raise IntegrationError(
        f"{type(trainer).__qualname__}._get_train_sampler chooses a "
        f"{type(sampler).__qualname__}, whose order Baton cannot save and resume (its "
        "ResumableSampler would take its place and train on other batches): turn off the "
        "setting that selects it (sample packing, curriculum or grouped sampling) so that a "
        "random or sequential order is asked for"
    )


def _set_progress(trainer: Any, name: str, value: Any) -> None:
    """Put back a saved progress attribute; a dict is filled in place (TRL's ``_metrics`` holds
    ``defaultdict(list)`` values that its ``compute_loss`` appends to)."""
    current = getattr(trainer, name, None)
    if isinstance(current, dict) and isinstance(value, dict):
        for key, saved in value.items():
            inner = current.get(key)
            if isinstance(inner, dict) and isinstance(saved, dict):
                inner.clear()
                inner.update(saved)
            else:
                current[key] = saved
        return
    setattr(trainer, name, value)


def _is_hf_dataset(dataset: Any) -> bool:
    try:
        import datasets
    except ImportError:
        return False
    return isinstance(dataset, datasets.Dataset)


def _refuse_jit_checkpoint(args: Any) -> None:
    """Refuse ``enable_jit_checkpoint=True``: Baton owns SIGTERM, once.

    transformers' JIT checkpoint (``trainer_jit_checkpoint.py``) installs its own SIGTERM
    handler, and 3 s after a SIGTERM each rank calls ``_save_checkpoint`` at whatever step it
    is on: with Baton that is a collective save that the ranks which got no SIGTERM (or got it
    at another step) never join, so it hangs, or it saves a second time beside Baton's own
    notice save. Baton's SIGTERM handling already does what the flag is for, at a step every
    rank agrees on.
    """
    if isinstance(args, tuple):  # positional: Trainer(model, args, ...)
        args = args[0] if args else None
    if getattr(args, "enable_jit_checkpoint", False):
        raise IntegrationError(
            "enable_jit_checkpoint=True installs transformers' own SIGTERM save, a second one "
            "beside Baton's (which would hang or save twice): set enable_jit_checkpoint=False. "
            "Baton already saves on SIGTERM, at a step every rank agrees on, then stops "
            "training (trainer.preempted, exit with trainer.exit_code)"
        )


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
