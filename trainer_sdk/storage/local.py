"""Checkpoints on a local (or network-mounted POSIX) filesystem.

Durability: every object is written to a temp name in its final directory, fsync'd, renamed
over the final name, and the directory fsync'd, so a crash leaves either the old object or the
new one, never a half-written or zero-filled file under a final name. Newly created
directories are fsync'd into their parent too.

Safety: paths are relative keys checked component by component; no component inside the root
may be a symbolic link (checked with ``lstat`` and opened with ``O_NOFOLLOW``), so a
checkpoint directory cannot redirect reads or writes outside itself.

Commits and fencing: a manifest is created with ``link(2)`` of a fsync'd temp file onto its
final name, which fails with ``EEXIST`` if any file is already there, so two writers can never
both commit one step (``O_EXCL`` semantics, but for a file that is complete before it appears).
``latest`` is replaced under an exclusive ``flock`` of the checkpoint root: read, compare, rename.

Limits on network filesystems: ``rename`` is atomic on local filesystems; some network
filesystems do not promise it. ``link`` is atomic on the NFS server, but a lost reply to a
retransmitted LINK can come back as ``EEXIST``; the temp file's link count (2 when our link
took) tells the two apart. ``flock`` on NFS is emulated with POSIX byte-range locks (Linux
>= 2.6.12) and needs a working lock manager (``nolock`` mounts make it local to one client):
there, ``latest`` is still only a hint, and readers check it against the manifests.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import secrets
import shutil
import stat
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Final, cast
from urllib.parse import unquote, urlparse

from trainer_sdk.errors import ManifestError, StorageError
from trainer_sdk.storage.base import TooLargeError

__all__ = [
    "SPARE_MIN_BYTES",
    "LocalStorage",
    "LocalWriter",
    "keep_as_spares",
    "spare_candidates",
    "take_spare",
    "write_beside_training",
]

_TMP_MARK: Final = ".tmp-"
_O_NOFOLLOW: Final = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC: Final = getattr(os, "O_CLOEXEC", 0)


_WRITEBACK_EVERY = 32 * 1024 * 1024
"""Bytes written between two early-writeback requests (see :func:`_start_writeback`).

32 MiB: large enough that the requests cost nothing, small enough that the disk starts
within a few blocks of the first write. Measured with bench/save_load.py (docs/format.md)."""
_SYNC_FILE_RANGE_WRITE: Final = 2


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` (the os module does not wrap it), or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range  # the C library already loaded
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return cast("Callable[[int, int, int, int], int]", fn)


_sync_file_range = _load_sync_file_range()


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``[offset, offset + nbytes)`` to disk now.

    Without this, dirty pages of a checkpoint sit in the page cache until the final fsync
    (Linux starts background writeback only past ``dirty_background_ratio`` of RAM), so the
    disk idles while we copy and hash, then the fsync writes everything. Starting writeback
    per chunk overlaps the disk with the rest of the save. It does not wait for the I/O and
    promises no durability: the fsync in :meth:`LocalWriter.commit` still does that.
    Linux only (``sync_file_range(2)``); elsewhere, and on any error, it does nothing.
    Not from a thread marked by :func:`write_beside_training`.
    """
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


_thread_role = threading.local()


def write_beside_training() -> None:
    """Mark the calling thread as one that writes while training steps run (an async save's
    background writer): the :class:`LocalWriter` objects it opens leave all disk writeback to
    the commit's fsync instead of starting it every 32 MiB.

    Early writeback shortens a save the caller waits for (the disk works during the copy), but
    beside training it costs the steps more than it wins: each request submits I/O from the
    writing thread while the step runs, and a ``sync_file_range`` per 32 MiB slowed the steps
    beside a 0.25 GiB background write to disk from 1.02-1.03x to 1.07-1.11x and raised the
    training time it lost from 30-33 ms to 43-47 ms, for 0.03 s sooner durable (0.41-0.47 s):
    two interleaved runs of ``bench/anchors.py``-style cycles (``docs/performance.md``,
    "Early writeback beside training"). Durability is the same: every file is fsync'd before
    it is renamed into place.
    """
    _thread_role.beside_training = True


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | _O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_temp(name: str) -> bool:
    return name.startswith(".") and _TMP_MARK in name


SPARE_MIN_BYTES: Final = 1024 * 1024
"""Files smaller than this are deleted, not kept as spares (their pages cost little)."""


