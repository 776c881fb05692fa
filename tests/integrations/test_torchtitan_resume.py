"""BatonCheckpointManager: torchtitan's smallest debug model, preempted and resumed exactly.

torchtitan's real parts: the Llama 3 ``debugmodel`` from its model registry (meta init, then
``init_weights``), FSDP2 ``fully_shard`` on a CPU gloo mesh, its ``OptimizersContainer``
(AdamW) and ``LRSchedulersContainer`` (warmup then linear decay), its
``ParallelAwareDataloader`` over a Stateful token stream split by data-parallel rank, and the
manager built through ``Config.build(...)`` with the arguments torchtitan's ``Trainer`` passes.
torchtitan 0.3's ``Trainer`` itself cannot run on a CPU-only machine (docs/integrations.md
says where and why: it selects CUDA, and none of its language-model attention backends trains
on a CPU), so the loop below mirrors ``Trainer.train``: ``load(step=-1)``, then per step
``step += 1``, train (``maybe_wait_for_staging()`` before the optimizer step), ``save(step,
last_step=...)``, and ``close()``; each layer's (parameter-free) inner attention is a causal
SDPA stand-in (``CausalAttention``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
from baton_testing.dist import run_ranks

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

STEPS = 8
SEQ = 32
RUN_TIMEOUT_S = 400.0


def _train(
    root: str, *, sigterm_at: int = 0, stop_after_load: bool = False, restart_data: bool = False
) -> dict[str, Any]:
    """One torchtitan-shaped run on this rank; returns losses (hex) and digests of the state."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import IterableDataset
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.models.llama3 import model_registry

    from trainer_sdk.integrations.torchtitan import BatonCheckpointManager

    class TokenStream(IterableDataset[dict[str, Any]]):
        """Like torchtitan's HF text dataset: split by rank, Stateful by sample index."""

        def __init__(self, rank: int, world: int) -> None:
            self.rank, self.world, self.sample_idx = rank, world, 0

        def __iter__(self) -> Any:
            while True:
                i = self.sample_idx * self.world + self.rank
                g = torch.Generator().manual_seed(1000 + i)
                tokens = torch.randint(0, 2048, (SEQ + 1,), generator=g)
                self.sample_idx += 1
                yield {"input": tokens[:-1]}, tokens[1:]

        def state_dict(self) -> dict[str, Any]:
            return {"sample_idx": self.sample_idx}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.sample_idx = state["sample_idx"]

    class CausalAttention(torch.nn.Module):
        """torchtitan 0.3's attention kernels cannot train on a CPU (flex attention has no CPU
        backward, varlen needs CUDA flash attention, sdpa is refused for language models).
        This parameter-free stand-in computes causal attention with SDPA, on the same
        (batch, length, heads, head_dim) layout; weights and optimizer state are unchanged."""

        def forward(self, q: Any, k: Any, v: Any, *, scale: Any = None, **_: Any) -> Any:
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                is_causal=True, scale=scale,
            )  # fmt: skip
            return out.transpose(1, 2)

    class TrainState:
        def __init__(self) -> None:
            self.step = 0
            self.ntokens_seen = 0

        def state_dict(self) -> dict[str, Any]:
            return {"step": self.step, "ntokens_seen": self.ntokens_seen}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]

    torch.use_deterministic_algorithms(True)
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    spec = model_registry("debugmodel")
    with torch.device("meta"):
        model = spec.model.build()
    for module in model.modules():  # see CausalAttention: the one part swapped for the CPU
        if hasattr(module, "inner_attention"):
            module.inner_attention = CausalAttention()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    optimizers = default_adamw(lr=2e-3).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(
        warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0
    ).build(optimizers=optimizers, training_steps=STEPS)
    loader = ParallelAwareDataloader(
        TokenStream(rank, world), dp_rank=rank, dp_world_size=world, batch_size=2
    )
    train_state = TrainState()
    manager = BatonCheckpointManager.Config(
        enable=True,
        interval=3,
        keep_latest_k=0,
        uri=str(Path(root) / "ckpt"),
        exit_on_notice=False,
        dataloader_on_reshard="restart" if restart_data else "refuse",
    ).build(
        dataloader=loader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder=root,
    )

    def digests() -> dict[str, str]:
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
        h = hashlib.sha256()
        for k in sorted(full):
            h.update(k.encode())
            h.update(full[k].detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        o = hashlib.sha256()
        for k, v in sorted(optimizers.state_dict().items()):
            o.update(k.encode())
            if isinstance(v, torch.Tensor):
                t = v.full_tensor() if hasattr(v, "full_tensor") else v
                o.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
            else:
                o.update(repr(v).encode())
        lr = [g["lr"] for opt in optimizers.optimizers for g in opt.param_groups]
        return {"model": h.hexdigest(), "optim": o.hexdigest(), "lr": repr(lr)}

    loaded = manager.load(step=-1)  # as Trainer.train calls it: load_step's default
    out: dict[str, Any] = {
        "loaded_step": train_state.step if loaded else 0,
        "after_load": digests(),
        "losses": {},
        "states": {},
        "preempted": False,
    }
    if stop_after_load:
        manager.close()
        return out
    data = iter(loader)
    while train_state.step < STEPS:
        train_state.step += 1
        inputs, labels = next(data)
        logits = model(inputs["input"])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        manager.maybe_wait_for_staging()
        optimizers.step()
        lr_schedulers.step()
        optimizers.zero_grad()
        train_state.ntokens_seen += labels.numel()
        out["losses"][str(train_state.step)] = loss.item().hex()
        out["states"][str(train_state.step)] = digests()
        if train_state.step == sigterm_at and rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        manager.save(train_state.step, last_step=train_state.step == STEPS)
        if manager.preempted:
            out["preempted"] = True
            break
    manager.close()
    return out


def _ranks(world: int, root: Path, **kwargs: Any) -> list[dict[str, Any]]:
    return run_ranks(
        _train, world, args=(str(root),), kwargs=kwargs, timeout=RUN_TIMEOUT_S,
        env={"HF_HUB_OFFLINE": "1"},
    )  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _ranks(2, tmp_path_factory.mktemp("titan-reference"))


def test_preempted_by_sigterm_then_resumed_bitwise(
    reference: list[dict[str, Any]], tmp_path: Path
) -> None:
    first = _ranks(2, tmp_path, sigterm_at=4)
    assert all(r["preempted"] for r in first)
    saved = max(int(s) for s in first[0]["losses"])
    assert saved in (4, 5)  # the boundary the ranks agreed on
    second = _ranks(2, tmp_path)
    for rank in (0, 1):
        assert second[rank]["loaded_step"] == saved
        assert second[rank]["after_load"] == reference[rank]["states"][str(saved)]
        # zero steps replayed, and every later step exactly the reference's
        assert sorted(map(int, second[rank]["losses"])) == list(range(saved + 1, STEPS + 1))
        losses = {**first[rank]["losses"], **second[rank]["losses"]}
        assert losses == reference[rank]["losses"]
        assert second[rank]["states"][str(STEPS)] == reference[rank]["states"][str(STEPS)]


def test_resumed_at_another_world_size(reference: list[dict[str, Any]], tmp_path: Path) -> None:
    # Two ranks save step 3 (interval=3) and are stopped at step 4.
    _ranks(2, tmp_path, sigterm_at=4)
    for newer in sorted((tmp_path / "ckpt").glob("step-*"))[1:]:
        shutil.rmtree(newer)  # keep step 3 only: the notice save of step 4/5 goes
    # The dataloader's per-rank positions cannot move to 1 rank: refused, with the fix named.
    with pytest.raises(AssertionError, match="dataloader_on_reshard='restart'"):
        _ranks(1, tmp_path, stop_after_load=True)
    # Allowed to restart the data stream: model, optimizer and LR schedule reshard exactly.
    one = _ranks(1, tmp_path, stop_after_load=True, restart_data=True)[0]
    assert one["loaded_step"] == 3
    assert one["after_load"] == reference[0]["states"]["3"]
    # And three ranks, where FSDP2's shards of 2 ranks must be cut differently.
    three = _ranks(3, tmp_path, restart_data=True)
    for r in three:
        assert r["after_load"] == reference[0]["states"]["3"]
        assert sorted(map(int, r["losses"])) == list(range(4, STEPS + 1))
