"""The reconciler's disruption hints, adaptive checkpoint interval and deletion cost, tick by
tick against the fakes of ``baton_testing.reconciler_fakes`` (the pure rules are in
test_disruption_hints.py and test_adaptive_interval.py)."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from baton_operator.pure.disruption import DELETION_COST
from baton_operator.pure.errors import KubeError
from baton_operator.pure.model import JobSpec
from baton_operator.pure.pods import PodView
from baton_operator.pure.reports import SidecarStatus
from baton_operator.reconcile.controller import JobMemory
from baton_testing.reconciler_fakes import JOB, NS, REPLICAS, FakeKube, Harness

HINTS = {
    "karpenter.sh/do-not-disrupt": "true",
    "cluster-autoscaler.kubernetes.io/safe-to-evict": "false",
}


def _annotations(h: Harness, attempt: int) -> list[dict[str, str]]:
    return [
        dict(h.kube.pods[h.pod(attempt, r)]["metadata"].get("annotations") or {})
        for r in range(REPLICAS)
    ]


def test_pods_carry_the_disruption_hints_exactly_while_the_notice_save_is_in_flight() -> None:
    h = Harness()
    h.running()
    assert h.kube.annotation_patches == [], "no hint while nothing is being saved"
    # What the API server holds when each request goes out.
    seen: list[tuple[str, int]] = []
    ask = h.sidecars.request_checkpoint

    async def request(ip: str, token: str, *, deadline: datetime, reason: str) -> str:
        seen.append((h.kube.status["phase"], len(h.kube.annotation_patches)))
        return await ask(ip, token, deadline=deadline, reason=reason)

    h.sidecars.request_checkpoint = request  # type: ignore[method-assign]
    h.spot_notice("n1")
    h.tick()  # Checkpointing: the requests first (the deadline's path), then record, hints
    assert h.kube.status["phase"] == "Checkpointing"
    assert seen == [("Running", 0)] * REPLICAS, "every request before any write"
    assert h.kube.status["notice"]["requestIds"] == [f"req-10.0.0.{r + 1}" for r in range(3)]
    assert h.kube.status["notice"]["requestedAt"] == h.kube.status["notice"]["receivedAt"]
    assert _annotations(h, 0) == [HINTS] * REPLICAS
    h.report_all(state="saving", trigger="notice")
    patches = len(h.kube.annotation_patches)
    h.tick()
    h.tick()
    assert len(h.kube.annotation_patches) == patches, "a steady state makes no API call"
    # Pods are deleted gracefully: the fake keeps them, as the API server does, so the hints
    # must be off them before they go.
    h.kube.delete_pod = _keep_deleting(h.kube)  # type: ignore[method-assign]
    h.report_all(state="committed", step=40, trigger="notice", uri="s3://bucket/tj", seconds=1.5)
    h.tick()
    assert h.kube.status["phase"] == "Restarting"
    assert _annotations(h, 0) == [{}] * REPLICAS


def _keep_deleting(kube: FakeKube) -> Callable[..., Any]:
    async def delete(namespace: str, name: str, *, grace_seconds: int | None) -> None:
        kube.deleted.append((name, grace_seconds))
        if name in kube.pods:
            kube.pods[name]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"

    return delete


def test_a_node_deleted_unseen_under_an_overdue_deletion_is_lost_and_its_pod_removed() -> None:
    # The noticed machine went while the Node watch was down (an API outage): the operator
    # still thinks n1 Ready, and its pod's graceful deletion has no kubelet to end it. Once
    # the deletion is overdue the operator looks the Node up, finds it gone, and removes the
    # pod at once instead of waiting minutes for the pod garbage collector.
    h = Harness()
    h.running()
    h.spot_notice("n1")
    h.tick()
    h.kube.delete_pod = _keep_deleting(h.kube)  # type: ignore[method-assign]
    h.report_all(state="committed", step=40, trigger="notice", uri="s3://bucket/tj", seconds=1.5)
    h.tick()
    assert h.kube.status["phase"] == "Restarting"
    graceful = [(n, g) for n, g in h.kube.deleted if g]
    assert len(graceful) == REPLICAS, h.kube.deleted
    h.kube.nodes.discard("n1")  # deleted while the watch was down: never announced
    assert h.cluster.node_ready("n1")
    h.tick()
    assert h.cluster.node_lost("n1", now=datetime.now(tz=UTC))
    assert (h.pod(0, 1), 0) in h.kube.deleted, h.kube.deleted
    forced = [n for n, g in h.kube.deleted if g == 0]
    assert forced == [h.pod(0, 1)], "only the pod on the vanished node is forced"
    # The nodes that exist were looked up once each; the next tick does not ask again.
    assert sorted(h.kube.node_lookups, key=str) == ["n0", "n1", "n2"]
    h.tick()
    assert sorted(h.kube.node_lookups, key=str) == ["n0", "n1", "n2"]


def test_the_node_lookups_under_overdue_deletions_are_not_kept_for_ever() -> None:
    # A spot cluster: node after node goes, each under a pod whose deletion is overdue, and
    # no name comes back. Each node is looked up (at most once per period), and a lookup
    # older than the period is forgotten: what the operator keeps stays bounded however many
    # nodes come and go in its life.
    h = Harness()
    spec = JobSpec.from_body(h.kube.job)
    actions = h.reconciler._actions
    start = datetime.now(tz=UTC)
    period = timedelta(seconds=11)  # longer than the lookup period (10 s)
    kept = []
    for i in range(40):
        node = f"spot-{i}"
        h.node(node)
        body = {
            "metadata": {
                "name": f"pod-{i}",
                "uid": f"uid-{i}",
                "labels": {},
                "deletionTimestamp": "2026-01-01T00:00:00Z",
            },
            "spec": {"nodeName": node},
            "status": {"phase": "Running"},
        }
        now = start + i * period
        asyncio.run(actions.delete_pods(spec, [PodView.from_body(body)], now))
        asyncio.run(actions.delete_pods(spec, [PodView.from_body(body)], now))
        kept.append(len(actions._node_checked))
    assert h.kube.node_lookups == [f"spot-{i}" for i in range(40)], "once per node and period"
    assert max(kept) == 1, kept


def test_the_hints_go_when_the_save_times_out_and_falls_back() -> None:
    h = Harness()
    h.running()
    h.spot_notice("n0")
    h.tick()
    assert _annotations(h, 0) == [HINTS] * REPLICAS
    h.kube.delete_pod = _keep_deleting(h.kube)  # type: ignore[method-assign]
    h.report_all(state="failed", trigger="notice", error="deadline passed")
    h.tick()
    assert h.kube.status["phase"] == "Restarting"
    assert _annotations(h, 0) == [{}] * REPLICAS


def test_a_restarted_operator_derives_the_hints_from_the_status_alone() -> None:
    h = Harness()
    h.running()
    h.spot_notice("n1")
    h.tick()
    # Another operator (no memory of this one) finds the job Checkpointing and pods without
    # hints (the first died between its status write and its patches): it puts them on.
    for r in range(REPLICAS):
        h.kube.pods[h.pod(0, r)]["metadata"].pop("annotations", None)
    h.memory = JobMemory()
    h.tick()
    assert h.kube.status["phase"] == "Checkpointing"
    assert _annotations(h, 0) == [HINTS] * REPLICAS
    # The first operator died after the restart decision but before taking the hints off and
    # deleting the pods: the next one takes them off the old attempt's pods.
    h.kube.status.update(phase="Restarting", attempt=1, restartAfter=None)
    h.kube.status.pop("notice", None)
    h.kube.delete_pod = _keep_deleting(h.kube)  # type: ignore[method-assign]
    h.memory = JobMemory()
    h.tick()
    assert _annotations(h, 0) == [{}] * REPLICAS


def test_hints_the_template_sets_itself_are_the_users_and_left_alone() -> None:
    h = Harness()
    h.kube.job["spec"]["template"]["metadata"] = {
        "annotations": {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"}
    }
    h.running()
    h.spot_notice("n1")
    h.tick()
    assert _annotations(h, 0) == [HINTS] * REPLICAS
    assert {k for _, p in h.kube.annotation_patches for k in p} == {"karpenter.sh/do-not-disrupt"}
    h.kube.delete_pod = _keep_deleting(h.kube)  # type: ignore[method-assign]
    h.report_all(state="committed", step=40, trigger="notice", uri="s3://bucket/tj", seconds=1.5)
    h.tick()
    assert (
        _annotations(h, 0)
        == [{"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"}] * REPLICAS
    )


def test_a_refused_hint_never_holds_up_the_save_and_is_tried_again() -> None:
    h = Harness()
    h.running()
    h.spot_notice("n1")
    h.kube.patch_errors = [
        KubeError.from_answer("patching pod: HTTP 403: forbidden (test)", status=403)
    ] * REPLICAS
    h.tick()
    assert h.kube.status["phase"] == "Checkpointing"
    assert _annotations(h, 0) == [{}] * REPLICAS
    h.report_all(state="requested")
    h.tick()  # the requests go out all the same, and the hints are tried again
    assert len(h.sidecars.requests) == REPLICAS
    assert _annotations(h, 0) == [HINTS] * REPLICAS


# ----------------------------------------------------------------- adaptive interval


def test_auto_interval_is_recorded_before_the_first_pod_and_rechosen_after_a_preemption() -> None:
    h = Harness()
    h.kube.job["spec"]["checkpoint"]["everySeconds"] = "auto"
    h.kube.job["metadata"]["creationTimestamp"] = datetime.now(tz=UTC).isoformat()
    h.running()
    first = copy.deepcopy(h.kube.status["checkpointInterval"])
    # Recorded in the write before rank 0 was created, so a restarted operator reads it back.
    write = next(i for i, w in enumerate(h.kube.writes) if "checkpointInterval" in w)
    assert write < len(h.kube.writes) - 1
    assert first["attempt"] == 0
    assert (first["saveMeasured"], first["interruptions"], first["source"]) == (False, 0, "prior")
    assert first["nodes"] == REPLICAS
    seconds = {h.env_of(0, r)["BATON_EVERY_SECONDS"] for r in range(REPLICAS)}
    assert seconds == {str(first["seconds"])}, "every rank of the attempt gets the same value"

    h.spot_notice("n1")
    h.tick()
    h.report_all(state="committed", step=40, trigger="notice", uri="s3://bucket/tj", seconds=1.5)
    h.tick()
    h.tick()  # Restarting -> Pending: attempt 1's rank 0, with an interval chosen afresh
    second = h.kube.status["checkpointInterval"]
    assert second["attempt"] == 1
    assert (second["saveSeconds"], second["saveMeasured"]) == (1.5, True)
    assert (second["interruptions"], second["source"]) == (1, "job")
    assert second["nodeSeconds"] >= 0
    assert second["seconds"] < first["seconds"], (first, second)
    assert h.kube.status["exposure"]["interruptions"] == 1
    assert "current" not in h.kube.status["exposure"], "the attempt's clock stopped"
    assert h.env_of(1, 0)["BATON_EVERY_SECONDS"] == str(second["seconds"])
    h.memory = JobMemory()  # a restarted operator: the recorded choice, not a new one
    h.kube.run(h.pod(1, 0), node="n0", ip="10.0.0.1")
    h.tick()
    assert h.kube.status["checkpointInterval"] == second
    assert h.env_of(1, 1)["BATON_EVERY_SECONDS"] == str(second["seconds"])
    gauge = h.registry.get_sample_value(
        "baton_checkpoint_interval_seconds", {"namespace": NS, "job": JOB}
    )
    assert gauge == second["seconds"]


def _pool_node(h: Harness, name: str, *, taints: tuple[dict[str, Any], ...] = ()) -> None:
    """The Node watch reports ``name``, Ready, in the node pool ``spot``."""
    h.cluster.update_node(
        {
            "metadata": {"name": name, "labels": {"karpenter.sh/nodepool": "spot"}},
            "spec": {"taints": list(taints)},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        },
        now=datetime.now(tz=UTC),
    )


def _commit_notice(h: Harness, node: str, step: int) -> None:
    """A spot notice on ``node`` (in the pool), every rank's save of ``step`` committed, and
    the next attempt's rank 0 created (its interval chosen)."""
    _pool_node(h, node, taints=({"key": "aws-node-termination-handler/spot-itn",
                                 "effect": "NoSchedule"},))  # fmt: skip
    h.tick()
    h.report_all(state="committed", step=step, trigger="notice", uri="s3://bucket/tj", seconds=1.5)
    h.tick()
    h.tick()


