"""The memory tier's copies in this pod: what it holds, and the replicas its peers send.

This pod's own snapshots (``fast_dir/step_*``) and the replicas peers push to it
(``fast_dir/{REPLICA_DIR}/<source>/step_*``) are read here (:meth:`ReplicaStore.held`, the
catalog a peer asks for, the file it downloads) and received here: the HTTP handlers in
:mod:`baton_sidecar._server` call :meth:`ReplicaStore.begin_file` and
:meth:`ReplicaStore.end_file` around each streamed upload, and
:meth:`ReplicaStore.commit_replica` with the manifest, last. No network I/O: sending and
fetching are :mod:`baton_sidecar._peer_transport`'s, deciding what to send or fetch is
:mod:`baton_sidecar._replication`'s.

A replica's manifest is written last, after every file it lists for the source's ranks has
arrived verified against it: a replica cut short has no manifest and is never listed or
served. Per source (a set of ranks, never a pod name) at most the newest complete replica and
the one being received are kept.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from baton_sidecar._config import SidecarConfig
from baton_sidecar._metrics import SidecarMetrics
from trainer_sdk.format.layout import (
    FILE_RE,
    MANIFEST,
    Manifest,
    check_name,
    new_hasher,
    parse_step_dir,
    step_dir,
)
from trainer_sdk.replication import REPLICA_DIR, parse_source
from trainer_sdk.storage.local import keep_as_spares, spare_candidates, take_spare

__all__ = [
    "MAX_MANIFEST_BYTES",
    "PART",
    "SPARES",
    "Held",
    "ReplicaStore",
    "ReplicationError",
    "ReplicationStats",
    "digest_text",
]

log = logging.getLogger("baton_sidecar.replication")

MAX_MANIFEST_BYTES: Final = 256 * 1024 * 1024
"""The largest manifest accepted from a peer (the format's own bound on JSON files)."""
PART: Final = ".part"
"""The suffix of a file being written; it is renamed to its name once verified."""
SPARES: Final = ".spare"
"""The directory in ``fast_dir/{REPLICA_DIR}`` that keeps, per source, the files of the replica
last superseded, for the next replica's files to overwrite (as the trainer's snapshots do:
:data:`trainer_sdk.loop._memory_tier.SPARES`): on tmpfs a new file costs about 4x the CPU of
overwriting one. Not a source key: nothing lists or serves it."""


class ReplicationError(Exception):
    """A refused upload or a failed transfer; ``status`` is the HTTP status (to answer with,
    or the one a peer answered)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class Held:
    """A complete snapshot (``source`` None: this pod's own) or replica in this pod's memory."""

    source: str | None
    step: int
    directory: Path
    manifest: Manifest
    manifest_sha256: str
    files: dict[str, int]
    """The files present here, at the size the manifest gives."""


def digest_text(digest: tuple[str, str]) -> str:
    """A manifest digest as the wire writes it: ``<algorithm>=<hex>``."""
    return f"{digest[0]}={digest[1]}"


@dataclass(slots=True)
class ReplicationStats:
    """What the replication has done, for ``GET /v1/status``; one per sidecar, shared by the
    store, the transport and the :class:`~baton_sidecar._replication.Replicator` (pushes,
    fills and uploads run on threads: every field is read and written under ``lock``)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    peer_state: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Peer address -> its last step, failures and last error."""
    last_replicated_step: int | None = None
    last_replicated_at: float | None = None
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_fetched: int = 0
    failures: int = 0
    last_error: str | None = None
    last_fill: dict[str, Any] | None = None

    def fail(self, what: str, peer: str | None = None) -> None:
        """Count a failure (of ``peer``, when one is to blame)."""
        with self.lock:
            self.failures += 1
            self.last_error = what
            if peer is not None:
                st = self.peer_state.setdefault(peer, {})
                st["failures"] = int(st.get("failures", 0)) + 1
                st["last_error"] = what


class ReplicaStore:
    """This pod's snapshots and the replicas it keeps for its peers; thread-safe."""

    def __init__(
        self, config: SidecarConfig, *, stats: ReplicationStats, metrics: SidecarMetrics
    ) -> None:
        assert config.fast_dir is not None
        self.config = config
        self.fast_dir = config.fast_dir
        self.replica_dir = config.fast_dir / REPLICA_DIR
        self.stats = stats
        self.metrics = metrics
        self._lock = stats.lock
        self._pending: dict[tuple[str, int], dict[str, tuple[str, str, int]]] = {}
        """Files of replicas being received, verified on arrival: (algorithm, digest, size)."""

    def listing(self) -> list[dict[str, Any]]:
        """Every replica directory here, complete or not (cheap: no manifest is parsed, for
        the status the operator polls)."""
        held = []
        with contextlib.suppress(OSError):
            for d in sorted(self.replica_dir.iterdir()):
                for name in sorted(os.listdir(d)):
                    step = parse_step_dir(name)
                    if step is not None and parse_source(d.name) is not None:
                        complete = (d / name / MANIFEST).exists()
                        held.append({"source": d.name, "step": step, "complete": complete})
        return held

    # ---- what this pod holds --------------------------------------------------------------

    def read_held(self, source: str | None, directory: Path, step: int) -> Held | None:
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
        return Held(source, step, directory, manifest, hashlib.sha256(data).hexdigest(), files)

    def held(self, *, own: bool = True) -> list[Held]:
        out: list[Held] = []
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
                    held = self.read_held(source, root / name, step)
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
                "digests": {n: digest_text(e.digest) for n, e in h.manifest.files.items()},
            }
            for h in self.held()
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
        part = directory / (name + PART)
        take_spare(spare_candidates(str(self.replica_dir / SPARES / source), size), str(part))
        return part, algorithm, want

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

    def refused(self, source: str, step: int, name: str, why: str) -> ReplicationError:
        """Record that one file of a replica was refused; the error to answer with."""
        self.stats.fail(f"refused {name} of step {step} from {source}: {why}")
        return ReplicationError(422, f"{name} refused: {why}; nothing was kept")

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
            raise self.refused(source, step, name, why)
        os.replace(part, part.with_name(name))
        with self._lock:
            self._pending.setdefault((source, step), {})[name] = (algorithm, want, size)
            self.stats.bytes_received += size
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
        tmp = directory / (MANIFEST + PART)
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
                older = sorted(
                    s for s in map(parse_step_dir, os.listdir(d)) if s is not None and s < step
                )
                for s in older:
                    if same and s == older[-1]:
                        # nothing reads it any more (a fetch of it happens only at a restore,
                        # when no snapshot replicates; one cut short is verified and refused)
                        with contextlib.suppress(OSError):
                            keep_as_spares(
                                str(d / step_dir(s)), str(self.replica_dir / SPARES / source)
                            )
                    shutil.rmtree(d / step_dir(s), ignore_errors=True)
                if not same and not any(parse_step_dir(n) is not None for n in os.listdir(d)):
                    shutil.rmtree(d, ignore_errors=True)

    # ---- pushing (the SDK's ``replicate`` request; a worker thread) -----------------------
