"""A training loop that checkpoints through torch.distributed.checkpoint, run under torchrun.

FSDP2 (``fully_shard`` on a CPU mesh, gloo) over a small MLP, AdamW, a batch per step drawn
from a generator seeded by (step, rank), so that a resumed run sees the same data. It is the
shape of a DCP user's loop (torchtitan's, verl's): ``get_state_dict`` / ``set_state_dict``
for the model and optimizer, ``dcp.save``/``dcp.load``, here through Baton's writer and
reader, with ``BatonNotices`` at the step boundary.

Environment: ``DCP_TEST_OUT`` (losses and final hashes go there), ``BATON_CHECKPOINT_URI``,
``DCP_TEST_STEPS`` (default 12), ``DCP_TEST_EVERY`` (periodic saves, default 4),
``DCP_TEST_SIGTERM_AT`` (rank 1 sends itself SIGTERM after that step: a real signal, the
others hear of it only through the agreement).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from trainer_sdk.integrations.dcp import BatonNotices


def build_model(mesh: Any, *, seed: int = 0, hidden: int = 32) -> nn.Module:
    """The loop's MLP, each layer and the whole fully sharded over ``mesh`` (also used by
    ``test_dcp_memory_tier.py``, with other seeds and a wider middle layer)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, hidden), nn.Tanh(), nn.Linear(hidden, hidden),
                          nn.Tanh(), nn.Linear(hidden, 4))  # fmt: skip
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def hashes(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, p in model.named_parameters():
        full = p.full_tensor()  # type: ignore[operator]
        out[name] = hashlib.sha256(full.detach().numpy().tobytes()).hexdigest()
        for k, v in opt.state[p].items():
            t = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[f"{name}/{k}"] = hashlib.sha256(t.detach().numpy().tobytes()).hexdigest()
    return out


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(os.environ["DCP_TEST_OUT"])
    (out / f"pid-{rank}").write_text(str(os.getpid()))
    steps = int(os.environ.get("DCP_TEST_STEPS", "12"))
    every = int(os.environ.get("DCP_TEST_EVERY", "4"))
    sigterm_at = int(os.environ.get("DCP_TEST_SIGTERM_AT", "0"))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build_model(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    notices = BatonNotices()

    def state() -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(model, opt)
        return {"model": model_sd, "optim": optim_sd}

    current = state()
    start = notices.resume(current)
    if start is not None:
        set_state_dict(model, opt, model_state_dict=current["model"],
                       optim_state_dict=current["optim"])  # fmt: skip
    first = 1 if start is None else start + 1
    with (out / f"losses-{rank}.jsonl").open("a") as log:
        for step in range(first, steps + 1):
            x, y = batch(step, rank)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            log.write(json.dumps([step, float(loss.item()).hex()]) + "\n")
            log.flush()
            if step == sigterm_at and rank == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            if notices.should_save(step, periodic=step % every == 0):
                notices.save(state(), step)  # exits 75 after a notice's save
    (out / f"final-{rank}.json").write_text(json.dumps(hashes(model, opt)))
    notices.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
