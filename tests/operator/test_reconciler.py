"""The reconciler's decisions, tick by tick, against a fake of the client layer (no cluster).

The fake stands in for exactly the two classes that do I/O (``kube.Kube`` and
``sidecars.SidecarClient``); everything above them is the real code: the controller, the
creator, the guarded writer, the pure layer, the metrics. The fake API keeps a
``resourceVersion`` and refuses a guarded write against an old one with a conflict, as the API
server does; pods are "run" by the test, as a kubelet would. The same paths run for real in
the cluster tests (test_preemption_cluster.py, test_lifecycle_cluster.py); these say which
decision is taken, and why, in milliseconds.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest
from baton_operator.client.metrics import Metrics
from baton_operator.pure import manifests
from baton_operator.pure.disruption import DELETION_COST
from baton_operator.pure.errors import KubeConflictError, KubeError, SidecarUnreachableError
from baton_operator.pure.model import JobSpec
from baton_operator.pure.nodes import NodeLease
from baton_operator.pure.pods import PodView
from baton_operator.pure.reports import SidecarStatus
from baton_operator.pure.settings import OperatorConfig
from baton_operator.reconcile.controller import ClusterView, JobMemory, Reconciler
from prometheus_client import CollectorRegistry

NS = "team"
JOB = "tj"
REPLICAS = 3


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    """JSON merge patch (RFC 7386), as the API server applies to ``status``."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
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
        _merge(self.job["status"], status)
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
        _merge(pod["metadata"].setdefault("annotations", {}), annotations)

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


def test_a_spot_notice_checkpoints_every_rank_then_moves_the_job() -> None:
    h = Harness()
    h.running()
    h.spot_notice("n1")
    before = datetime.now(tz=UTC)
    h.tick()
    status = h.kube.status
    assert status["phase"] == "Checkpointing"
    assert "n1" in status["avoidNodes"]
    assert status["notice"]["source"] == "aws"
    # The deadline is clamped to at least the operator's minimum window.
    deadline = datetime.fromisoformat(status["notice"]["deadline"].replace("Z", "+00:00"))
    assert deadline >= before.replace(microsecond=0) + timedelta(
        seconds=h.config.min_checkpoint_window_seconds
    )

    h.report_all(state="requested")
    h.tick()
    assert sorted(ip for ip, _, _ in h.sidecars.requests) == ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    assert all("aws: AWS Node Termination Handler" in r for _, _, r in h.sidecars.requests)
    assert h.kube.status["notice"]["requestIds"] == ["req-10.0.0.1", "req-10.0.0.2", "req-10.0.0.3"]
    assert h.kube.status["phase"] == "Checkpointing", "nothing committed yet: wait"

    h.report_all(state="committed", step=40, trigger="notice", uri="s3://bucket/tj", seconds=1.5)
    h.tick()
    status = h.kube.status
    assert status["phase"] == "Restarting"
    assert (status["attempt"], status["preemptions"], status["failures"]) == (1, 1, 0)
    assert status["resumedFromStep"] == 40
    assert status["lastCheckpoint"]["step"] == 40
    assert status["lastCheckpoint"]["trigger"] == "notice"
    assert "notice" not in status
    assert sorted(h.kube.deleted) == [
        (h.pod(0, r), h.config.delete_grace_seconds) for r in range(3)
    ]
    assert any(reason == "CheckpointCommitted" for _, reason, _ in h.events)

    h.tick()  # Restarting -> Pending, the new attempt's rank 0 resumes at the committed step
    assert h.kube.status["phase"] == "Pending"
    pod = h.kube.pods[h.pod(1, 0)]
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["BATON_RESUME_STEP"] == "40"
    assert "n1" in str(pod["spec"]["affinity"])
    assert h.kube.phases() == ["Pending", "Running", "Checkpointing", "Restarting", "Pending"]


def test_a_commit_seen_on_one_rank_settles_every_ranks_request_before_the_pods_go() -> None:
    # One rank's committed proves the checkpoint: the verdict comes while the other ranks are
    # still writing theirs. Their sidecars hear that the request is decided, or each would
    # keep its pod for its linger waiting for an outcome that nobody will read, and the
    # next attempt would wait for those pods (seen: 16 s in Restarting in bench/goodput.py).
    h = Harness()
    h.running()
    h.spot_notice("n1")
    h.tick()
    h.report_all(state="saving", step=40, trigger="notice")
    h.tick()
    assert h.kube.status["phase"] == "Checkpointing"
    assert h.sidecars.settled == [], "nothing is decided before a commit"
    ip0 = "10.0.0.1"
    h.sidecars.reports[ip0] = SidecarStatus(
        request_id=f"req-{ip0}", state="committed", step=40, trigger="notice",
        uri="s3://bucket/tj", seconds=1.5, tier="durable",
    )  # fmt: skip
    h.sidecars.reports["10.0.0.3"] = None  # this rank's sidecar no longer answers
    phases_seen: list[str] = []
    settle = h.sidecars.settle

    async def settle_after_the_decision(ip: str, token: str, request_id: str) -> None:
        phases_seen.append(h.kube.status["phase"])
        await settle(ip, token, request_id)

    h.sidecars.settle = settle_after_the_decision  # type: ignore[method-assign]
    h.tick()
    assert h.kube.status["phase"] == "Restarting"
    assert set(phases_seen) == {"Restarting"}, "settled only once the decision is written"
    assert sorted(h.sidecars.settled) == [
        ("10.0.0.1", "req-10.0.0.1"),
        ("10.0.0.2", "req-10.0.0.2"),
    ]
    assert sorted(h.kube.deleted) == [
        (h.pod(0, r), h.config.delete_grace_seconds) for r in range(3)
    ], "an unanswered settle holds nothing up"


def test_a_failed_save_falls_back_to_the_newest_step_any_rank_committed() -> None:
    h = Harness()
    h.running()
    # A periodic save committed step 30 (rank 2 knows it), newer than status.lastCheckpoint.
    h.kube.status["lastCheckpoint"] = {"step": 20, "trigger": "periodic"}
    h.spot_notice("n0")
    h.tick()
    assert h.kube.status["phase"] == "Checkpointing"
    h.report_all(state="saving", trigger="notice", last_committed_step=30)
    h.tick()
    h.report_all(state="failed", trigger="notice", error="disk full", last_committed_step=30)
    h.tick()
    status = h.kube.status
    assert status["phase"] == "Restarting"
    assert status["resumedFromStep"] == 30
    assert status["lastCheckpoint"] == {
        "step": 30,
        "uri": "s3://bucket/tj",
        "trigger": "periodic",
        "completedAt": status["lastCheckpoint"]["completedAt"],
    }
    assert (status["preemptions"], status["failures"]) == (1, 0), "a preemption, not a failure"
    fallback = [m for _, reason, m in h.events if reason == "CheckpointFallback"]
    assert len(fallback) == 1
    assert "disk full" in fallback[0]
    assert "the last step known to be committed is 30" in fallback[0]


def test_a_checkpoint_request_without_a_recorded_notice_says_why_it_was_sent() -> None:
    # The job is Checkpointing but status.notice is empty (an edit by hand, or a status
    # written by an older operator): the ranks are still asked, and the reason they log
    # ("control request <id> (operator: <reason>)") says what happened, not "None: None".
    h = Harness()
    h.running()
    h.kube.status["phase"] = "Checkpointing"
    h.tick()
    reasons = [r for _, _, r in h.sidecars.requests]
    assert len(reasons) == REPLICAS, h.sidecars.requests
    assert all("None" not in r for r in reasons), reasons
    assert all("no notice" in r for r in reasons), reasons


def test_a_partly_recorded_notice_gives_the_part_it_has_as_the_reason() -> None:
    h = Harness()
    h.running()
    h.kube.status["phase"] = "Checkpointing"
    h.kube.status["notice"] = {"reason": "maintenance window"}
    h.tick()
    assert [r for _, _, r in h.sidecars.requests] == ["maintenance window"] * REPLICAS


def test_a_notice_before_the_attempt_runs_moves_it_without_asking_for_a_save() -> None:
    h = Harness()
    for i in range(REPLICAS):
        h.node(f"n{i}")
    h.tick()
    h.tick()
    h.kube.run(h.pod(0, 0), node="n0", ip="10.0.0.1")
    h.spot_notice("n0")
    h.tick()
    status = h.kube.status
    assert status["phase"] == "Restarting"
    assert status["avoidNodes"] == ["n0"]
    assert status.get("resumedFromStep") is None
    assert h.sidecars.requests == [], "nothing trained since the last commit: nothing to save"


def test_a_disruption_target_on_a_node_that_is_not_ready_is_no_notice() -> None:
    h = Harness()
    h.running()
    pod = h.kube.pods[h.pod(0, 1)]
    pod["status"]["conditions"] = [
        {"type": "DisruptionTarget", "status": "True", "reason": "DeletionByTaintManager"}
    ]
    # Not Ready for a moment (not yet lost): the taint manager cleaning up a node that went
    # down is not an advance notice, so no save is asked.
    h.node("n1", ready=False, for_seconds=1)
    h.tick()
    assert h.kube.status["phase"] == "Running"
    assert h.sidecars.requests == []
    # Once the node counts as lost, it is a failure (no notice came), not a preemption.
    h.node("n1", ready=False, for_seconds=h.config.node_lost_seconds + 1)
    h.tick()
    status = h.kube.status
    assert (status["phase"], status["failures"], status["preemptions"]) == ("Restarting", 1, 0)
    assert (h.pod(0, 1), 0) in h.kube.deleted, "a pod on a lost node is deleted at once"
    assert h.sidecars.requests == []


