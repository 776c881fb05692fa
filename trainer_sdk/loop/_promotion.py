"""Promotion: a memory-tier snapshot copied to durable storage unchanged, verified as it goes.

A notice may commit a step to the memory tier only (its deadline was too short for a durable
save), and a restore may load a snapshot that is not durable yet; either way the snapshot must
then reach the checkpoint uri before its node goes away. :class:`Promotion` does that in the
background for a running job (every rank its own files, rank 0 the manifest last), on its own
worker thread and process group so that it never delays a snapshot; :func:`promote` does it
from one process that sees the whole snapshot (``trainer_sdk.promote``, for tools).

Who calls what: :class:`~trainer_sdk.loop._memory_tier.MemoryTier` owns one ``Promotion``
(``MemoryTier.promotion``) and asks :meth:`Promotion.holds` before it deletes an older
snapshot; the save engine calls :meth:`Promotion.start`, :meth:`Promotion.wait` and reads
:attr:`Promotion.step`. The helpers that tell a complete snapshot (:func:`missing`) and report
every rank's failure (:func:`error_json`, :func:`raise_failures`) are shared with the tier.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Final

import torch

from trainer_sdk.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    RankFailedError,
)
from trainer_sdk.format import _catalog
from trainer_sdk.format.layout import FILE_RE, FileEntry, Manifest, file_path, new_hasher, step_dir
from trainer_sdk.saveload._collectives import all_gather_json
from trainer_sdk.saveload._committing import check_writable, commit_manifest
from trainer_sdk.staging import AsyncSaver
from trainer_sdk.storage import Location, Storage, open_storage

__all__ = ["Promotion", "error_json", "missing", "promote", "raise_failures"]

log = logging.getLogger("trainer_sdk.memory_tier")


def missing(storage: Storage, step: int) -> str | None:
    """Why ``step`` under ``storage`` cannot be loaded from here, or None when it can: a valid
    manifest and every file it lists, at its size."""
    try:
        manifest = _catalog.read_manifest(storage, step)
    except IncompleteCheckpointError:
        return "no manifest (never committed)"
    except CheckpointError as e:
        return f"its manifest is bad: {e}"
    for name, entry in manifest.files.items():
        try:
            size = storage.size(file_path(step, name))
        except FileNotFoundError:
            return f"{name} is missing"
        except OSError as e:
            return f"{name} cannot be read: {e}"
        if size != entry.size:
            return f"{name} has {size} bytes, the manifest says {entry.size}"
    return None


def error_json(rank: int, err: BaseException) -> dict[str, Any]:
    """This rank's failed outcome, as gathered by the tier's collectives."""
    return {"ok": False, "rank": rank, "error": f"{type(err).__name__}: {err}"}


def raise_failures(outcomes: list[dict[str, Any]], step: int, what: str) -> None:
    """Raise :class:`RankFailedError` naming the first failed rank, if any rank failed."""
    failures = {r: str(o.get("error")) for r, o in enumerate(outcomes) if not o.get("ok")}
    if failures:
        first = min(failures)
        raise RankFailedError(
            rank=first,
            cause=f"{what}: {failures[first]}",
            failures=failures,
            what=f"memory snapshot of step {step}",
        )


def delete_snapshot(storage: Storage, step: int) -> None:
    """Delete the snapshot directory of ``step``; a failure is logged (tidying only: the next
    commit retries)."""
    try:
        storage.delete_tree(step_dir(step))
    except OSError as e:
        log.warning("could not delete memory snapshot %s/%s: %s", storage.uri, step_dir(step), e)


class Promotion:
    """One rank's side of promoting the tier's snapshots, one at a time, in the background.

    The snapshot being promoted is pinned: :meth:`holds` tells the tier not to delete it, and
    when a newer snapshot would have, the promotion deletes it once it is durable.
    """

    def __init__(self, storage: Storage, *, rank: int, world: int, timeout: timedelta) -> None:
        self.storage = storage
        """The tier's ``fast_dir``: where the snapshots are read from."""
        self.rank, self.world, self.timeout = rank, world, timeout
        self._saver: AsyncSaver | None = None
        """The promotion's own worker thread and process group (built at the first promotion,
        by every rank at the same point), so that a promotion never delays a snapshot."""
        self._pinned: int | None = None
        """The snapshot being promoted: newer snapshots do not delete it until it is durable."""
        self._outlived = False
        """A newer snapshot would have deleted the pinned one: the promotion deletes it."""

    @property
    def step(self) -> int | None:
        """The step being promoted, if any."""
        return self._pinned

    def holds(self, step: int) -> bool:
        """Whether the tier must keep ``step`` (it is being promoted); if so, the promotion
        deletes it when it ends, as the tier would have."""
        if step != self._pinned:
            return False
        self._outlived = True
        return True

    def start(
        self,
        step: int,
        durable: Storage,
        *,
        attempt: int | None,
        on_done: Callable[[int, BaseException | None], None],
    ) -> None:
        """Copy the complete snapshot of ``step`` to ``durable`` in the background, unchanged:
        every rank its own files (verified against the manifest's digests), then rank 0 the
        manifest, last. ``on_done(step, error)`` runs on the promotion's thread on every rank
        when it ends. Call it on every rank at the same point (the first call builds a process
        group, collectively). The snapshot is kept in ``fast_dir`` until then."""
        if self._saver is None:
            self._saver = AsyncSaver(timeout=self.timeout)
        self._saver.wait_previous()
        self._pinned = step

        def work(staged: dict[str, torch.Tensor], tree: Any) -> int:
            error: BaseException | None = None
            copied = 0
            try:
                copied = self._copy(step, durable, attempt=attempt)
            except BaseException as e:
                error = e
            finally:
                self._pinned = None
            if self._outlived:
                # kept only for the promotion: a newer snapshot has committed (and been
                # replicated) since, and would have deleted it
                self._outlived = False
                delete_snapshot(self.storage, step)
            on_done(step, error)
            if error is not None:
                raise error
            return copied

        self._saver.submit(step=step, tensors={}, json_tree=None, work=work)

    def _copy(self, step: int, dst: Storage, *, attempt: int | None) -> int:
        group = None if self._saver is None else self._saver.group
        timeout = self.timeout.total_seconds()
        what = f"promoting memory snapshot {step}"
        key = _catalog.manifest_key(step)
        outcome: dict[str, Any] = {"ok": True, "bytes": 0}
        data = b""
        try:
            data = self.storage.read_bytes(key)
            manifest = Manifest.parse(data, step=step)
            if dst.exists(key) and dst.read_bytes(key) != data:
                raise CheckpointError(
                    f"step {step} is already committed under {dst.uri} by another save; the "
                    "memory snapshot was not promoted and nothing was overwritten"
                )
            if not dst.exists(key):
                if attempt is not None:
                    check_writable(dst, step, attempt)
                for name, entry in manifest.files.items():
                    m = FILE_RE.fullmatch(name)
                    if m is not None and int(m.group(1)) == self.rank:
                        outcome["bytes"] += _copy_verified(self.storage, dst, step, name, entry)
        except Exception as e:
            if self.world == 1:
                raise
            outcome = error_json(self.rank, e)
        outcomes = [outcome]
        if self.world > 1:
            outcomes = all_gather_json(outcome, group=group, timeout=timeout, what=what)
        raise_failures(outcomes, step, "copying its files to durable storage")
        final: dict[str, Any] = {"ok": True}
        if self.rank == 0 and not dst.exists(key):
            try:
                commit_manifest(dst, step, data)  # the commit marker, last; then latest
            except Exception as e:
                if self.world == 1:
                    raise
                final = error_json(self.rank, e)
        if self.world > 1:
            finals = all_gather_json(final, group=group, timeout=timeout, what=what)
            raise_failures(finals, step, "committing the promoted manifest")
        copied = sum(int(o.get("bytes") or 0) for o in outcomes) + len(data)
        if self.rank == 0:
            log.info("promoted memory snapshot of step %d to %s (%d bytes)", step, dst.uri, copied)
        return copied

    def wait(self) -> None:
        """Wait for a promotion in flight; raise its failure (once)."""
        if self._saver is not None:
            self._saver.wait_previous()

    def close(self) -> None:
        """Wait for a promotion in flight (a failure is logged) and stop its writer."""
        if self._saver is not None:
            try:
                self._saver.close()
            except Exception as e:
                log.warning(
                    "rank %d: promoting the memory snapshot to durable storage failed: %s",
                    self.rank,
                    e,
                )


