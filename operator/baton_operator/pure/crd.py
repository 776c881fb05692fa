"""The TrainingJob CustomResourceDefinition: the single source of truth for its schema.

``deploy/`` and the Helm chart are generated from :func:`crd_manifest`, and the tests validate
examples against it, so the schema, the CEL rules and the printer columns live only here.

Every property carries a description because ``kubectl explain trainingjob.spec...`` is how
users discover the API. Every validation rule is CEL with a message that names the field and
the fix, so that the API server refuses a bad TrainingJob with a sentence, not a stack.

The operator keeps kopf's own bookkeeping in annotations (see ``settings.py``), so the status
schema below is complete: nothing unknown is written there, and nothing is pruned.

Why one module of this size: the schema is one object, and each field's description and CEL
rules (the Pod Security ones for every container kind among them) stand beside the field;
split by section, a reader would follow one field through several files.
"""

from __future__ import annotations

import copy
from typing import Any, Final

from . import model, podpolicy
from .vocabulary import Tier

__all__ = [
    "GPU_RESOURCE",
    "GROUP",
    "HISTORY_LIMIT",
    "KIND",
    "PLURAL",
    "POOLS_KEPT",
    "SHORT_NAME",
    "SINGULAR",
    "VERSION",
    "crd_manifest",
]

GROUP: Final = "baton.dev"
VERSION: Final = "v1alpha1"
KIND: Final = "TrainingJob"
PLURAL: Final = "trainingjobs"
SINGULAR: Final = "trainingjob"
SHORT_NAME: Final = "tj"

PHASES: Final = (
    "Pending",
    "Running",
    "Checkpointing",
    "Restarting",
    "Suspended",
    "Succeeded",
    "Failed",
)

# Bounds that keep the CEL cost estimate small (an unbounded list makes the API server
# reject the CRD for an estimated cost over budget) and that no real job comes near.
_MAX_CONTAINERS: Final = 64
_MAX_NAME: Final = 253
_MAX_URI: Final = 2048
_MAX_RESOURCES: Final = 64
_MAX_QUANTITY: Final = 64
_MAX_PORT: Final = 65535
_MAX_PROCS: Final = 64
"""procsPerReplica's ceiling: a GPU node has 8 or 16 GPUs, one process each; more processes
than this in one pod is a typo (1000 was once accepted and "succeeded" with one process)."""
GPU_RESOURCE: Final = "nvidia.com/gpu"
HISTORY_LIMIT: Final = 20
"""``status.interruptions`` keeps the newest this many (maxItems; economics.py trims)."""
POOLS_KEPT: Final = 20
"""``status.exposure.pools`` keeps the pools with the most node time, at most this many
(maxItems; interval.py trims): a job does not wander over more pools than that in practice."""
_GPU_Q: Final = f"'{GPU_RESOURCE}'"


def _int(
    description: str, *, minimum: int | None = None, default: int | None = None
) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer", "format": "int64", "description": description}
    if minimum is not None:
        schema["minimum"] = minimum
    if default is not None:
        schema["default"] = default
    return schema


def _str(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "description": description, **extra}


def _present(obj: str, field: str) -> str:
    """CEL: ``obj.field`` and each object on the way there are present."""
    parts = field.split(".")
    return " && ".join(f"has({obj}.{'.'.join(parts[: i + 1])})" for i in range(len(parts)))


def _required(field: str, where: str, fix: str) -> dict[str, Any]:
    # A CEL rule rather than the schema's `required`: a missing required field is an error
    # the API server does not run CEL rules after, and it then adds a confusing line
    # ("<nil>: Invalid value: null: some validation rules were not checked...").
    return {
        "rule": f"has(self.{field})",
        "message": f"{where}.{field} is required: {fix}",
        "fieldPath": f".{field}",
        "reason": "FieldValueRequired",
    }


