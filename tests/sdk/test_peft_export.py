"""The PEFT adapter export of a LoRA model saved by a plain Checkpointer: it is what PEFT's own
``save_pretrained`` writes (LoRA and DoRA), and adapters that hold more than LoRA matrices are
refused before anything is written. The 3-rank BatonTrainer run and its export are in
``tests/integrations/test_peft_lora_resume.py``. The model is a tiny LlamaForCausalLM from a
LlamaConfig (no download) wrapped by ``get_peft_model``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from baton_testing.tiny_llama import tiny_llama
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file

from trainer_sdk import Checkpointer, hf

TARGETS = ["q_proj", "v_proj"]


def _saved(tmp_path: Path, **lora: Any) -> tuple[Any, Path]:
    base = tiny_llama()
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, **lora))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero; any value shows a wrong mapping
                p.copy_(torch.randn_like(p))
    uri = tmp_path / "ckpt"
    with Checkpointer(uri, model=model, handle_sigterm=False) as ckpt:
        ckpt.save(1)
    return model, uri


@pytest.mark.parametrize("lora", [{}, {"use_dora": True}], ids=["lora", "dora"])
def test_adapter_export_is_what_peft_save_pretrained_writes(
    tmp_path: Path, lora: dict[str, Any]
) -> None:
    model, uri = _saved(tmp_path, **lora)
    model.save_pretrained(str(tmp_path / "peft"))
    hf.export_peft_adapter(uri, tmp_path / "ours", adapter_config=model.peft_config["default"])
    want = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    got = load_file(str(tmp_path / "ours" / "adapter_model.safetensors"))
    assert got.keys() == want.keys()
    for key, tensor in want.items():
        assert got[key].equal(tensor), key
    got_config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    want_config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    want_config["target_modules"] = sorted(want_config["target_modules"])  # a set in PEFT
    # save_pretrained adds the base's class for AutoPeftModel when the config has no
    # task_type; the config itself does not hold it
    assert want_config.pop("auto_mapping") is not None
    assert got_config.pop("auto_mapping") is None
    assert got_config == want_config


@pytest.mark.parametrize(
    ("lora", "named"),
    [({"modules_to_save": ["lm_head"]}, "modules_to_save"), ({"bias": "all"}, "bias='all'")],
)
def test_an_adapter_with_more_than_lora_matrices_is_refused(
    tmp_path: Path, lora: dict[str, Any], named: str
) -> None:
    """PEFT saves these beside the LoRA matrices; an export without them would load wrong."""
    model, uri = _saved(tmp_path, **lora)
    with pytest.raises(hf.HfExportError, match="save_pretrained") as e:
        hf.export_peft_adapter(uri, tmp_path / "a", adapter_config=model.peft_config["default"])
    assert named in str(e.value)
    assert not (tmp_path / "a").exists()
