"""Benchmark: trainer_sdk.save/load against DCP, torch.save and the disk's own limit.

    .venv/bin/python bench/save_load.py [--dir /work/bench-tmp] [--runs 5] [--gib 1]
                                        [--tmpfs /dev/shm] [--skip-tmpfs] [--skip-two-ranks]

One process, then two ranks in parallel (gloo), all in one run, side by side, interleaved run
by run so that drift in the machine's load hits every method alike. Every method fsyncs:
``raw`` is one sequential ``write`` of the same bytes + fsync of file and directory (the issue's
"disk limit"); ``raw+wb`` is the same write asking the kernel to start writeback after each
tensor (``sync_file_range``, as trainer_sdk does), the faster of the two on Linux and so the
stricter baseline; ``torch.save`` is followed by an fsync; DCP's FileSystemWriter fsyncs by
default.

Memory: the peak RSS above the pre-save RSS, sampled every 5 ms in a thread (page cache
is not RSS, so this is the memory the save itself allocates). Loads are measured cold (the
files' pages dropped with posix_fadvise DONTNEED first) and warm. Prints a table with ratios;
timings are medians. Not a test: nothing here passes or fails.

Fast media: the same save and a raw write of the same bytes to tmpfs (``--tmpfs``, the nearest
stand-in here for a GPU node's local NVMe at 5-25 GB/s), with the CPU seconds per GiB of each,
and the single-thread cost of each hash the format could use (sha256, BLAKE3, XXH3-128, crc32,
XXH3-64) on the same bytes: on fast media the CPU, not the device, bounds a save. The load
average is printed before and after, since on a shared machine it moves the wall-clock ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from baton_testing.pagecache import drop_cache
from baton_testing.ports import free_port  # tests/ is on the venv's path (`make venv`)

import trainer_sdk

N_TENSORS = 16


def make_state(gib: float, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = int(gib * 2**30 / 4 / N_TENSORS)
    return {f"layer{i:02d}.weight": torch.randn(n, generator=g) for i in range(N_TENSORS)}


class PeakRSS:
    """Peak resident memory above the starting point, sampled in a thread."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")
        self.base = self._rss()
        self.peak = self.base
        self._t = threading.Thread(target=self._run, daemon=True)

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            time.sleep(0.005)  # 5 ms: finer sampling costs the measured call real CPU

    def __enter__(self) -> PeakRSS:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self._rss())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_write(tensors: list[torch.Tensor], path: str, *, writeback: bool = False) -> None:
    """One sequential write of the tensors' bytes, fsync'd; ``writeback``: start disk
    writeback after each tensor (sync_file_range, Linux), so the disk works during the copy."""
    from trainer_sdk.storage.local import _start_writeback

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        off = 0
        for t in tensors:
            view = t.reshape(-1).view(torch.uint8).numpy().data
            while view:
                n = os.write(fd, view)
                if writeback:
                    _start_writeback(fd, off, n)
                off += n
                view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(os.path.dirname(path))


def raw_write_wb(tensors: list[torch.Tensor], path: str) -> None:
    raw_write(tensors, path, writeback=True)


def torch_save(state: dict[str, torch.Tensor], path: str) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(os.path.dirname(path))


def dcp_save(state: dict[str, torch.Tensor], path: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=path)


