"""The fakes of the reconciler's tests: the client layer in memory, and a harness over it.

``FakeKube`` and ``FakeSidecars`` stand in for exactly the two classes that do I/O
(``kube.Kube`` and ``sidecars.SidecarClient``); everything above them is the real code: the
controller, the creator, the guarded writer, the pure layer, the metrics. The fake API keeps a
``resourceVersion`` and refuses a guarded write against an old one with a conflict, as the API
server does; pods are "run" by the test, as a kubelet would. ``Harness`` is one ``Reconciler``
over the fakes and the steps a test takes with it. Used by ``tests/operator/test_reconciler*.py``
and the other operator tests that drive the reconciler tick by tick.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from baton_operator.client.metrics import Metrics
from baton_operator.pure import manifests
from baton_operator.pure.errors import KubeError, SidecarUnreachableError
from baton_operator.pure.nodes import NodeLease
from baton_operator.pure.reports import SidecarStatus
from baton_operator.pure.settings import OperatorConfig
from baton_operator.reconcile.controller import ClusterView, JobMemory, Reconciler
from prometheus_client import CollectorRegistry

NS = "team"
JOB = "tj"
REPLICAS = 3


def merge_patch(target: dict[str, Any], patch: dict[str, Any]) -> None:
    """JSON merge patch (RFC 7386), as the API server applies to ``status``."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            merge_patch(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


