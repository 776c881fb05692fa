"""``spec.suspend`` on the real control plane: how Kueue stops a job and starts it again.

One 2-replica job of the deterministic trainer, queued (Kueue's labels on the job): its pods
carry the queue and one pod group per attempt. ``suspend: true`` mid-run makes every rank
commit one step and all pods go (phase Suspended, no budget spent); ``suspend: false`` starts a
new attempt from that step, and the job finishes with every loss and the final state equal bit
for bit to an uninterrupted run of the same training. That reference runs as 2 local processes
while the job is suspended (no pod is running then), so it adds no load to the job's run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from baton_testing import trainer
from baton_testing.operator_harness import NAMESPACE, Baton, PodWatcher, unique

pytestmark = pytest.mark.cluster

STEPS = 40
EVERY = 5
QUEUE = {"kueue.x-k8s.io/queue-name": "team-a", "kueue.x-k8s.io/priority-class": "low"}


def _suspend(baton: Baton, job: str, value: bool) -> None:
    patch = json.dumps({"spec": {"suspend": value}})
    baton.cluster.kubectl("patch", "trainingjob", job, "-n", NAMESPACE, "--type", "merge",
                          "-p", patch)  # fmt: skip


def _kueue_problems(baton: Baton, job: str, attempt: int) -> list[str]:
    """What is missing from the Kueue metadata of the attempt's pods (empty: all there)."""
    pods = [
        p["metadata"]
        for p in baton.pods(job)
        if p["metadata"]["labels"]["baton.dev/attempt"] == str(attempt)
    ]
    want_labels = {**QUEUE, "kueue.x-k8s.io/pod-group-name": f"{job}-a{attempt}"}
    want_notes = {"kueue.x-k8s.io/pod-group-total-count": "2"}
    found = [] if len(pods) == 2 else [f"attempt {attempt} has {len(pods)} pods, not 2"]
    for meta in pods:
        labels, notes = meta["labels"], meta.get("annotations") or {}
        for key, value in want_labels.items():
            if labels.get(key) != value:
                found.append(f"{meta['name']}: label {key}={labels.get(key)!r}, want {value!r}")
        for key, value in want_notes.items():
            if notes.get(key) != value:
                found.append(f"{meta['name']}: annotation {key}={notes.get(key)!r}")
    return found


def test_suspend_checkpoints_stops_every_pod_and_resumes_bitwise(
    baton: Baton, tmp_path: Path
) -> None:
    job = unique("tj-suspend")
    out = baton.workdir / job
    # 0.3 s a step: about 10 s of training left when the suspend is patched, so the save
    # request always finds the ranks training, however loaded the machine.
    manifest = baton.job_manifest(job, steps=STEPS, every_steps=EVERY, sleep=0.3)
    manifest["metadata"]["labels"] = dict(QUEUE)
    applied = baton.apply(manifest)
    assert applied.returncode == 0, applied.stderr
    watcher = PodWatcher(baton, job)
    baton.wait_phase(job, "Running", timeout=180)
    assert _kueue_problems(baton, job, 0) == [], baton.diagnostics(job)
    baton.wait_steps(job, 6, timeout=120)

    _suspend(baton, job, True)
    suspended = baton.wait_phase(job, "Suspended", timeout=120)
    diag = baton.diagnostics(job)
    last = suspended.get("lastCheckpoint") or {}
    step = int(last.get("step") or 0)
    assert last.get("trigger") == "notice", f"the suspend did not commit its own save{diag}"
    assert step > EVERY, f"the suspend's save is newer than the periodic ones{diag}"
    assert (suspended["preemptions"], suspended["failures"]) == (0, 0), diag
    assert (suspended["attempt"], suspended["resumedFromStep"]) == (1, step), diag
    condition = {c["type"]: c for c in suspended["conditions"]}["Suspended"]
    assert condition["status"] == "True", diag
    assert f"stopped at step {step}" in condition["message"], diag
    assert (out / "ckpt" / f"step-{step:012d}" / "manifest.json").is_file(), diag
    baton.wait_for(job, lambda _: baton.pods(job) == [], timeout=90, what="every pod gone")
    assert any(e.startswith("Suspended: ") and f"step {step}" in e for e in baton.events(job))

    ref_result, ref_logs = trainer.reference(
        tmp_path / "reference", 2, ["--steps", str(STEPS), "--every-steps", str(EVERY)]
    )
    # The job stayed suspended, without pods, while the reference ran.
    assert baton.status(job)["phase"] == "Suspended"
    assert baton.pods(job) == []

    _suspend(baton, job, False)
    baton.wait_phase(job, "Running", timeout=180)
    assert _kueue_problems(baton, job, 1) == [], baton.diagnostics(job)
    final = baton.wait_phase(job, "Succeeded", timeout=240)
    watcher.stop()
    diag = baton.diagnostics(job)
    assert (final["preemptions"], final["failures"], final["attempt"]) == (0, 0, 1), diag
    assert final["resumedFromStep"] == step, diag
    assert baton.resume_env(job, 1) == {str(step)}, diag
    assert {c["type"]: c for c in final["conditions"]}["Suspended"]["status"] == "False"
    assert watcher.violations(replicas=2) == []

    # No step lost or recomputed on either rank, and every loss and the final state equal
    # the uninterrupted run bit for bit.
    got = trainer.loss_logs(out, 2)
    for rank in range(2):
        steps = sorted(got.get(rank, {}))
        assert steps == list(range(1, STEPS + 1)), f"rank {rank} logged steps {steps}"
        for s, losses in got[rank].items():
            assert losses == ref_logs[rank][s], (
                f"rank {rank} step {s} (suspended at {step}): {losses} != {ref_logs[rank][s]}"
            )
    result = json.loads((out / "result.json").read_text())
    for key in ("params_sha256", "optimizer_sha256", "scheduler_sha256", "scaler_sha256"):
        assert result[key] == ref_result[key], f"{key} differs from the uninterrupted run"
    assert result["step"] == STEPS
    baton.delete(job)
