"""Benchmark: what an async save costs training, Baton against the tools users would pick instead.

Issue #29, item 1. One run, one process, every contender interleaved save by save (Baton,
anchor A, anchor B, ..., Baton, ...; the order rotates each round), so that drift in the
machine's load hits every contender alike. Medians over ``--rounds`` saves each. The load
average (/proc/loadavg) is printed at the start, after every round and at the end.

The setup: a state of ``--tensors`` float32 tensors, ``--gib`` GiB in all, saved as
``{"model": {"p0": ..., ...}}``; a training loop on one intra-op thread
(``torch.set_num_threads(1)``) whose step is compute-bound (4 matmuls of 768², about 45 ms,
``_common.train_step``); an async save started every ``--every`` steps. Each cycle, per
contender: tensor p0 is changed, the save is called, ``--every`` training steps run, the
loop waits for the save to be durable (as the next save would), then ``--every`` steps run
with nothing in flight. Then, outside the timed part, the save is loaded back and p0 compared,
the files removed and ``sync``ed.

The figures, per save:

1. **Training time lost per save** = the time the save call blocks + the time the loop
   waits for the save at the end of the cycle (zero when the write finished within
   ``--every`` steps) + for every step that started while the save was in flight, its time
   minus the median step time of the same cycle's undisturbed steps. Also **step time while
   writing**: median in-flight step over median undisturbed step, all cycles pooled.
2. The same two on tmpfs (``--shm-dir``, default /dev/shm).
3. **Time to durable**: from the call until the files are fsync'd. A watcher thread waits
   for the contender's own completion ("done"), then fsyncs every file and directory of the
   save (a few ms for files already fsync'd); the save counts as in flight until then, so a
   contender that reports done before its bytes are durable pays for the fsync here like
   the ones that fsync themselves. The table says which ones do: Baton (fsync per file, then
   the manifest, then ``latest``) and DCP's ``FileSystemWriter`` (``sync_files=True``) do;
   torch-checkpointing 0.1.1 has no fsync anywhere in its source (``grep -rn fsync
   torch_checkpointing/`` is empty): its write future is done when the files are renamed into
   place, in the page cache.

The contenders (each saves the same state object; any of them can be left out with
``--skip``):

* ``baton``: ``trainer_sdk.staging.async_save`` (the writer of ``Checkpointer(async_save=
  True)``): copies into reused host buffers, then writes in a thread at ``nice`` +10.
* ``baton-bg``: the same with ``stage_in_background=True`` (the writer of ``Checkpointer(
  async_save=True, stage_in_background=True)``): the call returns at once, a staging thread
  copies, and each step ends with ``handle.wait_staged()`` where its optimizer step would go
  (as torch-checkpointing's lock).
* ``baton-proc``: ``baton-bg`` with ``writer_process=True`` (``Checkpointer(writer_process=
  True)``): the staged copy lives in memfds and a child process streams, hashes and fsyncs
  the shard; the commit stays in the training process.
* ``dcp-thread``: ``torch.distributed.checkpoint.async_save`` with ``FileSystemWriter``,
  thread executor, its default stager (``FileSystemWriter`` itself, a fresh CPU copy per save).
* ``dcp-process``: the same with ``async_checkpointer_type=AsyncCheckpointerType.PROCESS``
  (a daemon process writes; the staged copy is moved into shared memory to reach it).
* ``dcp-process-shm``: process executor with one ``DefaultStager(StagingOptions(
  use_pinned_memory=False, use_shared_memory=True, use_async_staging=False,
  use_non_blocking_copy=False))`` kept across saves: it caches its shared-memory copies per
  source storage, so from the second save on it copies into the same buffers (pinned memory
  and non-blocking copies need an accelerator; none here).
* ``torch-ckpt``: meta-pytorch ``torch_checkpointing`` (``CheckpointManager`` with its default
  async saver: staging in a thread into shared memory, a writer subprocess), with
  ``LocalFileSystemStorageConfig(use_direct_io=False)`` (its O_DIRECT default fails on ext4
  here). Its staging is asynchronous: the save call returns at once and the training loop
  must not change the state until the copy is done, which its API expresses as ``with
  manager.lock(): optimizer.step()``; each training step here ends with that ``with``, so
  the wait counts in the first steps' extra time.

And one that is not an anchor but the bound of this machine:

* ``floor``: the least an async writer of this state can cost here. The copy into one
  shared-memory buffer (a memfd) on a thread beside the next steps, the loop waiting for it
  where its optimizer step would go; then a separate process at ``nice`` +10
  (``bench/_floor_writer.py``, no torch) writes the bytes raw into one file in 8 MiB calls
  and fsyncs it and its directory. No format, no hashes, no manifest, no commit. Its ratio
  to the best anchor is how far below the anchors any writer can get on this machine; a goal
  below it cannot be met here by any implementation.

A process group of one rank (gloo) is initialised, because DCP's process executor needs one;
every contender runs under it, as in a ``torchrun`` job.

S3: not measured here. ``bench/s3.py`` (Baton against boto3's ``upload_file`` and put/get at
the server's limit) and ``bench/dcp_backend.py`` (``BatonWriter`` against
``s3torchconnector``'s DCP writer), both against a local versitygw, hold those rows; ``--s3``
runs ``bench/dcp_backend.py`` after this table, with the same ``--gib``.

Usage::

    python bench/anchors.py [--gib 1.0] [--rounds 7] [--every 40] [--dir /work/bench-tmp]
                            [--shm-dir /dev/shm] [--skip NAME,...] [--quick] [--s3]
                            [--python-bound]

``--python-bound`` replaces the 4 matmuls by about 45 ms of small tensor operations
(``_common.python_bound_step``): a loop that takes the GIL thousands of times a step, as a
GPU trainer's kernel-launch thread does, where a writer thread's GIL hand-offs show.

Not a test: timings are never assertions.

Why one module of this size: each contender's few lines of start, load-back and close sit
beside the one cycle that times them all and the table that compares them, so that a change
to how one contender is timed or counted is read against the others in the same file; the
floor's writer process is a separate, torch-free script (``bench/_floor_writer.py``).
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import (
    fsync_tree,
    loadavg,
    median,
    python_bound_step,
    step_inputs,
    tensor_state,
    train_step,
)

REPO = Path(__file__).resolve().parent.parent
STEP: list[Callable[[torch.Tensor, torch.Tensor], None]] = [train_step]
"""The training step the cycles run (``--python-bound`` swaps in ``python_bound_step``)."""

State = dict[str, dict[str, torch.Tensor]]


@dataclass
class Started:
    """One save in flight: ``wait`` returns when the contender reports it done."""

    wait: Callable[[], object]
    lock: Callable[[], AbstractContextManager[Any]] = nullcontext


class Contender:
    name = ""
    fsyncs = True  # does the contender's own "done" mean durable?

    def start(self, state: State, path: Path, step: int) -> Started:
        raise NotImplementedError

    def load_p0(self, state: State, path: Path, step: int) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        pass


def _empty_like(state: State) -> State:
    return {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}}


class Baton(Contender):
    name = "baton"

    def start(self, state: State, path: Path, step: int) -> Started:
        from trainer_sdk.staging import async_save

        handle = async_save(state, str(path), step=step)
        return Started(wait=handle.wait)

    def load_p0(self, state: State, path: Path, step: int) -> torch.Tensor:
        import trainer_sdk

        into = _empty_like(state)
        trainer_sdk.load(into, str(path), step=step)
        return into["model"]["p0"]


class Dcp(Contender):
    def __init__(self, name: str, process: bool, shm_stager: bool) -> None:
        self.name = name
        self.process = process
        self.stager: Any = None
        if shm_stager:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self.stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=False,
                    use_shared_memory=True,
                    use_async_staging=False,
                    use_non_blocking_copy=False,
                )
            )

    def spawn_daemon(self, log: Path) -> None:
        """Start DCP's checkpoint daemon process (one per trainer process, reused by every
        process-executor save) with its stderr in ``log``: it logs every request at INFO."""
        scratch = Path(tempfile.mkdtemp(prefix="baton-anchors-daemon-"))
        saved = os.dup(2)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.dup2(fd, 2)
            tiny: State = {"model": {"p0": torch.zeros(4)}}
            self.start(tiny, scratch / "s", 0).wait()
        finally:
            os.dup2(saved, 2)
            os.close(fd)
            os.close(saved)
            shutil.rmtree(scratch, ignore_errors=True)

    def start(self, state: State, path: Path, step: int) -> Started:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        kind = AsyncCheckpointerType.PROCESS if self.process else AsyncCheckpointerType.THREAD
        fut = dcp.async_save(
            state,
            storage_writer=dcp.FileSystemWriter(str(path)),
            async_checkpointer_type=kind,
            async_stager=self.stager,
        )
        assert isinstance(fut, Future), "staging is synchronous, so DCP returns a Future"
        return Started(wait=fut.result)

    def load_p0(self, state: State, path: Path, step: int) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp

        into = _empty_like(state)
        dcp.load(into, storage_reader=dcp.FileSystemReader(str(path)))
        return into["model"]["p0"]

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()


class TorchCheckpointing(Contender):
    name = "torch-ckpt"
    fsyncs = False

    def __init__(self) -> None:
        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        self.manager = CheckpointManager(
            CheckpointManager.Config(
                storage_config=LocalFileSystemStorageConfig(use_direct_io=False)
            )
        )

    def start(self, state: State, path: Path, step: int) -> Started:
        fut = self.manager.save(str(path), state)
        assert fut is not None, "the default saver is asynchronous"
        return Started(wait=fut.result, lock=self.manager.lock)

    def load_p0(self, state: State, path: Path, step: int) -> torch.Tensor:
        into = _empty_like(state)
        out = self.manager.load(str(path), into=into)
        p0: torch.Tensor = out["model"]["p0"]
        return p0

    def close(self) -> None:
        self.manager.close()


@dataclass
class Cycle:
    block_s: float
    wait_s: float
    done_s: float
    durable_s: float
    inflight: list[float]
    undisturbed: list[float]

    @property
    def lost_s(self) -> float:
        base = median(self.undisturbed)
        return self.block_s + self.wait_s + sum(t - base for t in self.inflight)


@dataclass
class Results:
    cycles: dict[tuple[str, str], list[Cycle]] = field(default_factory=dict)


def run_cycle(
    c: Contender,
    state: State,
    root: Path,
    step: int,
    every: int,
    w: torch.Tensor,
    x: torch.Tensor,
) -> Cycle:
    path = root / f"{c.name}-{step}"
    state["model"]["p0"].add_(1.0)
    expect = state["model"]["p0"].clone()
    marks: dict[str, float] = {}
    failure: list[BaseException] = []

    t0 = time.perf_counter()
    started = c.start(state, path, step)
    block = time.perf_counter() - t0

    def watch() -> None:
        try:
            started.wait()
            marks["done"] = time.perf_counter()
            fsync_tree(path)
            marks["durable"] = time.perf_counter()
        except BaseException as e:  # surfaced below, at the cycle's end
            failure.append(e)
            marks["done"] = marks["durable"] = time.perf_counter()

    watcher = threading.Thread(target=watch, name=f"watch-{c.name}", daemon=True)
    watcher.start()
    inflight: list[float] = []
    for _ in range(every):
        flying = "durable" not in marks  # a step that starts with the save in flight counts
        s0 = time.perf_counter()
        STEP[0](w, x)
        with started.lock():  # where an optimizer step would update the state
            pass
        if flying:
            inflight.append(time.perf_counter() - s0)
    w0 = time.perf_counter()
    watcher.join()
    wait = time.perf_counter() - w0
    if failure:
        raise RuntimeError(f"{c.name}: save of step {step} failed") from failure[0]
    undisturbed = []
    for _ in range(every):
        s0 = time.perf_counter()
        STEP[0](w, x)
        undisturbed.append(time.perf_counter() - s0)
    # outside the timed part: the save round-trips, then it goes
    got = c.load_p0(state, path, step)
    if not torch.equal(got, expect):
        raise RuntimeError(f"{c.name}: step {step} loaded back a different p0 than it saved")
    shutil.rmtree(path, ignore_errors=True)
    os.sync()
    return Cycle(
        block_s=block,
        wait_s=wait,
        done_s=marks["done"] - t0,
        durable_s=marks["durable"] - t0,
        inflight=inflight,
        undisturbed=undisturbed,
    )


class BatonBackground(Baton):
    """Baton with the staging copy on its staging thread (``stage_in_background``): the call
    returns at once and the loop waits for the copy where its optimizer step would go, as
    with torch-checkpointing's lock."""

    name = "baton-bg"

    def start(self, state: State, path: Path, step: int) -> Started:
        from trainer_sdk.staging import async_save

        handle = async_save(state, str(path), step=step, stage_in_background=True)

        @contextmanager
        def copied() -> Iterator[None]:
            handle.wait_staged()
            yield

        return Started(wait=handle.wait, lock=copied)


