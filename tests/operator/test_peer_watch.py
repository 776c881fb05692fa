"""A node lost without notice, judged by its Lease once the ranks stopped hearing from it
(nodes.py, suspecting.py): the verdicts alone, then the reconciler over the fakes. The real
thing (a node killed, a node frozen shorter than the window) is in test_recovery_cluster.py."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

import pytest
from baton_operator.pure.errors import KubeError
from baton_operator.pure.nodes import ClusterView, LeaseVerdict, NodeLease
from baton_operator.pure.settings import OperatorConfig
from baton_testing.reconciler_fakes import Harness

from .test_cluster_view import node

T0 = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)


def _at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def _view(window: float = 4.0) -> ClusterView:
    view = ClusterView(config=OperatorConfig(peer_lost_seconds=window, tick_seconds=1.0))
    for name in ("a", "b"):
        view.update_node(node(name), now=T0)
    return view


def test_a_suspected_node_is_lost_once_its_lease_goes_unrenewed_for_the_window() -> None:
    view = _view()
    assert view.suspect("a", "rank 0's trainer failed", now=T0)
    assert not view.suspect("a", "a second reason", now=T0), "suspected once"
    assert view.suspicion("a") == "rank 0's trainer failed"
    assert view.lease_read("a", NodeLease("r1"), now=_at(0.5)) is LeaseVerdict.WAITING
    # The window counts from the first read, on the operator's clock.
    assert view.lease_read("a", NodeLease("r1"), now=_at(4.4)) is LeaseVerdict.WAITING
    assert not view.node_lost("a", now=_at(4.4))
    assert view.lease_read("a", NodeLease("r1"), now=_at(4.5)) is LeaseVerdict.LOST
    assert view.node_lost("a", now=_at(4.5))
    assert view.node_ready("a"), "the Node watch still says Ready: the Lease judged it"
    assert not view.node_lost("b", now=_at(4.5))
    # A partition that healed: the Lease renewed again makes the node usable again.
    assert view.lease_read("a", NodeLease("r1"), now=_at(6)) is LeaseVerdict.LOST
    assert view.lease_read("a", NodeLease("r2"), now=_at(9)) is LeaseVerdict.RENEWED
    assert not view.node_lost("a", now=_at(9))
    assert view.suspicion("a") is None


def test_a_lease_renewed_within_the_window_clears_the_suspicion() -> None:
    view = _view()
    assert view.suspect("a", "rank 1's sidecar stopped answering", now=T0)
    assert view.lease_read("a", NodeLease("r1"), now=_at(0)) is LeaseVerdict.WAITING
    assert view.lease_read("a", NodeLease("r2"), now=_at(3)) is LeaseVerdict.RENEWED
    assert not view.node_lost("a", now=_at(60))
    assert view.suspect("a", "new evidence", now=_at(61)), "a new reason suspects it again"


def test_a_suspicion_nobody_reads_is_replaced_by_new_evidence_but_a_verdict_is_kept() -> None:
    view = _view()
    view.suspect("a", "old", now=T0)
    view.lease_read("a", NodeLease("r1"), now=T0)
    assert not view.suspect("a", "new", now=_at(119)), "still being judged"
    assert view.suspect("a", "new", now=_at(121)), "nobody read it for 2 minutes"
    assert view.suspicion("a") == "new"
    view.suspect("b", "x", now=T0)
    view.lease_read("b", NodeLease("r1"), now=T0)
    assert view.lease_read("b", NodeLease("r1"), now=_at(4)) is LeaseVerdict.LOST
    assert not view.suspect("b", "y", now=_at(600)), "a lost node stays lost"
    assert view.node_lost("b", now=_at(600))


def test_a_missing_lease_counts_as_unrenewed() -> None:
    view = _view()
    view.suspect("a", "x", now=T0)
    assert view.lease_read("a", None, now=_at(0)) is LeaseVerdict.WAITING
    assert view.lease_read("a", None, now=_at(4)) is LeaseVerdict.LOST


def test_the_auto_window_is_two_renew_intervals_read_from_the_lease() -> None:
    auto = ClusterView(config=OperatorConfig())
    assert auto.window(NodeLease("r", 40)) == 20, "the kubelet's default: renews every 10 s"
    assert auto.window(NodeLease("r", 8)) == 4, "the local cluster's agents: every 2 s"
    assert auto.window(NodeLease("r")) == 20, "a Lease that states no duration: the default"
    assert auto.window(None) == 20
    assert ClusterView(config=OperatorConfig(peer_lost_seconds=7)).window(NodeLease("r", 8)) == 7
    auto.update_node(node("a"), now=T0)
    auto.suspect("a", "x", now=T0)
    assert auto.waited("a") is None, "not read yet"
    auto.lease_read("a", NodeLease("r1", 8), now=T0)
    assert auto.waited("a") == 4
    assert auto.lease_read("a", NodeLease("r1", 8), now=_at(3.9)) is LeaseVerdict.WAITING
    assert auto.lease_read("a", NodeLease("r1", 8), now=_at(4)) is LeaseVerdict.LOST


def test_nothing_is_suspected_when_off_unknown_or_already_not_ready() -> None:
    off = ClusterView(config=OperatorConfig(peer_lost_seconds=0))
    off.update_node(node("a"), now=T0)
    assert not off.suspect("a", "x", now=T0)
    view = _view()
    view.update_node(node("b", ready=False), now=T0)
    assert not view.suspect("b", "x", now=T0), "NotReady: the node_lost_seconds clock runs"
    assert not view.suspect("never-seen", "x", now=T0)
    assert not view.suspect(None, "x", now=T0)
    with pytest.raises(ValueError, match="peer_lost_seconds"):
        OperatorConfig(peer_lost_seconds=-1)


def test_a_lease_is_read_at_most_every_half_tick_and_a_deleted_node_forgets() -> None:
    view = _view()
    assert not view.lease_due("a", now=T0), "not suspected: never read"
    view.suspect("a", "x", now=T0)
    assert view.lease_due("a", now=T0)
    view.lease_read("a", NodeLease("r1"), now=T0)
    assert not view.lease_due("a", now=_at(0.4))
    assert view.lease_due("a", now=_at(0.5))
    view.remove_node("a", now=_at(1))
    assert view.suspicion("a") is None


# ------------------------------------------------------------------- the reconciler


def _harness(**config: float) -> Harness:
    h = Harness(maxFailures=2, config=OperatorConfig(**config))
    h.use_memory_tier()
    h.running()
    h.kube.leases = {n: NodeLease(f"{n}-t0", 8) for n in ("n0", "n1", "n2")}
    return h


def _poll_tick(h: Harness) -> None:
    """A tick that polls the sidecars (a new attempt's first polls are paced by the clock)."""
    h.memory.next_progress_poll = None
    h.tick()


def _tick_later(h: Harness, node: str) -> None:
    """Make ``node``'s Lease due for a read, as a tick_seconds later would (the clock is real,
    and a Lease is read at most every half tick)."""
    suspicion = h.cluster.suspects[node]
    assert suspicion.last_read is not None
    suspicion.last_read -= timedelta(seconds=h.config.tick_seconds)


def _events(h: Harness, reason: str) -> list[str]:
    return [m for _, r, m in h.events if r == reason]


def test_a_survivors_failure_suspects_the_other_nodes_and_an_unrenewed_lease_recovers() -> None:
    h = _harness()
    # Rank 1's node died: ranks 0 and 2 broke on the process group and restarted in place.
    h.restarted_in_place(h.pod(0, 0), 1)
    h.restarted_in_place(h.pod(0, 2), 1)
    h.tick()
    (suspected,) = _events(h, "NodeSuspected")
    assert suspected.startswith("node n1: pod ")
    assert "as when a peer's node is lost" in suspected
    assert h.kube.lease_reads == ["n1"], "only the node of the rank that did not fail"
    assert "recovery" not in h.kube.status
    assert h.kube.status["failures"] == 0
    h.tick()
    assert len(_events(h, "NodeSuspected")) == 1, "one piece of evidence suspects once"
    assert "recovery" not in h.kube.status
    # The window passes with the Lease unrenewed (shifted, not slept: the clock is real).
    suspicion = h.cluster.suspects["n1"]
    assert suspicion.first_read is not None
    suspicion.first_read -= timedelta(seconds=4)  # the auto window of an 8 s Lease
    _tick_later(h, "n1")
    h.tick()
    assert h.cluster.node_ready("n1"), "the node never turned NotReady"
    (lost,) = _events(h, "NodeLost")
    assert "did not renew its Lease for 4 s" in lost
    status = h.kube.status
    assert [(e["rank"], e["node"]) for e in status["recovery"]["replaced"]] == [(1, "n1")]
    assert status["recovery"]["kept"] == [h.pod(0, 0), h.pod(0, 2)]
    assert "n1" in status["avoidNodes"]
    assert status["interruptions"][-1]["source"] == "node-lost"
    assert h.kube.deleted == [(h.pod(0, 1), 0)], "the lost pod goes at once"


def test_one_survivors_failure_suspects_every_other_node() -> None:
    # Three ranks; only rank 0's restart is seen so far: it casts doubt on both other nodes
    # (rank 1's and rank 2's), each suspected once for it.
    h = _harness()
    h.restarted_in_place(h.pod(0, 0), 1)
    h.tick()
    h.tick()
    suspected = _events(h, "NodeSuspected")
    assert sorted(m.split(":")[0] for m in suspected) == ["node n1", "node n2"]
    assert sorted(set(h.kube.lease_reads)) == ["n1", "n2"]


def test_a_blip_a_sidecar_falls_silent_and_its_node_renews_restarts_nothing() -> None:
    h = _harness(progress_poll_seconds=0.001)
    _poll_tick(h)  # every sidecar answers
    _poll_tick(h)
    assert not _events(h, "NodeSuspected")
    h.sidecars.reports["10.0.0.2"] = None  # rank 1's sidecar stops answering
    _poll_tick(h)
    (suspected,) = _events(h, "NodeSuspected")
    assert "node n1: rank 1's sidecar" in suspected
    assert "stopped answering" in suspected
    h.kube.leases["n1"] = NodeLease("n1-t1", 8)
    _tick_later(h, "n1")
    _poll_tick(h)
    (reachable,) = _events(h, "NodeReachable")
    assert "node n1 renewed its Lease: it is not lost" in reachable
    _poll_tick(h)
    assert len(_events(h, "NodeSuspected")) == 1, "the same silence suspects once"
    status = h.kube.status
    assert (status["phase"], status["attempt"], status["failures"]) == ("Running", 0, 0)
    assert "recovery" not in status
    assert not h.kube.deleted
    # It answers again; a later silence is new evidence.
    h.sidecars.reports["10.0.0.2"] = h.sidecars.reports["10.0.0.1"]
    _poll_tick(h)
    h.sidecars.reports["10.0.0.2"] = None
    _poll_tick(h)
    assert len(_events(h, "NodeSuspected")) == 2


def test_without_the_memory_tier_the_old_pod_on_a_lost_node_goes_at_once_and_is_avoided() -> None:
    # Rank 1's node died; ranks 0 and 2 broke on the process group and exited 1. The job
    # restarts as a new attempt (no memory tier), which waits for the old pods to be gone;
    # rank 1's never confirms a graceful delete (no kubelet), so its node is judged by its
    # Lease, and once lost its pod goes at once and the next attempt avoids the node.
    h = Harness(maxFailures=2)
    h.running()
    h.kube.leases = {n: NodeLease(f"{n}-t0", 8) for n in ("n0", "n1", "n2")}
    dead = h.pod(0, 1)
    graceful = h.kube.delete_pod

    async def no_kubelet_on_n1(namespace: str, name: str, *, grace_seconds: int | None) -> None:
        if name == dead and grace_seconds:
            h.kube.deleted.append((name, grace_seconds))
            h.kube.pods[name]["metadata"]["deletionTimestamp"] = "2026-12-04T12:00:00Z"
            return
        await graceful(namespace, name, grace_seconds=grace_seconds)

    h.kube.delete_pod = no_kubelet_on_n1  # type: ignore[method-assign]
    for rank in (0, 2):
        h.kube.pods[h.pod(0, rank)]["status"]["containerStatuses"] = [
            {"name": "trainer", "state": {"terminated": {"exitCode": 1}}}
        ]
    h.tick()
    assert h.kube.status["phase"] == "Restarting"
    (suspected,) = _events(h, "NodeSuspected")
    assert suspected.startswith("node n1: pod ")
    h.tick()  # the old pods are deleted, rank 1's gracefully: its node is not judged yet
    assert (dead, 0) not in h.kube.deleted
    assert dead in h.kube.pods
    suspicion = h.cluster.suspects["n1"]
    assert suspicion.first_read is not None
    suspicion.first_read -= timedelta(seconds=4)
    _tick_later(h, "n1")
    h.tick()
    (lost,) = _events(h, "NodeLost")
    assert lost.startswith("node n1 is lost")
    assert (dead, 0) in h.kube.deleted, "removed at once once its node is lost"
    assert "n1" in h.kube.status["avoidNodes"]
    # (The next attempt's pods carry avoidNodes as a NotIn node affinity: creating.py.)


def test_a_refused_lease_read_is_said_once_and_leaves_the_notready_path(
    caplog: pytest.LogCaptureFixture,
) -> None:
    h = _harness()
    h.kube.lease_error = KubeError.from_answer("leases is forbidden", status=403)
    h.restarted_in_place(h.pod(0, 0), 1)
    h.restarted_in_place(h.pod(0, 2), 1)
    with caplog.at_level(logging.WARNING, logger="baton_operator.suspecting"):
        h.tick()
        h.tick()
    said = [r.getMessage() for r in caplog.records if "cannot read node Leases" in r.getMessage()]
    assert len(said) == 1
    assert "kube-node-lease" in said[0]
    assert "recovery" not in h.kube.status
    h.node("n1", ready=False, for_seconds=h.config.node_lost_seconds + 1)
    h.tick()
    assert [e["rank"] for e in h.kube.status["recovery"]["replaced"]] == [1]
