"""A pod lost without notice: its ranks restore from a peer's replica, bitwise; both copies
lost: the durable tier, and the run says so.

Three "pods", each a real ``baton-sidecar`` with its own memory tier (``fast_dir``), control
directory and failure domain, peers in ring order (pod k replicates to pod k+1), and one rank
of a 3-rank gloo DDP trainer (``baton_testing.trainer``) per pod, snapshotting every step.
One chain, checked against the uninterrupted run:

1. pod 1 is lost (its trainer and sidecar SIGKILLed, its memory emptied); the survivors'
   trainers restart in place (killed and started again, their sidecars and memory kept); a
   fresh pod 1 (new sidecar, new address, which the survivors learn through
   ``PUT /v1/replication/peers``) joins, and every rank restores from the memory tier at the
   step of pod 1's replica on pod 2: each pod's sidecar fetched the files it lacked;
2. pod 1 and pod 2 (the holder of pod 1's replica) are lost together: nothing in memory has
   rank 1's data, so the ranks restore from the durable tier, and the logs say why;
3. the run ends bitwise equal to the uninterrupted one.
"""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest
from baton_testing import exactness, trainer
from baton_testing.sidecar_process import (
    TOKEN,
    SidecarProcess,
    pod_dir,
    replicating_sidecar,
    start_ring,
    wait_for,
)

import trainer_sdk

WORLD = 3
RANK1 = f"w{WORLD}-r1"


def _replica_step(holder: SidecarProcess, source: str) -> int | None:
    """The newest complete replica of ``source`` on ``holder`` (from its status)."""
    r = holder.status()
    assert r.status_code == 200, r.text
    steps = [
        int(h["step"])
        for h in r.json()["replication"]["held"]
        if h["source"] == source and h["complete"]
    ]
    return max(steps, default=None)


def _lose(pods: list[SidecarProcess], run: trainer.TrainerRun, tmp: Path, ks: list[int]) -> None:
    """Pods ``ks`` are gone (trainer and sidecar SIGKILLed at once, memory and control
    directory emptied); the other trainers die with the broken process group (killed here,
    as their containers restart in place)."""
    for k in ks:
        run.signal(k, signal.SIGKILL)
        proc = pods[k].proc
        assert proc is not None
        proc.kill()
        proc.wait()
        pods[k].stop()
    run.kill_all()
    for k in ks:
        for sub in ("fast", "control"):
            shutil.rmtree(pod_dir(tmp, k) / sub, ignore_errors=True)
        pods[k] = replicating_sidecar(tmp, k)


def _full_output(run: trainer.TrainerRun, rank: int) -> str:
    return run.outputs[rank].read_text(errors="replace")


def _resumed(run: trainer.TrainerRun, rank: int) -> tuple[int, str]:
    out = _full_output(run, rank)
    step = [ln.split()[1] for ln in out.splitlines() if ln.startswith("RESUMED_FROM ")]
    tier = [ln.split()[1] for ln in out.splitlines() if ln.startswith("RESUMED_TIER ")]
    assert step, out
    assert tier, out
    return int(step[-1]), tier[-1]


@pytest.mark.e2e  # 3 sidecars and 3 trainer ranks, three launches, a reference run
def test_a_lost_pod_restores_from_its_peers_replica_and_both_copies_lost_fall_back(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    ref = exactness.reference(tmp_path_factory.mktemp("reference-ddp-3"), world=WORLD)
    pods = [replicating_sidecar(tmp_path, k) for k in range(WORLD)]
    start_ring(pods, list(range(WORLD)))

    def args(sleep: float) -> list[str]:
        # the sleep (not part of the state) keeps each phase's window to act in a few
        # seconds wide on a loaded machine; the last phase runs to the end at full speed
        return exactness.args(
            tmp_path,
            "--every-steps", "10",
            "--sleep", str(sleep),
            "--control-dir", str(tmp_path / "pod{rank}" / "control"),
            "--fast-dir", str(tmp_path / "pod{rank}" / "fast"),
            "--fast-every-steps", "1",
        )  # fmt: skip

    try:
        # -- 1. pod 1 lost once pod 2 holds a replica of rank 1 newer than any durable step
        run = trainer.launch(WORLD, args(0.5), workdir=tmp_path / "out")
        try:

            def replicated_past_a_durable_step() -> bool:
                if any(p.poll() is not None for p in run.procs):
                    raise AssertionError(f"trainer ended early:\n{run.output()}")
                s = _replica_step(pods[2], RANK1)
                return s is not None and s >= 13 and s % 10 != 0

            wait_for(replicated_past_a_durable_step, exactness.RUN_TIMEOUT, "a replica of rank 1")
        finally:
            _lose(pods, run, tmp_path, [1])
        replica = _replica_step(pods[2], RANK1)
        assert replica is not None
        assert replica >= 13
        start_ring(pods, [1])
        run = trainer.launch(WORLD, args(1.0), workdir=tmp_path / "out")
        try:

            def past_the_next_durable_step() -> bool:
                if any(p.poll() is not None for p in run.procs):
                    raise AssertionError(f"trainer ended early:\n{run.output()}")
                s = _replica_step(pods[2], RANK1)
                durable = trainer_sdk.latest_step(str(tmp_path / "ck")) or 0
                return s is not None and durable >= 20 and s > durable and s % 10 != 0

            wait_for(past_the_next_durable_step, exactness.RUN_TIMEOUT, "a durable step 20")
        finally:
            # -- 2. pod 1 and the holder of its replica, pod 2, lost together
            _lose(pods, run, tmp_path, [1, 2])
        for rank in range(WORLD):
            assert _resumed(run, rank) == (replica, "memory"), run.output(rank)
        # pod 0 completed the snapshot from its peers (ranks 1 and 2's files)
        durable = trainer_sdk.latest_step(str(tmp_path / "ck"))
        assert durable is not None
        assert durable >= 20
        start_ring(pods, [1, 2])
        fill0 = pods[0].status().json()["replication"]["last_fill"]
        assert fill0["step"] == replica, fill0
        assert fill0["bytes"] > 0, fill0
        run = trainer.launch(WORLD, args(0.0), workdir=tmp_path / "out")
        codes = run.wait(exactness.RUN_TIMEOUT)
        assert codes == [0] * WORLD, run.output()
        for rank in range(WORLD):
            assert _resumed(run, rank) == (durable, "durable"), run.output(rank)
        out0 = _full_output(run, 0)
        # it says so: no pod could complete a snapshot with rank 1's files, and why
        assert "no memory snapshot could be completed from peers" in out0, out0
        assert "rank-00001-of-00003" in out0, out0
        assert f"resumed from durable step {durable}" in out0, out0
        exactness.check_exact(tmp_path, ref)
    finally:
        for p in pods:
            p.stop()
            assert TOKEN not in p.log(), "the bearer token appeared in a sidecar's log"
