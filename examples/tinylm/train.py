"""A small decoder-only transformer language model, trained with DDP over gloo on the CPU.

This is Baton's example trainer: it uses the SDK the way a user would (a Checkpointer,
``restore()``, ``step()``) and is deterministic, so that a run preempted any number of times
ends with exactly the weights of a run that never was. The demo and the end-to-end tests run it.

The text is generated from a seeded toy grammar, so the example needs no download.

Run it alone (one process)::

    python examples/tinylm/train.py --steps 60 --uri /tmp/ckpt --loss-log /tmp/loss.jsonl

or under torchrun (two processes on this machine)::

    torchrun --standalone --nproc-per-node 2 examples/tinylm/train.py \\
        --steps 6 --every-steps 3 --uri /tmp/ckpt --loss-log /tmp/loss.jsonl

or under the operator; torchrun and the operator set RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT. The loss log's flag is ``--loss-log``, not ``--log``: torchrun reads every option
on its command line, the script's too, as an abbreviation of its own, and ``--log`` matches
``--log-dir`` and ``--logs-specs`` ("ambiguous option", exit 2;
``tests/foundation/test_tinylm_recipe.py`` runs the recipe above as written).

``--d-model`` and ``--n-layers`` (or ``TINYLM_D_MODEL``, ``TINYLM_N_LAYERS``) size the model: the
default 64 x 2 is a state of about 1.3 MiB (weights and AdamW's moments), 1024 x 2 about 290
MiB, whose save is no longer free (``bench/goodput.py`` runs that). The loss log's ``done``
event gives the state's size in bytes.

``--plain-checkpoint-dir DIR`` turns Baton off and checkpoints the way most training scripts do
today: every ``--plain-every-steps`` steps, rank 0 writes the model, optimizer and scheduler
state with ``torch.save`` to ``DIR/step-N.pt``, and a restarted run resumes from the newest file
(the data order and the random streams start afresh, as they do in such scripts). It is the
baseline ``bench/goodput.py`` measures Baton against; none of it is Baton's checkpoint path,
which never pickles.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import math
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - the usual torch alias
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

import trainer_sdk

# --------------------------------------------------------------------------- data


def seconds_since_exec() -> float | None:
    """Seconds since this process started (its exec: interpreter start-up and imports
    included), from /proc; None where there is no /proc."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(
            float(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return time.time() - (boot + start_ticks / os.sysconf("SC_CLK_TCK"))


def generate_corpus(n_sentences: int, seed: int) -> str:
    """Sentences from a tiny seeded grammar: enough structure for the loss to fall."""
    rng = random.Random(seed)
    subjects = ["the cat", "a dog", "the old ship", "my friend", "the spot node", "a rank"]
    verbs = ["sees", "saves", "restores", "trains", "loses", "finds", "keeps"]
    objects = ["the checkpoint", "a step", "the weights", "every shard", "the manifest", "it"]
    tails = ["", " today", " again", " before the deadline", " exactly", " on time"]
    out = []
    for _ in range(n_sentences):
        out.append(
            f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}{rng.choice(tails)}."
        )
    return " ".join(out)


class CharWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Fixed windows over a character stream; the targets are the inputs shifted by one."""

    def __init__(self, text: str, context: int) -> None:
        vocab = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(vocab)}
        self.vocab_size = len(vocab)
        self.data = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)
        self.context = context
        self.count = (len(self.data) - 1) // context

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.context
        # A little randomness in the data path (numpy and python), as real pipelines have:
        # the SDK must restore both streams for the resumed run to see the same batches.
        jitter = int(np.random.randint(0, 3)) + random.randint(0, 1)
        start = min(start + jitter, len(self.data) - self.context - 1)
        chunk = self.data[start : start + self.context + 1]
        return chunk[:-1], chunk[1:]


# --------------------------------------------------------------------------- model


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    vocab_size: int
    context: int = 64
    """Tokens per window."""
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    dropout: float = 0.1
    """Dropout makes the run depend on the torch RNG, which the SDK must restore."""


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied embeddings
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        # Small initial weights keep the first losses near log(vocab), as in GPT-2.
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def warmup_cosine(warmup: int, total: int):  # type: ignore[no-untyped-def]
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def weights_sha256(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in the model's and the optimizer's state (what a save writes)."""
    tensors = list(model.state_dict().values())
    for per_param in optimizer.state_dict()["state"].values():
        tensors += [t for t in per_param.values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


# --------------------------------------------------------------------------- the baseline


class PlainCheckpoint:
    """What a training script without Baton does: ``torch.save`` every N steps, newest wins.

    Rank 0 writes ``step-N.pt`` (model, optimizer, scheduler, step) through a temporary file
    and a rename; every rank loads the newest on start. No notice handling, no data-loader or
    RNG state: after a restart the data order and dropout masks differ from an uninterrupted
    run's, as they do in such scripts. The benchmark's baseline, not Baton's path.
    """

    exit_code = 0

    def __init__(
        self,
        *,
        directory: str,
        every_steps: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        rank: int,
    ) -> None:
        self.dir = directory
        self.every = every_steps
        self.model, self.optimizer, self.scheduler, self.rank = model, optimizer, scheduler, rank
        self.last_bytes = 0
        self.saves = 0
        os.makedirs(directory, exist_ok=True)

    def restore(self) -> int:
        files = sorted(
            f for f in os.listdir(self.dir) if f.startswith("step-") and f.endswith(".pt")
        )
        if not files:
            return 0
        # The baseline as users write it; weights_only refuses arbitrary objects.
        state = torch.load(os.path.join(self.dir, files[-1]), weights_only=True)  # noqa: TID251
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        return int(state["step"])

    def step(self, step: int) -> bool:
        if step % self.every == 0 and self.rank == 0:
            path = os.path.join(self.dir, f"step-{step:08d}.pt")
            state = {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "step": step,
            }
            torch.save(state, path + ".tmp")
            self.last_bytes = os.path.getsize(path + ".tmp")
            self.saves += 1
            os.replace(path + ".tmp", path)
        return False

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=int(os.environ.get("TINYLM_STEPS", "200")))
    parser.add_argument(
        "--uri", default=None, help="checkpoint URI (default $BATON_CHECKPOINT_URI)"
    )
    parser.add_argument(
        "--loss-log", default=os.environ.get("TINYLM_LOG"), help="JSON-lines loss log (rank 0)"
    )
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--every-steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--step-sleep",
        type=float,
        default=float(os.environ.get("TINYLM_STEP_SLEEP", "0")),
        help="seconds to sleep per step, so that a demo has time to preempt mid-run",
    )
    parser.add_argument(
        "--plain-checkpoint-dir",
        default=None,
        help="no Baton: torch.save checkpoints to this directory (the benchmark's baseline)",
    )
    parser.add_argument("--plain-every-steps", type=int, default=10)
    parser.add_argument(
        "--d-model",
        type=int,
        default=int(os.environ.get("TINYLM_D_MODEL", "64")),
        help="width; with --n-layers sets the state's size (about 12 x 12 x d^2 x layers bytes)",
    )
    parser.add_argument("--n-layers", type=int, default=int(os.environ.get("TINYLM_N_LAYERS", "2")))
    args = parser.parse_args(argv)

    # Where a (re)start's seconds go, for bench/goodput.py: up to here, the interpreter and
    # the imports; then the rendezvous; then the set-up (the determinism flag, whose first call
    # imports torch's compiler stack, most of the set-up's time; data, model, DDP's broadcast,
    # the Checkpointer); then the restore.
    launched = seconds_since_exec()
    t_rdzv = time.monotonic()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rendezvous_seconds = time.monotonic() - t_rdzv
    rank = dist.get_rank() if dist.is_initialized() else 0

    # Determinism: same seeds on every rank for the model, per-rank seeds for the data path.
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)
    text = generate_corpus(4000, seed=args.seed)
    data = CharWindows(text, context=64)
    cfg = ModelConfig(
        vocab_size=data.vocab_size, context=64, d_model=args.d_model, n_layers=args.n_layers
    )
    model: nn.Module = TinyLM(cfg)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    if world_size > 1:
        model = DistributedDataParallel(model)

    sampler = trainer_sdk.ResumableSampler(data, shuffle=True, seed=args.seed)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, num_workers=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(warmup=max(1, args.steps // 10), total=args.steps)
    )

    ckpt: trainer_sdk.Checkpointer | PlainCheckpoint
    if args.plain_checkpoint_dir:
        ckpt = PlainCheckpoint(
            directory=args.plain_checkpoint_dir,
            every_steps=args.plain_every_steps,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            rank=rank,
        )
    else:
        ckpt = trainer_sdk.Checkpointer(
            uri=args.uri,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            dataloader=loader,
            every_steps=args.every_steps,
        )
    t0 = time.monotonic()
    setup_seconds = t0 - t_rdzv - rendezvous_seconds
    start = ckpt.restore()
    restore_seconds = time.monotonic() - t0
    attempt = os.environ.get("BATON_ATTEMPT", "0")
    log = open(args.loss_log, "a", encoding="utf-8") if (args.loss_log and rank == 0) else None  # noqa: SIM115
    if rank == 0:
        print(
            f"tinylm: world {world_size}, resuming at step {start} "
            f"(restore took {restore_seconds:.3f} s)",
            flush=True,
        )
        if log:
            log.write(
                json.dumps(
                    {
                        "event": "start",
                        "step": start,
                        "attempt": attempt,
                        "restore_seconds": restore_seconds,
                        "launch_seconds": launched,
                        "rendezvous_seconds": rendezvous_seconds,
                        "setup_seconds": setup_seconds,
                        "time": time.time(),
                    }
                )
                + "\n"
            )
            log.flush()

    def batches_forever() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # sampler.track() counts what the loop consumed (exact under prefetching) and starts
        # each epoch without drawing from the global RNG, as a plain iter(loader) would.
        while True:
            yield from sampler.track(loader)

    stopped_early = False
    batches = batches_forever()
    for step in range(start, args.steps):
        inputs, targets = next(batches)
        model.train()
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        if log:
            log.write(
                json.dumps(
                    {"step": step + 1, "loss": loss.item(), "attempt": attempt, "time": time.time()}
                )
                + "\n"
            )
            log.flush()
        if rank == 0 and (step + 1) % 10 == 0:
            print(f"tinylm: step {step + 1}/{args.steps} loss {loss.item():.4f}", flush=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        saves = ckpt.saves if isinstance(ckpt, PlainCheckpoint) else 0
        if ckpt.step(step + 1):
            stopped_early = True
            if rank == 0:
                print(f"tinylm: checkpointed step {step + 1} on notice; exiting", flush=True)
            break
        if log and isinstance(ckpt, PlainCheckpoint) and ckpt.saves != saves:
            saved = {"event": "saved", "step": step + 1, "bytes": ckpt.last_bytes}
            log.write(json.dumps({**saved, "time": time.time()}) + "\n")
            log.flush()
    ckpt.close()

    if not stopped_early and rank == 0:
        core = model.module if isinstance(model, DistributedDataParallel) else model
        digest = weights_sha256(core)
        print(f"tinylm: done at step {args.steps}; weights sha256 {digest}", flush=True)
        if log:
            done = {"event": "done", "step": args.steps, "sha256": digest}
            log.write(json.dumps({**done, "state_bytes": state_bytes(core, optimizer)}) + "\n")
    if log:
        log.close()
    # EX_TEMPFAIL after an emergency save: the operator then knows this rank stopped for a
    # notice and will resume it, rather than count it as finished (docs/contracts.md); 76
    # after a commit to the memory tier, whose pods are kept and restart in place.
    code = ckpt.exit_code if stopped_early else 0
    if dist.is_initialized():
        # DDP (and the Checkpointer, which holds it) goes before the process group: see
        # docs/checkpointer.md, after the loop example (a hang at exit otherwise).
        del ckpt, model
        gc.collect()
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    # sys.exit(main()), without the second of module teardown torch's compiler stack costs:
    # the operator restarts this rank (or learns a peer's node is lost) once it has exited.
    trainer_sdk.run(main)
