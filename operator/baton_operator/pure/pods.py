"""A typed view of one of a job's pods, and the decisions the controller takes about pods.

Pure. The controller lists the job's pods, parses each once into a :class:`PodView`, and asks
here: which notice (if any) the current attempt must serve (:func:`notice_for`), which nodes
to avoid after it (:func:`noticed_nodes`), how to delete a pod (:func:`delete_grace`), and what
the state machine sees of each rank (:func:`rank_view`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from . import manifests
from .jobstatus import JobStatus
from .lifecycle import RankView
from .nodes import ClusterView
from .notices import Graces, Notice, earliest, pod_notice
from .reports import SidecarStatus

__all__ = [
    "PodView",
    "delete_grace",
    "notice_for",
    "noticed_nodes",
    "rank_view",
    "restarted",
]

_FINISHED = ("Succeeded", "Failed")

_log = logging.getLogger("baton_operator.pods")


def _label_int(labels: Mapping[str, Any], key: str) -> int:
    try:
        return int(labels.get(key, -1))
    except ValueError:
        return -1


@dataclass(frozen=True, kw_only=True)
class PodView:
    """The parts of a pod the operator reads (``body`` is kept for the notice parsers)."""

    name: str
    uid: str
    """``metadata.uid``: tells a pod replaced under the same name from the one it replaced."""
    rank: int
    """From the rank label; -1 when it is missing or not a number."""
    attempt: int
    """From the attempt label; -1 when it is missing or not a number."""
    node: str | None
    ip: str | None
    phase: str
    deleting: bool
    """The pod has a ``deletionTimestamp``."""
    trainer_running: bool
    trainer_exit_code: int | None
    """The trainer container's exit code once it terminated (for good: a container that the
    kubelet restarts in place shows ``waiting``, its exit in ``lastState``)."""
    trainer_restarts: int
    """The trainer container's ``restartCount``: in-place restarts by the kubelet (the
    memory tier's restart rules, manifests.py)."""
    trainer_last_exit: int | None
    """The exit code of the trainer's previous run (``lastState.terminated``), if any."""
    unschedulable: bool
    """``PodScheduled`` is False for reason Unschedulable."""
    sidecar_final: SidecarStatus | None
    """The sidecar's last report, from its termination message once it has ended: what an
    operator that could not poll it (a new leader, one back from an API outage) learns of
    the save it served."""
    body: Mapping[str, Any]

    @property
    def finished(self) -> bool:
        """The pod itself ended (Succeeded or Failed)."""
        return self.phase in _FINISHED

    @classmethod
    def from_body(cls, pod: Mapping[str, Any]) -> PodView:
        """Parse a pod as the API returns it."""
        meta: Mapping[str, Any] = pod.get("metadata") or {}
        spec: Mapping[str, Any] = pod.get("spec") or {}
        status: Mapping[str, Any] = pod.get("status") or {}
        labels: Mapping[str, Any] = meta.get("labels") or {}
        running, exit_code, restarts, last_exit = _trainer(status)
        unschedulable = any(
            c.get("type") == "PodScheduled"
            and c.get("status") == "False"
            and c.get("reason") == "Unschedulable"
            for c in status.get("conditions") or []
        )
        return cls(
            sidecar_final=_sidecar_final(status),
            name=str(meta.get("name", "")),
            uid=str(meta.get("uid", "")),
            rank=_label_int(labels, manifests.RANK_LABEL),
            attempt=_label_int(labels, manifests.ATTEMPT_LABEL),
            node=spec.get("nodeName") or None,
            ip=status.get("podIP") or None,
            phase=str(status.get("phase", "Pending")),
            deleting=bool(meta.get("deletionTimestamp")),
            trainer_running=running,
            trainer_exit_code=exit_code,
            trainer_restarts=restarts,
            trainer_last_exit=last_exit,
            unschedulable=unschedulable,
            body=pod,
        )


def _trainer(status: Mapping[str, Any]) -> tuple[bool, int | None, int, int | None]:
    """The trainer container's (running, exit code, restart count, last exit code)."""
    for cs in status.get("containerStatuses") or []:
        if cs.get("name") != manifests.TRAINER_NAME:
            continue
        state = cs.get("state") or {}
        running, exit_code = False, None
        if "terminated" in state:
            exit_code = int(state["terminated"].get("exitCode", 1))
        else:
            running = "running" in state
        last = (cs.get("lastState") or {}).get("terminated")
        last_exit = None if last is None else int(last.get("exitCode", 1))
        return running, exit_code, int(cs.get("restartCount") or 0), last_exit
    return False, None, 0, None


