"""What a training loop's checkpoint holds, and how a loaded one is put back.

The :class:`~trainer_sdk.checkpointer.Checkpointer` saves one state dict per step; this module
builds it from the user's objects and applies a loaded one to them: model and optimizer
through ``torch.distributed.checkpoint.state_dict`` (plain modules, DDP, FSDP2), the
scheduler, the dataloader's Stateful part, ``extra`` objects, every RNG stream of the rank (as
``RankLocal``), and Baton's own record (step, world size, declared accumulation, DDP bucket
layout). Applying it checks the resume rules that need the saved values (accumulation, world
size and torch version changes) and restores the RNG last. See ``docs/checkpointer.md``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader

from trainer_sdk import rng
from trainer_sdk.errors import CheckpointError
from trainer_sdk.format._types import RankLocal, Stateful
from trainer_sdk.format.layout import Manifest
from trainer_sdk.loop import _ddp
from trainer_sdk.sampler import find_sampler
from trainer_sdk.saveload._loading import LoadInfo, torch_dtype

__all__ = ["ResumeError", "TrainingState"]

log = logging.getLogger("trainer_sdk.checkpointer")


class ResumeError(CheckpointError):
    """``restore()`` could not resume as asked (a setting differs from the checkpoint, or
    ``BATON_RESUME_STEP`` names a step that cannot be loaded and ``resume_fallback`` is off)."""


class TrainingState:
    """The user's objects, as one checkpointable state dict per step.

    Built once (a dataloader without a resumable state is refused here, at start-up, not at
    the first save). ``world_size``, ``rank`` and ``accumulation_steps`` are recorded in (and
    checked against) Baton's part of the state.
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        scheduler: Any | None,
        dataloader: Any | None,
        extra: Mapping[str, Any] | None,
        rank: int,
        world_size: int,
        accumulation_steps: int | None,
    ) -> None:
        if optimizer is not None and model is None:
            raise CheckpointError(
                "optimizer given without model: pass model= too (optimizer state is keyed by "
                "the model's parameter names)"
            )
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.dataloader = dataloader
        self.extra = extra
        self.rank = rank
        self.world_size = world_size
        self.accumulation_steps = accumulation_steps
        self._loader_state = _loader_state(dataloader) if dataloader is not None else None

    def build(self, step: int) -> dict[str, Any]:
        """The state dict of ``step``: a save flattens it, a load fills it in place."""
        state: dict[str, Any] = {}
        if self.model is not None:
            from torch.distributed.checkpoint.state_dict import (
                get_model_state_dict,
                get_state_dict,
            )

            if self.optimizer is not None:
                model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
                state["model"] = model_sd
                state["optimizer"] = optim_sd
            else:
                state["model"] = get_model_state_dict(self.model)
        if self.scheduler is not None:
            state["scheduler"] = _stateful(self.scheduler, "scheduler")
        if self.dataloader is not None:
            state["dataloader"] = self._loader_state
        if self.extra:
            state["extra"] = dict(self.extra)
        state["rng"] = RankLocal(_pack_rng(rng.capture()))
        state["baton"] = {
            "step": step,
            "world_size": self.world_size,
            "accumulation_steps": self.accumulation_steps,
        }
        return state

    def lay_out_optimizer(self, manifest: Manifest) -> bool:
        """Give an optimizer without state (a fresh process about to resume) the tensors
        ``manifest`` saved for it, uninitialised, so that the load fills them.

        Without this, ``torch.distributed.checkpoint.state_dict`` creates the state by running
        the optimizer once on zero gradients (``_init_optim_state``): a whole optimizer step of
        compute (Adam: several passes over every parameter) and the allocations, only for the
        load to overwrite every value; on 2 cores that was 0.4 s of a 0.7 s restore. Here the
        same tensors are allocated from the saved shapes and dtypes and nothing is computed;
        the load fills them and ``load_state_dict`` then takes the saved state whole (its
        non-tensor values too), exactly as after the zero step.

        Only where the mapping is certain: a ``torch.optim`` optimizer, parameters that are
        plain tensors (no DTensor, no FSDP1 flat parameter), every parameter's name found
        among the checkpoint's ``model.`` keys. Otherwise (and when the checkpoint has no
        optimizer state) nothing is done and the zero step runs as before. Returns whether
        the state was laid out. Tensors the shape of their parameter go on its device, others
        (Adam's ``step``, any 0-d value) on the CPU: ``load_state_dict`` moves every value
        where the optimizer keeps it, as it does after the zero step.
        """
        optim = self.optimizer
        if optim is None or self.model is None or optim.state:
            return False
        if not type(optim).__module__.startswith("torch.optim"):
            return False
        names = _param_names(self.model)
        if names is None:
            return False
        prefix = "optimizer.state."
        saved: dict[str, dict[str, Any]] = {}
        for key, entry in manifest.tensors.items():
            if key.startswith(prefix) and entry.kind == "replicated":
                fqn, _, name = key[len(prefix) :].rpartition(".")
                saved.setdefault(fqn, {})[name] = entry
        if not saved:
            return False
        params = [p for g in optim.param_groups for p in g["params"]]
        if any(
            id(p) not in names or f"model.{names[id(p)]}" not in manifest.tensors for p in params
        ):
            return False
        for p in params:
            for name, entry in saved.get(names[id(p)], {}).items():
                shape = tuple(entry.shape)
                on_param = shape == tuple(p.shape) and len(shape) > 0
                device = p.device if on_param else torch.device("cpu")
                optim.state[p][name] = torch.empty(
                    shape, dtype=torch_dtype(entry.dtype), device=device
                )
        return True

    def forget_laid_out(self) -> None:
        """Drop a laid-out optimizer state that no load filled (the load failed before
        :meth:`apply`), so that the next try starts from no state, as the first did."""
        if self.optimizer is not None:
            self.optimizer.state.clear()

    def for_save(self, step: int) -> dict[str, Any]:
        """:meth:`build`, plus what only saves carry (not the load template, so that
        checkpoints without it stay loadable): the DDP bucket layout."""
        state = self.build(step)
        layout = _ddp.bucket_layout(self.model)
        if layout is not None:
            state["baton"]["ddp_buckets"] = layout
        return state

    def apply(self, state: dict[str, Any], info: LoadInfo, step: int) -> dict[str, Any] | None:
        """Put a loaded ``state`` (from :meth:`build`, filled by a load) back into the objects.

        Raises :class:`ResumeError` if the declared accumulation differs from the saved one.
        Returns what the manifest of the next save records about this resume (a world size
        change), or None.
        """
        note: dict[str, Any] | None = None
        if info.resharded:
            log.warning(
                "step %d was saved by %d ranks and is loaded by %d: the data order continues "
                "without skips or repeats, but the run is not bitwise equal to one that kept "
                "its world size (recorded in the manifest of the next save)",
                step,
                info.saved_world_size,
                self.world_size,
            )
            note = {
                "resumed_from_step": step,
                "saved_world_size": info.saved_world_size,
                "world_size": self.world_size,
            }
        saved_torch = _major_minor(info.saved_torch_version)
        if saved_torch != _major_minor(str(torch.__version__)):
            log.warning(
                "step %d was saved with torch %s and is loaded with torch %s: optimizer and "
                "RNG state formats may differ between minor versions, and kernels may round "
                "differently, so the resumed run may not be bitwise equal",
                step,
                info.saved_torch_version,
                torch.__version__,
            )
        meta = state["baton"]
        # Undeclared means 1 (no accumulation) on both sides, so that a run that forgets to
        # declare its setting is refused too: stored and compared, never assumed.
        saved_accum = meta.get("accumulation_steps") or 1
        accum = self.accumulation_steps or 1
        if saved_accum != accum:
            declared = (
                f"declares accumulation_steps={accum}"
                if self.accumulation_steps is not None
                else "does not declare accumulation_steps (which means 1)"
            )
            raise ResumeError(
                f"checkpoint step {step} was trained with accumulation_steps={saved_accum}, "
                f"this run {declared}: resume with accumulation_steps={saved_accum}, or start "
                "a new run under another uri"
            )
        if self.model is not None:
            from torch.distributed.checkpoint.state_dict import (
                set_model_state_dict,
                set_state_dict,
            )

            if self.optimizer is not None:
                set_state_dict(
                    self.model,
                    self.optimizer,
                    model_state_dict=state["model"],
                    optim_state_dict=state["optimizer"],
                )
            else:
                set_model_state_dict(self.model, state["model"])
        if self.model is not None and meta.get("ddp_buckets"):
            # The first step after the resume must sum gradients in the same bucket positions
            # as the uninterrupted run did at that step (see trainer_sdk/loop/_ddp.py).
            _ddp.apply_bucket_layout(self.model, meta["ddp_buckets"])
        # RNG last: nothing after this may draw random numbers before training resumes.
        if any(p == "rng" or p.startswith("rng.") for p in info.missing_rank_local):
            # A rank that did not exist at save time: a deterministic state of its own,
            # derived from the step, so that a rerun of this resume draws the same numbers.
            log.info("rank %d has no saved RNG state; deriving one from step %d", self.rank, step)
            rng.restore(rng.derive(step, self.rank))
        else:
            rng.restore(_unpack_rng(state["rng"].value))
        return note


