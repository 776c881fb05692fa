"""RNG capture/restore: the next draws after a restore are bitwise those after the capture."""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import pytest
import torch

from trainer_sdk import rng


def _draws() -> dict[str, Any]:
    """A few draws of every kind that keeps hidden state (gauss pairs included)."""
    return {
        "random": [random.random(), random.gauss(0.0, 1.0), random.randint(0, 10**9)],
        "numpy": np.concatenate([np.random.rand(3), np.random.standard_normal(3)]).tolist(),
        "numpy_int": np.random.randint(0, 2**31, size=4).tolist(),
        "torch": torch.cat([torch.rand(5), torch.randn(5)]),
        "torch_perm": torch.randperm(50),
        "dropout": torch.nn.functional.dropout(torch.ones(64), p=0.5, training=True),
    }


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, b[key]), key
        else:
            assert value == b[key], key


def _global_states() -> tuple[Any, Any, torch.Tensor]:
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def _states_equal(a: tuple[Any, Any, torch.Tensor], b: tuple[Any, Any, torch.Tensor]) -> bool:
    np_a, np_b = a[1], b[1]
    numpy_same = (
        np_a[0] == np_b[0]
        and np.array_equal(np_a[1], np_b[1])
        and tuple(np_a[2:]) == tuple(np_b[2:])
    )
    return a[0] == b[0] and numpy_same and torch.equal(a[2], b[2])