def dcp_load(state: dict[str, torch.Tensor], path: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.load(state, checkpoint_id=path)


def cpu_seconds() -> float:
    """CPU time of this process, all threads, user + system."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


CPU: dict[str, list[float]] = {}
"""CPU seconds per measured call, by function name (reported beside the wall times)."""


def timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[float, int]:
    with PeakRSS() as mem:
        c0 = cpu_seconds()
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        dt = time.perf_counter() - t0
        CPU.setdefault(getattr(fn, "__name__", "?"), []).append(cpu_seconds() - c0)
    return dt, mem.extra


def _save_into(infos: list[Any], state: dict[str, Any], path: str, *, step: int) -> None:
    infos.append(trainer_sdk.save(state, path, step=step))


def fresh(base: Path, name: str) -> str:
    """Delete the previous output of ``name`` and let the disk settle before the next timing.

    The filesystem here is ext4 mounted with ``discard``: deleting a 1 GiB file queues its
    discards for the next journal commit, which the next fsync would pay for. Syncing now
    keeps one method's deletion out of another method's timing.
    """
    p = base / name
    if p.exists():
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    os.sync()
    time.sleep(0.5)
    return str(p)


def bench_one_process(base: Path, gib: float, runs: int) -> dict[str, Any]:
    state = make_state(gib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    tensors = list(state.values())
    res: dict[str, list[tuple[float, int]]] = {}
    phases: list[dict[str, float]] = []
    for run in range(runs):
        for name in ("raw", "raw+wb", "trainer_sdk", "dcp", "torch.save"):
            if name in ("raw", "raw+wb"):
                path = fresh(base, "raw")
                os.makedirs(path)
                fn = raw_write if name == "raw" else raw_write_wb
                out = timed(fn, tensors, f"{path}/data.bin")
            elif name == "trainer_sdk":
                path = fresh(base, "sdk")
                infos: list[trainer_sdk.SaveInfo] = []
                out = timed(_save_into, infos, state, path, step=run)
                phases.append(infos[0].phases)
            elif name == "dcp":
                path = fresh(base, "dcp")
                out = timed(dcp_save, state, path)
            else:
                path = fresh(base, "torchsave")
                os.makedirs(path)
                out = timed(torch_save, state, f"{path}/state.pt")
            res.setdefault(name, []).append(out)
            print(f"  run {run} {name:<12} {out[0]:.3f} s  +{out[1] / 2**20:.0f} MiB", flush=True)
    # loads: the last saves of trainer_sdk and DCP are on disk
    # zeros, not empty: the pages must exist before the load, or RSS would count them
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    sdk_load = trainer_sdk.load
    for run in range(runs):
        for name, fn in (
            ("load trainer_sdk cold", sdk_load),
            ("load dcp cold", dcp_load),
            ("load trainer_sdk warm", sdk_load),
            ("load dcp warm", dcp_load),
        ):
            where = str(base / ("sdk" if "sdk" in name else "dcp"))
            if "cold" in name:
                drop_cache(where)
            out = timed(fn, dest, where)
            res.setdefault(name, []).append(out)
            print(f"  run {run} {name:<22} {out[0]:.3f} s", flush=True)
    for k, v in dest.items():
        assert torch.equal(v, state[k]), k
    hash_share = statistics.median(p["hash"] / p["write"] for p in phases)
    cpu = {k: statistics.median(v) for k, v in CPU.items()}
    return {"bytes": nbytes, "results": res, "hash_busy_share_of_write": hash_share, "cpu": cpu}


# ------------------------------------------------------------------------------ tmpfs


def _hash_costs(state: dict[str, torch.Tensor]) -> dict[str, float]:
    """Single-thread seconds per GiB of each hash, over the state's bytes (best of 3)."""
    import hashlib

    from blake3 import blake3
    from xxhash import xxh3_64_intdigest, xxh3_128

    from trainer_sdk._crc import crc32
    from trainer_sdk.format.layout import BLOCK_SIZE

    views = [t.reshape(-1).view(torch.uint8).numpy().data for t in state.values()]
    nbytes = sum(len(v) for v in views)

    def sha256() -> None:
        h = hashlib.sha256()
        for v in views:
            h.update(v)

    def blake() -> None:
        h = blake3()
        for v in views:
            h.update(v)

    def xxh() -> None:
        h = xxh3_128()
        for v in views:
            h.update(v)

    def crc() -> None:
        for v in views:
            crc32(v)

    def xxh64() -> None:  # the block checksum of format v5, one per block
        for v in views:
            for o in range(0, len(v), BLOCK_SIZE):
                xxh3_64_intdigest(v[o : o + BLOCK_SIZE])

    out = {}
    for name, fn in (
        ("sha256", sha256),
        ("blake3", blake),
        ("xxh3_128", xxh),
        ("crc32", crc),
        ("xxh3_64", xxh64),
    ):
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        out[name] = best / (nbytes / 2**30)
    return out


def bench_tmpfs(base: Path, gib: float, runs: int) -> dict[str, Any]:
    state = make_state(gib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    tensors = list(state.values())
    wall: dict[str, list[float]] = {"raw": [], "trainer_sdk": []}
    cpu: dict[str, list[float]] = {"raw": [], "trainer_sdk": []}
    load_before = os.getloadavg()[0]
    for run in range(runs):
        for name in ("raw", "trainer_sdk"):
            path = base / name
            shutil.rmtree(path, ignore_errors=True)
            c0, t0 = cpu_seconds(), time.perf_counter()
            if name == "raw":
                os.makedirs(path)
                raw_write(tensors, f"{path}/data.bin")
            else:
                trainer_sdk.save(state, str(path), step=run)
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(cpu_seconds() - c0)
            print(f"  run {run} tmpfs {name:<12} {wall[name][-1]:.3f} s", flush=True)
        shutil.rmtree(base / "raw", ignore_errors=True)  # tmpfs is memory: keep one copy only
    return {
        "bytes": nbytes,
        "wall": {k: statistics.median(v) for k, v in wall.items()},
        "fastest": {k: min(v) for k, v in wall.items()},
        "paired": statistics.median(
            r / s for r, s in zip(wall["raw"], wall["trainer_sdk"], strict=True)
        ),
        "cpu": {k: statistics.median(v) for k, v in cpu.items()},
        "hash": _hash_costs(state),
        "load": (load_before, os.getloadavg()[0]),
    }


def tmpfs_table(where: str, data: dict[str, Any]) -> list[str]:
    gib = data["bytes"] / 2**30
    w, c, h, f = data["wall"], data["cpu"], data["hash"], data["fastest"]
    return [
        f"### Fast media: tmpfs ({where}), {gib:g} GiB, {N_TENSORS} tensors",
        "",
        "| operation | median s | GiB/s | CPU s per GiB | ratio |",
        "|---|---|---|---|---|",
        f"| raw write of the same bytes | {w['raw']:.3f} | {gib / w['raw']:.2f} | "
        f"{c['raw'] / gib:.2f} | 1.00x |",
        f"| trainer_sdk.save | {w['trainer_sdk']:.3f} | {gib / w['trainer_sdk']:.2f} | "
        f"{c['trainer_sdk'] / gib:.2f} | {w['raw'] / w['trainer_sdk']:.2f}x raw speed, "
        f"{c['raw'] / c['trainer_sdk']:.2f}x raw CPU |",
        "",
        "Hashes on one thread, CPU s per GiB of the same bytes: "
        + ", ".join(f"{k} {v:.2f}" for k, v in h.items())
        + " (format v5 hashes a shard with XXH3-128 and an XXH3-64 per block in the writing"
        " thread, v4 XXH3-128 and crc32; v2-v3 used BLAKE3 and crc32 in two threads, v1 sha256;"
        " these figures read the bytes from memory, where the writer's second hash reads them"
        " from cache).",
        f"Load average (1 min) {data['load'][0]:.1f} before the runs, {data['load'][1]:.1f} "
        f"after, on {os.cpu_count()} CPUs. On a loaded machine the wall times swing with the "
        f"scheduler, so two more ratios: median of the run-by-run ratios "
        f"{data['paired']:.2f}x, fastest run of each {f['raw'] / f['trainer_sdk']:.2f}x "
        f"({f['raw']:.3f} s raw, {f['trainer_sdk']:.3f} s save).",
    ]


# ------------------------------------------------------------------------------ 2 ranks


def _rank_main(base: str, gib: float, runs: int, out_path: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    state = make_state(gib)  # replicated (DDP-like): the same 1 GiB on both ranks
    mine = list(state.values())[rank::world]

    def slowest(dt: float) -> float:
        t = torch.tensor([dt])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    res: dict[str, list[tuple[float, int]]] = {}
    for run in range(runs):
        for name in ("raw", "raw+wb", "trainer_sdk", "dcp"):
            if rank == 0:
                fresh(Path(base), f"r2-{name}")
                os.makedirs(f"{base}/r2-{name}")
            dist.barrier()
            if name in ("raw", "raw+wb"):
                fn = raw_write if name == "raw" else raw_write_wb
                dt, extra = timed(fn, mine, f"{base}/r2-{name}/rank{rank}.bin")
            elif name == "trainer_sdk":
                dt, extra = timed(trainer_sdk.save, state, f"{base}/r2-trainer_sdk", step=run)
            else:
                dt, extra = timed(dcp_save, state, f"{base}/r2-dcp")
            res.setdefault(name, []).append((slowest(dt), extra))
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    for _ in range(runs):
        for name, path in (
            ("load trainer_sdk cold", "r2-trainer_sdk"),
            ("load dcp cold", "r2-dcp"),
        ):
            if rank == 0:
                drop_cache(f"{base}/{path}")
            dist.barrier()
            loader = trainer_sdk.load if "sdk" in name else dcp_load
            dt, extra = timed(loader, dest, f"{base}/{path}")
            res.setdefault(name, []).append((slowest(dt), extra))
    for k, v in dest.items():
        assert torch.equal(v, state[k]), k
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def bench_two_ranks(base: Path, gib: float, runs: int) -> dict[str, Any]:
    port = free_port()
    out = str(base / "r2-results.json")
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            LOCAL_RANK=str(rank),
        )
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--rank-mode",
                    "--dir",
                    str(base),
                    "--gib",
                    str(gib),
                    "--runs",
                    str(runs),
                    "--out",
                    out,
                ],
                env=env,
            )
        )
    for p in procs:
        if p.wait() != 0:
            raise SystemExit("a rank of the 2-rank benchmark failed")
    per_rank = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    merged = {
        k: [(t, max(pr[k][i][1] for pr in per_rank)) for i, (t, _) in enumerate(per_rank[0][k])]
        for k in per_rank[0]
    }
    return {"bytes": int(gib * 2**30), "results": merged}


