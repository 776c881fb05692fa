"""The memory tier's replica targets: tell each pod's sidecar its peers' failure domains.

A pod's sidecar starts with its peers in its environment (``manifests.replication_peers``:
the other pods by DNS name, in rank order, domains unknown), because pods are created before
they are placed. Once every pod of the attempt is on a node, the operator knows each peer's
node, zone and capacity pool, and sends every sidecar its ring of peers ordered so that its
copies go to another zone, else another pool, wherever the placement allows, with each peer's
node as its domain (``PUT /v1/replication/peers``, with the job's token like every sidecar
call). It sends again only when that changes (a pod replaced on another node); a sidecar that
does not answer yet is asked again at the next tick. The environment's list stays correct in
the meantime: the ranks' anti-affinity already puts every pod on a node of its own.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Final

from baton_operator.pure import manifests
from baton_operator.pure.errors import SidecarUnreachableError
from baton_operator.pure.pods import PodView
from baton_operator.pure.tick import Tick

from .services import Room, Services

__all__ = ["PeerWiring"]

_log = logging.getLogger("baton_operator.replicating")

_RETRY_SECONDS: Final = 5.0
"""After a sidecar did not answer, wait this long before asking it again: a hung sidecar
must not cost every tick a request timeout (the environment's peers serve meanwhile)."""


class PeerWiring(Room):
    """What each job's sidecars were last told; one per operator (the controller's)."""

    def __init__(self, services: Services) -> None:
        super().__init__(services)
        self._sent: dict[tuple[str, str], dict[str, str]] = {}
        """(namespace, job) -> pod UID -> the body its sidecar acknowledged (JSON)."""
        self._retry_at: dict[str, float] = {}
        """Pod UID -> when (monotonic) to ask a sidecar that did not answer again."""

    def forget(self, namespace: str, name: str) -> None:
        """The job was deleted."""
        for uid in self._sent.pop((namespace, name), {}):
            self._retry_at.pop(uid, None)

    async def sync(self, t: Tick, *, replicas: int) -> None:
        """Send each sidecar of the attempt its peers, once all ``replicas`` pods are placed
        and running, where it differs from what that pod's sidecar last acknowledged."""
        spec, token = t.spec, t.memory.token
        if spec.fast is None or replicas < 2 or token is None:
            return
        ready: list[tuple[int, PodView, str]] = []
        placed: dict[int, tuple[str, str | None, str | None]] = {}
        for rank in range(replicas):
            pod = t.current.get(rank)
            if pod is None or not pod.node or not pod.ip or pod.deleting or pod.finished:
                return
            ready.append((rank, pod, pod.ip))
            cluster = self._cluster
            placed[rank] = (pod.node, cluster.zone_of(pod.node), cluster.pool_of(pod.node))
        bodies = manifests.peers_update(spec, self._config, attempt=t.status.attempt, placed=placed)
        sent = self._sent.setdefault((spec.namespace, spec.name), {})
        uids = set()
        for rank, pod, ip in ready:
            uid = str((pod.body.get("metadata") or {}).get("uid", pod.name))
            uids.add(uid)
            body = json.dumps(bodies[rank], sort_keys=True)
            if sent.get(uid) == body or self._retry_at.get(uid, 0.0) > time.monotonic():
                continue
            try:
                await self._sidecars.set_peers(ip, token, bodies[rank])
            except SidecarUnreachableError as e:
                _log.debug("peers of %s not set yet: %s", pod.name, e)
                self._retry_at[uid] = time.monotonic() + _RETRY_SECONDS
                continue
            self._retry_at.pop(uid, None)
            sent[uid] = body
            _log.info(
                "replication peers of %s: %s",
                pod.name,
                ", ".join(f"{p['address']} [{p['domain']}]" for p in bodies[rank]["peers"]),
            )
        for uid in set(sent) - uids:
            del sent[uid]
            self._retry_at.pop(uid, None)
