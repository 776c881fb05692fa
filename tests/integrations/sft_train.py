"""A stock TRL ``SFTTrainer`` fine-tune of a tiny GPT-2, with Baton through ``baton_trainer``.

The diff to the stock script is the import and ``baton_trainer(SFTTrainer)`` in place of
``SFTTrainer`` (plus the exit code on a notice). Built without a download: a GPT-2 from a
``GPT2Config`` (dropout on), a word-level tokenizer built here, and a few rows of text in an
in-memory ``datasets.Dataset`` that SFTTrainer tokenizes itself (rows of different lengths, so
its collator pads). Two epochs of AdamW with a cosine schedule, gradient accumulation 2.

Test hooks (environment), as ``hf_train.py``'s: HF_TEST_OUT (loss logs, final state),
HF_TEST_HANG_AT (after this optimizer step, write hang-<rank> and wait to be SIGKILLed).

Exit status: 0 when training finished, 75 when it stopped after serving a notice.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

from trainer_sdk.integrations.transformers import baton_trainer

# The test hooks and the end-state dump of the HF test script beside this one (the script's
# folder is on sys.path when it runs).
from hf_train import Hooks, log_loss, save_final  # isort: skip

WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "under", "mat", "log", "red", "blue"]
ROWS = 24  # 12 per rank on 2 ranks: 6 batches of 2, 3 optimizer steps per epoch


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", "<eos>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>"
    )


def dataset() -> Dataset:
    g = torch.Generator().manual_seed(11)
    rows = []
    for _ in range(ROWS):
        n = int(torch.randint(4, 12, (1,), generator=g))
        idx = torch.randint(0, len(WORDS), (n,), generator=g).tolist()
        rows.append(" ".join(WORDS[i] for i in idx))
    return Dataset.from_dict({"text": rows})


class LoggedSFTTrainer(baton_trainer(SFTTrainer)):  # type: ignore[misc]
    """Records every micro-batch loss exactly (float.hex), with its optimizer step."""

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        loss = super().training_step(model, inputs, num_items_in_batch)
        log_loss(self, loss)
        return loss


def main() -> int:
    out = Path(os.environ["HF_TEST_OUT"])
    rank = int(os.environ.get("RANK", "0"))
    (out / f"pid-{rank}").write_text(str(os.getpid()))  # for the test's cleanup
    torch.use_deterministic_algorithms(True)
    tok = tokenizer()
    config = GPT2Config(
        vocab_size=len(tok),
        n_positions=32,
        n_embd=16,
        n_layer=2,
        n_head=2,
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    args = SFTConfig(
        output_dir=str(out / "sft-output"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        num_train_epochs=2,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=1,
        optim="adamw_torch",
        logging_steps=1,
        save_strategy="steps",
        save_steps=2,
        seed=1234,
        use_cpu=True,
        bf16=False,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        max_length=16,
    )
    trainer = LoggedSFTTrainer(
        model=model,
        args=args,
        train_dataset=dataset(),
        processing_class=tok,
        callbacks=[Hooks(out, rank)],
    )
    trainer.test_out = out
    trainer.train()
    if trainer.preempted:
        return int(trainer.exit_code)
    if rank == 0:
        save_final(trainer, model, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
