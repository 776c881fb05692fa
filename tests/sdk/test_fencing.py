"""Fencing of attempts and honest commits, with real processes and a real S3 server.

* Two live trainer processes with different ``BATON_ATTEMPT`` on one uri (what a network
  partition leaves behind when the operator replaces the pods of a node it believes lost):
  the stale one's commits are refused, nothing of the newer attempt is deleted, and readers
  see the newer lineage. On a filesystem and on S3.
* Two writers racing one step on S3: exactly one commit wins (``If-None-Match: *``).
* ``latest`` failing after the manifest (through the fault proxy): the save returns, readers
  load the step. A lost reply to the manifest PUT is recognised by reading it back.
* S3 throttling (503 SlowDown) on shard GETs beyond the retry budget: restore raises, it never
  falls back to an older step.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from baton_testing.dist import run_ranks
from baton_testing.s3 import Fault, S3Bucket
from torch import nn

import trainer_sdk
from trainer_sdk import api
from trainer_sdk.checkpointer import Checkpointer
from trainer_sdk.errors import CheckpointError, SupersededError, UnreadableCheckpointError


def _model(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: nn.Module, opt: torch.optim.Optimizer, k: float = 1.0) -> None:
    opt.zero_grad()
    model(torch.full((3, 4), k)).square().mean().backward()
    opt.step()


def _digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _wait_for(path: Path, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {path}")
        time.sleep(0.01)


def _two_attempts(uri: str, sync_dir: str) -> dict[str, Any]:
    """RANK 0 plays attempt 1 (left running on a partitioned node), RANK 1 attempt 2 (its
    replacement). No process group: they are two separate jobs' worth of processes."""
    sync = Path(sync_dir)
    role = int(os.environ["RANK"])
    os.environ["BATON_ATTEMPT"] = str(role + 1)
    model, opt = _model()
    ck = Checkpointer(
        uri, model=model, optimizer=opt, every_steps=1, keep_last=3, handle_sigterm=False
    )
    if role == 0:
        assert ck.restore() == 0
        for step in range(1, 10):
            _train(model, opt)
            ck.step(step)
        (sync / "attempt1-at-9").touch()
        _wait_for(sync / "attempt2-at-11")
        # Still running, unaware of its replacement: it trains on and tries to save.
        for step in range(10, 16):
            _train(model, opt, k=3.0)  # diverges from attempt 2, so a mix-up would show
            try:
                ck.step(step)
            except SupersededError as e:
                ck.close()
                return {"refused_at": step, "msg": str(e), "attempt": e.attempt, "newer": e.newer}
        ck.close()
        return {"refused_at": None}
    _wait_for(sync / "attempt1-at-9")
    start = ck.restore()
    for step in range(start + 1, start + 3):
        _train(model, opt)
        ck.step(step)
    ck.close()
    digest = _digest(model)
    (sync / "attempt2-at-11").touch()
    return {"start": start, "digest": digest}


