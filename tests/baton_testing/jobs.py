"""TrainingJob manifests for the cluster tests and the demo, from one builder.

The operator's cluster tests, the install tests (Helm, kustomize) and the demo each submit
TrainingJobs. They differ in the trainer they run and the few fields a test is about; the
rest (the resource's kind and version, the trainer container, the Pod Security ``restricted``
contexts, the per-job rendezvous port) is built here, so that a field the CRD gains or a rule
the namespaces enforce changes in one place.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

__all__ = [
    "API_VERSION",
    "RESTRICTED_CONTAINER",
    "RESTRICTED_POD",
    "trainer_command",
    "trainer_env",
    "training_job",
]

REPO: Final = Path(__file__).resolve().parents[2]
API_VERSION: Final = "baton.dev/v1alpha1"

RESTRICTED_POD: Final[Mapping[str, Any]] = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "seccompProfile": {"type": "RuntimeDefault"},
}
"""The pod ``securityContext`` that Pod Security ``restricted`` admits (a numeric non-root user)."""

RESTRICTED_CONTAINER: Final[Mapping[str, Any]] = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
}
"""The trainer container's ``securityContext`` that Pod Security ``restricted`` admits."""


def trainer_command(
    out: Path, *, steps: int, every_steps: int, sleep: float, timeout: float = 30
) -> list[str]:
    """The deterministic test trainer (``baton_testing.trainer``), logging into ``out``.

    It writes its loss log to ``out/loss.log`` and its final state to ``out/result.json``.
    """
    return [
        "python",
        "-m",
        "baton_testing.trainer",
        "--steps",
        str(steps),
        "--every-steps",
        str(every_steps),
        "--sleep",
        str(sleep),
        "--loss-log",
        str(out / "loss.log"),
        "--result",
        str(out / "result.json"),
        "--timeout",
        str(timeout),
    ]


def trainer_env() -> list[dict[str, Any]]:
    """The env the test trainer needs in a pod: this checkout's packages and test helpers."""
    return [
        {"name": "PYTHONPATH", "value": f"{REPO / 'tests'}:{REPO}"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]


def training_job(
    name: str,
    namespace: str,
    *,
    command: Sequence[str],
    checkpoint: Mapping[str, Any],
    failure_policy: Mapping[str, Any],
    image: str = "baton-example:dev",
    env: Sequence[Mapping[str, Any]] = (),
    replicas: int = 2,
    master_port: int | None = None,
    restricted: bool = False,
    pod: Mapping[str, Any] | None = None,
    spec: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A ``TrainingJob`` whose pods run one container, ``trainer``, with ``command``.

    ``master_port``: pods of the local cluster share the host's network, so jobs that may run
    side by side take a free port each for their rendezvous (``spec.masterPort``).
    ``restricted``: set the pod and container security contexts that Pod Security
    ``restricted`` admits. ``pod``: more fields of the pod template's spec (``nodeSelector``,
    ``tolerations``, ``terminationGracePeriodSeconds``...). ``spec``: more fields of the job's
    spec (``minReplicas``...), which win over the ones built here.
    """
    container: dict[str, Any] = {
        "name": "trainer",
        "image": image,
        "command": list(command),
        "env": [dict(e) for e in env],
    }
    pod_spec: dict[str, Any] = copy.deepcopy(dict(pod or {}))
    if restricted:
        pod_spec["securityContext"] = copy.deepcopy(dict(RESTRICTED_POD))
        container["securityContext"] = copy.deepcopy(dict(RESTRICTED_CONTAINER))
    pod_spec["containers"] = [container]
    job_spec: dict[str, Any] = {
        "replicas": replicas,
        "template": {"spec": pod_spec},
        "checkpoint": dict(checkpoint),
        "failurePolicy": dict(failure_policy),
    }
    if master_port is not None:
        job_spec["masterPort"] = master_port
    job_spec.update(copy.deepcopy(dict(spec or {})))
    return {
        "apiVersion": API_VERSION,
        "kind": "TrainingJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": job_spec,
    }
