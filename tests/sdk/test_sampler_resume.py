"""ResumableSampler: exact mid-epoch resume, no replayed epoch, no RNG advance, real DataLoaders.

Several ranks are simulated in one process (one sampler and DataLoader per rank, consumed in
lockstep as data-parallel training does): the sampler depends on rank and world size only
through its arguments, so this exercises exactly what separate processes would run.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset

from trainer_sdk.sampler import ResumableSampler, SamplerError, find_sampler


class IndexData(Dataset[int]):
    """Item i is i, so every batch says exactly which samples it holds."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _loader(sampler: ResumableSampler, n: int, *, bs: int = 4, workers: int = 0) -> DataLoader[Any]:
    return DataLoader(
        IndexData(n),
        batch_size=bs,
        sampler=sampler,
        num_workers=workers,
        # a tiny prefetch window still runs several batches ahead of the loop
        **({"prefetch_factor": 2} if workers else {}),
    )


def _take(it: Any, k: int) -> list[list[int]]:
    return [next(it).tolist() for _ in range(k)]


def _save(sampler: ResumableSampler) -> dict[str, Any]:
    """Through JSON, as a checkpoint stores it."""
    state: dict[str, Any] = json.loads(json.dumps(sampler.state_dict()))
    return state


def _flat(batches: list[list[int]]) -> list[int]:
    return [i for b in batches for i in b]


def _global_rng() -> tuple[Any, Any, torch.Tensor]:
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def _same_rng(a: tuple[Any, Any, torch.Tensor], b: tuple[Any, Any, torch.Tensor]) -> bool:
    return (
        a[0] == b[0]
        and np.array_equal(a[1][1], b[1][1])
        and a[1][2:] == b[1][2:]
        and torch.equal(a[2], b[2])
    )


# --- one rank -------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("stop_after", [0, 1, 5, 9])
def test_resume_mid_epoch_continues_at_the_exact_sample(workers: int, stop_after: int) -> None:
    n, bs = 37, 4  # 10 batches per epoch, the last one partial
    reference_sampler = ResumableSampler(n, seed=3)
    reference = [
        b.tolist() for _ in range(3) for b in reference_sampler.track(_loader(reference_sampler, n))
    ]

    first = ResumableSampler(n, seed=3)
    run = list(_take(first.track(_loader(first, n, workers=workers)), stop_after))
    state = _save(first)  # the loaders' workers have prefetched further; the state must not
    assert state["position"] == min(stop_after * bs, n)

    second = ResumableSampler(n, seed=3)
    second.load_state_dict(state)
    while len(run) < len(reference):
        run.extend(b.tolist() for b in second.track(_loader(second, n, workers=workers)))
    assert run == reference
    assert second.epoch == 3


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_in_a_later_epoch_does_not_replay_epoch_0(workers: int) -> None:
    n = 24
    s = ResumableSampler(n, seed=11)
    orders = [s.global_order(e) for e in range(3)]
    assert len({tuple(o) for o in orders}) == 3, "every epoch has its own order"
    for o in orders:
        assert sorted(o) == list(range(n))

    for _ in s.track(_loader(s, n, workers=workers)):
        pass
    assert s.epoch == 1
    for _ in s.track(_loader(s, n, workers=workers)):
        pass
    it = s.track(_loader(s, n, workers=workers))
    _take(it, 2)
    state = _save(s)
    assert (state["epoch"], state["position"]) == (2, 8)

    resumed = ResumableSampler(n, seed=11)
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # the DistributedSampler habit, with the restored epoch: keeps position
    rest = _flat([b.tolist() for b in resumed.track(_loader(resumed, n, workers=workers))])
    assert rest == orders[2][8:]
    with pytest.raises(SamplerError, match="replay"):
        resumed.set_epoch(0)
    nxt = _flat([b.tolist() for b in resumed.track(_loader(resumed, n))])
    assert nxt == resumed.global_order(3) != orders[0]


