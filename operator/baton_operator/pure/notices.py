"""Eviction notices: Node taints, labels and cordons, and Pod conditions -> :class:`Notice`.

Pure functions over raw API dicts, so every source is unit-tested without a cluster. Each
notice carries a deadline: from the notice's own time where the source records one (the
cluster autoscaler's taint value, the AWS Node Termination Handler's ``action-time`` label, a
NoExecute taint's ``timeAdded``, a pod's ``deletionTimestamp``), else from the moment the
operator saw it, plus the provider's documented grace period (:class:`Graces`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from .vocabulary import NOTICE_SOURCES
from .vocabulary import InterruptionSource as Source

__all__ = [
    "SOURCES",
    "Graces",
    "Notice",
    "earliest",
    "node_notices",
    "parse_time",
    "pod_notice",
]

NTH_PREFIX: Final = "aws-node-termination-handler/"
NTH_TAINTS: Final = {
    f"{NTH_PREFIX}spot-itn": "spot interruption notice",
    f"{NTH_PREFIX}rebalance-recommendation": "rebalance recommendation",
    f"{NTH_PREFIX}scheduled-maintenance": "scheduled maintenance",
    f"{NTH_PREFIX}asg-lifecycle-termination": "auto scaling group termination",
}
NTH_ACTION_TIME: Final = f"{NTH_PREFIX}action-time"
KARPENTER_DISRUPTED: Final = "karpenter.sh/disrupted"
KARPENTER_LEGACY: Final = "karpenter.sh/disruption"  # before v1: value "disrupting"
GKE_TERMINATION: Final = "cloud.google.com/impending-node-termination"
AUTOSCALER: Final = "ToBeDeletedByClusterAutoscaler"
OUT_OF_SERVICE: Final = "node.kubernetes.io/out-of-service"
DISRUPTION_TARGET: Final = "DisruptionTarget"

SOURCES: Final = NOTICE_SOURCES
"""Values of ``Notice.source`` (and of the ``source`` label of ``baton_notices_total``)."""

# When a node carries several notices (NTH cordons *and* taints), the specific one explains
# more to the on-call engineer than "cordoned"; cordon is reported only when alone.
_SPECIFICITY: Final[dict[str, int]] = {s: i for i, s in enumerate(SOURCES)}


@dataclass(frozen=True, kw_only=True)
class Graces:
    """Seconds from a notice to the node's loss, per source, when the notice has no end time."""

    aws_spot: float = 120.0
    """EC2 spot interruption notices come two minutes ahead."""
    aws_other: float = 120.0
    """Rebalance, maintenance and ASG termination: no fixed end; assume a spot-sized window."""
    karpenter: float = 120.0
    """Karpenter drains on spot interruption (two minutes) or consolidation (no fixed end)."""
    gke: float = 15.0
    """GKE spot gives 30 s of which non-system pods get about 15 s."""
    autoscaler: float = 600.0
    """Cluster autoscaler ``--max-graceful-termination-sec`` default."""
    cordon: float = 300.0
    """A cordon usually precedes a drain; give a maintenance-sized window."""
    pod_termination: float = 30.0
    """A pod's default ``terminationGracePeriodSeconds``."""

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 0:
                raise ValueError(f"Graces.{name} must be >= 0 seconds, got {value}")


@dataclass(frozen=True, kw_only=True)
class Notice:
    """A node (or one pod on it) is going away by ``deadline``."""

    source: str
    """One of :data:`SOURCES`."""
    node: str
    """The node the notice is about (for a pod notice, the pod's node)."""
    deadline: datetime
    """When the node is expected to go (timezone-aware UTC)."""
    reason: str
    """What the notice said, for Events and status."""
    pod: str | None = None
    """The pod, for a DisruptionTarget notice."""


def parse_time(value: str | None) -> datetime | None:
    """Parse an RFC 3339 time as Kubernetes writes it; None when absent or malformed."""
    if not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _epoch(value: str | None) -> datetime | None:
    try:
        return datetime.fromtimestamp(int(str(value)), tz=UTC)
    except (TypeError, ValueError, OverflowError, OSError):
        return None


