"""``BatonWriter``: DCP's ``StorageWriter`` that writes Baton's format and commits it (see the
package docstring)."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from trainer_sdk.errors import CheckpointError
from trainer_sdk.format._safetensors_io import PieceSource, st_dtype
from trainer_sdk.format._tree import TENSOR
from trainer_sdk.format.layout import (
    BLOCK_SIZE,
    FileEntry,
    Piece,
    file_path,
    json_name,
    step_dir,
)
from trainer_sdk.integrations.dcp._format import (
    EXTRA_KEY,
    encode_value,
    json_planner_data,
    sha256_hex,
)
from trainer_sdk.saveload._committing import build_manifest, check_writable, commit_built_manifest
from trainer_sdk.saveload._saving import write_shard_file
from trainer_sdk.storage import Location, Storage, open_storage
from trainer_sdk.wire import Trigger

__all__ = ["BatonWriter"]


@dataclass(frozen=True)
class _Slot:
    """The coordinator's word to each rank, in its plan's ``storage_data``: who it is."""

    rank: int
    world_size: int


def _refuse_pickled(fqn: str) -> CheckpointError:
    return CheckpointError(
        f"the non-tensor value {fqn!r} would be pickled by the planner (DCP's torch.save of a "
        "BytesIO); Baton checkpoints hold no pickle. Use a planner derived from "
        "DefaultSavePlanner (it is the default), or make the value a tensor"
    )


class BatonWriter(StorageWriter):
    """Write ``step`` under ``uri`` (a path, ``file://`` or ``s3://`` URI, or a ``Storage``).

    ``attempt`` is the writer's fencing attempt, as for ``trainer_sdk.save``: when a newer
    attempt has started writing under ``uri``, nothing is committed and the save raises
    ``SupersededError``. None reads it from ``$BATON_ATTEMPT`` (the operator sets it), else no
    fencing. ``trigger`` is recorded in the manifest.
    """

    def __init__(
        self,
        uri: Location,
        *,
        step: int,
        attempt: int | None = None,
        trigger: str = Trigger.PERIODIC,
    ) -> None:
        super().__init__()
        step_dir(step)  # validates the number
        self.storage: Storage = open_storage(uri)
        self.step = step
        env = os.environ.get("BATON_ATTEMPT")
        self.attempt = attempt if attempt is not None else (int(env) if env else None)
        self.trigger = trigger
        self._slot = _Slot(rank=0, world_size=1)
        self._is_coordinator = True
        self._started = time.perf_counter()

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None and str(checkpoint_id) != self.storage.uri:
            self.storage = open_storage(str(checkpoint_id))
        self._started = time.perf_counter()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True  # any path or file:// / s3:// URI; open_storage says what is wrong

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # Every rank refuses before it writes anything: a committed step, or a newer attempt.
        check_writable(self.storage, self.step, self.attempt)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        world = len(plans)
        return [
            dataclasses.replace(p, storage_data=_Slot(rank=i, world_size=world))
            for i, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        slot = plan.storage_data if isinstance(plan.storage_data, _Slot) else self._slot
        self._slot = slot
        fut: Future[list[WriteResult]] = Future()
        try:
            fut.set_result(self._write(plan.items, planner, slot))
        except BaseException as e:  # DCP gathers it and fails the save on every rank
            fut.set_exception(e)  # type: ignore[arg-type]  # torch's stub types it as T
        return fut

    def _write(
        self, items: list[WriteItem], planner: SavePlanner, slot: _Slot
    ) -> list[WriteResult]:
        sources: list[PieceSource] = []
        tensor_items: list[tuple[WriteItem, str]] = []
        results: list[WriteResult] = []
        for item in items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                lookup = getattr(planner, "lookup_object", None)
                if lookup is None:
                    raise _refuse_pickled(fqn)
                value = encode_value(fqn, lookup(item.index))
                results.append(
                    WriteResult(index=item.index, size_in_bytes=0, storage_data={"value": value})
                )
                continue
            t = planner.resolve_data(item)
            if not isinstance(t, torch.Tensor):
                raise _refuse_pickled(fqn)
            t = t.detach()
            if not t.is_contiguous():
                t = t.contiguous()
            td = item.tensor_data
            assert td is not None, f"DCP gave tensor item {fqn!r} without tensor_data"
            offsets = tuple(int(o) for o in td.chunk.offsets)
            name = (
                fqn
                if not any(offsets) and tuple(td.chunk.sizes) == tuple(td.size)
                else (f"{fqn}#box={','.join(map(str, offsets))}")
            )
            nbytes = t.numel() * t.element_size()
            sources.append(
                PieceSource(
                    name=name, dtype=st_dtype(t.dtype, key=fqn), shape=tuple(t.shape),
                    tensor=t, start=0, end=nbytes,
                )
            )  # fmt: skip
            tensor_items.append((item, name))
        sname, res = write_shard_file(
            self.storage, sources, step=self.step, rank=slot.rank, world=slot.world_size,
            metadata={"writer": "torch.distributed.checkpoint"},
        )  # fmt: skip
        file = {"name": sname, **FileEntry(
            size=res.size, xxh3_128=res.xxh3_128, data_start=res.data_start
        ).to_json()}  # fmt: skip
        for (item, name), src in zip(tensor_items, sources, strict=True):
            td = item.tensor_data
            assert td is not None
            begin, end, sums = res.pieces[name]
            piece = Piece(
                file=sname, name=name, dtype=src.dtype,
                offsets=tuple(int(o) for o in td.chunk.offsets), shape=tuple(src.shape),
                begin=begin, end=end, block_hash=res.block_hash, sums=sums,
            ).to_json()  # fmt: skip
            whole = tuple(td.chunk.sizes) == tuple(td.size)
            results.append(
                WriteResult(
                    index=item.index,
                    size_in_bytes=end - begin,
                    storage_data={
                        "piece": piece,
                        "kind": "replicated" if whole else "sharded",
                        "global_shape": [int(s) for s in td.size],
                    },
                )
            )
        # The shard file's entry rides on an extra result, so that a rank with no tensor
        # still reports its (empty) shard, which the manifest lists like any other.
        results.append(
            WriteResult(
                index=MetadataIndex(fqn=f"__baton_shard__{slot.rank}"),
                size_in_bytes=res.size,
                storage_data={"file": file, "rank": slot.rank},
            )
        )
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """The coordinator's commit: the JSON files, then the manifest (exclusive create after
        the fencing check), then ``latest``."""
        world = len(results)
        values: dict[str, Any] = {}
        records: list[dict[str, Any]] = []
        for rank_results in results:
            files: dict[str, Any] = {}
            tensors: dict[str, dict[str, Any]] = {}
            pieces: list[list[Any]] = []
            for r in rank_results:
                data = r.storage_data
                if "file" in data:
                    f = dict(data["file"])
                    files[f.pop("name")] = f
                elif "value" in data:
                    values[r.index.fqn] = data["value"]
                else:
                    key = r.index.fqn
                    p = data["piece"]
                    tensors.setdefault(
                        key,
                        {"kind": data["kind"], "dtype": p["dtype"], "shape": data["global_shape"]},
                    )
                    pieces.append([key, p])
            records.append({"files": files, "tensors": tensors, "pieces": pieces})
        # A tensor cut into chunks by one planner and written whole by no one is sharded: its
        # kind is the same on every rank's record (replicated only when one piece is all of it).
        kinds: dict[str, str] = {}
        for rec in records:
            for key, m in rec["tensors"].items():
                if kinds.get(key) == "sharded" or m["kind"] == "sharded":
                    kinds[key] = "sharded"
                else:
                    kinds[key] = m["kind"]
        for rec in records:
            for key, m in rec["tensors"].items():
                m["kind"] = kinds[key]
        tree: dict[str, Any] = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                if fqn not in values:
                    raise CheckpointError(f"no rank wrote the value of {fqn!r}")
                tree[fqn] = values[fqn]
            else:
                tree[fqn] = {TENSOR: fqn}
        for rank in range(world):
            data = json.dumps(tree if rank == 0 else {}, allow_nan=False).encode()
            name = json_name(rank, world)
            self.storage.write_atomic(file_path(self.step, name), data)
            records[rank]["files"][name] = {"size": len(data), "sha256": sha256_hex(data)}
        extra = {EXTRA_KEY: {"planner_data": json_planner_data(metadata.planner_data)}}
        manifest = build_manifest(
            records, step=self.step, trigger=self.trigger, block_size=BLOCK_SIZE, extra=extra
        )
        commit_built_manifest(self.storage, manifest, self.attempt)

    def storage_meta(self) -> Any:
        return None
