"""Where checkpoint bytes live: a local directory or S3. See :mod:`trainer_sdk.storage.base`."""

from __future__ import annotations

from trainer_sdk.storage.base import Storage, Writer

__all__ = ["Storage", "Writer", "open_storage"]


def open_storage(uri: str) -> Storage:
    """Open the checkpoint root named by ``uri``: a plain path, ``file://...`` or ``s3://...``."""
    if uri.startswith("s3://"):
        from trainer_sdk.storage.s3 import S3Storage  # boto3 only when used

        return S3Storage.from_uri(uri)
    from trainer_sdk.storage.local import LocalStorage

    return LocalStorage.from_uri(uri)
