"""Which steps exist and which are complete: manifest reading, torch-free.

Shared by :mod:`trainer_sdk.api` and the CLI (which must start fast and work without torch).
The functions that take a :data:`~trainer_sdk.storage.Location` (a path, a URI or a Storage)
are public through :mod:`trainer_sdk.api` (``list_steps``, ``latest_step``, ``delete_step``,
``cleanup_incomplete``, ``register_attempt``, ...); the rest serve the SDK and the CLI.
A step is *complete* when its ``manifest.json`` exists and passes validation; anything else
in a step directory is invisible to readers.

Errors fall into two kinds (the list is in ``docs/format.md``):

* *the checkpoint is bad*: the manifest fails validation (:class:`ManifestError`), or a file
  fails its checksum or size (:class:`CorruptCheckpointError`). Readers skip the step with a
  WARNING that names the file and the reason, and use the next older complete one.
* *it cannot be read now, or not by this version*: a permission or I/O error, a storage
  failure after every retry, a newer format version, an unknown dtype
  (:class:`UnreadableCheckpointError`). The step may be good: it is raised, never skipped.

Fencing: every manifest records its writer's *attempt*, and ``fence`` at the root holds the
newest attempt that has started writing. A step whose attempt is older than the attempt of an
older committed step was committed by a stale writer after a newer attempt took over; readers
ignore it (they follow the newest lineage).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Final

from trainer_sdk.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    ManifestError,
    StorageError,
    SupersededError,
    UnreadableCheckpointError,
)
from trainer_sdk.format.layout import (
    LATEST,
    MANIFEST,
    MAX_JSON_BYTES,
    Manifest,
    parse_latest,
    parse_step_dir,
    step_dir,
)
from trainer_sdk.storage import Location, Storage, TooLargeError, open_storage

__all__ = [
    "FENCE",
    "cleanup_incomplete",
    "complete_steps",
    "delete_step",
    "is_complete",
    "latest_hint",
    "latest_step",
    "list_steps",
    "manifest_absent",
    "manifest_key",
    "newest_attempt",
    "newest_complete",
    "read_fence",
    "read_manifest",
    "register_attempt",
    "remember_manifest",
    "retain",
    "step_dirs",
    "unreadable",
]

log = logging.getLogger("trainer_sdk.catalog")

FENCE: Final = "fence"
"""``{"attempt": N}``: the newest attempt that has started writing under this root."""


def manifest_key(step: int) -> str:
    return f"{step_dir(step)}/{MANIFEST}"


def unreadable(e: BaseException, step: int | None, what: str) -> UnreadableCheckpointError:
    """An :class:`UnreadableCheckpointError` for an I/O or storage failure, naming the fix."""
    where = f"step {step}" if step is not None else "the checkpoint root"
    return UnreadableCheckpointError(
        f"{where} cannot be read now ({what}: {type(e).__name__}: {e}). It may well be "
        "good, so it was neither skipped nor deleted: fix the cause (file permissions, the "
        "filesystem or the object store, credentials) and restart; to discard the step on "
        "purpose, delete it with trainer_sdk.delete_step()",
        step=step,
    )


class _ManifestCache:
    """Parsed manifests of committed steps, per root (its URI), each with the storage's
    version token of the manifest object it was parsed from.

    Why: a commit reads the manifests of the kept steps several times (the fence check, the
    reference check, retention), and parsing a manifest that lists a frozen base's tensors
    costs milliseconds, which against a save of a small adapter is a large share.

    Correctness: a committed manifest is written once (``create_exclusive``) and never in
    place; a step is gone or rewritten only after its manifest object is deleted (retention,
    ``delete_step``, a person) and, for a rewrite, created anew. So an entry is served only
    when the object's version token (``Storage.version``: ETag and size on S3; device, inode,
    size, mtime and ctime on a filesystem) is the one it was parsed from: a deleted manifest
    has no token (IncompleteCheckpointError, as without the cache), a rewritten one another
    token. An entry is stored only under the token of the very bytes it was parsed from:
    ``read_with_version`` returns the bytes and their token from one request (on S3 the GET's
    own ETag and length; on a filesystem ``fstat`` of the open file, before and after the
    read, a token that never matches if they differ), and without it the token is taken
    before and after the read and the entry stored only if the two agree. This process's own
    deletes drop their entries at once. Storages without ``version`` are
    never cached. Bounded: at most :data:`_CACHED_ROOTS` roots, and a root keeps only the steps
    its last listing still showed.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._roots: OrderedDict[str, dict[int, tuple[str, Manifest]]] = OrderedDict()

    def get(self, uri: str, step: int, token: str) -> Manifest | None:
        with self._lock:
            hit = self._roots.get(uri, {}).get(step)
            if hit is None or hit[0] != token:
                return None
            self._roots.move_to_end(uri)
            return hit[1]

    def put(self, uri: str, step: int, token: str, manifest: Manifest) -> None:
        with self._lock:
            self._roots.setdefault(uri, {})[step] = (token, manifest)
            self._roots.move_to_end(uri)
            while len(self._roots) > _CACHED_ROOTS:
                self._roots.popitem(last=False)

    def drop(self, uri: str, step: int) -> None:
        with self._lock:
            self._roots.get(uri, {}).pop(step, None)

    def keep_only(self, uri: str, steps: set[int]) -> None:
        with self._lock:
            cached = self._roots.get(uri)
            if cached is not None:
                for s in set(cached) - steps:
                    del cached[s]


