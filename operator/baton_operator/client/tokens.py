"""The sidecar tokens: derived from one key, so the operator never reads a job's Secret.

Each job's sidecars require a bearer token, which the operator puts in a per-job Secret
(``<job>-sidecar-token``, mounted into the pods) and must know again after a restart. Reading
it back would need ``get`` on Secrets in every namespace, and RBAC cannot limit ``get`` to
"Secrets this operator created" (``resourceNames`` takes fixed names, not patterns or labels):
the operator could then read any Secret anywhere. Instead each token is an HMAC of the job's
identity under one key, and the key lives in a single Secret in the operator's own namespace
(settings.KEY_SECRET_NAME), the only Secret the operator can ``get``. Every replica and every
restart derives the same token; a re-created job (new uid) gets a new one.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from typing import Any, Final

from baton_operator.pure.errors import BatonOperatorError
from baton_operator.pure.model import JobSpec

from .kube import Kube

__all__ = [
    "KEY_FIELD",
    "TokenKeyMissingError",
    "derive",
    "key_secret_manifest",
    "load_or_create_key",
]

KEY_FIELD: Final = "key"
_KEY_BYTES: Final = 32


class TokenKeyMissingError(BatonOperatorError):
    """The key Secret exists but holds no usable key."""


def derive(key: bytes, spec: JobSpec) -> str:
    """The sidecar token of one job: HMAC-SHA256 of namespace, name and uid under ``key``."""
    message = f"baton-sidecar-token\0{spec.namespace}\0{spec.name}\0{spec.uid}".encode()
    digest = hmac.new(key, message, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def key_secret_manifest(namespace: str, name: str, key: bytes) -> dict[str, Any]:
    """The operator's token-key Secret."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {
                "app.kubernetes.io/name": "baton-operator",
                "app.kubernetes.io/part-of": "baton",
            },
        },
        "stringData": {KEY_FIELD: base64.b64encode(key).decode()},
    }


async def load_or_create_key(kube: Kube, namespace: str, name: str) -> bytes:
    """The key from Secret ``namespace/name``, created (randomly) when it does not exist.

    Two replicas starting together both try to create it; the loser's create is a no-op
    (AlreadyExists) and both then read the winner's key.
    """
    fresh = secrets.token_bytes(_KEY_BYTES)
    await kube.create_secret(namespace, key_secret_manifest(namespace, name, fresh))
    encoded = await kube.read_secret_key(namespace, name, KEY_FIELD)
    if not encoded:
        raise TokenKeyMissingError(
            f"Secret {namespace}/{name} has no {KEY_FIELD!r}: delete it and restart the "
            "operator (running jobs' sidecars then refuse the operator until they restart)"
        )
    key = base64.b64decode(encoded)
    if len(key) < 16:
        raise TokenKeyMissingError(
            f"Secret {namespace}/{name}: the key is {len(key)} bytes, under 16: delete the "
            "Secret and restart the operator"
        )
    return key