def test_a_plain_loop_with_num_workers_0_saves_the_consumed_position() -> None:
    """The documented rule: without track(), num_workers=0 is exact."""
    n = 30
    s = ResumableSampler(n, seed=5)
    loader = _loader(s, n, bs=3)
    assert find_sampler(loader) is s
    seen: list[int] = []
    for i, batch in enumerate(loader):
        seen.extend(batch.tolist())
        if i == 3:
            break
    state = _save(s)
    assert state["position"] == 12
    resumed = ResumableSampler(n, seed=5)
    resumed.load_state_dict(state)
    seen.extend(_flat([b.tolist() for b in _loader(resumed, n, bs=3)]))
    assert seen == s.global_order(0)
    assert resumed.epoch == 1


def test_prefetching_workers_without_track_are_refused_not_saved_wrong() -> None:
    n = 40
    s = ResumableSampler(n, seed=1)
    loader = _loader(s, n, bs=2, workers=2)
    it = iter(loader)
    next(it)
    # The pitfall itself: the DataLoader has pulled indices for batches the loop never saw.
    assert s.state_dict()["position"] > 2
    assert find_sampler(loader) is s
    with pytest.raises(SamplerError, match="track"):
        s.state_dict()
    del it


def test_mark_consumed_counts_at_the_consumer() -> None:
    n = 20
    s = ResumableSampler(n, seed=2)
    it = iter(_loader(s, n, bs=4, workers=2))
    got = []
    for _ in range(2):
        batch = next(it)
        s.mark_consumed(len(batch))
        got.extend(batch.tolist())
    assert _save(s)["position"] == 8
    with pytest.raises(SamplerError, match="remain"):
        s.mark_consumed(13)
    with pytest.raises(SamplerError, match=">= 0"):
        s.mark_consumed(-1)
    del it


def test_sampler_and_skip_never_touch_a_global_rng() -> None:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    before = _global_rng()
    s = ResumableSampler(1000, seed=9)
    list(iter(s))
    s.set_epoch(5)
    state = s.state_dict()
    t = ResumableSampler(1000, seed=9)
    t.load_state_dict({**state, "position": 777})  # "skipping" 777 samples: positional, no draws
    assert len(list(iter(t))) == 223
    assert _same_rng(before, _global_rng())


def test_track_starts_iteration_without_a_global_torch_draw() -> None:
    """A plain iter(loader) draws a worker seed from torch's global RNG; a run resumed mid-epoch
    would then be one draw off from the uninterrupted run. track() does not draw."""
    n = 12
    s = ResumableSampler(n)
    loader = _loader(s, n)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    iter(loader)
    assert not torch.equal(before, torch.get_rng_state())  # what track() protects against
    torch.manual_seed(0)
    for _ in s.track(loader):
        pass
    assert torch.equal(before, torch.get_rng_state())


def test_set_epoch_and_length_follow_distributed_sampler_habits() -> None:
    s = ResumableSampler(10, num_replicas=3, rank=1)
    assert len(s) == 4  # ceil(10 / 3), padded
    assert len(ResumableSampler(10, num_replicas=3, rank=1, drop_last=True)) == 3
    it = iter(s)
    next(it)
    s.set_epoch(0)  # the current epoch: keeps the position
    assert s.position == 3
    s.set_epoch(4)  # a later epoch starts at its beginning
    assert (s.epoch, s.position, s.remaining()) == (4, 0, 4)
    assert list(it) == []  # the iterator of the abandoned pass stops
    assert len(list(iter(s))) == 4
    assert s.epoch == 5  # advanced by itself at the end of the epoch
    s.set_epoch(5)  # a loop calling set_epoch(epoch) after the automatic advance is a no-op
    assert (s.epoch, s.position) == (5, 0)


def test_unshuffled_order_is_the_dataset_order() -> None:
    s = ResumableSampler(IndexData(7), shuffle=False)
    assert list(iter(s)) == list(range(7))
    assert s.global_order(3) == list(range(7))


