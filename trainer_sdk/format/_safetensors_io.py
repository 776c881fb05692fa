"""Streaming safetensors writing and zero-copy byte views of tensors.

Why not ``safetensors.torch.save_file``: it serialises the whole file into one bytes object
first (a full extra copy of the state) and hashes nothing. Here the header is built from
metadata, then each tensor's bytes go straight from its memory to the storage writer in
``block_size`` chunks, while two background threads compute the file's BLAKE3 digest and a
crc32 per block (both release the GIL, so hashing overlaps the write). BLAKE3, not sha256
(format v2): sha256 costs about 0.8 CPU seconds per GiB here, more than writing the bytes to
tmpfs, so it capped saves to fast media; BLAKE3 (SIMD, still a cryptographic hash) costs
about a quarter of that. bf16
and other dtypes numpy lacks are written through uint8 views of the same memory.

CUDA tensors are copied to the host one chunk at a time through two reusable pinned buffers,
so a synchronous save of GPU state needs two chunks of host memory, not a copy of the state.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Final

import torch
from blake3 import blake3

from trainer_sdk.errors import CheckpointError
from trainer_sdk.format._crc import crc32
from trainer_sdk.storage.base import Writer

__all__ = [
    "ST_TO_TORCH",
    "TORCH_TO_ST",
    "PieceSource",
    "ShardResult",
    "byte_view",
    "st_dtype",
    "write_shard",
]

TORCH_TO_ST: Final[Mapping[torch.dtype, str]] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int16: "I16",
    torch.uint16: "U16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.uint32: "U32",
    torch.float32: "F32",
    torch.int64: "I64",
    torch.uint64: "U64",
    torch.float64: "F64",
    torch.complex64: "C64",
}
ST_TO_TORCH: Final[Mapping[str, torch.dtype]] = {v: k for k, v in TORCH_TO_ST.items()}


def st_dtype(dtype: torch.dtype, *, key: str) -> str:
    """The safetensors code of a torch dtype, or a CheckpointError naming the key and the fix."""
    code = TORCH_TO_ST.get(dtype)
    if code is None:
        raise CheckpointError(
            f"tensor {key!r} has dtype {dtype}, which safetensors cannot store; convert it "
            "(e.g. .to(torch.float32)) or keep it out of the checkpoint"
        )
    return code


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a flat ``memoryview`` (no copy).

    Works for dtypes numpy lacks (bf16, fp8) by viewing the same memory as uint8.
    """
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    if t.numel() == 0:
        return memoryview(b"")
    u8 = t.detach().reshape(-1).view(torch.uint8)
    return u8.numpy().data.cast("B")


@dataclass(frozen=True, kw_only=True, slots=True)
class PieceSource:
    """One tensor (or row range of one) to put in a shard file."""

    name: str
    """Name inside the safetensors file."""
    dtype: str
    """safetensors dtype code."""
    shape: tuple[int, ...]
    """Shape of the piece."""
    tensor: torch.Tensor
    """The source tensor (CPU or CUDA, contiguous); the piece is bytes [start, end) of it."""
    start: int
    end: int


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardResult:
    size: int
    blake3: str
    """Hex BLAKE3 of the whole file."""
    data_start: int
    pieces: Mapping[str, tuple[int, int, tuple[int, ...]]]
    """name -> (absolute begin, absolute end, crc32 per block)."""
    hash_seconds: float
    """Seconds the busier hashing thread worked (it overlaps the writes)."""


def _header(
    pieces: Sequence[PieceSource], metadata: Mapping[str, str]
) -> tuple[bytes, dict[str, tuple[int, int]]]:
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    offsets: dict[str, tuple[int, int]] = {}
    pos = 0
    for p in pieces:
        n = p.end - p.start
        header[p.name] = {"dtype": p.dtype, "shape": list(p.shape), "data_offsets": [pos, pos + n]}
        offsets[p.name] = (pos, pos + n)
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes; so do we
    return struct.pack("<Q", len(raw)) + raw, offsets


INLINE_BYTES: Final = 256 * 1024
"""Views up to this size are hashed (and, from host memory, gathered for one write) in the
writing thread: for a small view a pool task's hand-off (a Future, a lock, a queue) and a
``write`` call of its own cost more than the work, and a state of many small tensors (a small
model's memory-tier snapshot every step) paid that per tensor on the training process's
cores and GIL."""


class _Ready:
    """The result of work done inline (the part of ``Future`` that callers here use)."""

    __slots__ = ("_value",)

    def __init__(self, value: int) -> None:
        self._value = value

    def result(self) -> int:
        return self._value


_Result = Future[int] | _Ready


