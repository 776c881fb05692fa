"""Baton as torchtitan's checkpoint manager.

torchtitan (0.3) builds its checkpoint manager from ``Trainer.Config.checkpoint``, any
``BaseCheckpointManager.Config``: ``config.checkpoint.build(dataloader=..., model_parts=...,
optimizers=..., lr_schedulers=..., states={"train_state": trainer}, sd_adapter=...,
base_folder=...)``. :class:`BatonCheckpointManager` is one, so a run saves through Baton by
choosing its config::

    from trainer_sdk.integrations.torchtitan import BatonCheckpointManager
    config.checkpoint = BatonCheckpointManager.Config(enable=True, interval=500, keep_latest_k=3)

What it saves, under ``$BATON_CHECKPOINT_URI`` (else ``<dump_folder>/<folder>``): the model
parts (FSDP2/DTensor shards written by their owners, so any world size can load them), the
optimizers and LR schedulers (torchtitan's containers, keyed by parameter name), the train
state (step, tokens seen), the dataloader's position, and every RNG stream of every rank
(torchtitan's own DCP checkpoints keep none). No pickle: torchtitan's dataloader pickles its
state in ``state_dict()``; Baton saves the unpickled state instead.

Notices (SIGTERM, the sidecar's requests) are served at the ``save()`` that torchtitan calls
after every step: every rank saves the same step, then the process exits with the
Checkpointer's ``exit_code`` (75, EX_TEMPFAIL, the operator's "checkpointed on notice" status;
76 when the save committed to the memory tier, which restarts the trainer in place) unless
``exit_on_notice=False``.

What torchtitan 0.3 makes impossible, and why (also in ``docs/integrations.md``):

* Its dataloader (``ParallelAwareDataloader`` over HF datasets) keeps one stream position per
  data-parallel rank, over a dataset split by rank; the positions of N ranks say nothing
  about where M ranks should be (torchtitan#850). At another world size the manager therefore
  refuses, or with ``dataloader_on_reshard="restart"`` starts the data stream afresh (samples
  repeat). Model, optimizer, LR schedule and step reshard exactly.
* Its ``Trainer`` cannot run on a CPU-only machine: it picks CUDA when no accelerator is
  present (``torchtitan.tools.utils.get_device_info``: ``_get_available_device_type() or
  "cuda"``, then ``torch.cuda.set_device`` in ``Trainer.__init__``), none of its
  language-model attention backends trains on a CPU (flex: no CPU backward in torch; varlen:
  CUDA flash attention; sdpa: refused), and its memory monitor needs a device module with
  memory statistics. Baton's tests drive torchtitan's own model, containers, dataloader and
  this manager with a loop that makes ``Trainer.train``'s calls in its order.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any, Final, Literal

from torchdata.stateful_dataloader import StatefulDataLoader
from torchtitan.components.checkpointer import (
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    BaseCheckpointManager,
    ModelWrapper,
)
from torchtitan.components.dataloader import ParallelAwareDataloader

from trainer_sdk.checkpointer import Checkpointer
from trainer_sdk.format._types import RankLocal
from trainer_sdk.integrations import IntegrationError
from trainer_sdk.wire import EXIT_STOPPED_AFTER_NOTICE, Trigger

__all__ = ["EXIT_ON_NOTICE", "BatonCheckpointManager"]

log = logging.getLogger("trainer_sdk.integrations.torchtitan")

EXIT_ON_NOTICE: Final = EXIT_STOPPED_AFTER_NOTICE
"""Exit status after a notice was checkpointed (EX_TEMPFAIL, the SDK's
``EXIT_STOPPED_AFTER_NOTICE``): the operator reschedules."""
_KEEP_ALL: Final = 2**31 - 1  # keep_latest_k=0 means "keep every checkpoint"


class BatonCheckpointManager(BaseCheckpointManager):  # type: ignore[misc]  # untyped (Any)
    """torchtitan's checkpoint contract, served by a :class:`~trainer_sdk.Checkpointer`.

    torchtitan calls, on every rank: ``load(step=-1)`` once before training, ``save(step,
    last_step)`` after every step, ``maybe_wait_for_staging()`` before each optimizer step,
    ``close()`` at the end. ``interval`` is ``every_steps``; ``keep_latest_k`` is
    ``keep_last`` (0: keep all).
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):  # type: ignore[misc]
        initial_load_model_only: bool = False
        """Unused (no ``initial_load_path``); False, so that torchtitan does not warn."""

        uri: str | None = None
        """Checkpoint root (path, ``file://``, ``s3://``); default ``$BATON_CHECKPOINT_URI``,
        else ``<dump_folder>/<folder>``."""

        exit_on_notice: bool = True
        """After a notice is checkpointed, exit the process with the Checkpointer's
        ``exit_code`` (75; 76 after a memory-tier commit). False: ``save()``
        returns and :attr:`BatonCheckpointManager.preempted` is set; the caller stops."""

        async_save: bool = False
        """Periodic saves stage on the training thread and write in the background."""

        every_seconds: float | None = None
        """Also save when this many seconds passed since the last save."""

        dataloader_on_reshard: Literal["refuse", "restart"] = "refuse"
        """At another data-parallel size the dataloader's per-rank positions cannot be
        mapped (see the module doc): refuse to resume, or restart the data stream."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            problems = []
            if self.last_save_in_hf:
                problems.append(
                    "last_save_in_hf: export the final step with trainer_sdk.export_hf "
                    "(prefix 'extra.model.') instead"
                )
            if self.initial_load_path:
                problems.append(
                    "initial_load_path: DCP checkpoints are read with pickle; load the "
                    "weights into the model before training, or export them to a Baton "
                    "checkpoint with trainer_sdk.save"
                )
            if self.exclude_from_loading:
                problems.append(
                    "exclude_from_loading: a Baton resume restores the whole state, so that "
                    "it is exact; start a new run under another uri to drop a part"
                )
            if self.load_step != -1:
                problems.append(
                    f"load_step={self.load_step}: Baton resumes from the newest complete "
                    "step (the operator checks it against BATON_RESUME_STEP); delete newer "
                    "steps with trainer_sdk.delete_step to go back"
                )
            if problems:
                raise IntegrationError(
                    "BatonCheckpointManager cannot honour: " + "; ".join(problems)
                )

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any | None,
        model_parts: list[Any],
        optimizers: Any,
        lr_schedulers: Any,
        states: Mapping[str, Any],
        sd_adapter: Any | None = None,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.save_future = None
        self.config = config
        self.preempted = False
        """True after a notice was checkpointed (with ``exit_on_notice=False``)."""
        uri = (
            config.uri
            or os.environ.get("BATON_CHECKPOINT_URI")
            or os.path.join(base_folder, config.folder)
        )
        extra: dict[str, Any] = {
            MODEL: ModelWrapper(model_parts),
            OPTIMIZER: optimizers,
            LR_SCHEDULER: lr_schedulers,
            **states,
        }
        self._loader = (
            _DataloaderState(dataloader, on_reshard=config.dataloader_on_reshard)
            if dataloader is not None
            else None
        )
        self.checkpointer = Checkpointer(
            uri,
            dataloader=self._loader,
            extra=extra,
            every_steps=None if config.load_only else config.interval,
            every_seconds=None if config.load_only else config.every_seconds,
            keep_last=config.keep_latest_k or _KEEP_ALL,
            async_save=config.async_save,
        )

    def __del__(self) -> None:
        self.close()

    def _load(self, step: int = -1) -> bool:
        return self.checkpointer.restore() > 0

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if self.checkpointer.step(curr_step):
            self.preempted = True
            if self.config.exit_on_notice:
                code = self.checkpointer.exit_code
                log.warning("step %d checkpointed on notice: exiting %d", curr_step, code)
                self._close()
                raise SystemExit(code)
            return True
        if self.config.load_only:
            return False
        due = last_step or (curr_step == 1 and self.config.enable_first_step_checkpoint)
        if due and self.checkpointer.last_committed_step != curr_step:
            self.checkpointer.save(curr_step, trigger=Trigger.PERIODIC)
            return True
        return False

    def _maybe_wait_for_staging(self) -> None:
        # Staging (the copy of the state) happens inside save(), on the training thread,
        # before save() returns: the optimizer step can never overwrite what is being saved.
        return

    def _wait_for_saving(self) -> None:
        self.checkpointer.wait()

    def _close(self) -> None:
        checkpointer = getattr(self, "checkpointer", None)
        if checkpointer is not None:
            checkpointer.close()


class _DataloaderState:
    """torchtitan's dataloader position, without pickle, and refused at another world size.

    ``ParallelAwareDataloader.state_dict()`` pickles ``StatefulDataLoader``'s state; the state
    underneath is plain data, saved here as it is, per rank (it differs on every rank).
    """

    def __init__(self, loader: Any, *, on_reshard: str) -> None:
        self.loader = loader
        self.on_reshard = on_reshard

    def _world(self) -> int:
        return int(getattr(self.loader, "dp_world_size", 1))

    def state_dict(self) -> dict[str, Any]:
        if isinstance(self.loader, ParallelAwareDataloader):
            inner = StatefulDataLoader.state_dict(self.loader)
        else:
            inner = self.loader.state_dict()
        return {"dp_world_size": self._world(), "position": RankLocal(inner)}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        saved = int(state_dict["dp_world_size"])
        if saved != self._world():
            msg = (
                f"the checkpoint's dataloader positions are per rank of {saved} data-parallel "
                f"ranks, this run has {self._world()}: torchtitan's dataloader splits the "
                "dataset by rank, so those positions cannot be mapped onto other ranks "
                "(torchtitan#850)"
            )
            if self.on_reshard != "restart":
                raise IntegrationError(
                    f"{msg}. Resume with {saved} data-parallel ranks, or set "
                    "dataloader_on_reshard='restart' to start the data stream afresh "
                    "(samples already seen will be seen again)"
                )
            log.warning("%s; restarting the data stream as configured", msg)
            return
        position = state_dict["position"]
        if isinstance(position, RankLocal):
            position = position.value
        if isinstance(self.loader, ParallelAwareDataloader):
            StatefulDataLoader.load_state_dict(self.loader, position)
        else:
            self.loader.load_state_dict(position)
