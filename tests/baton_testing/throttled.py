"""A checkpoint storage that is slow for real: a local directory written at a bounded rate.

The notice tests need a durable tier too slow for a deadline, decided by the SDK from what it
measures, not a mocked decision. This wraps a real :class:`~trainer_sdk.storage.Storage` and
makes every streamed write take ``len(data) / rate`` seconds (a wide-area link or a throttled
bucket); small whole-object writes (manifests, ``latest``, the fence) and every read go at full
speed, as on object storage where latency, not bandwidth, bounds those.
"""

from __future__ import annotations

import time

from baton_testing.storage_wrapper import StorageWrapper

from trainer_sdk.storage import Storage
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


class ThrottledStorage(StorageWrapper):
    """``uri`` opened as usual, its streamed writes at most ``rate`` bytes per second."""

    def __init__(self, uri: str, *, rate: float) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be a positive number of bytes per second, got {rate}")
        super().__init__(uri)
        self.rate = rate

    def open_writer(self, path: str, *, size_hint: int | None = None) -> Writer:
        return _ThrottledWriter(self._inner.open_writer(path, size_hint=size_hint), self.rate)


def _check() -> Storage:  # mypy: ThrottledStorage satisfies the Storage protocol
    return ThrottledStorage(".", rate=1.0)
