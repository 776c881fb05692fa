"""The memory tier for a DCP loop (issue 28, item 1's last part): ``BatonNotices`` with
``fast_dir``/``fast_every_steps`` snapshots the DCP state dict into the tier, a resume takes the
newest step every rank can load from either tier by the ``Checkpointer``'s rules, a snapshot that
is not durable is promoted, and a bad snapshot is never used.

Real parts: three gloo ranks (one "pod": one ``fast_dir``, ``LOCAL_RANK`` 0..2), FSDP2 over a CPU
mesh, ``get_state_dict``/``set_state_dict`` and ``dcp.load``, real files; for the notice, two
real ``baton-sidecar`` processes replicating the pod's snapshots to a peer and a durable tier
throttled for real (``baton_testing.throttled``), so that the SDK's own measurements choose
the memory tier.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from baton_testing.dist import run_ranks
from integrations.dcp_train import batch, build_model, hashes

import trainer_sdk
from trainer_sdk.integrations.dcp import BatonLoadPlanner, BatonNotices, BatonReader

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

NPROC = 3


def _state(model: Any, opt: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def _fresh(mesh: Any, seed: int, hidden: int = 32) -> tuple[Any, Any]:
    """A model and AdamW with other values than the run's (``seed``), optimizer state built."""
    model = build_model(mesh, seed=seed, hidden=hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _train(model: Any, opt: Any, step: int, rank: int) -> None:
    x, y = batch(step, rank)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _resume(notices: BatonNotices, model: Any, opt: Any) -> int | None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    current = _state(model, opt)
    start = notices.resume(current)
    if start is not None:
        set_state_dict(model, opt, model_state_dict=current["model"],
                       optim_state_dict=current["optim"])  # fmt: skip
    return start


def _load_durable(mesh: Any, uri: Path, step: int, seed: int) -> dict[str, str]:
    """``dcp.load`` of ``step`` under ``uri`` through a plain ``BatonReader``, into a fresh
    model; its hashes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, opt = _fresh(mesh, seed)
    _train(model, opt, 0, 0)  # AdamW's state exists, with other values than the step's
    st = _state(model, opt)
    dcp.load(st, storage_reader=BatonReader(str(uri), step=step), planner=BatonLoadPlanner())
    set_state_dict(model, opt, model_state_dict=st["model"], optim_state_dict=st["optim"])
    return hashes(model, opt)


def _loop(notices: BatonNotices, model: Any, opt: Any, steps: range, every: int) -> None:
    """The DCP loop of the docs: a durable ``dcp.save`` every ``every`` steps (or on a notice),
    a memory snapshot whenever it is due."""
    import torch.distributed as dist

    for step in steps:
        _train(model, opt, step, dist.get_rank())
        if notices.should_save(step, periodic=step % every == 0):
            notices.save(_state(model, opt), step)
        if notices.snapshot_due(step):
            notices.snapshot(_state(model, opt), step)


def _tiers_body(root: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    base = Path(root)
    uri, fast = base / "ck", base / "fast"
    mesh = init_device_mesh("cpu", (NPROC,))
    out: dict[str, Any] = {}

    model, opt = _fresh(mesh, seed=0)
    with BatonNotices(str(uri), fast_dir=fast, fast_every_steps=1, timeout=120) as notices:
        out["first"] = _resume(notices, model, opt)
        _loop(notices, model, opt, range(1, 8), every=4)
    out["h7"] = hashes(model, opt)
    out["durable_after_run"] = trainer_sdk.list_steps(str(uri))
    out["memory_after_run"] = trainer_sdk.list_steps(str(fast))

    # A new process's state (other weights): the memory snapshot of step 7 is the newest.
    model, opt = _fresh(mesh, seed=1)
    _train(model, opt, 0, rank)
    with BatonNotices(str(uri), fast_dir=fast, timeout=120) as notices:
        out["resumed"] = [_resume(notices, model, opt), notices.restored.tier]
        out["h_memory"] = hashes(model, opt)
        # close() waits for the promotion of step 7, which the resume started (not durable)
    dist.barrier()
    out["durable_after_resume"] = trainer_sdk.list_steps(str(uri))
    out["h_promoted"] = _load_durable(mesh, uri, 7, seed=2)
    out["h_snapshot"] = _load_durable(mesh, fast, 7, seed=3)  # the snapshot, read as a step

    # Go on from the resumed state: a durable save at 8, a snapshot at 9.
    with BatonNotices(str(uri), fast_dir=fast, fast_every_steps=1, timeout=120) as notices:
        _loop(notices, model, opt, range(8, 10), every=4)
    out["h9"] = hashes(model, opt)
    dist.barrier()

    def case(name: str, spoil: Any) -> Path:
        """A copy of the pod's ``fast_dir`` with snapshot 9 spoiled by ``spoil``."""
        copy = base / name
        if rank == 0:
            shutil.copytree(fast, copy)
            spoil(copy / "step-000000000009")
        dist.barrier()
        return copy

    def incomplete(step_dir: Path) -> None:
        (step_dir / "manifest.json").unlink()  # a snapshot cut short: never committed

    def corrupt(step_dir: Path) -> None:
        manifest = json.loads((step_dir / "manifest.json").read_text())
        piece = manifest["tensors"]["model.2.weight"]["pieces"][0]
        shard = step_dir / piece["file"]
        data = bytearray(shard.read_bytes())
        data[piece["begin"]] ^= 0x01  # one bit of a tensor some rank reads
        shard.write_bytes(bytes(data))

    for name, spoil in (("incomplete", incomplete), ("corrupt", corrupt)):
        where = case(name, spoil)
        m, o = _fresh(mesh, seed=10)
        _train(m, o, 0, rank)
        with BatonNotices(str(uri), fast_dir=where, timeout=120) as notices:
            out[name] = [_resume(notices, m, o), notices.restored.tier, hashes(m, o)]
    out["h8"] = _load_durable(mesh, uri, 8, seed=4)
    return out


def test_a_dcp_loop_snapshots_promotes_and_falls_back_by_the_checkpointers_rules(
    tmp_path: Path,
) -> None:
    results = run_ranks(_tiers_body, NPROC, args=(str(tmp_path),), timeout=540)
    for rank, v in enumerate(results):
        assert v["first"] is None
        # durable every 4, snapshots every step: the durable tier has 4, the memory tier 7
        assert v["durable_after_run"] == [4], rank
        assert v["memory_after_run"] == [7], rank
        # resumed from the memory tier, bitwise (weights and AdamW state of every parameter)
        assert v["resumed"] == [7, "memory"], rank
        assert v["h_memory"] == v["h7"], rank
        # restoring a snapshot that was not durable promoted it: plain dcp.load reads it there
        assert v["durable_after_resume"] == [4, 7], rank
        assert v["h_promoted"] == v["h7"], rank
        assert v["h_snapshot"] == v["h7"], rank
        # a snapshot without its manifest, or with a flipped bit, is not used: durable step 8
        assert v["incomplete"] == [8, "durable", v["h8"]], rank
        assert v["corrupt"] == [8, "durable", v["h8"]], rank
        assert v["h8"] != v["h9"], "step 9 was trained past 8"


def test_dcp_notices_without_the_memory_tier_ignore_the_fast_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # memory_tier=False (what Lightning's callback passes): the operator's variables build no
    # tier, a snapshot already in fast_dir is not resumed from, and arguments asking for the
    # tier are refused with the fix. One process: no rank's behaviour differs here.
    uri, fast = tmp_path / "ck", tmp_path / "fast"
    state = {"w": torch.arange(6, dtype=torch.float32)}
    with BatonNotices(str(uri), fast_dir=fast, fast_every_steps=1, timeout=60) as notices:
        assert notices.has_memory_tier
        notices.save(state, 4)
        state["w"] += 1
        notices.snapshot(state, 7)
        notices.wait()
    assert trainer_sdk.list_steps(str(fast)) == [7]
    monkeypatch.setenv("BATON_FAST_DIR", str(fast))
    monkeypatch.setenv("BATON_FAST_EVERY_STEPS", "1")
    loaded = {"w": torch.zeros(6)}
    with BatonNotices(str(uri), memory_tier=False, timeout=60) as notices:
        assert not notices.has_memory_tier
        assert notices.fast_ignored == ("BATON_FAST_DIR", "BATON_FAST_EVERY_STEPS")
        assert not notices.snapshot_due(7)
        assert notices.resume(loaded) == 4
        assert notices.restored.tier == "durable"
        with pytest.raises(trainer_sdk.CheckpointError, match="leave memory_tier=True"):
            notices.snapshot(loaded, 8)
    assert torch.equal(loaded["w"], torch.arange(6, dtype=torch.float32))
    monkeypatch.setenv("BATON_FAST_DIR", str(tmp_path / "never"))
    with BatonNotices(str(uri), memory_tier=False, timeout=60) as notices:
        assert notices.fast_ignored == ("BATON_FAST_DIR", "BATON_FAST_EVERY_STEPS")
    assert not (tmp_path / "never").exists()  # a tier would have made its directory
    with pytest.raises(trainer_sdk.CheckpointError, match="drop those arguments"):
        BatonNotices(str(uri), memory_tier=False, fast_dir=fast)
    with pytest.raises(trainer_sdk.CheckpointError, match="drop those arguments"):
        BatonNotices(str(uri), memory_tier=False, fast_every_steps=1)


# ------------------------- a notice too short for the durable tier: memory, then promoted

HIDDEN = 1024
"""The middle layer's width: about 4.4 MB of weights and AdamW state per rank, so that the
throttled durable tier measures several seconds for a save and the memory tier well under one."""
RATE = 1 << 20
"""Bytes per second the durable tier takes (``ThrottledStorage``): the probe (8 MiB) measures it."""
LEFT = 4.0
"""Seconds left at the notice's agreement before the deadline minus the margin: more than a
replicated snapshot takes here, less than a durable save at ``RATE`` (about 7 s, measured)."""


def _notice_body(root: str, fast: str, control: str, sidecar: str, token: str) -> dict[str, Any]:
    import time
    from datetime import UTC, datetime

    import requests
    import torch.distributed as dist
    from baton_testing.throttled import ThrottledStorage
    from torch.distributed.device_mesh import init_device_mesh

    from trainer_sdk.control import ControlChannel

    rank = dist.get_rank()
    base = Path(root)
    mesh = init_device_mesh("cpu", (NPROC,))
    model, opt = _fresh(mesh, seed=0, hidden=HIDDEN)
    out: dict[str, Any] = {"exit": None}
    notices = BatonNotices(
        ThrottledStorage(str(base / "ck"), rate=RATE), fast_dir=fast, fast_every_steps=1,
        deadline_margin=1.0, timeout=120,
    )  # fmt: skip
    try:
        out["first"] = _resume(notices, model, opt)  # nothing yet; probes the durable tier
        for step in range(1, 20):
            _train(model, opt, step, rank)
            if step == 4 and rank == 0:  # the sidecar's notice reaches local rank 0 alone
                deadline = datetime.fromtimestamp(time.time() + LEFT + 1.0, tz=UTC)
                r = requests.post(
                    f"{sidecar}/v1/checkpoint", json={"deadline": deadline.isoformat(),
                                                      "reason": "spot"},
                    headers={"Authorization": f"Bearer {token}"}, timeout=10,
                )  # fmt: skip
                assert r.status_code in (200, 202), r.text
            out["step"] = step
            if notices.should_save(step):
                out["h_notice"] = hashes(model, opt)
                notices.save(_state(model, opt), step)  # exits once the promotion ended
            if notices.snapshot_due(step):
                notices.snapshot(_state(model, opt), step)
                notices.wait()  # each snapshot replicated before the next step: measured
    except SystemExit as e:
        out["exit"] = e.code
    status = ControlChannel(control).read_local_status(rank)
    assert status is not None
    out["status"] = [status.state.value, status.step, status.tier, status.trigger,
                     status.last_committed_step]  # fmt: skip
    out["durable"] = trainer_sdk.list_steps(str(base / "ck"))
    dist.barrier()
    # The relaunch: the newest step of either tier is the notice's, in memory and durable.
    m, o = _fresh(mesh, seed=7, hidden=HIDDEN)
    _train(m, o, 0, rank)
    with BatonNotices(str(base / "ck"), fast_dir=fast, timeout=120) as again:
        out["resumed"] = [_resume(again, m, o), again.restored.tier]
    out["h_resumed"] = hashes(m, o)
    return out


def test_a_notice_too_short_for_the_durable_tier_commits_to_memory_and_resumes_bitwise(
    tmp_path: Path,
) -> None:
    from baton_testing.sidecar_process import TOKEN, pod_dir, replicating_sidecar, start_ring

    pods = [replicating_sidecar(tmp_path, k) for k in range(3)]  # the trainer's pod, 2 peers
    start_ring(pods, [0, 1, 2])
    try:
        results = run_ranks(
            _notice_body, NPROC, timeout=540,
            args=(str(tmp_path), str(pod_dir(tmp_path, 0) / "fast"),
                  str(pods[0].control_dir), pods[0].url, TOKEN),
            env={"BATON_CONTROL_DIR": str(pods[0].control_dir)},
        )  # fmt: skip
    finally:
        for p in pods:
            p.stop()
    steps = {v["step"] for v in results}
    assert len(steps) == 1, f"every rank stopped at one agreed step: {steps}"
    (step,) = steps
    for rank, v in enumerate(results):
        assert v["first"] is None
        # 76: the operator keeps the other pods and restarts their trainers in place
        assert v["exit"] == 76, (rank, v)
        # committed to memory, then promoted: the status says so once the copy ended
        assert v["status"] == ["committed", step, "memory+promoted", "notice", step], rank
        assert v["durable"] == [step], rank
        assert v["resumed"] == [step, "memory"], rank
        assert v["h_resumed"] == v["h_notice"], rank
