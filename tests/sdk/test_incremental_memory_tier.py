"""Incremental durable saves with the memory tier on (``fast_every_steps``), on 3 gloo ranks of
one "pod" (a shared ``fast_dir``), for real: a frozen base and a trainable adapter (DDP).

* Durable saves after the first write only the trainable state and reference the base (the
  manifest's bytes are asserted); every memory snapshot carries the whole state, base
  included (its bytes measured per step and asserted equal to the whole state's), so that a
  recovering pod restores from a snapshot alone.
* A resume from a memory snapshot (promoted, then retained with the reference-aware rules)
  and a resume from a durable step (the pod's memory lost) are both bitwise equal to the
  uninterrupted run, and the durable saves after a durable resume reference the base again.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any

import pytest
from baton_testing.dist import run_ranks

pytestmark = [pytest.mark.timeout(900)]

_BASE = ("model.base.weight", "model.base.bias", "model.embed.weight")
_TRAINED = {"model.down.weight", "model.up.weight", "model.scale"} | {
    f"optimizer.state.{p}.weight.{s}"
    for p in ("down", "up")
    for s in ("step", "exp_avg", "exp_avg_sq")
}
_LAST = 9
_EVERY = 3  # durable saves at 3, 6, 9; a memory snapshot at every step


def _digest(t: Any) -> str:
    return hashlib.sha256(t.detach().contiguous().view(-1).numpy().tobytes()).hexdigest()


def _build(seed: int) -> tuple[Any, Any, Any]:
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

    class Adapted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(64, 512)
            self.base = nn.Linear(512, 512)
            self.down = nn.Linear(512, 4, bias=False)
            self.up = nn.Linear(4, 512, bias=False)
            self.register_buffer("scale", torch.ones(512))

        def forward(self, idx: Any) -> Any:
            x = self.embed(idx)
            return self.base(x) * self.scale + self.up(self.down(x))

    torch.manual_seed(seed)
    model = Adapted()
    for p in (*model.embed.parameters(), *model.base.parameters()):
        p.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, DDP(model), opt


def _train(model: Any, ddp: Any, opt: Any, step: int) -> None:
    import torch
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    opt.zero_grad()
    ddp(torch.randint(0, 64, (8,), generator=gen)).square().mean().backward()
    opt.step()
    with torch.no_grad():
        model.scale.add_(0.001)


def _state(model: Any, opt: Any) -> dict[str, str]:
    out = {f"model.{k}": _digest(v) for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        out.update({f"opt.{i}.{k}": _digest(v) for k, v in s.items()})
    return out


def _written(m: Any) -> dict[str, int]:
    """Tensor key -> bytes of it in files this step wrote (not references)."""
    out: dict[str, int] = {}
    for k, t in m.tensors.items():
        n = sum(p.nbytes for p in t.pieces if m.files[p.file].step is None)
        if n:
            out[k] = n
    return out


def _whole(m: Any) -> int:
    return sum(p.nbytes for t in m.tensors.values() for p in t.pieces)


def _train_and_save(ck: Any, model: Any, ddp: Any, opt: Any, root: str, fast: str,
                    first: int, last: int) -> dict[str, Any]:  # fmt: skip
    from trainer_sdk.api import read_manifest

    durable: dict[int, Any] = {}
    snapshots: dict[int, Any] = {}
    for step in range(first, last + 1):
        _train(model, ddp, opt, step)
        ck.step(step)
        ck.wait()  # the snapshot (and any promotion) committed; read before the next rotates
        snap = read_manifest(fast, step)
        snapshots[step] = [snap.total_bytes, _whole(snap), sum(_written(snap).values()),
                           sorted(snap.referenced_steps())]  # fmt: skip
        if step % _EVERY == 0:
            m = read_manifest(root, step)
            durable[step] = [m.total_bytes, _whole(m), _written(m), sorted(m.referenced_steps())]
    return {"durable": durable, "snapshots": snapshots}


def _body(tmp: str) -> dict[str, Any]:
    import torch.distributed as dist

    from trainer_sdk.checkpointer import Checkpointer

    base = Path(tmp)
    rank = dist.get_rank()
    out: dict[str, Any] = {}

    def ckpt(name: str, ddp: Any, opt: Any) -> Any:
        # the DDP module, as a script hands it over: its bucket layout is saved with the step,
        # so the first step after a resume reduces exactly as the uninterrupted run did
        return Checkpointer(
            base / name, model=ddp, optimizer=opt, every_steps=_EVERY, fast_every_steps=1,
            fast_dir=base / f"{name}-fast", keep_last=2, handle_sigterm=False, timeout=120,
        )  # fmt: skip

    # the uninterrupted run
    model, ddp, opt = _build(0)
    with ckpt("whole", ddp, opt) as ck:
        assert ck.restore() == 0
        out["whole"] = _train_and_save(ck, model, ddp, opt, str(base / "whole"),
                                       str(base / "whole-fast"), 1, _LAST)  # fmt: skip
    out["reference"] = _state(model, opt)

    # interrupted after step 7 (durable 3 and 6, snapshot 7), twice
    for name in ("mem", "dur"):
        model, ddp, opt = _build(0)
        with ckpt(name, ddp, opt) as ck:
            ck.restore()
            _train_and_save(ck, model, ddp, opt, str(base / name), str(base / f"{name}-fast"),
                            1, 7)  # fmt: skip
    dist.barrier()
    if rank == 0:  # "dur": the pod is replaced, its memory (the snapshots) is gone
        shutil.rmtree(base / "dur-fast")
    dist.barrier()

    for name, expect, tier in (("mem", 7, "memory"), ("dur", 6, "durable")):
        model, ddp, opt = _build(100 + rank)  # other values everywhere, base included
        with ckpt(name, ddp, opt) as ck:
            assert ck.restore() == expect
            assert ck.restored.tier == tier
            out[name] = _train_and_save(ck, model, ddp, opt, str(base / name),
                                        str(base / f"{name}-fast"), expect + 1, _LAST)  # fmt: skip
        out[f"{name}-state"] = _state(model, opt)
    return out


@pytest.mark.e2e  # three real ranks
def test_memory_tier_keeps_whole_snapshots_and_durable_saves_reference_the_base(
    tmp_path: Path,
) -> None:
    import trainer_sdk
    from trainer_sdk.cli import main as cli

    results = run_ranks(_body, 3, args=(str(tmp_path),), timeout=600)
    for r in results:  # JSON from the ranks: steps come back as strings
        for name in ("whole", "mem", "dur"):
            for part in ("durable", "snapshots"):
                r[name][part] = {int(k): v for k, v in r[name][part].items()}
    ref = results[0]["reference"]
    # both resumes are bitwise equal to the uninterrupted run, on every rank
    for r in results:
        assert r["reference"] == ref
        for name in ("mem", "dur"):
            differ = sorted(k for k in ref if r[f"{name}-state"].get(k) != ref[k])
            assert differ == [], (name, differ)

    whole = results[0]["whole"]
    durable, snapshots = whole["durable"], whole["snapshots"]
    full = durable[3][1]  # every tensor's bytes (the first durable save writes them all)
    assert sum(durable[3][2].values()) == full
    assert durable[3][3] == []
    saves = ", ".join(f"step {s}: {d[0]} B (references {d[3]})" for s, d in durable.items())
    print(f"\nbytes per durable save (all ranks): {saves}")
    snaps = ", ".join(f"step {s}: {v[0]} B" for s, v in snapshots.items())
    print(f"bytes per memory snapshot (all ranks): {snaps}")
    for s in (6, 9):
        total, every, written, refs = durable[s]
        assert refs == [3], (s, refs)  # the base is referenced in the first durable step
        assert every == full
        assert {k for k in written if not k.startswith("rng.")} == _TRAINED, sorted(written)
        assert not set(_BASE) & set(written)
        assert total < 1.1 * sum(written.values()) + 64 * 1024  # tensors + JSON and headers
        assert total < durable[3][0] / 5
    # every snapshot carries the whole state, base included, and references nothing
    for s, (total, every, wrote, refs) in snapshots.items():
        assert refs == [], (s, refs)
        assert every == full, (s, every)
        assert wrote == full, (s, wrote)
        assert total >= full

    # after the durable resume (from step 6), step 9 references the base in step 3 again
    dur = results[0]["dur"]["durable"]
    assert dur[9][3] == [3]
    assert {k for k in dur[9][2] if not k.startswith("rng.")} == _TRAINED
    # after the memory resume (snapshot 7, promoted), step 9 is written whole (the snapshot's
    # files are in fast_dir, which durable steps never reference)
    mem = results[0]["mem"]["durable"]
    assert mem[9][3] == []
    assert sum(mem[9][2].values()) == full
    # the chains left behind: every kept step verifies and loads; nothing unreferenced left
    for name, kept in (("mem", [7, 9]), ("dur", [6, 9]), ("whole", [6, 9])):
        root = tmp_path / name
        assert trainer_sdk.list_steps(str(root)) == kept, name
        files = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
        need = {"latest", "fence"}
        for s in kept:
            m = trainer_sdk.api.read_manifest(str(root), s)
            need.add(f"step-{s:012d}/manifest.json")
            need.update(m.path_of(k) for k in m.files)
            assert cli(["verify", str(root), "--step", str(s)]) == 0
        assert files == need, (name, sorted(files ^ need))
