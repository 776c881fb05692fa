"""The operator's RBAC, generated from the code that needs it (the single source of truth).

Three inputs, each next to the code that uses the permission:
- ``kube.PERMISSIONS``: every API call the operator makes itself (``@_needs`` on each method);
- ``watches.WATCHED``: every resource kopf watches for us (``list`` + ``watch``);
- ``_KOPF_OWN`` below: what kopf itself writes for a daemon-based operator, with the reason.

Nodes are cluster-scoped, so a ClusterRole is always needed. ``deploy/`` and the chart are
generated from :func:`rbac_manifests`; the integration tests run the operator under it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Final

from . import crd, kube, watches
from .kube import Permission

__all__ = ["CLUSTER_ROLE_NAME", "rbac_manifests", "rbac_rules", "required_permissions"]

CLUSTER_ROLE_NAME: Final = "baton-operator"

_KOPF_OWN: Final = frozenset(
    {
        # kopf adds and removes its finalizer on each TrainingJob (daemons require one, so
        # that a job's daemon is stopped before the job disappears) and keeps its progress
        # and diff-base in annotations (settings.py): both are patches of the main resource.
        Permission(crd.GROUP, crd.PLURAL, "patch"),
        # kopf.event()/kopf.info()/kopf.warn() post core/v1 Events.
        Permission("", "events", "create"),
        # Peering (one active operator): kopf reads and heartbeats the ClusterKopfPeering.
        Permission("kopf.dev", "clusterkopfpeerings", "list"),
        Permission("kopf.dev", "clusterkopfpeerings", "watch"),
        Permission("kopf.dev", "clusterkopfpeerings", "patch"),
    }
)


def required_permissions() -> frozenset[Permission]:
    """Every (group, resource, verb) the operator uses, derived from the code."""
    watched = {
        Permission(w.group, w.plural, verb) for w in watches.WATCHED for verb in ("list", "watch")
    }
    return frozenset(kube.PERMISSIONS) | watched | _KOPF_OWN


def rbac_rules() -> list[dict[str, Any]]:
    """The ClusterRole rules: one rule per (group, resource), verbs sorted, deterministic."""
    verbs: dict[tuple[str, str], set[str]] = defaultdict(set)
    for p in required_permissions():
        verbs[(p.group, p.resource)].add(p.verb)
    return [
        {"apiGroups": [group], "resources": [resource], "verbs": sorted(vs)}
        for (group, resource), vs in sorted(verbs.items())
    ]


def rbac_manifests(namespace: str, service_account: str) -> list[dict[str, Any]]:
    """ServiceAccount, ClusterRole and ClusterRoleBinding for an operator in ``namespace``."""
    labels = {"app.kubernetes.io/name": "baton-operator", "app.kubernetes.io/part-of": "baton"}
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": service_account, "namespace": namespace, "labels": labels},
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": CLUSTER_ROLE_NAME, "labels": labels},
            "rules": rbac_rules(),
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": CLUSTER_ROLE_NAME, "labels": labels},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": CLUSTER_ROLE_NAME,
            },
            "subjects": [
                {"kind": "ServiceAccount", "name": service_account, "namespace": namespace}
            ],
        },
    ]
