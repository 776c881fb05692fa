"""The storage protocol: the only thing the checkpoint format knows about where bytes live.

Who calls what, in which order (see ``trainer_sdk.api``):

* Every rank calls :meth:`Storage.open_writer` for each shard it owns, streams the bytes with
  :meth:`Writer.write` (hashing happens above this layer), then :meth:`Writer.commit`. A commit
  makes the object durable and visible under its final name in one step: on a filesystem a
  temp file is fsync'd and renamed, and the directory fsync'd; on S3 the multipart upload is
  completed. :meth:`Writer.abort` discards everything written so far (and, on S3, aborts the
  multipart upload) and must not hide the error that caused it.
* Rank 0 writes ``manifest.json`` with :meth:`Storage.write_atomic` only after every rank has
  committed its shards: that write is the checkpoint's commit. Then it writes ``latest``.
* Readers use :meth:`Storage.read_bytes` for small JSON files and :meth:`Storage.read_into`
  for ranges of shards, straight into the destination buffer (no extra copy).

Paths are ``str`` keys relative to the storage root, with ``/`` separators, never absolute and
never containing ``..``; ``trainer_sdk.layout`` validates them before they get here.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["Storage", "Writer"]


@runtime_checkable
class Writer(Protocol):
    """A streaming writer for one object. Not thread-safe; one writer per object."""

    def write(self, data: memoryview | bytes) -> None:
        """Append ``data``. May return before the bytes are durable; may block for backpressure."""

    def commit(self) -> None:
        """Make the whole object durable and visible under its final name, atomically."""

    def abort(self) -> None:
        """Discard the object. Safe to call after a failed write or commit; never raises."""


@runtime_checkable
class Storage(Protocol):
    """A checkpoint root: a local directory or an ``s3://bucket/prefix``."""

    @property
    def uri(self) -> str:
        """The root as a URI (``file:///abs/path`` or ``s3://bucket/prefix``)."""

    def open_writer(self, path: str, *, size_hint: int | None = None) -> Writer:
        """Start writing ``path``. ``size_hint`` (bytes) lets S3 choose the part size."""

    def write_atomic(self, path: str, data: bytes) -> None:
        """Write a small object whole and durably; readers see the old or the new, never half."""

    def read_bytes(self, path: str) -> bytes:
        """Read a whole (small) object. Raises ``FileNotFoundError`` if absent."""

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with ``len(out)`` bytes of ``path`` starting at ``offset``.

        Raises ``EOFError`` if the object is shorter than ``offset + len(out)``.
        """

    def size(self, path: str) -> int:
        """Size of the object in bytes. Raises ``FileNotFoundError`` if absent."""

    def exists(self, path: str) -> bool:
        """Whether the object exists (a committed file, not a temp or in-progress upload)."""

    def list_dir(self, path: str) -> list[str]:
        """Names directly under ``path`` ("" is the root), files and "directories" alike, sorted."""

    def delete(self, path: str) -> None:
        """Delete one object; missing is fine."""

    def delete_tree(self, path: str) -> None:
        """Delete everything under ``path``; missing is fine."""
