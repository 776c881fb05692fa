"""A stock Hugging Face Trainer fine-tune of a tiny Llama, with the two lines BatonTrainer needs.

Run under torchrun (or alone), or as a TrainingJob's command (one process per pod, the
operator's RANK/WORLD_SIZE/MASTER_ADDR). Built from configs only (no download): a
LlamaForCausalLM with attention dropout on, AdamW, a cosine schedule with warmup, gradient
accumulation with a short last group per epoch, and a shuffled map-style dataset. Checkpoints
go where a stock script's would: ``$BATON_CHECKPOINT_URI`` (BatonTrainer's default).

Test hooks (environment):
  HF_TEST_OUT        folder for the per-step loss logs and the final state
  HF_TEST_HANG_AT    after this optimizer step, write hang-<rank> (its pid) and wait to be
                     SIGKILLed (torchrun starts every worker in a session of its own)
  HF_TEST_SIGTERM_AT after this optimizer step, rank 1 sends itself SIGTERM
  HF_TEST_LORA       "1": fine-tune a LoRA adapter (peft) on the frozen base instead, as a
                     stock PEFT script does (get_peft_model on the model, nothing else changes)
  HF_TEST_HOLD_AT    after this optimizer step (before Baton's step boundary), write
                     held-<rank> and wait until the test creates the file "release" (so that
                     a notice the test gives arrives while training is in progress); no wait
                     when "release" exists already

Exit status: 0 when training finished, 75 when it stopped after serving a notice.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
)

from trainer_sdk import EXIT_STOPPED_AFTER_NOTICE
from trainer_sdk.integrations.transformers import BatonTrainer

SAMPLES = 44  # 11 batches of 2 per rank on 2 ranks: 6 optimizer steps per epoch, the last short
SEQ = 16
VOCAB = 64
HOLD_LIMIT_S = 600


class TokenDataset(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Hooks(TrainerCallback):
    def __init__(self, out: Path, rank: int) -> None:
        self.out, self.rank = out, rank
        self.hang_at = int(os.environ.get("HF_TEST_HANG_AT", "0"))
        self.sigterm_at = int(os.environ.get("HF_TEST_SIGTERM_AT", "0"))
        self.hold_at = int(os.environ.get("HF_TEST_HOLD_AT", "0"))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.sigterm_at and self.rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        if state.global_step == self.hang_at:
            (self.out / f"hang-{self.rank}").write_text(str(os.getpid()))
            while True:  # the test SIGKILLs the whole process group here
                time.sleep(1)
        release = self.out / "release"
        if state.global_step == self.hold_at and not release.exists():
            (self.out / f"held-{self.rank}").write_text(str(os.getpid()))
            deadline = time.monotonic() + HOLD_LIMIT_S
            while not release.exists():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"held after step {self.hold_at} for {HOLD_LIMIT_S} s")
                time.sleep(0.1)


class LoggedTrainer(BatonTrainer):
    """Records every micro-batch loss exactly (float.hex), with its optimizer step."""

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        loss = super().training_step(model, inputs, num_items_in_batch)
        log_loss(self, loss)
        return loss


def log_loss(trainer: Any, loss: torch.Tensor) -> None:
    """Append one micro-batch loss, exactly (float.hex), with the optimizer step it is part of
    (shared with sft_train.py, which imports it: the script's folder is on its path)."""
    with (trainer.test_out / f"losses-{trainer.args.process_index}.jsonl").open("a") as f:
        f.write(json.dumps({"step": trainer.state.global_step + 1, "loss": loss.item().hex()}))
        f.write("\n")


def save_final(trainer: Any, model: torch.nn.Module, out: Path) -> None:
    """Rank 0's end state for the tests' bitwise comparison: the weights, every optimizer
    state tensor and the learning rates (final.safetensors), and the loss log history. Tied
    weights (GPT-2's lm_head and embedding) are saved as copies, one per name."""
    final = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    opt = trainer.optimizer.optimizer.state_dict()
    for pid, st in opt["state"].items():
        for name, value in st.items():
            final[f"optim.{pid}.{name}"] = torch.as_tensor(value).clone()
    final["lr"] = torch.tensor([g["lr"] for g in opt["param_groups"]], dtype=torch.float64)
    save_file({k: v.contiguous().clone() for k, v in final.items()}, str(out / "final.safetensors"))
    log_history = [e for e in trainer.state.log_history if "loss" in e]
    (out / "log_history.json").write_text(json.dumps(log_history))


def main() -> int:
    out = Path(os.environ["HF_TEST_OUT"])
    rank = int(os.environ.get("RANK", "0"))
    (out / f"pid-{rank}").write_text(str(os.getpid()))  # for the test's cleanup
    torch.use_deterministic_algorithms(True)
    lora = os.environ.get("HF_TEST_LORA") == "1"
    width = 64 if lora else 16  # the LoRA run's frozen base outweighs its adapter, as usual
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        attention_dropout=0.1,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.config._attn_implementation = "eager"
    if lora:
        from peft import LoraConfig, get_peft_model

        adapter = LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"]
        )
        model = get_peft_model(model, adapter)
    args = TrainingArguments(
        output_dir=str(out / "hf-output"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        num_train_epochs=3,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        weight_decay=0.01,
        optim="adamw_torch",
        logging_steps=1,
        save_strategy="steps",
        save_steps=3,
        save_total_limit=2,
        seed=1234,
        use_cpu=True,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = LoggedTrainer(
        model=model,
        args=args,
        train_dataset=TokenDataset(),
        data_collator=default_data_collator,
        callbacks=[Hooks(out, rank)],
    )
    trainer.test_out = out
    trainer.train()
    if trainer.preempted:
        assert trainer.exit_code == EXIT_STOPPED_AFTER_NOTICE  # no memory tier here
        return trainer.exit_code
    if rank == 0:
        save_final(trainer, model, out)
        model.config.to_json_file(str(out / "config.json"))  # for the export test
        if lora:  # the adapter's config, for the adapter export test
            model.peft_config["default"].save_pretrained(str(out / "adapter"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