def _to_json_and_back(state: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint gives back: JSON parts through json (tuples become lists), tensors
    cloned (stored separately as safetensors)."""

    def split(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.clone()
        if isinstance(value, dict):
            return {k: split(v) for k, v in value.items()}
        return json.loads(json.dumps(value))

    return {k: split(v) for k, v in state.items()}


@pytest.fixture(autouse=True)
def _seeded() -> None:
    random.seed(1234)
    np.random.seed(1234)
    torch.manual_seed(1234)


def test_restore_reproduces_the_next_draws_of_every_stream() -> None:
    _draws()  # move every stream away from its seed, including a cached gaussian
    random.gauss(0.0, 1.0)
    np.random.standard_normal()
    saved = rng.capture()
    expected = _draws()
    _draws()  # wander further
    rng.restore(saved)
    _assert_same(_draws(), expected)


def test_capture_holds_only_tensors_and_json_and_survives_a_json_round_trip() -> None:
    random.gauss(0.0, 1.0)  # python caches the second gaussian: gauss_next is a float now
    np.random.standard_normal()  # numpy caches one too: has_gauss = 1
    saved = rng.capture()
    assert saved["python"]["gauss_next"] is not None
    assert saved["numpy"]["has_gauss"] == 1
    assert saved["numpy"]["keys"].dtype == torch.uint32
    assert saved["numpy"]["keys"].shape == (624,)
    assert saved["torch"].dtype == torch.uint8

    def check(value: Any, where: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                assert isinstance(k, str), where
                check(v, f"{where}.{k}")
        elif isinstance(value, list):
            for i, v in enumerate(value):
                check(v, f"{where}[{i}]")
        elif not isinstance(value, torch.Tensor):
            assert isinstance(value, int | float | str | type(None)), where

    check(saved, "state")
    expected = _draws()
    rng.restore(_to_json_and_back(saved))
    _assert_same(_draws(), expected)


def test_capture_draws_from_no_stream() -> None:
    before = _global_states()
    rng.capture()
    assert _states_equal(before, _global_states())


def test_a_partial_state_restores_only_its_streams() -> None:
    saved = rng.capture()
    expected_numpy = np.random.rand(4).tolist()
    random.random()
    torch.rand(3)
    python_state, torch_state = random.getstate(), torch.get_rng_state()
    rng.restore({"version": saved["version"], "numpy": saved["numpy"]})
    assert np.random.rand(4).tolist() == expected_numpy
    assert random.getstate() == python_state
    assert torch.equal(torch.get_rng_state(), torch_state)


def test_restore_leaves_generators_owned_by_user_code_alone() -> None:
    own_torch = torch.Generator().manual_seed(7)
    own_numpy = np.random.default_rng(7)
    own_python = random.Random(7)
    saved = rng.capture()
    torch.rand(10, generator=own_torch)
    own_numpy.random(10)
    own_python.random()
    mine = (own_torch.get_state(), own_numpy.bit_generator.state, own_python.getstate())
    rng.restore(saved)
    assert torch.equal(own_torch.get_state(), mine[0])
    assert own_numpy.bit_generator.state == mine[1]
    assert own_python.getstate() == mine[2]


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda s: s.update(version=99), "format version"),
        (lambda s: s.update(surprise=1), "unknown keys"),
        (lambda s: s["python"].update(state=[1, 2, 3]), "python.state"),
        (lambda s: s["python"].update(state=[-1] * 625), "python.state"),
        (lambda s: s["numpy"].update(keys=torch.zeros(10, dtype=torch.uint32)), "numpy.keys"),
        (lambda s: s["numpy"].update(keys=torch.full((624,), -1)), "uint32 values"),
        (lambda s: s["numpy"].update(keys=torch.zeros(624)), "integers"),
        (lambda s: s["numpy"].update(pos=999), "numpy.pos"),
        (lambda s: s["numpy"].update(bit_generator="PCG64"), "MT19937"),
        (lambda s: s.update(torch=torch.zeros(5056, dtype=torch.int64)), "uint8"),
        (lambda s: s.update(torch=torch.zeros(100, dtype=torch.uint8)), "5056"),
        (lambda s: s.update(cuda={"1": torch.zeros(16, dtype=torch.uint8)}), "keys '0'"),
        (lambda s: s.update(cuda=[torch.zeros(16, dtype=torch.uint8)]), "device index"),
        (lambda s: s.update(cuda_seed=-5), "cuda_seed"),
    ],
)
def test_a_malformed_state_is_refused_and_changes_no_stream(corrupt: Any, message: str) -> None:
    saved = rng.capture()
    corrupt(saved)
    random.random()
    np.random.rand()
    torch.rand(1)
    before = _global_states()
    with pytest.raises(rng.RngError, match=message):
        rng.restore(saved)
    # Validation happens before any stream is touched: python (checked first) is unchanged
    # even when the fault is in a later entry.
    assert _states_equal(before, _global_states())


def test_restore_refuses_a_non_dict() -> None:
    with pytest.raises(rng.RngError, match="must be a dict"):
        rng.restore([1, 2, 3])  # type: ignore[arg-type]


def test_a_widened_integer_dtype_for_numpy_keys_still_restores() -> None:
    saved = rng.capture()
    expected = np.random.rand(3).tolist()
    saved["numpy"]["keys"] = saved["numpy"]["keys"].to(torch.int64)
    rng.restore(saved)
    assert np.random.rand(3).tolist() == expected


def test_derive_is_deterministic_per_rank_and_changes_nothing_itself() -> None:
    before = _global_states()
    a0, again, a1 = rng.derive(42, 0), rng.derive(42, 0), rng.derive(42, 1)
    assert _states_equal(before, _global_states())

    rng.restore(a0)
    first = _draws()
    rng.restore(again)
    _assert_same(_draws(), first)
    rng.restore(a1)
    other = _draws()
    assert other["random"] != first["random"]
    assert other["numpy"] != first["numpy"]
    assert not torch.equal(other["torch"], first["torch"])
    rng.restore(rng.derive(43, 0))
    assert _draws()["numpy"] != first["numpy"]
    # the streams of one rank are seeded apart from each other
    assert len({a0["cuda_seed"], a1["cuda_seed"], rng.derive(43, 0)["cuda_seed"]}) == 3


def test_derive_refuses_a_negative_rank() -> None:
    with pytest.raises(rng.RngError, match="rank"):
        rng.derive(1, -1)


def test_mix_seed_is_stable_and_keeps_nearby_inputs_apart() -> None:
    # Pinned: sampler orders and derived streams of saved runs depend on these exact values.
    assert rng.mix_seed(0, 0) == rng.mix_seed(0, 0)
    assert rng.mix_seed(1, 0) != rng.mix_seed(0, 1)
    assert rng.mix_seed(-1) == rng.mix_seed(2**64 - 1)
    assert 0 <= rng.mix_seed(5, 6, 7) < 2**64
    assert rng.mix_seed(0, 0) == 0x93A9BDB51E5D5285


def test_python_state_may_come_as_an_integer_tensor() -> None:
    saved = rng.capture()
    expected = _draws()
    packed = torch.tensor(saved["python"]["state"], dtype=torch.int64)
    rng.restore({**saved, "python": {**saved["python"], "state": packed}})
    _assert_same(_draws(), expected)
    with pytest.raises(rng.RngError, match=r"python\.state"):
        rng.restore({**saved, "python": {**saved["python"], "state": packed[:10]}})
