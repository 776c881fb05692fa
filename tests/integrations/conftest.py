"""Fixtures of the integration tests: one uninterrupted Hugging Face run for the session, and
the operator (as in ``tests/operator/conftest.py``) for the cluster test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from baton_testing import hf_runs
from baton_testing.cluster import LocalCluster
from baton_testing.operator_harness import (
    Baton,
    OperatorInstall,
    install_operator,
    operator_process,
)


@pytest.fixture(scope="session")
def hf_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``hf_train.py`` on 2 gloo ranks under torchrun, never interrupted."""
    out = tmp_path_factory.mktemp("hf-reference")
    assert hf_runs.run(out) == 0, hf_runs.tail(out)
    return out


@pytest.fixture(scope="session")
def operator_install(
    local_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> OperatorInstall:
    """CRDs and generated RBAC applied; a kubeconfig with the operator's token (not admin)."""
    return install_operator(local_cluster, tmp_path_factory.mktemp("operator"))


@pytest.fixture
def baton(operator_install: OperatorInstall, tmp_path: Path) -> Iterator[Baton]:
    """A running ``baton-operator`` process and the job-level helpers of one test."""
    op = operator_process(operator_install, tmp_path)
    op.start()
    try:
        yield Baton(install=operator_install, workdir=tmp_path, operator=op)
    finally:
        op.stop()