_COPY_CHUNK: Final = 8 << 20
"""Bytes copied (and hashed) at a time by :func:`promote`: its memory is bounded by this."""


def _copy_verified(src: Storage, dst: Storage, step: int, name: str, entry: FileEntry) -> int:
    """Copy one file of ``step`` from ``src`` to ``dst`` in bounded chunks, checking it
    against the manifest's digest before it is committed; returns its size."""
    path = file_path(step, name)
    algorithm, want = entry.digest
    hasher = new_hasher(algorithm)
    buf = bytearray(min(_COPY_CHUNK, max(entry.size, 1)))
    writer = dst.open_writer(path, size_hint=entry.size)
    try:
        offset = 0
        while offset < entry.size:
            view = memoryview(buf)[: min(len(buf), entry.size - offset)]
            src.read_into(path, offset, view)
            hasher.update(view)
            writer.write(bytes(view))
            offset += len(view)
        if hasher.hexdigest() != want:
            raise CorruptCheckpointError(
                f"{algorithm} differs from the manifest's: the memory snapshot of step "
                f"{step} is corrupt and was not promoted",
                path=f"{src.uri}/{path}",
            )
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    return entry.size


def promote(fast_dir: Location, uri: Location, *, step: int) -> int:
    """Copy the complete memory snapshot of ``step`` from ``fast_dir`` to the durable ``uri``,
    unchanged; return the bytes copied (0 when it was already promoted).

    Every file is checked against the manifest's digest while it is copied (a snapshot that
    went bad in memory is refused, never made durable) and the manifest is written last,
    exclusively: the durable step is complete, or absent. Run it on one process that sees the
    whole snapshot (``fast_dir`` of a pod holds its own ranks' files). Refused, with nothing
    written, when the snapshot is incomplete, when ``step`` is already committed under ``uri``
    with another manifest, or when a newer attempt of the job writes there (fencing).
    """
    src = open_storage(fast_dir)
    dst = open_storage(uri)
    reason = missing(src, step)
    if reason is not None:
        raise IncompleteCheckpointError(
            f"the memory snapshot of step {step} under {src.uri} cannot be promoted: {reason}. "
            "Promote a complete snapshot (trainer_sdk.list_steps lists them)"
        )
    key = _catalog.manifest_key(step)
    data = src.read_bytes(key)
    manifest = Manifest.parse(data, step=step)
    if dst.exists(key):
        if dst.read_bytes(key) == data:
            return 0
        raise CheckpointError(
            f"step {step} is already committed under {dst.uri} by another save; the memory "
            "snapshot was not promoted and nothing was overwritten"
        )
    check_writable(dst, step, manifest.attempt)
    copied = 0
    for name, entry in manifest.files.items():
        copied += _copy_verified(src, dst, step, name, entry)
    commit_manifest(dst, step, data)  # the commit marker, last; then latest
    log.info("promoted memory snapshot of step %d to %s (%d bytes)", step, dst.uri, copied)
    return copied + len(data)
