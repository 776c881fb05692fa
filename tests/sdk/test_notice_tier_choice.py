"""Which tier a notice commits to: the decision's bounds, an estimate that was never measured,
and one rank slower than the others (every rank still takes the slowest rank's decision).

The end-to-end path (a memory-tier job on the local cluster whose durable tier is slow for
real, the noticed pod replaced, the others kept, the promotion) is in
``tests/operator/test_notice_recovery_cluster.py``.
"""

from __future__ import annotations

import math
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from baton_testing.dist import run_ranks

from trainer_sdk import api
from trainer_sdk.loop._deadline import SaveEstimator, choose_tier
from trainer_sdk.loop._memory_tier import MemoryTier


@pytest.mark.parametrize(
    ("durable_s", "memory_s", "left", "tier"),
    [
        (3.0, 1.0, None, "durable"),  # no deadline: always durable, whatever it costs
        (math.inf, 1.0, None, "durable"),
        (3.0, 1.0, 3.0, "durable"),  # durable fits exactly: nothing to promote afterwards
        (3.0, 1.0, 10.0, "durable"),
        (3.01, 1.0, 3.0, "memory"),  # durable misses, memory fits
        (3.01, 3.0, 3.0, "memory"),  # memory fits exactly
        (5.0, 3.01, 3.0, None),  # neither fits: skipped
        (5.0, math.inf, 3.0, None),  # memory never measured (or not replicating): skipped
        (5.0, 1.0, -1.0, None),  # already past the deadline minus the margin
        (0.0, 1.0, 0.0, "durable"),  # nothing measured at all keeps today's durable path
    ],
)
def test_choose_tier_bounds(
    durable_s: float, memory_s: float, left: float | None, tier: str | None
) -> None:
    assert choose_tier(durable_s=durable_s, memory_s=memory_s, left=left) == tier


def test_an_unmeasured_or_unreplicated_memory_tier_never_takes_a_notice(tmp_path: Path) -> None:
    """Snapshots without a replicating sidecar (a single process here): the estimate stays
    infinite, so a notice too short for a durable save is skipped, never trusted to memory."""
    tier = MemoryTier(
        str(tmp_path / "fast"), every_steps=1, local_rank=0, timeout=timedelta(seconds=60)
    )
    try:
        assert tier.notice_estimate(1 << 20) == math.inf  # nothing snapshotted yet
        model = torch.nn.Linear(4, 4)
        flat = api.flatten({"model": model.state_dict()})
        plan = api.plan_save(flat, 0, 1)
        assert tier.commit(1, flat, plan, attempt=None) is False  # committed, not replicated
        assert tier.last_committed == 1
        assert tier.notice_estimate(plan.nbytes) == math.inf
    finally:
        tier.close()


def test_the_estimator_is_pessimistic_and_absent_until_measured() -> None:
    est = SaveEstimator()
    assert est.estimate(1000) is None
    est.record(1000, 1.0)
    est.record(1000, 4.0)  # the slowest recent observation counts
    assert est.estimate(1000) == pytest.approx(est.fixed_s + est.safety * 4.0)


def _slow_rank_body(slow_rank: int) -> list[object]:
    import time

    import torch.distributed as dist

    from trainer_sdk.loop._deadline import choose_tier
    from trainer_sdk.saveload._collectives import all_reduce_max

    rank = dist.get_rank()
    group = dist.new_group(backend="gloo")
    durable = 8.0  # every rank: a durable save would miss the deadline
    memory = 6.0 if rank == slow_rank else 0.5  # one rank's replication is slow
    deadline = time.time() + 4.0
    est_d, est_m, now0 = all_reduce_max(
        [durable, memory, time.time() if rank == 0 else 0.0], group=group
    )
    left = deadline - now0
    return [est_m, choose_tier(durable_s=est_d, memory_s=est_m, left=left)]


@pytest.mark.parametrize("slow_rank", [0, 2])
def test_one_slow_rank_decides_for_every_rank(slow_rank: int) -> None:
    """The slowest rank's estimate is every rank's: one decision, never a split."""
    results = run_ranks(_slow_rank_body, 3, args=(slow_rank,), timeout=300)
    assert results == [[6.0, None]] * 3
