"""The deadline of the save in progress, for the storage backends that retry (S3).

A save served on a notice must end before the node goes away. The checkpointer knows the
deadline; the storage layer, which decides whether a failed request is tried again, does not.
This module carries it between them without changing the storage protocol: the checkpointer
runs the save inside :func:`deadline_scope`, and a backend reads :func:`current` where a
request begins. A backend that moves work to its own threads reads it in the caller's thread
first (the S3 writer when it is opened, ``read_into`` when it is called), because a context
variable does not follow work into a thread pool.

The deadline is kept as a ``time.monotonic()`` instant, so that a clock step during the save
cannot stretch or shrink it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

__all__ = ["current", "deadline_scope"]

_DEADLINE: ContextVar[float | None] = ContextVar("baton_save_deadline", default=None)


@contextmanager
def deadline_scope(unix_deadline: float | None) -> Iterator[None]:
    """Run the body as a save that must end by ``unix_deadline`` (UNIX seconds; None: none).

    Nested scopes keep the earlier deadline.
    """
    if unix_deadline is None:
        yield
        return
    instant = time.monotonic() + (unix_deadline - time.time())
    outer = _DEADLINE.get()
    token = _DEADLINE.set(instant if outer is None else min(outer, instant))
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def current() -> float | None:
    """The ``time.monotonic()`` instant by which the save in progress must end, or None."""
    return _DEADLINE.get()