class BatonProcess(Baton):
    """``baton-bg`` with its shard written by the writer process (``writer_process=True``):
    the staged copy in memfds, a child process streaming, hashing and fsyncing the shard."""

    name = "baton-proc"

    def start(self, state: State, path: Path, step: int) -> Started:
        from trainer_sdk.staging import async_save

        handle = async_save(
            state, str(path), step=step, stage_in_background=True, writer_process=True
        )

        @contextmanager
        def copied() -> Iterator[None]:
            handle.wait_staged()
            yield

        return Started(wait=handle.wait, lock=copied)


class Floor(Contender):
    """The least any async writer of this state can cost the loop on this machine: the copy
    into shared memory on a thread beside the next steps (the loop waits for it where its
    optimizer step would go, as for ``baton-bg`` and torch-checkpointing), then a separate
    process at ``nice`` +10 (``bench/_floor_writer.py``, no torch) writes the bytes raw into
    one file and fsyncs it: no format, no hashes, no manifest, no commit."""

    name = "floor"

    def __init__(self) -> None:
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._proc = subprocess.Popen(
            [sys.executable, str(REPO / "bench" / "_floor_writer.py"), str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
        )
        theirs.close()
        self._arena: torch.Tensor | None = None
        self._views: dict[str, torch.Tensor] = {}
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="floor-stage")

    def _map(self, state: State) -> None:
        total = sum(t.numel() * t.element_size() for t in state["model"].values())
        fd = os.memfd_create("baton-anchors-floor")
        try:
            os.ftruncate(fd, total)
            self._arena = torch.frombuffer(mmap.mmap(fd, total), dtype=torch.uint8)
            socket.send_fds(self._sock, [f"map {total}".encode()], [fd])
        finally:
            os.close(fd)
        if self._sock.recv(64) != b"ok":
            raise RuntimeError("floor: the writer process did not map the staging memory")
        off = 0
        for name, t in state["model"].items():
            n = t.numel() * t.element_size()
            self._views[name] = self._arena[off : off + n].view(t.dtype).view(t.shape)
            off += n

    def start(self, state: State, path: Path, step: int) -> Started:
        if self._arena is None:
            self._map(state)

        def copy() -> None:
            for k, t in state["model"].items():
                self._views[k].copy_(t)

        copied: Future[None] = self._copier.submit(copy)

        def write() -> None:
            copied.result()
            self._sock.send(f"write {path}".encode())
            answer = self._sock.recv(4096)
            if answer != b"ok":
                raise RuntimeError(f"floor: {answer.decode()}")

        written: Future[None] = self._copier.submit(write)

        @contextmanager
        def staged() -> Iterator[None]:
            copied.result()
            yield

        return Started(wait=written.result, lock=staged)

    def load_p0(self, state: State, path: Path, step: int) -> torch.Tensor:
        p0 = state["model"]["p0"]  # the first tensor: bytes [0, p0's size) of the file
        n = p0.numel() * p0.element_size()
        with open(path / "data.bin", "rb") as f:
            raw = bytearray(f.read(n))
        return torch.frombuffer(raw, dtype=p0.dtype).view(p0.shape)

    def close(self) -> None:
        self._copier.shutdown(wait=True)
        self._sock.close()
        self._proc.wait(timeout=30)