def test_a_disruption_target_on_a_ready_node_is_a_notice() -> None:
    h = Harness()
    h.running()
    pod = h.kube.pods[h.pod(0, 1)]
    pod["status"]["conditions"] = [
        {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}
    ]
    h.tick()
    assert h.kube.status["phase"] == "Checkpointing"
    assert h.kube.status["notice"]["source"] == "disruption-target"


def test_a_finished_pod_on_a_noticed_node_is_no_notice() -> None:
    h = Harness()
    h.running()
    pod = h.kube.pods[h.pod(0, 1)]
    pod["status"]["phase"] = "Succeeded"
    pod["status"]["containerStatuses"] = [
        {"name": manifests.TRAINER_NAME, "state": {"terminated": {"exitCode": 0}}}
    ]
    h.spot_notice("n1")
    h.tick()
    assert h.kube.status["phase"] == "Running", "a rank that finished has nothing to save"
    assert h.sidecars.requests == []


def test_a_rejected_pod_fails_the_job_once_naming_the_field() -> None:
    h = Harness()
    h.tick()
    h.kube.create_errors.append(
        KubeError.from_answer(
            f"creating pod {NS}/{h.pod(0, 0)}: HTTP 422: Pod is invalid",
            status=422,
            fields=("spec.containers[0].image",),
        )
    )
    h.tick()
    status = h.kube.status
    assert status["phase"] == "Failed"
    failed = h.kube.condition("Failed")
    assert failed["reason"] == "PodRejected"
    assert "spec.template.spec.containers[0].image" in failed["message"]
    assert "fix spec.template" in failed["message"]
    assert [r for _, r, _ in h.events].count("PodRejected") == 1
    assert h.tick() is None, "a failed job's daemon stops: nothing is retried"
    assert h.kube.created == []


def test_a_failed_jobs_service_is_deleted_and_a_users_service_is_kept() -> None:
    h = Harness()
    h.tick()
    assert list(h.kube.services) == [JOB], "the job starts with its headless Service"
    h.kube.create_errors.append(
        KubeError.from_answer(
            f"creating pod {NS}/{h.pod(0, 0)}: HTTP 422: Pod is invalid",
            status=422,
            fields=("spec.containers[0].image",),
        )
    )
    h.tick()
    assert h.kube.status["phase"] == "Failed"
    assert h.tick() is None
    assert h.kube.services == {}, "no rank of a Failed job runs again: its Service goes"

    # A Service of the job's name that the job does not own (the create found it there)
    # is the user's: the failed job leaves it alone.
    other = Harness()
    users = {"metadata": {"name": JOB, "namespace": NS}, "spec": {"clusterIP": "None"}}
    other.kube.services[JOB] = users
    other.tick()
    other.kube.create_errors.append(
        KubeError.from_answer(f"creating pod {NS}/x: HTTP 422: Pod is invalid", status=422)
    )
    other.tick()
    assert other.kube.status["phase"] == "Failed"
    assert other.tick() is None
    assert other.kube.services == {JOB: users}


