"""Creating a job's objects: its token Secret, its Service and each attempt's pods.

Creates are idempotent (deterministic names; "already exists" is success), so a restarted
operator simply creates what is missing. A failed create is classified by the client layer
(``errors``): a permanent one (the object is invalid, or Pod Security forbids it) fails the job
with a condition that names the field, since sending it again can never work; a temporary one
(quota, RBAC, an outage) is retried with an exponential backoff, not every tick. A template the
operator's pod policy refuses fails the job before anything is created.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Final

from . import interval, manifests, podpolicy
from .errors import KubeError
from .jobstatus import JobStatus, iso
from .kube import Kube
from .lifecycle import Phase
from .model import JobSpec
from .settings import OperatorConfig
from .tick import Tick
from .writing import StatusWriter

__all__ = ["Creator"]

_CREATE_BACKOFF_CEILING: Final = 60.0
"""Seconds: the longest wait between tries of a create that failed for a temporary reason."""


class Creator:
    """Starts jobs and creates their pods; reports every create error on the job."""

    def __init__(
        self,
        *,
        kube: Kube,
        config: OperatorConfig,
        token_for: Callable[[JobSpec], str],
        writer: StatusWriter,
        pools: interval.PoolLedger | None = None,
    ) -> None:
        self._kube = kube
        self._pools = pools
        """Node time and interruptions per pool (the controller's), for the interval."""
        self._config = config
        self._token_for = token_for
        self._writer = writer

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
        choice = interval.for_job(t.job, at=t.now, pools=self._pools)
        await self._writer.patch(
            t, t.patch().set({"checkpointInterval": choice.to_status(status.attempt)})
        )
        return choice.seconds

    async def ensure_pods(self, t: Tick, status: JobStatus, *, replicas: int) -> None:
        """Create the attempt's missing pods: rank 0 first, the others once it has an IP.

        ``masterAddr`` is recorded when every pod exists; until then nothing is missing.
        """
        spec = t.spec
        if status.master_addr or not t.memory.may_create(t.now):
            return
        every = await self._interval(t, status) if spec.auto_interval else None

        def body(rank: int, master: str | None) -> dict[str, Any]:
            return manifests.pod_manifest(
                spec, self._config, attempt=status.attempt, rank=rank, replicas=replicas,
                master_addr=master, resume_step=status.resumed_from_step,
                avoid_nodes=list(status.avoid_nodes), every_seconds=every,
            )  # fmt: skip

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

    async def refuse(self, t: Tick, refused: Sequence[podpolicy.Refusal]) -> None:
        """The template asks for what the pod policy forbids: fail the job, naming the fields."""
        message = podpolicy.summary(refused)
        # The next tick sees Failed and deletes whatever pods the job still has.
        await self._writer.patch(
            t,
            t.patch()
            .phase(Phase.FAILED)
            .condition("Ready", False, "PodTemplateRefused", message)
            .condition("Failed", True, "PodTemplateRefused", message)
            .set({"message": message, "notice": None}),
        )
        await self._writer.event(t.job, "Warning", "PodTemplateRefused", message)

    async def _create(self, t: Tick, status: JobStatus, *, kind: str, body: dict[str, Any]) -> bool:
        """Create a pod or the Service; on an error, report it and return False.

        Every error goes to ``status.message``, a condition and an Event that quote the API
        server (which names the field).
        """
        create = self._kube.create_pod if kind == "pod" else self._kube.create_service
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
        if error.permanent:
            reason = "PodRejected" if kind == "pod" else "ServiceRejected"
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
        reason = "PodCreateFailed" if kind == "pod" else "ServiceCreateFailed"
        message = f"could not create the {kind}{named}: {error}; retrying in {delay:.0f}s"
        patch.condition("Degraded", True, reason, message).set({"message": message})
        if status.phase is not None:  # a job not started yet has no status to add to
            await self._writer.patch(t, patch)
        await self._writer.event(t.job, "Warning", reason, message)
