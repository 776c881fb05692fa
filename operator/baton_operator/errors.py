"""The operator's one error base class, and the retryable/permanent split kopf understands."""

from __future__ import annotations

__all__ = ["BatonOperatorError", "KubeError", "SidecarError"]


class BatonOperatorError(Exception):
    """Base class of every error raised by ``baton_operator``."""


class KubeError(BatonOperatorError):
    """A Kubernetes API call failed; ``status`` is the HTTP status (0 when none came back)."""

    def __init__(self, message: str, *, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class SidecarError(BatonOperatorError):
    """A sidecar could not be reached or answered something that is not the contract."""
