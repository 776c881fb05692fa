"""The operator's one error base class, and the permanent/temporary split the reconciler acts on.

The split is kopf's (``kopf.PermanentError`` vs ``kopf.TemporaryError(delay=)``), kept in the
operator's own classes so that the client layer (``kube``, ``sidecars``) can say which kind a
failure is and the controller never parses an HTTP status itself:

- :class:`PermanentError`: sending the same thing again can never succeed (the API server
  found the object invalid, or an admission policy forbids it). A refused pod or Service ends
  the job ``Failed`` with a condition that names the field and the fix (``creating``); any
  other refused write (a status value the installed CRD does not allow) is reported the same
  way and the job's daemon stops instead of resending it (``faults.rejected``).
- :class:`TemporaryError`: someone or something can fix it (RBAC, a quota, an outage, a
  sidecar that is not up yet, a write that lost a race). Retried after ``delay`` (None: the
  caller's own backoff).
"""

from __future__ import annotations

__all__ = [
    "BatonOperatorError",
    "KubeConflictError",
    "KubeError",
    "KubeRejectedError",
    "KubeTemporaryError",
    "PermanentError",
    "SidecarUnreachableError",
    "TemporaryError",
]


class BatonOperatorError(Exception):
    """Base class of every error raised by ``baton_operator``."""


class PermanentError(BatonOperatorError):
    """Trying again cannot succeed: the job must fail and say what to fix."""


class TemporaryError(BatonOperatorError):
    """Trying again later can succeed; ``delay`` is the seconds to wait (None: caller's backoff)."""

    def __init__(self, message: str, *, delay: float | None = None) -> None:
        super().__init__(message)
        self.delay = delay


class KubeError(BatonOperatorError):
    """A Kubernetes API call failed; ``status`` is the HTTP status (0 when none came back).

    ``fields`` are the object fields the API server named in its answer (``details.causes``).
    The client layer raises one of the subclasses (:meth:`from_answer`), which also say whether
    the failure is permanent or temporary.
    """

    def __init__(self, message: str, *, status: int = 0, fields: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.fields = fields

    @property
    def permanent(self) -> bool:
        """Whether sending the same object again can never succeed."""
        return isinstance(self, PermanentError)

    @staticmethod
    def from_answer(message: str, *, status: int, fields: tuple[str, ...] = ()) -> KubeError:
        """The error for an API server's answer (``status`` 0: no answer came back).

        Invalid objects (400, 422) and Pod Security refusals (403 "violates PodSecurity") are
        permanent. A 409 is a lost race (:class:`KubeConflictError`: read afresh and decide again).
        Quotas, RBAC, expired resource versions and outages are temporary.
        """
        if status in (400, 422) or (status == 403 and "violates PodSecurity" in message):
            return KubeRejectedError(message, status=status, fields=fields)
        if status == 409:
            return KubeConflictError(message, status=status, fields=fields)
        return KubeTemporaryError(message, status=status, fields=fields)


class KubeRejectedError(KubeError, PermanentError):
    """The API server refused the object itself (invalid, or forbidden by admission)."""


class KubeTemporaryError(KubeError, TemporaryError):
    """An API call failed for a reason that can pass (RBAC, quota, 410, 5xx, no answer)."""

    def __init__(self, message: str, *, status: int = 0, fields: tuple[str, ...] = ()) -> None:
        KubeError.__init__(self, message, status=status, fields=fields)
        self.delay = None


class KubeConflictError(KubeTemporaryError):
    """A guarded write lost a race: the object changed since it was read (HTTP 409).

    Retry at once from a fresh read; never resend the same write.
    """

    def __init__(self, message: str, *, status: int = 409, fields: tuple[str, ...] = ()) -> None:
        super().__init__(message, status=status, fields=fields)
        self.delay = 0.0


class SidecarUnreachableError(TemporaryError):
    """No usable answer from a pod's sidecar: no connection, a timeout, an HTTP error status or
    JSON outside the contract. Temporary: the sidecar may be up by the next tick, and a sidecar
    that is gone for good is judged by its pod, not by this error."""