def test_auto_interval_reads_the_node_pools_rate_once_the_job_ran_there() -> None:
    h = Harness()
    h.kube.job["spec"]["checkpoint"]["everySeconds"] = "auto"
    h.kube.job["metadata"]["creationTimestamp"] = datetime.now(tz=UTC).isoformat()
    h.running()  # attempt 0 on n0..n2, not labelled yet: its nodes are in no known pool
    assert h.kube.status["exposure"]["current"]["nodes"] == REPLICAS
    assert h.kube.status["exposure"]["current"]["pools"] == []
    first = copy.deepcopy(h.kube.status["checkpointInterval"])
    for i in range(6):
        _pool_node(h, f"n{i}")
    _commit_notice(h, "n1", 40)
    second = copy.deepcopy(h.kube.status["checkpointInterval"])
    # Attempt 0 ran in no known pool: the job's own rate (the noticed node's pool counted it).
    assert (second["attempt"], second["source"], second["interruptions"]) == (1, "job", 1)
    pools = h.kube.status["exposure"]["pools"]
    assert pools == [{"pool": "karpenter.sh/nodepool=spot", "nodeSeconds": 0.0, "interruptions": 1}]
    # Attempt 1 runs on three nodes of the pool, then is preempted too.
    ips = {0: "n0", 1: "n3", 2: "n4"}
    h.kube.run(h.pod(1, 0), node=ips[0], ip="10.0.0.1")
    h.tick()
    for rank in range(1, REPLICAS):
        h.kube.run(h.pod(1, rank), node=ips[rank], ip=f"10.0.0.{rank + 1}")
    for rank in range(REPLICAS):
        h.sidecars.reports[f"10.0.0.{rank + 1}"] = SidecarStatus(state="idle")
    h.tick()
    exposure = h.kube.status["exposure"]
    assert h.kube.status["phase"] == "Running"
    assert exposure["current"]["pools"] == [{"pool": "karpenter.sh/nodepool=spot", "nodes": 3}]
    assert exposure["pool"] == "karpenter.sh/nodepool=spot"
    _commit_notice(h, "n3", 60)
    third = h.kube.status["checkpointInterval"]
    assert third["attempt"] == 2
    assert (third["source"], third["pool"]) == ("pool", "karpenter.sh/nodepool=spot")
    assert third["interruptions"] == 2
    assert third["mtbiSeconds"] < second["mtbiSeconds"] < first["mtbiSeconds"]
    assert third["seconds"] <= second["seconds"] < first["seconds"]
    assert h.env_of(2, 0)["BATON_EVERY_SECONDS"] == str(third["seconds"])


