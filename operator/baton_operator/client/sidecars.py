"""The HTTP client of the sidecars' control API: the only code that talks to a sidecar.

Each pod runs ``baton-sidecar`` on ``http://<podIP>:9440`` with a per-job bearer token
(docs/contracts.md). The token goes in a header and nowhere else: errors quote the pod and
the HTTP status, never the request.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import Any, Final

import aiohttp

from baton_operator.pure.errors import SidecarUnreachableError
from baton_operator.pure.lifecycle import clamp_deadline
from baton_operator.pure.reports import SidecarStatus

__all__ = ["MIN_LEAD", "SidecarClient", "SidecarStatus"]

MIN_LEAD: Final = timedelta(seconds=2)
"""The least time left that a checkpoint request carries. A notice can reach the operator
after its own deadline (the operator was slow or restarting); the sidecar refuses deadlines in
the past, so such a request would save nothing. With a short lead the SDK still decides
honestly, from its save-time estimate, whether to save or to report ``skipped``."""


class SidecarClient:
    """An aiohttp session for the sidecars; use as ``async with SidecarClient(...) as c``."""

    def __init__(self, *, port: int, timeout_seconds: float) -> None:
        self._port = port
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> SidecarClient:
        self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the session (idempotent)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _url(self, ip: str, path: str) -> str:
        host = f"[{ip}]" if ":" in ip else ip
        return f"http://{host}:{self._port}{path}"

    async def _call(
        self, method: str, ip: str, path: str, token: str, body: dict[str, Any] | None
    ) -> dict[str, Any]:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        headers = {"Authorization": f"Bearer {token}"}
        try:
            async with self._session.request(
                method, self._url(ip, path), json=body, headers=headers
            ) as resp:
                if resp.status >= 300:
                    text = (await resp.text())[:200]
                    raise SidecarUnreachableError(
                        f"sidecar at {ip} answered {method} {path} with HTTP {resp.status}: {text}"
                    )
                data = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            raise SidecarUnreachableError(
                f"sidecar at {ip} did not answer {method} {path} ({type(e).__name__}): is the "
                "pod running and its baton-sidecar container ready?"
            ) from None
        if not isinstance(data, dict):
            raise SidecarUnreachableError(f"sidecar at {ip} answered {path} with non-object JSON")
        return data

    async def request_checkpoint(
        self, ip: str, token: str, *, deadline: datetime, reason: str
    ) -> str:
        """``POST /v1/checkpoint``; returns the request id (merged requests share one).

        A deadline closer than :data:`MIN_LEAD` (or already past) is moved to now + MIN_LEAD.
        """
        deadline = clamp_deadline(deadline, now=datetime.now(tz=UTC), least=MIN_LEAD)
        data = await self._call(
            "POST",
            ip,
            "/v1/checkpoint",
            token,
            {"deadline": deadline.isoformat().replace("+00:00", "Z"), "reason": reason},
        )
        return str(data.get("id", ""))

    async def settle(self, ip: str, token: str, request_id: str) -> None:
        """``POST /v1/checkpoint/{id}/settled``: the operator has decided on that request
        (another rank's ``committed`` proved the checkpoint), so the sidecar need not stay
        up after its trainer for this rank's outcome to be read."""
        await self._call("POST", ip, f"/v1/checkpoint/{request_id}/settled", token, None)

    async def status(self, ip: str, token: str) -> SidecarStatus:
        """``GET /v1/status``."""
        return SidecarStatus.from_json(await self._call("GET", ip, "/v1/status", token, None))

    async def set_peers(self, ip: str, token: str, body: dict[str, Any]) -> None:
        """``PUT /v1/replication/peers`` (``{"peers": [...], "replicas": n}``): the memory
        tier's replica targets of that pod's sidecar."""
        await self._call("PUT", ip, "/v1/replication/peers", token, body)
