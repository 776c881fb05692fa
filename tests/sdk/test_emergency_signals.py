"""Notices reach one rank; the agreement collective makes every rank act on them alike."""

from __future__ import annotations

import os
import signal
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from baton_testing.dist import run_ranks

from trainer_sdk.control import ControlChannel
from trainer_sdk.loop._deadline import SaveEstimator, probe_write
from trainer_sdk.loop.signals import (
    ControlPoller,
    LocalNotice,
    NoticeBoard,
    SigtermListener,
    agree,
)
from trainer_sdk.storage import open_storage


def _received(listener: SigtermListener) -> bool:
    # a call, so that the type checker does not carry the earlier assert's narrowing over
    return listener.received


def test_sigterm_sets_a_flag_and_chains_the_previous_handler() -> None:
    seen: list[int] = []
    old = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        listener = SigtermListener()
        assert listener.install()
        os.kill(os.getpid(), signal.SIGTERM)
        # delivered to the main thread at the next bytecode boundary
        for _ in range(100):
            if listener.received:
                break
            time.sleep(0.01)
        assert listener.received
        assert seen == [signal.SIGTERM]
        listener.reset()
        assert not _received(listener)
        listener.uninstall()
        # the previous handler is back
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert seen == [signal.SIGTERM, signal.SIGTERM]
        assert not _received(listener)
    finally:
        signal.signal(signal.SIGTERM, old)


def test_control_poller_sees_a_request_once_and_clears_it(tmp_path: Path) -> None:
    channel = ControlChannel(tmp_path)
    poller = ControlPoller(channel)
    assert poller.poll() is None
    deadline = datetime.now(UTC) + timedelta(seconds=90)
    request, merged = channel.merge_request(deadline=deadline, reason="spot", source="aws")
    assert not merged
    got = poller.poll()
    assert got is not None
    assert got.id == request.id
    assert got.deadline is not None
    assert abs(got.deadline.timestamp() - deadline.timestamp()) < 0.01
    # polling again without a change costs a stat and returns the same request
    assert poller.poll() == got
    poller.served(got)
    assert not channel.request_path.exists()
    assert poller.poll() is None


def test_control_poller_ignores_an_unreadable_request(tmp_path: Path) -> None:
    channel = ControlChannel(tmp_path)
    channel.request_path.write_text("{not json")
    assert ControlPoller(channel).poll() is None


def test_notice_board_merges_sources_and_keeps_the_earliest_deadline(tmp_path: Path) -> None:
    channel = ControlChannel(tmp_path)
    board = NoticeBoard(sigterm=None, poller=ControlPoller(channel))
    now = time.time()
    board.request(deadline=now + 100, reason="first")
    board.request(deadline=now + 50, reason="second")
    channel.merge_request(
        deadline=datetime.fromtimestamp(now + 70, tz=UTC), reason="aws", source="aws"
    )
    local = board.local()
    assert local.api
    assert local.control is not None
    assert local.deadline == pytest.approx(now + 50, abs=1e-3)
    assert "second" in local.reason
    assert "aws" in local.reason
    board.served(local)
    after = board.local()
    assert not after.api
    assert after.control is None
    assert after.deadline is None


def test_single_process_agreement_adopts_the_local_view() -> None:
    local = LocalNotice(sigterm=True, deadline=1234.5, periodic_due=True)
    ag = agree(local, rank=0, group=None)
    assert ag.notice
    assert ag.sources == {"signal"}
    assert ag.trigger == "signal"
    assert ag.deadline == pytest.approx(1234.5)
    assert ag.periodic_due
    assert ag.rank0_time == pytest.approx(time.time(), abs=5)


def _agree_body() -> dict[str, object]:
    import torch.distributed as dist

    rank = dist.get_rank()
    # rank 1 alone heard SIGTERM; rank 0 alone knows a deadline and says a timed save is due;
    # rank 1 also claims a timed save is due, which must be ignored (rank 0's clock decides)
    local = (
        LocalNotice(deadline=5000.25, periodic_due=True)
        if rank == 0
        else LocalNotice(sigterm=True, deadline=9000.0, periodic_due=False)
    )
    quiet = agree(LocalNotice(periodic_due=rank == 1), rank=rank, group=dist.group.WORLD)
    ag = agree(local, rank=rank, group=dist.group.WORLD)
    return {
        "sources": sorted(ag.sources),
        "deadline": ag.deadline,
        "periodic": ag.periodic_due,
        "rank0_time": ag.rank0_time,
        "quiet_notice": quiet.notice,
        "quiet_periodic": quiet.periodic_due,
        "bg": ag.background_failed,
    }


def test_two_ranks_agree_on_one_view() -> None:
    a, b = run_ranks(_agree_body, 2, timeout=90)
    assert a == b
    assert a["sources"] == ["signal"]
    assert a["deadline"] == pytest.approx(5000.25)
    assert a["periodic"] is True
    assert a["quiet_notice"] is False
    assert a["quiet_periodic"] is False
    assert a["bg"] is False
    assert abs(float(a["rank0_time"]) - time.time()) < 120


