"""Every training loop shown in the README and the docs runs, as written, and stops at a notice.

Each ``python`` block with a whole loop (``restore()`` and ``ckpt.step(``) is taken from the
page unchanged, except that the ``...`` placeholder ("one optimizer step") becomes a real
optimizer step that counts itself. A real SIGTERM is sent to the process right after
``restore()``: the Checkpointer turns it into a checkpoint at the next step boundary, and the
loop must then stop. The check: every step the loop trained is in the last checkpoint (no
step is trained and then lost).
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainer_sdk
from trainer_sdk.checkpointer import Checkpointer

REPO = Path(__file__).resolve().parents[2]
PAGES = ["README.md", "docs/checkpointer.md", "docs/data-and-rng.md"]
_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)
_PLACEHOLDER = re.compile(r"^(\s*)\.\.\.(\s*#.*)?$", re.MULTILINE)


def _loops() -> list[Any]:
    out = []
    for page in PAGES:
        for i, block in enumerate(_BLOCK.findall((REPO / page).read_text())):
            if "ckpt.step(" in block and ".restore()" in block:  # a whole loop
                out.append(pytest.param(block, id=f"{page}#{i}"))
    return out


def test_the_docs_show_loops() -> None:
    assert len(_loops()) >= 3  # README, checkpointer.md, data-and-rng.md


class _Scaler:
    """A Stateful stand-in for a GradScaler (what README passes in ``extra``)."""

    def __init__(self) -> None:
        self.scale = 1.0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.scale = float(sd["scale"])


@pytest.mark.parametrize("block", _loops())
def test_a_documented_loop_stops_at_a_notice_and_loses_no_step(
    block: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATON_CHECKPOINT_URI", str(tmp_path / "ckpt"))
    for var in ("BATON_EVERY_STEPS", "BATON_KEEP_LAST", "BATON_CONTROL_DIR", "BATON_ATTEMPT"):
        monkeypatch.delenv(var, raising=False)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    dataset = TensorDataset(torch.randn(40, 4), torch.randn(40, 1))
    trained: list[int] = []

    def train_step(batch: Any = None) -> None:
        x = batch[0] if batch is not None else torch.ones(2, 4)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        trained.append(1)

    original_restore = Checkpointer.restore
    restored: list[int] = []

    def restore_then_sigterm(self: Checkpointer) -> int:
        start = original_restore(self)
        restored.append(start)
        os.kill(os.getpid(), signal.SIGTERM)  # the real signal; the Checkpointer handles it
        return start

    monkeypatch.setattr(Checkpointer, "restore", restore_then_sigterm)
    sampler = trainer_sdk.ResumableSampler(dataset, seed=0)
    namespace: dict[str, Any] = {
        "trainer_sdk": trainer_sdk,
        "DataLoader": DataLoader,
        "dataset": dataset,
        "model": model,
        "opt": opt,
        "sched": torch.optim.lr_scheduler.StepLR(opt, step_size=5),
        "scaler": _Scaler(),
        "loader": DataLoader(dataset, batch_size=8, sampler=sampler),
        "total_steps": 25,
        "start": 0,
        "train_one_optimizer_step": train_step,
        "train_step": train_step,
    }
    code = _PLACEHOLDER.sub(lambda m: f"{m.group(1)}train_step()", block)
    if "for step in range(start" in code:
        # The README's loop takes `start` from restore() on the line above it.
        assert "start = ckpt.restore()" in code
    exit_code: object = None
    try:
        exec(compile(code, "<doc loop>", "exec"), namespace)
    except SystemExit as e:
        exit_code = e.code
    ckpt = namespace["ckpt"]
    ckpt.close()
    assert restored == [0]
    assert trained, "the loop trained nothing"
    assert 0 < len(trained) < 25, "the loop did not stop at the notice"
    last = trainer_sdk.latest_step(str(tmp_path / "ckpt"))
    assert last == len(trained), (
        f"the loop trained {len(trained)} steps but the newest checkpoint is step {last}: "
        "steps were trained after the notice's checkpoint and would be lost"
    )
    if "sys.exit(75)" in block or "sys.exit(ckpt.exit_code)" in block:
        assert exit_code == 75  # a durable save: no memory tier here
