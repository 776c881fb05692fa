"""Benchmark: incremental saves of a frozen base with a trainable adapter (issue 27).

    .venv/bin/python bench/incremental.py [--base-mib 1024] [--dtype bfloat16] [--rank 8]
                                          [--layers 8] [--reps 4] [--dir /work/bench-tmp]
                                          [--skip-s3] [--quick]

A LoRA-like model: ``--layers`` square linear layers whose weights (``--base-mib`` MiB in all,
``--dtype``, ``requires_grad=False``) are the frozen base, each with a trainable low-rank pair
``down`` (rank x d) and ``up`` (d x rank) in float32, trained with AdamW (a few MiB of adapter,
twice that of optimizer state). One process; each timed save follows a real training step
(forward and backward through the whole model, one token).

Three Checkpointers save the same model and optimizer, each under its own root, interleaved
save by save (the order rotates every round, so drift in the machine's load hits each alike):

* ``incremental``: the default (``full_every_steps=0``): after the first save, the frozen base
  is referenced in the step that wrote it (format v3), not written again;
* ``full rewrite``: ``full_every_steps=1``: every save writes everything, as before v3;
* ``adapter alone``: a model holding only the ``down``/``up`` modules (the same tensors) and
  the same optimizer: the time and bytes of writing the trainable state alone, the yardstick
  of the goals below.

Per round and method: one manual save (``Checkpointer.save``, synchronous, fsync'd; "save")
and one notice save (``request_checkpoint`` then ``step()`` until it returns True: the
emergency save at the very step boundary where the notice is heard; "notice to commit").
Bytes per save are the manifest's ``total_bytes`` (the files that step wrote; references
excluded), read back after each save. The first save of each method (which writes the base
in every mode) is reported apart; the later ones give the medians.

Backends: a local disk directory (``--dir``), tmpfs (``/dev/shm``) and S3 (versitygw on
127.0.0.1, as ``bench/s3.py``; skipped with the reason printed when its binary cannot be had,
or with ``--skip-s3``).

Goals (issue 27): after the first write, an incremental save writes <= 1.1x the bytes of the
trainable state and takes <= 1.2x the time of writing those bytes alone ("adapter alone").

``--quick``: a 64 MiB base and 2 rounds, about half a minute: checks that the script runs,
its figures mean little. Not a test: nothing here passes or fails.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

MiB = 2**20
BUCKET = "bench"
METHODS = ("incremental", "full rewrite", "adapter alone")


class LoRALinear(nn.Module):
    """``base(x) + up(down(x))``: a frozen square weight and a trainable low-rank pair."""

    def __init__(self, d: int, rank: int, dtype: torch.dtype, gen: torch.Generator) -> None:
        super().__init__()
        self.base = nn.Linear(d, d, bias=False, device="meta", dtype=dtype)
        self.base.weight = nn.Parameter(
            (torch.randn(d, d, generator=gen) * d**-0.5).to(dtype), requires_grad=False
        )
        self.down = nn.Linear(d, rank, bias=False)
        self.up = nn.Linear(rank, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.base.weight
        return (x.to(w.dtype) @ w.T).float() + self.up(self.down(x))


class Adapted(nn.Module):
    def __init__(self, layers: int, d: int, rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.layers = nn.ModuleList(LoRALinear(d, rank, dtype, gen) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class AdapterOnly(nn.Module):
    """The adapter modules of ``model`` (the very same parameters), without the base."""

    def __init__(self, model: Adapted) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleDict({"down": layer.down, "up": layer.up})
            for layer in model.layers
            if isinstance(layer, LoRALinear)
        )


def nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class Figures:
    first_bytes: int = 0
    first_s: float = 0.0
    save_s: list[float] = field(default_factory=list)
    notice_s: list[float] = field(default_factory=list)
    later_bytes: list[int] = field(default_factory=list)


def train(model: Adapted, opt: torch.optim.Optimizer, d: int, gen: torch.Generator) -> None:
    opt.zero_grad()
    model(torch.randn(1, d, generator=gen)).square().mean().backward()
    opt.step()


def bench_backend(
    where: Callable[[str], str],
    model: Adapted,
    opt: torch.optim.Optimizer,
    reps: int,
    d: int,
) -> dict[str, Figures]:
    from trainer_sdk import Checkpointer
    from trainer_sdk.api import read_manifest

    common: dict[str, Any] = {"optimizer": opt, "keep_last": 1, "handle_sigterm": False}
    uris = {m: where(m.replace(" ", "-")) for m in METHODS}
    with_base = {"model": model, **common}
    cks = {
        "incremental": Checkpointer(uris["incremental"], full_every_steps=0, **with_base),
        "full rewrite": Checkpointer(uris["full rewrite"], full_every_steps=1, **with_base),
        "adapter alone": Checkpointer(uris["adapter alone"], model=AdapterOnly(model), **common),
    }
    figs = {m: Figures() for m in METHODS}
    gen = torch.Generator().manual_seed(1)
    try:
        train(model, opt, d, gen)
        for m in METHODS:  # the first save writes the base in every mode
            t0 = time.perf_counter()
            cks[m].save(1)
            figs[m].first_s = time.perf_counter() - t0
            figs[m].first_bytes = read_manifest(uris[m], 1).total_bytes
        for r in range(reps):
            order = METHODS[r % 3 :] + METHODS[: r % 3]
            if r % 2:
                order = order[::-1]
            save_step, notice_step = 2 * r + 2, 2 * r + 3
            train(model, opt, d, gen)
            for m in order:
                t0 = time.perf_counter()
                cks[m].save(save_step)
                figs[m].save_s.append(time.perf_counter() - t0)
                figs[m].later_bytes.append(read_manifest(uris[m], save_step).total_bytes)
            train(model, opt, d, gen)
            for m in order:
                t0 = time.perf_counter()
                cks[m].request_checkpoint(reason="bench")
                stopped = cks[m].step(notice_step)
                figs[m].notice_s.append(time.perf_counter() - t0)
                assert stopped, "the notice was not served at the step boundary"
                figs[m].later_bytes.append(read_manifest(uris[m], notice_step).total_bytes)
    finally:
        for ck in cks.values():
            ck.close()
    return figs


def s3_server(base: Path) -> tuple[Any, str | None]:
    """A started versitygw and None, or None and why S3 is skipped."""
    from baton_testing.s3 import REGION, VersityServer, client_env, versitygw_binary

    try:
        binary = versitygw_binary()
    except (RuntimeError, OSError) as e:
        return None, f"no versitygw binary ({e}); `make build` builds it"
    server = VersityServer(binary=binary, root=tempfile.mkdtemp(dir=base, prefix="versitygw-"))
    server.start()
    os.environ.update(client_env(server.endpoint))
    import boto3

    boto3.client("s3", endpoint_url=server.endpoint, region_name=REGION).create_bucket(
        Bucket=BUCKET
    )
    return server, None


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def report(name: str, figs: dict[str, Figures], trainable: int) -> list[str]:
    alone = figs["adapter alone"]
    full = figs["full rewrite"]
    out = []
    for m in METHODS:
        f = figs[m]
        b = statistics.median(f.later_bytes)
        out.append(
            f"| {name} | {m} | {f.first_bytes / MiB:.1f} MiB, {f.first_s:.2f} s "
            f"| {b / MiB:.2f} MiB | {_med(f.save_s):.3f} s (max {max(f.save_s):.3f}) "
            f"| {_med(f.notice_s):.3f} s (max {max(f.notice_s):.3f}) "
            f"| {b / trainable:.2f}x | {_med(f.save_s) / _med(alone.save_s):.2f}x "
            f"| {_med(f.notice_s) / _med(alone.notice_s):.2f}x "
            f"| {statistics.median(full.later_bytes) / b:.0f}x "
            f"| {_med(full.save_s) / _med(f.save_s):.1f}x "
            f"| {_med(full.notice_s) / _med(f.notice_s):.1f}x |"
        )
    return out


def goals(name: str, figs: dict[str, Figures], trainable: int) -> str:
    inc, alone = figs["incremental"], figs["adapter alone"]
    b = max(inc.later_bytes) / trainable
    s = _med(inc.save_s) / _med(alone.save_s)
    n = _med(inc.notice_s) / _med(alone.notice_s)
    extra_s = 1e3 * (_med(inc.save_s) - _med(alone.save_s))
    extra_n = 1e3 * (_med(inc.notice_s) - _med(alone.notice_s))
    verdict = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    return (
        f"{name}: bytes {b:.3f}x the trainable state (largest later save; goal <= 1.1x: "
        f"{verdict(b <= 1.1)}); time {s:.2f}x (save) and {n:.2f}x (notice to commit) the "
        f"adapter alone, {extra_s:+.0f} ms and {extra_n:+.0f} ms (goal <= 1.2x: "
        f"{verdict(s <= 1.2 and n <= 1.2)})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-mib", type=float, default=1024.0, help="frozen base, MiB")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--rank", type=int, default=8, help="adapter rank")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=4, help="rounds after the first save")
    ap.add_argument("--dir", default="/work/bench-tmp", help="the local disk's directory")
    ap.add_argument("--shm", default="/dev/shm", help="the tmpfs directory")
    ap.add_argument("--skip-s3", action="store_true")
    ap.add_argument("--quick", action="store_true", help="a 64 MiB base, 2 rounds: a smoke run")
    args = ap.parse_args()
    if args.quick:
        args.base_mib, args.reps = 64.0, 2
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    logging.getLogger("trainer_sdk").setLevel(logging.ERROR)  # a notice save logs a WARNING
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    elsize = torch.empty((), dtype=dtype).element_size()
    d = int(math.sqrt(args.base_mib * MiB / args.layers / elsize)) // 64 * 64
    model = Adapted(args.layers, d, args.rank, dtype)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    train(model, opt, d, torch.Generator().manual_seed(2))  # the optimizer state exists
    base_bytes = nbytes(p for p in model.parameters() if not p.requires_grad)
    adapter_bytes = nbytes(p for p in model.parameters() if p.requires_grad)
    opt_bytes = nbytes(v for s in opt.state.values() for v in s.values())
    trainable = adapter_bytes + opt_bytes

    disk = Path(args.dir)
    disk.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=disk, prefix="incremental-"))
    shm = Path(tempfile.mkdtemp(dir=args.shm, prefix="baton-incremental-"))
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    results: dict[str, dict[str, Figures]] = {}
    skipped: list[str] = []
    try:
        for name, root in (("local disk", work / "disk"), ("tmpfs", shm)):
            print(f"==> {name} ({args.reps} rounds)", file=sys.stderr)
            results[name] = bench_backend(
                lambda m, root=root: str(root / m), model, opt, args.reps, d
            )
        if args.skip_s3:
            skipped.append("S3 skipped: --skip-s3")
        else:
            server, why = s3_server(work)
            if server is None:
                skipped.append(f"S3 skipped: {why}")
                print(f"==> {skipped[-1]}", file=sys.stderr)
            else:
                try:
                    print(f"==> S3, versitygw ({args.reps} rounds)", file=sys.stderr)
                    results["S3 (versitygw)"] = bench_backend(
                        lambda m: f"s3://{BUCKET}/{m}", model, opt, args.reps, d
                    )
                finally:
                    server.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    load_after = os.getloadavg()
    print(
        f"\nFrozen base {base_bytes / MiB:.0f} MiB ({args.layers} x {d}x{d} {args.dtype}), "
        f"adapter {adapter_bytes / MiB:.2f} MiB (rank {args.rank}, float32) + AdamW state "
        f"{opt_bytes / MiB:.2f} MiB = trainable state {trainable / MiB:.2f} MiB. One process, "
        f"{args.reps} rounds (a save and a notice save per method each, interleaved), medians "
        f"(max); {time.perf_counter() - t_start:.0f} s in all. Load average "
        f"{load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f} before, "
        f"{load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} after.\n"
    )
    print(
        "| backend | method | first save | bytes per later save | save | notice to commit "
        "| bytes / trainable state | save / adapter alone | notice / adapter alone "
        "| full / this, bytes | full / this, save | full / this, notice |"
    )
    print("|---" * 12 + "|")
    for name, figs in results.items():
        print("\n".join(report(name, figs, trainable)))
    print()
    for name, figs in results.items():
        print(goals(name, figs, trainable))
    for line in skipped:
        print(line)


if __name__ == "__main__":
    main()
