"""The trainer under ``torchrun`` (2 processes in one "pod"), with one real sidecar.

Two facts of torchrun make the sidecar's status, not the exit code, the truth about a notice
save: torchrun reports a worker's exit 75 (``trainer_sdk.EXIT_STOPPED_AFTER_NOTICE``) as its own
exit 1, and on SIGTERM it forwards the signal to its workers and SIGKILLs them after
``--shutdown-timeout`` seconds (``PET_SHUTDOWN_TIMEOUT``, ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``;
30 by default), whether their save has finished or not. docs/checkpointer.md gives the
settings.
"""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from baton_testing import torchrun as launcher
from baton_testing.sidecar_process import SidecarProcess, wait_for
from baton_testing.trainer import read_loss_log

import trainer_sdk
from trainer_sdk.control import format_rfc3339, utcnow

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

_START_TIMEOUT = 300.0
"""Seconds for torchrun and two torch processes to start on 2 busy cores."""


class Torchrun:
    """``torchrun --standalone --nproc-per-node 2 -m baton_testing.trainer ...``."""

    def __init__(self, tmp: Path, control: Path, *, shutdown_timeout: int, sleep: float) -> None:
        self.tmp = tmp
        self.out = tmp / "torchrun.out"
        target = [
            "-m", "baton_testing.trainer",
            "--steps", "100000", "--sleep", str(sleep), "--timeout", "120",
            "--uri", str(tmp / "ckpt"), "--loss-log", str(tmp / "loss.log"),
            "--result", str(tmp / "result.json"),
        ]  # fmt: skip
        self.proc = launcher.launch(
            target, log=self.out, nproc=2, shutdown_timeout=shutdown_timeout,
            env=launcher.clean_env(BATON_CONTROL_DIR=str(control)),
        )  # fmt: skip

    def output(self) -> str:
        return launcher.tail(self.out, 8000)

    def wait_step(self, step: int) -> None:
        def reached() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"torchrun ended early:\n{self.output()}")
            lines = read_loss_log(self.tmp / "loss.log")
            return bool(lines) and lines[-1][0] >= step

        wait_for(reached, timeout=_START_TIMEOUT, what=f"step {step} under torchrun")

    def wait(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired as e:
            raise AssertionError(f"torchrun did not end:\n{self.output()}") from e

    def kill(self) -> None:
        """SIGKILL torchrun and every process under it, whatever is left."""
        if self.proc.poll() is None:
            launcher.kill(self.proc)


@pytest.fixture
def torchrun(tmp_path: Path) -> Iterator[Callable[..., Torchrun]]:
    started: list[Torchrun] = []

    def start(control: Path, **kwargs: Any) -> Torchrun:
        t = Torchrun(tmp_path, control, **kwargs)
        started.append(t)
        return t

    yield start
    for t in started:
        t.kill()


def _committed(sc: SidecarProcess, tr: Torchrun) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        body: dict[str, Any] = sc.status().json()
        if body["state"] in ("failed", "skipped"):
            raise AssertionError(f"the save ended {body['state']}: {body}\n{tr.output()}")
        return body if body["state"] == "committed" else None

    result: dict[str, Any] = wait_for(done, timeout=_START_TIMEOUT, what="a committed save")
    return result


def _check_committed(body: dict[str, Any], tmp: Path, trigger: str) -> None:
    step = body["step"]
    assert body["trigger"] == trigger
    assert [(r["state"], r["step"]) for r in body["ranks"]] == [("committed", step)] * 2
    assert (tmp / "ckpt" / f"step-{step:012d}" / "manifest.json").is_file()
    result = json.loads((tmp / "result.json").read_text())
    assert result["stopped"] is True
    assert result["step"] == step


def test_request_reaches_both_local_ranks_and_the_status_is_the_truth(
    tmp_path: Path,
    sidecar_factory: Callable[..., SidecarProcess],
    torchrun: Callable[..., Torchrun],
) -> None:
    sc = sidecar_factory()
    tr = torchrun(sc.control_dir, shutdown_timeout=30, sleep=0.05)
    tr.wait_step(2)
    deadline = format_rfc3339(utcnow() + timedelta(seconds=120))
    r = sc.post_checkpoint({"deadline": deadline, "reason": "node drained"})
    assert r.status_code == 202, r.text
    code = tr.wait()
    # Both workers exited 75; torchrun reports that as a failure of its own.
    assert trainer_sdk.EXIT_STOPPED_AFTER_NOTICE == 75
    assert "exitcode  : 75" in tr.output(), tr.output()
    assert code == 1, f"torchrun exited {code}:\n{tr.output()}"
    body = sc.status().json()
    assert body["state"] == "committed", body
    assert body["request_id"] == r.json()["id"]
    _check_committed(body, tmp_path, "notice")


@pytest.mark.parametrize("shutdown_timeout", [60, 1], ids=["enough-grace", "too-little-grace"])
def test_sigterm_to_torchrun_and_its_shutdown_timeout(
    tmp_path: Path,
    sidecar_factory: Callable[..., SidecarProcess],
    torchrun: Callable[..., Torchrun],
    shutdown_timeout: int,
) -> None:
    """SIGTERM reaches torchrun (the container's main process) while both workers are 10 s
    from their next step boundary: with 60 s of grace they save and commit; with 1 s torchrun
    SIGKILLs them first, and the sidecar never reports a commit."""
    sc = sidecar_factory()
    tr = torchrun(sc.control_dir, shutdown_timeout=shutdown_timeout, sleep=10.0)
    tr.wait_step(1)  # logged just before each worker sleeps 10 s, then reaches its boundary
    tr.proc.send_signal(signal.SIGTERM)
    code = tr.wait()
    assert code != 0, tr.output()
    body = sc.status().json()
    if shutdown_timeout == 60:
        assert body["state"] == "committed", f"{body}\n{tr.output()}"
        _check_committed(body, tmp_path, "signal")
    else:
        assert body["state"] != "committed", f"{body}\n{tr.output()}"
        assert body["last_committed_step"] is None
        assert not list((tmp_path / "ckpt").glob("step-*/manifest.json"))
        # torchrun's own words for the SIGKILL after --shutdown-timeout
        assert "forcefully exiting via 9" in tr.output(), tr.output()
