"""write_shard hashes in the writing thread: small views are gathered into one write; larger
ones are hashed and written HASH_PIECE bytes at a time, the XXH3-64 of a block running over its
pieces. A shard mixing both (in every order, around the threshold, split into blocks, blocks
split into pieces) must be the same file, digest and per-block XXH3-64 as the pieces' bytes say,
and read back bitwise by safetensors and by trainer_sdk.load; a byte flipped inside a block's
second piece, in a real file, is caught by a load and by ``verify``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from xxhash import xxh3_64_intdigest, xxh3_128_hexdigest

import trainer_sdk
from trainer_sdk import Checkpointer
from trainer_sdk.errors import CorruptCheckpointError
from trainer_sdk.format._safetensors_io import (
    HASH_PIECE,
    INLINE_BYTES,
    PieceSource,
    st_dtype,
    write_shard,
)


class _Recorder:
    """A Writer that keeps what it was given, call by call."""

    def __init__(self) -> None:
        self.calls: list[bytes] = []

    def write(self, data: memoryview | bytes) -> None:
        self.calls.append(bytes(data))

    def commit(self) -> None:
        pass

    def abort(self) -> None:
        pass


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    f32 = INLINE_BYTES // 4
    return {
        "tiny": torch.randn(3, generator=g),
        "at_threshold": torch.randn(f32, generator=g),  # exactly INLINE_BYTES: inline
        "over_threshold": torch.randn(f32 + 1, generator=g),  # one element more: a thread
        "small_after_large": torch.randn(5, 7, generator=g),
        "bf16": torch.randn(33, generator=g).to(torch.bfloat16),
        "big": torch.randn(3 * f32 + 11, generator=g),  # several blocks, the last one small
        "int_scalar": torch.tensor([42], dtype=torch.int64),
        "empty": torch.empty(0),
    }


@pytest.mark.parametrize(
    "block",
    [
        INLINE_BYTES + 4096,  # "big" splits into blocks above and below the threshold
        HASH_PIECE + 4096,  # "big" has a block of two pieces, the second a small one
    ],
)
def test_gathered_and_piecewise_views_are_hashed_and_written_in_order(block: int) -> None:
    tensors = _tensors()
    pieces = [
        PieceSource(
            name=k,
            dtype=st_dtype(t.dtype, key=k),
            shape=tuple(t.shape),
            tensor=t,
            start=0,
            end=t.numel() * t.element_size(),
        )
        for k, t in tensors.items()
    ]
    writer = _Recorder()
    res = write_shard(writer, pieces, metadata={"format": "test"}, block_size=block)
    data = b"".join(writer.calls)

    assert len(data) == res.size
    assert xxh3_128_hexdigest(data) == res.xxh3_128
    # the small views before "over_threshold" went out in fewer calls than pieces
    assert len(writer.calls) < len(pieces) + 2
    back = safetensors.torch.load(data)
    assert set(back) == set(tensors)
    for k, t in tensors.items():
        assert torch.equal(back[k], t), k
        begin, end, sums = res.pieces[k]
        raw = data[begin:end]
        assert raw == t.reshape(-1).view(torch.uint8).numpy().tobytes(), k
        want = [xxh3_64_intdigest(raw[o : o + block]) for o in range(0, len(raw), block)]
        assert list(sums) == want, k


def _model(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = torch.nn.Module()
    for k, t in tensors.items():
        model.register_buffer(k, t.clone())
    return model


def _checkpointer(tmp_path: Path, model: torch.nn.Module) -> Checkpointer:
    return Checkpointer(
        str(tmp_path / "ck"),
        model=model,
        fast_every_steps=1,
        fast_dir=str(tmp_path / "fast"),
        handle_sigterm=False,
    )


def test_memory_snapshot_of_mixed_tensor_sizes_restores_bitwise(tmp_path: Path) -> None:
    tensors = _tensors()
    ck = _checkpointer(tmp_path, _model(tensors))
    ck.restore()
    ck.step(1)
    ck.close()

    fresh = _model({k: torch.zeros_like(t) for k, t in tensors.items()})
    ck2 = _checkpointer(tmp_path, fresh)
    try:
        assert ck2.restore() == 1
        assert ck2.restored.step == 1
        assert ck2.restored.tier == "memory"
    finally:
        ck2.close()
    got = dict(fresh.named_buffers())
    for k, t in tensors.items():
        assert torch.equal(got[k], t), k


def test_a_byte_flipped_inside_a_block_is_caught_by_load_and_verify(tmp_path: Path) -> None:
    """Real files, the default 8 MiB blocks: a tensor of two blocks and a bit, each block
    hashed in HASH_PIECE pieces; the flipped byte is in the second piece of the second block,
    so only a block checksum that ran over every piece of its block catches it."""
    g = torch.Generator().manual_seed(11)
    block = 8 << 20
    state = {"w": torch.randn((2 * block + 12345) // 4, generator=g), "b": torch.randn(7)}
    trainer_sdk.save(state, str(tmp_path), step=1)
    step = tmp_path / "step-000000000001"
    manifest = json.loads((step / "manifest.json").read_text())
    ((piece,),) = [t["pieces"] for k, t in manifest["tensors"].items() if k == "w"]
    shard = step / piece["file"]
    data = shard.read_bytes()
    raw = data[piece["begin"] : piece["end"]]
    want = [f"{xxh3_64_intdigest(raw[o : o + block]):016x}" for o in range(0, len(raw), block)]
    assert piece["xxh3_64"] == want
    assert manifest["files"][piece["file"]]["xxh3_128"] == xxh3_128_hexdigest(data)
    back = {"w": torch.zeros_like(state["w"]), "b": torch.zeros(7)}
    trainer_sdk.load(back, str(tmp_path))
    assert torch.equal(back["w"], state["w"])
    assert torch.equal(back["b"], state["b"])

    bad = bytearray(data)
    bad[piece["begin"] + block + HASH_PIECE + 100] ^= 0x10
    shard.write_bytes(bytes(bad))
    with pytest.raises(CorruptCheckpointError, match=r"tensor 'w', block 1"):
        trainer_sdk.load(back, str(tmp_path))
    verify = subprocess.run(
        [sys.executable, "-m", "trainer_sdk", "verify", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert verify.returncode == 1, verify.stdout + verify.stderr
    assert f"{piece['file']}: xxh3_128" in verify.stdout
