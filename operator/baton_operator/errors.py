"""The operator's one error base class, and the retryable/permanent split kopf understands."""

from __future__ import annotations

__all__ = ["BatonOperatorError", "KubeError", "SidecarError"]


class BatonOperatorError(Exception):
    """Base class of every error raised by ``baton_operator``."""


class KubeError(BatonOperatorError):
    """A Kubernetes API call failed; ``status`` is the HTTP status (0 when none came back).

    ``fields`` are the object fields the API server named in its answer (``details.causes``).
    """

    def __init__(self, message: str, *, status: int = 0, fields: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.fields = fields

    @property
    def permanent(self) -> bool:
        """Whether sending the same object again can never succeed: the API server found it
        invalid (400, 422) or an admission policy forbids it (403 from Pod Security). Quotas,
        RBAC, conflicts and outages are temporary: someone or something can fix them."""
        if self.status in (400, 422):
            return True
        return self.status == 403 and "violates PodSecurity" in str(self)


class SidecarError(BatonOperatorError):
    """A sidecar could not be reached or answered something that is not the contract."""
