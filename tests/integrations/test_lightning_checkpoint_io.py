"""Baton's Lightning plugin and callback in one process: Lightning's checkpoint dict round
trips through a Baton step with nothing pickled, and every setting the integration cannot
honour is refused with the fix (the torchrun runs are in test_lightning_resume.py)."""

from __future__ import annotations

import math
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from trainer_sdk import latest_step
from trainer_sdk.control import ControlChannel
from trainer_sdk.integrations import IntegrationError
from trainer_sdk.integrations.lightning import BatonCallback, BatonCheckpointIO


def _lightning_like() -> dict[str, Any]:
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    return {
        "epoch": 1,
        "global_step": 7,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": {"net.0.weight": w, "net.0.bias": torch.ones(3)},
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 2}}}},
        "callbacks": {"BatonCallback": {"epoch": 1, "batches": 3}},
        "optimizer_states": [
            {
                "state": {0: {"step": torch.tensor(7.0), "exp_avg": w * 0.5}},
                "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "params": [0, 1]}],
            }
        ],
        "lr_schedulers": [{"step_size": 3, "gamma": 0.5, "_last_lr": [0.005], "best": math.inf}],
        "hparams_name": "kwargs",
        "hyper_parameters": {"lr": 0.01, "layers": [16, 32]},
    }


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return bool(a == b) and type(a) is type(b)


def test_lightnings_checkpoint_dict_round_trips_through_a_baton_step(tmp_path: Path) -> None:
    io = BatonCheckpointIO()
    checkpoint = _lightning_like()
    io.save_checkpoint(checkpoint, f"{tmp_path}/step-000000000007")
    assert latest_step(str(tmp_path)) == 7
    files = sorted(p.name for p in (tmp_path / "step-000000000007").iterdir())
    assert all(f.endswith((".json", ".safetensors")) for f in files), files  # no pickle
    assert _equal(io.load_checkpoint(tmp_path / "step-000000000007"), checkpoint)
    io.remove_checkpoint(f"{tmp_path}/step-000000000007")
    assert latest_step(str(tmp_path)) is None


def test_a_value_json_cannot_hold_is_refused_with_the_fix(tmp_path: Path) -> None:
    checkpoint = _lightning_like()
    checkpoint["hyper_parameters"]["data_dir"] = Path("/data")
    with pytest.raises(IntegrationError, match=r"'hyper_parameters\.data_dir' is a PosixPath"):
        BatonCheckpointIO().save_checkpoint(checkpoint, f"{tmp_path}/step-000000000007")
    checkpoint = _lightning_like()
    checkpoint["callbacks"]["Mine"] = {"seen": {1, 2}}
    with pytest.raises(IntegrationError, match=r"'callbacks\.Mine\.seen' is a set.*state_dict"):
        BatonCheckpointIO().save_checkpoint(checkpoint, f"{tmp_path}/step-000000000007")
    assert latest_step(str(tmp_path)) is None  # nothing committed


def test_a_path_that_is_not_a_step_and_unknown_options_are_refused(tmp_path: Path) -> None:
    io = BatonCheckpointIO()
    with pytest.raises(IntegrationError, match="enable_checkpointing=False"):
        io.save_checkpoint(_lightning_like(), f"{tmp_path}/epoch=0-step=7.ckpt")
    with pytest.raises(IntegrationError, match="not a Baton step"):
        io.load_checkpoint(f"{tmp_path}/last.ckpt")
    with pytest.raises(IntegrationError, match=r"storage_options \['compress'\]"):
        io.save_checkpoint(_lightning_like(), f"{tmp_path}/step-000000000007", {"compress": 1})


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(2, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Stream(IterableDataset[tuple[torch.Tensor]]):
    def __iter__(self) -> Any:
        return iter([(torch.ones(2),)] * 4)


def _fit(
    tmp_path: Path, loader: DataLoader[Any], *, max_steps: int = 2, **trainer_args: Any
) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
        **trainer_args,
    )  # fmt: skip
    trainer.fit(_Tiny(), loader)
    return trainer


def _loader() -> DataLoader[Any]:
    return DataLoader(TensorDataset(torch.ones(8, 2)), batch_size=2)


