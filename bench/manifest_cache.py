"""Benchmark: what the manifest cache saves a commit of an incremental step (issue 27).

    .venv/bin/python bench/manifest_cache.py [--rounds 25] [--dir /dev/shm]

A frozen bfloat16 base (8 layers of 2048x2048, 64 MiB) with a trainable rank-8 adapter per
layer and AdamW, one process. Two Checkpointers (``keep_last=2``) save the same model under
their own roots, interleaved save by save (the order alternates every round): one as the SDK
runs (parsed manifests of committed steps cached, ``_catalog._ManifestCache``), one with the
cache off (``_catalog._version_of`` answers None, as for a storage without ``version``, so
every read reads and parses the manifest again). Every save after the first is incremental.
Prints the median wall and CPU (``time.process_time``) seconds of a save, and their ratio;
CPU time moves less than wall time on a shared machine. Not a test: nothing passes or fails.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from trainer_sdk import Checkpointer
from trainer_sdk.format import _catalog


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--dir", default="/dev/shm", help="where the two roots go (tmpfs)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.manual_seed(0)
    base = nn.ModuleList(nn.Linear(2048, 2048, bias=False, dtype=torch.bfloat16) for _ in range(8))
    for p in base.parameters():
        p.requires_grad_(False)
    lora = nn.ModuleList(
        nn.Sequential(nn.Linear(2048, 8, bias=False), nn.Linear(8, 2048, bias=False))
        for _ in range(8)
    )
    model = nn.ModuleDict({"base": base, "lora": lora})
    opt = torch.optim.AdamW(lora.parameters(), lr=1e-3)
    real = _catalog._version_of

    def off(storage: Any) -> Callable[[str], str] | None:
        return None

    modes: dict[str, Any] = {"cache": real, "no cache": off}
    times: dict[str, tuple[list[float], list[float]]] = {m: ([], []) for m in modes}
    roots = {m: tempfile.mkdtemp(dir=args.dir, prefix="baton-mcache-") for m in modes}
    load_before = os.getloadavg()
    cks = {
        m: Checkpointer(roots[m], model=model, optimizer=opt, keep_last=2, handle_sigterm=False)
        for m in modes
    }
    try:
        step = 0
        for rnd in range(args.rounds):
            for m in list(modes) if rnd % 2 else list(modes)[::-1]:
                step += 1
                opt.zero_grad()
                x = torch.randn(4, 2048)
                torch.stack([a(x).sum() for a in lora]).sum().backward()
                opt.step()
                _catalog._version_of = modes[m]
                wall, cpu = time.perf_counter(), time.process_time()
                cks[m].save(step)
                if rnd > 0:  # the first save of each writes the base
                    times[m][0].append(time.perf_counter() - wall)
                    times[m][1].append(time.process_time() - cpu)
    finally:
        _catalog._version_of = real
        for ck in cks.values():
            ck.close()
        for r in roots.values():
            shutil.rmtree(r, ignore_errors=True)
    med = {m: (statistics.median(w), statistics.median(c)) for m, (w, c) in times.items()}
    for m, (w, c) in med.items():
        print(
            f"{m}: a save {w * 1e3:.1f} ms wall, {c * 1e3:.1f} ms CPU "
            f"(medians of {len(times[m][0])})"
        )
    (wc, cc), (wn, cn) = med["cache"], med["no cache"]
    print(
        f"cache / no cache: {wc / wn:.2f}x wall ({(wc - wn) * 1e3:+.1f} ms), "
        f"{cc / cn:.2f}x CPU ({(cc - cn) * 1e3:+.1f} ms). Load average "
        f"{' '.join(f'{x:.2f}' for x in load_before)} before, "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} after."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
