"""One reconcile step of a TrainingJob: observe, ask ``lifecycle`` what to do, do it.

The kopf daemon of each job calls :meth:`Reconciler.tick` about once a second. A tick is
level-triggered and idempotent: it reads the job and its pods fresh, and every decision is
written to ``status`` *before* it is carried out (the status says "attempt 3, Restarting";
then attempt 2's pods are deleted; then attempt 3's are created under deterministic names). An
operator killed at any point and started again reads the same status and the same pods, and
continues where it stopped, with no duplicate pod and no lost step.

The nodes' state (readiness, notices) comes from kopf's Node watch through :class:`ClusterView`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from . import lifecycle, manifests, podpolicy
from .errors import KubeError, SidecarUnreachableError
from .kube import Kube
from .lifecycle import Outcome, Phase, RankView, VerdictKind
from .metrics import Metrics
from .model import JobSpec, LastCheckpoint
from .notices import Notice, earliest, node_notices, parse_time, pod_notice
from .settings import EMERGENCY_EXIT_CODE, OperatorConfig
from .sidecars import SidecarClient, SidecarStatus
from .vocabulary import EMERGENCY_TRIGGERS, SaveState, Trigger

__all__ = ["ClusterView", "EventPoster", "JobMemory", "Reconciler"]

_log = logging.getLogger(__name__)

_CREATE_BACKOFF_CEILING = 60.0
"""Seconds: the longest wait between tries of a create that failed for a temporary reason."""

EventPoster = Callable[[Mapping[str, Any], str, str, str], Awaitable[None]]
"""``post(job_body, type, reason, message)``: posts a Kubernetes Event about the job."""


def _now() -> datetime:
    return datetime.now(tz=UTC)


def _last_commit_time(job: Mapping[str, Any], status: Mapping[str, Any]) -> float:
    """Unix time of the job's newest known commit; its creation time when it has none."""
    last = status.get("lastCheckpoint") or {}
    when = parse_time(last.get("completedAt")) or parse_time(
        (job.get("metadata") or {}).get("creationTimestamp")
    )
    return (when or _now()).timestamp()


