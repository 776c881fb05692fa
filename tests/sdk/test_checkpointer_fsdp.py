"""The Checkpointer with FSDP2 (DTensor shards) on 2 gloo ranks: each rank saves and restores
its own shards of the parameters and of AdamW's moments, sync and async."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from baton_testing.dist import run_ranks

# Two FSDP2 process groups per test: slow to start on 2 shared cores.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]


def _build(seed: int) -> tuple[Any, Any]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _full(model: Any, opt: Any) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for k, v in model.state_dict().items():
        out[f"p/{k}"] = v.full_tensor().flatten().tolist()
    for i, st in opt.state_dict()["state"].items():
        for name, v in st.items():
            t = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[f"o/{i}/{name}"] = t.flatten().tolist()
    return out


def _fsdp_body(root: str, async_save: bool) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor import DTensor

    from trainer_sdk.checkpointer import Checkpointer

    model, opt = _build(seed=0)
    assert isinstance(next(iter(model.parameters())), DTensor)
    x = torch.ones(4, 8)
    with Checkpointer(
        root, model=model, optimizer=opt, every_steps=2, async_save=async_save, keep_last=2
    ) as ck:
        assert ck.restore() == 0
        for step in range(1, 5):
            opt.zero_grad()
            model(x * step).square().mean().backward()
            opt.step()
            ck.step(step)
        ck.wait()
        saved = _full(model, opt)
        # change everything after the save: the checkpoint must hold the values of step 4
        with torch.no_grad():
            for p in model.parameters():
                p.add_(100.0)

    model2, opt2 = _build(seed=1)
    with Checkpointer(root, model=model2, optimizer=opt2) as ck2:
        step = ck2.restore()
    restored = _full(model2, opt2)
    return {"step": step, "equal": restored == saved, "keys": sorted(saved)}


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_fsdp2_shards_save_and_restore(tmp_path: Path, async_save: bool) -> None:
    a, b = run_ranks(_fsdp_body, 2, args=(str(tmp_path), async_save), timeout=240)
    assert a["step"] == b["step"] == 4
    assert a["equal"]
    assert b["equal"]
    assert any(k.endswith("exp_avg") for k in a["keys"])
