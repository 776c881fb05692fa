"""Cloud preemption notices, from fake metadata servers that answer as the documented ones do.

Each test runs the real ``baton-sidecar`` against a fake AWS, GCE or Azure endpoint on a local
port, makes the fake announce a preemption, and checks that a checkpoint request with the
notice's deadline appears in the control channel. The failure modes (5xx, timeouts, refused
connections, expired tokens) are produced for real by the fakes.

Here the trainer's side is played by writing ``status.json`` as the SDK does; the same path with
a real trainer is in ``test_with_trainer.py``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from baton_testing.fake_clouds import FakeAws, FakeAzure, FakeGce
from baton_testing.ports import free_port
from baton_testing.sidecar_process import SidecarProcess, wait_for
from prometheus_client.parser import text_string_to_metric_families

from trainer_sdk.control import ControlChannel, Request, State, Status, utcnow

FAST = {
    "BATON_SIDECAR_AWS_INTERVAL": "0.2",
    "BATON_SIDECAR_AZURE_INTERVAL": "0.2",
    "BATON_SIDECAR_GCE_WAIT": "5",
    "BATON_SIDECAR_METADATA_TIMEOUT": "1",
    "BATON_SIDECAR_BACKOFF_MAX": "1",
}


def _pending(sc: SidecarProcess) -> Callable[[], Request | None]:
    return lambda: ControlChannel(sc.control_dir).read_request()


def _sample(sc: SidecarProcess, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(sc.metrics()):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    raise AssertionError(f"no sample {name}{labels}")


def _commit(sc: SidecarProcess, request: Request, step: int = 100) -> None:
    """Serve ``request`` as the SDK does: take it, save, commit."""
    channel = ControlChannel(sc.control_dir)
    channel.write_status(
        Status(state=State.SAVING, request_id=request.id, step=step, deadline=request.deadline)
    )
    channel.clear_request(request.id)
    channel.write_status(
        Status(
            state=State.COMMITTED,
            request_id=request.id,
            step=step,
            seconds=1.5,
            trigger="notice",
            deadline=request.deadline,
            phases={"stage": 0.2, "write": 1.0, "commit": 0.3},
            bytes=4096,
            last_committed_step=step,
        )
    )


# ---- AWS ---------------------------------------------------------------------------------------


def test_aws_spot_notice_becomes_a_request_with_its_time(
    sidecar_factory: Callable[..., SidecarProcess],
) -> None:
    with FakeAws() as aws:
        sc = sidecar_factory(cloud="aws", env={**FAST, "BATON_AWS_IMDS_ENDPOINT": aws.url})
        wait_for(lambda: aws.count("GET", "/spot/instance-action") >= 2, what="AWS polls")
        assert _pending(sc)() is None, "no notice yet, so no request"

        when = (utcnow() + timedelta(seconds=120)).replace(microsecond=0)
        aws.set_notice(time=when)
        request = wait_for(_pending(sc), what="a request from the AWS notice")
        assert request.source == "aws"
        assert request.deadline == when
        assert "terminate" in request.reason

        # The notice stays up on IMDS; it must not turn into a second request after the save.
        _commit(sc, request)
        n = aws.count("GET", "/spot/instance-action")
        wait_for(lambda: aws.count("GET", "/spot/instance-action") >= n + 3, what="more polls")
        assert _pending(sc)() is None
        assert _sample(sc, "baton_notices_total", source="aws") == 1.0
        # One token for all of it (IMDSv2 tokens live up to 6 hours).
        assert aws.tokens_issued == 1
        token_headers = [
            r.headers.get("X-aws-ec2-metadata-token") for r in aws.requests if r.method == "GET"
        ]
        assert set(token_headers) == {"<present>"}


def test_aws_expired_token_is_refreshed(sidecar_factory: Callable[..., SidecarProcess]) -> None:
    with FakeAws() as aws:
        sc = sidecar_factory(cloud="aws", env={**FAST, "BATON_AWS_IMDS_ENDPOINT": aws.url})
        wait_for(lambda: aws.count("GET", "/spot/instance-action") >= 1, what="AWS polls")
        aws.expire_tokens()
        wait_for(lambda: aws.tokens_issued >= 2, what="a fresh token after a 401")
        assert any(r.status == 401 for r in aws.requests)
        aws.set_notice(time=utcnow() + timedelta(seconds=100))
        assert wait_for(_pending(sc), what="a request after the token refresh").source == "aws"
        # A refreshed token is routine, not an error.
        assert _sample(sc, "baton_sidecar_poll_errors_total", source="aws") == 0.0


def test_aws_failures_are_logged_retried_and_survived(
    sidecar_factory: Callable[..., SidecarProcess],
) -> None:
    port = free_port()
    # Nothing listens yet: connections are refused.
    sc = sidecar_factory(
        cloud="aws", env={**FAST, "BATON_AWS_IMDS_ENDPOINT": f"http://127.0.0.1:{port}"}
    )
    wait_for(lambda: sc.log().count("aws metadata request failed") >= 2, what="refused, logged")
    with FakeAws(port=port) as aws:
        aws.fail_next(2, status=500)  # the token PUT, then its retry
        aws.hang_next(1, seconds=5)  # longer than the 1 s request timeout
        wait_for(lambda: "timed out" in sc.log(), what="a timeout, logged")
        aws.fail_next(2, status=503)
        wait_for(lambda: "HTTP 503" in sc.log(), what="a 503, logged")
        when = (utcnow() + timedelta(seconds=90)).replace(microsecond=0)
        aws.set_notice(time=when)
        request = wait_for(_pending(sc), timeout=30, what="a request once AWS recovers")
        assert request.deadline == when
        assert sc.alive()
        assert _sample(sc, "baton_sidecar_poll_errors_total", source="aws") >= 5
        assert "HTTP 500" in sc.log()
        assert "retrying in" in sc.log()
        log = sc.log()
        # The IMDS token is never logged.
        assert not re.search(r"[A-Za-z0-9_-]{43}", log), "something token-shaped was logged"


def test_aws_malformed_notice_is_retried_and_undatable_one_saves_now(
    sidecar_factory: Callable[..., SidecarProcess],
) -> None:
    with FakeAws() as aws:
        aws.raw_notice = "<html>captive portal</html>"
        sc = sidecar_factory(cloud="aws", env={**FAST, "BATON_AWS_IMDS_ENDPOINT": aws.url})
        wait_for(lambda: "is not {action, time} JSON" in sc.log(), what="the bad body logged")
        assert _pending(sc)() is None
        aws.raw_notice = '{"action": "terminate", "time": "soon"}'
        request = wait_for(_pending(sc), what="a request from an undatable notice")
        assert request.deadline is None
        assert request.source == "aws"
        assert sc.alive()


# ---- GCE ---------------------------------------------------------------------------------------


def test_gce_preemption_becomes_a_request_30s_ahead(
    sidecar_factory: Callable[..., SidecarProcess],
) -> None:
    with FakeGce() as gce:
        sc = sidecar_factory(cloud="gce", env={**FAST, "BATON_GCE_METADATA_ENDPOINT": gce.url})
        # After the first plain read the sidecar hangs in a long poll; the change wakes it.
        wait_for(lambda: gce.count("GET", "/preempted") >= 1, what="the first preempted read")
        before = utcnow()
        gce.preempt()
        request = wait_for(_pending(sc), what="a request from the GCE preemption")
        after = utcnow()
        assert request.source == "gce"
        assert request.deadline is not None
        assert before + timedelta(seconds=29) <= request.deadline <= after + timedelta(seconds=31)
        long_polls = [r for r in gce.requests if r.query.get("wait_for_change") == "true"]
        assert long_polls, "the sidecar must long-poll, not busy-poll"
        assert all(r.headers.get("Metadata-Flavor") == "Google" for r in gce.requests)
        assert all("last_etag" in r.query and "timeout_sec" in r.query for r in long_polls)


def test_gce_terminate_maintenance_is_a_notice_migrate_is_not(
    sidecar_factory: Callable[..., SidecarProcess],
) -> None:
    with FakeGce() as gce:
        sc = sidecar_factory(cloud="gce", env={**FAST, "BATON_GCE_METADATA_ENDPOINT": gce.url})
        wait_for(lambda: gce.count("GET", "/maintenance-event") >= 1, what="maintenance read")
        gce.set_value("maintenance-event", "MIGRATE_ON_HOST_MAINTENANCE")
        wait_for(lambda: "no save needed" in sc.log(), what="the migration noticed")
        assert _pending(sc)() is None
        before = utcnow()
        gce.set_value("maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE")
        request = wait_for(_pending(sc), what="a request from host maintenance")
        assert request.deadline is not None
        assert request.deadline >= before + timedelta(seconds=59)
        assert "TERMINATE_ON_HOST_MAINTENANCE" in request.reason


def test_gce_errors_are_retried(sidecar_factory: Callable[..., SidecarProcess]) -> None:
    with FakeGce() as gce:
        gce.fail_next(4, status=503)
        sc = sidecar_factory(cloud="gce", env={**FAST, "BATON_GCE_METADATA_ENDPOINT": gce.url})
        wait_for(lambda: "HTTP 503" in sc.log(), what="503s, logged")
        wait_for(
            lambda: sum(r.status == 200 for r in gce.requests) >= 2,
            timeout=30,
            what="both keys read after the errors",
        )
        gce.preempt()
        assert wait_for(_pending(sc), what="a request after recovery").source == "gce"
        assert _sample(sc, "baton_sidecar_poll_errors_total", source="gce") >= 4
        assert sc.alive()


def test_gce_answer_without_metadata_flavor_is_not_trusted(
    sidecar_factory: Callable[..., SidecarProcess],
) -> None:
    with FakeGce() as gce:
        gce.impostor = True
        gce.values["preempted"] = "TRUE"
        sc = sidecar_factory(cloud="gce", env={**FAST, "BATON_GCE_METADATA_ENDPOINT": gce.url})
        wait_for(lambda: "not the GCE metadata server" in sc.log(), what="the impostor refused")
        assert _pending(sc)() is None, "an answer from an impostor must not cause a save"
        gce.impostor = False
        assert wait_for(_pending(sc), timeout=30, what="a request from the real server").source == (
            "gce"
        )


# ---- Azure -------------------------------------------------------------------------------------


def test_azure_preempt_is_requested_then_acknowledged_after_the_commit(
    sidecar_factory: Callable[..., SidecarProcess],
) -> None:
    with FakeAzure(vm_name="vm-7") as azure:
        sc = sidecar_factory(cloud="azure", env={**FAST, "BATON_AZURE_IMDS_ENDPOINT": azure.url})
        wait_for(lambda: azure.count("GET", "/scheduledevents") >= 1, what="Azure polls")
        # An event for another VM of the scale set is not ours.
        azure.add_event(not_before=utcnow() + timedelta(seconds=60), resources=["vm-3"])
        # A non-terminal event type (a reboot) is not a preemption either.
        azure.add_event(not_before=utcnow() + timedelta(seconds=60), event_type="Reboot")
        not_before = (utcnow() + timedelta(seconds=45)).replace(microsecond=0)
        event_id = azure.add_event(not_before=not_before)

        request = wait_for(_pending(sc), what="a request from the Preempt event")
        assert request.source == "azure"
        assert request.deadline == not_before
        assert event_id in request.reason

        # Not acknowledged before the checkpoint has committed.
        n = azure.count("GET", "/scheduledevents")
        wait_for(lambda: azure.count("GET", "/scheduledevents") >= n + 3, what="more polls")
        assert azure.acknowledged == []

        azure.fail_next(1, status=500)  # the first acknowledgement attempt (or a poll) fails
        _commit(sc, request)
        wait_for(lambda: azure.acknowledged, what="the acknowledgement")
        assert azure.acknowledged == [event_id]
        posts = [r for r in azure.requests if r.method == "POST" and r.status == 200]
        assert posts[0].headers["Metadata"] == "true"
        assert posts[0].query["api-version"] == "2020-07-01"
        assert '"StartRequests"' in posts[0].body
        assert _pending(sc)() is None, "the other events asked for nothing"
        assert _sample(sc, "baton_notices_total", source="azure") == 1.0


def test_azure_not_acknowledged_when_the_save_failed(
    sidecar_factory: Callable[..., SidecarProcess],
) -> None:
    with FakeAzure() as azure:
        sc = sidecar_factory(cloud="azure", env={**FAST, "BATON_AZURE_IMDS_ENDPOINT": azure.url})
        azure.add_event(not_before=utcnow() + timedelta(seconds=45))
        request = wait_for(_pending(sc), what="a request from the Preempt event")
        channel = ControlChannel(sc.control_dir)
        channel.clear_request(request.id)
        channel.write_status(
            Status(state=State.FAILED, request_id=request.id, error="disk full", step=3)
        )
        wait_for(
            lambda: _sample(sc, "baton_checkpoint_requests_total", result="failed") == 1.0,
            what="the failure counted",
        )
        n = azure.count("GET", "/scheduledevents")
        wait_for(lambda: azure.count("GET", "/scheduledevents") >= n + 3, what="more polls")
        assert azure.acknowledged == []


def test_azure_event_already_started_asks_for_a_save_at_once(
    sidecar_factory: Callable[..., SidecarProcess],
) -> None:
    with FakeAzure() as azure:
        sc = sidecar_factory(cloud="azure", env={**FAST, "BATON_AZURE_IMDS_ENDPOINT": azure.url})
        azure.add_event(not_before=None)
        request = wait_for(_pending(sc), what="a request from the started event")
        # No deadline: the SDK saves at the next step instead of judging a few seconds too
        # short and skipping.
        assert request.deadline is None
        assert request.source == "azure"


def test_azure_timeouts_and_errors_are_survived(
    sidecar_factory: Callable[..., SidecarProcess],
) -> None:
    with FakeAzure() as azure:
        azure.hang_next(2, seconds=4)
        azure.fail_next(3, status=502)
        sc = sidecar_factory(cloud="azure", env={**FAST, "BATON_AZURE_IMDS_ENDPOINT": azure.url})
        wait_for(lambda: "timed out" in sc.log(), what="a timeout, logged")
        wait_for(lambda: "HTTP 502" in sc.log(), timeout=30, what="a 502, logged")
        not_before = (datetime.now(UTC) + timedelta(seconds=40)).replace(microsecond=0)
        azure.add_event(not_before=not_before)
        request = wait_for(_pending(sc), timeout=30, what="a request once Azure answers")
        assert request.deadline == not_before
        assert sc.alive()


# ---- detection ---------------------------------------------------------------------------------


def test_auto_detects_the_cloud_that_answers(
    sidecar_factory: Callable[..., SidecarProcess],
) -> None:
    nobody = f"http://127.0.0.1:{free_port()}"
    with FakeGce() as gce, FakeAws() as decoy:
        decoy.stop()  # a port that refuses, like 169.254.169.254 off AWS
        sc = sidecar_factory(
            cloud="auto",
            env={
                **FAST,
                "BATON_GCE_METADATA_ENDPOINT": gce.url,
                "BATON_AWS_IMDS_ENDPOINT": decoy.url,
                "BATON_AZURE_IMDS_ENDPOINT": nobody,
            },
        )
        wait_for(lambda: "detected cloud(s): gce" in sc.log(), what="GCE detected")
        assert sc.status().json()["clouds"] == ["gce"]
        wait_for(lambda: gce.count("GET", "/preempted") >= 1, what="GCE polls")
        gce.preempt()
        assert wait_for(_pending(sc), what="a request").source == "gce"
        assert "aws notice poller started" not in sc.log()


def test_auto_with_no_cloud_turns_pollers_off(
    sidecar_factory: Callable[..., SidecarProcess],
) -> None:
    nobody = f"http://127.0.0.1:{free_port()}"
    sc = sidecar_factory(
        cloud="auto",
        env={
            **FAST,
            "BATON_GCE_METADATA_ENDPOINT": nobody,
            "BATON_AWS_IMDS_ENDPOINT": nobody,
            "BATON_AZURE_IMDS_ENDPOINT": nobody,
        },
    )
    wait_for(lambda: "cloud notices off" in sc.log(), timeout=30, what="pollers off")
    assert sc.status().json()["clouds"] == []
