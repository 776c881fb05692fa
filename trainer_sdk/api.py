"""save / load / latest_step: the checkpoint protocol on top of storage, layout and planning.

A save runs in four phases. They are separate functions so that the async writer
(``trainer_sdk.staging``) can stage tensors on the training thread and run phases 3 and 4 in a
background thread, on a process group of its own:

1. :func:`flatten` takes the state apart (``state_dict()`` is called on Stateful objects):
   every tensor becomes a :class:`~trainer_sdk.planning.FlatEntry` (replicated, sharded
   DTensor, or rank-local), everything else a JSON tree that refers to tensors by key.
2. :func:`~trainer_sdk.planning.plan_save` picks this rank's pieces; deterministic, no
   collective.
3. :func:`write_rank` streams this rank's ``.safetensors`` (hashing while writing) and its
   ``.json``, and commits both; returns a :class:`RankRecord`.
4. :func:`commit` gathers every rank's record (JSON over uint8 tensors, never pickle, bounded
   wait), and if and only if every rank succeeded, rank 0 writes ``manifest.json`` (the
   commit) and then ``latest``. Every rank returns, or every rank raises the same error naming
   the failing rank(s).

A load reads the manifest of a complete step, then, for every tensor in the state, only the
byte ranges that overlap what this rank holds (which is what makes a change of world size
work), straight into the destination tensors, verifying a crc32 per block as it goes.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import json
import logging
import math
import re
import sys
import time
from collections.abc import Collection, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Final

import torch

from trainer_sdk import _catalog
from trainer_sdk._collectives import (
    all_gather_json,
    broadcast_json,
    group_rank_world,
)
from trainer_sdk._crc import crc32
from trainer_sdk._safetensors_io import (
    ST_TO_TORCH,
    PieceSource,
    byte_view,
    st_dtype,
    write_shard,
)
from trainer_sdk._types import RankLocal, Stateful
from trainer_sdk._version import __version__ as _baton_version
from trainer_sdk.control import SavePhase, Trigger
from trainer_sdk.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    ManifestError,
    RankFailedError,
    StorageError,
    SupersededError,
    UnreadableCheckpointError,
    UnsupportedFormatError,
)
from trainer_sdk.layout import (
    BLOCK_SIZE,
    DTYPE_SIZES,
    LATEST,
    MANIFEST,
    FileEntry,
    Kind,
    Manifest,
    Piece,
    TensorEntry,
    block_count,
    file_path,
    json_name,
    new_hasher,
    parse_latest,
    shard_name,
    step_dir,
)
from trainer_sdk.planning import (
    FlatEntry,
    FlatState,
    SavePlan,
    intersect,
    plan_save,
    row_range,
)
from trainer_sdk.storage import Location, Storage, open_storage

__all__ = [
    "FlatEntry",
    "FlatState",
    "LoadInfo",
    "RankRecord",
    "SaveInfo",
    "SavePlan",
    "check_writable",
    "classify_load_error",
    "cleanup_incomplete",
    "commit",
    "complete_steps",
    "delete_step",
    "flatten",
    "iter_tensors",
    "latest_step",
    "list_steps",
    "load",
    "newest_attempt",
    "plan_save",
    "read_manifest",
    "register_attempt",
    "save",
    "step_dirs",
    "write_rank",
]

log = logging.getLogger("trainer_sdk.api")

# Markers in the JSON tree. User dict keys may not start with "__baton_".
_TENSOR: Final = "__baton_tensor__"
_RANK_LOCAL: Final = "__baton_rank_local__"
_TUPLE: Final = "__baton_tuple__"
_DICT: Final = "__baton_dict__"
_FLOAT: Final = "__baton_float__"
_DTYPE: Final = "__baton_dtype__"
_RESERVED: Final = "__baton_"
_TRIGGER_RE: Final = re.compile(r"[a-z][a-z0-9_-]{0,31}")
_READ_RUN: Final = 64 << 20
"""Bytes of whole blocks fetched by one read_into while loading (parallel ranged GETs on S3)."""


@dataclass(frozen=True, kw_only=True)
class SaveInfo:
    """What a committed save did (the same on every rank, except ``phases`` and ``seconds``)."""

    step: int
    uri: str
    """The checkpoint root."""
    bytes: int
    """Total bytes of the step's files, all ranks together."""
    seconds: float
    """Wall time of the save on this rank."""
    phases: dict[str, float]
    """Seconds per phase on this rank, keyed by :class:`~trainer_sdk.control.SavePhase` values."""
    files: int
    """Number of files in the step (shards and JSON files, without the manifest)."""
    trigger: str


@dataclass(frozen=True, kw_only=True)
class LoadInfo:
    """What a load did on this rank."""

    step: int
    uri: str
    seconds: float
    saved_world_size: int
    resharded: bool
    """The world size differs from the saved one."""
    missing_rank_local: list[str] = field(default_factory=list)
    """Paths of RankLocal values this rank did not get (its rank did not exist at save time);
    they were left as they were."""
    saved_torch_version: str = ""
    """The torch version that wrote the step (the manifest's ``torch_version``)."""
    saved_attempt: int = 0
    """The attempt that committed the step (the manifest's ``attempt``)."""


# ------------------------------------------------------------------------------ flatten


def _dtensor_type() -> type | None:
    """DTensor's class if torch.distributed.tensor is already imported, else None.

    A state can only hold DTensors if that module was imported, and importing it costs
    seconds, so a plain save never pays for it.
    """
    mod = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(mod, "DTensor", None)
    return dtensor if isinstance(dtensor, type) else None


def _as_any(x: object) -> Any:
    """DTensor's attributes are not in torch's stubs for Tensor; we use them dynamically."""
    return x


def _dtensor_box(dt: Any) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
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