class FakeKube:
    """The API calls ``Reconciler`` makes, on one job and its pods, in memory."""

    def __init__(self, job: dict[str, Any]) -> None:
        self.job = copy.deepcopy(job)
        self.job.setdefault("status", {})
        self.job["metadata"]["resourceVersion"] = "1"
        self.pods: dict[str, dict[str, Any]] = {}
        self.created: list[str] = []
        self.deleted: list[tuple[str, int | None]] = []
        self.create_errors: list[KubeError] = []
        self.patch_errors: list[KubeError] = []
        self.annotation_patches: list[tuple[str, dict[str, str | None]]] = []
        self.writes: list[dict[str, Any]] = []
        self.conflicts = 0
        self.before_write: Callable[[FakeKube], None] | None = None
        """Runs once, just before the next status write: another writer racing this one."""
        self.pod_groups: dict[str, dict[str, Any]] | None = None
        """The PodGroups that exist; None: the API server does not serve the API."""
        self.deleted_groups: list[str] = []
        self.services: dict[str, dict[str, Any]] = {}
        """The Services that exist, by name."""
        self.discoveries = 0
        self.nodes: set[str] = set()
        """The Nodes that exist (Harness.node adds them; a test deletes one unseen)."""
        self.node_lookups: list[str | None] = []
        self.leases: dict[str, NodeLease] = {}
        """Each node's Lease (a node missing here has none)."""
        self.lease_reads: list[str] = []
        self.lease_error: KubeError | None = None
        """Raised by every node Lease read (RBAC refused, say)."""

    def bump(self) -> str:
        version = str(int(self.job["metadata"]["resourceVersion"]) + 1)
        self.job["metadata"]["resourceVersion"] = version
        return version

    async def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.job)

    async def node_lease(self, node: str) -> NodeLease | None:
        self.lease_reads.append(node)
        if self.lease_error is not None:
            raise self.lease_error
        return self.leases.get(node)

    async def patch_job_status(
        self,
        namespace: str,
        name: str,
        status: dict[str, Any],
        *,
        resource_version: str | None = None,
    ) -> str | None:
        hook, self.before_write = self.before_write, None
        if hook is not None:
            hook(self)
        if (
            resource_version is not None
            and resource_version != self.job["metadata"]["resourceVersion"]
        ):
            self.conflicts += 1
            raise KubeError.from_answer(
                f"patching TrainingJob {namespace}/{name} status: HTTP 409: the object has been "
                "modified; please apply your changes to the latest version and try again",
                status=409,
            )
        merge_patch(self.job["status"], status)
        self.writes.append(copy.deepcopy(status))
        return self.bump()

    async def list_node_names(self, *, only: str | None = None) -> set[str]:
        self.node_lookups.append(only)
        return set(self.nodes) if only is None else self.nodes & {only}

    async def list_pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        want = dict(part.split("=", 1) for part in label_selector.split(","))
        return [
            copy.deepcopy(p)
            for p in self.pods.values()
            if all(p["metadata"]["labels"].get(k) == v for k, v in want.items())
        ]

    async def create_pod(self, namespace: str, body: dict[str, Any]) -> bool:
        if self.create_errors:
            raise self.create_errors.pop(0)
        name = body["metadata"]["name"]
        if name in self.pods:
            return False
        pod = copy.deepcopy(body)
        pod["metadata"]["uid"] = f"uid-{name}-{len(self.created)}"
        pod["status"] = {"phase": "Pending"}
        self.pods[name] = pod
        self.created.append(name)
        return True

    async def delete_pod(self, namespace: str, name: str, *, grace_seconds: int | None) -> None:
        self.deleted.append((name, grace_seconds))
        self.pods.pop(name, None)

    async def patch_pod_annotations(
        self, namespace: str, name: str, annotations: dict[str, str | None]
    ) -> None:
        if self.patch_errors:
            raise self.patch_errors.pop(0)
        pod = self.pods.get(name)
        if pod is None:
            return  # gone: as the client layer answers a 404
        self.annotation_patches.append((name, dict(annotations)))
        merge_patch(pod["metadata"].setdefault("annotations", {}), annotations)

    async def create_service(self, namespace: str, body: dict[str, Any]) -> bool:
        name = body["metadata"]["name"]
        if name in self.services:
            return False
        self.services[name] = copy.deepcopy(body)
        return True

    async def delete_owned_service(self, namespace: str, name: str, owner_uid: str) -> bool:
        service = self.services.get(name)
        owners = (service or {}).get("metadata", {}).get("ownerReferences") or []
        if not any(o["uid"] == owner_uid for o in owners):
            return False
        del self.services[name]
        return True

    async def serves(self, group_version: str, plural: str) -> bool:
        """Discovery: PodGroups are served only when a test says so (``pod_groups``)."""
        self.discoveries += 1
        return self.pod_groups is not None and (group_version, plural) == (
            "scheduling.k8s.io/v1beta1",
            "podgroups",
        )

    async def create_pod_group(self, namespace: str, body: dict[str, Any]) -> bool:
        assert self.pod_groups is not None, "a PodGroup sent to a cluster that serves none"
        name = body["metadata"]["name"]
        if name in self.pod_groups:
            return False
        self.pod_groups[name] = copy.deepcopy(body)
        self.created.append(f"podgroup/{name}")
        return True

    async def delete_pod_group(self, namespace: str, name: str) -> None:
        assert self.pod_groups is not None, "a PodGroup deleted on a cluster that serves none"
        self.deleted_groups.append(name)
        self.pod_groups.pop(name, None)

    async def create_secret(self, namespace: str, body: dict[str, Any]) -> bool:
        return True

    def run(self, name: str, *, node: str, ip: str) -> None:
        """What the kubelet reports once the pod's trainer runs."""
        pod = self.pods[name]
        pod["spec"]["nodeName"] = node
        pod["status"] = {
            "phase": "Running",
            "podIP": ip,
            "containerStatuses": [
                {"name": manifests.TRAINER_NAME, "state": {"running": {}}},
            ],
        }

    @property
    def status(self) -> dict[str, Any]:
        return cast(dict[str, Any], self.job["status"])

    def phases(self) -> list[str]:
        """Every phase written, in order."""
        return [w["phase"] for w in self.writes if "phase" in w]

    def condition(self, ctype: str) -> dict[str, Any]:
        return next(c for c in self.status["conditions"] if c["type"] == ctype)


