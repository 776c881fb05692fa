"""Every notice source becomes a Notice with the deadline its provider documents."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from baton_operator.pure.notices import Graces, earliest, node_notices, parse_time, pod_notice

NOW = datetime(2026, 11, 30, 4, 0, 0, tzinfo=UTC)
G = Graces()


def node(
    *,
    taints: list[dict[str, Any]] | None = None,
    labels: dict[str, str] | None = None,
    unschedulable: bool = False,
) -> dict[str, Any]:
    return {
        "metadata": {"name": "n1", "labels": labels or {}},
        "spec": {"taints": taints or [], "unschedulable": unschedulable},
    }


@pytest.mark.parametrize(
    ("key", "grace"),
    [
        ("aws-node-termination-handler/spot-itn", G.aws_spot),
        ("aws-node-termination-handler/rebalance-recommendation", G.aws_other),
        ("aws-node-termination-handler/scheduled-maintenance", G.aws_other),
        ("aws-node-termination-handler/asg-lifecycle-termination", G.aws_other),
    ],
)
def test_aws_nth_taints(key: str, grace: float) -> None:
    (n,) = node_notices(node(taints=[{"key": key, "effect": "NoSchedule"}]), now=NOW, graces=G)
    assert n.source == "aws"
    assert n.node == "n1"
    assert n.deadline == NOW + timedelta(seconds=grace)
    assert "AWS Node Termination Handler" in n.reason


def test_aws_action_time_label_anchors_the_deadline() -> None:
    t0 = NOW - timedelta(seconds=50)
    body = node(
        taints=[{"key": "aws-node-termination-handler/spot-itn", "effect": "NoSchedule"}],
        labels={"aws-node-termination-handler/action-time": str(int(t0.timestamp()))},
    )
    (n,) = node_notices(body, now=NOW, graces=G)
    assert n.deadline == t0 + timedelta(seconds=120)


def test_karpenter_v1_and_legacy() -> None:
    (n,) = node_notices(
        node(taints=[{"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}]), now=NOW, graces=G
    )
    assert n.source == "karpenter"
    assert n.deadline == NOW + timedelta(seconds=G.karpenter)
    legacy = node(taints=[{"key": "karpenter.sh/disruption", "value": "disrupting"}])
    assert [x.source for x in node_notices(legacy, now=NOW, graces=G)] == ["karpenter"]
    other = node(taints=[{"key": "karpenter.sh/disruption", "value": "something-else"}])
    assert node_notices(other, now=NOW, graces=G) == []


def test_gke_impending_termination() -> None:
    body = node(taints=[{"key": "cloud.google.com/impending-node-termination"}])
    (n,) = node_notices(body, now=NOW, graces=G)
    assert n.source == "gke"
    assert n.deadline == NOW + timedelta(seconds=15)


def test_autoscaler_taint_value_is_the_mark_time() -> None:
    marked = NOW - timedelta(seconds=100)
    body = node(
        taints=[
            {
                "key": "ToBeDeletedByClusterAutoscaler",
                "value": str(int(marked.timestamp())),
                "effect": "NoSchedule",
            }
        ]
    )
    (n,) = node_notices(body, now=NOW, graces=G)
    assert n.source == "autoscaler"
    assert n.deadline == marked + timedelta(seconds=600)


def test_cordon_alone_and_behind_a_specific_notice() -> None:
    (n,) = node_notices(node(unschedulable=True), now=NOW, graces=G)
    assert n.source == "cordon"
    assert n.deadline == NOW + timedelta(seconds=300)
    both = node(unschedulable=True, taints=[{"key": "aws-node-termination-handler/spot-itn"}])
    found = node_notices(both, now=NOW, graces=G)
    assert [x.source for x in found] == ["aws", "cordon"]
    picked = earliest(found)
    assert picked is not None
    assert picked.source == "aws"


def test_out_of_service_has_no_time_left() -> None:
    body = node(
        taints=[
            {
                "key": "node.kubernetes.io/out-of-service",
                "effect": "NoExecute",
                "timeAdded": "2026-11-30T03:59:00Z",
            }
        ]
    )
    (n,) = node_notices(body, now=NOW, graces=G)
    assert n.source == "out-of-service"
    assert n.deadline == datetime(2026, 11, 30, 3, 59, tzinfo=UTC)


def test_time_added_of_a_noexecute_taint_anchors_the_deadline() -> None:
    body = node(
        taints=[
            {
                "key": "cloud.google.com/impending-node-termination",
                "timeAdded": "2026-11-30T03:59:50Z",
            }
        ]
    )
    (n,) = node_notices(body, now=NOW, graces=G)
    assert n.deadline == datetime(2026, 11, 30, 4, 0, 5, tzinfo=UTC)


def test_unrelated_taints_are_not_notices() -> None:
    body = node(
        taints=[
            {"key": "nvidia.com/gpu", "effect": "NoSchedule"},
            {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"},
        ]
    )
    assert node_notices(body, now=NOW, graces=G) == []


def pod(cond: dict[str, Any] | None, **meta: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "job-a0-r1", **meta},
        "spec": {"nodeName": "n2", "terminationGracePeriodSeconds": 45},
        "status": {"conditions": [cond] if cond else []},
    }


def test_disruption_target_uses_the_deletion_timestamp() -> None:
    p = pod(
        {
            "type": "DisruptionTarget",
            "status": "True",
            "reason": "EvictionByEvictionAPI",
            "lastTransitionTime": "2026-11-30T04:00:00Z",
        },
        deletionTimestamp="2026-11-30T04:00:30Z",
    )
    n = pod_notice(p, now=NOW, graces=G)
    assert n is not None
    assert n.source == "disruption-target"
    assert n.node == "n2"
    assert n.pod == "job-a0-r1"
    assert n.deadline == datetime(2026, 11, 30, 4, 0, 30, tzinfo=UTC)
    assert "EvictionByEvictionAPI" in n.reason


def test_disruption_target_without_deletion_uses_the_pod_grace() -> None:
    p = pod(
        {
            "type": "DisruptionTarget",
            "status": "True",
            "reason": "PreemptionByScheduler",
            "lastTransitionTime": "2026-11-30T04:00:00Z",
        }
    )
    n = pod_notice(p, now=NOW, graces=G)
    assert n is not None
    assert n.deadline == NOW + timedelta(seconds=45)


def test_a_false_or_missing_condition_is_no_notice() -> None:
    assert (
        pod_notice(pod({"type": "DisruptionTarget", "status": "False"}), now=NOW, graces=G) is None
    )
    assert pod_notice(pod({"type": "Ready", "status": "True"}), now=NOW, graces=G) is None
    assert pod_notice(pod(None), now=NOW, graces=G) is None


def test_earliest_deadline_wins() -> None:
    a = node_notices(
        node(
            taints=[{"key": "ToBeDeletedByClusterAutoscaler", "value": str(int(NOW.timestamp()))}]
        ),
        now=NOW,
        graces=G,
    )
    b = node_notices(
        node(taints=[{"key": "cloud.google.com/impending-node-termination"}]), now=NOW, graces=G
    )
    picked = earliest(a + b)
    assert picked is not None
    assert picked.source == "gke"
    assert picked.deadline == NOW + timedelta(seconds=15)
    assert earliest([]) is None


def test_the_most_specific_source_is_reported_with_the_earliest_deadline() -> None:
    spot = node_notices(
        node(taints=[{"key": "aws-node-termination-handler/spot-itn"}]), now=NOW, graces=G
    )
    evicted = pod_notice(
        pod(
            {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"},
            deletionTimestamp="2026-11-30T04:00:20Z",
        ),
        now=NOW,
        graces=G,
    )
    assert evicted is not None
    picked = earliest([*spot, evicted])
    assert picked is not None
    assert picked.source == "aws"
    assert picked.deadline == NOW + timedelta(seconds=20)


def test_graces_reject_negative_values() -> None:
    with pytest.raises(ValueError, match="gke"):
        Graces(gke=-1)


def test_parse_time() -> None:
    assert parse_time("2026-11-30T04:00:00Z") == NOW
    assert parse_time("not a time") is None
    assert parse_time(None) is None
