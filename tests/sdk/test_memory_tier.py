"""The memory tier (``fast_every_steps`` / ``fast_dir``): snapshots in the durable format,
bounded on disk, never used when cut short, agreed on by every rank at restore, promotable.

Real parts only: the Checkpointer on real files; three real gloo ranks for the agreement (one
launch, several restores: a rank whose snapshot is missing, one whose snapshot is corrupt,
then all of them whole); a writer process SIGKILLed for real in the middle of a snapshot; and
``baton_testing.trainer`` on three ranks of one "pod" (torchrun's shape), killed at once (a
node lost without notice) and resumed from the memory snapshot, bitwise equal to the
uninterrupted run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from baton_testing import exactness, trainer
from baton_testing.dist import start_ranks
from baton_testing.s3 import S3Bucket

import trainer_sdk
from trainer_sdk.errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError
from trainer_sdk.loop._memory_tier import complete_steps
from trainer_sdk.storage import open_storage

STEP_PREFIX = "step-"


def _model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(step)  # the same batch on every rank and every run
    x = torch.randn(4, 8, generator=gen)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    out = [t.detach().numpy().tobytes().hex() for t in model.state_dict().values()]
    for st in opt.state_dict()["state"].values():
        out += [v.numpy().tobytes().hex() for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def _snapshot_dirs(fast: Path) -> list[str]:
    return sorted(n for n in os.listdir(fast) if n.startswith(STEP_PREFIX))


def _wait_for(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


# ------------------------------------------------------------------ one process, in-process


def test_snapshots_are_bounded_and_restore_prefers_the_newest_tier(tmp_path: Path) -> None:
    fast, uri = tmp_path / "fast", tmp_path / "ck"
    model, opt = _model()
    ck = trainer_sdk.Checkpointer(
        uri, model=model, optimizer=opt, every_steps=10, fast_every_steps=1, fast_dir=fast,
        handle_sigterm=False,
    )  # fmt: skip
    assert ck.restore() == 0
    assert ck.restored.tier is None
    for step in range(1, 14):
        _train(model, opt, step)
        ck.step(step)
        # the newest complete snapshot and the one being written, never more
        assert len(_snapshot_dirs(fast)) <= 2, _snapshot_dirs(fast)
    ck.wait()
    assert _snapshot_dirs(fast) == ["step-000000000013"]
    assert trainer_sdk.list_steps(str(uri)) == [10]
    # the same format as the durable tier: the ordinary loader reads a snapshot
    assert trainer_sdk.list_steps(str(fast)) == [13]
    want = _digest(model, opt)
    ck.close()

    model2, opt2 = _model(seed=1)
    ck2 = trainer_sdk.Checkpointer(
        uri, model=model2, optimizer=opt2, fast_dir=fast, handle_sigterm=False
    )
    assert ck2.restore() == 13
    assert ck2.restored == trainer_sdk.RestoreInfo(step=13, tier="memory", uri=f"file://{fast}")
    assert _digest(model2, opt2) == want
    ck2.close()  # waits for the promotion of step 13, which its restore started

    # Without the memory tier the same root resumes from the durable tier, where restoring a
    # snapshot that was not durable yet promoted it (docs/checkpointer.md, "Promotion").
    assert trainer_sdk.list_steps(str(uri)) == [10, 13]
    model3, opt3 = _model(seed=2)
    ck3 = trainer_sdk.Checkpointer(uri, model=model3, optimizer=opt3, handle_sigterm=False)
    assert ck3.restore() == 13
    assert ck3.restored.tier == "durable"
    assert _digest(model3, opt3) == want
    ck3.close()


def test_fast_every_steps_needs_a_directory_and_the_env_form_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(CheckpointError, match="needs fast_dir"):
        trainer_sdk.Checkpointer(tmp_path / "ck", fast_every_steps=1, handle_sigterm=False)
    monkeypatch.setenv("BATON_FAST_EVERY_STEPS", "2")
    monkeypatch.setenv("BATON_FAST_DIR", str(tmp_path / "fast"))
    model, opt = _model()
    with trainer_sdk.Checkpointer(
        tmp_path / "ck", model=model, optimizer=opt, handle_sigterm=False
    ) as ck:
        assert (ck.config.fast_every_steps, ck.config.fast_dir) == (2, str(tmp_path / "fast"))
        ck.restore()
        for step in (1, 2, 3):
            _train(model, opt, step)
            ck.step(step)
        ck.wait()
    assert _snapshot_dirs(tmp_path / "fast") == ["step-000000000002"]


def test_a_notice_is_served_by_a_durable_save_before_any_snapshot(tmp_path: Path) -> None:
    fast, uri = tmp_path / "fast", tmp_path / "ck"
    model, opt = _model()
    with trainer_sdk.Checkpointer(
        uri, model=model, optimizer=opt, fast_every_steps=1, fast_dir=fast, async_save=True,
        handle_sigterm=False,
    ) as ck:  # fmt: skip
        ck.restore()
        for step in range(1, 10):
            _train(model, opt, step)
            if step == 4:
                ck.request_checkpoint(reason="test notice")
            if ck.step(step):
                break
        want = _digest(model, opt)
    assert step == 4
    assert trainer_sdk.list_steps(str(uri)) == [4]  # the notice's save is durable
    # no snapshot of the noticed step: the notice came first and training stopped
    assert complete_steps(open_storage(str(fast)))[0] == [3]
    model2, opt2 = _model(seed=5)
    with trainer_sdk.Checkpointer(
        uri, model=model2, optimizer=opt2, fast_dir=fast, handle_sigterm=False
    ) as ck2:
        assert ck2.restore() == 4
        assert ck2.restored.tier == "durable"
    assert _digest(model2, opt2) == want
    assert _snapshot_dirs(fast) == []  # restore keeps only the snapshot it loaded (none here)


def _trained_snapshot(tmp_path: Path, steps: int = 7) -> tuple[Path, Path, list[str]]:
    fast, uri = tmp_path / "fast", tmp_path / "ck"
    model, opt = _model()
    with trainer_sdk.Checkpointer(
        uri, model=model, optimizer=opt, every_steps=5, fast_every_steps=1, fast_dir=fast,
        handle_sigterm=False,
    ) as ck:  # fmt: skip
        ck.restore()
        for step in range(1, steps + 1):
            _train(model, opt, step)
            ck.step(step)
        ck.wait()
        return fast, uri, _digest(model, opt)


def test_promoted_snapshot_restores_bitwise_from_the_durable_tier_alone(tmp_path: Path) -> None:
    fast, uri, want = _trained_snapshot(tmp_path)
    copied = trainer_sdk.promote(fast, uri, step=7)
    assert copied > 0
    assert trainer_sdk.promote(fast, uri, step=7) == 0  # already there: nothing to do
    assert trainer_sdk.latest_step(str(uri)) == 7
    shutil.rmtree(fast)  # the pod is gone
    model, opt = _model(seed=3)
    with trainer_sdk.Checkpointer(uri, model=model, optimizer=opt, handle_sigterm=False) as ck:
        assert ck.restore() == 7
        assert ck.restored.tier == "durable"
    assert _digest(model, opt) == want


def test_promotion_refuses_a_corrupt_or_incomplete_snapshot(tmp_path: Path) -> None:
    fast, uri, _ = _trained_snapshot(tmp_path)
    with pytest.raises(IncompleteCheckpointError, match="cannot be promoted"):
        trainer_sdk.promote(fast, uri, step=6)  # deleted when 7 was complete
    shard = fast / "step-000000000007" / "rank-00000-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x40
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="not promoted"):
        trainer_sdk.promote(fast, uri, step=7)
    assert trainer_sdk.list_steps(str(uri)) == [5]  # nothing of step 7 became durable
    assert not (uri / "step-000000000007" / "manifest.json").exists()


@pytest.mark.usefixtures("s3_bucket")
def test_promotion_to_s3_restores_bitwise(
    tmp_path: Path, s3_bucket: S3Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATON_S3_PART_SIZE_MIB", "5")
    fast, _, want = _trained_snapshot(tmp_path)
    uri = s3_bucket.uri("jobs/promoted")
    trainer_sdk.promote(fast, uri, step=7)
    assert "jobs/promoted/step-000000000007/manifest.json" in s3_bucket.keys("jobs/promoted/")
    model, opt = _model(seed=4)
    with trainer_sdk.Checkpointer(uri, model=model, optimizer=opt, handle_sigterm=False) as ck:
        assert ck.restore() == 7
        assert ck.restored.tier == "durable"
    assert _digest(model, opt) == want


# ------------------------------------------------------------ a writer killed mid-snapshot


def _big_layer() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(2048, 4096)  # 32 MiB of weights: a write that takes a while


def _big_writer_body(fast: str, uri: str) -> None:
    state = _big_layer()
    with trainer_sdk.Checkpointer(
        uri, model=state, fast_every_steps=1, fast_dir=fast, handle_sigterm=False
    ) as ck:
        ck.restore()
        for step in range(1, 10_000):
            with torch.no_grad():
                state.weight.add_(1.0)
            ck.step(step)


def test_a_snapshot_killed_mid_write_is_never_used(tmp_path: Path) -> None:
    fast, uri = tmp_path / "fast", tmp_path / "ck"
    group = start_ranks(_big_writer_body, 1, args=(str(fast), str(uri)), timeout=300)
    try:
        storage = open_storage(str(fast))

        def writing_unfinished() -> int | None:
            """A step whose shard is being streamed (a temp file), after a complete one."""
            for name in sorted(os.listdir(fast), reverse=True) if fast.exists() else []:
                d = fast / name
                if (
                    name.startswith(STEP_PREFIX)
                    and any(".tmp-" in n for n in os.listdir(d))
                    and not (d / "manifest.json").exists()
                    and complete_steps(storage)[0]
                ):
                    return int(name.removeprefix(STEP_PREFIX))
            return None

        # Freeze the writer while a step is half written (retry if it finished in between),
        # then kill it for real.
        while True:
            _wait_for(lambda: writing_unfinished() is not None, 240, "a snapshot being written")
            group.kill(0, signal.SIGSTOP)
            cut = writing_unfinished()
            if cut is not None:
                break
            group.kill(0, signal.SIGCONT)
        group.kill(0, signal.SIGKILL)
        group.wait()
    finally:
        if group.alive(0):
            group.kill(0, signal.SIGKILL)
    done, why = complete_steps(storage)
    assert done == [cut - 1], (done, why)  # only the older, complete one
    assert why[cut] == "no manifest (never committed)"

    model = _big_layer()
    want = model.weight.detach().clone()
    with torch.no_grad():
        for _ in range(cut - 1):
            want.add_(1.0)
        model.weight.zero_()
    with trainer_sdk.Checkpointer(
        uri, model=model, fast_every_steps=1, fast_dir=fast, handle_sigterm=False
    ) as ck:
        assert ck.restore() == cut - 1
        assert ck.restored.tier == "memory"
        # the interrupted step is gone, so that a new snapshot of it starts clean
        assert _snapshot_dirs(fast) == [f"step-{cut - 1:012d}"]
        assert torch.equal(model.weight, want)
        with torch.no_grad():
            model.weight.add_(1.0)
        ck.step(cut)
        ck.wait()
    assert complete_steps(storage)[0] == [cut]


# ------------------------------------------------- three ranks agree on a step all can load


def _agreement_body(root: str) -> dict[str, Any]:
    import torch.distributed as dist

    rank = dist.get_rank()
    base = Path(root)
    model, opt = _model()

    def checkpointer(fast: Path) -> trainer_sdk.Checkpointer:
        return trainer_sdk.Checkpointer(
            base / "ck", model=model, optimizer=opt, every_steps=10, fast_every_steps=1,
            fast_dir=fast, handle_sigterm=False, timeout=120,
        )  # fmt: skip

    out: dict[str, Any] = {}
    with checkpointer(base / "shared") as ck:  # one pod's emptyDir, shared by its 3 ranks
        ck.restore()
        for step in range(1, 14):
            _train(model, opt, step)
            if step == 10:
                out["digest10"] = _digest(model, opt)
            ck.step(step)
        ck.wait()
    out["digest13"] = _digest(model, opt)
    dist.barrier()

    def per_rank(case: str, prepare: Any) -> Path:
        """Give every rank its own fast_dir (as if each were a pod with the snapshot, e.g.
        from a replica): a whole copy, then ``prepare`` on one rank's."""
        mine = base / case / f"rank{rank}"
        if rank == 0:
            for r in range(3):
                shutil.copytree(base / "shared", base / case / f"rank{r}")
            prepare(base / case)
        dist.barrier()
        return mine

    def restore(case: str, fast: Path) -> None:
        model_, opt_ = _model(seed=100 + rank)  # other values everywhere
        for a, b in zip(model.parameters(), model_.parameters(), strict=True):
            with torch.no_grad():
                a.copy_(b)
        opt.load_state_dict(opt_.state_dict())
        with checkpointer(fast) as ck:
            step = ck.restore()
            out[case] = [step, ck.restored.tier, _digest(model, opt)]

    def missing(d: Path) -> None:
        shutil.rmtree(d / "rank1")  # rank 1's pod was replaced: an empty emptyDir
        (d / "rank1").mkdir()

    def corrupt(d: Path) -> None:
        """Flip a bit of a replicated tensor that rank 1 wrote, in rank 2's copy only."""
        step = d / "rank2" / "step-000000000013"
        manifest = json.loads((step / "manifest.json").read_text())
        piece = next(
            p
            for key, t in manifest["tensors"].items()
            if t["kind"] == "replicated"
            for p in t["pieces"]
            if p["file"] == "rank-00001-of-00003.safetensors"
        )
        shard = step / piece["file"]
        data = bytearray(shard.read_bytes())
        data[piece["begin"]] ^= 0x01
        shard.write_bytes(bytes(data))

    restore("missing", per_rank("missing", missing))
    restore("corrupt", per_rank("corrupt", corrupt))
    restore("whole", per_rank("whole", lambda d: None))
    return out


