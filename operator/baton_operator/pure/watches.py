"""The resources the operator watches through kopf, declared once.

``handlers.py`` passes these selectors to its ``@kopf.on.*`` decorators and ``rbac.py`` grants
``list`` and ``watch`` on exactly these, so the two cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from . import crd

__all__ = ["JOBS", "MANAGED_BY", "NODES", "PODS", "WATCHED", "Watched"]

MANAGED_BY: Final = {"app.kubernetes.io/managed-by": "baton"}
"""Only pods carrying this label are watched (kopf label filter), never every pod."""


@dataclass(frozen=True)
class Watched:
    """One watched resource: API group, version and plural."""

    group: str
    version: str
    plural: str

    def selector(self) -> tuple[str, ...]:
        """Positional arguments for ``@kopf.on.*`` (kopf spells the core group "v1")."""
        if self.group:
            return (self.group, self.version, self.plural)
        return (self.version, self.plural)


JOBS: Final = Watched(crd.GROUP, crd.VERSION, crd.PLURAL)
NODES: Final = Watched("", "v1", "nodes")
PODS: Final = Watched("", "v1", "pods")
WATCHED: Final = (JOBS, NODES, PODS)
