"""Data path + RNG together: a resumed loop sees the same samples *and* the same random numbers.

The dataset augments every item with python, numpy and torch randomness (as real data
pipelines do, in the main process with num_workers=0), and the loop draws dropout-like noise
after every batch. A run is interrupted mid-epoch, its sampler state and RNG captured; a "new
process" (every global stream scrambled, new sampler and loader) restores them and continues.
The (indices, augmentation, loop noise) sequence must equal the uninterrupted run's bitwise.

This is where the pitfalls bite: a resume that skips by iterating would run the augmentation
for skipped items and advance the RNG (transformers#46628); a plain ``iter(loader)`` after the
restore would draw a worker seed and shift the stream.
"""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from trainer_sdk import rng
from trainer_sdk.sampler import ResumableSampler

N, BATCH, SEED = 30, 4, 77


class Augmented(Dataset[tuple[int, float, float, float]]):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[int, float, float, float]:
        return i, random.random(), float(np.random.standard_normal()), float(torch.rand(()))


def _steps(sampler: ResumableSampler, epochs_left: int, stop_after: int | None) -> list[Any]:
    """Run the training-loop stand-in; returns one record per batch."""
    out: list[Any] = []
    loader = DataLoader(Augmented(), batch_size=BATCH, sampler=sampler)
    for _ in range(epochs_left):
        for idx, a, b, c in sampler.track(loader):
            noise = torch.randn(3).tolist()  # the model's own draw (dropout) after the batch
            out.append([idx.tolist(), a.tolist(), b.tolist(), c.tolist(), noise])
            if stop_after is not None and len(out) == stop_after:
                return out
    return out


def _seed_all(s: int) -> None:
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)


@pytest.mark.parametrize("stop_after", [1, 5, 8, 11])
def test_resumed_data_path_is_bitwise_the_uninterrupted_one(stop_after: int) -> None:
    _seed_all(SEED)
    reference = _steps(ResumableSampler(N, seed=SEED), 2, None)
    assert len(reference) == 16  # 8 batches per epoch, the last one partial

    _seed_all(SEED)
    first = ResumableSampler(N, seed=SEED)
    head = _steps(first, 2, stop_after)
    # the checkpoint: sampler state (JSON) and the RNG streams, taken at the step boundary
    sampler_state = json.loads(json.dumps(first.state_dict()))
    rng_state = rng.capture()

    _seed_all(12345)  # a new process: its streams are whatever its start-up left them
    torch.randn(100)
    second = ResumableSampler(N, seed=SEED)
    second.load_state_dict(sampler_state)
    rng.restore(rng_state)
    epochs_left = 2 - second.epoch
    tail = _steps(second, epochs_left, None)
    assert head + tail == reference
