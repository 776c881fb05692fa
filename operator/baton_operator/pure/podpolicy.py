"""What a TrainingJob's pod template may ask for: the operator is not a way around Pod Security.

The operator creates pods with its own identity, so anything a TrainingJob's author writes into
``spec.template`` runs with the operator's right to create pods, not the author's. A namespace
without Pod Security enforcement would then turn "may create TrainingJobs" into "may run a
privileged pod on any node". This module is the policy that prevents it: a pure function from
the template to the list of fields it refuses. The controller fails a job whose template has
any (a ``Failed`` condition naming each field, and an Event); the CRD's CEL rules (crd.py)
refuse the same fields at admission, so users see the refusal at ``kubectl apply`` and this
check is the backstop (an old CRD, a CEL-less server) and the only judge of the
ServiceAccount allow-list (the operator's configuration).

The list is Pod Security Admission's ``baseline`` and ``restricted`` checks, read from
``k8s.io/pod-security-admission``'s ``policy/check_*.go`` for Kubernetes 1.37 (the local
cluster's version), in every container kind (``containers``, ``initContainers``, restartable
sidecars among them; ``ephemeralContainers`` are refused outright: a template has no use for
them), plus Baton's own ``nodeName`` and ServiceAccount rules (docs/operator.md, "Security
policy", has the table). A field is refused with its path and the fix, never rewritten: the
operator only fills in restricted's settings where the template leaves them unset
(manifests.py), and a value that contradicts them (``allowPrivilegeEscalation: true``,
``runAsNonRoot: false``, a seccomp profile ``Unconfined``) is refused.

Why one module of this size: each check is written twice, as Python (:func:`refusals`) and as
CEL (:func:`forbid_in_schema`), side by side in one table (:data:`_CONTEXT_CHECKS`), so that
the two halves cannot drift apart.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

__all__ = [
    "ALLOWED_VOLUME_TYPES",
    "DEFAULT_SERVICE_ACCOUNTS",
    "SAFE_SYSCTLS",
    "PodPolicy",
    "Refusal",
    "forbid_in_schema",
    "refusals",
    "summary",
]

DEFAULT_SERVICE_ACCOUNTS: Final = ("default",)
"""A namespace's ``default`` account: what a pod gets when the template names none."""

SAFE_SYSCTLS: Final = (
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
    "net.ipv4.tcp_rmem",
    "net.ipv4.tcp_wmem",
    "net.ipv4.tcp_slow_start_after_idle",
    "net.ipv4.tcp_notsent_lowat",
)
"""The sysctls ``baseline`` allows at 1.37 (``check_sysctls.go``): namespaced and harmless."""

ALLOWED_VOLUME_TYPES: Final = (
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "image",
    "persistentVolumeClaim",
    "projected",
    "secret",
)
"""The volume sources ``restricted`` allows (``check_restrictedVolumes.go``)."""

_PROFILE_TYPES: Final = ("RuntimeDefault", "Localhost")
"""Seccomp and AppArmor profile types ``baseline``/``restricted`` allow (not Unconfined)."""
_SELINUX_TYPES: Final = (
    "", "container_t", "container_init_t", "container_kvm_t", "container_engine_t",
)  # fmt: skip
_APPARMOR_ANNOTATION: Final = "container.apparmor.security.beta.kubernetes.io/"
_ADDABLE_CAPABILITIES: Final = ("NET_BIND_SERVICE",)
_PREFIX: Final = "spec.template.spec"
_CONTAINER_LISTS: Final = ("initContainers", "containers")
_PROBES: Final = ("livenessProbe", "readinessProbe", "startupProbe")
_LIFECYCLE: Final = ("postStart", "preStop")


@dataclass(frozen=True, kw_only=True)
class PodPolicy:
    """The configurable part of the policy (``--allow-service-account``)."""

    allowed_service_accounts: tuple[str, ...] = DEFAULT_SERVICE_ACCOUNTS
    """ServiceAccounts a template may name. Any other would let a TrainingJob author run code
    as an account they may not hold (its token is mounted when the template asks for it)."""

    def __post_init__(self) -> None:
        if any(not isinstance(n, str) or not n for n in self.allowed_service_accounts):
            raise ValueError(
                "allowed_service_accounts holds ServiceAccount names: drop the empty entry"
            )


@dataclass(frozen=True)
class Refusal:
    """One refused field: its path in the TrainingJob and why it is refused."""

    field: str
    why: str

    def __str__(self) -> str:
        return f"{self.field} ({self.why})"


def _quoted(values: Sequence[str]) -> str:
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"


