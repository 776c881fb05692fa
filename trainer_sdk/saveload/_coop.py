"""Cooperative restore: bytes that every rank needs are read from storage once, then broadcast.

Why: under DDP every rank holds the whole model and optimizer, so a plain load has each of N
ranks read every byte: N times the state from storage, N clients competing for one bucket's
bandwidth. Here each tensor that every rank needs whole is read (and verified, a checksum per
block, exactly as a plain load does) by one rank, its *reader*, and sent to the others over the
process group. Storage sees each byte once.

Who does what, on every rank, in the same order (:func:`trainer_sdk.saveload._loading.load_step`):

1. :func:`candidates`: from the manifest (the same on every rank) and the live state, the
   tensors this rank needs whole: a plain (non-DTensor) destination of the saved shape and
   dtype, or none yet; saved as row ranges that tile the tensor. Rank-local values, DTensor
   destinations (each FSDP2 rank reads only its own box: see ``docs/checkpointer.md``) and
   empty tensors keep the plain path.
2. :func:`agree`: one JSON all-gather of every rank's candidates (or of its failure so far);
   the cooperative set is what every rank needs. If any rank failed before this point, no
   rank reads cooperatively and the failure is reported by the load's outcome exchange.
3. :func:`plan_units`: the set cut into units (whole pieces, large pieces in block-aligned
   chunks), each given to one reader, balanced by bytes; deterministic, no collective.
4. :func:`run`: every rank walks the same schedule. A large unit is read by its reader
   straight into the destination tensor's memory and broadcast in place; small units are
   packed per reader into one buffer, one broadcast each. A reader starts a broadcast as
   soon as its bytes are read, so reads on all readers and transfers overlap. A reader whose
   read fails keeps taking part (it sends whatever the buffer holds) and raises after the
   last broadcast: no peer waits on it, and the outcome exchange makes every rank raise the
   same classified error. Checksums are verified in the background as in a plain load and
   checked before the load returns (a corrupt block fails the load on every rank).

Destinations that are not contiguous CPU tensors (CUDA parameters) are filled through a
CPU staging tensor (pinned when CUDA is available), copied to the destination after the
broadcasts: the SDK's groups are gloo groups, which broadcast CPU tensors. Host memory for
that staging is at most the cooperative bytes held on CUDA.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol

import torch
import torch.distributed as dist

from trainer_sdk.format._safetensors_io import ST_TO_TORCH, byte_view
from trainer_sdk.format._tree import dtensor_type
from trainer_sdk.format.layout import DTYPE_SIZES, Manifest, Piece
from trainer_sdk.format.planning import row_range
from trainer_sdk.saveload._collectives import Broadcasts, all_gather_json

__all__ = [
    "SMALL",
    "Unit",
    "agree",
    "candidates",
    "plan_units",
    "run",
    "supported",
    "tensors_digest",
]

SMALL: Final = 1 << 20
"""Units smaller than this (bytes) are packed per reader into one buffer and one broadcast:
a state has hundreds of small tensors (biases, norms, optimizer step counters), and one
broadcast each would cost more in round trips than the bytes take."""

MAX_CHUNK: Final = 64 << 20
"""Largest unit (bytes): big enough for one read to fan out into parallel ranged GETs on S3,
small enough that readers balance and that reading the next unit overlaps sending this one."""


class _Reader(Protocol):
    m: Manifest

    def read_range(self, key: str, p: Piece, start: int, end: int, out: memoryview) -> None: ...


@dataclass(frozen=True, slots=True)
class Unit:
    """Bytes ``[start, end)`` of piece ``piece`` of tensor ``key``; they go to bytes
    ``[dest, dest + end - start)`` of the whole tensor, and group rank ``reader`` reads them."""

    key: str
    piece: Piece
    start: int
    end: int
    dest: int
    reader: int


def supported(group: Any) -> bool:
    """Whether ``group`` can broadcast CPU tensors (gloo, alone or beside nccl)."""
    return "gloo" in str(dist.get_backend(group))


def _row_tiled(shape: tuple[int, ...], pieces: tuple[Piece, ...]) -> bool:
    """Whether the pieces are runs of whole rows that tile the tensor without overlap (then a
    piece's bytes are one contiguous range of the whole tensor's)."""
    if not shape:
        return len(pieces) == 1
    spans = []
    for p in pieces:
        rows = row_range(p.offsets, p.shape, shape)
        if rows is None or p.shape[1:] != shape[1:]:
            return False
        spans.append(rows)
    spans.sort()
    at = 0
    for a, b in spans:
        if a != at:
            return False
        at = b
    return at == shape[0]


def candidates(slots: Mapping[str, Any], manifest: Manifest, *, strict: bool) -> dict[str, Any]:
    """key -> live destination (a tensor, or None for a fresh one) of every tensor this rank
    needs whole and could receive from a reader (see the module docstring, step 1)."""
    dtensor = dtensor_type()
    out: dict[str, Any] = {}
    for key, cur in slots.items():
        entry = manifest.tensors.get(key)
        if entry is None or entry.kind == "rank_local" or math.prod(entry.shape) == 0:
            continue
        if not _row_tiled(entry.shape, entry.pieces):
            continue
        if any(p.dtype != entry.dtype for p in entry.pieces):
            continue
        if dtensor is not None and isinstance(cur, dtensor):
            continue
        if isinstance(cur, torch.Tensor):
            if tuple(cur.shape) == entry.shape and cur.dtype == ST_TO_TORCH[entry.dtype]:
                out[key] = cur
            elif not strict:
                out[key] = None  # the plain path returns a fresh tensor too
        else:
            out[key] = None
    return out


def tensors_digest(manifest: Manifest) -> str:
    """sha256 of the manifest's tensor table (keys, dtypes, shapes, pieces with their files,
    offsets and block checksums): equal on ranks that read the same step's bytes."""
    h = hashlib.sha256()
    for key, entry in manifest.tensors.items():
        h.update(json.dumps([key, entry.to_json()], separators=(",", ":")).encode())
    return h.hexdigest()


