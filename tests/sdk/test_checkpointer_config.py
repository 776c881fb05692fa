"""CheckpointerConfig.from_env: arguments win over the environment, the environment over the
defaults; blank variables count as unset, and bad values name the variable or the setting."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch

from trainer_sdk.checkpointer import Checkpointer, CheckpointerConfig
from trainer_sdk.errors import CheckpointError

ENV = {
    "BATON_CHECKPOINT_URI": "s3://bucket/run",
    "BATON_EVERY_STEPS": "50",
    "BATON_EVERY_SECONDS": "90.5",
    "BATON_KEEP_LAST": "2",
    "BATON_CONTROL_DIR": "/run/baton",
}


def test_defaults_without_environment_or_arguments() -> None:
    assert CheckpointerConfig.from_env({}) == CheckpointerConfig()
    config = CheckpointerConfig()
    assert config.uri == "./checkpoints"
    assert config.keep_last == 3
    assert config.every_steps is None
    assert config.timeout == timedelta(minutes=10)


def test_the_environment_overrides_the_defaults() -> None:
    config = CheckpointerConfig.from_env(ENV)
    assert config.uri == "s3://bucket/run"
    assert config.every_steps == 50
    assert config.every_seconds == 90.5
    assert config.keep_last == 2
    assert config.control_dir == "/run/baton"


def test_arguments_override_the_environment_and_none_means_not_given() -> None:
    config = CheckpointerConfig.from_env(
        ENV, uri="/data/ckpt", every_steps=7, keep_last=None, control_dir="", timeout=30
    )
    assert config.uri == "/data/ckpt"
    assert config.every_steps == 7
    assert config.keep_last == 2  # None: the environment's value stands
    assert config.control_dir == "/run/baton"  # an empty directory is not given either
    assert config.timeout == timedelta(seconds=30)  # seconds become a timedelta


def test_blank_variables_count_as_unset() -> None:
    blank = dict.fromkeys(ENV, "  ")
    assert CheckpointerConfig.from_env(blank) == CheckpointerConfig()


def test_the_process_environment_is_read_when_none_is_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for var in ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("BATON_EVERY_STEPS", "12")
    assert CheckpointerConfig.from_env().every_steps == 12


def test_a_bad_value_names_the_variable_or_the_setting() -> None:
    with pytest.raises(CheckpointError, match=r"\$BATON_KEEP_LAST='two' is not an integer"):
        CheckpointerConfig.from_env({"BATON_KEEP_LAST": "two"})
    with pytest.raises(CheckpointError, match=r"keep_last=0: keep at least 1"):
        CheckpointerConfig.from_env({}, keep_last=0)
    with pytest.raises(CheckpointError, match=r"keep_last=0: keep at least 1"):
        CheckpointerConfig.from_env({"BATON_KEEP_LAST": "0"})  # refused, not replaced by 3
    with pytest.raises(TypeError, match=r"no setting \['every_step'\]"):
        CheckpointerConfig.from_env({}, every_step=5)


def test_stage_in_background_is_1_or_0_in_the_environment_and_an_argument_wins() -> None:
    assert CheckpointerConfig.from_env({"BATON_STAGE_IN_BACKGROUND": "1"}).stage_in_background
    assert not CheckpointerConfig.from_env({"BATON_STAGE_IN_BACKGROUND": "0"}).stage_in_background
    on = {"BATON_STAGE_IN_BACKGROUND": "1"}
    assert not CheckpointerConfig.from_env(on, stage_in_background=False).stage_in_background
    with pytest.raises(CheckpointError, match=r"BATON_STAGE_IN_BACKGROUND=2: set it to 1 \(on\)"):
        CheckpointerConfig.from_env({"BATON_STAGE_IN_BACKGROUND": "2"})


def test_writer_process_is_1_or_0_in_the_environment_and_an_argument_wins() -> None:
    assert CheckpointerConfig.from_env({"BATON_WRITER_PROCESS": "1"}).writer_process
    assert not CheckpointerConfig.from_env({}).writer_process
    on = {"BATON_WRITER_PROCESS": "1"}
    assert not CheckpointerConfig.from_env(on, writer_process=False).writer_process
    with pytest.raises(CheckpointError, match=r"BATON_WRITER_PROCESS=yes"):
        CheckpointerConfig.from_env({"BATON_WRITER_PROCESS": "yes"})
    with pytest.raises(CheckpointError, match=r"BATON_WRITER_PROCESS=2: set it to 1 \(on\)"):
        CheckpointerConfig.from_env({"BATON_WRITER_PROCESS": "2"})


def test_a_checkpointer_built_without_the_flags_takes_them_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Checkpointer(...) passed False for stage_in_background, which overrode
    # $BATON_STAGE_IN_BACKGROUND=1 (the goodput bench's --stage-in-background ran without it).
    monkeypatch.setenv("BATON_STAGE_IN_BACKGROUND", "1")
    monkeypatch.setenv("BATON_WRITER_PROCESS", "1")
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(uri=str(tmp_path), model=model, optimizer=opt, async_save=True)
    try:
        assert ckpt.config.stage_in_background
        assert ckpt.config.writer_process
    finally:
        ckpt.close()
    off = Checkpointer(
        uri=str(tmp_path), model=model, optimizer=opt, async_save=True,
        stage_in_background=False, writer_process=False,
    )  # fmt: skip
    try:
        assert not off.config.stage_in_background
        assert not off.config.writer_process
    finally:
        off.close()
