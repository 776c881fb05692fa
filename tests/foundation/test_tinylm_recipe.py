"""The example trainer's torchrun recipe runs as its docstring writes it.

``examples/tinylm/train.py`` once took ``--log``, which torchrun reads as an abbreviation of its
own ``--log-dir``/``--logs-specs`` ("ambiguous option: --log could match --log-dir", exit 2),
so the documented way to run it under torchrun failed before any rank started. This runs the
docstring's command (only its ``/tmp`` paths moved into the test's directory), two processes
and a few steps, and requires torchrun's exit 0: the elastic agent exits 0 only when every
local worker exited 0.
"""

from __future__ import annotations

import ast
import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import trainer_sdk
from trainer_sdk.format.layout import DTYPE_SIZES, MANIFEST, step_dir

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "tinylm" / "train.py"


def _recipe() -> list[str]:
    """The docstring's torchrun command, its shell line continuations joined."""
    doc = ast.get_docstring(ast.parse(TRAIN.read_text(encoding="utf-8"))) or ""
    commands = [c.strip() for c in doc.replace("\\\n", " ").splitlines()]
    found = [c for c in commands if c.startswith("torchrun ")]
    assert len(found) == 1, f"the docstring should document one torchrun command: {found}"
    return shlex.split(found[0])


def _run_tinylm(command: list[str]) -> subprocess.CompletedProcess[str]:
    """``command`` in the repository, outside any job (no Baton or torchrun environment), which
    must exit 0."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BATON_", "PET_"))}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(
        [sys.executable, *command],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def test_the_documented_torchrun_recipe_runs_as_written(tmp_path: Path) -> None:
    argv = _recipe()
    assert "--loss-log" in argv
    assert "--log" not in argv
    args = [str(tmp_path / a[len("/tmp/") :]) if a.startswith("/tmp/") else a for a in argv[1:]]
    proc = _run_tinylm(["-m", "torch.distributed.run", *args])
    assert "tinylm: world 2" in proc.stdout, proc.stdout
    steps = int(argv[argv.index("--steps") + 1])
    rows = [json.loads(line) for line in (tmp_path / "loss.jsonl").read_text().splitlines()]
    trained = [r["step"] for r in rows if "loss" in r]
    assert trained, rows
    assert max(trained) == steps, rows
    assert trainer_sdk.list_steps(str(tmp_path / "ckpt")), "the run saved no checkpoint"


def test_the_size_flags_set_the_state_that_the_checkpoint_holds(tmp_path: Path) -> None:
    """``--d-model``/``--n-layers`` (what ``bench/goodput.py`` sizes its state with) shape the
    model, and the size the run reports at its end is what its checkpoint holds."""
    sizes = {}
    for d_model, n_layers in ((32, 1), (64, 3)):
        run = tmp_path / f"d{d_model}-l{n_layers}"
        argv = ["--steps", "2", "--every-steps", "2", "--uri", str(run / "ckpt")]
        argv += ["--loss-log", str(run / "loss.jsonl"), "--d-model", str(d_model)]
        argv += ["--n-layers", str(n_layers)]
        _run_tinylm([str(TRAIN), *argv])
        rows = [json.loads(line) for line in (run / "loss.jsonl").read_text().splitlines()]
        done = [r for r in rows if r.get("event") == "done"]
        assert len(done) == 1, rows
        manifest = json.loads((run / "ckpt" / step_dir(2) / MANIFEST).read_text())
        blocks = [f"blocks.{i}." for i in range(n_layers)]
        assert all(any(b in key for key in manifest["tensors"]) for b in blocks), manifest
        assert f"blocks.{n_layers}." not in json.dumps(manifest["tensors"])
        qkv = manifest["tensors"]["model.blocks.0.qkv.weight"]["shape"]
        assert qkv == [3 * d_model, d_model]
        held = sum(
            math.prod(t["shape"]) * DTYPE_SIZES[t["dtype"]]
            for key, t in manifest["tensors"].items()
            if key.startswith(("model.", "optimizer."))
        )
        assert done[0]["state_bytes"] == held
        sizes[d_model, n_layers] = held
    assert sizes[64, 3] > 4 * sizes[32, 1]
