"""The sidecar with a real trainer: 2 gloo ranks running the real ``trainer_sdk.Checkpointer``.

Each rank is its own "pod" with its own control directory (``LOCAL_RANK=0`` in each), as on a
cluster with one rank per node. The operator's path: ``POST /v1/checkpoint`` to every pod's
sidecar, and the ranks save one agreed step and stop. The cloud path: a notice reaches one
node's sidecar only, and the ranks still save together, before the notice's deadline.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from baton_testing.fake_clouds import FakeAws, FakeAzure, FakeGce
from baton_testing.sidecar_process import SidecarProcess, wait_for
from baton_testing.trainer import TrainerRun, launch
from prometheus_client.parser import text_string_to_metric_families

from trainer_sdk import EXIT_STOPPED_AFTER_NOTICE
from trainer_sdk.control import format_rfc3339, parse_rfc3339, utcnow

pytestmark = pytest.mark.e2e

FAST = {
    "BATON_SIDECAR_AWS_INTERVAL": "0.5",
    "BATON_SIDECAR_AZURE_INTERVAL": "0.5",
    "BATON_SIDECAR_GCE_WAIT": "10",
    "BATON_SIDECAR_METADATA_TIMEOUT": "2",
    "BATON_SIDECAR_BACKOFF_MAX": "1",
}


@pytest.fixture
def trainer(tmp_path: Path) -> Iterator[Callable[..., TrainerRun]]:
    runs: list[TrainerRun] = []

    def start(control: Path) -> TrainerRun:
        run = launch(
            2,
            [
                "--steps",
                "100000",  # runs until a notice stops it
                "--sleep",
                "0.05",
                "--uri",
                str(tmp_path / "ckpt"),
                "--control-dir",
                f"{control}/{{rank}}",
                "--result",
                str(tmp_path / "result.json"),
            ],
            workdir=tmp_path / "trainer",
        )
        runs.append(run)
        return run

    yield start
    for run in runs:
        run.kill_all()


def _metric(sc: SidecarProcess, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(sc.metrics()):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    raise AssertionError(f"no sample {name}{labels}")


def _wait_training(sidecars: list[SidecarProcess], run: TrainerRun) -> None:
    def beating() -> bool:
        for p in run.procs:
            if p.poll() is not None:
                raise AssertionError(f"a rank exited early:\n{run.output()}")
        return all(sc.status().json()["trainer"] == "alive" for sc in sidecars)

    wait_for(beating, timeout=120, what="both ranks training")


def _wait_committed(sc: SidecarProcess, run: TrainerRun, timeout: float = 120) -> dict[str, Any]:
    def committed() -> dict[str, Any] | None:
        body: dict[str, Any] = sc.status().json()
        if body["state"] in ("failed", "skipped"):
            raise AssertionError(f"save ended {body['state']}: {body['error']}\n{run.output()}")
        return body if body["state"] == "committed" else None

    result: dict[str, Any] = wait_for(committed, timeout=timeout, what="a committed save")
    return result


def _check_stopped_at(run: TrainerRun, tmp_path: Path, step: int) -> None:
    assert run.wait(120) == [EXIT_STOPPED_AFTER_NOTICE] * 2, run.output()
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["stopped"] is True
    assert result["step"] == step
    manifest = tmp_path / "ckpt" / f"step-{step:012d}" / "manifest.json"
    assert manifest.is_file(), f"no manifest for step {step}"


def test_operator_request_leads_to_a_committed_step(
    tmp_path: Path,
    sidecar_factory: Callable[..., SidecarProcess],
    trainer: Callable[..., TrainerRun],
) -> None:
    control = tmp_path / "control"
    pods = [sidecar_factory(control_dir=control / str(rank)) for rank in range(2)]
    run = trainer(control)
    _wait_training(pods, run)

    deadline = format_rfc3339(utcnow() + timedelta(seconds=90))
    ids = []
    for sc in pods:  # the operator asks every pod of the job
        r = sc.post_checkpoint({"deadline": deadline, "reason": "node drained"})
        assert r.status_code == 202, r.text
        ids.append(r.json()["id"])

    statuses = [_wait_committed(sc, run) for sc in pods]
    step = statuses[0]["step"]
    assert isinstance(step, int)
    assert step > 0
    for body, request_id in zip(statuses, ids, strict=True):
        assert body["step"] == step, "every rank saves the same step"
        assert body["request_id"] == request_id
        assert body["seconds"] > 0
        assert body["last_committed_step"] == step
        assert body["uri"].endswith(f"step-{step:012d}")
        assert body["trigger"] == "notice"
        assert parse_rfc3339(body["updated"]) < parse_rfc3339(deadline)
    _check_stopped_at(run, tmp_path, step)

    sc = pods[0]
    # The metrics follow the status file on the sidecar's next look (every 0.5 s), while
    # GET /v1/status reads it at once: wait for that look, then for each figure.
    wait_for(lambda: _metric(sc, "baton_checkpoint_requests_total", result="committed") > 0,
             timeout=30, what="the sidecar's metrics to see the commit")  # fmt: skip
    assert _metric(sc, "baton_checkpoint_requests_total", result="committed") == 1.0
    assert _metric(sc, "baton_checkpoint_last_committed_step") == step
    assert _metric(sc, "baton_checkpoint_seconds_count", trigger="notice") == 1.0
    assert _metric(sc, "baton_checkpoint_bytes_total") > 0
    assert _metric(sc, "baton_checkpoint_phase_seconds_count", phase="write") == 1.0
    # Every phase the real SDK reported is a metric: the two sides share one vocabulary.
    reported = statuses[0]["phases"]
    assert set(reported) == {"drain", "plan", "write", "hash", "commit"}, reported
    for phase in reported:
        assert _metric(sc, "baton_checkpoint_phase_seconds_count", phase=phase) == 1.0, phase
    assert _metric(sc, "baton_checkpoint_deadline_margin_seconds_count") == 1.0
    assert _metric(sc, "baton_notices_total", source="operator") == 1.0
    # The trainer has exited; its heartbeat stops and the request file is gone.
    assert sc.status().json()["pending_request"] is None


@pytest.mark.parametrize("cloud", ["aws", "gce", "azure"])
def test_cloud_notice_leads_to_a_commit_before_its_deadline(
    tmp_path: Path,
    sidecar_factory: Callable[..., SidecarProcess],
    trainer: Callable[..., TrainerRun],
    cloud: str,
) -> None:
    fakes = {"aws": FakeAws, "gce": FakeGce, "azure": FakeAzure}
    endpoint_env = {
        "aws": "BATON_AWS_IMDS_ENDPOINT",
        "gce": "BATON_GCE_METADATA_ENDPOINT",
        "azure": "BATON_AZURE_IMDS_ENDPOINT",
    }
    control = tmp_path / "control"
    with fakes[cloud]() as fake:
        # Only rank 0's node gets the notice; rank 1's pod has no sidecar at all.
        sc = sidecar_factory(
            control_dir=control / "0",
            cloud=cloud,
            env={**FAST, endpoint_env[cloud]: fake.url},
        )
        run = trainer(control)
        _wait_training([sc], run)

        event_id = None
        if isinstance(fake, FakeAws):
            deadline = (utcnow() + timedelta(seconds=120)).replace(microsecond=0)
            fake.set_notice(time=deadline)
        elif isinstance(fake, FakeGce):
            deadline = utcnow() + timedelta(seconds=30)
            fake.preempt()
        else:
            assert isinstance(fake, FakeAzure)
            deadline = (utcnow() + timedelta(seconds=45)).replace(microsecond=0)
            event_id = fake.add_event(not_before=deadline)

        body = _wait_committed(sc, run, timeout=deadline.timestamp() - utcnow().timestamp())
        assert parse_rfc3339(body["updated"]) < deadline, "committed after the deadline"
        assert body["deadline"] is not None
        # The request carried the notice's deadline (GCE's is computed from its arrival).
        assert abs((parse_rfc3339(body["deadline"]) - deadline).total_seconds()) < 3
        _check_stopped_at(run, tmp_path, body["step"])
        assert _metric(sc, "baton_notices_total", source=cloud) == 1.0
        if isinstance(fake, FakeAzure):
            wait_for(lambda: fake.acknowledged, what="the Azure acknowledgement")
            assert fake.acknowledged == [event_id]
