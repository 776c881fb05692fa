"""Exactness beyond two ranks: 3 and 4 gloo ranks (DDP and FSDP2), one rank SIGKILLed or
SIGTERMed mid-run, resumed: per-step losses of every rank and the final weights, optimizer,
scheduler, scaler and sampler state are bitwise equal to an uninterrupted run.

With two ranks a gradient sum ``a + b`` is the same in either order, so only three or more
ranks show a reduction whose order changed across a resume. DDP reduces its first iteration
after construction with its initial bucket layout and only then rebuilds the buckets in
gradient-ready order; without ``trainer_sdk/loop/_ddp.py`` the first step after every resume was
summed in other positions than the uninterrupted run's, and the runs drifted apart by a last
bit a few steps later. The trainer is ``baton_testing.trainer``.

The shape ``ddp-3-staged`` saves in the background with the staging copy beside the next steps
(``stage_in_background``) and is held to the plain ``ddp-3`` reference: how a run saves must
not change how it trains.

Each shape runs one chain: SIGTERM to one rank, a resume from the agreed save, SIGKILL of
another rank in the resumed run, a resume to the end. Every segment is compared with the
reference, so both interruptions are checked in one set of runs instead of two (one trainer
start of 3-4 processes fewer per shape).
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
    # Periodic saves whose copy of the parameters and optimizer state runs beside the next
    # forward and backward, the optimizer's step waiting for it (stage_in_background).
    "ddp-3-staged": (3, ("--async-save", "--stage-in-background")),
}

_SAVE_ONLY = ("--async-save", "--stage-in-background")


@pytest.fixture(scope="module", params=sorted(SHAPES))
def shape(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, tuple[str, ...], dict[str, Any]]:
    world, extra = SHAPES[request.param]
    # How a run saves must not change how it trains: a shape that differs only in that is
    # held to the reference of its plain shape (a run with no background saves at all).
    trains_as = tuple(a for a in extra if a not in _SAVE_ONLY)
    ref = exactness.reference(
        tmp_path_factory.mktemp(f"reference-{request.param}"), world=world, extra=trains_as
    )
    return world, extra, ref


def _rng() -> random.Random:
    seed = int(os.environ.get("BATON_TEST_SEED", time.time_ns() % 10**6))
    print(f"BATON_TEST_SEED={seed}")
    return random.Random(seed)


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


def test_sigterm_then_sigkill_of_one_rank_resume_bitwise_exact(
    tmp_path: Path, shape: tuple[int, tuple[str, ...], dict[str, Any]]
) -> None:
    world, extra, ref = shape
    rng = _rng()
    args = exactness.args(tmp_path, *extra, "--sleep", "0.03")

    # SIGTERM: late enough that DDP has rebuilt its buckets and saved, early enough to leave
    # the resumed run room for its SIGKILL.
    target = rng.randrange(6, 12)
    run = trainer.launch(world, args, workdir=tmp_path / "out")
    exactness.wait_for_step(tmp_path, target, run)
    run.signal(world - 1, signal.SIGTERM)  # the notice reaches one rank only
    codes = run.wait(exactness.RUN_TIMEOUT)
    assert codes == [EXIT_STOPPED_AFTER_NOTICE] * world, run.output()
    stopped = json.loads((tmp_path / "result.json").read_text())
    assert stopped["stopped"], stopped
    saved = int(stopped["step"])
    assert target <= saved < exactness.STEPS - 6, stopped
    (tmp_path / "result.json").unlink()

    # SIGKILL in the resumed run: one process lost without notice, wherever it was. The
    # others must notice the lost peer in their next collective and fail on their own, not
    # hang (the trainer's collective timeout bounds it).
    kill_at = rng.randrange(saved + 1, exactness.STEPS - 5)
    run = trainer.launch(world, args, workdir=tmp_path / "out")
    exactness.wait_for_step(tmp_path, kill_at, run)
    run.signal(1, signal.SIGKILL)
    codes = run.wait(exactness.RUN_TIMEOUT)
    assert f"RESUMED_FROM {saved}" in run.output(0), run.output(0)
    assert codes[1] == -signal.SIGKILL
    assert all(c != 0 for c in codes), run.output()
    assert not (tmp_path / "result.json").exists()

    _finish(tmp_path, world, extra, ref)
