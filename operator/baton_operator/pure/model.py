"""Typed views of a TrainingJob's spec and status (parsed from, and written back as, dicts).

Defaults live in the CRD (the API server applies them); the same defaults are repeated here
only so that a body that skipped defaulting (a unit test, an old object) still parses.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Final

__all__ = [
    "JOB_NAME_PATTERN",
    "KUEUE_PRIORITY_LABEL",
    "KUEUE_QUEUE_LABEL",
    "MAX_JOB_NAME",
    "MAX_PORT",
    "QUANTITY_PATTERN",
    "FastTier",
    "JobSpec",
    "LastCheckpoint",
    "name_error",
    "parse_bytes",
]

KUEUE_QUEUE_LABEL: Final = "kueue.x-k8s.io/queue-name"
"""The LocalQueue a workload is queued in (Kueue's ``constants.QueueLabel``)."""
KUEUE_PRIORITY_LABEL: Final = "kueue.x-k8s.io/priority-class"
"""The WorkloadPriorityClass of a workload (Kueue's ``constants.WorkloadPriorityClassLabel``)."""


QUANTITY_PATTERN: Final = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
"""A byte quantity as ``sizeLimit`` takes one: digits, an optional fraction and a binary or
decimal suffix (``4Gi``, ``1.5G``, ``4096Mi``). The CRD checks the same pattern."""
_UNITS: Final = {
    "": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}  # fmt: skip


MAX_JOB_NAME: Final = 63
"""A TrainingJob's name is a DNS-1035 label: it names the job's headless Service."""
JOB_NAME_PATTERN: Final = "^[a-z]([-a-z0-9]*[a-z0-9])?$"
MAX_PORT: Final = 65535


def name_error(name: str) -> str | None:
    """Why ``name`` cannot name a TrainingJob, with the fix; None when it can.

    The CRD refuses such a name at admission (crd.py); this is the operator's backstop for an
    object admitted by an older CRD.
    """
    if len(name) <= MAX_JOB_NAME and re.fullmatch(JOB_NAME_PATTERN, name):
        return None
    return (
        f"metadata.name {name!r} is not a DNS-1035 label of at most {MAX_JOB_NAME} characters "
        "(lowercase letters, digits and '-', starting with a letter): it names the job's "
        "headless Service. Re-create the TrainingJob under such a name"
    )


def parse_bytes(value: object) -> int | None:
    """A quantity of bytes (an integer, or a string of :data:`QUANTITY_PATTERN`), rounded up
    to whole bytes; None when it is not one, or is not positive."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value > 0 else None
    if not isinstance(value, str) or not re.fullmatch(QUANTITY_PATTERN, value):
        return None
    digits = value.rstrip("kKMGTPEi")
    n = math.ceil(Decimal(digits) * _UNITS[value[len(digits) :]])
    return n if n > 0 else None


@dataclass(frozen=True, kw_only=True)
class FastTier:
    """``spec.checkpoint.fastEverySteps`` and its sizing: the memory tier (docs/operator.md,
    "The memory tier")."""

    every_steps: int
    """``BATON_FAST_EVERY_STEPS``: a snapshot into pod memory every this many steps."""
    size_limit: str
    """``fastSizeLimit`` as written: the memory ``emptyDir``'s ``sizeLimit``."""
    size_bytes: int
    """The same, in bytes (what the sidecar's memory is sized from)."""
    replicas: int
    """``fastReplicas``: peer pods that keep a copy of each pod's snapshot."""


def _fast_tier(ckpt: Mapping[str, Any]) -> tuple[FastTier | None, str | None]:
    """The memory tier of ``spec.checkpoint``, or why it is invalid (the CRD refuses the same
    at admission; this is the backstop for an old CRD or a server without CEL)."""
    every, size, replicas = (
        ckpt.get("fastEverySteps"),
        ckpt.get("fastSizeLimit"),
        ckpt.get("fastReplicas", 1),
    )
    if every is None:
        return None, None
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        return None, f"spec.checkpoint.fastEverySteps={every!r}: use an integer of 1 or more"
    if size is None:
        return None, (
            "spec.checkpoint.fastSizeLimit is required with fastEverySteps: set it to the "
            "memory emptyDir's size, about (2 + 2 x fastReplicas) x the pod's share of the "
            "checkpoint plus a margin (docs/operator.md, The memory tier), e.g. 4Gi"
        )
    size_bytes = parse_bytes(size)
    if size_bytes is None:
        return None, (
            f"spec.checkpoint.fastSizeLimit={size!r} is not a positive byte quantity: write "
            "it like 4Gi, 4096Mi or 4G"
        )
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        return None, f"spec.checkpoint.fastReplicas={replicas!r}: use an integer of 1 or more"
    tier = FastTier(
        every_steps=every, size_limit=str(size), size_bytes=size_bytes, replicas=replicas
    )
    return tier, None


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
    fast: FastTier | None = None
    """The memory tier (``spec.checkpoint.fastEverySteps``); None when it is off or invalid."""
    spec_error: str | None = None
    """Why the spec cannot be run, with the fix (the controller fails the job with it before
    creating anything); None when it can."""

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
        fast, spec_error = _fast_tier(ckpt)
        replicas = int(spec["replicas"])
        if fast is not None and 1 < replicas <= fast.replicas:
            spec_error = (
                f"spec.checkpoint.fastReplicas={fast.replicas} must be less than spec.replicas="
                f"{replicas} (each copy goes to another pod): lower fastReplicas"
            )
            fast = None
        master_port = int(spec.get("masterPort", 29500))
        if not 1 <= master_port <= MAX_PORT:
            spec_error = (
                f"spec.masterPort={master_port} is not a TCP port: use 1 to {MAX_PORT} "
                "(the default 29500 suits most jobs)"
            )
        spec_error = name_error(str(meta["name"])) or spec_error
        return cls(
            namespace=str(meta.get("namespace", "default")),
            name=str(meta["name"]),
            uid=str(meta.get("uid", "")),
            generation=int(meta.get("generation", 0)),
            replicas=replicas,
            procs_per_replica=int(spec.get("procsPerReplica", 1)),
            min_replicas=None if spec.get("minReplicas") is None else int(spec["minReplicas"]),
            elastic_wait_seconds=float(spec.get("elasticWaitSeconds", 60)),
            master_port=master_port,
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
            fast=fast,
            spec_error=spec_error,
        )


@dataclass(frozen=True, kw_only=True)
class LastCheckpoint:
    """``status.lastCheckpoint``: the newest step every rank reported committed."""

    step: int
    uri: str | None = None
    trigger: str | None = None
    completed_at: str | None = None
    seconds: float | None = None
    tier: str | None = None
    """``durable``, ``memory`` or ``memory+promoted``, as the ranks reported it (None: an SDK
    before tiers, whose saves are durable)."""

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
        if self.tier is not None:
            out["tier"] = self.tier
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
            tier=raw.get("tier"),
        )
