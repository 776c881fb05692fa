"""Real S3 servers for tests, and a fault-injecting HTTP proxy that can stand in front of either.

Two servers, one per session each, and the S3 tests run against both (the fixture is
parametrized): moto's server mode, a correctness fake that is quick to start, and versitygw
(the Versity S3 gateway, Apache-2.0, POSIX backend), a production S3 implementation that is
stricter than moto (it checks SigV4 signatures, checksums and part sizes as S3 does) and fast
enough to measure. versitygw is built from Go modules by ``tools/versitygw/build.sh`` (cached
by content hash; ``make build`` builds it).

Why a proxy rather than patched clients: the SDK's retry and abort logic must be exercised by the
same botocore code paths that meet a real S3 in production (HTTP status codes, S3 XML error
bodies, read timeouts, dropped connections). The proxy speaks plain HTTP/1.1 with keep-alive,
forwards every request to the server unchanged (signed headers included, so the server still
checks the signature), and answers selected requests with a fault instead.

Fixtures (registered through ``pytest_plugins`` in ``tests/conftest.py``):

* ``s3_server`` (session, parametrized ``moto`` / ``versitygw``): the server under test.
* ``moto_s3`` / ``versitygw_s3`` (session): each server alone, started on first use.
* ``s3_bucket`` (function): a fresh bucket on ``s3_server``, with ``AWS_ENDPOINT_URL_S3`` and
  the test credentials set in the environment; direct access, no faults.
* ``versitygw_bucket`` (function): the same on versitygw only, for what moto does not check.
* ``s3_faults`` (function): like ``s3_bucket``, but ``AWS_ENDPOINT_URL_S3`` points at a
  :class:`FaultProxy`; tests add :class:`Fault` rules and read the proxy's request log.

Why one module of this size: the two servers, the proxy and the fixtures are one tool for
the S3 tests: every fixture starts a server, some put the proxy in front of it, and the
proxy's faults are written against what both servers answer.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import http.client
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Literal

import boto3
import botocore.config
import pytest
from baton_testing.ports import free_port

__all__ = [
    "SERVER_KINDS",
    "Fault",
    "FaultProxy",
    "MotoServer",
    "S3Bucket",
    "S3Server",
    "Seen",
    "ServerKind",
    "VersityServer",
    "classify",
    "moto_s3",
    "s3_bucket",
    "s3_faults",
    "s3_server",
    "start_server",
    "versitygw_binary",
    "versitygw_bucket",
    "versitygw_s3",
]

FAKE_KEY_ID = "testing-key-id"
FAKE_SECRET = "testing-secret"  # moto accepts any credentials; versitygw's root account is this
REGION = "us-east-1"
REPO_ROOT = Path(__file__).resolve().parents[2]
VERSITYGW_BUILD = REPO_ROOT / "tools" / "versitygw" / "build.sh"

ServerKind = Literal["moto", "versitygw"]
SERVER_KINDS: tuple[ServerKind, ...] = ("moto", "versitygw")

Action = Literal["error", "stall", "drop_response", "reset", "truncate_body", "stall_body"]

_ERROR_MESSAGES = {
    "SlowDown": "Please reduce your request rate.",
    "InternalError": "We encountered an internal error. Please try again.",
    "ServiceUnavailable": "Service is unable to handle request.",
    "TooManyRequests": "Too many requests.",
    "AccessDenied": "Access Denied",
    "NoSuchUpload": "The specified upload does not exist. The upload ID may be invalid, or the "
    "upload may have been aborted or completed.",
}


def versitygw_binary() -> str:
    """The versitygw binary built by ``tools/versitygw/build.sh`` (instant once cached)."""
    result = subprocess.run(
        [str(VERSITYGW_BUILD)], capture_output=True, text=True, timeout=3600, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"tools/versitygw/build.sh failed (exit {result.returncode}); it needs Go 1.26+ and "
            f"the Go module proxy once (run `make build`):\n{result.stderr[-4000:]}"
        )
    return result.stdout.strip().splitlines()[-1]


class S3Server:
    """An S3 server in a subprocess (its own GIL, so client timings are honest) on a free
    127.0.0.1 port, reached with path-style requests and the test credentials."""

    kind: ServerKind

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _env(self) -> dict[str, str]:
        return dict(os.environ)

    def _ready(self) -> bool:
        """Whether the server answers (called until it does, or the start times out)."""
        raise NotImplementedError

    def _cleanup(self) -> None:
        """Remove what the server left behind (after it stopped)."""

    def start(self, timeout: float = 60.0) -> None:
        # Another process may take the port between probing and binding; retry a few times.
        for _ in range(5):
            self.port = free_port()
            self.proc = subprocess.Popen(
                self._command(),
                env=self._env(),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.proc.poll() is None:
                with contextlib.suppress(OSError):
                    if self._ready():
                        return
                time.sleep(0.1)
            self.stop()
        raise RuntimeError(f"the {self.kind} S3 server did not start: {self._start_hint()}")

    def _start_hint(self) -> str:
        return "see its command line in tests/baton_testing/s3.py"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        self._cleanup()

    def client(self, **config: Any) -> Any:
        """A boto3 S3 client straight to the server (no proxy, no faults)."""
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=FAKE_KEY_ID,
            aws_secret_access_key=FAKE_SECRET,
            config=botocore.config.Config(s3={"addressing_style": "path"}, **config),
        )


class MotoServer(S3Server):
    """``python -m moto.server``: a correctness fake, quick to start, about 100 MiB/s."""

    kind: ServerKind = "moto"

    def _command(self) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]

    def _ready(self) -> bool:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
        try:
            conn.request("GET", "/moto-api/data.json")
            return conn.getresponse().status == 200
        finally:
            conn.close()

    def _start_hint(self) -> str:
        return "is moto[server] installed in the venv?"


class VersityServer(S3Server):
    """versitygw with its POSIX backend on a fresh temporary directory (buckets are
    directories, metadata in xattrs): a production S3 implementation that checks signatures,
    checksums and part sizes. The test credentials are its root account."""

    kind: ServerKind = "versitygw"

    def __init__(self, binary: str | None = None, root: str | None = None) -> None:
        super().__init__()
        self.binary = binary
        self._own_root = root is None
        self.root = root or ""

    def _command(self) -> list[str]:
        if self.binary is None:
            self.binary = versitygw_binary()
        if not self.root:
            self.root = tempfile.mkdtemp(prefix="baton-versitygw-")
        return [
            self.binary,
            "--port",
            f"127.0.0.1:{self.port}",
            "--region",
            REGION,
            "--keep-alive",  # off by default: every request would open a new connection
            "--quiet",
            "--health",
            "/baton-health",
            "posix",
            self.root,
        ]

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(ROOT_ACCESS_KEY=FAKE_KEY_ID, ROOT_SECRET_KEY=FAKE_SECRET)
        return env

    def _ready(self) -> bool:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
        try:
            conn.request("GET", "/baton-health")
            return conn.getresponse().status == 200
        finally:
            conn.close()

    def _start_hint(self) -> str:
        return f"run {self.binary} by hand to see why (the data directory is {self.root})"

    def _cleanup(self) -> None:
        if self._own_root and self.root:
            shutil.rmtree(self.root)
            self.root = ""


def start_server(kind: ServerKind) -> S3Server:
    """A started S3 server of ``kind``; the caller stops it."""
    server: S3Server = MotoServer() if kind == "moto" else VersityServer()
    server.start()
    return server


def classify(method: str, path: str, query: dict[str, str]) -> tuple[str, str, str]:
    """(operation, bucket, key) of a path-style S3 request, e.g. ("UploadPart", "b", "k")."""
    bucket, _, key = urllib.parse.unquote(path.lstrip("/")).partition("/")
    if method == "PUT":
        if "partNumber" in query and "uploadId" in query:
            return "UploadPart", bucket, key
        return ("PutObject" if key else "CreateBucket"), bucket, key
    if method == "POST":
        if "uploads" in query:
            return "CreateMultipartUpload", bucket, key
        if "uploadId" in query:
            return "CompleteMultipartUpload", bucket, key
        if "delete" in query:
            return "DeleteObjects", bucket, key
        return "Post", bucket, key
    if method == "DELETE":
        if "uploadId" in query:
            return "AbortMultipartUpload", bucket, key
        return ("DeleteObject" if key else "DeleteBucket"), bucket, key
    if method == "HEAD":
        return ("HeadObject" if key else "HeadBucket"), bucket, key
    if not key:
        if "uploads" in query:
            return "ListMultipartUploads", bucket, key
        return "ListObjects", bucket, key
    if "uploadId" in query:
        return "ListParts", bucket, key
    return "GetObject", bucket, key


@dataclass(kw_only=True)
class Fault:
    """Answer matching requests with a fault instead of forwarding them (or after forwarding).

    A request matches when every given filter matches. ``nth`` counts matching requests from 1
    in arrival order; ``times`` limits how often the rule fires (None: always).
    """

    op: str
    """S3 operation as :func:`classify` names it: "UploadPart", "PutObject", "GetObject", ..."""
    action: Action = "error"
    """error: an S3 XML error response; stall: read the request, say nothing for ``seconds``,
    then close; drop_response: forward, then close without answering (the server did the work);
    reset: close without forwarding; truncate_body: forward, send headers and half the body,
    then close; stall_body: the same, but say nothing for ``seconds`` before closing."""
    status: int = 500
    code: str = "InternalError"
    key: str | None = None
    """fnmatch pattern on the object key."""
    part_numbers: frozenset[int] | None = None
    """Only UploadPart requests for these part numbers."""
    range_starts: frozenset[int] | None = None
    """Only GetObject requests whose ``Range`` header starts at one of these byte offsets.
    Concurrent ranged GETs arrive in any order, so a fault meant for one range names it here
    rather than by ``nth``."""
    nth: frozenset[int] | None = None
    """Only the n-th matching requests (1-based)."""
    times: int | None = None
    times_per_key: int | None = None
    """Fire at most this often per object key (e.g. "every PUT fails twice, then succeeds")."""
    seconds: float = 0.0
    matched: int = 0
    fired: int = 0
    fired_per_key: dict[str, int] = field(default_factory=dict)

    def matches(
        self, op: str, key: str, query: dict[str, str], range_header: str | None = None
    ) -> bool:
        if op != self.op or (self.key is not None and not fnmatch.fnmatchcase(key, self.key)):
            return False
        if self.range_starts is not None and _range_start(range_header) not in self.range_starts:
            return False
        if self.part_numbers is not None and int(query.get("partNumber", 0)) not in (
            self.part_numbers
        ):
            return False
        self.matched += 1
        if self.nth is not None and self.matched not in self.nth:
            return False
        if self.times is not None and self.fired >= self.times:
            return False
        fired_here = self.fired_per_key.get(key, 0)
        if self.times_per_key is not None and fired_here >= self.times_per_key:
            return False
        self.fired += 1
        self.fired_per_key[key] = fired_here + 1
        return True


def _range_start(header: str | None) -> int | None:
    """The first byte of a ``Range: bytes=a-b`` header; None without one."""
    if not header or not header.startswith("bytes="):
        return None
    first = header.removeprefix("bytes=").split("-", 1)[0]
    return int(first) if first.isdigit() else None


@dataclass(frozen=True, kw_only=True)
class Seen:
    """One request as the proxy saw it."""

    op: str
    method: str
    bucket: str
    key: str
    query: dict[str, str]
    headers: dict[str, str]
    """Request headers, names lower-cased."""
    body_sha256: str
    body_len: int
    status: int | None
    """The status the client got; None when it got no response (stall, drop, reset)."""
    fault: Action | None
    at: float
    """When the proxy had read the request (UNIX seconds)."""

    @property
    def part_number(self) -> int | None:
        return int(self.query["partNumber"]) if "partNumber" in self.query else None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _ProxyServer

    def log_message(self, format: str, *args: Any) -> None:
        pass  # keep test output clean; the proxy's request log is the record

    def _handle(self) -> None:
        proxy = self.server.proxy
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query, keep_blank_values=True))
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            self.send_error(501, "the fault proxy needs Content-Length request bodies")
            return
        body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
        arrived = time.time()
        op, bucket, key = classify(self.command, url.path, query)
        fault = proxy.pick_fault(op, key, query, self.headers.get("Range"))
        recorded = False

        def record(status: int | None) -> None:
            # Logged before the client gets any byte of the response: a client that has read its
            # answer always finds the request in the log.
            nonlocal recorded
            if not recorded:
                recorded = True
                proxy.record(self._seen(op, bucket, key, query, body, status, fault, arrived))

        if fault is not None and fault.action in ("stall", "reset", "drop_response", "stall_body"):
            # Logged on arrival: the client may give up and retry before this handler ends.
            record(None)
        try:
            if fault is None:
                self._forward(url, body, truncate=False, before_send=record)
            elif fault.action == "error":
                record(fault.status)
                self._send_s3_error(fault.status, fault.code, url.path)
            elif fault.action == "stall":
                proxy.stop_event.wait(fault.seconds)
                self.close_connection = True
            elif fault.action == "drop_response":
                self._forward(url, body, truncate=False, send=False)
                self.close_connection = True
            elif fault.action == "reset":
                self.close_connection = True
            else:
                stall = fault.seconds if fault.action == "stall_body" else 0.0
                self._forward(url, body, truncate=True, stall=stall, before_send=record)
                self.close_connection = True
        finally:
            record(None)  # the upstream failed before any status: the client got none

    def _seen(
        self,
        op: str,
        bucket: str,
        key: str,
        query: dict[str, str],
        body: bytes,
        status: int | None,
        fault: Fault | None,
        arrived: float,
    ) -> Seen:
        return Seen(
            op=op,
            method=self.command,
            bucket=bucket,
            key=key,
            query=query,
            headers={k.lower(): v for k, v in self.headers.items()},
            body_sha256=hashlib.sha256(body).hexdigest(),
            body_len=len(body),
            status=status,
            fault=None if fault is None else fault.action,
            at=arrived,
        )

    def do_GET(self) -> None:
        self._handle()

    def do_PUT(self) -> None:
        self._handle()

    def do_POST(self) -> None:
        self._handle()

    def do_DELETE(self) -> None:
        self._handle()

    def do_HEAD(self) -> None:
        self._handle()

    def _send_s3_error(self, status: int, code: str, resource: str) -> None:
        message = _ERROR_MESSAGES.get(code, code)
        xml = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message>"
            f"<Resource>{resource}</Resource><RequestId>baton-fault</RequestId></Error>"
        ).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", "0" if self.command == "HEAD" else str(len(xml)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(xml)

    def _forward(
        self,
        url: urllib.parse.SplitResult,
        body: bytes,
        *,
        truncate: bool,
        send: bool = True,
        stall: float = 0.0,
        before_send: Callable[[int], None] | None = None,
    ) -> int:
        upstream = http.client.HTTPConnection("127.0.0.1", self.server.proxy.upstream_port)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
            target = url.path + (f"?{url.query}" if url.query else "")
            upstream.request(self.command, target, body=body or None, headers=headers)
            resp = upstream.getresponse()
            data = resp.read()
            if not send:
                return resp.status
            if before_send is not None:
                before_send(resp.status)
            self.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in {"connection", "keep-alive", "transfer-encoding", "date"}:
                    if k.lower() == "content-length":
                        continue
                    self.send_header(k, v)
            length = int(resp.getheader("Content-Length") or len(data))
            self.send_header("Content-Length", str(length))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data[: len(data) // 2] if truncate else data)
                if stall:
                    self.wfile.flush()
                    self.server.proxy.stop_event.wait(stall)
            return resp.status
        finally:
            upstream.close()


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    proxy: FaultProxy


class FaultProxy:
    """A threaded HTTP proxy on 127.0.0.1 that forwards to an S3 server and injects
    :class:`Fault` s."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.stop_event = threading.Event()
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self._seen: list[Seen] = []
        self._server = _ProxyServer(("127.0.0.1", 0), _Handler)
        self._server.proxy = self
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def add(self, *faults: Fault) -> None:
        with self._lock:
            self._faults.extend(faults)

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()
            self._seen.clear()

    def pick_fault(
        self, op: str, key: str, query: dict[str, str], range_header: str | None = None
    ) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.matches(op, key, query, range_header):
                    return fault
        return None

    def record(self, seen: Seen) -> None:
        with self._lock:
            self._seen.append(seen)

    def seen(self, op: str | None = None) -> list[Seen]:
        """The request log so far, optionally only one operation's requests."""
        with self._lock:
            return [s for s in self._seen if op is None or s.op == op]


