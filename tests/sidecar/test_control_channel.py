"""The control channel's file format and its guarantees, between real processes."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest

from trainer_sdk.control import (
    ControlChannel,
    ControlFormatError,
    Liveness,
    Request,
    State,
    Status,
    format_rfc3339,
    parse_rfc3339,
    trainer_liveness,
    utcnow,
)


def test_importing_the_channel_and_the_sidecar_does_not_import_torch() -> None:
    code = (
        "import sys, trainer_sdk.control, baton_sidecar, baton_sidecar.__main__;"
        "import baton_sidecar._server, baton_sidecar._clouds;"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2026-01-02T03:04:05Z", datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)),
        ("2026-01-02t03:04:05z", datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)),
        ("2026-01-02T04:04:05+01:00", datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)),
        ("2026-01-02T03:04:05.123456789Z", datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=UTC)),
    ],
)
def test_rfc3339_parses_to_utc(text: str, expected: datetime) -> None:
    assert parse_rfc3339(text) == expected
    assert parse_rfc3339(text).tzinfo == UTC


@pytest.mark.parametrize(
    "text", ["2026-01-02", "2026-01-02T03:04:05", "tomorrow", "2026-13-02T03:04:05Z", ""]
)
def test_rfc3339_rejects_what_is_not(text: str) -> None:
    with pytest.raises(ControlFormatError):
        parse_rfc3339(text)


def test_format_rfc3339_is_utc_z_milliseconds() -> None:
    when = datetime(2026, 1, 2, 4, 4, 5, 678900, tzinfo=timezone(timedelta(hours=1)))
    assert format_rfc3339(when) == "2026-01-02T03:04:05.678Z"
    with pytest.raises(ControlFormatError, match="no time zone"):
        format_rfc3339(datetime(2026, 1, 2))  # naive on purpose


def test_merge_keeps_the_earliest_deadline_and_the_id(tmp_path: Path) -> None:
    ch = ControlChannel(tmp_path)
    now = utcnow()
    first, merged = ch.merge_request(deadline=now + timedelta(seconds=90), reason="a")
    assert not merged
    second, merged = ch.merge_request(
        deadline=now + timedelta(seconds=30), reason="b", source="aws"
    )
    assert merged
    assert second.id == first.id
    assert (second.reason, second.source) == ("b", "aws")
    third, merged = ch.merge_request(deadline=None, reason="c")
    assert merged
    assert third == second, "no deadline never beats a deadline"
    assert ch.read_request() == second
    # A request without a deadline takes one from a later merge.
    ch.clear_request(first.id)
    fourth, _ = ch.merge_request(deadline=None)
    fifth, merged = ch.merge_request(deadline=now + timedelta(seconds=60))
    assert merged
    assert fifth.id == fourth.id
    assert fifth.deadline is not None


def test_clear_removes_only_the_named_request(tmp_path: Path) -> None:
    ch = ControlChannel(tmp_path)
    req, _ = ch.merge_request(deadline=None)
    assert not ch.clear_request("someone-else")
    assert ch.read_request() == req
    assert ch.clear_request(req.id)
    assert ch.read_request() is None
    assert not ch.clear_request(req.id)


def test_status_round_trips_and_reads_tolerantly(tmp_path: Path) -> None:
    ch = ControlChannel(tmp_path)
    assert ch.read_status() is None
    status = Status(
        state=State("saving"),
        request_id="r",
        step=3,
        deadline=datetime(2030, 1, 1, tzinfo=UTC),
        phases={"write": 1},
        bytes=5,
        updated=datetime(2029, 1, 1, tzinfo=UTC),
        heartbeat=datetime(2029, 1, 1, 0, 0, 1, tzinfo=UTC),
    )
    ch.write_status(status)
    assert ch.read_status() == status
    assert ch.read_status().state is State.SAVING  # type: ignore[union-attr]
    # A newer writer's extra fields are ignored; absent optional fields take defaults.
    ch.status_path.write_text(
        json.dumps({"state": "committed", "step": 9, "future_field": [1], "seconds": 2})
    )
    read = ch.read_status()
    assert read is not None
    assert (read.state, read.step, read.seconds, read.phases) == (State.COMMITTED, 9, 2.0, {})


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("{half", "not valid JSON"),
        ('{"state": "exploding"}', "unknown"),
        ('{"state": "idle", "step": "12"}', "'step' must be int"),
        ('{"state": "idle", "step": true}', "'step' must be int"),
        ('{"state": "idle", "phases": {"write": "fast"}}', "phases"),
        ('{"state": "idle", "heartbeat": "yesterday"}', "RFC 3339"),
        ("[]", "JSON object"),
    ],
)
def test_bad_status_file_names_the_problem(tmp_path: Path, content: str, needle: str) -> None:
    ch = ControlChannel(tmp_path)
    ch.status_path.write_text(content)
    with pytest.raises(ControlFormatError, match=needle):
        ch.read_status()


def test_a_corrupt_request_is_replaced_not_wedged(tmp_path: Path) -> None:
    ch = ControlChannel(tmp_path)
    ch.request_path.write_text("{garbage")
    with pytest.raises(ControlFormatError):
        ch.read_request()
    req, merged = ch.merge_request(deadline=None, reason="after garbage")
    assert not merged
    assert ch.read_request() == req


def test_files_are_readable_by_the_other_container(tmp_path: Path) -> None:
    ch = ControlChannel(tmp_path)
    ch.merge_request(deadline=None)
    ch.write_status(Status())
    assert ch.request_path.stat().st_mode & 0o777 == 0o644
    assert ch.status_path.stat().st_mode & 0o777 == 0o644
    assert ch.lock_path.stat().st_mode & 0o777 == 0o666
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_liveness_from_heartbeat_age() -> None:
    now = utcnow()
    assert trainer_liveness(None) is Liveness.ABSENT
    beat = Status(heartbeat=now - timedelta(seconds=5))
    assert trainer_liveness(beat, now=now, silent_after=10, absent_after=20) is Liveness.ALIVE
    assert trainer_liveness(beat, now=now, silent_after=5, absent_after=20) is Liveness.SILENT
    assert trainer_liveness(beat, now=now, silent_after=1, absent_after=5) is Liveness.ABSENT


def test_request_rejects_naive_times() -> None:
    with pytest.raises(ControlFormatError, match="time zone"):
        Request(deadline=datetime(2030, 1, 1))  # naive on purpose


# ---- between processes -------------------------------------------------------------------------

_MERGER = """
import sys
from datetime import timedelta
from trainer_sdk.control import ControlChannel, utcnow
ch = ControlChannel(sys.argv[1])
for i in range(int(sys.argv[2])):
    ch.merge_request(deadline=utcnow() + timedelta(seconds=60 + i % 7), source="aws")
