"""Baton's in-pod sidecar: HTTP control for the operator, cloud notice pollers, metrics.

It imports only the torch-free :mod:`trainer_sdk.control` from the SDK. Run it with the
``baton-sidecar`` console script; see ``docs/sidecar.md``.
"""

from baton_sidecar._config import Cloud, SidecarConfig, parse_config
from baton_sidecar._errors import ConfigError, SidecarError
from baton_sidecar._serve import serve

__version__ = "0.1.0"
__all__ = [
    "Cloud",
    "ConfigError",
    "SidecarConfig",
    "SidecarError",
    "__version__",
    "parse_config",
    "serve",
]
