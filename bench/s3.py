"""Benchmark: trainer_sdk save/load over S3 against the S3 server's own limit and boto3.

    .venv/bin/python bench/s3.py [--gib 1] [--runs 3] [--dir /work/bench-tmp]
                                 [--levels 1,4,8,16] [--skip-two-ranks]

Runs against versitygw (a production S3 server, Apache-2.0, POSIX backend; built from Go
modules by tools/versitygw/build.sh) on 127.0.0.1, with its data under ``--dir``. moto is not
measured: it caps at about 100 MiB/s and says nothing about speed.

Side by side in one run, interleaved run by run so that drift in the machine's load hits every
method alike, each moving the same bytes (``--gib`` of float32 in 16 tensors):

* the server's limit: plain boto3 ``put_object`` / ``get_object`` of the 16 tensors as 16
  objects, from 1, 4, 8 and 16 threads (``--levels``); the best of these (and, for writes, of
  the plain multipart upload below) is the limit;
* a plain boto3 multipart upload of the same bytes as one object, shaped like the SDK's (16 MiB
  parts from 8 threads, CRC32 per part): the server's multipart path, which costs more than
  single PUTs (versitygw's POSIX backend copies the parts into the object at Complete);
* boto3's transfer manager with its default ``TransferConfig`` (8 MiB parts, 10 threads):
  ``upload_file`` / ``download_file`` of the same bytes as one file on tmpfs;
* ``trainer_sdk.save`` / ``trainer_sdk.load`` (default ``S3Config``, or ``BATON_S3_*``) in one
  process, and on 2 gloo ranks (replicated state: each rank writes half of it, and reads all
  of it: ``cooperative=False``; ``bench/restore.py`` measures the cooperative default).

Where the time goes: the CPU seconds per GiB of the client (this process, or both ranks) and of
the server (from /proc) for each method, next to the wall time. This machine has 2 cores for
client and server together, so the CPU per GiB decides most of the ranking. Timings are
medians; not a test: nothing here passes or fails.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import boto3.s3.transfer
import torch

# The S3 server driver the tests use (tests/ is on the venv's path: `make venv`).
from baton_testing.ports import free_port
from baton_testing.s3 import FAKE_KEY_ID, FAKE_SECRET, REGION, VersityServer

import trainer_sdk

ROOT = Path(__file__).resolve().parents[1]

N_TENSORS = 16
BUCKET = "bench"
GiB = 2**30
MiB = 2**20
MPU_PART = 16 * MiB  # S3Config's default part size and concurrency
MPU_THREADS = 8


def make_state(gib: float, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = int(gib * GiB / 4 / N_TENSORS)
    return {f"layer{i:02d}.weight": torch.randn(n, generator=g) for i in range(N_TENSORS)}


def client_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) of another process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def set_env(endpoint: str) -> None:
    os.environ.update(
        AWS_ENDPOINT_URL_S3=endpoint,
        AWS_ACCESS_KEY_ID=FAKE_KEY_ID,
        AWS_SECRET_ACCESS_KEY=FAKE_SECRET,
        AWS_REGION=REGION,
        AWS_CONFIG_FILE=os.devnull,
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
    )


def s3_client(max_pool: int = 32) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=os.environ["AWS_ENDPOINT_URL_S3"],
        region_name=REGION,
        config=boto3.session.Config(max_pool_connections=max_pool),
    )


def delete_prefix(client: Any, prefix: str) -> None:
    paginator = client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=BUCKET, Prefix=prefix):
        objects = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if objects:
            client.delete_objects(Bucket=BUCKET, Delete={"Objects": objects, "Quiet": True})


class Meter:
    """Wall time and CPU seconds of this process (or the given ones) and of the server."""

    def __init__(self, server_pid: int) -> None:
        self.server_pid = server_pid
        self.results: dict[str, list[dict[str, float]]] = {}

    def measure(self, name: str, fn: Callable[[], Any]) -> None:
        s0, c0 = process_cpu(self.server_pid), client_cpu()
        t0 = time.perf_counter()
        fn()
        wall = time.perf_counter() - t0
        self.add(name, wall, client_cpu() - c0, process_cpu(self.server_pid) - s0)

    def add(self, name: str, wall: float, client_s: float, server_s: float) -> None:
        self.results.setdefault(name, []).append(
            {"wall": wall, "client_cpu": client_s, "server_cpu": server_s}
        )


def mpu(client: Any, parts: list[bytes]) -> None:
    """The same bytes as one object, a plain boto3 multipart upload shaped like the SDK's
    (16 MiB parts from 8 threads, CRC32 per part): what the server's multipart path allows."""
    key = "raw/mpu"
    upload_id = client.create_multipart_upload(Bucket=BUCKET, Key=key, ChecksumAlgorithm="CRC32")[
        "UploadId"
    ]

    def one(n: int) -> dict[str, Any]:
        resp = client.upload_part(
            Bucket=BUCKET,
            Key=key,
            UploadId=upload_id,
            PartNumber=n,
            Body=parts[n - 1],
            ChecksumAlgorithm="CRC32",
        )
        return {"PartNumber": n, "ETag": resp["ETag"], "ChecksumCRC32": resp["ChecksumCRC32"]}

    with ThreadPoolExecutor(MPU_THREADS) as pool:
        listed = list(pool.map(one, range(1, len(parts) + 1)))
    client.complete_multipart_upload(
        Bucket=BUCKET, Key=key, UploadId=upload_id, MultipartUpload={"Parts": listed}
    )