def spare_candidates(spare_dir: str, size_hint: int | None) -> list[str]:
    """Spare files in ``spare_dir`` for a write of about ``size_hint`` bytes, best first: those
    that hold it, smallest first, then the others, largest first (a spare grows); in random
    order among equal sizes, so that processes writing at once rarely reach for the same one.
    None for a write under :data:`SPARE_MIN_BYTES`."""
    if size_hint is None or size_hint < SPARE_MIN_BYTES:
        return []
    sizes: list[tuple[int, int, str]] = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(spare_dir):
            with contextlib.suppress(FileNotFoundError):
                if entry.is_file(follow_symlinks=False):
                    size = entry.stat(follow_symlinks=False).st_size
                    sizes.append((size, secrets.randbits(32), entry.path))
    holds = sorted(s for s in sizes if s[0] >= size_hint)
    short = sorted((s for s in sizes if s[0] < size_hint), key=lambda s: (-s[0], s[1]))
    return [path for _, _, path in holds + short]


def take_spare(candidates: Sequence[str], dest: str) -> bool:
    """Rename the first of ``candidates`` this process can take to ``dest``; whether one was
    taken. ``rename(2)`` is atomic: two takers never get the same file (the loser tries the
    next)."""
    for spare in candidates:
        try:
            os.rename(spare, dest)
        except FileNotFoundError:  # another writer took it, or the spares were emptied
            continue
        return True
    return False


