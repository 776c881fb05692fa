"""The operator's fixtures, for every test folder that runs jobs under it (a pytest plugin).

``operator_install`` (session): the CRDs and the generated RBAC applied to the session's local
cluster, and a kubeconfig for the operator's ServiceAccount token (never admin). ``baton`` (per
test): a running ``baton-operator`` process and the job-level helpers of
:mod:`baton_testing.operator_harness`. ``tests/conftest.py`` registers this module in
``pytest_plugins``, so the operator's tests and the integrations' cluster test share one
install; the harness (and with it the operator package) is imported only when a test asks for
these fixtures.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from baton_testing.cluster import LocalCluster
    from baton_testing.operator_harness import Baton, OperatorInstall

__all__ = ["baton", "operator_install"]


@pytest.fixture(scope="session")
def operator_install(
    local_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> OperatorInstall:
    """CRDs and generated RBAC applied; a kubeconfig with the operator's token (not admin)."""
    from baton_testing.operator_harness import install_operator

    return install_operator(local_cluster, tmp_path_factory.mktemp("operator"))


@pytest.fixture
def baton(operator_install: OperatorInstall, tmp_path: Path) -> Iterator[Baton]:
    """A running ``baton-operator`` process and the job-level helpers of one test."""
    from baton_testing.operator_harness import Baton, operator_process

    op = operator_process(operator_install, tmp_path)
    op.start()
    try:
        yield Baton(install=operator_install, workdir=tmp_path, operator=op)
    finally:
        op.stop()
