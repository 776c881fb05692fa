"""Benchmark: what an async checkpoint costs the training loop, and how fast a notice is served.

Prints one table, all figures measured side by side in this run:

1. Blocking time of ``Checkpointer.step()`` when it starts an async save of a 1 GiB state
   (16 tensors), against a plain ``copy_`` of the same bytes into preallocated buffers (the
   floor for any staging). Target: <= 1.5x. Median of ``--repeat`` saves.
2. Step time of a compute-bound training loop (one intra-op thread, as a rank that leaves a
   core to the rest of its process) while the background write runs, as a ratio to the same
   steps right after the write (the GIL, CPU, memory bandwidth and the disk compete with
   training). Target: <= 1.10x.
3. Notice-to-commit latency of an emergency save of the same state (``request_checkpoint``
   then ``step()`` until it returns True; the save is synchronous and fsync'd).
4. Cost per step of the notice collective on 2 ranks (gloo, one ``all_reduce`` of 8 int64),
   and of a whole ``Checkpointer.step()`` that has nothing to save: with the agreement
   overlapped with the next step (the default for steps under ``notice_overlap_below``) and
   blocking (``notice_overlap_below=0``). Between two ``step()`` calls each rank sleeps 5 ms,
   as the host thread of a short GPU step waits for the device; only the time inside
   ``step()`` is counted. Target: <= 0.2 ms.

Usage: ``python bench/async_save.py [--gib 1.0] [--repeat 5] [--dir /tmp/baton-bench]``.
Not a test: timings are never assertions.
"""

from __future__ import annotations

import argparse
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
from _common import median, step_inputs, tensor_state, train_step  # bench/ is sys.path[0]
from torch import nn

REPO = Path(__file__).resolve().parent.parent


def _state_model(total_bytes: int, tensors: int = 16) -> nn.Module:
    state = tensor_state(total_bytes, tensors)
    params = nn.ParameterList([nn.Parameter(t, requires_grad=False) for t in state.values()])
    model = nn.Module()
    model.params = params
    return model


_median = median


def bench_blocking(root: Path, gib: float, repeat: int) -> dict[str, float]:
    from trainer_sdk import Checkpointer

    model = _state_model(int(gib * (1 << 30)))
    tensors = [p.data for p in model.parameters()]
    bufs = [torch.empty_like(t) for t in tensors]
    copy_times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for b, t in zip(bufs, tensors, strict=True):
            b.copy_(t)
        copy_times.append(time.perf_counter() - t0)
    del bufs

    uri = root / "blocking"
    ck = Checkpointer(
        str(uri), model=model, every_steps=1, async_save=True, keep_last=1, handle_sigterm=False
    )
    block, write = [], []
    for i in range(1, repeat + 2):
        ck.wait()  # measure the staging alone, not a wait for the previous write
        t0 = time.perf_counter()
        ck.step(i)
        block.append(time.perf_counter() - t0)
        handle = ck.last_save
        assert handle is not None
        t1 = time.perf_counter()
        handle.wait()
        write.append(time.perf_counter() - t1 + block[-1])
    ck.close()
    # the first save allocates the host buffers; the steady state is what training pays
    block, write = block[1:], write[1:]
    return {
        "copy_s": _median(copy_times),
        "block_s": _median(block),
        "save_total_s": _median(write),
    }


def bench_slowdown(root: Path, gib: float, saves: int) -> dict[str, float]:
    """Steps during each background write, then as many steps with nothing running, right
    after: the two sets see the same machine, so a change in its load hits both."""
    from trainer_sdk import Checkpointer

    w, x = step_inputs()
    for _ in range(3):
        train_step(w, x)
    undisturbed: list[float] = []

    model = _state_model(int(gib * (1 << 30)))
    ck = Checkpointer(
        str(root / "slowdown"),
        model=model,
        every_steps=1,
        async_save=True,
        keep_last=1,
        handle_sigterm=False,
    )
    during: list[float] = []
    for save in range(1, saves + 1):
        ck.step(save)  # stages (blocking), then the write runs in the background
        handle = ck.last_save
        assert handle is not None
        n = 0
        while not handle.done():
            t0 = time.perf_counter()
            train_step(w, x)
            during.append(time.perf_counter() - t0)
            n += 1
        handle.wait()
        for _ in range(max(n, 5)):
            t0 = time.perf_counter()
            train_step(w, x)
            undisturbed.append(time.perf_counter() - t0)
    ck.close()
    base = _median(undisturbed)
    return {
        "step_s": base,
        "step_during_write_s": _median(during) if during else float("nan"),
        "steps_measured": float(len(during)),
    }


def bench_notice(root: Path, gib: float, repeat: int) -> dict[str, float]:
    from trainer_sdk import Checkpointer
    from trainer_sdk.control import ControlChannel

    model = _state_model(int(gib * (1 << 30)))
    lat = []
    phases: dict[str, list[float]] = {}
    ctl = ControlChannel(root / "control")
    for i in range(repeat):
        ck = Checkpointer(
            str(root / "notice"),
            model=model,
            keep_last=1,
            handle_sigterm=False,
            control_dir=str(ctl.directory),
        )
        ck.restore()  # as a job would: loads the last one and calibrates the estimate
        t0 = time.perf_counter()
        ck.request_checkpoint(reason="bench")
        stopped = ck.step(i + 1)
        lat.append(time.perf_counter() - t0)
        ck.close()
        assert stopped
        status = ctl.read_status()
        assert status is not None
        for name, sec in status.phases.items():
            phases.setdefault(name, []).append(sec)
    out = {"notice_to_commit_s": _median(lat)}
    out.update({f"notice_phase_{k}_s": _median(v) for k, v in phases.items()})
    return out


