"""The Checkpointer across a world-size change: a step saved by 1 rank restores on 2. The model
and optimizer are equal everywhere; rank 0 gets its saved RNG streams back, and the new rank 1,
which has none, gets the deterministic state ``rng.derive(step, rank)``."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
from baton_testing.dist import run_ranks

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(1800),
]  # two process-group start-ups on 2 shared cores


def _digest(t: Any) -> str:
    return hashlib.sha256(t.contiguous().view(-1).numpy().tobytes()).hexdigest()


def _model(seed: int) -> tuple[Any, Any]:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _params(model: Any) -> dict[str, str]:
    return {k: _digest(v) for k, v in model.state_dict().items()}


def _save_one(root: str) -> dict[str, Any]:
    import torch

    from trainer_sdk.checkpointer import Checkpointer

    model, opt = _model(0)
    with Checkpointer(root, model=model, optimizer=opt) as ck:
        ck.restore()
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, 6)).square().mean().backward()
            opt.step()
        rng_at_save = _digest(torch.get_rng_state())
        ck.save(3)
    return {"params": _params(model), "rng": rng_at_save}


def _restore_two(root: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from trainer_sdk import rng
    from trainer_sdk.checkpointer import Checkpointer

    model, opt = _model(dist.get_rank() + 10)
    with Checkpointer(root, model=model, optimizer=opt) as ck:
        step = ck.restore()
    derived = _digest(rng.derive(3, dist.get_rank())["torch"])
    return {
        "step": step,
        "params": _params(model),
        "rng": _digest(torch.get_rng_state()),
        "derived": derived,
        "opt_steps": [float(s["step"]) for s in opt.state_dict()["state"].values()],
    }


def test_one_rank_saves_two_ranks_restore(tmp_path: Path) -> None:
    (saved,) = run_ranks(_save_one, 1, args=(str(tmp_path),), timeout=180)
    r0, r1 = run_ranks(_restore_two, 2, args=(str(tmp_path),), timeout=180)
    assert r0["step"] == r1["step"] == 3
    assert r0["params"] == r1["params"] == saved["params"]
    assert r0["opt_steps"] == r1["opt_steps"] == [3.0] * 4
    assert r0["rng"] == saved["rng"]  # rank 0 continues its own streams
    assert r1["rng"] == r1["derived"]  # rank 1 is new: a derived, reproducible state
    assert r1["rng"] != saved["rng"]