@dataclass(kw_only=True)
class S3Bucket:
    """A fresh bucket on the session's S3 server, and how the code under test reaches it."""

    name: str
    endpoint: str
    """What ``AWS_ENDPOINT_URL_S3`` is set to (the server itself, or the fault proxy)."""
    client: Any
    """A boto3 client straight to the server, for setting up and checking (never faulted)."""
    server: ServerKind
    """Which S3 server holds the bucket ("moto" or "versitygw")."""
    proxy: FaultProxy | None = None

    def uri(self, prefix: str = "ckpt") -> str:
        return f"s3://{self.name}/{prefix}" if prefix else f"s3://{self.name}"

    def keys(self, prefix: str = "") -> list[str]:
        paginator = self.client.get_paginator("list_objects_v2")
        return sorted(
            obj["Key"]
            for page in paginator.paginate(Bucket=self.name, Prefix=prefix)
            for obj in page.get("Contents", [])
        )

    def multipart_uploads(self) -> list[dict[str, Any]]:
        resp = self.client.list_multipart_uploads(Bucket=self.name)
        return list(resp.get("Uploads", []))

    def get(self, key: str) -> bytes:
        return bytes(self.client.get_object(Bucket=self.name, Key=key)["Body"].read())


_bucket_ids = itertools.count()


