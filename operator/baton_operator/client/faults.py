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

A permanent refusal (:class:`errors.KubeRejectedError`: the API server found the write
invalid, typically a status value the installed CRD's schema does not allow) is not retried:
sending the same write again can never succeed, and every retry is one more refused request.
:func:`rejected` sets ``Degraded`` (reason ``APIRejected``) and posts one Event, both naming
the fields the API server named, and the job's daemon stops; the next operator start (after
the CRD or the operator is fixed) drives the job again, and its first tick that works clears
the condition (:func:`clear_rejection`).

The reaction per HTTP status (docs/operator.md, "Faults"):

======  ==================  ===============================================================
code    reason              meaning and fix
======  ==================  ===============================================================
403     APIForbidden        the operator's RBAC lacks the verb: re-apply it
409     APIConflict         another writer won a race (kube.py retries conflicts first)
410     APIGone             a resourceVersion expired: the next tick reads afresh
422     APIRejected         the API server found an object invalid: reported at once, the
                            daemon stops (no retry can succeed)
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
from datetime import UTC, datetime, timedelta
from typing import Any, Final, TypeVar

from urllib3.exceptions import HTTPError as Urllib3Error

from baton_operator.pure.errors import KubeError, KubeRejectedError

from .kube import Kube
from .metrics import Health, Metrics

__all__ = [
    "JobFaults",
    "Outage",
    "clear_rejection",
    "instrument",
    "outage_after_takeover",
    "reaction",
    "record_outage",
    "rejected",
]

_log = logging.getLogger("baton_operator.faults")
_T = TypeVar("_T")

_MAX_BACKOFF_SECONDS: Final = 30.0
_ALWAYS_RECORDED: Final = frozenset({"APIForbidden", "APIUnauthorized"})
"""Reasons recorded on recovery even after one failed tick: an RBAC loss shorter than the
backoff must still leave a trace in status and Events, not only in the log."""
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

_REJECTED: Final = "APIRejected"
_REJECTED_FIX: Final = (
    "the operator stopped driving this job: install the CRD of the operator's version (helm "
    "upgrade, or kubectl apply -f deploy/crd.yaml), then restart the operator; if they already "
    "match, report this message as an operator bug"
)
_MAX_QUOTED: Final = 1024
"""Characters of the API server's answer quoted in a condition or an Event (a refusal of a
large object can list every invalid field)."""

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
            health.failed(str(e), status=e.status)
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
        self,
        kube: Kube,
        post: EventPoster,
        namespace: str,
        name: str,
        error: KubeError,
        *,
        began: datetime | None = None,
    ) -> None:
        """Record a failed tick; on the second in a row (a persisting fault), report it.

        ``began``: when the failed tick started. The fault is dated from there, not from when
        the failure came back: with the API server gone, a call fails only at the client's
        timeout, and dating the fault from then left that wait out of the span reported."""
        now = datetime.now(tz=UTC)
        self.failures += 1
        self.since = self.since or began or now
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
        if self.failures == 0 or (self.failures < 2 and self.reason not in _ALWAYS_RECORDED):
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


@dataclass(frozen=True, kw_only=True)
class Outage:
    """An API outage that ended a leadership: what a new leader records on every job."""

    began: datetime
    seconds: float
    last_error: str

    def message(self) -> str:
        return (
            f"Kubernetes API calls failed for {self.seconds:.0f}s from {_iso(self.began)} "
            f"(last error: {self.last_error}); the operator that leads now took its Lease "
            "after the outage and works again"
        )


