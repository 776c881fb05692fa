"""What the Node watch has told the operator: each node's readiness and notices.

Pure state (no I/O): the kopf Node handler feeds it, the controller and the pod decisions
(``pods.py``) read it.

A node can also be judged lost before it turns NotReady: when a job's ranks stop hearing
from it (a survivor's trainer failed on its broken process group, or a sidecar that had
answered stops answering), the node is *suspected* (:meth:`ClusterView.suspect`), and the
controller reads its node Lease each tick (:meth:`ClusterView.lease_read`). A Lease renewed
since the first read clears the suspicion (a blip); one not renewed over a window
(``peer_lost_seconds``; by default two of the kubelet's renew intervals, read from the Lease)
of the operator's own watching makes the node lost. The operator's
clock measures the wait, never the node's ``renewTime`` against it (clocks differ), and
either signal alone is not enough: a node slow to renew its Lease has not lost a rank, and a
rank that broke on a node that still renews is a crash (the pod's own status says so).

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
from enum import StrEnum
from typing import Any, Final

from .notices import Notice, node_notices, parse_time
from .settings import OperatorConfig

__all__ = [
    "DELETED_KEPT", "POOL_LABELS", "ZONE_LABEL", "ClusterView", "LeaseVerdict", "NodeLease",
    "node_pool",
]  # fmt: skip

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


KUBELET_RENEW_FRACTION: Final = 0.25
"""A kubelet renews its node Lease every ``leaseDurationSeconds`` x this (10 s of the default
40 s: the kubelet's ``nodeLeaseDurationSeconds``)."""
RENEWALS_MISSED: Final = 2
"""``peer_lost_seconds: auto`` waits this many renew intervals: a live kubelet renews within
one of any moment, and the second is the margin for a slow API server."""
DEFAULT_LEASE_SECONDS: Final = 40.0
"""The kubelet's default ``nodeLeaseDurationSeconds``, for a Lease that states none."""


SUSPICION_KEPT: Final = timedelta(minutes=2)
"""A suspicion whose Lease nobody read for this long (the jobs that raised it ended or moved)
is replaced by the next one; one that judged the node lost is kept until the node renews or
is deleted."""


@dataclass(frozen=True)
class NodeLease:
    """What one read of a node's Lease says (``kube-node-lease/<node>``)."""

    renew_time: str | None
    """``spec.renewTime`` as written: compared with the last read, never with a clock (the
    node's clock is not the operator's)."""
    duration_seconds: float | None = None
    """``spec.leaseDurationSeconds``: the kubelet renews every quarter of it."""


class LeaseVerdict(StrEnum):
    """What one read of a suspected node's Lease says (:meth:`ClusterView.lease_read`)."""

    WAITING = "waiting"
    """Not renewed since the first read, for less than the window."""
    RENEWED = "renewed"
    """Renewed since the first read: the node is alive; the suspicion is dropped."""
    LOST = "lost"
    """Not renewed over the window: the node is lost (until it renews again)."""


@dataclass
class _Suspicion:
    since: datetime
    """When the node was first suspected."""
    reason: str
    renew: str | None = None
    """The Lease's ``spec.renewTime`` at the first read (None: no Lease)."""
    window: float = 0.0
    """Seconds without a renewal that make the node lost (:meth:`ClusterView.window`)."""
    first_read: datetime | None = None
    last_read: datetime | None = None
    lost_at: datetime | None = None


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
    suspects: dict[str, _Suspicion] = field(default_factory=dict)
    """Nodes a job's ranks stopped hearing from, whose Lease is being watched."""

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
        self.suspects.pop(name, None)
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

    def suspect(self, node: str | None, reason: str, *, now: datetime) -> bool:
        """A job's ranks stopped hearing from ``node`` (``reason`` says how). Returns True
        when this is news: the node was not suspected yet, and the fast path is on
        (``peer_lost_seconds`` not 0). A node already lost, unknown or not Ready is left to
        the Node watch's path (its NotReady clock already runs, or it is gone)."""
        if not node or self.config.peer_lost_seconds == 0:
            return False
        found = self.suspects.get(node)
        if (
            found is not None
            and found.lost_at is None
            and now - (found.last_read or found.since) > SUSPICION_KEPT
        ):
            # Nobody has read its Lease for long (its jobs ended or moved): start afresh.
            del self.suspects[node]
        elif found is not None:
            return False
        if not self.node_ready(node):
            return False
        self.suspects[node] = _Suspicion(since=now, reason=reason)
        return True

    def suspicion(self, node: str | None) -> str | None:
        """Why ``node`` is suspected, or None."""
        found = self.suspects.get(node or "")
        return found.reason if found else None

    def window(self, lease: NodeLease | None) -> float:
        """Seconds a suspected node's Lease may go unrenewed before the node is lost:
        ``peer_lost_seconds``, or with ``auto`` (None) :data:`RENEWALS_MISSED` of the
        kubelet's renew intervals, read from the Lease itself (20 s for the default 40 s
        Lease; 4 s on the local cluster, whose agents renew every 2 s)."""
        if self.config.peer_lost_seconds is not None:
            return float(self.config.peer_lost_seconds)
        duration = (lease.duration_seconds if lease else None) or DEFAULT_LEASE_SECONDS
        return RENEWALS_MISSED * KUBELET_RENEW_FRACTION * duration

    def lease_due(self, node: str, *, now: datetime) -> bool:
        """Whether ``node`` is suspected and its Lease was not read in the last half tick
        (every job with a pod there reads it at its tick; one read is enough)."""
        found = self.suspects.get(node)
        if found is None:
            return False
        if found.last_read is None:
            return True
        return now - found.last_read >= timedelta(seconds=self.config.tick_seconds / 2)

    def lease_read(self, node: str, lease: NodeLease | None, *, now: datetime) -> LeaseVerdict:
        """Record one read of a suspected node's Lease (None when it has none) and judge it
        (:class:`LeaseVerdict`): lost once the same ``renewTime`` was read over
        :meth:`window` seconds of the operator's clock. A node judged lost whose Lease is
        renewed again (a partition that healed) is cleared too: its pods were replaced,
        and new ones may run there."""
        found = self.suspects.get(node)
        if found is None:
            return LeaseVerdict.RENEWED
        renewed = lease.renew_time if lease else None
        found.last_read = now
        if found.first_read is None:
            found.first_read, found.renew, found.window = now, renewed, self.window(lease)
            return LeaseVerdict.WAITING
        if renewed != found.renew:
            del self.suspects[node]
            return LeaseVerdict.RENEWED
        if found.lost_at is not None:
            return LeaseVerdict.LOST
        if now - found.first_read >= timedelta(seconds=found.window):
            found.lost_at = now
            return LeaseVerdict.LOST
        return LeaseVerdict.WAITING

    def waited(self, node: str) -> float | None:
        """The window a suspected node's Lease is judged by (None before the first read)."""
        found = self.suspects.get(node)
        return found.window if found and found.first_read else None

    def notices_on(self, node: str) -> list[Notice]:
        """The current notices of one node."""
        info = self.nodes.get(node)
        return list(info.notices) if info else []

    def node_lost(self, node: str | None, *, now: datetime) -> bool:
        """The node was deleted, has not been Ready for ``node_lost_seconds``, or was
        suspected and its Lease went unrenewed over its window (:meth:`window`)."""
        if not node:
            return False
        deleted = self.deleted.get(node)
        if deleted is not None and now - deleted < DELETED_KEPT:
            return True
        found = self.suspects.get(node)
        if found is not None and found.lost_at is not None:
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
