"""Benchmark: memory-tier replication between two sidecars against a plain loopback copy.

Prints one table, all figures measured side by side in this run (alternating, median of
``--repeat``):

1. **sidecar replication**: a ``--mib`` MiB snapshot (real format v1 files from
   ``trainer_sdk.save``, ``--tensors`` tensors) in one ``baton-sidecar``'s ``fast_dir`` on
   ``/dev/shm`` (the tmpfs a ``medium: Memory`` ``emptyDir`` is) copied to a second sidecar
   process on the SDK's request (``trainer_sdk.replication``: request file, streamed HTTP
   PUTs in ``BATON_REPLICATION_CHUNK_BYTES`` chunks, the receiver hashing every chunk
   against the manifest's digest and writing to its ``/dev/shm`` directory, manifest last),
   timed from the request to the answer. The snapshots are successive steps, as in
   training (the receiver keeps the newest replica and writes each one into the files of the
   one before the last); one replication before the timed ones fills the receiver;
2. **plain loopback copy**: the same files, sent by one Python process over one TCP
   connection in chunks of the same size (``socket.sendall``) to a second process that
   writes them to ``/dev/shm`` (``readinto`` and ``write``), no hashing: the floor for any
   copy between two processes on this machine;
3. **loopback copy + digest**: the same, with the receiver hashing every chunk with the
   manifest's algorithm (what verifying on arrival costs at least).

Every row also gives the CPU seconds per GiB that both ends spent (the two sidecar
processes and the loopback's receiver, from ``/proc``; its sender, this process, from
``getrusage``):
on a training node that CPU comes out of the training step beside it.

Usage: ``python bench/replication.py [--mib 256] [--tensors 8] [--repeat 5]``.
Not a test: timings are never assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

import trainer_sdk
from trainer_sdk.format.layout import DIGESTS
from trainer_sdk.replication import REPLICATE, SidecarLink

REPO = Path(__file__).resolve().parent.parent
SIDECAR = Path(sys.executable).parent / "baton-sidecar"
TOKEN = "bench-token"
CHUNK = 1 << 20

_RECEIVER = textwrap.dedent(
    """
    import hashlib, os, socket, sys
    from trainer_sdk.format.layout import new_hasher
    port_file, out_dir, algorithm, chunk = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    with open(port_file + ".tmp", "w") as f:
        f.write(str(srv.getsockname()[1]))
    os.replace(port_file + ".tmp", port_file)
    buf = bytearray(chunk)
    while True:
        conn, _ = srv.accept()
        f = conn.makefile("rb", buffering=0)
        header = b""
        while not header.endswith(b"\\n"):
            header += conn.recv(1)
        if header == b"quit\\n":
            break
        for item in header.decode().split():
            name, size = item.rsplit(":", 1)
            size = int(size)
            hasher = new_hasher(algorithm) if algorithm != "none" else None
            with open(os.path.join(out_dir, name), "wb") as out:
                left = size
                while left:
                    n = f.readinto(memoryview(buf)[: min(chunk, left)])
                    if not n:
                        raise SystemExit("sender went away")
                    if hasher is not None:
                        hasher.update(memoryview(buf)[:n])
                    out.write(memoryview(buf)[:n])
                    left -= n
        conn.sendall(b"ok")
        conn.close()
    """
)


def _shm() -> Path:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return Path(tempfile.mkdtemp(prefix="baton-repl-bench-", dir=base))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _sidecar(
    root: Path, name: str, port: int, peers: list[dict[str, str]]
) -> subprocess.Popen[bytes]:
    d = root / name
    (d / "token").mkdir(parents=True)
    (d / "token" / "token").write_text(TOKEN)
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
    env.update(
        BATON_CONTROL_DIR=str(d / "control"),
        BATON_SIDECAR_TOKEN_FILE=str(d / "token" / "token"),
        BATON_SIDECAR_PORT=str(port),
        BATON_CLOUD="none",
        BATON_FAST_DIR=str(d / "fast"),
        BATON_FAILURE_DOMAIN=name,
        BATON_REPLICATION_PEERS=json.dumps(peers),
        BATON_REPLICATION_CHUNK_BYTES=str(CHUNK),
        BATON_SIDECAR_LOG_LEVEL="WARNING",
    )
    return subprocess.Popen(
        [str(SIDECAR), "--host", "127.0.0.1"],
        env=env,
        stderr=open(d / "log", "wb"),
    )


def _wait(cond: object, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` so far (every thread), from ``/proc``."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def _own_cpu() -> float:
    """CPU seconds of this process so far."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    return me.ru_utime + me.ru_stime


