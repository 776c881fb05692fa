"""Runs of ``tests/integrations/hf_train.py`` (a Hugging Face Trainer script on BatonTrainer)
and the exact comparisons of their results.

Shared by the local torchrun tests (``tests/integrations/test_hf_trainer_resume.py``) and the
operator test (``tests/integrations/test_hf_operator_cluster.py``), which compare against one
uninterrupted run. Every micro-batch loss is logged as ``float.hex`` per rank
(``losses-<rank>.jsonl``); rank 0 writes ``final.safetensors`` (weights, AdamW state, learning
rates) and ``log_history.json`` at the end.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from baton_testing import torchrun
from safetensors.torch import load_file

REPO = torchrun.REPO
SCRIPT = REPO / "tests" / "integrations" / "hf_train.py"
SFT_SCRIPT = REPO / "tests" / "integrations" / "sft_train.py"
"""A TRL SFTTrainer fine-tune through ``baton_trainer`` (same hooks and outputs as SCRIPT)."""
RUN_TIMEOUT_S = 300.0
STEPS = 18
"""Optimizer steps of the whole run: 3 epochs of 6 (see hf_train.py)."""
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def start(
    out: Path, *, nproc: int = 2, script: Path = SCRIPT, **env: str
) -> subprocess.Popen[bytes]:
    """torchrun with ``nproc`` local workers of ``script``, checkpointing to ``out/ckpt``."""
    out.mkdir(parents=True, exist_ok=True)
    full_env = (
        torchrun.clean_env()
        | OFFLINE_ENV
        | {"HF_TEST_OUT": str(out), "BATON_CHECKPOINT_URI": str(out / "ckpt")}
        | env
    )
    return torchrun.launch(
        [str(script)], log=out / "torchrun.log", nproc=nproc, env=full_env, cwd=out
    )


def kill_job(proc: subprocess.Popen[bytes], out: Path) -> None:
    """SIGKILL torchrun and its workers, found under it and by the pids they wrote."""
    pids = [int(p.read_text()) for p in out.glob("pid-*")]
    torchrun.kill(proc, also=pids)
    for p in out.glob("pid-*"):
        p.unlink()


def finish(proc: subprocess.Popen[bytes], out: Path) -> int:
    return torchrun.finish(proc, out / "torchrun.log", timeout=RUN_TIMEOUT_S)


def run_until_hang(out: Path, step: int, *, nproc: int = 2, **env: str) -> None:
    """Run until every rank finished optimizer step ``step``, then SIGKILL the whole job."""
    for marker in out.glob("hang-*"):
        marker.unlink()
    proc = start(out, nproc=nproc, HF_TEST_HANG_AT=str(step), **env)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not all((out / f"hang-{r}").exists() for r in range(nproc)):
        if proc.poll() is not None:
            kill_job(proc, out)
            pytest.fail(f"the run exited ({proc.returncode}) before step {step}:\n{tail(out)}")
        if time.monotonic() > deadline:
            kill_job(proc, out)
            pytest.fail(f"step {step} not reached in {RUN_TIMEOUT_S}s:\n{tail(out)}")
        time.sleep(0.2)
    kill_job(proc, out)


def tail(out: Path) -> str:
    return torchrun.tail(out / "torchrun.log")


def run(out: Path, *, nproc: int = 2, script: Path = SCRIPT, **env: str) -> int:
    return finish(start(out, nproc=nproc, script=script, **env), out)


def losses(out: Path, rank: int) -> list[tuple[int, str]]:
    """(optimizer step, exact loss) of every micro-batch ``rank`` trained, in order."""
    lines = (out / f"losses-{rank}.jsonl").read_text().splitlines()
    return [(e["step"], e["loss"]) for e in map(json.loads, lines)]


def by_step(entries: list[tuple[int, str]]) -> dict[int, list[str]]:
    found: dict[int, list[str]] = {}
    for step, loss in entries:
        found.setdefault(step, []).append(loss)
    return found


def steps(entries: list[tuple[int, str]], ref: dict[int, list[str]]) -> list[int]:
    """Cut a loss log into optimizer steps (each run starts at a step boundary), checking that
    every appearance of a step, replays included, logged the reference's exact losses."""
    found: list[int] = []
    i = 0
    while i < len(entries):
        step = entries[i][0]
        assert step in ref, f"step {step} is not in the reference run"
        n = len(ref[step])
        chunk = entries[i : i + n]
        assert [s for s, _ in chunk] == [step] * n, f"step {step} logged partially: {chunk}"
        assert [loss for _, loss in chunk] == ref[step], f"step {step} losses differ"
        found.append(step)
        i += n
    return found


def assert_same_final(out: Path, ref: Path) -> None:
    """Final weights, AdamW state, learning rates (bit for bit) and the Trainer's log history
    equal the reference's."""
    got, want = load_file(str(out / "final.safetensors")), load_file(str(ref / "final.safetensors"))
    assert got.keys() == want.keys()
    assert any(k.startswith("optim.") for k in want)  # optimizer state is compared too
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype
        as_int = _int_of(tensor)
        assert got[key].view(-1).view(dtype=as_int).equal(tensor.view(-1).view(dtype=as_int)), (
            f"{key} differs"
        )
    assert json.loads((out / "log_history.json").read_text()) == json.loads(
        (ref / "log_history.json").read_text()
    )


def _int_of(t: Any) -> Any:
    import torch

    return {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()]
