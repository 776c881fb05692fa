"""RBAC is derived from the code: every API call is granted, and nothing else is."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from baton_operator import crd, kube, rbac, watches
from baton_operator.kube import Kube, Permission


def _api_calling_methods() -> dict[str, set[str]]:
    """Kube methods and the client attributes (``self._core``/``self._custom``) they use."""
    tree = ast.parse(Path(inspect.getfile(kube)).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Kube")
    out: dict[str, set[str]] = {}
    for fn in cls.body:
        if not isinstance(fn, ast.AsyncFunctionDef | ast.FunctionDef):
            continue
        used = {
            node.attr
            for node in ast.walk(fn)
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr in ("_core", "_custom")
        }
        out[fn.name] = used
    return out


def test_every_method_that_calls_the_api_declares_its_permission() -> None:
    for name, used in _api_calling_methods().items():
        method = getattr(Kube, name)
        declared = method.__dict__.get("baton_permissions", set())
        if name == "_create":
            continue  # the shared create helper; each public create_* declares its own verb
        if used:
            assert declared, f"Kube.{name} calls {sorted(used)} without @_needs(...)"
        verbs = {p.verb for p in declared}
        for attr in used:
            verb = attr.split("_")[0]
            expected = {
                "read": "get",
                "patch": "patch",
                "list": "list",
                "delete": "delete",
                "create": "create",
                "get": "get",
            }[verb]
            assert expected in verbs, f"Kube.{name} calls {attr} but declares {sorted(verbs)}"


def test_create_helpers_declare_create() -> None:
    for name in ("create_pod", "create_service", "create_secret"):
        perms = getattr(Kube, name).__dict__["baton_permissions"]
        assert {p.verb for p in perms} == {"create"}


def test_rules_are_exactly_the_required_permissions() -> None:
    granted = {
        Permission(group, resource, verb)
        for rule in rbac.rbac_rules()
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert granted == set(rbac.required_permissions())
    assert granted >= kube.PERMISSIONS
    for w in watches.WATCHED:
        assert Permission(w.group, w.plural, "list") in granted
        assert Permission(w.group, w.plural, "watch") in granted


def test_no_wildcards_and_no_secret_reading_beyond_get() -> None:
    for rule in rbac.rbac_rules():
        assert "*" not in rule["verbs"]
        assert "*" not in rule["resources"]
        assert "*" not in rule["apiGroups"]
    secrets = {p.verb for p in rbac.required_permissions() if p.resource == "secrets"}
    # list/watch on Secrets would expose every Secret in the cluster to the operator.
    assert secrets == {"create", "get"}
    nodes = {p.verb for p in rbac.required_permissions() if p.resource == "nodes"}
    assert nodes == {"list", "watch"}, "the operator never writes Nodes"


def test_manifests_bind_the_role_to_the_service_account() -> None:
    docs = rbac.rbac_manifests("baton-system", "baton-operator")
    kinds = [d["kind"] for d in docs]
    assert kinds == ["ServiceAccount", "ClusterRole", "ClusterRoleBinding"]
    binding = docs[2]
    assert binding["roleRef"]["name"] == docs[1]["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "baton-operator", "namespace": "baton-system"}
    ]
    assert docs[1]["rules"] == rbac.rbac_rules()


def test_status_is_patched_through_the_subresource() -> None:
    perms = rbac.required_permissions()
    assert Permission(crd.GROUP, f"{crd.PLURAL}/status", "patch") in perms
    assert Permission(crd.GROUP, crd.PLURAL, "update") not in perms
