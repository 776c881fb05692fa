"""export_hf: consolidated Hugging Face safetensors from a checkpoint of any world size."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from baton_testing.dist import run_ranks
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import trainer_sdk
from trainer_sdk import cli, hf


class TinyLM(torch.nn.Module):
    """Uneven shapes (7 rows over 2 ranks), a buffer, and tied input/output embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.up = torch.nn.Linear(6, 7)
        self.norm = torch.nn.LayerNorm(7)
        self.bn = torch.nn.BatchNorm1d(7)
        self.down = torch.nn.Linear(7, 6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.norm(torch.relu(self.up(self.embed(ids)))))
        return self.head(self.down(h))  # type: ignore[no-any-return]


def _read_export(out: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Load an export the way HF loaders do, checking the index against the files."""
    files = sorted(p.name for p in out.iterdir())
    assert not [f for f in files if f.startswith(".")], "no temp files left behind"
    if files == ["model.safetensors"]:
        tensors = load_file(out / "model.safetensors")
        with safe_open(str(out / "model.safetensors"), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
        return tensors, files
    assert "model.safetensors.index.json" in files
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = [f for f in files if f != "model.safetensors.index.json"]
    count = len(shards)
    assert count > 1
    assert shards == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    assert set(index["weight_map"].values()) == set(shards)
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        part = load_file(out / shard)
        assert set(part) == {k for k, v in index["weight_map"].items() if v == shard}
        with safe_open(str(out / shard), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
        assert not set(part) & set(tensors)
        tensors.update(part)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in tensors.values()
    )
    return tensors, shards


def _assert_equal_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype, k
        assert got[k].shape == v.shape, k
        assert torch.equal(got[k], v), k


def _trained_model() -> TinyLM:
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randint(0, 11, (8,))).sum().backward()
    opt.step()
    return model


def test_a_small_shard_size_gives_several_shards_matching_the_state_dict(tmp_path: Path) -> None:
    model = _trained_model()
    state = {"model": model.state_dict(), "extra": {"not_weights": torch.arange(5)}}
    trainer_sdk.save(state, str(tmp_path / "ckpt"), step=3)
    info = hf.export_hf(
        str(tmp_path / "ckpt"), tmp_path / "out", max_shard_size=200, weights_only=True
    )
    got, shards = _read_export(tmp_path / "out")
    _assert_equal_state(got, model.state_dict())
    assert info.files == tuple(shards)
    assert info.step == 3
    assert info.tensors == len(model.state_dict())
    # the huggingface_hub cutting rule: in order, a shard closes before it would pass the limit,
    # and only a tensor larger than the limit sits alone over it
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    for shard in shards:
        names = [k for k in model.state_dict() if index["weight_map"][k] == shard]
        size = sum(got[k].numel() * got[k].element_size() for k in names)
        assert size <= 200 or len(names) == 1


def test_a_model_that_fits_gives_one_file_without_index(tmp_path: Path) -> None:
    model = _trained_model()
    trainer_sdk.save({"model": model.state_dict()}, str(tmp_path / "ckpt"), step=1)
    trainer_sdk.save({"model": TinyLM().state_dict()}, str(tmp_path / "ckpt"), step=2)
    info = hf.export_hf(str(tmp_path / "ckpt"), tmp_path / "out", step=1, weights_only=True)
    got, files = _read_export(tmp_path / "out")
    assert files == ["model.safetensors"] == list(info.files)
    _assert_equal_state(got, model.state_dict())
    # step=None takes the newest complete step
    assert hf.export_hf(str(tmp_path / "ckpt"), tmp_path / "newest", weights_only=True).step == 2


def test_prefix_chooses_the_tensors_and_is_stripped(tmp_path: Path) -> None:
    model = _trained_model()
    trainer_sdk.save({"student": model.state_dict()}, str(tmp_path / "ckpt"), step=1)
    with pytest.raises(hf.HfExportError, match=r"prefix 'model\.'.*student\."):
        hf.export_hf(str(tmp_path / "ckpt"), tmp_path / "out", weights_only=True)
    hf.export_hf(str(tmp_path / "ckpt"), tmp_path / "out", prefix="student.", weights_only=True)
    _assert_equal_state(_read_export(tmp_path / "out")[0], model.state_dict())


def test_an_existing_export_is_not_overwritten_by_accident(tmp_path: Path) -> None:
    model = _trained_model()
    trainer_sdk.save({"model": model.state_dict()}, str(tmp_path / "ckpt"), step=1)
    out = tmp_path / "out"
    hf.export_hf(str(tmp_path / "ckpt"), out, max_shard_size=200, weights_only=True)
    (out / "README.md").write_text("mine")
    with pytest.raises(hf.HfExportError, match="overwrite"):
        hf.export_hf(str(tmp_path / "ckpt"), out, weights_only=True)
    hf.export_hf(str(tmp_path / "ckpt"), out, overwrite=True, weights_only=True)
    # the old shards are gone, the user's file is kept
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "model.safetensors"]


def test_errors_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(hf.HfExportError, match="no complete checkpoint"):
        hf.export_hf(str(tmp_path / "empty"), tmp_path / "out", weights_only=True)
    for bad in ("5 parsecs", "-1", 0, "GB"):
        with pytest.raises(hf.HfExportError, match="max_shard_size"):
            hf.parse_size(bad)  # type: ignore[arg-type]
    assert hf.parse_size("5GB") == 5 * 10**9
    assert hf.parse_size("2GiB") == 2 * 2**30
    assert hf.parse_size("1.5kb") == 1500
    assert hf.parse_size(123) == 123
    trainer_sdk.save({"model": {"w": torch.ones(2)}}, str(tmp_path / "c"), step=1)
    with pytest.raises(trainer_sdk.CheckpointError):
        hf.export_hf(str(tmp_path / "c"), tmp_path / "out", step=99, weights_only=True)


def test_the_cli_entry_exports_and_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _trained_model()
    trainer_sdk.save({"model": model.state_dict()}, str(tmp_path / "ckpt"), step=4)
    out = tmp_path / "out"
    argv = [
        "export-hf",
        "--weights-only",
        str(tmp_path / "ckpt"),
        str(out),
        "--max-shard-size",
        "300",
    ]
    assert cli.main([*argv, "--step", "4"]) == 0
    captured = capsys.readouterr()
    assert re.search(r"exported step 4: \d+ tensors", captured.out)
    assert "MiB" in captured.err
    _assert_equal_state(_read_export(out)[0], model.state_dict())
    assert (
        cli.main(["export-hf", "--weights-only", str(tmp_path / "ckpt"), str(out)]) == 1
    )  # already exported
    assert "overwrite" in capsys.readouterr().err
    assert (
        cli.main(["export-hf", "--weights-only", str(tmp_path / "ckpt"), str(out), "--overwrite"])
        == 0
    )
    capsys.readouterr()
    assert (
        cli.main(["export-hf", "--weights-only", str(tmp_path / "nothing"), str(tmp_path / "o2")])
        == 1
    )
    assert "no complete checkpoint" in capsys.readouterr().err


# --- from a 2-rank FSDP2 checkpoint ----------------------------------------------------------


def _fsdp2_save(uri: str, reference: str) -> list[str]:
    """On each rank: FSDP2-shard TinyLM, train a step, save model+optimizer; rank 0 also
    writes the full state dict (gathered by torch) as the reference."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = TinyLM()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model.up, model.down):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    model(torch.randint(0, 11, (8,))).sum().backward()
    opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    trainer_sdk.save({"model": model_sd, "optimizer": optim_sd}, uri, step=7)
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in full.items()}, reference)
    return sorted(k for k, v in model_sd.items() if isinstance(v, DTensor))