def flatten(state: Mapping[str, Any], *, process_group: Any = None) -> FlatState:
    """Phase 1: take ``state`` apart into tensor entries and a JSON tree (see module doc)."""
    if not isinstance(state, Mapping):
        raise CheckpointError(f"state must be a dict, got {type(state).__name__}")
    del process_group  # kinds do not depend on it: plain tensors are replicated by definition
    dtensor = _dtensor_type()
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
            dt = _as_any(t)
            if rank_local:
                raise CheckpointError(f"{key!r}: a DTensor cannot be RankLocal; unwrap it")
            for p in dt.placements:
                if p.is_partial():
                    raise CheckpointError(
                        f"DTensor {key!r} has a Partial placement; call "
                        ".redistribute(placements=[Replicate()]) or .full_tensor() first"
                    )
            offsets, local_shape, writes = _dtensor_box(dt)
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
        return {_TENSOR: key}

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
            return v if math.isfinite(v) else {_FLOAT: repr(v)}
        if isinstance(v, torch.Tensor):
            return add(path, v, rank_local)
        if isinstance(v, RankLocal):
            return {_RANK_LOCAL: walk(v.value, path, True)}
        if isinstance(v, Mapping):  # before Stateful: a Mapping is never taken as Stateful
            plain = all(isinstance(k, str) for k in v)
            for k in v:
                if isinstance(k, str) and k.startswith(_RESERVED):
                    raise CheckpointError(f"{path}: key {k!r} is reserved by Baton; rename it")
            if plain:
                return {k: walk(x, _sub(path, k), rank_local) for k, x in v.items()}
            return {
                _DICT: [
                    [key_json(k, path), walk(x, _sub(path, k), rank_local)] for k, x in v.items()
                ]
            }
        # Exact lists and tuples cannot be Stateful; subclasses are checked after Stateful.
        if type(v) is not list and type(v) is not tuple and isinstance(v, Stateful):
            return walk(v.state_dict(), path, rank_local)
        if isinstance(v, list):
            return [walk(x, f"{path}.{i}", rank_local) for i, x in enumerate(v)]
        if isinstance(v, tuple):
            return {_TUPLE: [walk(x, f"{path}.{i}", rank_local) for i, x in enumerate(v)]}
        if isinstance(v, torch.dtype):
            return {_DTYPE: str(v).removeprefix("torch.")}
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


# ------------------------------------------------------------------------- write_rank


@dataclass(frozen=True, kw_only=True)
class RankRecord:
    """What one rank wrote at one save: sent (as JSON) to rank 0 by :func:`commit`."""

    rank: int
    world_size: int
    step: int
    files: dict[str, FileEntry]
    tensors: dict[str, dict[str, Any]]
    """key -> {"kind", "dtype", "shape"} for every tensor this rank knows (pieces or not)."""
    pieces: list[tuple[str, Piece]]
    """(key, piece) for every piece this rank wrote."""
    replicated_digest: str
    seconds: float = 0.0
    hash_seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": True,
            "rank": self.rank,
            "world_size": self.world_size,
            "step": self.step,
            "files": {n: f.to_json() for n, f in self.files.items()},
            "tensors": self.tensors,
            "pieces": [[k, p.to_json()] for k, p in self.pieces],
            "replicated_digest": self.replicated_digest,
            "seconds": self.seconds,
            "hash_seconds": self.hash_seconds,
        }


def _refuse_if_committed(storage: Storage, step: int) -> None:
    if storage.exists(_manifest_key(step)):
        raise CheckpointError(
            f"step {step} under {storage.uri} was committed by another writer while this one "
            "was writing it; nothing of it was overwritten. Two trainers are writing to one "
            "checkpoint uri: stop the stale one, or give each run its own uri"
        )


def _json_default(v: Any) -> Any:
    raise TypeError(f"{type(v).__name__} is not JSON-serialisable")


def write_rank(
    storage: Storage,
    plan: SavePlan,
    tensors: Mapping[str, torch.Tensor],
    json_tree: Any,
    *,
    step: int,
    flat: FlatState | None = None,
    block_size: int = BLOCK_SIZE,
) -> RankRecord:
    """Phase 3: write and commit this rank's shard and JSON file.

    ``tensors[key]`` is the local data of entry ``key`` (``FlatState.tensors()``, or host
    copies of those staged by an async save); only the keys in ``plan.keys`` are read.
    ``flat`` (optional) supplies the metadata of every tensor; without it only the tensors
    this rank writes pieces of are described in the record.
    """
    t0 = time.perf_counter()
    rank, world = plan.rank, plan.world_size
    sources = []
    for p in plan.pieces:
        t = tensors[p.key]
        if not t.is_contiguous():
            t = t.contiguous()
        sources.append(
            PieceSource(
                name=p.name, dtype=p.dtype, shape=p.shape, tensor=t, start=p.start, end=p.end
            )
        )
    sname, jname = shard_name(rank, world), json_name(rank, world)
    writer = storage.open_writer(file_path(step, sname), size_hint=plan.nbytes)
    try:
        res = write_shard(
            writer,
            sources,
            metadata={
                "format": "baton-checkpoint-v1",
                "step": str(step),
                "rank": str(rank),
                "world_size": str(world),
            },
            block_size=block_size,
        )
        _refuse_if_committed(storage, step)  # never publish a file into a committed step
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    try:
        jdata = json.dumps(json_tree, allow_nan=False, default=_json_default).encode()
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"the JSON part of the state cannot be encoded: {e}") from e
    _refuse_if_committed(storage, step)
    storage.write_atomic(file_path(step, jname), jdata)
    files = {
        sname: FileEntry(size=res.size, blake3=res.blake3, data_start=res.data_start),
        jname: FileEntry(size=len(jdata), sha256=hashlib.sha256(jdata).hexdigest()),
    }
    meta: dict[str, dict[str, Any]] = {}
    if flat is not None:
        for k, ent in flat.entries.items():
            meta[k] = {"kind": ent.kind, "dtype": ent.dtype, "shape": list(ent.global_shape)}
    pieces: list[tuple[str, Piece]] = []
    for p in plan.pieces:
        meta.setdefault(p.key, {"kind": p.kind, "dtype": p.dtype, "shape": list(p.global_shape)})
        begin, end, crcs = res.pieces[p.name]
        pieces.append(
            (
                p.key,
                Piece(
                    file=sname,
                    name=p.name,
                    dtype=p.dtype,
                    offsets=p.offsets,
                    shape=p.shape,
                    begin=begin,
                    end=end,
                    crc32=crcs,
                    rank=rank if p.kind == "rank_local" else None,
                ),
            )
        )
    return RankRecord(
        rank=rank,
        world_size=world,
        step=step,
        files=files,
        tensors=meta,
        pieces=pieces,
        replicated_digest=plan.replicated_digest,
        seconds=time.perf_counter() - t0,
        hash_seconds=res.hash_seconds,
    )


