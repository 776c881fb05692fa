"""A notice too short for a durable save, answered by the memory tier: only the noticed pod
is replaced (issue 17, "Promotion and notices").

A 2-pod job snapshots every step into its pods' memory (``fastEverySteps: 1``), each pod's
sidecar copying its snapshot to the other pod, and writes its durable checkpoints through a
throttled storage (``--throttle-bytes-per-s`` in the pods' command: ``baton_testing.throttled``)
so slow that a durable save cannot fit the notice's deadline, while a snapshot with its
replication can; both are measured by the SDK, which decides from those measurements.

An AWS spot notice on rank 1's node (deadline: the operator's 25 s spot grace, minus the
SDK's margin): every rank commits the step to the memory tier and reports it; the operator
records ``lastCheckpoint.tier: memory`` and hands over to the recovery that keeps the
survivors: only rank 1's pod is replaced (off the noticed node), rank 0's pod keeps its UID,
sidecar and memory, its trainer exits ``EXIT_RESTART_IN_PLACE`` and is restarted in place.
Every rank restores the committed step from memory (rank 1's files from rank 0's replica),
the step is promoted to durable storage afterwards (``memory+promoted``, an Event, and a
complete checkpoint under the uri that ``trainer_sdk.load`` reads), the noticed machine goes
away, and the job ends bitwise equal to an uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from baton_testing import trainer
from baton_testing.operator_harness import Baton, poll, unique

import trainer_sdk
from trainer_sdk.format.layout import step_dir

pytestmark = pytest.mark.cluster

SHARED_OPERATOR = True

STEPS = 40
REPLICAS = 2
NO_DURABLE = 1000
"""``everySteps`` past the last step: no periodic durable save (the storage is slow)."""
RATE = 2048
"""Bytes per second of the durable tier: a durable save of a rank (about 16 KiB, measured by
a probe of the same rate) is estimated at about 12 s; a snapshot and its replication take a
fraction of a second."""
MARGIN = 17
"""The SDK's deadline margin (seconds): a 25 s notice leaves it about 6 s (after the notice
reaches the ranks and the probe), half the durable estimate, many times the memory tier's."""
NOTICE_AT = 6
"""Steps trained before the notice."""


def _pods_by_rank(baton: Baton, job: str) -> dict[int, dict[str, Any]]:
    return {int(p["metadata"]["labels"]["baton.dev/rank"]): p for p in baton.pods(job)}


def _trainer_status(pod: dict[str, Any]) -> dict[str, Any]:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs["name"] == "trainer":
            return dict(cs)
    raise AssertionError(f"pod {pod['metadata']['name']} has no trainer status")


