"""Emergency saves: a notice heard by one rank makes every rank save the same step, then stop;
the restart resumes bitwise-exactly. Real processes, 2 ranks, gloo."""

from __future__ import annotations

import json
import signal
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from baton_testing import exactness, trainer
from baton_testing.exactness import WORLD, check_exact, wait_for_step
from baton_testing.exactness import args as _args

from trainer_sdk import EXIT_STOPPED_AFTER_NOTICE, api
from trainer_sdk.control import ControlChannel, State
from trainer_sdk.format.layout import MANIFEST, step_dir

# Real trainer processes (2 ranks, several restarts): tens of seconds each on 2 cores.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return exactness.reference(tmp_path_factory.mktemp("reference"))


def _stopped_step(tmp: Path, run: trainer.TrainerRun) -> int:
    codes = run.wait(exactness.RUN_TIMEOUT)
    assert codes == [EXIT_STOPPED_AFTER_NOTICE] * WORLD, run.output()
    result = json.loads((tmp / "result.json").read_text())
    assert result["stopped"] is True
    step = int(result["step"])
    # every rank stopped at that step: its last logged step is the saved one
    for r in range(WORLD):
        lines = trainer.read_loss_log(tmp / ("loss.log" if r == 0 else f"loss.log.rank{r}"))
        assert lines[-1][0] == step, f"rank {r} went on past the agreed step {step}"
    return step


def _manifest(tmp: Path, step: int) -> dict[str, object]:
    data = json.loads((tmp / "ck" / step_dir(step) / MANIFEST).read_text())
    assert isinstance(data, dict)
    return data


def _resume_and_check(tmp: Path, reference: dict[str, Any], saved: int) -> None:
    run = trainer.run(WORLD, _args(tmp), workdir=tmp / "out", timeout=exactness.RUN_TIMEOUT)
    assert f"RESUMED_FROM {saved}" in run.output(0)
    check_exact(tmp, reference)


