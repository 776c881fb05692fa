"""Baton's trainer SDK: save and restore the whole training state, exactly.

Importing ``trainer_sdk`` is cheap and does not import torch. The public names below are
loaded on first use (PEP 562), so torch-free modules such as :mod:`trainer_sdk.control`
can be used by the sidecar without pulling torch into its process.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> submodule that defines it
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
    "Stateful": "_types",
    "BatonError": "errors",
    "CheckpointError": "errors",
    "list_steps": "api",
    "delete_step": "api",
    "cleanup_incomplete": "api",
    "RankLocal": "_types",
    "CorruptCheckpointError": "errors",
    "IncompleteCheckpointError": "errors",
    "ManifestError": "errors",
    "CollectiveTimeoutError": "errors",
    "RankFailedError": "errors",
    "StorageError": "errors",
    "EXIT_STOPPED_AFTER_NOTICE": "control",
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
