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
from torch.distributed.checkpoint import state_dict_saver as dcp_save
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner

from trainer_sdk import api
from trainer_sdk.control import ControlChannel
from trainer_sdk.errors import CheckpointError
from trainer_sdk.format import _catalog
from trainer_sdk.format.layout import step_dir
from trainer_sdk.format.planning import PlanCache
from trainer_sdk.integrations.dcp._tiers import build_engine
from trainer_sdk.integrations.dcp.writer import BatonWriter
from trainer_sdk.loop._config import CheckpointerConfig, env_number
from trainer_sdk.loop._deadline import choose_tier, deadline_scope
from trainer_sdk.loop._memory_tier import RestoreInfo
from trainer_sdk.loop._notices import announce_notice
from trainer_sdk.loop._status import StatusReporter
from trainer_sdk.loop.signals import (
    Agreement,
    ControlPoller,
    LocalNotice,
    NoticeBoard,
    SigtermListener,
    agree,
)
from trainer_sdk.saveload._collectives import all_reduce_max, broadcast_json, release_group
from trainer_sdk.storage import Location, open_storage
from trainer_sdk.wire import (
    EXIT_RESTART_IN_PLACE,
    EXIT_STOPPED_AFTER_NOTICE,
    State,
    Tier,
    Trigger,
)

__all__ = ["BatonNotices"]

_FAST_VARS = ("BATON_FAST_DIR", "BATON_FAST_EVERY_STEPS")
"""The memory tier's variables (the operator sets both for ``spec.checkpoint.fastEverySteps``)."""

log = logging.getLogger("trainer_sdk.checkpointer")


