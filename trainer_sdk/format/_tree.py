"""The tagged-JSON tree: how a training state that is not tensors is written, and read back.

A state is a dict of tensors, Stateful objects, dicts, lists, tuples and JSON values.
:func:`flatten` (the encoder, phase 1 of a save) takes it apart: every tensor becomes a
:class:`~trainer_sdk.format.planning.FlatEntry` keyed by its dotted path, and everything else a JSON
tree in which a tensor is the reference ``{"__baton_tensor__": key}``. :class:`TreeDecoder`
(used by a load) walks the saved tree and the live state together and rebuilds the values.

The two halves live together because they must agree on every tag; the round trip is tested
in ``tests/sdk/test_tree_roundtrip.py``. The tags (``docs/format.md``):

* ``{"__baton_tensor__": key}``: a tensor, stored in the shards under ``key``;
* ``{"__baton_rank_local__": node}``: a :class:`~trainer_sdk.RankLocal` value (each rank's own);
* ``{"__baton_tuple__": [...]}``: a tuple (a JSON list is a Python list);
* ``{"__baton_dict__": [[k, v], ...]}``: a dict with keys that are not all ``str``;
* ``{"__baton_float__": "inf"}``: a float JSON cannot hold (inf, -inf, nan);
* ``{"__baton_dtype__": "float32"}``: a ``torch.dtype``.

User dict keys may not start with ``__baton_``. Nothing is ever pickled.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping
from typing import Any, Final

import torch

from trainer_sdk.errors import CheckpointError, ManifestError
from trainer_sdk.format._safetensors_io import st_dtype
from trainer_sdk.format._types import RankLocal, Stateful
from trainer_sdk.format.layout import Kind
from trainer_sdk.format.planning import FlatEntry, FlatState

__all__ = ["TreeDecoder", "as_any", "dtensor_box", "dtensor_type", "flatten", "tensor_slots"]

TENSOR: Final = "__baton_tensor__"
RANK_LOCAL: Final = "__baton_rank_local__"
TUPLE: Final = "__baton_tuple__"
DICT: Final = "__baton_dict__"
FLOAT: Final = "__baton_float__"
DTYPE: Final = "__baton_dtype__"
RESERVED: Final = "__baton_"


def dtensor_type() -> type | None:
    """DTensor's class if torch.distributed.tensor is already imported, else None.

    A state can only hold DTensors if that module was imported, and importing it costs
    seconds, so a plain save never pays for it.
    """
    mod = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(mod, "DTensor", None)
    return dtensor if isinstance(dtensor, type) else None


def as_any(x: object) -> Any:
    """DTensor's attributes are not in torch's stubs for Tensor; we use them dynamically."""
    return x


def dtensor_box(dt: Any) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
    """(global offsets, local shape, writes) of this rank's part of a DTensor."""
    from torch.distributed.tensor._utils import (
        compute_local_shape_and_global_offset,
    )

    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:  # this rank is not in the tensor's mesh: it holds nothing
        return tuple(0 for _ in dt.shape), tuple(0 for _ in dt.shape), False
    local_shape, offsets = compute_local_shape_and_global_offset(dt.shape, mesh, dt.placements)
    writes = all(c == 0 for c, p in zip(coord, dt.placements, strict=True) if not p.is_shard())
    return tuple(int(o) for o in offsets), tuple(int(s) for s in local_shape), writes


def _sub(path: str, k: object) -> str:
    return f"{path}.{k}" if path else str(k)


# ------------------------------------------------------------------------------ encoder


