"""Exactness: a run killed and restarted any number of times ends bitwise equal to one that was
never interrupted (2 ranks, gloo, DDP; dropout, AdamW, StepLR, GradScaler, shuffled sampler,
numpy and python noise in the data path). The trainer is ``baton_testing.trainer``."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

import pytest
from baton_testing import exactness, trainer

# Real trainer processes (2 ranks, several restarts): tens of seconds each on 2 cores.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return exactness.reference(tmp_path_factory.mktemp("reference"))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_sigkill_and_restart_is_bitwise_exact(
    tmp_path: Path, reference: dict[str, Any], async_save: bool
) -> None:
    seed = int(os.environ.get("BATON_TEST_SEED", time.time_ns() % 10**6))
    rng = random.Random(seed)
    print(f"BATON_TEST_SEED={seed}")
    extra = ["--async-save"] if async_save else []
    kill_at = sorted(rng.sample(range(6, exactness.STEPS - 2), 2))
    for target in kill_at:
        run = trainer.launch(
            exactness.WORLD,
            exactness.args(tmp_path, *extra, "--sleep", "0.03"),
            workdir=tmp_path / "out",
        )
        exactness.wait_for_step(tmp_path, target, run)
        run.kill_all()  # SIGKILL both ranks, wherever they are (maybe mid-save)
    trainer.run(
        exactness.WORLD,
        exactness.args(tmp_path, *extra),
        workdir=tmp_path / "out",
        timeout=exactness.RUN_TIMEOUT,
    )
    exactness.check_exact(tmp_path, reference)
