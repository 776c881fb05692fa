"""The Checkpointer in one process: policy, retention, fallback, resume rules, async saves."""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import trainer_sdk
from trainer_sdk import api
from trainer_sdk.checkpointer import Checkpointer, ResumeError
from trainer_sdk.control import ControlChannel, State
from trainer_sdk.errors import CheckpointError


def _model(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _train(model: nn.Module, opt: torch.optim.Optimizer, n: int = 1) -> None:
    for _ in range(n):
        opt.zero_grad()
        model(torch.randn(4, 6)).square().mean().backward()
        opt.step()


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "BATON_CHECKPOINT_URI",
        "BATON_RESUME_STEP",
        "BATON_EVERY_STEPS",
        "BATON_EVERY_SECONDS",
        "BATON_KEEP_LAST",
        "BATON_CONTROL_DIR",
    ):
        monkeypatch.delenv(name, raising=False)


def test_policy_saves_every_n_steps_and_keeps_the_last_k(tmp_path: Path) -> None:
    model, opt = _model()
    with Checkpointer(str(tmp_path), model=model, optimizer=opt, every_steps=2, keep_last=2) as ck:
        assert ck.restore() == 0
        for step in range(1, 8):
            _train(model, opt)
            assert ck.step(step) is False
    assert api.list_steps(str(tmp_path)) == [4, 6]
    assert trainer_sdk.latest_step(str(tmp_path)) == 6


def test_a_pathlib_path_is_a_uri_and_retention_runs_through_the_opened_storage(
    tmp_path: Path,
) -> None:
    model, opt = _model()
    root = tmp_path / "ckpts"
    with Checkpointer(root, model=model, optimizer=opt, every_steps=1, keep_last=2) as ck:
        assert ck.config.uri == str(root)
        ck.restore()
        for step in range(1, 5):
            _train(model, opt)
            ck.step(step)
    assert api.list_steps(root) == [3, 4]


def test_environment_supplies_uri_and_policy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATON_CHECKPOINT_URI", str(tmp_path / "env"))
    monkeypatch.setenv("BATON_EVERY_STEPS", "3")
    monkeypatch.setenv("BATON_KEEP_LAST", "1")
    model, opt = _model()
    ck = Checkpointer(model=model, optimizer=opt)
    assert ck.config.uri == str(tmp_path / "env")
    assert ck.config.every_steps == 3
    assert ck.config.keep_last == 1
    for step in range(1, 7):
        _train(model, opt)
        ck.step(step)
    ck.close()
    assert api.list_steps(str(tmp_path / "env")) == [6]
    monkeypatch.setenv("BATON_EVERY_STEPS", "often")
    with pytest.raises(CheckpointError, match="BATON_EVERY_STEPS"):
        Checkpointer(model=model, optimizer=opt)


def test_restore_loads_model_optimizer_scheduler_and_extra(tmp_path: Path) -> None:
    model, opt = _model()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=64.0, growth_interval=1)
    with Checkpointer(
        str(tmp_path), model=model, optimizer=opt, scheduler=sched, extra={"scaler": scaler}
    ) as ck:
        ck.restore()
        for _ in range(3):
            opt.zero_grad()
            scaler.scale(model(torch.randn(4, 6)).square().mean()).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
        ck.save(3)
        saved = _params(model)
        saved_opt = opt.state_dict()
        saved_sched = sched.state_dict()
        saved_scale = scaler.get_scale()

    model2, opt2 = _model(seed=1)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    scaler2 = torch.amp.GradScaler("cpu", init_scale=1.0)
    with Checkpointer(
        str(tmp_path), model=model2, optimizer=opt2, scheduler=sched2, extra={"scaler": scaler2}
    ) as ck2:
        assert ck2.restore() == 3
    assert _equal(_params(model2), saved)
    got = opt2.state_dict()
    for idx, st in saved_opt["state"].items():
        for key, value in st.items():
            assert torch.equal(got["state"][idx][key], value)
    assert got["param_groups"][0]["lr"] == saved_opt["param_groups"][0]["lr"]
    assert sched2.state_dict()["last_epoch"] == saved_sched["last_epoch"]
    assert scaler2.get_scale() == saved_scale