def _immutable_rule(field: str) -> dict[str, Any]:
    # A transition rule on the root object: it may read the old status, so the field stays
    # editable until the operator has started the job (status.phase is set), and frozen after.
    # A field absent on either side is left to the rules that require it.
    return {
        "rule": (
            f"!has(oldSelf.status) || !has(oldSelf.status.phase) || "
            f"!({_present('self.spec', field)}) || !({_present('oldSelf.spec', field)}) || "
            f"self.spec.{field} == oldSelf.spec.{field}"
        ),
        "message": (
            f"spec.{field} is immutable once the job has started: delete and re-create the "
            "TrainingJob to change it"
        ),
        "fieldPath": f".spec.{field}",
        "reason": "FieldValueForbidden",
    }


def _name_rules() -> list[dict[str, Any]]:
    # The job's name is its headless Service's name and its pods' subdomain (DNS-1035 labels)
    # and a label value; longer derived names (pods, PodGroups) are cut with a digest
    # (manifests.bounded_name), so the name alone decides whether every attempt can run.
    return [
        {
            "rule": f"size(self.metadata.name) <= {model.MAX_JOB_NAME}",
            "message": (
                f"metadata.name must have at most {model.MAX_JOB_NAME} characters (it names "
                "the job's headless Service and its pods' DNS subdomain): choose a shorter "
                "name"
            ),
            "fieldPath": ".metadata.name",
            "reason": "FieldValueInvalid",
        },
        {
            "rule": f"self.metadata.name.matches('{model.JOB_NAME_PATTERN}')",
            "message": (
                "metadata.name must be a DNS-1035 label: lowercase letters, digits and '-', "
                "starting with a letter and ending with a letter or digit (it names the job's "
                "headless Service): rename the TrainingJob, e.g. my-job for my.job or My_Job"
            ),
            "fieldPath": ".metadata.name",
            "reason": "FieldValueInvalid",
        },
    ]


