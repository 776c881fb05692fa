"""A small, deterministic training script: the workload of the exactness and preemption tests.

It has every source of state that an exact resume must carry: dropout (torch's CPU RNG), AdamW
moments, a step LR schedule, a CPU ``GradScaler`` whose scale grows, a shuffled ``DataLoader``
over a :class:`~trainer_sdk.ResumableSampler`, and noise drawn from numpy's and python's global
RNGs inside the dataset's ``__getitem__``. Run it on one process, or on several with the usual
torch environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``: gloo + DDP)::

    python -m baton_testing.trainer --steps 40 --uri /tmp/ck --every-steps 5 \\
        --loss-log /tmp/loss.log --result /tmp/result.json

Outputs:

* ``--loss-log PATH``: one line per optimizer step, ``<step> <rank> <loss as float.hex()>``,
  appended (rank 0 writes PATH, rank r > 0 writes ``PATH.rank<r>``), so segments of an
  interrupted run can be compared bitwise with an uninterrupted run, step by step.
* ``--result PATH`` (rank 0): JSON with the last step, whether a notice stopped the run, and
  sha256 digests of the parameters and of the optimizer, scheduler and scaler state.
* stdout (rank 0): ``FINAL_SHA256 <digest of parameters>``.

A LoRA-shaped job (a fine-tune on a frozen base, issue 27): ``--lora-rank R`` freezes the first
layer (``requires_grad=False``) and trains a rank-``R`` low-rank adapter beside it
(``W x + B A x``, ``B`` zero at the start, as LoRA does) and the head; ``--frozen-base-mib N``
(with ``--lora-rank``) adds a frozen embedding table of about ``N`` MiB (float32 rows of 8) to
the base, one row of which each sample reads (chosen from its features), so that the base is
large, frozen and really used while a step still costs little. The base is drawn from its own
generator, so the run is as deterministic as the default one; without these options the model
(and every RNG stream) is the default one. The operator's LoRA notice test runs it.

``--hold-at N --hold-dir DIR``: after step ``N`` (before its checkpoint boundary) every rank
writes ``DIR/held-<rank>`` and waits until the file ``DIR/release`` exists, so that a test's
notice lands mid-run however slow the machine (``Baton.notice_while_held``); a run that finds
``release`` already there (a resumed attempt) does not hold.

:func:`launch` starts it on N local ranks as real processes (tests kill them with real signals),
forked from a process that imported torch once (``baton_testing.warm_start``).
The sidecar tests and the demo reuse it as their trainer.

Why one module of this size: it is one training script, and every option above changes the
same loop (the model, its state and the hold); split, the loop would read its options from
several files.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from baton_testing import warm_start
from baton_testing.warm_start import Rank

__all__ = ["TrainerRun", "launch", "main", "read_loss_log", "run"]

_TESTS_DIR = str(Path(__file__).resolve().parent.parent)
_REPO_DIR = str(Path(_TESTS_DIR).parent)


# ---- the script --------------------------------------------------------------------------


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m baton_testing.trainer", description=__doc__)
    p.add_argument("--steps", type=int, required=True, help="optimizer steps to train in total")
    p.add_argument("--uri", default=None, help="checkpoint root (default $BATON_CHECKPOINT_URI)")
    p.add_argument("--loss-log", default=None, help="per-step loss log (see module docstring)")
    p.add_argument("--result", default=None, help="JSON summary written by rank 0 at the end")
    p.add_argument(
        "--throttle-bytes-per-s",
        type=float,
        default=None,
        help="write checkpoints to --uri at most this fast (baton_testing.throttled)",
    )
    p.add_argument("--probe-bytes", type=int, default=None, help="Checkpointer(probe_bytes=...)")
    p.add_argument("--every-steps", type=int, default=None)
    p.add_argument("--every-seconds", type=float, default=None)
    p.add_argument("--keep-last", type=int, default=None)
    p.add_argument("--async-save", action="store_true", help="periodic saves in the background")
    p.add_argument(
        "--stage-in-background",
        action="store_true",
        help="Checkpointer(stage_in_background=True): with --async-save, the staging copy too",
    )
    p.add_argument(
        "--control-dir",
        default=None,
        help="control directory; '{rank}' is replaced by the rank (one 'pod' per rank), "
        "'{pod}' by RANK // LOCAL_WORLD_SIZE (one directory per pod of several processes)",
    )
    p.add_argument(
        "--fast-dir",
        default=None,
        help="the memory tier's directory ('{rank}' and '{pod}' as for --control-dir)",
    )
    p.add_argument("--fast-every-steps", type=int, default=None)
    p.add_argument("--notice-every", type=int, default=1)
    p.add_argument(
        "--notice-overlap-below",
        type=float,
        default=None,
        help="Checkpointer(notice_overlap_below=...): 0 never overlaps, inf always",
    )
    p.add_argument("--deadline-margin", type=float, default=5.0)
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--declare-accum", action="store_true", help="pass accum to the Checkpointer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--samples", type=int, default=96, help="dataset size")
    p.add_argument("--batch-size", type=int, default=4, help="per rank")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument(
        "--lora-rank",
        type=int,
        default=None,
        help="freeze the first layer and train a LoRA adapter of this rank on it (and the head)",
    )
    p.add_argument(
        "--frozen-base-mib",
        type=float,
        default=0.0,
        help="with --lora-rank: a frozen embedding table of about this many MiB in the base",
    )
    p.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard) instead of DDP")
    p.add_argument("--sleep", type=float, default=0.0, help="seconds per step (slows the run)")
    p.add_argument("--request-at", type=int, default=None, help="request_checkpoint at this step")
    p.add_argument("--request-rank", type=int, default=0, help="the rank that requests it")
    p.add_argument(
        "--request-deadline",
        type=float,
        default=None,
        help="deadline of --request-at, in seconds from the request",
    )
    p.add_argument("--timeout", type=float, default=60.0, help="collective timeout (seconds)")
    p.add_argument("--hold-at", type=int, default=None, help="hold after this step (docstring)")
    p.add_argument("--hold-dir", default=None, help="where --hold-at's files are")
    args = p.parse_args(argv)
    if args.lora_rank is not None and args.lora_rank < 1:
        p.error(f"--lora-rank {args.lora_rank}: use a positive rank")
    if args.frozen_base_mib and args.lora_rank is None:
        p.error("--frozen-base-mib is part of the LoRA model: add --lora-rank R")
    if (args.hold_at is None) != (args.hold_dir is None):
        p.error("--hold-at and --hold-dir go together: give both or neither")
    if args.lora_rank is not None and args.fsdp:
        p.error("--lora-rank runs under DDP (or alone): drop --fsdp")
    return args


def _sha256_tensors(items: Iterator[tuple[str, Any]]) -> str:
    import torch

    h = hashlib.sha256()
    for name, value in items:
        h.update(name.encode())
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            h.update(str(t.dtype).encode())
            h.update(repr(tuple(t.shape)).encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(json.dumps(value, sort_keys=True, default=repr).encode())
    return h.hexdigest()


def _walk(prefix: str, obj: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, Mapping):
        for key in sorted(obj, key=str):
            yield from _walk(f"{prefix}/{key}", obj[key])
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from _walk(f"{prefix}/{i}", v)
    else:
        yield prefix, obj


def _full(obj: Any) -> Any:
    """``obj`` with every DTensor replaced by its full tensor (a collective for FSDP2)."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return obj.full_tensor()
    if isinstance(obj, Mapping):
        return {k: _full(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_full(v) for v in obj]
    return obj


def _per_pod(template: str | None, rank: int) -> str | None:
    """``template`` with ``{rank}`` and ``{pod}`` (RANK // LOCAL_WORLD_SIZE) filled in."""
    if not template:
        return None
    pod = rank // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return template.replace("{rank}", str(rank)).replace("{pod}", str(pod))


HOLD_LIMIT_S = 300.0
"""How long ``--hold-at`` waits for the test's ``release`` before it fails the rank."""


def _hold(where: Path, rank: int) -> None:
    """``--hold-at``: say so in ``held-<rank>`` and wait for ``release`` (see the docstring)."""
    release = where / "release"
    if release.exists():
        return
    (where / f"held-{rank}").write_text(str(os.getpid()))
    limit = time.monotonic() + HOLD_LIMIT_S
    while not release.exists():
        if time.monotonic() > limit:
            raise RuntimeError(f"held for {HOLD_LIMIT_S:g} s and {release} never appeared")
        time.sleep(0.1)


def _lora_model(hidden: int, rank: int, base_mib: float) -> Any:
    """The LoRA-shaped model of ``--lora-rank`` (see the module docstring): a frozen base (the
    first layer, and a frozen table of ``base_mib`` MiB) and a trainable adapter and head."""
    import torch
    from torch import nn

    class LoRANet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            rows = int(base_mib * (1 << 20)) // (8 * 4)
            gen = torch.Generator().manual_seed(4321)  # the "pretrained" base: its own draw
            self.table = nn.Parameter(0.1 * torch.randn(rows, 8, generator=gen))
            self.base = nn.Linear(8, hidden)
            self.lora_a = nn.Parameter(0.1 * torch.randn(rank, 8, generator=gen))
            self.lora_b = nn.Parameter(torch.zeros(hidden, rank))  # LoRA: B starts at zero
            self.scale = 2.0 / rank
            self.drop = nn.Dropout(0.2)
            self.head = nn.Linear(hidden, 1)
            for p in (self.table, *self.base.parameters()):
                p.requires_grad_(False)

        def forward(self, x: Any) -> Any:
            if self.table.shape[0]:
                # One row of the table per sample, picked by its (noisy) first feature.
                row = torch.floor(x[:, 0] * 4099).long().remainder(self.table.shape[0])
                x = x + self.table[row]
            h = self.base(x) + (x @ self.lora_a.T) @ self.lora_b.T * self.scale
            return self.head(self.drop(torch.relu(h)))

    return LoRANet()


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    import trainer_sdk

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world_size > 1:
        from datetime import timedelta

        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))

    # Per-rank streams, as a real job would have (dropout masks differ between ranks).
    torch.manual_seed(args.seed * 1000 + rank)
    np.random.seed(args.seed * 1000 + rank)
    random.seed(args.seed * 1000 + rank)

    gen = torch.Generator().manual_seed(1234)  # the data itself is the same on every rank
    features = torch.randn(args.samples, 8, generator=gen)
    w_true = torch.randn(8, 1, generator=gen)
    targets = features @ w_true + 0.1

    class Noisy(Dataset[tuple[Any, Any]]):
        def __len__(self) -> int:
            return int(args.samples)

        def __getitem__(self, i: int) -> tuple[Any, Any]:
            # numpy and python randomness in the data path, drawn in the main process
            noise = torch.from_numpy(np.random.normal(0.0, 0.05, 8).astype(np.float32))
            scale = 1.0 + 0.1 * random.random()
            return features[i] * scale + noise, targets[i]

    dataset = Noisy()
    sampler = trainer_sdk.ResumableSampler(dataset, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=0)

    model: nn.Module
    if args.lora_rank is not None:
        model = _lora_model(args.hidden, args.lora_rank, args.frozen_base_mib)
    else:
        model = nn.Sequential(
            nn.Linear(8, args.hidden), nn.ReLU(), nn.Dropout(0.2), nn.Linear(args.hidden, 1)
        )
    if args.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif world_size > 1:
        model = nn.parallel.DistributedDataParallel(model)
    # The trained parameters only (a LoRA job's frozen base has no optimizer state).
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.8)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)

    uri: Any = args.uri
    if args.throttle_bytes_per_s:
        from baton_testing.throttled import ThrottledStorage

        uri = ThrottledStorage(args.uri, rate=args.throttle_bytes_per_s)
    ckpt = trainer_sdk.Checkpointer(
        uri,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        dataloader=loader,
        extra={"scaler": scaler},
        every_steps=args.every_steps,
        every_seconds=args.every_seconds,
        keep_last=args.keep_last,
        async_save=args.async_save,
        stage_in_background=args.stage_in_background or None,  # unset: the environment decides
        control_dir=_per_pod(args.control_dir, rank),
        **(
            {"fast_dir": _per_pod(args.fast_dir, rank), "fast_every_steps": args.fast_every_steps}
            if args.fast_dir
            else {}
        ),
        notice_every=args.notice_every,
        **(
            {"notice_overlap_below": args.notice_overlap_below}
            if args.notice_overlap_below is not None
            else {}
        ),
        deadline_margin=args.deadline_margin,
        **({"probe_bytes": args.probe_bytes} if args.probe_bytes else {}),
        timeout=args.timeout,
        accumulation_steps=args.accum if args.declare_accum else None,
    )
    step = ckpt.restore()
    print(f"RESUMED_FROM {step}", flush=True)
    print(f"RESUMED_TIER {ckpt.restored.tier}", flush=True)

    log_path = None
    if args.loss_log:
        log_path = args.loss_log if rank == 0 else f"{args.loss_log}.rank{rank}"

    def batches() -> Iterator[Any]:
        while True:  # epochs; the sampler moves to the next epoch by itself
            yield from sampler.track(loader)

    stream = batches()
    stopped = False
    while step < args.steps:
        model.train()
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(args.accum):
            x, y = next(stream)
            loss = nn.functional.mse_loss(model(x), y) / args.accum
            scaler.scale(loss).backward()
            total += float(loss.detach())
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        step += 1
        if log_path is not None:
            with open(log_path, "a", encoding="ascii") as f:
                f.write(f"{step} {rank} {total.hex()}\n")
        if args.request_at is not None and step == args.request_at and rank == args.request_rank:
            deadline = (
                None if args.request_deadline is None else time.time() + args.request_deadline
            )
            ckpt.request_checkpoint(deadline=deadline, reason="trainer --request-at")
        if args.sleep:
            time.sleep(args.sleep)
        if step == args.hold_at:
            _hold(Path(args.hold_dir), rank)
        if ckpt.step(step):
            stopped = True
            break
    ckpt.close()

    plain = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    # FSDP2 holds shards (DTensors): every rank takes part in gathering the full tensors.
    model_state = _full(dict(plain.state_dict()))
    optimizer_state = _full(optimizer.state_dict())
    if rank == 0:
        params = _sha256_tensors(_walk("p", model_state))
        result = {
            "step": step,
            "stopped": stopped,
            "world_size": world_size,
            "params_sha256": params,
            "optimizer_sha256": _sha256_tensors(_walk("o", optimizer_state)),
            "scheduler_sha256": _sha256_tensors(_walk("s", scheduler.state_dict())),
            "scaler_sha256": _sha256_tensors(_walk("g", scaler.state_dict())),
            "sampler": sampler.state_dict(),
        }
        if args.result:
            Path(args.result).write_text(json.dumps(result, indent=1))
        print(f"FINAL_SHA256 {params}", flush=True)
    # docs/contracts.md: a rank that stopped after an emergency save exits EX_TEMPFAIL, so the
    # operator never mistakes it for a finished (or failed) rank; after a notice's commit to
    # the memory tier, 76: its pod is kept and the trainer restarts in place.
    code = ckpt.exit_code if stopped else 0
    if world_size > 1:
        # Free DDP (and the Checkpointer, which holds it) before the process group, as
        # docs/checkpointer.md tells users: a DDP reducer that outlives destroy_process_group
        # is the last owner of the group, and frees it holding the GIL while a gloo worker may
        # need the GIL to drop its last work (a hang at exit, seen in a 4-rank run).
        ddp = weakref.ref(model) if isinstance(model, nn.parallel.DistributedDataParallel) else None
        del ckpt, model, plain
        gc.collect()
        assert ddp is None or ddp() is None, "the DDP module outlived its last reference"
        dist.destroy_process_group()
    return code