def test_sigterm_to_one_rank_saves_the_same_step_everywhere(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    run = trainer.launch(WORLD, _args(tmp_path, "--sleep", "0.05"), workdir=tmp_path / "out")
    wait_for_step(tmp_path, 6, run)
    run.signal(1, signal.SIGTERM)  # one rank only, like a node's kubelet would
    step = _stopped_step(tmp_path, run)
    assert step >= 6
    assert api.list_steps(str(tmp_path / "ck"))[-1] == step
    manifest = _manifest(tmp_path, step)
    assert manifest["trigger"] == "signal"
    assert manifest["world_size"] == WORLD
    _resume_and_check(tmp_path, reference, step)


def test_control_request_in_one_pod_saves_and_reports(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    ctl = tmp_path / "ctl{rank}"
    run = trainer.launch(
        WORLD,
        _args(tmp_path, "--sleep", "0.05", "--control-dir", str(ctl)),
        workdir=tmp_path / "out",
    )
    wait_for_step(tmp_path, 5, run)
    pod1 = ControlChannel(tmp_path / "ctl1")
    request, _ = pod1.merge_request(
        deadline=datetime.now(UTC) + timedelta(seconds=120), reason="spot notice", source="aws"
    )
    step = _stopped_step(tmp_path, run)
    assert not pod1.request_path.exists(), "the served request was not cleared"
    for r in range(WORLD):
        status = ControlChannel(tmp_path / f"ctl{r}").read_status()
        assert status is not None
        assert status.state == State.COMMITTED, status
        assert status.step == step
        assert status.last_committed_step == step
        assert status.trigger == "notice"
        assert status.seconds is not None
        assert status.seconds > 0
        assert status.uri is not None
        assert status.uri.endswith(step_dir(step))
        assert status.bytes is not None
        assert status.bytes > 0
        assert status.deadline is not None
    assert ControlChannel(tmp_path / "ctl1").read_status().request_id == request.id  # type: ignore[union-attr]
    assert _manifest(tmp_path, step)["trigger"] == "notice"
    _resume_and_check(tmp_path, reference, step)


# ``--notice-overlap-below 0``: the blocking agreement, which serves a notice at the very
# boundary where it is heard. The overlapped one (the default for short steps) serves it one
# boundary later: see the tests after this one.
_BLOCKING = ("--notice-overlap-below", "0")
_OVERLAPPED = ("--notice-overlap-below", "inf")


def test_request_checkpoint_on_one_rank(tmp_path: Path, reference: dict[str, Any]) -> None:
    run = trainer.launch(
        WORLD,
        _args(
            tmp_path, "--request-at", "10", "--request-rank", "1", "--request-deadline", "60",
            *_BLOCKING,
        ),
        workdir=tmp_path / "out",
    )  # fmt: skip
    step = _stopped_step(tmp_path, run)
    assert step == 10  # served at the very boundary where it was asked for
    assert _manifest(tmp_path, 10)["trigger"] == "notice"
    _resume_and_check(tmp_path, reference, 10)


def test_overlapped_agreement_serves_one_boundary_later_on_every_rank(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    # the request is made on rank 1 before step(10); the agreement that carries it runs
    # during step 11's compute, so every rank saves step 11 and stops there
    run = trainer.launch(
        WORLD,
        _args(
            tmp_path, "--request-at", "10", "--request-rank", "1", "--request-deadline", "60",
            *_OVERLAPPED,
        ),
        workdir=tmp_path / "out",
    )  # fmt: skip
    step = _stopped_step(tmp_path, run)
    assert step == 11
    assert api.list_steps(str(tmp_path / "ck"))[-1] == 11
    assert _manifest(tmp_path, 11)["trigger"] == "notice"
    _resume_and_check(tmp_path, reference, 11)


def test_overlapped_agreement_with_batched_checks_and_async_saves(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    # checks at multiples of 3, an async save at every step: a request at step 7 is shared
    # at the boundary of step 9 and served at the next one, 12, after the save in flight
    args = _args(
        tmp_path, "--async-save", "--notice-every", "3", "--request-at", "7",
        "--request-rank", "0", *_OVERLAPPED,
    )  # fmt: skip
    args[args.index("--every-steps") + 1] = "1"
    run = trainer.launch(WORLD, args, workdir=tmp_path / "out")
    step = _stopped_step(tmp_path, run)
    assert step == 12
    assert api.list_steps(str(tmp_path / "ck"))[-1] == 12
    assert _manifest(tmp_path, 12)["trigger"] == "notice"
    _resume_and_check(tmp_path, reference, 12)


def test_a_deadline_too_short_is_skipped_and_the_previous_step_resumes(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    run = trainer.launch(
        WORLD,
        _args(
            tmp_path,
            "--request-at", "10", "--request-rank", "0", "--request-deadline", "1",
            "--deadline-margin", "5", "--control-dir", str(tmp_path / "ctl{rank}"),
            *_BLOCKING,
        ),
        workdir=tmp_path / "out",
    )  # fmt: skip
    step = _stopped_step(tmp_path, run)
    assert step == 10
    # no new committed step: the newest is the periodic one before the request
    assert api.list_steps(str(tmp_path / "ck"))[-1] == 8
    assert not (tmp_path / "ck" / step_dir(10)).exists()
    status = ControlChannel(tmp_path / "ctl0").read_status()
    assert status is not None
    assert status.state == State.SKIPPED
    assert status.step == 10
    assert status.error is not None
    assert "deadline" in status.error
    assert "resume from step 8" in status.error
    assert status.last_committed_step == 8
    _resume_and_check(tmp_path, reference, 8)


def test_notice_with_an_async_save_in_flight(tmp_path: Path, reference: dict[str, Any]) -> None:
    # every step starts an async save, so the notice always finds one in flight
    args = _args(tmp_path, "--async-save", "--request-at", "9", "--request-rank", "1", *_BLOCKING)
    args[args.index("--every-steps") + 1] = "1"
    run = trainer.launch(WORLD, args, workdir=tmp_path / "out")
    step = _stopped_step(tmp_path, run)
    assert step == 9
    steps = api.list_steps(str(tmp_path / "ck"))
    assert steps[-1] == 9
    assert _manifest(tmp_path, 9)["trigger"] == "notice"
    _resume_and_check(tmp_path, reference, 9)


def test_sigterm_before_any_checkpoint_still_lands(tmp_path: Path) -> None:
    """No earlier save and no deadline: the probe write is the only estimate, and it suffices."""
    args = [
        "--steps",
        "1000",
        "--sleep",
        "0.05",
        "--uri",
        str(tmp_path / "ck"),
        "--loss-log",
        str(tmp_path / "loss.log"),
        "--result",
        str(tmp_path / "result.json"),
    ]
    run = trainer.launch(WORLD, args, workdir=tmp_path / "out")
    wait_for_step(tmp_path, 2, run)
    run.signal(0, signal.SIGTERM)
    step = _stopped_step(tmp_path, run)
    assert api.list_steps(str(tmp_path / "ck")) == [step]


def test_batched_notice_check_saves_at_the_next_multiple_of_k(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    # the check runs when step % 4 == 0 on every rank: a request at step 9 is served at 12
    run = trainer.launch(
        WORLD,
        _args(
            tmp_path,
            "--notice-every",
            "4",
            "--request-at",
            "9",
            "--request-rank",
            "1",
            *_BLOCKING,
        ),
        workdir=tmp_path / "out",
    )
    step = _stopped_step(tmp_path, run)
    assert step == 12
    assert _manifest(tmp_path, 12)["trigger"] == "notice"
    _resume_and_check(tmp_path, reference, 12)
