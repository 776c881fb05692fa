"""A background save that fails is raised at the next step() on every rank, never lost.

The fault is a full disk (ENOSPC) on shard writes. It is injected with a storage wrapper
because this sandbox runs as root (read-only directories do not stop root) and cannot mount
a small filesystem; everything else goes to the real local storage.
"""

from __future__ import annotations

import errno
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from baton_testing.dist import run_ranks
from torch import nn

from trainer_sdk import api
from trainer_sdk.checkpointer import Checkpointer
from trainer_sdk.errors import CheckpointError
from trainer_sdk.storage import open_storage
from trainer_sdk.storage.base import Storage, Writer


def _model(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.ones(4, 6)).square().mean().backward()
    opt.step()


class _FullDisk:
    """A storage whose shard writes fail with ENOSPC from step ``fail_from_step`` on."""

    def __init__(self, inner: Storage, fail_from_step: int) -> None:
        self.inner = inner
        self.fail_from_step = fail_from_step

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def uri(self) -> str:
        return self.inner.uri

    def open_writer(self, path: str, *, size_hint: int | None = None) -> Writer:
        writer = self.inner.open_writer(path, size_hint=size_hint)
        step = (
            int(path.split("/", maxsplit=1)[0].removeprefix("step-"))
            if path.startswith("step-")
            else -1
        )
        if step < self.fail_from_step:
            return writer
        outer = self

        class _W:
            def write(self, data: memoryview | bytes) -> None:
                raise OSError(
                    errno.ENOSPC, f"No space left on device (step {outer.fail_from_step})"
                )

            def commit(self) -> None:
                writer.commit()

            def abort(self) -> None:
                writer.abort()

        return _W()


def test_a_background_write_failure_surfaces_at_the_next_step(tmp_path: Path) -> None:
    model, opt = _model()
    storage = _FullDisk(open_storage(str(tmp_path)), fail_from_step=4)
    ck = Checkpointer(storage, model=model, optimizer=opt, every_steps=2, async_save=True)
    _train(model, opt)
    ck.step(1)
    _train(model, opt)
    ck.step(2)  # a good save
    ck.wait()
    _train(model, opt)
    ck.step(3)
    _train(model, opt)
    ck.step(4)  # fails in the background
    handle = ck.last_save
    assert handle is not None
    for _ in range(200):
        if handle.done():
            break
        time.sleep(0.01)
    with pytest.raises(CheckpointError, match="No space left on device") as info:
        ck.step(5)
    assert isinstance(info.value.__cause__, Exception)
    ck.close()
    # the failed step never became visible; the good one is intact
    assert api.list_steps(str(tmp_path)) == [2]


def test_close_raises_a_pending_background_failure(tmp_path: Path) -> None:
    model, opt = _model()
    storage = _FullDisk(open_storage(str(tmp_path)), fail_from_step=1)
    ck = Checkpointer(storage, model=model, optimizer=opt, every_steps=1, async_save=True)
    _train(model, opt)
    ck.step(1)
    with pytest.raises(OSError, match="No space left"):
        ck.close()


def _fail_on_rank1(root: str) -> dict[str, Any]:
    import torch.distributed as dist

    rank = dist.get_rank()
    model, opt = _model()  # the same replicated model on both ranks
    storage: Storage = open_storage(root)
    if rank == 1:
        storage = _FullDisk(storage, fail_from_step=4)
    ck = Checkpointer(storage, model=model, optimizer=opt, every_steps=2, async_save=True)
    raised_at, message = None, ""
    for step in range(1, 9):
        _train(model, opt)
        if step == 5:
            time.sleep(1.0)  # let the failed save finish, so the raise is at this very step
        try:
            ck.step(step)
        except CheckpointError as e:
            raised_at, message = step, str(e)
            break
    ck.close()  # the failure was raised once, at the step; nothing is left to raise
    return {"raised_at": raised_at, "message": message}


def test_a_failure_on_one_rank_is_raised_on_every_rank_at_the_same_step(tmp_path: Path) -> None:
    a, b = run_ranks(_fail_on_rank1, 2, args=(str(tmp_path),), timeout=180)
    assert a["raised_at"] == b["raised_at"] == 5
    # the rank whose disk was full names the cause; every rank names rank 1
    assert "No space left on device" in b["message"]
    assert "rank(s) 1" in a["message"] or "another rank" in a["message"]
    assert api.list_steps(str(tmp_path)) == [2]
