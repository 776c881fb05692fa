"""Benchmark: does the place of a background checkpoint writer (a thread of the training
process, or a process of its own) change what it costs the training steps beside it?

Issue #29, item 2 asked for a writer process fed from shared memory, as DCP's process executor
and torch-checkpointing have, on the grounds that a writer thread takes the training thread's
CPU, caches or GIL. This measures that directly, without Baton's format in the way: one
staged buffer of ``--mib`` MiB, written to ``--dir`` and fsync'd by

* ``thread-hash``: a thread of this process at ``nice`` +10, hashing each 512 KiB piece
  (XXH3-128 of the stream, XXH3-64 of the piece: what Baton's writer does) and writing it;
* ``thread-raw``: the same thread, no hashing;
* ``proc-hash``: a child process at ``nice`` +10 mapping the buffer (a memfd) and doing what
  ``thread-hash`` does;
* ``proc-raw``: the child, no hashing;
* ``none``: no writer (the control: steps against steps).

while the training loop runs steps on one intra-op thread; per contender and round, the median
step while the write is in flight over the median of the 15 steps before it. Two kinds of step:
``matmul`` (4 matmuls of 768², compute-bound, as ``bench/anchors.py``) and ``small`` (about
45 ms of small tensor operations: a Python-bound loop that takes the GIL thousands of times a
step, as a GPU trainer's kernel-launch thread does). Rounds interleave the contenders, the
order rotating; the load average is printed.

    .venv/bin/python bench/writer_place.py [--dir /work/bench-tmp] [--mib 256] [--rounds 10]

Not a test: timings are never assertions.
"""

from __future__ import annotations

import argparse
import mmap
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _common import loadavg
from xxhash import xxh3_64_intdigest, xxh3_128

PIECE = 512 << 10
"""Bytes hashed and written at a time (Baton's ``HASH_PIECE``)."""

CONTENDERS = ["thread-hash", "thread-raw", "proc-hash", "proc-raw", "none"]


def write_file(view: memoryview, path: str, hashed: bool) -> None:
    """Write ``view`` to ``path`` in PIECE calls (hashing each first if ``hashed``), fsync."""
    digest = xxh3_128()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for off in range(0, len(view), PIECE):
            piece = view[off : off + PIECE]
            if hashed:
                digest.update(piece)
                xxh3_64_intdigest(piece)
            os.write(fd, piece)
        os.fsync(fd)
    finally:
        os.close(fd)


def child(sock_fd: int) -> None:
    """The writer process: ``map SIZE`` with a memfd attached, then ``hash|raw PATH`` requests,
    each answered ``ok`` once written and fsync'd."""
    os.nice(10)
    sock = socket.socket(fileno=sock_fd)
    mapped: mmap.mmap | None = None
    while True:
        msg, fds, _, _ = socket.recv_fds(sock, 4096, 1)
        if not msg:
            return
        kind, arg = msg.decode().split(" ", 1)
        if kind == "map":
            mapped = mmap.mmap(fds[0], int(arg), prot=mmap.PROT_READ)
            os.close(fds[0])
        else:
            assert mapped is not None
            with memoryview(mapped) as view:
                write_file(view, arg, hashed=kind == "hash")
        sock.send(b"ok")


def matmul_step(w: torch.Tensor, x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        y = x
        for _ in range(4):
            y = torch.tanh(y @ w)
        float(y.sum())

    return step


def small_step(target_s: float = 0.045) -> Callable[[], None]:
    v = torch.randn(64)
    t0 = time.perf_counter()
    for _ in range(2000):
        (v * 1.0001 + 0.5).relu_()
    n = max(1, int(2000 * target_s / (time.perf_counter() - t0)))

    def step() -> None:
        y = v
        for _ in range(n):
            y = (y * 1.0001 + 0.5).relu_()
        float(y.sum())

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="a directory on disk (default: a temp dir)")
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="baton-writer-place-", dir=args.dir))
    n = args.mib << 20

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = subprocess.Popen(
        [sys.executable, __file__, "--child", str(theirs.fileno())], pass_fds=[theirs.fileno()]
    )
    theirs.close()
    fd = os.memfd_create("baton-writer-place")
    os.ftruncate(fd, n)
    shared = torch.frombuffer(mmap.mmap(fd, n), dtype=torch.uint8)
    socket.send_fds(ours, [f"map {n}".encode()], [fd])
    os.close(fd)
    assert ours.recv(16) == b"ok"
    private = torch.empty(n, dtype=torch.uint8)
    source = torch.randn(n // 4).view(torch.uint8)

    def start(kind: str) -> Callable[[], bool]:
        """Start ``kind``'s write; return a poll that is True once it is durable."""
        if kind == "none":
            left = [15]

            def count() -> bool:
                left[0] -= 1
                return left[0] < 0

            return count
        if kind.startswith("thread"):
            private.copy_(source)

            def run() -> None:
                tid = threading.get_native_id()
                os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + 10)
                with private.numpy().data as view:
                    write_file(view, str(root / "t.bin"), hashed=kind == "thread-hash")

            th = threading.Thread(target=run)
            th.start()
            return lambda: not th.is_alive()
        shared.copy_(source)
        ours.send(f"{kind.removeprefix('proc-')} {root / 'p.bin'}".encode())
        ours.setblocking(False)

        def answered() -> bool:
            try:
                got = ours.recv(16)
            except BlockingIOError:
                return False
            ours.setblocking(True)
            assert got == b"ok"
            return True

        return answered

    w, x = torch.randn(768, 768) / 30, torch.randn(768, 768)
    steps = {"matmul": matmul_step(w, x), "small": small_step()}
    ratios: dict[tuple[str, str], list[float]] = {}
    print(f"load average at start: {loadavg()}", flush=True)
    try:
        for r in range(args.rounds):
            for shape, step in steps.items():
                k = r % len(CONTENDERS)
                for kind in CONTENDERS[k:] + CONTENDERS[:k]:
                    base = []
                    for _ in range(15):
                        t0 = time.perf_counter()
                        step()
                        base.append(time.perf_counter() - t0)
                    done = start(kind)
                    flying = []
                    while not done():
                        t0 = time.perf_counter()
                        step()
                        flying.append(time.perf_counter() - t0)
                    ratio = statistics.median(flying) / statistics.median(base) if flying else 1.0
                    ratios.setdefault((shape, kind), []).append(ratio)
                    os.sync()
            print(f"round {r + 1}/{args.rounds} done, load average {loadavg()}", flush=True)
    finally:
        ours.close()
        proc.wait(timeout=30)
        for f in root.iterdir():
            f.unlink()
        root.rmdir()

    print(
        f"\n{args.mib} MiB written and fsync'd per save, {args.rounds} rounds; end load "
        f"{loadavg()}; step time while writing / before (median of rounds; min-max)"
    )
    print("| step | " + " | ".join(CONTENDERS) + " |")
    print("|---|" + "---|" * len(CONTENDERS))
    for shape in steps:
        cells = []
        for kind in CONTENDERS:
            v = ratios[(shape, kind)]
            cells.append(f"{statistics.median(v):.3f}x ({min(v):.2f}-{max(v):.2f})")
        print(f"| {shape} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(int(sys.argv[2]))
    else:
        main()
