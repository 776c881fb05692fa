"""A writer process for async saves: the shard file is streamed, hashed and made durable by a
child process that reads the staged bytes from shared memory, not by a thread of the trainer.

Why: a writer thread takes the GIL back after every 512 KiB piece it hashes and writes. Beside
a compute-bound step that costs nothing measurable, but beside a Python-bound one (a GPU
trainer's kernel-launch thread) it cost the steps that ran beside a write 2-5 % more than the
same write from a process (``bench/writer_place.py``, the write alone). In a whole save on
2 cores the effect was within the runs' spread (docs/performance.md, "The writer process"),
so it is an option (``Checkpointer(writer_process=True)``), off by default. DCP's process
executor and torch-checkpointing write from a process too.

How: the staging buffers (``_host_buffers.HostBuffers`` given this writer) live in memfds
(*arenas*: one per save that allocates), mapped by both processes; each arena is sent to the
child once, by file descriptor over a Unix socket (``SCM_RIGHTS``), when it is allocated. A
write request names the storage root, the file, the header bytes and each piece as (arena,
offset, length); the child streams exactly what
:func:`~trainer_sdk.format._safetensors_io.write_shard` would (both call
:func:`~trainer_sdk.format._shard_stream.stream_shard`), refuses to publish into a step whose
manifest exists, commits the file (fsync, rename, fsync of the directory) and answers with the
block checksums, the digest and its hashing seconds. Everything else of the save, the JSON file
and the commit (the records' all-gather, the manifest, ``latest``), stays in the training
process at normal priority. The child runs at ``nice`` +10, imports no torch, and exits when
the socket closes (the trainer exited or closed its saver), or is killed with the thread that
started it (``PR_SET_PDEATHSIG``). It runs in a session of its own, so that the signals a
launcher sends to the trainer's process group (torchrun stops a worker with ``killpg``) leave
the write that the trainer's own SIGTERM save may be waiting for alone.

Messages are JSON, each with a 4-byte length in front; no pickle. If the child dies, the save
it was writing fails with a :class:`~trainer_sdk.errors.CheckpointError` that says so (the
previous checkpoint stands) and the next save starts a new child. Local filesystems only: S3
saves keep the thread (their cost is the HTTP client's, not a file write).
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import json
import mmap
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any, Final

from trainer_sdk.errors import CheckpointError, StorageError
from trainer_sdk.format._shard_stream import stream_shard
from trainer_sdk.storage.local import LocalStorage, write_beside_training

__all__ = ["WriterProcess", "main"]

_LEN: Final = struct.Struct("<I")
NICE: Final = 10
"""The child's CPU priority below the trainer's (as the background writer thread's)."""


def _send(sock: socket.socket, obj: Any, fds: list[int] | None = None) -> None:
    data = json.dumps(obj).encode()
    frame = _LEN.pack(len(data)) + data
    if fds:
        sent = socket.send_fds(sock, [frame], fds)
        frame = frame[sent:]
    sock.sendall(frame)


def _recv_exact(sock: socket.socket, n: int, fds: list[int]) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk, got, _, _ = socket.recv_fds(sock, n - len(buf), 4)
        fds.extend(got)
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket) -> tuple[Any, list[int]] | None:
    """The next message and the descriptors that came with it; None at end of stream."""
    fds: list[int] = []
    head = _recv_exact(sock, _LEN.size, fds)
    if head is None:
        return None
    body = _recv_exact(sock, _LEN.unpack(head)[0], fds)
    if body is None:
        return None
    return json.loads(body), fds