def flatten(state: Mapping[str, Any]) -> FlatState:
    """Phase 1 of a save: take ``state`` apart into tensor entries and a JSON tree.

    ``state_dict()`` is called on Stateful objects. Every tensor becomes a FlatEntry
    (replicated, sharded DTensor, or rank-local) keyed by its dotted path.
    """
    if not isinstance(state, Mapping):
        raise CheckpointError(f"state must be a dict, got {type(state).__name__}")
    dtensor = dtensor_type()
    entries: dict[str, FlatEntry] = {}

    def add(key: str, t: torch.Tensor, rank_local: bool) -> dict[str, str]:
        if key in entries:
            raise CheckpointError(
                f"two tensors map to the key {key!r} (a dotted path); rename one of the keys"
            )
        if t.is_sparse or t.layout != torch.strided:
            raise CheckpointError(f"tensor {key!r} is not dense; call .to_dense() first")
        if t.device.type == "meta":
            raise CheckpointError(f"tensor {key!r} is on the meta device and has no data")
        dtype = st_dtype(t.dtype, key=key)
        if dtensor is not None and isinstance(t, dtensor):
            dt = as_any(t)
            if rank_local:
                raise CheckpointError(f"{key!r}: a DTensor cannot be RankLocal; unwrap it")
            for p in dt.placements:
                if p.is_partial():
                    raise CheckpointError(
                        f"DTensor {key!r} has a Partial placement; call "
                        ".redistribute(placements=[Replicate()]) or .full_tensor() first"
                    )
            offsets, local_shape, writes = dtensor_box(dt)
            local = dt.to_local().detach()
            if tuple(local.shape) != local_shape:  # padded local storage: keep the real rows
                local = local[tuple(slice(0, s) for s in local_shape)]
            if not local.is_contiguous():
                local = local.contiguous()
            entries[key] = FlatEntry(
                key=key,
                kind="sharded",
                dtype=dtype,
                global_shape=tuple(t.shape),
                offsets=offsets,
                local_shape=local_shape,
                writes=writes,
                tensor=local,
            )
        else:
            data = t.detach()
            if not data.is_contiguous():
                data = data.contiguous()  # one copy of this tensor; documented in format.md
            kind: Kind = "rank_local" if rank_local else "replicated"
            entries[key] = FlatEntry(
                key=key,
                kind=kind,
                dtype=dtype,
                global_shape=tuple(data.shape),
                offsets=tuple(0 for _ in data.shape),
                local_shape=tuple(data.shape),
                writes=True,
                tensor=data,
            )
        return {TENSOR: key}

    def key_json(k: Any, path: str) -> Any:
        if k is None or isinstance(k, (str, int, bool)):
            return k
        if isinstance(k, float) and math.isfinite(k):
            return k
        raise CheckpointError(
            f"{path}: dict key {k!r} of type {type(k).__name__} cannot be saved; use str or int"
        )

    def walk(v: Any, path: str, rank_local: bool) -> Any:
        # Cheap checks first: JSON scalars are most of the leaves, and isinstance against the
        # runtime-checkable Stateful protocol costs about 100x a concrete-type check.
        if v is None or isinstance(v, (str, int, bool)):
            return v
        if isinstance(v, float):
            return v if math.isfinite(v) else {FLOAT: repr(v)}
        if isinstance(v, torch.Tensor):
            return add(path, v, rank_local)
        if isinstance(v, RankLocal):
            return {RANK_LOCAL: walk(v.value, path, True)}
        if isinstance(v, Mapping):  # before Stateful: a Mapping is never taken as Stateful
            plain = all(isinstance(k, str) for k in v)
            for k in v:
                if isinstance(k, str) and k.startswith(RESERVED):
                    raise CheckpointError(f"{path}: key {k!r} is reserved by Baton; rename it")
            if plain:
                return {k: walk(x, _sub(path, k), rank_local) for k, x in v.items()}
            return {
                DICT: [
                    [key_json(k, path), walk(x, _sub(path, k), rank_local)] for k, x in v.items()
                ]
            }
        # Exact lists and tuples cannot be Stateful; subclasses are checked after Stateful.
        if type(v) is not list and type(v) is not tuple and isinstance(v, Stateful):
            return walk(v.state_dict(), path, rank_local)
        if isinstance(v, list):
            return [walk(x, f"{path}.{i}", rank_local) for i, x in enumerate(v)]
        if isinstance(v, tuple):
            return {TUPLE: [walk(x, f"{path}.{i}", rank_local) for i, x in enumerate(v)]}
        if isinstance(v, torch.dtype):
            return {DTYPE: str(v).removeprefix("torch.")}
        raise CheckpointError(
            f"{path or 'state'}: a value of type {type(v).__name__} cannot be saved; use "
            "tensors, dicts, lists, JSON values, or wrap it in an object with "
            "state_dict()/load_state_dict() (no pickle, by design)"
        )

    tree = {k: walk(v, str(k), False) for k, v in state.items()}
    for k in state:
        if not isinstance(k, str):
            raise CheckpointError(f"top-level state keys must be str, got {k!r}")
    return FlatState(entries=entries, tree=tree)


# ------------------------------------------------------------------------------ decoder


