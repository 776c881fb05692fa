"""Pure builders for everything the operator creates: pods, the headless Service, the Secret.

Names are deterministic (``<job>-a<attempt>-r<rank>``, cut with a digest past 63 characters:
:func:`bounded_name`), so a handler that runs twice creates
nothing twice, and an operator restarted mid-flow finds (adopts) what its previous life made.

Two ways to rendezvous (docs/operator.md, "Gang scheduling"):

- Without the PodGroup API (no DNS needed): rank 0's pod is created first and reads its own IP
  through the downward API (``status.podIP``); the other ranks are created once rank 0 has an
  IP and get it as a literal ``MASTER_ADDR``. A pod IP needs no DNS record, so there is no race
  between a pod starting and its name resolving.
- Gang scheduling (a ``scheduling.k8s.io/v1beta1`` PodGroup per attempt): a gang is admitted
  only once all its pods exist, so every rank is created at once, before rank 0 has an IP, and
  every rank gets rank 0's DNS name (:func:`master_dns_name`), which the job's headless Service
  (``publishNotReadyAddresses``) makes resolve as soon as rank 0 has an IP (and rank 0 resolves
  at once: the kubelet writes a pod's own name into its ``/etc/hosts``). torch's TCPStore
  client retries a name that does not resolve yet until its timeout, as it retries a refused
  connection.

Why one module of this size: every object the operator creates for a job (pods, Service,
PodGroup, Secret) and every name derived for them is built here, so that names, labels and
selectors agree by construction.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any, Final

from . import crd
from .model import JobSpec
from .settings import EMERGENCY_EXIT_CODE, OperatorConfig

__all__ = [
    "ATTEMPT_LABEL",
    "CONTROL_DIR",
    "CONTROL_VOLUME",
    "FAST_DIR",
    "FAST_VOLUME",
    "JOB_LABEL",
    "KUEUE_GROUP_COUNT_ANNOTATION",
    "KUEUE_GROUP_LABEL",
    "KUEUE_RETRIABLE_ANNOTATION",
    "MANAGED_BY_LABEL",
    "MAX_DNS_LABEL",
    "RANK_LABEL",
    "SIDECAR_NAME",
    "TOKEN_DIR",
    "TOKEN_KEY",
    "TOKEN_VOLUME",
    "TRAINER_NAME",
    "bounded_name",
    "job_selector",
    "kueue_group",
    "master_dns_name",
    "owner_reference",
    "peer_ring",
    "peers_update",
    "pod_group_manifest",
    "pod_group_name",
    "pod_labels",
    "pod_manifest",
    "pod_name",
    "replication_peers",
    "secret_name",
    "service_manifest",
    "sidecar_address",
    "token_secret_manifest",
]

JOB_LABEL: Final = "baton.dev/job"
ATTEMPT_LABEL: Final = "baton.dev/attempt"
RANK_LABEL: Final = "baton.dev/rank"
MANAGED_BY_LABEL: Final = "app.kubernetes.io/managed-by"
MANAGED_BY: Final = "baton"
KUEUE_GROUP_LABEL: Final = "kueue.x-k8s.io/pod-group-name"
"""Kueue's plain-pod integration admits the pods that share this label as one Workload (gang
admission); read from Kueue's ``pkg/controller/jobs/pod/constants`` (docs/operator.md)."""
KUEUE_GROUP_COUNT_ANNOTATION: Final = "kueue.x-k8s.io/pod-group-total-count"
"""How many pods the group has: Kueue admits none of them before it sees this many."""
KUEUE_RETRIABLE_ANNOTATION: Final = "kueue.x-k8s.io/retriable-in-group"
"""``"false"`` on every pod: Kueue finishes the group's Workload (and takes its finalizer off
the pods) once none of them runs, whatever their phase. Without it Kueue finishes a group only
when every pod Succeeded and keeps a failed or deleted pod until a replacement joins the group,
so an attempt that Baton ends (a restart) would keep its pods, and the job, forever."""
MAX_DNS_LABEL: Final = 63
"""The longest DNS label (RFC 1035), label value and hostname: every name the operator derives
from a job's name is bounded by it (:func:`bounded_name`)."""
_MAX_DNS_SUBDOMAIN: Final = 253
_DIGEST_CHARS: Final = 10
POD_GROUP_API_GROUP: Final = "scheduling.k8s.io"
POD_GROUP_VERSION: Final = "v1beta1"
POD_GROUP_PLURAL: Final = "podgroups"
"""Kubernetes 1.37's gang-scheduling API (beta, ``GenericWorkload`` gate): field names read
from ``k8s.io/api`` v0.37.2, ``scheduling/v1beta1/types.go`` and ``core/v1``'s
``PodSchedulingGroup``."""

