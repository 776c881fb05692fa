"""Two operator replicas: one acts, the other takes over when it dies, from the cluster's truth.

Each replica is a real ``baton-operator`` process with its own identity in the Lease, under the
generated RBAC. The takeover time is printed, never asserted (a loaded machine decides it);
what is asserted is the outcome: one attempt increment per preemption, no duplicate or
overlapping pods, no lost or recomputed step, and a reported resume step equal to the step
the trainers loaded.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from baton_testing.operator_harness import (
    NAMESPACE,
    Baton,
    OperatorProcess,
    PodWatcher,
    next_attempt,
    operator_process,
    poll,
    unique,
)

from .test_preemption_cluster import HintRecorder

pytestmark = pytest.mark.cluster

STEPS = 40
S3_SECRET = "wJalrXUtnFEMI-baton-test-not-a-real-key"


@pytest.fixture
def standby(baton: Baton, tmp_path: Path) -> Iterator[OperatorProcess]:
    """A second replica of the operator, started after the first."""
    workdir = tmp_path / "standby"
    workdir.mkdir()
    op = operator_process(baton.install, workdir)
    op.start()
    try:
        yield op
    finally:
        op.stop()


def _leader_gauge(op: OperatorProcess) -> float:
    for line in op.metrics().splitlines():
        if line.startswith("baton_operator_leader "):
            return float(line.split()[1])
    raise AssertionError(f"no baton_operator_leader in the metrics of {op.identity}")


def _active_and_standby(
    baton: Baton, other: OperatorProcess
) -> tuple[OperatorProcess, OperatorProcess]:
    ops = {baton.operator.identity: baton.operator, other.identity: other}
    poll(
        lambda: baton.lease_holder() in ops,
        timeout=120,
        what="one of the two operators to hold the Lease",
        diag=lambda: f"\nholder: {baton.lease_holder()!r}",
    )
    holder = baton.lease_holder()
    passive = next(op for name, op in ops.items() if name != holder)
    return ops[holder], passive


def _takes_the_lease(baton: Baton, standby: OperatorProcess, job: str, *, after: str) -> None:
    took = poll(
        lambda: baton.lease_holder() == standby.identity,
        timeout=120,
        what="the standby to take the Lease",
        diag=lambda: baton.diagnostics(job) + f"\n--- standby log ---\n{standby.tail()}",
    )
    print(f"standby {standby.identity} took the Lease {took:.1f}s after {after}")


def _job(baton: Baton, name: str) -> None:
    manifest = baton.job_manifest(name, steps=STEPS, every_steps=5, sleep=0.3)
    trainer = manifest["spec"]["template"]["spec"]["containers"][0]
    trainer["env"].append({"name": "AWS_SECRET_ACCESS_KEY", "value": S3_SECRET})
    result = baton.apply(manifest)
    assert result.returncode == 0, result.stderr


def test_two_operators_one_acts_through_a_preemption(
    baton: Baton, standby: OperatorProcess
) -> None:
    baton.cluster.add_node()  # replaces the node this test takes away
    active, passive = _active_and_standby(baton, standby)
    poll(
        lambda: _leader_gauge(active) == 1 and _leader_gauge(passive) == 0,
        timeout=60,
        what="the leader gauges (1 on the active replica, 0 on the standby)",
        diag=lambda: f"\n--- standby log ---\n{passive.tail()}",
    )
    job = unique("tj-ha")
    _job(baton, job)
    watcher = PodWatcher(baton, job)
    baton.wait_phase(job, "Running", timeout=240)
    baton.wait_steps(job, 8, timeout=180)
    node = baton.node_of(job, 1)
    baton.cluster.preempt(node, provider="aws", grace_s=30)
    final = baton.wait_phase(job, "Succeeded", timeout=360)
    watcher.stop()
    diag = baton.diagnostics(job) + f"\n--- standby log ---\n{passive.tail()}"
    assert final["attempt"] == 1, f"one preemption, one attempt increment{diag}"
    assert final["preemptions"] == 1, diag
    assert final["failures"] == 0, diag
    assert watcher.violations(replicas=2) == [], diag
    assert baton.loss_steps(job) == list(range(1, STEPS + 1)), diag
    restarts = [e for e in baton.events(job) if e.startswith("Restarting:")]
    assert len(restarts) == 1, f"the restart was acted on {len(restarts)} times{diag}"
    # The standby never reconciled: it stood by the whole time.
    standby_log = passive.log.read_text(errors="replace")
    assert "standing by" in standby_log, diag
    assert "this operator is active" not in standby_log, diag
    assert job not in standby_log, f"the standby touched the job{diag}"
    # Neither the token nor a credential from the template reaches logs, Events or status.
    secret = baton.kubectl_json("get", "secret", f"{job}-sidecar-token", "-n", NAMESPACE)
    token = base64.b64decode(secret["data"]["token"]).decode()
    events = baton.kubectl_json(
        "get", "events", "-n", NAMESPACE, "--field-selector", f"involvedObject.name={job}"
    )
    surfaces = {
        "active log": active.log.read_text(errors="replace"),
        "standby log": standby_log,
        "events": json.dumps(events),
        "status": json.dumps(baton.status(job)),
    }
    for where, text in surfaces.items():
        assert token not in text, f"the sidecar token is in the {where}"
        assert S3_SECRET not in text, f"the template's S3 secret is in the {where}"
    baton.delete(job)
    # A rolling update: the active replica gets SIGTERM, stops, releases the Lease, and the
    # standby acts without waiting for the Lease to expire.
    began = time.monotonic()
    active.stop()
    stopped = time.monotonic() - began
    poll(
        lambda: baton.lease_holder() == passive.identity,
        timeout=60,
        what="the standby to hold the Lease after the active replica's SIGTERM",
        diag=lambda: f"\nholder: {baton.lease_holder()!r}\n--- stopped log ---\n{active.tail()}",
    )
    print(f"SIGTERM to exit of the active operator: {stopped:.1f}s; standby holds the Lease "
          f"{time.monotonic() - began:.1f}s after the SIGTERM")  # fmt: skip
    assert "Signal SIGTERM is received" in active.log.read_text(errors="replace"), active.tail()
    assert f"{active.identity} released Lease" in active.log.read_text(errors="replace"), (
        active.tail()
    )


def test_kill_9_of_the_active_operator_at_checkpointing(
    baton: Baton, standby: OperatorProcess
) -> None:
    baton.cluster.add_node()
    active, passive = _active_and_standby(baton, standby)
    job = unique("tj-hakill")
    _job(baton, job)
    watcher = PodWatcher(baton, job)
    hints = HintRecorder(baton, job)
    baton.wait_phase(job, "Running", timeout=240)
    baton.wait_steps(job, 8, timeout=180)
    noticed = baton.node_of(job, 1)
    baton.cluster.preempt(noticed, provider="karpenter", grace_s=40)
    baton.wait_for(
        job, lambda s: s.get("phase") == "Checkpointing", timeout=180, what="Checkpointing"
    )
    active.kill()
    _takes_the_lease(baton, passive, job, after="kill -9")
    at_restart = baton.wait_for(job, next_attempt, timeout=240, what="the next attempt")
    diag = baton.diagnostics(job) + f"\n--- standby log ---\n{passive.tail()}"
    last = at_restart.get("lastCheckpoint") or {}
    assert last.get("step") is not None, f"no committed step known at the restart{diag}"
    assert at_restart.get("resumedFromStep") == last.get("step"), diag
    # The step the operator reports is the step the trainers are told to load.
    assert baton.resume_env(job, 1) == {str(last.get("step"))}, diag
    assert at_restart.get("preemptions") == 1, diag
    assert at_restart.get("failures") == 0, diag
    final = baton.wait_phase(job, "Succeeded", timeout=360)
    watcher.stop()
    hints.stop()
    assert final["attempt"] == 1, diag
    assert watcher.violations(replicas=2) == [], diag
    # The disruption hints never outlive the save, though the operator that set them was
    # killed during it: the standby takes them off (whether the kill came before or after
    # the active one put them on, which is a race here, so their presence is not asserted:
    # test_preemption_cluster.py watches them come and go). The noticed node's pod may be
    # drained and gone, hints and all, before the standby's first tick (see leftovers).
    assert hints.leftovers(drained_node=noticed) == [], f"{hints.seen}{diag}"
    assert baton.loss_steps(job) == list(range(1, STEPS + 1)), (
        f"a step was lost or recomputed around the notice at {last.get('step')}{diag}"
    )
    baton.delete(job)


def test_an_api_outage_that_ends_a_leadership_is_recorded_on_the_job(
    baton: Baton, standby: OperatorProcess
) -> None:
    """The API server stops long enough that the active operator exits for its Lease (issue
    31, section 3): the replica that leads afterwards writes the outage on the job, as a
    condition with its length and one Event, though the operator that saw it begin is gone."""
    active, _ = _active_and_standby(baton, standby)
    job = unique("tj-outage")
    _job(baton, job)
    baton.wait_phase(job, "Running", timeout=240)
    assert active.proc is not None
    with baton.cluster.apiserver_down(wait_controllers=False):
        poll(
            lambda: active.proc is None or active.proc.poll() is not None,
            timeout=120,
            what="the active operator to exit for its Lease",
            diag=lambda: f"\n--- active log ---\n{active.tail()}",
        )
    # Exit code 3 is the operator's "Lease lost" exit. The exit is what this test expects, so
    # it is reaped here: the harness's guard that fails a wait when the operator dies must not
    # fire on it (it did in CI whenever the job was still running when the record appeared).
    assert active.proc is not None
    assert active.proc.returncode == 3, active.tail()
    active.stop()
    baton.cluster.wait_controller_manager()

    def recorded(s: dict[str, Any]) -> bool:
        return any(
            c.get("type") == "Degraded" and c.get("reason") == "APIRecovered"
            and "Kubernetes API calls failed for" in str(c.get("message"))
            for c in s.get("conditions") or []
        )  # fmt: skip

    status = baton.wait_for(job, recorded, timeout=180, what="the outage's record")
    diag = baton.diagnostics(job)
    records = [
        e for e in baton.events(job)
        if e.startswith("APIRecovered: Kubernetes API calls failed for")
    ]  # fmt: skip
    assert len(records) == 1, f"one Event for the outage{diag}"
    assert any(c["message"] in records[0] for c in status["conditions"]), diag
    final = baton.wait_phase(job, "Succeeded", timeout=360)
    assert final["failures"] == 0, baton.diagnostics(job)
    baton.delete(job)


def test_a_stopped_leader_during_a_drain_save_leaves_one_true_record(
    baton: Baton, standby: OperatorProcess
) -> None:
    """Issue 31, section 3: the active operator is frozen (SIGSTOP: a VM pause, a stuck
    process) and the node is drained; the drain's SIGTERM makes the ranks save one agreed step
    (trigger ``signal``, no operator request, so no sidecar lingers) and stop. The replica that
    takes the Lease polls nobody: it reads the save from the ended sidecars' termination
    messages, and records it once, with no false fallback and no correction afterwards."""
    baton.cluster.add_node()  # replaces the drained node
    active, passive = _active_and_standby(baton, standby)
    job = unique("tj-hastop")
    _job(baton, job)
    watcher = PodWatcher(baton, job)
    baton.wait_phase(job, "Running", timeout=240)
    baton.wait_steps(job, 8, timeout=180)
    assert active.proc is not None
    os.killpg(active.proc.pid, signal.SIGSTOP)
    try:
        drained, survivor = baton.node_of(job, 1), baton.node_of(job, 0)
        baton.cluster.preempt(drained, provider="aws", grace_s=40)
        _takes_the_lease(baton, passive, job, after="SIGSTOP")
        at_restart = baton.wait_for(job, next_attempt, timeout=240, what="the next attempt")
        diag = baton.diagnostics(job) + f"\n--- standby log ---\n{passive.tail()}"
        ckpt = baton.workdir / job / "ckpt"
        # The drain's SIGTERM comes first ("signal"); on a loaded machine the new leader may
        # take over and ask before it does ("notice"): one save serves both, either way.
        emergency = {
            int(p.parent.name.removeprefix("step-")): json.loads(p.read_text())["trigger"]
            for p in ckpt.glob("step-*/manifest.json")
            if json.loads(p.read_text())["trigger"] in ("signal", "notice")
        }
        assert len(emergency) == 1, f"one save for the drain: {emergency}{diag}"
        ((step, trigger),) = emergency.items()
        print(f"the drain's save: step {step}, trigger {trigger}")
        last = at_restart.get("lastCheckpoint") or {}
        assert last.get("step") == step, f"the commit the ranks made, not an older one{diag}"
        assert at_restart.get("resumedFromStep") == step, diag
        assert baton.resume_env(job, 1) == {str(step)}, diag
        assert (at_restart.get("preemptions"), at_restart.get("failures")) == (1, 0), diag
        final = baton.wait_phase(job, "Succeeded", timeout=360)
        watcher.stop()
        diag = baton.diagnostics(job) + f"\n--- standby log ---\n{passive.tail()}"
        events = baton.events(job)
        for reason in ("CheckpointFallback", "ResumeStepCorrected"):
            assert not [e for e in events if e.startswith(f"{reason}:")], f"{reason}{diag}"
        (record,) = final.get("interruptions") or [None]
        assert record is not None, diag
        assert (record.get("resumeStep"), record.get("lastGoodStep")) == (step, step), diag
        assert record.get("stepsLost") == 0, diag
        # No operator saw the notice: the ranks' own save says when it came and went durable.
        assert record.get("noticeToDurableSeconds") is not None, diag
        assert record["noticeToDurableSeconds"] >= 0, diag
        # The drained rank's pod is gone with its node name; the survivor only saved because
        # its peer did: its node is not named as taken away.
        assert survivor not in record.get("nodes", []), diag
        assert set(record.get("nodes", [])) <= {drained}, diag
        assert final["attempt"] == 1, diag
        assert watcher.violations(replicas=2) == [], diag
        assert baton.loss_steps(job) == list(range(1, STEPS + 1)), (
            f"a step was lost or recomputed around the drain's save of step {step}{diag}"
        )
    finally:
        # Woken, the stopped replica finds the Lease held by another and exits (code 3) without
        # acting: the job is already done either way.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(active.proc.pid, signal.SIGCONT)
        watcher.stop()
    poll(
        lambda: active.proc is None or active.proc.poll() is not None,
        timeout=120,
        what="the woken operator to exit for its Lease",
        diag=lambda: f"\n--- woken log ---\n{active.tail()}",
    )
    assert active.proc is not None
    assert active.proc.returncode == 3, active.tail()
    active.stop()
    assert len([e for e in baton.events(job) if e.startswith("Restarting:")]) == 1
    baton.delete(job)
