"""The parsed manifests of committed steps are cached per root (``_catalog._ManifestCache``):
a commit of an incremental step reads no committed manifest twice (its fence check, its
reference check and retention used to read every kept step's manifest each time), and a step
deleted or rewritten behind the cache's back is never served from it.

Reads are counted through a real filesystem storage (a ``LocalStorage`` that counts what it
reads), with the real Checkpointer saving a frozen base and a trainable adapter; the rewrite
and the delete are also made on S3 (boto3 over HTTP against the test server).
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from baton_testing.s3 import FaultProxy, S3Bucket
from baton_testing.storage_wrapper import StorageWrapper
from torch import nn

from trainer_sdk import Checkpointer, api
from trainer_sdk.errors import IncompleteCheckpointError, ManifestError
from trainer_sdk.format import _catalog
from trainer_sdk.format._catalog import complete_steps, manifest_key, read_manifest
from trainer_sdk.storage import open_storage
from trainer_sdk.storage._s3_client import make_client
from trainer_sdk.storage.local import LocalStorage
from trainer_sdk.storage.s3 import S3Config, S3Storage


class CountingStorage(LocalStorage):
    """A real filesystem storage that counts the whole-object reads of each path."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.reads: Counter[str] = Counter()

    def read_bytes(self, path: str) -> bytes:
        self.reads[path] += 1
        return super().read_bytes(path)

    def read_versioned(self, path: str) -> tuple[bytes, str]:
        self.reads[path] += 1
        return super().read_versioned(path)

    def read_with_version(self, path: str, *, limit: int) -> tuple[bytes, str]:
        self.reads[path] += 1
        return super().read_with_version(path, limit=limit)

    def manifest_reads(self) -> Counter[str]:
        return Counter({p: n for p, n in self.reads.items() if p.endswith("/manifest.json")})


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 4, bias=False))
    for p in model[0].parameters():
        p.requires_grad_(False)  # the frozen base
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, opt


def test_commits_read_no_committed_manifest_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = CountingStorage(str(tmp_path / "ckpt"))
    model, opt = _model()
    steps = list(range(1, 9))
    with Checkpointer(storage, model=model, optimizer=opt, keep_last=2,
                      handle_sigterm=False) as ckpt:  # fmt: skip
        for step in steps:
            opt.zero_grad()
            model(torch.randn(2, 256)).square().mean().backward()
            opt.step()
            ckpt.save(step)
    reads = storage.manifest_reads()
    # Every commit checked its references and ran retention over the kept steps; none of
    # them read a committed manifest back (this process wrote each one and cached it).
    assert reads == Counter(), reads
    kept = complete_steps(storage)
    assert sorted(kept) == steps[-2:]
    base = manifest_key(steps[0])
    assert all(kept[s].referenced_steps() == {steps[0]} for s in kept), base
    # A reader in a new process (a fresh cache) reads each kept manifest once.
    monkeypatch.setattr(_catalog, "_manifests", _catalog._ManifestCache())
    other = CountingStorage(storage.root)
    for _ in range(3):
        assert sorted(complete_steps(other)) == steps[-2:]
    assert other.manifest_reads() == Counter({manifest_key(s): 1 for s in steps[-2:]})


def _save_plain(root: Path, step: int) -> None:
    state = {"w": torch.arange(8, dtype=torch.float32)}
    api.save(state, str(root), step=step)


def test_a_deleted_or_rewritten_step_is_not_served_from_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ckpt"
    _save_plain(root, 1)
    _save_plain(root, 2)
    monkeypatch.setattr(_catalog, "_manifests", _catalog._ManifestCache())  # a new process
    storage = CountingStorage(str(root))
    first = read_manifest(storage, 2)
    assert read_manifest(storage, 2) is first  # cached: unchanged object
    assert storage.manifest_reads()[manifest_key(2)] == 1

    # Rewritten by hand as a new object of the very same size (another writer's commit of
    # that step after the old one was deleted): read again, the new content returned.
    path = root / manifest_key(2)
    data = path.read_bytes()
    assert data.count(b'"periodic"') == 1
    os.unlink(path)
    path.write_bytes(data.replace(b'"periodic"', b'"rescue!!"'))  # a caller's own word
    assert path.stat().st_size == len(data)
    assert read_manifest(storage, 2).trigger == "rescue!!"
    path.write_bytes(data.replace(b'"periodic"', b'"backup!!"'))  # in place, the same size
    assert read_manifest(storage, 2).trigger == "backup!!"
    assert storage.manifest_reads()[manifest_key(2)] == 3

    # Deleted by hand (another writer's retention, a person): gone for readers at once.
    assert sorted(complete_steps(storage)) == [1, 2]
    os.unlink(path)
    with pytest.raises(IncompleteCheckpointError):
        read_manifest(storage, 2)
    assert sorted(complete_steps(storage)) == [1]

    # Deleted through the API: the entry goes with it.
    read_manifest(storage, 1)
    api.delete_step(storage, 1)
    with pytest.raises(IncompleteCheckpointError):
        read_manifest(storage, 1)


