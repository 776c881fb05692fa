"""Baton's trainer SDK: save and restore the whole training state, exactly.

Importing ``trainer_sdk`` is cheap and does not import torch. The public names below are
loaded on first use (PEP 562), so torch-free modules such as :mod:`trainer_sdk.control`
can be used by the sidecar without pulling torch into its process.

Type checkers do not run ``__getattr__``: they read the ``TYPE_CHECKING`` imports below, so a
user's mypy sees the real ``Checkpointer``, ``save`` and errors, not ``Any``. Every name in
``_LAZY`` has its import there (``tests/sdk/test_public_types.py`` runs mypy on a user script
and fails on any public name that is ``Any``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from trainer_sdk._version import __version__

if TYPE_CHECKING:
    from trainer_sdk.api import LoadInfo as LoadInfo
    from trainer_sdk.api import SaveInfo as SaveInfo
    from trainer_sdk.api import cleanup_incomplete as cleanup_incomplete
    from trainer_sdk.api import delete_step as delete_step
    from trainer_sdk.api import latest_step as latest_step
    from trainer_sdk.api import list_steps as list_steps
    from trainer_sdk.api import load as load
    from trainer_sdk.api import save as save
    from trainer_sdk.checkpointer import Checkpointer as Checkpointer
    from trainer_sdk.checkpointer import RestoreInfo as RestoreInfo
    from trainer_sdk.checkpointer import ResumeError as ResumeError
    from trainer_sdk.errors import BatonError as BatonError
    from trainer_sdk.errors import CheckpointError as CheckpointError
    from trainer_sdk.errors import CollectiveTimeoutError as CollectiveTimeoutError
    from trainer_sdk.errors import CorruptCheckpointError as CorruptCheckpointError
    from trainer_sdk.errors import IncompleteCheckpointError as IncompleteCheckpointError
    from trainer_sdk.errors import ManifestError as ManifestError
    from trainer_sdk.errors import RankFailedError as RankFailedError
    from trainer_sdk.errors import StorageError as StorageError
    from trainer_sdk.errors import SupersededError as SupersededError
    from trainer_sdk.errors import UnreadableCheckpointError as UnreadableCheckpointError
    from trainer_sdk.errors import UnsupportedFormatError as UnsupportedFormatError
    from trainer_sdk.exiting import exit_now as exit_now
    from trainer_sdk.exiting import run as run
    from trainer_sdk.format._types import RankLocal as RankLocal
    from trainer_sdk.format._types import Stateful as Stateful
    from trainer_sdk.hf import export_hf as export_hf
    from trainer_sdk.hf import export_peft_adapter as export_peft_adapter
    from trainer_sdk.loop._promotion import promote as promote
    from trainer_sdk.sampler import ResumableSampler as ResumableSampler
    from trainer_sdk.staging import AsyncSaveHandle as AsyncSaveHandle
    from trainer_sdk.staging import async_save as async_save
    from trainer_sdk.wire import EXIT_RESTART_IN_PLACE as EXIT_RESTART_IN_PLACE
    from trainer_sdk.wire import EXIT_STOPPED_AFTER_NOTICE as EXIT_STOPPED_AFTER_NOTICE

# public name -> submodule that defines it (keep in step with the TYPE_CHECKING imports above)
_LAZY: dict[str, str] = {
    "save": "api",
    "load": "api",
    "latest_step": "api",
    "async_save": "staging",
    "AsyncSaveHandle": "staging",
    "SaveInfo": "api",
    "LoadInfo": "api",
    "Checkpointer": "checkpointer",
    "ResumeError": "checkpointer",
    "ResumableSampler": "sampler",
    "export_hf": "hf",
    "export_peft_adapter": "hf",
    "Stateful": "format._types",
    "BatonError": "errors",
    "CheckpointError": "errors",
    "list_steps": "api",
    "delete_step": "api",
    "cleanup_incomplete": "api",
    "RankLocal": "format._types",
    "CorruptCheckpointError": "errors",
    "IncompleteCheckpointError": "errors",
    "ManifestError": "errors",
    "CollectiveTimeoutError": "errors",
    "RankFailedError": "errors",
    "StorageError": "errors",
    "SupersededError": "errors",
    "UnreadableCheckpointError": "errors",
    "UnsupportedFormatError": "errors",
    "EXIT_RESTART_IN_PLACE": "wire",
    "EXIT_STOPPED_AFTER_NOTICE": "wire",
    "promote": "loop._promotion",
    "RestoreInfo": "checkpointer",
    "run": "exiting",
    "exit_now": "exiting",
}

__all__ = ["__version__", *_LAZY]  # noqa: PLE0604 - the lazy names are all str


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer_sdk' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
