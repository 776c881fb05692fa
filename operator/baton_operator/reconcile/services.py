"""What every room of the reconciler works with, built once and handed to each.

The reconciler's rooms (``creating``, ``replicating``, ``actions``, ``progress``,
``suspending``, ``noticing``, ``recovering`` and the dispatcher in ``controller``) all talk to
the same API client, the same sidecar client, the same Node view, metrics, configuration and
status writer. :class:`Reconciler <baton_operator.reconcile.controller.Reconciler>` builds one
:class:`Services` and passes it to each room; a room subclasses :class:`Room`, which names its
members once, so a new dependency is one field here (and one line in :class:`Room`), not one
more argument in eight constructors. What only one room needs (the creator's token function,
the actions a room calls) stays that room's own argument.
"""

from __future__ import annotations

from dataclasses import dataclass

from baton_operator.client.kube import Kube
from baton_operator.client.metrics import Metrics
from baton_operator.client.sidecars import SidecarClient
from baton_operator.pure.nodes import ClusterView
from baton_operator.pure.settings import OperatorConfig

from .writing import StatusWriter

__all__ = ["Room", "Services"]


@dataclass(kw_only=True, frozen=True, slots=True)
class Services:
    """The dependencies every room shares (one per operator)."""

    kube: Kube
    """The API server (the only way a room reads or writes Kubernetes objects)."""
    sidecars: SidecarClient
    """The jobs' sidecars over HTTP."""
    cluster: ClusterView
    """The Node watch's state: notices, readiness, deletions, zones and pools."""
    metrics: Metrics
    """The operator's Prometheus series."""
    config: OperatorConfig
    """The operator's settings."""
    writer: StatusWriter
    """Guarded status patches and Events."""


class Room:
    """A room of the reconciler: its shared members, named once for every subclass."""

    def __init__(self, services: Services) -> None:
        self._kube = services.kube
        self._sidecars = services.sidecars
        self._cluster = services.cluster
        self._metrics = services.metrics
        self._config = services.config
        self._writer = services.writer
        self._patch = services.writer.patch
        self._event = services.writer.event
