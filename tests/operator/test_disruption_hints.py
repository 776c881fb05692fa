"""Which pods carry the disruption hints, decided from one tick's view (disruption.py), and
the pod-deletion-cost that ``spec.disruption.deletionCost`` keeps in step with the work at risk.

The reconciler's use of it, tick by tick, is in test_reconciler_hints.py; on the real control plane
in test_preemption_cluster.py.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from baton_operator.pure import manifests
from baton_operator.pure.crd import crd_manifest
from baton_operator.pure.disruption import (
    DELETION_COST,
    DELETION_COST_SECONDS,
    HINTS,
    INT32_MAX,
    cost_patches,
    hint_patches,
    work_at_risk,
)
from baton_operator.pure.lifecycle import Phase
from baton_operator.pure.model import JobSpec
from baton_operator.pure.pods import PodView


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


T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_the_work_at_risk_is_gpu_seconds_since_the_commit_or_steps_without_gpus() -> None:
    # 130 - 100 steps of 0.25 s on 16 GPUs.
    assert work_at_risk(step=130, committed_step=100, step_seconds=0.25, gpus=16) == 120
    assert work_at_risk(step=130, committed_step=100, step_seconds=None, gpus=0) == 30
    assert work_at_risk(step=130, committed_step=None, step_seconds=0.5, gpus=0) == 130
    assert work_at_risk(step=100, committed_step=100, step_seconds=0.25, gpus=16) == 0
    assert work_at_risk(step=90, committed_step=100, step_seconds=0.25, gpus=16) == 0
    # Unknown: no step reported yet, or GPUs but no step time.
    assert work_at_risk(step=None, committed_step=100, step_seconds=0.25, gpus=16) is None
    assert work_at_risk(step=130, committed_step=100, step_seconds=None, gpus=16) is None
    # An int32: a month of 10,000 GPUs is capped.
    huge = work_at_risk(step=10**9, committed_step=0, step_seconds=3.0, gpus=10_000)
    assert huge == INT32_MAX


def _costs(pods: list[PodView], cost: int | None, *, enabled: bool = True,
           last: datetime | None = None, now: datetime = T0,
           template: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    return cost_patches(pods, enabled=enabled, attempt=2, template=template or {}, cost=cost,
                        last_write=last, now=now)  # fmt: skip


def test_the_deletion_cost_goes_on_the_running_pods_and_follows_the_work_without_a_storm() -> None:
    pods = [
        _pod(0),
        _pod(1, phase="Succeeded"),
        _pod(2, deleting=True),
        _pod(0, attempt=1),
    ]
    assert _costs(pods, 500) == {"tj-2-0": {DELETION_COST: "500"}}
    assert _costs(pods, None) == {}, "unknown: nothing written"
    have = [
        _pod(0, annotations={DELETION_COST: "500"}),
        _pod(1, annotations={DELETION_COST: "500"}),
    ]
    soon = T0 + timedelta(seconds=DELETION_COST_SECONDS / 2)
    later = T0 + timedelta(seconds=DELETION_COST_SECONDS)
    # A change of less than a tenth is never written; a larger one waits for the period.
    assert _costs(have, 540, last=T0, now=later) == {}
    assert _costs(have, 800, last=T0, now=soon) == {}
    assert _costs(have, 800, last=T0, now=later) == {
        "tj-2-0": {DELETION_COST: "800"},
        "tj-2-1": {DELETION_COST: "800"},
    }
    # A commit resets it: a fall by half or more is written at once.
    assert _costs(have, 0, last=T0, now=soon) == {
        "tj-2-0": {DELETION_COST: "0"},
        "tj-2-1": {DELETION_COST: "0"},
    }
    assert _costs([_pod(0, annotations={DELETION_COST: "0"})], 0, last=T0, now=later) == {}


def test_turning_the_switch_off_removes_it_and_a_template_s_own_value_is_kept() -> None:
    pods = [_pod(0, annotations={DELETION_COST: "500"}), _pod(1, phase="Succeeded"),
            _pod(0, attempt=1, annotations={DELETION_COST: "7"})]  # fmt: skip
    assert _costs(pods, 800, enabled=False) == {
        "tj-2-0": {DELETION_COST: None},
        "tj-1-0": {DELETION_COST: None},
    }
    template = {"metadata": {"annotations": {DELETION_COST: "-100"}}}
    assert _costs(pods, 800, template=template) == {}
    assert _costs(pods, 800, enabled=False, template=template) == {}


def test_the_switch_is_a_boolean_off_by_default() -> None:
    spec = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    switch = spec["properties"]["disruption"]["properties"]["deletionCost"]
    assert (switch["type"], switch["default"]) == ("boolean", False)
    body: dict[str, Any] = {
        "metadata": {"name": "tj", "namespace": "team"},
        "spec": {"replicas": 1, "checkpoint": {"uri": "s3://b"}},
    }
    assert not JobSpec.from_body(body).deletion_cost
    body["spec"]["disruption"] = {"deletionCost": True}
    assert JobSpec.from_body(body).deletion_cost
