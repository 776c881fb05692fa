"""Progress lines for the command-line tools, fit for a terminal and for a log file.

On a terminal one line is redrawn in place (``\\r``). Anywhere else (a CI log, ``kubectl logs``,
a pipe) ``\\r`` would pile every update onto one run-on line, so a full line is written now
and then instead, and once at the end. Torch-free: the CLI's light commands use it.
"""

from __future__ import annotations

import time
from typing import Final, TextIO

__all__ = ["Progress"]

_TTY_EVERY_S: Final = 0.1
_LOG_EVERY_S: Final = 10.0
"""A log gets a line at most this often: enough to see a slow export move, few enough lines."""


class Progress:
    """Reports a changing status line on ``stream``; :meth:`done` ends it."""

    def __init__(self, stream: TextIO, *, every_s: float | None = None) -> None:
        self._stream = stream
        try:
            self._tty = stream.isatty()
        except (AttributeError, ValueError):  # a closed or minimal stream
            self._tty = False
        self._every = (
            every_s if every_s is not None else (_TTY_EVERY_S if self._tty else _LOG_EVERY_S)
        )
        self._last = float("-inf")
        self._width = 0
        self._pending: str | None = None

    def update(self, text: str) -> None:
        """Show ``text`` if enough time passed since the last line shown."""
        now = time.monotonic()
        if now - self._last < self._every:
            self._pending = text
            return
        self._last = now
        self._show(text)

    def done(self, text: str | None = None) -> None:
        """Show the final state (``text``, else the last update not yet shown) and end the line."""
        final = text if text is not None else self._pending
        if final is not None:
            self._show(final)
        if self._tty and self._width:
            print(file=self._stream, flush=True)
        self._width = 0
        self._pending = None

    def _show(self, text: str) -> None:
        self._pending = None
        if self._tty:
            pad = " " * max(0, self._width - len(text))
            print(f"\r{text}{pad}", end="", file=self._stream, flush=True)
            self._width = len(text)
        else:
            print(text, file=self._stream, flush=True)