def test_a_loader_with_drop_last_batches_ends_the_epoch_and_resumes_cleanly() -> None:
    n = 22
    s = ResumableSampler(n, seed=4)
    loader = DataLoader(IndexData(n), batch_size=5, sampler=s, drop_last=True)
    assert [len(b) for b in s.track(loader)] == [5, 5, 5, 5]
    assert (s.epoch, s.position) == (1, 0)
    out = _flat([b.tolist() for b in s.track(loader)])
    assert out == s.global_order(1)[:20]


def test_track_needs_a_loader_it_can_count() -> None:
    s = ResumableSampler(10)
    custom = DataLoader(IndexData(10), batch_sampler=[[0, 1], [2]])
    with pytest.raises(SamplerError, match="mark_consumed"):
        s.track(custom)
    other = ResumableSampler(10)
    with pytest.raises(SamplerError, match="mark_consumed"):
        s.track(DataLoader(IndexData(10), batch_size=2, sampler=other))
    with pytest.raises(SamplerError, match="not this"):
        s.track(DataLoader(IndexData(10), batch_size=None, sampler=other))
    wrapped = DataLoader(IndexData(10), batch_sampler=BatchSampler(s, 3, drop_last=False))
    assert find_sampler(wrapped) is s
    assert _flat([b.tolist() for b in s.track(wrapped)]) == s.global_order(0)
    unbatched = DataLoader(IndexData(10), batch_size=None, sampler=s)
    assert [int(x) for x in s.track(unbatched)] == s.global_order(1)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_samples": 11}, "dataset"),
        ({"seed": 8}, "seed"),
        ({"shuffle": False}, "shuffle"),
        ({"version": 0}, "version"),
        ({"position": 99}, "corrupt"),
        ({"epoch": -1}, "corrupt"),
        ({"position": "3"}, "must be an int"),
        # what a torch whose randperm draws differently would produce
        ({"order_check": "0" * 32, "torch_version": "9.9"}, "differs.*torch 9.9"),
    ],
)
def test_a_state_from_another_setup_is_refused(change: dict[str, Any], message: str) -> None:
    state = ResumableSampler(10, seed=7).state_dict()
    with pytest.raises(SamplerError, match=message):
        ResumableSampler(10, seed=7).load_state_dict({**state, **change})


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(SamplerError, match="rank"):
        ResumableSampler(10, num_replicas=2, rank=2)
    with pytest.raises(SamplerError, match="num_replicas"):
        ResumableSampler(10, num_replicas=0, rank=0)
    with pytest.raises(SamplerError, match=">= 0"):
        ResumableSampler(-1)


# --- several ranks and world-size changes ----------------------------------------------------


def _ranks(n: int, world: int, **kw: Any) -> list[ResumableSampler]:
    return [ResumableSampler(n, num_replicas=world, rank=r, seed=21, **kw) for r in range(world)]


def _lockstep(
    samplers: list[ResumableSampler], n: int, bs: int, steps: int | None, workers: int = 0
) -> tuple[list[list[int]], list[Any]]:
    """Every rank takes one batch per step, as data-parallel training does; returns what
    each rank consumed, and the (live) iterators."""
    its = [s.track(_loader(s, n, bs=bs, workers=workers)) for s in samplers]
    got: list[list[int]] = [[] for _ in samplers]
    step = 0
    while steps is None or step < steps:
        batches = [next(it, None) for it in its]
        if all(b is None for b in batches):
            break
        assert all(b is not None for b in batches), "ranks must have equal batch counts"
        for r, b in enumerate(batches):
            got[r].extend(b.tolist())
        step += 1
    return got, its


@pytest.mark.parametrize("workers", [0, 2])
def test_two_ranks_resume_mid_epoch_exactly(workers: int) -> None:
    n, bs = 50, 3
    reference, _ = _lockstep(_ranks(n, 2), n, bs, None)
    assert reference[0] == ResumableSampler(n, seed=21).global_order(0)[0::2]
    first = _ranks(n, 2)
    got, _its = _lockstep(first, n, bs, 4, workers)
    states = [_save(s) for s in first]
    assert states[0] == states[1], "the saved state is the same on every rank"
    second = _ranks(n, 2)
    for s, st in zip(second, states, strict=True):
        s.load_state_dict(st)
    rest, _ = _lockstep(second, n, bs, None, workers)
    assert [a + b for a, b in zip(got, rest, strict=True)] == reference


