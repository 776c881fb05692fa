"""Replication of the memory tier between pods' sidecars: push, receive, fill, report.

A snapshot in one pod's memory (``fast_dir``) is lost with its node. This module copies each
snapshot of its pod to ``replicas`` peer sidecars on other failure domains, keeps the replicas
other pods send here, and, before a restore, fetches from the peers every file of the newest
snapshot that this pod lacks, so that the SDK's agreement (``restore``) finds it complete.

Who calls what:

* the SDK (``LOCAL_RANK`` 0) asks through the control directory
  (:mod:`trainer_sdk.replication`); :func:`baton_sidecar._serve.serve` polls for requests and
  runs :meth:`Replicator.replicate` or :meth:`Replicator.fill` on a worker thread;
* peers call the HTTP handlers in :mod:`baton_sidecar._server`, which use
  :meth:`Replicator.receive_file`, :meth:`Replicator.commit_replica`,
  :meth:`Replicator.catalog` and :meth:`Replicator.file_for_download`.

Every transfer is streamed in chunks of ``replication_chunk_bytes`` (the memory a transfer
holds), every file is checked against the manifest's digest as it arrives, and a replica's
manifest is written last, after every file it lists for the source's ranks has been
verified: a replica cut short has no manifest and is never listed or served. A receiver keeps
per source (a set of ranks, never a pod name) at most the newest complete replica and the
one being received.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import logging
import os
import shutil
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from baton_sidecar._config import Peer, SidecarConfig
from baton_sidecar._metrics import SidecarMetrics
from trainer_sdk.layout import (
    FILE_RE,
    MANIFEST,
    Manifest,
    check_name,
    new_hasher,
    parse_step_dir,
    step_dir,
)
from trainer_sdk.replication import (
    ADVERT_FILE,
    REPLICA_DIR,
    Answer,
    parse_source,
    source_key,
    write_json_atomic,
)

__all__ = ["ReplicationError", "Replicator"]

log = logging.getLogger("baton_sidecar.replication")

MAX_MANIFEST_BYTES: Final = 256 * 1024 * 1024
"""The largest manifest accepted from a peer (the format's own bound on JSON files)."""
_PART: Final = ".part"


class ReplicationError(Exception):
    """A refused upload or a failed transfer; ``status`` is the HTTP status (to answer with,
    or the one a peer answered)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class _Held:
    """A complete snapshot (``source`` None: this pod's own) or replica in this pod's memory."""

    source: str | None
    step: int
    directory: Path
    manifest: Manifest
    manifest_sha256: str
    files: dict[str, int]
    """The files present here, at the size the manifest gives."""


def _digest(digest: tuple[str, str]) -> str:
    return f"{digest[0]}={digest[1]}"


def _ranks_of(names: Iterator[str] | list[str]) -> tuple[set[int], int | None]:
    ranks: set[int] = set()
    world: int | None = None
    for name in names:
        m = FILE_RE.fullmatch(name)
        if m:
            ranks.add(int(m.group(1)))
            world = int(m.group(2))
    return ranks, world


class Replicator:
    """This pod's side of the replication; thread-safe (pushes and fills run on threads)."""

    def __init__(
        self, config: SidecarConfig, *, token: Callable[[], str], metrics: SidecarMetrics
    ) -> None:
        assert config.fast_dir is not None
        self.config = config
        self.fast_dir = config.fast_dir
        self.replica_dir = config.fast_dir / REPLICA_DIR
        self.domain = config.failure_domain
        self._token = token
        self.metrics = metrics
        self._lock = threading.Lock()
        self._peers: list[Peer] = list(config.peers)
        self._replicas = config.replicas
        self._pending: dict[tuple[str, int], dict[str, tuple[str, str, int]]] = {}
        """Files of replicas being received, verified on arrival: (algorithm, digest, size)."""
        self._peer_state: dict[str, dict[str, Any]] = {}
        self.last_replicated_step: int | None = None
        self.last_replicated_at: float | None = None
        self.bytes_sent = 0
        self.bytes_received = 0
        self.bytes_fetched = 0
        self.failures = 0
        self.last_error: str | None = None
        self.last_fill: dict[str, Any] | None = None

    # ---- configuration and status ---------------------------------------------------------

    def set_peers(self, peers: list[Peer], replicas: int | None) -> None:
        with self._lock:
            self._peers = list(peers)
            if replicas is not None:
                self._replicas = replicas
        log.info(
            "replication peers set: %s (replicas %d)",
            ", ".join(f"{p.address} [{p.domain or '?'}]" for p in peers) or "none",
            self._replicas,
        )

    def status(self) -> dict[str, Any]:
        """The ``replication`` part of ``GET /v1/status``."""
        held = []  # cheap (no manifest is parsed): the operator polls this
        with contextlib.suppress(OSError):
            for d in sorted(self.replica_dir.iterdir()):
                for name in sorted(os.listdir(d)):
                    step = parse_step_dir(name)
                    if step is not None and parse_source(d.name) is not None:
                        complete = (d / name / MANIFEST).exists()
                        held.append({"source": d.name, "step": step, "complete": complete})
        with self._lock:
            return {
                "fast_dir": str(self.fast_dir),
                "domain": self.domain,
                "replicas": self._replicas,
                "peers": [
                    {
                        "address": p.address,
                        "domain": p.domain,
                        **self._peer_state.get(p.address, {}),
                    }
                    for p in self._peers
                ],
                "last_replicated_step": self.last_replicated_step,
                "last_replicated_at": self.last_replicated_at,
                "bytes_sent": self.bytes_sent,
                "bytes_received": self.bytes_received,
                "bytes_fetched": self.bytes_fetched,
                "failures": self.failures,
                "last_error": self.last_error,
                "held": held,
                "last_fill": self.last_fill,
            }

    def advertise(self) -> None:
        """Create or renew the advert the SDK checks before it asks (see
        :mod:`trainer_sdk.replication`); called every second or so."""
        path = self.config.control_dir / ADVERT_FILE
        try:
            os.utime(path)
        except FileNotFoundError:
            write_json_atomic(path, {"pid": os.getpid(), "fast_dir": str(self.fast_dir)})

    def withdraw(self) -> None:
        with contextlib.suppress(OSError):
            (self.config.control_dir / ADVERT_FILE).unlink()

    def _fail(self, what: str, peer: str | None = None) -> None:
        with self._lock:
            self.failures += 1
            self.last_error = what
            if peer is not None:
                st = self._peer_state.setdefault(peer, {})
                st["failures"] = int(st.get("failures", 0)) + 1
                st["last_error"] = what

    # ---- what this pod holds --------------------------------------------------------------

    def _read_held(self, source: str | None, directory: Path, step: int) -> _Held | None:
        try:
            data = (directory / MANIFEST).read_bytes()
            manifest = Manifest.parse(data, step=step)
        except FileNotFoundError:
            return None
        except Exception as e:
            log.debug("%s has no usable manifest: %s", directory, e)
            return None
        files: dict[str, int] = {}
        for name, entry in manifest.files.items():
            try:
                if os.stat(directory / name).st_size == entry.size:
                    files[name] = entry.size
            except OSError:
                continue
        return _Held(source, step, directory, manifest, hashlib.sha256(data).hexdigest(), files)

    def _held(self, *, own: bool = True) -> list[_Held]:
        out: list[_Held] = []
        roots: list[tuple[str | None, Path]] = [(None, self.fast_dir)] if own else []
        with contextlib.suppress(OSError):
            roots += [
                (d.name, d)
                for d in sorted(self.replica_dir.iterdir())
                if parse_source(d.name) is not None
            ]
        for source, root in roots:
            try:
                names = sorted(os.listdir(root))
            except OSError:
                continue
            for name in names:
                step = parse_step_dir(name)
                if step is not None:
                    held = self._read_held(source, root / name, step)
                    if held is not None:
                        out.append(held)
        return out

    def catalog(self) -> list[dict[str, Any]]:
        """The body of ``GET /v1/replicas``: every complete snapshot and replica held here."""
        return [
            {
                "source": h.source,
                "step": h.step,
                "files": h.files,
                "digests": {n: _digest(e.digest) for n, e in h.manifest.files.items()},
            }
            for h in self._held()
        ]

    def file_for_download(self, source: str | None, step: int, name: str) -> Path:
        """The file a peer asks for, from a *complete* snapshot or replica only."""
        if name != MANIFEST:
            check_name(name)
        if source is None:
            directory = self.fast_dir / step_dir(step)
        else:
            if parse_source(source) is None:
                raise ReplicationError(400, f"{source!r} is not a source key like 'w4-r2.3'")
            directory = self.replica_dir / source / step_dir(step)
        if not (directory / MANIFEST).is_file() or not (directory / name).is_file():
            raise ReplicationError(404, f"no complete copy of step {step} holds {name}")
        return directory / name

    # ---- receiving ------------------------------------------------------------------------

    def _source_dir(self, source: str) -> Path:
        if parse_source(source) is None:
            raise ReplicationError(
                400, f"{source!r} is not a source key like 'w4-r2.3' (world size, ranks)"
            )
        return self.replica_dir / source

    def begin_file(
        self, source: str, step: int, name: str, *, size: int | None, digest: str | None
    ) -> tuple[Path, str, str]:
        """Check an upload's headers and make room; returns (part path, algorithm, digest)."""
        world_ranks = parse_source(source)
        root = self._source_dir(source)
        try:
            check_name(name)
        except Exception as e:
            raise ReplicationError(400, str(e)) from None
        m = FILE_RE.fullmatch(name)
        assert m is not None
        assert world_ranks is not None
        if int(m.group(2)) != world_ranks[0] or int(m.group(1)) not in world_ranks[1]:
            raise ReplicationError(400, f"{name} is not a file of source {source}")
        if size is None:
            raise ReplicationError(411, "send Content-Length: replicas are not chunk-encoded")
        algorithm, _, want = (digest or "").partition("=")
        if not want:
            raise ReplicationError(
                400, "send X-Baton-Digest: <algorithm>=<hex> with the manifest's digest"
            )
        try:
            new_hasher(algorithm)
        except (ValueError, ImportError) as e:
            raise ReplicationError(400, str(e)) from None
        directory = root / step_dir(step)
        if (directory / MANIFEST).exists():
            raise ReplicationError(409, f"step {step} of {source} is already complete here")
        self._make_room(source, keep=step)
        directory.mkdir(parents=True, exist_ok=True)
        return directory / (name + _PART), algorithm, want

    def _make_room(self, source: str, *, keep: int) -> None:
        """Before a new replica of ``source``: drop its other incomplete ones, keep the
        newest complete (at most it and the one being received)."""
        root = self.replica_dir / source
        try:
            names = os.listdir(root)
        except FileNotFoundError:
            return
        for name in names:
            step = parse_step_dir(name)
            if step is not None and step != keep and not (root / name / MANIFEST).exists():
                shutil.rmtree(root / name, ignore_errors=True)
                with self._lock:
                    self._pending.pop((source, step), None)

    def end_file(
        self,
        source: str,
        step: int,
        name: str,
        part: Path,
        *,
        algorithm: str,
        want: str,
        got: str,
        size: int,
        expected: int,
    ) -> None:
        """After an upload's last byte: keep the file only if size and digest match."""
        if size != expected or got != want:
            part.unlink(missing_ok=True)
            why = (
                f"{size} bytes arrived, Content-Length said {expected}"
                if size != expected
                else f"its {algorithm} is {got}, the manifest says {want}"
            )
            self._fail(f"refused {name} of step {step} from {source}: {why}")
            raise ReplicationError(422, f"{name} refused: {why}; nothing was kept")
        os.replace(part, part.with_name(name))
        with self._lock:
            self._pending.setdefault((source, step), {})[name] = (algorithm, want, size)
            self.bytes_received += size
        self.metrics.replication_bytes.labels(direction="received").inc(size)

    def commit_replica(self, source: str, step: int, data: bytes) -> None:
        """The manifest, last: every file it lists for the source's ranks must have arrived
        verified against it; then it is written (atomically) and older replicas go."""
        world_ranks = parse_source(source)
        root = self._source_dir(source)
        assert world_ranks is not None
        try:
            manifest = Manifest.parse(data, step=step)
        except Exception as e:
            raise ReplicationError(422, f"the manifest of step {step} is not valid: {e}") from None
        if manifest.world_size != world_ranks[0]:
            raise ReplicationError(
                422, f"the manifest is of a world of {manifest.world_size}, the source {source}"
            )
        with self._lock:
            arrived = dict(self._pending.get((source, step), {}))
        directory = root / step_dir(step)
        for name, entry in manifest.files.items():
            m = FILE_RE.fullmatch(name)
            if m is None or int(m.group(1)) not in world_ranks[1]:
                continue
            algorithm, want = entry.digest
            if (
                arrived.get(name) != (algorithm, want, entry.size)
                or not (directory / name).is_file()
            ):
                raise ReplicationError(
                    409,
                    f"{name} of step {step} has not arrived verified against this manifest: "
                    "send every file of the source's ranks first, the manifest last",
                )
        tmp = directory / (MANIFEST + _PART)
        tmp.write_bytes(data)
        os.replace(tmp, directory / MANIFEST)
        with self._lock:
            self._pending.pop((source, step), None)
        self._drop_superseded(source, step, world_ranks)
        log.info("replica of step %d of %s complete (%s)", step, source, directory)

    def _drop_superseded(
        self, source: str, step: int, world_ranks: tuple[int, frozenset[int]]
    ) -> None:
        """After a replica of ``source`` at ``step`` completes: its older ones, and older
        replicas of sources it supersedes (overlapping ranks, or another world size: the job
        was resized), are deleted."""
        with contextlib.suppress(OSError):
            for d in self.replica_dir.iterdir():
                other = parse_source(d.name)
                if other is None:
                    continue
                same = d.name == source
                overlaps = other[0] != world_ranks[0] or bool(other[1] & world_ranks[1])
                if not (same or overlaps):
                    continue
                for name in os.listdir(d):
                    s = parse_step_dir(name)
                    if s is not None and s < step:
                        shutil.rmtree(d / name, ignore_errors=True)
                if not same and not any(parse_step_dir(n) is not None for n in os.listdir(d)):
                    shutil.rmtree(d, ignore_errors=True)

    # ---- pushing (the SDK's ``replicate`` request; a worker thread) -----------------------

    def _targets(self) -> list[Peer]:
        with self._lock:
            peers = list(self._peers)
        return [p for p in peers if not (self.domain and p.domain and p.domain == self.domain)]

    def replicate(self, step: int) -> Answer:
        """Copy this pod's snapshot of ``step`` to ``replicas`` peers of other domains."""
        t0 = time.monotonic()
        held = self._read_held(None, self.fast_dir / step_dir(step), step)
        if held is None:
            return Answer(id="", ok=False, step=step, error=f"no complete snapshot of step {step}")
        ranks, world = _ranks_of(list(held.files))
        if world is None:
            return Answer(id="", ok=False, step=step, error=f"step {step} holds no rank files")
        source = source_key(ranks, world)
        with self._lock:
            wanted = self._replicas
        targets = self._targets()
        if not targets:
            error = (
                "no peer on another failure domain is configured: set BATON_REPLICATION_PEERS "
                "or PUT /v1/replication/peers"
            )
            self._fail(error)
            return Answer(id="", ok=False, step=step, error=error)
        done: list[str] = []
        sent = 0
        errors: list[str] = []
        for peer in targets:
            if len(done) >= wanted:
                break
            try:
                sent += self._push(peer, source, held)
            except (OSError, http.client.HTTPException, ReplicationError) as e:
                why = f"{peer.address}: {e}"
                errors.append(why)
                self._fail(f"replicating step {step} to {why}", peer.address)
                self.metrics.replication_failures.labels(op="replicate").inc()
                log.warning("replicating step %d of %s to %s failed: %s", step, source, peer, e)
                continue
            done.append(peer.address)
            with self._lock:
                self._peer_state.setdefault(peer.address, {})["last_step"] = step
        if len(done) < wanted:
            return Answer(
                id="",
                ok=False,
                step=step,
                bytes=sent,
                peers=tuple(done),
                error=f"{len(done)} of {wanted} replicas made "
                f"({'; '.join(errors) or 'too few peers on other failure domains'})",
            )
        with self._lock:
            self.last_replicated_step = step
            self.last_replicated_at = time.time()
        self.metrics.replication_last_step.set(step)
        log.debug(
            "replicated step %d of %s to %s: %d bytes in %.3fs",
            step,
            source,
            ", ".join(done),
            sent,
            time.monotonic() - t0,
        )
        return Answer(id="", ok=True, step=step, bytes=sent, peers=tuple(done))

    def _connection(self, peer_address: str) -> tuple[http.client.HTTPConnection, str]:
        url = urllib.parse.urlsplit(peer_address)
        if url.scheme != "http" or not url.hostname:
            raise ReplicationError(400, f"peer address {peer_address!r}: use http://HOST:PORT")
        conn = http.client.HTTPConnection(
            url.hostname, url.port or 80, timeout=self.config.replication_timeout
        )
        return conn, url.path.rstrip("/")

    def _push(self, peer: Peer, source: str, held: _Held) -> int:
        """Stream every file (verified by the peer on arrival), then the manifest."""
        conn, base = self._connection(peer.address)
        chunk = bytearray(self.config.replication_chunk_bytes)
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
                    left = size
                    while left > 0:
                        n = f.readinto(memoryview(chunk)[: min(len(chunk), left)])
                        if not n:
                            raise OSError(f"{name} ended {left} bytes early while it was sent")
                        conn.send(memoryview(chunk)[:n])
                        left -= n
                self._expect_ok(conn, name)
                total += size
                with self._lock:
                    self.bytes_sent += size
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
                self.bytes_sent += len(data)
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

    # ---- filling (the SDK's ``fill`` request, before a restore; a worker thread) ----------

    def _peer_catalog(self, peer: Peer) -> list[dict[str, Any]]:
        conn, base = self._connection(peer.address)
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

    def fill(self) -> Answer:
        """Complete the newest snapshot that this pod and its peers together hold in full:
        fetch (verified) every file missing from ``fast_dir``, then its manifest, last.

        Every pod's manifest of a step lists the same files with the same digests (only its
        commit time differs), so a file counts for a step when its holder's manifest gives it
        the digest of the manifest chosen (this pod's own when it has one)."""
        t0 = time.monotonic()
        # step -> list of (holder: None here or a peer, source, files present, digests)
        offers: dict[int, list[tuple[Peer | None, str | None, dict[str, int], dict[str, str]]]]
        offers = {}
        for h in self._held():
            digests = {n: _digest(e.digest) for n, e in h.manifest.files.items()}
            offers.setdefault(h.step, []).append((None, h.source, h.files, digests))
        with self._lock:
            peers = list(self._peers)
        unreachable: list[str] = []
        for peer in peers:
            try:
                holdings = self._peer_catalog(peer)
            except (
                OSError,
                http.client.HTTPException,
                ReplicationError,
                ValueError,
                KeyError,
            ) as e:
                unreachable.append(f"{peer.address} ({e})")
                continue
            for item in holdings:
                try:
                    source = item["source"]
                    offers.setdefault(int(item["step"]), []).append(
                        (
                            peer,
                            None if source is None else str(source),
                            {str(n): int(v) for n, v in item["files"].items()},
                            {str(n): str(v) for n, v in item["digests"].items()},
                        )
                    )
                except (KeyError, TypeError, ValueError, AttributeError):
                    continue
        why: list[str] = []
        for step in sorted(offers, reverse=True):
            # this pod's own manifest first (it decides), then any other holder's
            ordered = sorted(offers[step], key=lambda o: (o[0] is not None, o[1] is not None))
            chosen = ordered[0]
            digests = chosen[3]
            holders: dict[str, list[tuple[Peer | None, str | None]]] = {}
            for holder, source, files, their in ordered:
                for name in files:
                    if name in digests and their.get(name) == digests[name]:
                        holders.setdefault(name, []).append((holder, source))
            missing = sorted(set(digests) - set(holders))
            if missing:
                why.append(f"step {step}: no reachable copy of {', '.join(missing)}")
                continue
            try:
                fetched = self._complete(step, (chosen[0], chosen[1]), holders)
            except (OSError, http.client.HTTPException, ReplicationError, ValueError) as e:
                why.append(f"step {step}: {e}")
                self._fail(f"filling step {step}: {e}")
                self.metrics.replication_failures.labels(op="fill").inc()
                continue
            self.last_fill = {
                "step": step,
                "bytes": fetched,
                "seconds": round(time.monotonic() - t0, 3),
                "at": time.time(),
                "error": None,
            }
            return Answer(id="", ok=True, step=step, bytes=fetched)
        if not offers and not unreachable:
            # nothing anywhere (a first start): nothing to complete, and nothing failed
            self.last_fill = {"step": None, "bytes": 0, "at": time.time(), "error": None}
            return Answer(id="", ok=True, step=None)
        if unreachable:
            why.append(f"unreachable peers: {', '.join(unreachable)}")
        error = "; ".join(why) or "no snapshot is held here or by any peer"
        self.last_fill = {"step": None, "bytes": 0, "at": time.time(), "error": error}
        return Answer(id="", ok=False, step=None, error=error)

    def _complete(
        self,
        step: int,
        manifest_from: tuple[Peer | None, str | None],
        holders: dict[str, list[tuple[Peer | None, str | None]]],
    ) -> int:
        directory = self.fast_dir / step_dir(step)
        directory.mkdir(parents=True, exist_ok=True)
        manifest_data = self._fetch_bytes(*manifest_from, step, MANIFEST)
        manifest = Manifest.parse(manifest_data, step=step)
        fetched = 0
        for name in sorted(manifest.files):
            target = directory / name
            if self._intact(target, manifest, name):
                continue  # this pod's own file
            errors: list[str] = []
            for peer, source in holders.get(name, []):
                try:
                    self._fetch_file(peer, source, step, name, manifest, target)
                except (OSError, http.client.HTTPException, ReplicationError) as e:
                    errors.append(f"{'here' if peer is None else peer.address}: {e}")
                    continue
                fetched += manifest.files[name].size
                break
            else:
                raise ReplicationError(
                    502, f"{name} could not be fetched intact: {'; '.join(errors) or 'no holder'}"
                )
        if not (directory / MANIFEST).exists():
            tmp = directory / (MANIFEST + _PART)
            tmp.write_bytes(manifest_data)
            os.replace(tmp, directory / MANIFEST)  # the commit marker, last
        with self._lock:
            self.bytes_fetched += fetched
        self.metrics.replication_bytes.labels(direction="fetched").inc(fetched)
        log.info("step %d completed in %s: %d bytes fetched", step, directory, fetched)
        return fetched

    def _intact(self, path: Path, manifest: Manifest, name: str) -> bool:
        """Whether ``path`` is there with the manifest's size and digest (read in chunks)."""
        entry = manifest.files[name]
        algorithm, want = entry.digest
        hasher = new_hasher(algorithm)
        chunk = bytearray(self.config.replication_chunk_bytes)
        size = 0
        try:
            with open(path, "rb", buffering=0) as f:
                while n := f.readinto(chunk):
                    hasher.update(memoryview(chunk)[:n])
                    size += n
        except OSError:
            return False
        return size == entry.size and hasher.hexdigest() == want

    def _path_for(self, source: str | None, step: int, name: str) -> str:
        who = "snapshots" if source is None else f"replicas/{source}"
        return f"/v1/{who}/{step}/{name}"

    def _fetch_bytes(self, peer: Peer | None, source: str | None, step: int, name: str) -> bytes:
        if peer is None:
            root = self.fast_dir if source is None else self.replica_dir / source
            return (root / step_dir(step) / name).read_bytes()
        conn, base = self._connection(peer.address)
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

    def _fetch_file(  # noqa: PLR0917 - one holder's address parts, then what to fetch
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
        part = target.with_name(name + _PART)
        chunk = bytearray(self.config.replication_chunk_bytes)
        conn: http.client.HTTPConnection | None = None
        try:
            if peer is None:
                root = self.fast_dir if source is None else self.replica_dir / source
                src: Any = open(root / step_dir(step) / name, "rb", buffering=0)  # noqa: SIM115
            else:
                conn, base = self._connection(peer.address)
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
