"""Writer processes under torchrun: three workers in one "pod", each saving through its own
``trainer_sdk.saveload._writer_process`` child (``BATON_WRITER_PROCESS=1``).

torchrun owns its workers' lives: it starts each in a session of its own and, on its own
SIGTERM (what the kubelet sends the container's main process), stops each with
``killpg(SIGTERM)``. A writer process in its worker's group died with that signal, under
the write that the worker's SIGTERM save then waited for. Here torchrun gets SIGTERM while
every worker is held mid-run with its writer alive; the writers must live through it, every
worker must commit the same step and exit 75, and the relaunched job must finish (torchrun
exits 0 only when every worker exited 0) bitwise equal to a run never interrupted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from baton_testing import torchrun
from baton_testing.trainer import read_loss_log

from trainer_sdk.control import ControlChannel

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

NPROC = 3
STEPS = 10
HOLD_AT = 4
RUN_TIMEOUT_S = 300.0
# 1,000,000 hidden units: about 40 MiB of weights and 80 MiB of AdamW moments, so that each
# worker's part of a save is above the 16 MiB below which saves skip the writer process.
TRAINER_ARGS = ["--steps", str(STEPS), "--every-steps", "3", "--async-save", "--hidden",
                "1000000", "--timeout", "120"]  # fmt: skip


def _start(out: Path, *extra: str, **env: str) -> subprocess.Popen[bytes]:
    target = [
        "-m", "baton_testing.trainer", *TRAINER_ARGS, "--uri", str(out / "ckpt"),
        "--loss-log", str(out / "loss.log"), "--result", str(out / "result.json"), *extra,
    ]  # fmt: skip
    return torchrun.launch(
        target, log=out / "torchrun.log", nproc=NPROC, env=torchrun.clean_env(**env),
        shutdown_timeout=120,
    )  # fmt: skip


def _tail(out: Path) -> str:
    return torchrun.tail(out / "torchrun.log")


def _finish(proc: subprocess.Popen[bytes], out: Path) -> int:
    return torchrun.finish(proc, out / "torchrun.log", timeout=RUN_TIMEOUT_S)


def _wait_for(
    what: str, ready: Callable[[], bool], proc: subprocess.Popen[bytes], out: Path
) -> None:
    torchrun.wait_until(what, ready, proc, out / "torchrun.log", timeout=RUN_TIMEOUT_S)


def _writers(launcher: int) -> dict[int, psutil.Process]:
    """Each worker's pid -> its writer process (the workers are torchrun's children)."""
    found: dict[int, psutil.Process] = {}
    for worker in psutil.Process(launcher).children():
        for child in worker.children():
            if "trainer_sdk.saveload._writer_process" in " ".join(child.cmdline()):
                found[worker.pid] = child
    return found


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_sigterm_to_torchrun_leaves_the_writer_processes_to_finish_the_save_and_resume_bitwise(
    tmp_path: Path,
) -> None:
    ref = tmp_path / "ref"
    with torchrun.killed_at_end(_start(ref)) as proc:
        assert _finish(proc, ref) == 0, _tail(ref)

    run, hold, control = tmp_path / "run", tmp_path / "hold", tmp_path / "control"
    hold.mkdir()
    control.mkdir()
    on = {"BATON_WRITER_PROCESS": "1", "BATON_CONTROL_DIR": str(control)}
    with torchrun.killed_at_end(
        _start(run, "--hold-at", str(HOLD_AT), "--hold-dir", str(hold), **on)
    ) as proc:
        # Held after step 4: the save of step 3 went through a writer process per worker.
        _wait_for(
            f"every worker held at step {HOLD_AT}",
            lambda: all((hold / f"held-{r}").exists() for r in range(NPROC)), proc, run,
        )  # fmt: skip
        writers = _writers(proc.pid)
        assert len(writers) == NPROC, f"a writer process per worker: {writers}\n{_tail(run)}"
        for worker, writer in writers.items():
            assert os.getpgid(writer.pid) != os.getpgid(worker), "the writer is in its group"

        proc.send_signal(signal.SIGTERM)  # the kubelet's, to the container's main process
        _wait_for(
            "torchrun's SIGTERM to its workers",
            lambda: "death signal, shutting down workers" in _tail(run), proc, run,
        )  # fmt: skip
        time.sleep(2.0)  # its killpg of each worker's group is sent by now
        assert all(_alive(w) for w in writers.values()), "a writer died with its worker's group"
        (hold / "release").touch()
        code = _finish(proc, run)
    assert code != 0, _tail(run)  # torchrun's own exit after its SIGTERM

    # Every worker saved the same step after its SIGTERM and reported the commit (its exit
    # code, 75, is not in torchrun's output after a SIGTERM to torchrun: the status is).
    channel = ControlChannel(control)
    reports = [channel.read_local_status(r) for r in range(NPROC)]
    assert all(r is not None for r in reports), reports
    steps = {r.step for r in reports if r is not None}
    assert len(steps) == 1, reports
    (saved,) = steps
    assert saved >= HOLD_AT
    for r in reports:
        assert r is not None
        assert (r.state.value, r.last_committed_step, r.trigger) == ("committed", saved, "signal")
    manifest = json.loads((run / "ckpt" / f"step-{saved:012d}" / "manifest.json").read_text())
    assert (manifest["trigger"], manifest["world_size"]) == ("signal", NPROC)
    stopped = json.loads((run / "result.json").read_text())
    assert (stopped["step"], stopped["stopped"]) == (saved, True)
    deadline = time.monotonic() + 30  # killed with their workers (PR_SET_PDEATHSIG)
    while any(_alive(w) for w in writers.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(w) for w in writers.values()), "a writer outlived its worker"

    with torchrun.killed_at_end(_start(run, BATON_WRITER_PROCESS="1")) as proc:
        assert _finish(proc, run) == 0, _tail(run)  # every worker exited 0
    got, want = (json.loads((d / "result.json").read_text()) for d in (run, ref))
    assert got == want
    for rank in range(NPROC):
        suffix = "" if rank == 0 else f".rank{rank}"
        losses = read_loss_log(run / f"loss.log{suffix}")
        assert losses == read_loss_log(ref / f"loss.log{suffix}"), f"rank {rank}'s losses"
