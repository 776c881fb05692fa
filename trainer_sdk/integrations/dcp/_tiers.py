"""``BatonNotices``' two tiers: the Checkpointer's own save engine and restorer, with ``dcp.load``.

A DCP loop gets the memory tier the way a ``Checkpointer`` does (``docs/checkpointer.md``, "The
memory tier"), from the same parts rather than a copy of them:
:class:`~trainer_sdk.loop._memory_tier. MemoryTier` writes, commits, replicates and promotes the
snapshots, the :class:`~trainer_sdk.loop._save_engine.SaveEngine` drives it (the attempt, the
promotion and what follows it), and the :class:`~trainer_sdk.loop._restoring.Restorer` chooses the
step (the newest every rank can load, of either tier, with its fallbacks). The one thing that
differs is how a step is loaded: through ``dcp.load`` with a :class:`BatonReader`, so that DCP's
planners reshard as they do for a durable step. A snapshot holds the state the loop hands
:meth:`BatonNotices.snapshot`, flattened by Baton (its tensor keys are DCP's dotted names), so
``BatonReader`` reads it like any Baton step.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint import state_dict_loader as dcp_load
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlanner

from trainer_sdk.integrations.dcp.reader import BatonLoadPlanner, BatonReader
from trainer_sdk.loop._config import CheckpointerConfig
from trainer_sdk.loop._deadline import SaveEstimator
from trainer_sdk.loop._memory_tier import MemoryTier
from trainer_sdk.loop._restoring import Restorer
from trainer_sdk.loop._reuse import Reuse
from trainer_sdk.loop._save_engine import RankParts, SaveEngine
from trainer_sdk.loop._status import StatusReporter
from trainer_sdk.loop._training_state import TrainingState
from trainer_sdk.storage import Storage

__all__ = ["DcpRestorer", "build_engine"]


def build_engine(
    config: CheckpointerConfig,
    *,
    storage: Storage,
    rank: int,
    world_size: int,
    local_rank: int,
    group: Any | None,
    reporter: StatusReporter,
    attempt: int,
) -> tuple[SaveEngine, DcpRestorer]:
    """The save engine and restorer of a DCP loop, built on every rank at the same point (the
    memory tier creates its process group here). The loop's state is DCP's state dict, not
    the Checkpointer's objects, so the engine's own durable saves (``prepare``/``save``) are
    never called: durable steps are written by ``dcp.save`` through a ``BatonWriter``."""
    fast = (
        MemoryTier(
            config.fast_dir,
            every_steps=config.fast_every_steps,
            local_rank=local_rank,
            timeout=config.timeout,
            control_dir=config.control_dir,
        )
        if config.fast_dir
        else None
    )
    parts = RankParts(
        config=config, rank=rank, world_size=world_size, storage=storage, group=group,
        objects=TrainingState(model=None, optimizer=None, scheduler=None, dataloader=None,
                              extra=None, rank=rank, world_size=world_size,
                              accumulation_steps=None),
        fast=fast,
        reuse=Reuse(full_every_steps=1, group=group, timeout=config.timeout.total_seconds()),
        estimator=SaveEstimator(), reporter=reporter,
    )  # fmt: skip
    engine = SaveEngine(parts, saver=None)
    engine.attempt = attempt  # registered by BatonNotices already
    return engine, DcpRestorer(parts, engine=engine)


class DcpRestorer(Restorer):
    """The Checkpointer's restore, loading each candidate step with ``dcp.load``."""

    def __init__(self, parts: RankParts, *, engine: SaveEngine) -> None:
        super().__init__(parts, engine=engine)
        self.state: dict[str, Any] = {}
        self.planner: LoadPlanner | None = None

    def load_into(self, state: dict[str, Any], planner: LoadPlanner | None) -> int:
        """:meth:`Restorer.restore` into ``state``: the step loaded (0: none)."""
        self.state, self.planner = state, planner
        try:
            return self.restore()
        finally:
            self.state, self.planner = {}, None

    def _load(self, step: int, storage: Storage) -> None:
        try:
            dcp_load.load(
                self.state,
                storage_reader=BatonReader(storage, step=step),
                planner=self.planner if self.planner is not None else BatonLoadPlanner(),
            )
        except CheckpointException as e:
            # DCP gathers every rank's failure into one BaseException; the restorer's verdicts
            # (skip, fall back, stop) are made from the error itself: this rank's, else the
            # first failing rank's.
            failures = e.failures
            rank = self.parts.rank if self.parts.rank in failures else min(failures)
            raise failures[rank][0] from e