def test_a_forbidden_create_is_retried_with_backoff_not_every_tick() -> None:
    h = Harness()
    h.tick()
    h.kube.create_errors.append(
        KubeError.from_answer(
            f"creating pod {NS}/{h.pod(0, 0)}: HTTP 403: pods is forbidden: exceeded quota: gpu",
            status=403,
        )
    )
    h.tick()
    assert h.kube.status["phase"] == "Pending"
    degraded = h.kube.condition("Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "PodCreateFailed")
    assert "exceeded quota" in degraded["message"]
    assert "retrying in 1s" in degraded["message"]
    assert h.memory.create_retry_at is not None
    h.tick()
    assert h.kube.created == [], "inside the backoff nothing is created"
    h.memory.create_retry_at = datetime.now(tz=UTC) - timedelta(seconds=1)  # the backoff passed
    h.tick()
    assert h.kube.created == [h.pod(0, 0)]
    degraded = h.kube.condition("Degraded")
    assert (degraded["status"], degraded["reason"]) == ("False", "Created")


def test_a_conflicting_write_is_detected_and_the_tick_decides_again_from_a_fresh_read() -> None:
    h = Harness()
    h.running()
    h.spot_notice("n1")

    def other_writer(kube: FakeKube) -> None:
        # Someone else changes the job between this tick's read and its write.
        kube.job["status"]["stepsLost"] = 7
        kube.bump()

    h.kube.before_write = other_writer
    h.tick()
    assert h.kube.conflicts == 1
    status = h.kube.status
    assert status["phase"] == "Checkpointing", "decided again and written"
    assert status["stepsLost"] == 7, "the other writer's change is kept, not overwritten"
    assert h.kube.phases().count("Checkpointing") == 1


def test_a_restart_another_writer_already_made_is_not_made_twice() -> None:
    h = Harness()
    h.running()
    h.spot_notice("n1")
    h.tick()
    h.tick()  # requests sent
    h.report_all(state="committed", step=40, trigger="notice")

    def other_operator(kube: FakeKube) -> None:
        # A second operator (a fail-over) took the same decision first.
        _merge(kube.job["status"], {"phase": "Restarting", "attempt": 1, "preemptions": 1,
                                    "resumedFromStep": 40, "notice": None})  # fmt: skip
        kube.bump()

    h.kube.before_write = other_operator
    h.tick()
    assert h.kube.conflicts == 1
    status = h.kube.status
    assert (status["phase"], status["attempt"], status["preemptions"]) == ("Restarting", 1, 1)


def test_a_write_that_keeps_losing_gives_up_to_the_daemons_backoff() -> None:
    h = Harness()
    h.running()
    h.spot_notice("n1")

    async def always_conflict(*args: Any, **kwargs: Any) -> str | None:
        raise KubeError.from_answer("patching: HTTP 409: modified", status=409)

    h.kube.patch_job_status = always_conflict  # type: ignore[method-assign]
    with pytest.raises(KubeConflictError):
        h.tick()
    assert h.kube.status["phase"] == "Running"


@pytest.mark.parametrize(
    ("status", "message", "kind"),
    [
        (422, "HTTP 422: invalid", "permanent"),
        (400, "HTTP 400: bad request", "permanent"),
        (403, "HTTP 403: pods is forbidden: violates PodSecurity restricted", "permanent"),
        (403, "HTTP 403: pods is forbidden: User cannot create pods", "temporary"),
        (409, "HTTP 409: modified", "conflict"),
        (410, "HTTP 410: too old", "temporary"),
        (503, "HTTP 503: unavailable", "temporary"),
        (0, "no answer (TimeoutError)", "temporary"),
    ],
)
def test_the_client_layer_says_which_errors_are_permanent(
    status: int, message: str, kind: str
) -> None:
    from baton_operator.pure.errors import PermanentError, TemporaryError

    error = KubeError.from_answer(message, status=status)
    assert error.permanent is (kind == "permanent")
    assert isinstance(error, PermanentError if kind == "permanent" else TemporaryError)
    assert isinstance(error, KubeConflictError) is (kind == "conflict")
    if kind == "conflict":
        assert cast(KubeConflictError, error).delay == 0.0


def test_jobs_by_phase_follow_each_jobs_phase_changes() -> None:
    h = Harness()

    def jobs(phase: str) -> float | None:
        return h.registry.get_sample_value("baton_jobs", {"phase": phase})

    h.tick()
    assert (jobs("Pending"), jobs("Running"), jobs("Failed")) == (1, 0, 0)
    h.running()
    h.tick()  # a tick counts the phase it reads
    assert (jobs("Pending"), jobs("Running")) == (0, 1)
    h.reconciler.forget(NS, JOB)
    assert (jobs("Pending"), jobs("Running")) == (0, 0)


def test_the_status_reports_the_step_the_ranks_actually_loaded() -> None:
    # An operator restarted mid-checkpoint found every rank gone and fell back to step 20,
    # while the ranks' notice save of step 24 had committed: the new attempt's ranks load
    # 24 (the newest complete step) and say so; the status must say it too.
    h = Harness()
    h.running()
    h.spot_notice("n1")
    h.tick()
    h.memory = JobMemory()  # the restarted operator remembers nothing
    h.kube.status["lastCheckpoint"] = {"step": 20, "trigger": "periodic"}
    h.kube.status["notice"]["requestedAt"] = h.kube.status["notice"]["receivedAt"]
    for name in list(h.kube.pods):
        pod = h.kube.pods[name]
        pod["status"]["phase"] = "Succeeded"
        pod["status"]["containerStatuses"][0]["state"] = {"terminated": {"exitCode": 75}}
    h.sidecars.reports.clear()
    h.tick()
    status = h.kube.status
    assert (status["phase"], status["resumedFromStep"]) == ("Restarting", 20)
    h.tick()  # Pending: rank 0 of attempt 1
    h.kube.run(h.pod(1, 0), node="n0", ip="10.0.1.1")
    h.tick()
    for rank in range(1, REPLICAS):
        h.kube.run(h.pod(1, rank), node=f"n{rank + 2}", ip=f"10.0.1.{rank + 1}")
    for rank in range(REPLICAS):
        idle = SidecarStatus(state="idle", last_committed_step=24)
        h.sidecars.reports[f"10.0.1.{rank + 1}"] = idle
    h.memory.next_progress_poll = None
    h.tick()
    status = h.kube.status
    assert status["resumedFromStep"] == 24
    assert status["lastCheckpoint"]["step"] == 24
    # The interruption that led here says so too (its steps lost are unknown: the restarted
    # operator never heard a step before it).
    (entry,) = status["interruptions"]
    assert (entry["attempt"], entry["resumeStep"]) == (0, 24), entry
    assert "stepsLost" not in entry
    corrected = [m for _, reason, m in h.events if reason == "ResumeStepCorrected"]
    assert len(corrected) == 1
    assert "loaded step 24, not the recorded step 20" in corrected[0]
    h.memory.next_progress_poll = None
    h.tick()
    assert len([r for _, r, _ in h.events if r == "ResumeStepCorrected"]) == 1, "said once"


def test_a_new_leader_reads_a_signal_save_from_the_ended_sidecars_and_records_it_once() -> None:
    # The active operator stopped (SIGSTOP) after it began the notice; the drain's SIGTERM made
    # every rank save step 24 (trigger signal, no request id, so no sidecar lingered) and exit
    # 75. The new leader has nobody to poll: each sidecar's last report is in its termination
    # message, which the kubelet keeps in the pod's status. No false fallback, one record.
    h = Harness()
    h.running()
    h.kube.status["lastCheckpoint"] = {"step": 20, "trigger": "periodic"}
    h.spot_notice("n1")
    h.tick()
    h.memory = JobMemory()  # the new leader remembers nothing
    h.build()
    beat = datetime.now(tz=UTC).isoformat()
    final = {
        "state": "committed", "step": 24, "trigger": "signal", "request_id": None,
        "uri": "s3://bucket/tj/step-000000000024", "seconds": 1.25, "last_committed_step": 24,
        "train_step": 24, "step_seconds": 0.5, "heartbeat": beat, "tier": "durable",
    }  # fmt: skip
    for name in list(h.kube.pods):
        pod = h.kube.pods[name]
        pod["status"]["phase"] = "Failed"
        pod["status"]["containerStatuses"][0]["state"] = {"terminated": {"exitCode": 75}}
        pod["status"]["initContainerStatuses"] = [
            {
                "name": manifests.SIDECAR_NAME,
                "state": {"terminated": {"exitCode": 0, "message": json.dumps(final)}},
            }
        ]
    h.sidecars.reports.clear()
    h.tick()
    status = h.kube.status
    assert (status["phase"], status["resumedFromStep"]) == ("Restarting", 24), status
    assert (status["lastCheckpoint"]["step"], status["lastCheckpoint"]["trigger"]) == (
        24,
        "notice",
    )
    assert (status["preemptions"], status["failures"]) == (1, 0)
    reasons = _reasons(h)
    assert "CheckpointFallback" not in reasons, h.events
    assert "CheckpointCommitted" in reasons
    (entry,) = status["interruptions"]
    assert (entry["lastGoodStep"], entry["resumeStep"], entry["stepsLost"]) == (24, 24, 0), entry
    assert entry["noticeToDurableSeconds"] is not None, entry
    h.tick()  # Pending: the new attempt resumes from the signal save, nothing to correct
    assert _env_of(h, 1, 0)["BATON_RESUME_STEP"] == "24"
    assert "ResumeStepCorrected" not in _reasons(h)


def test_a_sidecar_termination_message_that_is_not_a_report_is_ignored() -> None:
    def pod(message: str | None) -> PodView:
        state: dict[str, Any] = {"terminated": {"exitCode": 0}}
        if message is not None:
            state["terminated"]["message"] = message
        return PodView.from_body(
            {
                "status": {
                    "initContainerStatuses": [{"name": manifests.SIDECAR_NAME, "state": state}]
                }
            }
        )

    assert pod(None).sidecar_final is None
    assert pod("not json {").sidecar_final is None, "cut off at 4096 bytes, or an old sidecar"
    assert pod("[1, 2]").sidecar_final is None
    report = pod('{"state": "committed", "step": 7, "trigger": "notice"}').sidecar_final
    assert report is not None
    assert (report.state, report.step, report.committed_step) == ("committed", 7, 7)
    running = PodView.from_body(
        {"status": {"initContainerStatuses": [{"name": manifests.SIDECAR_NAME,
                                               "state": {"running": {}}}]}}
    )  # fmt: skip
    assert running.sidecar_final is None


def test_ranks_that_disagree_or_have_saved_since_claim_no_loaded_step() -> None:
    from baton_operator.pure.reports import loaded_step

    assert loaded_step([SidecarStatus(state="idle", last_committed_step=24)] * 2) == 24
    assert loaded_step([SidecarStatus(state="idle")]) is None, "not restored yet, or scratch"
    assert loaded_step([SidecarStatus(state="committed", step=30, last_committed_step=30)]) is None
    # The SDK's restored_step outlives the first save: a resume one step before a periodic
    # save was missed when only an idle report could say it (an API outage test in CI).
    saved_since = SidecarStatus(
        state="committed", step=25, last_committed_step=25, restored_step=24
    )
    assert loaded_step([saved_since, SidecarStatus(state="saving", restored_step=24)]) == 24
    assert loaded_step([saved_since, SidecarStatus(state="idle", restored_step=20)]) is None
    assert (
        loaded_step(
            [
                SidecarStatus(state="idle", last_committed_step=24),
                SidecarStatus(state="idle", last_committed_step=20),
            ]
        )
        is None
    )


# ----------------------------------------------------------------- disruption hints

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


def _env_of(h: Harness, attempt: int, rank: int) -> dict[str, str]:
    pod = h.kube.pods[h.pod(attempt, rank)]
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


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
    seconds = {_env_of(h, 0, r)["BATON_EVERY_SECONDS"] for r in range(REPLICAS)}
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
    assert _env_of(h, 1, 0)["BATON_EVERY_SECONDS"] == str(second["seconds"])
    h.memory = JobMemory()  # a restarted operator: the recorded choice, not a new one
    h.kube.run(h.pod(1, 0), node="n0", ip="10.0.0.1")
    h.tick()
    assert h.kube.status["checkpointInterval"] == second
    assert _env_of(h, 1, 1)["BATON_EVERY_SECONDS"] == str(second["seconds"])
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
    assert _env_of(h, 2, 0)["BATON_EVERY_SECONDS"] == str(third["seconds"])


def test_the_deletion_cost_follows_the_work_since_the_commit_and_goes_when_switched_off() -> None:
    h = Harness()
    h.kube.job["spec"]["disruption"] = {"deletionCost": True}
    h.running()
    at = datetime.now(tz=UTC)
    h.kube.status["lastCheckpoint"] = {"step": 20, "trigger": "periodic"}
    _training(h, "10.0.0.", step=30, at=at)
    h.tick()
    # No GPUs: the steps since the commit, on every running rank.
    assert [a.get(DELETION_COST) for a in _annotations(h, 0)] == ["10"] * REPLICAS
    written = len(h.kube.annotation_patches)
    _training(h, "10.0.0.", step=31, at=at)
    h.tick()
    assert len(h.kube.annotation_patches) == written, "a change of a tenth waits for the period"
    # A periodic commit of step 31: the work at risk falls to 0, written at once.
    _training(h, "10.0.0.", step=31, at=at, last_committed_step=31)
    h.tick()
    assert h.kube.status["lastCheckpoint"]["step"] == 31
    assert [a.get(DELETION_COST) for a in _annotations(h, 0)] == ["0"] * REPLICAS
    h.kube.job["spec"]["disruption"] = {"deletionCost": False}
    h.memory.next_progress_poll = None
    h.tick()
    assert [DELETION_COST in a for a in _annotations(h, 0)] == [False] * REPLICAS


# ----------------------------------------------------------------- spec.suspend (Kueue)


def _suspend(h: Harness, value: bool) -> None:
    """The user (or Kueue) sets ``spec.suspend``, as a patch of the spec does."""
    h.kube.job["spec"]["suspend"] = value
    h.kube.job["metadata"]["generation"] += 1
    h.kube.bump()


def _budgets(h: Harness) -> tuple[int, int]:
    return h.kube.status["preemptions"], h.kube.status["failures"]


def _reasons(h: Harness) -> list[str]:
    return [reason for _, reason, _ in h.events]


def test_suspend_checkpoints_every_rank_first_then_stops_the_pods_and_resumes_there() -> None:
    h = Harness(maxFailures=3)
    h.running()
    # Budgets already spent stay exactly as they are across the suspend.
    h.kube.status.update(preemptions=2, failures=1)
    _suspend(h, True)
    h.tick()
    status = h.kube.status
    assert status["phase"] == "Checkpointing"
    assert status["notice"]["source"] == "suspend"
    assert h.kube.condition("Checkpointing")["reason"] == "Suspend"
    assert h.kube.deleted == []
    # asked in the same tick, before the status was written
    assert sorted(ip for ip, _, _ in h.sidecars.requests) == ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    assert all(reason.startswith("suspend:") for _, _, reason in h.sidecars.requests)
    h.report_all(state="requested")
    h.tick()
    assert len(h.sidecars.requests) == REPLICAS, "asked once"
    deadline = h.sidecars.requests[0][1]
    assert deadline >= datetime.now(tz=UTC) + timedelta(
        seconds=h.config.suspend_save_seconds - 5
    ), "the suspend's own window, not a notice's"
    h.report_all(state="saving", trigger="notice")
    h.tick()
    h.tick()
    assert h.kube.deleted == [], "no pod goes before the save has an outcome"
    assert h.kube.status["phase"] == "Checkpointing"

    h.report_all(state="committed", step=40, trigger="notice", uri="s3://bucket/tj", seconds=1.5)
    h.tick()
    status = h.kube.status
    assert status["phase"] == "Suspended"
    assert sorted(h.kube.deleted) == [
        (h.pod(0, r), h.config.delete_grace_seconds) for r in range(REPLICAS)
    ]
    # decided: no sidecar keeps its pod waiting for its own outcome to be read
    assert sorted(h.sidecars.settled) == [
        (f"10.0.0.{r + 1}", f"req-10.0.0.{r + 1}") for r in range(3)
    ]
    assert (status["attempt"], status["resumedFromStep"]) == (1, 40)
    assert status["lastCheckpoint"]["step"] == 40
    assert status["restartReason"] == "suspend"
    assert _budgets(h) == (2, 1), "a suspend is neither a preemption nor a failure"
    assert "notice" not in status
    suspended = h.kube.condition("Suspended")
    assert (suspended["status"], suspended["reason"]) == ("True", "Suspended")
    assert "stopped at step 40" in suspended["message"]
    assert h.kube.condition("Ready")["status"] == "False"
    event = next(m for _, r, m in h.events if r == "Suspended")
    assert "stopped at step 40" in event
    assert "resumes from step 40" in event
    sample = h.registry.get_sample_value
    assert sample("baton_jobs", {"phase": "Suspended"}) == 0  # the phase is read next tick
    for _ in range(3):
        h.tick()
    assert sample("baton_jobs", {"phase": "Suspended"}) == 1
    assert (
        sample("baton_restarts_total", {"namespace": NS, "job": JOB, "reason": "suspend"}) is None
    )
    assert sample("baton_preemptions_total", {"namespace": NS, "job": JOB}) == 0
    assert h.kube.pods == {}, "a suspended job creates no pods"
    key = {"namespace": NS, "job": JOB}
    # Nothing runs, so no checkpoint is overdue (BatonNoRecentCheckpoint) and no budget is
    # being spent: the gauges go while the job is suspended.
    assert sample("baton_last_checkpoint_timestamp_seconds", key) is None
    assert sample("baton_failure_budget_remaining", key) is None

    _suspend(h, False)
    resumed = datetime.now(tz=UTC).replace(microsecond=0)
    h.tick()
    h.kube.status["lastCheckpoint"]["completedAt"] = "2026-01-01T00:00:00Z"  # long ago
    h.reconciler.forget(NS, JOB)  # an operator that starts now seeds the gauges afresh
    h.tick()
    # The suspended hours are no time without a checkpoint: it counts from the resume.
    assert sample("baton_last_checkpoint_timestamp_seconds", key) >= resumed.timestamp()
    assert sample("baton_failure_budget_remaining", key) == 2
    status = h.kube.status
    assert status["phase"] == "Pending"
    assert (status["attempt"], status["resumedFromStep"]) == (1, 40)
    assert _budgets(h) == (2, 1)
    assert h.kube.condition("Suspended")["status"] == "False"
    assert "Resumed" in _reasons(h)
    assert list(h.kube.pods) == [h.pod(1, 0)]
    assert _env_of(h, 1, 0)["BATON_RESUME_STEP"] == "40"
    assert h.kube.phases()[-4:] == ["Running", "Checkpointing", "Suspended", "Pending"]


def test_a_suspend_whose_save_times_out_still_stops_the_pods_at_the_last_committed_step() -> None:
    h = Harness()
    h.running()
    h.kube.status["lastCheckpoint"] = {"step": 20, "trigger": "periodic"}
    _suspend(h, True)
    h.tick()
    h.report_all(state="saving", trigger="notice")
    h.tick()
    assert h.kube.status["phase"] == "Checkpointing"
    # The deadline passes with the save still in flight (a stuck object store).
    h.kube.status["notice"]["deadline"] = "2026-01-01T00:00:00Z"
    h.tick()
    status = h.kube.status
    assert status["phase"] == "Suspended", "Kueue wants the quota back: the pods stop anyway"
    assert sorted(name for name, _ in h.kube.deleted) == [h.pod(0, r) for r in range(REPLICAS)]
    assert (status["attempt"], status["resumedFromStep"]) == (1, 20)
    assert (status["preemptions"], status["failures"]) == (0, 0)
    condition = h.kube.condition("Suspended")
    assert condition["reason"] == "SuspendedWithoutCheckpoint"
    assert "the last committed step is 20" in condition["message"]
    fallback = next(m for _, r, m in h.events if r == "CheckpointFallback")
    assert "deadline passed" in fallback
    assert "the last committed step is 20" in fallback
    assert "SuspendedWithoutCheckpoint" in _reasons(h)


def _memory_tier_job_suspended(last_checkpoint: dict[str, Any], **report: Any) -> Harness:
    """A running job with the memory tier and ``last_checkpoint`` recorded, suspended; every
    rank then answers the suspend's save with ``report``, and the operator ticks once."""
    h = Harness()
    h.kube.job["spec"]["checkpoint"].update({"fastEverySteps": 1, "fastSizeLimit": "64Mi"})
    h.running()
    h.kube.status["lastCheckpoint"] = last_checkpoint
    _suspend(h, True)
    h.tick()
    h.report_all(**report)
    h.tick()
    return h


def test_a_suspend_with_the_memory_tier_stops_no_pod_before_the_promotion_commits() -> None:
    # The SDK may commit a suspend's save to the memory tier (``choose_tier``: the request
    # has a deadline), replicated to peer pods. Every pod goes at the suspend, and with them
    # every copy: the save is its answer only once promoted to durable storage.
    h = _memory_tier_job_suspended(
        {"step": 20, "trigger": "periodic", "tier": "durable"}, state="requested"
    )
    memory = {"state": "committed", "step": 40, "trigger": "notice", "tier": "memory",
              "uri": "file:///fast/tj/step-40", "last_committed_step": 20}  # fmt: skip
    h.report_all(**memory)
    for _ in range(3):
        h.tick()
    assert h.kube.deleted == [], "a memory-only commit is no answer: its copies are in the pods"
    assert h.kube.status["phase"] == "Checkpointing"
    assert "Recovering" not in _reasons(h), "a suspend is never answered by a notice recovery"
    h.report_all(**{**memory, "tier": "memory+promoted", "uri": "s3://bucket/tj/step-40",
                    "last_committed_step": 40})  # fmt: skip
    h.tick()
    status = h.kube.status
    assert status["phase"] == "Suspended"
    assert sorted(name for name, _ in h.kube.deleted) == [h.pod(0, r) for r in range(REPLICAS)]
    assert status["resumedFromStep"] == 40
    assert status["lastCheckpoint"]["step"] == 40
    assert status["lastCheckpoint"]["tier"] == "memory+promoted", "recorded as a notice's is"


def test_a_suspend_whose_promotion_misses_the_deadline_resumes_from_the_durable_step() -> None:
    h = _memory_tier_job_suspended(
        {"step": 20, "trigger": "periodic", "tier": "durable"},
        state="committed",
        step=40,
        trigger="notice",
        tier="memory",
        last_committed_step=20,
    )
    h.kube.status["notice"]["deadline"] = "2026-01-01T00:00:00Z"
    h.tick()
    status = h.kube.status
    assert status["phase"] == "Suspended"
    assert (status["resumedFromStep"], status["lastCheckpoint"]["step"]) == (20, 20)
    assert h.kube.condition("Suspended")["reason"] == "SuspendedWithoutCheckpoint"


def test_a_suspend_after_a_memory_commit_not_yet_promoted_never_resumes_from_it() -> None:
    # A notice's recovery recorded step 30 on the memory tier (``lastCheckpoint.tier``); its
    # promotion is not seen yet when the suspend comes, and the suspend's own save fails.
    # The pods go with the only copies of step 30: the job resumes from step 20, the newest
    # step a rank reports durable, never from 30, which would exist nowhere.
    h = _memory_tier_job_suspended(
        {"step": 30, "trigger": "notice", "tier": "memory"},
        state="failed",
        step=35,
        trigger="notice",
        error="disk full",
        last_committed_step=20,
    )
    status = h.kube.status
    assert status["phase"] == "Suspended"
    assert status["resumedFromStep"] == 20
    assert status["lastCheckpoint"]["step"] == 20
    assert "the last committed step is 20" in h.kube.condition("Suspended")["message"]
    _suspend(h, False)
    h.tick()
    assert _env_of(h, 1, 0)["BATON_RESUME_STEP"] == "20"


def test_a_suspend_after_a_memory_commit_a_rank_proves_promoted_resumes_from_it() -> None:
    h = _memory_tier_job_suspended(
        {"step": 30, "trigger": "notice", "tier": "memory"},
        state="failed",
        step=35,
        trigger="notice",
        error="disk full",
        last_committed_step=30,
    )
    status = h.kube.status
    assert (status["phase"], status["resumedFromStep"]) == ("Suspended", 30)


def test_a_suspend_with_no_durable_step_behind_a_memory_commit_resumes_from_the_start() -> None:
    h = _memory_tier_job_suspended(
        {"step": 30, "trigger": "notice", "tier": "memory"},
        state="failed",
        step=35,
        trigger="notice",
        error="disk full",
    )
    status = h.kube.status
    assert status["phase"] == "Suspended"
    assert status.get("resumedFromStep") is None
    assert "lastCheckpoint" not in status, "its step is in no pod after the suspend"
    _suspend(h, False)
    h.tick()
    assert "BATON_RESUME_STEP" not in _env_of(h, 1, 0)


def test_a_job_created_suspended_creates_no_pods_until_unsuspended() -> None:
    h = Harness()
    h.kube.job["spec"]["suspend"] = True
    for i in range(REPLICAS):
        h.node(f"n{i}")
    for _ in range(4):
        h.tick()
    status = h.kube.status
    assert status["phase"] == "Suspended"
    assert h.kube.created == []
    assert h.kube.deleted == []
    assert status["attempt"] == 0, "nothing ran: no attempt is used up"
    assert h.kube.condition("Suspended")["status"] == "True"
    _suspend(h, False)
    h.tick()
    assert h.kube.status["phase"] == "Pending"
    assert h.kube.created == [h.pod(0, 0)]
    assert "BATON_RESUME_STEP" not in _env_of(h, 0, 0)
    h.kube.run(h.pod(0, 0), node="n0", ip="10.0.0.1")
    h.tick()
    assert h.kube.created == [h.pod(0, r) for r in range(REPLICAS)]


def test_a_suspend_before_the_attempt_runs_stops_its_pods_without_asking_for_a_save() -> None:
    h = Harness()
    for i in range(REPLICAS):
        h.node(f"n{i}")
    h.tick()
    h.tick()
    h.kube.run(h.pod(0, 0), node="n0", ip="10.0.0.1")
    h.kube.status["lastCheckpoint"] = {"step": 10, "trigger": "periodic"}
    _suspend(h, True)
    h.tick()
    status = h.kube.status
    assert status["phase"] == "Suspended"
    assert h.sidecars.requests == [], "nothing trained since the last commit: nothing to save"
    assert h.kube.deleted == [(h.pod(0, 0), h.config.delete_grace_seconds)]
    assert (status["attempt"], status["resumedFromStep"]) == (1, 10)
    assert (status["preemptions"], status["failures"]) == (0, 0)


def test_a_restarted_operator_finishes_a_suspend_decided_before_it_died() -> None:
    h = Harness()
    h.running()
    _suspend(h, True)
    h.tick()  # Checkpointing (suspend), written; the operator dies before asking the ranks
    h.memory = JobMemory()
    h.report_all(state="requested")
    h.tick()  # the next operator reads the status and asks them itself
    assert len(h.sidecars.requests) == REPLICAS
    h.report_all(state="committed", step=40, trigger="notice", uri="s3://bucket/tj", seconds=1.0)
    real_delete = h.kube.delete_pod

    async def killed(namespace: str, name: str, *, grace_seconds: int | None) -> None:
        raise RuntimeError("operator killed between its status write and the deletes")

    h.kube.delete_pod = killed  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="operator killed"):
        h.tick()
    assert h.kube.status["phase"] == "Suspended", "the decision is written before it is done"
    assert len(h.kube.pods) == REPLICAS
    h.kube.delete_pod = real_delete  # type: ignore[method-assign]
    h.memory = JobMemory()
    h.tick()
    assert h.kube.pods == {}, "the next operator deletes what the suspend left"
    status = h.kube.status
    assert (status["phase"], status["attempt"], status["resumedFromStep"]) == ("Suspended", 1, 40)
    assert h.kube.created.count(h.pod(1, 0)) == 0