def _check_fenced(uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sync = tmp_path / "sync"
    sync.mkdir()
    stale, newer = run_ranks(_two_attempts, 2, args=(uri, str(sync)), init_pg=False, timeout=600)
    assert newer["start"] == 9
    assert stale["refused_at"] == 10, stale
    assert (stale["attempt"], stale["newer"]) == (1, 2)
    assert "attempt 2" in stale["msg"], stale["msg"]
    assert "stale" in stale["msg"], stale["msg"]
    # nothing of attempt 2 was deleted or overwritten; readers see its lineage
    steps = api.complete_steps(uri)
    assert sorted(steps) == [9, 10, 11]  # attempt 2's retention kept the newest 3
    assert [steps[s].attempt for s in (9, 10, 11)] == [1, 2, 2]
    assert trainer_sdk.latest_step(uri) == 11
    model, opt = _model(seed=4)
    monkeypatch.setenv("BATON_ATTEMPT", "2")  # attempt 2 restarting in place
    with Checkpointer(uri, model=model, optimizer=opt, handle_sigterm=False) as ck:
        assert ck.restore() == 11
    assert _digest(model) == newer["digest"]


@pytest.fixture(autouse=True)
def _no_attempt_from_outside(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATON_ATTEMPT", raising=False)


def test_a_stale_attempt_cannot_commit_or_delete_on_a_filesystem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _check_fenced(str(tmp_path / "ckpt"), tmp_path, monkeypatch)


def test_a_stale_attempt_cannot_commit_or_delete_on_s3(
    s3_bucket: S3Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _check_fenced(s3_bucket.uri(), tmp_path, monkeypatch)


def test_without_baton_attempt_each_new_process_is_a_newer_generation(tmp_path: Path) -> None:
    uri = str(tmp_path)
    model, opt = _model()
    first = Checkpointer(uri, model=model, optimizer=opt, every_steps=1, handle_sigterm=False)
    first.restore()
    _train(model, opt)
    first.step(1)
    second = Checkpointer(uri, model=model, optimizer=opt, every_steps=1, handle_sigterm=False)
    assert second.restore() == 1
    _train(model, opt)
    second.step(2)
    with pytest.raises(SupersededError, match="attempt 2"):
        first.step(3)
    first.close()
    second.close()
    assert api.read_manifest(uri, 2).attempt == 2
    assert api.read_manifest(uri, 1).attempt == 1


# ---- two writers racing one step on S3 ---------------------------------------------------


def _race(uri: str, sync_dir: str) -> dict[str, Any]:
    sync = Path(sync_dir)
    role = int(os.environ["RANK"])
    # The same tensors (so the shard objects either writer leaves are identical): the race
    # under test is the one for the commit marker. Their manifests differ (time, trigger).
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    (sync / f"ready-{role}").touch()
    _wait_for(sync / f"ready-{1 - role}")
    try:
        api.save(state, uri, step=5, trigger=f"writer{role}")
    except CheckpointError as e:
        return {"won": False, "msg": str(e)}
    return {"won": True}


def test_two_writers_racing_one_step_on_s3_exactly_one_commits(
    s3_bucket: S3Bucket, tmp_path: Path
) -> None:
    for round_ in range(3):
        uri = s3_bucket.uri(f"race{round_}")
        sync = tmp_path / f"sync{round_}"
        sync.mkdir()
        results = run_ranks(_race, 2, args=(uri, str(sync)), init_pg=False, timeout=300)
        winners = [r for r, res in enumerate(results) if res["won"]]
        assert len(winners) == 1, results
        loser = results[1 - winners[0]]
        assert "committed" in loser["msg"], loser["msg"]
        assert api.read_manifest(uri, 5).trigger == f"writer{winners[0]}"
        st = {"w": torch.zeros(1000)}
        trainer_sdk.load(st, uri, step=5)
        assert torch.equal(st["w"], torch.arange(1000, dtype=torch.float32))


# ---- honest commits on S3 -----------------------------------------------------------------


def test_latest_failing_after_the_manifest_on_s3_is_a_warning(
    s3_faults: S3Bucket, caplog: pytest.LogCaptureFixture
) -> None:
    assert s3_faults.proxy is not None
    uri = s3_faults.uri()
    state = {"w": torch.ones(10)}
    api.save(state, uri, step=1)
    s3_faults.proxy.add(Fault(op="PutObject", key="*/latest", status=403, code="AccessDenied"))
    caplog.set_level(logging.WARNING, logger="trainer_sdk")
    state["w"] = torch.full((10,), 2.0)
    info = api.save(state, uri, step=2)  # returns: the manifest is the commit
    assert info.step == 2
    assert any(
        "step 2 is committed" in r.getMessage() and "AccessDenied" in r.getMessage()
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]
    assert json.loads(s3_faults.get("ckpt/latest")) == {"step": 1}  # the stale hint...
    assert trainer_sdk.latest_step(uri) == 2  # ...is not trusted
    st = {"w": torch.zeros(10)}
    assert trainer_sdk.load(st, uri).step == 2
    assert torch.equal(st["w"], torch.full((10,), 2.0))


def test_a_lost_reply_to_the_manifest_put_is_recognised(s3_faults: S3Bucket) -> None:
    assert s3_faults.proxy is not None
    uri = s3_faults.uri()
    s3_faults.proxy.add(
        Fault(op="PutObject", key="*/manifest.json", action="drop_response", times=1)
    )
    info = api.save({"w": torch.ones(10)}, uri, step=1)
    assert info.step == 1
    puts = s3_faults.proxy.seen("PutObject")
    manifest_puts = [s for s in puts if s.key.endswith("manifest.json")]
    # the first PUT took but its reply was lost; the retry met our own object (412)
    assert [s.fault for s in manifest_puts][:1] == ["drop_response"]
    assert any(s.status == 412 for s in manifest_puts), manifest_puts
    assert all(s.headers.get("if-none-match") == "*" for s in manifest_puts)
    assert trainer_sdk.latest_step(uri) == 1


def test_s3_throttling_on_shard_reads_beyond_retries_raises_and_never_falls_back(
    s3_faults: S3Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert s3_faults.proxy is not None
    monkeypatch.setenv("BATON_S3_MAX_ATTEMPTS", "2")
    monkeypatch.setenv("BATON_S3_RETRY_ROUNDS", "2")
    uri = s3_faults.uri()
    model, opt = _model()
    with Checkpointer(uri, model=model, optimizer=opt, handle_sigterm=False) as ck:
        _train(model, opt)
        ck.save(1)
        _train(model, opt)
        ck.save(2)
    s3_faults.proxy.add(
        Fault(
            op="GetObject",
            key="ckpt/step-000000000002/rank-*.safetensors",
            status=503,
            code="SlowDown",
        )
    )
    model2, opt2 = _model(seed=9)
    before = _digest(model2)
    with (
        Checkpointer(uri, model=model2, optimizer=opt2, handle_sigterm=False) as ck,
        pytest.raises(UnreadableCheckpointError, match="SlowDown") as info,
    ):
        ck.restore()
    assert info.value.step == 2
    assert "step 2" in str(info.value)
    assert _digest(model2) == before  # step 1 was not loaded instead
    assert api.complete_steps(uri).keys() == {1, 2}  # and nothing was deleted
