"""Pod templates that Pod Security Admission's baseline or restricted profile refuses, one
field at a time, in every container kind, and templates it allows: the cases of the security
policy's tests (tests/operator/test_pod_policy.py offline, with cel-python; and
tests/operator/test_security_cluster.py at the local cluster's API server).

The fields and values are read from ``k8s.io/pod-security-admission``'s ``policy/check_*.go``
for Kubernetes 1.37; ``plain_template()`` is a plain template that every check allows, with an init
container and a native (restartable) sidecar.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from baton_operator.pure import podpolicy

__all__ = [
    "ALLOWED",
    "CONTAINER_KINDS",
    "CONTAINER_ONLY",
    "CONTEXT_FIELDS",
    "ESCALATIONS",
    "REFUSED_VOLUMES",
    "plain_template",
]

Mutation = Callable[[dict[str, Any]], None]


def plain_template() -> dict[str, Any]:
    return {
        "metadata": {"labels": {"team": "ml"}},
        "spec": {
            "serviceAccountName": "default",
            "securityContext": {"runAsUser": 1000, "fsGroup": 1000},
            "volumes": [{"name": "scratch", "emptyDir": {}}],
            "initContainers": [
                {"name": "fetch", "image": "x", "securityContext": {}},
                # A native (restartable) sidecar: an init container that keeps running.
                {"name": "side", "image": "x", "restartPolicy": "Always", "securityContext": {}},
            ],
            "containers": [
                {
                    "name": "trainer",
                    "image": "x",
                    "ports": [{"containerPort": 29500}],
                    "securityContext": {"runAsUser": 1000, "capabilities": {"drop": ["ALL"]}},
                }
            ],
        },
    }


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def apply(t: dict[str, Any]) -> None:
        node: Any = t["spec"]
        parts = path.split(".")
        for part in parts[:-1]:
            node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
        last = parts[-1]
        if last.isdigit():
            node.append(value)
        else:
            node[last] = value

    return apply


def _annotate(key: str, value: str) -> Callable[[dict[str, Any]], None]:
    def apply(t: dict[str, Any]) -> None:
        t.setdefault("metadata", {}).setdefault("annotations", {})[key] = value

    return apply


P = "spec.template.spec"
APPARMOR = "container.apparmor.security.beta.kubernetes.io/"

# Pod Security Admission's baseline and restricted checks (k8s.io/pod-security-admission,
# policy/check_*.go, Kubernetes 1.37): (security-context field, a value each profile refuses).
CONTEXT_FIELDS: dict[str, Any] = {
    "runAsUser": 0,
    "runAsNonRoot": False,
    "seccompProfile.type": "Unconfined",
    "appArmorProfile.type": "Unconfined",
    "seLinuxOptions.type": "spc_t",
    "seLinuxOptions.user": "system_u",
    "seLinuxOptions.role": "sysadm_r",
    "windowsOptions.hostProcess": True,
}
CONTAINER_ONLY: dict[str, Any] = {
    "privileged": True,
    "allowPrivilegeEscalation": True,
    "capabilities.add": ["SYS_ADMIN"],
    "capabilities.drop": ["NET_RAW"],
    "procMount": "Unmasked",
}
HOST_HANDLERS = [
    f"{probe}.{handler}"
    for probe in ("livenessProbe", "readinessProbe", "startupProbe",
                  "lifecycle.postStart", "lifecycle.preStop")
    for handler in ("httpGet", "tcpSocket")
]  # fmt: skip
CONTAINER_KINDS = {"container": "containers.0", "init": "initContainers.0",
                   "sidecar": "initContainers.1"}  # fmt: skip
# Every volume source restricted refuses (check_restrictedVolumes.go), hostPath first.
REFUSED_VOLUMES = (
    "hostPath", "gcePersistentDisk", "awsElasticBlockStore", "gitRepo", "nfs", "iscsi",
    "glusterfs", "rbd", "flexVolume", "cinder", "cephfs", "flocker", "fc", "azureFile",
    "vsphereVolume", "quobyte", "azureDisk", "photonPersistentDisk", "portworxVolume",
    "scaleIO", "storageos",
)  # fmt: skip


def _index(path: str) -> str:
    """``containers.0`` -> ``containers[0]``."""
    name, i = path.split(".")
    return f"{name}[{i}]"


def _escalations() -> dict[str, tuple[Mutation, str, str]]:
    """(what a user writes, the field the operator names, the field the CEL message names)."""
    out: dict[str, tuple[Mutation, str, str]] = {
        "hostNetwork": (_set("hostNetwork", True), f"{P}.hostNetwork", ""),
        "hostPID": (_set("hostPID", True), f"{P}.hostPID", ""),
        "hostIPC": (_set("hostIPC", True), f"{P}.hostIPC", ""),
        "nodeName": (_set("nodeName", "spot-1"), f"{P}.nodeName", ""),
        "ephemeralContainers": (
            _set("ephemeralContainers", [{"name": "debug", "image": "x"}]),
            f"{P}.ephemeralContainers", "",
        ),
        "sysctls kernel.msgmax": (
            _set("securityContext.sysctls", [{"name": "kernel.msgmax", "value": "65536"}]),
            f"{P}.securityContext.sysctls", "",
        ),
        "apparmor annotation unconfined": (
            _annotate(f"{APPARMOR}trainer", "unconfined"),
            f"spec.template.metadata.annotations[{APPARMOR}trainer]",
            f"spec.template.metadata.annotations[{APPARMOR}*]",
        ),
    }  # fmt: skip
    for field, value in CONTEXT_FIELDS.items():
        out[f"pod {field}"] = (
            _set(f"securityContext.{field}", value),
            f"{P}.securityContext.{field}",
            "",
        )
    for kind, at in CONTAINER_KINDS.items():
        where = f"{P}.{_index(at)}"
        for field, value in {**CONTEXT_FIELDS, **CONTAINER_ONLY}.items():
            out[f"{kind} {field}"] = (
                _set(f"{at}.securityContext.{field}", value),
                f"{where}.securityContext.{field}",
                "",
            )
        out[f"{kind} hostPort"] = (
            _set(f"{at}.ports", [{"containerPort": 22}, {"containerPort": 22, "hostPort": 22}]),
            f"{where}.ports[1].hostPort",
            "",
        )
        for handler in HOST_HANDLERS:
            out[f"{kind} {handler}.host"] = (
                _set(f"{at}.{handler}", {"host": "10.0.0.1", "port": 80}),
                f"{where}.{handler}.host",
                "",
            )
    for source in REFUSED_VOLUMES:
        out[f"volume {source}"] = (
            _set("volumes.1", {"name": "v", source: {}}),
            f"{P}.volumes[1].{source}",
            f"{P}.volumes[].hostPath" if source == "hostPath" else f"{P}.volumes[] source",
        )
    return out


# (what a user writes, the field both checks must name; CEL with [] for an index)
ESCALATIONS = _escalations()


ALLOWED: dict[str, Mutation] = {
    "seccomp Localhost": _set(
        "securityContext.seccompProfile", {"type": "Localhost", "localhostProfile": "p.json"}
    ),
    "seccomp RuntimeDefault": _set("containers.0.securityContext.seccompProfile.type",
                                   "RuntimeDefault"),
    "apparmor Localhost": _set("initContainers.1.securityContext.appArmorProfile",
                               {"type": "Localhost", "localhostProfile": "k8s-train"}),
    "selinux container_t": _set("securityContext.seLinuxOptions", {"type": "container_t",
                                                                    "level": "s0:c1,c2"}),
    "selinux container_engine_t": _set("containers.0.securityContext.seLinuxOptions.type",
                                       "container_engine_t"),
    "safe sysctls": _set("securityContext.sysctls", [
        {"name": n, "value": "1"} for n in podpolicy.SAFE_SYSCTLS
    ]),
    "add NET_BIND_SERVICE": _set("containers.0.securityContext.capabilities.add",
                                 ["NET_BIND_SERVICE"]),
    "drop ALL and more": _set("containers.0.securityContext.capabilities.drop",
                              ["ALL", "NET_RAW"]),
    "procMount Default": _set("containers.0.securityContext.procMount", "Default"),
    "runAsNonRoot true": _set("initContainers.0.securityContext.runAsNonRoot", True),
    "no privilege escalation": _set("containers.0.securityContext.allowPrivilegeEscalation",
                                    False),
    "every allowed volume": _set("volumes", [
        {"name": k, k: {}} for k in podpolicy.ALLOWED_VOLUME_TYPES
    ]),
    "apparmor runtime/default": _annotate(f"{APPARMOR}trainer", "runtime/default"),
    "apparmor localhost": _annotate(f"{APPARMOR}side", "localhost/k8s-train"),
    "other annotations": _annotate("example.com/anything", "unconfined"),
}  # fmt: skip
