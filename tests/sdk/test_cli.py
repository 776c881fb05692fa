"""``python -m trainer_sdk ls|inspect|verify``: human output, progress, exit status."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

import trainer_sdk


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainer_sdk", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _make(root: Path) -> None:
    trainer_sdk.save({"w": torch.ones(300, 40), "b": torch.zeros(7)}, str(root), step=10)
    trainer_sdk.save({"w": torch.ones(300, 40) * 2, "b": torch.ones(7)}, str(root), step=20)
    (root / "step-000000000030").mkdir()  # a crashed save: no manifest


def test_ls_lists_complete_and_incomplete_steps_and_the_latest_hint(tmp_path: Path) -> None:
    _make(tmp_path)
    r = _cli("ls", str(tmp_path))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[:3] == ["STEP", "STATUS", "WORLD"]
    assert lines[1].split()[:4] == ["10", "complete", "1", "periodic"]
    assert lines[2].split()[:2] == ["20", "complete"]
    assert lines[3].split()[:2] == ["30", "incomplete"]
    assert lines[4] == "latest: 20 (agrees)"
    # a stale hint is reported as such
    (tmp_path / "latest").write_text(json.dumps({"step": 10}))
    assert "latest: 10 (stale: the newest complete step is 20)" in _cli("ls", str(tmp_path)).stdout


def test_inspect_shows_the_manifest(tmp_path: Path) -> None:
    _make(tmp_path)
    r = _cli("inspect", f"file://{tmp_path}", "--step", "10")
    assert r.returncode == 0, r.stderr
    assert "step        10" in r.stdout
    assert "world size  1" in r.stdout
    assert "trigger     periodic" in r.stdout
    w_line = next(line for line in r.stdout.splitlines() if line.strip().startswith("w "))
    assert w_line.split()[1:4] == ["replicated", "F32", "300x40"]
    assert "rank-00000-of-00001.safetensors" in r.stdout
    # the default is the newest complete step
    assert "step        20" in _cli("inspect", str(tmp_path)).stdout


def test_verify_passes_then_names_the_corrupt_file(tmp_path: Path) -> None:
    _make(tmp_path)
    ok = _cli("verify", str(tmp_path))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.startswith("OK step 20: 2 files")
    assert "verifying 2/2 files" in ok.stderr  # progress

    shard = tmp_path / "step-000000000020" / "rank-00000-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    bad = _cli("verify", str(tmp_path), "--step", "20")
    assert bad.returncode == 1
    assert "FAILED step 20" in bad.stdout
    assert "rank-00000-of-00001.safetensors: xxh3_128" in bad.stdout  # format v4 shards

    with open(shard, "r+b") as f:
        f.truncate(100)
    bad = _cli("verify", str(tmp_path), "--step", "20")
    assert bad.returncode == 1
    assert "100 bytes, the manifest says" in bad.stdout
    # the other step is untouched
    assert _cli("verify", str(tmp_path), "--step", "10").returncode == 0


def test_verify_of_an_incomplete_step_and_an_empty_root(tmp_path: Path) -> None:
    _make(tmp_path)
    r = _cli("verify", str(tmp_path), "--step", "30")
    assert r.returncode == 1
    assert "never committed" in r.stdout
    empty = tmp_path / "empty"
    r = _cli("verify", str(empty))
    assert r.returncode == 2
    assert "no complete checkpoint" in r.stderr
    assert _cli("ls", str(empty)).returncode == 2


def test_the_cli_does_not_import_torch(tmp_path: Path) -> None:
    _make(tmp_path)
    code = (
        "import sys\n"
        "from trainer_sdk.cli import main\n"
        f"rc = main(['verify', {str(tmp_path)!r}])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "sys.exit(rc)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert r.returncode == 0, r.stdout + r.stderr