def test_the_deletion_cost_follows_the_work_since_the_commit_and_goes_when_switched_off() -> None:
    h = Harness()
    h.kube.job["spec"]["disruption"] = {"deletionCost": True}
    h.running()
    at = datetime.now(tz=UTC)
    h.kube.status["lastCheckpoint"] = {"step": 20, "trigger": "periodic"}
    h.training("10.0.0.", step=30, at=at)
    h.tick()
    # No GPUs: the steps since the commit, on every running rank.
    assert [a.get(DELETION_COST) for a in _annotations(h, 0)] == ["10"] * REPLICAS
    written = len(h.kube.annotation_patches)
    h.training("10.0.0.", step=31, at=at)
    h.tick()
    assert len(h.kube.annotation_patches) == written, "a change of a tenth waits for the period"
    # A periodic commit of step 31: the work at risk falls to 0, written at once.
    h.training("10.0.0.", step=31, at=at, last_committed_step=31)
    h.tick()
    assert h.kube.status["lastCheckpoint"]["step"] == 31
    assert [a.get(DELETION_COST) for a in _annotations(h, 0)] == ["0"] * REPLICAS
    h.kube.job["spec"]["disruption"] = {"deletionCost": False}
    h.memory.next_progress_poll = None
    h.tick()
    assert [DELETION_COST in a for a in _annotations(h, 0)] == [False] * REPLICAS