def keep_as_spares(tree: str, spare_dir: str) -> None:
    """Move the files of ``tree`` of at least :data:`SPARE_MIN_BYTES` into ``spare_dir`` (on
    the same filesystem), after deleting the spares there that no write took since the last
    call, so that the spares never hold more than one tree. The caller deletes what is left
    of ``tree``. Only for files nothing reads any more: a spare is overwritten in place."""
    os.makedirs(spare_dir, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(spare_dir):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
    for parent, _dirs, files in os.walk(tree):
        for name in files:
            src = os.path.join(parent, name)
            st = os.lstat(src)
            if stat.S_ISREG(st.st_mode) and st.st_size >= SPARE_MIN_BYTES:
                os.rename(src, os.path.join(spare_dir, secrets.token_hex(8)))


class LocalWriter:
    """Streams one file to a temp name; :meth:`commit` makes it durable and visible.

    With ``spares`` (files of a deleted checkpoint, best first, see
    :meth:`LocalStorage.recycle_tree`) the temp file *is* the first of them this writer can
    take, renamed to the temp name and overwritten from its first byte; the commit cuts it to
    the bytes written. On tmpfs that is a third of the CPU of writing a new file (no page to
    allocate, zero and later free). Spares must be files in ``directory``'s filesystem that
    nothing else reads: ``rename(2)`` takes one atomically, so two writers never both take
    one (the loser tries the next); with none left the writer creates a new file.
    """

    def __init__(self, final: str, directory: str, *, spares: Sequence[str] = ()) -> None:
        self._final = final
        self._dir = directory
        base = os.path.basename(final)
        self._tmp = os.path.join(
            directory, f".{base}{_TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"
        )
        self._written = 0
        self._flushed = 0
        self._early_writeback = not getattr(_thread_role, "beside_training", False)
        self.reused = take_spare(spares, self._tmp)
        """Whether this writer overwrites a spare file rather than a new one."""
        flags = os.O_WRONLY | _O_NOFOLLOW | _O_CLOEXEC
        self._fd: int | None = os.open(
            self._tmp, flags if self.reused else flags | os.O_CREAT | os.O_EXCL, 0o644
        )

    @property
    def temp_path(self) -> str:
        """The temp file being written (for tests and diagnostics)."""
        return self._tmp

    def write(self, data: memoryview | bytes) -> None:
        if self._fd is None:
            raise StorageError(f"{self._final}: write after commit or abort")
        view = memoryview(data).cast("B")
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
            self._written += n
        if self._early_writeback and self._written - self._flushed >= _WRITEBACK_EVERY:
            _start_writeback(self._fd, self._flushed, self._written - self._flushed)
            self._flushed = self._written

    def commit(self) -> None:
        if self._fd is None:
            raise StorageError(f"{self._final}: commit after commit or abort")
        fd, self._fd = self._fd, None
        try:
            if self.reused:
                os.ftruncate(fd, self._written)  # a larger spare's old tail goes
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(self._tmp, self._final)
        _fsync_dir(self._dir)

    def abort(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(self._tmp)


class LocalStorage:
    """A checkpoint root on a POSIX filesystem (``/abs/path``, ``rel/path`` or ``file://``).

    With ``spares`` (a directory name under the root, for the memory tier's tmpfs),
    :meth:`recycle_tree` keeps a deleted tree's large files there, and :meth:`open_writer`
    overwrites one of them instead of creating a file. At most one recycled tree's files are
    kept: each recycle first deletes the spares the writes since the last one did not take.
    """

    def __init__(self, root: str, *, spares: str | None = None) -> None:
        self._root = os.path.abspath(root)
        self._spares = spares

    @classmethod
    def from_uri(cls, uri: str, *, spares: str | None = None) -> LocalStorage:
        if uri.startswith("file://"):
            parsed = urlparse(uri)
            if parsed.netloc not in ("", "localhost"):
                raise StorageError(f"{uri}: file:// URIs must be local (file:///abs/path)")
            return cls(unquote(parsed.path), spares=spares)
        if "://" in uri:
            raise StorageError(f"{uri}: unsupported scheme; use a path, file:// or s3://")
        return cls(uri, spares=spares)

    @property
    def root(self) -> str:
        return self._root

    @property
    def spares(self) -> str | None:
        """The spare files' directory under the root (the memory tier's tmpfs), or None."""
        return self._spares

    @property
    def uri(self) -> str:
        return f"file://{self._root}"

    # ------------------------------------------------------------------ paths and safety

    def _path(self, path: str, *, must_exist_parents: bool = False) -> str:
        """Absolute path of a key, refusing anything that could leave the root."""
        parts = path.split("/") if path else []
        for part in parts:
            if part in ("", ".", "..") or "\\" in part or "\x00" in part:
                raise ManifestError(f"unsafe storage key {path!r}", path=path)
        current = self._root
        for part in parts:
            current = os.path.join(current, part)
            try:
                st = os.lstat(current)
            except FileNotFoundError:
                if must_exist_parents:
                    raise
                break
            if stat.S_ISLNK(st.st_mode):
                raise ManifestError(
                    "is a symbolic link; Baton never follows links inside a checkpoint "
                    "(replace it with the real file or directory)",
                    path=path,
                )
        return os.path.join(self._root, *parts)

    def _makedirs(self, directory: str) -> None:
        """Create ``directory`` (and parents) and fsync each new entry into its parent."""
        missing: list[str] = []
        d = directory
        while not os.path.isdir(d):
            missing.append(d)
            parent = os.path.dirname(d)
            if parent == d:
                break
            d = parent
        for d in reversed(missing):
            try:
                os.mkdir(d, 0o755)
            except FileExistsError:
                continue
            _fsync_dir(os.path.dirname(d))

    def _open_read(self, path: str) -> int:
        full = self._path(path)
        try:
            return os.open(full, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise ManifestError("is a symbolic link; refusing to follow it", path=path) from e
            raise

    # ------------------------------------------------------------------ protocol

    def open_writer(self, path: str, *, size_hint: int | None = None) -> LocalWriter:
        full = self._path(path)
        directory = os.path.dirname(full)
        self._makedirs(directory)
        return LocalWriter(full, directory, spares=self._pick_spares(size_hint))

    def _spare_dir(self) -> str | None:
        return None if self._spares is None else self._path(self._spares)

    def _pick_spares(self, size_hint: int | None) -> list[str]:
        spare_dir = self._spare_dir()
        return [] if spare_dir is None else spare_candidates(spare_dir, size_hint)

    def recycle_tree(self, path: str) -> None:
        """Delete the tree ``path``, keeping its files of at least :data:`SPARE_MIN_BYTES` as
        spares for the next writes (without ``spares``: :meth:`delete_tree`). The spares the
        writes since the last recycle did not take are deleted first, so the spares never
        hold more than one tree. Only for trees nothing reads any more: a spare is
        overwritten in place."""
        spare_dir = self._spare_dir()
        full = self._path(path)
        if spare_dir is not None and os.path.isdir(full) and not os.path.islink(full):
            self._makedirs(spare_dir)
            keep_as_spares(full, spare_dir)
        self.delete_tree(path)

    def write_atomic(self, path: str, data: bytes) -> None:
        w = self.open_writer(path, size_hint=len(data))
        try:
            w.write(data)
            w.commit()
        except BaseException:
            w.abort()
            raise

    def create_exclusive(self, path: str, data: bytes) -> None:
        full = self._path(path)
        directory = os.path.dirname(full)
        self._makedirs(directory)
        w = LocalWriter(full, directory)
        try:
            w.write(data)
            fd, w._fd = w._fd, None
            assert fd is not None
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(w.temp_path, full, follow_symlinks=False)
            except FileExistsError:
                # A retransmitted LINK whose first reply was lost (NFS) reports EEXIST although
                # it took: then the temp file has a second name.
                if os.lstat(w.temp_path).st_nlink < 2 and self._read_or_none(path) != data:
                    raise FileExistsError(
                        errno.EEXIST, "another writer already created it", full
                    ) from None
            _fsync_dir(directory)
        finally:
            w.abort()  # removes the temp name (the final name, if linked, stays)

    def _read_or_none(self, path: str) -> bytes | None:
        try:
            return self.read_bytes(path)
        except FileNotFoundError:
            return None

    @staticmethod
    def _token(st: os.stat_result) -> str:
        return f"{st.st_dev}:{st.st_ino}:{st.st_mtime_ns}:{st.st_size}"

    def read_versioned(self, path: str) -> tuple[bytes, str]:
        fd = self._open_read(path)
        try:
            st = os.fstat(fd)
            out = bytearray(st.st_size)
            self._pread_into(fd, 0, memoryview(out), path)
            return bytes(out), self._token(st)
        finally:
            os.close(fd)

    def replace_if(self, path: str, data: bytes, *, token: str | None) -> bool:
        full = self._path(path)
        self._makedirs(os.path.dirname(full))
        lock = os.open(self._root, os.O_RDONLY | _O_CLOEXEC)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when closed, or if the process dies
            try:
                current: str | None = self._token(os.lstat(full))
            except FileNotFoundError:
                current = None
            if current != token:
                return False
            self.write_atomic(path, data)
            return True
        finally:
            os.close(lock)

    def read_bytes(self, path: str) -> bytes:
        fd = self._open_read(path)
        try:
            size = os.fstat(fd).st_size
            out = bytearray(size)
            self._pread_into(fd, 0, memoryview(out), path)
            return bytes(out)
        finally:
            os.close(fd)

    @staticmethod
    def _pread_into(fd: int, offset: int, out: memoryview, path: str) -> None:
        view = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        pos = offset
        while view:
            n = os.preadv(fd, [view], pos)
            if n == 0:
                raise EOFError(f"{path}: ends before byte {pos + len(view)}")
            view = view[n:]
            pos += n

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        fd = self._open_read(path)
        try:
            self._pread_into(fd, offset, out, path)
        finally:
            os.close(fd)

    def size(self, path: str) -> int:
        st = os.lstat(self._path(path))
        if not stat.S_ISREG(st.st_mode):
            raise ManifestError("is not a regular file", path=path)
        return st.st_size

    def version(self, path: str) -> str:
        """A token that changes when the object at ``path`` is replaced or written (device,
        inode, size, modification and change times; optional in the protocol, see
        ``_catalog.read_manifest``). Raises ``FileNotFoundError`` if absent."""
        return self._version_token(os.lstat(self._path(path)), path)

    @staticmethod
    def _version_token(st: os.stat_result, path: str) -> str:
        if not stat.S_ISREG(st.st_mode):
            raise ManifestError("is not a regular file", path=path)
        return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"

    def read_with_version(self, path: str, *, limit: int) -> tuple[bytes, str]:
        """The file's bytes and its :meth:`version` token, from ``fstat`` of the open file
        before and after the read. If the two differ (written while read), the token is one
        that :meth:`version` never returns, so a cache keyed on it never serves those bytes.
        Raises :class:`TooLargeError` over ``limit`` bytes (nothing read)."""
        fd = self._open_read(path)
        try:
            before = os.fstat(fd)
            token = self._version_token(before, path)
            if before.st_size > limit:
                raise TooLargeError(path, size=before.st_size, limit=limit)
            out = bytearray(before.st_size)
            self._pread_into(fd, 0, memoryview(out), path)
            if self._version_token(os.fstat(fd), path) != token:
                token = f"changed while read:{token}"
            return bytes(out), token
        finally:
            os.close(fd)

    def exists(self, path: str) -> bool:
        try:
            st = os.lstat(self._path(path))
        except (FileNotFoundError, NotADirectoryError):
            return False
        return stat.S_ISREG(st.st_mode)

    def list_dir(self, path: str) -> list[str]:
        try:
            names = os.listdir(self._path(path))
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(n for n in names if not _is_temp(n))

    def delete(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(path))

    def delete_tree(self, path: str) -> None:
        full = self._path(path)
        if full == self._root:
            raise StorageError("refusing to delete the checkpoint root itself")
        try:
            st = os.lstat(full)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(full)
        else:
            os.unlink(full)
        _fsync_dir(os.path.dirname(full))