def test_the_callback_refuses_a_trainer_it_cannot_serve(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    uri = str(tmp_path / "ckpt")
    with pytest.raises(IntegrationError, match=r"enable_checkpointing=False"):
        _fit(tmp_path, _loader(), plugins=[BatonCheckpointIO()], callbacks=[BatonCallback(uri)])
    with pytest.raises(IntegrationError, match=r"plugins=\[BatonCheckpointIO\(\)\]"):
        _fit(tmp_path, _loader(), enable_checkpointing=False, callbacks=[BatonCallback(uri)])
    with pytest.raises(IntegrationError, match="IterableDataset"):
        _fit(
            tmp_path, DataLoader(_Stream(), batch_size=2), enable_checkpointing=False,
            plugins=[BatonCheckpointIO()], callbacks=[BatonCallback(uri)],
        )  # fmt: skip
    with pytest.raises(IntegrationError, match="no plain BatchSampler"):
        _fit(
            tmp_path, DataLoader(TensorDataset(torch.ones(8, 2)), batch_size=None),
            enable_checkpointing=False, plugins=[BatonCheckpointIO()],
            callbacks=[BatonCallback(uri)],
        )  # fmt: skip
    assert signal.getsignal(signal.SIGTERM) == before  # Baton's handler went with the run


def test_a_single_process_fit_saves_and_resumes_through_the_callback(tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    args: dict[str, Any] = {"enable_checkpointing": False, "plugins": [BatonCheckpointIO()]}
    _fit(tmp_path, _loader(), callbacks=[BatonCallback(uri, every_n_steps=1)], **args)
    assert latest_step(uri) == 2
    callback = BatonCallback(uri, every_n_steps=1)
    trainer = _fit(tmp_path, _loader(), max_steps=3, callbacks=[callback], **args)
    assert callback.restored_step == 2
    assert trainer.global_step == 3
    assert latest_step(uri) == 3


def test_async_periodic_saves_commit_in_lightnings_thread_and_report_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # AsyncCheckpointIO around the plugin: each periodic save is snapshotted on the training
    # thread and committed in Lightning's writer thread, which reports the commit itself.
    control = tmp_path / "control"
    control.mkdir()
    monkeypatch.setenv("BATON_CONTROL_DIR", str(control))
    uri = str(tmp_path / "ckpt")
    args: dict[str, Any] = {
        "enable_checkpointing": False, "plugins": [AsyncCheckpointIO(BatonCheckpointIO())],
    }  # fmt: skip
    _fit(tmp_path, _loader(), callbacks=[BatonCallback(uri, every_n_steps=1)], **args)
    assert latest_step(uri) == 2  # fit's end waited for the writer thread
    for step in (1, 2):  # each committed whole, every digest right
        verify = subprocess.run(
            [sys.executable, "-m", "trainer_sdk", "verify", uri, "--step", str(step)],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert verify.returncode == 0, verify.stdout + verify.stderr
    status = ControlChannel(control).read_local_status(0)
    assert status is not None
    assert (status.state.value, status.step, status.last_committed_step) == ("committed", 2, 2)
    assert status.trigger == "periodic"
    callback = BatonCallback(uri, every_n_steps=1)
    args["plugins"] = [AsyncCheckpointIO(BatonCheckpointIO())]
    _fit(tmp_path, _loader(), max_steps=3, callbacks=[callback], **args)
    assert callback.restored_step == 2
    assert latest_step(uri) == 3


class _SeesNotices(pl.Callback):
    """Records, once training runs, whether the Baton callback's notices have a memory tier."""

    def __init__(self, baton: BatonCallback) -> None:
        self.baton = baton
        self.seen: list[tuple[bool, tuple[str, ...], str | None]] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        notices = self.baton.notices
        assert notices is not None
        self.seen.append((notices.has_memory_tier, notices.fast_ignored, notices.config.fast_dir))


def test_fast_settings_build_no_memory_tier_and_warn_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # What the operator sets for spec.checkpoint.fastEverySteps: the callback takes no
    # snapshots, so it builds no tier (the tier would create its directory) and says so once.
    fast = tmp_path / "fast"
    monkeypatch.setenv("BATON_FAST_DIR", str(fast))
    monkeypatch.setenv("BATON_FAST_EVERY_STEPS", "1")
    uri = str(tmp_path / "ckpt")
    baton = BatonCallback(uri, every_n_steps=1)
    sees = _SeesNotices(baton)
    with caplog.at_level("WARNING", logger="trainer_sdk"):
        _fit(
            tmp_path, _loader(), enable_checkpointing=False, plugins=[BatonCheckpointIO()],
            callbacks=[baton, sees],
        )  # fmt: skip
    assert sees.seen == [(False, ("BATON_FAST_DIR", "BATON_FAST_EVERY_STEPS"), None)]
    assert not fast.exists()
    warnings = [r.getMessage() for r in caplog.records if "fastEverySteps" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("BATON_FAST_DIR and BATON_FAST_EVERY_STEPS are set")
    assert "unset spec.checkpoint.fastEverySteps" in warnings[0]
    assert latest_step(uri) == 2  # the durable saves go on as without the variables
