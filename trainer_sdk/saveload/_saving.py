"""Phase 3 of a save: write this rank's files; and a whole save, phases 3 and 4 together.

:func:`write_rank` streams this rank's ``.safetensors`` (hashing while writing) and its
``.json``, and commits both; it returns a :class:`~trainer_sdk.saveload._committing.RankRecord`.
:func:`write_and_commit` runs the write and the commit (:mod:`trainer_sdk.saveload._committing`)
with the rules every saver needs (``api.save``, the async writer in :mod:`trainer_sdk.staging`,
the Checkpointer). The public entry point is :func:`trainer_sdk.api.save`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from trainer_sdk.errors import (
    CheckpointError,
)
from trainer_sdk.format import _catalog
from trainer_sdk.format._safetensors_io import PieceSource, ShardResult, write_shard
from trainer_sdk.format.layout import (
    BLOCK_SIZE,
    FileEntry,
    Manifest,
    Piece,
    file_path,
    json_name,
    shard_name,
)
from trainer_sdk.format.planning import FlatState, SavePlan
from trainer_sdk.saveload._committing import (
    RankRecord,
    References,
    SaveInfo,
    check_writable,
    commit,
    commit_failure,
)
from trainer_sdk.storage import Storage
from trainer_sdk.wire import SavePhase

__all__ = [
    "PublishRefusedError",
    "ShardWriter",
    "write_and_commit",
    "write_rank",
    "write_shard_file",
]

log = logging.getLogger("trainer_sdk.api")


def _refuse_if_committed(storage: Storage, step: int) -> None:
    if storage.exists(_catalog.manifest_key(step)):
        raise CheckpointError(
            f"step {step} under {storage.uri} was committed by another writer while this one "
            "was writing it; nothing of it was overwritten. Two trainers are writing to one "
            "checkpoint uri: stop the stale one, or give each run its own uri"
        )


def _json_default(v: Any) -> Any:
    raise TypeError(f"{type(v).__name__} is not JSON-serialisable")


class PublishRefusedError(Exception):
    """Raised by a :class:`ShardWriter` that wrote a file but did not publish it, because the
    step's manifest (its ``guard_key``) existed by then: another writer committed the step."""


class ShardWriter(Protocol):
    """Writes and commits a shard file somewhere other than the calling thread (the writer
    process of an async save, ``staging``), or declines (None) and the caller writes it."""

    def __call__(
        self,
        storage: Storage,
        path: str,
        sources: list[PieceSource],
        *,
        metadata: Mapping[str, str],
        block_size: int,
        guard_key: str,
    ) -> ShardResult | None:
        """What was written; None: declined, nothing written. Raises :class:`PublishRefusedError`
        if ``guard_key`` existed before the commit."""
        ...


def write_shard_file(
    storage: Storage,
    sources: list[PieceSource],
    *,
    step: int,
    rank: int,
    world: int,
    block_size: int = BLOCK_SIZE,
    metadata: Mapping[str, str] | None = None,
    shard_writer: ShardWriter | None = None,
) -> tuple[str, ShardResult]:
    """Write and commit this rank's shard file of ``step`` from ``sources``; its name and
    what was written (sizes, digests, every piece's byte range and block checksums). Refuses to
    publish into a step that another writer committed meanwhile. ``metadata`` adds entries to
    the safetensors header's ``__metadata__``. ``shard_writer``, if given and it accepts, writes
    the file instead of this thread. Used by :func:`write_rank` and by the DCP backend
    (``integrations.dcp``), whose planner decides the pieces."""
    sname = shard_name(rank, world)
    path = file_path(step, sname)
    meta = {
        "format": "baton-checkpoint-v1",
        "step": str(step),
        "rank": str(rank),
        "world_size": str(world),
        **(metadata or {}),
    }
    if shard_writer is not None:
        try:
            done = shard_writer(
                storage, path, sources, metadata=meta, block_size=block_size,
                guard_key=_catalog.manifest_key(step),
            )  # fmt: skip
        except PublishRefusedError:
            _refuse_if_committed(storage, step)
            raise CheckpointError(f"{path} was not published: step {step} is committed") from None
        if done is not None:
            return sname, done
    writer = storage.open_writer(path, size_hint=sum(s.end - s.start for s in sources))
    try:
        res = write_shard(writer, sources, metadata=meta, block_size=block_size)
        _refuse_if_committed(storage, step)  # never publish a file into a committed step
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    return sname, res


