"""Checkpoints on S3 (or any S3-compatible store) through boto3.

Why the SDK does its own multipart upload instead of using ``boto3``'s transfer manager: the
checkpoint writer streams bytes (it hashes them on the way), needs bounded memory, and must be
able to abort with the original error intact. Each :class:`_S3Writer` cuts its stream into
parts, uploads up to ``max_concurrency`` of them at once from a small thread pool, and holds at
most ``max_buffered_parts`` (+1 being filled) in memory; ``write`` blocks when they are all
taken. An object smaller than one part goes up with a single PutObject.

The object appears only when ``commit`` completes the multipart upload, so a half-written
shard is never visible. The checkpoint's own commit is ``manifest.json``, one PutObject by
rank 0 (:meth:`S3Storage.write_atomic`). ``latest`` is a plain PutObject too: it is a hint
that readers check against the manifests, so it needs no conditional write.

Configuration comes from the standard AWS variables (``AWS_ENDPOINT_URL_S3``, ``AWS_REGION``,
the credentials chain) and from :class:`S3Config`. Credentials are never logged.

Why one module of this size: the writer, the ranged reader and the conditional writes share
one client, its configuration and its error translation. What stands apart lives beside it:
the retry policy, which has no S3 knowledge of its own (``_s3_retry.py``), the making of a
client from :class:`S3Config` (``_s3_client.py``), and the paging and batching of listing and
deleting whole trees (``_s3_tree.py``).
"""

from __future__ import annotations

import base64
import dataclasses
import errno
import hashlib
import logging
import math
import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeVar

from trainer_sdk._crc import crc32
from trainer_sdk.errors import StorageError
from trainer_sdk.storage import _s3_retry as _retry
from trainer_sdk.storage import _s3_tree, _save_deadline
from trainer_sdk.storage._s3_client import make_client
from trainer_sdk.storage.base import TooLargeError

__all__ = ["S3Config", "S3Storage"]

log = logging.getLogger(__name__)

T = TypeVar("T")

MiB: Final = 1 << 20
MIN_PART_SIZE: Final = 5 * MiB
"""S3's smallest part (every part but the last)."""
MAX_PART_SIZE: Final = 5 * 1024 * MiB
MAX_PARTS: Final = 10_000
MAX_OBJECT_SIZE: Final = 5 * 1024 * 1024 * MiB
_PARTS_PER_SIZE_STEP: Final = 1000
_PRECONDITION_CODES: Final = frozenset({"PreconditionFailed", "ConditionalRequestConflict"})
"""S3's answers to a conditional write that lost: 412, or 409 when another conditional write
of the same key was in flight."""
"""After every 1000 parts the part size doubles, so a stream of unknown size still fits."""