def outage_after_takeover(
    seen: tuple[datetime, float, str] | None, previous_renew: datetime | None
) -> Outage | None:
    """The outage a replica that just took the Lease must record on the jobs, or None.

    ``seen``: the last run of failed calls this replica saw end (``Health.last_outage``);
    ``previous_renew``: when the Lease's previous holder last renewed it (``LeaderElector``;
    this identity's own predecessor after a restart). The holder's leadership ended in the
    outage when the outage ended after that renewal; it began no later than the renewal's
    successor was due, so the record starts at the earlier of the two: the start survives a
    restart of the replica that saw it begin. A Lease taken free or released (a clean
    handover) or a holder that stopped without an outage (``kill -9``) gives None.
    """
    if seen is None or previous_renew is None:
        return None
    began, lasted, error = seen
    ended = began + timedelta(seconds=lasted)
    if ended < previous_renew:
        return None  # an older outage, before the previous holder's last renewal
    start = min(began, previous_renew)
    return Outage(began=start, seconds=(ended - start).total_seconds(), last_error=error)


async def record_outage(
    kube: Kube, post: EventPoster, namespace: str, name: str, outage: Outage
) -> bool:
    """Write ``outage`` on the job (condition ``Degraded`` False, reason ``APIRecovered``)
    and post one ``APIRecovered`` Event, unless the job already carries it, finished before
    it, or was created after it. Best effort, as every fault report: True once done."""
    try:
        job = await kube.get_job(namespace, name)
    except KubeError as e:
        _log.warning("%s/%s: could not record the API outage: %s", namespace, name, e)
        return False
    if job is None:
        return True
    status = job.get("status") or {}
    created = str((job.get("metadata") or {}).get("creationTimestamp") or "")
    ended = outage.began + timedelta(seconds=outage.seconds)
    if status.get("phase") in ("Succeeded", "Failed") or (created and created > _iso(ended)):
        return True
    mark = f"from {_iso(outage.began)}"
    if any(
        c.get("type") == "Degraded" and mark in str(c.get("message") or "")
        for c in status.get("conditions") or []
    ):
        return True  # recorded already (by this operator before it restarted, or another)
    return await _report(
        kube, post, namespace, name,
        degraded=False, reason="APIRecovered", message=outage.message(), kind="Normal",
    )  # fmt: skip


async def rejected(
    kube: Kube, post: EventPoster, namespace: str, name: str, error: KubeRejectedError
) -> bool:
    """Report a write the API server refused for good: ``Degraded`` True (``APIRejected``)
    and one Warning Event, naming the refused fields and the fix. The caller stops retrying.
    Best effort (the report writes only ``conditions``, which the refusal did not concern
    unless it names them): True once written."""
    fields = ", ".join(error.fields) or "none named by the API server"
    quoted = str(error)
    if len(quoted) > _MAX_QUOTED:
        quoted = quoted[:_MAX_QUOTED] + "..."
    message = (
        f"the API server refused the operator's write (field {fields}): {quoted}; {_REJECTED_FIX}"
    )
    _log.error("%s/%s: %s", namespace, name, message)
    return await _report(
        kube, post, namespace, name,
        degraded=True, reason=_REJECTED, message=message, kind="Warning",
    )  # fmt: skip


async def clear_rejection(
    kube: Kube, post: EventPoster, namespace: str, name: str, job: Mapping[str, Any] | None
) -> bool:
    """After a daemon's first tick that worked: clear the ``APIRejected`` report a stopped
    daemon left on ``job`` (the job as that tick read it; None: unknown, nothing is done).
    Costs no API call unless the report is there. True when there is nothing (left) to do."""
    conditions = ((job or {}).get("status") or {}).get("conditions") or []
    left = next(
        (
            c for c in conditions
            if c.get("type") == "Degraded" and c.get("status") == "True"
            and c.get("reason") == _REJECTED
        ),
        None,
    )  # fmt: skip
    if left is None:
        return True
    message = (
        "the operator's writes to this job work again; it drives the job again (it had "
        f"stopped: {left.get('message') or 'a write was refused'})"
    )
    return await _report(
        kube, post, namespace, name,
        degraded=False, reason="APIRecovered", message=message, kind="Normal",
    )  # fmt: skip


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
