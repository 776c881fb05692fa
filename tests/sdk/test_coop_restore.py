"""Cooperative restore on 3 real gloo ranks: what every rank needs whole is read once, then sent.

* A DDP-style state (every tensor replicated, one of them saved as row ranges by several
  ranks, a bf16, a scalar, an int64, an empty tensor, a Stateful whose ``state_dict()`` returns
  copies, a key the live state lacks) restores bitwise on every rank, and the bytes read from
  storage, counted by a wrapper around the real storage, are 1.0x the tensors' bytes (3x with
  ``cooperative=False``).
* Mixed in: DTensor shards (each rank reads its own) and RankLocal values (each rank its own):
  bitwise, and still every byte read once.
* A corrupt block that only its reader reads, a shard file that is gone, and one rank's JSON
  file corrupt (a failure before the cooperative reads begin): all 3 ranks raise the same
  classified error, none waits for a peer.

Blocks are 4 KiB and the small-unit threshold 8 KiB here, so tensors span many blocks, large
pieces are cut into several units with different readers, and small ones are packed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from baton_testing.dist import run_ranks
from baton_testing.s3 import S3Bucket

pytestmark = pytest.mark.e2e  # real processes: several torch start-ups on 2 shared cores

BLOCK = 4096
SPLIT = 64 * 1024  # replicated tensors this large are saved as row ranges by several ranks


def _reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(29)
    return {
        "big": torch.randn(300, 257, generator=g),  # ~300 KiB: split over ranks at save
        "mid": torch.randn(40, 100, generator=g, dtype=torch.float64),
        "half": torch.randn(33, 17, generator=g).to(torch.bfloat16),
        "ints": torch.randint(-(2**40), 2**40, (1000,), generator=g),
        "scalar": torch.tensor(3.25),
        "empty": torch.zeros(0, 4),
    }


class Copies:
    """A Stateful whose ``state_dict()`` returns a fresh copy at every call."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.value.clone()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.value = sd["w"].clone()


def _state(fill: bool, *, mixed: bool) -> dict[str, Any]:
    import torch.distributed as dist

    ref = _reference()
    src = ref if fill else {k: torch.zeros_like(v) for k, v in ref.items()}
    state: dict[str, Any] = {
        "model": {k: v.clone() for k, v in src.items()},
        "copies": Copies(src["mid"].clone() + 1),
        "step": 7 if fill else 0,
    }
    if fill:
        state["added"] = ref["big"][:5].clone() * 2
    if mixed:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        from trainer_sdk import RankLocal

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        state["sharded"] = {
            k: distribute_tensor(v.clone(), mesh, [Shard(0)])
            for k, v in src.items()
            if k in ("big", "mid", "half")
        }
        own = torch.arange(100 + dist.get_rank(), dtype=torch.float32) * (dist.get_rank() + 1)
        state["own"] = RankLocal(own if fill else torch.zeros_like(own))
    return state


def _save(uri: str, mixed: bool, block: int = BLOCK) -> None:
    import torch.distributed as dist

    from trainer_sdk import api
    from trainer_sdk.storage import open_storage

    rank, world = dist.get_rank(), dist.get_world_size()
    storage = open_storage(uri)
    flat = api.flatten(_state(True, mixed=mixed))
    plan = api.plan_save(flat, rank, world, split_bytes=SPLIT)
    record = api.write_rank(
        storage, plan, flat.tensors(), flat.tree, step=1, flat=flat, block_size=block
    )
    api.commit(storage, record, step=1, block_size=block)


def _tensor_bytes(uri: str) -> dict[str, int]:
    from trainer_sdk import api
    from trainer_sdk.storage import open_storage

    m = api.read_manifest(open_storage(uri), 1)
    out = {"replicated": 0, "sharded": 0, "rank_local": 0}
    for e in m.tensors.values():
        out[e.kind] += sum(p.nbytes for p in e.pieces)
    return out


def _save_and_load(uri: str, mixed: bool, cooperative: bool) -> dict[str, Any]:
    import torch.distributed as dist
    from baton_testing.counting import CountingStorage

    from trainer_sdk import api
    from trainer_sdk.saveload import _coop

    _coop.SMALL = 2 * BLOCK  # type: ignore[misc]  # exercise the large-unit path too
    _save(uri, mixed)
    dist.barrier()
    storage = CountingStorage(uri)
    state = _state(False, mixed=mixed)
    live_big = state["model"]["big"]
    # the default group (process_group=None) for one state, an explicit one for the other
    group = dist.group.WORLD if mixed else None
    info = api.load(state, storage, process_group=group, strict=False, cooperative=cooperative)
    want = _state(True, mixed=mixed)
    equal = {k: torch.equal(state["model"][k], v) for k, v in want["model"].items()}
    equal["copies"] = torch.equal(state["copies"].value, want["copies"].value)
    equal["added"] = torch.equal(state["added"], want["added"])
    equal["step"] = state["step"] == 7
    equal["in_place"] = state["model"]["big"] is live_big
    if mixed:
        for k, v in want["sharded"].items():
            equal[f"sharded.{k}"] = torch.equal(state["sharded"][k].full_tensor(), v.full_tensor())
        equal["own"] = torch.equal(state["own"].value, want["own"].value)
    return {
        "equal": equal,
        "ranged": storage.ranged,
        "bytes_read": info.bytes_read,
        "cooperative_bytes": info.cooperative_bytes,
        "sizes": _tensor_bytes(uri),
    }


