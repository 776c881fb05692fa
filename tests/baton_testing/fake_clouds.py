"""Fake cloud metadata servers that answer as the documented AWS, GCE and Azure endpoints do.

Each fake is a real HTTP server on a 127.0.0.1 port, run by aiohttp on a thread of its own, so a
sidecar process (or anything else) talks to it over TCP exactly as it would to
``169.254.169.254``. Tests set the notice, then watch what the sidecar does; they can also make
the server misbehave the way the real ones do:

* ``fail_next(n, status)`` — the next ``n`` data requests answer an HTTP error (5xx, 429, ...);
* ``hang_next(n, seconds)`` — the next ``n`` data requests stall (the client times out);
* AWS ``expire_tokens()`` — every issued IMDSv2 token stops working (the next GET gets 401);
* a fake built with ``port=`` binds that port, so a test can start it late and show that the
  sidecar rides out refused connections.

The behaviour follows the public documentation:

* AWS IMDSv2: ``PUT /latest/api/token`` needs ``X-aws-ec2-metadata-token-ttl-seconds`` (1-21600)
  and refuses requests with ``X-Forwarded-For``; metadata GETs need
  ``X-aws-ec2-metadata-token`` (401 without a valid one). ``spot/instance-action`` is 404 until a
  notice, then ``{"action": "terminate", "time": "...Z"}``.
* GCE: every request needs ``Metadata-Flavor: Google`` (403 without) and every answer carries
  it. Values carry an ``ETag``; ``?wait_for_change=true&last_etag=E&timeout_sec=N`` hangs until
  the value's ETag differs from ``E`` or ``N`` seconds pass.
* Azure: requests need ``Metadata: true`` and ``api-version`` (400 without);
  ``/metadata/scheduledevents`` answers ``{"DocumentIncarnation": n, "Events": [...]}`` with
  ``NotBefore`` in RFC 1123; ``POST`` with ``{"StartRequests": [{"EventId": ...}]}`` acknowledges.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import secrets
import socket
import threading
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import format_datetime
from typing import Any, Self

from aiohttp import web

__all__ = ["FakeAws", "FakeAzure", "FakeGce", "Recorded"]


@dataclass(frozen=True, kw_only=True)
class Recorded:
    """One request the fake received (header values that are secrets are not kept)."""

    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    status: int
    body: str = ""


@dataclass(kw_only=True)
class _Faults:
    fail: list[int] = field(default_factory=list)
    hang: list[float] = field(default_factory=list)


class _FakeServer:
    """A real aiohttp server on its own thread and loop; subclasses add the routes."""

    def __init__(self, *, port: int = 0) -> None:
        self._port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._lock = threading.Lock()
        self._faults = _Faults()
        self.requests: list[Recorded] = []
        self.port = 0

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> Self:
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._start_site())
            except BaseException as e:
                errors.append(e)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._stop_site())
            # Cancel what still hangs (long polls, injected stalls) so that it ends cleanly,
            # until nothing is left (cancelled handlers may schedule follow-ups).
            while pending := asyncio.all_tasks(loop):
                for task in pending:
                    task.cancel()
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

        self._thread = threading.Thread(target=run, name=type(self).__name__, daemon=True)
        self._thread.start()
        ready.wait(10)
        if errors:
            raise errors[0]
        return self

    async def _start_site(self) -> None:
        app = web.Application(middlewares=[self._record])
        self.routes(app)
        # Long polls still hanging at stop are cut short, not waited for.
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self._port))
        self.port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock).start()

    async def _stop_site(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._loop = self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ---- faults ---------------------------------------------------------------------------

    def fail_next(self, n: int, status: int = 503) -> None:
        """The next ``n`` data requests answer ``status``."""
        with self._lock:
            self._faults.fail.extend([status] * n)

    def hang_next(self, n: int, seconds: float = 30.0) -> None:
        """The next ``n`` data requests stall ``seconds`` before answering (clients time out)."""
        with self._lock:
            self._faults.hang.extend([seconds] * n)

    async def _fault(self) -> web.Response | None:
        with self._lock:
            hang = self._faults.hang.pop(0) if self._faults.hang else None
            fail = self._faults.fail.pop(0) if self._faults.fail else None
        if hang is not None:
            await asyncio.sleep(hang)
        if fail is not None:
            return web.Response(status=fail, text="injected failure")
        return None

    def count(self, method: str, path_suffix: str) -> int:
        """How many requests with ``method`` to a path ending in ``path_suffix`` were answered."""
        with self._lock:
            return sum(
                1 for r in self.requests if r.method == method and r.path.endswith(path_suffix)
            )

    # ---- plumbing -------------------------------------------------------------------------

    _SECRET_HEADERS = frozenset({"x-aws-ec2-metadata-token", "authorization"})

    @web.middleware
    async def _record(self, request: web.Request, handler: Any) -> web.StreamResponse:
        body = await request.text() if request.can_read_body else ""
        response: web.StreamResponse = await handler(request)
        headers = {
            k: ("<present>" if k.lower() in self._SECRET_HEADERS else v)
            for k, v in request.headers.items()
        }
        with self._lock:
            self.requests.append(
                Recorded(
                    method=request.method,
                    path=request.path,
                    query=dict(request.query),
                    headers=headers,
                    status=response.status,
                    body=body,
                )
            )
        return response

    def routes(self, app: web.Application) -> None:
        raise NotImplementedError


class FakeAws(_FakeServer):
    """EC2 IMDSv2 with a spot ``instance-action``."""

    MAX_TTL = 21600

    def __init__(self, *, port: int = 0) -> None:
        super().__init__(port=port)
        self._tokens: set[str] = set()
        self.notice: dict[str, str] | None = None
        self.raw_notice: str | None = None
        """If set, served as the ``instance-action`` body as is (to test malformed answers)."""

    def set_notice(self, *, time: datetime, action: str = "terminate") -> None:
        """From now on ``spot/instance-action`` reports an interruption at ``time``."""
        with self._lock:
            self.notice = {
                "action": action,
                "time": time.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            }

    def expire_tokens(self) -> None:
        """Every token issued so far stops working, as when its TTL runs out."""
        with self._lock:
            self._tokens.clear()

    @property
    def tokens_issued(self) -> int:
        return self.count("PUT", "/latest/api/token")

    def routes(self, app: web.Application) -> None:
        app.router.add_put("/latest/api/token", self._token)
        app.router.add_get("/latest/meta-data/spot/instance-action", self._instance_action)
        app.router.add_get("/latest/meta-data/instance-id", self._instance_id)

    async def _token(self, request: web.Request) -> web.Response:
        if "X-Forwarded-For" in request.headers:
            return web.Response(status=403, text="Forbidden")
        ttl = request.headers.get("X-aws-ec2-metadata-token-ttl-seconds", "")
        if not ttl.isdigit() or not 1 <= int(ttl) <= self.MAX_TTL:
            return web.Response(status=400, text="Bad Request")
        fault = await self._fault()
        if fault is not None:
            return fault
        token = secrets.token_urlsafe(32)
        with self._lock:
            self._tokens.add(token)
        return web.Response(text=token, headers={"X-aws-ec2-metadata-token-ttl-seconds": ttl})

    def _authorized(self, request: web.Request) -> bool:
        with self._lock:
            return request.headers.get("X-aws-ec2-metadata-token") in self._tokens

    async def _instance_action(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.Response(status=401, text="Unauthorized")
        fault = await self._fault()
        if fault is not None:
            return fault
        with self._lock:
            notice, raw = self.notice, self.raw_notice
        if raw is not None:
            return web.Response(text=raw, content_type="text/plain")
        if notice is None:
            return web.Response(status=404, text="Not Found")
        return web.Response(text=json.dumps(notice), content_type="text/plain")

    async def _instance_id(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.Response(status=401, text="Unauthorized")
        return web.Response(text="i-0123456789abcdef0")


class FakeGce(_FakeServer):
    """The GCE metadata server's ``instance/preempted`` and ``instance/maintenance-event``."""

    def __init__(self, *, port: int = 0) -> None:
        super().__init__(port=port)
        self.values = {"preempted": "FALSE", "maintenance-event": "NONE"}
        self.impostor = False
        """Answer values without ``Metadata-Flavor: Google``, as a proxy or portal would."""
        # Created here, used only on the server's loop (a Condition binds to a loop on first use).
        self._changed = asyncio.Condition()

    def set_value(self, key: str, value: str) -> None:
        """Change ``instance/<key>`` and wake the long polls waiting on it."""
        assert self._loop is not None, "start the fake first"
        asyncio.run_coroutine_threadsafe(self._set(key, value), self._loop).result(10)

    async def _set(self, key: str, value: str) -> None:
        async with self._changed:
            self.values[key] = value
            self._changed.notify_all()

    def preempt(self) -> None:
        """The VM is being preempted: ``preempted`` turns ``TRUE``."""
        self.set_value("preempted", "TRUE")

    @staticmethod
    def _etag(value: str) -> str:
        return hashlib.sha256(value.encode()).hexdigest()[:16]

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/computeMetadata/v1/", self._root)
        app.router.add_get("/computeMetadata/v1/instance/{key:.+}", self._value)

    def _flavored(self, request: web.Request) -> web.Response | None:
        if request.headers.get("Metadata-Flavor") != "Google":
            return web.Response(
                status=403,
                text="Missing required header: Metadata-Flavor",
                headers={"Metadata-Flavor": "Google"},
            )
        return None

    async def _root(self, request: web.Request) -> web.Response:
        refused = self._flavored(request)
        if refused is not None:
            return refused
        return web.Response(text="instance/\nproject/\n", headers={"Metadata-Flavor": "Google"})

    async def _value(self, request: web.Request) -> web.Response:
        refused = self._flavored(request)
        if refused is not None:
            return refused
        key = request.match_info["key"]
        if key not in self.values:
            return web.Response(status=404, text="Not Found", headers={"Metadata-Flavor": "Google"})
        fault = await self._fault()
        if fault is not None:
            fault.headers["Metadata-Flavor"] = "Google"
            return fault
        if request.query.get("wait_for_change") == "true":
            last = request.query.get("last_etag")
            timeout = float(request.query.get("timeout_sec", "300"))
            if last is not None:

                def differs() -> bool:
                    return self._etag(self.values[key]) != last

                async with self._changed:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._changed.wait_for(differs), timeout)
        value = self.values[key]
        return web.Response(
            text=value,
            headers={"ETag": self._etag(value)}
            if self.impostor
            else {"Metadata-Flavor": "Google", "ETag": self._etag(value)},
            content_type="application/text",
        )


