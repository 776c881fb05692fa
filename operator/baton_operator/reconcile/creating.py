"""Creating a job's objects: its token Secret, its Service and each attempt's pods (and
deleting a Failed job's Service, which nothing uses any more).

Where the API server serves ``scheduling.k8s.io/v1beta1`` PodGroups (looked up once, then
cached), each attempt also gets a PodGroup, and all its pods are created in one pass, linked to
it, with rank 0's DNS name as the master address; elsewhere rank 0 comes first and the others
get its pod IP (manifests.py says why; docs/operator.md, "Gang scheduling").

Creates are idempotent (deterministic names; "already exists" is success), so a restarted
operator simply creates what is missing. A failed create is classified by the client layer
(``errors``): a permanent one (the object is invalid, or Pod Security forbids it) fails the job
with a condition that names the field, since sending it again can never work; a temporary one
(quota, RBAC, an outage) is retried with an exponential backoff, not every tick. A template the
operator's pod policy refuses fails the job before anything is created.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any, Final

from baton_operator.pure import interval, manifests, podpolicy
from baton_operator.pure.errors import KubeError
from baton_operator.pure.jobstatus import JobStatus, iso
from baton_operator.pure.lifecycle import Phase
from baton_operator.pure.model import JobSpec
from baton_operator.pure.tick import Tick

from .services import Room, Services

__all__ = ["Creator"]

_log = logging.getLogger("baton_operator.creating")

_CREATE_BACKOFF_CEILING: Final = 60.0
"""Seconds: the longest wait between tries of a create that failed for a temporary reason."""


class Creator(Room):
    """Starts jobs and creates their pods; reports every create error on the job."""

    def __init__(
        self,
        services: Services,
        *,
        token_for: Callable[[JobSpec], str],
        pools: interval.PoolLedger | None = None,
    ) -> None:
        super().__init__(services)
        self._pools = pools
        """Node time and interruptions per pool (the controller's), for the interval."""
        self._token_for = token_for
        self._gang_served: bool | None = None
        """Whether the API server serves PodGroups: None until discovery answered."""
        self._dropped: set[tuple[str, str, int]] = set()
        """(namespace, job uid, attempt) whose PodGroup this operator deleted: asked once."""

    async def start(self, t: Tick) -> None:
        """A new job: its Secret and Service, then ``Pending`` (the pods come next tick)."""
        spec, now = t.spec, t.now
        if not t.memory.may_create(now):
            return
        token = self._token_for(spec)
        await self._kube.create_secret(spec.namespace, manifests.token_secret_manifest(spec, token))
        # A job not started yet has no status of its own to add to (it gets one on success).
        empty = JobStatus()
        if not await self._create(t, empty, kind="service", body=manifests.service_manifest(spec)):
            return
        message = "creating the first attempt's pods"
        await self._writer.patch(
            t,
            t.patch_of(empty)
            .phase(Phase.PENDING)
            .condition("Ready", False, "Starting", message)
            .set(
                {
                    "attempt": 0,
                    "replicas": spec.replicas,
                    "worldSize": spec.replicas * spec.procs_per_replica,
                    "preemptions": 0,
                    "failures": 0,
                    "stepsLost": 0,
                    "avoidNodes": [],
                    "attemptStartedAt": iso(t.now),
                    "message": message,
                }
            ),
        )
        await self._writer.event(
            t.job, "Normal", "Created",
            f"starting {spec.replicas} replicas x {spec.procs_per_replica} processes",
        )  # fmt: skip

    async def _interval(self, t: Tick, status: JobStatus) -> int:
        """The attempt's checkpoint interval (``everySeconds: auto``): the one recorded for
        it, else chosen now and recorded before the attempt's first pod is created, so every
        rank (and a restarted operator) gets the same value."""
        chosen = interval.recorded(t.job, status.attempt)
        if chosen is not None:
            return chosen
        choice = interval.for_job(
            t.job, at=t.now, pools=self._pools, prior_seconds=self._config.interval_prior_seconds
        )
        await self._writer.patch(
            t, t.patch().set({"checkpointInterval": choice.to_status(status.attempt)})
        )
        return choice.seconds

    async def gang_served(self) -> bool:
        """Whether attempts get a PodGroup: the setting is on and the API server serves
        ``scheduling.k8s.io/v1beta1`` ``podgroups``. Discovered at the first call and cached
        (the served APIs change only with the API server's configuration); an error is raised
        (the tick is retried), never taken for "not served"."""
        if not self._config.gang_scheduling:
            return False
        if self._gang_served is None:
            self._gang_served = await self._kube.serves(
                f"{manifests.POD_GROUP_API_GROUP}/{manifests.POD_GROUP_VERSION}",
                manifests.POD_GROUP_PLURAL,
            )
        return self._gang_served

    async def _gang(self, t: Tick) -> bool:
        """Whether this attempt is a gang: PodGroups are served, and no pod of the attempt
        was created without one (an attempt begun by an operator without the API, or with
        the setting off, ends the way it began)."""
        if not await self.gang_served():
            return False
        return all((p.body.get("spec") or {}).get("schedulingGroup") for p in t.current.values())

    async def drop_pod_groups(self, t: Tick, attempts: Iterable[int]) -> None:
        """Delete the PodGroups of ``attempts`` (their pods are gone or going): a finished,
        suspended or replaced attempt's gang goes with it. A PodGroup's finalizer keeps it
        while a pod still uses it. A failed delete is logged and left to the garbage collector
        (the PodGroup is owned by the TrainingJob), never in the way of the restart."""
        if not await self.gang_served():
            return
        for attempt in sorted(set(attempts)):
            key = (t.spec.namespace, t.spec.uid, attempt)
            if attempt < 0 or key in self._dropped:
                continue
            name = manifests.pod_group_name(t.spec.name, attempt)
            try:
                await self._kube.delete_pod_group(t.spec.namespace, name)
            except KubeError as e:
                _log.warning("PodGroup %s/%s not deleted: %s", t.spec.namespace, name, e)
                continue
            self._dropped.add(key)

    async def drop_service(self, t: Tick) -> None:
        """Delete a Failed job's headless Service: it gives the ranks their DNS names, and no
        rank of a Failed job runs again (its pods are deleted), so it goes now rather than
        when the job is deleted. Only the Service the job owns; an error is raised (the tick
        is retried), as for the pods."""
        spec = t.spec
        if await self._kube.delete_owned_service(spec.namespace, spec.name, spec.uid):
            _log.info("deleted the Service %s/%s of the failed job", spec.namespace, spec.name)

    async def ensure_pods(self, t: Tick, status: JobStatus, *, replicas: int) -> None:
        """Create the attempt's missing pods.

        Gang path (PodGroups served): the attempt's PodGroup, then every rank in one pass,
        each with rank 0's DNS name as the master address. Otherwise rank 0 first, the others
        once it has an IP. ``masterAddr`` is recorded when every pod exists; until then
        nothing is missing.
        """
        spec = t.spec
        if status.master_addr or not t.memory.may_create(t.now):
            return
        every = await self._interval(t, status) if spec.auto_interval else None
        gang = await self._gang(t)
        group = manifests.pod_group_name(spec.name, status.attempt) if gang else None

        def body(rank: int, master: str | None) -> dict[str, Any]:
            return manifests.pod_manifest(
                spec, self._config, attempt=status.attempt, rank=rank, replicas=replicas,
                master_addr=master, resume_step=status.resumed_from_step,
                avoid_nodes=list(status.avoid_nodes), every_seconds=every, pod_group=group,
            )  # fmt: skip

        if group is not None:
            manifest = manifests.pod_group_manifest(spec, attempt=status.attempt, replicas=replicas)
            if not await self._create(t, status, kind="PodGroup", body=manifest):
                return
            name = manifests.master_dns_name(spec, self._config, status.attempt)
            for rank in range(replicas):
                if rank not in t.current and not await self._create(
                    t, status, kind="pod", body=body(rank, name)
                ):
                    return
            await self._writer.patch(t, t.patch().set({"masterAddr": name}))
            return
        rank0 = t.current.get(0)
        if rank0 is None:
            await self._create(t, status, kind="pod", body=body(0, None))
            return
        if not rank0.ip:
            return
        for rank in range(1, replicas):
            if rank not in t.current and not await self._create(
                t, status, kind="pod", body=body(rank, rank0.ip)
            ):
                return
        await self._writer.patch(t, t.patch().set({"masterAddr": rank0.ip}))

    async def replace_pod(self, t: Tick, status: JobStatus, *, rank: int, replicas: int) -> None:
        """Create ``rank``'s pod again under its own name, in the same attempt: a recovery
        that keeps the survivors (controller.py) replaces a pod lost with its node.

        The same name keeps its DNS name, which the other ranks reach rank 0 by
        (``masterAddr`` on the gang path) and the sidecars reach their peers by; the lost
        nodes are in ``avoidNodes``. No ``schedulingGroup``: the attempt's gang was admitted
        already and the survivors are bound, so the replacement is scheduled on its own.
        """
        spec = t.spec
        every = await self._interval(t, status) if spec.auto_interval else None
        body = manifests.pod_manifest(
            spec, self._config, attempt=status.attempt, rank=rank, replicas=replicas,
            master_addr=status.master_addr, resume_step=status.resumed_from_step,
            avoid_nodes=list(status.avoid_nodes), every_seconds=every,
        )  # fmt: skip
        await self._create(t, status, kind="pod", body=body)

    async def refuse(self, t: Tick, refused: Sequence[podpolicy.Refusal]) -> None:
        """The template asks for what the pod policy forbids: fail the job, naming the fields."""
        await self.reject(t, "PodTemplateRefused", podpolicy.summary(refused))

    async def reject(self, t: Tick, reason: str, message: str) -> None:
        """The spec cannot be run: fail the job with ``message`` (which names the fix) in its
        status, conditions and an Event."""
        # The next tick sees Failed and deletes whatever pods the job still has.
        await self._writer.patch(
            t,
            t.patch()
            .phase(Phase.FAILED)
            .condition("Ready", False, reason, message)
            .condition("Failed", True, reason, message)
            .set({"message": message, "notice": None}),
        )
        await self._writer.event(t.job, "Warning", reason, message)

    async def _create(self, t: Tick, status: JobStatus, *, kind: str, body: dict[str, Any]) -> bool:
        """Create a pod, the Service or a PodGroup; on an error, report it and return False.

        Every error goes to ``status.message``, a condition and an Event that quote the API
        server (which names the field).
        """
        if kind == "pod":
            create = self._kube.create_pod
        elif kind == "service":
            create = self._kube.create_service
        else:
            create = self._kube.create_pod_group
        try:
            await create(t.spec.namespace, body)
        except KubeError as e:
            await self._create_failed(t, status, kind=kind, error=e)
            return False
        if t.memory.create_failures:
            t.memory.create_failures = 0
            t.memory.create_retry_at = None
            message = f"{kind} {body['metadata']['name']} created"
            patch = t.patch_of(status).condition("Degraded", False, "Created", message)
            await self._writer.patch(t, patch)
        return True

    async def _create_failed(
        self, t: Tick, status: JobStatus, *, kind: str, error: KubeError
    ) -> None:
        # The API server names pod fields from the pod's root; the user wrote them under
        # spec.template (the operator keeps the template's container order).
        fields = [
            f"spec.template.{f}" if kind == "pod" and f.startswith("spec.") else f
            for f in error.fields
        ]
        named = f" (field {', '.join(fields)})" if fields else ""
        patch = t.patch_of(status)
        title = kind[0].upper() + kind[1:]
        if error.permanent:
            reason = f"{title}Rejected"
            fix = (
                "fix spec.template and re-create the TrainingJob"
                if kind == "pod"
                else "fix the TrainingJob and re-create it"
            )
            message = f"the API server rejected the {kind}{named}: {error}; {fix}"
            patch.phase(Phase.FAILED).condition("Ready", False, reason, message)
            patch.condition("Failed", True, reason, message).set({"message": message})
            await self._writer.patch(t, patch)
            await self._writer.event(t.job, "Warning", reason, message)
            return
        memory = t.memory
        memory.create_failures += 1
        delay = min(_CREATE_BACKOFF_CEILING, 2.0 ** (memory.create_failures - 1))
        memory.create_retry_at = t.now + timedelta(seconds=delay)
        reason = f"{title}CreateFailed"
        message = f"could not create the {kind}{named}: {error}; retrying in {delay:.0f}s"
        patch.condition("Degraded", True, reason, message).set({"message": message})
        if status.phase is not None:  # a job not started yet has no status to add to
            await self._writer.patch(t, patch)
        await self._writer.event(t.job, "Warning", reason, message)
