"""Format v4 (XXH3-128 digests of the shards) is what a save writes; v1 (sha256 for every file)
and v2 (BLAKE3 shards) checkpoints are still loaded and verified, a corrupt byte is caught by
a load (block crc32) and by ``verify`` (the whole-file digest) whichever digest the manifest
records, and a digest that does not fit its version is refused."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from blake3 import blake3
from xxhash import xxh3_128_hexdigest

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


def test_a_save_writes_v4_with_an_xxh3_128_digest_of_each_shard(tmp_path: Path) -> None:
    m = _save(tmp_path)
    assert m["version"] == FORMAT_VERSION == 4
    shard = m["files"][_SHARD]
    assert set(shard) == {"size", "xxh3_128", "data_start"}
    assert shard["xxh3_128"] == xxh3_128_hexdigest((tmp_path / _STEP / _SHARD).read_bytes())
    # the small JSON file keeps sha256, which any machine can check with sha256sum
    assert (
        m["files"][_JSON]["sha256"]
        == hashlib.sha256((tmp_path / _STEP / _JSON).read_bytes()).hexdigest()
    )
    assert _equal(_loaded(tmp_path), _state())
    assert _verify(tmp_path).returncode == 0


def _as_older(root: Path, version: int) -> None:
    """Rewrite the manifest as an older Baton wrote it: v1 with sha256 for every file, or v2
    with BLAKE3 for the shard."""
    path = root / _STEP / MANIFEST
    m = json.loads(path.read_text())
    m["version"] = version
    for name, f in m["files"].items():
        if f.pop("xxh3_128", None) is None:
            continue
        data = (root / _STEP / name).read_bytes()
        if version == 1:
            f["sha256"] = hashlib.sha256(data).hexdigest()
        else:
            f["blake3"] = blake3(data).hexdigest()
    path.write_text(json.dumps(m))


def _flip_a_data_byte(root: Path) -> None:
    shard = root / _STEP / _SHARD
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01  # in the last tensor's bytes
    shard.write_bytes(bytes(data))


@pytest.mark.parametrize(("version", "digest"), [(1, "sha256"), (2, "blake3"), (4, "xxh3_128")])
def test_every_version_loads_verifies_and_catches_a_flipped_byte(
    tmp_path: Path, version: int, digest: str
) -> None:
    _save(tmp_path)
    if version < 4:
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


def test_v4_accepts_any_digest_per_file(tmp_path: Path) -> None:
    m = _save(tmp_path)
    parsed = _parse(m)
    assert parsed.files[_SHARD].digest == ("xxh3_128", m["files"][_SHARD]["xxh3_128"])
    assert parsed.files[_JSON].digest == ("sha256", m["files"][_JSON]["sha256"])
    shard = m["files"][_SHARD]
    shard["blake3"] = "0" * 64  # e.g. a reference to a shard that a v3 Baton wrote
    del shard["xxh3_128"]
    assert _parse(m).files[_SHARD].digest == ("blake3", "0" * 64)