TRAINER_NAME: Final = "trainer"
SIDECAR_NAME: Final = "baton-sidecar"
TERMINATION_LOG: Final = "/dev/termination-log"
"""The sidecar's ``terminationMessagePath`` (Kubernetes' default, named explicitly)."""
CONTROL_VOLUME: Final = "baton-control"
CONTROL_DIR: Final = "/var/run/baton/control"
FAST_VOLUME: Final = "baton-fast"
FAST_DIR: Final = "/var/run/baton/fast"
"""The memory tier's ``emptyDir`` (``medium: Memory``), mounted here in the trainer and the
sidecar: ``BATON_FAST_DIR`` in both (docs/operator.md, "The memory tier")."""
TOKEN_VOLUME: Final = "baton-token"  # noqa: S105 (a volume name, not a secret)
TOKEN_DIR: Final = "/var/run/baton/token"  # noqa: S105 (a mount path)
TOKEN_KEY: Final = "token"  # noqa: S105 (a key name)
TOKEN_FILE_MODE: Final = 0o440
"""The token file's mode: owner (root) and the pod's ``fsGroup`` read it, nobody else."""
DEFAULT_FS_GROUP: Final = 65532
"""The pod's ``fsGroup`` when the template sets none (the sidecar image's non-root group)."""

# Every env name the operator owns in the trainer: a user value of the same name is dropped,
# because a wrong RANK or MASTER_ADDR would hang or corrupt the job.
_CONTRACT_ENV: Final = frozenset(
    {
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "NNODES",
        "MASTER_ADDR", "MASTER_PORT", "POD_IP", "BATON_CHECKPOINT_URI", "BATON_RESUME_STEP",
        "BATON_JOB", "BATON_ATTEMPT", "BATON_CONTROL_DIR", "BATON_EVERY_STEPS",
        "BATON_EVERY_SECONDS", "BATON_KEEP_LAST", "BATON_FAST_EVERY_STEPS", "BATON_FAST_DIR",
        "PET_NNODES", "PET_NODE_RANK",
        "PET_NPROC_PER_NODE", "PET_MASTER_ADDR", "PET_MASTER_PORT",
    }
)  # fmt: skip

_MI: Final = 1 << 20
_SIDECAR_MEMORY: Final = "48Mi"
"""The sidecar's memory request without replication: 39 MiB measured resident with all three
cloud pollers on (docs/sidecar.md)."""
_REPLICATING_SIDECAR_BASE_MI: Final = 64
"""The replicating sidecar's own memory, before the replicas it holds: the 48 MiB above plus
one 1 MiB chunk per transfer and aiohttp's buffers, with a margin."""

_DEFAULT_GRACE: Final = 30
"""The pod's terminationGracePeriodSeconds when the template leaves it unset (Kubernetes')."""

_RESTRICTED_CONTAINER: Final = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "runAsNonRoot": True,
    "seccompProfile": {"type": "RuntimeDefault"},
}
_RESTRICTED_POD: Final = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}


def bounded_name(name: str, limit: int = MAX_DNS_LABEL) -> str:
    """``name`` when it has at most ``limit`` characters; otherwise its head and a digest.

    The digest (10 hex characters of the SHA-256 of the whole name) keeps the result unique
    and deterministic, so a name derived from a job, an attempt and a rank stays valid (a DNS
    label, a label value) at any attempt and rank and is found again after a restart.
    """
    if len(name) <= limit:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:_DIGEST_CHARS]
    return f"{name[: limit - _DIGEST_CHARS - 1].rstrip('-.')}-{digest}"


def pod_name(job: str, attempt: int, rank: int) -> str:
    """The deterministic pod name of one rank of one attempt: ``<job>-a<attempt>-r<rank>``
    when it fits in a DNS label (63 characters; the name is also the pod's hostname),
    otherwise cut with a digest (:func:`bounded_name`)."""
    return bounded_name(f"{job}-a{attempt}-r{rank}")


