"""The memory tier's replication hand-off between the SDK and its pod's sidecar (torch-free).

A snapshot in one pod's memory does not survive the loss of its node. The pod's sidecar copies
each snapshot to peer sidecars on other failure domains, and fetches what is missing from
them before a restore (``docs/sidecar.md``, "Replication"). The SDK and the sidecar share two
directories: the control directory (``BATON_CONTROL_DIR``) and the memory tier (``fast_dir``).
This module is their whole contract, so that both sides read the same names:

* the sidecar advertises that it replicates by keeping ``replication.json`` in the control
  directory fresh (its modification time is renewed every second or so). A stale advert
  (a sidecar that died) is ignored: the SDK never waits for a sidecar that is gone;
* ``LOCAL_RANK`` 0 of the pod asks with ``<op>-request.json`` (``op`` is ``replicate``: copy
  the snapshot of ``step`` to the peers; or ``fill``: fetch from peers the files of the newest
  snapshot that the pod lacks) and waits, bounded, for ``<op>-answer.json`` with the same id;
* the sidecar listens on ``replication.bell``, a FIFO in the control directory, and the SDK
  writes a byte to it after each request, so a request is taken at once without the sidecar
  looking for one many times a second beside the training steps (it still looks every second
  or so, for an SDK that could not ring);
* the sidecar keeps the replicas it holds for other pods under ``<fast_dir>/replicas/``, one
  directory per *source*: the set of ranks whose files a snapshot holds (``w4-r2.3`` is ranks
  2 and 3 of a world of 4), never a pod name, so that a replacement pod finds its ranks' data.

The sidecar imports this module; it must not import torch (import-linter checks it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import stat
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Final

__all__ = [
    "ADVERT_FILE",
    "ADVERT_FRESH_SECONDS",
    "BELL_FILE",
    "FILL",
    "OPS",
    "REPLICATE",
    "REPLICA_DIR",
    "Answer",
    "ReplicationRequest",
    "SidecarLink",
    "answer_path",
    "parse_source",
    "read_request",
    "request_path",
    "ring_bell",
    "source_key",
    "write_answer",
    "write_json_atomic",
]

ADVERT_FILE: Final = "replication.json"
"""In the control directory: present and fresh while the pod's sidecar replicates."""
ADVERT_FRESH_SECONDS: Final = 10.0
"""An advert older than this is a sidecar that is gone (it renews the file every second)."""
BELL_FILE: Final = "replication.bell"
"""In the control directory: a FIFO the sidecar reads; a byte written to it means "a request
is waiting" (its content means nothing)."""
REPLICATE: Final = "replicate"
FILL: Final = "fill"
OPS: Final = (REPLICATE, FILL)
REPLICA_DIR: Final = "replicas"
"""Under ``fast_dir``: the replicas this pod's sidecar holds for other pods (not a step
directory, so the SDK's listing and retention never see it)."""

_SOURCE_RE: Final = re.compile(r"w(\d{1,6})-r(\d{1,6}(?:\.\d{1,6})*)")


def source_key(ranks: list[int] | set[int], world: int) -> str:
    """The name of a source (a set of ranks of a world), e.g. ``w4-r2.3``."""
    if not ranks or world < 1 or any(not 0 <= r < world for r in ranks):
        raise ValueError(f"ranks {sorted(ranks)} are not ranks of a world of {world}")
    return f"w{world}-r{'.'.join(str(r) for r in sorted(set(ranks)))}"


def parse_source(key: str) -> tuple[int, frozenset[int]] | None:
    """``(world, ranks)`` of a source key, or None when ``key`` is not one (a path guard)."""
    m = _SOURCE_RE.fullmatch(key)
    if m is None:
        return None
    world = int(m.group(1))
    ranks = frozenset(int(r) for r in m.group(2).split("."))
    if world < 1 or any(r >= world for r in ranks):
        return None
    return world, ranks


def request_path(control_dir: str | os.PathLike[str], op: str) -> Path:
    return Path(control_dir) / f"{op}-request.json"


def answer_path(control_dir: str | os.PathLike[str], op: str) -> Path:
    return Path(control_dir) / f"{op}-answer.json"