def test_a_notice_save_in_flight_when_the_job_is_suspended_ends_suspended() -> None:
    h = Harness()
    h.running()
    h.spot_notice("n1")
    h.tick()
    h.report_all(state="saving", trigger="notice")
    h.tick()
    _suspend(h, True)
    h.report_all(state="committed", step=40, trigger="notice", uri="s3://bucket/tj", seconds=1.5)
    h.tick()
    status = h.kube.status
    assert (status["phase"], status["resumedFromStep"], status["preemptions"]) == (
        "Suspended",
        40,
        0,
    )
    assert "n1" in status["avoidNodes"], "the resumed attempt still keeps off the noticed node"
    _suspend(h, False)
    h.tick()
    assert "n1" in str(h.kube.pods[h.pod(1, 0)]["spec"]["affinity"])


def _kueue_metadata(h: Harness, attempt: int) -> list[tuple[dict[str, str], dict[str, str]]]:
    pods = [h.kube.pods[h.pod(attempt, r)]["metadata"] for r in range(REPLICAS)]
    return [(m["labels"], m.get("annotations") or {}) for m in pods]


def test_pods_carry_the_jobs_kueue_queue_and_one_pod_group_per_attempt() -> None:
    h = Harness()
    h.kube.job["metadata"]["labels"] = {
        "kueue.x-k8s.io/queue-name": "team-a",
        "kueue.x-k8s.io/priority-class": "high",
        "other": "x",
    }
    h.running()
    seen = {0: _kueue_metadata(h, 0)}
    h.spot_notice("n1")
    h.tick()
    h.report_all(state="committed", step=40, trigger="notice", uri="s3://bucket/tj", seconds=1.5)
    h.tick()
    h.tick()
    h.kube.run(h.pod(1, 0), node="n0", ip="10.0.0.1")
    h.tick()
    seen[1] = _kueue_metadata(h, 1)
    for attempt, pods in seen.items():
        for labels, notes in pods:
            assert labels["kueue.x-k8s.io/queue-name"] == "team-a"
            assert labels["kueue.x-k8s.io/priority-class"] == "high"
            assert labels["kueue.x-k8s.io/pod-group-name"] == f"{JOB}-a{attempt}"
            assert notes["kueue.x-k8s.io/pod-group-total-count"] == str(REPLICAS)
            assert "other" not in labels, "only Kueue's labels pass from the job to its pods"


