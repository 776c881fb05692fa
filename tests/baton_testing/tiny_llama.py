"""The tiny Llama the export and PEFT tests train: a real ``transformers`` model of a few
thousand parameters, built from seed 0 so that every test file gets the same weights."""

from __future__ import annotations

from typing import Any

import torch
import transformers

DEFAULTS: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 32,
}


def tiny_llama(**overrides: Any) -> Any:
    """A ``LlamaForCausalLM`` of :data:`DEFAULTS` (``overrides`` replace or add config
    fields), its weights drawn after ``torch.manual_seed(0)``."""
    config = transformers.LlamaConfig(**{**DEFAULTS, **overrides})
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)
