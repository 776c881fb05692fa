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
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, Final, TypeVar

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from trainer_sdk import _ddp, api, rng
from trainer_sdk._collectives import all_gather_json, broadcast_json
from trainer_sdk._deadline import SaveEstimator, deadline_scope, probe_write
from trainer_sdk._types import RankLocal, Stateful
from trainer_sdk.control import (
    ROUTINE_TRIGGERS,
    ControlChannel,
    SavePhase,
    State,
    Status,
    Trigger,
)
from trainer_sdk.errors import (
    BatonError,
    CheckpointError,
    UnreadableCheckpointError,
)
from trainer_sdk.layout import step_dir
from trainer_sdk.sampler import find_sampler
from trainer_sdk.signals import (
    Agreement,
    ControlPoller,
    LocalNotice,
    NoticeBoard,
    PendingAgreement,
    SigtermListener,
    agree,
    agree_max,
    agreement_buffer,
    start_agreement,
)
from trainer_sdk.staging import AsyncSaveHandle, AsyncSaver, stage_and_commit
from trainer_sdk.storage import Location, Storage, open_storage

__all__ = ["Checkpointer", "CheckpointerConfig", "ResumeError"]

log = logging.getLogger("trainer_sdk.checkpointer")

_DEFAULT_URI: Final = "./checkpoints"
_HEARTBEAT_EVERY_S: Final = 5.0
_NO_STEP: Final = 10**12  # above every valid step number
_N = TypeVar("_N", int, float)

# Load verdicts, ordered so that the maximum over the ranks is the worst.
_LOAD_OK: Final = 0
_LOAD_SKIP: Final = 1
"""No manifest: the step never committed; silently not a candidate."""
_LOAD_FALL_BACK: Final = 2
"""The checkpoint is bad (checksum, truncation, invalid manifest): WARNING, next older step."""
_LOAD_UNREADABLE: Final = 3
"""It cannot be read now or by this version: raise, never fall back past it."""
_LOAD_FATAL: Final = 4
"""It does not fit this run (shapes, keys, settings): raise ResumeError."""
_VERDICTS: Final = {
    "incomplete": _LOAD_SKIP,
    "bad": _LOAD_FALL_BACK,
    "unreadable": _LOAD_UNREADABLE,
    "other": _LOAD_FATAL,
}


class ResumeError(CheckpointError):
    """``restore()`` could not resume as asked (a setting differs from the checkpoint, or
    ``BATON_RESUME_STEP`` names a step that cannot be loaded and ``resume_fallback`` is off)."""


