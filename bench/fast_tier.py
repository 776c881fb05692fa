"""Benchmark: what the memory tier (``fast_every_steps``) costs the training loop.

Prints one table, all figures measured side by side in this run:

1. Step time of ``examples/tinylm/train.py`` on 2 ranks (gloo, DDP, CPU) with a memory-tier
   snapshot every step (``BATON_FAST_EVERY_STEPS=1``, ``BATON_FAST_DIR`` on ``/dev/shm``, the
   tmpfs an ``emptyDir`` with ``medium: Memory`` is) and every ``--every`` steps, against no
   memory tier, as ratios. Runs alternate (off, 1, every, off, ...) so that a machine whose
   load drifts hurts all alike; the figure is the median over all steps after the first
   ``--skip`` of each run. Target (every step): <= 1.05x.
2. Blocking time of ``Checkpointer.step()`` at a snapshot step (one process, a ``--mib`` MiB
   state of 16 tensors; the previous snapshot's write is waited for outside the timing),
   against a plain ``copy_`` of the same bytes into preallocated buffers (the floor for any
   staging), as a ratio. Median of ``--repeat``.

3. The two parts of a snapshot of tinylm's state (its model and AdamW, one process, no
   training in between): ``step()`` blocking (flattening, planning, the copy) and the
   background write (files, hashes, manifest), as the time from ``step()``'s return to
   ``wait()``'s. Median of ``--steps`` snapshots after ``--skip``. Apart from the contention
   for cores and the GIL, these bound the slowdown of row 1: the blocking part is added to
   every snapshot step, and the write shares the process with the training step.

4. Why a snapshot overwrites the files of the one before the last: the CPU seconds of
   writing the ``--mib`` MiB state into a new file on ``/dev/shm`` (then deleted, as an old
   snapshot was) against writing it into the same file again (what the memory tier's spares
   do), alternating, median of ``--repeat``. ``--files-only`` prints just this row.

Usage: ``python bench/fast_tier.py [--steps 120] [--runs 2] [--mib 256] [--repeat 7]``.
Not a test: timings are never assertions.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPO = Path(__file__).resolve().parent.parent
TINYLM = REPO / "examples" / "tinylm" / "train.py"


def _shm_dir() -> Path:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return Path(tempfile.mkdtemp(prefix="baton-fast-bench-", dir=base))


def _tinylm_steps(root: Path, steps: int, fast: int | None, skip: int) -> list[float]:
    """Seconds per step of rank 0 (from its loss log) of one 2-rank tinylm run."""
    from baton_testing.ports import free_port  # tests/ is on the venv's path (`make venv`)

    run = Path(tempfile.mkdtemp(dir=root))
    log = run / "loss.jsonl"
    fast_dir = _shm_dir() if fast else None  # fast: fast_every_steps, or None
    port = free_port()
    procs = []
    try:
        for rank in range(2):
            env = dict(
                os.environ,
                RANK=str(rank),
                WORLD_SIZE="2",
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
            )
            for var in ("BATON_FAST_EVERY_STEPS", "BATON_FAST_DIR", "BATON_EVERY_STEPS"):
                env.pop(var, None)
            if fast_dir is not None:
                env.update(BATON_FAST_EVERY_STEPS=str(fast), BATON_FAST_DIR=str(fast_dir))
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(TINYLM),
                        "--steps",
                        str(steps),
                        "--uri",
                        str(run / "ck"),
                        "--loss-log",
                        str(log),
                    ],
                    env=env,
                    cwd=REPO,
                    stdout=subprocess.DEVNULL,
                )
            )
        for p in procs:
            if p.wait(timeout=1800) != 0:
                raise RuntimeError(f"tinylm exited {p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        if fast_dir is not None:
            shutil.rmtree(fast_dir, ignore_errors=True)
    times = [
        float(rec["time"])
        for rec in map(json.loads, log.read_text().splitlines())
        if "loss" in rec and int(rec["step"]) > skip
    ]
    return [b - a for a, b in itertools.pairwise(times)]


def bench_slowdown(root: Path, steps: int, runs: int, skip: int, every: int) -> dict[str, float]:
    modes: dict[str, int | None] = {"step_off_s": None, "step_on_s": 1, "step_every_s": every}
    times: dict[str, list[float]] = {k: [] for k in modes}
    for _ in range(runs):
        for key, fast in modes.items():
            times[key] += _tinylm_steps(root, steps, fast=fast, skip=skip)
    return {k: statistics.median(v) for k, v in times.items()}


def _state_model(total_bytes: int, tensors: int = 16) -> nn.Module:
    per = total_bytes // tensors // 4
    params = nn.ParameterList(
        [nn.Parameter(torch.randn(per // 1024, 1024), requires_grad=False) for _ in range(tensors)]
    )
    model = nn.Module()
    model.params = params
    return model


def bench_blocking(root: Path, mib: int, repeat: int) -> dict[str, float]:
    from trainer_sdk import Checkpointer

    model = _state_model(mib << 20)
    srcs = [p.data for p in model.parameters()]
    bufs = [torch.empty_like(s) for s in srcs]
    copies = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for b, s in zip(bufs, srcs, strict=True):
            b.copy_(s)
        copies.append(time.perf_counter() - t0)
    del bufs
    fast = _shm_dir()
    blocks = []
    try:
        ck = Checkpointer(
            str(root / "blocking-ck"), model=model, fast_every_steps=1, fast_dir=fast,
            handle_sigterm=False,
        )  # fmt: skip
        ck.restore()
        for step in range(1, repeat + 2):
            ck.wait()  # the previous snapshot's write: not part of the blocking figure
            t0 = time.perf_counter()
            ck.step(step)
            if step > 1:  # the first one allocates the host buffers
                blocks.append(time.perf_counter() - t0)
        ck.close()
    finally:
        shutil.rmtree(fast, ignore_errors=True)
    return {"copy_s": statistics.median(copies), "block_s": statistics.median(blocks)}


def bench_parts(root: Path, steps: int, skip: int) -> dict[str, float]:
    import importlib.util

    from trainer_sdk import Checkpointer

    spec = importlib.util.spec_from_file_location("tinylm_train", TINYLM)
    assert spec is not None
    assert spec.loader is not None
    tinylm = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = tinylm  # its dataclasses look their module up there
    spec.loader.exec_module(tinylm)
    vocab = tinylm.CharWindows(tinylm.generate_corpus(4000, seed=0), context=64).vocab_size
    model = tinylm.TinyLM(tinylm.ModelConfig(vocab_size=vocab, context=64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, vocab, (8, 64))).sum().backward()
    optimizer.step()  # the AdamW moments exist, as in training
    fast = _shm_dir()
    blocks, writes = [], []
    try:
        ck = Checkpointer(
            str(root / "parts-ck"), model=model, optimizer=optimizer, fast_every_steps=1,
            fast_dir=fast, handle_sigterm=False,
        )  # fmt: skip
        ck.restore()
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            ck.step(step)
            t1 = time.perf_counter()
            ck.wait()
            if step > skip:
                blocks.append(t1 - t0)
                writes.append(time.perf_counter() - t1)
        ck.close()
    finally:
        shutil.rmtree(fast, ignore_errors=True)
    return {"parts_block_s": statistics.median(blocks), "parts_write_s": statistics.median(writes)}


def bench_files(mib: int, repeat: int) -> dict[str, float]:
    """CPU seconds of writing ``mib`` MiB into a new tmpfs file (deleted after) and into an
    existing one, alternating; medians."""
    data = torch.randn(mib << 18).numpy()  # mib MiB of float32
    view = memoryview(data).cast("B")
    piece = 8 << 20
    fast = _shm_dir()
    path = fast / "shard"

    def write(flags: int) -> float:
        t0 = time.process_time()
        fd = os.open(path, flags, 0o644)
        try:
            for off in range(0, len(view), piece):
                os.write(fd, view[off : off + piece])
            os.fsync(fd)
        finally:
            os.close(fd)
        return time.process_time() - t0

    new, again = [], []
    try:
        write(os.O_WRONLY | os.O_CREAT)  # the first file (an older snapshot's)
        for _ in range(repeat):
            again.append(write(os.O_WRONLY))
            t0 = time.process_time()
            path.unlink()
            new.append(write(os.O_WRONLY | os.O_CREAT) + time.process_time() - t0)
    finally:
        shutil.rmtree(fast, ignore_errors=True)
    return {"file_new_cpu_s": statistics.median(new), "file_again_cpu_s": statistics.median(again)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=120, help="tinylm steps per run")
    p.add_argument("--runs", type=int, default=2, help="runs per mode (alternating)")
    p.add_argument("--skip", type=int, default=10, help="warm-up steps left out of each run")
    p.add_argument("--every", type=int, default=10, help="a second fast_every_steps measured")
    p.add_argument("--mib", type=int, default=256, help="state size of the blocking figure")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--files-only", action="store_true", help="only row 4 (new file or again)")
    args = p.parse_args()
    files = bench_files(args.mib, args.repeat)
    file_rows = [
        (
            f"write {args.mib} MiB into a new /dev/shm file (CPU)",
            f"{files['file_new_cpu_s'] * 1e3:.1f} ms",
            f"{files['file_new_cpu_s'] / files['file_again_cpu_s']:.2f}x",
        ),
        (
            f"write {args.mib} MiB into the same file again (CPU)",
            f"{files['file_again_cpu_s'] * 1e3:.1f} ms",
            "1.00x",
        ),
    ]
    if args.files_only:
        _print(file_rows, files)
        return
    root = Path(tempfile.mkdtemp(prefix="baton-bench-"))
    try:
        r: dict[str, Any] = {}
        r.update(bench_slowdown(root, args.steps, args.runs, args.skip, args.every))
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
        r.update(bench_blocking(root, args.mib, args.repeat))
        torch.set_num_threads(1)  # as tinylm's ranks run
        r.update(bench_parts(root, args.steps, args.skip))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = [
        ("tinylm, 2 ranks: step, no memory tier", f"{r['step_off_s'] * 1e3:.1f} ms", "1.00x"),
        (
            "tinylm, 2 ranks: step, fast_every_steps=1",
            f"{r['step_on_s'] * 1e3:.1f} ms",
            f"{r['step_on_s'] / r['step_off_s']:.3f}x (target <= 1.05x)",
        ),
        (
            f"tinylm, 2 ranks: step, fast_every_steps={args.every}",
            f"{r['step_every_s'] * 1e3:.1f} ms",
            f"{r['step_every_s'] / r['step_off_s']:.3f}x",
        ),
        (f"plain copy of a {args.mib} MiB state", f"{r['copy_s'] * 1e3:.1f} ms", "1.00x"),
        (
            "step() blocking at a snapshot",
            f"{r['block_s'] * 1e3:.1f} ms",
            f"{r['block_s'] / r['copy_s']:.2f}x copy",
        ),
        (
            "tinylm state, 1 process: step() blocking at a snapshot",
            f"{r['parts_block_s'] * 1e3:.1f} ms",
            f"{r['parts_block_s'] / r['step_off_s'] * 100:.0f} % of a step without the tier",
        ),
        (
            "tinylm state, 1 process: snapshot write (background)",
            f"{r['parts_write_s'] * 1e3:.1f} ms",
            f"{r['parts_write_s'] / r['step_off_s'] * 100:.0f} % of a step without the tier",
        ),
        *file_rows,
    ]
    _print(rows, {**r, **files})


def _print(rows: list[tuple[str, str, str]], figures: dict[str, Any]) -> None:
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    width = max(len(a) for a, _, _ in rows)
    for a, b, c in rows:
        print(f"{a:<{width}}  {b:>10}  {c}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