def _names(values: Sequence[str]) -> str:
    shown = [v or '""' for v in values]
    return ", ".join(shown[:-1]) + " or " + shown[-1]


def _strings(value: object) -> list[str]:
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


@dataclass(frozen=True)
class _Check:
    """One field of a security context: when Python refuses it, the same test in CEL, and why.

    ``path`` is below the security context (``seLinuxOptions.type``); ``bad`` judges a present
    value; ``cel`` is true for an allowed value, with ``{v}`` standing for it; ``leaf`` is the
    schema that declares the field to CEL.
    """

    path: str
    bad: Callable[[object], bool]
    cel: str
    leaf: dict[str, Any]
    why: str
    container_only: bool = False
    pod_only: bool = False


_BOOL: Final = {"type": "boolean"}
_STR: Final = {"type": "string", "maxLength": 253}
_INT: Final = {"type": "integer", "format": "int64"}
_STR_LIST: Final = {"type": "array", "maxItems": 64, "items": {"type": "string", "maxLength": 64}}

_CONTEXT_CHECKS: Final = (
    _Check("runAsUser", lambda v: v == 0, "{v} != 0", _INT,
           "0 runs as root; use a non-zero user id"),
    _Check("runAsNonRoot", lambda v: v is False, "{v}", _BOOL,
           "false lets the container run as root; remove it (the operator sets true)"),
    _Check("seccompProfile.type", lambda v: v not in _PROFILE_TYPES,
           f"{{v}} in {_quoted(_PROFILE_TYPES)}", _STR,
           "only RuntimeDefault or Localhost (Unconfined turns the syscall filter off); remove "
           "it (the operator sets RuntimeDefault)"),
    _Check("appArmorProfile.type", lambda v: v not in _PROFILE_TYPES,
           f"{{v}} in {_quoted(_PROFILE_TYPES)}", _STR,
           "only RuntimeDefault or Localhost (Unconfined turns AppArmor off); remove it"),
    _Check("seLinuxOptions.type", lambda v: v not in _SELINUX_TYPES,
           f"{{v}} in {_quoted(_SELINUX_TYPES)}", _STR,
           f"only {_names(_SELINUX_TYPES[1:])} (spc_t and other types leave the container's "
           "confinement); remove it"),
    _Check("seLinuxOptions.user", lambda v: v != "", "{v} == ''", _STR,
           "a custom SELinux user is forbidden; remove it"),
    _Check("seLinuxOptions.role", lambda v: v != "", "{v} == ''", _STR,
           "a custom SELinux role is forbidden; remove it"),
    _Check("windowsOptions.hostProcess", lambda v: v is True, "!{v}", _BOOL,
           "a Windows host process owns the node; remove it"),
    _Check("privileged", lambda v: v is True, "!{v}", _BOOL,
           "a privileged container owns the node; remove it", container_only=True),
    _Check("allowPrivilegeEscalation", lambda v: v is True, "!{v}", _BOOL,
           "true lets a process gain privileges (setuid); remove it (the operator sets false)",
           container_only=True),
    _Check("capabilities.add",
           lambda v: any(c not in _ADDABLE_CAPABILITIES for c in _strings(v)),
           f"{{v}}.all(c, c in {_quoted(_ADDABLE_CAPABILITIES)})", _STR_LIST,
           "every capability is dropped; only NET_BIND_SERVICE may be added back",
           container_only=True),
    _Check("capabilities.drop", lambda v: isinstance(v, list) and "ALL" not in v,
           "'ALL' in {v}", _STR_LIST,
           "must include ALL; remove it (the operator drops ALL)", container_only=True),
    _Check("procMount", lambda v: v not in ("Default", None), "{v} == 'Default'", _STR,
           "only Default (Unmasked shows the node's /proc); remove it", container_only=True),
    _Check("sysctls",
           lambda v: isinstance(v, list) and any(
               not isinstance(s, Mapping) or s.get("name") not in SAFE_SYSCTLS for s in v
           ),
           f"{{v}}.all(s, has(s.name) && s.name in {_quoted(SAFE_SYSCTLS)})",
           {"type": "array", "maxItems": 64, "items": {
               "type": "object", "x-kubernetes-preserve-unknown-fields": True,
               "properties": {"name": {**_STR, "description": "The sysctl."}}}},
           f"only the safe sysctls ({', '.join(SAFE_SYSCTLS)}) are namespaced and harmless; "
           "remove the others", pod_only=True),
)  # fmt: skip

_MISSING: Final = object()