class TreeDecoder:
    """Walks a saved JSON tree and the live state together, restoring in place.

    ``tensor(key, current)`` resolves a tensor reference: it fills ``current`` in place (and
    returns it) or returns a new tensor. With ``strict``, a live dict key the checkpoint lacks
    is an error. Paths of RankLocal values this rank has no saved value of (its rank did not
    exist at save time) are collected in :attr:`missing_rank_local`, their values untouched.
    """

    def __init__(self, tensor: Callable[[str, Any], Any], *, strict: bool) -> None:
        self._tensor = tensor
        self.strict = strict
        self.missing_rank_local: list[str] = []

    def node(self, cur: Any, g: Any, own: Any, path: str) -> Any:
        """Restore ``cur`` from the global tree node ``g`` (rank 0's) and this rank's ``own``."""
        if isinstance(g, dict) and RANK_LOCAL in g:
            if not (isinstance(own, dict) and RANK_LOCAL in own):
                self.missing_rank_local.append(path)
                return cur
            inner = cur.value if isinstance(cur, RankLocal) else cur
            new = self.node(inner, own[RANK_LOCAL], own[RANK_LOCAL], path)
            if isinstance(cur, RankLocal):
                cur.value = new
                return cur
            return new
        if isinstance(cur, Stateful) and not isinstance(cur, (Mapping, torch.Tensor)):
            loaded = self.node(cur.state_dict(), g, own, path)
            cur.load_state_dict(loaded)
            return cur
        if isinstance(g, dict) and TENSOR in g:
            return self._tensor(str(g[TENSOR]), cur)
        if isinstance(g, dict) and TUPLE in g:
            items = g[TUPLE]
            own_items = own[TUPLE] if isinstance(own, dict) and TUPLE in own else None
            curs = list(cur) if isinstance(cur, tuple) and len(cur) == len(items) else None
            return tuple(
                self.node(
                    curs[i] if curs else None,
                    x,
                    own_items[i] if own_items and i < len(own_items) else None,
                    f"{path}.{i}",
                )
                for i, x in enumerate(items)
            )
        if isinstance(g, dict) and FLOAT in g:
            return float(g[FLOAT])
        if isinstance(g, dict) and DTYPE in g:
            dt = getattr(torch, str(g[DTYPE]), None)
            if not isinstance(dt, torch.dtype):
                raise ManifestError(f"{path}: unknown dtype {g[DTYPE]!r}")
            return dt
        if isinstance(g, dict):
            if DICT in g:
                pairs = [(k, v) for k, v in g[DICT]]
                own_pairs = dict(own[DICT] if isinstance(own, dict) and DICT in own else [])
            else:
                pairs = list(g.items())
                own_pairs = own if isinstance(own, dict) else {}
            target: dict[Any, Any] = cur if isinstance(cur, dict) else {}
            saved_keys = {k for k, _ in pairs}
            if self.strict:
                lost = [k for k in target if k not in saved_keys]
                if lost:
                    raise CheckpointError(
                        f"{path or 'state'}: the checkpoint has no value for {lost[:5]}; pass "
                        "strict=False to keep their current values"
                    )
            for k, v in pairs:
                target[k] = self.node(target.get(k), v, own_pairs.get(k), _sub(path, k))
            return target
        if isinstance(g, list):
            own_list = own if isinstance(own, list) else []
            if isinstance(cur, list) and len(cur) == len(g):
                for i, x in enumerate(g):
                    cur[i] = self.node(
                        cur[i], x, own_list[i] if i < len(own_list) else None, f"{path}.{i}"
                    )
                return cur
            return [
                self.node(None, x, own_list[i] if i < len(own_list) else None, f"{path}.{i}")
                for i, x in enumerate(g)
            ]
        return g


def tensor_slots(state: Mapping[str, Any], tree: Mapping[str, Any]) -> dict[str, Any]:
    """key -> the live value a load would fill, for every tensor reference of ``tree`` (rank
    0's saved tree) outside RankLocal values, walking ``state`` the way
    :meth:`TreeDecoder.node` does, but changing nothing (no ``load_state_dict``, no
    assignment). A cooperative load uses it to know its destinations before it reads.

    A Stateful object's ``state_dict()`` is called here and again by the decoder, so a
    destination found here may be another object than the one the decoder meets (a
    ``state_dict()`` that returns copies): the caller must check, and copy if so.
    """
    out: dict[str, Any] = {}

    def walk(cur: Any, g: Any) -> None:
        if isinstance(g, dict) and RANK_LOCAL in g:
            return
        if isinstance(cur, Stateful) and not isinstance(cur, (Mapping, torch.Tensor)):
            cur = cur.state_dict()
        if isinstance(g, dict) and TENSOR in g:
            out[str(g[TENSOR])] = cur
        elif isinstance(g, dict) and TUPLE in g:
            items = g[TUPLE]
            curs = list(cur) if isinstance(cur, tuple) and len(cur) == len(items) else None
            for i, x in enumerate(items):
                walk(curs[i] if curs else None, x)
        elif isinstance(g, dict) and (FLOAT in g or DTYPE in g):
            return
        elif isinstance(g, dict):
            pairs = list(g[DICT]) if DICT in g else list(g.items())
            target = cur if isinstance(cur, dict) else {}
            for k, v in pairs:
                walk(target.get(k), v)
        elif isinstance(g, list):
            same = isinstance(cur, list) and len(cur) == len(g)
            for i, x in enumerate(g):
                walk(cur[i] if same else None, x)

    for key, g in tree.items():
        walk(state.get(key), g)
    return out