@dataclass(kw_only=True, frozen=True, slots=True)
class S3Config:
    """How :class:`S3Storage` talks to S3. The defaults suit AWS S3 from an EC2/EKS node."""

    part_size: int = 16 * MiB
    """Bytes per multipart part (the first 1000 parts), and the single-PUT threshold: a smaller
    object is one PutObject. S3 allows 5 MiB to 5 GiB. 16 MiB keeps a writer's memory small
    (``(max_buffered_parts + 1) * part_size``) while the per-request overhead stays a few
    percent of a part's transfer time. The writer raises it when ``size_hint`` would need more
    than 10,000 parts, and doubles it every 1000 parts for streams longer than their hint."""

    max_concurrency: int = 8
    """Parts uploaded, or ranges downloaded, in parallel per writer and per ``read_into``. One
    S3 connection carries roughly 85-90 MB/s, so 8 saturate about 5 Gbit/s."""

    max_buffered_parts: int | None = None
    """Parts a writer may hold in memory, in flight or queued (None: ``max_concurrency``).
    ``write`` blocks when all are taken: this is the writer's backpressure."""

    read_chunk_size: int = 16 * MiB
    """A ``read_into`` longer than this is split into ranged GETs of this many bytes, fetched
    in parallel straight into the destination buffer."""

    max_attempts: int = 5
    """Attempts per HTTP request inside botocore (its ``total_max_attempts``). botocore retries
    throttling (SlowDown, 429), 500/502/503/504, RequestTimeout, connection errors and read
    timeouts, with exponential backoff and full jitter."""

    retry_rounds: int = 3
    """How many times the SDK itself issues a data request (part upload, ranged GET, small
    PUT), each time with botocore's ``max_attempts`` inside. This covers botocore's retry quota
    running dry when many parts are throttled at once, and errors while a response body
    streams, which botocore never retries. 1 turns the SDK's own retries off."""

    backoff_base: float = 1.0
    """Seconds: the SDK's delay before round ``r + 1`` is uniform in
    ``[0, min(backoff_max, backoff_base * 2**(r-1))]`` (full jitter)."""

    backoff_max: float = 20.0
    """Seconds: the cap of the SDK's backoff (botocore caps its own at 20 s too)."""

    retry_mode: Literal["standard", "adaptive"] = "standard"
    """botocore's retry mode. "adaptive" adds client-side rate limiting after throttling
    responses; it slows every thread of the client, so it is opt-in."""

    connect_timeout: float = 10.0
    """Seconds to open a connection before the attempt counts as failed and is retried."""

    read_timeout: float = 60.0
    """Seconds without a byte from the server before the attempt counts as failed (a stalled
    request) and is retried. botocore's default; far above S3's time to first byte."""

    list_page_size: int = 1000
    """MaxKeys per ListObjectsV2 page (S3 returns at most 1000)."""

    endpoint_url: str | None = None
    """Overrides ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` (e.g. MinIO, Ceph, R2)."""

    region: str | None = None
    """Overrides ``AWS_REGION`` / ``AWS_DEFAULT_REGION``."""

    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    """botocore's S3 addressing style; many S3-compatible stores want "path"."""

    max_pool_connections: int = 32
    """HTTP connections kept per client; shared by every writer and reader of one storage, so
    it should be at least the number of writers that run at once times ``max_concurrency``."""

    sign_payload: bool = False
    """Put the SHA-256 of every request body into its signature. Off, a request says
    ``UNSIGNED-PAYLOAD`` and its body is protected by the CRC32 it carries in a signed header,
    which S3 verifies (what botocore does by default over https, and AWS's CRT client, the
    engine of ``s3torchconnector``, over http too). botocore's default over plain http is to
    sign, which costs a second pass over every byte (about 0.65 CPU s per GiB here) on a client
    that shares its cores with training. Signing stays on whatever this says when the
    CRC32s are off (``AWS_REQUEST_CHECKSUM_CALCULATION=when_required``), so that a body is
    never unprotected on the wire."""

    def __post_init__(self) -> None:
        if not MIN_PART_SIZE <= self.part_size <= MAX_PART_SIZE:
            raise ValueError(f"S3Config.part_size={self.part_size}: S3 parts must be 5 MiB..5 GiB")
        if self.max_concurrency < 1 or (
            self.max_buffered_parts is not None and self.max_buffered_parts < 1
        ):
            raise ValueError("S3Config.max_concurrency and max_buffered_parts must be >= 1")
        if self.read_chunk_size < 1 or not 1 <= self.list_page_size <= 1000:
            raise ValueError("S3Config: read_chunk_size >= 1 and list_page_size in 1..1000")
        if self.max_attempts < 1 or self.retry_rounds < 1:
            raise ValueError("S3Config.max_attempts and retry_rounds must be >= 1 (1 = no retry)")
        if self.backoff_base < 0 or self.backoff_max < 0:
            raise ValueError("S3Config: backoff_base and backoff_max must be >= 0 seconds")
        if self.connect_timeout <= 0 or self.read_timeout <= 0:
            raise ValueError("S3Config: timeouts must be > 0 seconds")
        if self.retry_mode not in ("standard", "adaptive"):
            raise ValueError(f"S3Config.retry_mode={self.retry_mode!r}: use standard or adaptive")
        if self.addressing_style not in ("auto", "path", "virtual"):
            raise ValueError(
                f"S3Config.addressing_style={self.addressing_style!r}: use auto, path or virtual"
            )

    @property
    def buffered_parts(self) -> int:
        return self.max_buffered_parts or self.max_concurrency

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> S3Config:
        """Defaults, overridden by ``BATON_S3_*`` variables (see ``ENV_VARS``): how a pod spec
        tunes S3 without code changes, since ``trainer_sdk.save(state, "s3://...")`` builds
        its storage from the URI alone."""
        env = os.environ if environ is None else environ
        kwargs: dict[str, Any] = {}
        for var, (name, convert) in ENV_VARS.items():
            raw = env.get(var)
            if raw is None or raw == "":
                continue
            try:
                kwargs[name] = convert(raw)
            except ValueError:
                kind = _KINDS.get(convert, convert.__name__)
                raise ValueError(f"{var}={raw!r} is not a valid {kind}") from None
        try:
            return cls(**kwargs)
        except ValueError as e:
            raise ValueError(f"{e} (from the BATON_S3_* environment variables)") from None