@pytest.mark.parametrize("mixed", [False, True], ids=["ddp", "ddp+fsdp+rank-local"])
def test_three_ranks_restore_bitwise_reading_each_byte_once(tmp_path: Path, mixed: bool) -> None:
    coop = run_ranks(_save_and_load, 3, args=(str(tmp_path / "coop"), mixed, True))
    plain = run_ranks(_save_and_load, 3, args=(str(tmp_path / "plain"), mixed, False))
    for results in (coop, plain):
        for r in results:
            assert all(r["equal"].values()), r["equal"]
    sizes = coop[0]["sizes"]
    state_bytes = sum(sizes.values())
    assert sum(r["ranged"] for r in coop) == state_bytes
    assert sum(r["bytes_read"] for r in coop) == state_bytes
    assert all(r["cooperative_bytes"] == sizes["replicated"] for r in coop)
    # today's path: every rank reads every replicated byte, and its own shard and value
    assert sum(r["ranged"] for r in plain) == 3 * sizes["replicated"] + (
        sizes["sharded"] + sizes["rank_local"]
    )
    assert all(r["cooperative_bytes"] == 0 for r in plain)


def _load_expecting_failure(uri: str, fault: str) -> dict[str, Any]:
    import torch.distributed as dist

    from trainer_sdk import api
    from trainer_sdk.format.layout import file_path, json_name
    from trainer_sdk.saveload import _coop
    from trainer_sdk.storage import open_storage

    _coop.SMALL = 2 * BLOCK  # type: ignore[misc]
    _save(uri, False)
    dist.barrier()
    storage = open_storage(uri)
    m = api.read_manifest(storage, 1)
    entry = m.tensors["model.big"]
    keys = [k for k in m.tensors if _coop.candidates({k: None}, m, strict=False)]
    units = _coop.plan_units(m, keys, dist.get_world_size())
    # a unit of model.big (read by exactly one rank) and the block of it to corrupt
    unit = next(u for u in units if u.key == "model.big" and u.end - u.start > BLOCK)
    if dist.get_rank() == 0:
        root = Path(uri)
        if fault == "corrupt-block":
            shard = root / file_path(1, unit.piece.file)
            data = bytearray(shard.read_bytes())
            data[unit.piece.begin + unit.start + BLOCK + 3] ^= 0x10
            shard.write_bytes(bytes(data))
        elif fault == "missing-shard":
            (root / file_path(1, unit.piece.file)).unlink()
        elif fault == "rank-2-json":
            path = root / file_path(1, json_name(2, 3))
            path.write_bytes(path.read_bytes().replace(b"step", b"stop"))
    dist.barrier()
    state = _state(False, mixed=False)
    try:
        api.load(
            state, uri, process_group=dist.group.WORLD, strict=False, timeout=60, cooperative=True
        )
    except Exception as e:
        return {
            "type": type(e).__name__,
            "kind": api.classify_load_error(e),
            "msg": str(e),
            "path": getattr(e, "path", None),
            "reader": unit.reader,
            "block": unit.start // BLOCK + 1,
            "pieces": len(entry.pieces),
        }
    return {"type": None}


@pytest.mark.parametrize("fault", ["corrupt-block", "missing-shard", "rank-2-json"])
def test_a_failure_on_one_rank_raises_the_same_error_on_all(tmp_path: Path, fault: str) -> None:
    results = run_ranks(_load_expecting_failure, 3, args=(str(tmp_path), fault), timeout=120)
    first = results[0]
    assert first["pieces"] > 1  # model.big was saved as row ranges by several ranks
    assert {r["type"] for r in results} == {"CorruptCheckpointError"}
    assert {r["kind"] for r in results} == {"bad"}  # restore() falls back to an older step
    assert len({r["path"] for r in results}) == 1
    if fault == "corrupt-block":
        reader = first["reader"]
        assert f"block {first['block']}" in results[reader]["msg"]
        for r, res in enumerate(results):
            assert res["msg"].endswith(results[reader]["msg"])
            if r != reader:
                assert f": rank {reader} failed to load step 1: " in res["msg"]
    if fault == "rank-2-json":  # ranks 0 and 1 stopped before reading, and name rank 2
        assert ": rank 2 failed to load step 1: " in results[0]["msg"]
        assert results[1]["msg"] == results[0]["msg"]


