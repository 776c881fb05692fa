"""Cold reads for the benchmarks: write back and drop the page cache of every file under a
directory, so the next read comes from the disk (``posix_fadvise(DONTNEED)``; no root needed)."""

from __future__ import annotations

import os
from pathlib import Path


def drop_cache(root: str | Path) -> None:
    """Flush and evict the cached pages of every file under ``root``."""
    for where, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(where, name), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
