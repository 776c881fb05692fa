"""Where checkpoint bytes live: a local directory or S3. See :mod:`trainer_sdk.storage.base`."""

from __future__ import annotations

import os
from typing import TypeAlias

from trainer_sdk.storage.base import Storage, TooLargeError, Writer

__all__ = ["Location", "Storage", "TooLargeError", "Writer", "open_storage"]

Location: TypeAlias = "str | os.PathLike[str] | Storage"
"""Where a checkpoint root is: a path (``str`` or ``pathlib.Path``), a ``file://`` or
``s3://`` URI, or an already opened :class:`Storage` (reused as is, e.g. one S3 client)."""


def open_storage(where: Location) -> Storage:
    """Open the checkpoint root ``where``: a path, ``file://...``, ``s3://...`` or a Storage."""
    if isinstance(where, os.PathLike):
        where = os.fspath(where)
    if not isinstance(where, str):
        if isinstance(where, Storage):
            return where
        raise TypeError(
            f"a checkpoint location must be a path, a file:// or s3:// URI, or a Storage; "
            f"got {type(where).__name__}"
        )
    if where.startswith("s3://"):
        from trainer_sdk.storage.s3 import S3Storage  # boto3 only when used

        return S3Storage.from_uri(where)
    from trainer_sdk.storage.local import LocalStorage

    return LocalStorage.from_uri(where)
