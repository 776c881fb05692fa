"""Format v5 (XXH3-128 digests of the shards, an XXH3-64 per block) is what a save writes; v1
(sha256 for every file), v2 (BLAKE3 shards) and v4 (XXH3-128 shards) checkpoints, all with a
crc32 per block, are still loaded and verified, a corrupt byte is caught by a load (the block
checksum) and by ``verify`` (the whole-file digest) whichever the manifest records, and a
digest or block checksum that does not fit its version is refused."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from blake3 import blake3
from xxhash import xxh3_64_intdigest, xxh3_128_hexdigest

import trainer_sdk
from trainer_sdk.errors import CorruptCheckpointError, ManifestError
from trainer_sdk.format.layout import FORMAT_VERSION, MANIFEST, Manifest

_STEP = "step-000000000007"
_SHARD = "rank-00000-of-00001.safetensors"
_JSON = "rank-00000-of-00001.json"


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(257, 31, generator=g),
        "h": torch.randn(64, generator=g).to(torch.bfloat16),
        "n": 5,
    }


def _save(root: Path) -> dict[str, Any]:
    trainer_sdk.save(_state(), str(root), step=7)
    data = json.loads((root / _STEP / MANIFEST).read_text())
    assert isinstance(data, dict)
    return data


def _verify(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainer_sdk", "verify", str(root)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _loaded(root: Path) -> dict[str, Any]:
    state: dict[str, Any] = {"w": torch.zeros(257, 31), "h": torch.zeros(64, dtype=torch.bfloat16)}
    state["n"] = 0
    trainer_sdk.load(state, str(root))
    return state


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return torch.equal(a["w"], b["w"]) and torch.equal(a["h"], b["h"]) and a["n"] == b["n"] == 5


def _blocks(data: bytes, piece: dict[str, Any], block: int) -> list[bytes]:
    raw = data[piece["begin"] : piece["end"]]
    return [raw[o : o + block] for o in range(0, len(raw), block)]


def test_a_save_writes_v5_with_an_xxh3_128_digest_of_each_shard_and_an_xxh3_64_per_block(
    tmp_path: Path,
) -> None:
    m = _save(tmp_path)
    assert m["version"] == FORMAT_VERSION == 5
    shard = m["files"][_SHARD]
    assert set(shard) == {"size", "xxh3_128", "data_start"}
    data = (tmp_path / _STEP / _SHARD).read_bytes()
    assert shard["xxh3_128"] == xxh3_128_hexdigest(data)
    for t in m["tensors"].values():
        for piece in t["pieces"]:
            assert "crc32" not in piece
            want = [f"{xxh3_64_intdigest(b):016x}" for b in _blocks(data, piece, m["block_size"])]
            assert piece["xxh3_64"] == want
    # the small JSON file keeps sha256, which any machine can check with sha256sum
    assert (
        m["files"][_JSON]["sha256"]
        == hashlib.sha256((tmp_path / _STEP / _JSON).read_bytes()).hexdigest()
    )
    assert _equal(_loaded(tmp_path), _state())
    assert _verify(tmp_path).returncode == 0


def _as_older(root: Path, version: int) -> None:
    """Rewrite the manifest as an older Baton wrote it: a crc32 per block, and v1 with sha256
    for every file, v2 with BLAKE3 for the shard, or v4 with XXH3-128 for it."""
    path = root / _STEP / MANIFEST
    m = json.loads(path.read_text())
    m["version"] = version
    data = (root / _STEP / _SHARD).read_bytes()
    for t in m["tensors"].values():
        for piece in t["pieces"]:
            del piece["xxh3_64"]
            piece["crc32"] = [zlib.crc32(b) for b in _blocks(data, piece, m["block_size"])]
    if version < 4:
        shard = m["files"][_SHARD]
        del shard["xxh3_128"]
        if version == 1:
            shard["sha256"] = hashlib.sha256(data).hexdigest()
        else:
            shard["blake3"] = blake3(data).hexdigest()
    path.write_text(json.dumps(m))


def _flip_a_data_byte(root: Path) -> None:
    shard = root / _STEP / _SHARD
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01  # in the last tensor's bytes
    shard.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("version", "digest"), [(1, "sha256"), (2, "blake3"), (4, "xxh3_128"), (5, "xxh3_128")]
)
def test_every_version_loads_verifies_and_catches_a_flipped_byte(
    tmp_path: Path, version: int, digest: str
) -> None:
    _save(tmp_path)
    if version < FORMAT_VERSION:
        _as_older(tmp_path, version)
    assert _equal(_loaded(tmp_path), _state())
    ok = _verify(tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr

    _flip_a_data_byte(tmp_path)
    bad = _verify(tmp_path)
    assert bad.returncode == 1
    assert f"{_SHARD}: {digest}" in bad.stdout
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch in tensor"):
        _loaded(tmp_path)


def _parse(m: dict[str, Any]) -> Manifest:
    return Manifest.parse(json.dumps(m).encode(), step=7, path="m.json")


@pytest.mark.parametrize(
    ("version", "digests", "message"),
    [
        (1, {"blake3": "0" * 64}, "has no sha256 digest"),
        (2, {}, "has no sha256 or blake3 digest"),
        (2, {"blake3": "ZZ" * 32}, r"\.blake3 must be 64 lowercase hex"),
        (2, {"blake3": "0" * 63}, r"\.blake3 must be 64 lowercase hex"),
        (3, {"xxh3_128": "0" * 32}, "has no sha256 or blake3 digest"),  # v4's digest
        (4, {}, "has no sha256 or blake3 or xxh3_128 digest"),
        (4, {"xxh3_128": "0" * 64}, r"\.xxh3_128 must be 32 lowercase hex"),
        (4, {"xxh3_128": "0" * 31 + "G"}, r"\.xxh3_128 must be 32 lowercase hex"),
    ],
)
def test_a_digest_that_does_not_fit_the_version_is_refused(
    tmp_path: Path, version: int, digests: dict[str, str], message: str
) -> None:
    m = _save(tmp_path)
    m["version"] = version
    shard = m["files"][_SHARD]
    shard.pop("xxh3_128")
    shard.update(digests)
    with pytest.raises(ManifestError, match=message):
        _parse(m)


@pytest.mark.parametrize(
    ("version", "change", "message"),
    [
        (4, {}, "needs exactly one block checksum of crc32$"),  # v5's xxh3_64 in a v4 manifest
        (5, {"crc32": [1]}, "needs exactly one block checksum of crc32 or xxh3_64"),  # both
        (5, {"xxh3_64": [1]}, r"xxh3_64 must list one checksum per block \(not 16 lowercase hex"),
        (5, {"xxh3_64": ["0" * 15 + "G"]}, "xxh3_64 must list one checksum per block"),
        (5, {"xxh3_64": ["0" * 16] * 2}, r"one checksum per block \(1, not 2\)"),
        (4, {"xxh3_64": None, "crc32": [2**32]}, r"crc32 must list .*\(not a 32-bit int each"),
        (4, {"xxh3_64": None, "crc32": [True]}, "crc32 must list one checksum per block"),
    ],
)
def test_a_block_checksum_that_does_not_fit_the_version_is_refused(
    tmp_path: Path, version: int, change: dict[str, Any], message: str
) -> None:
    m = _save(tmp_path)
    m["version"] = version
    piece = m["tensors"]["w"]["pieces"][0]
    assert len(piece["xxh3_64"]) == 1  # one block: 257 * 31 float32s
    for key, value in change.items():
        if value is None:
            del piece[key]
        else:
            piece[key] = value
    with pytest.raises(ManifestError, match=message):
        _parse(m)


def test_v5_accepts_a_crc32_piece_beside_xxh3_64_ones(tmp_path: Path) -> None:
    """A reference to a shard that a v4 Baton wrote keeps its crc32 blocks in a v5 manifest."""
    _save(tmp_path)
    path = tmp_path / _STEP / MANIFEST
    m = json.loads(path.read_text())
    data = (tmp_path / _STEP / _SHARD).read_bytes()
    piece = m["tensors"]["w"]["pieces"][0]
    piece["crc32"] = [zlib.crc32(b) for b in _blocks(data, piece, m["block_size"])]
    del piece["xxh3_64"]
    path.write_text(json.dumps(m))
    parsed = _parse(m)
    assert parsed.version == 5
    assert parsed.tensors["w"].pieces[0].block_hash == "crc32"
    assert parsed.tensors["h"].pieces[0].block_hash == "xxh3_64"
    assert Manifest.parse(parsed.to_json_bytes(), step=7) == parsed  # both kinds round-trip
    assert _equal(_loaded(tmp_path), _state())
    _flip_a_data_byte(tmp_path)  # in "h", the last tensor: its xxh3_64 block catches it
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch in tensor 'h'"):
        _loaded(tmp_path)


def test_v4_accepts_any_digest_per_file(tmp_path: Path) -> None:
    m = _save(tmp_path)
    parsed = _parse(m)
    assert parsed.files[_SHARD].digest == ("xxh3_128", m["files"][_SHARD]["xxh3_128"])
    assert parsed.files[_JSON].digest == ("sha256", m["files"][_JSON]["sha256"])
    shard = m["files"][_SHARD]
    shard["blake3"] = "0" * 64  # e.g. a reference to a shard that a v3 Baton wrote
    del shard["xxh3_128"]
    assert _parse(m).files[_SHARD].digest == ("blake3", "0" * 64)
