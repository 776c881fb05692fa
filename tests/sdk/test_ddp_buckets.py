"""DDP's gradient bucket layout, read from a trained DDP model and put back into a fresh one
(``trainer_sdk/loop/_ddp.py``), on 3 gloo ranks where the order of a sum shows.

The core fact, measured here on real processes: the first iteration of a freshly built DDP
sums the same gradients to other last bits than a DDP that has rebuilt its buckets, and
putting the rebuilt layout back makes the fresh one sum exactly like the old one.
"""

from __future__ import annotations

from typing import Any

import pytest
from baton_testing.dist import run_ranks

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def _model() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)
    )


def _grads(ddp: Any, x: Any) -> list[Any]:
    ddp.zero_grad(set_to_none=True)
    ddp(x).square().sum().backward()
    return [p.grad.clone() for p in ddp.parameters()]


def _same(a: list[Any], b: list[Any]) -> bool:
    import torch

    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _body() -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

    from trainer_sdk.loop._ddp import BucketLayoutError, apply_bucket_layout, bucket_layout

    torch.use_deterministic_algorithms(True)
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(100 + rank)
    inputs = [torch.randn(32, 16, generator=gen) for _ in range(3)]

    trained = DDP(_model())
    assert bucket_layout(trained) is None, "no layout before the first iteration"
    _grads(trained, inputs[0])
    layout = bucket_layout(trained)  # runs the pending rebuild early, as a save at step 1 would
    _grads(trained, inputs[1])
    assert bucket_layout(trained) == layout
    reference = _grads(trained, inputs[2])  # summed with the rebuilt layout

    fresh = DDP(_model())
    plain = _grads(fresh, inputs[2])  # first iteration: the initial layout

    restored = DDP(_model())
    assert layout is not None
    apply_bucket_layout(restored, layout)
    first = _grads(restored, inputs[2])
    second = _grads(restored, inputs[2])  # after the restored reducer's own rebuild

    never = DDP(_model(), find_unused_parameters=True)
    _grads(never, inputs[0])
    errors = []
    for bad in ([[0, 1]], [[4, 3, 2, 1, 0, 0]]):
        try:
            apply_bucket_layout(DDP(_model()), bad)
        except BucketLayoutError as e:
            errors.append(str(e))
    return {
        "layout": layout,
        "initial_differs": not _same(plain, reference),
        "restored_first_equal": _same(first, reference),
        "restored_second_equal": _same(second, reference),
        "restored_layout": bucket_layout(restored),
        "never_rebuilds": bucket_layout(never),
        "errors": errors,
    }


def test_restored_layout_sums_like_the_trained_ddp() -> None:
    results = run_ranks(_body, 3, timeout=600)
    for r in results:
        # The 6 parameters, in the order their gradients become ready: the last layer first.
        assert r["layout"] == [[5, 4, 3, 2, 1, 0]]
        assert r["initial_differs"], "the initial layout should round differently at 3 ranks"
        assert r["restored_first_equal"]
        assert r["restored_second_equal"]
        assert r["restored_layout"] == r["layout"]
        assert r["never_rebuilds"] is None
        assert len(r["errors"]) == 2
        assert all("does not cover this model's 6 trainable parameters" in e for e in r["errors"])
