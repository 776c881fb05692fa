"""What a TrainingJob's pod template may ask for: the operator is not a way around Pod Security.

The operator creates pods with its own identity, so anything a TrainingJob's author writes into
``spec.template`` runs with the operator's right to create pods, not the author's. A namespace
without Pod Security enforcement would then turn "may create TrainingJobs" into "may run a
privileged pod on any node". This module is the policy that prevents it: a pure function from
the template to the list of fields it refuses. The controller fails a job whose template has
any (a ``Failed`` condition naming each field, and an Event); the CRD's CEL rules (crd.py)
refuse the same fields at admission where the schema can express them, so most users see the
refusal at ``kubectl apply`` and this check is the backstop (an old CRD, a CEL-less server).

Refused, always (docs/operator.md, "Security policy"):

- ``hostNetwork``, ``hostPID``, ``hostIPC``: the node's namespaces;
- a ``hostPath`` volume: the node's filesystem;
- ``nodeName``: bypasses the scheduler, and so the operator's avoidance of noticed nodes;
- a container's ``privileged``, ``capabilities.add``, or a ``hostPort``;
- ``runAsUser: 0`` in the pod's or a container's security context;
- a ``serviceAccountName`` (or the deprecated ``serviceAccount``) outside
  :attr:`PodPolicy.allowed_service_accounts`: the pod would act with that account's rights.

Nothing is stripped silently: a template that asks for a privilege gets a clear "no", not a pod
that behaves differently from what its author wrote.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

__all__ = [
    "DEFAULT_SERVICE_ACCOUNTS",
    "PodPolicy",
    "Refusal",
    "forbid_in_schema",
    "refusals",
    "summary",
]

DEFAULT_SERVICE_ACCOUNTS: Final = ("default",)
"""A namespace's ``default`` account: what a pod gets when the template names none."""

_PREFIX: Final = "spec.template.spec"
_CONTAINER_LISTS: Final = ("initContainers", "containers", "ephemeralContainers")


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


def _is_true(value: object) -> bool:
    return value is True


def _security_context(ctx: object, path: str, *, container: bool) -> list[Refusal]:
    if not isinstance(ctx, Mapping):
        return []
    out: list[Refusal] = []
    if ctx.get("runAsUser") == 0:
        out.append(Refusal(f"{path}.runAsUser", "runs as root; use a non-zero user id"))
    if not container:
        return out
    if _is_true(ctx.get("privileged")):
        out.append(Refusal(f"{path}.privileged", "a privileged container owns the node"))
    caps = ctx.get("capabilities")
    if isinstance(caps, Mapping) and caps.get("add"):
        out.append(Refusal(f"{path}.capabilities.add", "added capabilities; every one is dropped"))
    return out


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
    return out


def refusals(template: Mapping[str, Any], policy: PodPolicy) -> list[Refusal]:
    """Every field of a TrainingJob's ``spec.template`` that the policy refuses, in field order.

    An empty list means the template may be run.
    """
    spec = template.get("spec")
    if not isinstance(spec, Mapping):
        return []
    out: list[Refusal] = []
    for key, why in (
        ("hostNetwork", "shares the node's network namespace"),
        ("hostPID", "shares the node's process namespace"),
        ("hostIPC", "shares the node's IPC namespace"),
    ):
        if _is_true(spec.get(key)):
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
    for i, volume in enumerate(spec.get("volumes") or []):
        if isinstance(volume, Mapping) and "hostPath" in volume:
            out.append(
                Refusal(
                    f"{_PREFIX}.volumes[{i}].hostPath",
                    "mounts the node's filesystem; use an emptyDir or a PVC",
                )
            )
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
_MAX_CAPABILITIES: Final = 64


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


