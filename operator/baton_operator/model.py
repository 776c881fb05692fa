"""Typed views of a TrainingJob's spec and status (parsed from, and written back as, dicts).

Defaults live in the CRD (the API server applies them); the same defaults are repeated here
only so that a body that skipped defaulting (a unit test, an old object) still parses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = ["KUEUE_PRIORITY_LABEL", "KUEUE_QUEUE_LABEL", "JobSpec", "LastCheckpoint"]

KUEUE_QUEUE_LABEL: Final = "kueue.x-k8s.io/queue-name"
"""The LocalQueue a workload is queued in (Kueue's ``constants.QueueLabel``)."""
KUEUE_PRIORITY_LABEL: Final = "kueue.x-k8s.io/priority-class"
"""The WorkloadPriorityClass of a workload (Kueue's ``constants.WorkloadPriorityClassLabel``)."""


def _queue_labels(labels: Mapping[str, Any]) -> dict[str, str]:
    if not labels.get(KUEUE_QUEUE_LABEL):
        return {}
    keys = (KUEUE_QUEUE_LABEL, KUEUE_PRIORITY_LABEL)
    return {k: str(labels[k]) for k in keys if labels.get(k)}


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """The parts of ``spec`` the operator acts on."""

    namespace: str
    name: str
    uid: str
    generation: int
    replicas: int
    procs_per_replica: int
    min_replicas: int | None
    elastic_wait_seconds: float
    master_port: int
    template: Mapping[str, Any]
    checkpoint_uri: str
    every_steps: int | None
    every_seconds: int | None
    auto_interval: bool
    """``everySeconds: auto``: the operator chooses ``every_seconds`` per attempt (interval.py)."""
    keep_last: int | None
    max_failures: int
    max_preemptions: int
    backoff_seconds: float
    max_backoff_seconds: float
    suspend: bool = False
    """``spec.suspend``: stop the pods after a checkpoint and keep them stopped (Kueue sets it
    on a job it has not admitted, or has preempted)."""
    deletion_cost: bool = False
    """``spec.disruption.deletionCost``: keep the pods' ``pod-deletion-cost`` annotation in
    step with the work lost since the last commit (disruption.py)."""
    queue_labels: Mapping[str, str] = field(default_factory=dict)
    """The job's Kueue labels that its pods carry too (``kueue.x-k8s.io/queue-name`` and
    ``kueue.x-k8s.io/priority-class``); empty when the job names no queue."""

    @property
    def key(self) -> str:
        """``namespace/name``, as in ``BATON_JOB``."""
        return f"{self.namespace}/{self.name}"

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> JobSpec:
        """Parse a TrainingJob object (as the API returns it)."""
        meta = body.get("metadata") or {}
        spec = body.get("spec") or {}
        ckpt = spec.get("checkpoint") or {}
        policy = spec.get("failurePolicy") or {}
        return cls(
            namespace=str(meta.get("namespace", "default")),
            name=str(meta["name"]),
            uid=str(meta.get("uid", "")),
            generation=int(meta.get("generation", 0)),
            replicas=int(spec["replicas"]),
            procs_per_replica=int(spec.get("procsPerReplica", 1)),
            min_replicas=None if spec.get("minReplicas") is None else int(spec["minReplicas"]),
            elastic_wait_seconds=float(spec.get("elasticWaitSeconds", 60)),
            master_port=int(spec.get("masterPort", 29500)),
            template=spec.get("template") or {},
            checkpoint_uri=str(ckpt["uri"]),
            every_steps=None if ckpt.get("everySteps") is None else int(ckpt["everySteps"]),
            every_seconds=(
                None if ckpt.get("everySeconds") in (None, "auto") else int(ckpt["everySeconds"])
            ),
            auto_interval=ckpt.get("everySeconds") == "auto",
            keep_last=None if ckpt.get("keepLast") is None else int(ckpt["keepLast"]),
            max_failures=int(policy.get("maxFailures", 3)),
            max_preemptions=int(policy.get("maxPreemptions", 100)),
            backoff_seconds=float(policy.get("backoffSeconds", 10)),
            max_backoff_seconds=float(policy.get("maxBackoffSeconds", 300)),
            suspend=bool(spec.get("suspend", False)),
            deletion_cost=bool((spec.get("disruption") or {}).get("deletionCost", False)),
            queue_labels=_queue_labels(meta.get("labels") or {}),
        )


@dataclass(frozen=True, kw_only=True)
class LastCheckpoint:
    """``status.lastCheckpoint``: the newest step every rank reported committed."""

    step: int
    uri: str | None = None
    trigger: str | None = None
    completed_at: str | None = None
    seconds: float | None = None

    def to_status(self) -> dict[str, Any]:
        """The status-subresource shape (camelCase, nulls dropped)."""
        out: dict[str, Any] = {"step": self.step}
        if self.uri is not None:
            out["uri"] = self.uri
        if self.trigger is not None:
            out["trigger"] = self.trigger
        if self.completed_at is not None:
            out["completedAt"] = self.completed_at
        if self.seconds is not None:
            out["seconds"] = self.seconds
        return out

    @classmethod
    def from_status(cls, raw: Mapping[str, Any] | None) -> LastCheckpoint | None:
        """Parse ``status.lastCheckpoint``; None when there is none yet."""
        if not raw or raw.get("step") is None:
            return None
        seconds = raw.get("seconds")
        return cls(
            step=int(raw["step"]),
            uri=raw.get("uri"),
            trigger=raw.get("trigger"),
            completed_at=raw.get("completedAt"),
            seconds=None if seconds is None else float(seconds),
        )