def _mib(raw: str) -> int:
    return int(raw) * MiB


def _flag(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)


ENV_VARS: Final[dict[str, tuple[str, Callable[[str], Any]]]] = {
    "BATON_S3_PART_SIZE_MIB": ("part_size", _mib),
    "BATON_S3_MAX_CONCURRENCY": ("max_concurrency", int),
    "BATON_S3_MAX_ATTEMPTS": ("max_attempts", int),
    "BATON_S3_RETRY_ROUNDS": ("retry_rounds", int),
    "BATON_S3_CONNECT_TIMEOUT": ("connect_timeout", float),
    "BATON_S3_READ_TIMEOUT": ("read_timeout", float),
    "BATON_S3_RETRY_MODE": ("retry_mode", str),
    "BATON_S3_ADDRESSING_STYLE": ("addressing_style", str),
    "BATON_S3_SIGN_PAYLOAD": ("sign_payload", _flag),
}
"""Environment overrides of :class:`S3Config` fields: variable -> (field, parser)."""

_KINDS: Final[dict[Callable[[str], Any], str]] = {
    _mib: "whole number of MiB",
    _flag: "flag (1 or 0)",
}
"""What an error about a variable calls its parser's kind (the others are named ``int``,
``float`` and ``str`` already)."""


def first_part_size(config: S3Config, size_hint: int | None) -> int:
    """Size of parts 1..1000: ``part_size``, raised so that ``size_hint`` fits 10,000 parts."""
    if size_hint is None or size_hint <= config.part_size * MAX_PARTS:
        return config.part_size
    return min(MAX_PART_SIZE, math.ceil(size_hint / MAX_PARTS / MiB) * MiB)


