"""Format v3 (references to earlier steps' shards) in one process: what a manifest may say,
what the committer refuses, what deletion keeps, and the settings that bound or turn off
references. The multi-rank behaviour (bytes per save, bitwise resume, retention over 10
steps, corruption, resharding) is in ``test_incremental.py``."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from baton_testing.s3 import S3Bucket
from torch import nn

import trainer_sdk
from trainer_sdk.api import read_manifest
from trainer_sdk.checkpointer import Checkpointer
from trainer_sdk.cli import main as cli
from trainer_sdk.errors import CheckpointError, ManifestError, UnsupportedFormatError
from trainer_sdk.format import layout
from trainer_sdk.format.layout import Manifest
from trainer_sdk.saveload import _committing
from trainer_sdk.storage import open_storage


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 2))
    model[0].requires_grad_(False)  # the frozen base
    return model, torch.optim.SGD(model[1].parameters(), lr=0.1)


def _saves(root: Path, steps: int, **kwargs: Any) -> list[Manifest]:
    model, opt = _model()
    with Checkpointer(root, model=model, optimizer=opt, keep_last=100, **kwargs) as ck:
        ck.restore()
        for step in range(1, steps + 1):
            opt.zero_grad()
            model(torch.randn(4, 64)).sum().backward()
            opt.step()
            ck.save(step)
    return [read_manifest(str(root), s) for s in range(1, steps + 1)]


def _raw(root: Path, step: int) -> dict[str, Any]:
    obj: dict[str, Any] = json.loads((root / f"step-{step:012d}" / "manifest.json").read_bytes())
    return obj


def _parse(m: dict[str, Any]) -> Manifest:
    return Manifest.parse(json.dumps(m).encode(), step=m["step"], path="m.json")


def _ref(m: dict[str, Any]) -> str:
    return next(k for k, f in m["files"].items() if "step" in f)


def _as_v2(m: dict[str, Any]) -> None:
    """Mark ``m`` as v2 with the digests a v2 manifest may have (BLAKE3 for the shards, crc32
    blocks)."""
    m["version"] = 2
    for f in m["files"].values():
        if f.pop("xxh3_128", None) is not None:
            f["blake3"] = "0" * 64
    for t in m["tensors"].values():
        for piece in t["pieces"]:
            piece["crc32"] = [0] * len(piece.pop("xxh3_64"))


def test_later_saves_reference_the_frozen_base(tmp_path: Path) -> None:
    m1, m2, m3 = _saves(tmp_path, 3)
    assert m1.version == 5  # nothing to reference, but xxh3_64 blocks: v5
    assert m1.referenced_steps() == set()
    for m in (m2, m3):
        assert m.version == 5
        assert m.referenced_steps() == {1}  # always the step that holds the bytes: one hop
        for key in ("model.0.weight", "model.0.bias"):
            (piece,) = m.tensors[key].pieces
            assert m.files[piece.file].step == 1
            assert m.path_of(piece.file) == "step-000000000001/rank-00000-of-00001.safetensors"
            assert piece == dataclasses.replace(m1.tensors[key].pieces[0], file=piece.file)
        assert m.total_bytes < m1.total_bytes - 64 * 64 * 4
        assert m.referenced_bytes == m1.files["rank-00000-of-00001.safetensors"].size
    out = io.StringIO()
    from trainer_sdk.cli import cmd_inspect

    cmd_inspect(open_storage(str(tmp_path)), 3, out)
    assert "reuses" in out.getvalue()
    assert "(reused)" in out.getvalue()
    assert cli(["verify", str(tmp_path), "--step", "3"]) == 0


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda m, k: m["files"][k].update(step=2), "its key must be exactly"),
        (lambda m, k: m["files"][k].pop("step"), "names another step's file but has no 'step'"),
        (lambda m, k: _as_v2(m), "format v2 does not have"),
        (
            lambda m, k: m["files"].update({"../" + k: m["files"].pop(k)}),
            "its key must be exactly",
        ),
        (
            lambda m, k: m["files"].update({"/abs/" + k: m["files"].pop(k)}),
            "its key must be exactly",
        ),
    ],
)
def test_a_reference_is_only_a_step_number_and_a_shard_name(
    tmp_path: Path, mutate: Any, message: str
) -> None:
    _saves(tmp_path, 2)
    m = _raw(tmp_path, 2)
    mutate(m, _ref(m))
    with pytest.raises(ManifestError, match=message):
        _parse(m)


def test_a_reference_to_a_later_step_or_itself_is_refused(tmp_path: Path) -> None:
    _saves(tmp_path, 2)
    m = _raw(tmp_path, 2)
    k = _ref(m)
    entry = m["files"].pop(k)
    m["files"][k.replace("000000000001", "000000000002")] = {**entry, "step": 2}
    with pytest.raises(ManifestError, match="not older than step 2"):
        _parse(m)


def test_a_v2_reader_refuses_v3_as_a_newer_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _saves(tmp_path, 2)
    m1, m2 = _raw(tmp_path, 1), _raw(tmp_path, 2)
    _as_v2(m1)  # as older Batons wrote them: BLAKE3 digests (v4 adds xxh3_128), crc32 blocks
    _as_v2(m2)
    m2["version"] = 3
    monkeypatch.setattr(layout, "FORMAT_VERSION", 2)  # what a v2 Baton is
    with pytest.raises(UnsupportedFormatError, match="format version 3 is not supported"):
        _parse(m2)
    assert _parse(m1).version == 2  # its own full steps it still reads


@pytest.mark.parametrize("reader", [3, 4])
def test_older_readers_refuse_v5_as_a_newer_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reader: int
) -> None:
    _saves(tmp_path, 2)
    assert _parse(_raw(tmp_path, 1)).version == 5  # xxh3_64 blocks: v5 with or without refs
    monkeypatch.setattr(layout, "FORMAT_VERSION", reader)  # what a v3 or v4 Baton is
    for step in (1, 2):
        with pytest.raises(UnsupportedFormatError, match="format version 5 is not supported"):
            _parse(_raw(tmp_path, step))


def test_the_committer_refuses_a_reference_no_committed_step_backs(tmp_path: Path) -> None:
    _saves(tmp_path, 2)
    storage = open_storage(str(tmp_path))
    m2 = read_manifest(str(tmp_path), 2)
    k = next(k for k, f in m2.files.items() if f.step is not None)

    def as_step_3(files: dict[str, Any]) -> Manifest:
        return dataclasses.replace(m2, step=3, files=files)

    forged = dict(m2.files)
    forged[k] = dataclasses.replace(m2.files[k], xxh3_128="0" * 32)  # not what step 1 committed
    with pytest.raises(CheckpointError, match=r"no complete step under .* committed"):
        _committing.commit_built_manifest(storage, as_step_3(forged), None)
    (tmp_path / m2.path_of(k)).rename(tmp_path / "aside")
    with pytest.raises(CheckpointError, match="which is missing"):
        _committing.commit_built_manifest(storage, as_step_3(dict(m2.files)), None)
    assert trainer_sdk.list_steps(str(tmp_path)) == [1, 2]  # nothing was committed
    (tmp_path / "aside").rename(tmp_path / m2.path_of(k))
    _committing.commit_built_manifest(storage, as_step_3(dict(m2.files)), None)
    assert trainer_sdk.list_steps(str(tmp_path)) == [1, 2, 3]


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_deleting_a_referenced_step_keeps_its_referenced_shard(tmp_path: Path) -> None:
    _saves(tmp_path, 3)
    shard = "step-000000000001/rank-00000-of-00001.safetensors"
    trainer_sdk.delete_step(str(tmp_path), 1)
    assert trainer_sdk.list_steps(str(tmp_path)) == [2, 3]  # no longer a restore point
    assert {f for f in _files(tmp_path) if f.startswith("step-000000000001/")} == {shard}
    from trainer_sdk.cli import cmd_ls

    out = io.StringIO()
    cmd_ls(open_storage(str(tmp_path)), out)
    assert out.getvalue().splitlines()[1].split()[:2] == ["1", "reused"]
    model, opt = _model()
    with Checkpointer(tmp_path, model=model, optimizer=opt) as ck:
        assert ck.restore() == 3
    assert cli(["verify", str(tmp_path), "--step", "2"]) == 0
    trainer_sdk.delete_step(str(tmp_path), 2)
    assert shard in _files(tmp_path)  # step 3 still references it
    trainer_sdk.delete_step(str(tmp_path), 3)
    assert trainer_sdk.cleanup_incomplete(str(tmp_path), older_than=4) == ["step-000000000001"]
    assert not any(f.startswith("step-") for f in _files(tmp_path))


def test_full_every_steps_bounds_how_far_a_reference_reaches(tmp_path: Path) -> None:
    ms = _saves(tmp_path, 5, full_every_steps=2)
    assert [sorted(m.referenced_steps()) for m in ms] == [[], [1], [], [3], []]


def test_full_every_steps_1_references_nothing(tmp_path: Path) -> None:
    ms = _saves(tmp_path, 3, full_every_steps=1)
    assert [sorted(m.referenced_steps()) for m in ms] == [[], [], []]
    assert [m.version for m in ms] == [5, 5, 5]


def test_async_saves_reference_too(tmp_path: Path) -> None:
    model, opt = _model()
    with Checkpointer(tmp_path, model=model, optimizer=opt, every_steps=1, async_save=True) as ck:
        ck.restore()
        for step in range(1, 4):
            opt.zero_grad()
            model(torch.randn(4, 64)).sum().backward()
            opt.step()
            ck.step(step)
        ck.wait()
    assert read_manifest(str(tmp_path), 3).referenced_steps() == {1}


def test_a_restore_records_what_it_loaded(tmp_path: Path) -> None:
    _saves(tmp_path, 2)
    model, opt = _model()
    with Checkpointer(tmp_path, model=model, optimizer=opt, keep_last=100) as ck:
        assert ck.restore() == 2
        ck.save(3)  # the first save after a restore references the loaded base
    assert read_manifest(str(tmp_path), 3).referenced_steps() == {1}


def test_a_load_into_the_live_model_makes_the_next_save_write_it(tmp_path: Path) -> None:
    """A load writes straight into the tensors' memory; it bumps their version counters, so a
    tensor it filled is never referenced as if unchanged."""
    model, opt = _model()
    with Checkpointer(tmp_path, model=model, optimizer=opt, keep_last=100) as ck:
        ck.restore()
        ck.save(1)
        ck.save(2)
        before = model[0].weight._version
        trainer_sdk.load({"model": model.state_dict()}, str(tmp_path), step=1, strict=False)
        assert model[0].weight._version > before
        ck.save(3)
    assert read_manifest(str(tmp_path), 2).referenced_steps() == {1}
    assert read_manifest(str(tmp_path), 3).referenced_steps() == set()


def test_references_and_retention_on_s3(s3_bucket: S3Bucket) -> None:
    """The same chain on S3 (moto and versitygw): later steps reference step 1's shard, and
    keep_last=2 deletes step 1's manifest and JSON file but keeps the referenced shard; every
    kept step loads and verifies; once nothing references it, the shard goes too."""
    uri = s3_bucket.uri("jobs/incr")
    model, opt = _model()
    with Checkpointer(uri, model=model, optimizer=opt, keep_last=2) as ck:
        ck.restore()
        for step in range(1, 5):
            opt.zero_grad()
            model(torch.randn(4, 64)).sum().backward()
            opt.step()
            ck.save(step)
    assert trainer_sdk.list_steps(uri) == [3, 4]
    prefix = "jobs/incr/"
    steps = {k[len(prefix) :] for k in s3_bucket.keys(prefix) if "/step-" in "/" + k}
    assert {k for k in steps if k.startswith("step-000000000001/")} == {
        "step-000000000001/rank-00000-of-00001.safetensors"
    }
    assert not any(k.startswith("step-000000000002/") for k in steps)
    for s in (3, 4):
        assert read_manifest(uri, s).referenced_steps() == {1}
        assert cli(["verify", uri, "--step", str(s)]) == 0
    fresh, fresh_opt = _model()
    with torch.no_grad():
        fresh[0].weight.zero_()
    with Checkpointer(uri, model=fresh, optimizer=fresh_opt) as ck:
        assert ck.restore() == 4
    assert torch.equal(fresh[0].weight, model[0].weight)
    trainer_sdk.delete_step(uri, 3)
    trainer_sdk.delete_step(uri, 4)
    trainer_sdk.cleanup_incomplete(uri, older_than=5)
    assert not [k for k in s3_bucket.keys(prefix) if "step-" in k]


def test_export_of_a_chain_reads_the_referenced_base(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    _saves(tmp_path / "ck", 3)
    trainer_sdk.export_hf(str(tmp_path / "ck"), tmp_path / "hf", step=3, weights_only=True)
    (weights,) = (tmp_path / "hf").glob("model*.safetensors")
    exported = load_file(str(weights))
    full: dict[str, Any] = {"model": {}}
    trainer_sdk.load(full, str(tmp_path / "ck"), step=1, strict=False)
    assert torch.equal(exported["0.weight"], full["model"]["0.weight"])


def test_the_save_estimate_counts_only_the_bytes_written(tmp_path: Path) -> None:
    """The plan a notice save is judged by (and the estimator learns from) leaves out the
    referenced tensors: a LoRA job's notice save is estimated at the adapter's size."""
    model, opt = _model()
    with Checkpointer(tmp_path, model=model, optimizer=opt) as ck:
        ck.restore()
        full = ck._engine.prepare(1)[1].nbytes
        ck.save(1)
        later = ck._engine.prepare(2)[1].nbytes
    base = sum(p.numel() * p.element_size() for p in model[0].parameters())
    assert full - later == base


def test_a_frozen_parameter_in_the_optimizer_is_still_referenced(tmp_path: Path) -> None:
    """AdamW(model.parameters()) with a frozen base: the base gets no gradient, so no step
    touches it, and the trained head (whose version the step bumps) is written each time."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 2))
    model[0].requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    with Checkpointer(tmp_path, model=model, optimizer=opt, keep_last=100) as ck:
        ck.restore()
        for step in (1, 2):
            opt.zero_grad()
            model(torch.randn(4, 64)).sum().backward()
            opt.step()
            ck.save(step)
    m = read_manifest(str(tmp_path), 2)
    reused = {k for k, t in m.tensors.items() if any(m.files[p.file].step for p in t.pieces)}
    assert reused == {"model.0.weight", "model.0.bias"}