# ------------------------------------------------------------------------------ report


def med(xs: list[tuple[float, int]]) -> tuple[float, int]:
    return statistics.median(x[0] for x in xs), max(x[1] for x in xs)


def table(title: str, data: dict[str, Any]) -> list[str]:
    r = data["results"]
    nbytes = data["bytes"]
    lines = [
        f"### {title}",
        "",
        "| operation | median s | GiB/s | peak extra RSS | ratio |",
        "|---|---|---|---|---|",
    ]
    raw = med(r["raw"])[0]
    raw_wb = med(r["raw+wb"])[0]
    dcp = med(r["dcp"])[0]
    for name in ("raw", "raw+wb", "trainer_sdk", "dcp", "torch.save"):
        if name not in r:
            continue
        t, mem = med(r[name])
        ratio = ""
        if name == "trainer_sdk":
            ratio = f"{raw / t:.2f}x raw speed ({raw_wb / t:.2f}x raw+wb), {dcp / t:.2f}x DCP speed"
        elif name != "raw":
            ratio = f"{raw / t:.2f}x raw speed"
        lines.append(
            f"| save {name} | {t:.3f} | {nbytes / t / 2**30:.2f} | "
            f"{mem / 2**20:.0f} MiB | {ratio} |"
        )
    for kind in ("cold", "warm"):
        a, b = f"load trainer_sdk {kind}", f"load dcp {kind}"
        if a in r and b in r:
            ta, ma = med(r[a])
            tb, mb = med(r[b])
            lines.append(
                f"| {a} | {ta:.3f} | {nbytes / ta / 2**30:.2f} | {ma / 2**20:.0f} MiB | "
                f"{tb / ta:.2f}x DCP speed |"
            )
            lines.append(f"| {b} | {tb:.3f} | {nbytes / tb / 2**30:.2f} | {mb / 2**20:.0f} MiB | |")
    budget = 64 * 2**20 + 0.05 * nbytes
    mem = med(r["trainer_sdk"])[1]
    lines += [
        "",
        f"trainer_sdk save extra memory {mem / 2**20:.0f} MiB vs budget "
        f"{budget / 2**20:.0f} MiB (64 MiB + 5% of the state).",
    ]
    if "cpu" in data:
        c = data["cpu"]
        names = {
            "raw_write": "raw",
            "raw_write_wb": "raw+wb",
            "_save_into": "trainer_sdk.save",
            "dcp_save": "DCP save",
            "torch_save": "torch.save",
            "load": "trainer_sdk.load",
            "dcp_load": "DCP load",
        }
        parts = [f"{names[k]} {v:.2f}" for k, v in c.items() if k in names]
        lines.append("CPU seconds per call (median, all threads): " + ", ".join(parts) + ".")
    if "hash_busy_share_of_write" in data:
        lines.append(
            f"Hashing (XXH3-128 and the block XXH3-64s, in the writing thread) took "
            f"{data['hash_busy_share_of_write']:.0%} of the write phase."
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/work/bench-tmp")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--rank-mode", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="")
    ap.add_argument("--skip-two-ranks", action="store_true")
    ap.add_argument("--tmpfs", default="/dev/shm", help="a tmpfs directory for the fast-media run")
    ap.add_argument("--skip-tmpfs", action="store_true")
    ap.add_argument("--skip-disk", action="store_true", help="only the tmpfs run")
    args = ap.parse_args()
    if args.rank_mode:
        _rank_main(args.dir, args.gib, args.runs, args.out)
        return
    os.makedirs(args.dir, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="save-load-", dir=args.dir))
    try:
        print(f"one process, {args.gib} GiB in {N_TENSORS} tensors, {args.runs} runs, in {base}")
        print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start")
        lines: list[str] = []
        if not args.skip_tmpfs:
            shm = Path(tempfile.mkdtemp(prefix="baton-bench-", dir=args.tmpfs))
            try:
                lines += [*tmpfs_table(args.tmpfs, bench_tmpfs(shm, args.gib, args.runs)), ""]
            finally:
                shutil.rmtree(shm, ignore_errors=True)
        if args.skip_disk:
            print("\n".join(["", *lines]))
            return
        one = bench_one_process(base, args.gib, args.runs)
        lines += table(f"One process, {args.gib:g} GiB, {N_TENSORS} tensors", one)
        if not args.skip_two_ranks:
            for p in base.iterdir():
                shutil.rmtree(p) if p.is_dir() else p.unlink()
            print("two ranks in parallel (replicated state, writes split over the ranks)")
            two = bench_two_ranks(base, args.gib, args.runs)
            title = f"Two ranks in parallel (gloo), {args.gib:g} GiB replicated state"
            lines += ["", *table(title, two)]
        lines.append(f"Load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs.")
        print("\n".join(["", *lines]))
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
