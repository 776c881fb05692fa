"""Which S3 failures are worth another try, the SDK's own retry loop, and error translation.

botocore's "standard" retry mode already retries every request on throttling (SlowDown, 429
and the other throttling codes), 500/502/503/504, RequestTimeout, connection errors and read
timeouts, with exponential backoff and full jitter. Two gaps remain, and this loop covers them
for the requests that move checkpoint data (part uploads, ranged GETs, small PUTs):

* botocore stops retrying when its per-client *retry quota* runs dry (14 units per transient
  retry, 5 per throttled one, out of 500). A checkpoint uploads hundreds of parts through one
  client, so a burst of 503s can drain the quota and fail a part on its first error.
* Errors while *streaming a response body* (a dropped connection or a stall halfway through a
  GET) happen after botocore returned, so botocore never retries them.

The loop re-issues the same call with the same arguments, so a retried part re-sends the very
same buffer: nothing is consumed from a stream between attempts.

A save with a deadline (a notice save, see ``_save_deadline``) never starts a retry that cannot
finish before it: the loop estimates a retry's length by how long the failed attempt took,
waits at most half the time to spare, and when a retry would not fit, gives up at once with
:class:`DeadlineError`, leaving the remaining seconds to the caller (to abort, report and exit
before the node goes). For that to hold for every attempt, :class:`~.s3.S3Storage` sends such a
save's requests through a client with botocore's own retries off, and this loop makes all of the
attempts (``max_attempts * retry_rounds`` of them).
"""

from __future__ import annotations

import errno
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import botocore.exceptions as bce
import urllib3.exceptions

from trainer_sdk.errors import StorageError

__all__ = [
    "CancelledError",
    "DeadlineError",
    "RetryPolicy",
    "ShortReadError",
    "describe",
    "error_code",
    "is_cancelled",
    "is_not_found",
    "is_retryable",
    "retrying",
    "translate",
]

log = logging.getLogger("trainer_sdk.storage.s3")

T = TypeVar("T")

_RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
_RETRYABLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestThrottled",
        "TooManyRequests",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
        "PriorRequestNotComplete",
        "InternalError",
        "ServiceUnavailable",
    }
)
_CREDENTIAL_CODES = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
    }
)


class ShortReadError(Exception):
    """A response body ended before the bytes its headers promised (the connection dropped)."""


class CancelledError(Exception):
    """The operation this call belonged to was abandoned (another part failed)."""


class DeadlineError(Exception):
    """A request failed, and another attempt could not have finished before the save's
    deadline, so none was started. The failure is the ``__cause__``."""

    def __init__(self, what: str, *, left: float, attempt_s: float) -> None:
        self.reason = (
            "no retry was started, because it could not finish before the save's deadline "
            f"({max(left, 0.0):.2f}s were left; the failed attempt took {attempt_s:.2f}s)"
        )
        super().__init__(f"{what}: {self.reason}")
        self.left = left
        self.attempt_s = attempt_s


@dataclass(frozen=True, kw_only=True, slots=True)
class RetryPolicy:
    """The SDK's own retry rounds on top of botocore's (see the module docstring)."""

    rounds: int
    backoff_base: float
    backoff_max: float


def error_code(e: BaseException) -> tuple[str, int | None]:
    """(S3 error code, HTTP status) of a ClientError; ("", None) for anything else."""
    if isinstance(e, bce.ClientError):
        err = e.response.get("Error", {})
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return str(err.get("Code", "")), int(status) if status is not None else None
    return "", None


def is_not_found(e: BaseException) -> bool:
    code, status = error_code(e)
    return code in {"NoSuchKey", "NotFound", "404"} or (
        status == 404 and code not in {"NoSuchBucket", "NoSuchUpload"}
    )


def is_cancelled(e: BaseException) -> bool:
    """Whether ``e`` (or its cause) says the call was abandoned, not that it failed itself."""
    return isinstance(e, CancelledError) or isinstance(e.__cause__, CancelledError)


def is_retryable(e: BaseException) -> bool:
    """Whether another attempt of the same request could succeed."""
    if isinstance(e, bce.ClientError):
        code, status = error_code(e)
        return code in _RETRYABLE_CODES or status in _RETRYABLE_STATUS
    return isinstance(
        e,
        bce.ConnectionError  # connect timeouts, refused and reset connections
        | bce.HTTPClientError  # read timeouts, connections closed mid-response
        | bce.ResponseStreamingError
        | bce.IncompleteReadError
        | urllib3.exceptions.HTTPError
        | ShortReadError
        | ConnectionError
        | TimeoutError,
    )


def describe(e: BaseException) -> str:
    """A one-line description without credentials (botocore never puts them in messages)."""
    code, status = error_code(e)
    if code:
        message = e.response.get("Error", {}).get("Message", "")  # type: ignore[attr-defined]
        return f"{code} (HTTP {status}): {message}".rstrip(": ")
    return f"{type(e).__name__}: {e}"


