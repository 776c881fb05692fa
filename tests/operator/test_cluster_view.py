"""What the operator remembers about nodes and sidecars between ticks."""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime, timedelta
from typing import Any

from baton_operator import handlers
from baton_operator.controller import ClusterView, JobMemory
from baton_operator.metrics import Metrics
from baton_operator.reports import answers
from baton_operator.settings import OperatorConfig
from baton_operator.sidecars import SidecarStatus
from baton_operator.watchcache import WatchCache
from prometheus_client import CollectorRegistry

T0 = datetime(2026, 11, 30, 4, 0, tzinfo=UTC)


def node(name: str, *, ready: bool = True, since: str = "2026-11-30T04:00:00Z",
         taints: list[dict[str, Any]] | None = None) -> dict[str, Any]:  # fmt: skip
    return {
        "metadata": {"name": name},
        "spec": {"taints": taints or []},
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "Unknown",
                                   "lastTransitionTime": since}]},
    }  # fmt: skip


def test_node_lost_after_the_configured_time_or_when_deleted() -> None:
    view = ClusterView(config=OperatorConfig(node_lost_seconds=20))
    view.update_node(node("a", ready=False), now=T0)
    assert view.node_lost("a", now=T0 + timedelta(seconds=19)) is False
    assert view.node_lost("a", now=T0 + timedelta(seconds=20)) is True
    view.update_node(node("b"), now=T0)
    assert view.node_lost("b", now=T0 + timedelta(hours=1)) is False
    assert view.node_ready("b")
    view.remove_node("b")
    assert view.node_lost("b", now=T0) is True
    assert view.node_lost("never-seen", now=T0) is False
    assert view.node_lost(None, now=T0) is False


def test_a_notice_is_fresh_once_and_keeps_its_first_deadline() -> None:
    view = ClusterView(config=OperatorConfig())
    taint = [{"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}]
    fresh = view.update_node(node("a", taints=taint), now=T0)
    assert [n.source for n in fresh] == ["karpenter"]
    again = view.update_node(node("a", taints=taint), now=T0 + timedelta(seconds=50))
    assert again == [], "a re-listed notice is not new"
    (kept,) = view.notices_on("a")
    assert kept.deadline == T0 + timedelta(seconds=120), "the first deadline is kept"
    view.update_node(node("a"), now=T0 + timedelta(seconds=60))
    assert view.notices_on("a") == []


def test_only_a_save_for_a_notice_answers_a_request() -> None:
    periodic = SidecarStatus(state="committed", step=10, trigger="periodic")
    ours = SidecarStatus(state="committed", step=12, trigger="notice", request_id="r1")
    signal = SidecarStatus(state="committed", step=12, trigger="signal")
    requested = SidecarStatus(state="requested", request_id="r1")
    assert not answers(periodic, "r1")
    assert answers(ours, "r1")
    assert answers(signal, "r1"), "SIGTERM and the request are served by one save"
    assert not answers(requested, "r1")
    assert answers(ours, ""), "when the POST got no id, a notice save still answers"


def test_memory_tells_a_served_notice_and_forgets_old_attempts() -> None:
    memory = JobMemory()
    memory.for_attempt(0)
    memory.reports[1] = SidecarStatus(state="committed", step=12, trigger="notice")
    memory.reports[0] = SidecarStatus(state="committed", step=10, trigger="periodic")
    assert memory.served_notice(1)
    assert not memory.served_notice(0)
    memory.for_attempt(0)
    assert memory.served_notice(1)
    memory.for_attempt(1)
    assert not memory.served_notice(1)


def _pod(name: str, job: str, node: str | None) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "team", "resourceVersion": "5",
                     "labels": {"baton.dev/job": job}},
        "spec": {"nodeName": node} if node else {},
    }  # fmt: skip


def test_only_a_change_that_matters_wakes_the_jobs_daemons() -> None:
    wake = asyncio.Event()
    elsewhere, pending = asyncio.Event(), asyncio.Event()
    cache = WatchCache()
    # The watch cache's node index: tj has a pod on n1; the other jobs have none there.
    cache.pod_event("ADDED", _pod("tj-0-0", "tj", "n1"))
    cache.pod_event("ADDED", _pod("other-0-0", "other", "n2"))
    cache.pod_event("ADDED", _pod("pending-0-0", "pending", None))
    memo: dict[str, Any] = {
        "cluster": ClusterView(config=OperatorConfig()),
        "metrics": Metrics(CollectorRegistry()),
        "wakers": {("team", "tj"): wake, ("team", "other"): elsewhere,
                   ("team", "pending"): pending},
        "cache": cache,
    }  # fmt: skip

    def node(*taints: dict[str, Any], ready: bool = True) -> dict[str, Any]:
        condition = {"type": "Ready", "status": "True" if ready else "False"}
        return {"metadata": {"name": "n1"}, "spec": {"taints": list(taints)},
                "status": {"conditions": [condition]}}  # fmt: skip

    def event(kind: str, body: dict[str, Any]) -> bool:
        wake.clear()
        asyncio.run(
            handlers._node_event(
                event={"type": kind}, body=body, memo=memo, logger=logging.getLogger("test")
            )
        )
        return wake.is_set()

    assert event("ADDED", node()), "a node newly Ready"
    assert not event("MODIFIED", node()), "a routine status update wakes nobody"
    spot = {"key": "aws-node-termination-handler/spot-itn", "effect": "NoSchedule"}
    assert event("MODIFIED", node(spot)), "a new notice"
    assert not event("MODIFIED", node(spot)), "the same notice again"
    assert event("MODIFIED", node(spot, ready=False)), "readiness lost"
    assert event("DELETED", node(spot, ready=False)), "the node is gone"
    # Only the jobs with a pod on the node are woken, however many others there are.
    assert not elsewhere.is_set()
    assert not pending.is_set()
