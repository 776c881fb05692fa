"""Incremental steps (format v3) with the plain Checkpointer on 3 gloo ranks, for real: a model
with a frozen base and a trainable adapter (DDP) writes its base once, later saves write the
adapter, its optimizer state and the small state only, and reference the base; the resume is
bitwise equal to an uninterrupted run; ``keep_last=2`` rotates out the step that first wrote
the base and leaves no unreferenced file; a frozen weight changed in place under
``torch.no_grad()`` is written again; a referenced file flipped or deleted by hand makes
restore name the referencing step and the file, fall back, and delete nothing; a chain saved
by 2 ranks restores on 3 and on 1; FSDP2 shards of a frozen layer are referenced per rank.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import pytest
from baton_testing.dist import run_ranks

pytestmark = [pytest.mark.timeout(900)]  # five process-group start-ups on 2 shared cores

_BASE = ("model.base.weight", "model.base.bias", "model.embed.weight")
_EDIT_STEP = 5
"""The step at which the frozen base weight is edited in place (under no_grad)."""


def _digest(t: Any) -> str:
    return hashlib.sha256(t.detach().contiguous().view(-1).numpy().tobytes()).hexdigest()


def _build() -> tuple[Any, Any, Any]:
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
            self.register_buffer("scale", torch.ones(512))  # a running buffer: changes

        def forward(self, idx: Any) -> Any:
            x = self.embed(idx)
            return self.base(x) * self.scale + self.up(self.down(x))

    torch.manual_seed(0)
    model = Adapted()
    for p in (*model.embed.parameters(), *model.base.parameters()):
        p.requires_grad_(False)
    ddp = DDP(model) if torch.distributed.is_initialized() else model
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, ddp, opt


def _train(model: Any, ddp: Any, opt: Any, step: int) -> None:
    import torch
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    opt.zero_grad()
    ddp(torch.randint(0, 64, (8,), generator=gen)).square().mean().backward()
    opt.step()
    with torch.no_grad():
        model.scale.add_(0.001)
        if step == _EDIT_STEP:  # a hand edit of a frozen weight: must be written again
            model.base.weight.mul_(0.5)


def _state(model: Any, opt: Any) -> dict[str, str]:
    out = {f"model.{k}": _digest(v) for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        out.update({f"opt.{i}.{k}": _digest(v) for k, v in s.items()})
    return out


def _run(root: str, first: int, last: int, keep_last: int) -> dict[str, Any]:
    from trainer_sdk.api import read_manifest
    from trainer_sdk.checkpointer import Checkpointer

    model, ddp, opt = _build()
    written = {}
    with Checkpointer(root, model=ddp, optimizer=opt, keep_last=keep_last) as ck:
        resumed = ck.restore()
        assert resumed == first - 1, (resumed, first)
        for step in range(first, last + 1):
            _train(model, ddp, opt, step)
            ck.save(step)
            written[step] = read_manifest(root, step).total_bytes  # before retention runs again
    return {"state": _state(model, opt), "written": written}


def _manifest(root: Path, step: int) -> Any:
    from trainer_sdk.api import read_manifest

    return read_manifest(str(root), step)


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def _expected_files(root: Path, steps: list[int]) -> set[str]:
    """Exactly the files the kept steps need: their own files and manifests, the shards they
    reference, and the root's ``latest`` and ``fence``."""
    out = {"latest", "fence"}
    for s in steps:
        m = _manifest(root, s)
        out.add(f"step-{s:012d}/manifest.json")
        out.update(m.path_of(k) for k in m.files)
    return out


def _written_keys(m: Any) -> set[str]:
    return {k for k, t in m.tensors.items() if any(m.files[p.file].step is None for p in t.pieces)}


