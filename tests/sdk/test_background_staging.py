"""Staging in the background (``stage_in_background``): the save call returns before the copy of
the parameters and optimizer state, the optimizer's step waits for it, what a forward changes
is copied in the call, and a tensor changed in place before its copy is done fails the save
instead of committing bytes of two steps.

The staging thread is held at a gate (a task queued on it before the save), so that "before
the copy is done" is a state the test is in, not a race it hopes to win.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import trainer_sdk
from trainer_sdk.checkpointer import Checkpointer
from trainer_sdk.errors import CheckpointError
from trainer_sdk.staging import AsyncSaver


def _model(seed: int = 0) -> tuple[nn.Sequential, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    # BatchNorm: its running statistics change in every training forward, outside the
    # optimizer's step, so they must be copied in the save call.
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _forward_backward(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(4, 6)).square().mean().backward()


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, s in enumerate(opt.state.values()):
        for k, v in s.items():
            out[f"optim.{i}.{k}"] = v.detach().clone()
    return out


def _hold(saver: AsyncSaver) -> threading.Event:
    """Queue a task on the saver's staging thread that waits for the returned event: a copy
    submitted after it cannot start until the event is set."""
    gate = threading.Event()
    saver._stager.submit(gate.wait, 30)
    return gate


def _assert_step_waits_for(gate: threading.Event, opt: torch.optim.Optimizer) -> None:
    """``opt.step()`` on another thread stays blocked while ``gate`` holds the staging thread,
    and returns once it is opened."""
    stepped = threading.Event()

    def optimizer_step() -> None:
        opt.step()
        stepped.set()

    stepper = threading.Thread(target=optimizer_step)
    stepper.start()
    assert not stepped.wait(0.5), "the optimizer's step ran before the save's copy was done"
    gate.set()
    assert stepped.wait(30)
    stepper.join()


def _one_step_trained(
    tmp_path: Path,
    wrap: Callable[[torch.optim.Optimizer], torch.optim.Optimizer] = lambda opt: opt,
) -> tuple[nn.Sequential, torch.optim.Optimizer, Checkpointer, AsyncSaver]:
    """A model, its optimizer (``wrap``-ped) after one step, and a Checkpointer that saves
    every step with the copy beside the next steps; and its saver."""
    model, plain = _model()
    opt = wrap(plain)
    ck = Checkpointer(
        str(tmp_path), model=model, optimizer=opt, every_steps=1, async_save=True,
        stage_in_background=True,
    )  # fmt: skip
    assert ck._saver is not None
    _forward_backward(model, opt)
    opt.step()
    return model, opt, ck, ck._saver


def test_the_optimizer_step_waits_for_the_copy_and_the_save_is_that_step(
    tmp_path: Path,
) -> None:
    model, opt, ck, saver = _one_step_trained(tmp_path)
    expected = _state(model, opt)
    gate = _hold(saver)
    ck.step(1)  # returns with the parameters' copy not started
    handle = ck.last_save
    assert handle is not None
    with pytest.raises(TimeoutError):
        handle.wait_staged(timeout=0.2)
    # The next step's forward and backward run beside the copy; the forward changes the
    # BatchNorm statistics, which the save call copied already.
    _forward_backward(model, opt)
    _assert_step_waits_for(gate, opt)
    handle.wait()
    ck.close()
    assert not opt._optimizer_step_pre_hooks  # close() removed the hook

    model2, opt2 = _model(seed=9)
    _forward_backward(model2, opt2)
    opt2.step()  # the optimizer's state exists, to be loaded into
    with Checkpointer(str(tmp_path), model=model2, optimizer=opt2) as ck2:
        assert ck2.restore() == 1
    got = _state(model2, opt2)
    assert got.keys() == expected.keys()
    for k in expected:
        assert torch.equal(got[k], expected[k]), k


def test_a_parameter_changed_before_its_copy_fails_that_save_and_keeps_the_last_one(
    tmp_path: Path,
) -> None:
    model, opt, ck, saver = _one_step_trained(tmp_path)
    ck.step(1)
    ck.wait()
    assert trainer_sdk.latest_step(str(tmp_path)) == 1

    _forward_backward(model, opt)
    opt.step()
    gate = _hold(saver)
    ck.step(2)
    with torch.no_grad():  # outside the optimizer's step: the contract says wait first
        first = model[0]
        assert isinstance(first, nn.Linear)
        first.weight.mul_(0.5)
    gate.set()
    _forward_backward(model, opt)
    opt.step()
    with pytest.raises(CheckpointError, match="changed in place while this save copied them"):
        ck.step(3)
    assert trainer_sdk.latest_step(str(tmp_path)) == 1
    ck.close()
    assert not (tmp_path / "step-000000000002" / "manifest.json").exists()


def test_public_async_save_in_the_background_saves_the_values_of_the_call(
    tmp_path: Path,
) -> None:
    weights = torch.arange(1 << 16, dtype=torch.float32)
    state: dict[str, Any] = {"w": weights, "meta": {"epoch": 3}}
    handle = trainer_sdk.async_save(state, str(tmp_path), step=4, stage_in_background=True)
    handle.wait_staged()
    weights.mul_(-1)  # after the copy: must not reach the checkpoint
    info = handle.wait()
    assert info.step == 4
    out: dict[str, Any] = {"w": torch.zeros(1 << 16), "meta": {"epoch": 0}}
    trainer_sdk.load(out, str(tmp_path), step=4)
    assert torch.equal(out["w"], torch.arange(1 << 16, dtype=torch.float32))
    assert out["meta"] == {"epoch": 3}


def test_a_deferred_copy_that_a_change_beats_is_never_handed_to_the_writer() -> None:
    saver = AsyncSaver()
    src = torch.zeros(1000)
    kept = torch.ones(10)
    ran: list[float] = []
    gate = _hold(saver)
    handle = saver.submit(
        step=1, tensors={"w": src, "b": kept}, json_tree={}, defer={"w"},
        work=lambda t, _: ran.append(float(t["w"].sum())),
    )  # fmt: skip
    kept.fill_(5.0)  # copied in the call: changing it at once is allowed
    src.add_(1.0)
    gate.set()
    with pytest.raises(CheckpointError, match=r"1 tensor\(s\) \('w'\)"):
        handle.wait()
    assert ran == []
    with pytest.raises(CheckpointError, match="changed in place"):
        saver.wait_previous()  # what the next submit does first: raised there, then cleared
    # the next save, with nothing changed during its copy, goes through
    handle = saver.submit(
        step=2, tensors={"w": src, "b": kept}, json_tree={}, defer={"w"},
        work=lambda t, _: ran.append(float(t["w"].sum() + t["b"].sum())),
    )  # fmt: skip
    handle.wait_staged()
    src.zero_()
    handle.wait()
    assert ran == [1000.0 + 50.0]
    saver.close()


def test_an_accelerate_wrapped_optimizer_waits_too(tmp_path: Path) -> None:
    # accelerate's AcceleratedOptimizer never calls Optimizer.__init__, so its own step() runs
    # no step hooks: the hook must go on the optimizer it wraps, which its step() calls.
    from accelerate import Accelerator

    model, wrapped, ck, saver = _one_step_trained(
        tmp_path, wrap=Accelerator(cpu=True).prepare_optimizer
    )
    assert type(wrapped).__name__ == "AcceleratedOptimizer"
    gate = _hold(saver)
    ck.step(1)
    _forward_backward(model, wrapped)
    _assert_step_waits_for(gate, wrapped)
    ck.close()


def test_an_optimizer_that_runs_no_step_hooks_is_refused_with_the_fix(tmp_path: Path) -> None:
    class Stepper:  # steps the parameters itself: no torch optimizer anywhere inside
        def __init__(self, params: list[nn.Parameter]) -> None:
            self.param_groups = [{"params": params}]
            self.state: dict[Any, Any] = {}

    from trainer_sdk.loop._save_engine import hooked_optimizer

    model, _ = _model()
    with pytest.raises(CheckpointError, match=r"pass the torch\.optim\.Optimizer it wraps"):
        hooked_optimizer(Stepper(list(model.parameters())))