def bench_one_process(
    meter: Meter, base: Path, gib: float, runs: int, levels: list[int]
) -> tuple[int, dict[str, torch.Tensor]]:
    state = make_state(gib)
    blobs = [t.numpy().tobytes() for t in state.values()]
    nbytes = sum(len(b) for b in blobs)
    client = s3_client(max(levels) + 4)
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else base
    src = Path(tempfile.mkdtemp(dir=shm, prefix="baton-bench-s3-"))
    try:
        with open(src / "state.bin", "wb") as f:
            for b in blobs:
                f.write(b)
        dest = {k: torch.zeros_like(v) for k, v in state.items()}
        whole = b"".join(blobs)
        part_bytes = [whole[o : o + MPU_PART] for o in range(0, len(whole), MPU_PART)]
        del whole
        config = boto3.s3.transfer.TransferConfig()  # the defaults, on purpose
        out = src / "downloaded.bin"
        uri = f"s3://{BUCKET}/sdk"
        for run in range(runs):
            print(f"  run {run + 1}/{runs}", file=sys.stderr)
            for level in levels:
                keys = [f"raw/c{level}/{i:02d}" for i in range(len(blobs))]

                def put(level: int = level, keys: list[str] = keys) -> None:
                    with ThreadPoolExecutor(level) as pool:
                        list(
                            pool.map(
                                lambda kb: client.put_object(Bucket=BUCKET, Key=kb[0], Body=kb[1]),
                                zip(keys, blobs, strict=True),
                            )
                        )

                def get(level: int = level, keys: list[str] = keys) -> None:
                    def one(key: str) -> int:
                        body = client.get_object(Bucket=BUCKET, Key=key)["Body"]
                        return len(body.read())

                    with ThreadPoolExecutor(level) as pool:
                        got = sum(pool.map(one, keys))
                    assert got == nbytes, (got, nbytes)

                meter.measure(f"put c={level}", put)
                meter.measure(f"get c={level}", get)
                delete_prefix(client, f"raw/c{level}/")

            meter.measure(f"multipart c={MPU_THREADS}", functools.partial(mpu, client, part_bytes))
            delete_prefix(client, "raw/mpu")
            meter.measure(
                "upload_file",
                lambda: client.upload_file(
                    str(src / "state.bin"), BUCKET, "tm/state", Config=config
                ),
            )
            meter.measure(
                "download_file",
                lambda: client.download_file(BUCKET, "tm/state", str(out), Config=config),
            )
            assert out.stat().st_size == nbytes
            out.unlink()
            delete_prefix(client, "tm/")

            meter.measure("sdk save", functools.partial(trainer_sdk.save, state, uri, step=run + 1))
            meter.measure("sdk load", functools.partial(trainer_sdk.load, dest, uri, step=run + 1))
            for k, v in dest.items():
                assert torch.equal(v, state[k]), k
            delete_prefix(client, "sdk/")
    finally:
        shutil.rmtree(src)
    return nbytes, state


def _rank_main(gib: float, runs: int, out_path: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = make_state(gib)  # replicated (DDP-like): each rank writes half of the tensors
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    uri = f"s3://{BUCKET}/r2"
    res: dict[str, list[list[float]]] = {}

    def timed(name: str, fn: Callable[[], Any]) -> None:
        dist.barrier()
        c0 = client_cpu()
        t0 = time.perf_counter()
        fn()
        both = torch.tensor([time.perf_counter() - t0, client_cpu() - c0], dtype=torch.float64)
        wall = both.clone()
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
        dist.all_reduce(both, op=dist.ReduceOp.SUM)
        res.setdefault(name, []).append([float(wall[0]), float(both[1])])

    for run in range(runs):
        timed("sdk save, 2 ranks", functools.partial(trainer_sdk.save, state, uri, step=run + 1))
        # Every rank reads all of it (the S3 read path's throughput); bench/restore.py measures
        # the cooperative default, where each byte is read once and broadcast.
        load = functools.partial(trainer_sdk.load, dest, uri, step=run + 1, cooperative=False)
        timed("sdk load, 2 ranks", load)
    for k, v in dest.items():
        assert torch.equal(v, state[k]), k
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def bench_two_ranks(meter: Meter, base: Path, gib: float, runs: int) -> None:
    port = free_port()
    out = str(base / "s3-r2-results.json")
    procs = []
    s0 = process_cpu(meter.server_pid)
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            LOCAL_RANK=str(rank),
        )
        cmd = [sys.executable, __file__, "--rank-mode", "--gib", str(gib), "--runs", str(runs)]
        procs.append(subprocess.Popen([*cmd, "--out", out], env=env))
    for p in procs:
        if p.wait() != 0:
            raise SystemExit("a rank of the 2-rank benchmark failed")
    server_s = (process_cpu(meter.server_pid) - s0) / (2 * runs)  # not split save/load
    res = json.loads(Path(f"{out}.0").read_text())
    for rank in range(2):
        Path(f"{out}.{rank}").unlink()
    for name, rows in res.items():
        for wall, cpu in rows:
            meter.add(name, wall, cpu, server_s)
    delete_prefix(s3_client(), "r2/")


