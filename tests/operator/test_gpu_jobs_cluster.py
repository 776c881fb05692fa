"""Real GPU job shapes on the real control plane: GPU requests, several processes per pod.

The local cluster's nodes advertise ``nvidia.com/gpu`` (``ClusterConfig.gpus_per_node``), so
pods that request GPUs schedule; nothing backs the number, and the trainer runs on the CPU
with gloo. What is tested is what the operator does with the shape:

* ``resources.limits: {nvidia.com/gpu: 2}`` written as an integer reaches the API server as
  written (the kubernetes client's own models once refused it before sending, silently);
* a template the API server rejects fails the job once, with the API server's reason and the
  field in ``status`` and an Event, and no retry loop;
* a temporary refusal (a quota) is reported and retried with a backoff until it clears;
* 2 pods x 2 processes under a plain ``torchrun`` (the operator sets its ``PET_*`` variables)
  survive an AWS spot notice with ``maxFailures: 0``: all 4 ranks commit one step, the job
  moves, resumes and Succeeds, and its per-step losses and final state are bitwise equal to an
  uninterrupted 4-rank run. torchrun reports the workers' exit 75 as 1; the committed save is
  what the operator believes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from baton_testing import trainer
from baton_testing.operator_harness import NAMESPACE, Baton, PodWatcher, next_attempt, unique

pytestmark = pytest.mark.cluster
# One operator process for all of this module's tests (baton_testing.operator_fixtures: an
# operator's stop costs about 6 s of teardown, per test when each test had its own).
SHARED_OPERATOR = True

STEPS = 36
WORLD = 4
_MODEL_ARGS = ["--every-steps", "4", "--samples", "48", "--batch-size", "4", "--timeout", "120"]


def _trainer_container(manifest: dict[str, Any]) -> dict[str, Any]:
    containers = manifest["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "trainer")


def _gpu_job(
    baton: Baton,
    name: str,
    *,
    resources: dict[str, Any],
    procs: int = 1,
    **kw: Any,
) -> dict[str, Any]:
    manifest = baton.job_manifest(name, **kw)
    manifest["spec"]["procsPerReplica"] = procs
    _trainer_container(manifest)["resources"] = resources
    return manifest


def _apply(baton: Baton, manifest: dict[str, Any]) -> None:
    result = baton.apply(manifest)
    assert result.returncode == 0, result.stderr


def _events(baton: Baton, job: str, reason: str) -> list[dict[str, Any]]:
    data = baton.kubectl_json(
        "get", "events", "-n", NAMESPACE, "--field-selector", f"involvedObject.name={job}"
    )
    return [e for e in data["items"] if e.get("reason") == reason]


def test_rejected_template_fails_once_with_the_field_and_integer_gpus_run(baton: Baton) -> None:
    bad = unique("tj-reject")
    # Extended resources may not be overcommitted: the API server refuses requests above the
    # limit (422, naming spec.containers[0].resources.requests).
    _apply(
        baton,
        _gpu_job(
            baton, bad, steps=4,
            resources={"limits": {"nvidia.com/gpu": 1}, "requests": {"nvidia.com/gpu": 2}},
        ),
    )  # fmt: skip
    failed = baton.wait_phase(bad, "Failed", timeout=120)
    conditions = {c["type"]: c for c in failed["conditions"]}
    assert conditions["Failed"]["reason"] == "PodRejected", failed
    message = failed["message"]
    # The field as the user wrote it in the TrainingJob, and the API server's reason.
    assert "(field spec.template.spec.containers[0].resources.requests)" in message
    assert "must be equal to nvidia.com/gpu limit" in message
    assert "HTTP 422" in message
    assert "fix spec.template and re-create the TrainingJob" in message
    assert conditions["Failed"]["message"] == message

    # Integer quantities, exactly as users write GPU manifests, create pods that run.
    good = unique("tj-gpus")
    _apply(
        baton,
        _gpu_job(baton, good, steps=6, sleep=0.05, resources={"limits": {"nvidia.com/gpu": 2}}),
    )
    final = baton.wait_phase(good, "Succeeded", timeout=240)
    assert (final["failures"], final["preemptions"]) == (0, 0)
    for pod in baton.pods(good):
        trainer_c = next(c for c in pod["spec"]["containers"] if c["name"] == "trainer")
        limits = trainer_c["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == "2"

    # While the good job ran for many ticks, the rejected one was not retried: one Event, and
    # not a single pod of it exists.
    rejected = _events(baton, bad, "PodRejected")
    assert len(rejected) == 1, rejected
    assert sum(int(e.get("count") or 1) for e in rejected) == 1, rejected
    assert "spec.template.spec.containers[0].resources.requests" in rejected[0]["message"]
    assert baton.pods(bad) == []
    assert baton.status(bad)["phase"] == "Failed"
    # Nothing of the failed job runs again, so its headless Service went too; the job that
    # Succeeded keeps its own (with its finished pods) until it is deleted.
    services = baton.kubectl_json("get", "services", "-n", NAMESPACE, "-l", f"baton.dev/job={bad}")
    assert services["items"] == [], [s["metadata"]["name"] for s in services["items"]]
    kept = baton.kubectl_json("get", "services", "-n", NAMESPACE, "-l", f"baton.dev/job={good}")
    assert [s["metadata"]["name"] for s in kept["items"]] == [good]
    baton.delete(bad)
    baton.delete(good)


def test_a_quota_refusal_is_reported_and_retried_with_backoff(baton: Baton) -> None:
    quota = unique("no-gpus")
    baton.cluster.kubectl(
        "apply", "-n", NAMESPACE, "-f", "-",
        input=yaml.safe_dump({
            "apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": quota},
            "spec": {"hard": {"requests.nvidia.com/gpu": "0"}},
        }),
    )  # fmt: skip
    job = unique("tj-quota")
    try:
        _apply(
            baton,
            _gpu_job(baton, job, steps=6, sleep=0.05, resources={"limits": {"nvidia.com/gpu": 1}}),
        )

        def degraded(s: dict[str, Any]) -> bool:
            return any(
                c["type"] == "Degraded" and c["status"] == "True" for c in s.get("conditions", [])
            )

        status = baton.wait_for(job, degraded, timeout=120, what="a Degraded condition")
        message = next(c for c in status["conditions"] if c["type"] == "Degraded")["message"]
        assert "exceeded quota" in message, message
        assert "retrying in" in message
        assert status["phase"] == "Pending"
        assert _events(baton, job, "PodCreateFailed")
    finally:
        baton.cluster.kubectl("delete", "resourcequota", quota, "-n", NAMESPACE, check=False)
    final = baton.wait_phase(job, "Succeeded", timeout=240)
    assert (final["failures"], final["preemptions"]) == (0, 0)
    conditions = {c["type"]: c for c in final["conditions"]}
    assert conditions["Degraded"]["status"] == "False"
    # Backoff: 1, 2, 4, ... s between tries, not one a tick; a handful at most.
    assert len(_events(baton, job, "PodCreateFailed")) < 12
    baton.delete(job)


def test_torchrun_2x2_gpus_survives_a_spot_notice_bitwise(baton: Baton, tmp_path: Path) -> None:
    baton.cluster.add_node()  # replaces the node this test takes away
    job = unique("tj-torchrun")
    out = baton.workdir / job
    command = [
        "torchrun", "-m", "baton_testing.trainer", "--steps", str(STEPS), *_MODEL_ARGS,
        "--sleep", "0.4", "--loss-log", str(out / "loss.log"),
        "--result", str(out / "result.json"),
    ]  # fmt: skip
    manifest = _gpu_job(
        baton, job, procs=2, replicas=2, every_steps=4, command=command,
        resources={"limits": {"nvidia.com/gpu": 2}},
        failure_policy={"maxFailures": 0, "backoffSeconds": 1},
    )  # fmt: skip
    _apply(baton, manifest)
    watcher = PodWatcher(baton, job)
    running = baton.wait_phase(job, "Running", timeout=240)
    assert running["worldSize"] == WORLD
    baton.wait_steps(job, 8, timeout=300)
    node = baton.node_of(job, 1)
    baton.cluster.preempt(node, provider="aws", grace_s=40)

    at_restart = baton.wait_for(job, next_attempt, timeout=180, what="the next attempt")
    diag = baton.diagnostics(job)
    last = at_restart.get("lastCheckpoint") or {}
    assert last.get("trigger") == "notice", f"the restart did not follow a notice save{diag}"
    step = int(last["step"])
    assert at_restart["resumedFromStep"] == step, diag
    assert (at_restart["preemptions"], at_restart["failures"]) == (1, 0), diag
    assert baton.resume_env(job, 1) <= {str(step)}, diag
    # Every one of the 4 ranks wrote its shards of that one step, and rank 0 committed it.
    step_dir = out / "ckpt" / f"step-{step:012d}"
    manifest_json = json.loads((step_dir / "manifest.json").read_text())
    assert manifest_json["world_size"] == WORLD
    # The operator's request, or the SIGTERM of the drain that came with the notice: one save
    # serves both.
    assert manifest_json["trigger"] in ("notice", "signal"), manifest_json["trigger"]
    for rank in range(WORLD):
        assert (step_dir / f"rank-{rank:05d}-of-{WORLD:05d}.json").is_file(), rank

    baton.wait_moved_once(job, node, watcher, replicas=2, timeout=480)
    events = [f"{e.get('reason')}: {e.get('message')}" for e in _events(baton, job, "Failed")]
    assert events == [], events

    # No step lost or recomputed on any rank, and every loss and the final state equal the
    # uninterrupted 4-rank run bit for bit.
    got = trainer.loss_logs(out, WORLD)
    ref_result, ref_logs = trainer.reference(
        tmp_path / "reference", WORLD, ["--steps", str(STEPS), *_MODEL_ARGS], timeout=600
    )
    for rank in range(WORLD):
        steps = sorted(got.get(rank, {}))
        assert steps == list(range(1, STEPS + 1)), f"rank {rank} logged steps {steps}"
        for s, losses in got[rank].items():
            assert losses == ref_logs[rank][s], (
                f"rank {rank} step {s} (resumed from {step}): {losses} != {ref_logs[rank][s]}"
            )
    result = json.loads((out / "result.json").read_text())
    for key in ("params_sha256", "optimizer_sha256", "scheduler_sha256", "scaler_sha256"):
        assert result[key] == ref_result[key], f"{key} differs from the uninterrupted run"
    assert result["step"] == STEPS
    assert result["world_size"] == WORLD
    baton.delete(job)