def test_restore_without_checkpoint_leaves_the_optimizer_untouched(tmp_path: Path) -> None:
    model, opt = _model()
    with Checkpointer(str(tmp_path), model=model, optimizer=opt) as ck:
        assert ck.restore() == 0
    # get_state_dict would have initialised the optimizer state with a zero step
    assert not opt.state


def _corrupt_newest(root: Path, step: int, how: str) -> Path:
    shard = next((root / f"step-{step:012d}").glob("rank-*.safetensors"))
    data = bytearray(shard.read_bytes())
    if how == "flip":
        data[-5] ^= 0xFF
        shard.write_bytes(bytes(data))
    else:
        shard.write_bytes(bytes(data[: len(data) // 2]))
    return shard


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    model, opt = _model()
    with Checkpointer(str(tmp_path), model=model, optimizer=opt, every_steps=5) as ck:
        ck.restore()
        for step in range(1, 11):
            _train(model, opt)
            if step == 5:
                at_five = _params(model)
            ck.step(step)
    _corrupt_newest(tmp_path, 10, how)
    model2, opt2 = _model(seed=3)
    caplog.set_level(logging.INFO, logger="trainer_sdk")
    with Checkpointer(str(tmp_path), model=model2, optimizer=opt2) as ck2:
        assert ck2.restore() == 5
    assert _equal(_params(model2), at_five)
    assert any(
        "step 10 could not be loaded" in r.getMessage() and "rank-00000-of-00001" in r.getMessage()
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]


def test_resume_step_from_the_operator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    model, opt = _model()
    with Checkpointer(str(tmp_path), model=model, optimizer=opt, every_steps=5) as ck:
        for step in range(1, 11):
            _train(model, opt)
            ck.step(step)
    _corrupt_newest(tmp_path, 10, "flip")
    monkeypatch.setenv("BATON_RESUME_STEP", "10")
    # strict: refuse and say how to proceed
    with (
        Checkpointer(str(tmp_path), model=model, optimizer=opt, resume_fallback=False) as ck,
        pytest.raises(ResumeError, match=r"BATON_RESUME_STEP=10.*resume_fallback=True"),
    ):
        ck.restore()
    # default: fall back, loudly
    caplog.set_level(logging.INFO, logger="trainer_sdk")
    with Checkpointer(str(tmp_path), model=model, optimizer=opt) as ck:
        assert ck.restore() == 5
    assert any(
        r.levelno == logging.ERROR and "BATON_RESUME_STEP=10" in r.getMessage()
        for r in caplog.records
    )


def test_incomplete_step_directories_are_never_loaded_and_only_a_commit_cleans_them(
    tmp_path: Path,
) -> None:
    model, opt = _model()
    with Checkpointer(str(tmp_path), model=model, optimizer=opt) as ck:
        _train(model, opt)
        ck.save(1)
    crashed = tmp_path / f"step-{7:012d}"
    crashed.mkdir()
    (crashed / "rank-00000-of-00001.safetensors").write_bytes(b"half a shard")
    with Checkpointer(str(tmp_path), model=model, optimizer=opt) as ck:
        assert ck.restore() == 1
        # restore() never deletes: the directory may be a save another writer has in flight
        assert (crashed / "rank-00000-of-00001.safetensors").exists()
        _train(model, opt)
        ck.save(8)  # a commit newer than it: now it is provably abandoned
    assert not crashed.exists()


def test_a_different_accumulation_setting_is_refused(tmp_path: Path) -> None:
    model, opt = _model()
    with Checkpointer(str(tmp_path), model=model, optimizer=opt, accumulation_steps=4) as ck:
        _train(model, opt)
        ck.save(1)
    with (
        Checkpointer(str(tmp_path), model=model, optimizer=opt, accumulation_steps=2) as ck,
        pytest.raises(ResumeError, match="accumulation_steps=4"),
    ):
        ck.restore()
    with Checkpointer(str(tmp_path), model=model, optimizer=opt, accumulation_steps=4) as ck:
        assert ck.restore() == 1


def test_bad_settings_name_the_fix(tmp_path: Path) -> None:
    model, opt = _model()
    with pytest.raises(CheckpointError, match="keep at least 1"):
        Checkpointer(str(tmp_path), model=model, optimizer=opt, keep_last=0)
    with pytest.raises(CheckpointError, match="pass model="):
        Checkpointer(str(tmp_path), optimizer=opt)
    with pytest.raises(CheckpointError, match="ResumableSampler"):
        Checkpointer(str(tmp_path), model=model, dataloader=[1, 2, 3]).save(1)


# ---- async ---------------------------------------------------------------------------------


def test_async_save_is_the_staged_state_even_if_tensors_change_at_once(tmp_path: Path) -> None:
    model, opt = _model()
    with Checkpointer(
        str(tmp_path), model=model, optimizer=opt, every_steps=1, async_save=True
    ) as ck:
        _train(model, opt)
        staged = _params(model)
        ck.step(1)
        handle = ck.last_save
        assert handle is not None
        assert handle.step == 1
        # mutate right away, while the background write may still run
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1000.0)
        handle.wait()
        assert handle.done()
        assert handle.exception() is None
    model2, opt2 = _model(seed=9)
    with Checkpointer(str(tmp_path), model=model2, optimizer=opt2) as ck2:
        assert ck2.restore() == 1
    assert _equal(_params(model2), staged)


def test_async_save_buffers_are_reused_across_saves(tmp_path: Path) -> None:
    model, opt = _model()
    with Checkpointer(
        str(tmp_path), model=model, optimizer=opt, every_steps=1, async_save=True, keep_last=1
    ) as ck:
        for step in range(1, 5):
            _train(model, opt)
            ck.step(step)
        assert ck._saver is not None
        first = ck._saver.buffers.allocations
        _train(model, opt)
        ck.step(5)
        ck.wait()
        assert ck._saver.buffers.allocations == first
    assert api.list_steps(str(tmp_path)) == [5]


def test_public_async_save_returns_a_handle_and_saves_the_staged_values(tmp_path: Path) -> None:
    weights = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    meta = {"epoch": 2}
    state: dict[str, Any] = {"w": weights, "meta": meta}
    handle = trainer_sdk.async_save(state, str(tmp_path), step=7)
    weights.mul_(-1)  # after staging: must not reach the checkpoint
    meta["epoch"] = 99
    info = handle.wait()
    assert handle.done()
    assert handle.exception() is None
    assert info.step == 7
    assert info.bytes > 0
    out: dict[str, Any] = {"w": torch.zeros(3, 4), "meta": {"epoch": 0}}
    trainer_sdk.load(out, str(tmp_path), step=7)
    assert torch.equal(out["w"], torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert out["meta"] == {"epoch": 2}
    # a second call reuses the same buffers
    handle2 = trainer_sdk.async_save(state, str(tmp_path), step=8)
    handle2.wait()
    assert trainer_sdk.latest_step(str(tmp_path)) == 8


# ---- notices, in one process (the 2-rank versions are in test_emergency_save.py) ---------


def _manifest_trigger(root: Path, step: int) -> str:
    data = json.loads((root / f"step-{step:012d}" / "manifest.json").read_text())
    return str(data["trigger"])


def test_request_checkpoint_saves_now_and_reports_in_the_control_dir(tmp_path: Path) -> None:
    model, opt = _model()
    ctl = tmp_path / "ctl"
    with Checkpointer(
        str(tmp_path / "ck"), model=model, optimizer=opt, every_steps=100, control_dir=str(ctl)
    ) as ck:
        assert ck.restore() == 0
        _train(model, opt)
        assert ck.step(1) is False
        ck.request_checkpoint(deadline=time.time() + 120, reason="maintenance")
        _train(model, opt)
        assert ck.step(2) is True
    assert api.list_steps(str(tmp_path / "ck")) == [2]
    assert _manifest_trigger(tmp_path / "ck", 2) == "notice"
    status = ControlChannel(ctl).read_status()
    assert status is not None
    assert status.state == State.COMMITTED
    assert status.step == 2
    assert status.last_committed_step == 2
    assert status.bytes is not None
    assert status.bytes > 0
    assert {"drain", "plan", "write", "commit"} <= set(status.phases)
    assert status.deadline is not None


@pytest.mark.parametrize("async_save", [False, True])
def test_a_periodic_save_reports_committed_without_a_request(
    tmp_path: Path, async_save: bool
) -> None:
    # The sidecar times every save from this status; the operator must not take it for a
    # served notice, so it carries no request id and the trigger says periodic.
    model, opt = _model()
    ctl = tmp_path / "ctl"

    def checkpointer() -> Checkpointer:
        return Checkpointer(
            str(tmp_path / "ck"),
            model=model,
            optimizer=opt,
            every_steps=2,
            control_dir=str(ctl),
            async_save=async_save,
        )

    with checkpointer() as ck:
        assert ck.restore() == 0
        for step in (1, 2):
            _train(model, opt)
            assert ck.step(step) is False
    status = ControlChannel(ctl).read_status()
    assert status is not None
    assert status.state == State.COMMITTED
    assert status.trigger == "periodic"
    assert status.request_id is None
    assert status.deadline is None
    assert status.step == 2
    assert status.last_committed_step == 2
    assert status.seconds is not None
    assert status.seconds > 0
    assert status.bytes is not None
    assert status.bytes > 0
    assert "write" in status.phases
    assert status.uri is not None
    assert status.uri.endswith("step-000000000002")
    assert status.restored_step is None, "it started from scratch"

    # A resumed process reports the step it restored for its whole life, after its next save
    # too (the operator corrects status.resumedFromStep from it whenever it polls).
    with checkpointer() as ck:
        assert ck.restore() == 2
        resumed = ControlChannel(ctl).read_status()
        assert resumed is not None
        assert (resumed.state, resumed.restored_step) == (State.IDLE, 2)
        for step in (3, 4):
            _train(model, opt)
            assert ck.step(step) is False
    status = ControlChannel(ctl).read_status()
    assert status is not None
    assert (status.state, status.step, status.restored_step) == (State.COMMITTED, 4, 2)


def test_a_control_request_with_a_too_short_deadline_is_skipped(tmp_path: Path) -> None:
    model, opt = _model()
    ctl = ControlChannel(tmp_path / "ctl")
    with Checkpointer(
        str(tmp_path / "ck"),
        model=model,
        optimizer=opt,
        every_steps=2,
        control_dir=str(ctl.directory),
    ) as ck:
        ck.restore()
        for step in (1, 2, 3):
            _train(model, opt)
            ck.step(step)
        request, _ = ctl.merge_request(
            deadline=datetime.now(UTC) + timedelta(seconds=1), reason="spot", source="aws"
        )
        _train(model, opt)
        assert ck.step(4) is True  # stop: the node is going away either way
    assert api.list_steps(str(tmp_path / "ck")) == [2]  # no step 4, not even partly
    assert not (tmp_path / "ck" / f"step-{4:012d}").exists()
    assert not ctl.request_path.exists()
    status = ctl.read_status()
    assert status is not None
    assert status.state == State.SKIPPED
    assert status.request_id == request.id
    assert status.step == 4
    assert status.error is not None
    assert "margin" in status.error
    assert "resume from step 2" in status.error


def test_sigterm_becomes_an_emergency_save_and_the_handler_is_restored(tmp_path: Path) -> None:
    model, opt = _model()
    before = signal.getsignal(signal.SIGTERM)
    with Checkpointer(str(tmp_path), model=model, optimizer=opt) as ck:
        ck.restore()
        _train(model, opt)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert ck.step(1) is True
    assert signal.getsignal(signal.SIGTERM) == before
    assert api.list_steps(str(tmp_path)) == [1]
    assert _manifest_trigger(tmp_path, 1) == "signal"


class _RequestDuringSave:
    """Extra state whose ``state_dict`` (read while a save collects the state) writes the
    sidecar's checkpoint request once armed: the operator's request landing while a save
    that a node drain's SIGTERM started is running."""

    def __init__(self, channel: ControlChannel) -> None:
        self.channel = channel
        self.armed = False
        self.request_id: str | None = None

    def state_dict(self) -> dict[str, Any]:
        if self.armed and self.request_id is None:
            request, _ = self.channel.merge_request(
                deadline=datetime.now(UTC) + timedelta(seconds=120), reason="spot", source="aws"
            )
            self.request_id = request.id
        return {"n": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def test_a_request_arriving_during_a_signal_save_is_answered_by_it(tmp_path: Path) -> None:
    # Unanswered, the request would keep the sidecar lingering for its outcome (15 s) and the
    # operator from seeing the commit as the answer to its notice: the next attempt waits.
    model, opt = _model()
    ctl = ControlChannel(tmp_path / "ctl")
    late = _RequestDuringSave(ctl)
    with Checkpointer(
        str(tmp_path / "ck"), model=model, optimizer=opt, every_steps=100,
        control_dir=str(ctl.directory), extra={"late": late},
    ) as ck:  # fmt: skip
        ck.restore()
        _train(model, opt)
        late.armed = True
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert ck.step(1) is True
    assert late.request_id is not None, "the save never read the extra state"
    assert api.list_steps(str(tmp_path / "ck")) == [1]
    assert _manifest_trigger(tmp_path / "ck", 1) == "signal"
    assert not ctl.request_path.exists(), "the request was left pending"
    status = ctl.read_status()
    assert status is not None
    assert (status.state, status.step) == (State.COMMITTED, 1)
    assert status.request_id == late.request_id


def test_a_checkpoint_that_does_not_fit_the_model_is_refused_not_skipped(tmp_path: Path) -> None:
    model, opt = _model()
    with Checkpointer(str(tmp_path), model=model, optimizer=opt) as ck:
        _train(model, opt)
        ck.save(1)
        _train(model, opt)
        ck.save(2)
    torch.manual_seed(0)
    other = nn.Sequential(nn.Linear(6, 9), nn.ReLU(), nn.Linear(9, 2))
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    # falling back to step 1 (same mismatch) or starting from 0 (and later deleting the good
    # checkpoints by retention) would both be wrong: refuse, name the fix, keep the files
    with (
        Checkpointer(str(tmp_path), model=other, optimizer=other_opt) as ck,
        pytest.raises(ResumeError, match=r"step 2 .* cannot be loaded into this run"),
    ):
        ck.restore()
    assert api.list_steps(str(tmp_path)) == [1, 2]


def test_every_seconds_saves_by_the_clock(tmp_path: Path) -> None:
    model, opt = _model()
    now = [1000.0]
    with Checkpointer(
        str(tmp_path), model=model, optimizer=opt, every_seconds=60, keep_last=10
    ) as ck:
        ck._engine.clock = lambda: now[0]
        ck._engine.last_save_time = now[0]
        for step in range(1, 8):
            _train(model, opt)
            now[0] += 25.0  # 25 s per step: due at 75 s (step 3), then at 150 s (step 6)
            ck.step(step)
    assert api.list_steps(str(tmp_path)) == [3, 6]
