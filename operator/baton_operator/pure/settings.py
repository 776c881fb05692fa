"""The operator's configuration: one frozen object, built by ``__main__`` from flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from .notices import Graces
from .podpolicy import PodPolicy

__all__ = ["EMERGENCY_EXIT_CODE", "KEY_SECRET_NAME", "LEASE_NAME", "OperatorConfig"]

LEASE_NAME: Final = "baton-operator"
"""The coordination.k8s.io Lease (in the operator's namespace) that elects the one active
operator. Fixed, so that RBAC can name it (``resourceNames``)."""
KEY_SECRET_NAME: Final = "baton-operator-token-key"  # noqa: S105 (a Secret's name)
"""The Secret (in the operator's namespace) holding the key the sidecar tokens derive from.
Fixed, so that RBAC can grant ``get`` on it and on no other Secret."""

EMERGENCY_EXIT_CODE = 75
"""A trainer that exits after an emergency save (a SIGTERM or a notice it saw itself, with the
save committed) exits with this code (``EX_TEMPFAIL``: "try again later"). The operator counts
such an exit as neither success nor failure: it resumes from the last committed step and counts
a preemption. See docs/contracts.md, "Operator"."""


@dataclass(frozen=True, kw_only=True)
class OperatorConfig:
    """Everything the operator can be told; defaults suit a production cluster."""

    namespaces: tuple[str, ...] = ()
    """Namespaces to serve; empty means every namespace (``--all-namespaces``)."""
    standalone: bool = False
    """Skip leader election: only for a single operator that nothing else can start twice."""
    operator_namespace: str = "baton-system"
    """The operator's own namespace: its Lease and its token-key Secret live there."""
    identity: str = ""
    """This replica's name in the Lease; empty means the host name (the pod's name). Stable
    across restarts of the same pod, so a restarted operator takes its Lease back at once
    instead of waiting for its dead predecessor's to expire."""
    lease_duration_seconds: int = 4
    """A holder that has not renewed for this long is presumed dead and a standby takes over:
    well inside GKE's 15 s for non-system pods. Whole seconds (the Lease field is an int)."""
    lease_renew_seconds: float = 1.0
    """How often the active operator renews the Lease."""
    lease_retry_seconds: float = 0.5
    """How often a standby looks at the Lease."""
    lease_renew_deadline_seconds: float = 3.0
    """An active operator that could not renew for this long exits at once (before its Lease
    can expire and a standby act), so two operators never act together."""
    pod_policy: PodPolicy = field(default_factory=PodPolicy)
    """What a pod template may ask for (podpolicy.py, docs/operator.md "Security policy")."""
    metrics_port: int = 8080
    """Port of ``/metrics`` and ``/healthz`` (docs/contracts.md)."""
    metrics_host: str = "0.0.0.0"  # noqa: S104 - the manifests pass the pod IP
    """Address ``/metrics`` and ``/healthz`` are served on. The chart and deploy/ pass the pod IP
    (``$POD_IP``), as the sidecar binds: where pods share a network namespace (the local
    cluster's pods are host processes), two replicas on ``0.0.0.0`` would take one port."""
    kubeconfig: str | None = None
    """A kubeconfig path; None means the in-cluster ServiceAccount (then ``$KUBECONFIG``)."""
    sidecar_image: str = "baton:0.1.0"
    """Image of the ``baton-sidecar`` container (the chart sets the released tag)."""
    sidecar_command: tuple[str, ...] = ("baton-sidecar",)
    """Command of the sidecar container."""
    sidecar_port: int = 9440
    """The sidecar's HTTP port (docs/contracts.md)."""
    sidecar_cloud: str = "auto"
    """``BATON_CLOUD`` for the sidecar: which cloud metadata service it polls for notices."""
    sidecar_linger_seconds: float = 15.0
    """``BATON_SIDECAR_LINGER``: after its trainer exits, a sidecar whose checkpoint outcome
    nobody has read keeps answering this long. Above a standby's takeover (lease duration +
    retry) plus kopf's start, so an operator killed mid-``Checkpointing`` is succeeded by one
    that still hears every rank's committed step; the pod's grace period caps it."""
    sidecar_timeout_seconds: float = 5.0
    """Per-request timeout when talking to a sidecar; a sidecar on a dying node may hang."""
    tick_seconds: float = 1.0
    """How often each job's daemon reconciles. Small, because notices have short deadlines."""
    progress_poll_seconds: float = 5.0
    """How often a running job's sidecars are asked for the last committed step."""
    min_checkpoint_window_seconds: float = 10.0
    """A deadline already past (or nearer than this) is pushed to now + this, so the SDK can
    still try a save at the next step, or say it skipped. Above the SDK's own safety margin
    (5 s by default), which it subtracts from the deadline."""
    suspend_save_seconds: float = 60.0
    """How long a suspend (``spec.suspend: true`` on a running job) waits for its checkpoint
    to commit before it stops the pods anyway: Kueue suspends a job to take its quota back,
    so the wait is bounded, and a save of a multi-GiB state to object storage fits in it."""
    node_lost_seconds: int = 20
    """Pods tolerate an unreachable/not-ready node this long before taint eviction (and the
    operator calls the node lost): the default 300 s would leave a job idle for five minutes."""
    peer_lost_seconds: float | None = None
    """A node that a job's ranks stopped hearing from (a memory-tier rank's trainer failed or
    restarted in place, or a sidecar that had answered stopped answering) is lost once its
    node Lease (``kube-node-lease``) has not been renewed over this many seconds of the
    operator's own watching, without waiting for NotReady and ``node_lost_seconds``
    (nodes.py, docs/operator.md "A node lost without notice"). None (``auto``): two of the
    kubelet's renew intervals, read from each Lease (a quarter of its
    ``leaseDurationSeconds``: 20 s by default), so a live node always renews within it and a
    blip shorter than it restarts nothing. 0 turns the fast path off (NotReady and
    ``node_lost_seconds`` only)."""
    delete_grace_seconds: int = 30
    """Grace given to an old attempt's pods when they are deleted after a committed save."""
    watch_server_timeout_seconds: int = 60
    """Server-side watch timeout (whole seconds: the API server parses it as an integer);
    without it a watch can stall silently (kopf#955, #957)."""
    watch_client_timeout_seconds: float = 90.0
    """Client-side timeout of a watch request, a little above the server's."""
    watch_connect_timeout_seconds: float = 10.0
    """TCP/TLS connect timeout of watch requests."""
    graces: Graces = field(default_factory=Graces)
    """Provider grace periods for notices that carry no end time."""
    cluster_domain: str = "cluster.local"
    """The cluster's DNS domain (the kubelet's ``clusterDomain``). With gang scheduling the
    ranks meet at rank 0's DNS name ``<hostname>.<job>.<namespace>.svc.<cluster_domain>``."""
    gang_scheduling: bool = True
    """Create a ``scheduling.k8s.io/v1beta1`` PodGroup per attempt, and every rank at once,
    where the API server serves PodGroups (docs/operator.md, "Gang scheduling"). False keeps
    the path of clusters without the API (rank 0 first, its pod IP) everywhere."""

    interval_prior_seconds: float = 6 * 3600
    """``everySeconds: auto``: the node time per interruption assumed before any is observed,
    counted as one observed interval (interval.py). Six hours by default (spot GPU capacity
    is commonly reclaimed every few hours to a day); smaller makes observed node time
    outweigh it sooner. The same as ``interval.PRIOR_MTBI_SECONDS`` (a unit test holds them
    equal; interval.py cannot be imported here without a cycle)."""

    def __post_init__(self) -> None:
        if self.watch_client_timeout_seconds <= self.watch_server_timeout_seconds:
            raise ValueError(
                "watch_client_timeout_seconds must exceed watch_server_timeout_seconds, or the "
                "client gives up on healthy watches: raise the client timeout"
            )
        if self.peer_lost_seconds is not None and self.peer_lost_seconds < 0:
            raise ValueError(
                "peer_lost_seconds must be >= 0 (0 turns the fast path off; None: auto)"
            )
        if self.tick_seconds <= 0 or self.progress_poll_seconds <= 0:
            raise ValueError("tick_seconds and progress_poll_seconds must be > 0")
        if not (
            0
            < self.lease_renew_seconds
            < self.lease_renew_deadline_seconds
            < self.lease_duration_seconds
        ):
            raise ValueError(
                "leader election needs 0 < lease_renew_seconds < lease_renew_deadline_seconds "
                "< lease_duration_seconds, or an active operator could still act after a "
                "standby took over: lengthen the lease"
            )
        if self.lease_retry_seconds <= 0:
            raise ValueError("lease_retry_seconds must be > 0")
        if not self.cluster_domain or self.cluster_domain.strip(".") != self.cluster_domain:
            raise ValueError(
                "cluster_domain must be a DNS domain such as cluster.local (no leading or "
                "trailing dot): set --cluster-domain to the kubelet's clusterDomain"
            )
        if not self.sidecar_command:
            raise ValueError("sidecar_command must name the sidecar executable")
        if self.interval_prior_seconds <= 0:
            raise ValueError(
                "interval_prior_seconds must be > 0: it is the node time assumed per "
                "interruption before any is observed (--interval-prior-seconds)"
            )