def agree(
    mine: Mapping[str, Any] | None,
    manifest: Manifest | None,
    *,
    step: int,
    group: Any,
    timeout: float,
) -> list[str] | None:
    """The keys every rank has among its candidates, in the manifest's order; None when a rank
    failed before this point (``mine`` and ``manifest`` are None on that rank). One collective,
    on every rank. Ranks whose manifests differ (each reads its own copy of a step, as from
    the memory tier's per-pod directories, and the copies are not the same) share nothing:
    an empty list, and every rank reads for itself."""
    order = list(manifest.tensors) if manifest is not None else []
    own = (
        {"ok": False}
        if mine is None or manifest is None
        else {
            "ok": True,
            "digest": tensors_digest(manifest),
            "keys": [i for i, k in enumerate(order) if k in mine],
        }
    )
    everyone = all_gather_json(
        own, group=group, timeout=timeout, what=f"load of step {step}: who reads what"
    )
    if not all(o.get("ok") for o in everyone):
        return None
    if len({o["digest"] for o in everyone}) != 1:
        return []
    common = set(range(len(order)))
    for o in everyone:
        common &= {int(i) for i in o["keys"]}
    return [order[i] for i in sorted(common)]


def plan_units(manifest: Manifest, keys: list[str], world: int) -> list[Unit]:
    """Cut ``keys`` into units and give each a reader, balanced by bytes (deterministic)."""
    bs = manifest.block_size
    total = sum(p.nbytes for k in keys for p in manifest.tensors[k].pieces)
    # A few units per reader so that they balance; whole blocks, so no block is read twice.
    chunk = min(MAX_CHUNK, max(SMALL, -(-total // (world * 8))))
    chunk = max(bs, chunk // bs * bs)
    raw: list[tuple[str, Piece, int, int, int]] = []
    for key in keys:
        entry = manifest.tensors[key]
        row = math.prod(entry.shape[1:]) * DTYPE_SIZES[entry.dtype]
        for p in entry.pieces:
            base = p.offsets[0] * row if entry.shape else 0
            for s in range(0, p.nbytes, chunk):
                e = min(s + chunk, p.nbytes)
                raw.append((key, p, s, e, base + s))
    loads = [0] * world
    readers = [0] * len(raw)
    for i in sorted(range(len(raw)), key=lambda i: (-(raw[i][3] - raw[i][2]), i)):
        r = min(range(world), key=lambda r: (loads[r], r))
        loads[r] += raw[i][3] - raw[i][2]
        readers[i] = r
    return [Unit(k, p, s, e, d, readers[i]) for i, (k, p, s, e, d) in enumerate(raw)]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 view of the same memory."""
    return t.detach().reshape(-1).view(torch.uint8)


def run(
    reader: _Reader,
    units: list[Unit],
    dests: Mapping[str, Any],
    *,
    rank: int,
    world: int,
    group: Any,
    timeout: float,
) -> dict[str, torch.Tensor]:
    """Fill every unit's tensor on every rank (see the module docstring, step 4); returns
    key -> the filled tensor (the live destination, or a fresh one where it had none)."""
    m = reader.m
    out: dict[str, torch.Tensor] = {}
    staging: dict[str, torch.Tensor] = {}
    for key in dict.fromkeys(u.key for u in units):
        entry = m.tensors[key]
        cur = dests[key]
        if isinstance(cur, torch.Tensor) and cur.device.type == "cpu" and cur.is_contiguous():
            out[key] = staging[key] = cur
            continue
        buf = torch.empty(
            entry.shape,
            dtype=ST_TO_TORCH[entry.dtype],
            pin_memory=isinstance(cur, torch.Tensor) and cur.is_cuda,
        )
        staging[key] = buf
        out[key] = cur if isinstance(cur, torch.Tensor) else buf
    error: BaseException | None = None

    def read(u: Unit, into: torch.Tensor) -> None:
        nonlocal error
        if u.reader != rank or error is not None:
            return
        try:
            reader.read_range(u.key, u.piece, u.start, u.end, byte_view(into))
        except Exception as e:  # reported after the last broadcast; see the module docstring
            error = e

    bc = Broadcasts(group=group, timeout=timeout, what=f"load of step {m.step}: sending tensors")
    big = [u for u in units if u.end - u.start >= SMALL]
    # Round-robin over the readers, so that every reader's first read starts at once.
    queues = [[u for u in big if u.reader == r] for r in range(world)]
    schedule = [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]
    for u in schedule:
        view = _bytes(staging[u.key])[u.dest : u.dest + u.end - u.start]
        read(u, view)
        bc.start(view, u.reader)
    buckets: list[tuple[torch.Tensor, list[Unit]]] = []
    for r in range(world):
        small = [u for u in units if u.reader == r and u.end - u.start < SMALL]
        if not small:
            continue
        bucket = torch.empty(sum(u.end - u.start for u in small), dtype=torch.uint8)
        at = 0
        for u in small:
            read(u, bucket[at : at + u.end - u.start])
            at += u.end - u.start
        bc.start(bucket, r)
        buckets.append((bucket, small))
    bc.wait()
    if error is not None:
        raise error
    for bucket, small in buckets:
        at = 0
        for u in small:
            n = u.end - u.start
            _bytes(staging[u.key])[u.dest : u.dest + n].copy_(bucket[at : at + n])
            at += n
    with torch.no_grad():
        for key, buf in staging.items():
            if out[key] is not buf:
                out[key].copy_(buf)
    return out
