"""``bench/goodput.py --render``: the methods of separate runs in one table and plot.

Each method of the goodput benchmark can be run alone on a quiet machine (a checkpoint-restart
baseline takes as long as the others together); ``--render`` with their ``goodput.json`` files
puts them in one table, with goodput and bitwise equality computed against the merged
uninterrupted run, and refuses runs of another job or schedule. Run as a user runs it: the
script in a subprocess, on files shaped as the benchmark writes them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "goodput.py"
ARGS = {"steps": "100", "every_steps": "10", "fast_every_steps": "5", "d_model": "64",
        "n_layers": "2", "batch_size": "8", "step_sleep": "0.3", "seed": "30", "mtbi": "60.0",
        "mix": "0.4,0.3,0.3"}  # fmt: skip
KILL = {"at_seconds": 20.0, "kind": "kill", "rank": 1, "replace_after_seconds": 5.0}


def _row(method: str, wall: float, sha: str, kinds: list[str]) -> dict[str, Any]:
    return {
        "method": method, "phase": "Succeeded", "wall_s": wall, "train_s": wall - 5,
        "median_step_s": 0.5, "steps_trained": 100 + 10 * len(kinds),
        "steps_recomputed": 10 * len(kinds),
        "interruptions": [{"kind": k, "at_s": 20.0, "at_step": 40} for k in kinds],
        "restart_s": [9.0] * len(kinds), "bytes_written": 2**20, "sha256": sha,
        "state_bytes": 2**20, "status_interruptions": [],
        "curve": [(1.0 + i, i) for i in range(0, 101, 10)],
        "goodput": None, "bitwise_equal": False,
    }  # fmt: skip


def _run_file(
    path: Path, rows: list[dict[str, Any]], interruptions: list[Any], **args: str
) -> Path:
    data = {"args": ARGS | args, "schedule": {"model": {}, "interruptions": interruptions},
            "rows": rows, "seconds": 100.0}  # fmt: skip
    path.write_text(json.dumps(data))
    return path


def _render(out: Path, *files: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, str(BENCH), "--out", str(out), "--render", *map(str, files)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)


def test_runs_made_one_at_a_time_render_as_one_table(tmp_path: Path) -> None:
    clean = _run_file(tmp_path / "a.json", [_row("no-interruptions", 55.0, "s1", [])], [KILL])
    baton = _run_file(
        tmp_path / "b.json",
        [_row("baton-memory", 60.5, "s1", ["kill"]), _row("baton-durable", 66.0, "s1", ["kill"])],
        [KILL],
    )
    base = _run_file(
        tmp_path / "c.json", [_row("checkpoint-restart", 110.0, "s2", ["kill"])], [KILL]
    )
    result = _render(tmp_path / "out", base, baton, clean)
    assert result.returncode == 0, result.stderr[-3000:]
    merged = json.loads((tmp_path / "out" / "goodput.json").read_text())
    rows = {r["method"]: r for r in merged["rows"]}
    # the benchmark's own method order, whatever the files' order
    assert list(rows) == ["no-interruptions", "baton-durable", "baton-memory", "checkpoint-restart"]
    # goodput: 100 steps at the uninterrupted median step (0.5 s) over each wall time
    assert rows["baton-memory"]["goodput"] == 50.0 / 60.5
    assert rows["checkpoint-restart"]["goodput"] == 50.0 / 110.0
    equal = {m: r["bitwise_equal"] for m, r in rows.items()}
    assert equal == {"no-interruptions": True, "baton-durable": True, "baton-memory": True,
                     "checkpoint-restart": False}  # fmt: skip
    table = (tmp_path / "out" / "goodput.md").read_text()
    assert "| baton-memory | 1 (kill) | 60 s | 1.10x | 0.55x | 83 % |" in table, table
    assert (tmp_path / "out" / "goodput.png").stat().st_size > 0


def test_runs_of_another_schedule_are_refused(tmp_path: Path) -> None:
    clean = _run_file(tmp_path / "a.json", [_row("no-interruptions", 55.0, "s1", [])], [KILL])
    other = _run_file(
        tmp_path / "b.json",
        [_row("baton-durable", 66.0, "s1", ["kill"])],
        [{**KILL, "at_seconds": 30.0}],
    )
    result = _render(tmp_path / "out", clean, other)
    assert result.returncode != 0
    assert "was run with other schedule than" in result.stderr, result.stderr[-2000:]
    assert "--schedule FILE" in result.stderr


def test_memory_tier_runs_of_several_intervals_share_one_table(tmp_path: Path) -> None:
    # fastEverySteps is the memory tier's setting, not the job's: runs at 10 and 25 go in one
    # table beside the uninterrupted run (made with another value), each labelled.
    clean = _run_file(
        tmp_path / "a.json", [_row("no-interruptions", 55.0, "s1", [])], [KILL],
        fast_every_steps="10",
    )  # fmt: skip
    every = {n: _run_file(tmp_path / f"m{n}.json", [_row("baton-memory", wall, "s1", ["kill"])],
                          [KILL], fast_every_steps=str(n))
             for n, wall in ((25, 58.0), (10, 60.5))}  # fmt: skip
    result = _render(tmp_path / "out", every[25], clean, every[10])
    assert result.returncode == 0, result.stderr[-3000:]
    merged = json.loads((tmp_path / "out" / "goodput.json").read_text())
    methods = [r["method"] for r in merged["rows"]]
    assert methods == ["no-interruptions", "baton-memory, every 10", "baton-memory, every 25"]
    table = (tmp_path / "out" / "goodput.md").read_text()
    assert "| baton-memory, every 25 | 1 (kill) | 58 s | 1.05x |" in table, table
    assert "| baton-memory, every 10 | 1 (kill) | 60 s | 1.10x |" in table, table
    # one memory-tier run keeps its plain name
    result = _render(tmp_path / "one", clean, every[25])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| baton-memory | 1 (kill) | 58 s |" in (tmp_path / "one" / "goodput.md").read_text()


def test_the_restarts_seconds_are_split_into_the_trainers_start_up_phases(tmp_path: Path) -> None:
    # tinylm logs each start's phases; the report shows their medians over a run's restarts
    # and what is left of the restart (the save, the pods, the first step). A run written
    # before the phases were logged renders without that table.
    clean = _run_file(tmp_path / "a.json", [_row("no-interruptions", 55.0, "s1", [])], [KILL])
    memory = _row("baton-memory", 60.5, "s1", ["kill", "aws notice", "kill"])
    memory["restart_s"] = [9.0, 12.0, 10.0]
    memory["restart_phases"] = [
        {"launch": 3.0, "rendezvous": 1.0, "setup": 2.0, "restore": 1.0},  # rest 2.0
        {"launch": 2.0, "rendezvous": 0.5, "setup": 2.5, "restore": 1.5},  # rest 5.5
        {"launch": 4.0, "rendezvous": 0.0, "setup": 1.0, "restore": 2.0},  # rest 3.0
    ]
    durable = _row("baton-durable", 66.0, "s1", ["kill"])  # no phases logged
    result = _render(
        tmp_path / "out", clean, _run_file(tmp_path / "b.json", [memory, durable], [KILL])
    )
    assert result.returncode == 0, result.stderr[-3000:]
    text = (tmp_path / "out" / "goodput.md").read_text()
    assert "| baton-memory | 3 | 10.0 s | 3.0 s | 0.5 s | 2.0 s | 1.5 s | 3.0 s |" in text, text
    assert "| baton-durable | 1 |" not in text
    (tmp_path / "old").mkdir()
    old = _run_file(tmp_path / "old" / "b.json", [durable], [KILL])
    result = _render(tmp_path / "old" / "out", clean, old)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Where the restarts went" not in (tmp_path / "old" / "out" / "goodput.md").read_text()
