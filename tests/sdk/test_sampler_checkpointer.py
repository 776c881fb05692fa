"""ResumableSampler behind a real Checkpointer (one process): exact resume with prefetching
workers when the loop uses track(), and a refusal, not a wrong save, when it does not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader, Dataset

import trainer_sdk
from trainer_sdk.sampler import ResumableSampler, SamplerError

N, BATCH, SEED = 40, 4, 3


class IndexData(Dataset[int]):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        return i


def _loader(workers: int) -> tuple[ResumableSampler, DataLoader[Any]]:
    sampler = ResumableSampler(N, seed=SEED)
    loader = DataLoader(IndexData(), batch_size=BATCH, sampler=sampler, num_workers=workers)
    return sampler, loader


def _train(uri: str, workers: int, total_steps: int, stop_at: int | None) -> list[list[int]]:
    """A training loop stand-in: one batch per step, a checkpoint every 3 steps."""
    sampler, loader = _loader(workers)
    seen: list[list[int]] = []
    with trainer_sdk.Checkpointer(
        uri, dataloader=loader, every_steps=3, handle_sigterm=False
    ) as ck:
        step = ck.restore()
        while step < total_steps:
            for batch in sampler.track(loader):
                seen.append(batch.tolist())
                step += 1
                ck.step(step)
                if step in (total_steps, stop_at):
                    break
            if step == stop_at:
                break
    return seen


@pytest.mark.parametrize("workers", [0, 2])
def test_checkpointer_resumes_the_sampler_at_the_exact_sample(tmp_path: Path, workers: int) -> None:
    total = 25  # 10 batches per epoch: the run crosses two epoch boundaries
    reference = _train(str(tmp_path / "ref"), 0, total, None)
    uri = str(tmp_path / "run")
    head = _train(uri, workers, total, stop_at=17)  # dies at 17; the last save was step 15
    assert trainer_sdk.latest_step(uri) == 15
    tail = _train(uri, workers, total, None)
    assert head[:15] + tail == reference


def test_checkpointer_refuses_a_prefetched_position(tmp_path: Path) -> None:
    _sampler, loader = _loader(2)
    with trainer_sdk.Checkpointer(
        str(tmp_path), dataloader=loader, every_steps=1, handle_sigterm=False
    ) as ck:
        ck.restore()
        it = iter(loader)  # a plain loop over a loader whose workers prefetch
        next(it)
        with pytest.raises(SamplerError, match="track"):
            ck.step(1)
        del it
    assert trainer_sdk.latest_step(str(tmp_path)) is None