def secret_name(job: str) -> str:
    """The per-job sidecar token Secret (docs/contracts.md); a Secret's name may have 253
    characters, more than a 63-character job name and the suffix need."""
    return bounded_name(f"{job}-sidecar-token", _MAX_DNS_SUBDOMAIN)


def job_selector(job: str, attempt: int | None = None) -> str:
    """A label selector for a job's pods (optionally one attempt's)."""
    sel = f"{JOB_LABEL}={job},{MANAGED_BY_LABEL}={MANAGED_BY}"
    return sel if attempt is None else f"{sel},{ATTEMPT_LABEL}={attempt}"


def pod_labels(job: str, attempt: int, rank: int) -> dict[str, str]:
    """The contract labels of a pod."""
    return {
        JOB_LABEL: job,
        ATTEMPT_LABEL: str(attempt),
        RANK_LABEL: str(rank),
        MANAGED_BY_LABEL: MANAGED_BY,
    }


def kueue_group(job: str, attempt: int) -> str:
    """The Kueue pod-group name of an attempt: one group (one Workload) per attempt, since an
    attempt's pods are created, run and deleted together, and a new attempt is admitted anew.

    A label value has at most 63 characters; a longer name keeps its head and a digest.
    """
    return bounded_name(f"{job}-a{attempt}")


def pod_group_name(job: str, attempt: int) -> str:
    """The attempt's PodGroup: the same name as its Kueue pod group (one gang per attempt)."""
    return kueue_group(job, attempt)


def _hostname(spec: JobSpec, attempt: int, rank: int) -> str:
    return str(
        (spec.template.get("spec") or {}).get("hostname") or pod_name(spec.name, attempt, rank)
    )


def _subdomain(spec: JobSpec) -> str:
    return str((spec.template.get("spec") or {}).get("subdomain") or spec.name)


def master_dns_name(spec: JobSpec, config: OperatorConfig, attempt: int) -> str:
    """Rank 0's DNS name in ``attempt``: ``<hostname>.<subdomain>.<ns>.svc.<domain>``.

    The pods' ``hostname`` and ``subdomain`` (``pod_manifest``) under the job's headless
    Service named like the subdomain give this A record (the Kubernetes DNS spec).
    """
    host = _hostname(spec, attempt, 0)
    return f"{host}.{_subdomain(spec)}.{spec.namespace}.svc.{config.cluster_domain}"


def pod_group_manifest(spec: JobSpec, *, attempt: int, replicas: int) -> dict[str, Any]:
    """The attempt's PodGroup: a gang of all ``replicas`` pods, owned by the TrainingJob.

    The scheduler binds none of the pods that name it (``spec.schedulingGroup``) until all
    ``minCount`` of them exist and fit, so no rank holds a GPU while a peer cannot be placed.
    """
    return {
        "apiVersion": f"{POD_GROUP_API_GROUP}/{POD_GROUP_VERSION}",
        "kind": "PodGroup",
        "metadata": {
            "name": pod_group_name(spec.name, attempt),
            "namespace": spec.namespace,
            "labels": {
                JOB_LABEL: spec.name,
                ATTEMPT_LABEL: str(attempt),
                MANAGED_BY_LABEL: MANAGED_BY,
            },
            "ownerReferences": [owner_reference(spec)],
        },
        "spec": {"schedulingPolicy": {"gang": {"minCount": replicas}}},
    }


def owner_reference(spec: JobSpec) -> dict[str, Any]:
    """Owned by the TrainingJob, so deleting the job garbage-collects everything it made.

    No ``blockOwnerDeletion``: setting it needs ``update`` on ``trainingjobs/finalizers``,
    a verb the operator would hold only for this.
    """
    return {
        "apiVersion": f"{crd.GROUP}/{crd.VERSION}",
        "kind": crd.KIND,
        "name": spec.name,
        "uid": spec.uid,
        "controller": True,
    }