def _spec_schema() -> dict[str, Any]:
    def quantities(description: str) -> dict[str, Any]:
        # A fresh dict per use: shared ones would become YAML anchors in the generated files.
        return {
            "type": "object",
            "description": description,
            "maxProperties": _MAX_RESOURCES,
            # maxLength keeps the estimated cost of the GPU rule in budget (strings are
            # otherwise unbounded).
            "additionalProperties": {
                "x-kubernetes-int-or-string": True,
                "maxLength": _MAX_QUANTITY,
            },
        }

    container = {
        "type": "object",
        "description": "A container of the pod template (core/v1 Container).",
        "x-kubernetes-preserve-unknown-fields": True,
        "required": ["name"],
        "properties": {
            "name": _str("The container name.", maxLength=_MAX_NAME),
            "resources": {
                "type": "object",
                "description": (
                    "core/v1 ResourceRequirements. Quantities may be integers or strings "
                    f"(`{GPU_RESOURCE}: 8`); they reach the API server as written."
                ),
                "x-kubernetes-preserve-unknown-fields": True,
                "properties": {
                    "limits": quantities("Resource limits."),
                    "requests": quantities("Resource requests."),
                },
            },
        },
    }
    template = {
        "type": "object",
        "description": (
            "The pod template for every replica (core/v1 PodTemplateSpec). It must have a "
            "container named `trainer`; the operator adds the env contract, the "
            "`baton-sidecar` native sidecar, the control volume and owner references. "
            "Required."
        ),
        "properties": {
            "metadata": {
                "type": "object",
                "description": "Labels and annotations copied onto every pod.",
                "x-kubernetes-preserve-unknown-fields": True,
            },
            "spec": {
                "type": "object",
                "description": "The pod spec (core/v1 PodSpec).",
                "x-kubernetes-preserve-unknown-fields": True,
                "properties": {
                    "containers": {
                        "type": "array",
                        "description": "The pod's containers; one must be named `trainer`.",
                        "maxItems": _MAX_CONTAINERS,
                        "items": container,
                    }
                },
            },
        },
        "x-kubernetes-validations": [
            {
                # Also the rule that requires spec and containers (see _required).
                "rule": (
                    "has(self.spec) && has(self.spec.containers) && "
                    "self.spec.containers.exists(c, c.name == 'trainer')"
                ),
                "message": (
                    "spec.template.spec.containers must include a container named `trainer` "
                    "(the operator injects the training env into it)"
                ),
                "fieldPath": ".spec.containers",
                "reason": "FieldValueRequired",
            }
        ],
    }
    checkpoint = {
        "type": "object",
        "description": "Where and how often the SDK saves checkpoints. Required.",
        "properties": {
            "uri": _str(
                "Where checkpoints live: `s3://bucket/prefix`, `file:///path` or an absolute "
                "path. Required. Immutable once the job has started.",
                maxLength=_MAX_URI,
            ),
            "everySteps": _int("Periodic checkpoint interval in optimizer steps (> 0)."),
            "everySeconds": {
                "x-kubernetes-int-or-string": True,
                "description": (
                    "A number of seconds or the string `auto` (an int-or-string field). A "
                    "number (> 0): the periodic checkpoint interval in seconds. `auto`: the "
                    "operator chooses it for each attempt from the measured save time and "
                    "the job's interruption rate (docs/operator.md, Adaptive interval). "
                    "Unset: no time-based saves."
                ),
            },
            "keepLast": _int(
                "How many committed checkpoints to keep (at least 1). Default: 3 (the SDK's "
                "keep_last when the operator passes none).",
                minimum=1,
            ),
            "fastEverySteps": _int(
                "The memory tier: every this many steps each rank also snapshots the whole "
                "state into its pod's memory (a medium: Memory emptyDir), and the sidecar "
                "copies it to fastReplicas peer pods on other nodes, so a node lost without "
                "notice costs about this many steps (docs/operator.md, The memory tier). "
                "Absent: no memory tier. Needs fastSizeLimit."
            ),
            "fastSizeLimit": {
                "x-kubernetes-int-or-string": True,
                "maxLength": _MAX_QUANTITY,
                "description": (
                    "The memory emptyDir's sizeLimit (bytes, or a quantity like 4Gi): about "
                    "(2 + 2 x fastReplicas) x the pod's share of the checkpoint plus a margin. "
                    "Required with fastEverySteps. The sidecar's memory request and limit grow "
                    "with it; add 2 x the pod's share to the trainer's own memory request."
                ),
            },
            # No schema default: a job without the memory tier would show `fastReplicas: 1`
            # (kubectl describe) for a tier it does not have; model.py applies the 1.
            "fastReplicas": _int(
                "With fastEverySteps only: how many peer pods (on other nodes) keep a copy of "
                "each pod's snapshot: k survives the loss of any k nodes. At most replicas - 1. "
                "Default: 1 when the memory tier is on.",
                minimum=1,
            ),
        },
        "x-kubernetes-validations": [
            _required(
                "uri",
                "spec.checkpoint",
                "where checkpoints live, e.g. s3://bucket/prefix or file:///data/ckpt",
            ),
            {
                "rule": "!has(self.fastEverySteps) || self.fastEverySteps > 0",
                "message": "spec.checkpoint.fastEverySteps must be greater than 0",
                "fieldPath": ".fastEverySteps",
                "reason": "FieldValueInvalid",
            },
            {
                "rule": "!has(self.fastEverySteps) || has(self.fastSizeLimit)",
                "message": (
                    "spec.checkpoint.fastSizeLimit is required with fastEverySteps: set it to "
                    "the memory emptyDir's size, about (2 + 2 x fastReplicas) x the pod's share "
                    "of the checkpoint plus a margin (docs/operator.md, The memory tier), e.g. "
                    "4Gi"
                ),
                "fieldPath": ".fastSizeLimit",
                "reason": "FieldValueRequired",
            },
            {
                "rule": (
                    "!has(self.fastSizeLimit) || (type(self.fastSizeLimit) == int ? "
                    "self.fastSizeLimit > 0 : (self.fastSizeLimit.matches('"
                    + model.QUANTITY_PATTERN.replace("\\", "\\\\")
                    + "') && !self.fastSizeLimit.matches('^[0.]+[A-Za-z]*$')))"
                ),
                "message": (
                    "spec.checkpoint.fastSizeLimit must be a positive byte quantity, written "
                    "like 4Gi, 4096Mi or 4G"
                ),
                "fieldPath": ".fastSizeLimit",
                "reason": "FieldValueInvalid",
            },
            {
                "rule": (
                    "!has(self.uri) || self.uri.startsWith('s3://') || "
                    "self.uri.startsWith('file://') || self.uri.startsWith('/')"
                ),
                "message": (
                    "spec.checkpoint.uri must start with s3:// or file://, or be an absolute path"
                ),
                "fieldPath": ".uri",
                "reason": "FieldValueInvalid",
            },
            {
                "rule": "!has(self.everySteps) || self.everySteps > 0",
                "message": "spec.checkpoint.everySteps must be greater than 0",
                "fieldPath": ".everySteps",
                "reason": "FieldValueInvalid",
            },
            {
                "rule": (
                    "!has(self.everySeconds) || (type(self.everySeconds) == string ? "
                    "self.everySeconds == 'auto' : self.everySeconds > 0)"
                ),
                "message": "spec.checkpoint.everySeconds must be greater than 0, or 'auto'",
                "fieldPath": ".everySeconds",
                "reason": "FieldValueInvalid",
            },
        ],
    }
    failure_policy = {
        "type": "object",
        "description": (
            "Budgets. Preemptions (a notice the operator acted on) and failures (a crash or "
            "an unannounced node loss) are counted separately."
        ),
        "properties": {
            "maxFailures": _int("Failures allowed before the job is Failed.", minimum=0, default=3),
            "maxPreemptions": _int(
                "Preemptions allowed before the job is Failed.", minimum=0, default=100
            ),
            "backoffSeconds": _int(
                "First delay before a restart after a failure; doubles per failure.",
                minimum=0,
                default=10,
            ),
            "maxBackoffSeconds": _int(
                "Ceiling of the exponential failure backoff.", minimum=0, default=300
            ),
        },
    }
    return {
        "type": "object",
        "description": "The desired training job.",
        "properties": {
            "replicas": _int(
                "Pods; WORLD_SIZE = replicas * procsPerReplica. Required. Immutable once started."
            ),
            "procsPerReplica": _int(
                "Training processes per pod (LOCAL_WORLD_SIZE), started by a launcher such as "
                "`torchrun` (the operator sets its PET_* variables). At most "
                f"{_MAX_PROCS}, and at most the trainer's `{GPU_RESOURCE}` limit when it has "
                "one. Immutable once started.",
                minimum=1,
                default=1,
            ),
            "minReplicas": _int(
                "Elastic floor: when fewer than `replicas` nodes can host the job for "
                "`elasticWaitSeconds`, restart with as few as this many pods. Unset means "
                "never shrink."
            ),
            "elasticWaitSeconds": _int(
                "How long pods may stay unschedulable before an elastic shrink.",
                minimum=0,
                default=60,
            ),
            "masterPort": {
                **_int(
                    "The rendezvous port (MASTER_PORT) on rank 0's pod and the job's headless "
                    "Service: 1 to 65535.",
                    minimum=1,
                    default=29500,
                ),
                "maximum": _MAX_PORT,
            },
            "template": template,
            "checkpoint": checkpoint,
            "failurePolicy": failure_policy,
            "suspend": {
                "type": "boolean",
                "default": False,
                "description": (
                    "As in batch/v1 Job and JobSet (Kueue sets it): true stops the job's pods "
                    "after a checkpoint (phase Suspended; no budget is spent), and a job "
                    "created suspended creates none; false again starts a new attempt that "
                    "resumes from the newest committed step."
                ),
            },
            "disruption": {
                "type": "object",
                "description": "Hints to the cluster's node removers about this job's pods.",
                "properties": {
                    "deletionCost": {
                        "type": "boolean",
                        "default": False,
                        "description": (
                            "Keep the annotation controller.kubernetes.io/pod-deletion-cost on "
                            "the running pods equal to the work lost if one went now: "
                            "GPU-seconds (steps without GPUs) since the last committed "
                            "checkpoint (Karpenter ranks consolidation candidates by it). "
                            "false removes it."
                        ),
                    },
                },
            },
        },
        "x-kubernetes-validations": [
            _required("replicas", "spec", "the number of pods, e.g. replicas: 2"),
            _required("template", "spec", "the pod template, with a container named `trainer`"),
            _required("checkpoint", "spec", "at least its uri, e.g. s3://bucket/prefix"),
            {
                "rule": "!has(self.replicas) || self.replicas >= 1",
                "message": "spec.replicas must be at least 1",
                "fieldPath": ".replicas",
                "reason": "FieldValueInvalid",
            },
            {
                "rule": f"!has(self.procsPerReplica) || self.procsPerReplica <= {_MAX_PROCS}",
                "message": (
                    f"spec.procsPerReplica must be at most {_MAX_PROCS} (processes per pod; "
                    "WORLD_SIZE = replicas * procsPerReplica): use more replicas instead"
                ),
                "fieldPath": ".procsPerReplica",
                "reason": "FieldValueInvalid",
            },
            {
                # One process per GPU: more would put two ranks on one device (NCCL refuses
                # that). 0 GPUs means a CPU job. [x].all(g, ...) binds the parsed quantity.
                "rule": (
                    "!has(self.procsPerReplica) || !has(self.template) || "
                    "!has(self.template.spec) || !has(self.template.spec.containers) || "
                    "self.template.spec.containers.all(c, "
                    "c.name != 'trainer' || !has(c.resources) || !has(c.resources.limits) || "
                    f"!({_GPU_Q} in c.resources.limits) || "
                    f"[int(string(c.resources.limits[{_GPU_Q}]))].all(g, "
                    "g == 0 || g >= self.procsPerReplica))"
                ),
                "message": (
                    "spec.procsPerReplica must not exceed the trainer container's "
                    f"resources.limits[{GPU_RESOURCE}] (one process per GPU): lower "
                    "spec.procsPerReplica or request more GPUs"
                ),
                "fieldPath": ".procsPerReplica",
                "reason": "FieldValueInvalid",
            },
            {
                "rule": (
                    "!has(self.replicas) || !has(self.checkpoint) || "
                    "!has(self.checkpoint.fastEverySteps) || !has(self.checkpoint.fastReplicas) "
                    "|| self.replicas <= 1 || self.checkpoint.fastReplicas < self.replicas"
                ),
                "message": (
                    "spec.checkpoint.fastReplicas must be less than spec.replicas (each copy "
                    "goes to another pod): lower fastReplicas"
                ),
                "fieldPath": ".checkpoint.fastReplicas",
                "reason": "FieldValueInvalid",
            },
            {
                "rule": "!has(self.minReplicas) || (self.minReplicas >= 1 && "
                "(!has(self.replicas) || self.minReplicas <= self.replicas))",
                "message": "spec.minReplicas must be between 1 and spec.replicas",
                "fieldPath": ".minReplicas",
                "reason": "FieldValueInvalid",
            },
        ],
    }


