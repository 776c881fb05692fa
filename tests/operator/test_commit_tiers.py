"""The tier of every commit: what the operator reads from the ranks' reports, records in
``status.lastCheckpoint.tier`` and counts in ``baton_checkpoints_total{tier}``.

A notice that committed to the memory tier is not the notice's answer until its promotion has
committed too: the restart that follows an answer deletes the pods, and with them the only
copies of a snapshot that is not durable yet.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from baton_operator.client.metrics import Metrics
from baton_operator.pure import lifecycle, reports
from baton_operator.pure.lifecycle import VerdictKind
from baton_operator.pure.model import LastCheckpoint
from baton_operator.pure.reports import SidecarStatus
from baton_operator.pure.vocabulary import Tier
from prometheus_client.parser import text_string_to_metric_families


def _report(**raw: Any) -> SidecarStatus:
    base: dict[str, Any] = {"state": "committed", "step": 16, "request_id": "r1",
                            "trigger": "notice", "last_committed_step": 10}  # fmt: skip
    return SidecarStatus.from_json({**base, **raw})


def test_a_memory_commit_is_no_answer_until_promoted() -> None:
    memory = _report(tier="memory")
    promoted = _report(tier="memory+promoted", last_committed_step=16)
    durable = _report(tier="durable", last_committed_step=16)
    legacy = _report(last_committed_step=16)  # an SDK before tiers: durable
    assert not memory.durable
    assert not reports.answers(memory, "r1")
    assert not reports.committed_notice(memory)
    assert reports.served_notice(memory)  # served: the SDK stops training after it
    # the step a restart may resume from: the durable one, not the snapshot's
    assert memory.committed_step == 10
    for done in (promoted, durable, legacy):
        assert done.durable
        assert reports.answers(done, "r1")
        assert reports.committed_notice(done)
        assert done.committed_step == 16


def test_the_notice_waits_for_the_promotion_then_commits_or_falls_back_at_the_deadline() -> None:
    now = datetime(2026, 12, 2, tzinfo=UTC)
    deadline = now + timedelta(seconds=30)

    def verdict(report: SidecarStatus, at: datetime) -> lifecycle.Verdict:
        answers = {r: report if reports.answers(report, "r1") else None for r in range(3)}
        return lifecycle.checkpoint_verdict(answers, replicas=3, now=at, deadline=deadline)

    assert verdict(_report(tier="memory"), now).kind is VerdictKind.WAIT
    done = verdict(_report(tier="memory+promoted", last_committed_step=16), now)
    assert (done.kind, done.step) == (VerdictKind.COMMITTED, 16)
    late = verdict(_report(tier="memory"), deadline + timedelta(seconds=1))
    assert late.kind is VerdictKind.FALLBACK
    # ... and the fallback resumes from the newest durable step
    best, _ = reports.fallback_fields(
        LastCheckpoint(step=10), [_report(tier="memory")], uri="s3://b/ck", now="t"
    )
    assert best == 10


def test_a_fallback_never_resumes_from_a_memory_commit_no_rank_proves_durable() -> None:
    # lastCheckpoint on the memory tier (a notice's recovery): the restart after a fallback
    # deletes every pod, and with them the snapshot's only copies.
    last = LastCheckpoint(step=16, uri="file:///fast/ck", trigger="notice", tier="memory")
    older = _report(state="failed", step=20, last_committed_step=10)
    assert reports.fallback_step(last, [older]) == 10
    best, fields = reports.fallback_fields(last, [older], uri="s3://b/ck", now="t")
    assert best == 10
    assert fields["lastCheckpoint"]["step"] == 10
    assert reports.fallback_fields(last, [], uri="s3://b/ck", now="t") == (
        None, {"lastCheckpoint": None},
    )  # fmt: skip
    # a rank reports the promotion committed: the step is durable, and stays recorded
    promoted = _report(state="failed", step=20, last_committed_step=16)
    assert reports.fallback_fields(last, [promoted], uri="s3://b/ck", now="t") == (16, {})
    for tier in ("durable", "memory+promoted", None):
        kept = LastCheckpoint(step=16, tier=tier)
        assert reports.fallback_fields(kept, [older], uri="u", now="t") == (16, {})


def test_commit_tier_prefers_the_promotion_and_ignores_unknown_words() -> None:
    assert reports.commit_tier([_report(tier="durable")], 16) == "durable"
    assert (
        reports.commit_tier([_report(tier="memory"), _report(tier="memory+promoted")], 16)
        == "memory+promoted"
    )
    assert reports.commit_tier([_report(tier="memory")], 15) is None  # another step
    assert reports.commit_tier([_report(tier="tape")], 16) is None
    assert reports.commit_tier([_report(), None], 16) is None


def test_last_checkpoint_keeps_its_tier() -> None:
    cp = LastCheckpoint(step=16, uri="s3://b/ck", trigger="notice", tier="memory+promoted")
    assert cp.to_status()["tier"] == "memory+promoted"
    assert LastCheckpoint.from_status(cp.to_status()) == cp
    assert "tier" not in LastCheckpoint(step=3).to_status()


def _samples(m: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _key(tier: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return ("baton_checkpoints_total", (("job", "a"), ("namespace", "ns"), ("tier", tier)))


def test_checkpoints_are_counted_per_tier_with_a_bounded_label() -> None:
    m = Metrics()
    m.job_running("ns", "a", failures_left=3, last_checkpoint=0.0)
    assert all(_samples(m)[_key(t)] == 0 for t in Tier)  # seeded at 0
    m.checkpoint_committed("ns", "a", "durable")
    m.checkpoint_committed("ns", "a", None)  # an SDK before tiers: durable
    m.checkpoint_committed("ns", "a", "memory+promoted")
    m.checkpoint_committed("ns", "a", "tape")  # never a new series
    s = _samples(m)
    assert s[_key("durable")] == 2
    assert s[_key("memory+promoted")] == 1
    assert s[_key("memory")] == 0
    assert not any(dict(labels).get("tier") == "tape" for _, labels in s)
    m.job_deleted("ns", "a")
    assert not any(name == "baton_checkpoints_total" for name, _ in _samples(m))
