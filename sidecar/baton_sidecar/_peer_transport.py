"""The memory tier's peer transport: HTTP between sidecars, streamed and verified.

Pushing a snapshot to a peer (every file, each checked by the peer as it arrives, then the
manifest, last), asking a peer what it holds, and fetching a file from a holder: a peer over
HTTP, or a snapshot or replica in this pod's own memory. Every transfer is streamed in chunks
of ``replication_chunk_bytes`` (the memory a transfer holds) and carries the job's bearer
token. What to send where, and which files to fetch, is decided in
:mod:`baton_sidecar._replication`; what is kept here, in :mod:`baton_sidecar._replica_store`.
"""

from __future__ import annotations

import http.client
import json
import os
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from baton_sidecar._config import Peer
from baton_sidecar._replica_store import (
    MAX_MANIFEST_BYTES,
    PART,
    Held,
    ReplicaStore,
    ReplicationError,
)
from trainer_sdk.format.layout import MANIFEST, Manifest, new_hasher, step_dir

__all__ = ["PeerTransport"]


class PeerTransport:
    """This pod's HTTP client to its peers' sidecars; thread-safe (no state of its own)."""

    def __init__(self, store: ReplicaStore, *, token: Callable[[], str]) -> None:
        """``store``: where a holder in this pod reads from, and whose configuration, counters
        and metrics the transfers use."""
        self.config = store.config
        self.fast_dir = store.fast_dir
        self.replica_dir = store.replica_dir
        self._token = token
        self.stats = store.stats
        self.metrics = store.metrics
        self._lock = store.stats.lock

    def connection(self, peer_address: str) -> tuple[http.client.HTTPConnection, str]:
        url = urllib.parse.urlsplit(peer_address)
        if url.scheme != "http" or not url.hostname:
            raise ReplicationError(400, f"peer address {peer_address!r}: use http://HOST:PORT")
        conn = http.client.HTTPConnection(
            url.hostname, url.port or 80, timeout=self.config.replication_timeout
        )
        return conn, url.path.rstrip("/")

    def push(self, peer: Peer, source: str, held: Held) -> int:
        """Stream every file (verified by the peer on arrival), then the manifest."""
        conn, base = self.connection(peer.address)
        total = 0
        try:
            prefix = f"{base}/v1/replicas/{source}/{held.step}"
            for name in sorted(held.files):
                algorithm, want = held.manifest.files[name].digest
                size = held.files[name]
                conn.putrequest("PUT", f"{prefix}/{name}")
                conn.putheader("Authorization", f"Bearer {self._token()}")
                conn.putheader("Content-Type", "application/octet-stream")
                conn.putheader("Content-Length", str(size))
                conn.putheader("X-Baton-Digest", f"{algorithm}={want}")
                conn.endheaders()
                with open(held.directory / name, "rb", buffering=0) as f:
                    # sendfile(2): the kernel copies the file's pages to the socket, with no
                    # trip through this process's memory
                    assert conn.sock is not None  # connected by endheaders()
                    sent = conn.sock.sendfile(f, 0, size)
                    if sent != size:
                        raise OSError(f"{name} ended {size - sent} bytes early while it was sent")
                self._expect_ok(conn, name)
                total += size
                with self._lock:
                    self.stats.bytes_sent += size
                self.metrics.replication_bytes.labels(direction="sent").inc(size)
            data = (held.directory / MANIFEST).read_bytes()
            conn.request(
                "PUT",
                f"{prefix}/{MANIFEST}",
                body=data,
                headers={
                    "Authorization": f"Bearer {self._token()}",
                    "Content-Type": "application/json",
                },
            )
            self._expect_ok(conn, MANIFEST)
            with self._lock:
                self.stats.bytes_sent += len(data)
            self.metrics.replication_bytes.labels(direction="sent").inc(len(data))
            return total + len(data)
        finally:
            conn.close()

    @staticmethod
    def _expect_ok(conn: http.client.HTTPConnection, name: str) -> None:
        resp = conn.getresponse()
        body = resp.read(64 * 1024)
        if resp.status // 100 != 2:
            try:
                message = json.loads(body).get("error", body.decode(errors="replace"))
            except ValueError:
                message = body.decode(errors="replace")
            raise ReplicationError(resp.status, f"{name}: HTTP {resp.status}: {message}")

    # ---- asking peers (the SDK's ``fill`` request, before a restore; a worker thread) ----------

    def peer_catalog(self, peer: Peer) -> list[dict[str, Any]]:
        conn, base = self.connection(peer.address)
        try:
            conn.request(
                "GET", f"{base}/v1/replicas", headers={"Authorization": f"Bearer {self._token()}"}
            )
            resp = conn.getresponse()
            body = resp.read(MAX_MANIFEST_BYTES)
            if resp.status != 200:
                raise ReplicationError(resp.status, f"HTTP {resp.status}: {body[:500]!r}")
            holdings = json.loads(body)["holdings"]
            return [h for h in holdings if isinstance(h, dict)]
        finally:
            conn.close()

    def _path_for(self, source: str | None, step: int, name: str) -> str:
        who = "snapshots" if source is None else f"replicas/{source}"
        return f"/v1/{who}/{step}/{name}"

    def fetch_bytes(self, peer: Peer | None, source: str | None, step: int, name: str) -> bytes:
        if peer is None:
            root = self.fast_dir if source is None else self.replica_dir / source
            return (root / step_dir(step) / name).read_bytes()
        conn, base = self.connection(peer.address)
        try:
            conn.request(
                "GET",
                base + self._path_for(source, step, name),
                headers={"Authorization": f"Bearer {self._token()}"},
            )
            resp = conn.getresponse()
            body = resp.read(MAX_MANIFEST_BYTES)
            if resp.status != 200:
                raise ReplicationError(resp.status, f"HTTP {resp.status} for {name}")
            return body
        finally:
            conn.close()

    def fetch_file(  # noqa: PLR0917 - one holder's address parts, then what to fetch
        self,
        peer: Peer | None,
        source: str | None,
        step: int,
        name: str,
        manifest: Manifest,
        target: Path,
    ) -> None:
        """Copy one file (from a peer, or from a replica held here), streamed and verified."""
        entry = manifest.files[name]
        algorithm, want = entry.digest
        hasher = new_hasher(algorithm)
        part = target.with_name(name + PART)
        chunk = bytearray(self.config.replication_chunk_bytes)
        conn: http.client.HTTPConnection | None = None
        try:
            if peer is None:
                root = self.fast_dir if source is None else self.replica_dir / source
                src: Any = open(root / step_dir(step) / name, "rb", buffering=0)  # noqa: SIM115
            else:
                conn, base = self.connection(peer.address)
                conn.request(
                    "GET",
                    base + self._path_for(source, step, name),
                    headers={"Authorization": f"Bearer {self._token()}"},
                )
                src = conn.getresponse()
                if src.status != 200:
                    raise ReplicationError(src.status, f"HTTP {src.status}")
            size = 0
            with open(part, "wb") as out:
                while True:
                    n = src.readinto(chunk)
                    if not n:
                        break
                    view = memoryview(chunk)[:n]
                    hasher.update(view)
                    out.write(view)
                    size += n
                    if size > entry.size:
                        break
            if peer is None:
                src.close()
            if size != entry.size or hasher.hexdigest() != want:
                raise ReplicationError(
                    422, f"{name} arrived with {size} bytes or another {algorithm}: refused"
                )
            os.replace(part, target)
        finally:
            if conn is not None:
                conn.close()
            part.unlink(missing_ok=True)
