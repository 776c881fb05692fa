"""The Lightning script under the operator: one spot preemption, resumed bitwise (issue 28).

``lightning_train.py`` (a stock ``LightningModule`` with ``BatonCheckpointIO`` and
``BatonCallback``, the script the torchrun tests run) is the command of a 2-replica
TrainingJob with ``maxFailures: 0``: one process per pod, Lightning's own multi-node DDP
(``num_nodes=2``) on the RANK/WORLD_SIZE/NODE_RANK/MASTER_ADDR the operator gives each pod. After
optimizer step ``HOLD_AT`` both ranks wait (in a callback before Baton's) until the test has
given rank 1's node an AWS spot notice and the operator has sent its checkpoint requests, so
the notice always lands mid-epoch. The ranks save one agreed step, exit 75, the job moves off
the noticed node, resumes and Succeeds: every micro-batch loss (and its sample ids), the final
weights, AdamW state and learning rate of both ranks equal an uninterrupted torchrun run of 2
processes, and no step is trained twice.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from baton_testing import hf_runs
from baton_testing.operator_harness import Baton, PodWatcher, unique

pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.timeout(900)]

SCRIPT = Path(__file__).with_name("lightning_train.py")
STEPS = 18
"""2 epochs of 9 optimizer steps (72 samples, batches of 4, over 2 ranks)."""
HOLD_AT = 4
"""Mid-epoch; the notice's step is 4 or 5 (the agreement may land a step later), and no
periodic save comes before the end (every 50), so the resume can only come from the notice."""
ENV = {"LT_TEST_EVERY": "50", "OMP_NUM_THREADS": "1"}


def _losses(out: Path, rank: int) -> list[list[Any]]:
    return [json.loads(line) for line in (out / f"losses-{rank}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lightning-reference-2")
    code = hf_runs.run(out, nproc=2, script=SCRIPT, LT_TEST_OUT=str(out), **ENV)
    assert code == 0, hf_runs.tail(out)
    return out


def test_lightning_job_survives_a_spot_notice_bitwise(baton: Baton, reference: Path) -> None:
    baton.cluster.add_node()  # replaces the node this test takes away
    job = unique("tj-lt")
    out = baton.workdir / job
    manifest = baton.job_manifest(
        job, replicas=2, every_steps=50, command=["python", str(SCRIPT)],
        failure_policy={"maxFailures": 0, "backoffSeconds": 1},
    )  # fmt: skip
    trainer = next(
        c for c in manifest["spec"]["template"]["spec"]["containers"] if c["name"] == "trainer"
    )
    trainer["env"] += [
        {"name": k, "value": v}
        for k, v in {**ENV, "LT_TEST_OUT": str(out), "LT_TEST_HOLD_AT": str(HOLD_AT)}.items()
    ]
    applied = baton.apply(manifest)
    assert applied.returncode == 0, applied.stderr
    watcher = PodWatcher(baton, job)

    node, at_restart = baton.notice_while_held(job, out, hold_at=HOLD_AT)
    last = at_restart.get("lastCheckpoint") or {}
    diag = baton.diagnostics(job)
    assert last.get("trigger") == "notice", f"the restart did not follow a notice save{diag}"
    step = int(last["step"])
    assert step in (HOLD_AT, HOLD_AT + 1), f"{step}{diag}"
    saved = json.loads((out / "ckpt" / f"step-{step:012d}" / "manifest.json").read_text())
    # The operator's request, or the SIGTERM of the drain that came with the notice: one save
    # serves both.
    assert saved["trigger"] in ("notice", "signal"), saved["trigger"]
    assert at_restart["resumedFromStep"] == step, diag
    assert (at_restart["preemptions"], at_restart["failures"]) == (1, 0), diag
    assert baton.resume_env(job, 1) <= {str(step)}, diag

    baton.wait_moved_once(job, node, watcher, replicas=2, timeout=420)

    for rank in (0, 1):
        final = json.loads((out / f"final-{rank}.json").read_text())
        assert final == json.loads((reference / f"final-{rank}.json").read_text()), rank
        ref = _losses(reference, rank)
        assert [e[0] for e in ref] == list(range(1, STEPS + 1))
        # Every step exactly once, with the uninterrupted run's loss and samples.
        assert _losses(out, rank) == ref, f"rank {rank}: steps lost or trained twice{diag}"
    baton.delete(job)
