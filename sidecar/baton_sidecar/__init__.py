"""Baton's in-pod sidecar: HTTP control for the operator, cloud notice pollers, metrics.

From the SDK it imports only torch-free modules: :mod:`trainer_sdk.wire` (the vocabulary),
:mod:`trainer_sdk.control` (the control files), :mod:`trainer_sdk.format.layout` (manifests and
hashes) and :mod:`trainer_sdk.replication` (the replication request files); an import-linter
contract forbids torch. Run it with the ``baton-sidecar`` console script; see ``docs/sidecar.md``.
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