_CACHED_ROOTS: Final = 16
_manifests = _ManifestCache()


def _version_of(storage: Storage) -> Callable[[str], str] | None:
    version = getattr(storage, "version", None)
    return version if callable(version) else None


def remember_manifest(storage: Storage, manifest: Manifest) -> None:
    """After this process committed ``manifest`` (its bytes are at its key now): cache it,
    so that later commits under this root do not read it back."""
    version = _version_of(storage)
    if version is None:
        return
    try:
        token = version(manifest_key(manifest.step))
    except (OSError, StorageError, CheckpointError):
        return  # only a cache: the next read reads it
    _manifests.put(storage.uri, manifest.step, token, manifest)


def read_manifest(where: Location, step: int) -> Manifest:
    """The validated manifest of ``step``.

    Raises :class:`IncompleteCheckpointError` if it never committed (no manifest object),
    :class:`ManifestError` if the manifest is bad, :class:`UnreadableCheckpointError` if it
    cannot be read now or by this version. A manifest parsed before is served from the cache
    when its object is unchanged (see :class:`_ManifestCache`): one ``version`` call, no read
    (on S3 one HEAD). A miss adds one ``read_with_version`` (one GET) where the storage has
    it; otherwise ``size``, ``read_bytes`` and ``version`` again (on S3 two HEADs and a GET).
    """
    storage = open_storage(where)
    key = manifest_key(step)
    version = _version_of(storage)
    token: str | None = None
    read_with_version = getattr(storage, "read_with_version", None)
    try:
        if version is not None:
            token = version(key)
            hit = _manifests.get(storage.uri, step, token)
            if hit is not None:
                return hit
        if version is not None and callable(read_with_version):
            # One request: the token is that of the bytes read, whatever happened since the
            # version() above (a GET on S3, where the fallback below costs two more HEADs).
            try:
                data, token = read_with_version(key, limit=MAX_JSON_BYTES)
            except TooLargeError as e:
                raise ManifestError(f"manifest is {e.size} bytes, over the limit", path=key) from e
        else:
            size = storage.size(key)
            if size > MAX_JSON_BYTES:
                raise ManifestError(f"manifest is {size} bytes, over the limit", path=key)
            data = storage.read_bytes(key)
            if version is not None and token != version(key):
                token = None  # changed during the read: not cached
    except FileNotFoundError as e:
        _manifests.drop(storage.uri, step)
        raise IncompleteCheckpointError(
            f"step {step} under {storage.uri} has no manifest: it never committed (load an "
            "older step, or cleanup_incomplete() it)"
        ) from e
    except (OSError, StorageError) as e:
        raise unreadable(e, step, f"reading {key}") from e
    manifest = Manifest.parse(data, step=step, path=key)
    if token is not None:
        _manifests.put(storage.uri, step, token, manifest)
    return manifest


def manifest_absent(storage: Storage, step: int) -> bool:
    """Whether ``step`` has no manifest object at all (an I/O failure raises, never "absent")."""
    key = manifest_key(step)
    try:
        return not storage.exists(key)
    except (OSError, StorageError) as e:
        raise unreadable(e, step, f"checking {key}") from e


def step_dirs(where: Location) -> list[int]:
    """Steps that have a directory under ``where`` (complete or not), ascending."""
    steps = [parse_step_dir(n) for n in open_storage(where).list_dir("")]
    return sorted(s for s in steps if s is not None)


def is_complete(storage: Storage, step: int) -> bool:
    """Whether ``step`` has a valid manifest. A bad manifest is not complete; a manifest that
    cannot be read now or by this version raises :class:`UnreadableCheckpointError`."""
    try:
        read_manifest(storage, step)
    except (IncompleteCheckpointError, ManifestError, CorruptCheckpointError):
        return False
    return True