def _env_number(name: str, kind: type[_N]) -> _N | None:
    """``$name`` parsed as ``kind`` (int or float); None when it is unset or blank."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return kind(raw)
    except ValueError as e:
        fix = (
            "an integer: set it to a whole number" if kind is int else "a number: set it to seconds"
        )
        raise CheckpointError(f"${name}={raw!r} is not {fix}") from e


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class CheckpointerConfig:
    """The resolved policy of a :class:`Checkpointer` (arguments first, then environment)."""

    uri: str
    """Checkpoint root: a path, ``file://...`` or ``s3://...``."""
    every_steps: int | None
    """Save when ``step % every_steps == 0``; ``None``: no step-based saves."""
    every_seconds: float | None
    """Save when this many seconds passed since the last save, by rank 0's clock."""
    keep_last: int
    """Complete checkpoints to keep (>= 1). Older ones are deleted after a newer commit."""
    async_save: bool
    """Periodic saves stage on the caller's thread and write in the background."""
    control_dir: str | None
    """The sidecar's control directory; ``None``: no control channel."""
    handle_sigterm: bool
    """Turn SIGTERM into an emergency save at the next step boundary."""
    notice_every: int
    """Run the notice collective every this many steps (1: every step)."""
    notice_overlap_below: float
    """While step boundaries come less than this many seconds apart, the notice collective
    is overlapped with the next step instead of waited for: a notice is then served one
    boundary later (so at most this much later) and ``step()`` costs microseconds, not a
    round trip to every rank. 1 s: a blocking collective is then under 0.2% of a step, and
    one boundary of delay is small against the shortest notice windows (15-30 s). 0: never
    overlap (a notice is served at the very boundary where it is heard); ``inf``: always."""
    deadline_margin: float
    """Seconds kept free before a deadline; a save that would end later is skipped."""
    timeout: timedelta
    """Bound on every collective the Checkpointer runs; a rank that does not answer fails
    the save with an error instead of hanging."""
    accumulation_steps: int | None
    """Declared gradient-accumulation steps; a resume with another value is refused."""
    resume_fallback: bool
    """When ``BATON_RESUME_STEP`` cannot be loaded: fall back to the newest complete older step
    (True, logged as an error) or raise :class:`ResumeError` (False)."""
    probe_bytes: int
    """Size of the probe write that calibrates the save-time estimate before the first save."""

    def __post_init__(self) -> None:
        if self.every_steps is not None and self.every_steps < 1:
            raise CheckpointError(
                f"every_steps={self.every_steps}: use a positive number or None for no step policy"
            )
        if self.every_seconds is not None and self.every_seconds <= 0:
            raise CheckpointError(
                f"every_seconds={self.every_seconds}: use a positive number or None"
            )
        if self.keep_last < 1:
            raise CheckpointError(
                f"keep_last={self.keep_last}: keep at least 1 (the newest complete checkpoint "
                "is never deleted)"
            )
        if self.notice_every < 1:
            raise CheckpointError(f"notice_every={self.notice_every}: use 1 or more")
        if not self.notice_overlap_below >= 0:  # also refuses NaN
            raise CheckpointError(
                f"notice_overlap_below={self.notice_overlap_below}: use seconds >= 0 "
                "(0 turns the overlap off, float('inf') always overlaps)"
            )
        if self.deadline_margin < 0:
            raise CheckpointError("deadline_margin must be >= 0 seconds")
        if self.accumulation_steps is not None and self.accumulation_steps < 1:
            raise CheckpointError("accumulation_steps must be >= 1 (or None if not declared)")


