"""A checkpoint storage that counts the bytes read through it (a real storage underneath).

Cooperative restore's claim is about storage traffic: every byte of a replicated state read
once by the group, not once per rank. This wrapper makes that measurable on any backend (a
directory, S3) without trusting the SDK's own count.
"""

from __future__ import annotations

import threading

from trainer_sdk.storage import Storage, open_storage
from trainer_sdk.storage.base import Writer

__all__ = ["CountingStorage"]


class CountingStorage:
    """``uri`` opened as usual; :attr:`ranged` counts bytes read by ``read_into`` (tensor data),
    :attr:`whole` bytes read by ``read_bytes`` and ``read_versioned`` (manifests, JSON)."""

    def __init__(self, uri: str) -> None:
        self._inner: Storage = open_storage(uri)
        self._lock = threading.Lock()
        self.ranged = 0
        self.whole = 0

    @property
    def uri(self) -> str:
        return self._inner.uri

    def open_writer(self, path: str, *, size_hint: int | None = None) -> Writer:
        return self._inner.open_writer(path, size_hint=size_hint)

    def write_atomic(self, path: str, data: bytes) -> None:
        self._inner.write_atomic(path, data)

    def create_exclusive(self, path: str, data: bytes) -> None:
        self._inner.create_exclusive(path, data)

    def read_versioned(self, path: str) -> tuple[bytes, str]:
        data, token = self._inner.read_versioned(path)
        with self._lock:
            self.whole += len(data)
        return data, token

    def replace_if(self, path: str, data: bytes, *, token: str | None) -> bool:
        return self._inner.replace_if(path, data, token=token)

    def read_bytes(self, path: str) -> bytes:
        data = self._inner.read_bytes(path)
        with self._lock:
            self.whole += len(data)
        return data

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        self._inner.read_into(path, offset, out)
        with self._lock:
            self.ranged += len(out)

    def size(self, path: str) -> int:
        return self._inner.size(path)

    def exists(self, path: str) -> bool:
        return self._inner.exists(path)

    def list_dir(self, path: str) -> list[str]:
        return self._inner.list_dir(path)

    def delete(self, path: str) -> None:
        self._inner.delete(path)

    def delete_tree(self, path: str) -> None:
        self._inner.delete_tree(path)
