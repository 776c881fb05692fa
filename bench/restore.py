"""Benchmark: cooperative restore against every rank reading everything, on disk and on S3.

    .venv/bin/python bench/restore.py [--dir /work/bench-tmp] [--gib 1] [--runs 3]
                                      [--ranks 2,3] [--skip-s3]

A DDP-style state (``--gib`` of float32 in 16 tensors, replicated on every rank) is saved once
by N gloo ranks (real processes), then loaded by the same N ranks with ``trainer_sdk.load``
run after run, alternating ``cooperative=True`` (the default: each byte read by one rank and
broadcast) and ``cooperative=False`` (every rank reads every byte, as loads did before),
ABBA so that drift in the machine's load hits both alike. Every load is cold: the pages of
the step's files (disk) or of the S3 server's backing files (versitygw on 127.0.0.1, as
``bench/s3.py``) are dropped first. Reported: the restore time (the slowest rank's), the
bytes read from storage by all ranks together (counted by a wrapper around the real storage,
``baton_testing.counting``) as a multiple of the state, and the time ratio; medians, with the
load average before and after. The restored state is checked bitwise. Not a test: nothing
passes or fails on a timing here.
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

N_TENSORS = 16
BUCKET = "bench"
GiB = 2**30


def make_tensor(gib: float, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(int(gib * GiB / 4 / N_TENSORS), generator=g)


def _rank_main(uri: str, cache_root: str, gib: float, runs: int, out: str) -> None:
    import torch.distributed as dist
    from baton_testing.counting import CountingStorage
    from baton_testing.pagecache import drop_cache

    import trainer_sdk

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    state = {f"layer{i:02d}.weight": make_tensor(gib, i) for i in range(N_TENSORS)}
    trainer_sdk.save(state, uri, step=1)
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    del state
    res: dict[str, list[list[float]]] = {}
    for run in range(runs):
        modes = [True, False] if run % 2 == 0 else [False, True]
        for coop in modes:
            for t in dest.values():
                t.zero_()
            if rank == 0:
                drop_cache(Path(cache_root))
            dist.barrier()
            storage = CountingStorage(uri)
            t0 = time.perf_counter()
            trainer_sdk.load(dest, storage, step=1, cooperative=coop)
            row = torch.tensor([time.perf_counter() - t0, storage.ranged], dtype=torch.float64)
            wall, read = row.clone(), row.clone()
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)
            dist.all_reduce(read, op=dist.ReduceOp.SUM)
            name = "cooperative" if coop else "every rank reads"
            res.setdefault(name, []).append([float(wall[0]), float(read[1])])
    for i, (k, v) in enumerate(dest.items()):
        assert torch.equal(v, make_tensor(gib, i)), k
    if rank == 0:
        Path(out).write_text(json.dumps({"world": world, "rows": res}))
    dist.destroy_process_group()


def run_ranks(n: int, uri: str, cache_root: Path, gib: float, runs: int, base: Path) -> Any:
    from baton_testing.ports import free_port

    port = free_port()
    out = base / f"restore-{n}.json"
    procs = []
    for rank in range(n):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(n),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        cmd = [sys.executable, __file__, "--rank-mode", uri, str(cache_root), str(gib)]
        procs.append(subprocess.Popen([*cmd, str(runs), str(out)], env=env))
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"a rank of the {n}-rank benchmark failed")
    return json.loads(out.read_text())


def main() -> None:
    # The helpers the tests use (this checkout's tests/, before any installed copy).
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-mode":
        uri, cache_root, gib, runs, out = sys.argv[2:7]
        _rank_main(uri, cache_root, float(gib), int(runs), out)
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/work/bench-tmp")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--ranks", default="2,3")
    ap.add_argument("--skip-s3", action="store_true")
    args = ap.parse_args()
    from baton_testing.s3 import REGION, VersityServer, client_env

    base = Path(args.dir)
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=base, prefix="restore-"))
    ranks = [int(x) for x in args.ranks.split(",")]
    load_before = os.getloadavg()
    table: list[tuple[str, int, Any]] = []
    server = None
    try:
        for n in ranks:
            print(f"==> disk, {n} ranks ({args.runs} runs)", file=sys.stderr)
            root = work / f"disk-{n}"
            table.append(("disk", n, run_ranks(n, str(root), root, args.gib, args.runs, work)))
        if not args.skip_s3:
            import boto3

            sroot = work / "versitygw"
            sroot.mkdir()
            server = VersityServer(root=str(sroot))
            server.start()
            os.environ.update(client_env(server.endpoint))
            boto3.client("s3", endpoint_url=server.endpoint, region_name=REGION).create_bucket(
                Bucket=BUCKET
            )
            for n in ranks:
                print(f"==> S3, {n} ranks ({args.runs} runs)", file=sys.stderr)
                uri = f"s3://{BUCKET}/r{n}"
                table.append(("S3", n, run_ranks(n, uri, sroot, args.gib, args.runs, work)))
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()
    nbytes = N_TENSORS * int(args.gib * GiB / 4 / N_TENSORS) * 4
    print(
        f"trainer_sdk.load of a replicated {nbytes / GiB:.2f} GiB state (16 float32 tensors) "
        f"on N gloo ranks, cold, median of {args.runs} interleaved runs; load average "
        f"{load_before[0]:.1f} before, {load_after[0]:.1f} after\n"
    )
    print(
        "| storage | ranks | restore s, every rank reads | restore s, cooperative | time ratio "
        "(cooperative / before) | bytes read, before | bytes read, cooperative |"
    )
    print("|---|---|---|---|---|---|---|")
    for where, n, res in table:
        rows = res["rows"]
        before = statistics.median(w for w, _ in rows["every rank reads"])
        after = statistics.median(w for w, _ in rows["cooperative"])
        read_b = statistics.median(b for _, b in rows["every rank reads"]) / nbytes
        read_a = statistics.median(b for _, b in rows["cooperative"]) / nbytes
        print(
            f"| {where} | {n} | {before:.2f} | {after:.2f} | {after / before:.2f}x | "
            f"{read_b:.2f}x | {read_a:.2f}x |"
        )


if __name__ == "__main__":
    main()
