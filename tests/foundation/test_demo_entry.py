"""The demo starts as the README says: ``make demo`` runs ``.venv/bin/python examples/demo/run.py``.

The example keeps the job, the preemption and the report; its driver is in the test helpers
(``tests/baton_testing/demo.py``), which the venv makes importable through a ``.pth`` file
(``make venv``). These run the example as a newcomer would, with no ``PYTHONPATH`` and from
another directory, and stop at its command line (the whole demo is ``tests/e2e/test_demo.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo" / "run.py"


def run_demo(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, str(DEMO), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_demo_imports_its_driver_from_the_venv(tmp_path: Path) -> None:
    proc = run_demo("--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for option in ("--provider", "--preemptions", "--kill-node", "--storage", "--out"):
        assert option in proc.stdout, proc.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--preemptions", "0"], "--preemptions must be at least 1"),
        (["--steps", "20"], "--steps is too small for that many interruptions"),
        (["--provider", "azure"], "invalid choice: 'azure'"),
        (["--goodput", "--kill-node"], "--goodput draws its own interruptions"),
    ],
)
def test_options_that_cannot_run_are_refused_before_anything_starts(
    tmp_path: Path, args: list[str], message: str
) -> None:
    proc = run_demo(*args, "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr
    assert not (tmp_path / "out").exists(), "a refused run must not start the demo"