def test_a_job_without_a_queue_gets_no_kueue_metadata() -> None:
    h = Harness()
    h.kube.job["metadata"]["labels"] = {"kueue.x-k8s.io/priority-class": "high"}
    h.running()
    for labels, notes in _kueue_metadata(h, 0):
        assert not [k for k in (*labels, *notes) if k.startswith("kueue.x-k8s.io/")]


# ----------------------------------------------------------------- interruption history, goodput


def _gpu_job(h: Harness, gpus_per_pod: int, *, age_seconds: float) -> datetime:
    """Give the trainer ``gpus_per_pod`` GPUs and make the job ``age_seconds`` old."""
    container = h.kube.job["spec"]["template"]["spec"]["containers"][0]
    container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus_per_pod)}}
    created = datetime.now(tz=UTC) - timedelta(seconds=age_seconds)
    h.kube.job["metadata"]["creationTimestamp"] = created.isoformat()
    return created


def _training(h: Harness, attempt_ip: str, *, step: int, at: datetime, **extra: Any) -> None:
    """Every rank's sidecar relays the SDK's progress: ``step`` finished at ``at``."""
    for rank in range(REPLICAS):
        h.sidecars.reports[f"{attempt_ip}{rank + 1}"] = SidecarStatus(
            state="idle", train_step=step, step_seconds=0.5, heartbeat=at, **extra
        )
    h.memory.next_progress_poll = None


def _sample(h: Harness, name: str) -> float | None:
    return h.registry.get_sample_value(name, {"namespace": NS, "job": JOB})


def test_a_notice_preemption_is_recorded_with_its_lead_time_and_notice_to_durable() -> None:
    h = Harness()
    _gpu_job(h, 2, age_seconds=100)
    h.running()
    _training(h, "10.0.0.", step=57, at=datetime.now(tz=UTC), last_committed_step=50)
    h.tick()
    goodput = h.kube.status["goodput"]
    assert goodput["step"] == 57
    assert goodput["productiveSeconds"] == pytest.approx(57 * 0.5)
    assert 100 <= goodput["wallSeconds"] < 100 + 60
    assert goodput["ratio"] == pytest.approx(57 * 0.5 / goodput["wallSeconds"], rel=1e-3)
    assert _sample(h, "baton_goodput_ratio") == pytest.approx(goodput["ratio"], rel=1e-3)

    h.spot_notice("n1")
    h.tick()
    h.report_all(state="committed", step=60, trigger="notice", uri="s3://bucket/tj", seconds=1.5,
                 train_step=60, step_seconds=0.5, heartbeat=datetime.now(tz=UTC))  # fmt: skip
    h.tick()
    status = h.kube.status
    assert status["phase"] == "Restarting"
    (entry,) = status["interruptions"]
    assert (entry["attempt"], entry["source"], entry["nodes"]) == (0, "aws", ["n1"])
    assert (entry["lastGoodStep"], entry["resumeStep"], entry["stepsLost"]) == (60, 60, 0)
    assert (entry["gpus"], entry["gpuSecondsLost"], entry["stepSeconds"]) == (6, 0.0, 0.5)
    notice_at = datetime.fromisoformat(entry["noticeAt"].replace("Z", "+00:00"))
    deadline = datetime.fromisoformat(entry["deadline"].replace("Z", "+00:00"))
    assert entry["leadSeconds"] == (deadline - notice_at).total_seconds()
    assert entry["leadSeconds"] >= h.config.min_checkpoint_window_seconds
    assert 0 <= entry["noticeToDurableSeconds"] <= entry["leadSeconds"]
    assert "restartSeconds" not in entry, "known once the next attempt trains"
    assert status["stepsLost"] == 0
    assert _sample(h, "baton_notice_lead_seconds_count") == 1
    assert _sample(h, "baton_steps_lost_per_restart_count") == 1


