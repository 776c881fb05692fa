"""Which pods carry the disruption hints, decided from one tick's view (disruption.py).

The reconciler's use of it, tick by tick, is in test_reconciler.py; on the real control plane
in test_preemption_cluster.py.
"""

from __future__ import annotations

from typing import Any

from baton_operator import manifests
from baton_operator.disruption import HINTS, hint_patches
from baton_operator.lifecycle import Phase
from baton_operator.pods import PodView


def _pod(rank: int, *, attempt: int = 2, phase: str = "Running", deleting: bool = False,
         annotations: dict[str, str] | None = None) -> PodView:  # fmt: skip
    meta: dict[str, Any] = {
        "name": f"tj-{attempt}-{rank}",
        "labels": {manifests.RANK_LABEL: str(rank), manifests.ATTEMPT_LABEL: str(attempt)},
        "annotations": dict(annotations or {}),
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return PodView.from_body({"metadata": meta, "spec": {}, "status": {"phase": phase}})


def test_only_the_current_attempts_live_pods_get_hints_while_checkpointing() -> None:
    pods = [
        _pod(0),
        _pod(1, phase="Succeeded"),  # stopped after its part of the save: saving nothing
        _pod(2, deleting=True),
        _pod(0, attempt=1),  # an older attempt's pod, still terminating
    ]
    patches = hint_patches(pods, phase=Phase.CHECKPOINTING, attempt=2, template={})
    assert patches == {"tj-2-0": dict(HINTS)}


def test_every_other_phase_takes_them_off_and_a_steady_state_patches_nothing() -> None:
    hinted = [_pod(0, annotations=dict(HINTS)), _pod(1, annotations={"other": "x", **HINTS})]
    off = dict.fromkeys(HINTS)
    for phase in (Phase.RUNNING, Phase.RESTARTING, Phase.PENDING, Phase.SUCCEEDED,
                  Phase.FAILED, None):  # fmt: skip
        assert hint_patches(hinted, phase=phase, attempt=2, template={}) == {
            "tj-2-0": off,
            "tj-2-1": off,
        }
    assert hint_patches(hinted, phase=Phase.CHECKPOINTING, attempt=2, template={}) == {}
    bare = [_pod(0, annotations={"other": "x"})]
    assert hint_patches(bare, phase=Phase.RUNNING, attempt=2, template={}) == {}


def test_a_key_the_template_sets_is_never_touched() -> None:
    template = {"metadata": {"annotations": {"karpenter.sh/do-not-disrupt": "true"}}}
    pods = [_pod(0, annotations={"karpenter.sh/do-not-disrupt": "true"})]
    assert hint_patches(pods, phase=Phase.RUNNING, attempt=2, template=template) == {}
    assert hint_patches(pods, phase=Phase.CHECKPOINTING, attempt=2, template=template) == {
        "tj-2-0": {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"}
    }
