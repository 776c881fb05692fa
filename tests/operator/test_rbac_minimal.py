"""RBAC is minimal: compared with lists written by hand here, not with the registry it is built
from. A new verb must be added both in the code (``@_needs``) and here, on purpose."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

from baton_operator import rbac
from baton_operator.client import kube
from baton_operator.client.kube import Kube

# What the operator may do where it runs jobs (a ClusterRole, or a Role per namespace).
WORKLOAD = [
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    # patch: the disruption hints (annotations) while a save is in flight (disruption.py).
    {"apiGroups": [""], "resources": ["pods"],
     "verbs": ["create", "delete", "list", "patch", "watch"]},
    # create only: the operator never reads a job's Secret back (tokens.py).
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
    # get, delete: a Failed job's headless Service, only when the job owns it (creating.py).
    {"apiGroups": [""], "resources": ["services"], "verbs": ["create", "delete", "get"]},
    {"apiGroups": ["baton.dev"], "resources": ["trainingjobs"],
     "verbs": ["get", "list", "patch", "watch"]},
    {"apiGroups": ["baton.dev"], "resources": ["trainingjobs/status"], "verbs": ["patch"]},
    # Gang scheduling: an attempt's PodGroup is created with its pods and deleted with them
    # (creating.py); never read, listed or watched (discovery needs no rule).
    {"apiGroups": ["scheduling.k8s.io"], "resources": ["podgroups"],
     "verbs": ["create", "delete"]},
]  # fmt: skip
NODES = [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["list", "watch"]}]
# kube-node-lease: the nodes' Leases, read only (a node the ranks stopped hearing from is lost
# once its kubelet stops renewing it: suspecting.py).
NODE_LEASES = [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get"]}]
# The operator's own namespace: the Lease and the token key, by name.
SELF = [
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
    {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["baton-operator-token-key"],
     "verbs": ["get"]},
    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
     "resourceNames": ["baton-operator"], "verbs": ["get", "update"]},
]  # fmt: skip


def _key(rule: dict[str, Any]) -> tuple[str, ...]:
    return (
        rule["apiGroups"][0],
        rule["resources"][0],
        ",".join(rule.get("resourceNames", [])),
        ",".join(rule["verbs"]),
    )


def _same(rules: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    assert sorted(map(_key, rules)) == sorted(map(_key, expected))


def test_workload_node_and_self_rules_are_the_hand_written_lists() -> None:
    _same(rbac.workload_rules(), WORKLOAD)
    _same(rbac.node_rules(), NODES)
    _same(rbac.self_rules(), SELF)
    _same(rbac.node_lease_rules(), NODE_LEASES)
    _same(rbac.rbac_rules(), WORKLOAD + NODES)


def test_all_namespaces_install_has_one_cluster_role_and_the_self_role() -> None:
    docs = rbac.rbac_manifests("baton-system", "baton-operator")
    assert [(d["kind"], d["metadata"]["name"], d["metadata"].get("namespace")) for d in docs] == [
        ("ServiceAccount", "baton-operator", "baton-system"),
        ("ClusterRole", "baton-operator", None),
        ("ClusterRoleBinding", "baton-operator", None),
        ("Role", "baton-operator-node-leases", "kube-node-lease"),
        ("RoleBinding", "baton-operator-node-leases", "kube-node-lease"),
        ("Role", "baton-operator-self", "baton-system"),
        ("RoleBinding", "baton-operator-self", "baton-system"),
    ]
    _same(docs[1]["rules"], WORKLOAD + NODES)
    _same(docs[3]["rules"], NODE_LEASES)
    _same(docs[5]["rules"], SELF)
    for binding in (docs[2], docs[4], docs[6]):
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "baton-operator", "namespace": "baton-system"}
        ]


def test_watch_namespaces_install_grants_nothing_cluster_wide_but_nodes() -> None:
    docs = rbac.rbac_manifests("ops", "op", watch_namespaces=["ml-a", "ml-b"])
    cluster = [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    assert [(d["kind"], d["metadata"]["name"]) for d in cluster] == [
        ("ClusterRole", "baton-operator-nodes"),
        ("ClusterRoleBinding", "baton-operator-nodes"),
    ]
    _same(cluster[0]["rules"], NODES)
    roles = {d["metadata"]["namespace"]: d for d in docs if d["kind"] == "Role"}
    assert sorted(roles) == ["kube-node-lease", "ml-a", "ml-b", "ops"]
    _same(roles["kube-node-lease"]["rules"], NODE_LEASES)
    _same(roles["ml-a"]["rules"], WORKLOAD)
    _same(roles["ml-b"]["rules"], WORKLOAD)
    _same(roles["ops"]["rules"], SELF)
    bindings = [d for d in docs if d["kind"] == "RoleBinding"]
    assert sorted((b["metadata"]["namespace"], b["roleRef"]["name"]) for b in bindings) == [
        ("kube-node-lease", "baton-operator-node-leases"),
        ("ml-a", "baton-operator"),
        ("ml-b", "baton-operator"),
        ("ops", "baton-operator-self"),
    ]


def test_no_wildcards_anywhere() -> None:
    docs = rbac.rbac_manifests("ops", "op", watch_namespaces=["ml-a"])
    docs += rbac.rbac_manifests("ops", "op")
    for doc in docs:
        for rule in doc.get("rules", []):
            for key in ("verbs", "resources", "apiGroups", "resourceNames"):
                assert "*" not in rule.get(key, []), rule


def _api_calling_methods() -> dict[str, set[str]]:
    """Kube methods and the client attributes (``self._core``/``self._custom``/
    ``self._coordination``) they use."""
    tree = ast.parse(Path(inspect.getfile(kube)).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Kube")
    out: dict[str, set[str]] = {}
    for fn in cls.body:
        if not isinstance(fn, ast.AsyncFunctionDef | ast.FunctionDef):
            continue
        out[fn.name] = {
            node.attr
            for node in ast.walk(fn)
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr in ("_core", "_custom", "_coordination")
        }
    return out


def test_every_method_that_calls_the_api_declares_its_permission() -> None:
    # The hand-written lists above hold only if no call escapes the registry.
    verb_of = {"read": "get", "get": "get", "patch": "patch", "list": "list",
               "delete": "delete", "create": "create"}  # fmt: skip
    for name, used in _api_calling_methods().items():
        if name.startswith("_"):
            continue  # shared private helpers; each public caller declares its own verb
        declared = getattr(Kube, name).__dict__.get("baton_permissions", set())
        if used:
            assert declared, f"Kube.{name} calls {sorted(used)} without @_needs(...)"
        verbs = {p.verb for p in declared}
        for attr in used:
            assert verb_of[attr.split("_")[0]] in verbs, f"Kube.{name} calls {attr}: {verbs}"


def test_the_node_lease_read_is_granted_in_kube_node_lease_only() -> None:
    # Declared on the method, but not in the registry the workload and self roles come from:
    # the same triple in the operator's namespace is its election Lease, granted by name.
    declared = Kube.node_lease.__dict__["baton_permissions"]
    assert declared == set(kube.NODE_LEASE_PERMISSIONS)
    assert not declared & kube.PERMISSIONS
    docs = rbac.rbac_manifests("ops", "op")
    granted = [
        (d["kind"], d["metadata"].get("namespace"))
        for d in docs
        if any(r["apiGroups"] == ["coordination.k8s.io"] and "get" in r["verbs"]
               and "resourceNames" not in r for r in d.get("rules", []))
    ]  # fmt: skip
    assert granted == [("Role", "kube-node-lease")]