class _Hasher:
    """BLAKE3 of the whole stream and a crc32 per chunk, each in its own background thread.

    Two threads, not one: both release the GIL, so on a machine with spare cores the digest
    and the crc32 run beside each other and beside the writer, and neither becomes the
    bottleneck of a save that the medium could absorb faster. Views of at most
    :data:`INLINE_BYTES` are hashed in the caller's thread instead (after the digest thread
    finished the views before them: the digest is of the stream, in order); the pools start
    only when a larger view comes.
    """

    def __init__(self) -> None:
        self._digest = blake3()
        self._digest_pool: ThreadPoolExecutor | None = None
        self._crc_pool: ThreadPoolExecutor | None = None
        self._last_digest: Future[int] | None = None
        self._digest_busy = 0.0
        self._crc_busy = 0.0

    @property
    def busy(self) -> float:
        """Seconds the busier of the two threads worked."""
        return max(self._digest_busy, self._crc_busy)

    def _digest_work(self, view: memoryview) -> int:
        t0 = time.perf_counter()
        self._digest.update(view)
        self._digest_busy += time.perf_counter() - t0
        return 0

    def _crc_work(self, view: memoryview) -> int:
        t0 = time.perf_counter()
        crc = crc32(view)
        self._crc_busy += time.perf_counter() - t0
        return crc

    def submit(self, view: memoryview, *, want_crc: bool = True) -> tuple[_Result, _Result]:
        """Hash ``view`` (in stream order); returns (digest result, crc result)."""
        if len(view) <= INLINE_BYTES:
            if self._last_digest is not None:
                self._last_digest.result()  # the digest thread's views come first
                self._last_digest = None
            self._digest_work(view)
            done = _Ready(0)
            return done, (_Ready(self._crc_work(view)) if want_crc else done)
        if self._digest_pool is None or self._crc_pool is None:
            self._digest_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="baton-blake3")
            self._crc_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="baton-crc32")
        dig = self._digest_pool.submit(self._digest_work, view)
        self._last_digest = dig
        crc = self._crc_pool.submit(self._crc_work, view) if want_crc else dig
        return dig, crc

    def hexdigest(self) -> str:
        for pool in (self._digest_pool, self._crc_pool):
            if pool is not None:
                pool.shutdown(wait=True)
        return self._digest.hexdigest()

    def close(self) -> None:
        for pool in (self._digest_pool, self._crc_pool):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)


class _PinnedRing:
    """Two reusable host buffers for copying CUDA chunks out, each guarded by its hash future."""

    def __init__(self, size: int) -> None:
        pin = torch.cuda.is_available()
        self._bufs = [torch.empty(size, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        self._busy: list[tuple[_Result, _Result] | None] = [None, None]
        self._i = 0

    def copy(self, src_u8: torch.Tensor) -> tuple[memoryview, int]:
        i = self._i
        self._i ^= 1
        futs = self._busy[i]
        if futs is not None:  # the hashers must be done with this buffer before we reuse it
            futs[0].result()
            futs[1].result()
        n = src_u8.numel()
        buf = self._bufs[i][:n]
        buf.copy_(src_u8)
        return buf.numpy().data.cast("B"), i

    def guard(self, i: int, futs: tuple[_Result, _Result]) -> None:
        self._busy[i] = futs


def _chunks(
    src: PieceSource, block_size: int, ring: _PinnedRing | None
) -> Iterator[tuple[memoryview, int | None]]:
    t = src.tensor
    if t.device.type == "cpu":
        view = byte_view(t)[src.start : src.end]
        for off in range(0, len(view), block_size):
            yield view[off : off + block_size], None
        return
    assert ring is not None
    u8 = t.detach().reshape(-1).view(torch.uint8)[src.start : src.end]
    for off in range(0, u8.numel(), block_size):
        view, slot = ring.copy(u8[off : off + block_size])
        yield view, slot


def write_shard(
    writer: Writer,
    pieces: Sequence[PieceSource],
    *,
    metadata: Mapping[str, str],
    block_size: int,
) -> ShardResult:
    """Stream a safetensors file of ``pieces`` into ``writer`` (not committed: the caller does).

    Every piece's bytes are read straight from its tensor; nothing is serialised in advance.
    """
    header, rel = _header(pieces, metadata)
    data_start = len(header)
    hasher = _Hasher()
    ring: _PinnedRing | None = None
    if any(p.tensor.device.type != "cpu" for p in pieces):
        ring = _PinnedRing(block_size)
    crc_futs: dict[str, list[_Result]] = {}
    try:
        hasher.submit(memoryview(header), want_crc=False)
        # Small views of host memory are gathered and written together (one write call per
        # INLINE_BYTES or so, not one per tensor); a pinned-ring view is written at once
        # (its buffer is reused as soon as it is hashed).
        gathered: list[memoryview | bytes] = [header]
        gathered_bytes = len(header)
        for p in pieces:
            futs = crc_futs.setdefault(p.name, [])
            for view, slot in _chunks(p, block_size, ring):
                both = hasher.submit(view)
                futs.append(both[1])
                if ring is not None and slot is not None:
                    ring.guard(slot, both)
                small = slot is None and len(view) <= INLINE_BYTES
                if small:
                    gathered.append(view)
                    gathered_bytes += len(view)
                if gathered and (not small or gathered_bytes >= INLINE_BYTES):
                    writer.write(b"".join(gathered))  # in stream order, before this view
                    gathered, gathered_bytes = [], 0
                if not small:
                    writer.write(view)
        if gathered:
            writer.write(b"".join(gathered))
        digest = hasher.hexdigest()
    finally:
        hasher.close()
    size = data_start + sum(e - b for b, e in rel.values())
    out = {
        name: (data_start + b, data_start + e, tuple(f.result() for f in crc_futs[name]))
        for name, (b, e) in rel.items()
    }
    return ShardResult(
        size=size, blake3=digest, data_start=data_start, pieces=out, hash_seconds=hasher.busy
    )