def part_size(first: int, part_number: int) -> int:
    """Size of part ``part_number`` (1-based): doubles every 1000 parts, capped at 5 GiB."""
    return min(MAX_PART_SIZE, first << ((part_number - 1) // _PARTS_PER_SIZE_STEP))


def part_checksum(body: bytes | bytearray | memoryview) -> str:
    """The ``ChecksumCRC32`` of a part: its CRC32, big-endian, base64. Computed with ISA-L
    (about a tenth of the CPU of botocore's own pass at zlib's speed, and without the GIL);
    botocore sends a checksum it is given and computes none."""
    return base64.b64encode(crc32(body).to_bytes(4, "big")).decode("ascii")


def _multipart_etag(etags: list[str]) -> str:
    """The ETag S3 gives a completed multipart object whose parts have MD5 ETags."""
    digests = b"".join(bytes.fromhex(e.strip('"')) for e in etags)
    return f'"{hashlib.md5(digests).hexdigest()}-{len(etags)}"'  # noqa: S324 - S3's format


@dataclass(frozen=True, kw_only=True, slots=True)
class _Part:
    number: int
    etag: str
    checksum: str | None


class S3Storage:
    """A checkpoint root at ``s3://bucket/prefix`` (see :class:`trainer_sdk.storage.Storage`).

    Thread-safe: one boto3 client serves every writer and reader of this storage.

    It is the whole :class:`~trainer_sdk.storage.Storage` protocol on S3 (some twenty
    operations, each short), and every one goes through the same client, key mapping, retry
    policy and error translation; the multipart writer is its own class below, and the
    listing and deleting of trees is :class:`~trainer_sdk.storage._s3_tree.S3Trees`'s.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        config: S3Config | None = None,
        client: Any = None,
    ) -> None:
        if not bucket or "/" in bucket:
            raise ValueError(f"invalid S3 bucket name {bucket!r}: use s3://bucket/prefix")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.config = config or S3Config()
        self._main_client = client if client is not None else make_client(self.config)
        self._client_given = client is not None
        self._once_client: Any = None
        self._once_lock = threading.Lock()
        self._calling = threading.local()
        self._policy = _retry.RetryPolicy(
            rounds=self.config.retry_rounds,
            backoff_base=self.config.backoff_base,
            backoff_max=self.config.backoff_max,
        )
        # A save with a deadline: every attempt is the SDK's own, so that each one can be
        # weighed against the deadline (see _s3_retry); as many attempts in all as otherwise.
        self._deadline_policy = _retry.RetryPolicy(
            rounds=self.config.retry_rounds * self.config.max_attempts,
            backoff_base=self.config.backoff_base,
            backoff_max=self.config.backoff_max,
        )
        # Follow botocore's checksum setting (AWS_REQUEST_CHECKSUM_CALCULATION): with
        # "when_supported" (the default) every part carries a CRC32 that S3 checks, and the
        # multipart upload is created with that algorithm, as boto3's transfer manager does.
        calc = getattr(self._client.meta.config, "request_checksum_calculation", None)
        self._part_checksums = calc in (None, "when_supported")

    @classmethod
    def from_uri(cls, uri: str, *, config: S3Config | None = None) -> S3Storage:
        """``s3://bucket`` or ``s3://bucket/prefix``."""
        if not uri.startswith("s3://"):
            raise ValueError(f"not an S3 URI: {uri!r} (expected s3://bucket/prefix)")
        bucket, _, prefix = uri[len("s3://") :].partition("/")
        return cls(bucket, prefix, config=config or S3Config.from_env())

    # -- helpers ---------------------------------------------------------------------------

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    @property
    def endpoint(self) -> str:
        return str(self._client.meta.endpoint_url)

    def _key(self, path: str) -> str:
        if path.startswith("/") or any(p in ("", ".", "..") for p in path.split("/")):
            raise ValueError(
                f"invalid storage path {path!r}: use a relative path without '..' or empty parts"
            )
        return f"{self.prefix}/{path}" if self.prefix else path

    def _dir_prefix(self, path: str) -> str:
        if not path:
            return f"{self.prefix}/" if self.prefix else ""
        return self._key(path.rstrip("/")) + "/"

    def _uri_of(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    @property
    def _trees(self) -> _s3_tree.S3Trees:
        # Made per use, not kept: it holds this storage's methods, and a storage that kept it
        # would outlive its last reference until the garbage collector ran (its client too).
        return _s3_tree.S3Trees(
            bucket=self.bucket, page_size=self.config.list_page_size, call=self._call,
            client=lambda: self._client, uri_of=self._uri_of,
        )  # fmt: skip

    @property
    def _client(self) -> Any:
        """The boto3 client for the request this thread is making: inside a save with a
        deadline (:meth:`_retrying`), one with botocore's own retries off."""
        if not getattr(self._calling, "deadline", False):
            return self._main_client
        with self._once_lock:
            if self._once_client is None:
                # A client passed in by the caller cannot be copied with other retries.
                self._once_client = (
                    self._main_client
                    if self._client_given
                    else make_client(dataclasses.replace(self.config, max_attempts=1))
                )
            return self._once_client

    def _retrying(
        self,
        what: str,
        fn: Callable[[], T],
        *,
        cancel: threading.Event | None = None,
        deadline: float | None = None,
    ) -> T:
        """``fn`` with the SDK's retries; within the save's deadline when there is one
        (``deadline``, else the one of this thread's save: see ``_save_deadline``)."""
        if deadline is None:
            deadline = _save_deadline.current()
        if deadline is None:
            return _retry.retrying(what, fn, policy=self._policy, cancel=cancel)

        def attempt() -> T:
            self._calling.deadline = True
            try:
                return fn()
            finally:
                self._calling.deadline = False

        return _retry.retrying(
            what, attempt, policy=self._deadline_policy, cancel=cancel, deadline=deadline
        )

    def _call(
        self,
        action: str,
        key: str,
        fn: Callable[[], T],
        *,
        cancel: threading.Event | None = None,
        deadline: float | None = None,
    ) -> T:
        """Run one S3 request (with the SDK's retry rounds) and translate its failure."""
        try:
            return self._retrying(
                f"{action} {self._uri_of(key)}", fn, cancel=cancel, deadline=deadline
            )
        except Exception as e:
            raise self._translate(e, action, key) from e

    def _translate(self, e: BaseException, action: str, key: str) -> Exception:
        if isinstance(e, StorageError | FileNotFoundError | EOFError):
            return e
        return _retry.translate(
            e, action=action, uri=self._uri_of(key), bucket=self.bucket, endpoint=self.endpoint
        )

    # -- writing ---------------------------------------------------------------------------

    def open_writer(self, path: str, *, size_hint: int | None = None) -> _S3Writer:
        if size_hint is not None and size_hint > MAX_OBJECT_SIZE:
            raise StorageError(
                f"{self._uri_of(self._key(path))}: {size_hint} bytes is over S3's 5 TiB object "
                "limit: shard the state over more ranks or files"
            )
        return _S3Writer(self, self._key(path), size_hint)

    def write_atomic(self, path: str, data: bytes) -> None:
        key = self._key(path)
        body = bytes(data)
        self._call(
            "write", key, lambda: self._client.put_object(Bucket=self.bucket, Key=key, Body=body)
        )

    # -- conditional writes (commit and fencing; see docs/s3.md) ----------------------------

    def _conditional_put(self, key: str, body: bytes, **condition: str) -> bool:
        """PutObject with a precondition; False when S3 answers 412 (or 409: a concurrent
        conditional write of the same key won). A store that does not implement the header
        answers 501 NotImplemented: that is an error naming the fix, never a silent
        unconditional write."""

        def put() -> bool:
            try:
                self._client.put_object(Bucket=self.bucket, Key=key, Body=body, **condition)
            except Exception as e:
                code, status = _retry.error_code(e)
                if code in _PRECONDITION_CODES or status in (409, 412):
                    return False
                if "IfMatch" in condition and _retry.is_not_found(e):
                    return False  # deleted since it was read: the version did not match
                if code == "NotImplemented" or status == 501:
                    raise StorageError(
                        f"{self._uri_of(key)}: the S3 endpoint {self.endpoint} does not "
                        "support conditional writes (If-None-Match / If-Match), which Baton "
                        "needs so that two writers can never commit one step: use a store that "
                        "has them (see docs/s3.md)"
                    ) from e
                raise
            return True

        return self._call("write", key, put)

    def create_exclusive(self, path: str, data: bytes) -> None:
        key = self._key(path)
        body = bytes(data)
        if self._conditional_put(key, body, IfNoneMatch="*"):
            # Read back: a store that ignores If-None-Match (some S3-compatible servers do)
            # would let a second writer overwrite us; then we must not report a commit.
            if self.read_bytes(path) != body:
                raise FileExistsError(
                    errno.EEXIST,
                    "another writer overwrote it (the store ignored If-None-Match)",
                    self._uri_of(key),
                )
            return
        # 412: an object is there. It is ours if the first PUT took and only its reply was
        # lost (botocore then retried and met our own object): read back and compare.
        try:
            there = self.read_bytes(path)
        except FileNotFoundError:
            there = None
        if there != body:
            raise FileExistsError(
                errno.EEXIST, "another writer already created it", self._uri_of(key)
            )

    def _get_whole(self, path: str, limit: int | None) -> tuple[bytes, str, int]:
        """One GetObject of the whole object: (bytes, ETag, size). Over ``limit`` bytes, the
        body is closed unread and :class:`TooLargeError` raised (never retried)."""
        key = self._key(path)

        def get() -> tuple[bytes, str, int]:
            resp = self._client.get_object(Bucket=self.bucket, Key=key)
            body = resp["Body"]
            size = int(resp["ContentLength"])
            try:
                if limit is not None and size > limit:
                    return b"", "", size
                data = bytes(body.read())
            finally:
                body.close()
            if len(data) != size:
                raise _retry.ShortReadError(f"{len(data)} of {size} bytes")
            return data, str(resp["ETag"]), size

        data, etag, size = self._call("read", key, get)
        if limit is not None and size > limit:
            raise TooLargeError(self._uri_of(key), size=size, limit=limit)
        return data, etag, size

    def read_versioned(self, path: str) -> tuple[bytes, str]:
        data, etag, _ = self._get_whole(path, None)
        return data, etag

    def read_with_version(self, path: str, *, limit: int) -> tuple[bytes, str]:
        """The object's bytes and its :meth:`version` token, from one GetObject (its ETag and
        ContentLength are the ones a HEAD gives). Raises :class:`TooLargeError` over ``limit``
        bytes, ``FileNotFoundError`` if absent."""
        data, etag, size = self._get_whole(path, limit)
        return data, f"{etag}:{size}"

    def replace_if(self, path: str, data: bytes, *, token: str | None) -> bool:
        key = self._key(path)
        if token is None:
            return self._conditional_put(key, bytes(data), IfNoneMatch="*")
        return self._conditional_put(key, bytes(data), IfMatch=token)

    # -- reading ---------------------------------------------------------------------------

    def read_bytes(self, path: str) -> bytes:
        return self.read_versioned(path)[0]

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        key = self._key(path)
        dest = out if out.format == "B" and out.ndim == 1 else out.cast("B")
        n = len(dest)
        if offset < 0:
            raise ValueError(f"negative offset {offset} reading {self._uri_of(key)}")
        if n == 0:
            return
        chunk = self.config.read_chunk_size
        ranges = [(o, min(chunk, n - o)) for o in range(0, n, chunk)]
        deadline = _save_deadline.current()  # read here: the pool's threads do not see it
        if len(ranges) == 1:
            self._read_range(key, offset, dest, None, deadline)
            return
        cancel = threading.Event()
        workers = min(self.config.max_concurrency, len(ranges))
        with ThreadPoolExecutor(workers, thread_name_prefix="baton-s3-get") as pool:
            futures = [
                pool.submit(self._read_range, key, offset + o, dest[o : o + ln], cancel, deadline)
                for o, ln in ranges
            ]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = next((f for f in futures if f in done and f.exception()), None)
            if failed is not None:
                cancel.set()
                for f in futures:
                    f.cancel()
                wait(futures)
                failed.result()  # raises the first error, already translated

    def _read_range(
        self,
        key: str,
        offset: int,
        dest: memoryview,
        cancel: threading.Event | None,
        deadline: float | None,
    ) -> None:
        end = offset + len(dest)

        def get() -> None:
            try:
                resp = self._client.get_object(
                    Bucket=self.bucket, Key=key, Range=f"bytes={offset}-{end - 1}"
                )
            except Exception as e:
                if _retry.error_code(e)[0] == "InvalidRange":
                    raise self._short_object(key, end) from e
                raise
            body = resp["Body"]
            try:
                if int(resp["ContentLength"]) < len(dest):
                    raise self._short_object(key, end)
                got = 0
                while got < len(dest):
                    k = body.readinto(dest[got:])
                    if not k:
                        raise _retry.ShortReadError(
                            f"{self._uri_of(key)}: body ended at {got} of {len(dest)} bytes"
                        )
                    got += k
            finally:
                body.close()

        self._call("read", key, get, cancel=cancel, deadline=deadline)

    def _short_object(self, key: str, end: int) -> EOFError:
        return EOFError(
            f"{self._uri_of(key)} is shorter than {end} bytes: the object was truncated or "
            "replaced; verify the checkpoint (python -m trainer_sdk verify)"
        )

    def _head(self, key: str) -> dict[str, Any] | None:
        try:
            head: dict[str, Any] = self._retrying(
                f"head {self._uri_of(key)}",
                lambda: self._client.head_object(Bucket=self.bucket, Key=key),
            )
        except Exception as e:
            if _retry.is_not_found(e):
                return None
            raise self._translate(e, "stat", key) from e
        return head

    def size(self, path: str) -> int:
        key = self._key(path)
        head = self._head(key)
        if head is None:
            raise FileNotFoundError(2, "no such S3 object", self._uri_of(key))
        return int(head["ContentLength"])

    def version(self, path: str) -> str:
        """The object's ETag and size (one HEAD): a PUT's ETag is the MD5 of its bytes, so it
        changes when the object is replaced with other bytes (optional in the protocol, see
        ``_catalog.read_manifest``). Raises ``FileNotFoundError`` if absent."""
        key = self._key(path)
        head = self._head(key)
        if head is None:
            raise FileNotFoundError(2, "no such S3 object", self._uri_of(key))
        return f"{head['ETag']}:{head['ContentLength']}"

    def exists(self, path: str) -> bool:
        return self._head(self._key(path)) is not None

    def list_dir(self, path: str) -> list[str]:
        return self._trees.names(self._dir_prefix(path))

    # -- deleting --------------------------------------------------------------------------

    def delete(self, path: str) -> None:
        key = self._key(path)
        self._call("delete", key, lambda: self._client.delete_object(Bucket=self.bucket, Key=key))

    def delete_tree(self, path: str) -> None:
        """Delete ``path`` and every object under ``path/``, and abort multipart uploads there
        (``_s3_tree``: a crashed rank's parts are billed until they are aborted)."""
        if not path.strip("/"):
            raise ValueError("refusing to delete the whole checkpoint root: name a directory")
        self._trees.delete(self._key(path.rstrip("/")))


@dataclass(kw_only=True)
class _Upload:
    """State of one multipart upload, shared with the part-upload threads."""

    upload_id: str
    pool: ThreadPoolExecutor
    slots: threading.Semaphore
    cancel: threading.Event = field(default_factory=threading.Event)
    futures: dict[int, Future[_Part]] = field(default_factory=dict)
    first_error: BaseException | None = None
    """The first part failure in time: the original error, whatever failed after it."""
    lock: threading.Lock = field(default_factory=threading.Lock)


class _S3Writer:
    """Streams one object to S3: single PUT if small, else a parallel multipart upload."""

    def __init__(self, storage: S3Storage, key: str, size_hint: int | None) -> None:
        self._s = storage
        self._key = key
        self._first_part = first_part_size(storage.config, size_hint)
        self._part_number = 1
        limit = self._first_part if size_hint is None else min(self._first_part, size_hint)
        self._buf = bytearray(limit)
        self._fill = 0
        self._upload: _Upload | None = None
        self._state: Literal["open", "committed", "aborted", "failed"] = "open"
        self._deadline = _save_deadline.current()
        """The save's deadline, read in the opening thread: the part threads do not see it."""

    @property
    def uri(self) -> str:
        return self._s._uri_of(self._key)

    def _closed_how(self) -> str:
        how = "aborted after an error" if self._state == "failed" else self._state
        return f"{how}: open a new writer to write the object again"

    def write(self, data: memoryview | bytes) -> None:
        if self._state != "open":
            raise StorageError(f"write to {self.uri} after the writer was {self._closed_how()}")
        mv = memoryview(data)
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        try:
            while mv:
                limit = part_size(self._first_part, self._part_number)
                n = min(len(mv), limit - self._fill)
                room = len(self._buf) - self._fill
                if n <= room:
                    self._buf[self._fill : self._fill + n] = mv[:n]
                else:  # the size hint was short: grow the buffer up to the part size
                    del self._buf[self._fill :]
                    self._buf += mv[:n]
                self._fill += n
                mv = mv[n:]
                if self._fill == limit:
                    self._send_part()
        except BaseException:
            self._fail()
            raise

    def _send_part(self) -> None:
        """Hand the full buffer to the pool; blocks while ``buffered_parts`` parts are held."""
        if self._part_number > MAX_PARTS:
            raise StorageError(
                f"{self.uri} needs more than {MAX_PARTS} parts: pass size_hint to "
                "open_writer or raise S3Config.part_size"
            )
        up = self._upload or self._start_upload()
        self._raise_failed_part(up)
        up.slots.acquire()  # backpressure; a part that fails releases its slot too
        self._raise_failed_part(up, release=True)
        number, buf = self._part_number, self._buf
        if len(buf) != self._fill:
            del buf[self._fill :]
        # Handed over in a list that the part's thread empties: the thread pool's work item
        # would otherwise hold the buffer after the part is done (see _upload_part).
        up.futures[number] = up.pool.submit(self._upload_part, up, number, [buf])
        self._part_number += 1
        self._buf = bytearray(part_size(self._first_part, self._part_number))
        self._fill = 0

    def _start_upload(self) -> _Upload:
        s = self._s
        extra = {"ChecksumAlgorithm": "CRC32"} if s._part_checksums else {}
        resp = s._call(
            "start upload of",
            self._key,
            lambda: s._client.create_multipart_upload(Bucket=s.bucket, Key=self._key, **extra),
            deadline=self._deadline,
        )
        self._upload = _Upload(
            upload_id=resp["UploadId"],
            pool=ThreadPoolExecutor(s.config.max_concurrency, thread_name_prefix="baton-s3-part"),
            slots=threading.Semaphore(s.config.buffered_parts),
        )
        return self._upload

    def _upload_part(self, up: _Upload, number: int, handed: list[bytearray]) -> _Part:
        """Upload one part; its buffer is dropped before its slot is released.

        The slot is what bounds the writer's memory (``buffered_parts`` parts plus the one
        filling): released while this thread still held the buffer, the writer could fill and
        hand over the next part first, one part over the bound (a 60 MiB stream measured
        21.2 MiB of peak against 17 at a load of 10: this thread was preempted in between).
        """
        s = self._s
        body = handed.pop()
        try:
            extra: dict[str, str] = {}
            if s._part_checksums:
                extra = {"ChecksumAlgorithm": "CRC32", "ChecksumCRC32": part_checksum(body)}
            # The same `body` object is passed on every attempt, botocore's and ours.
            resp = s._call(
                f"upload part {number} of",
                self._key,
                lambda: s._client.upload_part(
                    Bucket=s.bucket,
                    Key=self._key,
                    UploadId=up.upload_id,
                    PartNumber=number,
                    Body=body,
                    **extra,
                ),
                cancel=up.cancel,
                deadline=self._deadline,
            )
        except BaseException as e:
            with up.lock:
                if up.first_error is None and not up.cancel.is_set():
                    up.first_error = e
            up.cancel.set()  # stop the other parts from starting new rounds
            raise
        finally:
            body = bytearray()  # the closure's cell too: the part's bytes are freed here
            up.slots.release()
        return _Part(number=number, etag=resp["ETag"], checksum=extra.get("ChecksumCRC32"))

    @staticmethod
    def _raise_failed_part(up: _Upload, *, release: bool = False) -> None:
        error = _first_error(up)
        if error is not None:
            if release:
                up.slots.release()
            raise error

    def commit(self) -> None:
        if self._state != "open":
            raise StorageError(f"commit of {self.uri} after the writer was {self._closed_how()}")
        s = self._s
        try:
            if self._upload is None:
                del self._buf[self._fill :]
                body = self._buf
                s._call(
                    "write",
                    self._key,
                    lambda: s._client.put_object(Bucket=s.bucket, Key=self._key, Body=body),
                    deadline=self._deadline,
                )
            else:
                if self._fill:
                    self._send_part()
                self._complete(self._upload)
            self._state = "committed"
        except BaseException:
            self._fail()
            raise
        finally:
            self._buf = bytearray()
            up, self._upload = self._upload, None  # after a commit, abort() has nothing to do
            if up is not None:
                up.pool.shutdown(wait=True)

    def _complete(self, up: _Upload) -> None:
        s = self._s
        wait(up.futures.values())
        error = _first_error(up)
        if error is not None:
            raise error
        parts = [up.futures[number].result() for number in sorted(up.futures)]
        listed: list[dict[str, Any]] = []
        for p in parts:
            entry: dict[str, Any] = {"ETag": p.etag, "PartNumber": p.number}
            if p.checksum is not None:
                entry["ChecksumCRC32"] = p.checksum
            listed.append(entry)

        def complete() -> None:
            s._client.complete_multipart_upload(
                Bucket=s.bucket,
                Key=self._key,
                UploadId=up.upload_id,
                MultipartUpload={"Parts": listed},
            )

        try:
            s._retrying(f"complete upload of {self.uri}", complete, deadline=self._deadline)
        except Exception as e:
            # A retried Complete whose first attempt succeeded (the response was lost) gets
            # NoSuchUpload: the object is there if its ETag is the one these parts make.
            if _retry.error_code(e)[0] == "NoSuchUpload" and self._completed_as(parts):
                log.info("complete of %s: first attempt had succeeded", self.uri)
                return
            raise s._translate(e, "complete upload of", self._key) from e

    def _completed_as(self, parts: list[_Part]) -> bool:
        try:
            expected = _multipart_etag([p.etag for p in parts])
        except ValueError:  # ETags that are not MD5s (SSE-KMS): cannot tell, so fail safe
            return False
        head = self._s._head(self._key)
        return head is not None and head.get("ETag") == expected

    def _fail(self) -> None:
        """Abort after an error; never raises (the caller re-raises the original error)."""
        self._state = "failed"
        self._abort_quietly()

    def abort(self) -> None:
        if self._state == "committed":
            return
        if self._state == "open":
            self._state = "aborted"
        self._abort_quietly()

    def _abort_quietly(self) -> None:
        up, self._upload = self._upload, None
        self._buf = bytearray()
        if up is None:
            return
        up.cancel.set()
        for f in up.futures.values():
            f.cancel()
        # S3 may keep a part that is still uploading when the abort lands: wait for the
        # in-flight parts (bounded by their timeouts and attempts) before aborting.
        up.pool.shutdown(wait=True)
        s = self._s
        try:
            _retry.retrying(
                f"abort upload of {self.uri}",
                lambda: s._client.abort_multipart_upload(
                    Bucket=s.bucket, Key=self._key, UploadId=up.upload_id
                ),
                policy=s._policy,
            )
        except Exception as e:
            if _retry.error_code(e)[0] == "NoSuchUpload":
                return  # already gone (aborted or completed elsewhere)
            log.error(
                "aborting multipart upload %s of %s failed (%s); the original error is "
                "raised instead. Its parts are billed until aborted: a bucket lifecycle rule "
                "(AbortIncompleteMultipartUpload) or trainer_sdk cleanup removes them.",
                up.upload_id,
                self.uri,
                _retry.describe(e),
            )


def _first_error(up: _Upload) -> BaseException | None:
    """The original error: the part failure that came first in time, not those of the parts
    that failed or were abandoned after it (a timeout that ends later, a cancelled round)."""
    with up.lock:
        if up.first_error is not None:
            return up.first_error
    errors = [
        (_retry.is_cancelled(e), n, e)
        for n, f in sorted(up.futures.items())
        if f.done() and not f.cancelled() and (e := f.exception()) is not None
    ]
    return min(errors, key=lambda t: (t[0], t[1]))[2] if errors else None