def _overlap_body(root: str, below: float, request_at: int, sleep: float) -> dict[str, object]:
    import torch
    import torch.distributed as dist
    from torch import nn

    from trainer_sdk import Checkpointer, api

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    ck = Checkpointer(
        root, model=model, handle_sigterm=False, notice_overlap_below=below, timeout=60
    )
    stopped_at = None
    for step in range(1, 20):
        if step == request_at and rank == 2:  # one rank hears it, before this boundary
            ck.request_checkpoint(reason="test")
        if sleep:
            time.sleep(sleep)  # a slow training step: the stimulus, not a wait
        if ck.step(step):
            stopped_at = step
            break
    ck.close()
    return {"stopped_at": stopped_at, "steps": api.list_steps(root)}


@pytest.mark.parametrize(
    ("below", "sleep", "served"),
    [
        (float("inf"), 0.0, 6),  # always overlapped: served one boundary later
        (0.0, 0.0, 5),  # never: served at the boundary where it is heard
        (0.3, 0.6, 5),  # boundaries 0.6 s apart are too slow to overlap below 0.3 s
    ],
)
def test_every_rank_serves_the_notice_at_the_same_boundary(
    tmp_path: Path, below: float, sleep: float, served: int
) -> None:
    results = run_ranks(_overlap_body, 3, args=(str(tmp_path / "ck"), below, 5, sleep), timeout=240)
    assert [r["stopped_at"] for r in results] == [served] * 3
    assert results[0]["steps"] == [served]


def _close_with_pending_body() -> dict[str, object]:
    import logging

    import torch.distributed as dist
    from torch import nn

    from trainer_sdk import Checkpointer

    records: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("trainer_sdk.checkpointer").addHandler(_Keep())
    rank = dist.get_rank()
    root = os.environ["BATON_TEST_ROOT"]
    ck = Checkpointer(root, model=nn.Linear(2, 2), handle_sigterm=False, notice_overlap_below=60)
    assert ck.step(1) is False
    if rank == 1:
        ck.request_checkpoint(reason="late")
    assert ck.step(2) is False  # rank 1's request is in flight now
    ck.close()  # finishes the agreement in flight; nothing hangs, the notice is reported
    return {"warned": any("was not served" in m for m in records)}


def test_close_finishes_an_agreement_in_flight(tmp_path: Path) -> None:
    results = run_ranks(
        _close_with_pending_body, 2, env={"BATON_TEST_ROOT": str(tmp_path)}, timeout=120
    )
    assert [r["warned"] for r in results] == [True, True]


def test_notice_overlap_below_must_be_seconds(tmp_path: Path) -> None:
    from torch import nn

    from trainer_sdk import Checkpointer
    from trainer_sdk.errors import CheckpointError

    for bad in (-1.0, float("nan")):
        with pytest.raises(CheckpointError, match="notice_overlap_below"):
            Checkpointer(str(tmp_path), model=nn.Linear(2, 2), notice_overlap_below=bad)


def _measured(est: SaveEstimator) -> bool:
    return est.measured


def test_estimator_uses_real_saves_over_the_probe(tmp_path: Path) -> None:
    est = SaveEstimator(safety=2.0, fixed_s=0.5)
    assert est.estimate(100) is None
    assert not _measured(est)
    nbytes, seconds = probe_write(open_storage(str(tmp_path)), rank=3, nbytes=1 << 20)
    assert nbytes == 1 << 20
    assert seconds > 0
    # the probe leaves nothing behind
    assert not list((tmp_path / ".baton-probe").glob("*"))
    est.record(nbytes, seconds, probe=True)
    assert est.measured
    est.record(1000, 1.0)  # 1000 B/s, the slowest wins
    est.record(4000, 1.0)
    assert est.throughput == pytest.approx(1000.0)
    assert est.estimate(3000) == pytest.approx(0.5 + 2.0 * 3.0)


def test_small_incremental_saves_do_not_collapse_the_throughput() -> None:
    """A LoRA job's first save writes its 256 MiB frozen base; every later save writes 50 kB of
    adapter beside references to it, in a fixed 0.3 s. Before the two were kept apart, one such
    save made the estimator read 0.17 MB/s and predict 2,232 s for a full save (measured on a
    real 256 MiB run), so a notice save that had to rewrite the base was skipped."""
    est = SaveEstimator(safety=1.5, fixed_s=0.25)
    base = 256 << 20
    est.record(base, 2.0)  # the first save: about 134 MB/s
    for _ in range(12):  # more than the history: the large save must not be pushed out
        est.record(50_000, 0.3)
    assert est.throughput == pytest.approx(base / 2.0)
    # a full rewrite: the fixed cost of the small saves plus the bytes at the large throughput
    assert est.estimate(base) == pytest.approx(0.25 + 1.5 * (0.3 + 2.0))
    # the next adapter-only save: essentially its fixed cost
    assert est.estimate(50_000) == pytest.approx(0.25 + 1.5 * (0.3 + 50_000 / (base / 2.0)))
    # a slower large save is the one that counts (the slowest wins)
    est.record(base, 4.0)
    assert est.estimate(base) == pytest.approx(0.25 + 1.5 * (0.3 + 4.0))
