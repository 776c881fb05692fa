"""Save, then load into fresh objects: every tensor and all optimizer state come back bitwise.

Single process (plain model), and 2 and 3 real gloo ranks for DDP (replicated: each tensor
written once, the writing spread over the ranks) and FSDP2 (DTensor shards written by their
owners), plus a resharded load of the FSDP2 checkpoint into one process.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from baton_testing.dist import run_ranks
from safetensors import safe_open

import trainer_sdk
from trainer_sdk import RankLocal


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    # odd sizes: FSDP2 shards 7 and 13 rows unevenly over 2 and 3 ranks
    return torch.nn.Sequential(
        torch.nn.Linear(10, 13), torch.nn.ReLU(), torch.nn.Linear(13, 7), torch.nn.ReLU()
    )


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 10, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _assert_tree_equal(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        if hasattr(a, "to_local"):
            a, b = a.to_local(), b.to_local()
        assert a.dtype == b.dtype, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert set(a) == set(b), (path, set(a) ^ set(b))
        for k in a:
            _assert_tree_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b), path
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_tree_equal(x, y, f"{path}.{i}")
    else:
        assert a == b, (path, a, b)


def test_single_process_roundtrip_restores_everything_in_place(tmp_path: Path) -> None:
    model = _mlp(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    _train(model, opt, 3, seed=1)
    sched.step()
    extra = {
        "nested": {"t": torch.arange(6, dtype=torch.int64).reshape(2, 3), "n": [1, 2.5, None]},
        "tuple": (1, "a", float("inf")),
        "int_keys": {3: "x", 7: torch.ones(2)},
        "bf16": torch.randn(4, 5).to(torch.bfloat16),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "dtype": torch.float16,
    }
    state = {"model": model, "optim": opt, "sched": sched, "extra": extra, "step": 3}
    info = trainer_sdk.save(state, str(tmp_path), step=3)
    assert info.step == 3
    assert info.files == 2
    assert set(info.phases) >= {"flatten", "plan", "write", "commit"}
    assert trainer_sdk.latest_step(str(tmp_path)) == 3

    model2 = _mlp(99)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    weight_before = model2[0].weight
    state2: dict[str, Any] = {"model": model2, "optim": opt2, "sched": sched2, "extra": {}}
    li = trainer_sdk.load(state2, f"file://{tmp_path}", strict=False)
    assert li.step == 3
    assert li.saved_world_size == 1
    assert not li.resharded
    assert model2[0].weight is weight_before  # restored in place, not replaced
    _assert_tree_equal(model.state_dict(), model2.state_dict())
    _assert_tree_equal(opt.state_dict(), opt2.state_dict())
    assert sched.state_dict() == sched2.state_dict()
    assert state2["step"] == 3
    _assert_tree_equal(
        {k: v for k, v in extra.items() if k != "tuple"},
        {k: v for k, v in state2["extra"].items() if k != "tuple"},
    )
    assert state2["extra"]["tuple"][:2] == (1, "a")
    assert math.isinf(state2["extra"]["tuple"][2])

    # the shard is a valid safetensors file
    shard = tmp_path / "step-000000000003" / "rank-00000-of-00001.safetensors"
    with safe_open(str(shard), "pt") as f:
        assert torch.equal(f.get_tensor("extra.bf16"), extra["bf16"])
        assert torch.equal(f.get_tensor("model.0.weight"), model[0].weight.detach())
        assert f.metadata()["step"] == "3"


def test_strict_load_names_the_missing_key_and_the_shape_mismatch(tmp_path: Path) -> None:
    trainer_sdk.save({"w": torch.ones(3, 2)}, str(tmp_path), step=1)
    with pytest.raises(trainer_sdk.CheckpointError, match=r"no \['extra'\].*strict=False"):
        trainer_sdk.load({"w": torch.zeros(3, 2), "extra": 1}, str(tmp_path))
    with pytest.raises(trainer_sdk.CheckpointError, match=r"'w'.*F32 \[3, 2\].*same configuration"):
        trainer_sdk.load({"w": torch.zeros(2, 2)}, str(tmp_path))
    with pytest.raises(trainer_sdk.CheckpointError, match="already committed"):
        trainer_sdk.save({"w": torch.ones(3, 2)}, str(tmp_path), step=1)


def test_unsupported_values_are_refused_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(trainer_sdk.CheckpointError, match=r"state\.obj.*state_dict\(\)"):
        trainer_sdk.save({"state": {"obj": object()}}, str(tmp_path), step=1)
    assert trainer_sdk.latest_step(str(tmp_path)) is None


# ----------------------------------------------------------------------- multi-rank bodies


def _ddp_and_fsdp_body(root: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}

    # ---- DDP: replicated tensors
    ddp = DistributedDataParallel(_mlp(0))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    _train(ddp, opt, 2, seed=5 + rank)  # different data per rank, gradients all-reduced
    rng = torch.get_rng_state()
    state = {
        "model": ddp,
        "optim": opt,
        "step": 2,
        "rng": RankLocal(rng),
        "cursor": RankLocal({"rank": rank, "seen": [rank] * (rank + 1)}),
    }
    uri = f"{root}/ddp"
    trainer_sdk.save(state, uri, step=2)
    ddp2 = DistributedDataParallel(_mlp(123))
    opt2 = torch.optim.AdamW(ddp2.parameters(), lr=1e-2)
    state2: dict[str, Any] = {
        "model": ddp2,
        "optim": opt2,
        "step": 0,
        "rng": RankLocal(torch.zeros_like(rng)),
        "cursor": RankLocal({}),
    }
    info = trainer_sdk.load(state2, uri)
    assert not info.resharded
    assert info.missing_rank_local == []
    _assert_tree_equal(ddp.state_dict(), ddp2.state_dict())
    _assert_tree_equal(opt.state_dict(), opt2.state_dict())
    assert torch.equal(state2["rng"].value, rng)
    assert state2["cursor"].value == {"rank": rank, "seen": [rank] * (rank + 1)}
    assert state2["step"] == 2

    # ---- FSDP2: DTensor shards
    mesh = init_device_mesh("cpu", (world,))
    net = _mlp(0)
    for layer in (net[0], net[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    fopt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    _train(net, fopt, 2, seed=9 + rank)
    msd, osd = get_state_dict(net, fopt)
    uri = f"{root}/fsdp"
    trainer_sdk.save({"model": msd, "optim": osd, "step": 2}, uri, step=2)
    full = {k: v.full_tensor() for k, v in msd.items()}
    net2 = _mlp(321)
    for layer in (net2[0], net2[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(net2, mesh=mesh)
    fopt2 = torch.optim.AdamW(net2.parameters(), lr=1e-2)
    msd2, osd2 = get_state_dict(net2, fopt2)
    st = {"model": msd2, "optim": osd2, "step": 0}
    trainer_sdk.load(st, uri)
    set_state_dict(net2, fopt2, model_state_dict=st["model"], optim_state_dict=st["optim"])
    m_a, o_a = get_state_dict(net, fopt)
    m_b, o_b = get_state_dict(net2, fopt2)
    _assert_tree_equal(m_a, m_b)
    _assert_tree_equal(o_a, o_b)
    # both continue identically
    _train(net, fopt, 1, seed=77)
    _train(net2, fopt2, 1, seed=77)
    _assert_tree_equal(get_state_dict(net, fopt), get_state_dict(net2, fopt2))
    if rank == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in full.items()}, f"{root}/fsdp_full.safetensors")
    out["rank"] = rank
    return out


def _check_ddp_spread(root: Path, world: int) -> None:
    step = root / "ddp" / "step-000000000002"
    manifest = json.loads((step / "manifest.json").read_text())
    per_file: dict[str, int] = {}
    for entry in manifest["tensors"].values():
        if entry["kind"] != "replicated":
            continue
        assert len(entry["pieces"]) >= 1
        for p in entry["pieces"]:
            per_file[p["file"]] = per_file.get(p["file"], 0) + p["end"] - p["begin"]
    assert len(per_file) == world, f"replicated bytes all on {sorted(per_file)}"
    total = sum(per_file.values())
    # greedy bin-packing of these sizes keeps every rank well within 2x of its fair share
    assert max(per_file.values()) <= 2 * total / world, per_file
    rank_local = [e for e in manifest["tensors"].values() if e["kind"] == "rank_local"]
    assert sorted(p["rank"] for p in rank_local[0]["pieces"]) == list(range(world))
    for name in os.listdir(step):
        if name.endswith(".safetensors"):
            with safe_open(str(step / name), "pt") as f:
                assert len(list(f.keys())) > 0


def _check_fsdp_resharded_into_one_process(root: Path, world: int) -> None:
    from safetensors.torch import load_file

    full = load_file(str(root / "fsdp_full.safetensors"))
    manifest = json.loads((root / "fsdp" / "step-000000000002" / "manifest.json").read_text())
    sharded = [k for k, e in manifest["tensors"].items() if e["kind"] == "sharded"]
    assert any(k.startswith("model.") for k in sharded)
    assert any(".exp_avg" in k for k in sharded)
    loaded: dict[str, Any] = {}
    info = trainer_sdk.load(loaded, str(root / "fsdp"), strict=False)
    assert info.resharded
    assert info.saved_world_size == world
    for k, v in full.items():
        assert torch.equal(loaded["model"][k], v), k


@pytest.mark.e2e  # real processes: about a minute on a loaded 2-core machine
@pytest.mark.parametrize("world", [2, 3])
def test_ddp_and_fsdp2_roundtrip_on_real_ranks(tmp_path: Path, world: int) -> None:
    run_ranks(_ddp_and_fsdp_body, world, args=(str(tmp_path),), timeout=240)
    _check_ddp_spread(tmp_path, world)
    _check_fsdp_resharded_into_one_process(tmp_path, world)


# ---------------------------------------------------------------- resharding 2 -> 3 ranks


def _fsdp_model(world: int, seed: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    net = _mlp(seed)
    for layer in (net[0], net[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def _reshard_save_body(root: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank = dist.get_rank()
    net = _fsdp_model(2, seed=0)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    _train(net, opt, 2, seed=3 + rank)
    msd, osd = get_state_dict(net, opt)
    state = {
        "model": msd,
        "optim": osd,
        "replicated": torch.arange(40.0).reshape(8, 5),
        "rng": RankLocal(torch.tensor([100 + rank])),
    }
    trainer_sdk.save(state, f"{root}/ckpt", step=4)
    full_m = {k: v.full_tensor() for k, v in msd.items()}
    full_o = {
        f"{fqn}.{name}": (v.full_tensor() if hasattr(v, "full_tensor") else v)
        for fqn, s in osd["state"].items()
        for name, v in s.items()
    }
    if rank == 0:
        from safetensors.torch import save_file

        save_file(
            {
                **{f"m.{k}": v for k, v in full_m.items()},
                **{f"o.{k}": v for k, v in full_o.items()},
            },
            f"{root}/full.safetensors",
        )


def _reshard_load_body(root: str) -> dict[str, Any]:
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import get_state_dict

    world = dist.get_world_size()
    net = _fsdp_model(world, seed=42)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    msd, osd = get_state_dict(net, opt)
    st: dict[str, Any] = {
        "model": msd,
        "optim": osd,
        "replicated": torch.zeros(8, 5),
        "rng": RankLocal(torch.tensor([-1])),
    }
    info = trainer_sdk.load(st, f"{root}/ckpt")
    full = load_file(f"{root}/full.safetensors")
    for k, v in st["model"].items():
        assert torch.equal(v.full_tensor(), full[f"m.{k}"]), k
        assert v.to_local().shape[0] < full[f"m.{k}"].shape[0] or world == 1
    for fqn, s in st["optim"]["state"].items():
        for name, v in s.items():
            got = v.full_tensor() if hasattr(v, "full_tensor") else v
            assert torch.equal(got, full[f"o.{fqn}.{name}"]), (fqn, name)
    assert torch.equal(st["replicated"], torch.arange(40.0).reshape(8, 5))
    return {
        "resharded": info.resharded,
        "saved": info.saved_world_size,
        "missing": info.missing_rank_local,
        "rng": int(st["rng"].value.item()),
    }


@pytest.mark.e2e
def test_fsdp2_checkpoint_from_2_ranks_loads_on_3(tmp_path: Path) -> None:
    run_ranks(_reshard_save_body, 2, args=(str(tmp_path),), timeout=240)
    out = run_ranks(_reshard_load_body, 3, args=(str(tmp_path),), timeout=240)
    assert all(o["resharded"] and o["saved"] == 2 for o in out)
    # ranks 0 and 1 get their own RankLocal values; rank 2 did not exist: told, not guessed
    assert [o["rng"] for o in out] == [100, 101, -1]
    assert [o["missing"] for o in out] == [[], [], ["rng"]]


# -------------------------------------------------------------- retention and the hint


def test_latest_is_only_a_hint_and_never_moves_backwards(tmp_path: Path) -> None:
    uri = str(tmp_path)
    trainer_sdk.save({"w": torch.ones(2)}, uri, step=5)
    trainer_sdk.save({"w": torch.ones(2) * 3}, uri, step=3)  # an older step saved later
    assert json.loads((tmp_path / "latest").read_text()) == {"step": 5}
    assert trainer_sdk.list_steps(uri) == [3, 5]
    trainer_sdk.delete_step(uri, 5)
    assert not (tmp_path / "step-000000000005").exists()
    # the hint still says 5; readers check it against the manifests
    assert json.loads((tmp_path / "latest").read_text()) == {"step": 5}
    assert trainer_sdk.latest_step(uri) == 3
    st = {"w": torch.zeros(2)}
    assert trainer_sdk.load(st, uri).step == 3
    assert torch.equal(st["w"], torch.ones(2) * 3)


def test_cleanup_incomplete_never_touches_a_save_that_may_be_in_progress(tmp_path: Path) -> None:
    uri = str(tmp_path)
    (tmp_path / "step-000000000001").mkdir(parents=True)  # crashed before step 2 committed
    trainer_sdk.save({"w": torch.ones(2)}, uri, step=2)
    (tmp_path / "step-000000000003").mkdir()  # newer than the newest complete: maybe running
    assert trainer_sdk.cleanup_incomplete(uri) == ["step-000000000001"]
    assert (tmp_path / "step-000000000003").exists()
    assert trainer_sdk.list_steps(uri) == [2]


def test_non_contiguous_grad_and_views_are_saved_by_value(tmp_path: Path) -> None:
    base = torch.arange(24.0).reshape(4, 6)
    p = torch.nn.Parameter(torch.randn(3, 3))
    state = {"t": base.t(), "slice": base[1:3, 2:5], "param": p}
    trainer_sdk.save(state, str(tmp_path), step=1)
    st = {"t": torch.zeros(6, 4), "slice": torch.zeros(2, 3), "param": torch.zeros(3, 3)}
    trainer_sdk.load(st, str(tmp_path))
    assert torch.equal(st["t"], base.t())
    assert torch.equal(st["slice"], base[1:3, 2:5])
    assert torch.equal(st["param"], p.detach())


def test_iter_tensors_yields_whole_tensors_one_at_a_time(tmp_path: Path) -> None:
    from trainer_sdk.api import iter_tensors

    state = {"a": torch.randn(5, 3), "b": {"c": torch.arange(7)}, "r": RankLocal(torch.ones(2))}
    trainer_sdk.save(state, str(tmp_path), step=9)
    got = dict(iter_tensors(str(tmp_path)))
    assert set(got) == {"a", "b.c"}
    assert torch.equal(got["a"], state["a"])
    assert torch.equal(got["b.c"], state["b"]["c"])
    with_rl = dict(iter_tensors(str(tmp_path), kinds=("replicated", "rank_local")))
    assert torch.equal(with_rl["r"], torch.ones(2))


def test_paths_and_storage_objects_work_wherever_a_uri_does(tmp_path: Path) -> None:
    from trainer_sdk.api import iter_tensors
    from trainer_sdk.storage import open_storage

    root = tmp_path / "ckpt"
    state = {"w": torch.arange(12.0).reshape(3, 4), "meta": {"lr": 0.5}}
    trainer_sdk.save(state, root, step=1)  # a pathlib.Path
    storage = open_storage(f"file://{root}")
    trainer_sdk.save(state, storage, step=2)  # an opened Storage, reused as is
    assert open_storage(storage) is storage
    assert trainer_sdk.list_steps(root) == [1, 2]
    assert trainer_sdk.latest_step(storage) == 2
    dest = {"w": torch.zeros(3, 4), "meta": {"lr": 0.0}}
    info = trainer_sdk.load(dest, root, step=1)
    assert info.step == 1
    assert torch.equal(dest["w"], state["w"])
    assert dest["meta"] == {"lr": 0.5}
    assert [k for k, _ in iter_tensors(storage)] == ["w"]
    trainer_sdk.delete_step(storage, 1)
    assert trainer_sdk.list_steps(str(root)) == [2]
    with pytest.raises(TypeError, match="path, a file:// or s3:// URI, or a Storage"):
        trainer_sdk.latest_step(42)  # type: ignore[arg-type]


def test_stateful_list_subclasses_and_json_leaves_keep_their_meaning(tmp_path: Path) -> None:
    class History(list[int]):
        """A list that checkpoints itself as a dict (Stateful wins over list)."""

        def state_dict(self) -> dict[str, Any]:
            return {"items": list(self), "n": len(self)}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            self[:] = sd["items"]

    hist = History([3, 1, 2])
    state: dict[str, Any] = {
        "hist": hist,
        "plain": [1, 2.5, "x", None, True, (4, 5)],
        "inf": math.inf,
    }
    from trainer_sdk.api import flatten

    flat = flatten(state)
    assert flat.tree["hist"] == {"items": [3, 1, 2], "n": 3}
    trainer_sdk.save(state, tmp_path, step=1)
    fresh = History()
    dest: dict[str, Any] = {"hist": fresh, "plain": [], "inf": 0.0}
    trainer_sdk.load(dest, tmp_path)
    assert fresh == [3, 1, 2]
    assert dest["plain"] == [1, 2.5, "x", None, True, (4, 5)]
    assert dest["inf"] == math.inf
