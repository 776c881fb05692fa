"""The sidecar's HTTP API over real HTTP against the real ``baton-sidecar`` process."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import requests
from baton_sidecar._core import FINAL_REPORT_KEYS
from baton_testing.ports import free_port
from baton_testing.sidecar_process import SIDECAR_BIN, TOKEN, SidecarProcess, wait_for

from trainer_sdk.control import (
    ControlChannel,
    Request,
    State,
    Status,
    format_rfc3339,
    parse_rfc3339,
    utcnow,
)


def _in(seconds: float) -> str:
    return format_rfc3339(utcnow() + timedelta(seconds=seconds))


def test_healthz_and_metrics_need_no_token(sidecar: SidecarProcess) -> None:
    r = requests.get(f"{sidecar.url}/healthz", timeout=5)
    assert r.status_code == 200
    assert r.json() == {"ok": True}
    r = requests.get(f"{sidecar.url}/metrics", timeout=5)
    assert r.status_code == 200
    assert r.headers["Content-Type"].startswith("text/plain")
    assert "baton_notices_total" in r.text


@pytest.mark.parametrize(
    "authorization",
    [
        None,
        "Bearer wrong-token",
        f"Bearer {TOKEN}x",
        f"Basic {TOKEN}",
        "Bearer ",
        TOKEN,
    ],
    ids=["none", "wrong", "prefix-of-longer", "basic-scheme", "empty", "no-scheme"],
)
def test_api_refuses_missing_or_wrong_token(
    shared_sidecar: SidecarProcess, authorization: str | None
) -> None:
    sidecar = shared_sidecar
    headers = {} if authorization is None else {"Authorization": authorization}
    for r in (
        requests.get(f"{sidecar.url}/v1/status", headers=headers, timeout=5),
        requests.post(
            f"{sidecar.url}/v1/checkpoint",
            json={"deadline": _in(60), "reason": "x"},
            headers=headers,
            timeout=5,
        ),
    ):
        assert r.status_code == 401, r.text
        assert r.headers["WWW-Authenticate"].startswith("Bearer")
        assert "Authorization: Bearer" in r.json()["error"]
    assert not ControlChannel(sidecar.control_dir).request_path.exists()


def test_valid_request_lands_in_control_dir_and_merges(sidecar: SidecarProcess) -> None:
    channel = ControlChannel(sidecar.control_dir)
    later, earlier, latest = _in(120), _in(30), _in(600)

    r1 = sidecar.post_checkpoint({"deadline": later, "reason": "node tainted"})
    assert r1.status_code == 202, r1.text
    first = r1.json()
    assert first["merged"] is False
    pending = channel.read_request()
    assert pending is not None
    assert pending.id == first["id"]
    assert pending.deadline == parse_rfc3339(later)
    assert pending.source == "operator"
    assert pending.reason == "node tainted"

    # An earlier deadline wins; the id stays, so the SDK saves once.
    r2 = sidecar.post_checkpoint({"deadline": earlier, "reason": "spot notice"})
    assert r2.status_code == 202, r2.text
    assert r2.json()["id"] == first["id"]
    assert r2.json()["merged"] is True
    pending = channel.read_request()
    assert pending is not None
    assert pending.id == first["id"]
    assert pending.deadline == parse_rfc3339(earlier)
    assert pending.reason == "spot notice"

    # A later one changes nothing.
    r3 = sidecar.post_checkpoint({"deadline": latest})
    assert r3.status_code == 202
    assert r3.json() == {"id": first["id"], "merged": True, "deadline": earlier}
    pending = channel.read_request()
    assert pending is not None
    assert pending.deadline == parse_rfc3339(earlier)

    # Only one request file; no temp files left behind.
    assert sorted(p.name for p in sidecar.control_dir.iterdir() if p.name != ".lock") == [
        "request.json"
    ]
    metrics = sidecar.metrics()
    assert 'baton_notices_total{source="operator"} 3.0' in metrics


def test_request_after_sdk_took_the_previous_one_is_new(sidecar: SidecarProcess) -> None:
    channel = ControlChannel(sidecar.control_dir)
    first = sidecar.post_checkpoint({"deadline": _in(60)}).json()["id"]
    assert channel.clear_request(first)
    # The SDK finished that save; a new notice is a new request.
    channel.write_status(Status(state=State.COMMITTED, request_id=first, step=7))
    second = sidecar.post_checkpoint({"deadline": _in(60)}).json()
    assert second["merged"] is False
    assert second["id"] != first


def test_request_during_a_running_save_joins_it(sidecar: SidecarProcess) -> None:
    channel = ControlChannel(sidecar.control_dir)
    deadline = utcnow() + timedelta(seconds=40)
    channel.write_status(
        Status(state=State.SAVING, request_id="abc123", step=10, deadline=deadline)
    )
    r = sidecar.post_checkpoint({"deadline": _in(90), "reason": "operator retry"})
    assert r.status_code == 202
    assert r.json()["id"] == "abc123"
    assert r.json()["merged"] is True
    assert not channel.request_path.exists(), "a second save was queued for one notice"

    # A save whose trainer stopped beating is not joined: a fresh request is filed.
    channel.write_status(
        Status(
            state=State.SAVING,
            request_id="abc123",
            step=10,
            heartbeat=utcnow() - timedelta(hours=1),
        )
    )
    r = sidecar.post_checkpoint({"deadline": _in(90)})
    assert r.json()["merged"] is False
    assert r.json()["id"] != "abc123"
    assert channel.request_path.exists()


BAD_BODIES: list[tuple[str, bytes, int, str]] = [
    ("not-json", b"{deadline: soon", 400, "not valid JSON"),
    ("empty", b"", 400, "not valid JSON"),
    ("array", b"[1, 2]", 400, "JSON object"),
    ("string", b'"checkpoint please"', 400, "JSON object"),
    ("unknown-field", b'{"deadline": "%s", "priority": 1}', 400, "'priority'"),
    ("missing-deadline", b'{"reason": "x"}', 400, "'deadline' is missing"),
    ("null-deadline", b'{"deadline": null}', 400, "RFC 3339 string"),
    ("number-deadline", b'{"deadline": 1700000000}', 400, "RFC 3339 string"),
    ("garbage-deadline", b'{"deadline": "tomorrow"}', 400, "not an RFC 3339"),
    ("naive-deadline", b'{"deadline": "2030-01-02T03:04:05"}', 400, "time zone is required"),
    ("date-only", b'{"deadline": "2030-01-02"}', 400, "not an RFC 3339"),
    ("past-deadline", b'{"deadline": "2020-01-02T03:04:05Z"}', 422, "in the past"),
    ("far-deadline", b'{"deadline": "2999-01-02T03:04:05Z"}', 422, "check the units"),
    ("reason-number", b'{"deadline": "%s", "reason": 5}', 400, "'reason' must be a string"),
    ("reason-huge", b'{"deadline": "%s", "reason": "%s"}', 400, "keep it under"),
    ("invalid-utf8", b'{"deadline": "\xff\xfe"}', 400, "not valid JSON"),
]


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [(b, s, n) for _, b, s, n in BAD_BODIES],
    ids=[i for i, *_ in BAD_BODIES],
)
def test_malformed_requests_get_a_4xx_that_says_what_is_wrong(
    shared_sidecar: SidecarProcess, body: bytes, status: int, needle: str
) -> None:
    sidecar = shared_sidecar
    if b"%s" in body:
        fill = [_in(60).encode(), b"r" * 2000][: body.count(b"%s")]
        body = body % tuple(fill)
    r = sidecar.post_checkpoint(data=body)
    assert r.status_code == status, r.text
    assert r.headers["Content-Type"].startswith("application/json")
    assert needle in r.json()["error"]
    assert not ControlChannel(sidecar.control_dir).request_path.exists()


def test_oversized_body_is_413(shared_sidecar: SidecarProcess) -> None:
    sidecar = shared_sidecar
    body = b'{"deadline": "%s", "reason": "%s"}' % (_in(60).encode(), b"x" * 64 * 1024)
    r = sidecar.post_checkpoint(data=body)
    assert r.status_code == 413, r.text
    assert "too large" in r.json()["error"]
    assert not ControlChannel(sidecar.control_dir).request_path.exists()


def test_wrong_content_type_and_method_and_path(shared_sidecar: SidecarProcess) -> None:
    sidecar = shared_sidecar
    r = sidecar.post_checkpoint(data=b"deadline=soon", content_type="text/plain")
    assert r.status_code == 415
    assert "application/json" in r.json()["error"]
    r = requests.get(f"{sidecar.url}/v1/checkpoint", headers=sidecar.headers(), timeout=5)
    assert r.status_code == 405
    assert "POST" in r.json()["error"]
    r = requests.get(f"{sidecar.url}/v2/nothing", headers=sidecar.headers(), timeout=5)
    assert r.status_code == 404
    assert "/v1/checkpoint" in r.json()["error"]


def test_status_reports_the_sdk_status_and_trainer_liveness(
    sidecar_factory: Callable[..., SidecarProcess],
) -> None:
    sc = sidecar_factory(args=["--silent-after", "5", "--absent-after", "20"])
    channel = ControlChannel(sc.control_dir)

    body = sc.status().json()
    assert body["state"] == "idle"
    assert body["trainer"] == "absent"
    assert body["pending_request"] is None

    now = utcnow()
    written = Status(
        state=State.COMMITTED,
        request_id="r1",
        step=1200,
        uri="file:///ckpt/step-000000001200",
        seconds=3.25,
        trigger="notice",
        deadline=now + timedelta(seconds=30),
        phases={"plan": 0.5, "write": 2.0, "commit": 0.75},
        bytes=123456,
        last_committed_step=1200,
        updated=now,
        heartbeat=now,
    )
    channel.write_status(written)
    body = sc.status().json()
    expected = written.to_json()
    for key, value in expected.items():
        assert body[key] == value, key
    assert body["trainer"] == "alive"

    channel.write_status(written.beat(now - timedelta(seconds=8)))
    assert sc.status().json()["trainer"] == "silent"
    channel.write_status(written.beat(now - timedelta(seconds=25)))
    body = sc.status().json()
    assert body["trainer"] == "absent"
    assert body["state"] == "committed", "the status is reported as the SDK wrote it"

    r = sc.post_checkpoint({"deadline": _in(60), "reason": "x"})
    pending = sc.status().json()["pending_request"]
    assert pending["id"] == r.json()["id"]


def test_corrupt_status_file_is_a_clear_500(sidecar: SidecarProcess) -> None:
    sidecar.control_dir.mkdir(parents=True, exist_ok=True)
    (sidecar.control_dir / "status.json").write_text("{not json")
    r = sidecar.status()
    assert r.status_code == 500
    assert "status.json" in r.json()["error"]
    assert "delete it" in r.json()["error"]
    assert sidecar.alive()


def test_rotated_token_takes_effect_without_restart(sidecar: SidecarProcess) -> None:
    assert sidecar.status().status_code == 200
    # Kubernetes swaps a Secret volume's files atomically (a symlink flip); a rename is the same
    # for a reader.
    new = sidecar.token_file.with_name("token.new")
    new.write_text("rotated-token-value\n")
    os.replace(new, sidecar.token_file)
    assert sidecar.status().status_code == 401
    assert sidecar.status(token="rotated-token-value").status_code == 200
    # An emptied file does not lock everyone out: the last good token stays.
    sidecar.token_file.write_text("")
    assert sidecar.status(token="rotated-token-value").status_code == 200
    assert "rotated-token-value" not in sidecar.log()


def test_binds_to_pod_ip(sidecar_factory: Callable[..., SidecarProcess]) -> None:
    sc = sidecar_factory(host="127.0.0.2")
    assert sc.status().status_code == 200
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://127.0.0.1:{sc.port}/healthz", timeout=2)


def test_pod_ip_environment_is_the_default_host(tmp_path: Path) -> None:
    proc = SidecarProcess(tmp_path)
    proc.args = []  # no --host: POD_IP decides
    proc.env["POD_IP"] = "127.0.0.3"
    proc.host = "127.0.0.3"
    proc.start()
    try:
        assert proc.status().status_code == 200
    finally:
        assert proc.stop() == 0


@pytest.mark.parametrize("content", [None, ""], ids=["missing", "empty"])
def test_unusable_token_file_stops_startup_with_the_fix(
    tmp_path: Path, content: str | None
) -> None:
    token = tmp_path / "token"
    if content is not None:
        token.write_text(content)
    result = subprocess.run(
        [
            str(SIDECAR_BIN),
            "--host",
            "127.0.0.1",
            "--port",
            str(free_port()),
            "--token-file",
            str(token),
            "--control-dir",
            str(tmp_path / "c"),
            "--cloud",
            "none",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert str(token) in result.stderr
    assert "Secret" in result.stderr


def test_bad_flag_value_names_the_fix(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            str(SIDECAR_BIN),
            "--cloud",
            "none",
            "--control-dir",
            str(tmp_path),
            "--silent-after",
            "10",
            "--absent-after",
            "5",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2
    assert "absent_after must be at least silent_after" in result.stderr


def test_request_written_by_anything_else_is_reported(sidecar: SidecarProcess) -> None:
    # The control channel is the contract, not the sidecar: a tool may write a request itself.
    channel = ControlChannel(sidecar.control_dir)
    channel.write_request(Request(deadline=utcnow() + timedelta(seconds=50), source="kubectl"))
    pending = wait_for(lambda: sidecar.status().json()["pending_request"], what="pending request")
    assert pending["source"] == "kubectl"


def test_unusable_control_dir_stops_startup_with_the_fix(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the control directory should be")
    token = tmp_path / "token"
    token.write_text("t")
    result = subprocess.run(
        [
            str(SIDECAR_BIN),
            "--host",
            "127.0.0.1",
            "--port",
            str(free_port()),
            "--token-file",
            str(token),
            "--control-dir",
            str(blocker / "control"),
            "--cloud",
            "none",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert "cannot create the control directory" in result.stderr
    assert "emptyDir" in result.stderr


def test_control_dir_lost_while_running_is_a_503_not_a_crash(sidecar: SidecarProcess) -> None:
    # The volume vanishes (or turns into something else) under a running sidecar.
    sidecar.control_dir.rename(sidecar.control_dir.with_name("moved"))
    sidecar.control_dir.write_text("not a directory")
    r = sidecar.post_checkpoint({"deadline": _in(60)})
    assert r.status_code == 503, r.text
    assert "control directory" in r.json()["error"]
    assert sidecar.alive()
    assert requests.get(f"{sidecar.url}/healthz", timeout=5).status_code == 200


def test_secret_volume_style_rotation_through_symlinks(tmp_path: Path) -> None:
    # A Secret volume: token -> ..data/token, ..data -> ..<timestamp>; an update writes a new
    # timestamped directory and flips ..data atomically.
    vol = tmp_path / "secret"
    (vol / "..v1").mkdir(parents=True)
    (vol / "..v1" / "token").write_text(TOKEN)
    (vol / "..data").symlink_to("..v1")
    (vol / "token").symlink_to("..data/token")
    proc = SidecarProcess(tmp_path / "run")
    proc.env["BATON_SIDECAR_TOKEN_FILE"] = str(vol / "token")
    proc.start()
    try:
        assert proc.status().status_code == 200
        (vol / "..v2").mkdir()
        (vol / "..v2" / "token").write_text("second-token")
        (vol / "..data_tmp").symlink_to("..v2")
        os.replace(vol / "..data_tmp", vol / "..data")
        assert proc.status().status_code == 401
        assert proc.status(token="second-token").status_code == 200
    finally:
        assert proc.stop() == 0


def _committed(request_id: str) -> Status:
    now = utcnow()
    return Status(
        state=State.COMMITTED,
        request_id=request_id,
        step=40,
        uri="file:///ckpt/step-000000000040",
        seconds=1.5,
        trigger="notice",
        last_committed_step=40,
        updated=now,
        heartbeat=now,
    )


def _exited_within(sc: SidecarProcess, seconds: float) -> int:
    assert sc.proc is not None
    return sc.proc.wait(seconds)


def _sigterm(sc: SidecarProcess) -> None:
    """What the kubelet does once the trainer container has exited."""
    assert sc.proc is not None
    sc.proc.send_signal(signal.SIGTERM)


def _still_running_after(sc: SidecarProcess, seconds: float) -> None:
    assert sc.proc is not None
    with pytest.raises(subprocess.TimeoutExpired):
        sc.proc.wait(seconds)


def test_after_sigterm_an_unread_outcome_is_still_served_then_it_exits(
    sidecar_factory: Callable[..., SidecarProcess],
) -> None:
    # The trainer committed its notice save and exited; the kubelet stops the sidecar at once.
    sc = sidecar_factory(env={"BATON_SIDECAR_LINGER": "30"})
    ControlChannel(sc.control_dir).write_status(_committed("r-notice"))
    _sigterm(sc)
    _still_running_after(sc, 1.0)  # still there for the operator
    body = sc.status().json()  # the operator's poll
    assert (body["state"], body["request_id"], body["step"]) == ("committed", "r-notice", 40)
    assert _exited_within(sc, 5.0) == 0  # read: no reason to stay
    assert "stopping after the checkpoint outcome is read" in sc.log()


def test_after_sigterm_it_exits_at_once_when_nothing_is_unread(
    sidecar_factory: Callable[..., SidecarProcess],
) -> None:
    sc = sidecar_factory(env={"BATON_SIDECAR_LINGER": "30"})
    channel = ControlChannel(sc.control_dir)
    channel.write_status(_committed("r-old"))
    sc.status()  # the operator already read this outcome
    _sigterm(sc)
    assert _exited_within(sc, 5.0) == 0


def test_the_linger_is_bounded_and_a_second_sigterm_ends_it(
    sidecar_factory: Callable[..., SidecarProcess],
) -> None:
    bounded = sidecar_factory(env={"BATON_SIDECAR_LINGER": "1"})
    ControlChannel(bounded.control_dir).write_status(_committed("r-unread"))
    _sigterm(bounded)
    assert _exited_within(bounded, 6.0) == 0  # nobody read it: gone after ~1 s anyway
    # The log says what it waited for, and that nobody came.
    assert "the outcome of request r-unread (committed) not read yet" in bounded.log()
    assert "the linger is over" in bounded.log()

    impatient = sidecar_factory(env={"BATON_SIDECAR_LINGER": "60"})
    rid = impatient.post_checkpoint({"deadline": _in(60), "reason": "x"}).json()["id"]
    _sigterm(impatient)  # pending, never taken
    _still_running_after(impatient, 1.0)
    _sigterm(impatient)
    assert _exited_within(impatient, 5.0) == 0
    assert f"request {rid} not taken by the trainer yet (a second signal)" in impatient.log()


def test_a_request_the_operator_settled_is_not_waited_for(
    sidecar_factory: Callable[..., SidecarProcess],
) -> None:
    # The operator decided from another rank's committed: this rank's outcome will never be
    # read, so the pod goes as soon as its trainer has, not after the whole linger.
    sc = sidecar_factory(env={"BATON_SIDECAR_LINGER": "60"})
    ControlChannel(sc.control_dir).write_status(_committed("r-decided"))
    answer = sc.settle("r-decided")
    assert (answer.status_code, answer.json()) == (200, {"id": "r-decided", "settled": True})
    _sigterm(sc)
    assert _exited_within(sc, 5.0) == 0
    assert "stopping after the checkpoint outcome is read" not in sc.log()

    # A request still pending when it is settled (the trainer never took it) is not waited
    # for either; one settled id does not cover another.
    pending = sidecar_factory(env={"BATON_SIDECAR_LINGER": "60"})
    rid = pending.post_checkpoint({"deadline": _in(60), "reason": "x"}).json()["id"]
    assert pending.settle("some-other-request").status_code == 200
    _sigterm(pending)
    _still_running_after(pending, 1.0)
    assert pending.settle(rid).status_code == 200
    assert _exited_within(pending, 5.0) == 0


def test_settling_needs_the_token_and_a_request_id(
    sidecar_factory: Callable[..., SidecarProcess],
) -> None:
    sc = sidecar_factory()
    assert sc.settle("r-1", token=None).status_code == 401
    assert sc.settle("r-1", token="wrong").status_code == 401
    bad = sc.settle("a.b")
    assert bad.status_code == 400
    assert "is not a request id" in bad.json()["error"]


def test_on_exit_the_outcome_goes_into_the_termination_message(
    sidecar_factory: Callable[..., SidecarProcess], tmp_path: Path
) -> None:
    # A save served for SIGTERM (no request id: nothing lingers for it) and an operator that
    # never polled: the pod's status keeps the outcome in the sidecar's termination message.
    log = tmp_path / "termination-log"
    sc = sidecar_factory(env={"BATON_TERMINATION_LOG": str(log)})
    signalled = dataclasses.replace(_committed(""), request_id=None, trigger="signal")
    ControlChannel(sc.control_dir).write_status(signalled)
    _sigterm(sc)
    assert _exited_within(sc, 5.0) == 0
    report = json.loads(log.read_text())
    assert len(log.read_bytes()) <= 4096
    assert (report["state"], report["step"], report["trigger"]) == ("committed", 40, "signal")
    assert (report["last_committed_step"], report["request_id"]) == (40, None)
    assert report["heartbeat"] is not None
    assert sorted(report) == sorted(FINAL_REPORT_KEYS), "the SDK's fields only"


def test_an_unwritable_termination_log_is_logged_and_the_exit_is_clean(
    sidecar_factory: Callable[..., SidecarProcess], tmp_path: Path
) -> None:
    log = tmp_path / "missing-dir" / "termination-log"
    sc = sidecar_factory(env={"BATON_TERMINATION_LOG": str(log)})
    _sigterm(sc)
    assert _exited_within(sc, 5.0) == 0
    assert "cannot write the final report" in sc.log()
