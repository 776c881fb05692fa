"""Save on 2 real gloo ranks, load on 3 and on 1: tensors, RNG streams and data position.

* DTensors placed ``Shard(0)`` (built with ``distribute_tensor`` on a CPU mesh), including
  uneven splits (7 rows over 2 and 3 ranks) and a tensor with fewer rows than ranks, and
  replicated tensors: every full tensor is bitwise equal after the load.
* RNG: ranks that existed keep their own streams; a new rank gets ``rng.derive``'d ones.
* Data: a ``ResumableSampler`` saved mid-epoch on 2 ranks continues on the new world size, and
  over the whole epoch no sample is skipped or repeated.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from baton_testing.dist import run_ranks

import trainer_sdk
from trainer_sdk import rng
from trainer_sdk.sampler import ResumableSampler

pytestmark = pytest.mark.e2e  # real processes: several torch start-ups on 2 shared cores

STEP = 10
N_SAMPLES = 60  # 2 ranks x 3 batches x 4 = 24 consumed before the save; 36 left: splits over 1, 3
BATCH = 4
SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "rows7": ((7, 5), torch.float32),  # 4+3 over 2 ranks, 3+3+1 over 3
    "rows2": ((2, 4), torch.float32),  # fewer rows than 3 ranks: one rank holds an empty shard
    "half": ((9, 3), torch.bfloat16),
    "ints": ((5,), torch.int64),
    "wide": ((33, 64), torch.float64),
}


def _reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    out = {}
    for name, (shape, dtype) in SHAPES.items():
        if dtype.is_floating_point:
            out[name] = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
        else:
            out[name] = torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)
    return out


def _state(fill: bool) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ref = _reference()
    src = ref if fill else {k: torch.zeros_like(v) for k, v in ref.items()}
    return {
        "sharded": {k: distribute_tensor(v.clone(), mesh, [Shard(0)]) for k, v in src.items()},
        "replicated": {k: v.clone() for k, v in src.items()},
    }


def _draws() -> dict[str, list[Any]]:
    return {
        "python": [random.random() for _ in range(3)],
        "numpy": np.random.standard_normal(3).tolist(),
        "torch": torch.randn(3).tolist(),
    }


def _sampler_and_loader() -> tuple[ResumableSampler, Any]:
    from torch.utils.data import DataLoader

    sampler = ResumableSampler(N_SAMPLES, seed=5)
    return sampler, DataLoader(list(range(N_SAMPLES)), batch_size=BATCH, sampler=sampler)


def _save_on_ranks(uri: str) -> dict[str, Any]:
    import torch.distributed as dist

    rank = dist.get_rank()
    state = _state(fill=True)
    sampler, loader = _sampler_and_loader()
    batches = sampler.track(loader)
    consumed = [i for _ in range(3) for i in next(batches).tolist()]
    state["data"] = sampler
    random.seed(100 + rank)
    np.random.seed(100 + rank)
    torch.manual_seed(100 + rank)
    random.random()
    state["rng"] = trainer_sdk.RankLocal(rng.capture())
    expected = _draws()  # what a rank restored from this checkpoint must draw next
    trainer_sdk.save(state, uri, step=STEP)
    local_rows = {k: int(v.to_local().shape[0]) for k, v in state["sharded"].items()}
    return {"draws": expected, "consumed": consumed, "local_rows": local_rows}


def _load_on_ranks(uri: str) -> dict[str, Any]:
    import torch.distributed as dist

    rank = dist.get_rank()
    state = _state(fill=False)
    sampler, loader = _sampler_and_loader()
    state["data"] = sampler
    random.seed(999)  # anything: the load must replace it
    state["rng"] = trainer_sdk.RankLocal(rng.capture())
    info = trainer_sdk.load(state, uri)
    if "rng" in info.missing_rank_local:
        rng.restore(rng.derive(info.step, rank))  # a new rank: no saved streams of its own
    else:
        rng.restore(state["rng"].value)
    draws = _draws()
    ref = _reference()
    equal = {}
    for k, want in ref.items():
        full = state["sharded"][k].full_tensor()
        got = state["replicated"][k]
        equal[k] = [
            full.dtype == want.dtype and torch.equal(full, want),
            got.dtype == want.dtype and torch.equal(got, want),
        ]
    rest = [i for batch in sampler.track(loader) for i in batch.tolist()]
    return {
        "step": info.step,
        "saved_world_size": info.saved_world_size,
        "resharded": info.resharded,
        "missing": info.missing_rank_local,
        "equal": equal,
        "draws": draws,
        "rest": rest,
        "epoch_after": sampler.epoch,
        "local_rows": {k: int(v.to_local().shape[0]) for k, v in state["sharded"].items()},
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, Any]]]:
    uri = str(tmp_path_factory.mktemp("reshard") / "ckpt")
    results = run_ranks(_save_on_ranks, 2, args=(uri,), timeout=240)
    assert results[0]["local_rows"]["rows7"] == 4
    assert results[1]["local_rows"]["rows7"] == 3
    return uri, results


def _derived_draws(rank: int) -> dict[str, list[Any]]:
    before = rng.capture()
    try:
        rng.restore(rng.derive(STEP, rank))
        return _draws()
    finally:
        rng.restore(before)


@pytest.mark.parametrize("world", [3, 1])
def test_load_on_another_world_size(saved: tuple[str, list[dict[str, Any]]], world: int) -> None:
    uri, before = saved
    after = run_ranks(_load_on_ranks, world, args=(uri,), timeout=240)
    for rank, res in enumerate(after):
        assert (res["step"], res["saved_world_size"], res["resharded"]) == (STEP, 2, True)
        assert all(all(pair) for pair in res["equal"].values()), res["equal"]
        if rank < 2:
            assert res["missing"] == []
            assert res["draws"] == before[rank]["draws"], "an old rank keeps its own streams"
        else:
            assert res["missing"] == ["rng"]
            assert res["draws"] == _derived_draws(rank)
            assert res["draws"] != before[0]["draws"]
            assert res["draws"] != before[1]["draws"]
    if world == 3:
        assert [r["local_rows"]["rows7"] for r in after] == [3, 3, 1]
        assert [r["local_rows"]["rows2"] for r in after] == [1, 1, 0]
    # data: 24 consumed on 2 ranks before the save, the rest of the epoch on `world` ranks
    consumed = Counter(i for r in before for i in r["consumed"])
    consumed.update(i for r in after for i in r["rest"])
    assert consumed == Counter(range(N_SAMPLES)), "every sample exactly once over the epoch"
    assert all(r["epoch_after"] == 1 for r in after)


def test_load_without_a_process_group_gets_full_tensors(
    saved: tuple[str, list[dict[str, Any]]],
) -> None:
    uri, _ = saved
    ref = _reference()
    state: dict[str, Any] = {
        "sharded": {k: torch.zeros_like(v) for k, v in ref.items()},
        "replicated": {k: torch.zeros_like(v) for k, v in ref.items()},
    }
    info = trainer_sdk.load(state, uri, step=STEP)
    assert info.resharded
    for part in ("sharded", "replicated"):
        for k, want in ref.items():
            assert state[part][k].dtype == want.dtype
            assert torch.equal(state[part][k], want), (part, k)
