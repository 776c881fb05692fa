"""What the operator does when the Kubernetes API fails: count it, back off, say so, recover.

Every API call the Reconciler makes goes through :func:`instrument`, which counts failures in
``baton_operator_api_errors{verb,code}``, turns a call that got no answer (a timeout, a refused
connection) into a :class:`KubeError` with status 0, and feeds :class:`metrics.Health` (whose
``/healthz`` fails once every call has failed for a while). A job's daemon keeps a
:class:`JobFaults`: it backs off exponentially while calls fail, and when a failure persists
(the retry failed too) it sets the job's ``Degraded`` condition and posts an Event naming the
cause and the fix; when calls work again it clears the condition and posts ``APIRecovered``
with how long the fault lasted. Both reports are best effort: with RBAC removed nothing can be
written, so the recovery report is what leaves the trace in status and Events.

The reaction per HTTP status (docs/operator.md, "Faults"):

======  ==================  ===============================================================
code    reason              meaning and fix
======  ==================  ===============================================================
403     APIForbidden        the operator's RBAC lacks the verb: re-apply it
409     APIConflict         another writer won a race (kube.py retries conflicts first)
410     APIGone             a resourceVersion expired: the next tick reads afresh
422     APIRejected         the API server found an object invalid
5xx     APIUnavailable      the API server (or etcd) failed
0       APITimeout          no answer: a timeout or a refused connection
======  ==================  ===============================================================
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, TypeVar

from urllib3.exceptions import HTTPError as Urllib3Error

from .errors import KubeError
from .kube import Kube
from .metrics import Health, Metrics

__all__ = ["JobFaults", "instrument", "reaction"]

_log = logging.getLogger(__name__)
_T = TypeVar("_T")

_MAX_BACKOFF_SECONDS: Final = 30.0
_REACTIONS: Final[Mapping[int, tuple[str, str]]] = {
    401: ("APIUnauthorized", "the operator's credentials were refused: check its "
          "ServiceAccount token"),
    403: ("APIForbidden", "the operator's ServiceAccount lacks this permission: re-apply its "
          "RBAC (helm upgrade, or kubectl apply -f deploy/rbac.yaml)"),
    409: ("APIConflict", "another writer changed the object first; retrying"),
    410: ("APIGone", "the API server's history expired; the operator reads the object afresh"),
    422: ("APIRejected", "the API server refused an object as invalid"),
    0: ("APITimeout", "the API server did not answer; retrying with backoff"),
}  # fmt: skip
_UNAVAILABLE: Final = ("APIUnavailable", "the API server failed; retrying with backoff")
_OTHER: Final = ("APIError", "retrying with backoff")

EventPoster = Callable[[Mapping[str, Any], str, str, str], Awaitable[None]]


def reaction(status: int) -> tuple[str, str]:
    """The condition reason and the explanation for an HTTP status (0: no answer)."""
    if status in _REACTIONS:
        return _REACTIONS[status]
    if 500 <= status <= 599:
        return _UNAVAILABLE
    return _OTHER


def _counted(
    call: Callable[..., Awaitable[_T]], verb: str, metrics: Metrics, health: Health
) -> Callable[..., Awaitable[_T]]:
    @functools.wraps(call)
    async def wrapper(*args: Any, **kwargs: Any) -> _T:
        try:
            result = await call(*args, **kwargs)
        except KubeError as e:
            metrics.api_errors.labels(verb, str(e.status)).inc()
            health.failed(str(e))
            raise
        except (OSError, Urllib3Error) as e:
            # Only the exception's type: its text may carry a URL, never a header, but stay safe.
            metrics.api_errors.labels(verb, "0").inc()
            error = KubeError.from_answer(
                f"{call.__name__}: no answer from the API server ({type(e).__name__})", status=0
            )
            health.failed(str(error))
            raise error from e
        health.ok()
        return result

    return wrapper


def instrument(kube: Kube, metrics: Metrics, health: Health) -> Kube:
    """Wrap every API-calling method of ``kube`` (those with ``@_needs``), in place."""
    for name, fn in inspect.getmembers(type(kube), inspect.iscoroutinefunction):
        perms = fn.__dict__.get("baton_permissions")
        if not perms:
            continue
        verb = "/".join(sorted({p.verb for p in perms}))
        setattr(kube, name, _counted(getattr(kube, name), verb, metrics, health))
    return kube


def _iso(t: datetime) -> str:
    return t.astimezone(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


@dataclass
class JobFaults:
    """One job's run of failed API calls (kept by its daemon; nothing to persist)."""

    failures: int = 0
    since: datetime | None = None
    reason: str = ""
    last: str = ""
    reported: str = ""
    """The reason whose Degraded condition and Event were written ("" when none was)."""

    def backoff(self, tick_seconds: float) -> float:
        """Seconds before the next try: doubling from a tick, at most 30 s."""
        return float(min(_MAX_BACKOFF_SECONDS, tick_seconds * 2 ** min(self.failures, 8)))

    async def failed(
        self, kube: Kube, post: EventPoster, namespace: str, name: str, error: KubeError
    ) -> None:
        """Record a failed tick; on the second in a row (a persisting fault), report it."""
        now = datetime.now(tz=UTC)
        self.failures += 1
        self.since = self.since or now
        self.reason, fix = reaction(error.status)
        self.last = str(error)
        if self.failures < 2 or self.reported == self.reason:
            return
        message = f"{self.last}: {fix}"
        if await _report(
            kube, post, namespace, name,
            degraded=True, reason=self.reason, message=message, kind="Warning",
        ):  # fmt: skip
            self.reported = self.reason

    async def succeeded(self, kube: Kube, post: EventPoster, namespace: str, name: str) -> None:
        """A tick worked: if a fault was seen persisting, say it is over and for how long."""
        if self.failures < 2:
            self.failures, self.since = 0, None
            return
        lasted = (datetime.now(tz=UTC) - (self.since or datetime.now(tz=UTC))).total_seconds()
        message = (
            f"Kubernetes API calls work again after {lasted:.0f}s of {self.reason} "
            f"(last error: {self.last})"
        )
        if await _report(
            kube, post, namespace, name,
            degraded=False, reason="APIRecovered", message=message, kind="Normal",
        ):  # fmt: skip
            self.failures, self.since, self.reported = 0, None, ""


async def _report(
    kube: Kube, post: EventPoster, namespace: str, name: str, *, degraded: bool, reason: str,
    message: str, kind: str,
) -> bool:  # fmt: skip
    try:
        job = await kube.get_job(namespace, name)
        if job is None:
            return True
        status = job.get("status") or {}
        conditions = [c for c in status.get("conditions") or [] if c.get("type") != "Degraded"]
        conditions.append(
            {
                "type": "Degraded",
                "status": "True" if degraded else "False",
                "reason": reason,
                "message": message,
                "lastTransitionTime": _iso(datetime.now(tz=UTC)),
                "observedGeneration": int((job.get("metadata") or {}).get("generation", 0)),
            }
        )
        conditions.sort(key=lambda c: str(c.get("type")))
        await kube.patch_job_status(namespace, name, {"conditions": conditions})
        await post(job, kind, reason, message)
    except KubeError as e:
        _log.warning("%s/%s: could not report %s: %s", namespace, name, reason, e)
        return False
    return True