def ring_bell(control_dir: str | os.PathLike[str]) -> bool:
    """Wake the sidecar for a request just written; False when no sidecar listens.

    Never blocks and never raises: a missing FIFO, one nobody reads (``ENXIO``), a full one
    (``EAGAIN``: the sidecar has bells it has not read yet, so it will look anyway) and a
    path that is not a FIFO (left untouched) all mean the sidecar finds the request at its
    next look instead.
    """
    try:
        flags = os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW
        fd = os.open(Path(control_dir) / BELL_FILE, flags)
    except OSError:
        return False
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return False
        os.write(fd, b"\n")
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` atomically (a temporary file renamed over it)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # the other container may run as another user (contracts.md)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return None  # being replaced, or garbage: the writer renames whole files only
    return data if isinstance(data, dict) else None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ReplicationRequest:
    """One request of the SDK to its sidecar."""

    id: str
    op: str
    step: int | None
    """``replicate``: the snapshot to copy. ``fill``: None (the newest the peers can complete)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Answer:
    """The sidecar's answer to one request."""

    id: str
    ok: bool
    step: int | None = None
    """``replicate``: the step copied. ``fill``: the step now complete locally (None: none)."""
    bytes: int = 0
    """Bytes sent (``replicate``) or fetched (``fill``)."""
    peers: tuple[str, ...] = ()
    """``replicate``: the peers that now hold the snapshot."""
    error: str | None = None
    """What went wrong, when ``ok`` is false (or, for ``fill``, why no step could be
    completed)."""

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "peers": list(self.peers)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Answer:
        step = data.get("step")
        return cls(
            id=str(data.get("id")),
            ok=bool(data.get("ok")),
            step=int(step) if isinstance(step, int) else None,
            bytes=int(data.get("bytes") or 0),
            peers=tuple(str(p) for p in data.get("peers") or ()),
            error=None if data.get("error") is None else str(data.get("error")),
        )


def read_request(control_dir: str | os.PathLike[str], op: str) -> ReplicationRequest | None:
    """The sidecar's side: take the pending request of ``op`` (the file is removed), if any."""
    path = request_path(control_dir, op)
    data = _read_json(path)
    if data is None:
        return None
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    step = data.get("step")
    return ReplicationRequest(
        id=str(data.get("id")), op=op, step=int(step) if isinstance(step, int) else None
    )


def write_answer(control_dir: str | os.PathLike[str], op: str, answer: Answer) -> None:
    """The sidecar's side: answer a request of ``op``."""
    write_json_atomic(answer_path(control_dir, op), answer.to_json())


class SidecarLink:
    """The SDK's side (``LOCAL_RANK`` 0 of a pod): ask the pod's sidecar, wait for its answer."""

    def __init__(self, control_dir: str | os.PathLike[str]) -> None:
        self.control_dir = Path(control_dir)

    def available(self) -> bool:
        """Whether a live sidecar replicates for this pod (a fresh advert)."""
        try:
            age = time.time() - os.stat(self.control_dir / ADVERT_FILE).st_mtime
        except OSError:
            return False
        return age < ADVERT_FRESH_SECONDS

    def call(self, op: str, *, step: int | None, timeout: float) -> Answer:
        """Ask for ``op`` and wait at most ``timeout`` seconds; an answer with ``ok`` false
        when the sidecar fails, goes away or takes too long (it is never waited on longer)."""
        rid = uuid.uuid4().hex
        with contextlib.suppress(FileNotFoundError):
            answer_path(self.control_dir, op).unlink()
        write_json_atomic(request_path(self.control_dir, op), {"id": rid, "op": op, "step": step})
        ring_bell(self.control_dir)
        deadline = time.monotonic() + timeout
        pause = 0.002
        while True:
            data = _read_json(answer_path(self.control_dir, op))
            if data is not None and data.get("id") == rid:
                return Answer.from_json(data)
            if time.monotonic() > deadline:
                error = f"the sidecar did not answer the {op} request within {timeout:.0f}s"
                break
            if not self.available():
                error = f"the sidecar stopped advertising replication during the {op} request"
                break
            time.sleep(pause)
            pause = min(pause * 1.5, 0.05)
        with contextlib.suppress(FileNotFoundError):
            request_path(self.control_dir, op).unlink()
        return Answer(id=rid, ok=False, step=step, error=error)