# ----------------------------------------------------------------------------- commit


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _error_json(rank: int, err: BaseException) -> dict[str, Any]:
    out: dict[str, Any] = {"ok": False, "rank": rank, "error": f"{type(err).__name__}: {err}"}
    if isinstance(err, SupersededError):
        out.update(superseded=[err.attempt, err.newer], msg=str(err))
    return out


def check_writable(storage: Storage, step: int, attempt: int | None) -> None:
    """Refuse to write into ``step`` if it is already committed, or if a newer attempt than
    ``attempt`` has started under the root (fencing). Every rank calls it before writing its
    files, so a stale writer stops before it touches anything."""
    if attempt is not None:
        fence, _ = _catalog.read_fence(storage)
        if fence > attempt:
            raise _superseded(storage, step, attempt, fence)
    if storage.exists(_manifest_key(step)):
        raise CheckpointError(
            f"step {step} is already committed under {storage.uri} (by another writer, or an "
            "earlier save): nothing was overwritten. Two trainers may be writing to one "
            "checkpoint uri: give each run its own uri"
        )


def _superseded(storage: Storage, step: int, attempt: int, newest: int) -> SupersededError:
    return SupersededError(
        f"step {step} was not committed: this writer is attempt {attempt}, but attempt "
        f"{newest} of the job has since started writing under {storage.uri}. This process "
        "is a stale copy (its node was probably partitioned and its pods replaced): stop "
        "it. Nothing of the newer attempt was touched",
        attempt=attempt,
        newer=newest,
    )


def _build_manifest(
    records: list[dict[str, Any]], *, step: int, trigger: str, block_size: int, extra: Any
) -> Manifest:
    world = len(records)
    files: dict[str, FileEntry] = {}
    meta: dict[str, dict[str, Any]] = {}
    pieces: dict[str, list[Piece]] = {}
    for rec in records:
        for name, f in rec["files"].items():
            files[name] = FileEntry.from_json(f)
        for key, m in rec["tensors"].items():
            meta.setdefault(key, m)
        for key, pj in rec["pieces"]:
            pieces.setdefault(key, []).append(
                Piece(
                    file=pj["file"],
                    name=pj["name"],
                    dtype=pj["dtype"],
                    offsets=tuple(pj["offsets"]),
                    shape=tuple(pj["shape"]),
                    begin=pj["begin"],
                    end=pj["end"],
                    crc32=tuple(pj["crc32"]),
                    rank=pj.get("rank"),
                )
            )
    tensors: dict[str, TensorEntry] = {}
    for key, m in meta.items():
        ps = tuple(sorted(pieces.get(key, []), key=lambda p: (p.offsets, p.rank or 0)))
        shape = tuple(m["shape"])
        dtype = m["dtype"]
        if m["kind"] == "rank_local" and ps:
            shape, dtype = ps[0].shape, ps[0].dtype
        tensors[key] = TensorEntry(kind=m["kind"], dtype=dtype, shape=shape, pieces=ps)
    return Manifest(
        step=step,
        world_size=world,
        trigger=trigger,
        time=_now(),
        torch_version=str(torch.__version__),
        baton_version=_baton_version,
        block_size=block_size,
        files=files,
        tensors=tensors,
        extra=extra or {},
    )


def commit(
    storage: Storage,
    record: RankRecord | BaseException,
    *,
    step: int,
    trigger: str = Trigger.PERIODIC,
    process_group: Any = None,
    timeout: float = 600.0,
    block_size: int = BLOCK_SIZE,
    extra: Mapping[str, Any] | None = None,
    attempt: int | None = None,
) -> Manifest:
    """Phase 4: agree on the outcome; rank 0 writes the manifest (the commit), then ``latest``.

    Every rank calls it, with its :class:`RankRecord` or the exception its phases 1-3 raised
    (so a failing rank still takes part, and every rank learns who failed). Returns the
    manifest on every rank, or raises on every rank: :class:`RankFailedError` naming the
    failing ranks, or :class:`CollectiveTimeoutError` if a rank never arrived in ``timeout``
    seconds. No manifest is written unless every rank reported success.

    ``attempt`` is the writer's attempt (fencing): if a newer attempt has started or committed
    under this root, nothing is committed and every rank raises :class:`SupersededError`.
    None: no fencing, the manifest records the newest committed attempt (plain ``save()``).
    The manifest is created only if none is there yet (``If-None-Match: *`` on S3, ``link``
    on a filesystem). Once it is written the step is committed: a failure to move ``latest``
    afterwards is logged as a warning and the save still succeeds.
    """
    rank, world = group_rank_world(process_group)
    own = record.to_json() if isinstance(record, RankRecord) else _error_json(rank, record)
    records: list[dict[str, Any]] = all_gather_json(
        own, group=process_group, timeout=timeout, what=f"save of step {step}: gathering records"
    )
    failures = {r: str(rec.get("error")) for r, rec in enumerate(records) if not rec.get("ok")}
    if failures:
        first = min(failures)
        stale = next((rec for rec in records if "superseded" in rec), None)
        if stale is not None:  # fenced: every rank says so, not "rank r failed"
            mine, newer = stale["superseded"]
            raise SupersededError(str(stale["msg"]), attempt=int(mine), newer=int(newer))
        raise RankFailedError(rank=first, cause=failures[first], failures=failures)
    digests = {rec["replicated_digest"] for rec in records}
    if len(digests) > 1:
        raise CheckpointError(
            f"save of step {step}: the ranks disagree about which tensors are replicated (keys, "
            "dtypes or shapes differ between ranks). Plain tensors must be the same on every "
            "rank; wrap per-rank values in trainer_sdk.RankLocal."
        )
    manifest = _build_manifest(
        records, step=step, trigger=trigger, block_size=block_size, extra=dict(extra or {})
    )
    outcome: dict[str, Any] = {"ok": True}
    if rank == 0:
        try:
            manifest = _commit_manifest(storage, manifest, attempt)
        except Exception as e:  # reported to every rank below
            outcome = _error_json(0, e)
            if world == 1:
                raise
        else:
            try:
                _update_latest(storage, step)
            except Exception as e:  # the step is committed; latest is only a hint
                log.warning(
                    "step %d is committed under %s, but moving %r to it failed (%s: %s); "
                    "readers still find it (they list the manifests)",
                    step,
                    storage.uri,
                    LATEST,
                    type(e).__name__,
                    e,
                )
    if world > 1:
        outcome = broadcast_json(
            {**outcome, "attempt": manifest.attempt} if outcome.get("ok") else outcome,
            group=process_group,
            timeout=timeout,
            what=f"save of step {step}: confirming the commit",
        )
        if outcome.get("ok") and rank != 0:
            manifest = dataclasses.replace(manifest, attempt=int(outcome["attempt"]))
    if not outcome.get("ok"):
        if "superseded" in outcome:
            mine, newer = outcome["superseded"]
            raise SupersededError(str(outcome["msg"]), attempt=int(mine), newer=int(newer))
        raise RankFailedError(rank=0, cause=f"writing the manifest: {outcome.get('error')}")
    return manifest


