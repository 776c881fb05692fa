"""Asynchronous saves: copy the state into reusable host buffers, write it in the background.

Training should pay only for a memory copy. :class:`HostBuffers` holds one host copy of every
tensor this rank writes, allocated on the first save and reused by every later one (pinned
when the source is on a GPU, so the device-to-host copies run as DMA on a side stream).
Once the copy is done the caller may change its tensors freely; the background thread writes,
hashes and commits from the buffers.

The copy itself can leave the training thread too (``stage_in_background``): the call returns
at once, a staging thread copies while the next forward and backward run, and the optimizer's
step waits for the copy (a step pre-hook, :meth:`AsyncSaver.wait_staged`). Only tensors that
the optimizer's step alone changes (its parameters and its state) are copied that way; buffers
that a forward changes (BatchNorm's running statistics, DDP's buffer broadcast) are copied in
the call. Version counters catch an in-place change that beats the copy: the save fails
instead of committing bytes of two steps.

Invariants, and why:

* **At most one save in flight.** A new save first waits for the previous one (its buffers are
  being read). So memory is bounded by exactly one staged copy of this rank's share of the
  state, plus the writer's small chunk buffers.
* **Collectives of a background save run on their own gloo process group**, created once by
  every rank at start-up. Running them on the training group from a second thread would
  interleave with the training collectives in a different order on different ranks, which
  deadlocks NCCL and corrupts gloo pairings.
* **The background write yields the CPU to training; its commit does not wait behind it.**
  The write of a save above ``normal_priority_below`` bytes (this rank's share; 16 MiB for the
  Checkpointer and :func:`async_save`) runs on a thread at a lower CPU priority (``nice`` +10
  on Linux, per thread; it hashes what it writes itself), so on a busy machine the
  training step keeps its cores and the write takes what is left. It also leaves disk
  writeback to each file's fsync (``storage.local.write_beside_training``): early writeback
  shortens a save the caller waits for, but slowed the steps beside a background one. The
  commit (the records' all-gather, the manifest, ``latest``) then runs on a thread at normal
  priority, and so does the whole of a smaller save: its write costs a few milliseconds of
  CPU, and at background
  priority on a loaded machine (load 10 on 2 cores) a 4 MiB save took 5.7 s to commit where
  DCP's async save took 0.5 s (``bench/commit_latency.py``). The bound: a save's commit
  never runs at background priority, and neither does any part of a save of at most
  ``normal_priority_below`` bytes. (The priority cannot be raised again once lowered without
  ``CAP_SYS_NICE``, which a restricted pod lacks: hence two threads, not one renice.)
  The 2025 PyTorch DCP work moved its writer into a separate process for the same reason as
  the nice. Here the writer thread takes the GIL back after each 512 KiB piece it hashes and
  writes: beside a compute-bound step that costs nothing measurable, beside a Python-bound
  one (a GPU trainer's launch thread) 2-5 % of the steps that run beside the write
  (``bench/writer_place.py``; docs/performance.md, "The machine's floor"). With
  ``writer_process=True`` the buffers are memfds and a child process writes the shard
  (:mod:`trainer_sdk.saveload._writer_process`; :meth:`AsyncSaver.shard_writer`); the commit
  stays on the normal-priority thread here.
* **Background failures are never lost.** The handle keeps the exception; the
  ``Checkpointer`` raises it at the next ``step()`` or ``close()``, and
  :meth:`AsyncSaveHandle.wait` raises it to direct callers.

Who calls what: the ``Checkpointer`` (or :func:`async_save`) calls :meth:`AsyncSaver.submit` on
every rank at the same step; it returns after staging (or, for deferred tensors, after
starting their copy). The worker thread then calls
``trainer_sdk.api.write_rank`` and ``trainer_sdk.api.commit`` (rank 0 writes the manifest last).
"""

from __future__ import annotations

import atexit
import copy
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Final, Generic, TypeVar

import torch
import torch.distributed as dist

