"""crc32 of a buffer: the block checksum of the checkpoint format.

The same function as ``zlib.crc32`` (same polynomial, same values), from ISA-L when the
``isal`` package is installed: about 0.12 s per GiB here against zlib's 0.43 s, and it
releases the GIL, so checksumming a save costs a small fraction of a core. Without ``isal``
(a platform with no wheel) it falls back to ``zlib.crc32``; files are identical either way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

__all__ = ["IMPLEMENTATION", "crc32"]

try:
    from isal.isal_zlib import crc32 as _crc32

    IMPLEMENTATION: Final = "isal"
except ImportError:  # pragma: no cover - platforms without an isal wheel
    from zlib import crc32 as _crc32

    IMPLEMENTATION = "zlib"  # type: ignore[misc]

crc32: Final[Callable[[memoryview | bytes | bytearray], int]] = _crc32