class Checkpointer:
    """Saves and restores the whole training state; see the module docstring.

    Build it on every rank, on the main thread, after ``init_process_group`` (if any) and
    after building the model, optimizer, scheduler and dataloader.
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
        control_dir: str | None = None,
        handle_sigterm: bool = True,
        notice_every: int = 1,
        notice_overlap_below: float = 1.0,
        deadline_margin: float = 5.0,
        timeout: timedelta | float = timedelta(minutes=10),
        accumulation_steps: int | None = None,
        resume_fallback: bool = True,
        probe_bytes: int = 8 << 20,
    ) -> None:
        if optimizer is not None and model is None:
            raise CheckpointError(
                "optimizer given without model: pass model= too (optimizer state is keyed by "
                "the model's parameter names)"
            )
        storage: Storage | None = None
        if isinstance(uri, Storage):
            storage, resolved = uri, uri.uri
        else:
            resolved = (
                (os.fspath(uri) if uri else None)
                or os.environ.get("BATON_CHECKPOINT_URI")
                or _DEFAULT_URI
            )
        self.config = CheckpointerConfig(
            uri=str(resolved),
            every_steps=every_steps
            if every_steps is not None
            else _env_number("BATON_EVERY_STEPS", int),
            every_seconds=every_seconds
            if every_seconds is not None
            else _env_number("BATON_EVERY_SECONDS", float),
            keep_last=keep_last
            if keep_last is not None
            else (_env_number("BATON_KEEP_LAST", int) or 3),
            async_save=async_save,
            control_dir=control_dir or os.environ.get("BATON_CONTROL_DIR") or None,
            handle_sigterm=handle_sigterm,
            notice_every=notice_every,
            notice_overlap_below=notice_overlap_below,
            deadline_margin=deadline_margin,
            timeout=timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout),
            accumulation_steps=accumulation_steps,
            resume_fallback=resume_fallback,
            probe_bytes=probe_bytes,
        )
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.dataloader = dataloader
        self.extra = extra
        # Checked now, so that a wrong dataloader fails at start-up, not at the first save.
        self._loader_state = _loader_state(dataloader) if dataloader is not None else None
        self.storage: Storage = storage if storage is not None else open_storage(self.config.uri)

        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        # Main-thread checkpoint collectives (agreement, sync saves, restore) get a gloo group
        # of their own: the training group may be NCCL, and must not see extra collectives.
        self._group: Any | None = None
        if self.distributed and self.world_size > 1:
            self._group = dist.new_group(backend="gloo", timeout=self.config.timeout)
        # Built by every rank in the same order: it creates the background save group.
        self._saver: AsyncSaver | None = (
            AsyncSaver(timeout=self.config.timeout) if self.config.async_save else None
        )

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
        # The clock of the every_seconds policy (only rank 0's reading counts); replaceable
        # so that tests can drive time.
        self._clock: Callable[[], float] = time.monotonic
        self._last_save_time = self._clock()
        self._last_saved_step: int | None = None
        self._last_committed: int | None = None
        self._pending: PendingAgreement | None = None
        """The overlapped notice agreement started at the last boundary (every rank has one,
        or none), waited for and acted on at the next."""
        self._last_boundary: float | None = None
        """Rank 0's monotonic clock at the last agreed boundary (identical on every rank)."""
        self._agreement_buffer = agreement_buffer()
        self._attempt: int | None = None
        """This writer's attempt (rank 0 only; set by restore() or the first save)."""
        self._resume_note: dict[str, Any] | None = None
        """What the manifest of the next save records about the resume (world size change)."""
        # Every local rank reports in its own file; the sidecar folds them into one pod status.
        self._status = Status(
            state=State.IDLE,
            local_rank=self.local_rank,
            local_world_size=max(_env_number("LOCAL_WORLD_SIZE", int) or 1, 1),
        )
        self._status_lock = threading.Lock()
        self._last_beat = 0.0
        self._closed = False
        self._write_status(self._status)

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
        expected = _env_number("BATON_RESUME_STEP", int)
        self._register_attempt()
        steps = self._agreed_steps()
        if not self._estimator.measured:
            self._probe()
        loaded: int | None = None
        for candidate in sorted(steps, reverse=True):
            error: BaseException | None = None
            verdict = _LOAD_OK
            try:
                self._load(candidate)
            except ResumeError as e:
                error, verdict = e, _LOAD_FATAL
            except Exception as e:
                error, verdict = e, _VERDICTS[api.classify_load_error(e)]
            verdict, who = self._worst(verdict, candidate)
            if verdict == _LOAD_OK:
                loaded = candidate
                break
            if verdict == _LOAD_SKIP:
                log.debug("step %d has no manifest (a save that never committed)", candidate)
                continue
            if verdict == _LOAD_UNREADABLE:
                if isinstance(error, UnreadableCheckpointError):
                    raise error
                raise UnreadableCheckpointError(
                    f"checkpoint step {candidate} under {self.config.uri} cannot be read now or "
                    f"by this version on rank {who}: "
                    f"{error or 'see that rank' + chr(39) + 's log'}. It was left intact and "
                    "no older step was loaded (that would lose every step since): fix the "
                    "cause and restart",
                    step=candidate,
                ) from error
            if verdict == _LOAD_FATAL:
                # The checkpoint is readable but does not fit this run (other shapes, keys,
                # settings, dataset). An older step would not fit better, and starting from
                # zero would let retention delete the good checkpoints later: stop here.
                if isinstance(error, ResumeError):
                    raise error
                raise ResumeError(
                    f"checkpoint step {candidate} under {self.config.uri} cannot be loaded into "
                    f"this run: {error or f'rank {who} failed to load it (see its log)'}. The "
                    "checkpoint is left intact: build the model, optimizer, scheduler, sampler "
                    "and extra state like the run that saved it, or start a new run under "
                    "another uri"
                ) from error
            log.warning(
                "checkpoint step %d could not be loaded, it is bad (%s); falling back to an "
                "older step (the bad step is kept for inspection)",
                candidate,
                error if error is not None else f"rank {who} failed to load it",
            )
        if expected is not None and (loaded is None or loaded < expected):
            msg = (
                f"BATON_RESUME_STEP={expected} but the newest loadable checkpoint under "
                f"{self.config.uri} is {'none' if loaded is None else f'step {loaded}'}"
            )
            if not self.config.resume_fallback:
                raise ResumeError(
                    f"{msg}: check the storage, or pass resume_fallback=True to resume from the "
                    "newest loadable step"
                )
            log.error("%s; resuming from it instead (steps since it are lost)", msg)
        elif expected is not None and loaded is not None and loaded > expected:
            log.info(
                "BATON_RESUME_STEP=%d but the newer step %d is complete; resuming from it",
                expected,
                loaded,
            )
        if loaded is None:
            log.info("no checkpoint under %s: starting from step 0", self.config.uri)
            return 0
        log.info("resumed from step %d of %s", loaded, self.config.uri)
        self._last_saved_step = loaded
        self._last_committed = loaded
        self._last_save_time = self._clock()
        self._update_status(last_committed_step=loaded)
        return loaded

    def step(self, step: int) -> bool:
        """Call after each optimizer step with the number of optimizer steps done.

        Saves when the policy says so, serves a pending notice with a synchronous save of this
        step on every rank, and raises a background save's failure. Returns True after a
        notice was served (committed or skipped): the caller should stop training.
        """
        self._check_open()
        entered = time.monotonic()
        agreement: Agreement | None = None
        local: LocalNotice | None = None
        overlap = False
        if self._group is None or step % self.config.notice_every == 0:
            pending, self._pending = self._pending, None
            if pending is not None:  # started at the last boundary; ran during this step
                local = pending.local
                agreement = pending.wait(self.config.timeout)
            else:
                local = self._local_notice()
                agreement = agree(local, rank=self.rank, group=self._group)
            overlap = self._group is not None and self._overlap_next(agreement)
        self._heartbeat()
        if agreement is not None and agreement.background_failed:
            self._raise_background_failure()
        if agreement is not None and local is not None and agreement.notice:
            return self._serve_notice(step, local, agreement)
        periodic = (
            self.config.every_steps is not None and step % self.config.every_steps == 0
        ) or (agreement is not None and agreement.periodic_due)
        if periodic and step != self._last_saved_step:
            self._save(step, trigger=Trigger.PERIODIC, background=self.config.async_save)
        if overlap:
            # Last, after any save: what this rank knows now goes to every rank during the
            # next step, and every rank acts on it at the next boundary.
            self._pending = start_agreement(
                self._local_notice(),
                step=step,
                rank=self.rank,
                group=self._group,
                boundary=entered,
                buffer=self._agreement_buffer,
            )
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
        return self._last_committed

    def wait(self) -> None:
        """Wait for a background save in flight; raise its failure."""
        if self._saver is not None:
            self._drain()

    def close(self) -> None:
        """Drain the background save (raising its failure) and restore the SIGTERM handler."""
        if self._closed:
            return
        self._closed = True
        try:
            self._settle_agreement(on_close=True)
            if self._saver is not None:
                try:
                    self._drain()
                finally:
                    self._saver.close()
        finally:
            if self._sigterm is not None:
                self._sigterm.uninstall()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- state ----------------------------------------------------------------------------

    def _state(self, step: int) -> dict[str, Any]:
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
            "accumulation_steps": self.config.accumulation_steps,
        }
        return state

    def _load(self, step: int) -> None:
        state = self._state(step)
        info = api.load(
            state,
            self.storage.uri,
            step=step,
            process_group=self._group,
            timeout=self.config.timeout.total_seconds(),
        )
        if info.resharded:
            log.warning(
                "step %d was saved by %d ranks and is loaded by %d: the data order continues "
                "without skips or repeats, but the run is not bitwise equal to one that kept "
                "its world size (recorded in the manifest of the next save)",
                step,
                info.saved_world_size,
                self.world_size,
            )
            self._resume_note = {
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
        accum = self.config.accumulation_steps or 1
        if saved_accum != accum:
            declared = (
                f"declares accumulation_steps={accum}"
                if self.config.accumulation_steps is not None
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
            # as the uninterrupted run did at that step (see trainer_sdk/_ddp.py).
            _ddp.apply_bucket_layout(self.model, meta["ddp_buckets"])
        # RNG last: nothing after this may draw random numbers before training resumes.
        if any(p == "rng" or p.startswith("rng.") for p in info.missing_rank_local):
            # A rank that did not exist at save time: a deterministic state of its own,
            # derived from the step, so that a rerun of this resume draws the same numbers.
            log.info("rank %d has no saved RNG state; deriving one from step %d", self.rank, step)
            rng.restore(rng.derive(step, self.rank))
        else:
            rng.restore(_unpack_rng(state["rng"].value))

    # ---- saving ---------------------------------------------------------------------------

    def _prepare(self, step: int) -> tuple[api.FlatState, api.SavePlan]:
        state = self._state(step)
        # Only saves carry it (not the load template): checkpoints without it stay loadable.
        layout = _ddp.bucket_layout(self.model)
        if layout is not None:
            state["baton"]["ddp_buckets"] = layout
        flat = api.flatten(state)
        return flat, api.plan_save(flat, self.rank, self.world_size)

    def _save(
        self,
        step: int,
        *,
        trigger: str,
        background: bool,
        prepared: tuple[api.FlatState, api.SavePlan] | None = None,
    ) -> api.SaveInfo | None:
        """Save ``step``; returns what the save did, or None when it runs in the background."""
        # An overlapped agreement finishes before the save's collectives use the same group;
        # its answer is kept and acted on at the next boundary, as planned.
        self._settle_agreement()
        start = time.perf_counter()
        self._last_save_time = self._clock()
        self._last_saved_step = step
        self._register_attempt()
        extra = {"baton": {"resume": self._resume_note}} if self._resume_note else None
        if background:
            assert self._saver is not None
            # At most one save in flight: wait for (and raise the failure of) the previous.
            self._saver.wait_previous()
            flat, plan = prepared or self._prepare(step)
            handle = stage_and_commit(
                self._saver,
                flat,
                plan,
                self.storage,
                step=step,
                trigger=trigger,
                on_commit=self._after_commit,
                attempt=self._attempt,
                extra=extra,
            )
            self._resume_note = None
            log.debug("step %d staged in %.3fs", step, handle.stage_seconds)
            return None
        self._drain()
        flat, plan = prepared or self._prepare(step)
        info = api.write_and_commit(
            self.storage, plan, flat.tensors(), flat.tree, step=step, flat=flat, trigger=trigger,
            process_group=self._group, timeout=self.config.timeout.total_seconds(),
            started=start, attempt=self._attempt, extra=extra,
        )  # fmt: skip
        self._resume_note = None
        self._after_commit(info, plan.nbytes)
        return info

    def _after_commit(self, info: api.SaveInfo, rank_bytes: int) -> None:
        # Runs on the training thread (sync saves) or the worker thread (async saves), after
        # the manifest is written: only now may older checkpoints go.
        self._estimator.record(rank_bytes, info.seconds)
        self._last_committed = info.step
        if self.rank == 0:
            try:
                _retain(
                    self.storage,
                    committed=info.step,
                    keep_last=self.config.keep_last,
                    attempt=self._attempt,
                )
            except Exception as e:  # the step is committed; retention is tidying up only
                log.warning(
                    "step %d is committed, but deleting old checkpoints under %s failed "
                    "(%s: %s); they are kept and retried after the next save",
                    info.step,
                    self.config.uri,
                    type(e).__name__,
                    e,
                )
        if info.trigger in ROUTINE_TRIGGERS:
            # A routine save is a finished save too: the sidecar's duration, phase and bytes
            # metrics (and the dashboards built on them) come from this status. No request
            # id, so neither the sidecar nor the operator takes it for a served notice.
            self._update_status(
                state=State.COMMITTED,
                request_id=None,
                step=info.step,
                trigger=info.trigger,
                deadline=None,
                error=None,
                seconds=info.seconds,
                phases=info.phases,
                bytes=info.bytes,
                uri=self._step_uri(info.step),
                last_committed_step=info.step,
            )
        else:  # emergency saves report through _finish_notice, with their notice's details
            self._update_status(last_committed_step=info.step)

    # ---- the notice agreement ------------------------------------------------------------

    def _local_notice(self) -> LocalNotice:
        handle = self._saver.in_flight if self._saver is not None else None
        due_seconds = (
            self.config.every_seconds is not None
            and self._clock() - self._last_save_time >= self.config.every_seconds
        )
        return self._board.local(
            background_failed=handle is not None and handle.exception() is not None,
            periodic_due=due_seconds,
        )

    def _overlap_next(self, agreement: Agreement) -> bool:
        """Whether to overlap the next agreement with the next step. Decided from agreed
        values only (rank 0's clock), so every rank decides the same."""
        previous, self._last_boundary = self._last_boundary, agreement.rank0_monotonic
        below = self.config.notice_overlap_below
        if below <= 0:
            return False
        return previous is None or agreement.rank0_monotonic - previous < below

    def _settle_agreement(self, *, on_close: bool = False) -> None:
        pending = self._pending
        if pending is None:
            return
        if not on_close:
            pending.wait(self.config.timeout)
            return
        self._pending = None
        try:
            agreement = pending.wait(self.config.timeout)
        except Exception as e:  # closing: the other ranks may be gone; never hang or mask
            log.warning(
                "rank %d: the last notice agreement (step %d) did not finish at close: %s",
                self.rank,
                pending.step,
                e,
            )
            return
        if agreement.notice:
            log.warning(
                "rank %d: a notice (%s) arrived during the last step and was not served: the "
                "Checkpointer was closed first",
                self.rank,
                ", ".join(sorted(agreement.sources)),
            )

    def _drain(self) -> None:
        if self._saver is None:
            return
        self._saver.wait_previous()

    def _raise_background_failure(self) -> None:
        try:
            self._drain()
        except BaseException as e:
            raise CheckpointError(
                f"a background save failed: {e}. The previous complete checkpoint is "
                "unaffected; fix the cause (see the chained error) and restart"
            ) from e
        raise CheckpointError(
            "a background save failed on another rank (see that rank's log); the previous "
            "complete checkpoint is unaffected"
        )

    # ---- notices --------------------------------------------------------------------------

    def _serve_notice(self, step: int, local: LocalNotice, agreement: Agreement) -> bool:
        notice_t = time.perf_counter()
        trigger = agreement.trigger
        deadline_dt = (
            None
            if agreement.deadline is None
            else datetime.fromtimestamp(agreement.deadline, tz=UTC)
        )
        log.warning(
            "rank %d: checkpoint notice (%s) at step %d%s",
            self.rank,
            ", ".join(sorted(agreement.sources)),
            step,
            "" if deadline_dt is None else f", deadline {deadline_dt.isoformat()}",
        )
        self._update_status(
            state=State.REQUESTED,
            request_id=local.control.id if local.control is not None else None,
            step=step,
            trigger=trigger,
            deadline=deadline_dt,
            error=None,
            seconds=None,
            phases={},
            bytes=None,
            uri=None,
        )
        bg_error: BaseException | None = None
        try:
            # An async save in flight finishes first: it is an older, consistent step and
            # commits normally. If it failed, the emergency save still goes ahead, and the
            # failure is raised after it.
            try:
                self._drain()
            except Exception as e:
                bg_error = e
                log.error("the background save before the emergency save failed: %s", e)
            drain_s = time.perf_counter() - notice_t
            if step == self._last_committed:
                # Already committed at this very step (a periodic save just before): done.
                self._finish_notice(local, step, notice_t, {SavePhase.DRAIN: drain_s}, None)
                return self._after_notice(step, bg_error)
            t = time.perf_counter()
            prepared = self._prepare(step)
            nbytes = prepared[1].nbytes
            if not self._estimator.measured:
                self._probe()
            estimate = self._estimator.estimate(nbytes) or 0.0
            # The slowest rank's estimate against rank 0's clock: the same verdict everywhere.
            est_max, now0 = agree_max(
                [estimate, time.time() if self.rank == 0 else 0.0], group=self._group
            )
            plan_s = time.perf_counter() - t
            if agreement.deadline is not None:
                left = agreement.deadline - self.config.deadline_margin - now0
                if est_max > left:
                    reason = (
                        f"skipped: a save of step {step} is estimated at {est_max:.2f}s but only "
                        f"{max(left, 0.0):.2f}s are left before the deadline minus the "
                        f"{self.config.deadline_margin:g}s margin; the job will resume from "
                        + (
                            f"step {self._last_committed}"
                            if self._last_committed is not None
                            else "the start (no checkpoint yet)"
                        )
                    )
                    log.error("%s", reason)
                    self._update_status(
                        state=State.SKIPPED,
                        error=reason,
                        seconds=time.perf_counter() - notice_t,
                        phases={SavePhase.DRAIN: drain_s, SavePhase.PLAN: plan_s},
                    )
                    self._board.served(local)
                    return self._after_notice(step, bg_error)
            self._update_status(state=State.SAVING)
            # Storage retries (S3) never start one that could not end before the margin.
            with deadline_scope(
                None
                if agreement.deadline is None
                else agreement.deadline - self.config.deadline_margin
            ):
                info = self._save(step, trigger=trigger, background=False, prepared=prepared)
            assert info is not None
            phases = {SavePhase.DRAIN: drain_s, SavePhase.PLAN: plan_s, **info.phases}
            self._finish_notice(local, step, notice_t, phases, info.bytes)
        except BaseException as e:
            self._update_status(state=State.FAILED, error=f"{type(e).__name__}: {e}")
            self._board.served(local)
            raise
        return self._after_notice(step, bg_error)

    def _finish_notice(
        self,
        local: LocalNotice,
        step: int,
        notice_t: float,
        phases: dict[str, float],
        total_bytes: int | None,
    ) -> None:
        total = time.perf_counter() - notice_t
        self._update_status(
            state=State.COMMITTED,
            seconds=total,
            uri=self._step_uri(step),
            phases=phases,
            bytes=total_bytes,
            last_committed_step=step,
        )
        self._board.served(local)
        log.warning(
            "rank %d: emergency checkpoint of step %d committed in %.2fs", self.rank, step, total
        )

    def _after_notice(self, step: int, bg_error: BaseException | None) -> bool:
        if bg_error is not None:
            raise CheckpointError(
                f"the notice at step {step} was served, but the background save before it "
                f"failed: {bg_error}"
            ) from bg_error
        return True

    # ---- helpers --------------------------------------------------------------------------

    def _register_attempt(self) -> None:
        """Record this writer's attempt in the fence, once (``BATON_ATTEMPT``, or a generation
        derived from the uri's history outside Kubernetes). Rank 0 registers it and every
        rank learns it (bounded), so that every rank can refuse to write once superseded."""
        if self._attempt is not None:
            return
        attempt: Any = None
        error: str | None = None
        if self.rank == 0:
            try:
                attempt = api.register_attempt(self.storage, _env_number("BATON_ATTEMPT", int))
            except Exception as e:
                if self._group is None:
                    raise
                error = f"{type(e).__name__}: {e}"
        if self._group is not None:
            attempt, error = broadcast_json(
                [attempt, error],
                group=self._group,
                timeout=self.config.timeout.total_seconds(),
                what="registering the attempt",
            )
        if error is not None:
            raise CheckpointError(f"rank 0 could not register this run's attempt: {error}")
        self._attempt = int(attempt)
        if self.rank == 0:
            log.info("writing under %s as attempt %d", self.config.uri, self._attempt)

    def _agreed_steps(self) -> list[int]:
        """Rank 0's list of step directories (complete or not), on every rank; bounded."""
        steps = api.step_dirs(self.storage) if self.rank == 0 else []
        if self._group is None:
            return steps
        return [
            int(s)
            for s in broadcast_json(
                steps,
                group=self._group,
                timeout=self.config.timeout.total_seconds(),
                what="restore: listing the checkpoints",
            )
        ]

    def _worst(self, verdict: int, step: int) -> tuple[int, int]:
        """The worst load verdict of all ranks and the first rank that has it; bounded."""
        if self._group is None:
            return verdict, self.rank
        verdicts = all_gather_json(
            verdict,
            group=self._group,
            timeout=self.config.timeout.total_seconds(),
            what=f"restore: loading step {step}",
        )
        worst = max(int(v) for v in verdicts)
        return worst, next(r for r, v in enumerate(verdicts) if int(v) == worst)

    def _probe(self) -> None:
        try:
            nbytes, seconds = probe_write(
                self.storage, rank=self.rank, nbytes=self.config.probe_bytes
            )
        except (OSError, BatonError) as e:
            log.warning(
                "probe write to %s failed (%s): no save-time estimate yet", self.config.uri, e
            )
            return
        self._estimator.record(nbytes, seconds, probe=True)

    def _step_uri(self, step: int) -> str:
        return f"{self.storage.uri.rstrip('/')}/{step_dir(step)}"

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now - self._last_beat >= _HEARTBEAT_EVERY_S:
            self._last_beat = now
            self._update_status()

    def _update_status(self, *, beat: bool = False, **changes: Any) -> None:
        """Change fields of the status and write it (thread-safe: async commits call it)."""
        with self._status_lock:
            status = dataclasses.replace(self._status, **changes) if changes else self._status
            if changes and "updated" not in changes and "state" in changes:
                status = dataclasses.replace(status, updated=datetime.now(UTC))
            status = status.beat()
            self._status = status
            self._write_status(status)

    def _write_status(self, status: Status) -> None:
        if self._channel is None:
            return
        try:
            self._channel.write_status(status)
        except OSError as e:
            log.warning("could not write a status file in %s: %s", self._channel.directory, e)

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed: build a new one")


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


def _retain(storage: Storage, *, committed: int, keep_last: int, attempt: int | None) -> None:
    """Delete complete steps beyond the newest ``keep_last``, and step directories older than
    ``committed`` that have no manifest object at all (crashed or failed saves).

    Called on rank 0 only after ``committed``'s manifest is written, so the newest complete
    checkpoint is never deleted, and never before its successor is durable. Only steps older
    than ``committed`` are touched: a newer directory may be a save that another rank has
    already started (the next async save), and is not ours to judge. Fencing: if a newer
    attempt than ``attempt`` has started under the uri, nothing is deleted, and a step
    committed by a newer attempt is never deleted.
    """
    if attempt is not None:
        newest = api.newest_attempt(storage)
        if newest > attempt:
            log.warning(
                "attempt %d of this job has started writing under %s: this (stale) attempt %d "
                "deletes nothing there",
                newest,
                storage.uri,
                attempt,
            )
            return
    complete = api.complete_steps(storage)
    keep = set(sorted(complete)[-keep_last:]) | {committed}
    for old, manifest in complete.items():
        if old < committed and old not in keep:
            if attempt is not None and manifest.attempt > attempt:
                continue
            api.delete_step(storage, old)
    for name in api.cleanup_incomplete(storage, older_than=committed):
        log.info("removed incomplete checkpoint directory %s", name)


def _major_minor(version: str) -> tuple[str, ...]:
    """("2", "13") of "2.13.0+cpu": the part of a torch version that changes formats."""
    return tuple(version.split("+", maxsplit=1)[0].split(".")[:2])


def _global_rank0(group: Any) -> int:
    return int(dist.get_global_rank(group, 0))


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
