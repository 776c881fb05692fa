"""Cloud preemption notices, read from each cloud's instance metadata endpoint.

A notice here still causes a save when the operator is slow or down. Each poller turns a notice
into one checkpoint request carrying the notice's deadline:

* AWS (IMDSv2): ``PUT /latest/api/token`` for a session token, then
  ``GET /latest/meta-data/spot/instance-action``: 404 means no notice, 200 carries
  ``{"action": ..., "time": RFC3339}`` about two minutes ahead, 401 means the token expired.
* GCE: ``instance/preempted`` (``TRUE`` about 30 s before the stop) and
  ``instance/maintenance-event`` (``TERMINATE_ON_HOST_MAINTENANCE`` 60 s before), long-polled
  with ``wait_for_change`` and ``last_etag``, header ``Metadata-Flavor: Google``.
* Azure Scheduled Events: ``GET /metadata/scheduledevents`` with ``Metadata: true`` lists
  ``Preempt`` (and ``Terminate``) events with an RFC 1123 ``NotBefore`` at least 30 s ahead.
  Once the checkpoint has committed, ``POST {"StartRequests": [{"EventId": ...}]}`` tells Azure
  it may go ahead.

A poller never stops on an error: timeouts, 5xx, refused connections and expired tokens are
logged (never the token) and retried with exponential backoff.
"""

from __future__ import annotations

import abc
import asyncio
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from email.utils import parsedate_to_datetime
from typing import Any, ClassVar, Final

import aiohttp

from baton_sidecar._config import Cloud, SidecarConfig
from baton_sidecar._errors import SidecarError
from baton_sidecar._metrics import SidecarMetrics
from trainer_sdk.control import ControlError, Status, parse_rfc3339, utcnow
from trainer_sdk.wire import State

__all__ = [
    "AwsPoller",
    "AzurePoller",
    "GceWatch",
    "NoticeSink",
    "Poller",
    "detect_clouds",
    "make_pollers",
]

log = logging.getLogger("baton_sidecar.clouds")

NoticeSink = Callable[[str, datetime | None, str], Awaitable[str]]
"""``sink(source, deadline, reason)`` files a checkpoint request and returns its id."""

AWS_TOKEN_TTL_SECONDS: Final = 21600
"""IMDSv2 token lifetime asked for (the maximum, 6 h); it is renewed a minute before it ends."""
GCE_PREEMPT_GRACE: Final = timedelta(seconds=30)
"""GCE stops a preempted (spot) VM about 30 s after ``preempted`` turns ``TRUE``."""
GCE_MAINTENANCE_GRACE: Final = timedelta(seconds=60)
"""``maintenance-event`` changes 60 s before host maintenance begins."""
AZURE_API_VERSION: Final = "2020-07-01"
AZURE_NOTICE_TYPES: Final = frozenset({"Preempt", "Terminate"})
_BACKOFF_INITIAL: Final = 0.5


class PollError(SidecarError):
    """A metadata endpoint answered, but not as documented (retried like a network error)."""


class Poller(abc.ABC):
    """One loop against one metadata endpoint: poll, wait, and back off on errors."""

    source: ClassVar[str]

    def __init__(
        self,
        *,
        config: SidecarConfig,
        session: aiohttp.ClientSession,
        sink: NoticeSink,
        metrics: SidecarMetrics,
    ) -> None:
        self.config = config
        self.session = session
        self.sink = sink
        self.metrics = metrics
        self.failures = 0
        """Consecutive failed polls (0 after a success); tests and logs read it."""
        self.polls = 0
        """Successful polls so far."""

    @property
    def name(self) -> str:
        return self.source

    @abc.abstractmethod
    async def poll_once(self) -> float:
        """Poll once; return the seconds to wait before the next poll."""

    async def run(self) -> None:
        """Poll until cancelled; errors are logged, counted and retried with backoff."""
        log.info("%s notice poller started", self.name)
        while True:
            try:
                delay = await self.poll_once()
            except asyncio.CancelledError:
                raise
            except (aiohttp.ClientError, TimeoutError, PollError, ControlError, ValueError) as e:
                delay = self._failed(e, trace=False)
            except Exception as e:
                delay = self._failed(e, trace=True)
            else:
                if self.failures:
                    log.info("%s metadata endpoint answers again", self.name)
                self.failures = 0
                self.polls += 1
            await asyncio.sleep(delay)

    def _failed(self, error: BaseException, *, trace: bool) -> float:
        self.failures += 1
        self.metrics.poll_error(self.source)
        delay = min(self.config.backoff_max, _BACKOFF_INITIAL * 2.0 ** (self.failures - 1))
        delay *= random.uniform(0.75, 1.0)  # noqa: S311 - jitter, not cryptography
        log.warning(
            "%s metadata request failed (%d in a row), retrying in %.1fs: %s",
            self.name,
            self.failures,
            delay,
            _describe(error),
            exc_info=trace,
        )
        return delay

    def _timeout(self, seconds: float | None = None) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=seconds or self.config.request_timeout)


