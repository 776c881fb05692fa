"""Incremental steps: reference frozen, unchanged tensors in earlier steps instead of rewriting.

Why: a LoRA fine-tune's base weights never change, and rewriting them at every save makes each
save as large as the model (and a notice save impossible within its window). Format v3 lets a
step's manifest reference the pieces an earlier step of the same root committed
(``docs/format.md``, "References"); this module decides, soundly, which tensors a save may
reference, and remembers what it needs to decide at the next save.

The rule, per tensor (never a guess): it is referenced only if

* it is part of the model and not trained: it lives in the storage of a parameter that does
  not require grad or of a buffer of the model (and shares none with a parameter that does),
  and is not ``rank_local``. Optimizer state and other tensors are always written (they change
  whenever the model trains);
* the save or the durable restore that last touched it (this process wrote it to, or loaded
  it from, a committed step) saw the very same tensor: same storage (held by the record, so
  its memory cannot be reused by another tensor meanwhile), offset, shape, stride, dtype and
  device, and the same ``t._version``. Every in-place write through autograd's view of the
  tensor bumps the version (``copy_``, ``add_``, ``mul_`` under ``torch.no_grad()``, a
  ``load_state_dict``; Baton's own loads, which write straight into memory, bump it too), so
  a modified buffer or a hand-edited frozen weight is written again.
  Writes that bypass the version counter (through ``.data``, numpy, DLPack, a custom kernel)
  are not seen: set ``full_every_steps=1`` for models that do that to frozen tensors;
* every rank says so, with the same committed entry (one small JSON all-gather before the
  plan, so every rank plans the same pieces);
* the step that holds its bytes is less than ``full_every_steps`` steps old (when that is set).

References always name the step whose directory holds the file (never a step that references
it in turn), so a chain is one hop long. The committer checks each referenced file against
the committed manifests and its size (``_committing._check_references``); retention keeps
referenced files (``_catalog.retain``). A save that fails forgets the record: the next one
writes everything again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from trainer_sdk import api
from trainer_sdk.format.layout import FileEntry, Manifest, TensorEntry, ref_key
from trainer_sdk.saveload._collectives import all_gather_json

__all__ = ["Reuse", "frozen_storages"]

_Ident = tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class _Seen:
    """A tensor as a committed step holds it."""

    storage: Any
    """The tensor's untyped storage, held so that its memory cannot be reused by another
    tensor while the record stands (an equal data pointer then means the same storage)."""
    ident: _Ident
    version: int
    entry: TensorEntry
    """Its manifest entry, every piece naming a reference key of ``files``."""
    files: Mapping[str, FileEntry]
    """Reference key -> the committed entry of the shard, with the step that holds it."""

    @property
    def origin(self) -> int:
        """The oldest step whose files hold its bytes."""
        return min(f.step for f in self.files.values() if f.step is not None)

    @property
    def signature(self) -> str:
        """Equal on every rank that recorded the same committed entry."""
        obj = [self.entry.to_json(), {k: f.to_json() for k, f in sorted(self.files.items())}]
        return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:32]


def _capture(t: torch.Tensor) -> tuple[Any, _Ident, int] | None:
    """(storage, identity, version) of ``t``, or None when it cannot be tracked soundly."""
    if t.is_meta or t.is_inference():
        return None  # inference tensors have no version counter
    try:
        storage = t.untyped_storage()
        version = int(t._version)
    except (RuntimeError, NotImplementedError):
        return None
    ident = (
        str(t.device),
        storage.data_ptr(),
        t.storage_offset(),
        tuple(t.shape),
        tuple(t.stride()),
        t.dtype,
    )
    return storage, ident, version


def frozen_storages(model: torch.nn.Module | None) -> set[int]:
    """Data pointers of the storages of the model's frozen tensors: parameters that do not
    require grad, and buffers (a buffer that changes bumps its version and is written again).
    Only tensors in these storages are ever referenced. A frozen parameter may sit in the
    optimizer (``AdamW(model.parameters())``): it never gets a gradient, so no optimizer step
    touches it, and one that does bumps its version."""
    if model is None:
        return set()
    tensors: list[torch.Tensor] = [p for p in model.parameters() if not p.requires_grad]
    tensors += list(model.buffers())
    trained = {storage_ptr(p) for p in model.parameters() if p.requires_grad}
    return {storage_ptr(t) for t in tensors} - trained


def optimizer_storages(optimizer: torch.optim.Optimizer | None) -> set[int]:
    """Data pointers of the storages that only ``optimizer.step()`` changes: its parameters'
    and its state's (``exp_avg``, ...). What a save may copy in the background while the next
    forward and backward run, if the step waits for the copy (``stage_in_background``)."""
    if optimizer is None:
        return set()
    tensors = [p for group in optimizer.param_groups for p in group["params"]]
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return {storage_ptr(t) for t in tensors} - {0}


def storage_ptr(t: torch.Tensor) -> int:
    """The data pointer of the storage of ``t`` (of its local shard, for a DTensor)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return int(local.untyped_storage().data_ptr())


