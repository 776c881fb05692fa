"""``/metrics`` parses with prometheus_client's parser and follows the SDK's status transitions."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

from baton_testing.sidecar_process import SidecarProcess, wait_for
from prometheus_client.parser import text_string_to_metric_families

from trainer_sdk.control import ControlChannel, State, Status, utcnow

CONTRACT = {
    "baton_checkpoint_seconds": "histogram",
    "baton_checkpoint_phase_seconds": "histogram",
    "baton_checkpoint_bytes": "counter",
    "baton_checkpoint_last_committed_step": "gauge",
    "baton_checkpoint_deadline_margin_seconds": "histogram",
    "baton_notices": "counter",
    "baton_checkpoint_requests": "counter",
}


def _samples(sc: SidecarProcess) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for family in text_string_to_metric_families(sc.metrics()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = float(s.value)
    return out


def _value(sc: SidecarProcess, name: str, **labels: str) -> float:
    return _samples(sc).get((name, frozenset(labels.items())), float("nan"))


def test_metrics_follow_a_committed_save(sidecar: SidecarProcess) -> None:
    families = {f.name: f.type for f in text_string_to_metric_families(sidecar.metrics())}
    for name, kind in CONTRACT.items():
        assert families.get(name) == kind, f"{name} missing or not a {kind}: {families}"

    channel = ControlChannel(sidecar.control_dir)
    r = sidecar.post_checkpoint(
        {"deadline": (utcnow() + timedelta(seconds=60)).isoformat(), "reason": "test"}
    )
    assert r.status_code == 202
    request = channel.read_request()
    assert request is not None
    assert request.deadline is not None
    channel.write_status(Status(state=State.SAVING, request_id=request.id, step=42))
    channel.clear_request(request.id)
    committed_at = utcnow()
    channel.write_status(
        Status(
            state=State.COMMITTED,
            request_id=request.id,
            step=42,
            seconds=2.5,
            trigger="notice",
            deadline=request.deadline,
            phases={"drain": 0.25, "write": 1.5, "hash": 0.5, "commit": 0.25, "bogus": 9.0},
            bytes=1_000_000,
            last_committed_step=42,
            updated=committed_at,
        )
    )
    wait_for(
        lambda: _value(sidecar, "baton_checkpoint_requests_total", result="committed") == 1.0,
        what="the commit counted",
    )
    s = _samples(sidecar)

    def v(name: str, **labels: str) -> float:
        return s[(name, frozenset(labels.items()))]

    assert v("baton_checkpoint_seconds_count", trigger="notice") == 1.0
    assert v("baton_checkpoint_seconds_sum", trigger="notice") == 2.5
    phases = {"drain": 0.25, "write": 1.5, "hash": 0.5, "commit": 0.25}
    for phase, seconds in phases.items():
        assert v("baton_checkpoint_phase_seconds_count", phase=phase) == 1.0
        assert v("baton_checkpoint_phase_seconds_sum", phase=phase) == seconds
    assert v("baton_checkpoint_bytes_total") == 1_000_000
    assert v("baton_checkpoint_last_committed_step") == 42
    margin = (request.deadline - committed_at).total_seconds()
    assert v("baton_checkpoint_deadline_margin_seconds_count") == 1.0
    # The buckets go below zero (late commits), so Prometheus exposes no _sum; the buckets say
    # where the margin fell.
    assert 50 < margin <= 60
    assert v("baton_checkpoint_deadline_margin_seconds_bucket", le="30.0") == 0.0
    assert v("baton_checkpoint_deadline_margin_seconds_bucket", le="60.0") == 1.0
    assert v("baton_notices_total", source="operator") == 1.0
    # Bounded labels: an unknown phase is dropped, never a new series.
    assert not any(dict(labels).get("phase") == "bogus" for _, labels in s)

    # A heartbeat refresh of the same status is not a second save.
    channel.write_status(channel.read_status().beat())  # type: ignore[union-attr]
    channel.write_status(
        Status(state=State.FAILED, request_id="r2", step=50, error="disk full", trigger="weird")
    )
    wait_for(
        lambda: _value(sidecar, "baton_checkpoint_requests_total", result="failed") == 1.0,
        what="the failure counted",
    )
    s = _samples(sidecar)
    assert v("baton_checkpoint_requests_total", result="committed") == 1.0
    assert v("baton_checkpoint_seconds_count", trigger="notice") == 1.0

    channel.write_status(
        Status(state=State.COMMITTED, step=60, seconds=1.0, trigger="weird", last_committed_step=60)
    )
    wait_for(
        lambda: _value(sidecar, "baton_checkpoint_last_committed_step") == 60.0,
        what="the second commit",
    )
    # An unknown trigger is folded into "other".
    assert _value(sidecar, "baton_checkpoint_seconds_count", trigger="other") == 1.0
    assert not any(dict(labels).get("trigger") == "weird" for _, labels in _samples(sidecar))


def test_a_commit_without_a_request_moves_only_the_step_gauge(sidecar: SidecarProcess) -> None:
    channel = ControlChannel(sidecar.control_dir)
    channel.write_status(Status(state=State.IDLE, last_committed_step=None))
    wait_for(lambda: sidecar.status().json()["trainer"] == "alive", what="status seen")
    # A periodic save (or a restore) reports only the newest committed step.
    channel.write_status(Status(state=State.IDLE, last_committed_step=10))
    wait_for(
        lambda: _value(sidecar, "baton_checkpoint_last_committed_step") == 10.0,
        what="the new step",
    )
    assert _value(sidecar, "baton_checkpoint_requests_total", result="committed") == 0.0


def test_a_periodic_save_is_timed_but_answers_no_request(sidecar: SidecarProcess) -> None:
    # What the Checkpointer writes after a routine save: committed, trigger periodic, no id.
    channel = ControlChannel(sidecar.control_dir)
    channel.write_status(Status(state=State.IDLE, last_committed_step=None))
    wait_for(lambda: sidecar.status().json()["trainer"] == "alive", what="status seen")
    channel.write_status(
        Status(
            state=State.COMMITTED,
            request_id=None,
            step=20,
            seconds=1.25,
            trigger="periodic",
            phases={"plan": 0.05, "write": 1.0, "commit": 0.2},
            bytes=4096,
            last_committed_step=20,
        )
    )
    wait_for(
        lambda: _value(sidecar, "baton_checkpoint_seconds_count", trigger="periodic") == 1.0,
        what="the periodic save's duration",
    )
    assert _value(sidecar, "baton_checkpoint_seconds_sum", trigger="periodic") == 1.25
    assert _value(sidecar, "baton_checkpoint_phase_seconds_count", phase="write") == 1.0
    assert _value(sidecar, "baton_checkpoint_bytes_total") == 4096.0
    assert _value(sidecar, "baton_checkpoint_last_committed_step") == 20.0
    assert _value(sidecar, "baton_checkpoint_requests_total", result="committed") == 0.0


def test_restarted_sidecar_does_not_count_an_old_save_again(
    sidecar_factory: Callable[..., SidecarProcess],
) -> None:
    first = sidecar_factory()
    channel = ControlChannel(first.control_dir)
    channel.write_status(
        Status(state=State.COMMITTED, step=7, seconds=1.0, last_committed_step=7, bytes=10)
    )
    wait_for(
        lambda: _value(first, "baton_checkpoint_requests_total", result="committed") == 1.0,
        what="the commit counted",
    )
    assert first.stop() == 0
    second = sidecar_factory(control_dir=first.control_dir)
    wait_for(
        lambda: _value(second, "baton_checkpoint_last_committed_step") == 7.0,
        what="the last step reported after a restart",
    )
    assert _value(second, "baton_checkpoint_requests_total", result="committed") == 0.0
    assert _value(second, "baton_checkpoint_bytes_total") == 0.0