def complete_steps(where: Location, *, warn: bool = False) -> dict[int, Manifest]:
    """Every complete step of the newest lineage, with its manifest, ascending.

    Bad manifests are skipped (with a WARNING naming the file and the reason when ``warn``).
    A manifest that cannot be read now raises if it is newer than every readable complete
    step (it may be the newest good one); an older one is left out with a WARNING, since it
    cannot change which step is newest. Steps committed by a stale attempt after a newer
    attempt had committed an older step are left out (see the module docstring).
    """
    storage = open_storage(where)
    out: dict[int, Manifest] = {}
    dirs = step_dirs(storage)
    _manifests.keep_only(storage.uri, set(dirs))
    for s in reversed(dirs):  # newest first
        try:
            out[s] = read_manifest(storage, s)
        except IncompleteCheckpointError:
            continue
        except (ManifestError, CorruptCheckpointError) as e:
            if warn:
                log.warning("checkpoint step %d is bad and is skipped: %s", s, e)
            continue
        except UnreadableCheckpointError as e:
            if not out:
                raise
            log.warning(
                "checkpoint step %d cannot be read now and is left out (step %d is newer): %s",
                s,
                max(out),
                e,
            )
    out = dict(sorted(out.items()))
    lineage: dict[int, Manifest] = {}
    top = 0
    for s, m in out.items():
        if m.attempt < top:
            if warn:
                log.warning(
                    "checkpoint step %d was committed by attempt %d after attempt %d had "
                    "taken over (a stale writer); it is ignored",
                    s,
                    m.attempt,
                    top,
                )
            continue
        top = m.attempt
        lineage[s] = m
    return lineage


def newest_complete(storage: Storage) -> int | None:
    """The newest complete step of the newest lineage; bad steps are skipped with a WARNING,
    an unreadable one raises (never fall back silently past a step that may be good)."""
    steps = complete_steps(storage, warn=True)
    return max(steps) if steps else None


def read_fence(storage: Storage) -> tuple[int, str | None]:
    """(attempt in ``fence``, its version token); (0, None) when there is none."""
    try:
        data, token = storage.read_versioned(FENCE)
    except FileNotFoundError:
        return 0, None
    except (OSError, StorageError) as e:
        raise unreadable(e, None, f"reading {FENCE}") from e
    try:
        obj = json.loads(data[:4096])
        attempt = obj["attempt"] if isinstance(obj, dict) else None
    except ValueError:
        attempt = None
    if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 0:
        raise ManifestError(
            f'{FENCE} is not {{"attempt": N}}; delete it if no other writer is running',
            path=FENCE,
        )
    return attempt, token


def newest_attempt(where: Location) -> int:
    """The newest attempt that has started writing or committed under ``where`` (0: none)."""
    storage = open_storage(where)
    fence, _ = read_fence(storage)
    committed = complete_steps(storage)
    return max([fence, *(m.attempt for m in committed.values())])


def latest_hint(storage: Storage) -> int | None:
    """What ``latest`` says (a hint only), or None."""
    try:
        return parse_latest(storage.read_bytes(LATEST))
    except (FileNotFoundError, CheckpointError, OSError):
        return None


# ------------------------------------------------------------ public through trainer_sdk.api


def list_steps(uri: Location) -> list[int]:
    """Every complete step (valid manifest, newest lineage) under ``uri``, ascending.

    Raises :class:`UnreadableCheckpointError` if a manifest cannot be read now or by this
    version (so a caller never mistakes a step that may be good for a missing one).
    """
    return sorted(complete_steps(uri))


def latest_step(uri: Location) -> int | None:
    """The newest complete step under ``uri``, or None.

    ``latest`` is only a hint: the step directories are listed and their manifests validated,
    newest first, so a ``latest`` that is stale or points at a broken step is never trusted.
    A bad step is skipped with a WARNING; an unreadable one raises
    :class:`UnreadableCheckpointError`.
    """
    return newest_complete(open_storage(uri))


def referenced_paths(manifests: Mapping[int, Manifest], *, without: int | None = None) -> set[str]:
    """Storage keys of the shards that the steps in ``manifests`` (except ``without``) read
    from *other* steps' directories (format v3 references)."""
    out: set[str] = set()
    for s, m in manifests.items():
        if s != without:
            out.update(m.path_of(k) for k, f in m.files.items() if f.step is not None)
    return out


def _sweep_dir(storage: Storage, step: int, referenced: set[str]) -> list[str]:
    """Delete the files of ``step``'s directory that no kept step references; the directory
    itself when nothing in it is referenced. Returns the storage keys kept."""
    prefix = f"{step_dir(step)}/"
    keep = sorted(p for p in referenced if p.startswith(prefix))
    if not keep:
        storage.delete_tree(step_dir(step))
        return []
    for name in storage.list_dir(step_dir(step)):
        if prefix + name not in keep:
            storage.delete(prefix + name)
    return keep


