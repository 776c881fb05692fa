"""A restore lays the optimizer's state out from the checkpoint's manifest instead of running
the optimizer once on zero gradients (``trainer_sdk/loop/_training_state.py``,
``lay_out_optimizer``).

``torch.distributed.checkpoint.state_dict`` creates a fresh optimizer's state by calling its
``step()`` on zero gradients, a whole optimizer step of compute that the load then overwrites
(on 2 cores, 0.4 s of a 0.7 s restore of tinylm). These tests hold the replacement to what
matters: no optimizer step runs during the restore, the optimizer ends with exactly the saved
state (values, dtypes, devices, non-tensor values), and the resumed run is bitwise equal to one
never interrupted; where the mapping is not certain (an optimizer outside ``torch.optim``) the
zero step runs as before, with the same result. DDP at 3 and 4 ranks goes through the same
path in ``test_resume_exact_ranks.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from trainer_sdk.checkpointer import Checkpointer


class Nested(nn.Module):
    """A model whose own submodule is called ``module``: not a DDP wrapper's level."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(6, 8)
        self.head = nn.Linear(8, 2)
        self.frozen = nn.Linear(6, 6)  # not trained, not in the optimizer (a LoRA base)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.module(self.frozen(x))))


class OutsideAdamW(torch.optim.AdamW):
    """An optimizer class defined outside ``torch.optim``: its state is not laid out."""


OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    # Adagrad makes its state in its constructor: nothing to lay out, nothing to run.
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5, centered=True),
    "outside-torch-optim": lambda ps: OutsideAdamW(ps, lr=1e-2),
}


def _setup(kind: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer, list[int]]:
    torch.manual_seed(seed)
    model = Nested()
    opt = OPTIMIZERS[kind]([p for p in model.parameters() if p.requires_grad])
    steps: list[int] = []
    real_step = opt.step

    def counted(*args: Any, **kwargs: Any) -> Any:
        steps.append(1)
        return real_step(*args, **kwargs)

    opt.step = counted  # type: ignore[method-assign]
    return model, opt, steps


def _train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(4, 6)).square().mean().backward()
    opt.step()


def _tensors(obj: Any) -> dict[str, Any]:
    """Every leaf of a state dict, by path; tensors cloned (a state dict shares the live
    tensors, which later steps change in place)."""
    out: dict[str, Any] = {}

    def walk(v: Any, path: str) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(x, f"{path}.{k}")
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(x, f"{path}.{i}")
        else:
            out[path] = v.detach().clone() if isinstance(v, torch.Tensor) else v

    walk(obj, "")
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The paths where two state dicts differ (value, dtype, device or presence)."""
    bad = sorted(set(a) ^ set(b))
    for k in set(a) & set(b):
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            same = (
                isinstance(x, torch.Tensor)
                and isinstance(y, torch.Tensor)
                and x.dtype == y.dtype
                and x.device == y.device
                and x.shape == y.shape
                and torch.equal(x, y)
            )
        else:
            same = x == y
        if not same:
            bad.append(k)
    return bad


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_restore_lays_out_the_optimizer_and_resumes_bitwise(tmp_path: Path, kind: str) -> None:
    # The uninterrupted run: 5 steps, saved at step 3 (the restore below loads that save).
    model, opt, _ = _setup(kind, seed=0)
    with Checkpointer(str(tmp_path), model=model, optimizer=opt, every_steps=3) as ck:
        assert ck.restore() == 0
        for step in range(1, 6):
            _train(model, opt)
            ck.step(step)
            if step == 3:
                at_save = _tensors(opt.state_dict())
    reference_model = _tensors(model.state_dict())
    reference_opt = _tensors(opt.state_dict())

    # A new process's objects (another initialisation), resumed from step 3.
    model2, opt2, steps = _setup(kind, seed=1)
    with Checkpointer(str(tmp_path), model=model2, optimizer=opt2, every_steps=100) as ck:
        assert ck.restore() == 3
        zero_steps = len(steps)
        assert _same(_tensors(opt2.state_dict()), at_save) == []
        for step in range(4, 6):
            _train(model2, opt2)
            ck.step(step)
    # torch.optim's optimizers are laid out from the manifest: no step runs in the restore;
    # a class defined elsewhere gets DCP's zero step, as before.
    assert zero_steps == (1 if kind == "outside-torch-optim" else 0)
    assert _same(_tensors(model2.state_dict()), reference_model) == []
    assert _same(_tensors(opt2.state_dict()), reference_opt) == []


def test_a_failed_load_leaves_no_laid_out_state_for_the_older_step(tmp_path: Path) -> None:
    """The newest step cannot be read: the state laid out for it is dropped, and the older
    step is laid out from its own manifest. The newer step was saved with ``amsgrad`` (one
    more tensor per parameter, ``max_exp_avg_sq``): a stand-in left from the first try would
    be a value the older checkpoint lacks, and its load would be refused."""
    model, opt, _ = _setup("adamw", seed=0)
    with Checkpointer(str(tmp_path), model=model, optimizer=opt, every_steps=3) as ck:
        ck.restore()
        for step in range(1, 4):
            _train(model, opt)
            ck.step(step)
        at_save = _tensors(opt.state_dict())
    reference_model = _tensors(model.state_dict())
    amsgrad = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-2, amsgrad=True
    )
    with Checkpointer(str(tmp_path), model=model, optimizer=amsgrad, every_steps=100) as ck:
        _train(model, amsgrad)
        ck.save(4)
    newer = tmp_path / "step-000000000004"
    assert "max_exp_avg_sq" in (newer / "manifest.json").read_text()
    tree = next(newer.glob("rank-*.json"))
    tree.write_text(tree.read_text().replace('"lr"', '"lR"'))  # fails its digest

    model2, opt2, steps = _setup("adamw", seed=1)
    with Checkpointer(str(tmp_path), model=model2, optimizer=opt2, every_steps=100) as ck:
        assert ck.restore() == 3
    assert steps == []
    assert _same(_tensors(opt2.state_dict()), at_save) == []
    assert _same(_tensors(model2.state_dict()), reference_model) == []


def test_a_ddp_wrapped_model_is_laid_out_under_its_unwrapped_names(tmp_path: Path) -> None:
    """Every multi-rank job restores a DDP-wrapped model, whose parameters are named
    ``module.<fqn>`` while the checkpoint holds ``model.<fqn>``: the layout must see through
    the wrapper (the multi-rank resume tests stay bitwise if it does not, because the zero
    step takes over, so only this test catches the restore falling back to it). A 1-rank gloo
    group in this process, and the model's own submodule called ``module`` kept."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model, opt, _ = _setup("adamw", seed=0)
    with Checkpointer(str(tmp_path), model=model, optimizer=opt, every_steps=3) as ck:
        ck.restore()
        for step in range(1, 4):
            _train(model, opt)
            ck.step(step)
        at_save = _tensors(opt.state_dict())

    model2, opt2, steps = _setup("adamw", seed=1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(model2)
        with Checkpointer(str(tmp_path), model=ddp, optimizer=opt2, every_steps=100) as ck:
            assert ck.restore() == 3
            assert steps == []
            assert _same(_tensors(opt2.state_dict()), at_save) == []
        del ck, ddp  # DDP and the Checkpointer go before the process group
    finally:
        dist.destroy_process_group()
