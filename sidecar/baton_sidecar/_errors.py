"""The sidecar's one error base class and its kinds."""

from __future__ import annotations

__all__ = ["ConfigError", "SidecarError"]


class SidecarError(Exception):
    """Base class for errors raised by the sidecar."""


class ConfigError(SidecarError):
    """The sidecar's flags, environment or token file cannot be used as given."""