def test_frozen_base_is_written_once_and_resume_is_bitwise(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import trainer_sdk
    from trainer_sdk.checkpointer import Checkpointer
    from trainer_sdk.cli import main as cli

    whole, part = tmp_path / "whole", tmp_path / "part"
    uninterrupted = run_ranks(_run, 3, args=(str(whole), 1, 10, 2), timeout=300)
    run_ranks(_run, 3, args=(str(part), 1, 6, 2), timeout=300)
    resumed = run_ranks(_run, 3, args=(str(part), 7, 10, 2), timeout=300)
    # resume is bitwise equal to the uninterrupted run, on every rank, adapter, optimizer,
    # base (edited at step 5, before the interruption) and buffer alike
    assert [r["state"] for r in resumed] == [r["state"] for r in uninterrupted]

    for root in (whole, part):
        assert trainer_sdk.list_steps(str(root)) == [9, 10]
        # the step that first wrote the base is rotated out (no manifest, no JSON files, not
        # a restore point); of its shards only those holding the unedited base tensors are
        # left, and of step 5's only the one holding the edited weight: nothing unreferenced
        assert not (root / "step-000000000001" / "manifest.json").exists()
        assert _files(root) == _expected_files(root, [9, 10])
        old = [
            f for f in _files(root) if f.startswith(("step-000000000001/", "step-000000000005/"))
        ]
        assert old
        assert all(f.endswith(".safetensors") for f in old), old
        for s in (9, 10):
            m = _manifest(root, s)
            assert m.version == 5  # references (v3), xxh3_128 digests (v4), xxh3_64 blocks (v5)
            assert m.referenced_steps() == {1, _EDIT_STEP}
            assert {m.files[p.file].step for p in m.tensors["model.base.weight"].pieces} == {5}
            assert not set(_BASE) & _written_keys(m)
            assert cli(["verify", str(root), "--step", str(s)]) == 0
            state: dict[str, Any] = {"model": {}, "optimizer": {}}
            trainer_sdk.load(state, str(root), step=s, strict=False)  # one rank reads 3's
            assert state["model"]["base.weight"].shape == (512, 512)

    # bytes per save: the first writes everything, the later ones only what changes (and
    # step 5 the edited base weight again)
    written = {int(k): v for k, v in uninterrupted[0]["written"].items()}
    print(f"\nbytes written per save (uninterrupted run, all ranks): {written}")
    later = [written[s] for s in written if s not in (1, _EDIT_STEP)]
    assert max(later) < written[1] / 10
    assert max(later) < written[_EDIT_STEP] < written[1]
    assert max(later) - min(later) < 64  # the same bytes at every later save
    print("bytes per save (uninterrupted run):")
    sizes = {}
    for s in (9, 10):
        m = _manifest(whole, s)
        sizes[s] = m.total_bytes
        written = sum(p.nbytes for k in _written_keys(m) for p in m.tensors[k].pieces)
        base = sum(p.nbytes for k in _BASE for p in m.tensors[k].pieces)
        print(f"  step {s}: wrote {m.total_bytes} B (tensors {written} B), reuses {base} B")
        # what a later save writes: the adapter, its optimizer state, the buffer, the RNG
        assert {k for k in _written_keys(m) if not k.startswith("rng.")} == {
            "model.down.weight",
            "model.up.weight",
            "model.scale",
            *(
                f"optimizer.state.{p}.weight.{s}"
                for p in ("down", "up")
                for s in ("step", "exp_avg", "exp_avg_sq")
            ),
        }
        assert base == (64 * 512 + 512 * 512 + 512) * 4
        assert m.total_bytes < 1.1 * written + 64 * 1024  # files = tensors + JSON and headers
    # the first save of the interrupted run's second half, after a restore, references too
    m7 = _manifest(part, 10)
    assert m7.total_bytes < sizes[10] * 1.1
    full = sum(p.nbytes for t in _manifest(whole, 10).tensors.values() for p in t.pieces)
    print(f"  a full save's tensors: {full} B")
    assert sizes[10] < full / 5

    # a referenced shard flipped by hand: restore names the referencing step and the file,
    # falls back (past both steps: both reference it), and deletes nothing
    m = _manifest(part, 10)
    piece = m.tensors["model.base.weight"].pieces[0]
    path = part / m.path_of(piece.file)
    before = _files(part)
    data = bytearray(path.read_bytes())
    data[piece.begin + 5] ^= 0xFF
    path.write_bytes(bytes(data))
    model, _, opt = _build()
    with caplog.at_level(logging.WARNING), Checkpointer(part, model=model, optimizer=opt) as ck:
        assert ck.restore() == 0
    named = [r.getMessage() for r in caplog.records if m.path_of(piece.file) in r.getMessage()]
    assert any("referenced by step 10" in msg for msg in named), named
    assert any("referenced by step 9" in msg for msg in named), named
    assert before <= _files(part)  # nothing deleted (restore may only raise the fence)
    # deleted by hand: named as missing, nothing deleted either
    path.unlink()
    caplog.clear()
    before = _files(part)
    with caplog.at_level(logging.WARNING), Checkpointer(part, model=model, optimizer=opt) as ck:
        assert ck.restore() == 0
    assert any(
        "missing" in r.getMessage() and "referenced by step 10" in r.getMessage()
        for r in caplog.records
    )
    assert before <= _files(part)


def _chain(root: str) -> dict[str, Any]:
    """2 ranks: steps 1-3, 2 and 3 referencing step 1's base."""
    model, ddp, opt = _build()
    from trainer_sdk.checkpointer import Checkpointer

    with Checkpointer(root, model=ddp, optimizer=opt) as ck:
        ck.restore()
        for step in (1, 2, 3):
            _train(model, ddp, opt, step)
            ck.save(step)
    return {"state": _state(model, opt)}


def _restore_and_save(root: str) -> dict[str, Any]:
    """3 ranks: restore the chain, then save step 4 (which references world-2 shards)."""
    model, ddp, opt = _build()
    from trainer_sdk.checkpointer import Checkpointer

    with Checkpointer(root, model=ddp, optimizer=opt) as ck:
        assert ck.restore() == 3
        restored = _state(model, opt)
        _train(model, ddp, opt, 4)
        ck.save(4)
    return {"restored": restored, "state": _state(model, opt)}


def test_a_chain_reshards_two_to_three_and_to_one(tmp_path: Path) -> None:
    import trainer_sdk
    from trainer_sdk.cli import main as cli

    saved = run_ranks(_chain, 2, args=(str(tmp_path),), timeout=300)
    m3 = _manifest(tmp_path, 3)
    assert m3.referenced_steps() == {1}
    assert not set(_BASE) & _written_keys(m3)
    three = run_ranks(_restore_and_save, 3, args=(str(tmp_path),), timeout=300)
    assert [r["restored"] for r in three] == [saved[0]["state"]] * 3  # 2 -> 3
    m4 = _manifest(tmp_path, 4)
    assert m4.world_size == 3
    assert m4.referenced_steps() == {1}
    assert {m4.path_of(k) for k, f in m4.files.items() if f.step} <= {
        f"step-000000000001/rank-0000{r}-of-00002.safetensors" for r in (0, 1)
    }
    # 2 -> 1: the chain's step 3 into one process
    model, _, opt = _build()
    state: dict[str, Any] = {"model": model.state_dict()}
    trainer_sdk.load(state, str(tmp_path), step=3, strict=False)
    got = {k: v for k, v in _state(model, opt).items() if k.startswith("model.")}
    assert got == {k: v for k, v in saved[0]["state"].items() if k.startswith("model.")}
    # 3 -> 1: step 4, which references the world-2 shards, restored whole by a Checkpointer
    from trainer_sdk.checkpointer import Checkpointer

    model, _, opt = _build()
    with Checkpointer(tmp_path, model=model, optimizer=opt) as ck:
        assert ck.restore() == 4
    assert _state(model, opt) == three[0]["state"]
    for step in (3, 4):
        assert cli(["verify", str(tmp_path), "--step", str(step)]) == 0


def _fsdp_frozen(root: str) -> dict[str, Any]:
    """2 ranks, FSDP2: a frozen first layer (DTensor shards) and a trained second one."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainer_sdk.checkpointer import Checkpointer

    def build() -> tuple[Any, Any]:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
        model[0].requires_grad_(False)
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])

    def full(model: Any) -> dict[str, list[float]]:
        return {k: v.full_tensor().flatten().tolist() for k, v in model.state_dict().items()}

    model, opt = build()
    with Checkpointer(root, model=model, optimizer=opt, keep_last=2) as ck:
        ck.restore()
        for step in (1, 2, 3):
            opt.zero_grad()
            model(torch.ones(4, 32) * step).square().mean().backward()
            opt.step()
            ck.save(step)
    saved = full(model)
    model2, opt2 = build()
    with Checkpointer(root, model=model2, optimizer=opt2) as ck:
        step = ck.restore()
    return {"step": step, "equal": full(model2) == saved}


@pytest.mark.e2e
def test_fsdp2_frozen_shards_are_referenced(tmp_path: Path) -> None:
    a, b = run_ranks(_fsdp_frozen, 2, args=(str(tmp_path),), timeout=300)
    assert a == b == {"step": 3, "equal": True}
    m = _manifest(tmp_path, 3)
    for key in ("model.0.weight", "model.0.bias"):
        entry = m.tensors[key]
        assert entry.kind == "sharded"
        assert {m.files[p.file].step for p in entry.pieces} == {1}  # each rank's shard, reused
    assert not {k for k in _written_keys(m) if k.startswith("model.0.")}
    assert sorted(int(p.name[5:17]) for p in tmp_path.iterdir() if p.name.startswith("step-")) == [
        1,
        2,
        3,
    ]
    assert not (tmp_path / "step-000000000001" / "manifest.json").exists()
