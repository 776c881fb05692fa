"""Exports of a PEFT (LoRA) model saved by a plain Checkpointer: the adapter with its config
recorded or passed in, the base model with the adapter merged, and what is refused.

A plain Checkpointer records no ``peft_config`` (``BatonTrainer`` does; its 3-rank run is
``tests/integrations/test_peft_lora_resume.py``), so an export without one names the fix; a
one-process BatonTrainer run shows the record, and a resume from a step saved without it.
The model is a tiny LlamaForCausalLM from a LlamaConfig (no download) wrapped by
``get_peft_model``, its LoRA B matrices made non-zero so that a merge changes the base.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from baton_testing.tiny_llama import tiny_llama
from peft import LoraConfig, PeftModel, get_peft_model

from trainer_sdk import Checkpointer, cli, hf
from trainer_sdk.integrations import transformers as baton_hf

TARGETS = ["q_proj", "v_proj"]


def _base() -> Any:
    return tiny_llama()


def _saved(tmp_path: Path, **lora: Any) -> tuple[Any, Path]:
    model = get_peft_model(_base(), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, **lora))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero: a merge would change nothing
                p.copy_(torch.randn_like(p))
    uri = tmp_path / "ckpt"
    with Checkpointer(uri, model=model, handle_sigterm=False) as ckpt:
        ckpt.save(1)
    return model, uri


def test_adapter_export_without_a_saved_config_asks_for_it(tmp_path: Path) -> None:
    model, uri = _saved(tmp_path)
    with pytest.raises(hf.HfExportError, match="step 1 holds no PEFT config") as e:
        hf.export_peft_adapter(uri, tmp_path / "a")
    assert "adapter_config=model.peft_config['default']" in str(e.value)
    assert not (tmp_path / "a").exists()  # refused before anything was written
    code = cli.main(["export-hf", str(uri), str(tmp_path / "a"), "--adapter"])
    assert code == 1

    out = tmp_path / "b"
    hf.export_peft_adapter(uri, out, adapter_config=model.peft_config["default"])
    loaded = PeftModel.from_pretrained(_base(), str(out)).state_dict()
    trained = model.state_dict()
    assert loaded.keys() == trained.keys()
    assert all(loaded[k].equal(t) for k, t in trained.items())


@pytest.mark.parametrize("use_rslora", [False, True])
def test_merged_export_equals_peft_merge_and_unload(tmp_path: Path, use_rslora: bool) -> None:
    model, uri = _saved(tmp_path, use_rslora=use_rslora)
    adapter = tmp_path / "adapter"
    model.peft_config["default"].save_pretrained(str(adapter))
    out = tmp_path / "merged"
    code = cli.main([
        "export-hf", str(uri), str(out), "--merge-adapter", "--adapter-config", str(adapter),
        "--config", str(_config_dir(tmp_path, model)),
    ])  # fmt: skip
    assert code == 0
    got = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    want = model.merge_and_unload().state_dict()
    assert got.keys() == want.keys()
    for key, tensor in want.items():
        assert got[key].equal(tensor), f"{key} differs from PEFT's merge"
    assert not got["model.layers.0.self_attn.q_proj.weight"].equal(
        _base().state_dict()["model.layers.0.self_attn.q_proj.weight"]
    )


def test_merge_refuses_what_it_cannot_merge(tmp_path: Path) -> None:
    model, uri = _saved(tmp_path, use_dora=True)
    with pytest.raises(hf.HfExportError, match=r"merges plain LoRA only.*merge_and_unload"):
        hf.export_hf(
            uri,
            tmp_path / "m",
            weights_only=True,
            merge_adapter="default",
            adapter_config=model.peft_config["default"],
        )
    assert not (tmp_path / "m").exists()
    with pytest.raises(hf.HfExportError, match="holds no PEFT config"):
        hf.export_hf(uri, tmp_path / "m", weights_only=True, merge_adapter="default")


def _config_dir(tmp_path: Path, model: Any) -> Path:
    path = tmp_path / "base-config"
    model.get_base_model().config.save_pretrained(str(path))
    return path


class _Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (12, 8), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class _StopAt(transformers.TrainerCallback):
    """Ends the run after optimizer step ``step`` (its save at that step still happens)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


def test_baton_trainer_records_the_config_and_resumes_a_step_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = tmp_path / "ckpt"

    def trainer(*callbacks: Any) -> Any:
        model = get_peft_model(_base(), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], disable_tqdm=True,
            per_device_train_batch_size=2, save_strategy="steps", save_steps=2, max_steps=4,
        )  # fmt: skip
        return baton_hf.BatonTrainer(
            model=model, args=args, train_dataset=_Tokens(), baton_uri=uri,
            callbacks=list(callbacks),
        )  # fmt: skip

    with monkeypatch.context() as m:  # step 2 saved as a Baton before the record saved it
        m.setattr(baton_hf, "_peft_configs", lambda model: None)
        trainer(_StopAt(2)).train()
    with pytest.raises(hf.HfExportError, match="step 2 holds no PEFT config"):
        hf.export_peft_adapter(uri, tmp_path / "a")

    resumed = trainer()
    resumed.train()  # restores step 2 under strict loading, then saves step 4 with the record
    assert resumed.state.global_step == 4
    info = hf.export_peft_adapter(uri, tmp_path / "b")
    assert info.step == 4
    exported = json.loads((tmp_path / "b" / "adapter_config.json").read_text())
    assert (exported["r"], exported["lora_alpha"], exported["target_modules"]) == (4, 8, TARGETS)