def test_a_failure_records_the_steps_and_gpu_seconds_lost_then_the_restart_time() -> None:
    h = Harness(maxFailures=3)
    _gpu_job(h, 2, age_seconds=300)
    h.running()
    h.kube.status["lastCheckpoint"] = {"step": 50, "trigger": "periodic"}
    last_good = datetime.now(tz=UTC) - timedelta(seconds=30)
    _training(h, "10.0.0.", step=57, at=last_good, last_committed_step=50)
    h.tick()
    pod = h.kube.pods[h.pod(0, 2)]
    pod["status"]["phase"] = "Failed"
    pod["status"]["containerStatuses"][0]["state"] = {"terminated": {"exitCode": 1}}
    h.tick()
    status = h.kube.status
    assert (status["phase"], status["failures"], status["resumedFromStep"]) == (
        "Restarting", 1, 50,
    )  # fmt: skip
    (entry,) = status["interruptions"]
    assert entry["source"] == "failure"
    assert "noticeAt" not in entry
    assert "noticeToDurableSeconds" not in entry
    assert (entry["lastGoodStep"], entry["resumeStep"], entry["stepsLost"]) == (57, 50, 7)
    assert entry["gpus"] == REPLICAS * 2
    assert entry["gpuSecondsLost"] == pytest.approx(7 * 0.5 * REPLICAS * 2)
    assert status["stepsLost"] == 7
    assert _sample(h, "baton_steps_lost_total") == 7
    assert _sample(h, "baton_gpu_seconds_lost_total") == pytest.approx(21.0)

    h.kube.status.pop("restartAfter")  # the failure's backoff is over
    h.tick()  # Pending: attempt 1
    h.kube.run(h.pod(1, 0), node="n0", ip="10.0.1.1")
    h.tick()
    for rank in range(1, REPLICAS):
        h.kube.run(h.pod(1, rank), node=f"n{rank}", ip=f"10.0.1.{rank + 1}")
    # The new attempt's ranks restored step 50 and have not stepped yet: nothing to fill.
    for rank in range(REPLICAS):
        h.sidecars.reports[f"10.0.1.{rank + 1}"] = SidecarStatus(
            state="idle", last_committed_step=50
        )
    h.memory.next_progress_poll = None
    h.tick()
    assert "restartSeconds" not in h.kube.status["interruptions"][-1]
    first = last_good.replace(microsecond=0) + timedelta(seconds=42)
    _training(h, "10.0.1.", step=51, at=first, last_committed_step=50)
    h.tick()
    (entry,) = h.kube.status["interruptions"]
    last_good_at = datetime.fromisoformat(entry["lastGoodStepAt"].replace("Z", "+00:00"))
    assert entry["restartSeconds"] == (first - last_good_at).total_seconds()
    assert 42 <= entry["restartSeconds"] < 43
    assert _sample(h, "baton_restart_seconds_count") == 1
    h.memory.next_progress_poll = None
    h.tick()
    assert _sample(h, "baton_restart_seconds_count") == 1, "filled once"


def test_a_node_lost_without_notice_is_recorded_as_node_lost() -> None:
    h = Harness(maxFailures=3)
    h.running()
    _training(h, "10.0.0.", step=12, at=datetime.now(tz=UTC))
    h.tick()
    h.node("n2", ready=False, for_seconds=3600)
    h.tick()
    status = h.kube.status
    assert status["phase"] == "Restarting", status
    (entry,) = status["interruptions"]
    assert (entry["source"], entry["nodes"]) == ("node-lost", ["n2"])
    assert (entry["lastGoodStep"], entry["stepsLost"]) == (12, 12), "no checkpoint: all lost"
    assert (entry["gpus"], entry["gpuSecondsLost"]) == (0, 0.0), "a job without GPUs"


def test_the_history_keeps_the_newest_twenty() -> None:
    h = Harness(maxFailures=3)
    h.running()
    old = [{"attempt": -100 + i, "source": "failure", "at": "2026-01-01T00:00:00Z"}
           for i in range(20)]  # fmt: skip
    h.kube.status["interruptions"] = old
    pod = h.kube.pods[h.pod(0, 0)]
    pod["status"]["containerStatuses"][0]["state"] = {"terminated": {"exitCode": 1}}
    h.tick()
    history = h.kube.status["interruptions"]
    assert len(history) == 20
    assert history[0] == old[1], "the oldest went"
    assert history[-1]["attempt"] == 0
    assert "stepsLost" not in history[-1], "no step was ever reported: unknown, not 0"


# ----------------------------------------------------------------- gang scheduling (PodGroup)

GANG = OperatorConfig(gang_scheduling=True)
MASTER_NAME = f"{JOB}-a{{attempt}}-r0.{JOB}.{NS}.svc.cluster.local"


def _gang(h: Harness) -> None:
    """The API server serves scheduling.k8s.io/v1beta1 PodGroups (none exist yet)."""
    h.kube.pod_groups = {}
    for i in range(REPLICAS):
        h.node(f"n{i}")


def _assert_gang_attempt(h: Harness, attempt: int) -> None:
    """The attempt's PodGroup (all ranks, owned by the job) and every rank linked to it, all
    of them rendezvousing at rank 0's DNS name."""
    assert h.kube.pod_groups is not None
    group = h.kube.pod_groups[f"{JOB}-a{attempt}"]
    assert group["apiVersion"] == "scheduling.k8s.io/v1beta1"
    assert group["kind"] == "PodGroup"
    assert group["spec"] == {"schedulingPolicy": {"gang": {"minCount": REPLICAS}}}
    assert group["metadata"]["namespace"] == NS
    assert group["metadata"]["labels"]["baton.dev/attempt"] == str(attempt)
    assert [(o["kind"], o["uid"]) for o in group["metadata"]["ownerReferences"]] == [
        ("TrainingJob", "uid-1")
    ]
    master = MASTER_NAME.format(attempt=attempt)
    for rank in range(REPLICAS):
        pod = h.kube.pods[h.pod(attempt, rank)]
        assert pod["spec"]["schedulingGroup"] == {"podGroupName": f"{JOB}-a{attempt}"}
        assert (pod["spec"]["hostname"], pod["spec"]["subdomain"]) == (h.pod(attempt, rank), JOB)
        env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
        for name in ("MASTER_ADDR", "PET_MASTER_ADDR"):
            assert env[name] == {"name": name, "value": master}
    assert h.kube.status["masterAddr"] == master


def test_a_gang_attempt_creates_its_pod_group_then_every_rank_in_one_pass() -> None:
    h = Harness(config=GANG)
    _gang(h)
    h.tick()  # Secret, Service, Pending
    h.tick()
    # No pod has an IP (none is bound): every rank exists anyway, after the group.
    assert h.kube.created == [f"podgroup/{JOB}-a0", *(h.pod(0, r) for r in range(REPLICAS))]
    _assert_gang_attempt(h, 0)
    h.tick()
    assert len(h.kube.created) == 1 + REPLICAS, "nothing is created twice"
    assert h.kube.discoveries == 1, "the served APIs are discovered once, then cached"
    for rank in range(REPLICAS):
        h.kube.run(h.pod(0, rank), node=f"n{rank}", ip=f"10.0.0.{rank + 1}")
        h.sidecars.reports[f"10.0.0.{rank + 1}"] = SidecarStatus(state="idle")
    h.tick()
    assert h.kube.status["phase"] == "Running"
    assert h.kube.deleted_groups == []


def test_a_restart_drops_the_old_attempts_pod_group_and_gangs_the_new_one() -> None:
    h = Harness(config=GANG)
    _gang(h)
    h.tick()
    h.tick()
    for rank in range(REPLICAS):
        h.kube.run(h.pod(0, rank), node=f"n{rank}", ip=f"10.0.0.{rank + 1}")
        h.sidecars.reports[f"10.0.0.{rank + 1}"] = SidecarStatus(state="idle")
    h.tick()
    h.spot_notice("n1")
    h.tick()
    h.report_all(state="committed", step=40, trigger="notice", uri="s3://bucket/tj", seconds=1.5)
    h.tick()
    assert h.kube.status["phase"] == "Restarting"
    # The old attempt's pods and its gang go together (the group's finalizer keeps it
    # until the pods are gone).
    assert h.kube.deleted_groups == [f"{JOB}-a0"]
    assert "masterAddr" not in h.kube.status
    h.tick()  # Restarting -> Pending: the new attempt, all at once
    assert h.kube.status["phase"] == "Pending"
    _assert_gang_attempt(h, 1)
    for rank in range(REPLICAS):
        h.kube.run(h.pod(1, rank), node=f"n{rank}", ip=f"10.0.1.{rank + 1}")
        pod = h.kube.pods[h.pod(1, rank)]
        pod["status"]["phase"] = "Succeeded"
        pod["status"]["containerStatuses"][0]["state"] = {"terminated": {"exitCode": 0}}
    h.tick()
    assert h.kube.status["phase"] == "Succeeded"
    assert h.tick() is None
    assert h.kube.deleted_groups == [f"{JOB}-a0", f"{JOB}-a1"], "a finished gang goes too"
    assert h.kube.discoveries == 1