def build(names: list[str]) -> list[Contender]:
    makers: dict[str, Callable[[], Contender]] = {
        "baton": Baton,
        "baton-bg": BatonBackground,
        "baton-proc": BatonProcess,
        "dcp-thread": lambda: Dcp("dcp-thread", process=False, shm_stager=False),
        "dcp-process": lambda: Dcp("dcp-process", process=True, shm_stager=False),
        "dcp-process-shm": lambda: Dcp("dcp-process-shm", process=True, shm_stager=True),
        "torch-ckpt": TorchCheckpointing,
        "floor": Floor,
    }
    return [makers[n]() for n in names]


BATON = ("baton", "baton-bg", "baton-proc")
FLOOR = "floor"
"""Not an anchor: the machine's bound (``Floor``); its column's ratio to the best anchor says
how far below an anchor any writer can get here."""
ALL = [
    "baton",
    "baton-bg",
    "baton-proc",
    "dcp-thread",
    "dcp-process",
    "dcp-process-shm",
    "torch-ckpt",
    FLOOR,
]


def _init_group() -> None:
    from baton_testing.ports import free_port  # tests/ is on the venv's path (`make venv`)

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)


def _fmt_ms(s: float) -> str:
    return f"{s * 1e3:.0f} ms"


def table(res: Results, contenders: list[Contender], media: list[str]) -> list[list[str]]:
    names = [c.name for c in contenders]
    rows: list[list[str]] = []

    def add(
        label: str, per: dict[str, float], fmt: Callable[[float], str], ratio_col: bool = True
    ) -> None:
        anchors = {n: v for n, v in per.items() if n not in BATON and n != FLOOR}
        ratios = []
        for ours in (n for n in (*BATON, FLOOR) if n in names):
            ratio = ""
            if ratio_col and ours in per and anchors:
                best = min(anchors.values())
                ratio = f"{per[ours] / best:.2f}x" if best > 0 else "(best anchor <= 0)"
            ratios.append(ratio)
        rows.append([label, *(fmt(per[n]) if n in per else "-" for n in names), *ratios])

    for medium in media:
        lost, slow, block, wait, done, durable, steps = {}, {}, {}, {}, {}, {}, {}
        for n in names:
            cs = res.cycles.get((medium, n), [])
            if not cs:
                continue
            lost[n] = median([c.lost_s for c in cs])
            inflight = [t for c in cs for t in c.inflight]
            base = [t for c in cs for t in c.undisturbed]
            slow[n] = median(inflight) / median(base) if inflight else float("nan")
            block[n] = median([c.block_s for c in cs])
            wait[n] = median([c.wait_s for c in cs])
            done[n] = median([c.done_s for c in cs])
            durable[n] = median([c.durable_s for c in cs])
            steps[n] = median([float(len(c.inflight)) for c in cs])
        add(f"{medium}: training time lost per save", lost, _fmt_ms)
        add(f"{medium}: step time while writing", slow, lambda v: f"{v:.2f}x")
        add(f"{medium}:   of which the save call blocks", block, _fmt_ms, False)
        add(f"{medium}:   of which waiting at the cycle's end", wait, _fmt_ms, False)
        add(f"{medium}:   steps in flight (median)", steps, lambda v: f"{v:.0f}", False)
        add(f"{medium}: call to done (its own report)", done, lambda v: f"{v:.2f} s")
        if medium == "disk":
            add(f"{medium}: call to durable (fsync'd)", durable, lambda v: f"{v:.2f} s")
    rows.append(
        [
            "done means durable?",
            *("yes" if c.fsyncs else "NO: no fsync (page cache)" for c in contenders),
            *("" for n in (*BATON, FLOOR) if n in names),
        ]
    )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=7, help="timed saves per contender and medium")
    ap.add_argument("--every", type=int, default=40, help="training steps per save")
    ap.add_argument("--dir", default=None, help="a directory on disk (default: a temp dir)")
    ap.add_argument("--shm-dir", default="/dev/shm", help="a directory on tmpfs; '' skips it")
    ap.add_argument("--skip", default="", help=f"comma-separated, of: {','.join(ALL)}")
    ap.add_argument("--quick", action="store_true", help="0.05 GiB, 2 rounds, 10 steps a save")
    ap.add_argument(
        "--python-bound",
        action="store_true",
        help="a step of thousands of small ops (GIL-bound, as a GPU launch thread) for the matmuls",
    )
    ap.add_argument("--s3", action="store_true", help="then run bench/dcp_backend.py (S3 rows)")
    args = ap.parse_args()
    if args.quick:
        args.gib, args.rounds, args.every = 0.05, 2, 10
    if args.python_bound:
        STEP[0] = python_bound_step
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    skip = {s for s in args.skip.split(",") if s}
    unknown = skip - set(ALL)
    if unknown:
        sys.exit(f"--skip: unknown {sorted(unknown)}; choose from {','.join(ALL)}")
    names = [n for n in ALL if n not in skip]

    loads = [loadavg()]
    print(f"load average at start: {loads[0]}", flush=True)
    _init_group()
    media = {"disk": Path(tempfile.mkdtemp(prefix="baton-anchors-", dir=args.dir))}
    if args.shm_dir:
        media["tmpfs"] = Path(tempfile.mkdtemp(prefix="baton-anchors-", dir=args.shm_dir))
    state: State = {"model": tensor_state(int(args.gib * (1 << 30)), args.tensors)}
    w, x = step_inputs()
    for _ in range(5):
        STEP[0](w, x)
    contenders = build(names)
    daemon_log = Path(tempfile.gettempdir()) / "baton-anchors-dcp-daemon.log"
    for c in contenders:
        if isinstance(c, Dcp) and c.process:
            c.spawn_daemon(daemon_log)
            print(f"DCP's checkpoint daemon logs to {daemon_log}", flush=True)
            break
    res = Results()
    step = 0
    try:
        # one untimed save each per medium: buffers, the DCP daemon process, caches
        for root in media.values():
            for c in contenders:
                step += 1
                run_cycle(c, state, root, step, 2, w, x)
        for r in range(args.rounds):
            for medium, root in media.items():
                k = r % len(contenders)
                for c in contenders[k:] + contenders[:k]:
                    step += 1
                    cyc = run_cycle(c, state, root, step, args.every, w, x)
                    res.cycles.setdefault((medium, c.name), []).append(cyc)
            loads.append(loadavg())
            print(f"round {r + 1}/{args.rounds} done, load average {loads[-1]}", flush=True)
    finally:
        for c in contenders:
            c.close()
        for root in media.values():
            shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()

    rows = table(res, contenders, list(media))
    head = ["figure", *names, *(f"{n} / best anchor" for n in (*BATON, FLOOR) if n in names)]
    print()
    print(
        f"{args.gib:g} GiB in {args.tensors} float32 tensors; a save every {args.every} steps; "
        f"{args.rounds} saves each per medium, interleaved; medians; "
        f"step: {'python-bound' if args.python_bound else 'matmuls'}"
    )
    print(f"load average (1 5 15 min): start {loads[0]}, during {', '.join(loads[1:])}, ", end="")
    print(f"end {loadavg()}")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(
        "torch-ckpt's 'done' is before its bytes are durable: it never fsyncs (torch_checkpointing"
        " 0.1.1 source); its in-flight time and durable time include the fsync this bench adds."
    )
    print(
        "S3 rows: bench/s3.py (Baton vs boto3 upload_file / put_object) and bench/dcp_backend.py"
        " (BatonWriter vs s3torchconnector), against a local versitygw; --s3 runs the latter."
    )
    if args.s3:
        subprocess.run(
            [sys.executable, str(REPO / "bench" / "dcp_backend.py"), "--gib", str(args.gib)],
            check=True,
        )


if __name__ == "__main__":
    main()
