"""Restore: which step every rank loads, from which tier, and what happens when one fails.

:class:`Restorer` is the Checkpointer's ``restore()``: rank 0 lists the step directories and
every rank learns the list, every rank says which memory-tier snapshots it can load, and the
candidates are tried newest first (at the same step the memory tier first, it is faster to
read). After each load every rank learns the worst verdict of all ranks, so that all load the
same step or fail the same way: a step without a manifest is skipped, a bad one (checksum,
truncation, invalid manifest) falls back to the next older step with a WARNING, one that
cannot be read now or by this version raises :class:`~trainer_sdk.errors.UnreadableCheckpointError`,
one that does not fit this run raises :class:`~trainer_sdk.loop._training_state.ResumeError`; a
memory snapshot that cannot be loaded is never a reason to stop (the durable tier is the
ground truth). Then ``BATON_RESUME_STEP`` is checked, the snapshots of a run that is gone are
cleared, and a step restored from the memory tier that is not durable yet is promoted.

The writing it needs (the attempt in the fence, the write probe, the promotion, the record the
policies count from) is the save engine's (:mod:`trainer_sdk.loop._save_engine`), which it is
handed; it holds no reference to the Checkpointer.
"""

from __future__ import annotations

import logging
from typing import Any, Final

from trainer_sdk import api
from trainer_sdk.errors import CheckpointError, UnreadableCheckpointError
from trainer_sdk.format import _catalog
from trainer_sdk.format.layout import FILE_RE, step_dir
from trainer_sdk.loop._config import env_number
from trainer_sdk.loop._memory_tier import RestoreInfo
from trainer_sdk.loop._reuse import frozen_storages
from trainer_sdk.loop._save_engine import RankParts, SaveEngine
from trainer_sdk.loop._training_state import ResumeError
from trainer_sdk.saveload._collectives import all_gather_json, broadcast_json
from trainer_sdk.storage import Storage
from trainer_sdk.wire import Tier

__all__ = ["Restorer"]

log = logging.getLogger("trainer_sdk.checkpointer")


# Load verdicts, ordered so that the maximum over the ranks is the worst.
_LOAD_OK: Final = 0
_LOAD_SKIP: Final = 1
"""No manifest: the step never committed; silently not a candidate."""
_LOAD_FALL_BACK: Final = 2
"""The checkpoint is bad (checksum, truncation, invalid manifest): WARNING, next older step."""
_LOAD_UNREADABLE: Final = 3
"""It cannot be read now or by this version: raise, never fall back past it."""
_LOAD_FATAL: Final = 4
"""It does not fit this run (shapes, keys, settings): raise ResumeError."""
_VERDICTS: Final = {
    "incomplete": _LOAD_SKIP,
    "bad": _LOAD_FALL_BACK,
    "unreadable": _LOAD_UNREADABLE,
    "other": _LOAD_FATAL,
}