class FakeSidecars:
    """Each pod IP's sidecar: its current report, or unreachable (None)."""

    def __init__(self) -> None:
        self.reports: dict[str, SidecarStatus | None] = {}
        self.requests: list[tuple[str, datetime, str]] = []
        self.peer_puts: list[tuple[str, dict[str, Any]]] = []
        """``PUT /v1/replication/peers`` bodies by pod IP (the memory tier's peers)."""
        self.peers_down: set[str] = set()
        """Pod IPs whose sidecar does not answer that PUT."""
        self.settled: list[tuple[str, str]] = []
        """``POST /v1/checkpoint/{id}/settled`` calls: (pod IP, request id)."""

    async def status(self, ip: str, token: str) -> SidecarStatus:
        report = self.reports.get(ip)
        if report is None:
            raise SidecarUnreachableError(f"sidecar at {ip} did not answer (test)")
        return report

    async def request_checkpoint(
        self, ip: str, token: str, *, deadline: datetime, reason: str
    ) -> str:
        self.requests.append((ip, deadline, reason))
        return f"req-{ip}"

    async def settle(self, ip: str, token: str, request_id: str) -> None:
        if self.reports.get(ip) is None:
            raise SidecarUnreachableError(f"sidecar at {ip} did not answer (test)")
        self.settled.append((ip, request_id))

    async def set_peers(self, ip: str, token: str, body: dict[str, Any]) -> None:
        if ip in self.peers_down:
            raise SidecarUnreachableError(f"sidecar at {ip} did not answer (test)")
        self.peer_puts.append((ip, body))


def job_body(**failure_policy: Any) -> dict[str, Any]:
    return {
        "apiVersion": "baton.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {
            "name": JOB,
            "namespace": NS,
            "uid": "uid-1",
            "generation": 1,
            "creationTimestamp": "2026-01-01T00:00:00Z",
        },
        "spec": {
            "replicas": REPLICAS,
            "template": {
                "spec": {
                    "containers": [
                        {"name": "trainer", "image": "trainer:1", "command": ["python", "t.py"]}
                    ]
                }
            },
            "checkpoint": {"uri": "s3://bucket/tj"},
            "failurePolicy": {"maxFailures": 1, **failure_policy},
        },
    }


