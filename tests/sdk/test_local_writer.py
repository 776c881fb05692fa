"""The local writer's early writeback and the block checksum function.

No timings here (bench/save_load.py measures speed); these pin down behaviour: the ranges
handed to the kernel for early writeback tile the file in order, the real sync_file_range is
used on Linux, and the ISA-L crc32 gives exactly zlib's values, so files stay identical.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import zlib
from pathlib import Path

import pytest
import torch

import trainer_sdk
from trainer_sdk import _crc
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


def test_the_background_writer_leaves_writeback_to_the_fsync_and_a_save_in_the_caller_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Beside training (an async save's writer thread) early writeback slows the steps more
    # than it shortens the save, so that thread's writers leave it to the fsync; a save the
    # caller waits for still starts it every _WRITEBACK_EVERY bytes. Both round-trip.
    from trainer_sdk import staging

    asked: dict[str, int] = {}

    def record(fd: int, off: int, n: int) -> None:
        name = threading.current_thread().name
        asked[name] = asked.get(name, 0) + 1

    monkeypatch.setattr(local, "_WRITEBACK_EVERY", 1 << 20)
    monkeypatch.setattr(local, "_start_writeback", record)
    g = torch.Generator().manual_seed(4)
    # above the 16 MiB that async_save writes wholly at normal priority on its commit thread
    state = {f"w{i}": torch.randn(3 << 20, generator=g) for i in range(2)}  # 24 MiB
    trainer_sdk.save(state, str(tmp_path / "sync"), step=1)
    assert asked.pop("MainThread") >= 20
    assert asked == {}
    staging.async_save(state, str(tmp_path / "async"), step=2).wait()
    assert asked == {}
    for root, step in (("sync", 1), ("async", 2)):
        dest = {k: torch.zeros_like(v) for k, v in state.items()}
        assert trainer_sdk.load(dest, str(tmp_path / root)).step == step
        for k, v in state.items():
            assert torch.equal(dest[k], v), (root, k)


# ------------------------------------------------ spares: the memory tier overwrites old files


def _bytes(n: int, seed: int) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).numpy().tobytes()


def _write(storage: local.LocalStorage, path: str, data: bytes) -> local.LocalWriter:
    w = storage.open_writer(path, size_hint=len(data))
    w.write(data[: len(data) // 3])
    w.write(data[len(data) // 3 :])
    w.commit()
    return w


def test_a_recycled_tree_leaves_its_large_files_and_the_next_writes_overwrite_them(
    tmp_path: Path,
) -> None:
    mib = local.SPARE_MIN_BYTES
    storage = local.LocalStorage(str(tmp_path), spares=".spare")
    big, bigger, small = _bytes(2 * mib, 1), _bytes(3 * mib, 2), _bytes(mib // 2, 3)
    assert not _write(storage, "old/a.bin", big).reused  # no spare yet: a new file
    _write(storage, "old/b.bin", bigger)
    _write(storage, "old/c.json", small)
    inodes = {os.stat(tmp_path / "old" / n).st_ino for n in ("a.bin", "b.bin")}

    storage.recycle_tree("old")
    assert not (tmp_path / "old").exists()
    spares = sorted(os.path.getsize(p) for p in (tmp_path / ".spare").iterdir())
    assert spares == [2 * mib, 3 * mib]  # the small file was deleted, not kept
    # A small write never takes a spare (the shards need them).
    assert not _write(storage, "new/c.json", small).reused
    assert len(list((tmp_path / ".spare").iterdir())) == 2

    # A write takes the smallest spare that holds it; the commit cuts it to what was written.
    shorter = _bytes(2 * mib - 5, 4)
    w = _write(storage, "new/a.bin", shorter)
    assert w.reused
    assert (tmp_path / "new" / "a.bin").read_bytes() == shorter
    assert os.stat(tmp_path / "new" / "a.bin").st_ino in inodes
    # A longer write than any spare grows the largest one.
    longer = _bytes(4 * mib + 7, 5)
    assert _write(storage, "new/b.bin", longer).reused
    assert (tmp_path / "new" / "b.bin").read_bytes() == longer
    # No spare left: a new file.
    assert not _write(storage, "new/c.bin", big).reused
    assert storage.list_dir("") == [".spare", "new"]
    assert list((tmp_path / ".spare").iterdir()) == []
    assert all(".tmp-" not in p.name for p in (tmp_path / "new").iterdir())


def test_spares_never_hold_more_than_one_recycled_tree(tmp_path: Path) -> None:
    mib = local.SPARE_MIN_BYTES
    storage = local.LocalStorage(str(tmp_path), spares=".spare")
    for tree, seed in (("one", 1), ("two", 2)):
        _write(storage, f"{tree}/x.bin", _bytes(2 * mib, seed))
        _write(storage, f"{tree}/y.bin", _bytes(2 * mib, seed + 10))
    storage.recycle_tree("one")
    storage.recycle_tree("two")  # one's spares were not taken: they go first
    assert len(list((tmp_path / ".spare").iterdir())) == 2
    # Without spares, recycling is deleting.
    plain = local.LocalStorage(str(tmp_path / "plain"))
    _write(plain, "t/x.bin", _bytes(2 * mib, 3))
    plain.recycle_tree("t")
    assert plain.list_dir("") == []


def test_writers_racing_for_spares_each_take_another_or_a_new_file(tmp_path: Path) -> None:
    mib = local.SPARE_MIN_BYTES
    storage = local.LocalStorage(str(tmp_path), spares=".spare")
    _write(storage, "old/x.bin", _bytes(2 * mib, 1))
    _write(storage, "old/y.bin", _bytes(2 * mib, 2))
    storage.recycle_tree("old")
    spares = sorted(str(p) for p in (tmp_path / ".spare").iterdir())
    # Three writers reach for the same spares in the same order (as the processes of one pod
    # can): the first takes the first, the second the next, the third gets a new file.
    writers = [
        local.LocalWriter(str(tmp_path / f"{n}.bin"), str(tmp_path), spares=spares)
        for n in ("a", "b", "c")
    ]
    assert [w.reused for w in writers] == [True, True, False]
    for w, seed in zip(writers, (7, 8, 9), strict=True):
        w.write(_bytes(mib + 3, seed))
        w.commit()
    for n, seed in zip(("a", "b", "c"), (7, 8, 9), strict=True):
        assert (tmp_path / f"{n}.bin").read_bytes() == _bytes(mib + 3, seed)
    assert list((tmp_path / ".spare").iterdir()) == []
