"""GPU checks for the CUDA paths that CPU-only CI cannot reach.

Run on a machine with a CUDA GPU (the device tool's machine, or any GPU box)::

    .venv/bin/python bench/gpu_check.py [--gib 1.0] [--out results.json]

It checks, with real CUDA tensors:

1. save/load round trip of a CUDA model + AdamW state, bitwise;
2. async staging: host buffers are pinned, allocated once and reused, copied on a side
   stream; mutating the CUDA tensors right after staging does not change the saved values;
   with ``stage_in_background`` the copy on the staging thread waits for a write still
   queued on the caller's own side stream;
3. RNG: every CUDA device's generator is captured and restored (the next draws repeat);
4. exact resume: a model with dropout trained N steps equals one trained N/2 steps, saved,
   rebuilt from scratch and restored, then trained N/2 more (deterministic algorithms on);
5. a benchmark: blocking time of staging 1 GiB from the GPU against a plain copy into
   preallocated pinned buffers, and trainer_sdk.save of CUDA state against torch.save.

Exits non-zero if any check fails. It prints a table and, with --out, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

# Deterministic cuBLAS needs this before CUDA initialises.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch
from torch import nn

import trainer_sdk
from trainer_sdk import rng
from trainer_sdk.staging import HostBuffers

DEVICE = "cuda"
"""Where the checks run; --cpu-dry-run sets "cpu" to exercise this script without a GPU."""
RESULTS: dict[str, Any] = {}
FAILURES: list[str] = []


def check(name: str, fn: Callable[[], Any]) -> None:
    t0 = time.perf_counter()
    try:
        detail = fn()
    except Exception as e:  # a check script reports every failure and goes on
        FAILURES.append(f"{name}: {type(e).__name__}: {e}")
        print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
        return
    RESULTS[name] = {"ok": True, "seconds": time.perf_counter() - t0, "detail": detail}
    print(f"ok   {name} ({time.perf_counter() - t0:.2f} s) {detail or ''}", flush=True)


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Dropout(0.1), nn.Linear(512, 256)).to(
        DEVICE
    )


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 256, device=DEVICE)
        loss = (model(x) - x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def assert_state_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for k, value in a.items():
        assert torch.equal(value.cpu(), b[k].cpu()), f"{k} differs"


def check_roundtrip(root: Path) -> str:
    model = make_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt, 3)
    trainer_sdk.save({"model": model, "optim": opt}, str(root / "rt"), step=3)
    fresh = make_model(1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    train(fresh, fresh_opt, 1)  # materialise optimizer state to load into
    trainer_sdk.load({"model": fresh, "optim": fresh_opt}, str(root / "rt"))
    assert_state_equal(model.state_dict(), fresh.state_dict())
    assert all(p.device.type == DEVICE for p in fresh.parameters()), "load moved parameters"
    return f"weights and optimizer bitwise equal, still on {DEVICE}"


def check_staging() -> str:
    src = {f"t{i}": torch.randn(1 << 20, device=DEVICE) for i in range(4)}
    bufs = HostBuffers()
    staged = bufs.stage(src)
    if DEVICE == "cuda":
        assert all(b.is_pinned() for b in staged.values()), "staging buffers are not pinned"
    expected = {k: v.cpu().clone() for k, v in src.items()}
    for v in src.values():  # mutate right after stage() returns, on the training stream
        v.mul_(-1.0).add_(7.0)
    for k in src:
        assert torch.equal(staged[k], expected[k]), f"staged {k} changed after mutation"
    allocations = bufs.allocations
    bufs.stage(src)
    assert bufs.allocations == allocations, "buffers were reallocated on the second save"
    return f"pinned, reused ({allocations} allocations), isolated from later mutation"


def check_async(root: Path) -> str:
    params = {"w": torch.randn(4096, 1024, device=DEVICE)}
    expected = params["w"].cpu().clone()
    handle = trainer_sdk.async_save(params, str(root / "async"), step=1)
    params["w"].zero_()  # must not reach the checkpoint
    handle.wait()
    loaded = {"w": torch.empty(4096, 1024, device=DEVICE)}
    trainer_sdk.load(loaded, str(root / "async"), step=1)
    assert torch.equal(loaded["w"].cpu(), expected), "async save wrote mutated values"
    return "async save holds the staged values"


def check_async_background(root: Path) -> str:
    """``stage_in_background``: the save is called on a side stream of the caller's with a
    write to the tensor still queued on it; the staging thread's copy must wait for that
    write (the event ``mark_streams`` records), not for its own thread's current stream."""
    w = torch.randn(4096, 1024, device=DEVICE)
    side = torch.cuda.Stream() if DEVICE == "cuda" else None  # type: ignore[no-untyped-call]
    with torch.cuda.stream(side) if side is not None else nullcontext():
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())  # w's randn
        a = torch.randn(4096, 4096, device=DEVICE)
        for _ in range(8):  # a long write, still queued when the save is called
            a = a @ a / 64.0
        w.copy_(a[:, :1024])
        handle = trainer_sdk.async_save(
            {"w": w}, str(root / "async-bg"), step=1, stage_in_background=True
        )
        handle.wait_staged()
        expected = w.cpu().clone()  # the value at the call: the queued write included
        w.zero_()  # after wait_staged: must not reach the checkpoint
    handle.wait()
    loaded = {"w": torch.empty(4096, 1024, device=DEVICE)}
    trainer_sdk.load(loaded, str(root / "async-bg"), step=1)
    assert torch.equal(loaded["w"].cpu(), expected), "the background copy missed a queued write"
    return "the copy on the staging thread saw the side stream's queued write"