from trainer_sdk import api
from trainer_sdk.errors import CheckpointError
from trainer_sdk.format._safetensors_io import PieceSource, ShardResult, shard_header, shard_result
from trainer_sdk.saveload._collectives import backend_timeout, release_group
from trainer_sdk.saveload._host_buffers import HostBuffers, mark_streams
from trainer_sdk.saveload._saving import PublishRefusedError, ShardWriter
from trainer_sdk.saveload._writer_process import WriterProcess
from trainer_sdk.storage import Location, Storage, open_storage
from trainer_sdk.storage.local import LocalStorage, write_beside_training
from trainer_sdk.wire import Trigger

__all__ = ["AsyncSaveHandle", "AsyncSaver", "HostBuffers", "async_save", "stage_and_commit"]

log = logging.getLogger("trainer_sdk.staging")

T = TypeVar("T")


NORMAL_PRIORITY_BYTES: Final = 16 << 20
"""Saves of at most this many bytes (this rank's share) are written at normal priority by the
Checkpointer and :func:`async_save`: a few milliseconds of CPU, not worth a starved commit."""

BACKGROUND_NICE: Final = 10
"""How much lower (in ``nice`` steps) the background writer runs than the training thread:
at +10 the kernel gives it about a tenth of a core that training also wants, and all of an
idle one."""


def _yield_cpu() -> None:
    """Lower the calling thread's CPU priority (Linux, where ``nice`` is per thread; threads
    it starts inherit it; elsewhere, or if refused, the write runs at normal priority), and
    leave the disk writeback of its files to their fsync (:func:`write_beside_training`)."""
    write_beside_training()
    if sys.platform != "linux":
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE)
    except OSError as e:
        log.info("the background checkpoint writer keeps normal CPU priority: %s", e)


def _version(t: torch.Tensor) -> int | None:
    """The autograd version counter of ``t``: every in-place operation on it (or on a view of
    it) adds one. None for tensors that keep none (created under inference mode)."""
    try:
        return int(t._version)
    except RuntimeError:
        return None


def _check_untouched(
    names: list[str], sources: list[torch.Tensor], before: list[int | None]
) -> None:
    """Raise if a source of a background copy was changed in place while it was copied: the
    staged bytes may then mix two steps, and such a save must never commit."""
    changed = [
        n
        for n, t, v in zip(names, sources, before, strict=True)
        if v is not None and _version(t) != v
    ]
    if changed:
        shown = ", ".join(repr(n) for n in changed[:3]) + (" ..." if len(changed) > 3 else "")
        raise CheckpointError(
            f"{len(changed)} tensor(s) ({shown}) changed in place while this save copied them in "
            "the background, so the save is abandoned (the previous checkpoint stands). Wait "
            "for the copy before changing them: call handle.wait_staged() (or "
            "AsyncSaver.wait_staged()) before the optimizer step; the Checkpointer does it "
            "itself with stage_in_background=True, in a hook on the optimizer's step. Only "
            "tensors that the optimizer's step alone changes may be staged in the background"
        )


@dataclass(kw_only=True)
class AsyncSaveHandle(Generic[T]):
    """A save running in the background. Returned by :func:`async_save` and
    ``Checkpointer.last_save``."""

    step: int
    """The step being saved."""
    staged_bytes: int
    """Bytes this rank staged (and is writing)."""
    stage_seconds: float
    """How long staging blocked the caller."""
    _future: Future[T] = field(repr=False)
    _staged: Future[None] | None = field(default=None, repr=False)
    """The background part of the staging copy; None: all of it was done in the call."""

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the staging copy is complete: from then on the save reads only its
        own buffers, and the saved tensors may change. At once for a save staged wholly in
        the call. Does not raise the save's errors (``wait`` does); raises ``TimeoutError``
        if ``timeout`` seconds pass first."""
        if self._staged is None:
            return
        done, _ = wait_futures([self._staged], timeout)
        if not done:
            raise TimeoutError(f"the staging copy of step {self.step} is still running")

    def done(self) -> bool:
        """Whether the save has finished (committed or failed)."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> T:
        """Block until the save has committed and return its result; raise its error if it
        failed, or ``TimeoutError`` if ``timeout`` seconds pass first."""
        return self._future.result(timeout)

    def exception(self) -> BaseException | None:
        """The error of a finished, failed save; ``None`` while running or after success."""
        if not self._future.done():
            return None
        return self._future.exception()


