"""A stock Lightning script under torchrun with Baton's CheckpointIO and Callback (issue 28,
item 2).

Three DDP ranks (gloo: sums over three are order-sensitive) of ``lightning_train.py``, 2
epochs of 6 optimizer steps, a periodic save every 4. SIGTERM to rank 1 alone mid-epoch, or a
sidecar's request in the control directory: every rank saves the same step and exits 75; the
relaunch resumes mid-epoch and ends with weights, AdamW state, learning rate and every
micro-batch loss (and the samples it was computed on) bitwise equal to a run never
interrupted (the sidecar's run with the memory tier's variables set: one warning, no tier).
SIGKILL of the whole job after a periodic save, twice: each relaunch resumes from the newest
periodic save, replays exactly the steps after it, and ends bitwise equal too.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
from baton_testing import hf_runs

from trainer_sdk.control import ControlChannel
from trainer_sdk.format.layout import step_dir

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SCRIPT = Path(__file__).with_name("lightning_train.py")
NPROC = 3
STEPS = 12


def _start(out: Path, **env: str) -> subprocess.Popen[bytes]:
    return hf_runs.start(out, nproc=NPROC, script=SCRIPT, LT_TEST_OUT=str(out), **env)


def _run(out: Path, **env: str) -> int:
    return hf_runs.finish(_start(out, **env), out)


def _losses(out: Path, rank: int) -> list[list[object]]:
    """[step, float.hex of the loss, sample ids] of every micro-batch ``rank`` trained."""
    return [json.loads(line) for line in (out / f"losses-{rank}.jsonl").read_text().splitlines()]


def _final(out: Path, rank: int) -> dict[str, object]:
    return dict(json.loads((out / f"final-{rank}.json").read_text()))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lightning-reference")
    assert _run(out) == 0, hf_runs.tail(out)
    for rank in range(NPROC):
        assert [e[0] for e in _losses(out, rank)] == list(range(1, STEPS + 1))
    return out


def _stopped_at(run: Path, control: Path, code: int, *, step: int, trigger: str) -> None:
    """Every rank saved ``step`` (``trigger``), reported it committed to the sidecar and
    exited 75 (torchrun's own exit: 1, as when a worker fails)."""
    log = hf_runs.tail(run)
    assert code == 1, log
    assert [int(c) for c in re.findall(r"exitcode  : (-?\d+)", log)] == [75] * NPROC, log
    manifest = json.loads((run / "ckpt" / step_dir(step) / "manifest.json").read_text())
    assert manifest["trigger"] == trigger
    for rank in range(NPROC):
        assert _losses(run, rank)[-1][0] == step, "every rank stopped after the saved step"
    channel = ControlChannel(control)
    for local_rank in range(NPROC):  # each local rank's report to the sidecar
        status = channel.read_local_status(local_rank)
        assert status is not None, local_rank
        got = (status.state.value, status.step, status.last_committed_step, status.trigger)
        assert got == ("committed", step, step, trigger), (local_rank, status)


def _resumes_bitwise(run: Path, reference: Path, **env: str) -> None:
    assert _run(run, **env) == 0, hf_runs.tail(run)  # every rank exits 0: torchrun says so
    assert "Restoring states from the checkpoint path at" in hf_runs.tail(run)
    for rank in range(NPROC):
        assert _final(run, rank) == _final(reference, rank), f"rank {rank}"
        # Same steps, same losses bit for bit, on the same samples: none replayed or skipped.
        assert _losses(run, rank) == _losses(reference, rank), f"rank {rank}"


@pytest.mark.parametrize("io", ["sync", "async"])
def test_sigterm_to_one_rank_saves_one_step_exits_75_and_resumes_bitwise(
    tmp_path: Path, reference: Path, io: str
) -> None:
    # async: Lightning's AsyncCheckpointIO; the periodic saves of steps 4 and 8 commit in rank
    # 0's writer thread while training goes on, and the notice's save of step 9 waits for them.
    mode = {"LT_TEST_ASYNC": "1"} if io == "async" else {}
    run = tmp_path / "run"
    control = tmp_path / "control"
    control.mkdir()
    code = _run(run, LT_TEST_SIGTERM_AT="9", BATON_CONTROL_DIR=str(control), **mode)
    steps = sorted(int(p.name.removeprefix("step-")) for p in (run / "ckpt").glob("step-*"))
    assert steps == [4, 8, 9], f"periodic saves at 4 and 8, the notice's at 9: {steps}"
    _stopped_at(run, control, code, step=9, trigger="signal")
    _resumes_bitwise(run, reference, **mode)


def test_a_sidecar_request_mid_epoch_saves_that_step_on_every_rank_and_resumes_bitwise(
    tmp_path: Path, reference: Path
) -> None:
    run = tmp_path / "run"
    control = tmp_path / "control"
    control.mkdir()
    # With the operator's memory-tier variables (fastEverySteps) set: the integration takes no
    # snapshots, so no rank builds a tier (it would create fast_dir), one rank says so, and the
    # notice is served on the durable tier as without them.
    fast = tmp_path / "fast"
    code = _run(
        run, LT_TEST_REQUEST_AT="5", BATON_CONTROL_DIR=str(control),
        BATON_FAST_DIR=str(fast), BATON_FAST_EVERY_STEPS="1",
    )  # fmt: skip
    steps = sorted(int(p.name.removeprefix("step-")) for p in (run / "ckpt").glob("step-*"))
    assert steps == [4, 5], steps
    _stopped_at(run, control, code, step=5, trigger="notice")
    log = (run / "torchrun.log").read_text(errors="replace")
    assert log.count("fastEverySteps has no effect for this job") == 1, hf_runs.tail(run)
    assert not fast.exists()
    assert ControlChannel(control).read_request() is None, "the served request was cleared"
    _resumes_bitwise(run, reference)


def _kill_when_hung(run: Path, **env: str) -> None:
    """Start the job, wait until every rank hangs at ``LT_TEST_HANG_AT``, SIGKILL it whole."""
    for hung in run.glob("hung-*"):
        hung.unlink()
    proc = _start(run, **env)
    deadline = time.monotonic() + hf_runs.RUN_TIMEOUT_S
    while not all((run / f"hung-{rank}").exists() for rank in range(NPROC)):
        assert proc.poll() is None, hf_runs.tail(run)
        assert time.monotonic() < deadline, hf_runs.tail(run)
        time.sleep(0.2)
    hf_runs.kill_job(proc, run)


def test_sigkill_twice_after_periodic_saves_resumes_bitwise(
    tmp_path: Path, reference: Path
) -> None:
    run = tmp_path / "run"
    _kill_when_hung(run, LT_TEST_HANG_AT="6")
    steps = sorted(int(p.name.removeprefix("step-")) for p in (run / "ckpt").glob("step-*"))
    assert steps == [4], steps
    _kill_when_hung(run, LT_TEST_HANG_AT="10")  # resumed from step 4, killed again
    steps = sorted(int(p.name.removeprefix("step-")) for p in (run / "ckpt").glob("step-*"))
    assert steps == [4, 8], steps
    assert _run(run) == 0, hf_runs.tail(run)
    for rank in range(NPROC):
        assert _final(run, rank) == _final(reference, rank), f"rank {rank}"
        ref = _losses(reference, rank)
        # Steps 5-6 trained, killed, trained again from step 4; 5-10 trained, killed, 9-12
        # trained again from step 8: each time with the uninterrupted run's exact losses.
        assert _losses(run, rank) == ref[:6] + ref[4:10] + ref[8:], f"rank {rank}"
