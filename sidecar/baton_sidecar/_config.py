"""The sidecar's settings, from flags and the environment (flags win), checked once at start.

The names are contracts (``docs/contracts.md``): the operator sets the environment, tests set
the metadata endpoints to local fake servers.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import os
import urllib.parse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final, TypeVar

from baton_sidecar._errors import ConfigError

_N = TypeVar("_N", int, float)

__all__ = [
    "DEFAULT_AWS_ENDPOINT",
    "DEFAULT_AZURE_ENDPOINT",
    "DEFAULT_GCE_ENDPOINT",
    "DEFAULT_PORT",
    "DEFAULT_TOKEN_FILE",
    "Cloud",
    "Peer",
    "SidecarConfig",
    "parse_config",
    "parse_peers",
]

DEFAULT_PORT: Final = 9440
DEFAULT_TOKEN_FILE: Final = "/var/run/baton/token/token"  # noqa: S105 - a path
DEFAULT_CONTROL_DIR: Final = "/var/run/baton/control"
DEFAULT_AWS_ENDPOINT: Final = "http://169.254.169.254"
DEFAULT_GCE_ENDPOINT: Final = "http://metadata.google.internal"
DEFAULT_AZURE_ENDPOINT: Final = "http://169.254.169.254"


class Cloud(enum.StrEnum):
    """Which cloud's preemption notices to watch."""

    AWS = "aws"
    GCE = "gce"
    AZURE = "azure"
    AUTO = "auto"
    """Probe each metadata endpoint briefly at start and watch the one that answers."""
    NONE = "none"
    """Watch no cloud: notices come only from the operator."""


@dataclasses.dataclass(frozen=True, slots=True)
class Peer:
    """Another pod's sidecar that may hold replicas of this pod's memory snapshots."""

    address: str
    """``http://HOST:PORT`` of its API (the pod IP and the sidecar port)."""
    domain: str = ""
    """Its failure domain (a node, capacity pool or zone name); a peer of this pod's own
    domain is never a replica target (it would be lost with this pod). Empty: unknown."""


