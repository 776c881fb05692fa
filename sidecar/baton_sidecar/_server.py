"""The sidecar's HTTP API: what the operator calls, with bearer-token auth and strict input.

``POST /v1/checkpoint``, ``GET /v1/status`` and the replication endpoints that peers and the
operator call (``/v1/replicas/...``, ``/v1/snapshots/...``, ``PUT /v1/replication/peers``)
need ``Authorization: Bearer <token>``; ``/healthz`` and ``/metrics`` are open (probes and
Prometheus carry no token). Every error is a JSON object ``{"error": ...}`` that says what was
wrong and how to fix it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import re
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Final

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from baton_sidecar._config import parse_peers
from baton_sidecar._core import Sidecar
from baton_sidecar._errors import ConfigError
from baton_sidecar._replica_store import MAX_MANIFEST_BYTES, ReplicationError
from baton_sidecar._replication import Replicator
from trainer_sdk.control import ControlError, parse_rfc3339, utcnow
from trainer_sdk.format.layout import MANIFEST, Hasher, new_hasher

__all__ = ["TokenFile", "create_app"]

log = logging.getLogger("baton_sidecar.server")

CHECKPOINT_FIELDS: Final = frozenset({"deadline", "reason"})
MAX_REASON_CHARS: Final = 1024
MAX_DEADLINE_AHEAD: Final = timedelta(days=7)
"""A deadline further ahead is almost surely a unit mistake (milliseconds read as seconds)."""
_OPEN_PATHS: Final = frozenset({"/healthz", "/metrics"})

SIDECAR_KEY: Final = web.AppKey("sidecar", Sidecar)
REPLICATOR_KEY: Final = web.AppKey("replicator", Replicator)
MAX_PEERS_BODY: Final = 1 << 20
"""A peer list of a thousand pods is about 80 KiB."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class TokenFile:
    """The bearer token, re-read whenever its file changes (a rotated Secret swaps the file)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._ident: tuple[int, int, int] | None = None
        self._token = b""
        self._problem: str | None = None
        self._refresh(startup=True)

    def _refresh(self, *, startup: bool = False) -> None:
        try:
            st = os.stat(self.path)  # follows the Secret volume's ..data symlink
            ident = (st.st_ino, st.st_mtime_ns, st.st_size)
            if ident == self._ident:
                return
            token = self.path.read_bytes().strip()
        except OSError as e:
            if startup:
                raise ConfigError(
                    f"cannot read the token file {self.path}: {e.strerror}. Mount the job's "
                    "Secret there or pass --token-file / BATON_SIDECAR_TOKEN_FILE"
                ) from e
            if self._problem != str(e):  # once per problem, not once per request
                self._problem = str(e)
                log.warning(
                    "cannot re-read the token file %s (%s); keeping the last token", self.path, e
                )
            return
        if not token:
            if startup:
                raise ConfigError(
                    f"the token file {self.path} is empty: the Secret's 'token' key needs a value"
                )
            log.warning("the token file %s is empty now; keeping the last token", self.path)
            self._ident = ident  # warned once; a rewrite changes the identity again
            return
        if self._ident is not None:
            log.info("the token file %s changed; using the new token", self.path)
        self._ident, self._token, self._problem = ident, token, None

    def current(self) -> str:
        """The token itself, for this sidecar's own requests to its peers (the pods of a job
        share the job's Secret). Never log it."""
        self._refresh()
        return self._token.decode()

    def accepts(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header carries the current token (constant time)."""
        self._refresh()
        if not authorization:
            return False
        scheme, _, presented = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(presented.strip().encode(), self._token)


TOKEN_KEY: Final = web.AppKey("token", TokenFile)


def _error(status: int, message: str, **headers: str) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers or None)


@web.middleware
async def _errors_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own errors (404, 405, 413) as JSON that says what to do."""
    try:
        return await handler(request)
    except web.HTTPRequestEntityTooLarge as e:
        return _error(413, f"request body too large: {e.text}; a checkpoint request is tiny")
    except web.HTTPMethodNotAllowed as e:
        return _error(
            405,
            f"{request.method} is not allowed on {request.path}: use "
            f"{', '.join(sorted(e.allowed_methods))}",
            Allow=",".join(sorted(e.allowed_methods)),
        )
    except web.HTTPNotFound:
        return _error(
            404,
            f"no endpoint {request.path}: use POST /v1/checkpoint, GET /v1/status, "
            "GET /metrics, GET /healthz, or the replication endpoints (docs/sidecar.md)",
        )
    except web.HTTPException:
        raise
    except Exception as e:
        log.exception("%s %s failed", request.method, request.path)
        return _error(500, f"internal error ({type(e).__name__}); see the sidecar's log")


@web.middleware
async def _auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.path in _OPEN_PATHS:
        return await handler(request)
    if not request.app[TOKEN_KEY].accepts(request.headers.get("Authorization")):
        # The presented value is never logged: it may be a near-miss of the real token.
        log.warning(
            "refused %s %s from %s: bad or missing token",
            request.method,
            request.path,
            request.remote,
        )
        return _error(
            401,
            "missing or wrong bearer token: send 'Authorization: Bearer <token>' with the value "
            "of the job's sidecar-token Secret",
            **{"WWW-Authenticate": 'Bearer realm="baton-sidecar"'},
        )
    return await handler(request)


async def _post_checkpoint(request: web.Request) -> web.Response:
    content_type = request.headers.get("Content-Type", "application/json")
    if content_type.split(";")[0].strip().lower() != "application/json":
        return _error(415, f"Content-Type {content_type!r}: send the body as application/json")
    raw = await request.read()  # raises 413 beyond client_max_size
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        return _error(
            400, f'body is not valid JSON ({e}): send {{"deadline": RFC3339, "reason": str}}'
        )
    problem = _check_body(body)
    if problem is not None:
        return _error(400, problem)
    try:
        deadline = parse_rfc3339(body["deadline"])
    except ControlError as e:
        return _error(400, f"'deadline': {e}")
    now = utcnow()
    if deadline <= now:
        return _error(
            422,
            f"deadline {body['deadline']} is {(now - deadline).total_seconds():.1f}s in the past "
            f"(the sidecar's clock says {now.isoformat()}): send a future time",
        )
    if deadline - now > MAX_DEADLINE_AHEAD:
        return _error(
            422,
            f"deadline {body['deadline']} is more than {MAX_DEADLINE_AHEAD.days} days ahead: "
            "check the units; a notice deadline is seconds to minutes away",
        )
    sidecar = request.app[SIDECAR_KEY]
    try:
        req, merged = await sidecar.request_checkpoint(
            deadline=deadline, reason=body.get("reason", ""), source="operator"
        )
    except OSError as e:
        log.error("cannot write the checkpoint request to %s: %s", sidecar.channel.directory, e)
        return _error(
            503,
            f"cannot write to the control directory {sidecar.channel.directory}: {e.strerror}; "
            "check the baton-control emptyDir mount",
        )
    return web.json_response(
        {
            "id": req.id,
            "merged": merged,
            "deadline": req.to_json()["deadline"],
        },
        status=202,
    )


_REQUEST_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


async def _post_settled(request: web.Request) -> web.Response:
    """The operator decided on a request from another rank's outcome: this sidecar need not
    wait at shutdown for its own to be read (:meth:`Sidecar.settle`)."""
    request_id = request.match_info["id"]
    if not _REQUEST_ID.fullmatch(request_id):
        return _error(
            400,
            f"{request_id[:80]!r} is not a request id: use the 'id' that POST /v1/checkpoint "
            "answered (letters, digits, '_' and '-', at most 64)",
        )
    request.app[SIDECAR_KEY].settle(request_id)
    log.info("checkpoint request %s settled by the operator", request_id)
    return web.json_response({"id": request_id, "settled": True})


def _check_body(body: Any) -> str | None:
    if not isinstance(body, dict):
        return (
            'body must be a JSON object like {"deadline": RFC3339, "reason": str}, '
            f"got {type(body).__name__}"
        )
    unknown = sorted(set(body) - CHECKPOINT_FIELDS)
    if unknown:
        return (
            f"unknown field(s) {', '.join(map(repr, unknown))}: "
            "the allowed fields are 'deadline' and 'reason'"
        )
    if "deadline" not in body:
        return (
            "'deadline' is missing: give the time the checkpoint must be committed by, as RFC 3339"
        )
    if not isinstance(body["deadline"], str):
        return (
            "'deadline' must be an RFC 3339 string like '2026-01-02T03:04:05Z', "
            f"got {body['deadline']!r}"
        )
    reason = body.get("reason", "")
    if not isinstance(reason, str):
        return f"'reason' must be a string, got {type(reason).__name__}"
    if len(reason) > MAX_REASON_CHARS:
        return f"'reason' is {len(reason)} characters: keep it under {MAX_REASON_CHARS}"
    return None


async def _get_status(request: web.Request) -> web.Response:
    sidecar = request.app[SIDECAR_KEY]
    try:
        return web.json_response(sidecar.status_view())
    except ControlError as e:
        return _error(500, f"the trainer's status cannot be read: {e}")


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[SIDECAR_KEY].metrics.exposition()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _healthz(request: web.Request) -> web.Response:
    # Healthy means the event loop answers. The trainer's state is not the sidecar's health:
    # restarting the sidecar would not bring a stopped trainer back.
    return web.json_response({"ok": True})


# ---- replication (docs/sidecar.md, "Replication") ------------------------------------------


def _replicator(request: web.Request) -> Replicator:
    replicator = request.app.get(REPLICATOR_KEY)
    if replicator is None:
        raise ReplicationError(
            404,
            "this sidecar has no memory tier: set BATON_FAST_DIR (the trainer's fast_dir) to "
            "replicate snapshots and hold peers' replicas",
        )
    return replicator


def _step(request: web.Request) -> int:
    raw = request.match_info["step"]
    if not raw.isdigit() or len(raw) > 12:
        raise ReplicationError(400, f"step {raw!r} must be a whole number below 10**12")
    return int(raw)


async def _read_bounded(request: web.Request, limit: int) -> bytes:
    body = bytearray()
    async for data in request.content.iter_chunked(64 * 1024):
        body += data
        if len(body) > limit:
            raise ReplicationError(413, f"body over {limit} bytes")
    return bytes(body)


def _write_hashed(out: Any, hasher: Hasher, data: bytes) -> None:
    hasher.update(data)
    out.write(data)


async def _put_replica(request: web.Request) -> web.Response:
    """A peer's upload of one file of a replica (verified as it arrives), or its manifest
    (last: the replica is complete once it is written)."""
    try:
        replicator = _replicator(request)
        source, name, step = (
            request.match_info["source"],
            request.match_info["name"],
            _step(request),
        )
        if name == MANIFEST:
            data = await _read_bounded(request, MAX_MANIFEST_BYTES)
            await asyncio.to_thread(replicator.store.commit_replica, source, step, data)
            return web.json_response({"complete": True, "source": source, "step": step})
        expected = request.content_length
        part, algorithm, want = await asyncio.to_thread(
            replicator.store.begin_file,
            source,
            step,
            name,
            size=expected,
            digest=request.headers.get("X-Baton-Digest"),
        )
        assert expected is not None
        chunk = replicator.config.replication_chunk_bytes
        hasher = new_hasher(algorithm)
        size = 0
        try:
            # A spare file begin_file took is overwritten in place (no new pages), then cut to
            # what arrived.
            with open(part, "r+b" if part.exists() else "wb") as out:
                # Each piece as it arrives (at most `chunk` bytes), hashed and written on the
                # event loop: into memory (tmpfs) that is a fraction of a millisecond per MiB,
                # cheaper than a hand-off to a thread and back.
                try:
                    async for data in request.content.iter_chunked(chunk):
                        size += len(data)
                        if size > expected:
                            break
                        _write_hashed(out, hasher, data)
                except ConnectionError as e:
                    # The sender went away mid-body (killed, its node gone): nothing is kept,
                    # and it counts as a failed receive like a short or corrupt body does.
                    why = f"the sender went away after {size} of {expected} bytes ({e})"
                    raise replicator.store.refused(source, step, name, why) from e
                out.truncate()
            replicator.store.end_file(
                source,
                step,
                name,
                part,
                algorithm=algorithm,
                want=want,
                got=hasher.hexdigest(),
                size=size,
                expected=expected,
            )
        finally:
            part.unlink(missing_ok=True)  # renamed away when it was kept
        return web.json_response({"stored": name, "bytes": size})
    except ReplicationError as e:
        if e.status == 422:
            request.app[SIDECAR_KEY].metrics.replication_failures.labels(op="receive").inc()
        return _error(e.status, str(e))


async def _get_replicas(request: web.Request) -> web.Response:
    try:
        replicator = _replicator(request)
    except ReplicationError as e:
        return _error(e.status, str(e))
    return web.json_response({"holdings": await asyncio.to_thread(replicator.store.catalog)})


async def _get_replica_file(request: web.Request) -> web.StreamResponse:
    try:
        replicator = _replicator(request)
        path = replicator.store.file_for_download(
            request.match_info.get("source"), _step(request), request.match_info["name"]
        )
    except ReplicationError as e:
        return _error(e.status, str(e))
    except ValueError as e:
        return _error(400, str(e))
    return web.FileResponse(path, chunk_size=replicator.config.replication_chunk_bytes)


async def _put_peers(request: web.Request) -> web.Response:
    try:
        replicator = _replicator(request)
        raw = await _read_bounded(request, MAX_PEERS_BODY)
    except ReplicationError as e:
        return _error(e.status, str(e))
    try:
        body = json.loads(raw)
    except ValueError as e:
        return _error(400, f'body is not JSON ({e}): send {{"peers": [...], "replicas": n}}')
    if not isinstance(body, dict) or set(body) - {"peers", "replicas"} or "peers" not in body:
        return _error(
            400,
            'send {"peers": [{"address": "http://HOST:PORT", "domain": str}], "replicas": n} '
            "(replicas optional)",
        )
    replicas = body.get("replicas")
    if replicas is not None and (not isinstance(replicas, int) or replicas < 1):
        return _error(400, f"'replicas' must be an integer of 1 or more, got {replicas!r}")
    try:
        peers = parse_peers(body["peers"])
    except ConfigError as e:
        return _error(400, str(e))
    replicator.set_peers(list(peers), replicas)
    return web.json_response(replicator.status())


def create_app(
    sidecar: Sidecar, token: TokenFile, replicator: Replicator | None = None
) -> web.Application:
    """The aiohttp application (no background tasks; see :func:`baton_sidecar.serve`)."""
    app = web.Application(
        middlewares=[_errors_as_json, _auth], client_max_size=sidecar.config.max_body_bytes
    )
    app[SIDECAR_KEY] = sidecar
    app[TOKEN_KEY] = token
    if replicator is not None:
        app[REPLICATOR_KEY] = replicator
    app.router.add_get("/v1/replicas", _get_replicas)
    app.router.add_put("/v1/replicas/{source}/{step}/{name}", _put_replica)
    app.router.add_get("/v1/replicas/{source}/{step}/{name}", _get_replica_file)
    app.router.add_get("/v1/snapshots/{step}/{name}", _get_replica_file)
    app.router.add_put("/v1/replication/peers", _put_peers)
    app.router.add_post("/v1/checkpoint", _post_checkpoint)
    app.router.add_post("/v1/checkpoint/{id}/settled", _post_settled)
    app.router.add_get("/v1/status", _get_status)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/healthz", _healthz)
    return app