def token_secret_manifest(spec: JobSpec, token: str) -> dict[str, Any]:
    """The Secret holding the bearer token the sidecars require (``stringData``)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": secret_name(spec.name),
            "namespace": spec.namespace,
            "labels": {JOB_LABEL: spec.name, MANAGED_BY_LABEL: MANAGED_BY},
            "ownerReferences": [owner_reference(spec)],
        },
        "stringData": {TOKEN_KEY: token},
    }


def service_manifest(spec: JobSpec) -> dict[str, Any]:
    """The headless Service over the job's pods: with the pods' ``hostname``/``subdomain`` it
    gives each rank a DNS name, rank 0's being the gang path's ``MASTER_ADDR``; not-ready
    addresses are published, so the name resolves as soon as rank 0 has an IP."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": spec.name,
            "namespace": spec.namespace,
            "labels": {JOB_LABEL: spec.name, MANAGED_BY_LABEL: MANAGED_BY},
            "ownerReferences": [owner_reference(spec)],
        },
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {JOB_LABEL: spec.name, MANAGED_BY_LABEL: MANAGED_BY},
            "ports": [
                {"name": "rendezvous", "port": spec.master_port, "protocol": "TCP"},
            ],
        },
    }


def _env(name: str, value: object) -> dict[str, Any]:
    return {"name": name, "value": str(value)}


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _trainer_env(
    spec: JobSpec,
    *,
    attempt: int,
    rank: int,
    replicas: int,
    master_addr: str | None,
    resume_step: int | None,
    every_seconds: int | None,
) -> list[dict[str, Any]]:
    procs = spec.procs_per_replica
    # Without a master address (rank 0 on the rank-0-first path) the pod reads its own IP
    # from the downward API; otherwise rank 0's IP, or on the gang path every rank (rank 0
    # too, through the kubelet's /etc/hosts entry for its own name) gets rank 0's DNS name.
    master = (
        _field_env("MASTER_ADDR", "status.podIP")
        if master_addr is None
        else _env("MASTER_ADDR", master_addr)
    )
    env: list[dict[str, Any]] = []
    if procs == 1:
        env += [_env("RANK", rank), _env("LOCAL_RANK", 0)]
    # With several processes per pod a launcher gives each its RANK and LOCAL_RANK; without
    # them a plain `python train.py` stops at once in init_process_group ("environment
    # variable RANK expected, but not set") instead of hanging in a rendezvous that only one
    # process per pod ever joins.
    env += [
        _env("WORLD_SIZE", replicas * procs),
        _env("LOCAL_WORLD_SIZE", procs),
        _env("NODE_RANK", rank),
        _env("NNODES", replicas),
        _field_env("POD_IP", "status.podIP"),
        master,
        _env("MASTER_PORT", spec.master_port),
        # torchrun's defaults (what Kubeflow's PyTorchJob sets too): a plain `torchrun
        # train.py` in the template starts procsPerReplica workers and joins the job.
        _env("PET_NNODES", replicas),
        _env("PET_NODE_RANK", rank),
        _env("PET_NPROC_PER_NODE", procs),
        {**master, "name": "PET_MASTER_ADDR"},
        _env("PET_MASTER_PORT", spec.master_port),
        _env("BATON_CHECKPOINT_URI", spec.checkpoint_uri),
        _env("BATON_JOB", spec.key),
        _env("BATON_ATTEMPT", attempt),
        _env("BATON_CONTROL_DIR", CONTROL_DIR),
    ]
    if resume_step is not None:
        env.append(_env("BATON_RESUME_STEP", resume_step))
    if spec.every_steps is not None:
        env.append(_env("BATON_EVERY_STEPS", spec.every_steps))
    if every_seconds is not None:
        env.append(_env("BATON_EVERY_SECONDS", every_seconds))
    if spec.keep_last is not None:
        env.append(_env("BATON_KEEP_LAST", spec.keep_last))
    if spec.fast is not None:
        env.append(_env("BATON_FAST_EVERY_STEPS", spec.fast.every_steps))
        env.append(_env("BATON_FAST_DIR", FAST_DIR))
    return env


def sidecar_address(spec: JobSpec, config: OperatorConfig, attempt: int, rank: int) -> str:
    """``http://<DNS name>:<port>`` of a rank's sidecar: its pod's name under the job's
    headless Service, which resolves as soon as the pod has an IP and follows a pod replaced
    under the same name."""
    host = _hostname(spec, attempt, rank)
    dns = f"{host}.{_subdomain(spec)}.{spec.namespace}.svc.{config.cluster_domain}"
    return f"http://{dns}:{config.sidecar_port}"


