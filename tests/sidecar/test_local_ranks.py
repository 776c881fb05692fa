"""Several processes per pod share one sidecar and one control directory.

Each local rank writes its own status file (``status.json`` for ``LOCAL_RANK=0``,
``status.local-<k>.json`` for the others); the sidecar reports one status for the pod:
``committed`` only when every local rank committed the same save, ``failed`` as soon as one
failed, the least advanced state in between, and the oldest heartbeat. One request reaches
every rank of the job (local rank 0 takes it; the ranks' per-step agreement carries it).

The first tests write the files as each local rank's Checkpointer would and read them through a
real sidecar; the last one runs 2 pods x 2 processes of the real trainer (4 gloo ranks).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from baton_testing.sidecar_process import SidecarProcess, wait_for
from baton_testing.trainer import launch

from trainer_sdk import EXIT_STOPPED_AFTER_NOTICE
from trainer_sdk.control import (
    ControlChannel,
    ControlFormatError,
    State,
    Status,
    format_rfc3339,
    local_status_file,
    utcnow,
)


def _write(ch: ControlChannel, local_rank: int, state: State, **kw: Any) -> Status:
    status = Status(
        state=state,
        local_rank=local_rank,
        local_world_size=kw.pop("local_world_size", 3),
        trigger=kw.pop("trigger", "notice"),
        step=kw.pop("step", 12),
        **kw,
    )
    ch.write_status(status)
    return status


def test_each_local_rank_has_its_own_file(tmp_path: Path) -> None:
    ch = ControlChannel(tmp_path)
    assert local_status_file(0) == "status.json"
    assert local_status_file(2) == "status.local-2.json"
    _write(ch, 0, State.SAVING)
    _write(ch, 2, State.COMMITTED)
    assert json.loads((tmp_path / "status.json").read_text())["local_rank"] == 0
    assert json.loads((tmp_path / "status.local-2.json").read_text())["state"] == "committed"
    assert ch.read_local_status(1) is None
    with pytest.raises(ControlFormatError, match="LOCAL_RANK"):
        local_status_file(-1)


def test_committed_only_when_every_local_rank_committed(
    tmp_path: Path, sidecar_factory: Callable[..., SidecarProcess]
) -> None:
    sc = sidecar_factory()
    ch = ControlChannel(sc.control_dir)
    _write(ch, 0, State.COMMITTED, request_id="r1", uri="file:///ck/step-000000000012")
    # Local rank 1 still saving, local rank 2 has written nothing yet: it has not begun.
    _write(ch, 1, State.SAVING)
    body = sc.status().json()
    assert body["state"] == "requested"
    assert body["request_id"] == "r1"
    assert [r["state"] for r in body["ranks"]] == ["committed", "saving", "absent"]
    # Local rank 2 still reports the previous save (another step): not begun either.
    _write(ch, 2, State.COMMITTED, step=8, trigger="periodic")
    assert sc.status().json()["state"] == "requested"
    _write(ch, 2, State.SAVING)
    assert sc.status().json()["state"] == "saving"
    _write(ch, 1, State.COMMITTED)
    assert sc.status().json()["state"] == "saving"
    _write(ch, 2, State.COMMITTED)
    body = sc.status().json()
    assert body["state"] == "committed"
    assert body["step"] == 12
    assert body["uri"] == "file:///ck/step-000000000012"
    assert [r["state"] for r in body["ranks"]] == ["committed"] * 3
    # The save counts once in the sidecar's metrics, when the last local rank committed.
    wait_for(
        lambda: 'baton_checkpoint_requests_total{result="committed"} 1.0' in sc.metrics(),
        what="the committed save in the metrics",
    )


def test_one_failed_local_rank_fails_the_pod(
    tmp_path: Path, sidecar_factory: Callable[..., SidecarProcess]
) -> None:
    sc = sidecar_factory()
    ch = ControlChannel(sc.control_dir)
    _write(ch, 0, State.SAVING, request_id="r2")
    _write(ch, 1, State.SAVING)
    _write(ch, 2, State.FAILED, error="OSError: No space left on device")
    body = sc.status().json()
    assert body["state"] == "failed"
    assert body["error"] == "local rank 2: OSError: No space left on device"
    assert body["request_id"] == "r2"


def test_requested_while_a_local_rank_has_not_taken_the_save(tmp_path: Path) -> None:
    ch = ControlChannel(tmp_path)
    _write(ch, 0, State.SAVING, local_world_size=2)
    _write(ch, 1, State.IDLE, local_world_size=2, step=None, trigger=None)
    status = ch.read_status()
    assert status is not None
    assert status.state is State.REQUESTED


def test_the_oldest_heartbeat_speaks_for_the_pod(
    tmp_path: Path, sidecar_factory: Callable[..., SidecarProcess]
) -> None:
    sc = sidecar_factory()
    ch = ControlChannel(sc.control_dir)
    now = utcnow()
    _write(ch, 0, State.IDLE, local_world_size=2, heartbeat=now)
    # Local rank 1 stopped beating two minutes ago (a hung or dead process).
    _write(ch, 1, State.IDLE, local_world_size=2, heartbeat=now - timedelta(seconds=120))
    body = sc.status().json()
    assert body["trainer"] == "silent"
    assert body["heartbeat_age_seconds"] >= 120
    # With one process per pod the single file is the status, unchanged.
    solo = ControlChannel(tmp_path / "solo")
    written = _write(solo, 0, State.SAVING, local_world_size=1)
    read = solo.read_status()
    assert read is not None
    assert read.to_json() == written.to_json()


@pytest.mark.e2e
@pytest.mark.timeout(1200)
def test_two_pods_of_two_processes_commit_together(
    tmp_path: Path, sidecar_factory: Callable[..., SidecarProcess]
) -> None:
    control = tmp_path / "control"
    pods = [sidecar_factory(control_dir=control / str(pod)) for pod in range(2)]
    run = launch(
        4,
        [
            "--steps", "100000",  # runs until the notice stops it
            "--sleep", "0.05",
            "--uri", str(tmp_path / "ckpt"),
            "--control-dir", f"{control}/{{pod}}",
            "--result", str(tmp_path / "result.json"),
        ],
        workdir=tmp_path / "trainer",
        procs_per_pod=2,
    )  # fmt: skip
    try:

        def training() -> bool:
            if any(p.poll() is not None for p in run.procs):
                raise AssertionError(f"a rank exited early:\n{run.output()}")
            bodies = [sc.status().json() for sc in pods]
            return all(
                b["trainer"] == "alive" and [r["state"] for r in b["ranks"]] == ["idle", "idle"]
                for b in bodies
            )

        wait_for(training, timeout=300, what="4 ranks training, 2 per pod")
        # The notice reaches pod 1's sidecar only (say, its node's cloud metadata).
        deadline = format_rfc3339(utcnow() + timedelta(seconds=120))
        r = pods[1].post_checkpoint({"deadline": deadline, "reason": "spot interruption"})
        assert r.status_code == 202, r.text
        request_id = r.json()["id"]
        assert run.wait(300) == [EXIT_STOPPED_AFTER_NOTICE] * 4, run.output()
    finally:
        run.kill_all()
    result = json.loads((tmp_path / "result.json").read_text())
    step = result["step"]
    assert result["stopped"] is True
    assert (tmp_path / "ckpt" / f"step-{step:012d}" / "manifest.json").is_file()
    for pod, sc in enumerate(pods):
        body = sc.status().json()
        assert body["state"] == "committed", body
        assert body["step"] == step
        assert body["trigger"] == "notice"
        assert [(r["state"], r["step"]) for r in body["ranks"]] == [("committed", step)] * 2
        # Only the pod that was asked has a request id to report.
        assert body["request_id"] == (request_id if pod == 1 else None)
