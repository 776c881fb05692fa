"""A notice whose deadline is too short for a durable save commits to the memory tier, is
promoted to durable storage, and survives the loss of the noticed pod; a notice with time
enough still takes the durable path. Every commit's tier is in the ranks' reports.

Three "pods", each a real ``baton-sidecar`` replicating its memory tier to the next pod (ring
order), and one rank of a 3-rank gloo DDP trainer (``baton_testing.trainer``) per pod,
snapshotting every step. The durable tier is slow for real: a local directory written at
``RATE`` bytes per second (``baton_testing.throttled``), so the SDK measures a durable save
far slower than a snapshot plus its replication and decides from those measurements.

1. A notice at step 16 with a 5 s deadline (1 s margin): every rank commits step 16 to the
   memory tier and reports ``tier: memory``; the promotion starts. Pod 1 (the notice's node)
   is then lost at once (trainer and sidecar SIGKILLed, its memory and control directory
   emptied); the other trainers restart in place. The snapshot files seen just before are
   kept aside to compare with.
2. A fresh pod 1 joins; every rank resumes from step 16 of the memory tier (pod 1's files
   from pod 2's replica); the durable step 16 ends up byte-identical to the snapshot (its
   promotion, finished before the loss or redone by the restore) and loadable by
   ``trainer_sdk.load``. A notice at step 22 with a long deadline commits durably
   (``tier: durable``).
3. The run ends bitwise equal to the uninterrupted one.
"""

from __future__ import annotations

import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
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
from trainer_sdk import EXIT_STOPPED_AFTER_NOTICE
from trainer_sdk.layout import step_dir

WORLD = 3
RATE = 4096.0
"""Bytes per second of the durable tier: a few seconds per durable save of this trainer."""
SHORT_NOTICE = 16
LONG_NOTICE = 22


def _status(pod: SidecarProcess) -> dict[str, Any]:
    r = pod.status()
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def _resumed(run: trainer.TrainerRun, rank: int) -> tuple[int, str]:
    out = run.outputs[rank].read_text(errors="replace")
    step = [ln.split()[1] for ln in out.splitlines() if ln.startswith("RESUMED_FROM ")]
    tier = [ln.split()[1] for ln in out.splitlines() if ln.startswith("RESUMED_TIER ")]
    assert step, out
    assert tier, out
    return int(step[-1]), tier[-1]


def _committed(pods: list[SidecarProcess], run: trainer.TrainerRun, step: int) -> list[str]:
    """Wait until every pod's sidecar reports the notice's save of ``step`` committed; return
    the tiers they report."""

    def every_pod_committed() -> list[str] | None:
        views = [_status(p) for p in pods]
        if all(v["state"] == "committed" and v["step"] == step for v in views):
            return [str(v["tier"]) for v in views]
        for v in views:
            if v["state"] in ("failed", "skipped"):
                raise AssertionError(f"the notice's save ended {v['state']}: {v['error']}")
        if any(p.poll() is not None for p in run.procs) and any(
            v["state"] != "committed" for v in views
        ):
            codes = [p.poll() for p in run.procs]
            raise AssertionError(f"trainer ended ({codes}) before committing:\n{run.output()}")
        return None

    tiers: list[str] = wait_for(every_pod_committed, exactness.RUN_TIMEOUT, f"step {step}")
    return tiers


def _tensors(uri: Path, step: int) -> dict[str, Any]:
    state: dict[str, Any] = {}
    trainer_sdk.load(state, str(uri), step=step, strict=False)
    flat: dict[str, Any] = {}

    def walk(prefix: str, obj: Any) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(obj, list | tuple):
            for i, v in enumerate(obj):
                walk(f"{prefix}/{i}", v)
        else:
            flat[prefix] = obj

    walk("", state)
    return flat