class AsyncSaver:
    """Stages on the caller's thread, writes and commits on one background thread.

    Build it on every rank at the same point (it creates a process group, collectively, when
    ``torch.distributed`` is initialised). ``timeout`` bounds every collective of the
    background group.
    """

    def __init__(
        self,
        *,
        timeout: timedelta = timedelta(minutes=10),
        normal_priority_below: int = 0,
        writer_process: bool = False,
    ) -> None:
        self.writer: WriterProcess | None = WriterProcess() if writer_process else None
        """The writer process of the background writes to a local filesystem, if asked for
        (:mod:`trainer_sdk.saveload._writer_process`); started by the first such save."""
        self.buffers = HostBuffers(writer=self.writer)
        self.normal_priority_below = normal_priority_below
        """Saves of at most this many staged bytes run wholly at normal priority (0: none)."""
        self.group: Any | None = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # Created now, by every rank in the same order; used only by the worker thread.
            self.group = dist.new_group(backend="gloo", timeout=backend_timeout(timeout))
        self.timeout = timeout
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="baton-ckpt", initializer=_yield_cpu
        )
        self._normal_thread: int | None = None
        self._normal = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="baton-commit", initializer=self._mark_normal
        )
        # The deferred part of a staging copy (submit's ``defer``): normal priority, since the
        # training loop waits for it before its next optimizer step.
        self._stager = ThreadPoolExecutor(max_workers=1, thread_name_prefix="baton-stage")
        self._lock = threading.Lock()
        self._inflight: AsyncSaveHandle[Any] | None = None
        self._closed = False

    @property
    def in_flight(self) -> AsyncSaveHandle[Any] | None:
        """The current or last save's handle."""
        return self._inflight

    def submit(
        self,
        *,
        step: int,
        tensors: Mapping[str, torch.Tensor],
        json_tree: Any,
        work: Callable[[dict[str, torch.Tensor], Any], T],
        defer: Collection[str] = (),
    ) -> AsyncSaveHandle[T]:
        """Stage ``tensors`` (and a deep copy of ``json_tree``), then run ``work`` on them in the
        background. Waits for the previous save first and raises its error, if any.

        The tensors named in ``defer`` are copied on a staging thread after this returns, not
        in the call: until :meth:`AsyncSaveHandle.wait_staged` (or :meth:`wait_staged`)
        returns, the caller must not change them. A change that completes before their copy
        does is caught by their version counters, and the save fails instead of committing
        bytes of two steps (changes through ``.data`` bypass the counters: the caller's
        contract is what keeps those out)."""
        if self._closed:
            raise CheckpointError("this saver is closed: create a new one to save again")
        self.wait_previous()
        start = time.perf_counter()
        pairs = self.buffers.reserve(tensors)
        later = [name for name in pairs if name in defer]
        self.buffers.copy([pair for name, pair in pairs.items() if name not in defer])
        staged_future: Future[None] | None = None
        if later:
            sources = [pairs[name][1] for name in later]
            versions = [_version(t) for t in sources]
            marks = mark_streams(sources)
            copies = [pairs[name] for name in later]

            def copy_later() -> None:
                self.buffers.copy(copies, after=marks)
                _check_untouched(later, sources, versions)

            staged_future = self._stager.submit(copy_later)
            log.debug(
                "step %d: %d of %d tensors copied beside the caller's next steps", step,
                len(later), len(pairs),
            )  # fmt: skip
        staged = {name: dst for name, (dst, _) in pairs.items()}
        tree = copy.deepcopy(json_tree)
        stage_s = time.perf_counter() - start
        nbytes = sum(t.numel() * t.element_size() for t in staged.values())
        pool = self._normal if nbytes <= self.normal_priority_below else self._pool

        def run() -> T:
            if staged_future is not None:
                staged_future.result()  # a failed or torn copy fails the save
            return work(staged, tree)

        handle: AsyncSaveHandle[T] = AsyncSaveHandle(
            step=step, staged_bytes=nbytes, stage_seconds=stage_s, _future=pool.submit(run),
            _staged=staged_future,
        )  # fmt: skip
        with self._lock:
            self._inflight = handle
        return handle

    def wait_staged(self) -> None:
        """Wait until the save in flight, if any, has finished copying the tensors it
        deferred (:meth:`submit`); then they may change. Safe from any thread, and what an
        optimizer's step pre-hook calls."""
        with self._lock:
            handle = self._inflight
        if handle is not None:
            handle.wait_staged()

    def at_normal_priority(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on this saver's normal-priority thread and return its result (at once
        when called there): the commit of a save whose write ran at background priority."""
        if threading.get_ident() == self._normal_thread:
            return fn()  # a small save: already there
        return self._normal.submit(fn).result()

    def _mark_normal(self) -> None:
        self._normal_thread = threading.get_ident()

    def wait_previous(self) -> None:
        """Wait for the save in flight, if any, and raise its error (only once)."""
        with self._lock:
            handle, self._inflight = self._inflight, None
        if handle is not None:
            handle.wait()

    def close(self) -> None:
        """Drain (raising a failure of the last save), stop the worker thread and destroy the
        background group (a gloo group alive at interpreter exit can abort the process:
        :func:`~trainer_sdk.saveload._collectives.release_group`)."""
        if self._closed:
            return
        try:
            self.wait_previous()
        finally:
            self._closed = True
            self._stager.shutdown(wait=True)
            self._pool.shutdown(wait=True)
            self._normal.shutdown(wait=True)
            if self.writer is not None:
                self.writer.close()
            group, self.group = self.group, None
            release_group(group)

    def shard_writer(self, staged_bytes: int) -> ShardWriter | None:
        """What writes the shard of a save of ``staged_bytes`` in the writer process, or None
        for the writing thread: no writer process, or a save small enough for normal priority
        (a few milliseconds of CPU; the round trip would cost more)."""
        if self.writer is None or staged_bytes <= self.normal_priority_below:
            return None
        writer, buffers = self.writer, self.buffers

        def write(
            storage: Storage,
            path: str,
            sources: list[PieceSource],
            *,
            metadata: Mapping[str, str],
            block_size: int,
            guard_key: str,
        ) -> ShardResult | None:
            if type(storage) is not LocalStorage:
                return None  # S3 and wrapped storages keep the thread
            pieces = []
            for src in sources:
                where = buffers.locate(src.tensor)
                if where is None:
                    return None
                arena, base = where
                pieces.append((src.name, arena, base + src.start, src.end - src.start))
            header, rel = shard_header(sources, metadata)
            sums, digest, hash_s, refused = writer.write_shard(
                storage, path, header=header, pieces=pieces, block_size=block_size,
                guard_key=guard_key,
            )  # fmt: skip
            if refused:
                raise PublishRefusedError(path)
            return shard_result(len(header), rel, sums, digest, hash_s)

        return write


def stage_and_commit(
    saver: AsyncSaver,
    flat: api.FlatState,
    plan: api.SavePlan,
    storage: Storage,
    *,
    step: int,
    trigger: str,
    on_commit: Callable[[api.SaveInfo, int], None] | None = None,
    attempt: int | None = None,
    extra: Mapping[str, Any] | None = None,
    references: api.References | None = None,
    on_manifest: Callable[[api.Manifest], None] | None = None,
    defer: Callable[[Mapping[str, torch.Tensor]], Collection[str]] | None = None,
) -> AsyncSaveHandle[api.SaveInfo]:
    """Stage the tensors ``plan`` writes, then write and commit them in the background.

    Every rank of the saver's group calls it at the same step. ``on_commit(info, rank_bytes)``
    runs on the worker thread after the manifest is written (retention, status).
    ``attempt``, ``extra``, ``references`` and ``on_manifest`` go to
    :func:`~trainer_sdk.saveload._saving.write_and_commit`. ``defer(tensors)`` names those of
    the tensors to stage whose copy may finish after this returns (:meth:`AsyncSaver.submit`).
    """
    t0 = time.perf_counter()
    live = flat.tensors()
    keys = plan.keys
    to_stage = {k: live[k] for k in flat.entries if k in keys}
    group = saver.group
    timeout = saver.timeout.total_seconds()

    def work(staged: dict[str, torch.Tensor], tree: Any) -> api.SaveInfo:
        info = api.write_and_commit(
            storage, plan, staged, tree, step=step, flat=flat, trigger=trigger,
            process_group=group, timeout=timeout, started=t0, attempt=attempt, extra=extra,
            run_commit=saver.at_normal_priority, references=references, on_manifest=on_manifest,
            shard_writer=saver.shard_writer(plan.nbytes),
        )  # fmt: skip
        if on_commit is not None:
            on_commit(info, plan.nbytes)
        return info

    return saver.submit(
        step=step, tensors=to_stage, json_tree=flat.tree, work=work,
        defer=defer(to_stage) if defer is not None else (),
    )  # fmt: skip


class _ProcessSaver:
    """The AsyncSavers of this process that :func:`async_save` uses, one per
    ``writer_process`` setting: each created by the first call that asks for it, then reused
    (its host buffers and its process group) by every later one. Only one save is in flight
    across both: a call first waits for the other saver's save."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._savers: dict[bool, AsyncSaver] = {}

    def get(self, *, timeout: timedelta, writer_process: bool) -> AsyncSaver:
        """The saver for ``writer_process``, created with ``timeout`` on its first call (and
        closed at exit), once the other one has no save in flight."""
        with self._lock:
            other = self._savers.get(not writer_process)
            saver = self._savers.get(writer_process)
            if saver is None:
                if not self._savers:
                    atexit.register(self._close_at_exit)
                saver = AsyncSaver(
                    timeout=timeout,
                    normal_priority_below=NORMAL_PRIORITY_BYTES,
                    writer_process=writer_process,
                )
                self._savers[writer_process] = saver
        if other is not None:
            other.wait_previous()
        return saver

    def _close_at_exit(self) -> None:
        """Drain the last save and destroy the savers' groups while the interpreter is alive
        (a failure was the caller's to see through the handle: logged here)."""
        with self._lock:
            savers, self._savers = list(self._savers.values()), {}
        for saver in savers:
            try:
                saver.close()
            except Exception as e:
                log.warning("the last async_save failed: %s", e)