def _loopback(files: list[Path], algorithm: str, out: Path) -> tuple[float, float]:
    """Seconds to send ``files`` to a fresh receiver process that writes (and hashes) them,
    and the CPU seconds both processes spent on it (from the first byte to the receiver's
    answer: not the receiver's start-up)."""
    port_file = out / "port"
    recv = subprocess.Popen(
        [sys.executable, "-c", _RECEIVER, str(port_file), str(out), algorithm, str(CHUNK)],
        cwd=REPO,
    )
    try:
        _wait(port_file.exists, "the receiver")
        port = int(port_file.read_text())
        buf = bytearray(CHUNK)
        cpu0 = _own_cpu() + _cpu_seconds([recv.pid])
        t0 = time.perf_counter()
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(" ".join(f"{p.name}:{p.stat().st_size}" for p in files).encode() + b"\n")
            for p in files:
                with open(p, "rb", buffering=0) as f:
                    while n := f.readinto(buf):
                        s.sendall(memoryview(buf)[:n])
            assert s.recv(2) == b"ok"
        seconds = time.perf_counter() - t0
        used = _own_cpu() + _cpu_seconds([recv.pid]) - cpu0
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"quit\n")
        recv.wait(30)
        return seconds, used
    finally:
        if recv.poll() is None:
            recv.kill()
        for p in out.iterdir():
            p.unlink()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    root = _shm()
    before = " ".join(map(str, os.getloadavg()))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        pa, pb = _free_port(), _free_port()
        procs.append(
            _sidecar(root, "a", pa, [{"address": f"http://127.0.0.1:{pb}", "domain": "b"}])
        )
        procs.append(_sidecar(root, "b", pb, []))
        numel = args.mib * (1 << 20) // 4 // args.tensors
        gen = torch.Generator().manual_seed(0)
        state = {f"t{i}": torch.randn(numel, generator=gen) for i in range(args.tensors)}
        step = 1
        for i in range(args.repeat + 1):  # successive snapshots, each replicated once
            with torch.no_grad():
                state["t0"][0] = i
            trainer_sdk.save(state, str(root / "a" / "fast"), step=step + i)
        snap = root / "a" / "fast" / f"step-{step:012d}"
        files = sorted(snap.iterdir())
        nbytes = sum(f.stat().st_size for f in files)
        manifest = json.loads((snap / "manifest.json").read_text())
        algorithms = {k for e in manifest["files"].values() for k in e if k in DIGESTS}
        algorithm = next(a for a in ("xxh3_128", "blake3", "sha256") if a in algorithms)
        link = SidecarLink(root / "a" / "control")
        _wait(link.available, "the sidecar's advert")
        _wait(SidecarLink(root / "b" / "control").available, "the peer's advert")
        loop_out = _shm()
        times: dict[str, list[float]] = {"replication": [], "loopback": [], "digest": []}
        cpu: dict[str, list[float]] = {k: [] for k in times}
        sidecars = [proc.pid for proc in procs]
        for i in range(args.repeat + 1):
            cpu0 = _cpu_seconds(sidecars)
            t0 = time.perf_counter()
            answer = link.call(REPLICATE, step=step + i, timeout=600)
            seconds = time.perf_counter() - t0
            if not answer.ok:
                raise SystemExit(f"replication failed: {answer.error}")
            if i == 0:
                continue  # fills the receiver: from here each replica has one before it
            times["replication"].append(seconds)
            cpu["replication"].append(_cpu_seconds(sidecars) - cpu0)
            for key, algo in (("loopback", "none"), ("digest", algorithm)):
                seconds, used = _loopback(files, algo, loop_out)
                times[key].append(seconds)
                cpu[key].append(used)
        shutil.rmtree(loop_out, ignore_errors=True)
        med = {k: statistics.median(v) for k, v in times.items()}
        med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
        mib = nbytes / (1 << 20)
        print(f"snapshot: {mib:.0f} MiB in {len(files)} files ({algorithm} digests), "
              f"chunk {CHUNK >> 10} KiB, median of {args.repeat}")  # fmt: skip
        print(f"load average before: {before}, after: {' '.join(map(str, os.getloadavg()))}")
        print("| copy | seconds | MiB/s | vs plain loopback | CPU s per GiB (both ends) |")
        print("|---|---|---|---|---|")
        rows = [
            ("plain loopback copy (2 processes, TCP)", "loopback"),
            (f"loopback copy + {algorithm} on receive", "digest"),
            ("sidecar replication (verified, manifest last)", "replication"),
        ]
        for label, key in rows:
            per_gib = med_cpu[key] * 1024 / mib
            print(f"| {label} | {med[key]:.3f} | {mib / med[key]:.0f} | "
                  f"{med[key] / med['loopback']:.2f}x | {per_gib:.2f} |")  # fmt: skip
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
