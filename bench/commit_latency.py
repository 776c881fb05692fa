"""Benchmark: how long an async save takes to commit on a loaded machine (issue 29, item 3).

A background save that the training loop is not waiting for may yield the CPU to training,
but its commit must not be starved: a notice drains it, and the operator reads the commit to
know what a restart would lose. This runs ``--burners`` CPU-bound processes at normal priority
(the machine's load rises to about that number), and measures, side by side in one run,
interleaved, the time from the save's call to its commit (the returned handle done) for:

* ``trainer_sdk.async_save`` (Baton's background writer; since this item its write runs at
  background priority only for saves above ``staging.NORMAL_PRIORITY_BYTES`` and its commit
  always runs at normal priority);
* ``torch.distributed.checkpoint.async_save`` with DCP's ``FileSystemWriter`` (thread
  executor, its default).

A ``--mib`` MiB state of 8 tensors, a save every ``--every`` seconds while the main thread
computes (one intra-op thread, as a rank). Median and worst over ``--repeat`` saves each; the
load average is printed. Not a test: timings are never assertions.

Usage: ``python bench/commit_latency.py [--mib 4] [--burners 10] [--repeat 10]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch


def _burn(stop: Any) -> None:
    x = 0
    while not stop.is_set():
        for i in range(100_000):
            x += i * i


def _state(mib: float) -> dict[str, Any]:
    per = int(mib * 2**20) // 8 // 4
    return {"model": {f"p{i}": torch.randn(per) for i in range(8)}, "step": 0}


def _baton(root: Path, state: dict[str, Any], step: int) -> float:
    from trainer_sdk.staging import async_save

    t0 = time.perf_counter()
    handle = async_save(state, root, step=step)
    handle.wait()
    return time.perf_counter() - t0


def _dcp(root: Path, state: dict[str, Any], step: int) -> float:
    import torch.distributed.checkpoint as dcp

    t0 = time.perf_counter()
    fut = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(str(root / f"s{step}")))
    fut.result()
    return time.perf_counter() - t0


def _compute(stop: threading.Event) -> None:
    a = torch.randn(256, 256)
    while not stop.is_set():
        a = torch.tanh(a @ a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=float, default=4.0)
    ap.add_argument("--burners", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    torch.set_num_threads(1)
    base = Path(tempfile.mkdtemp(prefix="baton-commit-", dir=args.dir))
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    burners = [ctx.Process(target=_burn, args=(stop,), daemon=True) for _ in range(args.burners)]
    for p in burners:
        p.start()
    computing = threading.Event()
    trainer = threading.Thread(target=lambda: None)
    times: dict[str, list[float]] = {"baton": [], "dcp": []}
    try:
        time.sleep(3.0)  # let the load rise
        state = _state(args.mib)
        trainer = threading.Thread(target=_compute, args=(computing,), daemon=True)
        trainer.start()
        for i in range(args.repeat):
            order = ("baton", "dcp") if i % 2 == 0 else ("dcp", "baton")
            for name in order:
                state["model"]["p0"].add_(1.0)
                root = base / name
                fn = _baton if name == "baton" else _dcp
                times[name].append(fn(root, state, i + 1))
    finally:
        computing.set()
        trainer.join(timeout=10)
        stop.set()
        for p in burners:
            p.join(timeout=10)
        shutil.rmtree(base, ignore_errors=True)
    load = os.getloadavg()
    print(f"{args.mib:g} MiB state, {args.burners} burners, load average "
          f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f}, {args.repeat} saves each")  # fmt: skip
    print("| method | call to commit, median | worst |")
    print("|---|---|---|")
    for name, xs in times.items():
        print(f"| {name} | {statistics.median(xs):.3f} s | {max(xs):.3f} s |")
    ratio = statistics.median(times["baton"]) / statistics.median(times["dcp"])
    print(f"Baton / DCP (medians): {ratio:.2f}x")


if __name__ == "__main__":
    main()
