"""Fixtures of the integration tests: one uninterrupted Hugging Face run for the session (the
operator's ``baton`` fixture, for the cluster test, is in ``baton_testing.operator_fixtures``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from baton_testing import hf_runs


@pytest.fixture(scope="session")
def hf_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``hf_train.py`` on 2 gloo ranks under torchrun, never interrupted."""
    out = tmp_path_factory.mktemp("hf-reference")
    assert hf_runs.run(out) == 0, hf_runs.tail(out)
    return out
