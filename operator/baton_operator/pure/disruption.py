"""Disruption hints: tell the cluster's node removers not to take a node mid-commit.

Karpenter (consolidation, drift) and the cluster autoscaler (scale-down) remove nodes on their
own schedule and know nothing of a checkpoint being written. While the job's ranks write a
notice save, losing one more node costs the whole save; so while the job is ``Checkpointing``
its pods carry the annotations both read, and at no other time.

Pure. The hints are derived from the job's status on every tick, never remembered: an operator
restarted mid-save puts them back while the phase is ``Checkpointing`` and takes them off as
soon as it is not, so an annotation never outlives its reason. A key the job's own template sets
belongs to the user: it is never added, changed or removed here.

With ``spec.disruption.deletionCost`` the running pods also carry
``controller.kubernetes.io/pod-deletion-cost``: the work the job would lose if one of them went
now (every rank's work since the last commit is lost with any one pod), in GPU-seconds, or in
steps when the job has no GPUs. Karpenter adds it (scaled by 2^-27) to each pod's eviction cost
when it ranks consolidation candidates. It is rewritten only when it changed by a tenth (or
fell by half: a commit) and at most every :data:`DELETION_COST_SECONDS`, so a running job costs
a patch per pod per half minute at most, not one per poll.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any, Final

from .lifecycle import Phase
from .pods import PodView

__all__ = [
    "DELETION_COST",
    "DELETION_COST_SECONDS",
    "DO_NOT_DISRUPT",
    "HINTS",
    "INT32_MAX",
    "SAFE_TO_EVICT",
    "cost_patches",
    "hint_patches",
    "wants_hints",
    "work_at_risk",
]

DO_NOT_DISRUPT: Final = "karpenter.sh/do-not-disrupt"
"""Karpenter (v0.32 and later) does not consolidate or drift a node with such a pod."""
SAFE_TO_EVICT: Final = "cluster-autoscaler.kubernetes.io/safe-to-evict"
"""The cluster autoscaler (1.2.3 and later) does not scale down a node with such a pod."""
HINTS: Final[Mapping[str, str]] = {DO_NOT_DISRUPT: "true", SAFE_TO_EVICT: "false"}


def wants_hints(pod: PodView, *, phase: Phase | None, attempt: int) -> bool:
    """Whether ``pod`` should carry the hints now: the job is writing a notice save and the
    pod is one of the current attempt's ranks that is still running (a pod that ended, or is
    being deleted, is saving nothing)."""
    return (
        phase is Phase.CHECKPOINTING
        and pod.attempt == attempt
        and not pod.finished
        and not pod.deleting
    )


def _template_annotations(template: Mapping[str, Any]) -> Mapping[str, Any]:
    meta: Mapping[str, Any] = template.get("metadata") or {}
    return meta.get("annotations") or {}


def hint_patches(
    pods: Iterable[PodView],
    *,
    phase: Phase | None,
    attempt: int,
    template: Mapping[str, Any],
) -> dict[str, dict[str, str | None]]:
    """The annotation merge patches that bring each pod's hints in line with ``phase``.

    Returns ``{pod name: {key: value, or None to remove}}``, only for pods that differ (a
    steady state costs no API call). Keys the template sets itself are left as they are.
    """
    owned = {k: v for k, v in HINTS.items() if k not in _template_annotations(template)}
    patches: dict[str, dict[str, str | None]] = {}
    for pod in pods:
        meta: Mapping[str, Any] = pod.body.get("metadata") or {}
        have: Mapping[str, Any] = meta.get("annotations") or {}
        want = wants_hints(pod, phase=phase, attempt=attempt)
        patch: dict[str, str | None] = {}
        for key, value in owned.items():
            if want and have.get(key) != value:
                patch[key] = value
            elif not want and key in have:
                patch[key] = None
        if patch:
            patches[pod.name] = patch
    return patches


DELETION_COST: Final = "controller.kubernetes.io/pod-deletion-cost"
"""Read by Karpenter (v1.0 to v1.14 at least: ``EvictionCost`` adds value / 2^27 to a pod's
eviction cost, clamped to [-10, 10]) and by the ReplicaSet controller (Kubernetes 1.22 and
later, beta) to prefer the pods with the lower cost for removal."""
DELETION_COST_SECONDS: Final = 30.0
"""Seconds between two writes of a job's deletion cost (a fall by half, i.e. a commit, is
written at once): node removers act on minutes, and a write is a patch per pod."""
INT32_MAX: Final = 2**31 - 1
"""The annotation is an int32; larger costs are written as this."""


def work_at_risk(
    *, step: int | None, committed_step: int | None, step_seconds: float | None, gpus: int
) -> int | None:
    """The work lost if a pod went now: ``(step - committed step) x step seconds x GPUs`` in
    GPU-seconds; in steps when the job has no GPUs; None while the step (or, with GPUs, the
    step time) is unknown. Capped at :data:`INT32_MAX`."""
    if step is None:
        return None
    steps = max(0, step - (committed_step or 0))
    if gpus <= 0:
        return min(INT32_MAX, steps)
    if step_seconds is None:
        return None
    return min(INT32_MAX, round(steps * step_seconds * gpus))


def _changed(old: int, new: int) -> bool:
    return abs(new - old) >= max(1.0, 0.1 * max(old, new))


def cost_patches(
    pods: Iterable[PodView],
    *,
    enabled: bool,
    attempt: int,
    template: Mapping[str, Any],
    cost: int | None,
    last_write: datetime | None,
    now: datetime,
) -> dict[str, dict[str, str | None]]:
    """The annotation patches that bring the pods' :data:`DELETION_COST` in line.

    Enabled: the current attempt's running pods get ``str(cost)`` when they have none, or
    when it changed by a tenth and the last write is :data:`DELETION_COST_SECONDS` old, or
    fell by half (a commit); nothing while ``cost`` is unknown. Disabled: removed from every
    pod that has it. A key the template sets is the user's and left alone.
    """
    if DELETION_COST in _template_annotations(template):
        return {}
    due = last_write is None or (now - last_write).total_seconds() >= DELETION_COST_SECONDS
    patches: dict[str, dict[str, str | None]] = {}
    for pod in pods:
        meta: Mapping[str, Any] = pod.body.get("metadata") or {}
        have = (meta.get("annotations") or {}).get(DELETION_COST)
        if not enabled:
            if have is not None:
                patches[pod.name] = {DELETION_COST: None}
            continue
        if cost is None or pod.attempt != attempt or pod.finished or pod.deleting:
            continue
        try:
            old = int(str(have)) if have is not None else None
        except ValueError:
            old = None  # not ours to keep: written again
        if old is None or (_changed(old, cost) and (due or cost * 2 <= old)):
            patches[pod.name] = {DELETION_COST: str(cost)}
    return patches