def test_a_suspend_drops_the_gang_and_the_unsuspended_attempt_gets_a_new_one() -> None:
    h = Harness(config=GANG)
    _gang(h)
    h.tick()
    h.tick()
    _assert_gang_attempt(h, 0)
    _suspend(h, True)  # Pending, nothing trained: stops at once
    h.tick()
    assert h.kube.status["phase"] == "Suspended"
    assert h.kube.deleted_groups == [f"{JOB}-a0"]
    _suspend(h, False)
    h.tick()
    assert h.kube.status["phase"] == "Pending"
    _assert_gang_attempt(h, 1)


def test_without_the_pod_group_api_rank_0_comes_first_and_its_ip_is_the_master() -> None:
    h = Harness(config=GANG)  # the fake serves no scheduling.k8s.io/v1beta1
    h.tick()
    h.tick()
    assert h.kube.created == [h.pod(0, 0)], "the others wait for rank 0's IP"
    h.tick()
    assert h.kube.created == [h.pod(0, 0)]
    h.kube.run(h.pod(0, 0), node="n0", ip="10.0.0.1")
    h.tick()
    assert h.kube.created == [h.pod(0, r) for r in range(REPLICAS)]
    assert h.kube.status["masterAddr"] == "10.0.0.1"
    for rank in range(REPLICAS):
        pod = h.kube.pods[h.pod(0, rank)]
        assert "schedulingGroup" not in pod["spec"]
        if rank:
            assert _env_of(h, 0, rank)["MASTER_ADDR"] == "10.0.0.1"
    assert h.kube.discoveries == 1


def test_gang_scheduling_off_never_asks_for_the_api() -> None:
    h = Harness(config=OperatorConfig(gang_scheduling=False))
    _gang(h)
    h.tick()
    h.tick()
    assert h.kube.created == [h.pod(0, 0)]
    assert h.kube.pod_groups == {}
    assert h.kube.discoveries == 0


def test_an_attempt_begun_without_a_pod_group_ends_the_way_it_began() -> None:
    """An operator upgraded (or switched on) mid-attempt finds rank 0 without a group: the
    attempt keeps the rank-0-first path; a gang of n whose rank 0 is outside it never binds."""
    h = Harness(config=OperatorConfig(gang_scheduling=False))
    h.tick()
    h.tick()
    assert h.kube.created == [h.pod(0, 0)]
    served = Harness(config=GANG)
    served.kube = h.kube
    served.memory = h.memory
    served.reconciler = Reconciler(
        kube=cast(Any, h.kube), sidecars=cast(Any, h.sidecars), cluster=h.cluster,
        metrics=Metrics(CollectorRegistry()), config=GANG, post_event=_no_event,
        token_for=lambda spec: "token",
    )  # fmt: skip
    _gang(served)
    served.tick()
    assert served.kube.created == [h.pod(0, 0)]
    served.kube.run(h.pod(0, 0), node="n0", ip="10.0.0.1")
    served.tick()
    assert served.kube.created == [h.pod(0, r) for r in range(REPLICAS)]
    assert served.kube.pod_groups == {}
    assert served.kube.status["masterAddr"] == "10.0.0.1"


async def _no_event(job: Any, kind: str, reason: str, message: str) -> None:
    return None


def test_a_refused_pod_group_fails_the_job_naming_it() -> None:
    h = Harness(config=GANG)
    _gang(h)
    h.tick()

    async def refuse(namespace: str, body: dict[str, Any]) -> bool:
        raise KubeError.from_answer(
            "creating PodGroup team/tj-a0: HTTP 422: PodGroup.scheduling.k8s.io \"tj-a0\" is "
            "invalid: spec.schedulingPolicy.gang.minCount: Invalid value",
            status=422, fields=("spec.schedulingPolicy.gang.minCount",),
        )  # fmt: skip

    h.kube.create_pod_group = refuse  # type: ignore[method-assign]
    h.tick()
    assert h.kube.status["phase"] == "Failed"
    assert h.kube.condition("Failed")["reason"] == "PodGroupRejected"
    assert "spec.schedulingPolicy.gang.minCount" in h.kube.status["message"]
    assert h.kube.created == [], "no rank is created without its gang"


def test_a_gang_that_does_not_fit_shrinks_one_replica_at_a_time_to_min_replicas() -> None:
    """A gang binds all or none, so "how many could be placed" is unknown: each elastic step
    tries one replica fewer (not straight to minReplicas), and that attempt is a gang too."""
    h = Harness(config=GANG)
    h.kube.job["spec"].update(minReplicas=1, elasticWaitSeconds=0)
    _gang(h)
    h.tick()
    h.tick()
    for rank in range(REPLICAS):
        h.kube.pods[h.pod(0, rank)]["status"] = {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}],
        }
    h.tick()  # unschedulableSince
    h.tick()  # the wait (0 s) is over: shrink
    status = h.kube.status
    assert (status["phase"], status["restartReason"]) == ("Restarting", "elastic"), status
    assert status["replicas"] == REPLICAS - 1
    assert "a gang: none is bound until all fit" in status["message"]
    assert h.kube.deleted_groups == [f"{JOB}-a0"]
    h.tick()  # the old pods are gone: the smaller attempt, as a gang of its own
    group = (h.kube.pod_groups or {})[f"{JOB}-a1"]
    assert group["spec"]["schedulingPolicy"]["gang"]["minCount"] == REPLICAS - 1
    assert sorted(n for n in h.kube.pods if "-a1-" in n) == [h.pod(1, r) for r in range(2)]


# ----------------------------------------------------------------- the memory tier's recovery


def _memory_tier(h: Harness) -> None:
    h.kube.job["spec"]["checkpoint"].update({"fastEverySteps": 1, "fastSizeLimit": "64Mi"})


def _restarted_in_place(h: Harness, name: str, restarts: int, last_exit: int = 1) -> None:
    """The kubelet restarted the pod's trainer in place (its restart rules)."""
    h.kube.pods[name]["status"]["containerStatuses"] = [
        {
            "name": manifests.TRAINER_NAME,
            "state": {"running": {}},
            "restartCount": restarts,
            "lastState": {"terminated": {"exitCode": last_exit}},
        }
    ]


def _restored(h: Harness, ips: list[str], *, step: int, tier: str) -> None:
    beat = datetime.now(tz=UTC) + timedelta(seconds=1)
    for ip in ips:
        h.sidecars.reports[ip] = SidecarStatus(
            state="idle", restored_step=step, restored_tier=tier, train_step=step, heartbeat=beat
        )


def _lose_rank1_and_recover(h: Harness, *, tier: str) -> dict[str, Any]:
    _memory_tier(h)
    h.running()
    kept_uids = {r: h.kube.pods[h.pod(0, r)]["metadata"]["uid"] for r in (0, 2)}
    h.node("n1", ready=False, for_seconds=h.config.node_lost_seconds + 1)
    _restarted_in_place(h, h.pod(0, 0), 1)
    _restarted_in_place(h, h.pod(0, 2), 1)
    h.tick()
    status = h.kube.status
    assert (status["phase"], status["attempt"], status["failures"]) == ("Running", 0, 1)
    recovery = status["recovery"]
    assert [(e["rank"], e["pod"], e["node"]) for e in recovery["replaced"]] == [
        (1, h.pod(0, 1), "n1")
    ]
    assert recovery["kept"] == [h.pod(0, 0), h.pod(0, 2)]
    assert "n1" in status["avoidNodes"]
    assert status["interruptions"][-1]["source"] == "node-lost"
    assert h.kube.deleted == [(h.pod(0, 1), 0)], "only the lost pod goes, at once"
    assert ("Warning", "Recovering") in [(k, r) for k, r, _ in h.events]
    h.tick()  # the replacement: the same name, the same attempt, no schedulingGroup
    assert h.kube.created.count(h.pod(0, 1)) == 2
    body = h.kube.pods[h.pod(0, 1)]
    assert body["metadata"]["labels"][manifests.ATTEMPT_LABEL] == "0"
    assert "n1" in str(body["spec"]["affinity"]), "the replacement avoids the lost node"
    trainer_env = {e["name"]: e.get("value") for e in body["spec"]["containers"][0]["env"]}
    assert trainer_env["MASTER_ADDR"] == status["masterAddr"]
    h.kube.run(h.pod(0, 1), node="n3", ip="10.0.0.9")
    h.node("n3")
    h.tick()
    assert h.kube.status.get("recovery"), "no rank has reported its restore yet"
    _restored(h, ["10.0.0.1", "10.0.0.9", "10.0.0.3"], step=7, tier=tier)
    h.tick()
    status = h.kube.status
    assert "recovery" not in status
    assert {r: h.kube.pods[h.pod(0, r)]["metadata"]["uid"] for r in (0, 2)} == kept_uids
    assert status["trainerRestarts"] == {h.pod(0, 0): 1, h.pod(0, 1): 0, h.pod(0, 2): 1}
    assert (status["attempt"], status["failures"], status["resumedFromStep"]) == (0, 1, 7)
    assert status["interruptions"][-1]["resumeStep"] == 7
    h.tick()  # the survivors' in-place restarts were the recovery's: no failure
    assert (h.kube.status["attempt"], h.kube.status["failures"]) == (0, 1)
    return status


def test_a_lost_node_with_the_memory_tier_replaces_only_its_pod() -> None:
    h = Harness(maxFailures=2)
    status = _lose_rank1_and_recover(h, tier="memory")
    last = status["lastRecovery"]
    assert (last["tier"], last["restoredStep"]) == ("memory", 7)
    assert h.kube.condition("Recovering")["status"] == "False"
    assert any(k == "Normal" and r == "Recovered" and "memory tier" in m for k, r, m in h.events)