@pytest.mark.e2e  # 3 sidecars and 3 trainer ranks, three launches, a reference run
def test_a_short_notice_commits_to_memory_is_promoted_and_survives_the_pods_loss(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    ref = exactness.reference(tmp_path_factory.mktemp("reference-ddp-3"), world=WORLD)
    pods = [replicating_sidecar(tmp_path, k) for k in range(WORLD)]
    start_ring(pods, list(range(WORLD)))
    ck = tmp_path / "ck"

    def args(*extra: str) -> list[str]:
        return exactness.args(
            tmp_path,
            "--every-steps", "10",
            "--control-dir", str(tmp_path / "pod{rank}" / "control"),
            "--fast-dir", str(tmp_path / "pod{rank}" / "fast"),
            "--fast-every-steps", "1",
            "--throttle-bytes-per-s", str(RATE),
            "--probe-bytes", "4096",
            "--deadline-margin", "1",
            "--notice-overlap-below", "0",  # the notice is served at the step it arrives
            *extra,
        )  # fmt: skip

    try:
        # -- 1. a notice too short for a durable save: the memory tier, on every rank
        run = trainer.launch(
            WORLD,
            args("--request-at", str(SHORT_NOTICE), "--request-deadline", "5"),
            workdir=tmp_path / "out",
        )
        try:
            tiers = _committed(pods, run, SHORT_NOTICE)
            kept = tmp_path / "snapshot"
            # each pod holds its own rank's files and a manifest (its own "time"); pod 0's,
            # copied last, is the one rank 0 promotes
            for k in reversed(range(WORLD)):
                shutil.copytree(
                    pod_dir(tmp_path, k) / "fast" / step_dir(SHORT_NOTICE),
                    kept,
                    dirs_exist_ok=True,
                )
        finally:
            # pod 1 is lost with its node; the others' trainers restart in place
            run.signal(1, signal.SIGKILL)
            proc = pods[1].proc
            assert proc is not None
            proc.kill()
            proc.wait()
            pods[1].stop()
            run.kill_all()
            for sub in ("fast", "control"):
                shutil.rmtree(pod_dir(tmp_path, 1) / sub, ignore_errors=True)
            pods[1] = replicating_sidecar(tmp_path, 1)
        assert tiers == ["memory"] * WORLD, tiers
        out0 = run.outputs[0].read_text(errors="replace")
        assert "committing to the memory tier, then promoting it" in out0, out0

        # -- 2. the noticed pod replaced: resume from its replica, promoted; a long notice
        start_ring(pods, [1])
        run = trainer.launch(
            WORLD,
            args("--request-at", str(LONG_NOTICE), "--request-deadline", "600"),
            workdir=tmp_path / "out",
        )
        tiers = _committed(pods, run, LONG_NOTICE)
        codes = run.wait(exactness.RUN_TIMEOUT)
        assert codes == [EXIT_STOPPED_AFTER_NOTICE] * WORLD, run.output()
        assert tiers == ["durable"] * WORLD, tiers
        for rank in range(WORLD):
            assert _resumed(run, rank) == (SHORT_NOTICE, "memory"), run.output(rank)
            status = _status(pods[rank])
            assert status["restored_step"] == SHORT_NOTICE, status
            assert status["restored_tier"] == "memory", status
        # the promoted step: the snapshot's files unchanged, loadable from the durable tier
        promoted = ck / step_dir(SHORT_NOTICE)
        names = sorted(p.name for p in kept.iterdir())
        # (a writer killed with its node leaves a temporary file, never a committed name)
        assert sorted(p.name for p in promoted.iterdir() if not p.name.startswith(".")) == names
        for name in names:
            assert (promoted / name).read_bytes() == (kept / name).read_bytes(), name
        loaded = _tensors(ck, SHORT_NOTICE)
        assert any(isinstance(v, torch.Tensor) for v in loaded.values()), loaded.keys()

        # -- 3. to the end, bitwise equal to the uninterrupted run
        run = trainer.launch(WORLD, args(), workdir=tmp_path / "out")
        codes = run.wait(exactness.RUN_TIMEOUT)
        assert codes == [0] * WORLD, run.output()
        for rank in range(WORLD):
            assert _resumed(run, rank) == (LONG_NOTICE, "durable"), run.output(rank)
        exactness.check_exact(tmp_path, ref)
    finally:
        for p in pods:
            p.stop()
            assert TOKEN not in p.log(), "the bearer token appeared in a sidecar's log"
