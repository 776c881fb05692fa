"""The operator's fixtures, for every test folder that runs jobs under it (a pytest plugin).

``operator_install`` (session): the CRDs and the generated RBAC applied to the session's local
cluster, and a kubeconfig for the operator's ServiceAccount token (never admin). ``baton`` (per
test): a running ``baton-operator`` process and the job-level helpers of
:mod:`baton_testing.operator_harness`. ``tests/conftest.py`` registers this module in
``pytest_plugins``, so the operator's tests and the integrations' cluster test share one
install; the harness (and with it the operator package) is imported only when a test asks for
these fixtures.

A test module that sets ``SHARED_OPERATOR = True`` gets one operator process for all of its
tests (``module_operator``) instead of one per test, as one operator serves many jobs in a real
cluster. Started per test, an operator costs its start (about 1 s) and its stop (about 0.6 s
since the operator stopped handing kopf a ``stop_flag``, which kopf then waited 5 s for; it was
about 6 s of every test's teardown). What each test relies on is kept: a running
operator when it starts (started again if the test before killed it, or it exited), a working
directory of its own, uniquely named jobs, and metrics read per job. Such a module may set
``OPERATOR_ARGS`` (a list of flags) to add to the shared process's test-sized settings.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from baton_testing.cluster import LocalCluster
    from baton_testing.operator_harness import Baton, OperatorInstall, OperatorProcess

__all__ = ["baton", "module_operator", "operator_install"]


@pytest.fixture(scope="session")
def operator_install(
    local_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> OperatorInstall:
    """CRDs and generated RBAC applied; a kubeconfig with the operator's token (not admin)."""
    from baton_testing.operator_harness import install_operator

    return install_operator(local_cluster, tmp_path_factory.mktemp("operator"))


@pytest.fixture(scope="module")
def module_operator(
    request: pytest.FixtureRequest,
    operator_install: OperatorInstall,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[OperatorProcess]:
    """One ``baton-operator`` process for the tests of a module with ``SHARED_OPERATOR = True``
    (started by ``baton`` when a test needs it, stopped after the module's last test), with
    the module's ``OPERATOR_ARGS`` added to its flags."""
    from baton_testing.operator_harness import operator_process

    op = operator_process(operator_install, tmp_path_factory.mktemp("operator-of-module"))
    op.args.extend(getattr(request.module, "OPERATOR_ARGS", ()))
    try:
        yield op
    finally:
        op.stop()


@pytest.fixture
def baton(
    request: pytest.FixtureRequest, operator_install: OperatorInstall, tmp_path: Path
) -> Iterator[Baton]:
    """A running ``baton-operator`` process and the job-level helpers of one test (the
    module's shared process when the module sets ``SHARED_OPERATOR = True``)."""
    from baton_testing.operator_harness import Baton, operator_process

    if getattr(request.module, "SHARED_OPERATOR", False):
        shared: OperatorProcess = request.getfixturevalue("module_operator")
        if shared.proc is None or shared.proc.poll() is not None:
            shared.start()
        yield Baton(install=operator_install, workdir=tmp_path, operator=shared)
        return
    op = operator_process(operator_install, tmp_path)
    op.start()
    try:
        yield Baton(install=operator_install, workdir=tmp_path, operator=op)
    finally:
        op.stop()
