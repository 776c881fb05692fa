"""Fixtures for the deployment tests: the helm binary, the repo paths, a real Prometheus."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from baton_testing.prometheus import prometheus_server

__all__ = ["prometheus_server"]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def helm() -> str:
    """The helm binary built from Go modules by tools/helm/build.sh (cached after the first)."""
    result = subprocess.run(
        [str(ROOT / "tools" / "helm" / "build.sh")],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"tools/helm/build.sh failed:\n{result.stderr[-4000:]}")
    return result.stdout.strip().splitlines()[-1]
