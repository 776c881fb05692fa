"""Exactness beyond two ranks: 3 and 4 gloo ranks (DDP and FSDP2), one rank SIGKILLed or
SIGTERMed mid-run, resumed: per-step losses of every rank and the final weights, optimizer,
scheduler, scaler and sampler state are bitwise equal to an uninterrupted run.

With two ranks a gradient sum ``a + b`` is the same in either order, so only three or more
ranks show a reduction whose order changed across a resume. DDP reduces its first iteration
after construction with its initial bucket layout and only then rebuilds the buckets in
gradient-ready order; without ``trainer_sdk/_ddp.py`` the first step after every resume was
summed in other positions than the uninterrupted run's, and the runs drifted apart by a last
bit a few steps later. The trainer is ``baton_testing.trainer``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from baton_testing import exactness, trainer

from trainer_sdk import EXIT_STOPPED_AFTER_NOTICE

# Real trainer processes, 3-4 ranks on 2 shared cores: minutes per shape.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]

SHAPES = {
    "ddp-3": (3, ()),
    "ddp-4": (4, ()),
    "fsdp2-3": (3, ("--fsdp",)),
    "fsdp2-4": (4, ("--fsdp",)),
}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def shape(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, tuple[str, ...], dict[str, Any]]:
    world, extra = SHAPES[request.param]
    ref = exactness.reference(
        tmp_path_factory.mktemp(f"reference-{request.param}"), world=world, extra=extra
    )
    return world, extra, ref


def _target() -> int:
    seed = int(os.environ.get("BATON_TEST_SEED", time.time_ns() % 10**6))
    print(f"BATON_TEST_SEED={seed}")
    # Late enough that DDP has rebuilt its buckets and saved, early enough to train on after.
    return random.Random(seed).randrange(6, exactness.STEPS - 6)


def _finish(tmp: Path, world: int, extra: tuple[str, ...], ref: dict[str, Any]) -> None:
    last = trainer.run(
        world,
        exactness.args(tmp, *extra),
        workdir=tmp / "out",
        timeout=exactness.RUN_TIMEOUT,
    )
    resumed = [line for line in last.output(0).splitlines() if line.startswith("RESUMED_FROM")]
    print(resumed)
    assert resumed, last.output(0)
    assert resumed[0] != "RESUMED_FROM 0", last.output(0)
    exactness.check_exact(tmp, ref)


def test_sigterm_to_one_rank_resumes_bitwise_exact(
    tmp_path: Path, shape: tuple[int, tuple[str, ...], dict[str, Any]]
) -> None:
    world, extra, ref = shape
    target = _target()
    run = trainer.launch(
        world, exactness.args(tmp_path, *extra, "--sleep", "0.03"), workdir=tmp_path / "out"
    )
    exactness.wait_for_step(tmp_path, target, run)
    run.signal(world - 1, signal.SIGTERM)  # the notice reaches one rank only
    codes = run.wait(exactness.RUN_TIMEOUT)
    assert codes == [EXIT_STOPPED_AFTER_NOTICE] * world, run.output()
    stopped = json.loads((tmp_path / "result.json").read_text())
    assert stopped["stopped"], stopped
    assert target <= stopped["step"] < exactness.STEPS, stopped
    (tmp_path / "result.json").unlink()
    _finish(tmp_path, world, extra, ref)


def test_sigkill_of_one_rank_resumes_bitwise_exact(
    tmp_path: Path, shape: tuple[int, tuple[str, ...], dict[str, Any]]
) -> None:
    world, extra, ref = shape
    target = _target()
    run = trainer.launch(
        world, exactness.args(tmp_path, *extra, "--sleep", "0.03"), workdir=tmp_path / "out"
    )
    exactness.wait_for_step(tmp_path, target, run)
    run.signal(1, signal.SIGKILL)  # one process lost without notice, wherever it was
    # The others must notice the lost peer in their next collective and fail on their own,
    # not hang (the trainer's collective timeout bounds it).
    codes = run.wait(exactness.RUN_TIMEOUT)
    assert codes[1] == -signal.SIGKILL
    assert all(c != 0 for c in codes), run.output()
    assert not (tmp_path / "result.json").exists()
    _finish(tmp_path, world, extra, ref)