"""

_READER = """
import sys
from trainer_sdk.control import ControlChannel, ControlFormatError
ch = ControlChannel(sys.argv[1])
for _ in range(int(sys.argv[2])):
    try:
        ch.read_request()
        ch.read_status()
    except ControlFormatError as e:
        sys.exit(f"torn read: {e}")
"""


def test_concurrent_writers_never_tear_a_file_or_serve_a_request_twice(tmp_path: Path) -> None:
    ch = ControlChannel(tmp_path)
    ch.write_status(Status())
    merger = subprocess.Popen([sys.executable, "-c", _MERGER, str(tmp_path), "300"])
    reader = subprocess.Popen(
        [sys.executable, "-c", _READER, str(tmp_path), "3000"], stderr=subprocess.PIPE
    )
    # Serve requests while they arrive, as the SDK does, and rewrite the status meanwhile.
    ids: list[str] = []
    while merger.poll() is None or ch.read_request() is not None:
        req = ch.read_request()
        if req is not None and ch.clear_request(req.id):
            ids.append(req.id)
            ch.write_status(Status(state=State.COMMITTED, request_id=req.id))
    assert merger.wait(60) == 0
    _, err = reader.communicate(timeout=60)
    assert reader.returncode == 0, err.decode()
    assert ids, "no request was served"
    assert len(ids) == len(set(ids)), "a request was served twice"