def replication_peers(
    spec: JobSpec, config: OperatorConfig, *, attempt: int, rank: int, replicas: int
) -> list[dict[str, str]]:
    """The other ranks' sidecars in ring order, starting after ``rank`` (the sidecar sends to
    the first ``fastReplicas`` that answer, so every pod receives as many copies as it sends).
    Their failure domains are unknown before the pods are placed: empty, which the sidecar
    never skips; one pod per node (the ranks' anti-affinity) already keeps every copy on
    another node, and the operator sets the domains once the pods are placed."""
    order = [(rank + k) % replicas for k in range(1, replicas)]
    return [{"address": sidecar_address(spec, config, attempt, r), "domain": ""} for r in order]


def _interleave(groups: Iterable[list[int]]) -> list[int]:
    """Round-robin over ``groups`` (largest first), so neighbours come from different groups
    wherever the sizes allow."""
    ordered = sorted(groups, key=lambda g: (-len(g), g))
    out: list[int] = []
    for i in range(max((len(g) for g in ordered), default=0)):
        out.extend(g[i] for g in ordered if i < len(g))
    return out


def peer_ring(placed: Mapping[int, tuple[str | None, str | None]]) -> list[int]:
    """The ranks in replication ring order, from each rank's ``(zone, pool)``: zones
    interleaved, and pools within a zone, so that a rank's successors (its replica targets)
    are in another zone, else another pool, wherever the job's placement allows (spot
    capacity is reclaimed per pool, and a zone can fail as one). Unlabelled nodes form one
    group; without labels the ring is rank order."""
    zones: dict[str | None, dict[str | None, list[int]]] = {}
    for rank in sorted(placed):
        zone, pool = placed[rank]
        zones.setdefault(zone, {}).setdefault(pool, []).append(rank)
    return _interleave(_interleave(pools.values()) for pools in zones.values())


def peers_update(
    spec: JobSpec,
    config: OperatorConfig,
    *,
    attempt: int,
    placed: Mapping[int, tuple[str, str | None, str | None]],
) -> dict[int, dict[str, Any]]:
    """The body of ``PUT /v1/replication/peers`` for each rank's sidecar once every pod of
    the attempt is placed: ``placed`` maps each rank to its ``(node, zone, pool)``.

    Each rank's peers are the ring (:func:`peer_ring`) after it, with their nodes as failure
    domains (the sidecar's own ``BATON_FAILURE_DOMAIN``), so every pod still receives as many
    copies as it sends.
    """
    if spec.fast is None or len(placed) < 2:
        return {}
    ring = peer_ring({rank: (zone, pool) for rank, (_, zone, pool) in placed.items()})
    n = len(ring)
    copies = min(spec.fast.replicas, n - 1)
    out: dict[int, dict[str, Any]] = {}
    for i, rank in enumerate(ring):
        after = [ring[(i + k) % n] for k in range(1, n)]
        peers = [
            {"address": sidecar_address(spec, config, attempt, r), "domain": placed[r][0]}
            for r in after
        ]
        out[rank] = {"peers": peers, "replicas": copies}
    return out


def _mi(n: int) -> str:
    return f"{math.ceil(n / _MI)}Mi"


def _sidecar_replication(
    spec: JobSpec, config: OperatorConfig, *, attempt: int, rank: int, replicas: int
) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
    """The replicating sidecar's env and resources; None without the memory tier, or with a
    single pod (no peer to copy to: its snapshots serve only that pod)."""
    fast = spec.fast
    if fast is None or replicas < 2:
        return None
    copies = min(fast.replicas, replicas - 1)
    peers = replication_peers(spec, config, attempt=attempt, rank=rank, replicas=replicas)
    env = [
        _env("BATON_FAST_DIR", FAST_DIR),
        _env("BATON_REPLICATION_REPLICAS", copies),
        _env("BATON_REPLICATION_PEERS", json.dumps(peers, separators=(",", ":"))),
        # This pod's own domain: its node (the peers' come with the operator's update).
        _field_env("BATON_FAILURE_DOMAIN", "spec.nodeName"),
    ]
    # A tmpfs page is charged to the container that writes it: the sidecar writes the
    # replicas it receives (2 per copy it holds: the newest and the next) and a restore's
    # fill. With the emptyDir sized (2 + 2 x copies) x the pod's share, the replicas are
    # copies / (1 + copies) of it (the request); a fill after a pod's loss can take the
    # rest, and the kubelet evicts a pod past sizeLimit anyway, so the limit is all of it.
    base = _REPLICATING_SIDECAR_BASE_MI * _MI
    held = math.ceil(fast.size_bytes * copies / (1 + copies))
    resources = {
        "requests": {"cpu": "10m", "memory": _mi(base + held)},
        "limits": {"memory": _mi(base + fast.size_bytes)},
    }
    return env, resources


