"""Format v1 pieces that need no processes: names, manifest validation, planning, boxes."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from trainer_sdk.api import flatten
from trainer_sdk.errors import ManifestError, UnsupportedFormatError
from trainer_sdk.format.layout import (
    FORMAT_NAME,
    FORMAT_VERSION,
    Manifest,
    check_name,
    parse_latest,
    parse_step_dir,
    step_dir,
)
from trainer_sdk.format.planning import FlatEntry, FlatState, intersect, plan_save, row_range


def test_names() -> None:
    assert step_dir(1200) == "step-000000001200"
    assert parse_step_dir("step-000000001200") == 1200
    assert parse_step_dir("step-12") is None
    assert parse_step_dir("step-000000001200.tmp") is None
    assert check_name("rank-00001-of-00004.json") == "rank-00001-of-00004.json"
    for bad in ("../rank-00001-of-00004.json", "/rank-00001-of-00004.json", "x.json", 3, None):
        with pytest.raises(ManifestError):
            check_name(bad)
    assert parse_latest(b'{"step": 12}') == 12
    assert parse_latest(b"garbage") is None
    assert parse_latest(b'{"step": -1}') is None
    with pytest.raises(ValueError, match="step"):
        step_dir(-1)


def _manifest(**over: Any) -> dict[str, Any]:
    sha = "0" * 64
    m: dict[str, Any] = {
        "format": FORMAT_NAME,
        "version": 1,
        "step": 5,
        "world_size": 1,
        "trigger": "periodic",
        "time": "2026-01-01T00:00:00Z",
        "torch_version": "x",
        "baton_version": "y",
        "block_size": 8 * 2**20,
        "files": {
            "rank-00000-of-00001.safetensors": {"size": 100 + 16, "sha256": sha, "data_start": 100},
            "rank-00000-of-00001.json": {"size": 10, "sha256": sha},
        },
        "tensors": {
            "w": {
                "kind": "replicated",
                "dtype": "F32",
                "shape": [2, 2],
                "pieces": [
                    {
                        "file": "rank-00000-of-00001.safetensors",
                        "name": "w",
                        "dtype": "F32",
                        "offsets": [0, 0],
                        "shape": [2, 2],
                        "begin": 100,
                        "end": 116,
                        "crc32": [123],
                    }
                ],
            }
        },
    }
    m.update(over)
    return m


def _parse(m: dict[str, Any]) -> Manifest:
    return Manifest.parse(json.dumps(m).encode(), step=5)


def test_a_valid_manifest_round_trips() -> None:
    parsed = _parse(_manifest())
    assert parsed.tensors["w"].pieces[0].nbytes == 16
    again = Manifest.parse(parsed.to_json_bytes(), step=5)
    assert again == parsed


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda m: m.update(version=0), "'version' must be an int in"),
        (lambda m: m.update(format="other"), "not a baton-checkpoint"),
        (lambda m: m.update(step=6), "says step 6"),
        (lambda m: m["files"].pop("rank-00000-of-00001.json"), "JSON file"),
        (lambda m: m["tensors"]["w"]["pieces"][0].update(shape=[2, 1]), "byte length"),
        (lambda m: m["tensors"]["w"]["pieces"][0].update(begin=50, end=66), "outside the data"),
        (lambda m: m["tensors"]["w"]["pieces"][0].update(crc32=[]), "crc32"),
        (lambda m: m["tensors"]["w"]["pieces"][0].update(offsets=[1, 0]), "outside the global"),
        (lambda m: m["tensors"]["w"].update(dtype="F64"), "dtype"),
        (lambda m: m["tensors"]["w"].update(kind="pickled"), "unknown kind"),
        (lambda m: m["tensors"]["w"]["pieces"][0].update(file="../../etc/passwd"), "plain"),
        (lambda m: m["files"]["rank-00000-of-00001.json"].update(size=2**40), "over the JSON"),
        (lambda m: m["files"]["rank-00000-of-00001.json"].update(sha256="zz"), "hex"),
        (lambda m: m.update(tensors=[]), "must be an object"),
        (lambda m: m.pop("files"), "malformed"),
    ],
)
def test_invalid_manifests_are_refused(mutate: Any, message: str) -> None:
    m = _manifest()
    mutate(m)
    with pytest.raises(ManifestError, match=message):
        _parse(m)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda m: m.update(version=FORMAT_VERSION + 1),
            f"format version {FORMAT_VERSION + 1} is not supported.*upgrade trainer_sdk",
        ),
        (lambda m: m["tensors"]["w"].update(dtype="F4"), "dtype 'F4'.*upgrade trainer_sdk"),
        (lambda m: m["tensors"]["w"]["pieces"][0].update(dtype="F4"), "dtype 'F4'.*upgrade"),
    ],
)
def test_a_newer_writer_is_unsupported_not_invalid(mutate: Any, message: str) -> None:
    """A newer format version or dtype: the step may be good, so it is not a ManifestError
    (which readers skip) but an UnsupportedFormatError (which restore() raises)."""
    m = _manifest()
    mutate(m)
    with pytest.raises(UnsupportedFormatError, match=message) as info:
        _parse(m)
    assert not isinstance(info.value, ManifestError)
    assert info.value.step == 5


def test_not_json_and_wrong_world() -> None:
    with pytest.raises(ManifestError, match="not valid JSON"):
        Manifest.parse(b"{nope", step=5)
    m = _manifest()
    m["files"]["rank-00001-of-00002.json"] = {"size": 1, "sha256": "0" * 64}
    with pytest.raises(ManifestError, match="world of size 1"):
        _parse(m)


def _flat(sizes: dict[str, tuple[int, ...]]) -> FlatState:
    entries = {}
    for k, shape in sizes.items():
        t = torch.zeros(shape)
        entries[k] = FlatEntry(
            key=k,
            kind="replicated",
            dtype="F32",
            global_shape=shape,
            offsets=(0,) * len(shape),
            local_shape=shape,
            writes=True,
            tensor=t,
        )
    return FlatState(entries=entries, tree={})


def test_replicated_writes_are_spread_and_cover_every_byte_once() -> None:
    sizes = {f"t{i}": (10 + i * 7, 5) for i in range(11)}
    sizes["scalar"] = ()
    flat = _flat(sizes)
    for world in (1, 2, 3, 5):
        plans = [plan_save(flat, r, world) for r in range(world)]
        assert plans == [plan_save(flat, r, world) for r in range(world)]  # deterministic
        assert len({p.replicated_digest for p in plans}) == 1
        loads = [p.nbytes for p in plans]
        total = sum(e.nbytes for e in flat.entries.values())
        assert sum(loads) == total
        assert max(loads) - min(loads) <= max(e.nbytes for e in flat.entries.values())
        keys = sorted(p.key for plan in plans for p in plan.pieces)
        assert keys == sorted(sizes)


def test_big_replicated_tensors_are_split_into_row_ranges() -> None:
    flat = _flat({"emb": (1001, 64), "small": (3,)})
    plans = [plan_save(flat, r, 3, split_bytes=1024) for r in range(3)]
    pieces = [p for pl in plans for p in pl.pieces if p.key == "emb"]
    emb = sorted((p.offsets[0], p.shape[0], p.start, p.end) for p in pieces)
    assert [e[1] for e in emb] == [334, 334, 333]
    assert [e[0] for e in emb] == [0, 334, 668]
    assert all(e[3] - e[2] == e[1] * 64 * 4 for e in emb)
    assert {p.name for pl in plans for p in pl.pieces if p.key == "emb"} == {
        "emb#rows=0:334",
        "emb#rows=334:668",
        "emb#rows=668:1001",
    }
    assert all(any(p.key == "emb" for p in pl.pieces) for pl in plans)


def test_flatten_marks_kinds_and_refuses_reserved_keys() -> None:
    from trainer_sdk import RankLocal
    from trainer_sdk.errors import CheckpointError

    flat = flatten({"a": {"w": torch.ones(2)}, "r": RankLocal(torch.ones(1)), "n": [1, (2, 3)]})
    assert {k: e.kind for k, e in flat.entries.items()} == {"a.w": "replicated", "r": "rank_local"}
    assert flat.tree["n"] == [1, {"__baton_tuple__": [2, 3]}]
    with pytest.raises(CheckpointError, match="reserved"):
        flatten({"a": {"__baton_tensor__": 1}})
    with pytest.raises(CheckpointError, match="two tensors map to the key"):
        flatten({"a.b": torch.ones(1), "a": {"b": torch.ones(1)}})


def test_boxes() -> None:
    assert intersect((0, 0), (4, 3), (2, 0), (4, 3)) == ((2, 0), (2, 3))
    assert intersect((0,), (2,), (2,), (2,)) is None
    assert intersect((), (), (), ()) == ((), ())
    assert row_range((2, 0), (2, 3), (4, 3)) == (2, 4)
    assert row_range((2, 1), (2, 2), (4, 3)) is None
    assert row_range((), (), ()) == (0, 1)


def _slab(file: str, offset: int, rows: int, begin: int) -> dict[str, Any]:
    return {
        "file": file,
        "name": f"w#rows={offset}:{offset + rows}",
        "dtype": "F32",
        "offsets": [offset, 0],
        "shape": [rows, 2],
        "begin": begin,
        "end": begin + rows * 8,
        "crc32": [1],
    }


def test_row_slabs_must_tile_without_overlap() -> None:
    f = "rank-00000-of-00001.safetensors"
    m = _manifest()
    m["files"][f]["size"] = 100 + 32
    m["tensors"]["w"]["shape"] = [4, 2]
    m["tensors"]["w"]["pieces"] = [_slab(f, 0, 2, 100), _slab(f, 2, 2, 116)]
    assert len(_parse(m).tensors["w"].pieces) == 2
    m["tensors"]["w"]["pieces"] = [_slab(f, 0, 2, 100), _slab(f, 1, 2, 116)]
    m["tensors"]["w"]["shape"] = [3, 2]  # same volume as a gap-free tiling, but overlapping
    m["tensors"]["w"]["pieces"][1]["shape"] = [1, 2]
    m["tensors"]["w"]["pieces"][1]["end"] = 124
    with pytest.raises(ManifestError, match="overlap"):
        _parse(m)