class Harness:
    """One Reconciler over the fakes, and the steps a test takes with it."""

    def __init__(self, *, config: OperatorConfig | None = None, **failure_policy: Any) -> None:
        self.config = config or OperatorConfig()
        self.kube = FakeKube(job_body(**failure_policy))
        self.sidecars = FakeSidecars()
        self.cluster = ClusterView(config=self.config)
        self.events: list[tuple[str, str, str]] = []
        self.memory = JobMemory()
        self.build()

    def build(self, **extra: Any) -> None:
        """(Re)make the Reconciler over the fakes, with a fresh metrics registry; ``extra`` are
        more Reconciler arguments (a subclass's watch cache)."""

        async def post(job: Any, kind: str, reason: str, message: str) -> None:
            self.events.append((kind, reason, message))

        self.registry = CollectorRegistry()
        self.reconciler = Reconciler(
            kube=cast(Any, self.kube),
            sidecars=cast(Any, self.sidecars),
            cluster=self.cluster,
            metrics=Metrics(self.registry),
            config=self.config,
            post_event=post,
            token_for=lambda spec: "token",
            **extra,
        )

    def tick(self) -> float | None:
        return asyncio.run(self.reconciler.tick(NS, JOB, self.memory))

    def node(
        self,
        name: str,
        *,
        ready: bool = True,
        taints: tuple[dict[str, Any], ...] = (),
        for_seconds: float = 3600,
    ) -> None:
        """The Node watch reports ``name``, Ready (or not) for ``for_seconds``."""
        now = datetime.now(tz=UTC)
        self.kube.nodes.add(name)
        self.cluster.update_node(
            {
                "metadata": {"name": name},
                "spec": {"taints": list(taints)},
                "status": {
                    "conditions": [
                        {
                            "type": "Ready",
                            "status": "True" if ready else "False",
                            "lastTransitionTime": (
                                now - timedelta(seconds=for_seconds)
                            ).isoformat(),
                        }
                    ]
                },
            },
            now=now,
        )

    def pod(self, attempt: int, rank: int) -> str:
        return manifests.pod_name(JOB, attempt, rank)

    def running(self) -> None:
        """Start the job and run every rank of attempt 0 on nodes n0..n2: phase Running."""
        for i in range(REPLICAS):
            self.node(f"n{i}")
        self.tick()  # Secret, Service, Pending
        self.tick()  # rank 0
        self.kube.run(self.pod(0, 0), node="n0", ip="10.0.0.1")
        self.tick()  # ranks 1.., masterAddr
        for rank in range(1, REPLICAS):
            self.kube.run(self.pod(0, rank), node=f"n{rank}", ip=f"10.0.0.{rank + 1}")
        for rank in range(REPLICAS):
            self.sidecars.reports[f"10.0.0.{rank + 1}"] = SidecarStatus(state="idle")
        self.tick()
        assert self.kube.status["phase"] == "Running", self.kube.status

    def spot_notice(self, node: str = "n1") -> None:
        self.node(node, taints=({"key": "aws-node-termination-handler/spot-itn",
                                 "effect": "NoSchedule"},))  # fmt: skip

    def report_all(self, **report: Any) -> None:
        for rank in range(REPLICAS):
            ip = f"10.0.0.{rank + 1}"
            self.sidecars.reports[ip] = SidecarStatus(**{"request_id": f"req-{ip}", **report})

    def env_of(self, attempt: int, rank: int) -> dict[str, str]:
        """The trainer container's environment in the pod of ``attempt`` and ``rank``."""
        pod = self.kube.pods[self.pod(attempt, rank)]
        return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}

    def reasons(self) -> list[str]:
        """The reasons of the Events posted so far, in order."""
        return [reason for _, reason, _ in self.events]

    def suspend(self, value: bool) -> None:
        """The user (or Kueue) sets ``spec.suspend``, as a patch of the spec does."""
        self.kube.job["spec"]["suspend"] = value
        self.kube.job["metadata"]["generation"] += 1
        self.kube.bump()

    def training(self, attempt_ip: str, *, step: int, at: datetime, **extra: Any) -> None:
        """Every rank's sidecar relays the SDK's progress: ``step`` finished at ``at``."""
        for rank in range(REPLICAS):
            self.sidecars.reports[f"{attempt_ip}{rank + 1}"] = SidecarStatus(
                state="idle", train_step=step, step_seconds=0.5, heartbeat=at, **extra
            )
        self.memory.next_progress_poll = None

    def use_memory_tier(self) -> None:
        """Turn the memory tier on in the job's spec (before it starts)."""
        self.kube.job["spec"]["checkpoint"].update({"fastEverySteps": 1, "fastSizeLimit": "64Mi"})

    def restarted_in_place(self, name: str, restarts: int, last_exit: int = 1) -> None:
        """The kubelet restarted the pod's trainer in place (its restart rules)."""
        self.kube.pods[name]["status"]["containerStatuses"] = [
            {
                "name": manifests.TRAINER_NAME,
                "state": {"running": {}},
                "restartCount": restarts,
                "lastState": {"terminated": {"exitCode": last_exit}},
            }
        ]

    def restored(self, ips: list[str], *, step: int, tier: str) -> None:
        """The sidecars at ``ips`` report their trainers restored ``step`` from ``tier``."""
        beat = datetime.now(tz=UTC) + timedelta(seconds=1)
        for ip in ips:
            self.sidecars.reports[ip] = SidecarStatus(
                state="idle", restored_step=step, restored_tier=tier, train_step=step,
                heartbeat=beat,
            )  # fmt: skip
