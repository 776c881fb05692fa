"""A memory snapshot whose replication was interrupted is never used, on the local cluster.

A 2-pod job snapshots every 5 steps into its pods' memory and each pod's sidecar copies its
pod's snapshot to the other pod. The sidecar of rank 1's pod is frozen (SIGSTOP: a process
that stops answering, as a hung or swapped-out sidecar would); ``s`` is then the newest
replica of rank 1's snapshot in rank 0's memory. The next snapshot is written completely
into both pods' memory, but its copies cannot finish: rank 1's sidecar neither sends its
pod's snapshot nor receives rank 0's. Rank 1's node is killed in that state. The survivor's
memory holds a complete snapshot newer than ``s`` (its own) and the replica of rank 1's
``s``: the ranks must restore ``s``, the newest step every rank's data survives for, never
the newer step whose replication was interrupted, and end bitwise equal to an
uninterrupted run. (The process-level tests in tests/sdk/test_memory_tier.py and
tests/sidecar/test_replication.py kill a writer mid-file, a sender and a receiver
mid-transfer; this is the same rule through the operator's recovery.)

Then the same job loses the node of rank 1's replacement in the middle of a snapshot's write:
its trainer is frozen while the snapshot's directory in its pod's memory has files but no
manifest, and its node is killed. Nothing of that snapshot is used: the ranks restore the
snapshot before it, and the survivor's pod is still the first one.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import kubernetes.client
import pytest
from baton_testing import trainer
from baton_testing.cluster import LocalCluster
from baton_testing.operator_harness import NAMESPACE, Baton, poll, unique

pytestmark = pytest.mark.cluster

SHARED_OPERATOR = True
OPERATOR_ARGS = ["--node-lost-seconds", "2"]
"""A node is called lost 2 s after it turns NotReady (the local cluster's node-monitor grace
is 8 s), not the harness's 10 s: each of the two recoveries starts 8 s sooner."""

STEPS = 50
REPLICAS = 2
EVERY = 5
"""``fastEverySteps``: several steps between two snapshots, so that the trainer freeze below
finds a write in progress within a few snapshots."""
NO_DURABLE = 1000
"""``everySteps`` past the last step: no durable save before the job's end."""
MEMORY_ROOT = Path("/dev/shm/localcluster")
"""Where the node agents put a pod's memory-backed emptyDirs (tests/cluster/README.md)."""