def _commit_manifest(storage: Storage, manifest: Manifest, attempt: int | None) -> Manifest:
    """Rank 0's commit: fence check, then create the manifest exclusively. Returns the
    manifest as written (with its attempt)."""
    step = manifest.step
    newest = _catalog.newest_attempt(storage)
    if attempt is None:
        attempt = newest
    elif attempt < newest:
        raise _superseded(storage, step, attempt, newest)
    manifest = dataclasses.replace(manifest, attempt=attempt)
    data = manifest.to_json_bytes()
    Manifest.parse(data, step=step)  # never commit a manifest readers would refuse
    try:
        storage.create_exclusive(_manifest_key(step), data)
    except FileExistsError as e:
        raise CheckpointError(
            f"step {step} under {storage.uri} was committed by another writer at the same "
            "time (its manifest is there and differs from ours); that commit stands. Two "
            "trainers are writing to one checkpoint uri: give each run its own uri"
        ) from e
    return manifest


def _manifest_key(step: int) -> str:
    return _catalog.manifest_key(step)


def _update_latest(storage: Storage, step: int) -> None:
    """Point ``latest`` at ``step`` unless it already names a newer step (it is a hint).

    A compare-and-swap (``If-Match`` on S3, a locked compare on a filesystem), retried a few
    times when another writer moved it in between, so ``latest`` never moves backwards.
    """
    for _ in range(5):
        try:
            data, token = storage.read_versioned(LATEST)
            current = parse_latest(data)
        except FileNotFoundError:
            current, token = None, None
        if current is not None and current > step:
            return
        if storage.replace_if(LATEST, json.dumps({"step": step}).encode(), token=token):
            return
    raise StorageError(f"{storage.uri}/{LATEST} kept changing under us; left as it is")


# ------------------------------------------------------------------------------- save


def save(
    state: Mapping[str, Any],
    uri: Location,
    *,
    step: int,
    trigger: str = Trigger.PERIODIC,
    process_group: Any = None,
    timeout: float = 600.0,
    attempt: int | None = None,
) -> SaveInfo:
    """Save ``state`` as step ``step`` under ``uri``. Every rank of the group calls it.

    Returns once the step is committed (its manifest is durable), on every rank; or raises the
    same error on every rank (see :func:`commit`). ``timeout`` bounds each collective, in
    seconds; it must cover the slowest rank's write.
    """
    t0 = time.perf_counter()
    step_dir(step)  # validates the step number
    if not _TRIGGER_RE.fullmatch(trigger):
        raise ValueError(f"trigger must match {_TRIGGER_RE.pattern}, got {trigger!r}")
    storage = open_storage(uri)
    rank, world = group_rank_world(process_group)
    if storage.exists(_manifest_key(step)):
        raise CheckpointError(
            f"step {step} is already committed under {storage.uri}; save a new step, or "
            "delete_step() it first"
        )
    phases: dict[str, float] = {}
    try:
        t = time.perf_counter()
        flat = flatten(state, process_group=process_group)
        phases[SavePhase.FLATTEN] = time.perf_counter() - t
        t = time.perf_counter()
        plan = plan_save(flat, rank, world)
        phases[SavePhase.PLAN] = time.perf_counter() - t
    except Exception as exc:
        if world == 1:
            raise
        # Still take part in the commit, so that every rank learns who failed.
        return write_and_commit(
            storage, exc, {}, None, step=step, trigger=trigger, process_group=process_group,
            timeout=timeout, started=t0, phases=phases, attempt=attempt,
        )  # fmt: skip
    return write_and_commit(
        storage, plan, flat.tensors(), flat.tree, step=step, flat=flat, trigger=trigger,
        process_group=process_group, timeout=timeout, started=t0, phases=phases,
        attempt=attempt,
    )  # fmt: skip