def _status_schema() -> dict[str, Any]:
    condition = {
        "type": "object",
        "description": "A condition in the usual Kubernetes shape.",
        "required": ["type", "status"],
        "properties": {
            "type": _str("Ready, Progressing, Checkpointing, Degraded or Failed."),
            "status": _str("True, False or Unknown.", enum=["True", "False", "Unknown"]),
            "reason": _str("A CamelCase reason."),
            "message": _str("What happened, for a human."),
            "lastTransitionTime": _str("When status last changed.", format="date-time"),
            "observedGeneration": _int("The spec generation this condition is about."),
        },
    }
    notice = {
        "type": "object",
        "description": "The eviction notice being handled (checkpoint-then-reschedule).",
        "properties": {
            "source": _str(
                "aws, karpenter, gke, autoscaler, cordon, out-of-service, disruption-target; "
                "suspend for the save before a suspend."
            ),
            "nodes": {
                "type": "array",
                "items": {"type": "string"},
                "description": "The noticed nodes.",
            },
            "reason": _str("What the notice said."),
            "deadline": _str("When the node is expected to go.", format="date-time"),
            "receivedAt": _str("When the operator saw the notice.", format="date-time"),
            "requestedAt": _str("When checkpoints were requested.", format="date-time"),
            "requestIds": {
                "type": "array",
                "items": {"type": "string"},
                "description": "The sidecars' request ids, by rank.",
            },
        },
    }
    last_checkpoint = {
        "type": "object",
        "description": "The newest checkpoint that every rank reported committed.",
        "properties": {
            "step": _int("The optimizer step."),
            "uri": _str("Where it lives."),
            "trigger": _str("periodic, notice or signal."),
            "completedAt": _str("When the operator saw the commit.", format="date-time"),
            "seconds": {"type": "number", "description": "Save time reported by the SDK."},
            "tier": {
                "type": "string",
                "enum": [t.value for t in Tier],
                "description": (
                    "Where it committed: durable (the checkpoint uri), memory (a notice's "
                    "snapshot in the pods' memory tier, replicated to peers) or memory+promoted "
                    "(that snapshot since copied to the checkpoint uri)."
                ),
            },
        },
    }
    checkpoint_interval = {
        "type": "object",
        "description": (
            "With everySeconds: auto, the interval chosen for the current attempt and its "
            "inputs (Young: sqrt(2 x saveSeconds x mtbiSeconds), within bounds)."
        ),
        "properties": {
            "seconds": _int("The interval given to the ranks (BATON_EVERY_SECONDS)."),
            "attempt": _int("The attempt it was chosen for."),
            "saveSeconds": {"type": "number", "description": "The save cost used."},
            "saveMeasured": {
                "type": "boolean",
                "description": "Whether saveSeconds was measured (false: the default).",
            },
            "mtbiSeconds": {
                "type": "number",
                "description": (
                    "The job's mean time between interruptions used: (nodeSeconds + "
                    "priorSeconds) / (interruptions + 1) / nodes."
                ),
            },
            "source": _str(
                "Where the rate came from: pool (every job seen on the pool), job (the job's "
                "own) or prior (nothing observed yet).",
                enum=["pool", "job", "prior"],
            ),
            "pool": _str("The job's node pool (label=value), when known."),
            "interruptions": _int("Interruptions in the window (the pool's or the job's)."),
            "nodeSeconds": {
                "type": "number",
                "description": "The window: node seconds observed (the pool's or the job's).",
            },
            "nodes": _int("The job's nodes (replicas), which the per-node MTBI is shared by."),
            "priorSeconds": _int("The prior: node seconds per interruption, one pseudo-interval."),
            "bounded": _str("min or max when a bound overrode the formula."),
        },
    }

    def _exposure_counts(description: str, **extra: Any) -> dict[str, Any]:
        return {
            "type": "object",
            "description": description,
            "properties": {
                "nodeSeconds": {"type": "number", "description": "Running time x nodes."},
                "interruptions": _int("Preemptions and failures in that time."),
                **extra,
            },
        }

    exposure = _exposure_counts(
        "The job's node time and interruptions over its whole life, in total and per node "
        "pool, and the running attempt's clock: the interruption rate of everySeconds: auto.",
        pool=_str("The pool most of the latest running attempt's nodes were in."),
        pools={
            "type": "array",
            "maxItems": POOLS_KEPT,
            "items": _exposure_counts("One pool's share.", pool=_str("label=value.")),
            "description": "Per node pool (label=value).",
        },
        current={
            "type": "object",
            "description": "The running attempt: since when, on how many nodes of which pools.",
            "properties": {
                "since": _str("When the attempt was Running.", format="date-time"),
                "nodes": _int("Its distinct nodes."),
                "pools": {
                    "type": "array",
                    "description": "Its nodes per pool (nodes without a pool label left out).",
                    "items": {
                        "type": "object",
                        "properties": {"pool": _str("label=value."), "nodes": _int("Its nodes.")},
                    },
                },
            },
        },
    )

    def _num(description: str) -> dict[str, Any]:
        return {"type": "number", "description": description}

    interruption = {
        "type": "object",
        "description": "One interruption: a notice-driven preemption, a node lost, a failure.",
        "properties": {
            "attempt": _int("The attempt it ended."),
            "source": _str(
                "The notice's source (aws, karpenter, gke, azure, disruption-target...), "
                "node-lost, eviction (a rank saved on its own after a SIGTERM) or failure."
            ),
            "nodes": {"type": "array", "items": {"type": "string"}, "description": "Its nodes."},
            "at": _str("When the operator decided the restart.", format="date-time"),
            "noticeAt": _str("When the notice was received.", format="date-time"),
            "deadline": _str("The notice's deadline (clamped).", format="date-time"),
            "leadSeconds": _num("Notice to deadline: the time the notice gave."),
            "noticeToDurableSeconds": _num(
                "Notice to every rank's committed save; absent when the save did not commit."
            ),
            "lastGoodStep": _int("The last training step any rank reported before it."),
            "lastGoodStepAt": _str("When that step was reported.", format="date-time"),
            "resumeStep": _int("The step the next attempt resumes from."),
            "stepsLost": _int("lastGoodStep - resumeStep: steps to recompute (a lower bound)."),
            "stepSeconds": _num("The measured mean seconds per step (the ranks' median)."),
            "gpus": _int("The attempt's GPUs (its pods' nvidia.com/gpu requests)."),
            "gpuSecondsLost": _num("stepsLost x stepSeconds x gpus (an estimate)."),
            "restartSeconds": _num(
                "From lastGoodStepAt to the next attempt's first reported step; absent "
                "until it trains."
            ),
        },
    }
    goodput = {
        "type": "object",
        "description": (
            "Productive step time / wall time: step x stepSeconds over the time since the "
            "job was created less the time it was suspended (an estimate)."
        ),
        "properties": {
            "ratio": _num("Goodput, 0 to 1."),
            "productiveSeconds": _num("step x stepSeconds."),
            "wallSeconds": _num("Since creation, less suspendedSeconds."),
            "step": _int("The last training step reported."),
            "stepSeconds": _num("The measured mean seconds per step."),
            "suspendedSeconds": _num("Time spent suspended, not counted as wall time."),
            "updatedAt": _str("When it was computed.", format="date-time"),
        },
    }
    return {
        "type": "object",
        "description": "What the operator observed and did.",
        "properties": {
            "phase": _str("Where the job is in its lifecycle.", enum=list(PHASES)),
            "message": _str("The latest thing that happened, for a human."),
            "reason": _str(
                "The CamelCase reason of the condition the operator last set true (e.g. "
                "Running, Checkpointing, PodTemplateRefused, BudgetExhausted): why the job is "
                "in its phase."
            ),
            "attempt": _int("Incremented on every restart; pods carry it in their names."),
            "worldSize": _int("WORLD_SIZE of the current attempt."),
            "replicas": _int("Pods in the current attempt (fewer than spec after a shrink)."),
            "preemptions": _int("Notices acted on (budget spec.failurePolicy.maxPreemptions)."),
            "failures": _int("Crashes and unannounced node losses (budget maxFailures)."),
            "resumedFromStep": _int("BATON_RESUME_STEP of the current attempt."),
            "stepsLost": _int("Steps recomputed after restarts, in total."),
            "observedGeneration": _int("The spec generation last acted on."),
            "masterAddr": _str(
                "Rank 0's pod IP for the current attempt, or its DNS name when the attempt "
                "is gang-scheduled (a PodGroup per attempt)."
            ),
            "attemptStartedAt": _str("When the current attempt was created.", format="date-time"),
            "restartAfter": _str("Backoff: no new attempt before this time.", format="date-time"),
            "restartReason": _str("preemption, failure, elastic or suspend."),
            "suspendedAt": _str("When the job was last suspended.", format="date-time"),
            "unschedulableSince": _str(
                "When pods of the current attempt first could not be placed.", format="date-time"
            ),
            "avoidNodes": {
                "type": "array",
                "items": {"type": "string"},
                "description": "Nodes with a notice; new attempts are kept off them.",
            },
            "notice": notice,
            "recovery": {
                "type": "object",
                "x-kubernetes-preserve-unknown-fields": True,
                "description": (
                    "The recovery that keeps the survivors, while it runs (memory tier; "
                    "docs/operator.md): startedAt, replaced (rank, pod, uid, node), kept "
                    "(pod names), nodes (lost)."
                ),
            },
            "lastRecovery": {
                "type": "object",
                "x-kubernetes-preserve-unknown-fields": True,
                "description": (
                    "The last finished recovery that kept the survivors: startedAt, "
                    "finishedAt, seconds, replaced, kept, nodes, restoredStep, tier "
                    "(memory, or durable when the memory tier could not cover every rank)."
                ),
            },
            "trainerRestarts": {
                "type": "object",
                "additionalProperties": {"type": "integer"},
                "description": (
                    "Pod name -> in-place trainer restarts already explained (by a "
                    "recovery); any more are counted as crashes."
                ),
            },
            "interruptions": {
                "type": "array",
                "items": interruption,
                "maxItems": HISTORY_LIMIT,
                "description": f"The newest {HISTORY_LIMIT} interruptions, oldest first.",
            },
            "goodput": goodput,
            "suspendedSeconds": _num("Seconds the job spent suspended, in total."),
            "lastCheckpoint": last_checkpoint,
            "checkpointInterval": checkpoint_interval,
            "exposure": exposure,
            "conditions": {
                "type": "array",
                "items": condition,
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
                "description": (
                    "Ready, Progressing, Checkpointing, Recovering, Degraded, Suspended, "
                    "Succeeded, Failed."
                ),
            },
        },
    }


