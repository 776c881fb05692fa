"""A stock PyTorch Lightning script, run under torchrun, with Baton in its Trainer arguments.

A LightningModule (small MLP, AdamW, a StepLR stepped every optimizer step) trained with DDP on
gloo over a shuffled map-style dataset: Lightning puts its ``DistributedSampler`` under the
loader. The only Baton lines are ``plugins=[BatonCheckpointIO()]`` and
``callbacks=[BatonCallback(...)]`` (with ``enable_checkpointing=False``).

Every micro-batch loss is logged per rank as ``[step, float.hex, sample ids]`` in
``losses-<rank>.jsonl``; at the end each rank writes ``final-<rank>.json``: sha256 of every
weight and AdamW state tensor, and the learning rate.

Environment: ``LT_TEST_OUT``, ``BATON_CHECKPOINT_URI``, ``LT_TEST_EVERY`` (periodic saves,
default 4), ``LT_TEST_SIGTERM_AT`` (rank 1 sends itself SIGTERM while training that step: a
real signal, the other rank hears of it only through the agreement), ``LT_TEST_HANG_AT``
(every rank writes ``hung-<rank>`` and sleeps while training that step, to be SIGKILLed),
``LT_TEST_REQUEST_AT`` (rank 0 writes a checkpoint request into ``$BATON_CONTROL_DIR`` while
training that step, as the sidecar does for the operator), ``LT_TEST_HOLD_AT`` (after that
optimizer step, before Baton's step boundary, every rank writes ``held-<rank>`` and waits for
the file ``release``: the operator's cluster test gives a notice while the job is held),
``LT_TEST_ASYNC=1`` (Lightning's ``AsyncCheckpointIO`` around the plugin: periodic saves in its
writer thread).

One process per device: under ``torchrun`` on one machine (``LOCAL_WORLD_SIZE`` processes), or
one per pod under the operator (``WORLD_SIZE`` pods of one process each, ``NODE_RANK`` set):
``Trainer(devices=LOCAL_WORLD_SIZE, num_nodes=WORLD_SIZE // LOCAL_WORLD_SIZE)``, Lightning's own
multi-node DDP.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch import nn
from torch.utils.data import DataLoader, Dataset

from trainer_sdk.control import ControlChannel
from trainer_sdk.integrations.lightning import BatonCallback, BatonCheckpointIO

OUT = Path(os.environ["LT_TEST_OUT"])
SIGTERM_AT = int(os.environ.get("LT_TEST_SIGTERM_AT", "0"))
HANG_AT = int(os.environ.get("LT_TEST_HANG_AT", "0"))
REQUEST_AT = int(os.environ.get("LT_TEST_REQUEST_AT", "0"))
HOLD_AT = int(os.environ.get("LT_TEST_HOLD_AT", "0"))
ASYNC = os.environ.get("LT_TEST_ASYNC") == "1"


class Numbers(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 16, generator=g)
        self.y = torch.randn(n, 4, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class Model(pl.LightningModule):
    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
        self._log = (OUT / f"losses-{int(os.environ['RANK'])}.jsonl").open("a")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, ids = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        step = self.trainer.global_step + 1
        self._log.write(json.dumps([step, float(loss.item()).hex(), ids.tolist()]) + "\n")
        self._log.flush()
        if step == SIGTERM_AT and self.global_rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        if step == REQUEST_AT and self.global_rank == 0:  # as the sidecar would, for the operator
            ControlChannel(os.environ["BATON_CONTROL_DIR"]).merge_request(
                deadline=datetime.now(UTC) + timedelta(seconds=60), reason="node drain"
            )
        if step == HANG_AT:  # the test SIGKILLs the job here (a node lost without notice)
            (OUT / f"hung-{self.global_rank}").write_text(str(step))
            time.sleep(600)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Hold(pl.Callback):
    """After optimizer step ``HOLD_AT``, wait for the test's ``release`` file (listed before
    BatonCallback, so it runs before Baton's step boundary)."""

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step != HOLD_AT or (OUT / f"held-{trainer.global_rank}").exists():
            return
        (OUT / f"held-{trainer.global_rank}").write_text(str(HOLD_AT))
        while not (OUT / "release").exists():
            time.sleep(0.1)


def _hashes(model: Model) -> dict[str, Any]:
    opt = model.trainer.optimizers[0]
    out: dict[str, Any] = {"lr": opt.param_groups[0]["lr"]}
    for name, p in model.named_parameters():
        out[name] = hashlib.sha256(p.detach().numpy().tobytes()).hexdigest()
        for k, v in opt.state[p].items():
            out[f"{name}/{k}"] = hashlib.sha256(v.detach().numpy().tobytes()).hexdigest()
    return out


def main() -> None:
    rank = int(os.environ["RANK"])
    (OUT / f"pid-{rank}").write_text(str(os.getpid()))
    pl.seed_everything(0)
    model = Model()
    loader = DataLoader(Numbers(72), batch_size=4, shuffle=True)
    devices = int(os.environ["LOCAL_WORLD_SIZE"])
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, num_nodes=int(os.environ["WORLD_SIZE"]) // devices,
        strategy="ddp", max_epochs=2,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(OUT), deterministic=True,
        enable_checkpointing=False,
        plugins=[AsyncCheckpointIO(BatonCheckpointIO()) if ASYNC else BatonCheckpointIO()],
        callbacks=[
            *([Hold()] if HOLD_AT else []),
            BatonCallback(every_n_steps=int(os.environ.get("LT_TEST_EVERY", "4"))),
        ],
    )  # fmt: skip
    trainer.fit(model, loader)
    (OUT / f"final-{rank}.json").write_text(json.dumps(_hashes(model)))


if __name__ == "__main__":
    main()
