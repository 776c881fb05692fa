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

import pytest
import torch
from baton_testing.s3 import S3Bucket
from torch import nn

from trainer_sdk import Checkpointer, _catalog, api
from trainer_sdk._catalog import complete_steps, manifest_key, read_manifest
from trainer_sdk.errors import IncompleteCheckpointError
from trainer_sdk.storage import open_storage
from trainer_sdk.storage.local import LocalStorage


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
