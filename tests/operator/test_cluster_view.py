"""What the operator remembers about nodes and sidecars between ticks."""

from __future__ import annotations

import asyncio
import http.server
import json
import logging
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

from baton_operator import handlers
from baton_operator.client.kube import Kube
from baton_operator.client.metrics import Health, Metrics
from baton_operator.client.sidecars import SidecarStatus
from baton_operator.pure import nodes
from baton_operator.pure.reports import answers
from baton_operator.pure.settings import OperatorConfig
from baton_operator.pure.watchcache import WatchCache
from baton_operator.reconcile.controller import ClusterView, JobMemory
from kubernetes import client as k8s_client
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


def test_a_trainer_that_exits_or_restarts_wakes_its_jobs_daemon() -> None:
    wake = asyncio.Event()
    cache = WatchCache()
    memo: dict[str, Any] = {
        "config": OperatorConfig(), "wakers": {("team", "tj"): wake}, "cache": cache,
    }  # fmt: skip

    def pod(version: int, **trainer: Any) -> dict[str, Any]:
        body = _pod("tj-a0-r0", "tj", "n1")
        body["metadata"]["resourceVersion"] = str(version)
        body["status"] = {"containerStatuses": [{"name": "trainer", **trainer}]}
        return body

    def event(kind: str, body: dict[str, Any]) -> bool:
        wake.clear()
        asyncio.run(handlers._pod_event(event={"type": kind, "object": body}, body=body,
                                        memo=memo))  # fmt: skip
        return wake.is_set()

    running = {"state": {"running": {}}, "restartCount": 0}
    assert not event("ADDED", pod(1, **running)), "a trainer starting wakes nobody"
    assert not event("MODIFIED", pod(2, **running)), "nor does a routine update"
    restarted = {"state": {"running": {}}, "restartCount": 1,
                 "lastState": {"terminated": {"exitCode": 1}}}  # fmt: skip
    assert event("MODIFIED", pod(3, **restarted)), "restarted in place: its process group broke"
    assert not event("MODIFIED", pod(4, **restarted)), "the same restart again"
    assert event("MODIFIED", pod(5, state={"terminated": {"exitCode": 1}}, restartCount=1))
    assert not event("DELETED", pod(6, state={"terminated": {"exitCode": 1}}, restartCount=1))


class _NodeList(http.server.BaseHTTPRequestHandler):
    """GET /api/v1/nodes of an API server that has one Node left, n1."""

    def do_GET(self) -> None:
        if self.path.split("?")[0] != "/api/v1/nodes":
            self.send_error(404)
            return
        body = json.dumps({"kind": "NodeList", "apiVersion": "v1", "metadata": {},
                           "items": [node("n1")]}).encode()  # fmt: skip
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_a_node_deleted_during_an_api_outage_is_lost_once_calls_work_again() -> None:
    # The Node watch never announces a deletion it was down for: the operator would think n2
    # Ready and wait for its pods' graceful deletion, which no kubelet there confirms. Calls
    # working again after an outage make it list the Nodes: n2 is gone, so it is lost, and
    # the daemon of the job with a pod there is woken.
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NodeList)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    config = k8s_client.Configuration()
    config.host = f"http://127.0.0.1:{server.server_address[1]}"
    view = ClusterView(config=OperatorConfig())
    view.update_node(node("n1"), now=T0)
    view.update_node(node("n2"), now=T0)
    cache = WatchCache()
    cache.pod_event("ADDED", _pod("tj-0-0", "tj", "n2"))
    cache.pod_event("ADDED", _pod("other-0-0", "other", "n1"))
    wake, elsewhere = asyncio.Event(), asyncio.Event()
    memo: dict[str, Any] = {
        "cluster": view, "cache": cache, "kube": Kube(k8s_client.ApiClient(config)),
        "wakers": {("team", "tj"): wake, ("team", "other"): elsewhere},
    }  # fmt: skip
    try:
        asyncio.run(handlers._sweep_nodes(memo))
    finally:
        server.shutdown()
        server.server_close()
    assert view.node_lost("n2", now=T0), "a node deleted unseen is lost"
    assert view.node_ready("n1")
    assert not view.node_lost("n1", now=T0)
    assert wake.is_set()
    assert not elsewhere.is_set()
    assert view.sweep({"n1"}) == [], "nothing more to forget"


def test_only_an_outage_long_enough_to_hide_a_deletion_lists_the_nodes() -> None:
    now = [0.0]
    health = Health(clock=lambda: now[0])
    lasted: list[float] = []
    health.on_recovered(lasted.append)
    health.ok()
    assert lasted == [], "no failure, nothing recovered"
    health.failed("get: 503")
    now[0] = 12.5
    health.failed("get: no answer")
    health.ok()
    health.ok()
    assert lasted == [12.5], "called once, with the outage's length"


def test_deleted_nodes_are_remembered_for_an_hour_not_for_the_operators_life() -> None:
    """Every deleted node's name was kept for the operator's whole life (issue 25): on a spot
    cluster names are deleted all day and never come back. A deletion is remembered as long
    as pods may still name the node, then dropped."""
    view = ClusterView(config=OperatorConfig())
    every = timedelta(seconds=30)
    deletions = 10 * 24 * 120  # ten days of a spot node deleted every 30 s
    for i in range(deletions):
        when = T0 + i * every
        view.update_node(node(f"spot-{i}"), now=when)
        view.remove_node(f"spot-{i}", now=when)
        assert len(view.deleted) <= nodes.DELETED_KEPT / every + 1
    last = T0 + (deletions - 1) * every
    assert len(view.deleted) == nodes.DELETED_KEPT / every
    assert not view.nodes
    # Within the hour, a pod on a deleted node is lost; after it the name is unknown, as to
    # an operator started since (its overdue deletion makes the operator look the node up).
    assert view.node_lost(f"spot-{deletions - 1}", now=last + nodes.DELETED_KEPT / 2)
    assert not view.node_lost(f"spot-{deletions - 1}", now=last + nodes.DELETED_KEPT)
    assert not view.node_lost("spot-0", now=last)
    # A name that comes back is a live node again, and its new deletion is remembered anew.
    view.update_node(node("spot-0"), now=last)
    assert not view.node_lost("spot-0", now=last)
    assert view.sweep(set(), now=last + every) == ["spot-0"]
    assert view.node_lost("spot-0", now=last + every)
