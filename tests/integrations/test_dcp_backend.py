"""Baton as a torch.distributed.checkpoint storage backend (issue 28, build item 1).

Real DCP (``dcp.save``, ``dcp.async_save``, ``dcp.load`` with DCP's own planners), real gloo
ranks as processes, DTensor shards on a CPU mesh, the filesystem and both S3 servers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
from baton_testing.dist import run_ranks
from baton_testing.s3 import S3Bucket
from torch.distributed.checkpoint.api import CheckpointException

import trainer_sdk
from trainer_sdk.errors import SupersededError
from trainer_sdk.integrations.dcp import BatonLoadPlanner, BatonReader, BatonWriter

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled, unavailable or uninitialized:UserWarning"
)  # DCP's note that a test without a process group saves in one process, as meant

ROWS = 10  # not a multiple of 3: the ranks' Shard(0) chunks differ in size


def _full(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(ROWS, 6, generator=g),
        "emb": torch.randn(ROWS, 4, generator=g, dtype=torch.float64),
        "bias": torch.randn(6, generator=g),
    }


def _state(mesh: Any, seed: int | None) -> dict[str, Any]:
    """The training state every rank holds: two DTensors sharded by rows, one replicated
    tensor, optimizer-like nesting with int keys, and non-tensor values."""
    from torch.distributed.tensor import Shard, distribute_tensor

    full = _full(0) if seed is None else _full(seed)
    if seed is None:
        full = {k: torch.zeros_like(v) for k, v in full.items()}
    return {
        "model": {
            "w": distribute_tensor(full["w"], mesh, [Shard(0)]),
            "emb": distribute_tensor(full["emb"], mesh, [Shard(0)]),
            "bias": full["bias"].clone(),
        },
        "optim": {"state": {0: {"exp_avg": full["bias"] * 2, "step": torch.tensor(3.0)}}},
        "step": 0 if seed is None else 120,
        "meta": {"name": "" if seed is None else "run-a", "window": (0, 0.0) if seed is None
                 else (4, 0.5)},
    }  # fmt: skip


def _save_body(root: str, step: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    dcp.save(_state(mesh, seed=7), storage_writer=BatonWriter(root, step=step))
    return {"rank": dist.get_rank()}


def _load_body(root: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = _state(mesh, seed=None)
    dcp.load(state, storage_reader=BatonReader(root), planner=BatonLoadPlanner())
    want = _full(7)
    return {
        "w": torch.equal(state["model"]["w"].full_tensor(), want["w"]),
        "emb": torch.equal(state["model"]["emb"].full_tensor(), want["emb"]),
        "bias": torch.equal(state["model"]["bias"], want["bias"]),
        "exp_avg": torch.equal(state["optim"]["state"][0]["exp_avg"], want["bias"] * 2),
        "opt_step": float(state["optim"]["state"][0]["step"]),
        "step": state["step"],
        "meta": [state["meta"]["name"], list(state["meta"]["window"]),
                 type(state["meta"]["window"]).__name__],
    }  # fmt: skip


def _step_files(root: Path, step: int) -> set[str]:
    return {p.name for p in (root / f"step-{step:012d}").iterdir()}


def test_three_ranks_save_through_dcp_and_two_or_three_load(tmp_path: Path) -> None:
    """DCP's planners decide who writes which chunk (3 ranks, uneven Shard(0) rows); the step
    is Baton's format and commit; 1, 2 and 3 ranks load it back exactly (DCP reshards); the
    CLI verifies and exports it."""
    root = tmp_path / "ckpt"
    run_ranks(_save_body, 3, args=(str(root), 120), timeout=180)
    assert _step_files(root, 120) == {
        "manifest.json",
        *(f"rank-{r:05d}-of-00003.{ext}" for r in range(3) for ext in ("json", "safetensors")),
    }  # no .metadata pickle, nothing but Baton's files
    manifest = json.loads((root / "step-000000000120" / "manifest.json").read_text())
    assert manifest["world_size"] == 3
    assert manifest["tensors"]["model.w"]["kind"] == "sharded"
    assert [p["offsets"][0] for p in manifest["tensors"]["model.w"]["pieces"]] == [0, 4, 8]
    assert manifest["tensors"]["model.bias"]["kind"] == "replicated"
    assert json.loads((root / "latest").read_text()) == {"step": 120}
    expected = {
        "w": True, "emb": True, "bias": True, "exp_avg": True, "opt_step": 3.0, "step": 120,
        "meta": ["run-a", [4, 0.5], "tuple"],
    }  # fmt: skip
    for world in (1, 2, 3):
        results = run_ranks(_load_body, world, args=(str(root),), timeout=180)
        assert results == [expected] * world, f"{world} ranks: {results}"
    # The same step is a Baton step: verify reads every digest; load gives DCP's keys.
    verify = subprocess.run(
        [sys.executable, "-m", "trainer_sdk", "verify", str(root)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert verify.returncode == 0, verify.stdout + verify.stderr
    # ... and exports: the model's tensors, whole, as Hugging Face safetensors.
    exported = tmp_path / "hf"
    export = subprocess.run(
        [sys.executable, "-m", "trainer_sdk", "export-hf", str(root), str(exported),
         "--weights-only"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert export.returncode == 0, export.stdout + export.stderr
    weights = safetensors.torch.load_file(exported / "model.safetensors")
    assert sorted(weights) == ["bias", "emb", "w"]
    for name, tensor in _full(7).items():
        assert torch.equal(weights[name], tensor), name
    flat: dict[str, Any] = {}
    trainer_sdk.load(flat, root)
    assert torch.equal(flat["model.w"], _full(7)["w"])
    assert flat["step"] == 120
    assert flat["meta.window"] == (4, 0.5)


def test_a_flipped_byte_fails_the_dcp_load_naming_the_file(tmp_path: Path) -> None:
    state = {"w": torch.arange(64.0).reshape(8, 8), "step": 3}
    dcp.save(state, storage_writer=BatonWriter(tmp_path, step=3))
    shard = tmp_path / "step-000000000003" / "rank-00000-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x40
    shard.write_bytes(bytes(data))
    target = {"w": torch.zeros(8, 8), "step": 0}
    with pytest.raises(CheckpointException) as exc:
        dcp.load(target, storage_reader=BatonReader(tmp_path), planner=BatonLoadPlanner())
    assert "checksum mismatch in tensor 'w'" in str(exc.value)
    assert "rank-00000-of-00001.safetensors" in str(exc.value)


def test_values_are_json_and_the_pickling_planner_is_refused(tmp_path: Path) -> None:
    """Non-tensor values are stored as Baton's JSON; DCP's default load planner would
    torch.load (unpickle) them, so it is refused with the fix."""
    dcp.save({"w": torch.ones(2), "step": 9}, storage_writer=BatonWriter(tmp_path, step=9))
    tree = json.loads((tmp_path / "step-000000000009" / "rank-00000-of-00001.json").read_text())
    assert tree == {"w": {"__baton_tensor__": "w"}, "step": 9}
    target = {"w": torch.zeros(2), "step": 0}
    with pytest.raises(CheckpointException) as exc:
        dcp.load(target, storage_reader=BatonReader(tmp_path))
    assert "planner=trainer_sdk.integrations.dcp.BatonLoadPlanner()" in str(exc.value)
    tensors_only = {"w": torch.zeros(2)}  # no value to decode: the default planner is fine
    dcp.load(tensors_only, storage_reader=BatonReader(tmp_path))
    assert torch.equal(tensors_only["w"], torch.ones(2))


def test_a_checkpointer_step_loads_through_dcp(tmp_path: Path) -> None:
    """A step written by Baton's own save loads through dcp.load where the keys match:
    optimizer state keyed by int, param_groups (a list of dicts), a scalar step."""
    m = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    trainer_sdk.save({"model": m.state_dict(), "optim": opt.state_dict(), "step": 5}, tmp_path,
                     step=5)  # fmt: skip
    m2 = torch.nn.Linear(4, 3)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=0.5)
    m2(torch.randn(2, 4)).sum().backward()
    opt2.step()
    state = {"model": m2.state_dict(), "optim": opt2.state_dict(), "step": 0}
    dcp.load(state, storage_reader=BatonReader(tmp_path), planner=BatonLoadPlanner())
    assert torch.equal(state["model"]["weight"], m.weight.detach())
    assert torch.equal(
        state["optim"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"]
    )
    assert state["optim"]["param_groups"][0]["lr"] == 0.01
    assert state["step"] == 5


def test_dcp_async_save_commits_a_baton_step(tmp_path: Path) -> None:
    state = {"w": torch.randn(16, 16), "step": 11}
    fut = dcp.async_save(state, storage_writer=BatonWriter(tmp_path, step=11))
    fut.result(timeout=120)
    assert trainer_sdk.latest_step(tmp_path) == 11
    target = {"w": torch.zeros(16, 16), "step": 0}
    dcp.load(target, storage_reader=BatonReader(tmp_path, step=11), planner=BatonLoadPlanner())
    assert torch.equal(target["w"], state["w"])
    assert target["step"] == 11


def test_committed_steps_and_newer_attempts_are_never_overwritten(tmp_path: Path) -> None:
    dcp.save({"w": torch.ones(4)}, storage_writer=BatonWriter(tmp_path, step=1, attempt=2))
    with pytest.raises(CheckpointException) as exc:
        dcp.save({"w": torch.zeros(4)}, storage_writer=BatonWriter(tmp_path, step=1, attempt=2))
    assert "already committed" in str(exc.value)
    with pytest.raises(CheckpointException) as stale:
        dcp.save({"w": torch.zeros(4)}, storage_writer=BatonWriter(tmp_path, step=2, attempt=1))
    assert f"{SupersededError.__name__}: step 2 was not committed" in str(stale.value)
    assert "this writer is attempt 1, but attempt 2" in str(stale.value)
    assert trainer_sdk.list_steps(tmp_path) == [1]
    out = {"w": torch.zeros(4)}
    dcp.load(out, storage_reader=BatonReader(tmp_path))
    assert torch.equal(out["w"], torch.ones(4))


def test_dcp_to_s3_and_back(s3_bucket: S3Bucket, monkeypatch: pytest.MonkeyPatch) -> None:
    uri = s3_bucket.uri("dcp/run")
    state = {"w": torch.randn(64, 32), "b": torch.randn(32).to(torch.bfloat16), "step": 40}
    dcp.save(state, storage_writer=BatonWriter(uri, step=40))
    assert json.loads(s3_bucket.get("dcp/run/latest")) == {"step": 40}
    target = {"w": torch.zeros(64, 32), "b": torch.zeros(32, dtype=torch.bfloat16), "step": 0}
    dcp.load(target, storage_reader=BatonReader(uri), planner=BatonLoadPlanner())
    assert torch.equal(target["w"], state["w"])
    assert torch.equal(target["b"], state["b"])
    assert target["step"] == 40