def test_a_short_notice_commits_to_memory_and_replaces_only_the_noticed_pod(
    baton: Baton, tmp_path: Path
) -> None:
    train = ["--steps", str(STEPS), "--every-steps", str(NO_DURABLE)]
    ref = trainer.reference(tmp_path / "reference", REPLICAS, train)
    baton.cluster.add_node()
    job = unique("tj-noticemem")
    out = baton.workdir / job
    manifest = baton.job_manifest(
        job, steps=STEPS, every_steps=NO_DURABLE, sleep=0.3, replicas=REPLICAS,
        failure_policy={"maxFailures": 0, "maxPreemptions": 1, "backoffSeconds": 1},
    )  # fmt: skip
    manifest["spec"]["checkpoint"].update({"fastEverySteps": 1, "fastSizeLimit": "64Mi"})
    trainer_c = manifest["spec"]["template"]["spec"]["containers"][0]
    # The kept trainer, restarted, waits in the rendezvous for the replacement to start.
    trainer_c["command"][trainer_c["command"].index("--timeout") + 1] = "120"
    trainer_c["command"] += [
        "--uri", manifest["spec"]["checkpoint"]["uri"],
        "--throttle-bytes-per-s", str(RATE), "--probe-bytes", str(RATE),
        "--deadline-margin", str(MARGIN),
    ]  # fmt: skip
    applied = baton.apply(manifest)
    assert applied.returncode == 0, applied.stderr
    baton.wait_phase(job, "Running", timeout=180)
    baton.wait_steps(job, NOTICE_AT)
    before = _pods_by_rank(baton, job)
    noticed = before[1]["spec"]["nodeName"]
    assert before[0]["spec"]["nodeName"] != noticed
    # The machine goes away after the operator's deadline (25 s), the noticed pod long gone.
    baton.cluster.preempt(noticed, provider="aws", grace_s=30, cordon_only=True)

    recovered = baton.wait_for(
        job, lambda s: bool(s.get("lastRecovery")), timeout=150, what="the recovery to end"
    )
    diag = baton.diagnostics(job)
    committed = recovered["lastCheckpoint"]
    step = committed["step"]
    assert step >= NOTICE_AT, diag
    assert committed["trigger"] == "notice", diag
    assert committed["tier"] in ("memory", "memory+promoted"), diag  # promoted meanwhile?
    last = recovered["lastRecovery"]
    assert (last["cause"], last["step"], last["tier"]) == ("notice", step, "memory"), diag
    assert last["restoredStep"] == step, diag
    assert [e["rank"] for e in last["replaced"]] == [1], diag
    assert last["kept"] == [f"{job}-a0-r0"], diag
    assert last["nodes"] == [noticed], diag
    # A preemption, not a failure; the same attempt, the interruption says it was a notice.
    assert (recovered["attempt"], recovered["preemptions"], recovered["failures"]) == (0, 1, 0)
    entry = recovered["interruptions"][-1]
    assert (entry["source"], entry["resumeStep"]) == ("aws", step), diag
    events = baton.events(job)
    assert any(
        e.startswith("CheckpointCommitted: ") and f"step {step} to the memory tier" in e
        for e in events
    ), diag
    assert any(e.startswith("Recovering: ") and "notice" in e for e in events), diag
    assert any(e.startswith("Recovered: ") and "notice" in e for e in events), diag
    after = _pods_by_rank(baton, job)
    assert after[0]["metadata"]["uid"] == before[0]["metadata"]["uid"], "rank 0 was replaced"
    restarted = _trainer_status(after[0])
    assert restarted["restartCount"] >= 1, diag
    # It stopped after the save with the code its restart rule restarts.
    assert restarted["lastState"]["terminated"]["exitCode"] == trainer_sdk.EXIT_RESTART_IN_PLACE
    assert after[1]["metadata"]["uid"] != before[1]["metadata"]["uid"], diag
    assert after[1]["spec"]["nodeName"] != noticed, diag

    # The promotion afterwards: the status and an Event say so, and the step is complete
    # under the durable uri.
    promoted = baton.wait_for(
        job, lambda s: (s.get("lastCheckpoint") or {}).get("tier") == "memory+promoted",
        timeout=120, what="the memory commit's promotion",
    )  # fmt: skip
    assert promoted["lastCheckpoint"]["step"] == step, baton.diagnostics(job)
    assert any(
        e.startswith("CheckpointPromoted: ") and f"step {step}" in e for e in baton.events(job)
    ), baton.diagnostics(job)
    uri = out / "ckpt"
    assert (uri / step_dir(step) / "manifest.json").is_file()
    state: dict[str, Any] = {}
    trainer_sdk.load(state, str(uri), step=step, strict=False)
    assert any(isinstance(v, torch.Tensor) for v in _leaves(state)), state.keys()

    # The noticed machine goes away; the job does not notice.
    poll(
        lambda: noticed not in baton.cluster.nodes(), timeout=120,
        what=f"node {noticed} to be removed", diag=lambda: baton.diagnostics(job),
    )  # fmt: skip
    final = baton.wait_phase(job, "Succeeded", timeout=240)
    diag = baton.diagnostics(job)
    assert (final["attempt"], final["failures"], final["preemptions"]) == (0, 0, 1), diag
    trainer.assert_equal_to_reference(out, REPLICAS, STEPS, ref, diag)
    baton.delete(job)


def _leaves(obj: Any) -> list[Any]:
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _leaves(v)]
    if isinstance(obj, list | tuple):
        return [x for v in obj for x in _leaves(v)]
    return [obj]