def retrying(
    what: str,
    fn: Callable[[], T],
    *,
    policy: RetryPolicy,
    cancel: threading.Event | None = None,
    deadline: float | None = None,
) -> T:
    """Call ``fn`` until it succeeds, a non-retryable error occurs, or the rounds run out.

    Exponential backoff with full jitter between rounds (delays uniform in
    ``[0, min(backoff_max, backoff_base * 2**round)]``), so that many parts failing together
    do not retry in lockstep. ``cancel`` cuts the waiting short when the whole operation failed.
    ``deadline`` (a ``time.monotonic()`` instant): a retry is started only if another attempt as
    long as the failed one ends before it, after a backoff cut to at most half the slack left;
    if it cannot, :class:`DeadlineError` is raised from the failure.
    """
    for attempt in range(1, policy.rounds + 1):
        if cancel is not None and cancel.is_set():
            raise CancelledError(what)
        started = time.monotonic()
        try:
            return fn()
        except Exception as e:
            if not is_retryable(e) or attempt == policy.rounds:
                raise
            delay = random.uniform(  # noqa: S311 - jitter, not cryptography
                0.0, min(policy.backoff_max, policy.backoff_base * 2 ** (attempt - 1))
            )
            if deadline is not None:
                now = time.monotonic()
                attempt_s, room = now - started, deadline - now
                if attempt_s >= room:
                    raise DeadlineError(what, left=room, attempt_s=attempt_s) from e
                # Wait at most half the slack, so that a failed retry leaves time for another.
                delay = min(delay, (room - attempt_s) / 2)
            log.warning(
                "%s failed (%s); the SDK retries it (round %d of %d) in %.2fs",
                what,
                describe(e),
                attempt + 1,
                policy.rounds,
                delay,
            )
            if cancel is not None:
                if cancel.wait(delay):
                    raise
            else:
                threading.Event().wait(delay)
    raise AssertionError("unreachable")  # pragma: no cover


def translate(e: BaseException, *, action: str, uri: str, bucket: str, endpoint: str) -> Exception:
    """The SDK error for a botocore failure, with a message that names the fix.

    Callers ``raise translate(e, ...) from e`` so that the botocore error stays attached.
    """
    if isinstance(e, CancelledError):
        return StorageError(f"{action} {uri} was abandoned because another part failed")
    if isinstance(e, DeadlineError):
        cause = e.__cause__
        return StorageError(
            f"{action} {uri} failed ({describe(cause) if cause is not None else 'unknown'}) "
            f"and {e.reason}. The job resumes from the previous checkpoint; "
            "if S3 is often this slow, give the notice more time (deadline_margin, the "
            "provider's grace period) or save periodically more often"
        )
    code, status = error_code(e)
    if code == "NoSuchBucket":
        return StorageError(
            f"S3 bucket {bucket!r} does not exist at {endpoint}: create the bucket or fix "
            f"BATON_CHECKPOINT_URI (now {uri!r})"
        )
    if code == "NoSuchUpload":
        return StorageError(
            f"the multipart upload of {uri} is gone ({action}): a bucket lifecycle rule or a "
            "cleanup of this step by another process aborted it. Save again, and keep "
            "AbortIncompleteMultipartUpload longer than a save takes"
        )
    if is_not_found(e):
        return FileNotFoundError(errno.ENOENT, f"no such S3 object ({action})", uri)
    # Before the 403 check: S3 answers a bad signature or an unknown key with 403 too.
    if code in _CREDENTIAL_CODES:
        return StorageError(
            f"S3 rejected the credentials while trying to {action} {uri}: check "
            "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or refresh AWS_SESSION_TOKEN / the "
            f"workload identity) [{describe(e)}]"
        )
    if code in {"AccessDenied", "AllAccessDisabled"} or status == 403:
        return StorageError(
            f"access denied to {action} {uri}: grant the checkpoint role the S3 permissions "
            "listed in docs/s3.md (a missing s3:ListBucket also turns 'not found' into 403), "
            "or check which credentials are in use (AWS_PROFILE, AWS_ACCESS_KEY_ID, workload "
            f"identity) [{describe(e)}]"
        )
    if isinstance(e, bce.NoCredentialsError | bce.PartialCredentialsError):
        return StorageError(
            f"no AWS credentials found to {action} {uri}: set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, or configure a profile or workload identity (IRSA, EKS Pod "
            "Identity)"
        )
    if isinstance(e, bce.EndpointConnectionError):
        return StorageError(
            f"cannot connect to the S3 endpoint {endpoint} to {action} {uri}: check "
            f"AWS_ENDPOINT_URL_S3 / AWS_REGION and the network [{describe(e)}]"
        )
    if is_retryable(e):
        return StorageError(
            f"{action} {uri} failed after all retries: {describe(e)}. S3 kept failing or "
            "throttling: retry later, lower S3Config.max_concurrency, or raise "
            "S3Config.max_attempts / retry_rounds"
        )
    return StorageError(f"{action} {uri} failed: {describe(e)}")