def write_and_commit(
    storage: Storage,
    plan: SavePlan | BaseException,
    tensors: Mapping[str, torch.Tensor],
    json_tree: Any,
    *,
    step: int,
    trigger: str,
    process_group: Any,
    timeout: float,
    started: float,
    flat: FlatState | None = None,
    phases: dict[str, float] | None = None,
    attempt: int | None = None,
    extra: Mapping[str, Any] | None = None,
) -> SaveInfo:
    """Phases 3 and 4 together, with the rules every saver needs (sync, async, Checkpointer).

    A rank whose write fails still takes part in the commit (unless it is alone), so that every
    rank learns who failed; an error from the commit is chained to that rank's own error.
    ``plan`` may already be the exception an earlier phase raised. ``started`` is the
    ``time.perf_counter()`` at which the save began; ``phases`` has the earlier phases' times.
    ``attempt`` and ``extra`` go to :func:`commit` (fencing, and free-form manifest JSON).
    """
    phases = dict(phases or {})
    record: RankRecord | BaseException
    if isinstance(plan, BaseException):
        record = plan
    else:
        t = time.perf_counter()
        try:
            check_writable(storage, step, attempt)
            record = write_rank(storage, plan, tensors, json_tree, step=step, flat=flat)
            phases[SavePhase.WRITE] = time.perf_counter() - t
            phases[SavePhase.HASH] = record.hash_seconds
        except Exception as exc:
            if group_rank_world(process_group)[1] == 1:
                raise
            record = exc
    t = time.perf_counter()
    try:
        manifest = commit(
            storage, record, step=step, trigger=trigger, process_group=process_group,
            timeout=timeout, attempt=attempt, extra=extra,
        )  # fmt: skip
    except BaseException as e:
        if isinstance(record, BaseException):
            raise e from record
        raise
    phases[SavePhase.COMMIT] = time.perf_counter() - t
    return SaveInfo(
        step=step,
        uri=storage.uri,
        bytes=manifest.total_bytes,
        seconds=time.perf_counter() - started,
        phases=phases,
        files=len(manifest.files),
        trigger=trigger,
    )


# ----------------------------------------------------------------- reading checkpoints


def read_manifest(storage: Location, step: int) -> Manifest:
    """The validated manifest of ``step``; IncompleteCheckpointError if it never committed."""
    return _catalog.read_manifest(open_storage(storage), step)


def _step_dirs(storage: Storage) -> list[int]:
    return _catalog.step_dirs(storage)


def _is_complete(storage: Storage, step: int) -> bool:
    return _catalog.is_complete(storage, step)


def list_steps(uri: Location) -> list[int]:
    """Every complete step (valid manifest, newest lineage) under ``uri``, ascending.

    Raises :class:`UnreadableCheckpointError` if a manifest cannot be read now or by this
    version (so a caller never mistakes a step that may be good for a missing one).
    """
    return sorted(_catalog.complete_steps(open_storage(uri)))


def latest_step(uri: Location) -> int | None:
    """The newest complete step under ``uri``, or None.

    ``latest`` is only a hint: the step directories are listed and their manifests validated,
    newest first, so a ``latest`` that is stale or points at a broken step is never trusted.
    A bad step is skipped with a WARNING; an unreadable one raises
    :class:`UnreadableCheckpointError`.
    """
    return _catalog.newest_complete(open_storage(uri))


def delete_step(uri: Location, step: int) -> None:
    """Delete one step: the manifest first (so readers stop seeing it at once), then the rest."""
    storage = open_storage(uri)
    storage.delete(_manifest_key(step))
    storage.delete_tree(step_dir(step))


def cleanup_incomplete(uri: Location, *, older_than: int | None = None) -> list[str]:
    """Delete step directories that are provably abandoned: no manifest object at all, and
    older than ``older_than`` (default: the newest complete step, so an in-progress save is
    never touched). A directory whose manifest is bad or cannot be read is kept (it may be
    good, or be evidence). Only a writer should call this, after its own commit. Returns the
    deleted directory names."""
    storage = open_storage(uri)
    limit = latest_step(storage) if older_than is None else older_than
    if limit is None:
        return []
    removed = []
    for s in _step_dirs(storage):
        if s < limit and _catalog.manifest_absent(storage, s):
            storage.delete_tree(step_dir(s))
            removed.append(step_dir(s))
    return removed


def step_dirs(uri: Location) -> list[int]:
    """Steps that have a directory under ``uri`` (complete or not), ascending."""
    return _catalog.step_dirs(open_storage(uri))


def complete_steps(uri: Location) -> dict[int, Manifest]:
    """Every complete step of the newest lineage, with its manifest (see :func:`list_steps`)."""
    return _catalog.complete_steps(open_storage(uri))


def newest_attempt(uri: Location) -> int:
    """The newest attempt that has started writing or committed under ``uri`` (0: none)."""
    return _catalog.newest_attempt(open_storage(uri))


def register_attempt(uri: Location, attempt: int | None) -> int:
    """Record in ``fence`` that ``attempt`` starts writing under ``uri``; return the attempt.

    ``attempt`` None (outside Kubernetes, no ``BATON_ATTEMPT``): derive a new generation, one
    above the newest attempt seen under ``uri``. A compare-and-swap, so two writers starting
    together get different generations and the fence never moves backwards. Raises
    :class:`SupersededError` if a newer attempt has already started or committed.
    """
    storage = open_storage(uri)
    for _ in range(20):
        fence, token = _catalog.read_fence(storage)
        committed = max((m.attempt for m in _catalog.complete_steps(storage).values()), default=0)
        newest = max(fence, committed)
        mine = newest + 1 if attempt is None else attempt
        if mine < newest:
            raise SupersededError(
                f"this run is attempt {mine}, but attempt {newest} has already started writing "
                f"under {storage.uri}: this process is a stale copy of the job, stop it. (If "
                f"you reuse the uri for a new job on purpose, delete {storage.uri}/"
                f"{_catalog.FENCE} first, or give the new job its own uri)",
                attempt=mine,
                newer=newest,
            )
        if mine == fence:
            return mine
        if storage.replace_if(_catalog.FENCE, json.dumps({"attempt": mine}).encode(), token=token):
            return mine
    raise StorageError(f"{storage.uri}/{_catalog.FENCE} kept changing under us; retry")


def classify_load_error(e: BaseException) -> str:
    """Which kind a load failure is: ``incomplete`` (no manifest: the step never committed),
    ``bad`` (the checkpoint is corrupt or invalid: fall back to an older step), ``unreadable``
    (it cannot be read now or by this version: raise, never fall back) or ``other`` (it does
    not fit the live state). The list is in ``docs/format.md``."""
    if isinstance(e, IncompleteCheckpointError):
        return "incomplete"
    if isinstance(e, UnreadableCheckpointError):
        return "unreadable"
    if isinstance(e, CorruptCheckpointError | ManifestError | EOFError):
        return "bad"
    if isinstance(e, OSError | StorageError):
        return "unreadable"
    return "other"