def _resolve(m: Manifest, key: str) -> tuple[TensorEntry, dict[str, FileEntry]]:
    """``m``'s entry of ``key`` with every piece naming the step that holds its file."""
    entry = m.tensors[key]
    files: dict[str, FileEntry] = {}
    pieces = []
    for p in entry.pieces:
        f = m.files[p.file]
        if f.step is None:
            rk, f = ref_key(m.step, p.file), dataclasses.replace(f, step=m.step)
        else:
            rk = p.file
        files[rk] = f
        pieces.append(dataclasses.replace(p, file=rk))
    return dataclasses.replace(entry, pieces=tuple(pieces)), files


class Reuse:
    """This process's record of the tensors committed steps hold, and the save-time decision.

    Who calls what (the Checkpointer, every rank at the same points): :meth:`plan` when a
    durable save is planned (it runs one collective), :meth:`for_save` when that plan is
    written, :meth:`restored` after a durable restore. Not thread-safe by itself: an async
    save records its commit on the worker thread, and the next :meth:`plan` runs only after
    the Checkpointer has waited for it.
    """

    def __init__(self, *, full_every_steps: int, group: Any, timeout: float) -> None:
        self.full_every_steps = full_every_steps
        self.group = group
        self.timeout = timeout
        self._seen: dict[str, _Seen] = {}
        self._planned: tuple[api.SavePlan, api.References, dict[str, Any]] | None = None

    def _eligible(
        self, flat: api.FlatState, frozen: set[int]
    ) -> dict[str, tuple[Any, _Ident, int]]:
        out: dict[str, tuple[Any, _Ident, int]] = {}
        if self.full_every_steps == 1:
            return out
        for key, e in flat.entries.items():
            if e.kind == "rank_local" or e.tensor.requires_grad:
                continue
            got = _capture(e.tensor)
            if got is not None and got[1][1] in frozen:
                out[key] = got
        return out

    def plan(
        self, flat: api.FlatState, plan: api.SavePlan, step: int, frozen: set[int]
    ) -> api.SavePlan:
        """``plan`` without the pieces of the tensors this save references (the same on every
        rank); :meth:`for_save` of the returned plan gives the references."""
        if self.full_every_steps == 1:  # off: the same on every rank, so no collective
            return plan
        now = self._eligible(flat, frozen)
        mine: dict[str, str] = {}
        for key, (_, ident, version) in now.items():
            seen = self._seen.get(key)
            if seen is None or seen.ident != ident or seen.version != version:
                continue
            if self.full_every_steps and step - seen.origin >= self.full_every_steps:
                continue
            ent = flat.entries[key]
            if (ent.kind, ent.dtype, ent.global_shape) != (
                seen.entry.kind,
                seen.entry.dtype,
                seen.entry.shape,
            ):
                continue
            mine[key] = seen.signature
        agreed = all_gather_json(
            mine, group=self.group, timeout=self.timeout, what=f"save of step {step}: reuse"
        )
        keys = [k for k, sig in mine.items() if all(other.get(k) == sig for other in agreed)]
        files: dict[str, FileEntry] = {}
        tensors: dict[str, TensorEntry] = {}
        for key in keys:
            seen = self._seen[key]
            tensors[key] = seen.entry
            files.update(seen.files)
        reduced = dataclasses.replace(
            plan, pieces=tuple(p for p in plan.pieces if p.key not in tensors)
        )
        refs = api.References(files=files, tensors=tensors)
        self._planned = (reduced, refs, now)
        return reduced

    def for_save(
        self, plan: api.SavePlan
    ) -> tuple[api.References | None, Callable[[Manifest], None] | None]:
        """The references of ``plan`` (None unless :meth:`plan` made it) and the callback that
        records the committed manifest. Forgets the record until that commit: a save that
        fails (a referenced file gone, say) leaves the next one writing everything."""
        planned, self._planned = self._planned, None
        self._seen = {}
        if planned is None or planned[0] is not plan:
            return None, None
        _, refs, now = planned
        return refs, lambda m: self._record(m, now)

    def _record(self, m: Manifest, now: Mapping[str, tuple[Any, _Ident, int]]) -> None:
        seen: dict[str, _Seen] = {}
        for key, (storage, ident, version) in now.items():
            if key in m.tensors and m.tensors[key].kind != "rank_local":
                entry, files = _resolve(m, key)
                if files:
                    seen[key] = _Seen(storage, ident, version, entry, files)
        self._seen = seen

    def forget(self) -> None:
        """Drop the record: the next save writes everything (before a restore loads)."""
        self._seen = {}
        self._planned = None

    def restored(self, m: Manifest, flat: api.FlatState, frozen: set[int]) -> None:
        """After a durable restore of ``m``'s step: the tensors of ``flat`` (the state as the
        next save will flatten it) now hold ``m``'s bytes where their layout matches."""
        self._planned = None
        now = {
            k: v
            for k, v in self._eligible(flat, frozen).items()
            if k in m.tensors
            and (flat.entries[k].kind, flat.entries[k].dtype, flat.entries[k].global_shape)
            == (m.tensors[k].kind, m.tensors[k].dtype, m.tensors[k].shape)
        }
        self._record(m, now)
