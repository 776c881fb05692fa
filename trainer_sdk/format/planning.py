"""Who writes which bytes, and which byte ranges a reader needs.

Save side: :func:`plan_save` decides, from metadata every rank already has, which tensors (or
row ranges of tensors) this rank writes. No collective is needed: every rank runs the same
deterministic computation on the same inputs.

* ``replicated`` tensors (plain tensors under a process group: DDP) are written once. Tensors
  of at least ``split_bytes`` are cut into row ranges first; then the units are bin-packed
  greedily by size (largest first, ties broken by position and rank), so the bytes spread
  evenly over the ranks instead of all landing on rank 0.
* ``sharded`` tensors (DTensor) are written by their owners; when a placement replicates a
  shard over a mesh dimension, only the owner at coordinate 0 of that dimension writes it.
* ``rank_local`` values are written by their own rank.

Load side: :func:`intersect` and :func:`row_range` turn "this rank needs box B of tensor T"
into byte ranges of the pieces that overlap B, which is how a different world size reads only
what it needs.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import torch

from trainer_sdk.format.layout import DTYPE_SIZES, Kind

__all__ = [
    "SPLIT_BYTES",
    "FlatEntry",
    "FlatState",
    "PlanCache",
    "PlannedPiece",
    "SavePlan",
    "intersect",
    "plan_save",
    "row_range",
]

SPLIT_BYTES: Final = 32 * 1024 * 1024
"""Replicated tensors at least this large are split into row ranges across ranks, so one huge
embedding does not leave one rank writing while the others wait."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FlatEntry:
    """One tensor of a flattened state, with what this rank holds of it."""

    key: str
    """Dotted path of the tensor in the state (``model.layer.weight``)."""
    kind: Kind
    dtype: str
    """safetensors dtype code."""
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    """Where this rank's local data starts in the global tensor (zeros unless sharded)."""
    local_shape: tuple[int, ...]
    writes: bool
    """Whether this rank is the designated writer of its local data (sharded dedupe)."""
    tensor: torch.Tensor
    """The local data: the whole tensor, or this rank's shard (``DTensor.to_local()``)."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.local_shape) * DTYPE_SIZES[self.dtype]


@dataclass(frozen=True, kw_only=True, slots=True)
class FlatState:
    """A state taken apart: tensors by key, plus the JSON tree that refers to them."""

    entries: Mapping[str, FlatEntry]
    """In traversal order, which is also the order pieces are laid out in a shard."""
    tree: Any
    """JSON-able tree of the whole state, tensors replaced by ``{"__baton_tensor__": key}``."""

    def tensors(self) -> dict[str, torch.Tensor]:
        """key -> local tensor: what ``write_rank`` reads (and what an async save stages)."""
        return {k: e.tensor for k, e in self.entries.items()}


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannedPiece:
    """A piece this rank writes: bytes ``[start, end)`` of ``tensors[key]``."""

    key: str
    name: str
    """Name inside this rank's safetensors file."""
    kind: Kind
    dtype: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True, kw_only=True, slots=True)
class SavePlan:
    """What one rank writes at one save."""

    rank: int
    world_size: int
    pieces: tuple[PlannedPiece, ...]
    replicated_digest: str
    """sha256 of the replicated tensors' keys, dtypes and shapes: equal on every rank, or the
    ranks disagree about what is replicated and the save is refused."""

    @property
    def keys(self) -> set[str]:
        """The tensors this rank's pieces come from (the ones an async save must stage)."""
        return {p.key for p in self.pieces}

    @property
    def nbytes(self) -> int:
        return sum(p.end - p.start for p in self.pieces)


class PlanCache:
    """:func:`plan_save` of the last state with the same layout (keys in order, kinds, dtypes,
    shapes, offsets, writers), for a loop that saves the same tensors at every step (the
    memory tier snapshots every ``fast_every_steps``): the plan depends on that layout only,
    never on values. Safe to share between threads (one reference swapped whole)."""

    def __init__(self) -> None:
        self._last: tuple[tuple[Any, ...], SavePlan] | None = None

    def plan(self, flat: FlatState, rank: int, world_size: int) -> SavePlan:
        layout = (
            rank,
            world_size,
            tuple(
                (k, e.kind, e.dtype, e.global_shape, e.offsets, e.local_shape, e.writes)
                for k, e in flat.entries.items()
            ),
        )
        last = self._last
        if last is not None and last[0] == layout:
            return last[1]
        plan = plan_save(flat, rank, world_size)
        self._last = (layout, plan)
        return plan