# ---- launching it from tests -------------------------------------------------------------


@dataclass
class TrainerRun:
    """Running trainer ranks (from :func:`launch`)."""

    procs: list[Rank]
    workdir: Path
    outputs: list[Path] = field(default_factory=list)

    def signal(self, rank: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to one rank, if it still runs."""
        if self.procs[rank].poll() is None:
            os.kill(self.procs[rank].pid, sig)

    def kill_all(self) -> None:
        """SIGKILL every rank still running (a hard node loss) and reap them."""
        for r in range(len(self.procs)):
            self.signal(r, signal.SIGKILL)
        for p in self.procs:
            p.wait()

    def wait(self, timeout: float = 120.0) -> list[int]:
        """Wait for every rank; kill all at ``timeout`` and raise. Returns the exit codes."""
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired as e:
                self.kill_all()
                raise AssertionError(f"trainer timed out after {timeout}s:\n{self.output()}") from e
        return [int(p.returncode) for p in self.procs]

    def output(self, rank: int | None = None) -> str:
        """The combined stdout/stderr of one rank, or of all (tail)."""
        ranks = range(len(self.procs)) if rank is None else [rank]
        return "\n".join(
            f"--- rank {r}:\n{self.outputs[r].read_text(errors='replace')[-6000:]}" for r in ranks
        )


def launch(
    world_size: int,
    args: Sequence[str],
    *,
    workdir: str | os.PathLike[str],
    env: Mapping[str, str] | None = None,
    procs_per_pod: int = 1,
) -> TrainerRun:
    """Start the trainer on ``world_size`` local ranks (real processes, gloo); returns at once.

    By default every rank gets ``LOCAL_RANK=0`` and ``LOCAL_WORLD_SIZE=1``: each is its own
    "pod", so that a notice can reach one rank only (pass ``--control-dir .../{rank}``). With
    ``procs_per_pod=N`` ranks ``[kN, (k+1)N)`` form pod ``k`` (``LOCAL_RANK`` 0..N-1,
    ``LOCAL_WORLD_SIZE=N``), as torchrun would start them; pass ``--control-dir .../{pod}``.
    """
    if procs_per_pod < 1 or world_size % procs_per_pod:
        raise ValueError(f"procs_per_pod={procs_per_pod} must divide world_size={world_size}")
    from baton_testing.ports import free_port

    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    run_ = TrainerRun(procs=[], workdir=work)
    for rank in range(world_size):
        child_env = dict(os.environ)
        child_env.update(env or {})
        child_env.update(
            {
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank % procs_per_pod),
                "LOCAL_WORLD_SIZE": str(procs_per_pod),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join(
                    [_TESTS_DIR, _REPO_DIR, child_env.get("PYTHONPATH", "")]
                ).rstrip(os.pathsep),
            }
        )
        out_path = work / f"rank{rank}.{len(list(work.glob(f'rank{rank}.*.out')))}.out"
        if warm_start.enabled():  # forked from a process that imported torch once
            run_.procs.append(
                warm_start.start(
                    "baton_testing.trainer.main",
                    [list(args)],
                    env=child_env,
                    cwd=_REPO_DIR,
                    out_path=str(out_path),
                )
            )
        else:
            with open(out_path, "wb") as out:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "baton_testing.trainer", *args],
                    env=child_env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=_REPO_DIR,
                )
            run_.procs.append(proc)
        run_.outputs.append(out_path)
    return run_


def run(
    world_size: int,
    args: Sequence[str],
    *,
    workdir: str | os.PathLike[str],
    env: Mapping[str, str] | None = None,
    timeout: float = 120.0,
) -> TrainerRun:
    """Run the trainer to the end; raise (with every rank's output) unless all exit 0."""
    r = launch(world_size, args, workdir=workdir, env=env)
    codes = r.wait(timeout)
    if any(codes):
        raise AssertionError(f"trainer exited {codes}:\n{r.output()}")
    return r


def read_loss_log(path: str | os.PathLike[str]) -> list[tuple[int, str]]:
    """The (step, loss hex) lines of one rank's loss log, in the order written."""
    p = Path(path)
    if not p.exists():
        return []
    lines = []
    for line in p.read_text(encoding="ascii").splitlines():
        parts = line.split()
        if len(parts) == 3:  # a line cut by SIGKILL mid-write has fewer parts
            lines.append((int(parts[0]), parts[2]))
    return lines


def loss_logs(out: str | os.PathLike[str], world_size: int) -> dict[int, dict[int, list[str]]]:
    """rank -> step -> every loss that rank logged for that step, over all attempts.

    The trainer writes rank 0's losses to ``loss.log`` and rank r's to ``loss.log.rank{r}``;
    a step logged twice was recomputed after a resume.
    """
    logs: dict[int, dict[int, list[str]]] = {}
    for rank in range(world_size):
        path = Path(out) / ("loss.log" if rank == 0 else f"loss.log.rank{rank}")
        for step, loss in read_loss_log(path):
            logs.setdefault(rank, {}).setdefault(step, []).append(loss)
    return logs


STATE_DIGESTS = ("params_sha256", "optimizer_sha256", "scheduler_sha256", "scaler_sha256")
"""The result's digests of the final training state (weights, optimizer, LR schedule, scaler)."""


def assert_equal_to_reference(
    out: str | os.PathLike[str],
    world_size: int,
    steps: int,
    ref: tuple[dict[str, Any], dict[int, dict[int, list[str]]]],
    diag: str = "",
) -> None:
    """The run under ``out`` against :func:`reference`'s ``ref``: every rank logged every
    step, each time with the reference's loss bit for bit (a step run again after a restore
    included), and the final state's digests are equal."""
    ref_result, ref_logs = ref
    got = loss_logs(out, world_size)
    for rank in range(world_size):
        assert sorted(got.get(rank, {})) == list(range(1, steps + 1)), f"rank {rank}{diag}"
        for step, losses in got[rank].items():
            assert set(losses) == {ref_logs[rank][step][0]}, f"rank {rank} step {step}: {losses}"
    result = json.loads((Path(out) / "result.json").read_text())
    for key in STATE_DIGESTS:
        assert result[key] == ref_result[key], f"{key} differs from the uninterrupted run"


def reference(
    tmp: Path, world_size: int, args: list[str], *, timeout: float = 300
) -> tuple[dict[str, Any], dict[int, dict[int, list[str]]]]:
    """Train uninterrupted as ``world_size`` local processes (no pods, no operator) with
    ``args`` plus a checkpoint, loss log and result under ``tmp``: the result and every
    rank's losses, the reference a cluster test compares its job with."""
    tmp.mkdir(parents=True, exist_ok=True)
    files = [
        "--uri", str(tmp / "ck"), "--loss-log", str(tmp / "loss.log"),
        "--result", str(tmp / "result.json"),
    ]  # fmt: skip
    run(world_size, [*args, *files], workdir=tmp / "out", timeout=timeout)
    return json.loads((tmp / "result.json").read_text()), loss_logs(tmp, world_size)


if __name__ == "__main__":
    import trainer_sdk

    trainer_sdk.run(main)  # as tinylm does: the pods' restarts do not wait for the teardown
