"""``BatonNotices``: SIGTERM and the sidecar's requests for a loop that saves through DCP (see
the package docstring)."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import state_dict_loader as dcp_load
from torch.distributed.checkpoint import state_dict_saver as dcp_save
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner

from trainer_sdk import _catalog
from trainer_sdk._collectives import all_reduce_max, broadcast_json, release_group
from trainer_sdk._config import env_number
from trainer_sdk._deadline import deadline_scope
from trainer_sdk._notices import announce_notice
from trainer_sdk._status import StatusReporter
from trainer_sdk.control import ControlChannel
from trainer_sdk.errors import CheckpointError
from trainer_sdk.integrations.dcp.reader import BatonLoadPlanner, BatonReader
from trainer_sdk.integrations.dcp.writer import BatonWriter
from trainer_sdk.layout import step_dir
from trainer_sdk.signals import (
    Agreement,
    ControlPoller,
    LocalNotice,
    NoticeBoard,
    SigtermListener,
    agree,
)
from trainer_sdk.storage import Location, open_storage
from trainer_sdk.wire import EXIT_STOPPED_AFTER_NOTICE, State, Tier, Trigger

__all__ = ["BatonNotices"]

log = logging.getLogger("trainer_sdk.checkpointer")


class BatonNotices:
    """Preemption notices for a loop that saves through DCP (see the module docstring).

    Build it on every rank, on the main thread (the SIGTERM handler), after
    ``init_process_group``; it creates a gloo group of its own for the agreement, registers
    this run's attempt in the checkpoint's fence (``$BATON_ATTEMPT``, else a new generation)
    and reports to the sidecar through ``$BATON_CONTROL_DIR`` when it is set. ``uri`` defaults
    to ``$BATON_CHECKPOINT_URI``. Call :meth:`close` at the end (or use it as a context).
    """

    def __init__(
        self,
        uri: Location | None = None,
        *,
        exit_on_notice: bool = True,
        deadline_margin: float = 5.0,
        timeout: float = 600.0,
    ) -> None:
        where = uri if uri is not None else os.environ.get("BATON_CHECKPOINT_URI")
        if where is None:
            raise CheckpointError(
                "BatonNotices needs a checkpoint uri: pass one, or set BATON_CHECKPOINT_URI"
            )
        self.storage = open_storage(where)
        self.exit_on_notice = exit_on_notice
        self.deadline_margin = deadline_margin
        self.timeout = timeout
        initialized = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if initialized else 0
        self.world_size = dist.get_world_size() if initialized else 1
        self.group: Any | None = (
            dist.new_group(backend="gloo") if initialized and self.world_size > 1 else None
        )
        local_rank = env_number("LOCAL_RANK", int) or 0
        control_dir = os.environ.get("BATON_CONTROL_DIR")
        channel = ControlChannel(control_dir) if control_dir else None
        self._sigterm = SigtermListener()
        self._sigterm.install()
        poller = ControlPoller(channel) if channel is not None and local_rank == 0 else None
        self.board = NoticeBoard(sigterm=self._sigterm, poller=poller)
        self.status = StatusReporter(
            channel,
            local_rank=local_rank,
            local_world_size=env_number("LOCAL_WORLD_SIZE", int) or 1,
        )
        self.attempt = self._register_attempt()
        self._notice: tuple[LocalNotice, Agreement] | None = None
        self._closed = False

    def _register_attempt(self) -> int:
        attempt: Any = None
        error: str | None = None
        if self.rank == 0:
            try:
                attempt = _catalog.register_attempt(self.storage, env_number("BATON_ATTEMPT", int))
            except Exception as e:
                if self.group is None:
                    raise
                error = f"{type(e).__name__}: {e}"
        if self.group is not None:
            attempt, error = broadcast_json(
                [attempt, error], group=self.group, timeout=self.timeout,
                what="registering the attempt",
            )  # fmt: skip
        if error is not None:
            raise CheckpointError(f"rank 0 could not register this run's attempt: {error}")
        return int(attempt)

    def __enter__(self) -> BatonNotices:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def resume(self, state: dict[str, Any], *, planner: LoadPlanner | None = None) -> int | None:
        """Load the newest complete step into ``state`` with ``dcp.load`` (every rank; rank 0
        chooses the step) and report it; the step loaded, or None when there is none."""
        chosen = _catalog.newest_complete(self.storage) if self.rank == 0 else None
        if self.group is not None:
            chosen = broadcast_json(
                chosen, group=self.group, timeout=self.timeout, what="choosing the step to load"
            )
        if chosen is None:
            return None
        step = int(chosen)
        dcp_load.load(
            state,
            storage_reader=BatonReader(self.storage, step=step),
            planner=planner if planner is not None else BatonLoadPlanner(),
        )
        self.status.update(
            last_committed_step=step, restored_step=step, restored_tier=Tier.DURABLE.value
        )
        log.info("rank %d: resumed from step %d of %s", self.rank, step, self.storage.uri)
        return step

    def should_save(self, step: int, *, periodic: bool = False) -> bool:
        """Whether to save ``step`` now: a notice some rank heard (agreed by every rank), or
        ``periodic``. Call it on every rank at every step boundary (it is a collective)."""
        self.status.heartbeat(step)
        local = self.board.local()
        agreement = agree(local, rank=self.rank, group=self.group)
        if not agreement.notice:
            self._notice = None
            return periodic
        self._notice = (local, agreement)
        announce_notice(self.status, rank=self.rank, step=step, local=local, agreement=agreement)
        return True

    @property
    def notice_agreed(self) -> bool:
        """Whether the last :meth:`should_save` agreed on a notice that the next save serves."""
        return self._notice is not None

    def save(self, state: dict[str, Any], step: int, *, planner: SavePlanner | None = None) -> None:
        """``dcp.save`` of ``state`` as ``step`` through a :class:`BatonWriter` (every rank),
        reported to the sidecar. After a notice save, with ``exit_on_notice``, the process
        exits with 75 once every rank has committed."""

        def write(trigger: Trigger) -> None:
            writer = BatonWriter(self.storage, step=step, attempt=self.attempt, trigger=trigger)
            dcp_save.save(state, storage_writer=writer, planner=planner)

        self.save_with(write, step)

    def save_with(self, write: Callable[[Trigger], None], step: int) -> None:
        """Save ``step`` by calling ``write(trigger)`` on every rank, as :meth:`save` does
        with ``dcp.save``: the status reports around it, the notice's deadline on storage
        retries, and after a notice save (with ``exit_on_notice``) exit 75 once every rank
        has committed. ``write`` commits the step under :attr:`storage` (for a framework
        whose own save path writes the Baton step, such as Lightning's ``CheckpointIO``)."""
        notice = self._notice
        trigger = Trigger.PERIODIC if notice is None else notice[1].trigger
        deadline = None if notice is None else notice[1].deadline
        t0 = time.perf_counter()
        self.status.update(state=State.SAVING, step=step, trigger=trigger)
        try:
            with deadline_scope(None if deadline is None else deadline - self.deadline_margin):
                write(trigger)
        except BaseException as e:
            self.status.update(
                state=State.FAILED, error=f"{type(e).__name__}: {e}", **self._served()
            )
            raise
        seconds = time.perf_counter() - t0
        self.status.update(
            state=State.COMMITTED, seconds=seconds,
            uri=f"{self.storage.uri}/{step_dir(step)}", last_committed_step=step,
            tier=Tier.DURABLE.value, **self._served(),
        )  # fmt: skip
        if notice is None:
            return
        log.warning(
            "rank %d: emergency checkpoint of step %d committed in %.2fs", self.rank, step, seconds
        )
        if self.exit_on_notice:
            # No rank exits before every rank has reported the commit: under torchrun the
            # first worker to exit makes the agent SIGTERM the others, which must not cut off
            # a local rank's report to the sidecar.
            if self.group is not None:
                all_reduce_max([0.0], group=self.group)
            self.close()
            sys.exit(EXIT_STOPPED_AFTER_NOTICE)

    def _served(self) -> dict[str, Any]:
        """Forget the notice just served; a control request that came during its save is
        answered by the same outcome (see ``NoticeServer``)."""
        if self._notice is None:
            return {}
        local, _ = self._notice
        self._notice = None
        self.board.served(local)
        late = self.board.late_request(local)
        return {} if late is None else {"request_id": late.id}

    def close(self) -> None:
        """Put the previous SIGTERM handler back and destroy the agreement group."""
        if self._closed:
            return
        self._closed = True
        self._sigterm.uninstall()
        group, self.group = self.group, None
        release_group(group)