def _get(node: object, path: str) -> object:
    """The value at a dotted ``path`` below ``node``; :data:`_MISSING` when absent or null."""
    for part in path.split("."):
        if not isinstance(node, Mapping) or node.get(part) is None:
            return _MISSING
        node = node[part]
    return node


def _security_context(ctx: object, path: str, *, container: bool) -> list[Refusal]:
    if not isinstance(ctx, Mapping):
        return []
    out: list[Refusal] = []
    for check in _CONTEXT_CHECKS:
        if (check.container_only and not container) or (check.pod_only and container):
            continue
        value = _get(ctx, check.path)
        if value is not _MISSING and check.bad(value):
            out.append(Refusal(f"{path}.{check.path}", check.why))
    return out


def _host_fields() -> list[str]:
    """Paths below a container whose ``host`` would point a probe or hook past the pod."""
    handlers = ("httpGet", "tcpSocket")
    probes = [f"{p}.{h}" for p in _PROBES for h in handlers]
    return probes + [f"lifecycle.{e}.{h}" for e in _LIFECYCLE for h in handlers]


_HOST_WHY: Final = (
    "a probe or hook on another host reaches past the pod; remove host (the pod's IP is used)"
)


def _containers(spec: Mapping[str, Any]) -> list[Refusal]:
    out: list[Refusal] = []
    for key in _CONTAINER_LISTS:
        items = spec.get(key)
        if not isinstance(items, Sequence):
            continue
        for i, c in enumerate(items):
            if not isinstance(c, Mapping):
                continue
            path = f"{_PREFIX}.{key}[{i}]"
            out.extend(
                _security_context(
                    c.get("securityContext"), f"{path}.securityContext", container=True
                )
            )
            for j, port in enumerate(c.get("ports") or []):
                if isinstance(port, Mapping) and port.get("hostPort"):
                    out.append(
                        Refusal(f"{path}.ports[{j}].hostPort", "binds a port on the node itself")
                    )
            for handler in _host_fields():
                if _get(c, f"{handler}.host") not in (_MISSING, ""):
                    out.append(Refusal(f"{path}.{handler}.host", _HOST_WHY))
    if spec.get("ephemeralContainers"):
        out.append(
            Refusal(
                f"{_PREFIX}.ephemeralContainers",
                "debug containers are added to a running pod (kubectl debug), never in a "
                "template; remove them",
            )
        )
    return out


def _volumes(spec: Mapping[str, Any]) -> list[Refusal]:
    out: list[Refusal] = []
    for i, volume in enumerate(spec.get("volumes") or []):
        if not isinstance(volume, Mapping):
            continue
        if "hostPath" in volume:
            out.append(
                Refusal(
                    f"{_PREFIX}.volumes[{i}].hostPath",
                    "mounts the node's filesystem; use an emptyDir or a PVC",
                )
            )
        elif not any(k in volume for k in ALLOWED_VOLUME_TYPES):
            source = next((k for k in volume if k != "name"), "")
            out.append(Refusal(f"{_PREFIX}.volumes[{i}].{source}".rstrip("."), _VOLUME_WHY))
    return out


_VOLUME_WHY: Final = (
    f"only {_names(ALLOWED_VOLUME_TYPES)} volumes are allowed (Pod Security restricted); "
    "use a persistentVolumeClaim or a csi volume"
)


_APPARMOR_WHY: Final = (
    "only runtime/default or localhost/<profile> (unconfined turns AppArmor off); remove it"
)


def _apparmor_annotations(template: Mapping[str, Any]) -> list[Refusal]:
    annotations = (template.get("metadata") or {}).get("annotations") or {}
    out: list[Refusal] = []
    for key, value in annotations.items():
        if not str(key).startswith(_APPARMOR_ANNOTATION):
            continue
        if value == "runtime/default" or str(value).startswith("localhost/"):
            continue
        out.append(
            Refusal(
                f"spec.template.metadata.annotations[{key}]",
                _APPARMOR_WHY,
            )
        )
    return out


