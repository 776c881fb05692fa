"""The stand-in trainer of ``bench/operator_scale.py`` against the real sidecar.

The scale benchmark runs hundreds of these in place of torch trainers, and its reaction figure
is the ``created`` time of the request they record. So the stand-in must take a request from
the real sidecar through the real control channel, record it, and answer it as the SDK does
(``committed`` for that request id, exit 75), or the operator would never move the jobs on.
The benchmark itself starts a cluster of its own and is not run by the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from baton_testing.sidecar_process import SidecarProcess

from trainer_sdk import EXIT_STOPPED_AFTER_NOTICE

BENCH = Path(__file__).resolve().parents[2] / "bench" / "operator_scale.py"


def test_stand_in_trainer_answers_a_sidecar_request(
    sidecar: SidecarProcess, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
    env.update(
        BATON_CONTROL_DIR=str(sidecar.control_dir),
        BATON_CHECKPOINT_URI=str(tmp_path / "ckpt"),
        RANK="1",
        BATON_ATTEMPT="2",
    )
    log = tmp_path / "trainer.log"
    with log.open("wb") as sink:
        trainer = subprocess.Popen(
            [sys.executable, str(BENCH), "trainer", "--out", str(out)],
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while not (out / "ready-a2-r1").exists():
            assert trainer.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the stand-in trainer never became ready"
            time.sleep(0.05)
        before = datetime.now(UTC)
        notice_deadline = (before + timedelta(seconds=60)).isoformat().replace("+00:00", "Z")
        posted = sidecar.post_checkpoint({"deadline": notice_deadline, "reason": "bench"})
        assert posted.status_code == 202, posted.text
        request_id = posted.json()["id"]
        code = trainer.wait(timeout=60)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(timeout=10)
    assert code == EXIT_STOPPED_AFTER_NOTICE, log.read_text()
    record = json.loads((out / "request-a2-r1.json").read_text())
    assert record["request"]["id"] == request_id
    created = datetime.fromisoformat(record["request"]["created"].replace("Z", "+00:00"))
    seen = datetime.fromisoformat(record["seen"].replace("Z", "+00:00"))
    # Millisecond timestamps: the request was made after `before` (less the rounding).
    assert before - timedelta(milliseconds=1) <= created <= seen
    status = sidecar.status().json()
    assert status["state"] == "committed", status
    assert status["request_id"] == request_id
    assert status["trigger"] == "notice"
    assert status["uri"] == f"{tmp_path / 'ckpt'}/step-{status['step']:012d}"
    assert not (sidecar.control_dir / "request.json").exists(), "the request was not cleared"
