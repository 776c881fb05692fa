"""Checks a pod spec against the Pod Security Standards' ``restricted`` profile, offline.

The API server enforces the profile only in a namespace labelled for it, and only on a live
cluster; the chart tests render manifests without one, and the operator's pure builders produce
pod specs without one. This applies the profile's rules (Kubernetes "Pod Security Standards",
restricted, latest) to a spec dict and lists every violation, so a test can assert an empty
list and show all problems at once. It also requires a read-only root filesystem, which Baton's
own components promise on top of the profile.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["ALLOWED_VOLUME_TYPES", "pod_specs", "restricted_violations"]

# Volume types the restricted profile allows.
ALLOWED_VOLUME_TYPES = frozenset(
    {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
)

_POD_TEMPLATE_KINDS = frozenset(
    {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job", "ReplicationController"}
)


def pod_specs(manifest: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """The pod specs inside a manifest (a Pod, a workload's template, a CronJob's), named."""
    kind = manifest.get("kind")
    name = f"{kind}/{manifest.get('metadata', {}).get('name')}"
    if kind == "Pod":
        return [(name, manifest["spec"])]
    if kind in _POD_TEMPLATE_KINDS:
        return [(name, manifest["spec"]["template"]["spec"])]
    if kind == "CronJob":
        return [(name, manifest["spec"]["jobTemplate"]["spec"]["template"]["spec"])]
    return []


def restricted_violations(spec: Mapping[str, Any], *, read_only_root: bool = True) -> list[str]:
    """Every way ``spec`` breaks Pod Security ``restricted`` (empty when it meets it)."""
    problems: list[str] = []
    pod_sc: Mapping[str, Any] = spec.get("securityContext") or {}
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            problems.append(f"spec.{field} must be false")
    for volume in spec.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= ALLOWED_VOLUME_TYPES:
            problems.append(f"volume {volume.get('name')!r} uses {sorted(kinds)}")
    if pod_sc.get("runAsUser") == 0:
        problems.append("spec.securityContext.runAsUser must not be 0")
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type")
    if pod_seccomp not in (None, "RuntimeDefault", "Localhost"):
        problems.append(f"spec.securityContext.seccompProfile.type is {pod_seccomp}")
    for sysctl in pod_sc.get("sysctls") or []:
        problems.append(f"sysctl {sysctl.get('name')} is not allowed")
    containers = [
        (f"{group}[{c.get('name')}]", c)
        for group in ("initContainers", "containers", "ephemeralContainers")
        for c in spec.get(group) or []
    ]
    if not containers:
        problems.append("the pod has no containers")
    for where, container in containers:
        sc: Mapping[str, Any] = container.get("securityContext") or {}
        if sc.get("privileged"):
            problems.append(f"{where}: privileged must be false")
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{where}: allowPrivilegeEscalation must be set to false")
        caps: Mapping[str, Any] = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            problems.append(f"{where}: capabilities.drop must include ALL")
        extra = set(caps.get("add") or []) - {"NET_BIND_SERVICE"}
        if extra:
            problems.append(f"{where}: capabilities.add {sorted(extra)} is not allowed")
        non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
        if non_root is not True:
            problems.append(f"{where}: runAsNonRoot must be true (pod or container)")
        if sc.get("runAsUser") == 0:
            problems.append(f"{where}: runAsUser must not be 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type", pod_seccomp)
        if seccomp not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{where}: seccompProfile must be RuntimeDefault or Localhost")
        if any(p.get("hostPort") for p in container.get("ports") or []):
            problems.append(f"{where}: hostPort is not allowed")
        if read_only_root and sc.get("readOnlyRootFilesystem") is not True:
            problems.append(f"{where}: readOnlyRootFilesystem must be true")
    return problems
