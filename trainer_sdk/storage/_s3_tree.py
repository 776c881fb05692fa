"""Listing and deleting trees of S3 objects, for :class:`~trainer_sdk.storage.s3.S3Storage`.

Why apart from ``s3.py``: a tree is pages of keys, not one object. A listing walks
ListObjectsV2's continuation tokens; a deletion lists every key under the tree, deletes them
with DeleteObjects (at most 1000 keys a request, and a request can fail for some keys only),
then aborts the multipart uploads left under the tree: a rank that crashed mid-upload leaves
parts that S3 bills until they are aborted, and retention or cleanup of an incomplete step is
when to do it. :class:`S3Trees` does that paging and batching; every request goes through the
storage's own retries and error translation (its ``call``) and its client.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, Final

from trainer_sdk.errors import StorageError

__all__ = ["S3Trees"]

_DELETE_BATCH: Final = 1000
"""DeleteObjects takes at most 1000 keys."""


class S3Trees:
    """The trees of one bucket, reached through one :class:`S3Storage`'s requests.

    ``call(action, key, request)`` runs ``request`` with the storage's retries and translates
    its failure (``S3Storage._call``); ``client()`` is the boto3 client to build a request on;
    ``uri_of(key)`` names a key in messages.
    """

    def __init__(
        self,
        *,
        bucket: str,
        page_size: int,
        call: Callable[[str, str, Callable[[], Any]], Any],
        client: Callable[[], Any],
        uri_of: Callable[[str], str],
    ) -> None:
        self._bucket = bucket
        self._page_size = page_size
        self._call = call
        self._client = client
        self._uri_of = uri_of

    def names(self, prefix: str) -> list[str]:
        """The names right under ``prefix`` (a key prefix ending in ``/``, or ``""`` for the
        bucket's root): its objects and its "directories", sorted."""
        names: set[str] = set()
        for page in self._object_pages(prefix, Delimiter="/"):
            for cp in page.get("CommonPrefixes", []):
                name = cp["Prefix"][len(prefix) :].rstrip("/")
                if name:
                    names.add(name)
            for obj in page.get("Contents", []):
                name = obj["Key"][len(prefix) :]
                if name:  # a "directory marker" object named like the prefix itself
                    names.add(name)
        return sorted(names)

    def delete(self, key: str) -> None:
        """Delete the object ``key`` (if there is one) and every object under ``key/``, then
        abort the multipart uploads under ``key/``."""
        prefix = key + "/"
        keys = [key]  # the path itself, if it is an object (deleting a missing key is fine)
        for page in self._object_pages(prefix):
            keys.extend(obj["Key"] for obj in page.get("Contents", []))
        for i in range(0, len(keys), _DELETE_BATCH):
            batch = {
                "Objects": [{"Key": k} for k in keys[i : i + _DELETE_BATCH]],
                "Quiet": True,
            }
            resp = self._call(
                "delete",
                prefix,
                functools.partial(self._client().delete_objects, Bucket=self._bucket, Delete=batch),
            )
            errors = resp.get("Errors", [])
            if errors:
                first = errors[0]
                raise StorageError(
                    f"deleting {len(errors)} objects under {self._uri_of(prefix)} failed, e.g. "
                    f"{first.get('Key')}: {first.get('Code')} {first.get('Message')}: grant "
                    "s3:DeleteObject (see docs/s3.md) and delete again"
                )
        self._abort_uploads_under(prefix)

    def _object_pages(self, prefix: str, **listing: str) -> Iterator[dict[str, Any]]:
        """Every page of ListObjectsV2 under ``prefix`` (``listing``: e.g. its Delimiter)."""
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {
                "Bucket": self._bucket,
                "Prefix": prefix,
                **listing,
                "MaxKeys": self._page_size,
            }
            if token:
                kwargs["ContinuationToken"] = token
            page = self._call(
                "list", prefix, functools.partial(self._client().list_objects_v2, **kwargs)
            )
            yield page
            if not page.get("IsTruncated"):
                return
            token = page["NextContinuationToken"]

    def _abort_uploads_under(self, prefix: str) -> None:
        markers: dict[str, str] = {}
        while True:
            resp = self._call(
                "list uploads",
                prefix,
                functools.partial(
                    self._client().list_multipart_uploads,
                    Bucket=self._bucket,
                    Prefix=prefix,
                    **markers,
                ),
            )
            for up in resp.get("Uploads", []):
                self._call(
                    "abort upload",
                    up["Key"],
                    functools.partial(
                        self._client().abort_multipart_upload,
                        Bucket=self._bucket,
                        Key=up["Key"],
                        UploadId=up["UploadId"],
                    ),
                )
            if not resp.get("IsTruncated"):
                return
            markers = {
                "KeyMarker": resp["NextKeyMarker"],
                "UploadIdMarker": resp["NextUploadIdMarker"],
            }