@pytest.mark.parametrize(("new_world", "n"), [(3, 60), (1, 60), (3, 61), (1, 61)])
def test_world_size_change_mid_epoch_skips_and_repeats_nothing(new_world: int, n: int) -> None:
    bs = 3
    before = _ranks(n, 2)
    got, _ = _lockstep(before, n, bs, 3)  # 9 samples per rank: global position 18
    state = _save(before[0])
    assert state["position"] == 18
    after = _ranks(n, new_world)
    for s in after:
        s.load_state_dict(state)
    rest, _ = _lockstep(after, n, bs, None)
    consumed = Counter(i for per_rank in got + rest for i in per_rank)
    order = before[0].global_order(0)
    remaining = n - 18
    padding = -remaining % new_world
    # Every sample exactly once; the only repeats are the padding DistributedSampler also adds
    # (from the start of the epoch's order) when the rest does not split evenly.
    assert set(consumed) == set(range(n))
    assert sorted(i for i, c in consumed.items() if c > 1) == sorted(order[:padding])
    assert sum(consumed.values()) == n + padding
    assert all(s.epoch == 1 and s.position == 0 for s in after)


def test_drop_last_after_a_world_size_change_repeats_nothing() -> None:
    n, bs = 61, 2
    before = _ranks(n, 2, drop_last=True)
    got, _ = _lockstep(before, n, bs, 4)
    after = _ranks(n, 4, drop_last=True)
    for s in after:
        s.load_state_dict(_save(before[1]))
    rest, _ = _lockstep(after, n, bs, None)
    consumed = Counter(i for per_rank in got + rest for i in per_rank)
    assert max(consumed.values()) == 1
    # 45 left over 4 ranks: 11 each, and the one at the very end of the order is dropped
    dropped = set(range(n)) - set(consumed)
    assert dropped == {before[0].global_order(0)[-1]}


def test_several_world_size_changes_in_one_epoch() -> None:
    n, bs = 84, 2
    consumed: list[int] = []
    samplers = _ranks(n, 2)
    # (steps at the current world size, world size after them): positions 12, 42, 48, then
    # 36 left over 4 ranks
    for steps, next_world in [(3, 3), (5, 1), (3, 4), (None, 0)]:
        got, _ = _lockstep(samplers, n, bs, steps)
        consumed.extend(i for per_rank in got for i in per_rank)
        if steps is None:
            break
        state = _save(samplers[0])
        samplers = _ranks(n, next_world)
        for s in samplers:
            s.load_state_dict(state)
    assert sorted(consumed) == list(range(n))
    assert all(s.epoch == 1 for s in samplers)


def test_a_loader_that_reorders_batches_is_refused() -> None:
    """With in_order=False a count of consumed samples cannot say which were consumed."""
    s = ResumableSampler(20)
    loader = DataLoader(IndexData(20), batch_size=2, sampler=s, num_workers=2, in_order=False)
    with pytest.raises(SamplerError, match="in_order"):
        s.track(loader)
    assert find_sampler(loader) is s
    with pytest.raises(SamplerError, match="in_order"):
        s.state_dict()
    # without workers there is nothing to reorder
    t = ResumableSampler(20)
    plain = DataLoader(IndexData(20), batch_size=2, sampler=t, in_order=False)
    assert find_sampler(plain) is t
    assert len(list(t.track(plain))) == 10


