"""The storage protocol: the only thing the checkpoint format knows about where bytes live.

Who calls what, in which order (see ``trainer_sdk.api``):

* Every rank calls :meth:`Storage.open_writer` for each shard it owns, streams the bytes with
  :meth:`Writer.write` (hashing happens above this layer), then :meth:`Writer.commit`. A commit
  makes the object durable and visible under its final name in one step: on a filesystem a
  temp file is fsync'd and renamed, and the directory fsync'd; on S3 the multipart upload is
  completed. :meth:`Writer.abort` discards everything written so far (and, on S3, aborts the
  multipart upload) and must not hide the error that caused it.
* Rank 0 writes ``manifest.json`` with :meth:`Storage.create_exclusive` only after every rank
  has committed its shards: that write is the checkpoint's commit, and it fails if any manifest
  is already there, so two writers can never both commit one step. Then it moves ``latest``
  with :meth:`Storage.read_versioned` and :meth:`Storage.replace_if` (a compare-and-swap, so
  two writers cannot interleave a read and a write of it).
* Readers use :meth:`Storage.read_bytes` for small JSON files and :meth:`Storage.read_into`
  for ranges of shards, straight into the destination buffer (no extra copy).

Optional: ``version(path) -> str``, a token that changes whenever the object at ``path`` is
replaced (raises ``FileNotFoundError`` if absent). Both built-in backends have it; with it,
the parsed manifests of committed steps are cached per root (``_catalog.read_manifest``), so
that a commit does not read and parse every kept step's manifest again. Also optional, and
only used with ``version``: ``read_with_version(path, *, limit) -> tuple[bytes, str]``, the
object's bytes and the ``version`` token *of those bytes*, in one request (one GET on S3),
raising :class:`TooLargeError` without reading the object if it is over ``limit`` bytes. A
manifest read that misses the cache then costs one HEAD and one GET on S3, not three HEADs
and a GET; without it the cache reads ``size``, ``read_bytes`` and ``version`` again.

Paths are ``str`` keys relative to the storage root, with ``/`` separators, never absolute and
never containing ``..``; ``trainer_sdk.format.layout`` validates them before they get here.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["Storage", "TooLargeError", "Writer"]


class TooLargeError(ValueError):
    """``read_with_version`` refused an object over its ``limit``; none of its bytes were read."""

    def __init__(self, path: str, *, size: int, limit: int) -> None:
        super().__init__(f"{path} is {size} bytes, over the limit of {limit}")
        self.path = path
        self.size = size
        self.limit = limit


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

    def create_exclusive(self, path: str, data: bytes) -> None:
        """Write a small object whole and durably, only if no object is at ``path`` yet.

        Raises ``FileExistsError`` if another object is there. If the object there has exactly
        ``data`` (our own write whose reply was lost and was retried), it returns normally:
        the bytes are read back and compared, so a lost reply is never reported as a failure.
        S3: ``PutObject`` with ``If-None-Match: *``; a filesystem: ``link(2)`` of a fsync'd
        temp file onto the final name.
        """

    def read_versioned(self, path: str) -> tuple[bytes, str]:
        """A small object and an opaque version token of it (an ETag, or inode and mtime).

        Raises ``FileNotFoundError`` if absent.
        """

    def replace_if(self, path: str, data: bytes, *, token: str | None) -> bool:
        """Replace ``path`` with ``data`` if it is still at version ``token`` (None: absent).

        Returns False, writing nothing, when another writer changed it in between. S3:
        ``If-Match`` / ``If-None-Match: *``; a filesystem: under an exclusive ``flock`` of
        the checkpoint root, compare then rename.
        """

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
