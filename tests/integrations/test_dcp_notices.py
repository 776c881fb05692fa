"""A DCP training loop under torchrun with BatonNotices (issue 28, item 1's notice hook).

Three ranks of FSDP2 in one "pod" (torchrun, gloo), checkpointing through ``dcp.save`` with
Baton's writer. Rank 1 alone gets SIGTERM; every rank saves the same step and exits 75; the
relaunch resumes through ``dcp.load`` and ends bitwise equal to a run never interrupted, with
every rank's exit code checked.
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest
from baton_testing import hf_runs

from trainer_sdk.control import ControlChannel

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SCRIPT = Path(__file__).with_name("dcp_train.py")
NPROC = 3
STEPS = 12


def _run(out: Path, **env: str) -> int:
    return hf_runs.run(out, nproc=NPROC, script=SCRIPT, DCP_TEST_OUT=str(out),
                       DCP_TEST_STEPS=str(STEPS), **env)  # fmt: skip


def _losses(out: Path, rank: int) -> list[tuple[int, str]]:
    lines = (out / f"losses-{rank}.jsonl").read_text().splitlines()
    return [(int(s), h) for s, h in (json.loads(line) for line in lines)]


def test_sigterm_to_one_rank_of_a_dcp_loop_saves_one_step_and_resumes_bitwise(
    tmp_path: Path,
) -> None:
    ref = tmp_path / "ref"
    assert _run(ref) == 0, hf_runs.tail(ref)
    run = tmp_path / "run"
    control = tmp_path / "control"
    control.mkdir()
    code = _run(run, DCP_TEST_SIGTERM_AT="6", BATON_CONTROL_DIR=str(control))
    log = hf_runs.tail(run)
    assert code == 1, log  # torchrun's exit when a worker fails
    # Every rank's exit: 75 after the save, or SIGTERM from torchrun's agent, which stops the
    # remaining workers once the first one exits (its semantics, not Baton's); never another
    # code. That no rank was cut off before it reported the commit is checked on the status
    # files below.
    codes = [int(c) for c in re.findall(r"exitcode  : (-?\d+)", log)]
    assert len(codes) == NPROC, log
    assert set(codes) <= {75, -signal.SIGTERM}, log
    assert 75 in codes, log
    steps = sorted(int(p.name.removeprefix("step-")) for p in (run / "ckpt").glob("step-*"))
    assert steps == [4, 6], f"the periodic save at 4 and the notice's at 6: {steps}\n{log}"
    manifest = json.loads((run / "ckpt" / "step-000000000006" / "manifest.json").read_text())
    assert manifest["trigger"] == "signal"
    assert manifest["world_size"] == NPROC
    for rank in range(NPROC):
        assert max(s for s, _ in _losses(run, rank)) == 6, "every rank stopped after step 6"
    channel = ControlChannel(control)
    for local_rank in range(NPROC):  # each local rank's report to the sidecar
        status = channel.read_local_status(local_rank)
        assert status is not None, local_rank
        got = (status.state.value, status.step, status.last_committed_step, status.trigger)
        assert got == ("committed", 6, 6, "signal"), (local_rank, status)
    assert _run(run) == 0, hf_runs.tail(run)  # every rank exits 0: torchrun says so
    for rank in range(NPROC):
        final = json.loads((run / f"final-{rank}.json").read_text())
        assert final == json.loads((ref / f"final-{rank}.json").read_text()), f"rank {rank}"
        got = _losses(run, rank)
        assert [s for s, _ in got] == [*range(1, 7), *range(7, STEPS + 1)], "no step replayed"
        assert dict(got) == dict(_losses(ref, rank)), f"rank {rank}'s losses differ"