def _save_only(uri: str) -> None:
    _save(uri, True)


def _load_resharded(uri: str) -> dict[str, Any]:
    import torch.distributed as dist
    from baton_testing.counting import CountingStorage

    from trainer_sdk import api

    storage = CountingStorage(uri)
    state = _state(False, mixed=True)
    info = api.load(state, storage, process_group=dist.group.WORLD, strict=False, cooperative=True)
    want = _state(True, mixed=True)
    equal = {k: torch.equal(state["model"][k], v) for k, v in want["model"].items()}
    for k, v in want["sharded"].items():
        equal[f"sharded.{k}"] = torch.equal(state["sharded"][k].full_tensor(), v.full_tensor())
    return {
        "equal": equal,
        "resharded": info.resharded,
        "ranged": storage.ranged,
        "sizes": _tensor_bytes(uri),
    }


def test_resharded_shards_are_read_once_but_for_blocks_that_straddle_two_ranks(
    tmp_path: Path,
) -> None:
    """Saved on 2 ranks, loaded on 3: each rank reads only the blocks of its own box, so the
    only bytes read twice are the blocks that hold a boundary between two ranks' boxes (a
    crc32 covers a whole block): at most one block per boundary, 2 boundaries per tensor."""
    uri = str(tmp_path)
    run_ranks(_save_only, 2, args=(uri,))
    results = run_ranks(_load_resharded, 3, args=(uri,))
    for r in results:
        assert r["resharded"]
        assert all(r["equal"].values()), r["equal"]
    # every byte once (rank-local values: ranks 0 and 1 read their own, rank 2 had none)
    once = sum(results[0]["sizes"].values())
    total = sum(r["ranged"] for r in results)
    assert once <= total <= once + 3 * 2 * BLOCK  # 3 sharded tensors, 2 boundaries each


def _load_own_copies(a: str, b: str) -> dict[str, Any]:
    import torch.distributed as dist
    from baton_testing.counting import CountingStorage

    from trainer_sdk import api

    _save(a, False)
    _save(b, False, block=2 * BLOCK)  # the same state, another block size: other crc32s
    dist.barrier()
    storage = CountingStorage(b if dist.get_rank() == 2 else a)
    state = _state(False, mixed=False)
    info = api.load(state, storage, process_group=dist.group.WORLD, strict=False, cooperative=True)
    want = _state(True, mixed=False)
    return {
        "equal": all(torch.equal(state["model"][k], v) for k, v in want["model"].items()),
        "ranged": storage.ranged,
        "cooperative_bytes": info.cooperative_bytes,
        "sizes": _tensor_bytes(a),
    }


def test_ranks_whose_copies_of_a_step_differ_each_read_their_own(tmp_path: Path) -> None:
    """Each rank reads its own copy of the step (as from the memory tier's per-pod
    directories); when the copies' tensor tables differ, no bytes are shared between them."""
    results = run_ranks(_load_own_copies, 3, args=(str(tmp_path / "a"), str(tmp_path / "b")))
    for r in results:
        assert r["equal"]
        assert r["cooperative_bytes"] == 0
        assert r["ranged"] == r["sizes"]["replicated"]


def _default_load(uri: str) -> dict[str, Any]:
    import torch.distributed as dist
    from baton_testing.counting import CountingStorage

    from trainer_sdk import api

    _save(uri, False)
    dist.barrier()
    storage = CountingStorage(uri)
    state = _state(False, mixed=False)
    info = api.load(state, storage, process_group=dist.group.WORLD, strict=False)
    want = _state(True, mixed=False)
    return {
        "equal": all(torch.equal(state["model"][k], v) for k, v in want["model"].items()),
        "ranged": storage.ranged,
        "cooperative_bytes": info.cooperative_bytes,
        "sizes": _tensor_bytes(uri),
    }


def test_by_default_s3_is_read_once_and_a_filesystem_by_every_rank(
    tmp_path: Path, s3_bucket: S3Bucket
) -> None:
    """``cooperative=None``: on for S3 (one GET per byte for the group), off for a filesystem
    (each rank's page cache and disk beat the process group; docs/performance.md)."""
    on_s3 = run_ranks(_default_load, 3, args=(s3_bucket.uri("coop"),), timeout=240)
    on_disk = run_ranks(_default_load, 3, args=(str(tmp_path),))
    replicated = on_s3[0]["sizes"]["replicated"]
    assert all(r["equal"] for r in on_s3 + on_disk)
    assert all(r["cooperative_bytes"] == replicated for r in on_s3)
    assert sum(r["ranged"] for r in on_s3) == replicated
    assert all(r["cooperative_bytes"] == 0 for r in on_disk)
    assert sum(r["ranged"] for r in on_disk) == 3 * replicated