def _iso(t: datetime) -> str:
    return t.astimezone(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


@dataclass
class _Node:
    ready: bool
    not_ready_since: datetime | None
    notices: list[Notice]


@dataclass
class ClusterView:
    """What the Node watch has told us: readiness and notices per node."""

    config: OperatorConfig
    nodes: dict[str, _Node] = field(default_factory=dict)
    deleted: set[str] = field(default_factory=set)

    def update_node(self, body: Mapping[str, Any], *, now: datetime) -> list[Notice]:
        """Record a Node; return the notices that are new on it (for Events and metrics)."""
        name = str((body.get("metadata") or {}).get("name", ""))
        ready = False
        since: datetime | None = None
        for cond in (body.get("status") or {}).get("conditions") or []:
            if cond.get("type") == "Ready":
                ready = cond.get("status") == "True"
                since = None if ready else (parse_time(cond.get("lastTransitionTime")) or now)
        found = node_notices(body, now=now, graces=self.config.graces)
        old = self.nodes.get(name)
        # Keep the first-seen deadline of a notice: a re-list after an operator restart must
        # not push it later.
        known = {n.source: n for n in old.notices} if old else {}
        merged = [known.get(n.source, n) for n in found]
        fresh = [n for n in found if n.source not in known]
        self.nodes[name] = _Node(ready=ready, not_ready_since=since, notices=merged)
        self.deleted.discard(name)
        return fresh

    def remove_node(self, name: str) -> None:
        """A Node object was deleted: whatever ran there is lost."""
        self.nodes.pop(name, None)
        self.deleted.add(name)

    def notices_on(self, node: str) -> list[Notice]:
        """The current notices of one node."""
        info = self.nodes.get(node)
        return list(info.notices) if info else []

    def node_lost(self, node: str | None, *, now: datetime) -> bool:
        """The node was deleted, or has not been Ready for ``node_lost_seconds``."""
        if not node:
            return False
        if node in self.deleted:
            return True
        info = self.nodes.get(node)
        if info is None or info.ready or info.not_ready_since is None:
            return False
        return now - info.not_ready_since >= timedelta(seconds=self.config.node_lost_seconds)

    def node_ready(self, node: str | None) -> bool:
        """Whether the node is known and Ready."""
        info = self.nodes.get(node or "")
        return bool(info and info.ready)


@dataclass
class JobMemory:
    """What a job's daemon remembers between ticks (nothing that must survive a restart)."""

    token: str | None = None
    next_progress_poll: datetime | None = None
    attempt: int | None = None
    """The attempt ``reports`` belong to."""
    reports: dict[int, SidecarStatus] = field(default_factory=dict)
    """The last answer of each rank's sidecar in this attempt. A sidecar stops soon after its
    trainer (native sidecar), so its last word is kept here for the decision after."""

    def for_attempt(self, attempt: int) -> None:
        """Forget the reports of an earlier attempt."""
        if self.attempt != attempt:
            self.attempt = attempt
            self.reports = {}

    create_failures: int = 0
    """Creates of pods or the Service that failed in a row (temporary errors)."""
    create_retry_at: datetime | None = None
    """No create is tried before this time (backoff after a temporary error)."""

    def committed_notice(self, rank: int) -> bool:
        """The rank's sidecar reported a *committed* save for a notice or a signal: the
        checkpoint holds every rank's shards, whatever exit code the trainer (or torchrun,
        which turns a worker's 75 into 1) ends with."""
        r = self.reports.get(rank)
        return (
            r is not None
            and r.state == SaveState.COMMITTED
            and (r.trigger in EMERGENCY_TRIGGERS or bool(r.request_id))
        )

    def served_notice(self, rank: int) -> bool:
        """The rank's SDK reported serving a notice (a save for a request or a signal)."""
        r = self.reports.get(rank)
        return (
            r is not None
            and r.state in (SaveState.COMMITTED, SaveState.SKIPPED)
            and (r.trigger in EMERGENCY_TRIGGERS or bool(r.request_id))
        )


@dataclass
class _Tick:
    """Everything one tick of one job has observed."""

    job: Mapping[str, Any]
    spec: JobSpec
    status: dict[str, Any]
    current: Mapping[int, Mapping[str, Any]]
    memory: JobMemory
    now: datetime
    views: list[RankView] = field(default_factory=list)


def _set_condition(
    conditions: list[dict[str, Any]],
    ctype: str,
    status: bool,
    reason: str,
    message: str,
    *,
    now: datetime,
    generation: int,
) -> list[dict[str, Any]]:
    value = "True" if status else "False"
    out = [c for c in conditions if c.get("type") != ctype]
    old = next((c for c in conditions if c.get("type") == ctype), None)
    changed = old is None or old.get("status") != value
    out.append(
        {
            "type": ctype,
            "status": value,
            "reason": reason,
            "message": message,
            "lastTransitionTime": _iso(now)
            if changed or old is None
            else old.get("lastTransitionTime"),
            "observedGeneration": generation,
        }
    )
    return sorted(out, key=lambda c: str(c["type"]))


def _answers(report: SidecarStatus, request_id: str) -> bool:
    """Whether a sidecar report is about the save serving this notice.

    Our request's id, or an emergency save (a signal or another notice: the SDK serves all
    pending notices with one save). A periodic save's report is never the answer.
    """
    if report.state in (SaveState.IDLE, SaveState.REQUESTED):
        return False
    if request_id and report.request_id == request_id:
        return True
    return report.trigger in EMERGENCY_TRIGGERS


def _trainer_state(pod: Mapping[str, Any]) -> tuple[bool, int | None]:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") != manifests.TRAINER_NAME:
            continue
        state = cs.get("state") or {}
        if "terminated" in state:
            return False, int(state["terminated"].get("exitCode", 1))
        return "running" in state, None
    return False, None


def _unschedulable(pod: Mapping[str, Any]) -> bool:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if (
            cond.get("type") == "PodScheduled"
            and cond.get("status") == "False"
            and cond.get("reason") == "Unschedulable"
        ):
            return True
    return False


def _attempt_of(pod: Mapping[str, Any]) -> int:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    try:
        return int(labels.get(manifests.ATTEMPT_LABEL, -1))
    except ValueError:
        return -1


def _rank_of(pod: Mapping[str, Any]) -> int:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    try:
        return int(labels.get(manifests.RANK_LABEL, -1))
    except ValueError:
        return -1


class Reconciler:
    """Drives TrainingJobs; shared by every job's daemon."""

    def __init__(
        self,
        *,
        kube: Kube,
        sidecars: SidecarClient,
        cluster: ClusterView,
        metrics: Metrics,
        config: OperatorConfig,
        post_event: EventPoster,
        token_for: Callable[[JobSpec], str],
    ) -> None:
        self._kube = kube
        self._token_for = token_for
        """The sidecar token of a job (tokens.derive under the operator's key): the operator
        never reads a job's Secret back (docs/operator.md, Security policy)."""
        self._sidecars = sidecars
        self._cluster = cluster
        self._metrics = metrics
        self._config = config
        self._post = post_event
        self._phases: dict[tuple[str, str], str] = {}

    def _count_phase(self, namespace: str, name: str, phase: str | None) -> None:
        """Keep ``baton_jobs{phase}`` equal to the number of jobs in each phase."""
        key = (namespace, name)
        if phase is None:
            self._phases.pop(key, None)
        else:
            self._phases[key] = phase
        for p in Phase:
            count = sum(1 for v in self._phases.values() if v == p.value)
            self._metrics.jobs.labels(p.value).set(count)

    def forget(self, namespace: str, name: str) -> None:
        """The job was deleted: stop counting it and drop its metric series."""
        self._count_phase(namespace, name, None)
        self._metrics.job_deleted(namespace, name)

    # ----------------------------------------------------------------- entry point

    async def tick(self, namespace: str, name: str, memory: JobMemory) -> float | None:
        """Reconcile once. Returns seconds until the next tick, or None when the job is gone
        or finished (the daemon may stop)."""
        job = await self._kube.get_job(namespace, name)
        if job is None:
            self.forget(namespace, name)
            return None
        spec = JobSpec.from_body(job)
        status: dict[str, Any] = dict(job.get("status") or {})
        phase = Phase(status["phase"]) if status.get("phase") else None
        self._count_phase(namespace, name, (phase or Phase.PENDING).value)
        now = _now()
        tick = self._config.tick_seconds
        if phase not in (Phase.SUCCEEDED, Phase.FAILED):
            refused = podpolicy.refusals(spec.template, self._config.pod_policy)
            if refused:
                # Before anything is created: the operator's right to create pods is not
                # lent to a template that asks for the node's privileges.
                await self._refuse(job, spec, status, refused, now)
                return tick
        if phase is None:
            await self._start(job, spec, now, memory)
            return tick
        pods = await self._kube.list_pods(namespace, manifests.job_selector(spec.name))
        if phase in (Phase.SUCCEEDED, Phase.FAILED):
            self._metrics.job_finished(namespace, name)
            if phase is Phase.FAILED:
                await self._delete_pods(spec, [p for p in pods if not self._finished(p)], now)
            return None
        self._metrics.job_running(
            namespace,
            name,
            failures_left=max(0, spec.max_failures - int(status.get("failures", 0))),
            last_checkpoint=_last_commit_time(job, status),
        )
        if memory.token is None:
            memory.token = self._token_for(spec)
        attempt = int(status.get("attempt", 0))
        memory.for_attempt(attempt)
        current = {_rank_of(p): p for p in pods if _attempt_of(p) == attempt}
        stale = [p for p in pods if _attempt_of(p) != attempt]
        t = _Tick(job=job, spec=spec, status=status, current=current, memory=memory, now=now)
        if phase is Phase.RESTARTING:
            await self._restarting(t, stale)
            return tick
        if stale:
            await self._delete_pods(spec, stale, now)
        replicas = int(status.get("replicas") or spec.replicas)
        views = [
            self._view(
                job=spec.name,
                rank=rank,
                pod=current.get(rank),
                status=status,
                memory=memory,
                now=now,
            )
            for rank in range(replicas)
        ]
        t.views = views
        if phase is Phase.CHECKPOINTING:
            await self._checkpointing(t)
            # A sidecar lives only a moment after its trainer stops: poll it often.
            return min(tick, 0.25)
        await self._ensure_pods(
            job, spec, status=status, current=current, replicas=replicas, now=now, memory=memory
        )
        notice = self._notice(current, now)
        if notice is not None:
            await self._begin_checkpoint(t, phase, notice)
            return min(tick, 0.25)
        await self._progress(t)
        outcome, detail = lifecycle.classify(views, replicas)
        if outcome is Outcome.FAILED and any(
            v.exit_code not in (None, 0, EMERGENCY_EXIT_CODE) and not v.committed_notice
            for v in views
        ):
            # The exit code is not the whole truth: torchrun reports a worker's 75 ("stopped
            # after a committed notice save") as 1. The sidecar lingers until that save's
            # outcome is read; read it now, before a failure is counted.
            await self._poll_ranks(views, memory)
            views = [
                replace(
                    v,
                    served_notice=memory.served_notice(v.rank),
                    committed_notice=memory.committed_notice(v.rank),
                )
                for v in views
            ]
            t.views = views
            outcome, detail = lifecycle.classify(views, replicas)
        await self._act(t, phase, outcome, detail)
        return tick

    # ----------------------------------------------------------------- observation

    def _finished(self, pod: Mapping[str, Any]) -> bool:
        return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")

    def _view(
        self,
        *,
        job: str,
        rank: int,
        pod: Mapping[str, Any] | None,
        status: Mapping[str, Any],
        memory: JobMemory,
        now: datetime,
    ) -> RankView:
        attempt = int(status.get("attempt", 0))
        name = manifests.pod_name(job, attempt, rank)
        if pod is None:
            # Missing is only a fault once the attempt's pods were all created (masterAddr is
            # recorded after that); before, the pod simply does not exist yet.
            return RankView(
                rank=rank,
                pod=name,
                exists=not status.get("masterAddr"),
                served_notice=memory.served_notice(rank),
            )
        meta = pod.get("metadata") or {}
        pstatus = pod.get("status") or {}
        node = (pod.get("spec") or {}).get("nodeName")
        running, exit_code = _trainer_state(pod)
        return RankView(
            rank=rank,
            pod=str(meta.get("name", name)),
            phase=str(pstatus.get("phase", "Pending")),
            node=node,
            ip=pstatus.get("podIP"),
            exit_code=exit_code,
            running=running,
            unschedulable=_unschedulable(pod),
            node_lost=self._cluster.node_lost(node, now=now),
            deleting=bool(meta.get("deletionTimestamp")),
            disrupted=bool(meta.get("deletionTimestamp"))
            or pod_notice(pod, now=now, graces=self._config.graces) is not None,
            served_notice=memory.served_notice(rank),
            committed_notice=memory.committed_notice(rank),
        )

    def _notice(self, current: Mapping[int, Mapping[str, Any]], now: datetime) -> Notice | None:
        found: list[Notice] = []
        for pod in current.values():
            if self._finished(pod):
                continue
            node = (pod.get("spec") or {}).get("nodeName")
            if not node:
                continue
            found.extend(self._cluster.notices_on(node))
            pn = pod_notice(pod, now=now, graces=self._config.graces)
            # A DisruptionTarget on a pod whose node is not Ready is the node's loss being
            # cleaned up (taint eviction), not an advance notice: it is handled as a failure.
            if pn is not None and self._cluster.node_ready(node):
                found.append(pn)
        return earliest(found)

    # ----------------------------------------------------------------- actions

    async def _patch(self, spec: JobSpec, status: dict[str, Any]) -> None:
        status.setdefault("observedGeneration", spec.generation)
        await self._kube.patch_job_status(spec.namespace, spec.name, status)

    async def _event(self, job: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
        _log.info("%s/%s: %s: %s", job["metadata"]["namespace"], job["metadata"]["name"],
                  reason, message)  # fmt: skip
        try:
            await self._post(job, kind, reason, message)
        except Exception:  # an Event is best effort; never let it stop the reconcile
            _log.warning("could not post Event %s", reason, exc_info=False)

    async def _start(
        self, job: Mapping[str, Any], spec: JobSpec, now: datetime, memory: JobMemory
    ) -> None:
        if not self._may_create(memory, now):
            return
        token = self._token_for(spec)
        await self._kube.create_secret(spec.namespace, manifests.token_secret_manifest(spec, token))
        service = manifests.service_manifest(spec)
        if not await self._create(
            job, spec, status={}, memory=memory, kind="service", body=service, now=now
        ):
            return
        conditions = _set_condition(
            [], "Ready", False, "Starting", "creating the first attempt's pods",
            now=now, generation=spec.generation,
        )  # fmt: skip
        await self._patch(
            spec,
            {
                "phase": Phase.PENDING.value,
                "attempt": 0,
                "replicas": spec.replicas,
                "worldSize": spec.replicas * spec.procs_per_replica,
                "preemptions": 0,
                "failures": 0,
                "stepsLost": 0,
                "avoidNodes": [],
                "attemptStartedAt": _iso(now),
                "message": "creating the first attempt's pods",
                "conditions": conditions,
            },
        )
        await self._event(
            job, "Normal", "Created",
            f"starting {spec.replicas} replicas x {spec.procs_per_replica} processes",
        )  # fmt: skip

    @staticmethod
    def _may_create(memory: JobMemory, now: datetime) -> bool:
        return memory.create_retry_at is None or now >= memory.create_retry_at

    async def _create(
        self,
        job: Mapping[str, Any],
        spec: JobSpec,
        *,
        status: Mapping[str, Any],
        memory: JobMemory,
        kind: str,
        body: dict[str, Any],
        now: datetime,
    ) -> bool:
        """Create a pod or the Service; on an error, report it and return False.

        Every error goes to ``status.message``, a condition and an Event that quote the API
        server (which names the field). A permanent one (the object is invalid, or Pod
        Security forbids it) fails the job: sending it again can never work. A temporary one
        (quota, RBAC, an outage) is retried with an exponential backoff, not every tick.
        """
        create = self._kube.create_pod if kind == "pod" else self._kube.create_service
        try:
            await create(spec.namespace, body)
        except KubeError as e:
            await self._create_failed(
                job, spec, status=status, memory=memory, kind=kind, error=e, now=now
            )
            return False
        if memory.create_failures:
            memory.create_failures = 0
            memory.create_retry_at = None
            conditions = _set_condition(
                list(status.get("conditions") or []), "Degraded", False, "Created",
                f"{kind} {body['metadata']['name']} created", now=now,
                generation=spec.generation,
            )  # fmt: skip
            await self._patch(spec, {"conditions": conditions})
        return True

    async def _create_failed(
        self,
        job: Mapping[str, Any],
        spec: JobSpec,
        *,
        status: Mapping[str, Any],
        memory: JobMemory,
        kind: str,
        error: KubeError,
        now: datetime,
    ) -> None:
        # The API server names pod fields from the pod's root; the user wrote them under
        # spec.template (the operator keeps the template's container order).
        fields = [
            f"spec.template.{f}" if kind == "pod" and f.startswith("spec.") else f
            for f in error.fields
        ]
        named = f" (field {', '.join(fields)})" if fields else ""
        conditions = list(status.get("conditions") or [])
        if error.permanent:
            reason = "PodRejected" if kind == "pod" else "ServiceRejected"
            fix = (
                "fix spec.template and re-create the TrainingJob"
                if kind == "pod"
                else "fix the TrainingJob and re-create it"
            )
            message = f"the API server rejected the {kind}{named}: {error}; {fix}"
            conditions = _set_condition(conditions, "Ready", False, reason, message,
                                        now=now, generation=spec.generation)  # fmt: skip
            conditions = _set_condition(conditions, "Failed", True, reason, message,
                                        now=now, generation=spec.generation)  # fmt: skip
            await self._patch(
                spec, {"phase": Phase.FAILED.value, "message": message, "conditions": conditions}
            )
            await self._event(job, "Warning", reason, message)
            return
        memory.create_failures += 1
        delay = min(_CREATE_BACKOFF_CEILING, 2.0 ** (memory.create_failures - 1))
        memory.create_retry_at = now + timedelta(seconds=delay)
        reason = "PodCreateFailed" if kind == "pod" else "ServiceCreateFailed"
        message = f"could not create the {kind}{named}: {error}; retrying in {delay:.0f}s"
        conditions = _set_condition(conditions, "Degraded", True, reason, message,
                                    now=now, generation=spec.generation)  # fmt: skip
        if status:  # a job not started yet has no status to add to (it gets one on success)
            await self._patch(spec, {"message": message, "conditions": conditions})
        await self._event(job, "Warning", reason, message)

    async def _ensure_pods(
        self,
        job: Mapping[str, Any],
        spec: JobSpec,
        *,
        status: Mapping[str, Any],
        current: Mapping[int, Mapping[str, Any]],
        replicas: int,
        now: datetime,
        memory: JobMemory,
    ) -> None:
        attempt = int(status.get("attempt", 0))
        resume = status.get("resumedFromStep")
        avoid = list(status.get("avoidNodes") or [])
        resume_step = None if resume is None else int(resume)
        master = status.get("masterAddr")
        if master or not self._may_create(memory, now):
            return
        rank0 = current.get(0)
        if rank0 is None:
            body = manifests.pod_manifest(
                spec,
                self._config,
                attempt=attempt,
                rank=0,
                replicas=replicas,
                master_addr=None,
                resume_step=resume_step,
                avoid_nodes=avoid,
            )
            await self._create(
                job, spec, status=status, memory=memory, kind="pod", body=body, now=now
            )
            return
        ip = (rank0.get("status") or {}).get("podIP")
        if not ip:
            return
        for rank in range(1, replicas):
            if rank not in current:
                body = manifests.pod_manifest(
                    spec,
                    self._config,
                    attempt=attempt,
                    rank=rank,
                    replicas=replicas,
                    master_addr=ip,
                    resume_step=resume_step,
                    avoid_nodes=avoid,
                )
                if not await self._create(
                    job, spec, status=status, memory=memory, kind="pod", body=body, now=now
                ):
                    return
        await self._patch(spec, {"masterAddr": ip})

    async def _refuse(
        self,
        job: Mapping[str, Any],
        spec: JobSpec,
        status: Mapping[str, Any],
        refused: Sequence[podpolicy.Refusal],
        now: datetime,
    ) -> None:
        message = podpolicy.summary(refused)
        conditions = list(status.get("conditions") or [])
        for ctype, value, reason in (
            ("Ready", False, "PodTemplateRefused"),
            ("Failed", True, "PodTemplateRefused"),
        ):
            conditions = _set_condition(conditions, ctype, value, reason, message,
                                        now=now, generation=spec.generation)  # fmt: skip
        # The next tick sees Failed and deletes whatever pods the job still has.
        await self._patch(
            spec,
            {"phase": Phase.FAILED.value, "message": message, "notice": None,
             "conditions": conditions},
        )  # fmt: skip
        await self._event(job, "Warning", "PodTemplateRefused", message)

    async def _delete_pods(
        self, spec: JobSpec, pods: Sequence[Mapping[str, Any]], now: datetime
    ) -> None:
        for pod in pods:
            meta = pod.get("metadata") or {}
            node = (pod.get("spec") or {}).get("nodeName")
            lost = self._cluster.node_lost(node, now=now) or (
                node is not None and node in self._cluster.deleted
            )
            if meta.get("deletionTimestamp") and not lost:
                continue  # already going, gracefully
            # A pod on a lost node never finishes a graceful delete (no kubelet to confirm):
            # remove it at once; its replacement has another name and another node.
            grace = 0 if lost else self._config.delete_grace_seconds
            await self._kube.delete_pod(spec.namespace, str(meta["name"]), grace_seconds=grace)

    async def _restart(
        self,
        job: Mapping[str, Any],
        spec: JobSpec,
        status: Mapping[str, Any],
        *,
        kind: str,
        resume_step: int | None,
        detail: str,
        now: datetime,
        current: Mapping[int, Mapping[str, Any]],
        replicas: int | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        plan = lifecycle.plan_restart(
            spec,
            kind=kind,
            attempt=int(status.get("attempt", 0)),
            preemptions=int(status.get("preemptions", 0)),
            failures=int(status.get("failures", 0)),
            resume_step=resume_step,
            now=now,
            replicas=replicas,
            detail=detail,
        )
        conditions = list(status.get("conditions") or [])
        conditions = _set_condition(conditions, "Checkpointing", False, "Done", plan.message,
                                    now=now, generation=spec.generation)  # fmt: skip
        conditions = _set_condition(conditions, "Ready", False, "Restarting", plan.message,
                                    now=now, generation=spec.generation)  # fmt: skip
        patch: dict[str, Any] = {
            "phase": plan.phase.value,
            "attempt": plan.attempt,
            "replicas": plan.replicas,
            "worldSize": plan.replicas * spec.procs_per_replica,
            "preemptions": plan.preemptions,
            "failures": plan.failures,
            "resumedFromStep": plan.resume_step,
            "restartReason": plan.reason,
            "restartAfter": None if plan.restart_after is None else _iso(plan.restart_after),
            "masterAddr": None,
            "notice": None,
            "unschedulableSince": None,
            "message": plan.message,
            **(extra or {}),
        }
        if plan.exhausted:
            reason = "FailureBudgetExhausted" if kind == "failure" else "PreemptionBudgetExhausted"
            conditions = _set_condition(conditions, "Failed", True, reason, plan.message,
                                        now=now, generation=spec.generation)  # fmt: skip
        patch["conditions"] = conditions
        # The decision is durable before anything is deleted: a restarted operator resumes it.
        await self._patch(spec, patch)
        self._metrics.failure_budget.labels(spec.namespace, spec.name).set(
            max(0, spec.max_failures - plan.failures)
        )
        if plan.exhausted:
            await self._event(job, "Warning", "Failed", plan.message)
        else:
            self._metrics.count_restart(spec.namespace, spec.name, plan.reason)
            if kind == "preemption":
                self._metrics.preemptions.labels(spec.namespace, spec.name).inc()
            await self._event(
                job, "Warning" if kind == "failure" else "Normal", "Restarting", plan.message
            )
        await self._delete_pods(spec, list(current.values()), now)

    async def _restarting(
        self,
        t: _Tick,
        stale: Sequence[Mapping[str, Any]],
    ) -> None:
        spec, status, current, now = t.spec, t.status, t.current, t.now
        if stale:
            # The old attempt's pods must be fully gone before the new ones start: two
            # generations of ranks must never share a checkpoint directory or a rendezvous.
            await self._delete_pods(spec, stale, now)
            return
        after = parse_time(status.get("restartAfter"))
        if after is not None and now < after:
            return
        replicas = int(status.get("replicas") or spec.replicas)
        resume = status.get("resumedFromStep")
        message = f"attempt {status.get('attempt')}: starting {replicas} replicas " + (
            "from scratch" if resume is None else f"from step {resume}"
        )
        await self._patch(
            spec,
            {
                "phase": Phase.PENDING.value,
                "attemptStartedAt": _iso(now),
                "restartAfter": None,
                "message": message,
            },
        )
        await self._ensure_pods(
            t.job, spec, status={**status, "masterAddr": None}, current=current,
            replicas=replicas, now=now, memory=t.memory,
        )  # fmt: skip

    async def _begin_checkpoint(
        self,
        t: _Tick,
        phase: Phase,
        notice: Notice,
    ) -> None:
        job, spec, status, current, now = t.job, t.spec, t.status, t.current, t.now
        noticed_nodes = sorted(
            {
                str((p.get("spec") or {}).get("nodeName"))
                for p in current.values()
                if (p.get("spec") or {}).get("nodeName")
                and (
                    self._cluster.notices_on(str(p["spec"]["nodeName"]))
                    or pod_notice(p, now=now, graces=self._config.graces)
                )
            }
        )
        avoid = sorted(set(status.get("avoidNodes") or []) | set(noticed_nodes) | {notice.node})
        avoid = [n for n in avoid if n]
        if notice.source == "disruption-target":
            self._metrics.notices.labels(notice.source).inc()
        last = LastCheckpoint.from_status(status.get("lastCheckpoint"))
        if phase is not Phase.RUNNING:
            # Nothing has trained since the last commit: move at once.
            await self._event(
                job, "Normal", "EvictionNotice",
                f"{notice.reason} on node {notice.node} before the attempt was running; "
                "moving the job to other nodes",
            )  # fmt: skip
            await self._restart(
                job, spec, status, kind="preemption",
                resume_step=None if last is None else last.step,
                detail=f"{notice.source} notice on {notice.node} before start",
                now=now, current=current, extra={"avoidNodes": avoid},
            )  # fmt: skip
            return
        deadline = max(
            notice.deadline, now + timedelta(seconds=self._config.min_checkpoint_window_seconds)
        )
        message = (
            f"{notice.reason} on node {notice.node}: asking all "
            f"{len(current)} ranks to checkpoint before {_iso(deadline)}"
        )
        conditions = _set_condition(
            list(status.get("conditions") or []), "Checkpointing", True, "EvictionNotice",
            message, now=now, generation=spec.generation,
        )  # fmt: skip
        await self._patch(
            spec,
            {
                "phase": Phase.CHECKPOINTING.value,
                "avoidNodes": avoid,
                "notice": {
                    "source": notice.source,
                    "nodes": noticed_nodes or [notice.node],
                    "reason": notice.reason,
                    "deadline": _iso(deadline),
                    "receivedAt": _iso(now),
                },
                "message": message,
                "conditions": conditions,
            },
        )
        await self._event(job, "Warning", "EvictionNotice", message)

    async def _checkpointing(
        self,
        t: _Tick,
    ) -> None:
        job, spec, status, current, now, memory, views = (
            t.job,
            t.spec,
            t.status,
            t.current,
            t.now,
            t.memory,
            t.views,
        )
        notice = dict(status.get("notice") or {})
        deadline = parse_time(notice.get("deadline")) or now
        received = parse_time(notice.get("receivedAt")) or now
        token = memory.token or ""
        replicas = len(views)
        ids: list[str] = list(notice.get("requestIds") or [])
        if not notice.get("requestedAt"):
            ids = []
            for v in views:
                rid = ""
                if v.ip and v.exit_code is None:
                    try:
                        rid = await self._sidecars.request_checkpoint(
                            v.ip, token, deadline=deadline,
                            reason=f"{notice.get('source')}: {notice.get('reason')}",
                        )  # fmt: skip
                    except SidecarUnreachableError as e:
                        _log.warning("checkpoint request to rank %d failed: %s", v.rank, e)
                ids.append(rid)
            await self._patch(spec, {"notice": {"requestedAt": _iso(now), "requestIds": ids}})
        live = await self._poll_ranks(views, memory)
        reports: dict[int, SidecarStatus | None] = {}
        gone: list[int] = []
        for v in views:
            report = memory.reports.get(v.rank)
            expected = ids[v.rank] if v.rank < len(ids) else ""
            if report is not None and not _answers(report, expected):
                report = None  # e.g. the last periodic save: not the answer to this notice
            reports[v.rank] = report
            finished = v.exit_code is not None or v.phase in ("Succeeded", "Failed")
            if v.node_lost or not v.exists or (live.get(v.rank) is None and finished):
                gone.append(v.rank)
        verdict = lifecycle.checkpoint_verdict(
            reports, replicas=replicas, now=now, deadline=deadline, unreachable_is_final=gone
        )
        if verdict.kind is VerdictKind.WAIT:
            return
        last = LastCheckpoint.from_status(status.get("lastCheckpoint"))
        if verdict.kind is VerdictKind.COMMITTED and verdict.step is not None:
            checkpoint = LastCheckpoint(
                step=verdict.step,
                uri=verdict.uri or spec.checkpoint_uri,
                trigger=Trigger.NOTICE.value,
                completed_at=_iso(now),
                seconds=verdict.seconds,
            )
            key = (spec.namespace, spec.name)
            self._metrics.notice_to_commit.labels(*key).observe((now - received).total_seconds())
            self._metrics.deadline_margin.labels(*key).observe((deadline - now).total_seconds())
            self._metrics.last_checkpoint.labels(*key).set(now.timestamp())
            self._metrics.steps_lost.labels(*key).observe(0)
            self._metrics.steps_lost_total.labels(*key).inc(0)
            await self._event(
                job, "Normal", "CheckpointCommitted",
                f"all {replicas} ranks committed step {verdict.step} "
                f"{(now - received).total_seconds():.1f}s after the notice; "
                f"moving off node(s) {', '.join(notice.get('nodes') or [])}",
            )  # fmt: skip
            await self._restart(
                job, spec, status, kind="preemption", resume_step=verdict.step,
                detail=f"{notice.get('source')} notice, checkpoint at step {verdict.step}",
                now=now, current=current,
                extra={"lastCheckpoint": checkpoint.to_status()},
            )  # fmt: skip
            return
        # Fall back to the newest step every rank is known to have committed.
        best = self._best_known_step(memory, last)
        message = (
            f"checkpoint before the notice did not complete ({verdict.reason}); resuming from "
            + ("the start (no checkpoint was committed yet)" if best is None else
               f"the last committed step {best}; work after it is recomputed")
        )  # fmt: skip
        await self._event(job, "Warning", "CheckpointFallback", message)
        extra: dict[str, Any] = {}
        if best is not None and (last is None or best > last.step):
            extra["lastCheckpoint"] = LastCheckpoint(
                step=best,
                uri=spec.checkpoint_uri,
                trigger=Trigger.PERIODIC.value,
                completed_at=_iso(now),
            ).to_status()
        await self._restart(
            job, spec, status, kind="preemption", resume_step=best,
            detail=f"{notice.get('source')} notice, {verdict.reason}", now=now,
            current=current, extra=extra,
        )  # fmt: skip

    @staticmethod
    def _best_known_step(memory: JobMemory, last: LastCheckpoint | None) -> int | None:
        steps = [last.step] if last is not None else []
        steps.extend(s for r in memory.reports.values() if (s := r.committed_step) is not None)
        return max(steps) if steps else None

    async def _poll_ranks(
        self, views: Sequence[RankView], memory: JobMemory
    ) -> dict[int, SidecarStatus]:
        """Ask every reachable sidecar for its status; remember each answer in ``memory``."""
        live: dict[int, SidecarStatus] = {}
        if memory.token is None:
            return live
        for v in views:
            if not v.ip or v.node_lost:
                continue
            try:
                live[v.rank] = await self._sidecars.status(v.ip, memory.token)
            except SidecarUnreachableError as e:
                _log.debug("rank %d status: %s", v.rank, e)
                continue
            memory.reports[v.rank] = live[v.rank]
        return live

    async def _progress(self, t: _Tick) -> None:
        """Learn periodic commits (and served notices) from the sidecars, every few seconds."""
        if t.memory.next_progress_poll is not None and t.now < t.memory.next_progress_poll:
            return
        t.memory.next_progress_poll = t.now + timedelta(seconds=self._config.progress_poll_seconds)
        await self._learn_commit(t)

    async def _learn_commit(self, t: _Tick) -> int | None:
        """Poll the sidecars and record a newer committed step in ``status.lastCheckpoint``.

        Any rank's ``committed`` proves the manifest is written; returns the newest known step.
        """
        await self._poll_ranks(t.views, t.memory)
        last = LastCheckpoint.from_status(t.status.get("lastCheckpoint"))
        best = self._best_known_step(t.memory, last)
        if best is None or (last is not None and best <= last.step):
            return best
        source = next((r for r in t.memory.reports.values() if r.committed_step == best), None)
        checkpoint = LastCheckpoint(
            step=best,
            uri=(source.uri if source else None) or t.spec.checkpoint_uri,
            trigger=(source.trigger if source else None) or Trigger.PERIODIC.value,
            completed_at=_iso(t.now),
            seconds=source.seconds if source else None,
        )
        await self._patch(t.spec, {"lastCheckpoint": checkpoint.to_status()})
        t.status["lastCheckpoint"] = checkpoint.to_status()
        self._metrics.last_checkpoint.labels(t.spec.namespace, t.spec.name).set(t.now.timestamp())
        return best

    async def _succeed(
        self,
        job: Mapping[str, Any],
        spec: JobSpec,
        status: Mapping[str, Any],
        now: datetime,
        current: Mapping[int, Mapping[str, Any]],
    ) -> None:
        message = f"all {len(current)} ranks finished training"
        conditions = list(status.get("conditions") or [])
        conditions = _set_condition(conditions, "Ready", False, "Succeeded", message,
                                    now=now, generation=spec.generation)  # fmt: skip
        conditions = _set_condition(conditions, "Succeeded", True, "Succeeded", message,
                                    now=now, generation=spec.generation)  # fmt: skip
        conditions = _set_condition(conditions, "Checkpointing", False, "Done", message,
                                    now=now, generation=spec.generation)  # fmt: skip
        await self._patch(
            spec,
            {"phase": Phase.SUCCEEDED.value, "message": message, "notice": None,
             "conditions": conditions},
        )  # fmt: skip
        await self._event(job, "Normal", "Succeeded", message)

    async def _act(
        self,
        t: _Tick,
        phase: Phase,
        outcome: Outcome,
        detail: str,
    ) -> None:
        job, spec, status, current, now = t.job, t.spec, t.status, t.current, t.now
        last = LastCheckpoint.from_status(status.get("lastCheckpoint"))
        resume = None if last is None else last.step
        if outcome is Outcome.SUCCEEDED:
            await self._succeed(job, spec, status, now, current)
        elif outcome in (Outcome.FAILED, Outcome.NODE_LOST):
            await self._restart(
                job, spec, status, kind="failure", resume_step=resume, detail=detail,
                now=now, current=current,
            )  # fmt: skip
        elif outcome is Outcome.PREEMPTED:
            # The rank saved on its own (SIGTERM or a cloud notice its sidecar saw): ask the
            # survivors' rank 0 what it committed, then resume there.
            learned = await self._learn_commit(t)
            await self._restart(
                job, spec, status, kind="preemption",
                resume_step=learned if learned is not None else resume,
                detail=detail, now=now, current=current,
            )  # fmt: skip
        elif outcome is Outcome.UNSCHEDULABLE:
            await self._maybe_shrink(t, detail)
        elif outcome is Outcome.RUNNING and phase is Phase.PENDING:
            resume_txt = "" if status.get("resumedFromStep") is None else (
                f", resumed from step {status.get('resumedFromStep')}"
            )  # fmt: skip
            message = f"attempt {status.get('attempt')}: {detail}{resume_txt}"
            conditions = _set_condition(
                list(status.get("conditions") or []), "Ready", True, "Running", message,
                now=now, generation=spec.generation,
            )  # fmt: skip
            await self._patch(
                spec,
                {"phase": Phase.RUNNING.value, "message": message, "conditions": conditions,
                 "unschedulableSince": None},
            )  # fmt: skip
            await self._event(job, "Normal", "Running", message)

    async def _maybe_shrink(
        self,
        t: _Tick,
        detail: str,
    ) -> None:
        job, spec, status, current, now = t.job, t.spec, t.status, t.current, t.now
        since = parse_time(status.get("unschedulableSince"))
        if since is None:
            await self._patch(spec, {"unschedulableSince": _iso(now), "message": detail})
            return
        replicas = int(status.get("replicas") or spec.replicas)
        if now - since < timedelta(seconds=spec.elastic_wait_seconds):
            return
        # The scheduler is the judge of capacity (node selectors, taints, resources, one rank
        # per node): the ranks it could place are what the job can have now.
        placed = sum(1 for p in current.values() if (p.get("spec") or {}).get("nodeName"))
        target = lifecycle.elastic_replicas(spec, current=replicas, placeable=placed)
        if target is None:
            return
        last = LastCheckpoint.from_status(status.get("lastCheckpoint"))
        await self._restart(
            job, spec, status, kind="elastic",
            resume_step=None if last is None else last.step,
            detail=f"{detail} for {spec.elastic_wait_seconds:.0f}s; shrinking from {replicas} "
            f"to {target} replicas ({placed} could be placed)",
            now=now, current=current, replicas=target,
            # Noticed nodes are gone or going; a shrunk job may use any node that is left.
            extra={"avoidNodes": []},
        )  # fmt: skip
