"""Numbers the Checkpointer reads from the environment: a value that is not a number stops it
at construction with an error that names the variable and the fix (nothing is saved)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from trainer_sdk.checkpointer import Checkpointer
from trainer_sdk.errors import CheckpointError


def _state() -> dict[str, nn.Module | torch.optim.Optimizer]:
    model = nn.Linear(2, 2)
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}


def test_every_seconds_from_the_environment_is_a_float(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATON_EVERY_SECONDS", " 2.5 ")
    ck = Checkpointer(str(tmp_path), **_state())
    try:
        assert ck.config.every_seconds == 2.5
    finally:
        ck.close()


_NOT_AN_INTEGER = "is not an integer: set it to a whole number"


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("BATON_EVERY_STEPS", "1.5", f"$BATON_EVERY_STEPS='1.5' {_NOT_AN_INTEGER}"),
        ("BATON_KEEP_LAST", "all", f"$BATON_KEEP_LAST='all' {_NOT_AN_INTEGER}"),
        (
            "BATON_EVERY_SECONDS",
            "soon",
            "$BATON_EVERY_SECONDS='soon' is not a number: set it to seconds",
        ),
    ],
)
def test_a_setting_that_is_not_a_number_names_the_variable_and_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, value: str, message: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(CheckpointError) as e:
        Checkpointer(str(tmp_path), **_state())
    assert str(e.value) == message
    assert not any(tmp_path.iterdir()), "nothing is written before the settings are valid"