class AwsPoller(Poller):
    """EC2 spot interruption notices through IMDSv2."""

    source = "aws"
    TOKEN_HEADER: Final = "X-aws-ec2-metadata-token"  # noqa: S105 - a header name
    TTL_HEADER: Final = "X-aws-ec2-metadata-token-ttl-seconds"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._token: str | None = None
        self._token_expires = 0.0
        self._notified: set[tuple[str, str]] = set()
        self.token_fetches = 0

    async def _get_token(self) -> str:
        if self._token is not None and time.monotonic() < self._token_expires:
            return self._token
        url = f"{self.config.aws_endpoint}/latest/api/token"
        async with self.session.put(
            url, headers={self.TTL_HEADER: str(AWS_TOKEN_TTL_SECONDS)}, timeout=self._timeout()
        ) as resp:
            if resp.status != 200:
                raise PollError(f"IMDSv2 token request answered HTTP {resp.status}")
            token = (await resp.text()).strip()
        if not token:
            raise PollError("IMDSv2 token request answered an empty token")
        self._token = token
        self._token_expires = time.monotonic() + AWS_TOKEN_TTL_SECONDS - 60
        self.token_fetches += 1
        return token

    async def poll_once(self) -> float:
        url = f"{self.config.aws_endpoint}/latest/meta-data/spot/instance-action"
        for attempt in (1, 2):
            token = await self._get_token()
            async with self.session.get(
                url, headers={self.TOKEN_HEADER: token}, timeout=self._timeout()
            ) as resp:
                if resp.status == 401 and attempt == 1:
                    # The token expired or IMDS restarted: fetch a new one and ask again.
                    log.info("IMDSv2 token was rejected; fetching a new one")
                    self._token = None
                    continue
                if resp.status == 404:
                    return self.config.aws_interval
                if resp.status != 200:
                    raise PollError(f"spot/instance-action answered HTTP {resp.status}")
                body = await resp.text()
            await self._on_notice(body)
            return self.config.aws_interval
        raise PollError("IMDSv2 rejected a freshly fetched token (HTTP 401)")

    async def _on_notice(self, body: str) -> None:
        try:
            notice = json.loads(body)
            action, when = str(notice["action"]), str(notice["time"])
        except (ValueError, KeyError, TypeError) as e:
            raise PollError(
                f"spot/instance-action is not {{action, time}} JSON: {body[:200]!r}"
            ) from e
        if (action, when) in self._notified:
            return
        try:
            deadline: datetime | None = parse_rfc3339(when)
        except ControlError:
            # An undatable notice still means the instance is going: save at the next step,
            # without a deadline the SDK could judge too short.
            log.warning("EC2 spot notice time %r is not RFC 3339; asking for a save now", when)
            deadline = None
        await self.sink(self.source, deadline, f"EC2 spot interruption: {action} at {when}")
        self._notified.add((action, when))


