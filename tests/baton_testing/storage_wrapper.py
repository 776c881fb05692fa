"""A real checkpoint storage behind a wrapper that passes every call through: the base of the
test storages that change one thing (``throttled.py``: slow writes; ``counting.py``: counted
reads). It has no ``version``, so the SDK's manifest cache never serves a wrapped storage, and
no ``read_with_version`` (used only with ``version``): a wrapper that adds ``version`` gets the
cache's fallback path (``tests/sdk/test_manifest_cache.py``)."""

from __future__ import annotations

from trainer_sdk.storage import Storage, open_storage
from trainer_sdk.storage.base import Writer

__all__ = ["StorageWrapper"]


class StorageWrapper:
    """``uri`` opened as usual; every Storage call goes to it unchanged."""

    def __init__(self, uri: str) -> None:
        self._inner: Storage = open_storage(uri)

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
        return self._inner.read_versioned(path)

    def replace_if(self, path: str, data: bytes, *, token: str | None) -> bool:
        return self._inner.replace_if(path, data, token=token)

    def read_bytes(self, path: str) -> bytes:
        return self._inner.read_bytes(path)

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        self._inner.read_into(path, offset, out)

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


def _check() -> Storage:  # mypy: StorageWrapper satisfies the Storage protocol
    return StorageWrapper(".")
