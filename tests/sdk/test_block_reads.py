"""Loading reads whole checksum blocks in runs and verifies every block it touches.

Blocks are made small here (4 KiB) so that one tensor spans many blocks and several read
runs, and byte ranges that start and end inside blocks take the edge-block path.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer_sdk import api
from trainer_sdk.errors import CorruptCheckpointError
from trainer_sdk.format.layout import file_path
from trainer_sdk.storage import open_storage

BLOCK = 4096


def save_small_blocks(root: Path, tensor: torch.Tensor) -> api.Manifest:
    storage = open_storage(str(root))
    flat = api.flatten({"w": tensor})
    plan = api.plan_save(flat, 0, 1)
    record = api.write_rank(
        storage, plan, flat.tensors(), flat.tree, step=1, flat=flat, block_size=BLOCK
    )
    return api.commit(storage, record, step=1, block_size=BLOCK)


@pytest.fixture
def saved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, torch.Tensor]:
    # Three blocks per read_into call, so a 25-block tensor takes nine runs.
    monkeypatch.setattr(api, "_READ_RUN", 3 * BLOCK)
    tensor = torch.arange(25 * BLOCK // 4, dtype=torch.float32)
    save_small_blocks(tmp_path, tensor)
    return tmp_path, tensor


def test_whole_tensor_read_in_runs_is_exact(saved: tuple[Path, torch.Tensor]) -> None:
    root, tensor = saved
    out = torch.empty_like(tensor)
    api.load({"w": out}, str(root))
    assert torch.equal(out, tensor)


@pytest.mark.parametrize(
    ("start", "end"), [(0, 3 * BLOCK), (100, 7 * BLOCK + 5), (BLOCK + 1, BLOCK + 2)]
)
def test_ranges_inside_blocks_are_exact(
    saved: tuple[Path, torch.Tensor], start: int, end: int
) -> None:
    root, tensor = saved
    storage = open_storage(str(root))
    manifest = api.read_manifest(storage, 1)
    (piece,) = manifest.tensors["w"].pieces
    reader = api._Reader(storage, manifest)
    out = bytearray(end - start)
    try:
        reader.read_range("w", piece, start, end, memoryview(out))
        reader.check()
    finally:
        reader.close()
    assert bytes(out) == tensor.numpy().tobytes()[start:end]


def test_flipped_byte_in_a_middle_block_is_caught(saved: tuple[Path, torch.Tensor]) -> None:
    root, tensor = saved
    storage = open_storage(str(root))
    manifest = api.read_manifest(storage, 1)
    (piece,) = manifest.tensors["w"].pieces
    shard = root / file_path(1, piece.file)
    data = bytearray(shard.read_bytes())
    data[piece.begin + 11 * BLOCK + 7] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"block 11") as info:
        api.load({"w": torch.empty_like(tensor)}, str(root))
    assert piece.file in str(info.value)