class BatonNotices:
    """Preemption notices for a loop that saves through DCP (see the module docstring).

    Build it on every rank, on the main thread (the SIGTERM handler), after
    ``init_process_group``; it creates a gloo group of its own for the agreement, registers
    this run's attempt in the checkpoint's fence (``$BATON_ATTEMPT``, else a new generation)
    and reports to the sidecar through ``$BATON_CONTROL_DIR`` when it is set. ``uri`` defaults
    to ``$BATON_CHECKPOINT_URI``. ``fast_dir`` and ``fast_every_steps`` (defaults
    ``$BATON_FAST_DIR`` and ``$BATON_FAST_EVERY_STEPS``) turn on the memory tier, as for a
    ``Checkpointer`` (its process group is created here too): :meth:`snapshot`, and
    :meth:`resume` and notices that consider it (see the package docstring).
    ``memory_tier=False`` says the caller takes no snapshots (Lightning's ``BatonCallback``):
    no memory tier is built (no thread, no process group, nothing written to the fast
    directory), ``$BATON_FAST_DIR``/``$BATON_FAST_EVERY_STEPS`` are ignored and named in
    :attr:`fast_ignored` for the caller to warn about, and resume and notices use the durable
    tier alone. Call :meth:`close` at the end (or use it as a context).
    """

    def __init__(
        self,
        uri: Location | None = None,
        *,
        exit_on_notice: bool = True,
        deadline_margin: float = 5.0,
        timeout: float = 600.0,
        fast_dir: str | os.PathLike[str] | None = None,
        fast_every_steps: int | None = None,
        memory_tier: bool = True,
    ) -> None:
        if not memory_tier and (fast_dir or fast_every_steps is not None):
            raise CheckpointError(
                "BatonNotices(memory_tier=False) takes no snapshots, but fast_dir= or "
                "fast_every_steps= asks for them: drop those arguments, or leave memory_tier on"
            )
        where = uri if uri is not None else os.environ.get("BATON_CHECKPOINT_URI")
        if where is None:
            raise CheckpointError(
                "BatonNotices needs a checkpoint uri: pass one, or set BATON_CHECKPOINT_URI"
            )
        self.storage = open_storage(where)
        # The Checkpointer's settings and their checks, from the same arguments and variables
        # (BATON_FAST_DIR, BATON_FAST_EVERY_STEPS, BATON_CONTROL_DIR), for the parts reused;
        # without the memory tier, as if the fast variables were unset.
        environ: dict[str, str] = dict(os.environ)
        self.fast_ignored: tuple[str, ...] = ()
        """The memory tier's variables set in the environment and ignored because of
        ``memory_tier=False`` (empty otherwise): the caller's cue to warn that the job's
        ``fastEverySteps`` has no effect."""
        if not memory_tier:
            self.fast_ignored = tuple(v for v in _FAST_VARS if environ.get(v, "").strip())
            for var in _FAST_VARS:
                environ.pop(var, None)
        self.config = CheckpointerConfig.from_env(
            environ, uri=self.storage.uri, deadline_margin=deadline_margin, timeout=timeout,
            fast_dir=os.fspath(fast_dir) if fast_dir else None, fast_every_steps=fast_every_steps,
        )  # fmt: skip
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
        control_dir = self.config.control_dir
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
        self._engine, self._restorer = build_engine(
            self.config, storage=self.storage, rank=self.rank, world_size=self.world_size,
            local_rank=local_rank, group=self.group, reporter=self.status, attempt=self.attempt,
        )  # fmt: skip
        self._plans = PlanCache()
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
        """Load the newest step every rank can load into ``state`` with ``dcp.load`` (every
        rank), by the ``Checkpointer``'s rules: durable steps and, with the memory tier, the
        snapshots every rank has, newest first (the snapshot first at the same step); a bad
        step falls back to an older one, a snapshot that cannot be loaded to the next
        candidate of either tier; a snapshot that is not durable yet is promoted in the
        background; ``BATON_RESUME_STEP`` is checked. The step loaded, or None when none."""
        step = self._restorer.load_into(state, planner)
        return None if self._restorer.restored.tier is None else step

    @property
    def restored(self) -> RestoreInfo:
        """What :meth:`resume` loaded: the step, the tier (``"memory"`` or ``"durable"``) and
        the root it was read from (as ``Checkpointer.restored``)."""
        return self._restorer.restored

    @property
    def has_memory_tier(self) -> bool:
        """Whether a memory tier was built (``fast_dir`` set, ``memory_tier`` left on)."""
        return self._engine.fast is not None

    def snapshot_due(self, step: int) -> bool:
        """Whether ``step`` is a memory-tier snapshot step (``step % fast_every_steps == 0``)."""
        fast = self._engine.fast
        return fast is not None and fast.due(step)

    def snapshot(self, state: dict[str, Any], step: int) -> None:
        """Snapshot ``state`` as ``step`` into the memory tier (every rank, at the same step):
        the tensors are copied into the tier's own buffers before it returns, and written,
        committed and replicated in the background, as the ``Checkpointer``'s are. A failed
        snapshot raises :class:`CheckpointError` at the next one."""
        if self._engine.fast is None:
            raise CheckpointError(
                "BatonNotices has no memory tier: pass fast_dir= (or set BATON_FAST_DIR, an "
                "emptyDir with medium: Memory), and leave memory_tier=True"
            )
        self._engine.snapshot(step, self._prepare(state))

    def wait(self) -> None:
        """Wait for the memory tier's snapshot and promotion in flight (every rank); raise a
        failure (as ``Checkpointer.wait``)."""
        self._engine.wait()

    def _prepare(self, state: dict[str, Any]) -> tuple[api.FlatState, api.SavePlan]:
        flat = api.flatten(state)
        return flat, self._plans.plan(flat, self.rank, self.world_size)

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

        # With the memory tier, durable saves are measured: a notice weighs them against it.
        prepared = self._prepare(state) if self._engine.fast is not None else None
        if prepared is not None and self._notice is not None and self._memory_fits(prepared):
            self._commit_to_memory(step, prepared)
            return

        def write(trigger: Trigger) -> None:
            writer = BatonWriter(self.storage, step=step, attempt=self.attempt, trigger=trigger)
            t0 = time.perf_counter()
            dcp_save.save(state, storage_writer=writer, planner=planner)
            if prepared is not None:
                self._engine.parts.estimator.record(prepared[1].nbytes, time.perf_counter() - t0)

        self.save_with(write, step)

    def _memory_fits(self, prepared: tuple[api.FlatState, api.SavePlan]) -> bool:
        """The ``Checkpointer``'s choice of tier for the agreed notice (``choose_tier``, on the
        slowest rank's estimates and rank 0's clock): True when a durable save would not end
        before the deadline minus the margin and a replicated memory commit would."""
        assert self._notice is not None
        nbytes = prepared[1].nbytes
        estimator = self._engine.parts.estimator
        if not estimator.measured:
            self._engine.probe()
        durable_s, memory_s, now0 = all_reduce_max(
            [
                estimator.estimate(nbytes) or 0.0,
                self._engine.memory_estimate(nbytes),
                time.time() if self.rank == 0 else 0.0,
            ],
            group=self.group,
        )
        deadline = self._notice[1].deadline
        left = None if deadline is None else deadline - self.deadline_margin - now0
        if choose_tier(durable_s=durable_s, memory_s=memory_s, left=left) is not Tier.MEMORY:
            return False
        log.warning(
            "rank %d: a durable save is estimated at %.2fs, the memory tier with its "
            "replication at %.2fs, and %.2fs are left before the deadline minus the margin: "
            "committing to the memory tier, then promoting it",
            self.rank,
            durable_s,
            memory_s,
            left,
        )
        return True

    def _commit_to_memory(self, step: int, prepared: tuple[api.FlatState, api.SavePlan]) -> None:
        """Serve the notice with a memory commit (every rank), then promote it in the
        background; the process exits 76 (75 after a SIGTERM) once :meth:`close` has waited
        for the promotion, as the ``Checkpointer``'s ``exit_code`` says."""
        assert self._notice is not None
        trigger = self._notice[1].trigger

        def commit() -> None:
            if not self._engine.commit_memory(step, prepared):
                self._engine.promote(step)  # it may still become durable before the node goes
                raise CheckpointError(
                    f"the memory snapshot of step {step} committed but was not replicated to a "
                    "peer (see the replication warning above): it would be lost with this node. "
                    "Its promotion to durable storage runs until the process ends"
                )

        seconds = self._reported(step, trigger, commit)
        self.status.update(
            state=State.COMMITTED, seconds=seconds, tier=Tier.MEMORY.value,
            uri=self._engine.snapshot_uri(step), **self._served(),
        )  # fmt: skip
        self._engine.promote(step)  # reported committed first: this may wait
        code = EXIT_RESTART_IN_PLACE if trigger == Trigger.NOTICE else EXIT_STOPPED_AFTER_NOTICE
        self._stop(step, seconds, code)

    def save_with(self, write: Callable[[Trigger], None], step: int) -> None:
        """Save ``step`` by calling ``write(trigger)`` on every rank, as :meth:`save` does
        with ``dcp.save``: the status reports around it, the notice's deadline on storage
        retries, and after a notice save (with ``exit_on_notice``) exit 75 once every rank
        has committed. ``write`` commits the step under :attr:`storage` (for a framework
        whose own save path writes the Baton step, such as Lightning's ``CheckpointIO``)."""
        notice = self._notice
        trigger = Trigger.PERIODIC if notice is None else notice[1].trigger
        deadline = None if notice is None else notice[1].deadline

        def scoped() -> None:
            with deadline_scope(None if deadline is None else deadline - self.deadline_margin):
                write(trigger)

        seconds = self._reported(step, trigger, scoped)
        self.status.update(
            state=State.COMMITTED, seconds=seconds,
            uri=f"{self.storage.uri}/{step_dir(step)}", last_committed_step=step,
            tier=Tier.DURABLE.value, **self._served(),
        )  # fmt: skip
        if notice is not None:
            self._stop(step, seconds, EXIT_STOPPED_AFTER_NOTICE)

    def _reported(self, step: int, trigger: Trigger, work: Callable[[], None]) -> float:
        """Run ``work`` (a save) with the status around it: ``saving``, then ``failed`` with
        the error when it raises; the seconds it took."""
        t0 = time.perf_counter()
        self.status.update(state=State.SAVING, step=step, trigger=trigger)
        try:
            work()
        except BaseException as e:
            self.status.update(
                state=State.FAILED, error=f"{type(e).__name__}: {e}", **self._served()
            )
            raise
        return time.perf_counter() - t0

    def _stop(self, step: int, seconds: float, code: int) -> None:
        """After a notice's commit: exit with ``code`` once every rank has committed (with
        ``exit_on_notice``)."""
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
            sys.exit(code)

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
        """Wait for the memory tier's snapshot and promotion in flight (a failure is logged),
        put the previous SIGTERM handler back and destroy the agreement group."""
        if self._closed:
            return
        self._closed = True
        if self._engine.fast is not None:
            self._engine.fast.close()
        self._sigterm.uninstall()
        group, self.group = self.group, None
        release_group(group)
