"""The operator's RBAC, generated from the code that needs it (the single source of truth).

Four inputs, each next to the code that uses the permission:
- ``kube.PERMISSIONS``: every API call the operator makes itself (``@_needs`` on each method);
- ``watches.WATCHED``: every resource kopf watches for us (``list`` + ``watch``);
- ``leader.PERMISSIONS``: the Lease that elects the one active operator;
- ``_KOPF_OWN`` below: what kopf itself writes for a daemon-based operator, with the reason.

Each permission is granted in the narrowest scope that works:

- *self* (a Role in the operator's namespace): the Lease and the token-key Secret, ``get`` and
  ``update`` by name (``resourceNames``). This is the only ``get`` on Secrets the operator has:
  it never reads the per-job Secrets it writes (tokens.py), nor any other Secret.
- *nodes* (cluster-scoped, read-only): Nodes carry the preemption notices.
- *node leases* (a Role in ``kube-node-lease``, ``get``): a node the ranks stopped hearing
  from is lost once its kubelet stops renewing its Lease (nodes.py), before it turns NotReady.
- *workload* (TrainingJobs, pods, Services, Secret ``create``, Events): a ClusterRole when the
  operator serves every namespace; with ``watch_namespaces``, a Role in each of them and
  nothing cluster-wide but the Node rule.

``create`` cannot be limited by name in RBAC (the name is not known at authorisation time), so
the operator may create Secrets where it serves jobs; creating a Secret reveals no other one.
``deploy/`` and the chart are generated from :func:`rbac_manifests`; the cluster tests run the
operator under it, and ``tests/operator/test_rbac_minimal.py`` compares it with a list written
by hand.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from .client import kube, leader
from .client.kube import Permission
from .pure import crd, watches
from .pure.settings import KEY_SECRET_NAME, LEASE_NAME

__all__ = [
    "CLUSTER_ROLE_NAME",
    "NODES_ROLE_NAME",
    "NODE_LEASES_ROLE_NAME",
    "SELF_ROLE_NAME",
    "node_lease_rules",
    "node_rules",
    "rbac_manifests",
    "rbac_rules",
    "required_permissions",
    "self_rules",
    "workload_rules",
]

CLUSTER_ROLE_NAME: Final = "baton-operator"
"""The workload ClusterRole (every namespace), or each namespace's workload Role."""
NODES_ROLE_NAME: Final = "baton-operator-nodes"
"""The only cluster-wide grant when the operator serves a list of namespaces."""
SELF_ROLE_NAME: Final = "baton-operator-self"
"""The Role in the operator's namespace: its Lease and its token key."""
NODE_LEASES_ROLE_NAME: Final = "baton-operator-node-leases"
"""The Role in ``kube-node-lease``: read the nodes' Leases (kube.NODE_LEASE_PERMISSIONS)."""

_KOPF_OWN: Final = frozenset(
    {
        # kopf adds and removes its finalizer on each TrainingJob (daemons require one, so
        # that a job's daemon is stopped before the job disappears) and keeps its progress
        # and diff-base in annotations (settings.py): both are patches of the main resource.
        Permission(crd.GROUP, crd.PLURAL, "patch"),
        # kopf.event()/kopf.info()/kopf.warn() post core/v1 Events.
        Permission("", "events", "create"),
    }
)

_SELF_NAMED: Final[Mapping[Permission, str]] = {
    Permission(leader.GROUP, "leases", "get"): LEASE_NAME,
    Permission(leader.GROUP, "leases", "update"): LEASE_NAME,
    Permission("", "secrets", "get"): KEY_SECRET_NAME,
}
"""Permissions used only on one named object in the operator's namespace."""
_SELF_ANY_NAME: Final = frozenset(
    {
        Permission(leader.GROUP, "leases", "create"),  # the first operator makes the Lease
        Permission("", "secrets", "create"),  # ... and the token key
    }
)
_CLUSTER_SCOPED: Final = frozenset({"nodes"})


def required_permissions() -> frozenset[Permission]:
    """Every (group, resource, verb) the operator uses, derived from the code."""
    watched = {
        Permission(w.group, w.plural, verb) for w in watches.WATCHED for verb in ("list", "watch")
    }
    return frozenset(kube.PERMISSIONS) | watched | _KOPF_OWN | leader.PERMISSIONS


def _rules(
    perms: Iterable[Permission], names: Mapping[Permission, str] | None = None
) -> list[dict[str, Any]]:
    """One rule per (group, resource, resourceName), verbs sorted, deterministic."""
    verbs: dict[tuple[str, str, str], set[str]] = defaultdict(set)
    for p in perms:
        verbs[(p.group, p.resource, (names or {}).get(p, ""))].add(p.verb)
    rules = []
    for (group, resource, name), vs in sorted(verbs.items()):
        rule: dict[str, Any] = {"apiGroups": [group], "resources": [resource]}
        if name:
            rule["resourceNames"] = [name]
        rule["verbs"] = sorted(vs)
        rules.append(rule)
    return rules


