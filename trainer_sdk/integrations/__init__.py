"""Baton inside the training frameworks people already use.

* :mod:`trainer_sdk.integrations.transformers`: :class:`BatonTrainer`, a drop-in for the Hugging
  Face ``Trainer`` whose checkpoints are Baton checkpoints, and ``baton_trainer(cls)`` for any
  ``Trainer`` subclass (TRL's ``SFTTrainer``...).
* :mod:`trainer_sdk.integrations.lightning`: ``BatonCheckpointIO`` and ``BatonCallback``,
  Baton's checkpoints, resume and notices for PyTorch Lightning's ``Trainer.fit``.
* :mod:`trainer_sdk.integrations.torchtitan`: Baton as torchtitan's checkpoint manager.

Each submodule imports its framework; importing this package imports neither. The diffs a
user applies to a stock script, and what Baton adds, are in ``docs/integrations.md``.
"""

from __future__ import annotations

from trainer_sdk.errors import BatonError

__all__ = ["IntegrationError"]


class IntegrationError(BatonError):
    """A framework setting that Baton cannot honour exactly; the message names the fix."""
