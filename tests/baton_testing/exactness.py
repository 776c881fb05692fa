"""Shared by the exactness and emergency-save tests: one uninterrupted reference run of
``baton_testing.trainer`` per pytest session and shape (world size, trainer options such as
``--fsdp``), and the bitwise comparison against it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from baton_testing import trainer

__all__ = ["RUN_TIMEOUT", "STEPS", "WORLD", "args", "check_exact", "reference", "wait_for_step"]

STEPS = 30
WORLD = 2
_BASE = ["--steps", str(STEPS), "--every-steps", "4", "--samples", "40", "--batch-size", "4"]
RUN_TIMEOUT = 600.0
"""Seconds a trainer run may take. A run takes seconds on an idle machine, but on 2 cores
shared with other work, each process gets a small slice and the start-up (torch imports,
process groups) alone has taken over two minutes."""
_cache: dict[str, dict[str, Any]] = {}


def args(tmp: Path, *extra: str) -> list[str]:
    """Trainer arguments for a run under ``tmp`` (checkpoints, loss logs, result)."""
    return [
        *_BASE,
        "--uri", str(tmp / "ck"),
        "--loss-log", str(tmp / "loss.log"),
        "--result", str(tmp / "result.json"),
        *extra,
    ]  # fmt: skip


def _log(tmp: Path, rank: int) -> Path:
    return tmp / ("loss.log" if rank == 0 else f"loss.log.rank{rank}")


def reference(tmp: Path, *, world: int = WORLD, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """The uninterrupted run on ``world`` ranks with trainer options ``extra`` (computed once
    per session and shape, in ``tmp`` the first time)."""
    key = f"ref/{world}/{' '.join(extra)}"
    if key not in _cache:
        trainer.run(world, args(tmp, *extra), workdir=tmp / "out", timeout=RUN_TIMEOUT)
        result = json.loads((tmp / "result.json").read_text())
        losses = {r: dict(trainer.read_loss_log(_log(tmp, r))) for r in range(world)}
        assert result["step"] == STEPS
        assert result["world_size"] == world
        assert not result["stopped"]
        assert all(sorted(v) == list(range(1, STEPS + 1)) for v in losses.values())
        _cache[key] = {"result": result, "losses": losses, "world": world}
    return _cache[key]


def check_exact(tmp: Path, ref: dict[str, Any]) -> None:
    """Every logged step of every segment of the run under ``tmp`` equals the reference
    bitwise, every step was trained, and the final state digests are equal."""
    for r in range(int(ref.get("world", WORLD))):
        lines = trainer.read_loss_log(_log(tmp, r))
        assert {s for s, _ in lines} == set(range(1, STEPS + 1)), f"rank {r} missed steps"
        for step, loss in lines:
            assert loss == ref["losses"][r][step], f"rank {r} step {step}: {loss} != reference"
    got = json.loads((tmp / "result.json").read_text())
    for key in ("params_sha256", "optimizer_sha256", "scheduler_sha256", "scaler_sha256"):
        assert got[key] == ref["result"][key], key
    assert got["sampler"] == ref["result"]["sampler"]
    assert got["step"] == STEPS


def wait_for_step(
    tmp: Path, step: int, run: trainer.TrainerRun, timeout: float = RUN_TIMEOUT
) -> None:
    """Wait until rank 0 has logged ``step`` (or later); fail if the trainer ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = trainer.read_loss_log(_log(tmp, 0))
        if lines and lines[-1][0] >= step:
            return
        if any(p.poll() is not None for p in run.procs):
            raise AssertionError(f"trainer ended before step {step}:\n{run.output()}")
        time.sleep(0.01)
    run.kill_all()
    raise AssertionError(f"step {step} not reached in {timeout}s:\n{run.output()}")