_PROCESS_SAVER: Final = _ProcessSaver()


def async_save(
    state: Mapping[str, Any],
    uri: Location,
    *,
    step: int,
    trigger: str = Trigger.MANUAL,
    timeout: float = 600.0,
    stage_in_background: bool = False,
    writer_process: bool = False,
) -> AsyncSaveHandle[api.SaveInfo]:
    """Save ``state`` as ``step`` under ``uri`` in the background; returns once staged.

    Every rank calls it, at the same point. The first call creates the host buffers and (under
    a process group) a gloo group for the background collectives; later calls reuse both, and
    each waits for the previous save first (raising its error, if it failed). After it
    returns, the tensors in ``state`` may be modified: the save writes the staged copy. Call
    ``.wait()`` on the handle (or on the last one before exiting) to learn the outcome.

    ``stage_in_background=True``: the call returns before the copy, which runs on a staging
    thread while training goes on; the tensors in ``state`` must not change until
    ``handle.wait_staged()`` returns (put it before the optimizer step, as
    ``torch-checkpointing`` asks for its lock). A tensor changed in place before its copy is
    done fails the save (never a torn commit).

    ``writer_process=True``: a save of more than 16 MiB to a local filesystem is written by a
    child process from the staged copy in shared memory (``Checkpointer(writer_process=True)``,
    docs/checkpointer.md). Calls with it and calls without it use two savers, each with its
    own buffers and process group (created by the first call of each kind, on every rank at
    the same call).
    """
    saver = _PROCESS_SAVER.get(timeout=timedelta(seconds=timeout), writer_process=writer_process)
    saver.wait_previous()
    rank, world = (
        (dist.get_rank(), dist.get_world_size())
        if dist.is_available() and dist.is_initialized()
        else (0, 1)
    )
    storage = open_storage(uri)
    flat = api.flatten(state)
    plan = api.plan_save(flat, rank, world)
    return stage_and_commit(
        saver, flat, plan, storage, step=step, trigger=trigger,
        defer=(lambda tensors: tensors.keys()) if stage_in_background else None,
    )  # fmt: skip
