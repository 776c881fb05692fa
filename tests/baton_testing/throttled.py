"""A checkpoint storage that is slow for real: a local directory written at a bounded rate.

The notice tests need a durable tier too slow for a deadline, decided by the SDK from what it
measures, not a mocked decision. This wraps a real :class:`~trainer_sdk.storage.Storage` and
makes every streamed write take ``len(data) / rate`` seconds (a wide-area link or a throttled
bucket); small whole-object writes (manifests, ``latest``, the fence) and every read go at full
speed, as on object storage where latency, not bandwidth, bounds those.
"""

from __future__ import annotations

import time

from trainer_sdk.storage import Storage, open_storage
from trainer_sdk.storage.base import Writer

__all__ = ["ThrottledStorage"]


class _ThrottledWriter:
    def __init__(self, inner: Writer, rate: float) -> None:
        self._inner = inner
        self._rate = rate

    def write(self, data: memoryview | bytes) -> None:
        time.sleep(len(data) / self._rate)
        self._inner.write(data)

    def commit(self) -> None:
        self._inner.commit()

    def abort(self) -> None:
        self._inner.abort()


class ThrottledStorage:
    """``uri`` opened as usual, its streamed writes at most ``rate`` bytes per second."""

    def __init__(self, uri: str, *, rate: float) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be a positive number of bytes per second, got {rate}")
        self._inner = open_storage(uri)
        self.rate = rate

    @property
    def uri(self) -> str:
        return self._inner.uri

    def open_writer(self, path: str, *, size_hint: int | None = None) -> Writer:
        return _ThrottledWriter(self._inner.open_writer(path, size_hint=size_hint), self.rate)

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


def _check() -> Storage:  # mypy: ThrottledStorage satisfies the Storage protocol
    return ThrottledStorage(".", rate=1.0)
