"""A background save that fails is raised at a later step() on every rank, never lost.

The fault is real: the writing process runs under ``RLIMIT_FSIZE`` with ``SIGXFSZ`` ignored,
so the kernel refuses the shard's writes past the limit with ``EFBIG`` ("File too large"), as
it refuses them with ``ENOSPC`` on a full disk. That needs no privileges (a small mounted
filesystem would), and it is set only in the writer's own process, never in pytest's: each
scenario runs in fresh processes through ``baton_testing.dist``. Nothing waits a fixed time:
the scenarios wait for the background save to have finished, and assert on the order of
events, not on the step a failure happens to be reported at.
"""

from __future__ import annotations

import resource
import signal
import time
from pathlib import Path
from typing import Any

import torch
from baton_testing.dist import run_ranks
from torch import nn

from trainer_sdk import api
from trainer_sdk.checkpointer import Checkpointer
from trainer_sdk.errors import CheckpointError

_LIMIT = 1024
"""Bytes a process may write to one file once the fault is on: less than any shard here."""


def _model(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.ones(4, 6)).square().mean().backward()
    opt.step()


def _file_size_limit(nbytes: int) -> None:
    """From now on, this process cannot write a file past ``nbytes`` (EFBIG)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the process
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))


def _wait_done(ck: Checkpointer, timeout: float = 240.0) -> None:
    handle = ck.last_save
    assert handle is not None
    deadline = time.monotonic() + timeout
    while not handle.done():
        if time.monotonic() > deadline:
            raise AssertionError("the background save did not finish")
        time.sleep(0.01)


def _fails_in_the_background(root: str) -> dict[str, Any]:
    model, opt = _model()
    ck = Checkpointer(
        root, model=model, optimizer=opt, every_steps=2, async_save=True, handle_sigterm=False
    )
    for step in (1, 2):
        _train(model, opt)
        ck.step(step)
    ck.wait()  # step 2 is committed
    _file_size_limit(_LIMIT)
    for step in (3, 4):
        _train(model, opt)
        ck.step(step)  # step 4's save starts, and fails, in the background
    _wait_done(ck)
    try:
        _train(model, opt)
        ck.step(5)
    except CheckpointError as e:
        cause = e.__cause__
        ck.close()
        return {"msg": str(e), "cause": f"{type(cause).__name__}: {cause}"}
    ck.close()
    return {"msg": None}


def test_a_background_write_failure_surfaces_at_the_next_step(tmp_path: Path) -> None:
    (out,) = run_ranks(_fails_in_the_background, 1, args=(str(tmp_path),), init_pg=False)
    assert out["msg"] is not None, "the failed background save was never raised"
    assert "a background save failed" in out["msg"]
    assert "File too large" in out["msg"], out
    assert out["cause"].startswith("OSError"), out
    # the failed step never became visible; the good one is intact
    assert api.list_steps(str(tmp_path)) == [2]


def _close_raises(root: str) -> dict[str, Any]:
    model, opt = _model()
    ck = Checkpointer(
        root, model=model, optimizer=opt, every_steps=1, async_save=True, handle_sigterm=False
    )
    _file_size_limit(_LIMIT)
    _train(model, opt)
    ck.step(1)
    try:
        ck.close()
    except OSError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"error": None}


def test_close_raises_a_pending_background_failure(tmp_path: Path) -> None:
    (out,) = run_ranks(_close_raises, 1, args=(str(tmp_path),), init_pg=False)
    assert out["error"] is not None, "close() swallowed the background failure"
    assert "File too large" in out["error"]
    assert api.list_steps(str(tmp_path)) == []


def _fail_on_rank1(root: str) -> dict[str, Any]:
    import torch.distributed as dist

    rank = dist.get_rank()
    model, opt = _model()  # the same replicated model on both ranks
    ck = Checkpointer(
        root, model=model, optimizer=opt, every_steps=2, async_save=True, handle_sigterm=False
    )
    raised_at, message = None, ""
    for step in range(1, 13):
        _train(model, opt)
        if step == 3:
            ck.wait()  # step 2 is committed on every rank
            if rank == 1:
                _file_size_limit(_LIMIT)  # only rank 1's disk is "full"
        try:
            ck.step(step)
        except CheckpointError as e:
            raised_at, message = step, str(e)
            break
        if step == 4:
            _wait_done(ck)  # step 4's save has failed (on rank 1) or been refused (rank 0)
    ck.close()  # the failure was raised once, at the step; nothing is left to raise
    return {"raised_at": raised_at, "message": message}


def test_a_failure_on_one_rank_is_raised_on_every_rank_at_the_same_step(tmp_path: Path) -> None:
    a, b = run_ranks(_fail_on_rank1, 2, args=(str(tmp_path),), timeout=240)
    assert a["raised_at"] is not None, "rank 0 never raised the failure"
    assert a["raised_at"] == b["raised_at"]  # the same step on every rank
    assert 4 < a["raised_at"] < 12  # after the failed save, before the next one was due twice
    # the rank whose file writes failed names the cause; every rank names rank 1
    assert "File too large" in b["message"]
    assert "rank(s) 1" in a["message"] or "another rank" in a["message"]
    assert api.list_steps(str(tmp_path)) == [2]