def _pack_rng(captured: dict[str, Any]) -> dict[str, Any]:
    """Python's Mersenne Twister state (625 ints) as one int64 tensor instead of a JSON list.

    Same values, but one tensor entry instead of 625 JSON leaves, which the flattening walk
    would visit one by one on every save (it is on the blocking path of an async save).
    """
    py = captured.get("python")
    if isinstance(py, dict) and isinstance(py.get("state"), list):
        captured = {
            **captured,
            "python": {**py, "state": torch.tensor(py["state"], dtype=torch.int64)},
        }
    return captured


def _unpack_rng(saved: dict[str, Any]) -> dict[str, Any]:
    py = saved.get("python")
    if isinstance(py, dict) and isinstance(py.get("state"), torch.Tensor):
        saved = {**saved, "python": {**py, "state": [int(x) for x in py["state"].tolist()]}}
    return saved


def _param_names(model: torch.nn.Module) -> dict[int, str] | None:
    """``id(parameter)`` -> the name ``torch.distributed.checkpoint.state_dict`` saves it
    under: ``named_parameters`` without the wrappers' own level (DDP's ``module``,
    ``torch.compile``'s ``_orig_mod``); None where parameters are not plain tensors (DTensor,
    FSDP1's flat parameters). A wrapper this does not know leaves a name the checkpoint
    lacks, which the caller checks."""
    wrapped = {
        prefix
        for prefix, m in model.named_modules()
        if isinstance(m, torch.nn.parallel.DistributedDataParallel)
        or type(m).__name__ == "OptimizedModule"
    }
    names: dict[int, str] = {}
    for name, p in model.named_parameters():
        if type(p) not in (torch.nn.Parameter, torch.Tensor):
            return None
        parts = name.split(".")
        kept = [
            part
            for i, part in enumerate(parts)
            if not (part in ("module", "_orig_mod") and ".".join(parts[:i]) in wrapped)
        ]
        names[id(p)] = ".".join(kept)
    return names


