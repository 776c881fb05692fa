"""The local writer's early writeback and the block checksum function.

No timings here (bench/save_load.py measures speed); these pin down behaviour: the ranges
handed to the kernel for early writeback tile the file in order, the real sync_file_range is
used on Linux, and the ISA-L crc32 gives exactly zlib's values, so files stay identical.
"""

from __future__ import annotations

import itertools
import os
import sys
import zlib
from pathlib import Path

import pytest
import torch

import trainer_sdk
from trainer_sdk.format import _crc
from trainer_sdk.storage import local


def test_block_crc_is_zlib_crc32_and_comes_from_isal() -> None:
    # isal is a declared dependency: if this fails the slow fallback is in use
    assert _crc.IMPLEMENTATION == "isal"
    rng = torch.Generator().manual_seed(3)
    for n in (0, 1, 7, 4096, 8 * 2**20 + 5):
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=rng).numpy().tobytes()
        assert _crc.crc32(data) == zlib.crc32(data), n
        assert _crc.crc32(memoryview(data)) == zlib.crc32(data), n


def test_writeback_ranges_tile_the_file_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(local, "_WRITEBACK_EVERY", 1000)
    monkeypatch.setattr(local, "_start_writeback", lambda fd, off, n: calls.append((off, n)))
    storage = local.LocalStorage(str(tmp_path))
    w = storage.open_writer("a/file.bin")
    payload = bytes(range(256)) * 20  # 5120 bytes in uneven writes
    for chunk in (payload[:700], payload[700:2500], payload[2500:2600], payload[2600:]):
        w.write(chunk)
    w.commit()
    assert (tmp_path / "a" / "file.bin").read_bytes() == payload
    # contiguous, non-overlapping, starting at 0, each at least the threshold
    assert calls[0][0] == 0
    for (off, n), (nxt, _) in itertools.pairwise(calls):
        assert off + n == nxt
    assert all(n >= 1000 for _, n in calls)
    covered = calls[-1][0] + calls[-1][1]
    assert len(payload) - 1000 < covered <= len(payload)  # the tail is left to the fsync


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_linux_uses_the_real_sync_file_range(tmp_path: Path) -> None:
    assert local._sync_file_range is not None
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"x" * 8192)
        local._start_writeback(fd, 0, 8192)  # must not raise on a real file
    finally:
        os.close(fd)


def test_a_save_with_early_writeback_round_trips(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a small threshold so a small state goes through many writeback requests
    monkeypatch.setattr(local, "_WRITEBACK_EVERY", 64 * 1024)
    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(50_000 + i, generator=g) for i in range(4)}
    trainer_sdk.save(state, str(tmp_path), step=1)
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    trainer_sdk.load(dest, str(tmp_path))
    for k, v in state.items():
        assert torch.equal(dest[k], v), k
