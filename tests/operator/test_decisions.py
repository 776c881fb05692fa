"""The pure layer's decisions that used to be inline in the controller, one by one.

``pods`` (which notice, how to delete), ``lifecycle`` (when to move at once, the one deadline
clamp), ``reports`` (the fallback step) and ``jobstatus`` (parsing the status, and the one way
a phase changes). The reconciler's use of them is tested in test_reconciler*.py.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from baton_operator.pure import lifecycle, manifests
from baton_operator.pure.jobstatus import JobStatus, StatusPatch
from baton_operator.pure.lifecycle import Phase
from baton_operator.pure.model import LastCheckpoint
from baton_operator.pure.nodes import ClusterView
from baton_operator.pure.pods import PodView, delete_grace, notice_for, noticed_nodes
from baton_operator.pure.reports import SidecarStatus, fallback_fields, fallback_step
from baton_operator.pure.settings import OperatorConfig

NOW = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
CONFIG = OperatorConfig()


def pod(name: str, node: str | None, *, phase: str = "Running", **extra: Any) -> PodView:
    body: dict[str, Any] = {
        "metadata": {
            "name": name,
            "labels": {manifests.RANK_LABEL: "1", manifests.ATTEMPT_LABEL: "2"},
            **extra.pop("metadata", {}),
        },
        "spec": {"nodeName": node} if node else {},
        "status": {"phase": phase, **extra},
    }
    return PodView.from_body(body)


def cluster(**nodes: dict[str, Any]) -> ClusterView:
    view = ClusterView(config=CONFIG)
    for name, node in nodes.items():
        ready = node.pop("ready", True)
        since = node.pop("since", NOW - timedelta(hours=1))
        view.update_node(
            {
                "metadata": {"name": name},
                "spec": node,
                "status": {
                    "conditions": [
                        {
                            "type": "Ready",
                            "status": "True" if ready else "False",
                            "lastTransitionTime": since.isoformat(),
                        }
                    ]
                },
            },
            now=NOW,
        )
    return view


SPOT = {"taints": [{"key": "aws-node-termination-handler/spot-itn", "effect": "NoSchedule"}]}
DISRUPTED = {"conditions": [{"type": "DisruptionTarget", "status": "True", "reason": "Preempt"}]}


def test_pod_view_parses_labels_node_and_the_trainer() -> None:
    p = pod(
        "a",
        "n1",
        podIP="10.0.0.9",
        containerStatuses=[
            {"name": "baton-sidecar", "state": {"running": {}}},
            {"name": manifests.TRAINER_NAME, "state": {"terminated": {"exitCode": 75}}},
        ],
    )
    assert (p.rank, p.attempt, p.node, p.ip) == (1, 2, "n1", "10.0.0.9")
    assert (p.trainer_running, p.trainer_exit_code, p.finished) == (False, 75, False)
    bad = PodView.from_body({"metadata": {"labels": {manifests.RANK_LABEL: "x"}}})
    assert (bad.rank, bad.attempt, bad.node, bad.phase) == (-1, -1, None, "Pending")


def test_notice_for_takes_node_notices_and_ready_nodes_pod_conditions() -> None:
    view = cluster(n1=dict(SPOT), n2={}, n3={"ready": False, "since": NOW})
    graces = CONFIG.graces
    found = notice_for([pod("a", "n1")], view, now=NOW, graces=graces)
    assert found is not None
    assert found.source == "aws"
    assert notice_for([pod("a", "n2")], view, now=NOW, graces=graces) is None
    on_ready = notice_for([pod("b", "n2", **DISRUPTED)], view, now=NOW, graces=graces)
    assert on_ready is not None
    assert on_ready.source == "disruption-target"
    assert notice_for([pod("c", "n3", **DISRUPTED)], view, now=NOW, graces=graces) is None
    assert notice_for([pod("d", "n1", phase="Succeeded")], view, now=NOW, graces=graces) is None
    assert notice_for([pod("e", None)], view, now=NOW, graces=graces) is None
    # The nodes to avoid include a pod's own notice, whatever its node's readiness.
    pods = [pod("a", "n1"), pod("c", "n3", **DISRUPTED), pod("x", "n2")]
    assert noticed_nodes(pods, view, now=NOW, graces=graces) == ["n1", "n3"]


def test_delete_grace() -> None:
    view = cluster(up={}, down={"ready": False, "since": NOW - timedelta(hours=1)})
    going = {"metadata": {"deletionTimestamp": "2026-03-01T12:00:00Z"}}
    assert delete_grace(pod("a", "up"), view, now=NOW, grace_seconds=30) == 30
    assert delete_grace(pod("a", "up", **going), view, now=NOW, grace_seconds=30) is None
    assert delete_grace(pod("a", "down", **going), view, now=NOW, grace_seconds=30) == 0
    view.remove_node("up")
    assert delete_grace(pod("a", "up"), view, now=NOW, grace_seconds=30) == 0


def test_only_a_running_attempt_asks_for_a_save() -> None:
    assert not lifecycle.moves_at_once(Phase.RUNNING)
    assert lifecycle.moves_at_once(Phase.PENDING)


def test_clamp_deadline() -> None:
    least = timedelta(seconds=10)
    far = NOW + timedelta(seconds=120)
    assert lifecycle.clamp_deadline(far, now=NOW, least=least) == far
    assert lifecycle.clamp_deadline(NOW - timedelta(seconds=5), now=NOW, least=least) == NOW + least


def test_fallback_step_is_the_newest_any_rank_or_the_status_knows() -> None:
    last = LastCheckpoint(step=20)
    reports = [
        SidecarStatus(state="failed", last_committed_step=30),
        SidecarStatus(state="committed", step=25),
        SidecarStatus(state="idle"),
    ]
    assert fallback_step(last, reports) == 30
    assert fallback_step(LastCheckpoint(step=50), reports) == 50
    assert fallback_step(None, [SidecarStatus(state="idle")]) is None
    # What a restart after an incomplete save writes: lastCheckpoint only when a rank knows
    # of a newer commit than the status does.
    now = "2026-12-01T12:00:00Z"
    best, fields = fallback_fields(last, reports, uri="s3://b/j", now=now)
    assert best == 30
    assert fields == {
        "lastCheckpoint": LastCheckpoint(
            step=30, uri="s3://b/j", trigger="periodic", completed_at=now
        ).to_status()
    }
    assert fallback_fields(LastCheckpoint(step=50), reports, uri="u", now=now) == (50, {})
    assert fallback_fields(None, [], uri="u", now=now) == (None, {})


def test_job_status_parses_the_body() -> None:
    status = JobStatus.from_body(
        {
            "metadata": {"resourceVersion": "77"},
            "status": {
                "phase": "Checkpointing",
                "attempt": 3,
                "replicas": 0,
                "lastCheckpoint": {"step": 40},
                "notice": {"source": "aws", "deadline": "2026-03-01T12:02:00Z",
                           "requestIds": ["a", ""]},
            },
        }
    )  # fmt: skip
    assert (status.phase, status.attempt, status.resource_version) == (
        Phase.CHECKPOINTING,
        3,
        "77",
    )
    assert status.replicas_or(4) == 4, "0 replicas means none recorded yet"
    assert status.resume_step == 40
    assert status.notice is not None
    assert status.notice.deadline == NOW + timedelta(minutes=2)
    assert status.notice.request_ids == ("a", "")
    assert status.notice.requested_at is None
    assert JobStatus.from_body({}).phase is None


def test_a_true_conditions_reason_is_the_jobs_reason_column() -> None:
    """``status.reason`` (the REASON column of ``kubectl get trainingjobs``) is the reason of
    the condition last set true; a false one leaves it alone."""
    running = JobStatus(phase=Phase.RUNNING)
    patch = StatusPatch(running, now=NOW, generation=1).phase(Phase.FAILED)
    patch.condition("Failed", True, "PodTemplateRefused", "no").condition(
        "Ready", False, "Failed", "not ready"
    )
    assert patch.render()["reason"] == "PodTemplateRefused"
    quiet = StatusPatch(running, now=NOW, generation=1).condition("Degraded", False, "Ok", "")
    assert "reason" not in quiet.render()


def test_every_phase_change_is_checked() -> None:
    ready = {"type": "Ready", "status": "True", "lastTransitionTime": "t0"}
    running = JobStatus(phase=Phase.RUNNING, conditions=(ready,))
    patch = StatusPatch(running, now=NOW, generation=2).phase(Phase.CHECKPOINTING)
    patch.condition("Ready", True, "Running", "still ready").set({"message": "m"})
    body = patch.render()
    assert body["phase"] == "Checkpointing"
    assert body["observedGeneration"] == 2
    assert body["conditions"][0]["lastTransitionTime"] == "t0", "unchanged value keeps its time"
    with pytest.raises(ValueError, match="illegal phase change Running -> Pending"):
        StatusPatch(running, now=NOW, generation=2).phase(Phase.PENDING)
    with pytest.raises(ValueError, match=r"StatusPatch\.phase"):
        StatusPatch(running, now=NOW, generation=2).set({"phase": "Failed"})
    # A new job may fail before anything ran (a refused template), but never start Running.
    StatusPatch(JobStatus(), now=NOW, generation=1).phase(Phase.FAILED)
    with pytest.raises(ValueError, match="starts Pending"):
        StatusPatch(JobStatus(), now=NOW, generation=1).phase(Phase.RUNNING)