def node_notices(node: Mapping[str, Any], *, now: datetime, graces: Graces) -> list[Notice]:
    """Every notice a Node carries, most specific first (see :func:`earliest` to pick one)."""
    meta = node.get("metadata") or {}
    name = str(meta.get("name", ""))
    labels: Mapping[str, str] = meta.get("labels") or {}
    spec = node.get("spec") or {}
    taints: list[Mapping[str, Any]] = spec.get("taints") or []
    found: list[Notice] = []

    def add(source: str, base: datetime | None, grace: float, reason: str) -> None:
        start = base or now
        found.append(
            Notice(
                source=source,
                node=name,
                deadline=start + timedelta(seconds=grace),
                reason=reason,
            )
        )

    for taint in taints:
        key = str(taint.get("key", ""))
        added = parse_time(taint.get("timeAdded"))
        if key in NTH_TAINTS:
            grace = graces.aws_spot if key.endswith("spot-itn") else graces.aws_other
            base = added or _epoch(labels.get(NTH_ACTION_TIME))
            add(Source.AWS, base, grace, f"AWS Node Termination Handler: {NTH_TAINTS[key]}")
        elif key == KARPENTER_DISRUPTED or (
            key == KARPENTER_LEGACY and taint.get("value") == "disrupting"
        ):
            add(Source.KARPENTER, added, graces.karpenter, "Karpenter is disrupting the node")
        elif key == GKE_TERMINATION:
            add(Source.GKE, added, graces.gke, "GKE: impending node termination")
        elif key == AUTOSCALER:
            # The taint's value is the Unix time at which the autoscaler marked the node.
            base = _epoch(taint.get("value")) or added
            add(
                Source.AUTOSCALER,
                base,
                graces.autoscaler,
                "cluster autoscaler is removing the node",
            )
        elif key == OUT_OF_SERVICE:
            # The node is already down: no time left for a save, the last commit is all we get.
            add(Source.OUT_OF_SERVICE, added or now, 0.0, "node is out of service (already down)")
    if spec.get("unschedulable"):
        add(Source.CORDON, None, graces.cordon, "node was cordoned")
    found.sort(key=lambda n: _SPECIFICITY[n.source])
    return found


def pod_notice(pod: Mapping[str, Any], *, now: datetime, graces: Graces) -> Notice | None:
    """The ``DisruptionTarget`` condition of a pod as a notice, or None."""
    status = pod.get("status") or {}
    for cond in status.get("conditions") or []:
        if cond.get("type") != DISRUPTION_TARGET or cond.get("status") != "True":
            continue
        meta = pod.get("metadata") or {}
        spec = pod.get("spec") or {}
        deadline = parse_time(meta.get("deletionTimestamp"))
        if deadline is None:
            grace = spec.get("terminationGracePeriodSeconds")
            start = parse_time(cond.get("lastTransitionTime")) or now
            seconds = float(grace) if grace is not None else graces.pod_termination
            deadline = start + timedelta(seconds=seconds)
        reason = str(cond.get("reason") or "DisruptionTarget")
        message = cond.get("message")
        return Notice(
            source=Source.DISRUPTION_TARGET,
            node=str(spec.get("nodeName") or ""),
            deadline=deadline,
            reason=f"pod disruption: {reason}" + (f" ({message})" if message else ""),
            pod=str(meta.get("name", "")),
        )
    return None


def earliest(notices: list[Notice]) -> Notice | None:
    """The notice to act on: the earliest deadline of all, reported as the most specific one.

    A spot interruption usually arrives as several notices at once (NTH's taint and cordon,
    then the drain's DisruptionTarget on the pod); the on-call engineer should read "AWS spot
    interruption", while the save must meet the earliest deadline of them all.
    """
    if not notices:
        return None
    deadline = min(n.deadline for n in notices)
    best = min(notices, key=lambda n: (_SPECIFICITY[n.source], n.deadline))
    return replace(best, deadline=deadline)
