"""TRL's SFTTrainer through ``baton_trainer``: a fine-tune on 2 gloo ranks under torchrun,
SIGKILLed mid-run and resumed, ends bitwise equal to a run that was never interrupted.

The script (``sft_train.py``) is a stock SFTTrainer fine-tune (a tiny GPT-2 with dropout, a
tokenizer and a few rows of text built in the script, no download) whose trainer class is
``baton_trainer(SFTTrainer)``. Every micro-batch loss is logged exactly on every rank; rank 0
saves the final weights, AdamW state and learning rates, and the log history, whose TRL
metrics (``num_tokens``, a running count) must survive the resume too.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from baton_testing import hf_runs

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

STEPS = 6
"""Optimizer steps: 2 epochs of 3 (24 rows, 2 ranks, batch 2, accumulation 2)."""


def test_sft_sigkill_mid_run_resumes_bitwise(tmp_path: Path) -> None:
    ref = tmp_path / "reference"
    assert hf_runs.run(ref, script=hf_runs.SFT_SCRIPT) == 0, hf_runs.tail(ref)

    out = tmp_path / "killed"
    # save_steps=2: killed after step 3, the last step of epoch 0; resumed from step 2.
    proc = hf_runs.start(out, script=hf_runs.SFT_SCRIPT, HF_TEST_HANG_AT="3")
    deadline = time.monotonic() + hf_runs.RUN_TIMEOUT_S
    while not all((out / f"hang-{r}").exists() for r in (0, 1)):
        if proc.poll() is not None or time.monotonic() > deadline:
            hf_runs.kill_job(proc, out)
            pytest.fail(f"the run did not reach step 3 (exit {proc.returncode}):\n"
                        f"{hf_runs.tail(out)}")  # fmt: skip
        time.sleep(0.2)
    hf_runs.kill_job(proc, out)
    assert hf_runs.run(out, script=hf_runs.SFT_SCRIPT) == 0, hf_runs.tail(out)

    hf_runs.assert_same_final(out, ref)  # log history included: num_tokens kept its count
    for rank in (0, 1):
        want = hf_runs.by_step(hf_runs.losses(ref, rank))
        assert sorted(want) == list(range(1, STEPS + 1))
        steps = hf_runs.steps(hf_runs.losses(out, rank), want)
        assert steps == [1, 2, 3, 3, 4, 5, 6], "the resume replays exactly step 3"