def bench_raw_write(root: Path, gib: float) -> dict[str, float]:
    """A sequential write of the same bytes, fsync'd: the disk's limit, for context."""
    chunk = os.urandom(8 << 20)
    n = int(gib * (1 << 30)) // len(chunk)
    path = root / "raw.bin"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(n):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    path.unlink()
    return {"raw_write_s": seconds}


def _collective_worker(out: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from trainer_sdk import Checkpointer
    from trainer_sdk.loop.signals import LocalNotice, agree

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    group = dist.new_group(backend="gloo")
    for _ in range(200):
        agree(LocalNotice(), rank=rank, group=group)
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        agree(LocalNotice(), rank=rank, group=group)
    per_agree = (time.perf_counter() - t0) / n
    model = nn.Linear(8, 8)
    result = {"agree_s": per_agree}
    for mode, below in (("step_overlapped_s", 1.0), ("step_blocking_s", 0.0)):
        ck = Checkpointer(
            str(Path(out).parent / "collective-ck"),
            model=model,
            handle_sigterm=False,
            notice_overlap_below=below,
        )
        for i in range(50):
            ck.step(i + 1)
        inside = []
        for i in range(500):
            time.sleep(0.005)  # the device computes the step; the host waits
            t0 = time.perf_counter()
            ck.step(i + 1000)
            inside.append(time.perf_counter() - t0)
        ck.close()
        # the slower rank's figure: a blocking step waits for the other rank
        vec = torch.tensor([statistics.mean(inside)], dtype=torch.float64)
        dist.all_reduce(vec, op=dist.ReduceOp.MAX)
        result[mode] = float(vec.item())
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def bench_collective(root: Path) -> dict[str, float]:
    from baton_testing.ports import free_port  # tests/ is on the venv's path (`make venv`)

    out = root / "collective.json"
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--collective-worker", str(out)], env=env, cwd=REPO
            )
        )
    for p in procs:
        p.wait(timeout=300)
    data: dict[str, float] = json.loads(out.read_text())
    return data


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dir", default=None)
    p.add_argument("--collective-worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.collective_worker:
        _collective_worker(args.collective_worker)
        return
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    root = Path(args.dir or tempfile.mkdtemp(prefix="baton-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        r: dict[str, Any] = {}
        r.update(bench_blocking(root, args.gib, args.repeat))
        r.update(bench_slowdown(root, args.gib, max(3, args.repeat)))
        r.update(bench_raw_write(root, args.gib))
        r.update(bench_notice(root, args.gib, max(3, args.repeat // 2)))
        r.update({f"coll_{k}": v for k, v in bench_collective(root).items()})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gib = args.gib
    rows = [
        ("state", f"{gib:g} GiB, 16 tensors", ""),
        ("plain copy into preallocated buffers", f"{r['copy_s'] * 1e3:.0f} ms", "1.00x"),
        (
            "step() blocking, async save",
            f"{r['block_s'] * 1e3:.0f} ms",
            f"{r['block_s'] / r['copy_s']:.2f}x copy (target <= 1.5x)",
        ),
        ("async save, stage to commit", f"{r['save_total_s']:.2f} s", ""),
        ("training step, undisturbed", f"{r['step_s'] * 1e3:.1f} ms", "1.00x"),
        (
            "training step, background write running",
            f"{r['step_during_write_s'] * 1e3:.1f} ms",
            f"{r['step_during_write_s'] / r['step_s']:.2f}x ({int(r['steps_measured'])} steps; "
            "target <= 1.10x)",
        ),
        (
            "notice to commit (sync, fsync'd)",
            f"{r['notice_to_commit_s']:.2f} s",
            f"{gib / r['notice_to_commit_s']:.2f} GiB/s",
        ),
        (
            "  of which write / commit",
            f"{r.get('notice_phase_write_s', 0):.2f} s / {r.get('notice_phase_commit_s', 0):.2f} s",
            "",
        ),
        (
            "raw sequential write of the same bytes, fsync'd",
            f"{r['raw_write_s']:.2f} s",
            f"{gib / r['raw_write_s']:.2f} GiB/s (the disk, for context)",
        ),
        ("notice collective, 2 ranks gloo, back to back", f"{r['coll_agree_s'] * 1e6:.0f} us", ""),
        (
            "Checkpointer.step(), nothing due, 2 ranks, overlapped",
            f"{r['coll_step_overlapped_s'] * 1e6:.0f} us",
            "per step (target <= 200 us; the default)",
        ),
        (
            "Checkpointer.step(), nothing due, 2 ranks, blocking",
            f"{r['coll_step_blocking_s'] * 1e6:.0f} us",
            "per step (notice_overlap_below=0)",
        ),
    ]
    w0 = max(len(a) for a, _, _ in rows)
    w1 = max(len(b) for _, b, _ in rows)
    print(f"{'measure':<{w0}}  {'value':>{w1}}  ratio")
    for a, b, c in rows:
        print(f"{a:<{w0}}  {b:>{w1}}  {c}")


if __name__ == "__main__":
    main()