def _fill_in(ctx: dict[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``ctx`` with each of restricted's ``defaults`` that it leaves unset filled in.

    A value the template sets is kept: podpolicy.py has refused every one that contradicts
    restricted (``allowPrivilegeEscalation: true``, ``runAsNonRoot: false``, an Unconfined
    seccomp profile, capabilities other than NET_BIND_SERVICE added or ALL not dropped), so
    what remains is the author's own stricter or equal choice (a Localhost profile).
    """
    out = dict(ctx)
    for key, value in defaults.items():
        if out.get(key) is None:
            out[key] = copy.deepcopy(value)
        elif isinstance(value, Mapping) and isinstance(out[key], Mapping):
            out[key] = _fill_in(out[key], value)
    return out


def _restricted(container: dict[str, Any]) -> None:
    container["securityContext"] = _fill_in(
        container.get("securityContext") or {}, _RESTRICTED_CONTAINER
    )


def _sidecar(
    spec: JobSpec, config: OperatorConfig, *, attempt: int, rank: int, replicas: int
) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": SIDECAR_NAME,
        "image": config.sidecar_image,
        "command": list(config.sidecar_command),
        # A native sidecar: starts before the trainer, lives as long as it, never blocks the
        # pod from completing.
        "restartPolicy": "Always",
        "env": [
            _field_env("POD_IP", "status.podIP"),
            _env("BATON_SIDECAR_PORT", config.sidecar_port),
            _env("BATON_SIDECAR_TOKEN_FILE", f"{TOKEN_DIR}/{TOKEN_KEY}"),
            _env("BATON_CONTROL_DIR", CONTROL_DIR),
            _env("BATON_JOB", spec.key),
            _env("BATON_CLOUD", config.sidecar_cloud),
            # Long enough for a standby operator to take over and read a notice save's outcome
            # (docs/operator.md, "High availability"); the pod's grace period caps it.
            _env("BATON_SIDECAR_LINGER", config.sidecar_linger_seconds),
            # The save's outcome, kept in the pod's status after the sidecar ends: read by an
            # operator that could not poll it (pods.PodView.sidecar_final).
            _env("BATON_TERMINATION_LOG", TERMINATION_LOG),
        ],
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "File",
        "ports": [{"name": "baton-ctl", "containerPort": config.sidecar_port, "protocol": "TCP"}],
        "volumeMounts": [
            {"name": CONTROL_VOLUME, "mountPath": CONTROL_DIR},
            {"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True},
        ],
        "resources": {"requests": {"cpu": "10m", "memory": _SIDECAR_MEMORY}},
        # The trainer starts only once the sidecar answers (a native sidecar's startup probe
        # gates the main containers), so a notice can never arrive before it is heard.
        "startupProbe": {
            "httpGet": {"path": "/healthz", "port": config.sidecar_port},
            "periodSeconds": 1,
            "failureThreshold": 60,
        },
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": config.sidecar_port},
            "periodSeconds": 10,
            "failureThreshold": 3,
        },
    }
    if spec.fast is not None:
        container["volumeMounts"].append({"name": FAST_VOLUME, "mountPath": FAST_DIR})
    replication = _sidecar_replication(spec, config, attempt=attempt, rank=rank, replicas=replicas)
    if replication is not None:
        container["env"].extend(replication[0])
        container["resources"] = replication[1]
    _restricted(container)
    # The sidecar writes only into the control and memory-tier emptyDirs.
    container["securityContext"]["readOnlyRootFilesystem"] = True
    return container


def _avoid_nodes(affinity: dict[str, Any], avoid: Iterable[str]) -> None:
    nodes = sorted(set(avoid))
    if not nodes:
        return
    # The API server allows a single value per In/NotIn on a node *field* selector, so each
    # avoided node is its own requirement; requirements within a term are ANDed.
    exprs = [{"key": "metadata.name", "operator": "NotIn", "values": [n]} for n in nodes]
    node_aff = affinity.setdefault("nodeAffinity", {})
    required = node_aff.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.setdefault("nodeSelectorTerms", [])
    if not terms:
        terms.append({})
    # Terms are ORed: the exclusion has to be ANDed into every one of them.
    for term in terms:
        term.setdefault("matchFields", []).extend(dict(e) for e in exprs)


def _spread_ranks(affinity: dict[str, Any], job: str, attempt: int) -> None:
    # One rank per node: a node loss then costs one rank, and "how many nodes can host the
    # job" (the elastic decision) is simply the number of usable nodes.
    pod_aff = affinity.setdefault("podAntiAffinity", {})
    pod_aff.setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append(
        {
            "labelSelector": {"matchLabels": {JOB_LABEL: job, ATTEMPT_LABEL: str(attempt)}},
            "topologyKey": "kubernetes.io/hostname",
        }
    )


def pod_manifest(
    spec: JobSpec,
    config: OperatorConfig,
    *,
    attempt: int,
    rank: int,
    replicas: int,
    master_addr: str | None,
    resume_step: int | None,
    avoid_nodes: Iterable[str] = (),
    every_seconds: int | None = None,
    pod_group: str | None = None,
) -> dict[str, Any]:
    """The pod of ``rank`` in ``attempt``: the user's template plus Baton's contract.

    ``master_addr`` is rank 0's pod IP or, with a ``pod_group`` (gang scheduling), its DNS
    name, given to every rank then; None (rank 0 of the rank-0-first path only) makes the pod
    read its own IP. ``pod_group`` links the pod to the attempt's PodGroup
    (``spec.schedulingGroup``).
    ``every_seconds`` is the interval chosen for the attempt when the spec says
    ``everySeconds: auto`` (interval.py); otherwise the spec's own value is used.
    """
    if rank != 0 and master_addr is None:
        raise ValueError(
            f"rank {rank} needs rank 0's pod IP (create rank 0 first) or, with a PodGroup, "
            "its DNS name (master_dns_name) as master_addr"
        )
    if spec.auto_interval and every_seconds is None:
        raise ValueError(
            "spec.checkpoint.everySeconds is auto: pass the interval chosen for the attempt "
            "(interval.for_job) as every_seconds"
        )
    template: Mapping[str, Any] = spec.template
    tmeta = template.get("metadata") or {}
    pod_spec: dict[str, Any] = copy.deepcopy(dict(template.get("spec") or {}))

    containers: list[dict[str, Any]] = pod_spec.get("containers") or []
    trainer = next((c for c in containers if c.get("name") == TRAINER_NAME), None)
    if trainer is None:
        raise ValueError("spec.template.spec.containers needs a container named `trainer`")
    env = _trainer_env(
        spec,
        attempt=attempt,
        rank=rank,
        replicas=replicas,
        master_addr=master_addr,
        resume_step=resume_step,
        every_seconds=spec.every_seconds if every_seconds is None else every_seconds,
    )
    user_env = [e for e in trainer.get("env") or [] if e.get("name") not in _CONTRACT_ENV]
    if not any(e.get("name") == "PET_SHUTDOWN_TIMEOUT" for e in user_env):
        # torchrun SIGKILLs its workers 30 s after it forwards a SIGTERM (pytorch#68258),
        # which would cut short a save the SDK starts on that signal. Let it wait as long
        # as the kubelet does; the user's own value wins.
        grace = pod_spec.get("terminationGracePeriodSeconds")
        env.append(_env("PET_SHUTDOWN_TIMEOUT", _DEFAULT_GRACE if grace is None else grace))
    trainer["env"] = env + user_env
    ours = (CONTROL_VOLUME, FAST_VOLUME)
    mounts = [m for m in trainer.get("volumeMounts") or [] if m.get("name") not in ours]
    mounts.append({"name": CONTROL_VOLUME, "mountPath": CONTROL_DIR})
    if spec.fast is not None:
        mounts.append({"name": FAST_VOLUME, "mountPath": FAST_DIR})
    trainer["volumeMounts"] = mounts
    for c in containers:
        _restricted(c)
    init = [c for c in pod_spec.get("initContainers") or [] if c.get("name") != SIDECAR_NAME]
    for c in init:
        _restricted(c)
    sidecar = _sidecar(spec, config, attempt=attempt, rank=rank, replicas=replicas)
    pod_spec["initContainers"] = [sidecar, *init]

    volumes = [
        v
        for v in pod_spec.get("volumes") or []
        if v.get("name") not in (CONTROL_VOLUME, TOKEN_VOLUME, FAST_VOLUME)
    ]
    volumes.append({"name": CONTROL_VOLUME, "emptyDir": {}})
    if spec.fast is not None:
        # tmpfs: a snapshot's pages are memory, charged to the container that writes them;
        # the kubelet sizes the tmpfs at sizeLimit (and evicts a pod past it).
        volumes.append(
            {
                "name": FAST_VOLUME,
                "emptyDir": {"medium": "Memory", "sizeLimit": spec.fast.size_limit},
            }
        )
    volumes.append(
        {
            "name": TOKEN_VOLUME,
            # Group-only: the kubelet gives a Secret's files the pod's fsGroup as their group,
            # and the sidecar (whatever non-root user its image runs as) has that group.
            "secret": {"secretName": secret_name(spec.name), "defaultMode": TOKEN_FILE_MODE},
        }
    )
    pod_spec["volumes"] = volumes

    pod_ctx = _fill_in(pod_spec.get("securityContext") or {}, _RESTRICTED_POD)
    if pod_ctx.get("fsGroup") is None:
        # Without an fsGroup a 0440 token would be root's alone. Only set here, the change
        # policy keeps the kubelet from re-owning the user's volumes on every start.
        pod_ctx["fsGroup"] = DEFAULT_FS_GROUP
        pod_ctx.setdefault("fsGroupChangePolicy", "OnRootMismatch")
    pod_spec["securityContext"] = pod_ctx

    affinity = pod_spec.setdefault("affinity", {})
    _avoid_nodes(affinity, avoid_nodes)
    _spread_ranks(affinity, spec.name, attempt)

    tolerations = [
        t
        for t in pod_spec.get("tolerations") or []
        if t.get("key") not in ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")
    ]
    # Tolerated without end: the operator alone removes a lost node's pods (after
    # --node-lost-seconds, nodes.ClusterView.node_lost). A timed toleration made the taint
    # manager a second judge, and it deletes by name with no UID precondition: its timer,
    # set for the lost pod, fired on the same-named replacement the operator had already
    # created on a healthy node (the timer is not cancelled when a pod of that name exists on
    # an untainted node: tainteviction.handlePodUpdate), and the job restarted from scratch.
    for key in ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready"):
        tolerations.append({"key": key, "operator": "Exists", "effect": "NoExecute"})
    pod_spec["tolerations"] = tolerations
    # The operator decides what happens after a rank exits; a kubelet restart would hide it.
    pod_spec["restartPolicy"] = "Never"
    if spec.fast is not None:
        # The memory tier's recovery keeps the survivors' pods (their sidecar and memory):
        # a trainer whose process group broke (a peer's node was lost) exits non-zero and
        # the kubelet restarts it in place (Kubernetes 1.35+ container restart rules, beta
        # and on by default). Success and the emergency exit after a notice save stay final:
        # those the operator decides on. The operator tells a crash from a recovery's restart
        # by the restart count (controller.py, docs/operator.md).
        trainer["restartPolicy"] = "Never"
        trainer["restartPolicyRules"] = [
            {
                "action": "Restart",
                "exitCodes": {"operator": "NotIn", "values": [0, EMERGENCY_EXIT_CODE]},
            }
        ]
    pod_spec["enableServiceLinks"] = False
    pod_spec.setdefault("automountServiceAccountToken", False)
    pod_spec.setdefault("hostname", pod_name(spec.name, attempt, rank))
    pod_spec.setdefault("subdomain", spec.name)
    if pod_group is not None:
        pod_spec["schedulingGroup"] = {"podGroupName": pod_group}

    labels = {**(tmeta.get("labels") or {}), **pod_labels(spec.name, attempt, rank)}
    annotations = dict(tmeta.get("annotations") or {})
    if spec.queue_labels:
        # Kueue's plain-pod integration: the queue (and priority) the job is queued in, and
        # the attempt's pods as one gang of `replicas` pods.
        labels.update(spec.queue_labels)
        labels[KUEUE_GROUP_LABEL] = kueue_group(spec.name, attempt)
        annotations[KUEUE_GROUP_COUNT_ANNOTATION] = str(replicas)
        annotations[KUEUE_RETRIABLE_ANNOTATION] = "false"  # an attempt is never retried
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(spec.name, attempt, rank),
            "namespace": spec.namespace,
            "labels": labels,
            "annotations": annotations,
            "ownerReferences": [owner_reference(spec)],
        },
        "spec": pod_spec,
    }