def refusals(template: Mapping[str, Any], policy: PodPolicy) -> list[Refusal]:
    """Every field of a TrainingJob's ``spec.template`` that the policy refuses, in field order.

    An empty list means the template may be run.
    """
    out = _apparmor_annotations(template)
    spec = template.get("spec")
    if not isinstance(spec, Mapping):
        return out
    for key, why in (
        ("hostNetwork", "shares the node's network namespace"),
        ("hostPID", "shares the node's process namespace"),
        ("hostIPC", "shares the node's IPC namespace"),
    ):
        if spec.get(key) is True:
            out.append(Refusal(f"{_PREFIX}.{key}", why))
    if spec.get("nodeName"):
        out.append(
            Refusal(
                f"{_PREFIX}.nodeName",
                "bypasses the scheduler and the operator's node avoidance; use a nodeSelector",
            )
        )
    for key in ("serviceAccountName", "serviceAccount"):
        account = spec.get(key)
        if account and account not in policy.allowed_service_accounts:
            allowed = ", ".join(policy.allowed_service_accounts) or "none"
            out.append(
                Refusal(
                    f"{_PREFIX}.{key}",
                    f"ServiceAccount {account!r} is not allowed (allowed: {allowed}; the "
                    "operator's --allow-service-account adds one)",
                )
            )
    out.extend(
        _security_context(
            spec.get("securityContext"), f"{_PREFIX}.securityContext", container=False
        )
    )
    out.extend(_volumes(spec))
    out.extend(_containers(spec))
    return out


def summary(found: Sequence[Refusal]) -> str:
    """One message for a status condition and an Event: every field, and the fix."""
    fields = "; ".join(str(r) for r in found)
    return (
        f"the pod template asks for privileges the operator does not grant: {fields}. "
        "Remove these fields and re-create the TrainingJob (docs/operator.md, Security policy)"
    )


# ----------------------------------------------------------------- the same policy in CEL

_MAX_VOLUMES: Final = 256
_MAX_PORTS: Final = 64
_MAX_EPHEMERAL: Final = 64


def _rule(rule: str, field: str, why: str, path: str) -> dict[str, Any]:
    return {
        "rule": rule,
        "message": f"{field} is not allowed: {why} (docs/operator.md, Security policy)",
        "fieldPath": path,
        "reason": "FieldValueForbidden",
    }


def _declare(node: dict[str, Any], name: str, schema: dict[str, Any]) -> dict[str, Any]:
    """Declare ``name`` under ``node`` (CEL sees only declared fields) and return it."""
    props = node.setdefault("properties", {})
    found: dict[str, Any] = props.setdefault(name, schema)
    return found


def _obj(description: str, **props: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "description": description,
        "x-kubernetes-preserve-unknown-fields": True,
        **({"properties": props} if props else {}),
    }


def _declare_path(node: dict[str, Any], path: str, leaf: dict[str, Any], why: str) -> None:
    """Declare every object on ``path`` below ``node`` and the leaf (described by ``why``)."""
    *parents, last = path.split(".")
    for part in parents:
        node = _declare(node, part, _obj(f"core/v1 {part}; see its fields."))
    _declare(node, last, {**copy.deepcopy(leaf), "description": f"Refused unless: {why}"})


def _guarded(base: str, path: str, allowed: str) -> str:
    """CEL: true when ``base.path`` is absent, or present and ``allowed``."""
    parts = path.split(".")
    guards = [f"!has({base}.{'.'.join(parts[: i + 1])})" for i in range(len(parts))]
    return " || ".join([*guards, allowed.format(v=f"{base}.{path}")])


def _context_rules(node: dict[str, Any], where: str, *, container: bool) -> list[dict[str, Any]]:
    """Declare a security context's checked fields under ``node`` and return their rules."""
    ctx = _declare(
        node,
        "securityContext",
        _obj(
            "core/v1 SecurityContext; the operator fills in Pod Security restricted's settings "
            "where it is unset."
        ),
    )
    rules = []
    for check in _CONTEXT_CHECKS:
        if (check.container_only and not container) or (check.pod_only and container):
            continue
        _declare_path(ctx, check.path, check.leaf, check.why)
        path = f"securityContext.{check.path}"
        rules.append(
            _rule(_guarded("self", path, check.cel), f"{where}.{path}", check.why, f".{path}")
        )
    return rules


def _container_rules(container: dict[str, Any], where: str) -> None:
    rules = _context_rules(container, where, container=True)
    _declare(
        container,
        "ports",
        {
            "type": "array",
            "description": "core/v1 ContainerPort list; a hostPort is refused.",
            "maxItems": _MAX_PORTS,
            "items": _obj(
                "core/v1 ContainerPort.",
                hostPort={"type": "integer", "format": "int32", "description": "Refused."},
            ),
        },
    )
    rules.append(
        _rule(
            "!has(self.ports) || self.ports.all(p, !has(p.hostPort) || p.hostPort == 0)",
            f"{where}.ports[].hostPort", "it binds a port on the node itself", ".ports",
        )
    )  # fmt: skip
    for handler in _host_fields():
        path = f"{handler}.host"
        _declare_path(container, path, _STR, _HOST_WHY)
        rules.append(
            _rule(_guarded("self", path, "{v} == ''"), f"{where}.{path}", _HOST_WHY, f".{path}")
        )
    container.setdefault("x-kubernetes-validations", []).extend(rules)