def test_a_recovery_the_memory_tier_cannot_cover_says_it_used_the_durable_tier() -> None:
    h = Harness(maxFailures=2)
    status = _lose_rank1_and_recover(h, tier="durable")
    assert status["lastRecovery"]["tier"] == "durable"
    assert h.kube.condition("Recovering")["reason"] == "RecoveredFromDurable"
    warning = [m for k, r, m in h.events if (k, r) == ("Warning", "RecoveredFromDurable")]
    assert warning
    assert "durable tier" in warning[0]
    assert "step 7" in warning[0]


def test_rank_0_lost_while_ranks_reach_it_by_ip_starts_a_new_attempt() -> None:
    h = Harness(maxFailures=2)
    _memory_tier(h)
    h.running()
    assert h.kube.status["masterAddr"] == "10.0.0.1"
    h.node("n0", ready=False, for_seconds=h.config.node_lost_seconds + 1)
    h.tick()
    status = h.kube.status
    assert (status["phase"], status["attempt"], status["failures"]) == ("Restarting", 1, 1)
    assert "recovery" not in status


def test_rank_0_lost_on_the_gang_path_is_replaced_under_its_dns_name() -> None:
    h = Harness(maxFailures=2)
    h.kube.pod_groups = {}
    _memory_tier(h)
    for i in range(REPLICAS):
        h.node(f"n{i}")
    h.tick()
    h.tick()
    for rank in range(REPLICAS):
        h.kube.run(h.pod(0, rank), node=f"n{rank}", ip=f"10.0.0.{rank + 1}")
        h.sidecars.reports[f"10.0.0.{rank + 1}"] = SidecarStatus(state="idle")
    h.tick()
    master = h.kube.status["masterAddr"]
    assert master.startswith(h.pod(0, 0) + ".")
    h.node("n0", ready=False, for_seconds=h.config.node_lost_seconds + 1)
    h.tick()
    assert [e["rank"] for e in h.kube.status["recovery"]["replaced"]] == [0]
    h.tick()
    body = h.kube.pods[h.pod(0, 0)]
    assert "schedulingGroup" not in body["spec"], "the gang was admitted already"
    env = {e["name"]: e.get("value") for e in body["spec"]["containers"][0]["env"]}
    assert env["MASTER_ADDR"] == master


def test_a_trainer_restarted_in_place_without_a_node_loss_is_a_failure() -> None:
    h = Harness(maxFailures=2)
    _memory_tier(h)
    h.running()
    _restarted_in_place(h, h.pod(0, 2), 1, last_exit=3)
    h.tick()
    # A survivor restarts before its peer's node looks lost: not counted yet.
    assert (h.kube.status["attempt"], h.kube.status["failures"]) == (0, 0)
    assert h.memory.restart_seen_at is not None
    h.memory.restart_seen_at -= timedelta(
        seconds=h.config.node_lost_seconds + 61  # past lifecycle.restart_grace_seconds
    )
    h.tick()
    status = h.kube.status
    assert (status["phase"], status["attempt"], status["failures"]) == ("Restarting", 1, 1)
    assert "exited with code 3 and was restarted in place 1 time(s)" in status["message"]


def test_a_crash_loop_during_a_recovery_gives_it_up_for_a_new_attempt() -> None:
    h = Harness(maxFailures=3)
    _memory_tier(h)
    h.running()
    h.node("n1", ready=False, for_seconds=h.config.node_lost_seconds + 1)
    h.tick()
    assert h.kube.status["recovery"]
    _restarted_in_place(h, h.pod(0, 2), 4)
    h.tick()
    status = h.kube.status
    assert (status["phase"], status["attempt"], status["failures"]) == ("Restarting", 1, 2)
    assert "recovery" not in status
    assert any(r == "RecoveryFailed" and "crash loop" in m for _, r, m in h.events)


def test_without_the_memory_tier_a_lost_node_still_starts_a_new_attempt() -> None:
    h = Harness(maxFailures=2)
    h.running()
    h.node("n1", ready=False, for_seconds=h.config.node_lost_seconds + 1)
    h.tick()
    status = h.kube.status
    assert (status["phase"], status["attempt"], status["failures"]) == ("Restarting", 1, 1)
    assert "recovery" not in status


def test_a_second_node_lost_during_a_recovery_joins_it_while_a_survivor_remains() -> None:
    h = Harness(maxFailures=2)
    _memory_tier(h)
    h.running()
    h.node("n1", ready=False, for_seconds=h.config.node_lost_seconds + 1)
    h.tick()
    h.node("n2", ready=False, for_seconds=h.config.node_lost_seconds + 1)
    h.tick()
    status = h.kube.status
    recovery = status["recovery"]
    assert [e["rank"] for e in recovery["replaced"]] == [1, 2]
    assert (recovery["kept"], recovery["nodes"]) == ([h.pod(0, 0)], ["n1", "n2"])
    assert (status["attempt"], status["failures"]) == (0, 1), "one recovery, counted once"
    assert status["interruptions"][-1]["nodes"] == ["n1", "n2"]
    assert (h.pod(0, 2), 0) in h.kube.deleted
    h.tick()
    assert h.kube.created.count(h.pod(0, 1)) == h.kube.created.count(h.pod(0, 2)) == 2
    # The last survivor lost too: nothing is left to keep, a new attempt.
    h.node("n0", ready=False, for_seconds=h.config.node_lost_seconds + 1)
    h.tick()
    status = h.kube.status
    assert (status["phase"], status["attempt"], status["failures"]) == ("Restarting", 1, 2)
    assert "recovery" not in status


def test_a_succeeded_job_reports_its_final_goodput_and_newest_commit() -> None:
    """Goodput is written at the final step, not left at the last throttled write, and
    ``lastCheckpoint`` is the newest commit a rank reported, not the periodic one polled
    before (issue 31, section 3)."""
    h = Harness()
    h.running()
    h.memory.next_progress_poll = None
    for rank in range(REPLICAS):
        h.sidecars.reports[f"10.0.0.{rank + 1}"] = SidecarStatus(
            state="idle", train_step=41, step_seconds=1.0, last_committed_step=40,
            trigger="periodic",
        )  # fmt: skip
    h.tick()
    assert h.kube.status["goodput"]["step"] == 41
    assert h.kube.status["lastCheckpoint"]["step"] == 40
    # The ranks train on to step 80, commit it on a manual request, and finish before the
    # next progress poll is due.
    for rank in range(REPLICAS):
        h.sidecars.reports[f"10.0.0.{rank + 1}"] = SidecarStatus(
            state="committed", step=80, train_step=80, step_seconds=1.0,
            last_committed_step=80, trigger="manual", uri="s3://bucket/tj",
        )  # fmt: skip
        pod = h.kube.pods[h.pod(0, rank)]
        pod["status"]["containerStatuses"][0]["state"] = {"terminated": {"exitCode": 0}}
    h.tick()
    status = h.kube.status
    assert status["phase"] == "Succeeded", status
    assert status["goodput"]["step"] == 80, status["goodput"]
    assert status["lastCheckpoint"]["step"] == 80
    assert status["lastCheckpoint"]["trigger"] == "manual"


def test_messages_count_ranks_as_pods_times_processes_and_name_the_pods() -> None:
    """A job of 3 pods of 2 processes each has 6 ranks: no message says "all 3 ranks"
    (issue 31, section 3)."""
    h = Harness()
    h.kube.job["spec"]["procsPerReplica"] = 2
    h.running()
    h.spot_notice("n1")
    h.tick()
    h.report_all(state="requested")
    h.tick()
    h.report_all(state="committed", step=40, trigger="notice", uri="s3://bucket/tj", seconds=1.5)
    h.tick()
    assert h.kube.status["phase"] == "Restarting"
    h.tick()  # Restarting -> Pending: rank 0
    h.node("n3")  # in place of the noticed n1
    h.kube.run(h.pod(1, 0), node="n0", ip="10.0.1.1")
    h.tick()  # the other ranks
    for rank in range(1, REPLICAS):
        h.kube.run(h.pod(1, rank), node=("n3", "n2")[rank - 1], ip=f"10.0.1.{rank + 1}")
    for rank in range(REPLICAS):
        h.sidecars.reports[f"10.0.1.{rank + 1}"] = SidecarStatus(state="idle")
    h.tick()
    assert h.kube.status["phase"] == "Running"
    for rank in range(REPLICAS):
        pod = h.kube.pods[h.pod(1, rank)]
        pod["status"]["containerStatuses"][0]["state"] = {"terminated": {"exitCode": 0}}
    h.tick()
    assert h.kube.status["phase"] == "Succeeded"
    texts = [message for _, _, message in h.events] + [
        c["message"] for c in h.kube.status["conditions"]
    ]
    assert not [m for m in texts if "all 3 ranks" in m], texts
    by_reason = {reason: message for _, reason, message in h.events}
    assert by_reason["CheckpointCommitted"].startswith("all 6 ranks (3 pods) committed step 40")
    assert "asking all 6 ranks (3 pods) to checkpoint" in by_reason["EvictionNotice"]
    assert by_reason["Succeeded"] == "all 6 ranks (3 pods) finished training"
    assert "all 3 pods are running" in by_reason["Running"]
