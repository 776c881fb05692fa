"""A checkpoint storage that counts the bytes read through it (a real storage underneath).

Cooperative restore's claim is about storage traffic: every byte of a replicated state read
once by the group, not once per rank. This wrapper makes that measurable on any backend (a
directory, S3) without trusting the SDK's own count.
"""

from __future__ import annotations

import threading

from baton_testing.storage_wrapper import StorageWrapper

__all__ = ["CountingStorage"]


class CountingStorage(StorageWrapper):
    """``uri`` opened as usual; :attr:`ranged` counts bytes read by ``read_into`` (tensor data),
    :attr:`whole` bytes read by ``read_bytes`` and ``read_versioned`` (manifests, JSON)."""

    def __init__(self, uri: str) -> None:
        super().__init__(uri)
        self._lock = threading.Lock()
        self.ranged = 0
        self.whole = 0

    def read_versioned(self, path: str) -> tuple[bytes, str]:
        data, token = self._inner.read_versioned(path)
        with self._lock:
            self.whole += len(data)
        return data, token

    def read_bytes(self, path: str) -> bytes:
        data = self._inner.read_bytes(path)
        with self._lock:
            self.whole += len(data)
        return data

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        self._inner.read_into(path, offset, out)
        with self._lock:
            self.ranged += len(out)
