"""Leader election on a ``coordination.k8s.io`` Lease: exactly one operator acts.

Why not kopf's peering: two operators of equal priority both pause, and an operator restarted
after ``kill -9`` waits for its own dead predecessor's record to expire (53 s measured), longer
than GKE's whole notice window. A Lease is the Kubernetes way (client-go's ``leaderelection``)
and it can be reasoned about with three numbers (settings.py):

- the active operator renews every ``lease_renew_seconds``; if it has not renewed for
  ``lease_renew_deadline_seconds`` it exits at once (``os._exit`` in ``__main__``), before
  its Lease can expire, so it never acts beside a successor;
- a standby looks every ``lease_retry_seconds``; it takes over once the Lease record has not
  changed for ``lease_duration_seconds`` *by its own clock* (it never compares its clock with
  the holder's), so a standby acts at most duration + retry (4.5 s by default) after the
  active operator's last renewal;
- an operator whose identity already holds the Lease (the same pod, restarted) renews it at
  once: it never waits for its own dead predecessor.

Every write is an update with the Lease's ``resourceVersion``: of two standbys racing for an
expired Lease, one gets ``409 Conflict`` and stays standby. The active operator renews with one
request, not two: it replaces the Lease guarded by the resourceVersion of its own last write
(a conflict means someone else wrote: it then reads the Lease as a standby would). On an API
server slowed by load, each renewal then waits for one answer within the renew deadline. A
stopping operator releases the Lease (empty holder), so a rollout hands over without waiting
for expiry.

This is a client-layer module: it is the only code that touches Leases, and it declares its
RBAC permissions in :data:`PERMISSIONS` (rbac.py grants them in the operator's namespace only,
``get``/``update`` by name).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, Protocol

from kubernetes import client as k8s_client
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError as Urllib3Error

from baton_operator.pure.errors import BatonOperatorError, KubeError

from .kube import Permission

__all__ = ["PERMISSIONS", "LeaderElector", "LeadershipLostError", "LeaseClient", "LeaseTimings"]

_log = logging.getLogger("baton_operator.leader")

# No answer from the API server: a refused connection or a timeout is an OSError, or, once
# the client's retries are spent, urllib3's MaxRetryError (not an OSError). A standby must
# keep retrying through either, not exit.
_NO_ANSWER: Final = (OSError, Urllib3Error)

GROUP: Final = "coordination.k8s.io"
PERMISSIONS: Final = frozenset(
    {
        Permission(GROUP, "leases", "get"),
        Permission(GROUP, "leases", "create"),
        Permission(GROUP, "leases", "update"),
    }
)
"""What :class:`LeaseClient` calls: ``create`` (the first operator ever), ``get`` and
``update`` (every renewal and takeover)."""


class LeadershipLostError(BatonOperatorError):
    """The active operator could not renew its Lease in time: it must stop acting now."""


def _micro_time(t: datetime) -> str:
    # MicroTime: RFC 3339 with microseconds, as the API server writes it.
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse_micro_time(value: Any) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


class LeaseClient:
    """get / create / update of one Lease, with a request timeout on every call.

    The calls run on a thread of their own, not on asyncio's shared default executor: there a
    renewal would queue behind the reconcilers' blocking API and sidecar calls, and on a busy
    machine miss its deadline, and the active operator would stop for nothing.
    """

    def __init__(self, api_client: Any, *, namespace: str, name: str, timeout: float) -> None:
        self._api: Any = k8s_client.CoordinationV1Api(api_client)
        self.namespace = namespace
        self.name = name
        self._timeout = timeout
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lease")

    async def _call(self, call: Callable[..., Any], *args: Any) -> Any:
        request = functools.partial(
            call, *args, _preload_content=False, _request_timeout=self._timeout
        )
        return await asyncio.get_running_loop().run_in_executor(self._thread, request)

    def _what(self) -> str:
        return f"Lease {self.namespace}/{self.name}"

    async def get(self) -> dict[str, Any] | None:
        """The Lease as a dict, or None when there is none."""
        return await self._request(
            "reading", 404, self._api.read_namespaced_lease, self.name, self.namespace
        )

    def _body(self, spec: dict[str, Any], resource_version: str | None = None) -> dict[str, Any]:
        metadata: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if resource_version is not None:
            metadata["resourceVersion"] = resource_version
        return {"apiVersion": f"{GROUP}/v1", "kind": "Lease", "metadata": metadata, "spec": spec}

    async def _request(
        self, doing: str, none_on: int, call: Callable[..., Any], *args: Any
    ) -> dict[str, Any] | None:
        """One read, create or guarded replace: the Lease as the API server answered (after a
        write, with its new resourceVersion), or None on the HTTP status ``none_on`` (404 on a
        read: there is no Lease; 409 on a write: another operator wrote first). Any other
        refusal, and no answer at all, is a :class:`KubeError` that names what was being done."""
        try:
            resp = await self._call(call, *args)
        except ApiException as e:
            if e.status == none_on:
                return None
            raise KubeError(f"{doing} {self._what()}: HTTP {e.status}", status=e.status) from e
        except _NO_ANSWER as e:
            raise KubeError(f"{doing} {self._what()}: {type(e).__name__}") from e
        lease: dict[str, Any] = json.loads(resp.data)
        return lease

    async def create(self, spec: dict[str, Any]) -> dict[str, Any] | None:
        """Create the Lease; None when another operator created it first."""
        return await self._request(
            "creating", 409, self._api.create_namespaced_lease, self.namespace, self._body(spec)
        )

    async def update(self, lease: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any] | None:
        """Replace the Lease's spec, guarded by its resourceVersion; None on a conflict."""
        body = self._body(spec, lease["metadata"]["resourceVersion"])
        return await self._request(
            "updating", 409, self._api.replace_namespaced_lease, self.name, self.namespace, body
        )


