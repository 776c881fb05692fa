"""How :class:`~trainer_sdk.storage.s3.S3Storage` makes its boto3 clients.

Why apart from ``s3.py``: a client is made from :class:`~trainer_sdk.storage.s3.S3Config`
alone (botocore's retries, timeouts, connection pool and addressing style, the region from
``AWS_REGION``), once per storage and once more for a save with a deadline (botocore's own
retries off); nothing in it depends on what the storage does with the client. Making one is
kept cheap: a fresh session per client (sessions are not thread-safe, and each one resolves
the credentials chain anew), sharing one botocore data loader, so that the S3 model is parsed
once per process (a client costs ~80 ms instead of ~400 ms).
"""

from __future__ import annotations

import functools
import os
import threading
from typing import TYPE_CHECKING, Any

import boto3
import botocore.config
import botocore.loaders
import botocore.session

if TYPE_CHECKING:
    from trainer_sdk.storage.s3 import S3Config

__all__ = ["make_client"]

_LOADER_LOCK = threading.Lock()
"""Guards the creation of clients (and of the shared loader, on the first one)."""


@functools.cache
def _loader() -> Any:
    """The process's one botocore data loader: the S3 model is parsed once per process."""
    return botocore.loaders.create_loader()


def make_client(config: S3Config) -> Any:
    """A boto3 S3 client configured by ``config`` (credentials from the usual AWS chain)."""
    # botocore reads AWS_DEFAULT_REGION but not AWS_REGION, the name the contracts use.
    region = config.region or os.environ.get("AWS_REGION") or None
    # A fresh session per storage, sharing one loader (see the module's docstring).
    with _LOADER_LOCK:
        core = botocore.session.get_session()
        core.register_component("data_loader", _loader())
        # Unsigned bodies only when each one carries a CRC32 (S3Config.sign_payload); the
        # checksum setting as botocore resolves it (environment, then the config file).
        checksums = core.get_config_variable("request_checksum_calculation")
        sign = config.sign_payload or checksums == "when_required"
        bc = botocore.config.Config(
            retries={"mode": config.retry_mode, "total_max_attempts": config.max_attempts},
            connect_timeout=config.connect_timeout,
            read_timeout=config.read_timeout,
            max_pool_connections=config.max_pool_connections,
            s3={"addressing_style": config.addressing_style, "payload_signing_enabled": sign},
            user_agent_extra="baton-trainer-sdk",
        )
        session = boto3.session.Session(botocore_session=core)
        return session.client("s3", region_name=region, endpoint_url=config.endpoint_url, config=bc)
