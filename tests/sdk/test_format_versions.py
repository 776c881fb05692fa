"""Format v2 (BLAKE3 digests of the shards) is what a save writes; v1 checkpoints (sha256 for
every file) are still loaded and verified, and a digest that does not fit its version is
refused."""

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

import trainer_sdk
from trainer_sdk.errors import ManifestError
from trainer_sdk.format.layout import MANIFEST, PLAIN_VERSION, Manifest

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


def test_a_save_writes_v2_with_a_blake3_digest_of_each_shard(tmp_path: Path) -> None:
    m = _save(tmp_path)
    assert m["version"] == PLAIN_VERSION == 2  # v3 only where a step references
    shard = m["files"][_SHARD]
    assert set(shard) == {"size", "blake3", "data_start"}
    assert shard["blake3"] == blake3((tmp_path / _STEP / _SHARD).read_bytes()).hexdigest()
    # the small JSON file keeps sha256, which any machine can check with sha256sum
    assert (
        m["files"][_JSON]["sha256"]
        == hashlib.sha256((tmp_path / _STEP / _JSON).read_bytes()).hexdigest()
    )
    assert _equal(_loaded(tmp_path), _state())
    assert _verify(tmp_path).returncode == 0


def _as_v1(root: Path) -> None:
    """Rewrite the manifest as an older Baton wrote it: version 1, sha256 for every file."""
    path = root / _STEP / MANIFEST
    m = json.loads(path.read_text())
    m["version"] = 1
    for name, f in m["files"].items():
        f.pop("blake3", None)
        f["sha256"] = hashlib.sha256((root / _STEP / name).read_bytes()).hexdigest()
    path.write_text(json.dumps(m))


def test_v1_checkpoints_still_load_and_verify(tmp_path: Path) -> None:
    _save(tmp_path)
    _as_v1(tmp_path)
    assert _equal(_loaded(tmp_path), _state())
    ok = _verify(tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr

    shard = tmp_path / _STEP / _SHARD
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01
    shard.write_bytes(bytes(data))
    bad = _verify(tmp_path)
    assert bad.returncode == 1
    assert f"{_SHARD}: sha256" in bad.stdout


def _parse(m: dict[str, Any]) -> Manifest:
    return Manifest.parse(json.dumps(m).encode(), step=7, path="m.json")


@pytest.mark.parametrize(
    ("version", "digests", "message"),
    [
        (1, {"blake3": "0" * 64}, "has no sha256 digest"),
        (2, {}, "has no sha256 or blake3 digest"),
        (2, {"blake3": "ZZ" * 32}, r"\.blake3 must be 64 lowercase hex"),
        (2, {"blake3": "0" * 63}, r"\.blake3 must be 64 lowercase hex"),
    ],
)
def test_a_digest_that_does_not_fit_the_version_is_refused(
    tmp_path: Path, version: int, digests: dict[str, str], message: str
) -> None:
    m = _save(tmp_path)
    m["version"] = version
    shard = m["files"][_SHARD]
    shard.pop("blake3")
    shard.update(digests)
    with pytest.raises(ManifestError, match=message):
        _parse(m)


def test_v2_accepts_either_digest_per_file(tmp_path: Path) -> None:
    m = _save(tmp_path)
    parsed = _parse(m)
    assert parsed.files[_SHARD].digest == ("blake3", m["files"][_SHARD]["blake3"])
    assert parsed.files[_JSON].digest == ("sha256", m["files"][_JSON]["sha256"])
