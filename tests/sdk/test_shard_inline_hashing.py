"""write_shard's inline path: small views are hashed in the writing thread and gathered into
one write; larger ones go to the hashing threads. A shard mixing both (in every order, around
the threshold, split into blocks) must be the same file, digest and per-block crc32 as the
pieces' bytes say, and read back bitwise by safetensors and by trainer_sdk.load."""

from __future__ import annotations

import zlib
from pathlib import Path

import safetensors.torch
import torch
from blake3 import blake3

from trainer_sdk import Checkpointer
from trainer_sdk.format._safetensors_io import INLINE_BYTES, PieceSource, st_dtype, write_shard


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


def test_mixed_inline_and_threaded_pieces_are_hashed_and_written_in_order() -> None:
    tensors = _tensors()
    block = INLINE_BYTES + 4096  # "big" splits into blocks above and below the threshold
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
    assert blake3(data).hexdigest() == res.blake3
    # the small views before "over_threshold" went out in fewer calls than pieces
    assert len(writer.calls) < len(pieces) + 2
    back = safetensors.torch.load(data)
    assert set(back) == set(tensors)
    for k, t in tensors.items():
        assert torch.equal(back[k], t), k
        begin, end, crcs = res.pieces[k]
        raw = data[begin:end]
        assert raw == t.reshape(-1).view(torch.uint8).numpy().tobytes(), k
        want = [zlib.crc32(raw[o : o + block]) for o in range(0, len(raw), block)]
        assert list(crcs) == want, k


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
