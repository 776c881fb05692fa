"""trainer_sdk.save / load / latest_step through s3:// against real S3 servers (moto and
versitygw, over HTTP), in one process and on 2 gloo ranks, and a save whose upload fails for
good."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from baton_testing.dist import run_ranks
from baton_testing.s3 import Fault, S3Bucket

import trainer_sdk
from trainer_sdk import cli
from trainer_sdk.errors import BatonError

# 5 MiB parts, and few quick retries, so that a 6 MiB tensor is a real multipart upload and a
# permanent failure gives up fast.
S3_ENV = {
    "BATON_S3_PART_SIZE_MIB": "5",
    "BATON_S3_MAX_ATTEMPTS": "2",
    "BATON_S3_RETRY_ROUNDS": "1",
}


def _model_state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 16)).sum().backward()
    opt.step()
    return {
        "model": model,
        "optim": opt,
        "big": torch.randn(6 * 1024 * 1024 // 4 + 3),  # > one 5 MiB part
        "meta": {"epoch": seed, "name": "run"},
    }


def _tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in state["model"].state_dict().items()}
    for pid, st in state["optim"].state_dict()["state"].items():
        for k, v in st.items():
            out[f"optim.{pid}.{k}"] = torch.as_tensor(v)
    out["big"] = state["big"]
    return out


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k
    assert a["meta"] == b["meta"]


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in S3_ENV.items():
        monkeypatch.setenv(k, v)


@pytest.mark.usefixtures("s3_env")
def test_save_load_latest_one_process(s3_bucket: S3Bucket) -> None:
    uri = s3_bucket.uri("jobs/a")
    assert trainer_sdk.latest_step(uri) is None
    saved = _model_state(1)
    info = trainer_sdk.save(saved, uri, step=10)
    assert info.step == 10
    assert info.uri == uri
    later = _model_state(2)
    trainer_sdk.save(later, uri, step=20)
    assert trainer_sdk.latest_step(uri) == 20
    assert json.loads(s3_bucket.get("jobs/a/latest")) == {"step": 20}
    assert "jobs/a/step-000000000020/manifest.json" in s3_bucket.keys("jobs/a/")
    assert s3_bucket.multipart_uploads() == []

    fresh = _model_state(3)
    loaded = trainer_sdk.load(fresh, uri, step=10)
    assert loaded.step == 10
    _assert_same(fresh, saved)
    fresh = _model_state(4)
    assert trainer_sdk.load(fresh, uri).step == 20  # None: the newest complete step
    _assert_same(fresh, later)


def _two_rank_body(uri: str) -> list[bool]:
    import torch.distributed as dist

    state = _model_state(7)  # replicated: the same on both ranks, as with DDP
    trainer_sdk.save(state, uri, step=5)
    latest = trainer_sdk.latest_step(uri)
    fresh = _model_state(100 + dist.get_rank())
    info = trainer_sdk.load(fresh, uri)
    ta, tb = _tensors(state), _tensors(fresh)
    return [latest == 5, info.step == 5] + [torch.equal(ta[k], tb[k]) for k in ta]


@pytest.mark.e2e  # two fresh torch processes: ~30 s on a busy 2-core machine
@pytest.mark.usefixtures("s3_env")
def test_save_load_two_ranks_gloo(s3_bucket: S3Bucket) -> None:
    uri = s3_bucket.uri("jobs/ddp")
    results = run_ranks(_two_rank_body, 2, args=(uri,), timeout=180)
    assert all(all(r) for r in results), results
    keys = s3_bucket.keys("jobs/ddp/step-000000000005/")
    assert [k.rsplit("/", 1)[1] for k in keys] == [
        "manifest.json",
        "rank-00000-of-00002.json",
        "rank-00000-of-00002.safetensors",
        "rank-00001-of-00002.json",
        "rank-00001-of-00002.safetensors",
    ]
    assert trainer_sdk.latest_step(uri) == 5
    assert s3_bucket.multipart_uploads() == []


@pytest.mark.usefixtures("s3_env")
def test_upload_failing_for_good_leaves_no_committed_step(s3_faults: S3Bucket) -> None:
    assert s3_faults.proxy is not None
    uri = s3_faults.uri("jobs/f")
    good = _model_state(1)
    trainer_sdk.save(good, uri, step=1)

    s3_faults.proxy.add(Fault(op="UploadPart", part_numbers=frozenset({2}), status=500))
    with pytest.raises(BatonError, match=r"upload part 2 of .*InternalError"):
        trainer_sdk.save(_model_state(2), uri, step=2)
    assert trainer_sdk.latest_step(uri) == 1
    assert not any("step-000000000002/manifest.json" in k for k in s3_faults.keys(""))
    assert s3_faults.multipart_uploads() == []  # the writer aborted its upload
    assert json.loads(s3_faults.get("jobs/f/latest")) == {"step": 1}

    # The manifest PUT (the commit) failing for good: still no step 3.
    s3_faults.proxy.clear()
    s3_faults.proxy.add(Fault(op="PutObject", key="*/manifest.json", status=503, code="SlowDown"))
    with pytest.raises(BatonError, match=r"manifest\.json"):
        trainer_sdk.save(_model_state(3), uri, step=3)
    assert trainer_sdk.latest_step(uri) == 1

    fresh = _model_state(9)
    assert trainer_sdk.load(fresh, uri).step == 1
    _assert_same(fresh, good)


def _rank_fails_body(uri: str) -> list[str]:
    state = _model_state(11)
    trainer_sdk.save(state, uri, step=1)
    try:
        trainer_sdk.save(_model_state(12), uri, step=2)
    except BatonError as e:
        return [type(e).__name__, str(e), str(trainer_sdk.latest_step(uri))]
    return ["no error"]


@pytest.mark.e2e  # two fresh torch processes
@pytest.mark.usefixtures("s3_env")
def test_one_rank_upload_failing_fails_the_save_on_every_rank(s3_faults: S3Bucket) -> None:
    """Rank 1's shard cannot be uploaded: both ranks raise the same error naming rank 1 and
    the S3 cause, rank 0 writes no manifest, and no multipart upload is left behind."""
    assert s3_faults.proxy is not None
    uri = s3_faults.uri("jobs/r")
    shard = "jobs/r/step-000000000002/rank-00001-of-00002.safetensors"
    # Whichever way the shard goes up (one PUT or parts), it fails for good.
    s3_faults.proxy.add(
        Fault(op="UploadPart", key=shard, status=500),
        Fault(op="PutObject", key=shard, status=500),
    )
    results = run_ranks(_rank_fails_body, 2, args=(uri,), timeout=240)
    for name, message, latest in results:
        assert name == "RankFailedError", message
        assert "rank(s) 1" in message
        assert "InternalError" in message
        assert latest == "1"
    assert results[0][1] == results[1][1]
    assert not any("step-000000000002/manifest.json" in k for k in s3_faults.keys(""))
    assert s3_faults.multipart_uploads() == []


@pytest.mark.usefixtures("s3_env")
def test_cli_ls_and_verify_over_s3(s3_bucket: S3Bucket, capsys: pytest.CaptureFixture[str]) -> None:
    """python -m trainer_sdk ls / verify read S3 through the same storage; a byte flipped in
    the bucket is caught by name."""
    uri = s3_bucket.uri("jobs/cli")
    trainer_sdk.save(_model_state(5), uri, step=3)
    assert cli.main(["ls", uri]) == 0
    assert "3" in capsys.readouterr().out
    assert cli.main(["verify", uri]) == 0
    capsys.readouterr()

    key = "jobs/cli/step-000000000003/rank-00000-of-00001.safetensors"
    data = bytearray(s3_bucket.get(key))
    data[len(data) // 2] ^= 0xFF
    s3_bucket.client.put_object(Bucket=s3_bucket.name, Key=key, Body=bytes(data))
    assert cli.main(["verify", uri, "--step", "3"]) != 0
    captured = capsys.readouterr()
    assert "rank-00000-of-00001.safetensors" in captured.out + captured.err
    # The file's hash (sha256, or the newer format's) no longer matches the manifest.
    assert "differs from the manifest" in captured.out + captured.err


@pytest.mark.usefixtures("s3_env")
def test_checkpointer_on_s3_keeps_last_and_resumes(s3_bucket: S3Bucket) -> None:
    """The training-loop face on s3://: periodic saves, keep_last retention through
    S3Storage.delete_tree, and a restore in a fresh Checkpointer."""
    uri = s3_bucket.uri("jobs/ck")
    state = _model_state(21)
    ck = trainer_sdk.Checkpointer(
        uri,
        model=state["model"],
        optimizer=state["optim"],
        every_steps=1,
        keep_last=2,
        handle_sigterm=False,
    )
    assert ck.restore() == 0
    for step in range(1, 5):
        assert ck.step(step) is False
    ck.close()
    steps = sorted({k.split("/")[2] for k in s3_bucket.keys("jobs/ck/") if "/step-" in k})
    assert steps == ["step-000000000003", "step-000000000004"]
    assert s3_bucket.multipart_uploads() == []

    fresh = _model_state(22)
    ck2 = trainer_sdk.Checkpointer(
        uri, model=fresh["model"], optimizer=fresh["optim"], handle_sigterm=False
    )
    assert ck2.restore() == 4
    ck2.close()
    for k, v in state["model"].state_dict().items():
        assert torch.equal(v, fresh["model"].state_dict()[k]), k