def write_rank(
    storage: Storage,
    plan: SavePlan,
    tensors: Mapping[str, torch.Tensor],
    json_tree: Any,
    *,
    step: int,
    flat: FlatState | None = None,
    block_size: int = BLOCK_SIZE,
    shard_writer: ShardWriter | None = None,
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
    jname = json_name(rank, world)
    sname, res = write_shard_file(storage, sources, step=step, rank=rank, world=world,
                                  block_size=block_size, shard_writer=shard_writer)  # fmt: skip
    try:
        jdata = json.dumps(json_tree, allow_nan=False, default=_json_default).encode()
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"the JSON part of the state cannot be encoded: {e}") from e
    _refuse_if_committed(storage, step)
    storage.write_atomic(file_path(step, jname), jdata)
    files = {
        sname: FileEntry(size=res.size, xxh3_128=res.xxh3_128, data_start=res.data_start),
        jname: FileEntry(size=len(jdata), sha256=hashlib.sha256(jdata).hexdigest()),
    }
    meta: dict[str, dict[str, Any]] = {}
    if flat is not None:
        for k, ent in flat.entries.items():
            meta[k] = {"kind": ent.kind, "dtype": ent.dtype, "shape": list(ent.global_shape)}
    pieces: list[tuple[str, Piece]] = []
    for p in plan.pieces:
        meta.setdefault(p.key, {"kind": p.kind, "dtype": p.dtype, "shape": list(p.global_shape)})
        begin, end, sums = res.pieces[p.name]
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
                    block_hash=res.block_hash,
                    sums=sums,
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


# ------------------------------------------------------------------- write and commit


def write_and_commit(
    storage: Storage,
    plan: SavePlan,
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
    run_commit: Callable[[Callable[[], Manifest]], Manifest] | None = None,
    references: References | None = None,
    on_manifest: Callable[[Manifest], None] | None = None,
    shard_writer: ShardWriter | None = None,
) -> SaveInfo:
    """Phases 3 and 4 together, with the rules every saver needs (sync, async, Checkpointer).

    A rank whose write fails still takes part in the commit (unless it is alone), so that every
    rank learns who failed; an error from the commit is chained to that rank's own error.
    (A rank whose *earlier* phase failed calls :func:`commit_failure` instead.) ``started``
    is the ``time.perf_counter()`` at which the save began; ``phases`` has the earlier phases'
    times. ``attempt`` and ``extra`` go to :func:`commit` (fencing, and free-form manifest
    JSON). ``run_commit(fn)``, if given, runs phase 4 (``fn``) where it must run: an async
    save writes at background priority and commits at normal priority (``staging``).
    ``references`` go to the manifest (tensors not written, see :class:`References`);
    ``on_manifest(manifest)`` runs on every rank once the step is committed.
    ``shard_writer`` writes the shard file elsewhere if it accepts (:class:`ShardWriter`).
    """
    phases = dict(phases or {})
    t = time.perf_counter()
    try:
        check_writable(storage, step, attempt)
        record = write_rank(
            storage, plan, tensors, json_tree, step=step, flat=flat, shard_writer=shard_writer
        )
    except Exception as exc:
        commit_failure(
            storage, exc, step=step, trigger=trigger, process_group=process_group,
            timeout=timeout, attempt=attempt,
        )  # fmt: skip
    phases[SavePhase.WRITE] = time.perf_counter() - t
    phases[SavePhase.HASH] = record.hash_seconds
    t = time.perf_counter()

    def phase4() -> Manifest:
        return commit(
            storage, record, step=step, trigger=trigger, process_group=process_group,
            timeout=timeout, attempt=attempt, extra=extra, references=references,
        )  # fmt: skip

    manifest = phase4() if run_commit is None else run_commit(phase4)
    if on_manifest is not None:
        on_manifest(manifest)
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
