"""A LoRA fine-tune (peft) through BatonTrainer on 3 gloo ranks under torchrun: the frozen base
is written once, every later save writes only the adapter, its optimizer state and the small
state, and a run killed twice and stopped by SIGTERM ends bitwise equal to an uninterrupted one.

The script is ``hf_train.py`` with ``HF_TEST_LORA=1``: a stock HF Trainer script whose model is
wrapped by ``peft.get_peft_model`` (LoRA on q_proj and v_proj, dropout on), nothing else
changed. 3 ranks: 4 optimizer steps per epoch of 2 micro-batches, 3 epochs, a save every 3
steps, ``save_total_limit=2``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from baton_testing import hf_runs

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

NPROC = 3
STEPS = 12
LORA = {"HF_TEST_LORA": "1"}


def _manifest(out: Path, step: int) -> Any:
    from trainer_sdk.api import read_manifest

    return read_manifest(str(out / "ckpt"), step)


def _steps(out: Path) -> list[int]:
    """The committed steps (a rotated-out step that holds referenced files has no manifest)."""
    manifests = (out / "ckpt").glob("step-*/manifest.json")
    return sorted(int(p.parent.name.removeprefix("step-")) for p in manifests)


def _written(m: Any) -> dict[str, int]:
    """The tensors this step's own files hold (not referenced), with their bytes."""
    return {
        k: sum(p.nbytes for p in t.pieces)
        for k, t in m.tensors.items()
        if any(m.files[p.file].step is None for p in t.pieces)
    }


@pytest.fixture(scope="module")
def lora_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lora-reference")
    assert hf_runs.run(out, nproc=NPROC, **LORA) == 0, hf_runs.tail(out)
    return out


def test_the_frozen_base_is_written_once(lora_reference: Path) -> None:
    kept = _steps(lora_reference)
    assert kept == [9, 12], kept  # save_total_limit=2
    for step in kept:
        m = _manifest(lora_reference, step)
        base = {k for k in m.tensors if k.startswith("model.") and "lora_" not in k}
        adapter = {k for k in m.tensors if k.startswith("model.") and "lora_" in k}
        assert base, "no frozen base in the checkpoint"
        assert len(adapter) == 8, adapter  # A and B of q_proj and v_proj in 2 layers
        written = _written(m)
        assert adapter <= set(written), f"step {step} did not write the adapter"
        # the base is read from the first save's files (step 3, rotated out, its referenced
        # files kept), never written again
        for key in base:
            assert {m.files[p.file].step for p in m.tensors[key].pieces} == {3}, (step, key)
        trainable = sum(written.values())  # adapter + its AdamW state + the small state
        own_json = sum(f.size for n, f in m.files.items() if f.step is None and n.endswith(".json"))
        print(
            f"\nstep {step}: wrote {m.total_bytes} B (tensors {trainable} B, per-rank JSON "
            f"{own_json} B), reuses {m.referenced_bytes} B of step 3"
        )
        # what the save wrote is the trainable state (its tensors, and the per-rank JSON that
        # holds the data position and the index) within 10 % for the safetensors headers
        assert m.total_bytes <= 1.1 * (trainable + own_json), (step, m.total_bytes)
        # the tensors written (adapter + AdamW state) are a fraction of the base's bytes; the
        # per-rank JSON (TrainerState, index, the PEFT config) does not grow with the model
        assert trainable < m.referenced_bytes / 4, (step, trainable)


