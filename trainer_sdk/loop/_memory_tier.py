"""The memory tier: a snapshot of the whole training state every few steps, in the pod's memory.

A durable save to object storage is too slow to take every step, so a node lost without
notice costs every step since the last one. The memory tier closes that gap: every
``fast_every_steps`` steps each rank writes its share of the state into ``fast_dir`` (an
``emptyDir`` with ``medium: Memory`` in Kubernetes, shared by the processes of one pod) in the
*same* format v1 layout as the durable tier: shards, JSON files, and a ``manifest.json``
written last as the commit marker. So a snapshot is read by the ordinary loader, and
:func:`trainer_sdk.promote` (:mod:`trainer_sdk.loop._promotion`) copies one to durable
storage unchanged.

Who calls what, and in which order (every rank alike, at the same step):

* ``Checkpointer.step`` calls :meth:`MemoryTier.snapshot` after any durable save of that
  step. It waits for the previous snapshot's write (normally long finished), copies the state
  into this tier's own host buffers (pinned when the state is on a GPU: the async staging path
  of :mod:`trainer_sdk.staging`) and returns; that copy is all a snapshot costs the step.
* The tier's worker thread (its own thread, buffers and gloo group, at lower CPU priority)
  writes this rank's files, gathers every rank's record, and then each pod's first process
  (``LOCAL_RANK`` 0) writes the manifest into its ``fast_dir``; a last gather tells every rank
  that every pod committed. Only then are older snapshots deleted: at most the newest complete
  snapshot and the one being written exist, and a snapshot cut short (a killed process, a
  full ``emptyDir``) has no manifest and is never read.
* ``Checkpointer.restore`` asks :func:`complete_steps` on every rank, keeps the steps every
  rank can load, and tries them with the durable steps, newest first (see ``restore``).
* A notice whose deadline is too short for a durable save may commit here instead
  (:meth:`MemoryTier.commit`, when every pod's snapshots replicate and were measured fast
  enough), and then the tier's :class:`~trainer_sdk.loop._promotion.Promotion` copies that
  snapshot to the checkpoint uri, every rank its own files, rank 0 the manifest last. A
  restore from a snapshot that is not durable yet (its promotion was cut short by the node's
  end) promotes it the same way.

The durable tier never waits for this one: a durable or notice save does not wait for a
snapshot in flight (they use other threads, buffers and process groups), and the snapshot
writer yields the CPU to them.

The promotion to durable storage is its own module, :mod:`trainer_sdk.loop._promotion`: it
shares with the snapshots only the step it pins, which :meth:`MemoryTier._delete_older` asks
it about.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final

import torch

from trainer_sdk import api
from trainer_sdk.errors import (
    CheckpointError,
)
from trainer_sdk.format.layout import (
    BLOCK_SIZE,
    parse_step_dir,
    step_dir,
)
from trainer_sdk.loop._deadline import SaveEstimator
from trainer_sdk.loop._promotion import (
    Promotion,
    delete_snapshot,
    error_json,
    missing,
    raise_failures,
)
from trainer_sdk.replication import FILL, REPLICATE, SidecarLink
from trainer_sdk.saveload._collectives import all_gather_json, group_rank_world
from trainer_sdk.saveload._committing import build_manifest, commit_manifest
from trainer_sdk.saveload._saving import write_rank
from trainer_sdk.staging import AsyncSaveHandle, AsyncSaver
from trainer_sdk.storage import Storage
from trainer_sdk.storage.local import LocalStorage

__all__ = [
    "TRIGGER",
    "MemoryTier",
    "RestoreInfo",
    "complete_steps",
]

log = logging.getLogger("trainer_sdk.memory_tier")

TRIGGER: Final = "memory"
"""The ``trigger`` a snapshot's manifest records (kept when it is promoted)."""
SPARES: Final = ".spare"
"""The directory in ``fast_dir`` that keeps the shard files of the snapshot last deleted, for
the next snapshot to overwrite (:meth:`LocalStorage.recycle_tree`): writing a new file on
tmpfs costs about 4x the CPU of overwriting one (the kernel allocates, zeroes and later frees
every page), and that CPU comes out of the training step beside it. Not a step directory:
nothing lists or replicates it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RestoreInfo:
    """What ``Checkpointer.restore`` loaded (``Checkpointer.restored``)."""

    step: int
    """The step loaded; 0 when there was none."""
    tier: str | None
    """The value of :class:`~trainer_sdk.wire.Tier` loaded from: ``"memory"`` (the snapshot in
    ``fast_dir``), ``"durable"`` (the checkpoint uri), or ``None`` when nothing was loaded."""
    uri: str | None
    """The root the step was read from."""


def complete_steps(storage: Storage) -> tuple[list[int], dict[int, str]]:
    """Snapshots under ``storage`` that this process can load (newest first), and why each
    other step directory cannot be loaded."""
    ok: list[int] = []
    why: dict[int, str] = {}
    for name in reversed(storage.list_dir("")):
        step = parse_step_dir(name)
        if step is None:
            continue
        reason = missing(storage, step)
        if reason is None:
            ok.append(step)
        else:
            why[step] = reason
    return ok, why


class MemoryTier:
    """One rank's side of the memory tier: writes snapshots to ``fast_dir``, lists them.

    Build it on every rank at the same point (it creates a gloo process group collectively,
    for the writer's collectives). ``local_rank`` 0 writes each manifest into its pod's
    ``fast_dir`` and deletes older snapshots there. With ``control_dir`` and a sidecar that
    replicates (:mod:`trainer_sdk.replication`), ``local_rank`` 0 also has each committed
    snapshot copied to the peers before older ones are deleted, and fills ``fast_dir`` from
    the peers before a restore lists it.

    The snapshot, the notice's commit and the restore from memory read and change the same
    few fields (the staging buffers and saver, the peers' replicas); the promotion of a
    snapshot to durable storage is :attr:`promotion` (:mod:`trainer_sdk.loop._promotion`).
    """

    def __init__(
        self,
        fast_dir: str,
        *,
        every_steps: int | None,
        local_rank: int,
        timeout: timedelta,
        control_dir: str | None = None,
    ) -> None:
        if "://" in fast_dir and not fast_dir.startswith("file://"):
            raise CheckpointError(
                f"fast_dir={fast_dir!r}: the memory tier is a local directory (an emptyDir "
                "with medium: Memory in Kubernetes); use a path, and put durable checkpoints "
                "under the checkpoint uri"
            )
        os.makedirs(fast_dir.removeprefix("file://"), exist_ok=True)
        self.storage = LocalStorage.from_uri(fast_dir, spares=SPARES)
        self.every_steps = every_steps
        self.local_rank = local_rank
        self.saver = AsyncSaver(timeout=timeout)
        self.rank, self.world = group_rank_world(self.saver.group)
        self.last_committed: int | None = None
        """The newest snapshot this process committed."""
        self.last_replicated: int | None = None
        """The newest snapshot every pod's sidecar copied to its peers (None: none yet)."""
        self._replication_error: str | None = None
        self.link: SidecarLink | None = (
            SidecarLink(control_dir) if control_dir and local_rank == 0 else None
        )
        self.estimator = SaveEstimator()
        """Measured seconds of replicated snapshots, from the start of the copy to every pod's
        replica (what a notice committing here would wait for)."""
        self.promotion = Promotion(
            self.storage, rank=self.rank, world=self.world, timeout=self.saver.timeout
        )
        """Copies a snapshot to durable storage in the background (a notice's, or one restored
        before it was durable); the snapshot it copies is kept here until it is durable."""

    @property
    def uri(self) -> str:
        return self.storage.uri

    def due(self, step: int) -> bool:
        """Whether ``step`` is a snapshot step."""
        return self.every_steps is not None and step % self.every_steps == 0

    def snapshot(
        self,
        step: int,
        flat: api.FlatState,
        plan: api.SavePlan,
        *,
        attempt: int | None,
        extra: Mapping[str, Any] | None = None,
        defer: Callable[[Mapping[str, torch.Tensor]], Collection[str]] | None = None,
    ) -> AsyncSaveHandle[int]:
        """Stage ``step`` and write it in the background; returns after the copy (of all but
        the tensors ``defer`` names: :meth:`~trainer_sdk.staging.AsyncSaver.submit`).

        Waits for the previous snapshot first: if it failed, raises :class:`CheckpointError`
        (on every rank: its collectives told every rank)."""
        try:
            self.saver.wait_previous()
        except BaseException as e:
            raise CheckpointError(
                f"a memory-tier snapshot failed: {e}. Durable checkpoints are unaffected. If "
                f"{self.uri} is full, raise the emptyDir's sizeLimit (and the pod's memory "
                "request) to 2x the state's size per pod (docs/checkpointer.md, 'The memory "
                "tier'), or turn the tier off (fast_every_steps=None)"
            ) from e
        live = flat.tensors()
        keys = plan.keys  # a property that builds a set: once, not once per tensor
        to_stage = {k: live[k] for k in flat.entries if k in keys}
        started = time.perf_counter()

        def work(staged: dict[str, torch.Tensor], tree: Any) -> int:
            self._write(step, plan, staged, tree, flat, attempt=attempt, extra=extra)
            if self.last_replicated == step:
                # copy, write, commit and replication, as a notice would wait for them
                self.estimator.record(plan.nbytes, time.perf_counter() - started)
            return step

        return self.saver.submit(
            step=step, tensors=to_stage, json_tree=flat.tree, work=work,
            defer=defer(to_stage) if defer is not None else (),
        )  # fmt: skip

    def _write(
        self,
        step: int,
        plan: api.SavePlan,
        staged: Mapping[str, torch.Tensor],
        tree: Any,
        flat: api.FlatState,
        *,
        attempt: int | None,
        extra: Mapping[str, Any] | None,
    ) -> int:
        """The worker thread's part: files, records, manifest, then older snapshots go."""
        t0 = time.perf_counter()
        group = self.saver.group
        timeout = self.saver.timeout.total_seconds()
        own: dict[str, Any]
        try:
            own = write_rank(self.storage, plan, staged, tree, step=step, flat=flat).to_json()
        except Exception as e:
            if self.world == 1:
                raise
            own = error_json(self.rank, e)
        records: list[dict[str, Any]] = all_gather_json(
            own, group=group, timeout=timeout, what=f"memory snapshot of step {step}"
        )
        raise_failures(records, step, "writing its files")
        manifest = build_manifest(
            records, step=step, trigger=TRIGGER, block_size=BLOCK_SIZE, extra=dict(extra or {})
        )
        manifest = dataclasses.replace(manifest, attempt=attempt or 0)
        outcome: dict[str, Any] = {"ok": True}
        if self.local_rank == 0:
            try:
                # Not re-parsed here, unlike a durable commit (a tenth of a small model's write):
                # a snapshot readers refuse only sends restore to the durable tier. Compact
                # (the C encoder): the indented form was a third of a small model's write.
                data = manifest.to_json_bytes(indent=None)
                commit_manifest(self.storage, step, data, latest=False)
            except Exception as e:
                if self.world == 1:
                    raise
                outcome = error_json(self.rank, e)
        if self.world > 1:
            outcomes = all_gather_json(
                outcome, group=group, timeout=timeout, what=f"memory snapshot of step {step}"
            )
            raise_failures(outcomes, step, "writing the manifest")
        self.last_committed = step
        # Replication starts only once every pod has committed the step (so a replica of any
        # pod implies a complete snapshot in every other pod), and older snapshots go only
        # once every pod's copy has ended: until then an older step may be the newest that
        # survives the loss of any one node. A copy that failed does not keep them (memory
        # stays bounded; the failure is in the log and the sidecar's status, and restore
        # falls back to the durable tier).
        replicated = self._replicate(step, timeout) if self.local_rank == 0 else None
        views = [replicated]
        if self.world > 1:
            views = all_gather_json(
                replicated, group=group, timeout=timeout, what=f"replicating step {step}"
            )
        if any(v is not None for v in views) and all(v is not False for v in views):
            self.last_replicated = step
        if self.local_rank == 0:
            self._delete_older(step)
        log.debug("memory snapshot of step %d in %.3fs", step, time.perf_counter() - t0)
        return step

    def _delete_older(self, committed: int) -> None:
        """Delete every snapshot directory older than ``committed`` (complete or not), except
        one being promoted; the newest of them leaves its shard files as spares for the next
        snapshot (:data:`SPARES`). Nothing reads them any more: a restore, the only reader of
        an older snapshot, never runs beside a snapshot, and the sidecar sends a step while
        the tier waits for it. (A sidecar still sending it after the tier stopped waiting,
        half the collective timeout, would read overwritten bytes; the receiving peer checks
        every file against the manifest's digests and refuses such a replica, as any cut
        short.)"""
        older = [
            step
            for step in map(parse_step_dir, self.storage.list_dir(""))
            if step is not None and step < committed and not self.promotion.holds(step)
        ]
        for old in sorted(older):
            if old == max(older):
                try:
                    self.storage.recycle_tree(step_dir(old))
                except OSError as e:
                    log.warning("could not recycle memory snapshot of step %d: %s", old, e)
                    delete_snapshot(self.storage, old)
            else:
                delete_snapshot(self.storage, old)

    def _replicate(self, step: int, timeout: float) -> bool | None:
        """Have the pod's sidecar copy ``step`` to its peers (``LOCAL_RANK`` 0; bounded by
        half the collective timeout, so that the other ranks' gather never times out on it).
        None when no sidecar replicates for this pod."""
        if self.link is None or not self.link.available():
            return None
        answer = self.link.call(REPLICATE, step=step, timeout=timeout / 2)
        if not answer.ok:
            # once per distinct error, not once per snapshot (the sidecar's status and
            # metrics count every failure)
            if answer.error != self._replication_error:
                log.warning(
                    "the memory snapshot of step %d was not replicated to a peer: %s. It "
                    "survives only in this pod; if its node is lost, restore uses the durable "
                    "tier. Later snapshots that fail the same way are not logged again",
                    step,
                    answer.error,
                )
            self._replication_error = answer.error
            return False
        if self._replication_error is not None:
            log.info("memory snapshots are replicated again (step %d)", step)
        self._replication_error = None
        log.debug("memory snapshot of step %d replicated to %s", step, ", ".join(answer.peers))
        return True

    def fill_from_peers(self) -> None:
        """Before a restore lists the snapshots: ``LOCAL_RANK`` 0 has the pod's sidecar fetch
        from its peers the files of the newest snapshot that this pod lacks (other pods'
        ranks; all of them when the pod was replaced), verified; then every rank waits for
        every pod (a collective), so that no rank lists its ``fast_dir`` while it is filled."""
        outcome: dict[str, Any] = {"ok": True}
        if self.link is not None and self.link.available():
            t0 = time.perf_counter()
            answer = self.link.call(FILL, step=None, timeout=self.saver.timeout.total_seconds() / 2)
            if answer.ok and answer.step is not None:
                log.info(
                    "memory snapshot of step %d completed from peers into %s (%d bytes fetched "
                    "in %.2fs)",
                    answer.step,
                    self.uri,
                    answer.bytes,
                    time.perf_counter() - t0,
                )
            elif answer.ok:
                log.debug("no memory snapshot here or at any peer (a first start)")
            else:
                log.warning(
                    "no memory snapshot could be completed from peers into %s: %s",
                    self.uri,
                    answer.error,
                )
            outcome = {"ok": answer.ok, "step": answer.step}
        if self.world > 1:
            all_gather_json(
                outcome,
                group=self.saver.group,
                timeout=self.saver.timeout.total_seconds(),
                what="restore: filling the memory tier from peers",
            )

    def local_steps(self) -> tuple[list[int], dict[int, str]]:
        """Snapshots this process can load (newest first), and why others cannot; filled from
        the peers first (:meth:`fill_from_peers`). Call it on every rank (a collective)."""
        self.fill_from_peers()
        return complete_steps(self.storage)

    def clear(self, *, keep: int | None) -> None:
        """Delete every snapshot but ``keep`` (``LOCAL_RANK`` 0 only): after a restore, newer
        snapshots are from a run that is gone, and a new snapshot of their step must not
        find them."""
        if self.local_rank != 0:
            return
        for name in self.storage.list_dir(""):
            step = parse_step_dir(name)
            if step is not None and step != keep:
                self.storage.delete_tree(step_dir(step))

    def wait(self) -> None:
        """Wait for the snapshot in flight; raise its failure."""
        self.saver.wait_previous()

    # ---- notices and promotion ------------------------------------------------------------

    def notice_estimate(self, nbytes: int) -> float:
        """Seconds a notice committing ``nbytes`` here would take on this rank (measured:
        the slowest recent replicated snapshot), or ``math.inf`` when this tier cannot take
        a notice: no snapshot was replicated by every pod yet, or this pod's sidecar stopped
        replicating (a snapshot only in the memory of a node that is going away is lost)."""
        if self.last_replicated is None:
            return math.inf
        if self.local_rank == 0 and (self.link is None or not self.link.available()):
            return math.inf
        estimate = self.estimator.estimate(nbytes)
        return math.inf if estimate is None else estimate

    def commit(
        self, step: int, flat: api.FlatState, plan: api.SavePlan, *, attempt: int | None
    ) -> bool:
        """Snapshot ``step`` now and wait for its commit and replication (every rank, at the
        same step); returns whether every pod's replica of it exists. Raises the snapshot's
        failure."""
        self.snapshot(step, flat, plan, attempt=attempt)
        self.saver.wait_previous()
        return self.last_replicated == step

    def close(self) -> None:
        """Wait for the snapshot and a promotion in flight (a failure is logged: the durable
        tier is what a closing run relies on) and stop the writers."""
        try:
            self.saver.close()
        except Exception as e:
            log.warning("rank %d: the last memory snapshot failed: %s", self.rank, e)
        self.promotion.close()