def _row_bytes(shape: tuple[int, ...], dtype: str) -> int:
    return math.prod(shape[1:]) * DTYPE_SIZES[dtype]


def plan_save(
    flat: FlatState, rank: int, world_size: int, *, split_bytes: int = SPLIT_BYTES
) -> SavePlan:
    """Deterministically choose this rank's pieces (see the module docstring)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of size {world_size}")
    order = {k: i for i, k in enumerate(flat.entries)}
    # (nbytes, position, row start, row end, key) for every replicated unit
    units: list[tuple[int, int, int, int, str]] = []
    digest_src: list[Any] = []
    for key, e in flat.entries.items():
        if e.kind != "replicated":
            continue
        digest_src.append([key, e.dtype, list(e.global_shape)])
        shape = e.global_shape
        rows = shape[0] if shape else 1
        if world_size > 1 and shape and e.nbytes >= split_bytes and rows >= 2:
            k = min(world_size, rows)
            step = -(-rows // k)
            for a in range(0, rows, step):
                b = min(a + step, rows)
                units.append(((b - a) * _row_bytes(shape, e.dtype), order[key], a, b, key))
        else:
            units.append((e.nbytes, order[key], 0, rows, key))
    loads = [0] * world_size
    mine: list[tuple[int, int, int, int, str]] = []
    for unit in sorted(units, key=lambda u: (-u[0], u[1], u[2])):
        target = min(range(world_size), key=lambda r: (loads[r], r))
        loads[target] += unit[0]
        if target == rank:
            mine.append(unit)

    pieces: list[tuple[int, int, PlannedPiece]] = []
    for nbytes, pos, a, b, key in mine:
        e = flat.entries[key]
        shape = e.global_shape
        whole = not shape or (a == 0 and b == shape[0])
        rb = _row_bytes(shape, e.dtype) if shape else nbytes
        pieces.append(
            (
                pos,
                a,
                PlannedPiece(
                    key=key,
                    name=key if whole else f"{key}#rows={a}:{b}",
                    kind="replicated",
                    dtype=e.dtype,
                    global_shape=shape,
                    offsets=(a, *([0] * (len(shape) - 1))) if shape else (),
                    shape=((b - a), *shape[1:]) if shape else (),
                    start=a * rb if shape else 0,
                    end=b * rb if shape else nbytes,
                ),
            )
        )
    for key, e in flat.entries.items():
        if e.kind == "replicated" or not e.writes:
            continue
        if e.kind == "sharded" and math.prod(e.local_shape) == 0:
            continue
        pieces.append(
            (
                order[key],
                0,
                PlannedPiece(
                    key=key,
                    name=key,
                    kind=e.kind,
                    dtype=e.dtype,
                    global_shape=e.global_shape,
                    offsets=e.offsets,
                    shape=e.local_shape,
                    start=0,
                    end=e.nbytes,
                ),
            )
        )
    pieces.sort(key=lambda t: (t[0], t[1]))
    names = [p.name for _, _, p in pieces]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"two pieces would be named {dup!r} in one file; rename the key")
    digest = hashlib.sha256(json.dumps(digest_src).encode()).hexdigest()
    return SavePlan(
        rank=rank,
        world_size=world_size,
        pieces=tuple(p for _, _, p in pieces),
        replicated_digest=digest,
    )


def intersect(
    a_off: tuple[int, ...],
    a_shape: tuple[int, ...],
    b_off: tuple[int, ...],
    b_shape: tuple[int, ...],
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The box where two boxes overlap (offsets, shape), or None if they do not."""
    lo = tuple(max(a, b) for a, b in zip(a_off, b_off, strict=True))
    hi = tuple(
        min(a + sa, b + sb) for a, sa, b, sb in zip(a_off, a_shape, b_off, b_shape, strict=True)
    )
    if any(h <= lo_ for lo_, h in zip(lo, hi, strict=True)):
        return None
    return lo, tuple(h - lo_ for lo_, h in zip(lo, hi, strict=True))


def row_range(
    box_off: tuple[int, ...], box_shape: tuple[int, ...], outer_shape: tuple[int, ...]
) -> tuple[int, int] | None:
    """If ``box`` (relative to a row-major array of ``outer_shape``) is a run of whole rows,
    its [first, last) row: then its bytes are contiguous. Otherwise None."""
    if not outer_shape:
        return (0, 1)
    for d in range(1, len(outer_shape)):
        if box_off[d] != 0 or box_shape[d] != outer_shape[d]:
            return None
    return box_off[0], box_off[0] + box_shape[0]
