"""The demo, smaller: a 2-rank job on the local cluster survives an AWS spot notice exactly.

Runs ``examples/demo/run.py`` as a newcomer would (a subprocess: its own cluster, S3 server and
Helm install) with fewer steps, and checks its machine-readable report: the job Succeeded
after one preemption, the checkpoint answered the notice before the deadline, no step was lost,
and the final weights are bitwise equal to the uninterrupted reference run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "demo" / "run.py"


def test_aws_notice_is_survived_with_bitwise_equal_weights(tmp_path: Path) -> None:
    out = tmp_path / "demo-out"
    command = [sys.executable, str(DEMO), "--out", str(out), "--steps", "50"]
    command += ["--every-steps", "10", "--step-sleep", "0.25", "--timeout", "600"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1200, check=False)
    tail = (result.stdout + result.stderr)[-6000:]
    assert result.returncode == 0, f"the demo failed (exit {result.returncode}):\n{tail}"

    report = json.loads((out / "report.json").read_text())
    assert report["phase"] == "Succeeded", tail
    assert report["preemptions"] == 1, tail
    assert report["failures"] == 0, tail
    (event,) = report["interruptions"]
    assert event["kind"] == "aws notice"
    # NTH taints and drains at once: the operator acts on whichever deadline comes first, the
    # node's spot notice or the evicted pod's DisruptionTarget (docs/demo.md).
    assert event["notice_source"] in ("aws", "disruption-target"), tail
    assert event["checkpoint_trigger"] == "notice"
    assert event["resumed_step"] == event["checkpoint_step"] >= event["at_step"], tail
    assert event["margin_s"] > 0, "the checkpoint was committed after the deadline"
    assert event["notice_to_commit_s"] < event["notice_lead_s"]
    assert report["steps_lost"] == 0, tail
    assert report["sha256"] == report["reference_sha256"], tail
    assert report["bitwise_equal"] is True

    # The report a person reads and the plot exist and say the same.
    text = (out / "report.md").read_text()
    assert "BITWISE EQUAL" in text
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Every step of the job was trained exactly once across both attempts.
    losses = [json.loads(line) for line in (out / "loss.jsonl").read_text().splitlines()]
    steps = [e["step"] for e in losses if "loss" in e]
    assert steps == list(range(1, 51)), steps