class Restorer:
    """Loads the newest step every rank can load; see the module docstring.

    Built once by the Checkpointer, on every rank, with the parts it built; ``restore`` is
    called by every rank at the same point (each of its collectives is bounded).
    """

    def __init__(self, parts: RankParts, *, engine: SaveEngine) -> None:
        self.parts = parts
        self._engine = engine
        self.restored = RestoreInfo(step=0, tier=None, uri=None)
        """What the last restore loaded (unchanged by one that found nothing)."""

    def restore(self) -> int:
        """What :meth:`Checkpointer.restore <trainer_sdk.checkpointer.Checkpointer.restore>`
        does (see its docstring): load the newest step every rank can load, from either tier,
        into the objects; return the step to continue from (0 when there is none)."""
        expected = env_number("BATON_RESUME_STEP", int)
        self._engine.register_attempt()
        steps = self._agreed_steps()
        snapshots = self._agreed_snapshots() if self.parts.fast is not None else []
        if not self.parts.estimator.measured:
            self._engine.probe()
        loaded, tier, root = self._load_newest(steps, snapshots)
        self._check_expected(expected, loaded)
        if self.parts.fast is not None:
            self._clear_snapshots(keep=loaded if tier == Tier.MEMORY else None)
        if loaded is None:
            log.info("no checkpoint under %s: starting from step 0", self.parts.config.uri)
            return 0
        memory_on = self.parts.fast is not None
        if memory_on and tier == Tier.DURABLE and not snapshots and self.parts.rank == 0:
            # The memory tier is on but had no step every rank could load (a pod and the
            # holder of its replica both lost, say): the steps since this one are lost.
            log.warning(
                "resumed from durable step %d (%s): no memory snapshot was loadable by every "
                "rank (see the warnings above for which rank lacked what)",
                loaded,
                root,
            )
        else:
            log.info("resumed from step %d of the %s tier (%s)", loaded, tier, root)
        self.restored = RestoreInfo(
            step=loaded, tier=None if tier is None else tier.value, uri=root
        )
        self._engine.restored(loaded, durable=tier == Tier.DURABLE)
        if tier == Tier.DURABLE:
            self.parts.reporter.update(
                last_committed_step=loaded, restored_step=loaded, restored_tier=Tier.DURABLE.value
            )
        else:
            self.parts.reporter.update(restored_step=loaded, restored_tier=Tier.MEMORY.value)
            if self._needs_promotion(loaded):
                self._engine.promote(loaded)
        return loaded

    def _load_newest(
        self, steps: list[int], snapshots: list[int]
    ) -> tuple[int | None, Tier | None, str | None]:
        """Try the durable ``steps`` and memory ``snapshots`` newest first (at the same step the
        memory tier first: it is faster to read) until every rank loaded one; return it, its
        tier and the root of the last candidate tried (the uri when there was none)."""
        candidates: list[tuple[int, Tier]] = sorted(
            [(s, Tier.DURABLE) for s in steps] + [(s, Tier.MEMORY) for s in snapshots],
            key=lambda c: (c[0], c[1] == Tier.MEMORY),
            reverse=True,
        )
        loaded: int | None = None
        tier: Tier | None = None
        root = self.parts.config.uri
        for candidate, where in candidates:
            fast = self.parts.fast
            storage = self.parts.storage if where == Tier.DURABLE or fast is None else fast.storage
            root = self.parts.config.uri if where == Tier.DURABLE else storage.uri
            error: BaseException | None = None
            verdict = _LOAD_OK
            try:
                self._load(candidate, storage)
            except ResumeError as e:
                error, verdict = e, _LOAD_FATAL
            except Exception as e:
                error, verdict = e, _VERDICTS[api.classify_load_error(e)]
            verdict, who = self._worst(verdict, candidate)
            if verdict == _LOAD_OK:
                loaded, tier = candidate, where
                break
            if where == Tier.MEMORY and verdict != _LOAD_FATAL:
                # The durable tier is the ground truth: a snapshot that cannot be read is
                # never a reason to stop, whatever the cause.
                log.warning(
                    "the memory snapshot of step %d under %s could not be loaded (%s); "
                    "trying the next newest step (of either tier)",
                    candidate,
                    root,
                    error if error is not None else f"rank {who} failed to load it",
                )
                continue
            if verdict == _LOAD_SKIP:
                log.debug("step %d has no manifest (a save that never committed)", candidate)
                continue
            if verdict == _LOAD_UNREADABLE:
                if isinstance(error, UnreadableCheckpointError):
                    raise error
                raise UnreadableCheckpointError(
                    f"checkpoint step {candidate} under {root} cannot be read now or "
                    f"by this version on rank {who}: "
                    f"{error or 'see that rank' + chr(39) + 's log'}. It was left intact and "
                    "no older step was loaded (that would lose every step since): fix the "
                    "cause and restart",
                    step=candidate,
                ) from error
            if verdict == _LOAD_FATAL:
                # The checkpoint is readable but does not fit this run (other shapes, keys,
                # settings, dataset). An older step would not fit better, and starting from
                # zero would let retention delete the good checkpoints later: stop here.
                if isinstance(error, ResumeError):
                    raise error
                raise ResumeError(
                    f"checkpoint step {candidate} under {root} cannot be loaded into "
                    f"this run: {error or f'rank {who} failed to load it (see its log)'}. The "
                    "checkpoint is left intact: build the model, optimizer, scheduler, sampler "
                    "and extra state like the run that saved it, or start a new run under "
                    "another uri"
                ) from error
            log.warning(
                "checkpoint step %d could not be loaded, it is bad (%s); falling back to an "
                "older step (the bad step is kept for inspection)",
                candidate,
                error if error is not None else f"rank {who} failed to load it",
            )
        return loaded, tier, root

    def _check_expected(self, expected: int | None, loaded: int | None) -> None:
        """Compare the step loaded with ``BATON_RESUME_STEP``: a newer one is fine, an older
        one (or none) raises unless ``resume_fallback``."""
        if expected is not None and (loaded is None or loaded < expected):
            msg = (
                f"BATON_RESUME_STEP={expected} but the newest loadable checkpoint under "
                f"{self.parts.config.uri} is {'none' if loaded is None else f'step {loaded}'}"
            )
            if not self.parts.config.resume_fallback:
                raise ResumeError(
                    f"{msg}: check the storage, or pass resume_fallback=True to resume from the "
                    "newest loadable step"
                )
            log.error("%s; resuming from it instead (steps since it are lost)", msg)
        elif expected is not None and loaded is not None and loaded > expected:
            log.info(
                "BATON_RESUME_STEP=%d but the newer step %d is complete; resuming from it",
                expected,
                loaded,
            )

    def _load(self, step: int, storage: Storage) -> None:
        self.parts.reuse.forget()  # whatever this load writes, the record is rebuilt from it
        objects = self.parts.objects
        try:
            manifest = _catalog.read_manifest(storage, step)
        except Exception:  # api.load below meets it again, on every rank together
            manifest = None
        laid_out = manifest is not None and objects.lay_out_optimizer(manifest)
        state = objects.build(step)
        try:
            info = api.load(
                state,
                storage,
                step=step,
                process_group=self.parts.group,
                timeout=self.parts.config.timeout.total_seconds(),
                # The durable tier: api.load's choice (each byte read once on S3). A memory
                # snapshot is in each pod's own memory, where every rank reading its own copy
                # is faster.
                cooperative=None if storage is self.parts.storage else False,
            )
        except BaseException:
            if laid_out:
                objects.forget_laid_out()  # the next step tried starts from no state again
            raise
        note = self.parts.objects.apply(state, info, step)
        if note is not None:
            self._engine.resume_note = note
        if storage is self.parts.storage:
            # A durable step: the next durable save may reference what it holds. A memory
            # snapshot's files live in fast_dir, which durable steps never reference: after a
            # restore from one, the next durable save writes everything.
            flat = api.flatten(self.parts.objects.for_save(step))
            self.parts.reuse.restored(_catalog.read_manifest(storage, step), flat, self._frozen())

    def _frozen(self) -> set[int]:
        return frozen_storages(self.parts.objects.model)

    def _needs_promotion(self, step: int) -> bool:
        """After a restore from the memory tier: whether to promote the snapshot of ``step``
        (every rank learns rank 0's answer; bounded). Yes when the step is not durable (a
        notice's promotion cut short by its node's end, or a node lost between durable
        saves), so that losing every copy in memory later cannot lose it; not when the world
        size changed (every rank copies its own files, and the new ranks have none: the next
        durable save makes a later step durable)."""
        assert self.parts.fast is not None
        promote = False
        if self.parts.rank == 0:
            try:
                names = self.parts.fast.storage.list_dir(step_dir(step))
            except OSError:
                names = []
            worlds = {int(m.group(2)) for n in names if (m := FILE_RE.fullmatch(n))}
            if self.parts.storage.exists(_catalog.manifest_key(step)):
                promote = False
            elif worlds != {self.parts.world_size}:
                log.info(
                    "the memory snapshot of step %d (world %s) is not promoted at this world "
                    "size (%d); the next durable save makes a later step durable",
                    step,
                    sorted(worlds),
                    self.parts.world_size,
                )
            else:
                promote = True
                log.warning(
                    "step %d was restored from the memory tier and is not durable yet: "
                    "promoting it to %s in the background",
                    step,
                    self.parts.config.uri,
                )
        if self.parts.group is not None:
            promote = broadcast_json(
                promote,
                group=self.parts.group,
                timeout=self.parts.config.timeout.total_seconds(),
                what="restore: promoting the memory snapshot",
            )
        return bool(promote)

    def _agreed_steps(self) -> list[int]:
        """Rank 0's list of step directories (complete or not), on every rank; bounded."""
        steps = api.step_dirs(self.parts.storage) if self.parts.rank == 0 else []
        if self.parts.group is None:
            return steps
        return [
            int(s)
            for s in broadcast_json(
                steps,
                group=self.parts.group,
                timeout=self.parts.config.timeout.total_seconds(),
                what="restore: listing the checkpoints",
            )
        ]

    def _agreed_snapshots(self) -> list[int]:
        """The memory-tier snapshots that every rank can load, newest first; bounded. A rank
        that cannot load the newest one (its pod was replaced, its emptyDir is empty, a file
        is missing) holds the whole group to an older step, or to the durable tier."""
        assert self.parts.fast is not None
        ok, why = self.parts.fast.local_steps()
        mine: list[Any] = [ok, {str(s): r for s, r in why.items()}]
        raw = (
            [mine]
            if self.parts.group is None
            else all_gather_json(
                mine,
                group=self.parts.group,
                timeout=self.parts.config.timeout.total_seconds(),
                what="restore: listing the memory snapshots",
            )
        )
        loadable = [{int(s) for s in view[0]} for view in raw]
        reasons: list[dict[str, str]] = [dict(view[1]) for view in raw]
        common = set.intersection(*loadable)
        newest = max(set.union(*loadable), default=None)
        if self.parts.rank == 0 and newest is not None and newest not in common:
            lacking = [
                f"rank {r} ({reasons[r].get(str(newest), 'no such snapshot')})"
                for r, have in enumerate(loadable)
                if newest not in have
            ]
            log.warning(
                "the memory snapshot of step %d cannot be loaded by %s: the group restores from "
                "the newest step every rank can load (%s)",
                newest,
                ", ".join(lacking),
                f"memory snapshot {max(common)}, or a newer durable step"
                if common
                else "a durable checkpoint",
            )
        return sorted(common, reverse=True)

    def _clear_snapshots(self, *, keep: int | None) -> None:
        """After a restore: delete the snapshots of a run that is gone (every one but ``keep``),
        then wait for every rank, so that no new snapshot starts before its step is free."""
        assert self.parts.fast is not None
        error: str | None = None
        try:
            self.parts.fast.clear(keep=keep)
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
        errors = (
            [error]
            if self.parts.group is None
            else all_gather_json(
                error,
                group=self.parts.group,
                timeout=self.parts.config.timeout.total_seconds(),
                what="restore: clearing old memory snapshots",
            )
        )
        failed = {r: e for r, e in enumerate(errors) if e is not None}
        if failed:
            r = min(failed)
            raise CheckpointError(
                f"rank {r} could not delete old memory snapshots under {self.parts.fast.uri}: "
                f"{failed[r]}. A new snapshot of their step would be refused; check the "
                "directory's permissions, or empty it and restart"
            )

    def _worst(self, verdict: int, step: int) -> tuple[int, int]:
        """The worst load verdict of all ranks and the first rank that has it; bounded."""
        if self.parts.group is None:
            return verdict, self.parts.rank
        verdicts = all_gather_json(
            verdict,
            group=self.parts.group,
            timeout=self.parts.config.timeout.total_seconds(),
            what=f"restore: loading step {step}",
        )
        worst = max(int(v) for v in verdicts)
        return worst, next(r for r, v in enumerate(verdicts) if int(v) == worst)
