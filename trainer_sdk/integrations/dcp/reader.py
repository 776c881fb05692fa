"""``BatonReader`` and ``BatonLoadPlanner``: DCP's ``Metadata`` from the JSON manifest, verified
ranged reads, non-tensor values decoded from JSON (see the package docstring)."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from trainer_sdk.errors import CheckpointError
from trainer_sdk.format import _catalog
from trainer_sdk.format._tree import DICT, RESERVED, TENSOR
from trainer_sdk.format.layout import Manifest
from trainer_sdk.integrations.dcp._format import EXTRA_KEY, decode_value
from trainer_sdk.saveload._loading import Reader, torch_dtype
from trainer_sdk.storage import Location, Storage, open_storage

__all__ = ["BatonLoadPlanner", "BatonReader"]

_READ_RUN: Final = 64 << 20
"""Bytes of whole blocks fetched by one ranged read (as ``trainer_sdk.load`` does)."""


class BatonLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with non-tensor values decoded from Baton's JSON (never
    ``torch.load``, which unpickles)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = decode_value(json.loads(value.getvalue()), fqn)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


@dataclass(frozen=True)
class _TensorRef:
    key: str
    piece: int


@dataclass(frozen=True)
class _ValueRef:
    value: Any


class BatonReader(StorageReader):
    """Read ``step`` (None: the newest complete one) under ``uri``, verified as it is read."""

    def __init__(self, uri: Location, *, step: int | None = None) -> None:
        super().__init__()
        self.storage: Storage = open_storage(uri)
        self.step = step
        self._manifest: Manifest | None = None
        self._refs: dict[MetadataIndex, _TensorRef | _ValueRef] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None and str(checkpoint_id) != self.storage.uri:
            self.storage = open_storage(str(checkpoint_id))
        self._manifest = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True

    def _resolve(self) -> Manifest:
        if self._manifest is None:
            step = self.step
            if step is None:
                step = _catalog.newest_complete(self.storage)
                if step is None:
                    raise CheckpointError(f"no complete checkpoint under {self.storage.uri}")
            self._manifest = _catalog.read_manifest(self.storage, step)
        return self._manifest

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        manifest = self._resolve()
        reader = Reader(self.storage, manifest, read_run=_READ_RUN)
        try:
            tree = reader.read_json(0)
        finally:
            reader.close()
        if not isinstance(tree, dict):
            raise CheckpointError(f"step {manifest.step}: rank 0's JSON tree is not an object")
        sd_meta: dict[str, Any] = {}
        refs: dict[MetadataIndex, _TensorRef | _ValueRef] = {}
        for fqn, leaf in _leaves(tree, ""):
            if isinstance(leaf, dict) and TENSOR in leaf:
                key = str(leaf[TENSOR])
                entry = manifest.tensors.get(key)
                if entry is None or entry.kind == "rank_local":
                    continue  # RankLocal values have no DCP equivalent
                sd_meta[fqn] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=torch_dtype(entry.dtype)),
                    size=torch.Size(entry.shape),
                    chunks=[
                        ChunkStorageMetadata(
                            offsets=torch.Size(p.offsets), sizes=torch.Size(p.shape)
                        )
                        for p in entry.pieces
                    ],
                )
                for i, p in enumerate(entry.pieces):
                    refs[MetadataIndex(fqn, torch.Size(p.offsets))] = _TensorRef(key, i)
            else:
                sd_meta[fqn] = BytesStorageMetadata()
                refs[MetadataIndex(fqn)] = _ValueRef(leaf)
        self._refs = refs
        planner_data = (manifest.extra.get(EXTRA_KEY) or {}).get("planner_data")
        mappings = (
            {k: tuple(v) for k, v in planner_data.items()}
            if isinstance(planner_data, dict)
            else None
        )
        return Metadata(state_dict_metadata=sd_meta, planner_data=mappings, storage_data=None)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if not self._refs:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        fut: Future[None] = Future()
        try:
            self._read(plan.items, planner)
            fut.set_result(None)
        except BaseException as e:
            fut.set_exception(e)  # type: ignore[arg-type]  # torch's stub types it as T
        return fut

    def _read(self, items: list[ReadItem], planner: LoadPlanner) -> None:
        manifest = self._resolve()
        reader = Reader(self.storage, manifest, read_run=_READ_RUN)
        try:
            for item in items:
                ref = self._refs.get(item.storage_index)
                if ref is None:
                    raise CheckpointError(
                        f"step {manifest.step} has no {item.storage_index.fqn!r} at offsets "
                        f"{list(item.storage_index.offset or ())}"
                    )
                if item.type == LoadItemType.BYTE_IO:
                    assert isinstance(ref, _ValueRef)
                    if not isinstance(planner, BatonLoadPlanner):
                        raise CheckpointError(
                            f"{item.dest_index.fqn!r} is a non-tensor value, stored as JSON; "
                            "DCP's default planner would torch.load (unpickle) it. Pass "
                            "planner=trainer_sdk.integrations.dcp.BatonLoadPlanner() to dcp.load"
                        )
                    planner.load_bytes(item, io.BytesIO(json.dumps(ref.value).encode()))
                    continue
                assert isinstance(ref, _TensorRef)
                entry = manifest.tensors[ref.key]
                piece = entry.pieces[ref.piece]
                box_off = tuple(
                    int(a) + int(b)
                    for a, b in zip(piece.offsets, item.storage_offsets, strict=True)
                )
                box_shape = tuple(int(n) for n in item.lengths)
                target = planner.resolve_tensor(item).detach()
                if tuple(target.shape) != box_shape:
                    raise CheckpointError(
                        f"{item.dest_index.fqn!r}: the planner's target has shape "
                        f"{list(target.shape)}, the box read is {list(box_shape)}"
                    )
                want = torch_dtype(entry.dtype)
                if target.dtype != want:
                    raise CheckpointError(
                        f"{item.dest_index.fqn!r} is {entry.dtype} in step {manifest.step}, "
                        f"the state's tensor is {target.dtype}"
                    )
                with torch.no_grad():
                    reader.read_box(ref.key, entry, target, box_off, box_shape)
                reader.check()
                planner.commit_tensor(item, target)
            reader.check()
        finally:
            reader.close()


def _mapping_items(node: Any) -> list[tuple[Any, Any]] | None:
    """The items of a saved dict (plain, or tagged for non-str keys); None if not a dict."""
    if not isinstance(node, dict):
        return None
    if DICT in node:
        return [(k, v) for k, v in node[DICT]]
    if any(str(k).startswith(RESERVED) for k in node):
        return None  # a tensor reference or another tagged value
    return list(node.items())


def _is_terminal(node: Any) -> bool:
    """DCP's rule (``_traverse.traverse_state_dict``): dicts are walked; a list is walked when
    it holds a tensor, a dict or a walked list; everything else (tuples too) is a leaf."""
    if _mapping_items(node) is not None:
        return False
    if not isinstance(node, list):
        return True
    for x in node:
        if _mapping_items(x) is not None or (isinstance(x, list) and not _is_terminal(x)):
            return False
        if isinstance(x, dict) and TENSOR in x:
            return False
    return True


def _leaves(node: Any, path: str) -> Iterator[tuple[str, Any]]:
    """(DCP's fully qualified name, leaf) of a saved JSON tree, walked as DCP walks a state
    dict, so that the names equal the ones DCP's planners give the live state."""
    items = _mapping_items(node)
    if items is not None:
        for k, v in items:
            yield from _leaves(v, f"{path}.{k}" if path else str(k))
    elif isinstance(node, dict) and TENSOR in node:
        yield path, node
    elif not _is_terminal(node):
        for i, v in enumerate(node):
            yield from _leaves(v, f"{path}.{i}")
    else:
        yield path, node