def test_on_s3_a_rewritten_or_deleted_step_is_read_again(
    s3_bucket: S3Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S3: the token is the object's ETag and size (one HEAD); a PUT of other bytes of the
    same size changes the ETag."""
    uri = s3_bucket.uri("jobs/cache")
    state = {"w": torch.arange(8, dtype=torch.float32)}
    api.save(state, uri, step=1)
    api.save(state, uri, step=2)
    monkeypatch.setattr(_catalog, "_manifests", _catalog._ManifestCache())
    storage = open_storage(uri)
    first = read_manifest(storage, 2)
    assert read_manifest(storage, 2) is first  # cached: the object is unchanged
    key = f"jobs/cache/{manifest_key(2)}"
    data = s3_bucket.get(key)
    s3_bucket.client.put_object(
        Bucket=s3_bucket.name, Key=key, Body=data.replace(b'"periodic"', b'"rescue!!"')
    )
    assert read_manifest(storage, 2).trigger == "rescue!!"
    s3_bucket.client.delete_object(Bucket=s3_bucket.name, Key=key)
    with pytest.raises(IncompleteCheckpointError):
        read_manifest(storage, 2)
    assert sorted(complete_steps(storage)) == [1]


# ------------------------------------------------------------------ what a manifest read costs


def _requests(proxy: FaultProxy, key: str, since: int) -> Counter[str]:
    return Counter(s.op for s in proxy.seen()[since:] if s.key == key)


def test_on_s3_a_manifest_read_is_one_head_and_one_get_on_a_miss_one_head_on_a_hit(
    s3_faults: S3Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GET's own ETag and length are the token (``read_with_version``), so a miss no
    longer takes the size and the token again with two more HEADs."""
    proxy = s3_faults.proxy
    assert proxy is not None
    uri = s3_faults.uri("jobs/cost")
    api.save({"w": torch.arange(8, dtype=torch.float32)}, uri, step=1)
    monkeypatch.setattr(_catalog, "_manifests", _catalog._ManifestCache())  # a new process
    storage = open_storage(uri)
    key = f"jobs/cost/{manifest_key(1)}"

    mark = len(proxy.seen())
    first = read_manifest(storage, 1)
    assert _requests(proxy, key, mark) == Counter({"HeadObject": 1, "GetObject": 1})
    mark = len(proxy.seen())
    assert read_manifest(storage, 1) is first  # the GET's token is the one a HEAD gives
    assert _requests(proxy, key, mark) == Counter({"HeadObject": 1})

    # Replaced by another object: its token changes, it is read again, then served again.
    data = s3_faults.get(key)
    s3_faults.client.put_object(
        Bucket=s3_faults.name, Key=key, Body=data.replace(b'"periodic"', b'"rescue!!"')
    )
    mark = len(proxy.seen())
    again = read_manifest(storage, 1)
    assert again.trigger == "rescue!!"
    assert _requests(proxy, key, mark) == Counter({"HeadObject": 1, "GetObject": 1})
    mark = len(proxy.seen())
    assert read_manifest(storage, 1) is again
    assert _requests(proxy, key, mark) == Counter({"HeadObject": 1})


class _BodySpy:
    """The body of a GetObject response as botocore hands it over, with the bytes read off it
    counted (to show that a refused manifest's body is closed unread)."""

    def __init__(self, body: Any, log: list[int]) -> None:
        self._body = body
        self._log = log

    def read(self, amt: int | None = None) -> bytes:
        data: bytes = self._body.read(amt)
        self._log.append(len(data))
        return data

    def close(self) -> None:
        self._body.close()


def test_on_s3_a_manifest_over_the_limit_is_refused_with_its_body_unread(
    s3_faults: S3Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = s3_faults.proxy
    assert proxy is not None
    uri = s3_faults.uri("jobs/big")
    api.save({"w": torch.arange(8, dtype=torch.float32)}, uri, step=1)
    key = f"jobs/big/{manifest_key(1)}"
    size = len(s3_faults.get(key))
    monkeypatch.setattr(_catalog, "_manifests", _catalog._ManifestCache())
    monkeypatch.setattr(_catalog, "MAX_JSON_BYTES", size - 1)
    client = make_client(S3Config.from_env())
    read: list[int] = []

    def spy(parsed: dict[str, Any], **_: Any) -> None:
        if "Body" in parsed:
            parsed["Body"] = _BodySpy(parsed["Body"], read)

    client.meta.events.register("after-call.s3.GetObject", spy)
    storage = S3Storage(s3_faults.name, "jobs/big", client=client)
    mark = len(proxy.seen())
    with pytest.raises(ManifestError, match=f"manifest is {size} bytes, over the limit"):
        read_manifest(storage, 1)
    assert _requests(proxy, key, mark) == Counter({"HeadObject": 1, "GetObject": 1})
    assert read == []  # the body was closed, none of it read
    with pytest.raises(ManifestError):
        read_manifest(storage, 1)  # refused again: a refusal is never cached
    monkeypatch.setattr(_catalog, "MAX_JSON_BYTES", size)
    assert read_manifest(storage, 1).step == 1
    assert sum(read) == size


class _ReadCountingStorage(LocalStorage):
    """A real filesystem storage that counts the bytes it reads off files, and can append to
    a file right after reading it (a write that lands while the reader has it open)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.bytes_read = 0
        self.append_after_read: bytes | None = None

    def _pread_into(self, fd: int, offset: int, out: memoryview, path: str) -> None:  # type: ignore[override]
        LocalStorage._pread_into(fd, offset, out, path)
        self.bytes_read += len(out)
        if self.append_after_read is not None:
            with open(os.path.join(self.root, path), "ab") as f:
                f.write(self.append_after_read)
            self.append_after_read = None


def test_on_a_filesystem_the_token_is_that_of_the_bytes_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ckpt"
    _save_plain(root, 1)
    monkeypatch.setattr(_catalog, "_manifests", _catalog._ManifestCache())
    storage = _ReadCountingStorage(str(root))
    key = manifest_key(1)
    data, token = storage.read_with_version(key, limit=1 << 20)
    assert token == storage.version(key)
    assert data == (root / key).read_bytes()

    # Written while read (a trailing space: still a valid manifest): the bytes returned are
    # not those of the file now, and their token is one that version() never gives.
    storage.append_after_read = b" "
    first = read_manifest(storage, 1)
    assert storage.bytes_read == 2 * len(data)
    second = read_manifest(storage, 1)
    assert second is not first  # not cached: read again
    assert storage.bytes_read == 3 * len(data) + 1
    assert read_manifest(storage, 1) is second  # unchanged across that read: cached
    assert storage.bytes_read == 3 * len(data) + 1

    # Over the limit: refused before any byte is read.
    size = len(data) + 1
    monkeypatch.setattr(_catalog, "_manifests", _catalog._ManifestCache())
    monkeypatch.setattr(_catalog, "MAX_JSON_BYTES", size - 1)
    before = storage.bytes_read
    with pytest.raises(ManifestError, match=f"manifest is {size} bytes, over the limit"):
        read_manifest(storage, 1)
    assert storage.bytes_read == before


class _VersionedWrapper(StorageWrapper):
    """A storage with ``version`` but no ``read_with_version`` (a user's storage): the manifest
    cache serves it through the old path, counted call by call."""

    def __init__(self, uri: str) -> None:
        super().__init__(uri)
        self.calls: Counter[str] = Counter()

    def version(self, path: str) -> str:
        self.calls["version"] += 1
        token: str = self._inner.version(path)  # type: ignore[attr-defined]
        return token

    def size(self, path: str) -> int:
        self.calls["size"] += 1
        return super().size(path)

    def read_bytes(self, path: str) -> bytes:
        self.calls["read_bytes"] += 1
        return super().read_bytes(path)


def test_a_storage_without_read_with_version_is_cached_the_old_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ckpt"
    _save_plain(root, 1)
    monkeypatch.setattr(_catalog, "_manifests", _catalog._ManifestCache())
    storage = _VersionedWrapper(str(root))
    assert not hasattr(storage, "read_with_version")
    first = read_manifest(storage, 1)
    assert storage.calls == Counter({"version": 2, "size": 1, "read_bytes": 1})
    storage.calls.clear()
    assert read_manifest(storage, 1) is first
    assert storage.calls == Counter({"version": 1})
