"""RNG state through a real checkpoint (safetensors + JSON files, one process): the draws after
a load are bitwise the draws after the save. The multi-rank case is in test_reshard.py."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

import trainer_sdk
from trainer_sdk import rng


def _draws() -> list[Any]:
    return [
        random.random(),
        random.gauss(0.0, 1.0),
        np.random.standard_normal(3).tolist(),
        np.random.randint(0, 2**31, 3).tolist(),
        torch.randn(4).tolist(),
        torch.randperm(20).tolist(),
    ]


def _contains(tree: Any, value: Any) -> bool:
    if tree == value:
        return True
    if isinstance(tree, dict):
        return any(_contains(v, value) for v in tree.values())
    if isinstance(tree, list):
        return any(_contains(v, value) for v in tree)
    return False


def test_rng_state_round_trips_through_a_checkpoint(tmp_path: Path) -> None:
    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    random.gauss(0.0, 1.0)  # leave a cached gaussian in python and in numpy
    np.random.standard_normal()
    captured = rng.capture()
    trainer_sdk.save({"rng": trainer_sdk.RankLocal(captured)}, str(tmp_path), step=1)
    expected = _draws()

    # the byte states are per-rank tensors in the safetensors shard, the rest is JSON
    tensors = trainer_sdk.api.read_manifest(str(tmp_path), 1).tensors
    assert (tensors["rng.numpy.keys"].kind, tensors["rng.numpy.keys"].dtype) == (
        "rank_local",
        "U32",
    )
    assert (tensors["rng.torch"].kind, tensors["rng.torch"].dtype) == ("rank_local", "U8")
    rank_json = json.loads(
        (tmp_path / "step-000000000001" / "rank-00000-of-00001.json").read_text()
    )
    assert _contains(rank_json, captured["python"]["state"]), "python's state is plain JSON ints"

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    template = {"rng": trainer_sdk.RankLocal(rng.capture())}
    info = trainer_sdk.load(template, str(tmp_path))
    assert info.missing_rank_local == []
    loaded = template["rng"].value
    assert loaded["numpy"]["keys"].dtype == torch.uint32
    rng.restore(loaded)
    assert _draws() == expected
