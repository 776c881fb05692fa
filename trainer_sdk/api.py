"""save / load / latest_step: the SDK's checkpoint functions (a facade over the protocol).

This module holds the public functions; the protocol behind them lives in one module per
concern, each documented there:

* :mod:`trainer_sdk.format._tree`: the tagged-JSON tree, :func:`flatten` (encoder) and its decoder;
* :mod:`trainer_sdk.saveload._saving`: phase 3 of a save (:func:`write_rank`) and the whole save;
* :mod:`trainer_sdk.saveload._committing`: phase 4, agree and commit (:func:`commit`);
* :mod:`trainer_sdk.saveload._loading`: verified ranged reads into the live state;
* :mod:`trainer_sdk.format._catalog`: which steps exist and are complete, deletion, fencing.

A save runs in four phases. They are separate functions so that the async writer
(``trainer_sdk.staging``) can stage tensors on the training thread and run phases 3 and 4 in a
background thread, on a process group of its own:

1. :func:`flatten` takes the state apart (``state_dict()`` is called on Stateful objects):
   every tensor becomes a :class:`~trainer_sdk.format.planning.FlatEntry` (replicated, sharded
   DTensor, or rank-local), everything else a JSON tree that refers to tensors by key.
2. :func:`~trainer_sdk.format.planning.plan_save` picks this rank's pieces; deterministic, no
   collective.
3. :func:`write_rank` streams this rank's ``.safetensors`` (hashing while writing) and its
   ``.json``, and commits both; returns a :class:`RankRecord`.
4. :func:`commit` gathers every rank's record (JSON over uint8 tensors, never pickle, bounded
   wait), and if and only if every rank succeeded, rank 0 writes ``manifest.json`` (the
   commit) and then ``latest``. Every rank returns, or every rank raises the same error naming
   the failing rank(s).

A load reads the manifest of a complete step, then, for every tensor in the state, only the
byte ranges that overlap what this rank holds (which is what makes a change of world size
work), straight into the destination tensors, verifying a checksum per block as it goes.
"""

from __future__ import annotations

import re
import time
from collections.abc import Collection, Iterator, Mapping
from typing import Any, Final

import torch

from trainer_sdk.errors import CheckpointError
from trainer_sdk.format import _catalog
from trainer_sdk.format._catalog import (
    cleanup_incomplete,
    complete_steps,
    delete_step,
    latest_step,
    list_steps,
    newest_attempt,
    read_manifest,
    register_attempt,
    step_dirs,
)
from trainer_sdk.format._tree import flatten
from trainer_sdk.format.layout import Manifest, step_dir
from trainer_sdk.format.planning import FlatEntry, FlatState, SavePlan, plan_save
from trainer_sdk.saveload._collectives import broadcast_json, group_rank_world
from trainer_sdk.saveload._committing import (
    RankRecord,
    References,
    SaveInfo,
    check_writable,
    commit,
    commit_failure,
)
from trainer_sdk.saveload._loading import (
    LoadInfo,
    Reader,
    classify_load_error,
    load_step,
    torch_dtype,
)
from trainer_sdk.saveload._saving import write_and_commit, write_rank
from trainer_sdk.storage import Location, Storage, open_storage
from trainer_sdk.wire import SavePhase, Trigger

__all__ = [
    "FlatEntry",
    "FlatState",
    "LoadInfo",
    "Manifest",
    "RankRecord",
    "References",
    "SaveInfo",
    "SavePlan",
    "check_writable",
    "classify_load_error",
    "cleanup_incomplete",
    "commit",
    "commit_failure",
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
    "read_tree",
    "register_attempt",
    "save",
    "step_dirs",
    "write_and_commit",
    "write_rank",
]

_TRIGGER_RE: Final = re.compile(r"[a-z][a-z0-9_-]{0,31}")

_READ_RUN = 64 << 20
"""Bytes of whole blocks fetched by one ``read_into`` while loading (on S3 one call fans out
into parallel ranged GETs). Read when a load starts, so tests can make it small."""


def _Reader(storage: Storage, manifest: Manifest) -> Reader:  # noqa: N802 - reads like the class
    """A verified reader of one step, reading in runs of :data:`_READ_RUN`."""
    return Reader(storage, manifest, read_run=_READ_RUN)


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
    if storage.exists(_catalog.manifest_key(step)):
        raise CheckpointError(
            f"step {step} is already committed under {storage.uri}; save a new step, or "
            "delete_step() it first"
        )
    phases: dict[str, float] = {}
    try:
        t = time.perf_counter()
        flat = flatten(state)
        phases[SavePhase.FLATTEN] = time.perf_counter() - t
        t = time.perf_counter()
        plan = plan_save(flat, rank, world)
        phases[SavePhase.PLAN] = time.perf_counter() - t
    except Exception as exc:
        # Still take part in the commit, so that every rank learns who failed.
        commit_failure(
            storage, exc, step=step, trigger=trigger, process_group=process_group,
            timeout=timeout, attempt=attempt,
        )  # fmt: skip
    return write_and_commit(
        storage, plan, flat.tensors(), flat.tree, step=step, flat=flat, trigger=trigger,
        process_group=process_group, timeout=timeout, started=t0, phases=phases,
        attempt=attempt,
    )  # fmt: skip


def load(
    state: dict[str, Any],
    uri: Location,
    *,
    step: int | None = None,
    process_group: Any = None,
    strict: bool = True,
    timeout: float = 600.0,
    cooperative: bool | None = None,
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

    ``cooperative``: every tensor that every rank needs whole (a DDP model and optimizer) is
    read from storage by one rank, verified there, and broadcast to the others, so storage
    serves each byte once instead of once per rank; with a group of more than one rank that
    can broadcast CPU tensors (gloo, as the Checkpointer's own groups are). ``None`` (the
    default): on for S3, off for a filesystem, where the page cache and local disks beat
    sending the bytes over the process group (``docs/performance.md``, "Cooperative
    restore"); ``True`` or ``False`` forces it (``True`` for a shared network filesystem).
    Sharded (DTensor) and rank-local values are read by their own rank either way. See
    ``docs/checkpointer.md``.
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
    if cooperative is None:
        cooperative = storage.uri.startswith("s3://")
    return load_step(
        state, storage, step, process_group=process_group, rank=rank, world=world,
        strict=strict, timeout=timeout, started=t0, read_run=_READ_RUN, cooperative=cooperative,
    )  # fmt: skip


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
                out = torch.empty(p0.shape, dtype=torch_dtype(p0.dtype))
                reader.read_piece(key, p0, out)
            else:
                out = torch.empty(entry.shape, dtype=torch_dtype(entry.dtype))
                reader.read_box(key, entry, out, (0,) * len(entry.shape), entry.shape)
            reader.check()
            yield key, out
    finally:
        reader.close()


def read_tree(uri: Location, step: int, *, rank: int = 0) -> Any:
    """The JSON tree of ``rank``'s state at ``step`` as saved: the values that are not
    tensors, tensors as ``{"__baton_tensor__": key}`` references, tagged as in
    ``docs/format.md`` (for tools: ``export_peft_adapter`` reads the PEFT config that
    ``BatonTrainer`` records). Checked against the manifest's digest; no tensor is read."""
    storage = open_storage(uri)
    manifest = read_manifest(storage, step)
    if not 0 <= rank < manifest.world_size:
        raise CheckpointError(
            f"step {step} was saved by {manifest.world_size} ranks: rank {rank} has no tree"
        )
    reader = _Reader(storage, manifest)
    try:
        return reader.read_json(rank)
    finally:
        reader.close()