def check_rng() -> str:
    if DEVICE != "cuda":
        return "n/a without CUDA"
    torch.cuda.manual_seed_all(123)
    state = rng.capture()
    assert "cuda" in state or any("cuda" in k for k in state), f"no CUDA RNG in {list(state)}"
    first = torch.rand(8, device=DEVICE).cpu()
    torch.rand(100, device=DEVICE)
    rng.restore(state)
    again = torch.rand(8, device=DEVICE).cpu()
    assert torch.equal(first, again), "CUDA RNG not restored"
    return f"{torch.cuda.device_count()} device(s) restored"


def check_exact_resume(root: Path) -> str:
    torch.use_deterministic_algorithms(True)
    try:
        steps = 40
        torch.manual_seed(7)
        ref = make_model(0)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        ref_losses = train(ref, ref_opt, steps)

        torch.manual_seed(7)
        model = make_model(0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ckpt = trainer_sdk.Checkpointer(
            str(root / "exact"), model=model, optimizer=opt, handle_sigterm=False
        )
        first = train(model, opt, steps // 2)
        ckpt.save(steps // 2)
        ckpt.close()

        torch.manual_seed(999)  # a different process would start elsewhere
        model2 = make_model(5)
        opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
        ckpt2 = trainer_sdk.Checkpointer(
            str(root / "exact"), model=model2, optimizer=opt2, handle_sigterm=False
        )
        start = ckpt2.restore()
        assert start == steps // 2, f"restored step {start}, expected {steps // 2}"
        second = train(model2, opt2, steps - start)
        ckpt2.close()
        assert first + second == ref_losses, "loss curve differs after resume"
        assert_state_equal(ref.state_dict(), model2.state_dict())
        return "weights and loss curve bitwise equal after resume"
    finally:
        torch.use_deterministic_algorithms(False)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def median_time(fn: Callable[[], None], runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench(root: Path, gib: float) -> str:
    n = int(gib * (1 << 30)) // 4 // 16
    src = {f"t{i}": torch.randn(n, device=DEVICE) for i in range(16)}
    total = sum(t.numel() * 4 for t in src.values())
    plain = {
        k: torch.empty(v.shape, dtype=v.dtype, pin_memory=DEVICE == "cuda") for k, v in src.items()
    }

    def plain_copy() -> None:
        for k, v in src.items():
            plain[k].copy_(v, non_blocking=True)

    bufs = HostBuffers()
    bufs.stage(src)  # allocate once, as training would on its first save
    t_plain = median_time(plain_copy)
    t_stage = median_time(lambda: bufs.stage(src) and None)
    steps = iter(range(1, 1000))
    t_sdk = median_time(
        lambda: trainer_sdk.save(src, str(root / "bench"), step=next(steps)) and None, 3
    )

    def torch_save_fsynced() -> None:
        # fsync'd like trainer_sdk.save, so both numbers mean "durable on disk".
        with open(root / "bench.pt", "wb") as f:
            torch.save(src, f)
            f.flush()
            os.fsync(f.fileno())

    t_torch = median_time(torch_save_fsynced, 3)
    gbs = total / (1 << 30)
    RESULTS["bench"] = {
        "bytes": total,
        "plain_copy_s": t_plain,
        "stage_s": t_stage,
        "sdk_save_s": t_sdk,
        "torch_save_s": t_torch,
    }
    print(f"\n{'what':<40}{'seconds':>10}{'GiB/s':>10}")
    for name, t in [
        ("plain D2H copy into pinned buffers", t_plain),
        ("HostBuffers.stage (async blocking)", t_stage),
        ("trainer_sdk.save (sync, fsync'd)", t_sdk),
        ("torch.save (fsync'd)", t_torch),
    ]:
        print(f"{name:<40}{t:>10.3f}{gbs / t:>10.2f}")
    return (
        f"stage/plain = {t_stage / t_plain:.2f}x (target <= 1.5x); "
        f"save vs torch.save = {t_torch / t_sdk:.2f}x faster"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="benchmark state size")
    parser.add_argument("--out", default=None, help="write results as JSON here")
    parser.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="run the same checks on the CPU (CUDA-only assertions say n/a): tests this script",
    )
    args = parser.parse_args()
    global DEVICE  # noqa: PLW0603 - one switch for the whole script
    if args.cpu_dry_run:
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible; run this on a GPU machine", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "CPU dry run"
    print(f"gpu_check: torch {torch.__version__}, {name}", flush=True)
    with tempfile.TemporaryDirectory(prefix="baton-gpu-") as tmp:
        root = Path(tmp)
        check("roundtrip", lambda: check_roundtrip(root))
        check("staging", check_staging)
        check("async_save", lambda: check_async(root))
        check("async_save_background", lambda: check_async_background(root))
        check("rng", check_rng)
        check("exact_resume", lambda: check_exact_resume(root))
        check("bench", lambda: bench(root, args.gib))
    if args.out:
        Path(args.out).write_text(json.dumps({"results": RESULTS, "failures": FAILURES}, indent=2))
    print(f"\n{len(RESULTS)} passed, {len(FAILURES)} failed", flush=True)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