def forbid_in_schema(template: dict[str, Any]) -> None:
    """Add CEL rules to the CRD's ``spec.template`` schema that refuse, at admission, what
    :func:`refusals` refuses (everything but the ServiceAccount allow-list, which is the
    operator's configuration). Called by crd.py."""
    spec = template["properties"]["spec"]
    p = "spec.template.spec"
    for name in ("hostNetwork", "hostPID", "hostIPC"):
        _declare(spec, name, {"type": "boolean", "description": "Refused when true."})
    _declare(spec, "nodeName", {"type": "string", "description": "Refused: use a nodeSelector."})
    volume_sources = {k: _obj("An allowed volume source.") for k in ALLOWED_VOLUME_TYPES}
    _declare(
        spec,
        "volumes",
        {
            "type": "array",
            "description": f"core/v1 Volume list; only {_names(ALLOWED_VOLUME_TYPES)} volumes.",
            "maxItems": _MAX_VOLUMES,
            "items": _obj(
                "core/v1 Volume.",
                hostPath=_obj("Refused: use an emptyDir or a PVC."),
                **volume_sources,
            ),
        },
    )
    _declare(
        spec,
        "ephemeralContainers",
        {
            "type": "array",
            "description": "Refused: debug containers are added to running pods only.",
            "maxItems": _MAX_EPHEMERAL,
            "items": _obj("core/v1 EphemeralContainer."),
        },
    )
    containers = spec["properties"]["containers"]
    init = _declare(
        spec,
        "initContainers",
        {
            "type": "array",
            "description": "The pod's init containers (the operator adds its sidecar first).",
            "maxItems": containers.get("maxItems", 64),
            "items": copy.deepcopy(containers["items"]),
        },
    )
    _container_rules(containers["items"], f"{p}.containers[]")
    _container_rules(init["items"], f"{p}.initContainers[]")
    allowed_volume = " || ".join(f"has(v.{k})" for k in ("hostPath", *ALLOWED_VOLUME_TYPES))
    rules = [
        _rule("!has(self.hostNetwork) || !self.hostNetwork", f"{p}.hostNetwork",
              "it shares the node's network namespace", ".hostNetwork"),
        _rule("!has(self.hostPID) || !self.hostPID", f"{p}.hostPID",
              "it shares the node's process namespace", ".hostPID"),
        _rule("!has(self.hostIPC) || !self.hostIPC", f"{p}.hostIPC",
              "it shares the node's IPC namespace", ".hostIPC"),
        _rule("!has(self.nodeName) || self.nodeName == ''", f"{p}.nodeName",
              "it bypasses the scheduler and the operator's node avoidance; use a "
              "nodeSelector", ".nodeName"),
        _rule("!has(self.volumes) || self.volumes.all(v, !has(v.hostPath))",
              f"{p}.volumes[].hostPath", "it mounts the node's filesystem; use an "
              "emptyDir or a PVC", ".volumes"),
        # hostPath has its own rule (and message) above.
        _rule(f"!has(self.volumes) || self.volumes.all(v, {allowed_volume})",
              f"{p}.volumes[] source", _VOLUME_WHY, ".volumes"),
        _rule("!has(self.ephemeralContainers) || size(self.ephemeralContainers) == 0",
              f"{p}.ephemeralContainers", "debug containers are added to a running pod "
              "(kubectl debug), never in a template; remove them", ".ephemeralContainers"),
        *_context_rules(spec, p, container=False),
    ]  # fmt: skip
    spec.setdefault("x-kubernetes-validations", []).extend(rules)
    meta = template["properties"]["metadata"]
    _declare(
        meta,
        "annotations",
        {
            "type": "object",
            "description": (
                "Copied onto every pod; an AppArmor annotation "
                f"({_APPARMOR_ANNOTATION}<container>) only runtime/default or localhost/*."
            ),
            "additionalProperties": {"type": "string"},
        },
    )
    template.setdefault("x-kubernetes-validations", []).append(
        _rule(
            "!has(self.metadata) || !has(self.metadata.annotations) || "
            f"self.metadata.annotations.all(k, !k.startsWith('{_APPARMOR_ANNOTATION}') || "
            "self.metadata.annotations[k] == 'runtime/default' || "
            "self.metadata.annotations[k].startsWith('localhost/'))",
            f"spec.template.metadata.annotations[{_APPARMOR_ANNOTATION}*]",
            _APPARMOR_WHY,
            ".metadata.annotations",
        )
    )
