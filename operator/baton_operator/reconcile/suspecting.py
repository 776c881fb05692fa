"""Nodes a job's ranks stopped hearing from: suspected at once, lost once their Lease says so.

A node lost without notice looks Ready for the node-monitor grace period (50 s by default),
then NotReady for ``node_lost_seconds``, before the Node watch calls it lost (nodes.py). The
job's ranks know much sooner: a peer's collective breaks and the survivors' trainers fail (a
memory-tier trainer is restarted in place), and a sidecar that had answered stops answering.
Neither is proof: a crash breaks the collective too, and a network blip silences a sidecar
for a while. So :class:`PeerWatch` only *suspects* the nodes concerned
(:meth:`ClusterView.suspect <baton_operator.pure.nodes.ClusterView.suspect>`) and reads
their node Lease at each tick: a kubelet that has not renewed it over a window of the
operator's watching (two of its renew intervals by default; ``peer_lost_seconds``) is gone,
the verdict the NotReady path reaches tens of seconds later, and one that renews clears the
suspicion (a blip: nothing restarts). Each step is an
Event on the job, so the on-call engineer sees why a pod was replaced, or why it was not.

Without the memory tier a rank's failure restarts the whole job at once (lifecycle.classify),
and the verdict still matters: the old attempt's pod on a lost node never confirms its
graceful deletion (no kubelet), and the next attempt waits until it is gone, so
:meth:`PeerWatch.judge` also runs on an old attempt's pods (the controller's restart path),
and a lost node's pod is then deleted at once and the node avoided. A silent sidecar is a
reason for every job: a node frozen or cut off breaks nothing visible until the collective
times out.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from baton_operator.pure.errors import KubeError
from baton_operator.pure.lifecycle import RankView
from baton_operator.pure.nodes import LeaseVerdict
from baton_operator.pure.pods import restarted
from baton_operator.pure.settings import EMERGENCY_EXIT_CODE
from baton_operator.pure.tick import Tick

from .services import Room, Services

__all__ = ["PeerWatch"]

_log = logging.getLogger("baton_operator.suspecting")


class PeerWatch(Room):
    """Suspects the nodes a job's ranks stopped hearing from and judges them by their Lease."""

    def __init__(self, services: Services) -> None:
        super().__init__(services)
        self._lease_refused = False
        """A Lease read was refused (said once per operator, not at every tick)."""

    async def watch(self, t: Tick) -> bool:
        """Suspect, read the suspected nodes' Leases, judge. Returns True when a node of this
        job was judged lost at this tick: the caller rebuilds its rank views."""
        if self._config.peer_lost_seconds == 0:
            return False
        for node, reason, key in self._reasons(t):
            # One piece of evidence (a restart, an exit, a silence) may cast doubt on several
            # nodes: each is suspected once for it.
            mark = f"{key}@{node}"
            if mark in t.memory.suspected:
                continue
            t.memory.suspected.add(mark)
            if self._cluster.suspect(node, reason, now=t.now):
                await self._event(
                    t.job, "Normal", "NodeSuspected",
                    f"node {node}: {reason}; it is lost if its kubelet does not renew its "
                    f"Lease within {_window(self._config.peer_lost_seconds)}",
                )  # fmt: skip
        return bool(await self.judge(t, {v.node for v in t.views if v.node}))

    async def judge(self, t: Tick, nodes: Iterable[str]) -> set[str]:
        """Read the Lease of each suspected node among ``nodes`` that is due, post what it
        says, and return the nodes judged lost at this read. Also for an old attempt's pods:
        a pod on a lost node is deleted at once, not after NotReady."""
        lost: set[str] = set()
        for node in sorted(set(nodes)):
            if not self._cluster.lease_due(node, now=t.now):
                continue
            try:
                lease = await self._kube.node_lease(node)
            except KubeError as e:
                if not self._lease_refused:
                    self._lease_refused = True
                    _log.warning(
                        "cannot read node Leases (%s): a node lost without notice waits for "
                        "NotReady and --node-lost-seconds; grant get on leases in "
                        "kube-node-lease (deploy/rbac.yaml and the chart do)", e,
                    )  # fmt: skip
                continue
            reason = self._cluster.suspicion(node) or ""
            was_lost = self._cluster.node_lost(node, now=t.now)
            verdict = self._cluster.lease_read(node, lease, now=t.now)
            if verdict is LeaseVerdict.RENEWED:
                await self._event(
                    t.job, "Normal", "NodeReachable",
                    f"node {node} renewed its Lease: it is not lost ({reason}); nothing is "
                    "replaced",
                )  # fmt: skip
            elif verdict is LeaseVerdict.LOST and not was_lost:
                lost.add(node)
                await self._event(
                    t.job, "Warning", "NodeLost",
                    f"node {node} is lost: its kubelet did not renew its Lease for "
                    f"{self._cluster.waited(node) or 0:g} s after the ranks stopped hearing "
                    f"from it ({reason})",
                )  # fmt: skip
        return lost

    def _reasons(self, t: Tick) -> list[tuple[str, str, str]]:
        """(node, reason, key) for each node this tick gives a reason to suspect; ``key``
        names the evidence, so that one piece of evidence suspects a node once."""
        out: list[tuple[str, str, str]] = []
        views = [v for v in t.views if v.exists and v.node and not v.node_lost]
        accounted: Mapping[str, Any] = (t.job.get("status") or {}).get("trainerRestarts") or {}
        broken: dict[int, tuple[str, str]] = {
            p.rank: (
                f"pod {p.name}'s trainer failed (exit {p.trainer_last_exit}) and restarted",
                f"{p.name}:restart:{p.trainer_restarts}",
            )
            for p in restarted(t.current.values(), accounted)
        }
        for v in t.views:
            if v.exit_code not in (None, 0, EMERGENCY_EXIT_CODE) and not v.committed_notice:
                broken.setdefault(
                    v.rank,
                    (f"pod {v.pod}'s trainer exited with code {v.exit_code}", f"{v.pod}:exit"),
                )
        broken_nodes = {v.node for v in t.views if v.rank in broken}
        for rank, (what, key) in sorted(broken.items()):
            for v in _peers_of(views, rank, broken, broken_nodes):
                assert v.node is not None
                out.append((v.node, f"{what}, as when a peer's node is lost", key))
        for s in views:
            if s.rank in t.memory.silent and s.node and s.running and not s.disrupted:
                out.append(
                    (s.node, f"rank {s.rank}'s sidecar (pod {s.pod}) stopped answering",
                     f"{s.pod}:silent")
                )  # fmt: skip
        return out


def _window(configured: float | None) -> str:
    """The window as an Event says it (``auto``: read from the node's Lease)."""
    if configured is None:
        return "two of its renew intervals"
    return f"{configured:g} s"


def _peers_of(
    views: list[RankView], rank: int, broken: Mapping[int, object], broken_nodes: set[str | None]
) -> list[RankView]:
    """The ranks whose node a failure of ``rank`` casts doubt on: those that did not fail,
    on a node where no rank failed (a node that restarted a trainer is alive)."""
    return [
        v
        for v in views
        if v.rank != rank
        and v.rank not in broken
        and v.node not in broken_nodes
        and v.exit_code is None
    ]
