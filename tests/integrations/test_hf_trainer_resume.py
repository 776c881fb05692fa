"""BatonTrainer: a Hugging Face Trainer run on 2 gloo ranks under torchrun, preempted for real,
ends bitwise equal to a run that was never interrupted.

The script (``hf_train.py``) is a stock fine-tune of a tiny LlamaForCausalLM built from a
LlamaConfig (attention dropout on, AdamW, cosine schedule with warmup, gradient accumulation
with a short last group in every epoch, shuffled data). Every micro-batch loss is logged
exactly (float.hex) on every rank; the final weights, optimizer state and learning rates are
saved by rank 0 at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

SCRIPT = Path(__file__).with_name("hf_train.py")
REPO = SCRIPT.parents[2]
RUN_TIMEOUT_S = 300.0


def _start(out: Path, **env: str) -> subprocess.Popen[bytes]:
    out.mkdir(parents=True, exist_ok=True)
    full_env = {
        **os.environ,
        "HF_TEST_OUT": str(out),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
        **env,
    }
    with (out / "torchrun.log").open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc-per-node=2", "--max-restarts=0", str(SCRIPT)],
            env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


def _kill_job(proc: subprocess.Popen[bytes], out: Path) -> None:
    """SIGKILL torchrun and its workers (each in a session of its own, so killed by pid)."""
    pids = [int(p.read_text()) for p in out.glob("pid-*")]
    for pgid in [proc.pid, *pids]:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
    proc.wait(timeout=60)
    for pid in pids:  # the workers are torchrun's children: gone once torchrun is reaped
        deadline = time.monotonic() + 60
        while Path(f"/proc/{pid}").exists() and _state(pid) != "Z":
            assert time.monotonic() < deadline, f"worker {pid} survived SIGKILL"
            time.sleep(0.1)
    for p in out.glob("pid-*"):
        p.unlink()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return "Z"


def _finish(proc: subprocess.Popen[bytes], out: Path) -> int:
    try:
        return proc.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _kill_job(proc, out)
        pytest.fail(f"torchrun ran past {RUN_TIMEOUT_S}s:\n{_tail(out)}")


def _tail(out: Path) -> str:
    return (out / "torchrun.log").read_text(errors="replace")[-6000:]


def _run(out: Path, **env: str) -> int:
    return _finish(_start(out, **env), out)


def _run_until_hang(out: Path, step: int) -> None:
    """Run until every rank finished optimizer step ``step``, then SIGKILL the whole job."""
    for marker in out.glob("hang-*"):
        marker.unlink()
    proc = _start(out, HF_TEST_HANG_AT=str(step))
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not all((out / f"hang-{r}").exists() for r in (0, 1)):
        if proc.poll() is not None:
            _kill_job(proc, out)
            pytest.fail(f"the run exited ({proc.returncode}) before step {step}:\n{_tail(out)}")
        if time.monotonic() > deadline:
            _kill_job(proc, out)
            pytest.fail(f"step {step} not reached in {RUN_TIMEOUT_S}s:\n{_tail(out)}")
        time.sleep(0.2)
    _kill_job(proc, out)


def _losses(out: Path, rank: int) -> list[tuple[int, str]]:
    lines = (out / f"losses-{rank}.jsonl").read_text().splitlines()
    return [(e["step"], e["loss"]) for e in map(json.loads, lines)]


def _steps(
    entries: list[tuple[int, str]], ref: dict[int, list[str]]
) -> list[tuple[int, list[str]]]:
    """Cut a loss log into optimizer steps (each run starts at a step boundary), checking that
    every appearance of a step, replays included, logged the reference's exact losses."""
    steps: list[tuple[int, list[str]]] = []
    i = 0
    while i < len(entries):
        step = entries[i][0]
        n = len(ref[step])
        chunk = entries[i : i + n]
        assert [s for s, _ in chunk] == [step] * n, f"step {step} logged partially: {chunk}"
        assert [loss for _, loss in chunk] == ref[step], f"step {step} losses differ"
        steps.append((step, ref[step]))
        i += n
    return steps


def _by_step(entries: list[tuple[int, str]]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for step, loss in entries:
        out.setdefault(step, []).append(loss)
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf-reference")
    assert _run(out) == 0, _tail(out)
    return out


def _assert_same_final(out: Path, ref: Path) -> None:
    got, want = load_file(str(out / "final.safetensors")), load_file(str(ref / "final.safetensors"))
    assert got.keys() == want.keys()
    assert any(k.startswith("optim.") for k in want)  # optimizer state is compared too
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype
        assert (
            got[key]
            .view(-1)
            .view(dtype=_int_of(tensor))
            .equal(tensor.view(-1).view(dtype=_int_of(tensor)))
        ), f"{key} differs"
    assert json.loads((out / "log_history.json").read_text()) == json.loads(
        (ref / "log_history.json").read_text()
    )


def _int_of(t: Any) -> Any:
    import torch

    return {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()]


def test_sigkill_mid_epoch_twice_resumes_bitwise(reference: Path, tmp_path: Path) -> None:
    # save_steps=3 and 6 optimizer steps per epoch: killed after step 4 (epoch 0) and step 11
    # (epoch 1), resumed from steps 3 and 9, both in the middle of an epoch.
    _run_until_hang(tmp_path, 4)
    _run_until_hang(tmp_path, 11)
    assert _run(tmp_path) == 0, _tail(tmp_path)
    _assert_same_final(tmp_path, reference)
    for rank in (0, 1):
        ref = _by_step(_losses(reference, rank))
        assert sorted(ref) == list(range(1, 19))
        steps = [s for s, _ in _steps(_losses(tmp_path, rank), ref)]
        # every step trained, and the only replays are the steps after each checkpoint
        assert steps == [1, 2, 3, 4, *range(4, 12), *range(10, 19)]


def test_sigterm_to_one_rank_saves_the_last_step_and_replays_nothing(
    reference: Path, tmp_path: Path
) -> None:
    # Rank 1 alone gets SIGTERM after step 4 (no periodic save at 4 or 5). The ranks agree on
    # it at a step boundary, save that step, and stop; torchrun reports the exit 75.
    code = _run(tmp_path, HF_TEST_SIGTERM_AT="4")
    assert code == 1, _tail(tmp_path)
    assert "exitcode  : 75" in _tail(tmp_path)
    last = {rank: max(s for s, _ in _losses(tmp_path, rank)) for rank in (0, 1)}
    saved = max(int(p.name.removeprefix("step-")) for p in (tmp_path / "ckpt").glob("step-*"))
    manifest = json.loads((tmp_path / "ckpt" / f"step-{saved:012d}" / "manifest.json").read_text())
    assert manifest["trigger"] == "signal"
    assert last == {0: saved, 1: saved}, "the notice save is of the last step trained"
    assert saved in (4, 5)

    assert _run(tmp_path) == 0, _tail(tmp_path)
    _assert_same_final(tmp_path, reference)
    for rank in (0, 1):
        ref = _by_step(_losses(reference, rank))
        steps = [s for s, _ in _steps(_losses(tmp_path, rank), ref)]
        assert steps == list(range(1, 19)), "a step was replayed or skipped"