def _sidecar_status(pod: dict[str, Any], token: str) -> dict[str, Any]:
    req = urllib.request.Request(
        f"http://{pod['status']['podIP']}:9440/v1/status",
        headers={"Authorization": f"Bearer {token}"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return dict(json.load(resp)["replication"])


def _held(status: dict[str, Any], source: str) -> int | None:
    """The step of the complete replica of ``source`` this sidecar holds (None: none)."""
    steps = [h["step"] for h in status["held"] if h["source"] == source and h["complete"]]
    return max(steps, default=None)


def _sidecar_pid(cluster: LocalCluster, pod: dict[str, Any]) -> int:
    for pid in cluster.pod_processes(pod["metadata"]["uid"]):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"baton-sidecar" in cmdline:
            return pid
    raise AssertionError(f"no baton-sidecar process of pod {pod['metadata']['name']}")


def _trainer_pids(cluster: LocalCluster, pod: dict[str, Any]) -> list[int]:
    """Every process of the pod but its sidecar: the trainer container's."""
    sidecar = _sidecar_pid(cluster, pod)
    return [p for p in cluster.pod_processes(pod["metadata"]["uid"]) if p != sidecar]


def _memory_dir(pod: dict[str, Any]) -> Path:
    return MEMORY_ROOT / str(pod["metadata"]["uid"]) / "baton-fast"


def _committed_steps(memory: Path) -> list[int]:
    """The steps of the complete snapshots (with their manifest) of a pod's own in memory."""
    return [int(m.parent.name.split("-")[1]) for m in memory.glob("step-*/manifest.json")]


def _being_written(memory: Path, *, after: int) -> Path | None:
    """The directory of a snapshot the pod's trainer is writing now: files but no manifest,
    and newer than a snapshot it committed itself after step ``after``.

    Not every directory without a manifest is a write: after a restore the SDK deletes the
    snapshots other than the restored one, and retention deletes older ones, and a directory
    being deleted has lost its manifest too, or vanishes under the scan (the fresh-clone run
    at 9c3ecfa failed so: FileNotFoundError on a step-10 the restore's clean-up deleted).
    Both only ever delete steps at or below the newest committed one; a write is above it."""
    committed = [step for step in _committed_steps(memory) if step > after]
    if not committed:
        return None  # the pod has not committed a snapshot of its own since the restore
    newest = max(committed)
    for d in memory.glob("step-*"):
        if int(d.name.split("-")[1]) <= newest:
            continue
        try:
            if not (d / "manifest.json").exists() and any(d.iterdir()):
                return d
        except FileNotFoundError:
            continue  # deleted under the scan
    return None


def test_a_snapshot_interrupted_mid_replication_or_mid_write_is_never_used(
    baton: Baton, tmp_path: Path
) -> None:
    baton.cluster.add_node()
    baton.cluster.add_node()  # for the second loss's replacement
    job = unique("tj-halfcopy")
    out = baton.workdir / job
    manifest = baton.job_manifest(
        job, steps=STEPS, every_steps=NO_DURABLE, sleep=0.3, replicas=REPLICAS,
        failure_policy={"maxFailures": 2, "backoffSeconds": 1},
    )  # fmt: skip
    manifest["spec"]["checkpoint"].update({"fastEverySteps": EVERY, "fastSizeLimit": "64Mi"})
    trainer_c = manifest["spec"]["template"]["spec"]["containers"][0]
    # The survivor's restarted trainer waits in the rendezvous for the replacement; the SDK
    # waits for a copy at most half of this, so the frozen copy stays pending until the kill.
    trainer_c["command"][trainer_c["command"].index("--timeout") + 1] = "120"
    applied = baton.apply(manifest)
    assert applied.returncode == 0, applied.stderr
    baton.wait_phase(job, "Running", timeout=180)
    pods = {int(p["metadata"]["labels"]["baton.dev/rank"]): p for p in baton.pods(job)}
    survivor, lost = pods[0], pods[1]
    assert survivor["spec"]["nodeName"] != lost["spec"]["nodeName"]
    core = kubernetes.client.CoreV1Api(baton.cluster.api)
    secret = core.read_namespaced_secret(f"{job}-sidecar-token", NAMESPACE)
    assert secret.data is not None, f"the job's Secret {secret.metadata} has no data"
    token = base64.b64decode(secret.data["token"]).decode()
    pid = _sidecar_pid(baton.cluster, lost)
    frozen: list[int] = []

    def answering(pod: dict[str, Any]) -> bool:
        """Whether the pod's sidecar serves its API yet (its trainer may be Running first)."""
        try:
            _sidecar_status(pod, token)
        except urllib.error.URLError as e:
            if isinstance(e.reason, ConnectionRefusedError):
                return False
            raise
        return True

    poll(lambda: answering(survivor) and answering(lost), timeout=120,
         what="both sidecars answering", diag=lambda: baton.diagnostics(job))  # fmt: skip

    def freeze_then_a_newer_snapshot() -> bool:
        """Freeze rank 1's sidecar, then wait for rank 0 to commit a snapshot newer than the
        newest replica of rank 1's in its memory: no copy of it can finish (each needs the
        frozen sidecar, as sender or receiver). Rarely rank 0's own copy of that replica's
        step is what hangs, and no newer snapshot comes: let go and try again."""
        if _held(_sidecar_status(survivor, token), "w2-r1") is None:
            return False  # no replica of rank 1's yet: nothing the ranks could restore
        os.kill(pid, signal.SIGSTOP)
        until = time.monotonic() + 20
        while time.monotonic() < until:
            newest = max(_committed_steps(_memory_dir(survivor)), default=0)
            held = _held(_sidecar_status(survivor, token), "w2-r1")  # read after `newest`
            if held is not None and newest > held:
                frozen.append(held)
                return True
            time.sleep(0.05)
        os.kill(pid, signal.SIGCONT)
        return False

    try:
        poll(freeze_then_a_newer_snapshot, timeout=180,
             what="rank 1's sidecar frozen and a newer snapshot committed in rank 0's memory",
             diag=lambda: baton.diagnostics(job))  # fmt: skip
    finally:
        baton.cluster.kill_node(lost["spec"]["nodeName"])  # SIGKILL reaches a stopped process
    s = frozen[0]

    recovered = baton.wait_for(
        job, lambda st: bool(st.get("lastRecovery")), timeout=180, what="the recovery to end"
    )
    diag = baton.diagnostics(job)
    last = recovered["lastRecovery"]
    assert last["tier"] == "memory", diag
    assert last["restoredStep"] == s, f"restored {last['restoredStep']}, not {s}{diag}"
    assert [e["rank"] for e in last["replaced"]] == [1], diag
    assert last["kept"] == [f"{job}-a0-r0"], diag
    assert recovered["resumedFromStep"] == s, diag
    now = {int(p["metadata"]["labels"]["baton.dev/rank"]): p for p in baton.pods(job)}
    assert now[0]["metadata"]["uid"] == survivor["metadata"]["uid"], "the survivor was replaced"

    # Second loss: the replacement's node, while its trainer writes a snapshot.
    replacement = now[1]
    assert replacement["metadata"]["uid"] != lost["metadata"]["uid"], diag
    mem = _memory_dir(replacement)
    writing: list[int] = []

    def freeze_mid_write() -> bool:
        """Freeze rank 1's trainer while it writes a snapshot newer than s (files but no
        manifest yet; a write takes milliseconds here: look often).

        The trainer's PIDs are found before the window, not once a write is seen: finding them
        scans /proc (every process's environ), which takes longer than a write, and at load
        6-10 every one of the job's 9 writes ended during the scan, the job finished, and the
        test waited out its timeout (a pytest-xdist stress run)."""
        phase = baton.status(job).get("phase")
        assert phase == "Running", f"the job is {phase} before a write was caught{diag}"
        pids = _trainer_pids(baton.cluster, replacement)
        if not pids:
            return False
        until = time.monotonic() + 1.0
        while time.monotonic() < until:
            partial = _being_written(mem, after=s)
            if partial is not None:
                for p in pids:
                    os.kill(p, signal.SIGSTOP)
                if (partial / "manifest.json").exists():
                    for p in pids:
                        os.kill(p, signal.SIGCONT)  # finished meanwhile: catch the next one
                    continue
                writing.append(int(partial.name.split("-")[1]))
                return True
            time.sleep(0.001)
        return False

    poll(freeze_mid_write, timeout=180, what="rank 1's trainer frozen mid-snapshot",
         diag=lambda: baton.diagnostics(job))  # fmt: skip
    n = writing[0]
    baton.cluster.kill_node(replacement["spec"]["nodeName"])
    second = baton.wait_for(
        job, lambda st: (st.get("lastRecovery") or {}).get("startedAt") != last["startedAt"],
        timeout=180, what="the second recovery to end",
    )  # fmt: skip
    diag = baton.diagnostics(job)
    again = second["lastRecovery"]
    assert again["tier"] == "memory", diag
    # The snapshot before n: every rank's data survived in the survivor's memory; n's did not.
    assert again["restoredStep"] == n - EVERY, f"restored {again['restoredStep']}, n={n}{diag}"
    assert [e["rank"] for e in again["replaced"]] == [1], diag
    assert again["kept"] == [f"{job}-a0-r0"], diag
    now = {int(p["metadata"]["labels"]["baton.dev/rank"]): p for p in baton.pods(job)}
    assert now[0]["metadata"]["uid"] == survivor["metadata"]["uid"], "the survivor was replaced"

    final = baton.wait_phase(job, "Succeeded", timeout=240)
    diag = baton.diagnostics(job)
    assert (final["attempt"], final["failures"]) == (0, 2), diag
    ref = trainer.reference(
        tmp_path / "reference", REPLICAS, ["--steps", str(STEPS), "--every-steps", str(NO_DURABLE)]
    )
    # Steps after a restored step ran again; each time with the reference's loss.
    trainer.assert_equal_to_reference(out, REPLICAS, STEPS, ref, diag)
    baton.delete(job)
