"""Benchmark: ``dcp.save`` / ``dcp.load`` through Baton's storage backend against DCP's own.

    .venv/bin/python bench/dcp_backend.py [--dir /work/bench-tmp] [--gib 1] [--runs 3]
                                          [--skip-s3]

The same state (``--gib`` of float32 in 16 tensors, one process, DCP's default planners) saved
and loaded by each writer/reader pair, interleaved run by run so that drift in the machine's
load hits every method alike; medians, with the load average printed before and after:

* disk: ``BatonWriter`` / ``BatonReader`` (``trainer_sdk.integrations.dcp``) against DCP's
  ``FileSystemWriter`` / ``FileSystemReader`` (its default: one file per rank, fsync'd, a pickled
  ``.metadata``). Both fsync; Baton also hashes every block (BLAKE3) on save and verifies on load.
* S3 (versitygw on 127.0.0.1, as ``bench/s3.py``): ``BatonWriter("s3://...")`` against AWS's
  ``s3torchconnector`` 1.5 ``S3StorageWriter`` / ``S3StorageReader`` (its DCP integration, the
  anchor a DCP user on S3 would pick; DCP itself has no S3 writer but fsspec's). Baton's
  default sends each part's CRC32 in a signed header and no hash of the body in the signature
  (``S3Config.sign_payload=False``), as s3torchconnector's CRT client does over http (it sends
  ``UNSIGNED-PAYLOAD`` and no checksum); a third saver, ``BatonWriter, body signed``, is
  Baton with ``sign_payload=True`` (botocore's own default over http: a SHA-256 of every part).

Loads are cold for the disk rows (the files' pages dropped first). Client CPU seconds per GiB
are this process's (user + system). Not a test: nothing passes or fails here.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from baton_testing.pagecache import drop_cache

# The S3 server driver the tests use (tests/ is on the venv's path: `make venv`).
from baton_testing.s3 import REGION, VersityServer, client_env

from trainer_sdk.integrations.dcp import BatonLoadPlanner, BatonReader, BatonWriter
from trainer_sdk.storage.s3 import S3Config, S3Storage

N_TENSORS = 16
BUCKET = "bench"
GiB = 2**30


def make_state(gib: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = int(gib * GiB / 4 / N_TENSORS)
    return {f"layer{i:02d}.weight": torch.randn(n, generator=g) for i in range(N_TENSORS)}


def empty_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.empty_like(v) for k, v in state.items()}


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Table:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.rows: dict[str, list[tuple[float, float]]] = {}

    def timed(self, name: str, fn: Callable[[], Any]) -> None:
        c0, t0 = cpu(), time.perf_counter()
        fn()
        self.rows.setdefault(name, []).append((time.perf_counter() - t0, cpu() - c0))

    def line(self, name: str, anchor: str) -> str:
        wall = statistics.median(w for w, _ in self.rows[name])
        cpu_s = statistics.median(c for _, c in self.rows[name])
        ref = statistics.median(w for w, _ in self.rows[anchor])
        mibs = self.nbytes / 2**20 / wall
        gib = self.nbytes / GiB
        return f"| {name} | {wall:.2f} | {mibs:.0f} | {ref / wall:.2f}x | {cpu_s / gib:.2f} |"


def bench_disk(base: Path, state: dict[str, torch.Tensor], runs: int, t: Table) -> None:
    for run in range(runs):
        baton_root = base / f"baton-{run}"
        fs_root = base / f"fs-{run}"
        savers: list[tuple[str, Callable[[], Any]]] = [
            (
                "disk save: BatonWriter",
                lambda root=baton_root, step=run: dcp.save(
                    state, storage_writer=BatonWriter(str(root), step=step)
                ),
            ),
            (
                "disk save: FileSystemWriter",
                lambda root=fs_root: dcp.save(
                    state, storage_writer=dcp.FileSystemWriter(str(root))
                ),
            ),
        ]
        for name, fn in savers if run % 2 == 0 else reversed(savers):
            t.timed(name, fn)
        loaders: list[tuple[str, Path, Callable[[], Any]]] = [
            (
                "disk load: BatonReader",
                baton_root,
                lambda root=baton_root: dcp.load(
                    empty_like(state),
                    storage_reader=BatonReader(str(root)),
                    planner=BatonLoadPlanner(),
                ),
            ),
            (
                "disk load: FileSystemReader",
                fs_root,
                lambda root=fs_root: dcp.load(
                    empty_like(state), storage_reader=dcp.FileSystemReader(root)
                ),
            ),
        ]
        for name, root, fn in loaders if run % 2 == 0 else reversed(loaders):
            drop_cache(root)
            t.timed(name, fn)
        shutil.rmtree(baton_root)
        shutil.rmtree(fs_root)


def bench_s3(base: Path, state: dict[str, torch.Tensor], runs: int, t: Table) -> None:
    import boto3
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client
    from s3torchconnector.dcp import S3StorageReader, S3StorageWriter
    from s3torchconnector.dcp.s3_file_system import S3FileSystem

    root = Path(tempfile.mkdtemp(dir=base, prefix="versitygw-"))
    server = VersityServer(root=str(root))
    server.start()
    try:
        os.environ.update(client_env(server.endpoint))
        boto3.client("s3", endpoint_url=server.endpoint, region_name=REGION).create_bucket(
            Bucket=BUCKET
        )
        config = S3ClientConfig(force_path_style=True)

        def connector_fs() -> Any:
            client = S3Client(REGION, endpoint=server.endpoint, s3client_config=config)
            return S3FileSystem(REGION, s3_client=client)

        def s3tc_writer(uri: str) -> Any:
            writer = S3StorageWriter(REGION, uri, s3client_config=config, overwrite=True)
            writer.fs = connector_fs()  # the anchor's own API has no endpoint argument here
            writer.path = writer.fs.init_path(uri)
            return writer

        def s3tc_reader(uri: str) -> Any:
            reader = S3StorageReader(REGION, uri, s3client_config=config)
            reader.fs = connector_fs()
            reader.path = reader.fs.init_path(uri)
            return reader

        for run in range(runs):
            baton_uri = f"s3://{BUCKET}/baton-{run}"
            s3tc_uri = f"s3://{BUCKET}/s3tc-{run}"
            savers: list[tuple[str, Callable[[], Any]]] = [
                (
                    "S3 save: BatonWriter",
                    lambda uri=baton_uri, step=run: dcp.save(
                        state, storage_writer=BatonWriter(uri, step=step)
                    ),
                ),
                (
                    "S3 save: BatonWriter, body signed",
                    lambda uri=f"{baton_uri}-signed", step=run: dcp.save(
                        state,
                        storage_writer=BatonWriter(
                            S3Storage.from_uri(uri, config=S3Config(sign_payload=True)),
                            step=step,
                        ),
                    ),
                ),
                (
                    "S3 save: s3torchconnector",
                    lambda uri=s3tc_uri: dcp.save(state, storage_writer=s3tc_writer(uri)),
                ),
            ]
            for name, fn in savers if run % 2 == 0 else reversed(savers):
                t.timed(name, fn)
            loaders: list[tuple[str, Callable[[], Any]]] = [
                (
                    "S3 load: BatonReader",
                    lambda uri=baton_uri: dcp.load(
                        empty_like(state),
                        storage_reader=BatonReader(uri),
                        planner=BatonLoadPlanner(),
                    ),
                ),
                (
                    "S3 load: s3torchconnector",
                    lambda uri=s3tc_uri: dcp.load(
                        empty_like(state), storage_reader=s3tc_reader(uri)
                    ),
                ),
            ]
            for name, fn in loaders if run % 2 == 0 else reversed(loaders):
                t.timed(name, fn)
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/work/bench-tmp")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--skip-s3", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = Path(args.dir)
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=base, prefix="dcp-backend-"))
    state = make_state(args.gib)
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    load_before = os.getloadavg()
    t = Table(nbytes)
    try:
        print(f"==> disk ({args.runs} runs)", file=sys.stderr)
        bench_disk(work, state, args.runs, t)
        if not args.skip_s3:
            print(f"==> S3 ({args.runs} runs)", file=sys.stderr)
            bench_s3(work, state, args.runs, t)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()
    print(
        f"dcp.save/dcp.load of {nbytes / GiB:.2f} GiB (16 float32 tensors), 1 process, "
        f"median of {args.runs} interleaved runs; load average {load_before[0]:.1f} before, "
        f"{load_after[0]:.1f} after\n"
    )
    print("| method | seconds | MiB/s | speed vs anchor | client CPU s/GiB |")
    print("|---|---|---|---|---|")
    pairs = [
        ("disk save: BatonWriter", "disk save: FileSystemWriter"),
        ("disk load: BatonReader", "disk load: FileSystemReader"),
        ("S3 save: BatonWriter", "S3 save: s3torchconnector"),
        ("S3 save: BatonWriter, body signed", "S3 save: s3torchconnector"),
        ("S3 load: BatonReader", "S3 load: s3torchconnector"),
    ]
    for mine, anchor in pairs:
        if mine in t.rows:
            print(t.line(mine, anchor))
            print(t.line(anchor, anchor))


if __name__ == "__main__":
    main()
