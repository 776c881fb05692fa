"""Which steps exist and which are complete: manifest reading, torch-free.

Shared by :mod:`trainer_sdk.api` and the CLI (which must start fast and work without torch).
A step is *complete* when its ``manifest.json`` exists and passes validation; anything else
in a step directory is invisible to readers.
"""

from __future__ import annotations

from trainer_sdk.errors import CheckpointError, IncompleteCheckpointError, ManifestError
from trainer_sdk.layout import (
    LATEST,
    MANIFEST,
    MAX_JSON_BYTES,
    Manifest,
    parse_latest,
    parse_step_dir,
    step_dir,
)
from trainer_sdk.storage import Storage

__all__ = [
    "is_complete",
    "latest_hint",
    "manifest_key",
    "newest_complete",
    "read_manifest",
    "step_dirs",
]


def manifest_key(step: int) -> str:
    return f"{step_dir(step)}/{MANIFEST}"


def read_manifest(storage: Storage, step: int) -> Manifest:
    """The validated manifest of ``step``; IncompleteCheckpointError if it never committed."""
    key = manifest_key(step)
    try:
        size = storage.size(key)
        if size > MAX_JSON_BYTES:
            raise ManifestError(f"manifest is {size} bytes, over the limit", path=key)
        data = storage.read_bytes(key)
    except FileNotFoundError as e:
        raise IncompleteCheckpointError(
            f"step {step} under {storage.uri} has no manifest: it never committed (load an "
            "older step, or cleanup_incomplete() it)"
        ) from e
    return Manifest.parse(data, step=step, path=key)


def step_dirs(storage: Storage) -> list[int]:
    """Steps that have a directory (complete or not), ascending."""
    steps = [parse_step_dir(n) for n in storage.list_dir("")]
    return sorted(s for s in steps if s is not None)


def is_complete(storage: Storage, step: int) -> bool:
    try:
        read_manifest(storage, step)
    except (CheckpointError, OSError):
        return False
    return True


def newest_complete(storage: Storage) -> int | None:
    for s in reversed(step_dirs(storage)):
        if is_complete(storage, s):
            return s
    return None


def latest_hint(storage: Storage) -> int | None:
    """What ``latest`` says (a hint only), or None."""
    try:
        return parse_latest(storage.read_bytes(LATEST))
    except (FileNotFoundError, CheckpointError, OSError):
        return None