def _unclassified() -> frozenset[Permission]:
    return required_permissions() - set(_SELF_NAMED) - _SELF_ANY_NAME


def workload_rules() -> list[dict[str, Any]]:
    """Rules on namespaced resources where jobs run (a ClusterRole, or one Role each)."""
    perms = {p for p in _unclassified() if p.resource not in _CLUSTER_SCOPED}
    # Secrets: create only (the per-job token Secret); get is in self_rules, by name.
    perms.add(Permission("", "secrets", "create"))
    return _rules(perms)


def node_rules() -> list[dict[str, Any]]:
    """Rules on cluster-scoped resources: read-only Nodes."""
    return _rules(p for p in _unclassified() if p.resource in _CLUSTER_SCOPED)


def node_lease_rules() -> list[dict[str, Any]]:
    """Rules of the Role in ``kube-node-lease``: ``get`` on the nodes' Leases."""
    return _rules(kube.NODE_LEASE_PERMISSIONS)


def self_rules() -> list[dict[str, Any]]:
    """Rules of the Role in the operator's own namespace."""
    return _rules([*_SELF_NAMED, *_SELF_ANY_NAME], _SELF_NAMED)


def rbac_rules() -> list[dict[str, Any]]:
    """The cluster-wide ClusterRole's rules (an operator serving every namespace)."""
    return _rules(
        [p for p in _unclassified() if p.resource not in _CLUSTER_SCOPED]
        + [Permission("", "secrets", "create")]
        + [p for p in _unclassified() if p.resource in _CLUSTER_SCOPED]
    )


def _metadata(name: str, labels: Mapping[str, str], namespace: str | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": dict(labels)}
    if namespace is not None:
        meta["namespace"] = namespace
    return meta


def _binding(
    kind: str, name: str, role_kind: str, *, sa: Mapping[str, str], labels: Mapping[str, str],
    namespace: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": kind,
        "metadata": _metadata(name, labels, namespace),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind, "name": name},
        "subjects": [{"kind": "ServiceAccount", **sa}],
    }


def _role(
    kind: str, name: str, rules: list[dict[str, Any]], *, labels: Mapping[str, str],
    namespace: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": kind,
        "metadata": _metadata(name, labels, namespace),
        "rules": rules,
    }


def rbac_manifests(
    namespace: str, service_account: str, *, watch_namespaces: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """ServiceAccount, roles and bindings for an operator in ``namespace``.

    With ``watch_namespaces`` empty, one ClusterRole (workload and Nodes); else a Role per
    served namespace and a Node-only ClusterRole. Always a Role in ``kube-node-lease`` to read
    the nodes' Leases, and one in ``namespace`` for the operator's Lease and the token key.
    """
    labels = {"app.kubernetes.io/name": "baton-operator", "app.kubernetes.io/part-of": "baton"}
    sa = {"name": service_account, "namespace": namespace}
    docs: list[dict[str, Any]] = [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": service_account, "namespace": namespace, "labels": labels},
        },
    ]
    if not watch_namespaces:
        docs += [
            _role("ClusterRole", CLUSTER_ROLE_NAME, rbac_rules(), labels=labels),
            _binding("ClusterRoleBinding", CLUSTER_ROLE_NAME, "ClusterRole", sa=sa, labels=labels),
        ]
    else:
        docs += [
            _role("ClusterRole", NODES_ROLE_NAME, node_rules(), labels=labels),
            _binding("ClusterRoleBinding", NODES_ROLE_NAME, "ClusterRole", sa=sa, labels=labels),
        ]
        for ns in dict.fromkeys(watch_namespaces):
            docs += [
                _role("Role", CLUSTER_ROLE_NAME, workload_rules(), labels=labels, namespace=ns),
                _binding(
                    "RoleBinding", CLUSTER_ROLE_NAME, "Role", sa=sa, labels=labels, namespace=ns
                ),
            ]
    lease_ns = kube.NODE_LEASE_NAMESPACE
    docs += [
        _role("Role", NODE_LEASES_ROLE_NAME, node_lease_rules(), labels=labels, namespace=lease_ns),
        _binding(
            "RoleBinding", NODE_LEASES_ROLE_NAME, "Role", sa=sa, labels=labels, namespace=lease_ns
        ),
        _role("Role", SELF_ROLE_NAME, self_rules(), labels=labels, namespace=namespace),
        _binding("RoleBinding", SELF_ROLE_NAME, "Role", sa=sa, labels=labels, namespace=namespace),
    ]
    return docs