def _container_rules(container: dict[str, Any], where: str) -> None:
    # Declared so that CEL can see them; the rules sit on the container, one per field.
    _declare(
        container,
        "securityContext",
        _obj(
            "core/v1 SecurityContext; the operator adds Pod Security restricted's settings.",
            privileged={"type": "boolean", "description": "Refused when true."},
            runAsUser={"type": "integer", "format": "int64", "description": "Refused when 0."},
            capabilities=_obj(
                "Every capability is dropped; none may be added.",
                add={
                    "type": "array",
                    "description": "Refused when not empty.",
                    "maxItems": _MAX_CAPABILITIES,
                    "items": {"type": "string"},
                },
            ),
        ),
    )
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
    container.setdefault("x-kubernetes-validations", []).extend(
        [
            _rule(
                "!has(self.securityContext) || !has(self.securityContext.privileged) || "
                "!self.securityContext.privileged",
                f"{where}.securityContext.privileged", "a privileged container owns the node",
                ".securityContext.privileged",
            ),
            _rule(
                "!has(self.securityContext) || !has(self.securityContext.capabilities) || "
                "!has(self.securityContext.capabilities.add) || "
                "size(self.securityContext.capabilities.add) == 0",
                f"{where}.securityContext.capabilities.add", "every capability is dropped",
                ".securityContext.capabilities.add",
            ),
            _rule(
                "!has(self.securityContext) || !has(self.securityContext.runAsUser) || "
                "self.securityContext.runAsUser != 0",
                f"{where}.securityContext.runAsUser", "0 runs as root; use a non-zero user id",
                ".securityContext.runAsUser",
            ),
            _rule(
                "!has(self.ports) || self.ports.all(p, !has(p.hostPort) || p.hostPort == 0)",
                f"{where}.ports[].hostPort", "it binds a port on the node itself", ".ports",
            ),
        ]
    )  # fmt: skip


def forbid_in_schema(template: dict[str, Any]) -> None:
    """Add CEL rules to the CRD's ``spec.template`` schema that refuse, at admission, what
    :func:`refusals` refuses and a schema can express (everything but the ServiceAccount
    allow-list, which is the operator's configuration). Called by crd.py."""
    spec = template["properties"]["spec"]
    p = "spec.template.spec"
    for name in ("hostNetwork", "hostPID", "hostIPC"):
        _declare(spec, name, {"type": "boolean", "description": "Refused when true."})
    _declare(spec, "nodeName", {"type": "string", "description": "Refused: use a nodeSelector."})
    _declare(
        spec,
        "securityContext",
        _obj(
            "core/v1 PodSecurityContext; the operator adds Pod Security restricted's settings.",
            runAsUser={"type": "integer", "format": "int64", "description": "Refused when 0."},
        ),
    )
    _declare(
        spec,
        "volumes",
        {
            "type": "array",
            "description": "core/v1 Volume list; a hostPath volume is refused.",
            "maxItems": _MAX_VOLUMES,
            "items": _obj(
                "core/v1 Volume.",
                hostPath=_obj("Refused: use an emptyDir or a PVC."),
            ),
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
    spec.setdefault("x-kubernetes-validations", []).extend(
        [
            _rule("!has(self.hostNetwork) || !self.hostNetwork", f"{p}.hostNetwork",
                  "it shares the node's network namespace", ".hostNetwork"),
            _rule("!has(self.hostPID) || !self.hostPID", f"{p}.hostPID",
                  "it shares the node's process namespace", ".hostPID"),
            _rule("!has(self.hostIPC) || !self.hostIPC", f"{p}.hostIPC",
                  "it shares the node's IPC namespace", ".hostIPC"),
            _rule("!has(self.nodeName) || self.nodeName == ''", f"{p}.nodeName",
                  "it bypasses the scheduler and the operator's node avoidance; use a "
                  "nodeSelector", ".nodeName"),
            _rule("!has(self.securityContext) || !has(self.securityContext.runAsUser) || "
                  "self.securityContext.runAsUser != 0", f"{p}.securityContext.runAsUser",
                  "0 runs as root; use a non-zero user id", ".securityContext.runAsUser"),
            _rule("!has(self.volumes) || self.volumes.all(v, !has(v.hostPath))",
                  f"{p}.volumes[].hostPath", "it mounts the node's filesystem; use an "
                  "emptyDir or a PVC", ".volumes"),
        ]
    )  # fmt: skip