class CallHealth(Protocol):
    """What the elector tells about its Lease calls (``metrics.Health``: a standby that
    cannot reach the API server says so on ``/healthz`` too, and remembers the outage)."""

    def ok(self) -> None: ...

    def failed(self, error: str, *, status: int | None = None) -> None: ...


@dataclass(frozen=True, kw_only=True)
class LeaseTimings:
    """The three numbers of the election (their reasons are in settings.py)."""

    duration: int
    renew: float
    retry: float
    renew_deadline: float


class LeaderElector:
    """Acquire, keep and release the Lease for ``identity``."""

    def __init__(
        self,
        client: LeaseClient,
        *,
        identity: str,
        timings: LeaseTimings,
        clock: Callable[[], float] = time.monotonic,
        health: CallHealth | None = None,
    ) -> None:
        if not identity:
            raise ValueError("a leader-election identity is needed: pass --identity")
        self._client = client
        self.identity = identity
        self._t = timings
        self._clock = clock
        self._observed: tuple[str, float] | None = None
        """(resourceVersion, our clock when we first saw it): the holder's liveness, judged
        by our own clock only."""
        self._written: dict[str, Any] | None = None
        """The Lease as our last write left it, while we lead: a renewal replaces it guarded by
        its resourceVersion without reading it first (one round trip, not two)."""
        self.leading = False
        self._health = health
        self.previous_renew: datetime | None = None
        """When the holder this identity took the Lease from (its own predecessor too, after
        a restart) last renewed it; None when the Lease was free or released. The start of
        an outage that ended that holder's leadership survives here."""

    async def try_acquire_or_renew(self) -> bool:
        """One attempt; True when this identity holds the Lease afterwards."""
        now = datetime.now(tz=UTC)
        spec = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": self._t.duration,
            "acquireTime": _micro_time(now),
            "renewTime": _micro_time(now),
            "leaseTransitions": 0,
        }
        if self.leading and self._written is not None:
            # A renewal: if nobody wrote the Lease since our last write, its resourceVersion
            # is the one we hold, and the guarded replace succeeds. A conflict means someone
            # did: look at it the way a standby would (below).
            mine = dict(self._written.get("spec") or {})
            spec["acquireTime"] = mine.get("acquireTime") or spec["acquireTime"]
            spec["leaseTransitions"] = int(mine.get("leaseTransitions") or 0)
            self._written = await self._client.update(self._written, spec)
            if self._written is not None:
                return True
            spec["acquireTime"], spec["leaseTransitions"] = spec["renewTime"], 0
        lease = await self._client.get()
        if lease is None:
            self._written = await self._client.create(spec)
            self.leading = self._written is not None
            return self.leading
        old = dict(lease.get("spec") or {})
        holder = str(old.get("holderIdentity") or "")
        version = str(lease["metadata"]["resourceVersion"])
        if self._observed is None or self._observed[0] != version:
            self._observed = (version, self._clock())
        if holder and holder != self.identity:
            # The holder's own duration decides (an older operator may use another one).
            duration = float(old.get("leaseDurationSeconds") or self._t.duration)
            if self._clock() - self._observed[1] < duration:
                self.leading = False
                return False
        renewed = _parse_micro_time(old.get("renewTime")) if holder else None
        transitions = int(old.get("leaseTransitions") or 0)
        if holder == self.identity:
            spec["acquireTime"] = old.get("acquireTime") or spec["acquireTime"]
            spec["leaseTransitions"] = transitions
        else:
            spec["leaseTransitions"] = transitions + 1
        self._written = await self._client.update(lease, spec)
        self.leading = self._written is not None
        if self.leading:
            self.previous_renew = renewed
        return self.leading

    async def acquire(self) -> None:
        """Wait (as a standby) until this identity holds the Lease."""
        said = False
        while True:
            try:
                acquired = await self.try_acquire_or_renew()
                if self._health is not None:
                    self._health.ok()
                if acquired:
                    _log.info(
                        "leader election: %s holds Lease %s/%s; this operator is active",
                        self.identity, self._client.namespace, self._client.name,
                    )  # fmt: skip
                    return
            except KubeError as e:
                _log.warning("leader election: %s; retrying", e)
                if self._health is not None:
                    self._health.failed(str(e), status=e.status)
            if not said:
                _log.info(
                    "leader election: Lease %s/%s is held by another operator; standing by",
                    self._client.namespace, self._client.name,
                )  # fmt: skip
                said = True
            await asyncio.sleep(self._t.retry)

    async def keep(self, stop: threading.Event | None = None) -> None:
        """Renew until leadership is lost, then raise :class:`LeadershipLostError`; return
        once ``stop`` is set (a clean stop, before :meth:`release`).

        ``__main__`` runs this in a thread and event loop of its own, so that a busy operator
        (hundreds of jobs' reconcilers on the main loop) cannot delay its renewals.
        """
        last_ok = self._clock()
        while stop is None or not stop.is_set():
            await asyncio.sleep(self._t.renew)
            if stop is not None and stop.is_set():
                return
            left = self._t.renew_deadline - (self._clock() - last_ok)
            try:
                ok = await asyncio.wait_for(self.try_acquire_or_renew(), timeout=max(left, 0.01))
            except (KubeError, TimeoutError) as e:
                ok = False
                _log.warning("leader election: renewal failed: %s", e or type(e).__name__)
            if ok:
                last_ok = self._clock()
                continue
            if self._clock() - last_ok >= self._t.renew_deadline or not self._still_ours():
                self.leading = False
                raise LeadershipLostError(
                    f"could not renew Lease {self._client.namespace}/{self._client.name} "
                    f"within {self._t.renew_deadline:.1f}s (or another operator took it): "
                    "stopping so that two operators never act at once"
                )

    def _still_ours(self) -> bool:
        # A renewal that lost a race or found another holder means someone else leads.
        return self.leading

    async def release(self) -> None:
        """Give the Lease up (a clean stop): a standby takes over without waiting."""
        if not self.leading:
            return
        self.leading = False
        self._written = None
        try:
            lease = await self._client.get()
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            spec = dict(lease["spec"])
            spec["holderIdentity"] = ""
            spec["renewTime"] = None
            spec["acquireTime"] = None
            await self._client.update(lease, spec)
        except KubeError as e:
            _log.warning("leader election: could not release the Lease: %s", e)
        else:
            _log.info(
                "leader election: %s released Lease %s/%s", self.identity,
                self._client.namespace, self._client.name,
            )  # fmt: skip