@pytest.mark.parametrize("workers", [0, 2])
def test_persistent_workers_across_epochs_and_a_resume(workers: int) -> None:
    n = 18
    kw: dict[str, Any] = {"persistent_workers": True, "num_workers": workers} if workers else {}
    s = ResumableSampler(n, seed=8)
    loader = DataLoader(IndexData(n), batch_size=4, sampler=s, **kw)
    seen = [_flat([b.tolist() for b in s.track(loader)]) for _ in range(2)]
    assert seen == [s.global_order(0), s.global_order(1)]
    it = s.track(loader)
    part = _flat(_take(it, 2))
    state = _save(s)
    t = ResumableSampler(n, seed=8)
    t.load_state_dict(state)
    rest = _flat(
        [b.tolist() for b in t.track(DataLoader(IndexData(n), batch_size=4, sampler=t, **kw))]
    )
    assert part + rest == s.global_order(2)


# (untracked iteration with prefetching workers is refused by design, tested above)
@pytest.mark.parametrize(("workers", "tracked"), [(0, True), (2, True), (0, False)])
def test_break_and_iterate_again_continues_where_the_loop_stopped(
    workers: int, tracked: bool
) -> None:
    n = 26
    s = ResumableSampler(n, seed=6)
    loader = _loader(s, n, bs=3, workers=workers)
    got: list[int] = []
    for _ in range(3):  # three interruptions (an eval, a break) in one epoch
        it = iter(s.track(loader)) if tracked else iter(loader)
        got.extend(_flat(_take(it, 2)))
        del it
    rest = s.track(loader) if tracked else loader
    got.extend(_flat([b.tolist() for b in rest]))
    assert got == s.global_order(0)
    assert s.epoch == 1


@pytest.mark.parametrize("workers", [0, 2])
def test_a_break_after_the_last_batch_of_an_epoch_loses_no_epoch(workers: int) -> None:
    n = 12
    s = ResumableSampler(n, seed=10)
    loader = _loader(s, n, bs=4, workers=workers)
    for i, _ in enumerate(s.track(loader)):
        if i == 2:  # the epoch's last batch: the loop stops before the loader says it is done
            break
    assert s.epoch == 1
    assert _flat([b.tolist() for b in s.track(loader)]) == s.global_order(1)
    assert s.epoch == 2


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("scenario", range(30))
def test_random_world_size_changes_keep_every_epoch_exactly_once(
    scenario: int, drop_last: bool
) -> None:
    """Random dataset sizes, batch sizes and sequences of world sizes (incl. more ranks than
    samples): over an epoch every sample is consumed once, except for the padding of the final
    pass (taken from the start of the order), or with drop_last the tail it drops."""
    r = random.Random(scenario)
    n, bs = r.randint(1, 40), r.randint(1, 5)
    world = r.randint(1, 4)
    samplers = _ranks(n, world, drop_last=drop_last)
    order = samplers[0].global_order(0)
    consumed: Counter[int] = Counter()
    pass_start = 0  # where the pass on the current world size began
    for _ in range(r.randint(0, 4)):
        if samplers[0].epoch != 0:
            break  # (a loaded position can already be the end of the epoch, with drop_last)
        got, _its = _lockstep(samplers, n, bs, r.randint(0, 3))
        consumed.update(i for per_rank in got for i in per_rank)
        if samplers[0].epoch != 0:
            break
        state = _save(samplers[0])
        assert all(_save(s) == state for s in samplers[1:])
        world, pass_start = r.randint(1, 4), state["position"]
        samplers = _ranks(n, world, drop_last=drop_last)
        for s in samplers:
            s.load_state_dict(state)
    if samplers[0].epoch == 0:  # finish the epoch on the last world size
        got, _its = _lockstep(samplers, n, bs, None)
        consumed.update(i for per_rank in got for i in per_rank)
    if drop_last:
        kept = pass_start + (n - pass_start) // world * world
        assert consumed == Counter(order[:kept])
    else:
        pad = -(n - pass_start) % world
        assert set(consumed) == set(range(n))
        assert sum(consumed.values()) == n + pad
        assert consumed - Counter(range(n)) == Counter((order * (pad // n + 1))[:pad])
    assert all(s.epoch == 1 and s.position == 0 for s in samplers)
