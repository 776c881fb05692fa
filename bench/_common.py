"""Pieces that more than one benchmark in ``bench/`` uses: the state, the training step, the
machine's load and an fsync of a saved tree.

Kept here so that ``async_save.py`` and ``anchors.py`` time the same step on the same state
(a change to one changes both). The scripts run as ``python bench/NAME.py``, so this folder is
on ``sys.path`` and ``import _common`` finds this file.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def tensor_state(total_bytes: int, tensors: int = 16) -> dict[str, torch.Tensor]:
    """``tensors`` float32 tensors of ``total_bytes`` together, each shaped (rows, 1024)."""
    per = total_bytes // tensors // 4
    return {f"p{i}": torch.randn(per // 1024, 1024) for i in range(tensors)}


def train_step(w: torch.Tensor, x: torch.Tensor) -> None:
    """A compute-bound step: 4 matmuls of 768x768 and a reduction (about 40 ms on one thread
    of this machine's cores), then a host read of the result, as a loss.item() would."""
    y = x
    for _ in range(4):
        y = torch.tanh(y @ w)
    float(y.sum())


def python_bound_step(w: torch.Tensor, x: torch.Tensor) -> None:
    """A step of about 45 ms spent in thousands of small tensor operations: a Python-bound
    loop that takes the GIL at every operation, as a GPU trainer's kernel-launch thread does
    (``w`` and ``x`` are ignored; the operand is a 64-element vector)."""
    y = _SMALL
    for _ in range(_small_ops()):
        y = (y * 1.0001 + 0.5).relu_()
    float(y.sum())


_SMALL = torch.randn(64)
_SMALL_OPS: list[int] = []


def _small_ops(target_s: float = 0.045) -> int:
    """How many small operations take ``target_s`` on this machine (measured once)."""
    if not _SMALL_OPS:
        t0 = time.perf_counter()
        for _ in range(2000):
            (_SMALL * 1.0001 + 0.5).relu_()
        _SMALL_OPS.append(max(1, int(2000 * target_s / (time.perf_counter() - t0))))
    return _SMALL_OPS[0]


def step_inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    return torch.randn(768, 768) / 30, torch.randn(768, 768)


def loadavg() -> str:
    """The first three fields of /proc/loadavg (1, 5 and 15 minutes)."""
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def fsync_tree(root: str | Path) -> None:
    """fsync every file and directory under ``root`` and ``root``'s parent: after this the
    tree is durable whatever its writer did. Cheap for files already fsync'd."""
    root = Path(root)
    for where, _, files in os.walk(root, topdown=False):
        for name in files:
            fd = os.open(os.path.join(where, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(where, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(root.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
