"""The Hugging Face Trainer script under the operator: one spot preemption, resumed bitwise.

``hf_train.py`` (a stock HF ``Trainer`` fine-tune of a tiny LlamaForCausalLM on BatonTrainer,
the same script the torchrun tests run) is the command of a 2-replica TrainingJob with
``maxFailures: 0``: one process per pod, given RANK/WORLD_SIZE/MASTER_ADDR and
``BATON_CHECKPOINT_URI`` by the operator, on gloo. After optimizer step ``HOLD_AT`` both ranks
wait (in a Trainer callback, before Baton's step boundary) until the test has given rank 1's
node an AWS spot notice and the operator has sent its checkpoint requests to the sidecars, so
that the notice always lands mid-run, however slow the machine. The ranks save one agreed step,
exit 75, the job moves off the noticed node, resumes and Succeeds. Every micro-batch loss of
every rank, the final weights, the AdamW state, the learning rates and the Trainer's log
history are bitwise equal to the uninterrupted torchrun run (``hf_reference``), and no step is
trained twice.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from baton_testing import hf_runs
from baton_testing.operator_harness import Baton, PodWatcher, unique

pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.timeout(900)]

HOLD_AT = 4
"""Mid-epoch (6 optimizer steps per epoch). The ranks agree on a notice at the step boundary
where they see it or, with the agreement overlapped with the next step, at the one after:
step 4 or 5, neither a periodic save (the script's save_steps=3, everySteps 10 here), so the
resume can only come from the notice's own save."""


def test_hf_trainer_job_survives_a_spot_notice_bitwise(baton: Baton, hf_reference: Path) -> None:
    baton.cluster.add_node()  # replaces the node this test takes away
    job = unique("tj-hf")
    out = baton.workdir / job
    manifest = baton.job_manifest(
        job, replicas=2, every_steps=10, command=["python", str(hf_runs.SCRIPT)],
        failure_policy={"maxFailures": 0, "backoffSeconds": 1},
    )  # fmt: skip
    trainer = next(
        c for c in manifest["spec"]["template"]["spec"]["containers"] if c["name"] == "trainer"
    )
    trainer["env"] += [
        {"name": k, "value": v}
        for k, v in {
            **hf_runs.OFFLINE_ENV,
            "HF_TEST_OUT": str(out),
            "HF_TEST_HOLD_AT": str(HOLD_AT),
        }.items()
    ]
    applied = baton.apply(manifest)
    assert applied.returncode == 0, applied.stderr
    watcher = PodWatcher(baton, job)

    node, at_restart = baton.notice_while_held(job, out, hold_at=HOLD_AT)
    last = at_restart.get("lastCheckpoint") or {}
    # Read first: the resumed run's periodic saves (save_total_limit=2) retire this step once
    # it has saved twice, which takes it many seconds from here (pods start, torch imports).
    saved_path = out / "ckpt" / f"step-{int(last.get('step', 0)):012d}" / "manifest.json"
    saved = json.loads(saved_path.read_text()) if saved_path.is_file() else {}
    diag = baton.diagnostics(job)
    assert last.get("trigger") == "notice", f"the restart did not follow a notice save{diag}"
    step = int(last["step"])
    assert saved, f"{saved_path} is not there{diag}"
    assert at_restart["resumedFromStep"] == step, diag
    assert (at_restart["preemptions"], at_restart["failures"]) == (1, 0), diag
    assert baton.resume_env(job, 1) <= {str(step)}, diag
    assert saved["world_size"] == 2
    # The operator's request, or the SIGTERM of the drain that came with the notice: one save
    # serves both.
    assert saved["trigger"] in ("notice", "signal"), saved["trigger"]
    assert step in (HOLD_AT, HOLD_AT + 1), step

    baton.wait_moved_once(job, node, watcher, replicas=2, timeout=420)

    # Each rank trained every step exactly once, with the uninterrupted run's exact losses,
    # and ended in its exact state.
    hf_runs.assert_same_final(out, hf_reference)
    for rank in (0, 1):
        ref = hf_runs.by_step(hf_runs.losses(hf_reference, rank))
        steps = hf_runs.steps(hf_runs.losses(out, rank), ref)
        assert steps == list(range(1, hf_runs.STEPS + 1)), (
            f"rank {rank}: steps lost or trained twice around the notice save of step {step}"
        )
    baton.delete(job)