_COLUMNS: Final = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {
        "name": "World",
        "type": "integer",
        "jsonPath": ".status.worldSize",
        "description": "WORLD_SIZE of the current attempt",
    },
    {"name": "Attempt", "type": "integer", "jsonPath": ".status.attempt", "priority": 1},
    {
        "name": "Checkpoint",
        "type": "integer",
        "jsonPath": ".status.lastCheckpoint.step",
        "description": "The last committed checkpoint step",
    },
    {
        "name": "Step",
        "type": "integer",
        "jsonPath": ".status.goodput.step",
        "description": "The last training step the ranks reported",
    },
    {"name": "Preemptions", "type": "integer", "jsonPath": ".status.preemptions"},
    {"name": "Failures", "type": "integer", "jsonPath": ".status.failures"},
    {
        "name": "Reason",
        "type": "string",
        "jsonPath": ".status.reason",
        "description": "Why the job is in its phase",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {
        "name": "Message",
        "type": "string",
        "jsonPath": ".status.message",
        "priority": 1,
        "description": "The latest thing that happened",
    },
]


def crd_manifest() -> dict[str, Any]:
    """Return the ``apiextensions.k8s.io/v1`` CRD for ``trainingjobs.baton.dev`` (a fresh dict)."""
    spec = _spec_schema()
    # The security policy's CEL half (podpolicy.py): refused at `kubectl apply`.
    podpolicy.forbid_in_schema(spec["properties"]["template"])
    schema = {
        "type": "object",
        "description": (
            "A distributed PyTorch training job that survives spot preemptions: the operator "
            "checkpoints every rank at one step before a node goes and resumes elsewhere."
        ),
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            # Only name may be declared here (the API server owns metadata); declared so that
            # the name rules' fieldPath is a path of the schema.
            "metadata": {"type": "object", "properties": {"name": {"type": "string"}}},
            "spec": spec,
            "status": _status_schema(),
        },
        "x-kubernetes-validations": [
            *_name_rules(),
            _immutable_rule("replicas"),
            _immutable_rule("procsPerReplica"),
            _immutable_rule("checkpoint.uri"),
        ],
    }
    return copy.deepcopy(
        {
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{PLURAL}.{GROUP}"},
            "spec": {
                "group": GROUP,
                "scope": "Namespaced",
                "names": {
                    "kind": KIND,
                    "plural": PLURAL,
                    "singular": SINGULAR,
                    "listKind": f"{KIND}List",
                    "shortNames": [SHORT_NAME],
                    "categories": ["baton"],
                },
                "versions": [
                    {
                        "name": VERSION,
                        "served": True,
                        "storage": True,
                        "schema": {"openAPIV3Schema": schema},
                        "subresources": {"status": {}},
                        "additionalPrinterColumns": _COLUMNS,
                    }
                ],
            },
        }
    )