def _sidecar_final(status: Mapping[str, Any]) -> SidecarStatus | None:
    """The sidecar's termination message (manifests.TERMINATION_LOG), parsed; None while it
    runs, or when the message is missing or not a report (an older sidecar, a cut-off file)."""
    for cs in status.get("initContainerStatuses") or []:
        if cs.get("name") != manifests.SIDECAR_NAME:
            continue
        message = ((cs.get("state") or {}).get("terminated") or {}).get("message")
        if not message:
            return None
        try:
            raw = json.loads(message)
            return SidecarStatus.from_json(raw) if isinstance(raw, dict) else None
        except (ValueError, TypeError) as e:
            _log.debug("sidecar termination message not a report: %s", e)
            return None
    return None


def notice_for(
    pods: Iterable[PodView], cluster: ClusterView, *, now: datetime, graces: Graces
) -> Notice | None:
    """The earliest notice the attempt must serve, if any.

    A pod that finished or was never placed has nothing to save. A node's notices count; a
    pod's ``DisruptionTarget`` counts only while its node is Ready: on a node that is not, it
    is the node's loss being cleaned up (taint eviction), handled as a failure.
    """
    found: list[Notice] = []
    for pod in pods:
        if pod.finished or not pod.node:
            continue
        found.extend(cluster.notices_on(pod.node))
        pn = pod_notice(pod.body, now=now, graces=graces)
        if pn is not None and cluster.node_ready(pod.node):
            found.append(pn)
    return earliest(found)


def noticed_nodes(
    pods: Iterable[PodView], cluster: ClusterView, *, now: datetime, graces: Graces
) -> list[str]:
    """The nodes of ``pods`` that carry a notice (their own, or one of their pods'), sorted."""
    return sorted(
        {
            p.node
            for p in pods
            if p.node and (cluster.notices_on(p.node) or pod_notice(p.body, now=now, graces=graces))
        }
    )


def delete_grace(
    pod: PodView, cluster: ClusterView, *, now: datetime, grace_seconds: int
) -> int | None:
    """The grace period to delete ``pod`` with, or None to leave it (already going, gracefully).

    A pod on a lost node never finishes a graceful delete (no kubelet to confirm): it is
    removed at once (0); its replacement has another name and another node.
    """
    lost = cluster.node_lost(pod.node, now=now)
    if pod.deleting and not lost:
        return None
    return 0 if lost else grace_seconds


def rank_view(
    rank: int,
    pod: PodView | None,
    *,
    job: str,
    status: JobStatus,
    cluster: ClusterView,
    now: datetime,
    graces: Graces,
    served_notice: bool,
    committed_notice: bool,
) -> RankView:
    """What the state machine sees of one rank of the current attempt."""
    name = manifests.pod_name(job, status.attempt, rank)
    if pod is None:
        # Missing is only a fault once the attempt's pods were all created (masterAddr is
        # recorded after that); before, the pod simply does not exist yet.
        return RankView(
            rank=rank, pod=name, exists=not status.master_addr, served_notice=served_notice
        )
    return RankView(
        rank=rank,
        pod=pod.name or name,
        phase=pod.phase,
        node=pod.node,
        ip=pod.ip,
        exit_code=pod.trainer_exit_code,
        running=pod.trainer_running,
        unschedulable=pod.unschedulable,
        node_lost=cluster.node_lost(pod.node, now=now),
        deleting=pod.deleting,
        disrupted=pod.deleting or pod_notice(pod.body, now=now, graces=graces) is not None,
        served_notice=served_notice,
        committed_notice=committed_notice,
    )


def trainer_ended(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> bool:
    """Whether a pod's trainer exited or was restarted in place between two versions of the
    pod: a moment the job's daemon should not wait a tick for (a rank that broke on its
    process group is the first sign of a peer's lost node: suspecting.py)."""
    # Only the trainer's status is read: this runs on every pod event (handlers.py).
    _, exit_after, restarts_after, _ = _trainer(new.get("status") or {})
    if old is None:
        return exit_after is not None or restarts_after > 0
    _, exit_before, restarts_before, _ = _trainer(old.get("status") or {})
    if (exit_after, restarts_after) == (exit_before, restarts_before):
        return False
    return exit_after is not None or restarts_after > restarts_before


def restarted(pods: Iterable[PodView], accounted: Mapping[str, Any]) -> list[PodView]:
    """The pods whose trainer the kubelet restarted in place more often than ``accounted``
    (``status.trainerRestarts``: pod name -> the restarts already explained), by rank.

    Only memory-tier pods restart in place (their trainer's restart rules); an in-place
    restart is either part of a recovery (a peer's node was lost: the process group broke)
    or a crash, which the controller counts as a failure.
    """
    out = []
    for pod in pods:
        try:
            known = int(accounted.get(pod.name) or 0)
        except (TypeError, ValueError):
            known = 0
        if pod.trainer_restarts > known:
            out.append(pod)
    return sorted(out, key=lambda p: p.rank)