def parse_peers(raw: object) -> tuple[Peer, ...]:
    """Peers from their JSON form ``[{"address": "http://10.0.0.7:9440", "domain": "node-b"}]``
    (``BATON_REPLICATION_PEERS`` and ``PUT /v1/replication/peers``); ConfigError says why not."""
    if not isinstance(raw, list):
        raise ConfigError(
            'replication peers must be a JSON list like [{"address": "http://10.0.0.7:9440", '
            f'"domain": "node-b"}}], got {type(raw).__name__}'
        )
    peers = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or set(item) - {"address", "domain"}:
            raise ConfigError(
                f"peer {i}: {item!r} must be an object with 'address' and optional 'domain'"
            )
        address, domain = item.get("address"), item.get("domain", "")
        url = urllib.parse.urlsplit(address) if isinstance(address, str) else None
        if url is None or url.scheme != "http" or not url.hostname or url.path not in ("", "/"):
            raise ConfigError(
                f"peer {i}: address {address!r} must be http://HOST:PORT (the peer pod's IP "
                "and sidecar port)"
            )
        try:
            _ = url.port
        except ValueError as e:
            raise ConfigError(f"peer {i}: address {address!r}: {e}") from None
        if not isinstance(domain, str) or len(domain) > 253:
            raise ConfigError(f"peer {i}: domain must be a string of at most 253 characters")
        assert isinstance(address, str)
        peers.append(Peer(address.rstrip("/"), domain))
    return tuple(peers)


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class SidecarConfig:
    """Everything the sidecar needs; see ``docs/sidecar.md`` for the matching flags."""

    control_dir: Path
    """The directory shared with the trainer (``$BATON_CONTROL_DIR``)."""
    token_file: Path = Path(DEFAULT_TOKEN_FILE)
    """The bearer token (the per-job Secret). Re-read when it changes, since Secrets rotate."""
    host: str = "0.0.0.0"  # noqa: S104 - the pod IP is preferred; this is the documented fallback
    """Address to bind: the pod IP (``$POD_IP``), so the API is not served on other interfaces."""
    port: int = DEFAULT_PORT
    """TCP port of the API, ``/metrics`` and ``/healthz``."""
    cloud: Cloud = Cloud.AUTO
    """Which cloud notices to watch."""
    aws_endpoint: str = DEFAULT_AWS_ENDPOINT
    """AWS instance metadata service (IMDSv2) base URL."""
    gce_endpoint: str = DEFAULT_GCE_ENDPOINT
    """GCE metadata server base URL."""
    azure_endpoint: str = DEFAULT_AZURE_ENDPOINT
    """Azure instance metadata service base URL."""
    silent_after: float = 60.0
    """Seconds without a trainer heartbeat before the trainer counts as ``silent``. The SDK beats
    at step boundaries, so this must exceed the longest step."""
    absent_after: float = 300.0
    """Seconds without a heartbeat before the trainer counts as ``absent`` (gone)."""
    status_interval: float = 0.5
    """Seconds between looks at ``status.json`` (one ``stat`` each) for metrics and Azure acks."""
    aws_interval: float = 5.0
    """Seconds between AWS spot notice polls; AWS suggests every 5 s of its 120 s notice."""
    azure_interval: float = 1.0
    """Seconds between Azure Scheduled Events polls; a Preempt gives as little as 30 s."""
    gce_wait_seconds: int = 60
    """How long one GCE ``wait_for_change`` long poll may hang before it is renewed."""
    probe_timeout: float = 1.0
    """Seconds one metadata probe may take during auto-detection; link-local answers are fast."""
    request_timeout: float = 5.0
    """Seconds one metadata request (not a long poll) may take before it is retried."""
    backoff_max: float = 30.0
    """The longest wait between retries of a failing metadata endpoint."""
    linger_seconds: float = 5.0
    """After SIGTERM, how long to keep answering ``/v1/status`` while a checkpoint request's
    outcome has not been read yet (the trainer usually exits right after its notice save, and
    the kubelet stops the sidecar at once). 0 exits at once; a second SIGTERM always does."""
    termination_log: Path | None = None
    """Where to write the save's outcome when the sidecar stops (``$BATON_TERMINATION_LOG``:
    the container's ``terminationMessagePath``, which the kubelet copies into the pod's
    status): an operator that was not there to poll (a new leader after a fail-over, or one
    back from an API outage) reads a commit from the pod itself. None: not written."""
    max_body_bytes: int = 16 * 1024
    """Largest accepted request body; a checkpoint request is a few hundred bytes."""
    log_level: str = "INFO"
    """Python logging level name for the sidecar's own log."""
    fast_dir: Path | None = None
    """The pod's memory tier (``$BATON_FAST_DIR``, the trainer's ``fast_dir``). Set: the
    sidecar replicates its snapshots to peers and keeps peers' replicas under
    ``<fast_dir>/replicas/``. None: no replication."""
    peers: tuple[Peer, ...] = ()
    """Peer sidecars, in the order to try them as replica targets (the operator lists the
    others in ring order starting after this pod, so that targets spread evenly)."""
    replicas: int = 1
    """How many peers of other failure domains receive each snapshot. 1 survives the loss
    of any one node; each replica costs a peer the snapshot's size in memory (twice while the
    next one arrives)."""
    failure_domain: str = ""
    """This pod's failure domain (node, pool or zone); peers of the same domain are skipped."""
    replication_chunk_bytes: int = 1 << 20
    """Bytes received and hashed, or read in a fetch, at a time: the memory one transfer holds
    (a push goes out with sendfile(2), no buffer of its own)."""
    replication_timeout: float = 60.0
    """Seconds a peer may stay silent during one replication request before it fails."""
    replication_poll_interval: float = 1.0
    """Seconds between looks (one ``stat`` per op) for the SDK's replication requests when no
    bell rings: the SDK rings ``replication.bell`` after each request, so this bounds only a
    request whose bell was lost (or a control directory that cannot hold a FIFO)."""

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"port {self.port} is out of range: use 1-65535 (default 9440)")
        if self.silent_after <= 0 or self.absent_after < self.silent_after:
            raise ConfigError(
                f"silent_after={self.silent_after} and absent_after={self.absent_after}: both "
                "must be positive and absent_after must be at least silent_after"
            )
        for name in (
            "status_interval",
            "aws_interval",
            "azure_interval",
            "probe_timeout",
            "request_timeout",
            "backoff_max",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.linger_seconds < 0:
            raise ConfigError(f"linger_seconds must be 0 or more, got {self.linger_seconds}")
        if self.gce_wait_seconds < 1:
            raise ConfigError(f"gce_wait_seconds must be at least 1, got {self.gce_wait_seconds}")
        if self.replicas < 1:
            raise ConfigError(
                f"BATON_REPLICATION_REPLICAS={self.replicas}: use 1 or more (or leave "
                "BATON_FAST_DIR unset to turn replication off)"
            )
        if self.replication_chunk_bytes < 4096:
            raise ConfigError(
                f"replication_chunk_bytes={self.replication_chunk_bytes}: use at least 4096"
            )
        if self.replication_timeout <= 0 or self.replication_poll_interval <= 0:
            raise ConfigError("replication_timeout and replication_poll_interval must be positive")


def parse_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> SidecarConfig:
    """Build the config from command-line flags, falling back to the environment."""
    env = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(
        prog="baton-sidecar",
        description="Baton's in-pod agent: checkpoint API, cloud notice pollers, metrics.",
    )
    parser.add_argument("--host", default=env.get("POD_IP") or "0.0.0.0")  # noqa: S104
    parser.add_argument(
        "--port", type=int, default=_env_number(env, "BATON_SIDECAR_PORT", DEFAULT_PORT)
    )
    parser.add_argument(
        "--token-file", default=env.get("BATON_SIDECAR_TOKEN_FILE", DEFAULT_TOKEN_FILE)
    )
    parser.add_argument("--control-dir", default=env.get("BATON_CONTROL_DIR", DEFAULT_CONTROL_DIR))
    parser.add_argument(
        "--cloud",
        choices=[c.value for c in Cloud],
        default=env.get("BATON_CLOUD", Cloud.AUTO.value),
    )
    parser.add_argument(
        "--silent-after",
        type=float,
        default=_env_number(env, "BATON_SIDECAR_SILENT_AFTER", 60.0),
        help="seconds without a trainer heartbeat before it counts as silent",
    )
    parser.add_argument(
        "--absent-after",
        type=float,
        default=_env_number(env, "BATON_SIDECAR_ABSENT_AFTER", 300.0),
        help="seconds without a trainer heartbeat before it counts as absent",
    )
    parser.add_argument(
        "--log-level", default=env.get("BATON_SIDECAR_LOG_LEVEL", "INFO"), help="logging level"
    )
    args = parser.parse_args(argv)
    try:
        cloud = Cloud(args.cloud)
    except ValueError as e:
        raise ConfigError(
            f"BATON_CLOUD={args.cloud!r} is unknown: use one of {', '.join(c.value for c in Cloud)}"
        ) from e
    return SidecarConfig(
        host=args.host,
        port=args.port,
        token_file=Path(args.token_file),
        control_dir=Path(args.control_dir),
        cloud=cloud,
        aws_endpoint=env.get("BATON_AWS_IMDS_ENDPOINT", DEFAULT_AWS_ENDPOINT).rstrip("/"),
        gce_endpoint=env.get("BATON_GCE_METADATA_ENDPOINT", DEFAULT_GCE_ENDPOINT).rstrip("/"),
        azure_endpoint=env.get("BATON_AZURE_IMDS_ENDPOINT", DEFAULT_AZURE_ENDPOINT).rstrip("/"),
        silent_after=args.silent_after,
        absent_after=args.absent_after,
        log_level=str(args.log_level).upper(),
        aws_interval=_env_number(env, "BATON_SIDECAR_AWS_INTERVAL", 5.0),
        azure_interval=_env_number(env, "BATON_SIDECAR_AZURE_INTERVAL", 1.0),
        gce_wait_seconds=int(_env_number(env, "BATON_SIDECAR_GCE_WAIT", 60.0)),
        request_timeout=_env_number(env, "BATON_SIDECAR_METADATA_TIMEOUT", 5.0),
        status_interval=_env_number(env, "BATON_SIDECAR_STATUS_INTERVAL", 0.5),
        backoff_max=_env_number(env, "BATON_SIDECAR_BACKOFF_MAX", 30.0),
        linger_seconds=_env_number(env, "BATON_SIDECAR_LINGER", 5.0),
        fast_dir=Path(env["BATON_FAST_DIR"]) if env.get("BATON_FAST_DIR") else None,
        termination_log=(
            Path(env["BATON_TERMINATION_LOG"]) if env.get("BATON_TERMINATION_LOG") else None
        ),
        peers=_env_peers(env),
        replicas=_env_number(env, "BATON_REPLICATION_REPLICAS", 1),
        failure_domain=env.get("BATON_FAILURE_DOMAIN", ""),
        replication_chunk_bytes=_env_number(env, "BATON_REPLICATION_CHUNK_BYTES", 1 << 20),
        replication_timeout=_env_number(env, "BATON_REPLICATION_TIMEOUT", 60.0),
        replication_poll_interval=_env_number(env, "BATON_REPLICATION_POLL_INTERVAL", 1.0),
    )


def _env_peers(env: Mapping[str, str]) -> tuple[Peer, ...]:
    raw = env.get("BATON_REPLICATION_PEERS", "")
    if not raw.strip():
        return ()
    try:
        value = json.loads(raw)
    except ValueError as e:
        raise ConfigError(
            f"BATON_REPLICATION_PEERS is not JSON ({e}): set it to a list like "
            '[{"address": "http://10.0.0.7:9440", "domain": "node-b"}]'
        ) from None
    return parse_peers(value)


def _env_number(env: Mapping[str, str], name: str, default: _N) -> _N:
    """``env[name]`` parsed as the type of ``default`` (int or float); unset or empty: default."""
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return type(default)(raw)
    except ValueError as e:
        what = (
            "an integer: set it to a number"
            if isinstance(default, int)
            else "a number: set it to seconds"
        )
        raise ConfigError(f"{name}={raw!r} is not {what} like {default}") from e
