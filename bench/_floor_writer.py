"""The writer process of ``bench/anchors.py``'s ``floor`` contender: the least a checkpoint
writer can do to make a staged state durable, with none of a format's work.

Started once by the bench with one end of a Unix socket pair as ``argv[1]``; imports no torch.
Requests, one per message: ``map`` with a file descriptor attached (a memfd holding the staged
bytes; mapped read-only and kept), or ``write DIR`` (create DIR, write every mapped byte to
``DIR/data.bin`` in 8 MiB ``write`` calls, fsync the file and DIR, answer ``ok``). No header,
no hashes, no manifest, no rename: what any writer of these bytes must do at least. It runs at
``nice`` +10, as Baton's background writer does. It exits when the socket closes.
"""

from __future__ import annotations

import mmap
import os
import socket
import sys

CHUNK = 8 << 20


def write_all(view: memoryview, directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    fd = os.open(os.path.join(directory, "data.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for off in range(0, len(view), CHUNK):
            os.write(fd, view[off : off + CHUNK])
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def main() -> None:
    os.nice(10)
    sock = socket.socket(fileno=int(sys.argv[1]))
    mapped: mmap.mmap | None = None
    while True:
        msg, fds, _, _ = socket.recv_fds(sock, 4096, 1)
        if not msg:
            return
        if fds:
            size = int(msg.split()[1])
            mapped = mmap.mmap(fds[0], size, prot=mmap.PROT_READ)
            os.close(fds[0])
            sock.sendall(b"ok")
            continue
        assert mapped is not None, "write before map"
        try:
            with memoryview(mapped) as view:
                write_all(view, msg.decode().split(" ", 1)[1])
            sock.sendall(b"ok")
        except OSError as e:
            sock.sendall(f"err {e}".encode())


if __name__ == "__main__":
    main()