@pytest.mark.e2e  # two fresh torch processes with FSDP2: tens of seconds on 2 shared cores
def test_export_from_a_two_rank_fsdp2_checkpoint(tmp_path: Path) -> None:
    uri, reference = str(tmp_path / "ckpt"), str(tmp_path / "reference.safetensors")
    sharded = run_ranks(_fsdp2_save, 2, args=(uri, reference), timeout=180)
    assert "up.weight" in sharded[0], "the parameters were DTensors (Shard(0)) when saved"
    manifest = trainer_sdk.api.read_manifest(uri, 7)
    assert manifest.world_size == 2
    assert manifest.tensors["model.up.weight"].kind == "sharded"
    assert len(manifest.tensors["model.up.weight"].pieces) == 2  # 7 rows: 4 + 3
    hf.export_hf(uri, tmp_path / "out", max_shard_size=150, weights_only=True)
    got, shards = _read_export(tmp_path / "out")
    assert len(shards) > 1
    _assert_equal_state(got, load_file(reference))


def test_python_m_trainer_sdk_export_hf(tmp_path: Path) -> None:
    from trainer_sdk import cli

    model = _trained_model()
    trainer_sdk.save({"model": model.state_dict()}, str(tmp_path / "ckpt"), step=2)
    out = tmp_path / "out"
    assert (
        cli.main(
            [
                "export-hf",
                "--weights-only",
                str(tmp_path / "ckpt"),
                str(out),
                "--max-shard-size",
                "250",
            ]
        )
        == 0
    )
    got, shards = _read_export(out)
    assert len(shards) > 1
    _assert_equal_state(got, model.state_dict())


