"""Disruption hints: tell the cluster's node removers not to take a node mid-commit.

Karpenter (consolidation, drift) and the cluster autoscaler (scale-down) remove nodes on their
own schedule and know nothing of a checkpoint being written. While the job's ranks write a
notice save, losing one more node costs the whole save; so while the job is ``Checkpointing``
its pods carry the annotations both read, and at no other time.

Pure. The hints are derived from the job's status on every tick, never remembered: an operator
restarted mid-save puts them back while the phase is ``Checkpointing`` and takes them off as
soon as it is not, so an annotation never outlives its reason. A key the job's own template sets
belongs to the user: it is never added, changed or removed here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final

from .lifecycle import Phase
from .pods import PodView

__all__ = ["DO_NOT_DISRUPT", "HINTS", "SAFE_TO_EVICT", "hint_patches", "wants_hints"]

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
