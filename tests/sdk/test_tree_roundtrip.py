"""The tagged-JSON tree round-trips: what flatten() encodes, TreeDecoder rebuilds exactly.

No storage here: the tree goes through real JSON text (as it does on disk, with NaN refused),
and tensor references are resolved from the flattened entries themselves.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

from trainer_sdk.errors import CheckpointError
from trainer_sdk.format._tree import TreeDecoder, flatten
from trainer_sdk.format._types import RankLocal
from trainer_sdk.format.planning import FlatState


class Counter:
    """A Stateful object: saved through state_dict(), restored through load_state_dict()."""

    def __init__(self, n: int = 0) -> None:
        self.n = n
        self.scale = torch.zeros(2)

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "scale": self.scale}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = sd["n"]
        self.scale = sd["scale"]


def sample_state() -> dict[str, Any]:
    return {
        "model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3)},
        "ints": {1: "one", 2: [3, 4], None: True, 2.5: "float key", False: 0},
        "tuple": (1, "two", (3.0, torch.tensor([7], dtype=torch.int64))),
        "floats": [math.inf, -math.inf, 0.25, -0.0],
        "dtype": torch.bfloat16,
        "rng": RankLocal({"seed": 5, "state": torch.tensor([1, 2, 3], dtype=torch.uint8)}),
        "counter": Counter(9),
        "nested": [[{"a": None}], [], {}],
        "text": "ünïcode",
    }


def through_json(flat: FlatState) -> Any:
    return json.loads(json.dumps(flat.tree, allow_nan=False))


def decoder_for(flat: FlatState, *, strict: bool = True) -> TreeDecoder:
    tensors = flat.tensors()

    def tensor(key: str, cur: Any) -> Any:
        saved = tensors[key]
        if isinstance(cur, torch.Tensor) and cur.shape == saved.shape:
            cur.copy_(saved)
            return cur
        return saved.clone()

    return TreeDecoder(tensor, strict=strict)


def decode(flat: FlatState, live: dict[str, Any], *, strict: bool = True) -> TreeDecoder:
    tree = through_json(flat)
    dec = decoder_for(flat, strict=strict)
    for key, g in tree.items():
        live[key] = dec.node(live.get(key), g, g, key)
    return dec


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype
        assert torch.equal(a, b)
    elif isinstance(a, RankLocal):
        assert isinstance(b, RankLocal)
        assert_same(a.value, b.value)
    elif isinstance(a, Counter):
        assert isinstance(b, Counter)
        assert_same(a.state_dict(), b.state_dict())
    elif isinstance(a, dict):
        assert isinstance(b, dict)
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b)
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float)
        assert math.isnan(b)
    else:
        assert type(a) is type(b), (a, b)
        assert a == b


def test_every_kind_of_value_round_trips_into_an_empty_state() -> None:
    state = sample_state()
    state["floats"].append(math.nan)
    flat = flatten(state)
    restored: dict[str, Any] = {}
    dec = decode(flat, restored)
    assert dec.missing_rank_local == []
    # Into an empty state, RankLocal and Stateful values come back as their plain contents.
    expected = dict(state)
    expected["rng"] = state["rng"].value
    expected["counter"] = state["counter"].state_dict()
    assert_same(expected, restored)


def test_a_live_state_is_restored_in_place() -> None:
    saved = sample_state()
    flat = flatten(saved)
    live = sample_state()
    w, rng_state, counter = live["model"]["w"], live["rng"].value["state"], live["counter"]
    w.zero_()
    rng_state.zero_()
    counter.n, counter.scale = 0, torch.full((2,), 3.0)
    live["ints"][1] = "changed"
    decode(flat, live)
    assert_same(saved, live)
    assert live["model"]["w"] is w  # the same tensors, filled in place
    assert live["rng"].value["state"] is rng_state
    assert live["counter"] is counter
    assert counter.n == 9


def test_tensor_references_name_every_entry_once() -> None:
    flat = flatten(sample_state())
    refs: list[str] = []

    def collect(node: Any) -> None:
        if isinstance(node, dict):
            if "__baton_tensor__" in node:
                refs.append(node["__baton_tensor__"])
            for v in node.values():
                collect(v)
        elif isinstance(node, list):
            for v in node:
                collect(v)

    collect(through_json(flat))
    assert sorted(refs) == sorted(flat.entries)
    assert flat.entries["rng.state"].kind == "rank_local"
    assert flat.entries["model.w"].kind == "replicated"
    assert flat.entries["tuple.2.1"].kind == "replicated"


def test_strict_decoding_refuses_a_live_key_the_tree_lacks() -> None:
    flat = flatten({"opt": {"lr": 0.1}})
    live: dict[str, Any] = {"opt": {"lr": 1.0, "momentum": 0.9}}
    lost = r"opt: the checkpoint has no value for \['momentum'\]"
    with pytest.raises(CheckpointError, match=lost):
        decode(flat, live)
    lenient: dict[str, Any] = {"opt": {"lr": 1.0, "momentum": 0.9}}
    decode(flat, lenient, strict=False)
    assert lenient == {"opt": {"lr": 0.1, "momentum": 0.9}}


def test_a_rank_without_a_saved_value_keeps_its_own() -> None:
    flat = flatten({"r": RankLocal(7)})
    tree = through_json(flat)
    dec = decoder_for(flat)
    mine = RankLocal(42)
    out = dec.node(mine, tree["r"], None, "r")  # no tree of this rank's own
    assert out is mine
    assert mine.value == 42
    assert dec.missing_rank_local == ["r"]


def test_values_json_cannot_hold_are_refused_with_the_fix() -> None:
    with pytest.raises(CheckpointError, match=r"x: a value of type set cannot be saved"):
        flatten({"x": {1, 2}})
    with pytest.raises(CheckpointError, match=r"dict key .* cannot be saved; use str or int"):
        flatten({"x": {(1, 2): 3}})
