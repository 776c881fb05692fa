"""What a rank's exit means when a launcher (torchrun) stands between the pod and the workers.

torchrun reports a worker's exit 75 ("stopped after a committed notice save") as its own exit
1. The committed save the sidecar reported is the truth: such an exit is a preemption, never
a failure, and ``maxFailures: 0`` survives it. A save that did not commit leaves exit 1 a
failure. The cluster test (``test_gpu_jobs_cluster.py``) runs the same through real torchrun.
"""

from __future__ import annotations

from typing import Any

from baton_operator.client.sidecars import SidecarStatus
from baton_operator.pure import lifecycle
from baton_operator.pure.lifecycle import Outcome, RankView
from baton_operator.reconcile.controller import JobMemory


def view(rank: int, **kw: Any) -> RankView:
    return RankView(rank=rank, pod=f"p{rank}", **kw)


def test_exit_1_after_a_committed_notice_save_is_a_preemption() -> None:
    ranks = [
        view(0, exit_code=1, served_notice=True, committed_notice=True),
        view(1, exit_code=1, served_notice=True, committed_notice=True),
    ]
    outcome, detail = lifecycle.classify(ranks, 2)
    assert outcome is Outcome.PREEMPTED, detail
    assert "rank(s) 0, 1" in detail


def test_exit_1_is_a_failure_without_a_committed_save() -> None:
    # A served notice whose save was skipped (no time) or failed proves nothing about exit 1.
    skipped = [view(0, exit_code=1, served_notice=True), view(1, exit_code=75)]
    assert lifecycle.classify(skipped, 2)[0] is Outcome.FAILED
    plain = [view(0, exit_code=1), view(1, running=True)]
    assert lifecycle.classify(plain, 2)[0] is Outcome.FAILED


def test_one_pod_stopped_after_the_save_while_the_other_still_stops() -> None:
    ranks = [
        view(0, exit_code=1, served_notice=True, committed_notice=True),
        view(1, running=True),
    ]
    assert lifecycle.classify(ranks, 2)[0] is Outcome.PENDING


def _memory(**report: Any) -> JobMemory:
    memory = JobMemory()
    memory.for_attempt(0)
    memory.reports[0] = SidecarStatus(**report)
    return memory


def test_memory_reads_a_committed_notice_from_the_sidecar_report() -> None:
    notice = _memory(state="committed", step=12, trigger="notice", request_id="r1")
    assert notice.committed_notice(0)
    assert notice.served_notice(0)
    signal = _memory(state="committed", step=12, trigger="signal")
    assert signal.committed_notice(0)
    # A periodic save's commit is not a reason to stop: exit 1 after it is a crash.
    periodic = _memory(state="committed", step=10, trigger="periodic")
    assert not periodic.committed_notice(0)
    skipped = _memory(state="skipped", trigger="notice", request_id="r1")
    assert skipped.served_notice(0)
    assert not skipped.committed_notice(0)
    assert not JobMemory().committed_notice(0)