class _Servers:
    """At most one server of each kind per test session, started on first use."""

    def __init__(self) -> None:
        self._servers: dict[ServerKind, S3Server] = {}

    def get(self, kind: ServerKind) -> S3Server:
        if kind not in self._servers:
            self._servers[kind] = start_server(kind)
        return self._servers[kind]

    def stop_all(self) -> None:
        while self._servers:
            self._servers.popitem()[1].stop()


@pytest.fixture(scope="session")
def _s3_servers() -> Iterator[_Servers]:
    servers = _Servers()
    try:
        yield servers
    finally:
        servers.stop_all()


@pytest.fixture(scope="session", params=SERVER_KINDS)
def s3_server(request: pytest.FixtureRequest, _s3_servers: _Servers) -> S3Server:
    """The S3 server under test: every test that uses it runs against moto and versitygw."""
    kind: ServerKind = request.param
    return _s3_servers.get(kind)


@pytest.fixture(scope="session")
def moto_s3(_s3_servers: _Servers) -> S3Server:
    """The session's moto server alone."""
    return _s3_servers.get("moto")


@pytest.fixture(scope="session")
def versitygw_s3(_s3_servers: _Servers) -> S3Server:
    """The session's versitygw server alone."""
    return _s3_servers.get("versitygw")


def client_env(endpoint: str) -> dict[str, str]:
    """The environment that points S3 clients (boto3, the SDK, s3torchconnector) at a local
    server ``endpoint`` with the fake credentials, and never at a developer's ~/.aws files
    (the fixtures below and the benchmarks in bench/ set it)."""
    return {
        "AWS_ENDPOINT_URL_S3": endpoint,
        "AWS_ACCESS_KEY_ID": FAKE_KEY_ID,
        "AWS_SECRET_ACCESS_KEY": FAKE_SECRET,
        "AWS_REGION": REGION,
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }


def _set_env(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> None:
    for var, value in client_env(endpoint).items():
        monkeypatch.setenv(var, value)
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(var, raising=False)


def _new_bucket(server: S3Server) -> tuple[str, Any]:
    name = f"baton-test-{os.getpid()}-{next(_bucket_ids)}"
    client = server.client()
    client.create_bucket(Bucket=name)
    return name, client


def _drop_bucket(client: Any, name: str) -> None:
    """Empty and delete a test's bucket: moto keeps every byte in memory for the session, and
    versitygw keeps them on disk."""
    for up in client.list_multipart_uploads(Bucket=name).get("Uploads", []):
        client.abort_multipart_upload(Bucket=name, Key=up["Key"], UploadId=up["UploadId"])
    paginator = client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=name):
        objects = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if objects:
            client.delete_objects(Bucket=name, Delete={"Objects": objects, "Quiet": True})
    client.delete_bucket(Bucket=name)


def _bucket_on(server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Bucket]:
    name, client = _new_bucket(server)
    _set_env(monkeypatch, server.endpoint)
    try:
        yield S3Bucket(name=name, endpoint=server.endpoint, client=client, server=server.kind)
    finally:
        _drop_bucket(client, name)


@pytest.fixture
def s3_bucket(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Bucket]:
    """A fresh bucket; the AWS env vars point boto3 straight at the server."""
    yield from _bucket_on(s3_server, monkeypatch)


@pytest.fixture
def versitygw_bucket(versitygw_s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Bucket]:
    """Like ``s3_bucket``, on versitygw only: for what only a real server checks."""
    yield from _bucket_on(versitygw_s3, monkeypatch)


@pytest.fixture
def s3_faults(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Bucket]:
    """A fresh bucket behind a :class:`FaultProxy`; the AWS env vars point at the proxy."""
    name, client = _new_bucket(s3_server)
    proxy = FaultProxy(s3_server.port)
    proxy.start()
    _set_env(monkeypatch, proxy.endpoint)
    try:
        yield S3Bucket(
            name=name, endpoint=proxy.endpoint, client=client, server=s3_server.kind, proxy=proxy
        )
    finally:
        proxy.stop()
        _drop_bucket(client, name)
