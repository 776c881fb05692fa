"""What the DCP backend stores besides Baton's own format: non-tensor values as Baton's tagged
JSON, and DCP's flatten mappings in the manifest's ``extra``."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, Final

from trainer_sdk.errors import CheckpointError
from trainer_sdk.format._tree import TreeDecoder, flatten

EXTRA_KEY: Final = "dcp"
"""Where the manifest's ``extra`` keeps what DCP's planner recorded (its flatten mappings)."""


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def json_planner_data(planner_data: Any) -> Any:
    """DCP's flatten mappings (fqn -> path of str/int) as JSON; anything else is dropped."""
    if not isinstance(planner_data, Mapping):
        return None
    out: dict[str, list[Any]] = {}
    for fqn, path in planner_data.items():
        if isinstance(path, (tuple, list)) and all(isinstance(p, (str, int)) for p in path):
            out[str(fqn)] = list(path)
    return out


def encode_value(fqn: str, value: Any) -> Any:
    """A non-tensor value as Baton's tagged JSON (tuples, non-str keys, nan and dtypes kept)."""
    flat = flatten({"v": value})
    if flat.entries:
        raise CheckpointError(
            f"the value {fqn!r} holds tensors inside a non-tensor container DCP did not "
            "flatten; flatten it (flatten_state_dict=True, the default)"
        )
    return flat.tree["v"]


def decode_value(value: Any, fqn: str) -> Any:
    def no_tensor(key: str, cur: Any) -> Any:
        raise CheckpointError(f"{fqn!r}: a tensor reference {key!r} inside a JSON value")

    return TreeDecoder(no_tensor, strict=False).node(None, value, value, fqn)