class WriterProcess:
    """The trainer's side: starts the child on first use, sends it the staging memory, asks it
    to write shard files. One request at a time (an ``AsyncSaver`` has one save in flight)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._fds: dict[int, tuple[int, int]] = {}
        """Arena id -> (memfd, size): kept open so that a new child can map them again."""
        self._sent: set[int] = set()
        """Arena ids the current child has mapped."""

    @property
    def pid(self) -> int | None:
        """The child's pid while it runs (tests kill it to produce a writer's death)."""
        return None if self._proc is None else self._proc.pid

    @property
    def descriptors(self) -> int:
        """How many memfds this object holds open (one per arena of staging buffers)."""
        return len(self._fds)

    def add_arena(self, arena_id: int, fd: int, size: int) -> None:
        """Register an arena of staging buffers (a memfd of ``size`` bytes); the child maps it
        before its next write. The descriptor is this object's from now on."""
        with self._lock:
            self._fds[arena_id] = (fd, size)

    def drop_arena(self, arena_id: int) -> None:
        """Forget an arena none of whose buffers is used any more (reallocated for a new shape,
        or left the state)."""
        with self._lock:
            entry = self._fds.pop(arena_id, None)
            if entry is not None:
                os.close(entry[0])
            if arena_id in self._sent and self._sock is not None:
                self._sent.discard(arena_id)
                try:
                    _send(self._sock, {"op": "unmap", "id": arena_id})
                except OSError:
                    self._stop()

    def write_shard(
        self,
        storage: LocalStorage,
        path: str,
        *,
        header: bytes,
        pieces: list[tuple[str, int, int, int]],
        block_size: int,
        guard_key: str,
    ) -> tuple[dict[str, list[int]], str, float, bool]:
        """Write and commit ``path`` under ``storage`` in the child: ``header``, then each
        piece ``(name, arena id, offset, length)``. Returns the block checksums per piece, the
        file's XXH3-128 hex digest, the child's hashing seconds, and whether it refused because
        ``guard_key`` (the step's manifest) existed before the commit (nothing published)."""
        with self._lock:
            request = {
                "op": "write",
                "root": storage.root,
                "spares": storage.spares,
                "path": path,
                "header": base64.b64encode(header).decode(),
                "pieces": pieces,
                "block_size": block_size,
                "guard": guard_key,
            }
            try:
                sock = self._ensure()
                _send(sock, request)
                got = _recv(sock)
            except OSError as e:
                got = None
                cause: BaseException | None = e
            else:
                cause = None
            if got is None:
                code = self._stop()
                raise CheckpointError(
                    f"the checkpoint writer process exited (code {code}) while writing {path}; "
                    "this save is abandoned and the previous checkpoint stands; the next save "
                    "starts a new writer process"
                ) from cause
        reply = got[0]
        if "error" in reply:
            kind = StorageError if reply.get("kind") == "OSError" else CheckpointError
            raise kind(f"the checkpoint writer process could not write {path}: {reply['error']}")
        return reply["sums"], reply["digest"], reply["hash_seconds"], reply["refused"]

    def _ensure(self) -> socket.socket:
        """The socket to a running child that has mapped every arena (started if needed)."""
        if self._proc is not None and self._proc.poll() is not None:
            self._stop()
        if self._sock is None:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                # A session of its own: a signal sent to the trainer's process group
                # (torchrun's agent stops each worker with killpg(SIGTERM), a terminal's
                # Ctrl-C reaches its foreground group) would end the writer too, in the
                # middle of the write that the trainer's SIGTERM save waits for. The child
                # ends with its trainer (PR_SET_PDEATHSIG, the socket's end) instead.
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "trainer_sdk.saveload._writer_process",
                     str(theirs.fileno())],
                    pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )  # fmt: skip
            except OSError as e:
                ours.close()
                raise CheckpointError(
                    f"could not start the checkpoint writer process ({sys.executable} -m "
                    f"trainer_sdk.saveload._writer_process): {e}; this save is abandoned and "
                    "the previous checkpoint stands. Fix the cause, or write from a thread "
                    "(writer_process=False, BATON_WRITER_PROCESS=0)"
                ) from e
            finally:
                theirs.close()
            self._sock = ours
            self._sent = set()
        for arena_id, (fd, size) in self._fds.items():
            if arena_id not in self._sent:
                _send(self._sock, {"op": "map", "id": arena_id, "size": size}, [fd])
                self._sent.add(arena_id)
        return self._sock

    def _stop(self) -> int | None:
        """Close the socket (the child exits at end of stream) and reap the child."""
        sock, self._sock = self._sock, None
        proc, self._proc = self._proc, None
        self._sent = set()
        if sock is not None:
            sock.close()
        if proc is None:
            return None
        try:
            return proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def close(self) -> None:
        """Stop the child and close every arena's descriptor (the mappings stay valid)."""
        with self._lock:
            self._stop()
            for fd, _ in self._fds.values():
                os.close(fd)
            self._fds.clear()


# ---------------------------------------------------------------------------- the child


def _blocks(view: memoryview, block_size: int) -> Iterator[memoryview]:
    for off in range(0, len(view), block_size):
        yield view[off : off + block_size]


def _write(maps: dict[int, mmap.mmap], req: dict[str, Any]) -> dict[str, Any]:
    storage = LocalStorage(req["root"], spares=req["spares"])
    header = base64.b64decode(req["header"])
    views = [
        (name, memoryview(maps[arena_id])[off : off + n])
        for name, arena_id, off, n in req["pieces"]
    ]
    size = len(header) + sum(len(v) for _, v in views)
    writer = storage.open_writer(req["path"], size_hint=size)
    try:
        sums, hasher = stream_shard(
            writer, header, ((name, _blocks(v, req["block_size"]), True) for name, v in views)
        )
        if storage.exists(req["guard"]):  # never publish a file into a committed step
            writer.abort()
            return {"sums": {}, "digest": "", "hash_seconds": 0.0, "refused": True}
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    finally:
        for _, v in views:
            v.release()
    return {"sums": sums, "digest": hasher.hexdigest(), "hash_seconds": hasher.busy,
            "refused": False}  # fmt: skip


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the thread that started it ends (a trainer
    killed mid-write must not leave a writer behind that publishes a file afterwards, beside
    its replacement); and leave at once if that already happened."""
    if sys.platform != "linux":
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:
        sys.exit(0)


_PR_SET_PDEATHSIG: Final = 1


def main(sock_fd: int) -> None:
    """The child: serve ``map``, ``unmap`` and ``write`` requests until the socket closes."""
    _die_with_parent()
    os.nice(NICE)
    write_beside_training()  # leave disk writeback to each file's fsync, as the thread does
    sock = socket.socket(fileno=sock_fd)
    maps: dict[int, mmap.mmap] = {}
    while True:
        got = _recv(sock)
        if got is None:
            return
        req, fds = got
        if req["op"] == "map":
            maps[req["id"]] = mmap.mmap(fds[0], req["size"], prot=mmap.PROT_READ)
            os.close(fds[0])
        elif req["op"] == "unmap":
            m = maps.pop(req["id"], None)
            if m is not None:
                with contextlib.suppress(BufferError):  # a view still held: freed with it
                    m.close()
        else:
            try:
                reply = _write(maps, req)
            except OSError as e:
                reply = {"error": str(e), "kind": "OSError"}
            except Exception as e:  # reported to the trainer, which fails the save with it
                reply = {"error": f"{type(e).__name__}: {e}", "kind": type(e).__name__}
            _send(sock, reply)


if __name__ == "__main__":
    main(int(sys.argv[1]))