def _major_minor(version: str) -> tuple[str, ...]:
    """("2", "13") of "2.13.0+cpu": the part of a torch version that changes formats."""
    return tuple(version.split("+", maxsplit=1)[0].split(".")[:2])


def _stateful(obj: Any, what: str) -> Any:
    if not isinstance(obj, Stateful):
        raise CheckpointError(
            f"{what} of type {type(obj).__name__} has no state_dict()/load_state_dict(): "
            "pass an object that has both"
        )
    return obj


def _loader_state(loader: Any) -> Any:
    """The Stateful part of a dataloader: itself, else its sampler or batch sampler's sampler."""
    if isinstance(loader, Stateful):
        return loader
    if isinstance(loader, DataLoader):
        # find_sampler also tells the sampler whether workers prefetch ahead of the loop.
        sampler = find_sampler(loader)
        if sampler is not None:
            return sampler
    for candidate in (
        getattr(loader, "sampler", None),
        getattr(getattr(loader, "batch_sampler", None), "sampler", None),
        getattr(loader, "batch_sampler", None),
    ):
        if isinstance(candidate, Stateful):
            return candidate
    raise CheckpointError(
        f"dataloader of type {type(loader).__name__} has no resumable state: build it with "
        "sampler=trainer_sdk.ResumableSampler(...) (or pass any object with "
        "state_dict()/load_state_dict())"
    )