@pytest.mark.e2e  # three real ranks
def test_ranks_agree_on_a_step_every_rank_can_load(tmp_path: Path) -> None:
    group = start_ranks(_agreement_body, 3, args=(str(tmp_path),), timeout=600)
    results = group.wait()
    assert all(r.ok for r in results), [(r.error, r.output[-3000:]) for r in results]
    for r in results:
        v = r.value
        # rank 1 has no snapshot: the whole group takes the durable step, bitwise
        assert v["missing"] == [10, "durable", v["digest10"]]
        # rank 2's copy has a flipped bit: its load fails, the group falls back together
        assert v["corrupt"] == [10, "durable", v["digest10"]]
        assert v["whole"] == [13, "memory", v["digest13"]]
    log0 = results[0].output
    assert "cannot be loaded by rank 1 (no such snapshot)" in log0, log0
    assert "the group restores from the newest step every rank can load" in log0
    assert "the memory snapshot of step 13 under" in log0, log0
    assert "could not be loaded" in log0, log0


# ------------------------------ three ranks of one pod overwrite the snapshot before last


def _square_layers(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Nine 1 MiB tensors with AdamW's state: every rank's shard is over SPARE_MIN_BYTES."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*(torch.nn.Linear(512, 512, bias=False) for _ in range(3)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _recycling_body(root: str) -> dict[str, Any]:
    import torch.distributed as dist

    base = Path(root)
    fast = base / "fast"  # one pod's emptyDir, shared by its 3 ranks
    model, opt = _square_layers(0)

    def checkpointer() -> trainer_sdk.Checkpointer:
        return trainer_sdk.Checkpointer(
            base / "ck", model=model, optimizer=opt, every_steps=4, fast_every_steps=1,
            fast_dir=fast, handle_sigterm=False, timeout=120,
        )  # fmt: skip

    def shard_inodes(step: int) -> list[int]:
        d = fast / f"{STEP_PREFIX}{step:012d}"
        return sorted(os.stat(d / n).st_ino for n in os.listdir(d) if n.endswith(".safetensors"))

    out: dict[str, Any] = {"inodes": {}, "dirs": []}
    with checkpointer() as ck:
        ck.restore()
        for step in range(1, 9):
            x = torch.randn(16, 512, generator=torch.Generator().manual_seed(step))
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            ck.step(step)
            ck.wait()
            dist.barrier()  # every rank's write of this step is over before anyone looks
            out["inodes"][step] = shard_inodes(step)
            out["dirs"].append(sorted(os.listdir(fast)))
            dist.barrier()
    out["digest"] = _digest(model, opt)
    dist.barrier()

    model, opt = _square_layers(100 + dist.get_rank())  # other values everywhere
    with checkpointer() as ck:
        out["restored"] = [ck.restore(), ck.restored.tier, _digest(model, opt)]
    return out


@pytest.mark.e2e  # three real ranks
def test_a_pods_ranks_overwrite_the_snapshot_before_last_and_restore_bitwise(
    tmp_path: Path,
) -> None:
    """A snapshot takes the shard files of the one before the last (writing new files on tmpfs
    costs 4x the CPU), from any rank of the pod, and nothing it writes is lost or mixed."""
    group = start_ranks(_recycling_body, 3, args=(str(tmp_path),), timeout=600)
    results = group.wait()
    assert all(r.ok for r in results), [(r.error, r.output[-3000:]) for r in results]
    v = results[0].value
    inodes = {int(k): set(ino) for k, ino in v["inodes"].items()}
    assert all(len(ino) == 3 for ino in inodes.values()), inodes  # one shard per rank
    for step in range(3, 9):
        # the files of step - 2 went to the spares when step - 1 committed, and this step's
        # three shards overwrote exactly them (whichever rank took whichever)
        assert inodes[step] == inodes[step - 2], (step, inodes)
    # once a snapshot is done: it alone, and from step 2 the spares (the files of step - 1)
    assert v["dirs"][0] == [f"{STEP_PREFIX}{1:012d}"]
    for step, names in enumerate(v["dirs"][1:], start=2):
        assert names == [".spare", f"{STEP_PREFIX}{step:012d}"], names
    for r in results:
        assert r.value["digest"] == v["digest"]  # DDP-free, the same batches: one state
        assert r.value["restored"] == [8, "memory", v["digest"]]
    # the durable tier has no spares: its steps are whole and load bitwise too
    assert trainer_sdk.list_steps(str(tmp_path / "ck")) == [4, 8]


# ----------------------------------- a node lost without notice: 3 ranks, resume, bitwise


def _newest_snapshot(fast: Path) -> int | None:
    if not fast.exists():
        return None
    done = complete_steps(open_storage(str(fast)))[0]
    return done[0] if done else None


@pytest.mark.e2e  # real trainer processes, 3 ranks, a reference run
@pytest.mark.parametrize("in_background", [False, True], ids=["copy-in-step", "copy-beside"])
def test_all_ranks_killed_resume_from_the_memory_snapshot_bitwise(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, in_background: bool
) -> None:
    # copy-beside: each snapshot's copy of the parameters and AdamW state runs beside the next
    # forward and backward (BATON_STAGE_IN_BACKGROUND), the optimizer's step waiting for it.
    ref = exactness.reference(tmp_path_factory.mktemp("reference-ddp-3"), world=3)
    fast = tmp_path / "fast"
    env = {"BATON_FAST_EVERY_STEPS": "1", "BATON_FAST_DIR": str(fast)}
    if in_background:
        env["BATON_STAGE_IN_BACKGROUND"] = "1"
    args = exactness.args(tmp_path, "--every-steps", "10", "--sleep", "0.1")
    run = trainer.launch(3, args, workdir=tmp_path / "out", env=env, procs_per_pod=3)
    try:

        def between_durable_saves() -> bool:
            if any(p.poll() is not None for p in run.procs):
                raise AssertionError(f"trainer ended early:\n{run.output()}")
            s = _newest_snapshot(fast)
            return s is not None and s >= 13 and s % 10 != 0

        _wait_for(between_durable_saves, exactness.RUN_TIMEOUT, "a snapshot after step 12")
    finally:
        run.kill_all()  # every rank at once, no notice: the node is gone
    snap = _newest_snapshot(fast)
    durable = trainer_sdk.latest_step(str(tmp_path / "ck"))
    assert snap is not None
    assert durable is not None
    # Normally 13-15: only the memory tier has it (durable steps are multiples of 10). On a
    # starved machine the kill may land later; at 20 both tiers have it, memory is preferred.
    assert snap >= 13
    assert snap >= durable, (snap, durable)

    last = trainer.launch(3, args, workdir=tmp_path / "out", env=env, procs_per_pod=3)
    codes = last.wait(exactness.RUN_TIMEOUT)
    assert codes == [0, 0, 0], last.output()
    assert f"RESUMED_FROM {snap}" in last.output(0), last.output(0)
    exactness.check_exact(tmp_path, ref)