def test_a_damaged_checkpoint_is_named_and_leaves_no_half_export(tmp_path: Path) -> None:
    model = _trained_model()
    trainer_sdk.save({"model": model.state_dict()}, str(tmp_path / "ckpt"), step=1)
    manifest = trainer_sdk.api.read_manifest(str(tmp_path / "ckpt"), 1)
    last = manifest.tensors["model.head.weight"].pieces[0]
    shard = tmp_path / "ckpt" / "step-000000000001" / last.file
    data = bytearray(shard.read_bytes())
    data[last.begin] ^= 0xFF  # a flipped byte in the last model tensor: earlier shards are fine
    shard.write_bytes(bytes(data))
    out = tmp_path / "out"
    with pytest.raises(trainer_sdk.errors.CorruptCheckpointError, match=last.file):
        hf.export_hf(str(tmp_path / "ckpt"), out, max_shard_size=100, weights_only=True)
    assert sorted(p.name for p in out.iterdir()) == []


def test_an_export_never_reads_the_optimizer_bytes(tmp_path: Path) -> None:
    model = _trained_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randint(0, 11, (8,))).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    trainer_sdk.save(state, tmp_path / "ckpt", step=1)
    manifest = trainer_sdk.api.read_manifest(tmp_path / "ckpt", 1)
    moments = [k for k in manifest.tensors if k.startswith("optim.") and k.endswith("exp_avg")]
    assert moments, sorted(manifest.tensors)
    # Damage every optimizer moment: a reader that touched them would fail its block checksum.
    for key in moments:
        piece = manifest.tensors[key].pieces[0]
        shard = tmp_path / "ckpt" / "step-000000000001" / piece.file
        data = bytearray(shard.read_bytes())
        data[piece.begin] ^= 0xFF
        shard.write_bytes(bytes(data))
    info = hf.export_hf(tmp_path / "ckpt", tmp_path / "out", weights_only=True)
    got, _ = _read_export(tmp_path / "out")
    assert info.tensors == len(got)
    _assert_equal_state(got, model.state_dict())


def test_export_from_s3(s3_bucket: Any, tmp_path: Path) -> None:
    """The checkpoint is read over HTTP from an S3 server (moto), the export lands locally."""
    model = _trained_model()
    uri = s3_bucket.uri("runs/lm")
    trainer_sdk.save({"model": model.state_dict(), "optimizer": {"m": torch.ones(4)}}, uri, step=6)
    info = hf.export_hf(uri, tmp_path / "out", max_shard_size=300, weights_only=True)
    got, shards = _read_export(tmp_path / "out")
    assert info.step == 6
    assert len(shards) > 1
    _assert_equal_state(got, model.state_dict())