def test_killed_twice_and_sigtermed_resumes_bitwise(lora_reference: Path, tmp_path: Path) -> None:
    # saves at 3, 6, 9: killed after steps 4 and 8 (resumed from 3 and 6); then rank 1 alone
    # gets SIGTERM after step 10, the ranks agree on a step and save it, and the last run ends.
    hf_runs.run_until_hang(tmp_path, 4, nproc=NPROC, **LORA)
    hf_runs.run_until_hang(tmp_path, 8, nproc=NPROC, **LORA)
    code = hf_runs.run(tmp_path, nproc=NPROC, HF_TEST_SIGTERM_AT="10", **LORA)
    assert code == 1, hf_runs.tail(tmp_path)  # torchrun turns a rank's 75 into 1
    assert "exitcode  : 75" in hf_runs.tail(tmp_path)
    saved = _steps(tmp_path)[-1]
    assert saved in (10, 11), _steps(tmp_path)
    manifest = json.loads((tmp_path / "ckpt" / f"step-{saved:012d}" / "manifest.json").read_text())
    assert manifest["trigger"] == "signal"
    assert hf_runs.run(tmp_path, nproc=NPROC, **LORA) == 0, hf_runs.tail(tmp_path)
    for rank in range(NPROC):  # every rank trained to the end
        assert max(s for s, _ in hf_runs.losses(tmp_path, rank)) == STEPS, rank
    hf_runs.assert_same_final(tmp_path, lora_reference)
    for rank in range(NPROC):
        ref = hf_runs.by_step(hf_runs.losses(lora_reference, rank))
        assert sorted(ref) == list(range(1, STEPS + 1))
        steps = hf_runs.steps(hf_runs.losses(tmp_path, rank), ref)
        # the replays are the steps after each kill's checkpoint; none after the SIGTERM save
        assert steps == [1, 2, 3, 4, *range(4, 9), *range(7, saved + 1), *range(saved + 1, 13)]


def test_the_adapter_exports_in_peft_layout(lora_reference: Path, tmp_path: Path) -> None:
    """``export-hf --adapter`` writes PEFT's own layout of the last step's adapter, its config
    from the checkpoint (BatonTrainer records ``model.peft_config``), and
    ``PeftModel.from_pretrained`` on the base gives the trained model, every tensor bitwise."""
    import subprocess
    import sys

    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path / "adapter-export"
    cli = [sys.executable, "-m", "trainer_sdk", "export-hf", str(lora_reference / "ckpt")]
    done = subprocess.run(
        [*cli, str(out), "--adapter"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "exported the adapter 'default' of step 12: 8 tensors" in done.stdout, done.stdout
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    # the config the checkpoint holds is the one PEFT's save_pretrained wrote in the script
    exported_config = json.loads((out / "adapter_config.json").read_text())
    script_config = json.loads((lora_reference / "adapter" / "adapter_config.json").read_text())
    script_config["target_modules"] = sorted(script_config["target_modules"])  # a set in PEFT
    assert exported_config == {**script_config, "inference_mode": True}
    saved = load_file(str(out / "adapter_model.safetensors"))
    assert all(".default." not in k and "lora_" in k for k in saved), sorted(saved)

    torch.manual_seed(0)  # the script's base, before the adapter
    base = LlamaForCausalLM(LlamaConfig.from_json_file(str(lora_reference / "config.json")))
    loaded = PeftModel.from_pretrained(base, str(out)).state_dict()
    final = load_file(str(lora_reference / "final.safetensors"))
    trained = {k.removeprefix("model."): v for k, v in final.items() if k.startswith("model.")}
    assert loaded.keys() == trained.keys()
    for key, tensor in trained.items():
        assert loaded[key].equal(tensor), f"{key} differs from the trained model"

    # the base with the adapter merged, as PEFT's merge_and_unload() gives it, bit for bit
    # (cli.main in this process: no second interpreter start)
    from transformers import AutoModelForCausalLM

    from trainer_sdk import cli as baton_cli

    merged = tmp_path / "merged"
    config = ["--config", str(lora_reference / "config.json")]
    args = ["export-hf", str(lora_reference / "ckpt"), str(merged), "--merge-adapter", *config]
    assert baton_cli.main(args) == 0
    got = AutoModelForCausalLM.from_pretrained(merged).state_dict()
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig.from_json_file(str(lora_reference / "config.json")))
    want = PeftModel.from_pretrained(base, str(out)).merge_and_unload().state_dict()
    assert got.keys() == want.keys()
    for key, tensor in want.items():
        assert got[key].equal(tensor), f"{key} differs from PEFT's merge"

    # an adapter name the checkpoint does not hold is refused, naming the ones it does
    wrong = subprocess.run(
        [*cli, str(tmp_path / "x"), "--adapter", "other"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert wrong.returncode == 1
    assert "no tensor of a PEFT adapter named 'other'" in wrong.stderr, wrong.stderr
    assert "adapters found: ['default']" in wrong.stderr, wrong.stderr
