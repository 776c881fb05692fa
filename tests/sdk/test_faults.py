"""Faults: corrupt and hostile checkpoints are refused by name; killed saves stay invisible.

Corruption and hostile manifests are produced for real on real files. The kill tests run two
real gloo ranks and SIGKILL one of them at a point found by watching the checkpoint directory
(no test hooks in the product): while a rank streams its shard, and (for rank 0) after every
shard is committed but before the manifest.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from baton_testing.dist import start_ranks

import trainer_sdk
from trainer_sdk import RankLocal
from trainer_sdk.errors import CorruptCheckpointError, ManifestError
from trainer_sdk.format.layout import MAX_HEADER_BYTES, parse_safetensors_header

STEP1 = "step-000000000001"
STEP2 = "step-000000000002"
SHARD = "rank-00000-of-00001.safetensors"


def _state(v: float) -> dict[str, Any]:
    return {"w": torch.full((64, 32), v), "b": torch.arange(10.0) * v, "n": int(v)}


def _two_steps(root: Path) -> None:
    trainer_sdk.save(_state(1.0), str(root), step=1)
    trainer_sdk.save(_state(2.0), str(root), step=2)


def _load_step(root: Path, step: int | None = None) -> dict[str, Any]:
    st = _state(0.0)
    trainer_sdk.load(st, str(root), step=step)
    return st


def _manifest(root: Path, step_dir: str = STEP2) -> dict[str, Any]:
    return json.loads((root / step_dir / "manifest.json").read_text())


def _write_manifest(root: Path, m: dict[str, Any], step_dir: str = STEP2) -> None:
    (root / step_dir / "manifest.json").write_text(json.dumps(m))


# ------------------------------------------------------------------------- corruption


def test_truncated_shard_is_named_and_the_previous_step_still_loads(tmp_path: Path) -> None:
    _two_steps(tmp_path)
    shard = tmp_path / STEP2 / SHARD
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    with pytest.raises(CorruptCheckpointError, match=rf"{STEP2}/{SHARD}.*truncated") as ei:
        _load_step(tmp_path, 2)
    assert ei.value.path.endswith(SHARD)
    assert _load_step(tmp_path, 1)["n"] == 1


def test_flipped_byte_in_a_tensor_is_caught_by_name(tmp_path: Path) -> None:
    _two_steps(tmp_path)
    entry = _manifest(tmp_path)["tensors"]["w"]["pieces"][0]
    shard = tmp_path / STEP2 / SHARD
    data = bytearray(shard.read_bytes())
    data[entry["begin"] + 1000] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=rf"{SHARD}.*checksum mismatch in tensor 'w'"):
        _load_step(tmp_path, 2)
    assert torch.equal(_load_step(tmp_path, 1)["w"], torch.full((64, 32), 1.0))


def test_flipped_byte_in_a_json_file_is_caught_by_name(tmp_path: Path) -> None:
    _two_steps(tmp_path)
    js = tmp_path / STEP2 / "rank-00000-of-00001.json"
    data = bytearray(js.read_bytes())
    data[-2] ^= 0x01
    js.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"rank-00000-of-00001\.json.*sha256"):
        _load_step(tmp_path, 2)


# ---------------------------------------------------------------------- hostile manifests


@pytest.mark.parametrize(
    "bad_name",
    ["../x.safetensors", "/etc/passwd", "sub/rank-00000-of-00001.safetensors", "..", ""],
)
def test_manifest_file_names_outside_the_step_are_refused(tmp_path: Path, bad_name: str) -> None:
    _two_steps(tmp_path)
    outside = tmp_path / "x.safetensors"
    outside.write_bytes((tmp_path / STEP2 / SHARD).read_bytes())  # a valid target, outside
    m = _manifest(tmp_path)
    m["files"][bad_name] = m["files"].pop(SHARD)
    for t in m["tensors"].values():
        for p in t["pieces"]:
            p["file"] = bad_name
    _write_manifest(tmp_path, m)
    with pytest.raises(ManifestError, match="not a plain checkpoint file name"):
        trainer_sdk.load(_state(0.0), str(tmp_path), step=2)
    # for readers the step does not exist: the newest valid one is step 1
    assert trainer_sdk.latest_step(str(tmp_path)) == 1
    assert trainer_sdk.list_steps(str(tmp_path)) == [1]
    assert _load_step(tmp_path)["n"] == 1


def test_piece_offsets_past_the_end_of_the_file_are_refused(tmp_path: Path) -> None:
    _two_steps(tmp_path)
    m = _manifest(tmp_path)
    p = m["tensors"]["w"]["pieces"][0]
    size = m["files"][SHARD]["size"]
    p["begin"], p["end"] = size + 10, size + 10 + (p["end"] - p["begin"])
    _write_manifest(tmp_path, m)
    with pytest.raises(ManifestError, match="outside the data"):
        _load_step(tmp_path, 2)


def test_manifest_that_claims_a_bigger_file_cannot_read_past_eof(tmp_path: Path) -> None:
    _two_steps(tmp_path)
    m = _manifest(tmp_path)
    m["files"][SHARD]["size"] += 4096
    p = m["tensors"]["b"]["pieces"][0]
    n = p["end"] - p["begin"]
    p["begin"] = m["files"][SHARD]["size"] - n
    p["end"] = m["files"][SHARD]["size"]
    _write_manifest(tmp_path, m)
    with pytest.raises(CorruptCheckpointError, match="the manifest says"):
        _load_step(tmp_path, 2)


def test_huge_header_is_refused(tmp_path: Path) -> None:
    _two_steps(tmp_path)
    m = _manifest(tmp_path)
    m["files"][SHARD]["data_start"] = 8 + MAX_HEADER_BYTES + 1
    _write_manifest(tmp_path, m)
    with pytest.raises(ManifestError, match="data_start"):
        _load_step(tmp_path, 2)
    # and a shard whose own header length is huge is refused before anything is allocated
    shard = tmp_path / STEP2 / SHARD
    data = bytearray(shard.read_bytes())
    data[:8] = (2**40).to_bytes(8, "little")
    with pytest.raises(ManifestError, match=r"over the \d+ limit"):
        parse_safetensors_header(bytes(data[:64]), len(data), path=str(shard))


def test_overlapping_or_incomplete_pieces_are_refused(tmp_path: Path) -> None:
    _two_steps(tmp_path)
    m = _manifest(tmp_path)
    m["tensors"]["w"]["shape"] = [65, 32]
    _write_manifest(tmp_path, m)
    with pytest.raises(ManifestError, match="pieces hold"):
        _load_step(tmp_path, 2)


def test_symlinks_inside_a_checkpoint_are_never_followed(tmp_path: Path) -> None:
    _two_steps(tmp_path)
    elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    elsewhere.mkdir()
    shard = tmp_path / STEP2 / SHARD
    target = elsewhere / SHARD
    target.write_bytes(shard.read_bytes())
    shard.unlink()
    shard.symlink_to(target)
    with pytest.raises(ManifestError, match="symbolic link"):
        _load_step(tmp_path, 2)
    # a symlinked step directory is refused too
    os.rename(tmp_path / STEP1, elsewhere / STEP1)
    (tmp_path / STEP1).symlink_to(elsewhere / STEP1)
    with pytest.raises(ManifestError, match="symbolic link"):
        _load_step(tmp_path, 1)
    # step 1's manifest sits behind the link, so step 1 is not a complete step; step 2's
    # manifest is fine (its shard link is caught when the shard is read, as above)
    assert trainer_sdk.list_steps(str(tmp_path)) == [2]


# ------------------------------------------------------------------------ killed saves


def _kill_body(root: str, big_rank: int, big_mib: int) -> dict[str, Any]:
    import torch.distributed as dist

    rank = dist.get_rank()
    trainer_sdk.save({"w": torch.ones(8), "r": RankLocal(torch.tensor([rank]))}, root, step=1)

    # a rank that fails in Python fails the save on every rank, naming it
    bad: dict[str, Any] = {"w": torch.ones(8)}
    if rank == 1:
        bad["oops"] = object()
    try:
        trainer_sdk.save(bad, root, step=5, timeout=60)
        failed: dict[str, Any] = {"error": None}
    except trainer_sdk.RankFailedError as e:
        failed = {"error": type(e).__name__, "rank": e.rank, "msg": str(e)}

    n = big_mib * 2**18 if rank == big_rank else 8
    state = {"w": torch.ones(8), "big": RankLocal(torch.ones(n))}
    t0 = time.monotonic()
    try:
        trainer_sdk.save(state, root, step=2, timeout=60)
        result: dict[str, Any] = {"error": None}
    except trainer_sdk.CheckpointError as e:
        result = {"error": type(e).__name__, "msg": str(e)}
    result["seconds"] = time.monotonic() - t0
    result["failed"] = failed
    return result


def _wait_for(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


def _assert_step2_invisible(root: Path) -> None:
    assert not (root / STEP2 / "manifest.json").exists()
    assert trainer_sdk.latest_step(str(root)) == 1
    assert trainer_sdk.list_steps(str(root)) == [1]
    st: dict[str, Any] = {"w": torch.zeros(8), "r": RankLocal(torch.tensor([-1]))}
    info = trainer_sdk.load(st, str(root))
    assert info.step == 1
    assert torch.equal(st["w"], torch.ones(8))
    assert torch.equal(st["r"].value, torch.tensor([0]))
    assert trainer_sdk.cleanup_incomplete(str(root), older_than=3) == [STEP2]
    assert not (root / STEP2).exists()


@pytest.mark.e2e  # two real ranks and a 512 MiB write: tens of seconds
def test_rank_killed_while_writing_leaves_no_step_and_the_survivor_errors(
    tmp_path: Path,
) -> None:
    group = start_ranks(_kill_body, 2, args=(str(tmp_path), 1, 512), timeout=240)
    step2 = tmp_path / STEP2

    def writing() -> bool:
        names = os.listdir(step2) if step2.exists() else []
        return any(n.startswith(".rank-00001-of-00002.safetensors.tmp-") for n in names)

    _wait_for(writing, 200, "rank 1 to start streaming its shard")
    group.kill(1)
    results = group.wait()
    assert results[1].returncode == -signal.SIGKILL
    r0 = results[0]
    assert r0.ok, r0.error or r0.output
    assert r0.value["failed"]["error"] == "RankFailedError"
    assert r0.value["failed"]["rank"] == 1
    assert "object" in r0.value["failed"]["msg"]
    assert r0.value["error"] == "CollectiveTimeoutError", r0.value
    assert "rank(s) 1 never arrived" in r0.value["msg"], r0.value["msg"]
    _assert_step2_invisible(tmp_path)


@pytest.mark.e2e
def test_rank0_killed_after_all_shards_but_before_the_manifest(tmp_path: Path) -> None:
    group = start_ranks(_kill_body, 2, args=(str(tmp_path), 1, 512), timeout=240)
    step2 = tmp_path / STEP2
    files0 = [step2 / "rank-00000-of-00002.safetensors", step2 / "rank-00000-of-00002.json"]
    files1 = [step2 / "rank-00001-of-00002.safetensors", step2 / "rank-00001-of-00002.json"]
    # rank 0's part is small: once committed, rank 0 waits for rank 1 inside the commit.
    # Freeze it there, let rank 1 commit its shard too, then kill rank 0: every shard is
    # durable, the manifest was never written.
    _wait_for(lambda: all(f.exists() for f in files0), 200, "rank 0's files")
    group.kill(0, signal.SIGSTOP)
    _wait_for(lambda: all(f.exists() for f in files1), 200, "rank 1's files")
    assert not (step2 / "manifest.json").exists()
    group.kill(0, signal.SIGKILL)
    results = group.wait()
    assert results[0].returncode == -signal.SIGKILL
    r1 = results[1]
    assert r1.ok, r1.error or r1.output
    assert r1.value["error"] == "CollectiveTimeoutError", r1.value
    _assert_step2_invisible(tmp_path)


def _stuck_rank_body(root: str, released: str) -> dict[str, Any]:
    import torch.distributed as dist

    rank = dist.get_rank()
    if rank == 1:
        # A hung rank: alive (its sockets open) but never reaches the save, until rank 0's
        # save has given up (60 s at most: far beyond rank 0's 3 s deadline).
        end = time.monotonic() + 60
        while not os.path.exists(released) and time.monotonic() < end:
            time.sleep(0.05)
        return {"error": None, "released": os.path.exists(released)}
    t0 = time.monotonic()
    try:
        trainer_sdk.save({"w": torch.ones(4)}, root, step=1, timeout=3)
        return {"error": None}
    except trainer_sdk.CollectiveTimeoutError as e:
        return {
            "error": type(e).__name__,
            "msg": str(e),
            "ranks": list(e.ranks),
            "seconds": time.monotonic() - t0,
        }
    finally:
        Path(released).touch()


@pytest.mark.e2e
def test_a_rank_that_never_arrives_times_out_by_name(tmp_path: Path) -> None:
    root, released = tmp_path / "ck", tmp_path / "rank0-gave-up"
    group = start_ranks(_stuck_rank_body, 2, args=(str(root), str(released)), timeout=120)
    results = group.wait()
    r0, r1 = results
    assert r0.ok, r0.error or r0.output
    assert r0.value["error"] == "CollectiveTimeoutError"
    assert r0.value["ranks"] == [1]
    assert "no answer within 3 s; rank(s) 1 never arrived" in r0.value["msg"]
    # bounded: the wait ended at the deadline, while the stuck rank still hung
    assert r0.value["seconds"] < 25
    assert r1.ok, r1.error or r1.output
    assert r1.value["released"], "rank 1 stopped hanging before rank 0 gave up"
    assert trainer_sdk.latest_step(str(root)) is None
