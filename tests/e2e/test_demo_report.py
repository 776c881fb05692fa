"""The demo's report, figure by figure, without a cluster.

``tests/e2e/test_demo.py`` runs the whole demo and checks the verdicts; this pins down how each
figure of the report is derived from what the demo recorded: the operator's notice and
checkpoint in ``status`` (RFC 3339 times), its Event's own notice-to-commit figure, and the
trainer's loss log of every attempt (steps lost, restore time, downtime). The measurements come
from the driver (``baton_testing.demo.measure``), the Markdown from the example's ``report``.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from baton_testing.demo import NO_NOTICE, Demo, DemoConfig, Interruption, measure

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo" / "run.py"


@pytest.fixture(scope="module")
def example() -> ModuleType:
    """``examples/demo/run.py`` as a module (it is a script, not part of a package)."""
    spec = importlib.util.spec_from_file_location("baton_demo_example", DEMO)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _log(path: Path, entries: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(e) + "\n" for e in entries)
    path.write_text(text + '{"step": 99, "lo')  # a half-written last line is skipped


def _losses(steps: range, attempt: int, t0: float) -> list[dict[str, Any]]:
    return [{"step": s, "loss": 3.0 - s / 100, "attempt": attempt, "time": t0 + s} for s in steps]


def test_a_notice_answered_in_time_is_measured_from_status_and_the_loss_log(
    tmp_path: Path, example: ModuleType
) -> None:
    cfg = DemoConfig(out=tmp_path / "out", steps=30, every_steps=10)
    demo = Demo(cfg)
    # Attempt 0 trains steps 1-13 (times 1001-1013); the notice comes at t=1013.5; attempt 1
    # restores step 13 (0.5 s) at t=1040 and trains 14-30; the final weights' digest last.
    _log(
        demo.loss_log,
        [
            *_losses(range(1, 14), 0, 1000.0),
            {"event": "start", "step": 13, "attempt": 1, "restore_seconds": 0.5, "time": 1040.0},
            *_losses(range(14, 31), 1, 1026.0),
            {"event": "done", "step": 30, "sha256": "f00d"},
        ],
    )
    event = Interruption(kind="aws notice", node="node-2", rank=1, at_step=13, injected_at=1013.5)
    event.notice = {
        "source": "aws",
        "receivedAt": "1970-01-01T00:16:54Z",  # 1014: seen 0.5 s after it was given
        "deadline": "1970-01-01T00:18:54Z",  # 120 s later
    }
    event.committed = {
        "step": 13,
        "trigger": "notice",
        "completedAt": "1970-01-01T00:16:56Z",  # 1016: 2 s after the notice, in whole seconds
        "seconds": 0.4,
    }
    demo.interruptions = [event]
    demo._fill_resume(event)
    demo.final_status = {"phase": "Succeeded", "preemptions": 1, "failures": 0}
    # The operator's own figure, finer than status' whole seconds, wins.
    demo.saved_events = ["Checkpointed: committed step 13 1.25s after the notice (aws)"]

    data = measure(demo, "f00d", started=0.0)

    (row,) = data["interruptions"]
    assert row["notice_source"] == "aws"
    assert row["notice_lead_s"] == 120.0
    assert row["notice_seen_after_s"] == 0.5
    assert row["notice_to_commit_s"] == 1.25
    assert row["margin_s"] == 120.0 - 1.25
    assert row["sdk_save_s"] == 0.4
    assert (row["checkpoint_step"], row["checkpoint_trigger"]) == (13, "notice")
    assert (row["last_step_before"], row["resumed_step"], row["steps_lost"]) == (13, 13, 0)
    assert row["restore_s"] == 0.5
    assert row["downtime_s"] == 1040.0 - 1013.5
    assert data["steps_lost"] == 0
    assert (data["sha256"], data["bitwise_equal"]) == ("f00d", True)
    assert (data["phase"], data["preemptions"], data["failures"]) == ("Succeeded", 1, 0)

    text = example.report(cfg, data, demo.saved_events)
    assert "- interruption: aws notice x 1" in text
    assert (
        "| 1 | aws notice | node-2 (1) | 13 | 120.0 s | 1.2 s | 0.4 s | 118.8 s | "
        "step 13 (notice) | 13 | 0 | 0.5 s | 26.5 s |"
    ) in text
    assert "- verdict: **BITWISE EQUAL**" in text
    assert "    Checkpointed: committed step 13 1.25s after the notice (aws)" in text


def test_a_lost_node_counts_the_steps_trained_after_the_last_periodic_save(
    tmp_path: Path, example: ModuleType
) -> None:
    cfg = DemoConfig(out=tmp_path / "out", steps=30, every_steps=10, kill_node=True)
    demo = Demo(cfg)
    # Attempt 0 trains 1-15; the node dies at t=1015.5 without a notice; attempt 1 resumes from
    # the periodic checkpoint of step 10 and trains 11-30 again: 5 steps trained twice.
    _log(
        demo.loss_log,
        [
            *_losses(range(1, 16), 0, 1000.0),
            {"event": "start", "step": 10, "attempt": 1, "restore_seconds": 0.7, "time": 1050.0},
            *_losses(range(11, 31), 1, 1040.0),
            {"event": "done", "step": 30, "sha256": "beef"},
        ],
    )
    event = Interruption(kind=NO_NOTICE, node="node-1", rank=0, at_step=15, injected_at=1015.5)
    event.committed = {"step": 10, "trigger": "periodic", "completedAt": "1970-01-01T00:16:50Z"}
    demo.interruptions = [event]
    demo._fill_resume(event)
    demo.final_status = {"phase": "Succeeded", "preemptions": 0, "failures": 1}

    data = measure(demo, "f00d", started=0.0)

    (row,) = data["interruptions"]
    # No notice: no lead, no notice-to-commit, no margin (a periodic save answers nothing).
    assert row["notice_lead_s"] is None
    assert row["notice_to_commit_s"] is None
    assert row["margin_s"] is None
    assert (row["last_step_before"], row["resumed_step"], row["steps_lost"]) == (15, 10, 5)
    assert data["steps_lost"] == 5
    assert data["bitwise_equal"] is False

    text = example.report(cfg, data, [])
    assert "- interruption: kill-node (no notice) x 1" in text
    assert "| n/a | n/a | n/a | n/a | step 10 (periodic) | 10 | 5 | 0.7 s |" in text
    assert "- verdict: **DIFFERENT**" in text


def test_a_lost_node_with_the_memory_tier_is_reported_beside_todays_path(
    tmp_path: Path, example: ModuleType
) -> None:
    """``--kill-node`` runs the job twice: the report puts the memory tier's recovery (the
    same attempt, one pod replaced, resumed from the snapshot of the step before the loss)
    beside today's (every pod restarted from the periodic checkpoint)."""
    cfg = DemoConfig(out=tmp_path / "out", steps=30, every_steps=10, kill_node=True)
    durable = Demo(cfg)
    _log(
        durable.loss_log,
        [
            *_losses(range(1, 16), 0, 1000.0),
            {"event": "start", "step": 10, "attempt": 1, "restore_seconds": 0.7, "time": 1050.0},
            *_losses(range(11, 31), 1, 1040.0),
            {"event": "done", "step": 30, "sha256": "f00d"},
        ],
    )
    lost = Interruption(kind=NO_NOTICE, node="node-1", rank=1, at_step=15, injected_at=1015.5)
    lost.committed = {"step": 10, "trigger": "periodic"}
    durable.interruptions = [lost]
    durable._fill_resume(lost)
    durable.final_status = {"phase": "Succeeded", "preemptions": 0, "failures": 1}

    # The memory-tier run: the survivors restart in place in attempt 0 and load step 15's
    # snapshot (rank 1's from its replica); the first new step comes 9.5 s after the loss.
    memory = Demo(cfg)
    memory.label = "memory"
    memory.loss_log = memory.out / "loss-memory.jsonl"
    _log(
        memory.loss_log,
        [
            *_losses(range(1, 16), 0, 2000.0),
            {"event": "start", "step": 15, "attempt": 0, "restore_seconds": 0.2, "time": 2024.0},
            *_losses(range(16, 31), 0, 2009.0),
            {"event": "done", "step": 30, "sha256": "f00d"},
        ],
    )
    again = Interruption(kind=NO_NOTICE, node="node-2", rank=1, at_step=15, injected_at=2015.5)
    again.committed = {"step": 15, "trigger": "memory"}
    memory.interruptions = [again]
    memory._fill_resume(again)
    memory.final_status = {
        "phase": "Succeeded",
        "preemptions": 1,
        "failures": 0,
        "lastRecovery": {"replaced": [{"rank": 1}], "restoredStep": 15, "tier": "memory"},
    }

    data = measure(durable, "f00d", started=0.0)
    data["memory_tier"] = measure(memory, "f00d", started=0.0)

    assert data["steps_lost"] == 5
    assert data["pods_replaced"] == "all"
    fast = data["memory_tier"]
    (row,) = fast["interruptions"]
    assert (row["last_step_before"], row["resumed_step"], row["steps_lost"]) == (15, 15, 0)
    assert row["to_first_step_s"] == pytest.approx(2025.0 - 2015.5)
    assert (fast["path"], fast["pods_replaced"], fast["bitwise_equal"]) == ("memory", 1, True)

    text = example.report(cfg, data, [])
    assert "## The same node loss with the memory tier (fastEverySteps 1)" in text
    assert (
        "| durable checkpoints only | Succeeded | step 10 (periodic) | 5 | 0.7 s | 35.5 s | all "
        "| bitwise equal |"
    ) in text
    assert (
        "| memory tier | Succeeded | step 15 (memory) | 0 | 0.2 s | 9.5 s | 1 | bitwise equal |"
        in (text)
    )
