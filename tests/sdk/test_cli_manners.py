"""``python -m trainer_sdk`` behaves in pipes and logs: ``| head`` ends quietly, progress has
no carriage returns unless stderr is a terminal, and ``inspect`` shows the Checkpointer's key
prefix once."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
from pathlib import Path

import torch

import trainer_sdk


def _many_tensors(root: Path) -> None:
    # A Checkpointer over a model whose own keys start with "model." (as transformers' do):
    # checkpoint keys are "model.model.layers.N...".
    layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(1000))
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = layers
    with trainer_sdk.Checkpointer(root, model=model, handle_sigterm=False) as ckpt:
        ckpt.save(5)


def test_inspect_into_head_ends_without_a_traceback(tmp_path: Path) -> None:
    _many_tensors(tmp_path)
    # A real pipe whose reader exits after one line, as `python -m trainer_sdk inspect | head -1`.
    r = subprocess.run(
        f"{sys.executable} -m trainer_sdk inspect {tmp_path} | head -n 1; "
        'echo "status=${PIPESTATUS[0]}" >&2',
        shell=True, executable="/bin/bash", capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    assert r.stdout.startswith("checkpoint  ")
    assert "Traceback" not in r.stderr, r.stderr
    assert "BrokenPipeError" not in r.stderr, r.stderr
    assert "status=141" in r.stderr  # what `yes | head` reports: killed-by-SIGPIPE's status


def test_inspect_shows_the_prefix_once(tmp_path: Path) -> None:
    _many_tensors(tmp_path)
    r = subprocess.run(
        [sys.executable, "-m", "trainer_sdk", "inspect", str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    heading = next(line for line in lines if line.strip().startswith("model."))
    assert heading.split()[:3] == ["model.", "(2000", "tensors,"]
    assert "model.model." not in r.stdout
    assert any(line.split()[0] == "model.layers.0.weight" for line in lines if line.strip())
    # top-level keys without a dot (here the Checkpointer's own) stay as they are
    assert any(line.strip().startswith("rng.") for line in lines)


def _verify_progress(root: Path, *, tty: bool) -> str:
    """stderr of `verify` when it is a pipe, or a pseudo-terminal."""
    cmd = [sys.executable, "-m", "trainer_sdk", "verify", str(root)]
    if not tty:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stderr
    primary, secondary = pty.openpty()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=secondary)
    os.close(secondary)
    chunks = []
    while True:
        ready, _, _ = select.select([primary], [], [], 120)
        assert ready, "verify printed nothing for 120s"
        try:
            data = os.read(primary, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(primary)
    assert proc.wait(timeout=120) == 0
    return b"".join(chunks).decode()


def test_progress_uses_carriage_returns_only_on_a_terminal(tmp_path: Path) -> None:
    trainer_sdk.save({"w": torch.ones(300, 40), "b": torch.zeros(7)}, str(tmp_path), step=10)
    logged = _verify_progress(tmp_path, tty=False)
    assert "\r" not in logged
    assert logged.splitlines()[-1].startswith("verifying 2/2 files")  # a final line, whole
    shown = _verify_progress(tmp_path, tty=True)
    assert "\rverifying" in shown
