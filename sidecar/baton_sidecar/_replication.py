"""Replication of the memory tier between pods' sidecars: what to push, what to fill, status.

A snapshot in one pod's memory (``fast_dir``) is lost with its node. The :class:`Replicator`
copies each snapshot of its pod to ``replicas`` peer sidecars on other failure domains and,
before a restore, fetches from the peers every file of the newest snapshot that this pod
lacks, so that the SDK's agreement (``restore``) finds it complete. It decides what to send
where and what to fetch from whom; the parts it uses are one module each:

* :mod:`baton_sidecar._replica_store`: what this pod holds, and the replicas peers send here
  (:class:`~baton_sidecar._replica_store.ReplicaStore`: receive, verify, commit, catalog);
* :mod:`baton_sidecar._peer_transport`: HTTP to the peers, streamed and verified
  (:class:`~baton_sidecar._peer_transport.PeerTransport`: push, peer catalog, fetch).

Who calls what:

* the SDK (``LOCAL_RANK`` 0) asks through the control directory
  (:mod:`trainer_sdk.replication`); :func:`baton_sidecar._serve.serve` polls for requests and
  runs :meth:`Replicator.replicate` or :meth:`Replicator.fill` on a worker thread;
* peers call the HTTP handlers in :mod:`baton_sidecar._server`, which use
  :attr:`Replicator.store` (``begin_file``, ``end_file``, ``commit_replica``, ``catalog``,
  ``file_for_download``).
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from baton_sidecar._config import Peer, SidecarConfig
from baton_sidecar._metrics import SidecarMetrics
from baton_sidecar._peer_transport import PeerTransport
from baton_sidecar._replica_store import (
    PART,
    ReplicaStore,
    ReplicationError,
    ReplicationStats,
    digest_text,
)
from trainer_sdk.format.layout import FILE_RE, MANIFEST, Manifest, new_hasher, step_dir
from trainer_sdk.replication import ADVERT_FILE, Answer, source_key, write_json_atomic

__all__ = ["Replicator"]

log = logging.getLogger("baton_sidecar.replication")


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
        self.domain = config.failure_domain
        self.metrics = metrics
        self.stats = ReplicationStats()
        self._lock = self.stats.lock
        self.store = ReplicaStore(config, stats=self.stats, metrics=metrics)
        """What this pod holds; the peers' uploads go here (``_server``)."""
        self.transport = PeerTransport(self.store, token=token)
        self._peers: list[Peer] = list(config.peers)
        self._replicas = config.replicas

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
        held = self.store.listing()  # cheap (no manifest is parsed): the operator polls this
        with self._lock:
            return {
                "fast_dir": str(self.fast_dir),
                "domain": self.domain,
                "replicas": self._replicas,
                "peers": [
                    {
                        "address": p.address,
                        "domain": p.domain,
                        **self.stats.peer_state.get(p.address, {}),
                    }
                    for p in self._peers
                ],
                "last_replicated_step": self.stats.last_replicated_step,
                "last_replicated_at": self.stats.last_replicated_at,
                "bytes_sent": self.stats.bytes_sent,
                "bytes_received": self.stats.bytes_received,
                "bytes_fetched": self.stats.bytes_fetched,
                "failures": self.stats.failures,
                "last_error": self.stats.last_error,
                "held": held,
                "last_fill": self.stats.last_fill,
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

    # ---- pushing (the SDK's ``replicate`` request; a worker thread) -----------------------

    def _targets(self) -> list[Peer]:
        with self._lock:
            peers = list(self._peers)
        return [p for p in peers if not (self.domain and p.domain and p.domain == self.domain)]

    def replicate(self, step: int) -> Answer:
        """Copy this pod's snapshot of ``step`` to ``replicas`` peers of other domains."""
        t0 = time.monotonic()
        held = self.store.read_held(None, self.fast_dir / step_dir(step), step)
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
            self.stats.fail(error)
            return Answer(id="", ok=False, step=step, error=error)
        done: list[str] = []
        sent = 0
        errors: list[str] = []
        for peer in targets:
            if len(done) >= wanted:
                break
            try:
                sent += self.transport.push(peer, source, held)
            except (OSError, http.client.HTTPException, ReplicationError) as e:
                why = f"{peer.address}: {e}"
                errors.append(why)
                self.stats.fail(f"replicating step {step} to {why}", peer.address)
                self.metrics.replication_failures.labels(op="replicate").inc()
                log.warning("replicating step %d of %s to %s failed: %s", step, source, peer, e)
                continue
            done.append(peer.address)
            with self._lock:
                self.stats.peer_state.setdefault(peer.address, {})["last_step"] = step
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
            self.stats.last_replicated_step = step
            self.stats.last_replicated_at = time.time()
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
        for h in self.store.held():
            digests = {n: digest_text(e.digest) for n, e in h.manifest.files.items()}
            offers.setdefault(h.step, []).append((None, h.source, h.files, digests))
        with self._lock:
            peers = list(self._peers)
        unreachable: list[str] = []
        for peer in peers:
            try:
                holdings = self.transport.peer_catalog(peer)
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
                self.stats.fail(f"filling step {step}: {e}")
                self.metrics.replication_failures.labels(op="fill").inc()
                continue
            self.stats.last_fill = {
                "step": step,
                "bytes": fetched,
                "seconds": round(time.monotonic() - t0, 3),
                "at": time.time(),
                "error": None,
            }
            return Answer(id="", ok=True, step=step, bytes=fetched)
        if not offers and not unreachable:
            # nothing anywhere (a first start): nothing to complete, and nothing failed
            self.stats.last_fill = {"step": None, "bytes": 0, "at": time.time(), "error": None}
            return Answer(id="", ok=True, step=None)
        if unreachable:
            why.append(f"unreachable peers: {', '.join(unreachable)}")
        error = "; ".join(why) or "no snapshot is held here or by any peer"
        self.stats.last_fill = {"step": None, "bytes": 0, "at": time.time(), "error": error}
        return Answer(id="", ok=False, step=None, error=error)

    def _complete(
        self,
        step: int,
        manifest_from: tuple[Peer | None, str | None],
        holders: dict[str, list[tuple[Peer | None, str | None]]],
    ) -> int:
        directory = self.fast_dir / step_dir(step)
        directory.mkdir(parents=True, exist_ok=True)
        manifest_data = self.transport.fetch_bytes(*manifest_from, step, MANIFEST)
        manifest = Manifest.parse(manifest_data, step=step)
        fetched = 0
        for name in sorted(manifest.files):
            target = directory / name
            if self._intact(target, manifest, name):
                continue  # this pod's own file
            errors: list[str] = []
            for peer, source in holders.get(name, []):
                try:
                    self.transport.fetch_file(peer, source, step, name, manifest, target)
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
            tmp = directory / (MANIFEST + PART)
            tmp.write_bytes(manifest_data)
            os.replace(tmp, directory / MANIFEST)  # the commit marker, last
        with self._lock:
            self.stats.bytes_fetched += fetched
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