# ------------------------------------------------------------------------------- load


class _Reader:
    """Reads verified byte ranges of one committed step."""

    def __init__(self, storage: Storage, manifest: Manifest) -> None:
        self.storage = storage
        self.m = manifest
        self._sizes_ok: set[str] = set()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="baton-verify")
        self._checks: list[Future[None]] = []
        self.bytes_read = 0

    def _path(self, name: str) -> str:
        return file_path(self.m.step, name)

    def check_size(self, name: str) -> None:
        if name in self._sizes_ok:
            return
        path = self._path(name)
        try:
            size = self.storage.size(path)
        except FileNotFoundError as e:
            raise CorruptCheckpointError("missing, but the manifest lists it", path=path) from e
        want = self.m.files[name].size
        if size != want:
            raise CorruptCheckpointError(
                f"is {size} bytes, the manifest says {want} (truncated or overwritten); load "
                "an older step",
                path=path,
            )
        self._sizes_ok.add(name)

    def read_json(self, rank: int) -> Any:
        name = json_name(rank, self.m.world_size)
        self.check_size(name)
        data = self.storage.read_bytes(self._path(name))
        algorithm, want = self.m.files[name].digest
        h = new_hasher(algorithm)
        h.update(data)
        if h.hexdigest() != want:
            raise CorruptCheckpointError(
                f"{algorithm} differs from the manifest", path=self._path(name)
            )
        try:
            return json.loads(data)
        except ValueError as e:
            raise ManifestError(f"not valid JSON ({e})", path=self._path(name)) from e

    def _verify(self, view: memoryview | bytearray, want: int, path: str, key: str, k: int) -> None:
        if crc32(view) != want:
            raise CorruptCheckpointError(
                f"checksum mismatch in tensor {key!r}, block {k}: the file is corrupt; load an "
                "older step",
                path=path,
            )

    def read_range(self, key: str, p: Piece, start: int, end: int, out: memoryview) -> None:
        """Bytes [start, end) of piece ``p`` into ``out``, verifying every block touched."""
        self.check_size(p.file)
        path = self._path(p.file)
        bs = self.m.block_size
        # Whole blocks are read in runs of up to _READ_RUN bytes per read_into call: on S3 one
        # call fans out into parallel ranged GETs, and the checksums of a run are verified in
        # the background while the next run is read.
        run_blocks = max(1, _READ_RUN // bs)
        try:
            blocks = range(start // bs, block_count(end, bs))
            whole = [k for k in blocks if start <= k * bs and min((k + 1) * bs, p.nbytes) <= end]
            for i in range(0, len(whole), run_blocks):
                run = whole[i : i + run_blocks]
                r0, r1 = run[0] * bs, min((run[-1] + 1) * bs, p.nbytes)
                self.storage.read_into(path, p.begin + r0, out[r0 - start : r1 - start])
                for k in run:
                    view = out[k * bs - start : min((k + 1) * bs, p.nbytes) - start]
                    self._checks.append(
                        self._pool.submit(self._verify, view, p.crc32[k], path, key, k)
                    )
                self.bytes_read += r1 - r0
            for k in blocks:
                b0, b1 = k * bs, min((k + 1) * bs, p.nbytes)
                if start <= b0 and b1 <= end:
                    continue  # read above
                # an edge block: read it whole into scratch so it can be verified
                tmp = bytearray(b1 - b0)
                self.storage.read_into(path, p.begin + b0, memoryview(tmp))
                self._verify(tmp, p.crc32[k], path, key, k)
                lo, hi = max(start, b0), min(end, b1)
                out[lo - start : hi - start] = memoryview(tmp)[lo - b0 : hi - b0]
                self.bytes_read += b1 - b0
        except EOFError as e:
            raise CorruptCheckpointError(
                f"ends early while reading tensor {key!r}: {e}", path=path
            ) from e

    def check(self) -> None:
        """Wait for the checksums of everything read so far; raise on the first mismatch."""
        checks, self._checks = self._checks, []
        for f in checks:
            f.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def read_box(
        self,
        key: str,
        entry: TensorEntry,
        dest: torch.Tensor,
        dest_off: tuple[int, ...],
        dest_shape: tuple[int, ...],
    ) -> None:
        """Fill ``dest`` (holding box ``dest_off``/``dest_shape`` of the tensor) from pieces."""
        item = DTYPE_SIZES[entry.dtype]
        covered = 0
        direct = dest.device.type == "cpu" and dest.is_contiguous()
        dview = byte_view(dest) if direct else None
        dest_row = math.prod(dest_shape[1:]) * item
        for p in entry.pieces:
            ov = intersect(p.offsets, p.shape, dest_off, dest_shape)
            if ov is None:
                continue
            ov_off, ov_shape = ov
            covered += math.prod(ov_shape)
            if math.prod(ov_shape) == 0:
                continue
            src_rel = tuple(a - b for a, b in zip(ov_off, p.offsets, strict=True))
            dst_rel = tuple(a - b for a, b in zip(ov_off, dest_off, strict=True))
            src_rows = row_range(src_rel, ov_shape, p.shape)
            dst_rows = row_range(dst_rel, ov_shape, dest_shape)
            src_row = math.prod(p.shape[1:]) * item
            if dview is not None and src_rows is not None and dst_rows is not None:
                n = math.prod(ov_shape) * item
                s = src_rows[0] * src_row
                d = dst_rows[0] * dest_row
                self.read_range(key, p, s, s + n, dview[d : d + n])
                continue
            # general case (non-row boxes, CUDA or strided destinations): read the covering
            # rows of the piece into scratch, then copy the box
            r0 = src_rel[0] if p.shape else 0
            r1 = r0 + ov_shape[0] if p.shape else 1
            scratch = torch.empty((r1 - r0, *p.shape[1:]), dtype=ST_TO_TORCH[entry.dtype])
            self.read_range(key, p, r0 * src_row, r1 * src_row, byte_view(scratch))
            src = (
                scratch[
                    (
                        slice(None),
                        *(slice(a, a + n) for a, n in zip(src_rel[1:], ov_shape[1:], strict=True)),
                    )
                ]
                if p.shape
                else scratch.reshape(())
            )
            dst = dest[tuple(slice(a, a + n) for a, n in zip(dst_rel, ov_shape, strict=True))]
            dst.copy_(src)
        if covered != math.prod(dest_shape):
            raise CorruptCheckpointError(
                f"the pieces of tensor {key!r} cover {covered} of the {math.prod(dest_shape)} "
                "elements this rank needs",
                path=self._path(MANIFEST),
            )

    def read_piece(self, key: str, p: Piece, dest: torch.Tensor) -> None:
        if dest.device.type == "cpu" and dest.is_contiguous():
            self.read_range(key, p, 0, p.nbytes, byte_view(dest))
            return
        tmp = torch.empty(p.shape, dtype=ST_TO_TORCH[p.dtype])
        self.read_range(key, p, 0, p.nbytes, byte_view(tmp))
        dest.copy_(tmp)


def _torch_dtype(code: str) -> torch.dtype:
    return ST_TO_TORCH[code]


class _Restorer:
    """Walks the saved JSON tree and the live state together, restoring in place."""

    def __init__(self, reader: _Reader, rank: int, world: int, strict: bool) -> None:
        self.r = reader
        self.m = reader.m
        self.rank = rank
        self.world = world
        self.strict = strict
        self.missing_rank_local: list[str] = []
        self.dtensor = _dtensor_type()

    # -- tensors
    def _mismatch(self, key: str, want: str, got: torch.Tensor) -> CheckpointError:
        return CheckpointError(
            f"tensor {key!r}: the checkpoint holds {want}, the destination is "
            f"{got.dtype} {list(got.shape)}. Build the model/optimizer with the same "
            "configuration as the saved run, or load into a fresh value (strict=False)."
        )

    def tensor(self, key: str, cur: Any) -> Any:
        entry = self.m.tensors.get(key)
        if entry is None:
            raise ManifestError(f"tensor {key!r} is in the JSON tree but not in the manifest")
        if entry.kind == "rank_local":
            piece = next((p for p in entry.pieces if p.rank == self.rank), None)
            if piece is None:
                raise CorruptCheckpointError(
                    f"rank {self.rank}'s value of {key!r} is missing", path=MANIFEST
                )
            want = f"{piece.dtype} {list(piece.shape)}"
            dt = _torch_dtype(piece.dtype)
            if isinstance(cur, torch.Tensor):
                if tuple(cur.shape) != piece.shape or cur.dtype != dt:
                    if self.strict:
                        raise self._mismatch(key, want, cur)
                    cur = None
                else:
                    self.r.read_piece(key, piece, cur)
                    return cur
            out = torch.empty(piece.shape, dtype=dt)
            self.r.read_piece(key, piece, out)
            return out
        dt = _torch_dtype(entry.dtype)
        want = f"{entry.dtype} {list(entry.shape)}"
        if self.dtensor is not None and isinstance(cur, self.dtensor):
            cur = _as_any(cur)
            if tuple(cur.shape) != entry.shape or cur.dtype != dt:
                raise self._mismatch(key, want, cur)
            off, local_shape, _ = _dtensor_box(cur)
            local = cur.to_local()
            if tuple(local.shape) != local_shape:
                local = local[tuple(slice(0, s) for s in local_shape)]
            with torch.no_grad():
                self.r.read_box(key, entry, local, off, local_shape)
            return cur
        if isinstance(cur, torch.Tensor):
            if tuple(cur.shape) != entry.shape or cur.dtype != dt:
                if self.strict:
                    raise self._mismatch(key, want, cur)
            else:
                with torch.no_grad():
                    self.r.read_box(key, entry, cur, (0,) * len(entry.shape), entry.shape)
                return cur
        out = torch.empty(entry.shape, dtype=dt)
        self.r.read_box(key, entry, out, (0,) * len(entry.shape), entry.shape)
        return out

    # -- tree
    def node(self, cur: Any, g: Any, own: Any, path: str) -> Any:
        """Restore ``cur`` from the global tree node ``g`` (rank 0's) and this rank's ``own``."""
        if isinstance(g, dict) and _RANK_LOCAL in g:
            if not (isinstance(own, dict) and _RANK_LOCAL in own):
                self.missing_rank_local.append(path)
                return cur
            inner = cur.value if isinstance(cur, RankLocal) else cur
            new = self.node(inner, own[_RANK_LOCAL], own[_RANK_LOCAL], path)
            if isinstance(cur, RankLocal):
                cur.value = new
                return cur
            return new
        if isinstance(cur, Stateful) and not isinstance(cur, (Mapping, torch.Tensor)):
            loaded = self.node(cur.state_dict(), g, own, path)
            cur.load_state_dict(loaded)
            return cur
        if isinstance(g, dict) and _TENSOR in g:
            return self.tensor(str(g[_TENSOR]), cur)
        if isinstance(g, dict) and _TUPLE in g:
            items = g[_TUPLE]
            own_items = own[_TUPLE] if isinstance(own, dict) and _TUPLE in own else None
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
        if isinstance(g, dict) and _FLOAT in g:
            return float(g[_FLOAT])
        if isinstance(g, dict) and _DTYPE in g:
            dt = getattr(torch, str(g[_DTYPE]), None)
            if not isinstance(dt, torch.dtype):
                raise ManifestError(f"{path}: unknown dtype {g[_DTYPE]!r}")
            return dt
        if isinstance(g, dict):
            if _DICT in g:
                pairs = [(k, v) for k, v in g[_DICT]]
                own_pairs = dict(own[_DICT] if isinstance(own, dict) and _DICT in own else [])
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
                sub = f"{path}.{k}" if path else str(k)
                target[k] = self.node(target.get(k), v, own_pairs.get(k), sub)
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


def load(
    state: dict[str, Any],
    uri: Location,
    *,
    step: int | None = None,
    process_group: Any = None,
    strict: bool = True,
    timeout: float = 600.0,
) -> LoadInfo:
    """Restore ``state`` in place from step ``step`` (None: the newest complete one).

    Tensors are filled in place (``copy_`` semantics, straight from the file into their
    memory), Stateful objects get ``load_state_dict`` with the restored sub-tree, and other
    values are replaced in their dict or list (tuples are rebuilt). Keys the checkpoint has
    but ``state`` lacks are added. With ``strict`` (the default) every key of ``state`` must be
    in the checkpoint and every tensor's shape and dtype must match.

    Under a process group every rank calls it; rank 0 chooses the step when ``step`` is None,
    and if any rank fails, every rank raises the first failing rank's error (so all of them
    can fall back to an older step together). A failed load may leave ``state`` partly
    restored.
    """
    t0 = time.perf_counter()
    if not isinstance(state, dict):
        raise CheckpointError(f"state must be a dict, got {type(state).__name__}")
    storage = open_storage(uri)
    rank, world = group_rank_world(process_group)
    if step is None:
        chosen = latest_step(storage) if rank == 0 else None
        if world > 1:
            chosen = broadcast_json(
                chosen, group=process_group, timeout=timeout, what="load: choosing the step"
            )
        if chosen is None:
            raise CheckpointError(f"no complete checkpoint under {storage.uri}")
        step = int(chosen)
    err: BaseException | None = None
    info: LoadInfo | None = None
    try:
        info = _load_local(state, storage, step, rank=rank, world=world, strict=strict)
    except Exception as e:
        if world == 1:
            raise
        err = e
    if world > 1:
        own = (
            {"ok": True}
            if err is None
            else {
                "ok": False,
                "type": type(err).__name__,
                "kind": classify_load_error(err),
                "msg": str(err),
                "path": getattr(err, "path", None),
            }
        )
        outcomes = all_gather_json(
            own, group=process_group, timeout=timeout, what=f"load of step {step}"
        )
        bad = [(r, o) for r, o in enumerate(outcomes) if not o.get("ok")]
        if bad:
            r, o = bad[0]
            if err is not None and r == rank:
                raise err
            msg = f"rank {r} failed to load step {step}: {o['msg']}"
            if o["type"] == "CorruptCheckpointError" and o.get("path"):
                raise CorruptCheckpointError(msg, path=str(o["path"])) from err
            if o["type"] == "IncompleteCheckpointError":
                raise IncompleteCheckpointError(msg) from err
            if o["type"] == "ManifestError":
                raise ManifestError(msg) from err
            if o.get("kind") == "unreadable":
                cls = (
                    UnsupportedFormatError
                    if o["type"] == "UnsupportedFormatError"
                    else UnreadableCheckpointError
                )
                raise cls(msg, step=step) from err
            raise CheckpointError(msg) from err
    assert info is not None
    return dataclasses.replace(info, seconds=time.perf_counter() - t0)


def _load_local(
    state: dict[str, Any], storage: Storage, step: int, *, rank: int, world: int, strict: bool
) -> LoadInfo:
    try:
        return _load_step(state, storage, step, rank=rank, world=world, strict=strict)
    except (OSError, StorageError) as e:  # I/O, permissions, throttling after every retry
        raise _catalog.unreadable(e, step, "loading it") from e


def _load_step(
    state: dict[str, Any], storage: Storage, step: int, *, rank: int, world: int, strict: bool
) -> LoadInfo:
    manifest = read_manifest(storage, step)
    reader = _Reader(storage, manifest)
    try:
        global_tree = reader.read_json(0)
        own_tree = (
            global_tree
            if rank == 0
            else reader.read_json(rank)
            if rank < manifest.world_size
            else None
        )
        if not isinstance(global_tree, dict):
            raise ManifestError("rank 0's JSON tree is not an object")
        restorer = _Restorer(reader, rank, world, strict)
        if strict:
            lost = [k for k in state if k not in global_tree]
            if lost:
                raise CheckpointError(
                    f"the checkpoint of step {step} has no {lost}; pass strict=False to keep "
                    "their current values"
                )
        for key, g in global_tree.items():
            own = own_tree.get(key) if isinstance(own_tree, dict) else None
            state[key] = restorer.node(state.get(key), g, own, key)
        reader.check()
    finally:
        reader.close()
    return LoadInfo(
        step=step,
        uri=storage.uri,
        seconds=0.0,
        saved_world_size=manifest.world_size,
        resharded=manifest.world_size != world,
        missing_rank_local=restorer.missing_rank_local,
        saved_torch_version=manifest.torch_version,
        saved_attempt=manifest.attempt,
    )


def iter_tensors(
    uri: Location,
    *,
    step: int | None = None,
    kinds: tuple[str, ...] = ("replicated", "sharded"),
    keys: Collection[str] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (key, full tensor) for the tensors of a step, one at a time (for exporters).

    Each tensor is assembled from its pieces into a fresh CPU tensor; memory is bounded by
    the largest tensor. Rank-local tensors are skipped unless ``"rank_local"`` is in ``kinds``
    (then rank 0's value is yielded). ``keys``, if given, limits the walk to those keys:
    nothing else is read (an exporter of weights never reads the optimizer's bytes).
    """
    storage = open_storage(uri)
    if step is None:
        step = latest_step(storage)
        if step is None:
            raise CheckpointError(f"no complete checkpoint under {storage.uri}")
    manifest = read_manifest(storage, step)
    reader = _Reader(storage, manifest)
    try:
        for key, entry in manifest.tensors.items():
            if entry.kind not in kinds or (keys is not None and key not in keys):
                continue
            if entry.kind == "rank_local":
                p0 = next((p for p in entry.pieces if p.rank == 0), None)
                if p0 is None:
                    continue
                out = torch.empty(p0.shape, dtype=_torch_dtype(p0.dtype))
                reader.read_piece(key, p0, out)
            else:
                out = torch.empty(entry.shape, dtype=_torch_dtype(entry.dtype))
                reader.read_box(key, entry, out, (0,) * len(entry.shape), entry.shape)
            reader.check()
            yield key, out
    finally:
        reader.close()
