"""Phase 4 of a save: agree, then commit (see :mod:`trainer_sdk.saveload._saving` for phase 3).

:func:`commit` gathers every rank's :class:`RankRecord` (JSON over uint8 tensors, never
pickle, bounded wait), and if and only if every rank succeeded, rank 0 builds the manifest
(:func:`build_manifest`), checks its references against the steps they name, writes
``manifest.json`` (the commit, :func:`commit_manifest`) and then ``latest``. Every rank
returns, or every rank raises the same error naming the failing rank(s).
:func:`commit_failure` is how a rank whose earlier phase failed still takes part, so that
every rank learns who failed; :func:`check_writable` is the fencing check a save makes
before it writes (a newer attempt owns the checkpoint). The DCP storage writer and the memory
tier commit through the same functions.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from trainer_sdk._version import __version__ as _baton_version
from trainer_sdk.errors import (
    CheckpointError,
    RankFailedError,
    StorageError,
    SupersededError,
)
from trainer_sdk.format import _catalog
from trainer_sdk.format.layout import (
    BLOCK_SIZE,
    LATEST,
    FileEntry,
    Manifest,
    Piece,
    TensorEntry,
    lowest_version,
    parse_latest,
)
from trainer_sdk.saveload._collectives import all_gather_json, broadcast_json, group_rank_world
from trainer_sdk.storage import Storage
from trainer_sdk.wire import Trigger

__all__ = [
    "RankRecord",
    "References",
    "SaveInfo",
    "build_manifest",
    "check_writable",
    "commit",
    "commit_built_manifest",
    "commit_failure",
    "commit_manifest",
]

log = logging.getLogger("trainer_sdk.api")


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
class References:
    """Tensors a save does not write but references in earlier steps (format v3): the same
    on every rank (agreed before planning, see :mod:`trainer_sdk.loop._reuse`)."""

    files: Mapping[str, FileEntry]
    """``ref_key(S, name)`` -> the entry step S committed for that shard, with ``step=S``."""
    tensors: Mapping[str, TensorEntry]
    """key -> the whole entry, its pieces naming keys of ``files``."""


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


def build_manifest(
    records: list[dict[str, Any]],
    *,
    step: int,
    trigger: str,
    block_size: int,
    extra: Any,
    references: References | None = None,
) -> Manifest:
    """The manifest of ``step`` from every rank's record (in rank order), without an attempt
    (the committer sets it). Every rank can build it; :func:`commit` and the memory tier do.
    ``references``: tensors taken whole from earlier steps (then the manifest is v3)."""
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
            pieces.setdefault(key, []).append(Piece.from_record(pj))
    tensors: dict[str, TensorEntry] = {}
    for key, m in meta.items():
        ps = tuple(sorted(pieces.get(key, []), key=lambda p: (p.offsets, p.rank or 0)))
        shape = tuple(m["shape"])
        dtype = m["dtype"]
        if m["kind"] == "rank_local" and ps:
            shape, dtype = ps[0].shape, ps[0].dtype
        tensors[key] = TensorEntry(kind=m["kind"], dtype=dtype, shape=shape, pieces=ps)
    if references is not None and references.tensors:
        files.update(references.files)
        for key, entry in references.tensors.items():
            if pieces.get(key):
                raise CheckpointError(f"tensor {key!r} is both written and referenced")
            tensors[key] = entry
    return Manifest(
        version=lowest_version(files, tensors),
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
    references: References | None = None,
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
    manifest = build_manifest(
        records, step=step, trigger=trigger, block_size=block_size, extra=dict(extra or {}),
        references=references,
    )  # fmt: skip
    outcome: dict[str, Any] = {"ok": True}
    if rank == 0:
        try:
            manifest = commit_built_manifest(storage, manifest, attempt)
        except Exception as e:  # reported to every rank below
            outcome = _error_json(0, e)
            if world == 1:
                raise
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


def commit_built_manifest(storage: Storage, manifest: Manifest, attempt: int | None) -> Manifest:
    """Rank 0's commit of a durable save: fence check, then :func:`commit_manifest`. Returns
    the manifest as written (with its attempt). Also the commit of a step written through DCP
    (``integrations.dcp``), whose coordinator builds the manifest itself."""
    step = manifest.step
    newest = _catalog.newest_attempt(storage)
    if attempt is None:
        attempt = newest
    elif attempt < newest:
        raise _superseded(storage, step, attempt, newest)
    manifest = dataclasses.replace(manifest, attempt=attempt)
    data = manifest.to_json_bytes()
    parsed = Manifest.parse(data, step=step)  # never commit a manifest readers would refuse
    if manifest.referenced_steps():
        _check_references(storage, manifest)
    try:
        commit_manifest(storage, step, data)
    except FileExistsError as e:
        raise CheckpointError(
            f"step {step} under {storage.uri} was committed by another writer at the same "
            "time (its manifest is there and differs from ours); that commit stands. Two "
            "trainers are writing to one checkpoint uri: give each run its own uri"
        ) from e
    _catalog.remember_manifest(storage, parsed)  # the next commits' checks need not read it
    return manifest


def _check_references(storage: Storage, manifest: Manifest) -> None:
    """The fencing of references (v3): every referenced shard must be one that a complete
    step of this root's lineage committed (in its own directory, or referenced in turn) with
    the very same entry, and must still be there at its size. Otherwise nothing is committed."""
    complete = _catalog.complete_steps(storage)
    known: dict[str, FileEntry] = {}
    for s, m in complete.items():
        for k, f in m.files.items():
            if f.step is None and k.endswith(".safetensors"):
                known[m.path_of(k)] = dataclasses.replace(f, step=s)
            elif f.step is not None:
                known[m.path_of(k)] = f
    for k, f in manifest.files.items():
        if f.step is None:
            continue
        path = manifest.path_of(k)
        if known.get(path) != f:
            raise CheckpointError(
                f"step {manifest.step} would reference {path}, which no complete step under "
                f"{storage.uri} committed with that size and digest (deleted, or rewritten by "
                "another writer); not committed, the next save writes the tensors again"
            )
        try:
            size = storage.size(path)
        except FileNotFoundError:
            size = -1
        if size != f.size:
            raise CheckpointError(
                f"step {manifest.step} would reference {path}, which is "
                f"{'missing' if size < 0 else f'{size} bytes, not {f.size}'}; not committed, "
                "the next save writes the tensors again"
            )


def _manifest_key(step: int) -> str:
    return _catalog.manifest_key(step)


def commit_manifest(storage: Storage, step: int, data: bytes, *, latest: bool = True) -> None:
    """The commit of ``step`` under ``storage``: create its manifest (``data``) exclusively,
    then, with ``latest``, point ``latest`` at it.

    The one commit path of durable saves, memory snapshots (``latest=False``: ``fast_dir`` has
    no ``latest``) and promotions. The manifest is the commit marker, so the caller writes it
    last, after every file it lists, and does its fencing check before. It is created only if
    none is there yet (``If-None-Match: *`` on S3, ``link`` on a filesystem):
    ``FileExistsError`` when another writer committed the step first (the caller says what
    that means for it). Once it is written the step is committed: a failure to move ``latest``
    afterwards is logged as a warning and never raised (readers list the manifests).
    """
    storage.create_exclusive(_manifest_key(step), data)
    if not latest:
        return
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


def commit_failure(
    storage: Storage,
    error: Exception,
    *,
    step: int,
    trigger: str,
    process_group: Any,
    timeout: float,
    attempt: int | None = None,
) -> NoReturn:
    """Raise ``error`` after telling the other ranks (this rank's phases 1-3 failed).

    Alone, ``error`` is raised as it is. Under a process group this rank still takes part in
    :func:`commit`, reporting the failure, so that every rank raises the same error naming
    the failing rank(s) instead of waiting for this one; that error is chained to ``error``.
    """
    if group_rank_world(process_group)[1] == 1:
        raise error
    try:
        commit(
            storage, error, step=step, trigger=trigger, process_group=process_group,
            timeout=timeout, attempt=attempt,
        )  # fmt: skip
    except BaseException as e:
        raise e from error
    raise AssertionError(f"commit of step {step} succeeded although this rank failed: {error}")
