"""What the Node watch has told the operator: each node's readiness and notices.

Pure state (no I/O): the kopf Node handler feeds it, the controller and the pod decisions
(``pods.py``) read it.

A deleted Node leaves a tombstone (:attr:`ClusterView.deleted`): its pods stay in the API
until the operator removes them or the pod garbage collector does (orphans, after 40 s), and
a pod on a deleted node is lost at once, while a pod on a node never seen is not (the Node
watch's first listing may not have come yet). A tombstone is kept :data:`DELETED_KEPT`, then
dropped: on a spot cluster node names are deleted all day and never come back, and a set of
every name ever deleted grew for the operator's whole life. After that a pod still naming
the node is judged as by an operator started since (the node unknown): its overdue deletion
makes the operator look the node up, and the pod garbage collector removes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from .notices import Notice, node_notices, parse_time
from .settings import OperatorConfig

__all__ = ["DELETED_KEPT", "POOL_LABELS", "ZONE_LABEL", "ClusterView", "node_pool"]

DELETED_KEPT: Final = timedelta(hours=1)
"""How long a deleted Node's tombstone is kept: its pods are gone well before (the operator
force-deletes them at its job's next tick, at most a 30 s API backoff later; the pod garbage
collector after 40 s), with a wide margin for a slow tick or a stopped controller-manager."""

ZONE_LABEL: Final = "topology.kubernetes.io/zone"
"""A node's zone (the well-known label every cloud's nodes carry)."""

POOL_LABELS: Final = (
    "karpenter.sh/nodepool",
    "cloud.google.com/gke-nodepool",
    "eks.amazonaws.com/nodegroup",
    "kubernetes.azure.com/agentpool",
    "baton.dev/node-pool",
)
"""Node labels that name a node's pool, first match wins: Karpenter's NodePool, GKE's node
pool, an EKS managed node group, an AKS agent pool, and ``baton.dev/node-pool`` for anything
else (set it on nodes of self-managed groups). Spot capacity is reclaimed per pool, so the
adaptive interval (interval.py) measures interruption rates per pool."""


def node_pool(labels: Mapping[str, Any] | None) -> str | None:
    """The pool a node's (or a nodeSelector's) labels name, if any (:data:`POOL_LABELS`)."""
    for key in POOL_LABELS:
        value = (labels or {}).get(key)
        if value:
            return f"{key}={value}"
    return None


@dataclass
class _Node:
    ready: bool
    not_ready_since: datetime | None
    notices: list[Notice]


UNSEEN_DELETION: Final = (
    "node {node} is gone, and its deletion was not seen by the Node watch (it was down or "
    "refused meanwhile): its pods are lost ({when})"
)
"""The WARNING logged when a list finds a known Node deleted (``node``, ``when``)."""


@dataclass
class ClusterView:
    """What the Node watch has told us: readiness and notices per node."""

    config: OperatorConfig
    nodes: dict[str, _Node] = field(default_factory=dict)
    deleted: dict[str, datetime] = field(default_factory=dict)
    """Deleted nodes, by when their deletion was seen, for :data:`DELETED_KEPT`."""
    pools: dict[str, str] = field(default_factory=dict)
    """Each labelled node's pool (:func:`node_pool`)."""
    zones: dict[str, str] = field(default_factory=dict)
    """Each labelled node's zone (:data:`ZONE_LABEL`)."""

    def update_node(self, body: Mapping[str, Any], *, now: datetime) -> list[Notice]:
        """Record a Node; return the notices that are new on it (for Events and metrics)."""
        meta: Mapping[str, Any] = body.get("metadata") or {}
        name = str(meta.get("name", ""))
        pool = node_pool(meta.get("labels"))
        if pool is None:
            self.pools.pop(name, None)
        else:
            self.pools[name] = pool
        zone = (meta.get("labels") or {}).get(ZONE_LABEL)
        if zone:
            self.zones[name] = str(zone)
        else:
            self.zones.pop(name, None)
        ready = False
        since: datetime | None = None
        for cond in (body.get("status") or {}).get("conditions") or []:
            if cond.get("type") == "Ready":
                ready = cond.get("status") == "True"
                since = None if ready else (parse_time(cond.get("lastTransitionTime")) or now)
        found = node_notices(body, now=now, graces=self.config.graces)
        old = self.nodes.get(name)
        # Keep the first-seen deadline of a notice: a re-list after an operator restart must
        # not push it later.
        known = {n.source: n for n in old.notices} if old else {}
        merged = [known.get(n.source, n) for n in found]
        fresh = [n for n in found if n.source not in known]
        self.nodes[name] = _Node(ready=ready, not_ready_since=since, notices=merged)
        self.deleted.pop(name, None)
        return fresh

    def remove_node(self, name: str, *, now: datetime | None = None) -> None:
        """A Node object was deleted (seen at ``now``, default the clock): whatever ran there
        is lost. Tombstones older than :data:`DELETED_KEPT` go."""
        now = now or datetime.now(tz=UTC)
        self.nodes.pop(name, None)
        self.pools.pop(name, None)
        self.zones.pop(name, None)
        horizon = now - DELETED_KEPT
        self.deleted = {n: t for n, t in self.deleted.items() if t > horizon and n != name}
        self.deleted[name] = now

    def sweep(self, present: set[str], *, now: datetime | None = None) -> list[str]:
        """Forget the known nodes a fresh list no longer has, as deleted; return them.

        The Node watch tells of a deletion only while it runs: a Node deleted while the API
        server was unreachable (a restart, an outage) is never announced, and would stay
        known and Ready here, so its pods would be deleted gracefully and wait minutes for
        the pod garbage collector instead of being replaced at once."""
        gone = sorted(set(self.nodes) - present)
        for name in gone:
            self.remove_node(name, now=now)
        return gone

    def notices_on(self, node: str) -> list[Notice]:
        """The current notices of one node."""
        info = self.nodes.get(node)
        return list(info.notices) if info else []

    def node_lost(self, node: str | None, *, now: datetime) -> bool:
        """The node was deleted, or has not been Ready for ``node_lost_seconds``."""
        if not node:
            return False
        deleted = self.deleted.get(node)
        if deleted is not None and now - deleted < DELETED_KEPT:
            return True
        info = self.nodes.get(node)
        if info is None or info.ready or info.not_ready_since is None:
            return False
        return now - info.not_ready_since >= timedelta(seconds=self.config.node_lost_seconds)

    def pool_of(self, node: str | None) -> str | None:
        """The node's pool (``label=value``), or None when no :data:`POOL_LABELS` label names
        it (or the node is unknown)."""
        return self.pools.get(node or "")

    def zone_of(self, node: str | None) -> str | None:
        """The node's zone (:data:`ZONE_LABEL`), or None when unlabelled or unknown."""
        return self.zones.get(node or "")

    def node_ready(self, node: str | None) -> bool:
        """Whether the node is known and Ready."""
        info = self.nodes.get(node or "")
        return bool(info and info.ready)
