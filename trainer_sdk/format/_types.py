"""The two plug-in types of a checkpointable state: :class:`Stateful` and :class:`RankLocal`.

Torch-free on purpose (these are cheap to import and to ``isinstance``-check).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

__all__ = ["RankLocal", "Stateful"]

T = TypeVar("T")


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` / ``load_state_dict()``: models, optimizers, schedulers,
    grad scalers, samplers, your own objects.

    On save, ``state_dict()`` is called and its result saved like any other value. On load, the
    saved sub-tree is restored (tensors copied into the tensors of the current ``state_dict()``
    where shapes match, so no extra full copy is made) and passed to ``load_state_dict()``.
    """

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any], /) -> Any: ...


@dataclass(slots=True)
class RankLocal(Generic[T]):
    """Marks a value that differs per rank (RNG states, per-rank data cursors).

    It is saved into the rank's own files. On load with the same world size every rank gets its
    own value back, in place. With a different world size, ranks below the saved world size get
    theirs, and the others get nothing: the key is listed in ``LoadInfo.missing_rank_local``
    and the value is left as it was, never silently replaced by another rank's.

    ``value`` may be anything a state may hold (tensors, dicts, lists, JSON values, Stateful).
    Under one process (no process group) it behaves like the plain value.
    """

    value: T
    """The wrapped per-rank value."""