def report(meter: Meter, nbytes: int, levels: list[int], runs: int, gib: float) -> list[str]:
    r = meter.results

    def med(name: str, field: str = "wall") -> float:
        return statistics.median(x[field] for x in r[name])

    def moved(name: str) -> int:
        # A replicated state is written once (each rank writes half) but read by every rank.
        return 2 * nbytes if name == "sdk load, 2 ranks" else nbytes

    def mibs(name: str) -> float:
        return moved(name) / MiB / med(name)

    put_best = max([f"put c={c}" for c in levels] + [f"multipart c={MPU_THREADS}"], key=mibs)
    get_best = max([f"get c={c}" for c in levels], key=mibs)
    put_limit, get_limit = mibs(put_best), mibs(get_best)
    lines = [
        f"S3 benchmark: versitygw (POSIX backend) on 127.0.0.1, {nbytes / MiB:.0f} MiB in "
        f"{N_TENSORS} tensors, medians of {runs} runs "
        f"(`bench/s3.py --gib {gib:g} --runs {runs}`)",
        "",
        "| method | MiB/s | x server limit | x boto3 transfer | client CPU s/GiB "
        "| server CPU s/GiB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    rows: list[tuple[str, str, str]] = []  # (name, limit kind, boto3 reference)
    rows += [(f"put c={c}", "put", "") for c in levels]
    rows += [(f"multipart c={MPU_THREADS}", "put", ""), ("upload_file", "put", "")]
    rows += [(n, "put", "upload_file") for n in ("sdk save", "sdk save, 2 ranks") if n in r]
    rows += [(f"get c={c}", "get", "") for c in levels]
    rows += [("download_file", "get", "")]
    rows += [(n, "get", "download_file") for n in ("sdk load", "sdk load, 2 ranks") if n in r]
    for name, kind, ref in rows:
        limit = put_limit if kind == "put" else get_limit
        vs_ref = f"{mibs(name) / mibs(ref):.2f}" if ref else ""
        label = name
        if name in (put_best, get_best):
            label += " (limit)"
        lines.append(
            f"| {label} | {mibs(name):.0f} | {mibs(name) / limit:.2f} | {vs_ref} "
            f"| {med(name, 'client_cpu') / (moved(name) / GiB):.2f} "
            f"| {med(name, 'server_cpu') / (moved(name) / GiB):.2f} |"
        )
    if "sdk save, 2 ranks" in r:
        lines += [
            "",
            "2 ranks: wall time of the slower rank, client CPU of both; the server CPU of the "
            "2-rank rows is the average of save and load (measured over both together). The "
            "state is replicated: the ranks write half of it each, and each reads all of it, "
            "so the 2-rank load moves twice the bytes (counted in its MiB/s).",
        ]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default="/work/bench-tmp", help="the server's data directory")
    ap.add_argument("--levels", default="1,4,8,16", help="thread counts for the server's limit")
    ap.add_argument("--skip-two-ranks", action="store_true")
    ap.add_argument("--rank-mode", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_mode:
        _rank_main(args.gib, args.runs, args.out)
        return
    levels = [int(x) for x in args.levels.split(",")]
    base = Path(args.dir)
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(dir=base, prefix="versitygw-"))
    server = VersityServer(root=str(root))
    server.start()
    try:
        assert server.proc is not None
        set_env(server.endpoint)
        s3_client().create_bucket(Bucket=BUCKET)
        meter = Meter(server.proc.pid)
        print(f"==> 1 process ({args.runs} runs)", file=sys.stderr)
        nbytes, _ = bench_one_process(meter, base, args.gib, args.runs, levels)
        if not args.skip_two_ranks:
            print(f"==> 2 ranks ({args.runs} runs)", file=sys.stderr)
            bench_two_ranks(meter, base, args.gib, args.runs)
    finally:
        server.stop()
        shutil.rmtree(root)
    print("\n".join(report(meter, nbytes, levels, args.runs, args.gib)))


if __name__ == "__main__":
    main()