class GceWatch(Poller):
    """One GCE metadata key, long-polled with ``wait_for_change``."""

    source = "gce"
    HEADERS: Final = {"Metadata-Flavor": "Google"}

    def __init__(self, *, key: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.key = key
        self._etag: str | None = None
        self._value: str | None = None

    @property
    def name(self) -> str:
        return f"gce {self.key}"

    async def poll_once(self) -> float:
        url = f"{self.config.gce_endpoint}/computeMetadata/v1/instance/{self.key}"
        params: dict[str, str] = {}
        timeout = self._timeout()
        if self._etag is not None:
            wait = self.config.gce_wait_seconds
            params = {"wait_for_change": "true", "timeout_sec": str(wait), "last_etag": self._etag}
            timeout = self._timeout(wait + self.config.request_timeout)
        started = time.monotonic()
        async with self.session.get(
            url, headers=self.HEADERS, params=params, timeout=timeout
        ) as resp:
            if resp.status != 200:
                raise PollError(f"instance/{self.key} answered HTTP {resp.status}")
            if resp.headers.get("Metadata-Flavor") != "Google":
                # Something else (a proxy, a captive portal) answered in its place.
                raise PollError(
                    f"instance/{self.key} answered without 'Metadata-Flavor: Google': "
                    "that is not the GCE metadata server; check BATON_GCE_METADATA_ENDPOINT"
                )
            value = (await resp.text()).strip()
            etag = resp.headers.get("ETag")
        changed = etag != self._etag
        if value != self._value:
            await self._on_value(value)
        # Remembered only once acted on, so that a failed request is made again.
        self._value, self._etag = value, etag
        # A long poll that returned at once without a change would spin: pace it.
        if not changed and time.monotonic() - started < 1.0:
            return 1.0
        return 0.0

    async def _on_value(self, value: str) -> None:
        if self.key == "preempted":
            if value.upper() == "TRUE":
                await self.sink(
                    self.source, utcnow() + GCE_PREEMPT_GRACE, "GCE preemption (preempted=TRUE)"
                )
        elif value.startswith("TERMINATE"):
            await self.sink(
                self.source,
                utcnow() + GCE_MAINTENANCE_GRACE,
                f"GCE host maintenance: maintenance-event={value}",
            )
        elif value not in ("", "NONE"):
            log.info("GCE maintenance-event is %s: no save needed (the VM keeps running)", value)


class AzurePoller(Poller):
    """Azure Scheduled Events: ``Preempt`` and ``Terminate``, acknowledged after the commit."""

    source = "azure"
    HEADERS: Final = {"Metadata": "true"}

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._vm_name: str | None = None
        self._vm_name_tried = False
        self._requested: dict[str, str] = {}
        """Event id -> checkpoint request id, for events not yet acknowledged."""
        self._ready: set[str] = set()
        """Events whose checkpoint committed, to acknowledge at the next poll."""
        self.acknowledged: set[str] = set()

    @property
    def _url(self) -> str:
        return f"{self.config.azure_endpoint}/metadata/scheduledevents"

    async def _learn_vm_name(self) -> None:
        # Events of an availability set or scale set reach every VM in it; only ours matter.
        # If the name cannot be read, every event counts: an extra save beats a missed one.
        self._vm_name_tried = True
        try:
            async with self.session.get(
                f"{self.config.azure_endpoint}/metadata/instance/compute/name",
                headers=self.HEADERS,
                params={"api-version": "2021-02-01", "format": "text"},
                timeout=self._timeout(),
            ) as resp:
                if resp.status == 200:
                    self._vm_name = (await resp.text()).strip() or None
        except (aiohttp.ClientError, TimeoutError) as e:
            log.info("Azure VM name unknown (%s): acting on every event", _describe(e))
        if self._vm_name:
            log.info("Azure VM name is %s", self._vm_name)

    async def poll_once(self) -> float:
        if not self._vm_name_tried:
            await self._learn_vm_name()
        async with self.session.get(
            self._url,
            headers=self.HEADERS,
            params={"api-version": AZURE_API_VERSION},
            timeout=self._timeout(),
        ) as resp:
            if resp.status != 200:
                raise PollError(f"scheduledevents answered HTTP {resp.status}")
            text = await resp.text()
        try:
            events = json.loads(text).get("Events") or []
        except (ValueError, AttributeError) as e:
            raise PollError(f"scheduledevents is not a JSON document: {text[:200]!r}") from e
        listed = set()
        for event in events:
            if not isinstance(event, dict):
                continue
            event_id = str(event.get("EventId", ""))
            listed.add(event_id)
            if not event_id or event_id in self._requested or event_id in self.acknowledged:
                continue
            if event.get("EventType") not in AZURE_NOTICE_TYPES:
                continue
            resources = event.get("Resources") or []
            if self._vm_name and resources and self._vm_name not in resources:
                continue
            deadline = _azure_not_before(event.get("NotBefore"))
            request_id = await self.sink(
                self.source,
                deadline,
                f"Azure {event.get('EventType')} event {event_id}",
            )
            self._requested[event_id] = request_id
        # Events that are gone need no acknowledgement any more.
        for event_id in list(self._requested):
            if event_id not in listed:
                self._requested.pop(event_id)
                self._ready.discard(event_id)
        if self._ready:
            await self._acknowledge(sorted(self._ready))
        return self.config.azure_interval

    def on_status(self, status: Status) -> None:
        """Status listener: a committed save makes the events it served ready to acknowledge."""
        if status.state is not State.COMMITTED or status.request_id is None:
            return
        for event_id, request_id in self._requested.items():
            if request_id == status.request_id:
                self._ready.add(event_id)

    async def _acknowledge(self, event_ids: list[str]) -> None:
        body = {"StartRequests": [{"EventId": event_id} for event_id in event_ids]}
        async with self.session.post(
            self._url,
            headers=self.HEADERS,
            params={"api-version": AZURE_API_VERSION},
            json=body,
            timeout=self._timeout(),
        ) as resp:
            if resp.status != 200:
                # Kept in _ready: the next poll tries again.
                raise PollError(f"acknowledging {event_ids} answered HTTP {resp.status}")
        for event_id in event_ids:
            self._ready.discard(event_id)
            self._requested.pop(event_id, None)
            self.acknowledged.add(event_id)
        log.info("acknowledged Azure events %s after the checkpoint committed", event_ids)


def _azure_not_before(value: object) -> datetime | None:
    """The event's ``NotBefore``, or ``None`` (save at the next step) when it has none.

    An event already ``Started`` has an empty ``NotBefore``: the VM is going now, and any
    deadline would be one the SDK must judge too short, so no deadline is given at all.
    """
    if isinstance(value, str) and value.strip():
        try:
            return parsedate_to_datetime(value)
        except (TypeError, ValueError):
            log.warning("Azure NotBefore %r is not an RFC 1123 date; asking for a save now", value)
    return None


def _describe(error: BaseException) -> str:
    if isinstance(error, TimeoutError):
        return "timed out"
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


async def _probe(
    cloud: Cloud, config: SidecarConfig, session: aiohttp.ClientSession
) -> Cloud | None:
    timeout = aiohttp.ClientTimeout(total=config.probe_timeout)
    try:
        if cloud is Cloud.AWS:
            async with session.put(
                f"{config.aws_endpoint}/latest/api/token",
                headers={AwsPoller.TTL_HEADER: "60"},
                timeout=timeout,
            ) as resp:
                return cloud if resp.status == 200 else None
        if cloud is Cloud.GCE:
            async with session.get(
                f"{config.gce_endpoint}/computeMetadata/v1/",
                headers=GceWatch.HEADERS,
                timeout=timeout,
            ) as resp:
                ok = resp.status == 200 and resp.headers.get("Metadata-Flavor") == "Google"
                return cloud if ok else None
        async with session.get(
            f"{config.azure_endpoint}/metadata/scheduledevents",
            headers=AzurePoller.HEADERS,
            params={"api-version": AZURE_API_VERSION},
            timeout=timeout,
        ) as resp:
            return cloud if resp.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


async def detect_clouds(config: SidecarConfig, session: aiohttp.ClientSession) -> list[Cloud]:
    """The clouds whose metadata endpoint answers as documented, probed at the same time."""
    found = await asyncio.gather(
        *(_probe(c, config, session) for c in (Cloud.AWS, Cloud.GCE, Cloud.AZURE))
    )
    return [c for c in found if c is not None]


def make_pollers(
    clouds: list[Cloud],
    *,
    config: SidecarConfig,
    session: aiohttp.ClientSession,
    sink: NoticeSink,
    metrics: SidecarMetrics,
) -> list[Poller]:
    """The pollers for ``clouds`` (GCE has two: ``preempted`` and ``maintenance-event``)."""
    kwargs: dict[str, Any] = {
        "config": config,
        "session": session,
        "sink": sink,
        "metrics": metrics,
    }
    pollers: list[Poller] = []
    for cloud in clouds:
        if cloud is Cloud.AWS:
            pollers.append(AwsPoller(**kwargs))
        elif cloud is Cloud.GCE:
            pollers.append(GceWatch(key="preempted", **kwargs))
            pollers.append(GceWatch(key="maintenance-event", **kwargs))
        elif cloud is Cloud.AZURE:
            pollers.append(AzurePoller(**kwargs))
    return pollers