class FakeAzure(_FakeServer):
    """Azure IMDS Scheduled Events and the VM's ``compute/name``."""

    def __init__(self, *, port: int = 0, vm_name: str = "baton-vm-0") -> None:
        super().__init__(port=port)
        self.vm_name = vm_name
        self.events: list[dict[str, Any]] = []
        self.incarnation = 1
        self.acknowledged: list[str] = []

    def add_event(
        self,
        *,
        not_before: datetime | None,
        event_type: str = "Preempt",
        resources: list[str] | None = None,
    ) -> str:
        """Schedule an event (for this VM unless ``resources`` says otherwise); returns its id.

        ``not_before=None`` lists an event that has already started (``NotBefore`` empty).
        """
        event_id = str(uuid.uuid4()).upper()
        with self._lock:
            self.events.append(
                {
                    "EventId": event_id,
                    "EventType": event_type,
                    "ResourceType": "VirtualMachine",
                    "Resources": resources if resources is not None else [self.vm_name],
                    "EventStatus": "Scheduled" if not_before is not None else "Started",
                    "NotBefore": ""
                    if not_before is None
                    else format_datetime(not_before.astimezone(UTC), usegmt=True),
                    "Description": "",
                    "EventSource": "Platform",
                    "DurationInSeconds": -1,
                }
            )
            self.incarnation += 1
        return event_id

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/metadata/scheduledevents", self._list)
        app.router.add_post("/metadata/scheduledevents", self._start)
        app.router.add_get("/metadata/instance/compute/name", self._name)

    @staticmethod
    def _refused(request: web.Request) -> web.Response | None:
        if request.headers.get("Metadata") != "true":
            return web.json_response(
                {"error": "Bad request. Required metadata header not specified"}, status=400
            )
        if "api-version" not in request.query:
            return web.json_response(
                {"error": "Bad request. api-version was not specified in the request."},
                status=400,
            )
        return None

    async def _list(self, request: web.Request) -> web.Response:
        refused = self._refused(request)
        if refused is not None:
            return refused
        fault = await self._fault()
        if fault is not None:
            return fault
        with self._lock:
            doc = {"DocumentIncarnation": self.incarnation, "Events": list(self.events)}
        return web.json_response(doc)

    async def _start(self, request: web.Request) -> web.Response:
        refused = self._refused(request)
        if refused is not None:
            return refused
        fault = await self._fault()
        if fault is not None:
            return fault
        try:
            body = await request.json()
            ids = [str(item["EventId"]) for item in body["StartRequests"]]
        except (ValueError, KeyError, TypeError):
            return web.json_response({"error": "Bad request. Invalid StartRequests"}, status=400)
        with self._lock:
            known = {e["EventId"] for e in self.events}
            for event_id in ids:
                if event_id in known:
                    self.acknowledged.append(event_id)
            for event in self.events:
                if event["EventId"] in ids:
                    event["EventStatus"] = "Started"
                    event["NotBefore"] = ""
            self.incarnation += 1
        return web.Response(status=200)

    async def _name(self, request: web.Request) -> web.Response:
        refused = self._refused(request)
        if refused is not None:
            return refused
        return web.Response(text=self.vm_name)
