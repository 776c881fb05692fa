"""export_hf writes the model's config.json, so that the export loads as it is.

Without one, ``from_pretrained`` silently builds a default-shaped model of its class; so an
export without a config is refused unless asked for as ``weights_only``. The model is a tiny
LlamaForCausalLM built from a LlamaConfig (no download), trained one step so that no weight
is at its initial value, saved by the Checkpointer, exported, and loaded back with
``AutoModelForCausalLM.from_pretrained``: its logits equal the trained model's exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from baton_testing.tiny_llama import tiny_llama

from trainer_sdk import Checkpointer, hf


def _trained(tmp_path: Path) -> tuple[torch.nn.Module, Path]:
    model = tiny_llama(attention_dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    uri = tmp_path / "ckpt"
    with Checkpointer(uri, model=model, optimizer=opt, handle_sigterm=False) as ckpt:
        ckpt.save(1)
    return model.eval(), uri


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.arange(24).reshape(2, 12) % 64
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("shard_size", ["5GB", 20_000])  # one file; several plus the index
def test_export_with_the_config_loads_with_equal_logits(tmp_path: Path, shard_size: object) -> None:
    model, uri = _trained(tmp_path)
    out = tmp_path / "export"
    info = hf.export_hf(uri, out, config=model.config, max_shard_size=shard_size)
    assert info.config == str(out / "config.json")
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    if shard_size != "5GB":
        assert len(info.files) > 1
        assert (out / "model.safetensors.index.json").exists()

    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert type(loaded) is type(model)
    assert loaded.config.hidden_size == 16
    assert torch.equal(_logits(loaded.eval()), _logits(model))


def test_config_as_a_path_a_folder_or_a_dict(tmp_path: Path) -> None:
    model, uri = _trained(tmp_path)
    saved = tmp_path / "saved-config"
    model.config.save_pretrained(saved)
    for name, config in (
        ("file", saved / "config.json"),
        ("folder", str(saved)),
        ("dict", model.config.to_dict()),
    ):
        out = tmp_path / name
        hf.export_hf(uri, out, config=config)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
        assert torch.equal(_logits(loaded.eval()), _logits(model)), name


def test_no_config_is_refused_unless_weights_only(tmp_path: Path) -> None:
    model, uri = _trained(tmp_path)
    with pytest.raises(hf.HfExportError, match=r"config=model\.config.*weights_only=True"):
        hf.export_hf(uri, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before writing anything
    info = hf.export_hf(uri, tmp_path / "out", weights_only=True)
    assert info.config is None
    assert not (tmp_path / "out" / "config.json").exists()
    with pytest.raises(hf.HfExportError, match="contradict"):
        hf.export_hf(uri, tmp_path / "o2", config=model.config, weights_only=True)
    with pytest.raises(hf.HfExportError, match="is not a model config"):
        hf.export_hf(uri, tmp_path / "o3", config=42)
    with pytest.raises(hf.HfExportError, match="cannot read the config"):
        hf.export_hf(uri, tmp_path / "o4", config=tmp_path / "missing.json")


def test_cli_requires_config_or_weights_only(tmp_path: Path) -> None:
    model, uri = _trained(tmp_path)
    model.config.save_pretrained(tmp_path / "cfg")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "trainer_sdk", "export-hf", str(uri), *args],
            capture_output=True, text=True, timeout=300, check=False, env=env,
        )  # fmt: skip

    bare = cli(str(tmp_path / "a"))
    assert bare.returncode == 2
    assert "--config" in bare.stderr
    assert "--weights-only" in bare.stderr
    ok = cli(str(tmp_path / "b"), "--config", str(tmp_path / "cfg"))
    assert ok.returncode == 0, ok.stderr
    assert "and config.json" in ok.stdout
    assert "\r" not in ok.stderr  # stderr is a pipe here, not a terminal
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "b", local_files_only=True
    )
    assert torch.equal(_logits(loaded.eval()), _logits(model))