def delete_step(uri: Location, step: int, *, referenced: set[str] | None = None) -> None:
    """Delete one step: the manifest first (so readers stop seeing it at once), then the rest,
    except the shards a later complete step references (format v3): those stay in the
    directory, which is no longer a step, until no kept step references them (the sweep of
    :func:`cleanup_incomplete`). ``referenced``: those shards' keys, when already known."""
    storage = open_storage(uri)
    if referenced is None:
        referenced = referenced_paths(complete_steps(storage), without=step)
    storage.delete(manifest_key(step))
    _manifests.drop(storage.uri, step)
    kept = _sweep_dir(storage, step, referenced)
    if kept:
        log.info(
            "step %d is deleted (no longer a restore point), but %d of its shard(s) are kept: "
            "later steps reference them (%s)",
            step,
            len(kept),
            ", ".join(kept),
        )


def cleanup_incomplete(uri: Location, *, older_than: int | None = None) -> list[str]:
    """Delete step directories that are provably abandoned: no manifest object at all, and
    older than ``older_than`` (default: the newest complete step, so an in-progress save is
    never touched). A directory whose manifest is bad or cannot be read is kept (it may be
    good, or be evidence). Shards that a complete step references (format v3) are kept, the
    rest of their directory goes. Only a writer should call this, after its own commit.
    Returns the names of the directories deleted whole."""
    storage = open_storage(uri)
    limit = latest_step(storage) if older_than is None else older_than
    if limit is None:
        return []
    removed = []
    referenced: set[str] | None = None
    for s in step_dirs(storage):
        if s < limit and manifest_absent(storage, s):
            if referenced is None:
                referenced = referenced_paths(complete_steps(storage))
            if not _sweep_dir(storage, s, referenced):
                removed.append(step_dir(s))
    return removed


def register_attempt(uri: Location, attempt: int | None) -> int:
    """Record in ``fence`` that ``attempt`` starts writing under ``uri``; return the attempt.

    ``attempt`` None (outside Kubernetes, no ``BATON_ATTEMPT``): derive a new generation, one
    above the newest attempt seen under ``uri``. A compare-and-swap, so two writers starting
    together get different generations and the fence never moves backwards. Raises
    :class:`SupersededError` if a newer attempt has already started or committed.
    """
    storage = open_storage(uri)
    for _ in range(20):
        fence, token = read_fence(storage)
        committed = max((m.attempt for m in complete_steps(storage).values()), default=0)
        newest = max(fence, committed)
        mine = newest + 1 if attempt is None else attempt
        if mine < newest:
            raise SupersededError(
                f"this run is attempt {mine}, but attempt {newest} has already started writing "
                f"under {storage.uri}: this process is a stale copy of the job, stop it. (If "
                f"you reuse the uri for a new job on purpose, delete {storage.uri}/"
                f"{FENCE} first, or give the new job its own uri)",
                attempt=mine,
                newer=newest,
            )
        if mine == fence:
            return mine
        if storage.replace_if(FENCE, json.dumps({"attempt": mine}).encode(), token=token):
            return mine
    raise StorageError(f"{storage.uri}/{FENCE} kept changing under us; retry")


def retain(storage: Storage, *, committed: int, keep_last: int, attempt: int | None) -> None:
    """Delete complete steps beyond the newest ``keep_last``, and step directories older than
    ``committed`` that have no manifest object at all (crashed or failed saves).

    The Checkpointer calls it on rank 0 only after ``committed``'s manifest is written, so the
    newest complete checkpoint is never deleted, and never before its successor is durable.
    Only steps older than ``committed`` are touched: a newer directory may be a save that
    another rank has already started (the next async save), and is not ours to judge.
    Fencing: if a newer attempt than ``attempt`` has started under the uri, nothing is
    deleted, and a step committed by a newer attempt is never deleted.
    """
    if attempt is not None:
        newest = newest_attempt(storage)
        if newest > attempt:
            log.warning(
                "attempt %d of this job has started writing under %s: this (stale) attempt %d "
                "deletes nothing there",
                newest,
                storage.uri,
                attempt,
            )
            return
    complete = complete_steps(storage)
    keep = set(sorted(complete)[-keep_last:]) | {committed}
    kept = {s: m for s, m in complete.items() if s in keep or s >= committed}
    for old, manifest in complete.items():
        if old < committed and old not in keep:
            if attempt is not None and manifest.attempt > attempt:
                kept[old] = manifest
                continue
            delete_step(storage, old, referenced=referenced_paths(kept))
    for name in cleanup_incomplete(storage, older_than=committed):
        log.info("removed incomplete checkpoint directory %s", name)
