"""API faults are counted by verb and code, fail /healthz when they persist, and back off.

A real API client against a port where nothing listens (a refused connection, as when the API
server is down), and the real /healthz server; the cluster tests produce 403s for real.
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, cast
from urllib.error import HTTPError

import pytest
from baton_operator import handlers
from baton_operator.client import faults, leader, metrics
from baton_operator.client import kube as kube_mod
from baton_operator.client.kube import Kube
from baton_operator.pure.errors import KubeError
from baton_operator.pure.settings import OperatorConfig
from baton_operator.pure.watchcache import WatchCache
from baton_operator.reconcile.writing import StatusWriter
from baton_testing.ports import free_port
from baton_testing.reconciler_fakes import JOB, NS, FakeKube, Harness, job_body
from kubernetes import client as k8s_client
from kubernetes.client.exceptions import ApiException


def _dead_api_kube() -> Kube:
    config = k8s_client.Configuration()
    config.host = f"http://127.0.0.1:{free_port()}"
    config.retries = 0
    return Kube(k8s_client.ApiClient(config))


def _count(m: metrics.Metrics, verb: str, code: str) -> float:
    value = m.registry.get_sample_value(
        "baton_operator_api_errors_total", {"verb": verb, "code": code}
    )
    return 0.0 if value is None else value


def test_a_call_without_answer_is_a_kube_error_counted_by_verb_and_code() -> None:
    m, health = metrics.Metrics(), metrics.Health(grace_seconds=0.0)
    kube = faults.instrument(_dead_api_kube(), m, health)

    async def run() -> None:
        with pytest.raises(KubeError) as info:
            await kube.get_job("ns", "job")
        assert info.value.status == 0
        assert "no answer from the API server" in str(info.value)
        with pytest.raises(KubeError):
            await kube.list_pods("ns", "a=b")

    asyncio.run(run())
    assert _count(m, "get", "0") == 1
    assert _count(m, "list", "0") == 1
    problem = health.problem()
    assert problem is not None
    assert "every Kubernetes API call has failed" in problem


def test_healthz_fails_only_after_the_grace_and_recovers() -> None:
    now = [0.0]
    health = metrics.Health(grace_seconds=30.0, clock=lambda: now[0])
    health.failed("reading TrainingJob ns/job: HTTP 403: forbidden")
    now[0] = 29.0
    assert health.problem() is None, "a brief fault is not a dead operator"
    now[0] = 31.0
    assert "HTTP 403" in (health.problem() or "")
    health.ok()
    assert health.problem() is None
    assert health.failing_for() == 0.0


def test_the_healthz_endpoint_answers_503_with_the_cause() -> None:
    m, health = metrics.Metrics(), metrics.Health(grace_seconds=0.0)
    port = free_port()

    async def run() -> tuple[int, str, int]:
        runner = await metrics.serve(m, port=port, host="127.0.0.1", health=health)
        try:
            url = f"http://127.0.0.1:{port}/healthz"
            ok = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).status)
            health.failed("listing pods in ns: HTTP 403: forbidden")

            def sick() -> tuple[int, str]:
                try:
                    urllib.request.urlopen(url, timeout=10)
                except HTTPError as e:
                    return e.code, e.read().decode()
                raise AssertionError("/healthz answered 200 while the API was failing")

            code, text = await asyncio.to_thread(sick)
            return ok, text, code
        finally:
            await runner.cleanup()

    ok, text, code = asyncio.run(run())
    assert ok == 200
    assert code == 503
    assert "HTTP 403" in text


@pytest.mark.parametrize(
    ("status", "reason"),
    [(403, "APIForbidden"), (409, "APIConflict"), (410, "APIGone"), (422, "APIRejected"),
     (500, "APIUnavailable"), (503, "APIUnavailable"), (0, "APITimeout"), (418, "APIError")],
)  # fmt: skip
def test_every_status_has_a_reaction(status: int, reason: str) -> None:
    got, fix = faults.reaction(status)
    assert got == reason
    assert fix
    if status == 403:
        assert "re-apply its RBAC" in fix


def test_backoff_doubles_from_a_tick_up_to_30_seconds() -> None:
    f = faults.JobFaults()
    delays = []
    for _ in range(10):
        f.failures += 1
        delays.append(f.backoff(0.5))
    assert delays[:4] == [1.0, 2.0, 4.0, 8.0]
    assert max(delays) == 30.0
    assert delays == sorted(delays)


def test_a_standby_that_cannot_reach_the_api_fails_healthz_naming_the_lease() -> None:
    """/healthz stayed 200 on a standby that could not reach the API server (issue 31): its
    Lease calls feed the same Health as the active operator's calls."""
    config = k8s_client.Configuration()
    config.host = f"http://127.0.0.1:{free_port()}"
    config.retries = 0
    health = metrics.Health(grace_seconds=0.0)
    elector = leader.LeaderElector(
        leader.LeaseClient(k8s_client.ApiClient(config), namespace="ops", name="baton",
                           timeout=5.0),
        identity="standby-1", health=health,
        timings=leader.LeaseTimings(duration=4, renew=1.0, retry=0.01, renew_deadline=3.0),
    )  # fmt: skip

    async def run() -> None:
        task = asyncio.create_task(elector.acquire())
        while health.failing_for() == 0.0 and health.problem() is None:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert "Lease ops/baton" in (health.problem() or "")
    health.ok()
    assert health.last_outage is not None
    assert "Lease ops/baton" in health.last_outage[2]


_T0 = datetime(2026, 12, 3, 7, 0, 0, tzinfo=UTC)


def test_an_outage_that_ended_a_leadership_starts_at_the_previous_holders_last_renewal() -> None:
    # The replica restarted during a 63 s outage: it saw only the outage's tail, the Lease
    # keeps when its predecessor last renewed.
    seen = (_T0 + timedelta(seconds=20), 43.0, "HTTP 503")
    outage = faults.outage_after_takeover(seen, _T0)
    assert outage is not None
    assert (outage.began, outage.seconds) == (_T0, 63.0)
    assert "failed for 63s from 2026-12-03T07:00:00Z" in outage.message()
    # A standby that saw the whole outage: it began after the last renewal.
    outage = faults.outage_after_takeover((_T0 + timedelta(seconds=1), 62.0, "x"), _T0)
    assert outage is not None
    assert outage.seconds == 63.0
    # No outage seen (kill -9 of the holder), a free Lease, or an older outage: nothing.
    assert faults.outage_after_takeover(None, _T0) is None
    assert faults.outage_after_takeover(seen, None) is None
    assert faults.outage_after_takeover((_T0 - timedelta(seconds=90), 5.0, "x"), _T0) is None


class _Jobs:
    """get_job / patch_job_status over one job, as Kube does."""

    def __init__(self, phase: str, created: str = "2026-12-03T06:00:00Z") -> None:
        self.job: dict[str, Any] = {
            "metadata": {"name": "tj", "namespace": "ns", "creationTimestamp": created},
            "status": {"phase": phase, "conditions": []},
        }
        self.events: list[tuple[str, str, str]] = []

    async def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.job

    async def patch_job_status(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self.job["status"].update(patch)

    async def post(self, job: Any, kind: str, reason: str, message: str) -> None:
        self.events.append((kind, reason, message))


def test_a_new_leader_records_the_outage_once_on_each_job_that_lived_through_it() -> None:
    outage = faults.Outage(began=_T0, seconds=63.0, last_error="HTTP 503")

    def record(jobs: _Jobs) -> None:
        asyncio.run(faults.record_outage(cast(Any, jobs), jobs.post, "ns", "tj", outage))

    running = _Jobs("Running")
    record(running)
    record(running)  # the second replica to lead, or this one once more: no second record
    [condition] = running.job["status"]["conditions"]
    assert (condition["type"], condition["status"], condition["reason"]) == (
        "Degraded", "False", "APIRecovered",
    )  # fmt: skip
    assert "failed for 63s from 2026-12-03T07:00:00Z" in condition["message"]
    assert running.events == [("Normal", "APIRecovered", condition["message"])]
    for untouched in (_Jobs("Succeeded"), _Jobs("Pending", created="2026-12-03T07:05:00Z")):
        record(untouched)
        assert untouched.job["status"]["conditions"] == []
        assert untouched.events == []


def test_an_rbac_loss_of_one_tick_is_recorded_on_recovery_and_a_blip_is_not() -> None:
    """An RBAC loss shorter than the backoff showed nowhere but the log (issue 31)."""
    denied = _Jobs("Running")
    api = faults.JobFaults()
    forbidden = KubeError("listing pods in ns: HTTP 403: forbidden", status=403)
    asyncio.run(api.failed(cast(Any, denied), denied.post, "ns", "tj", forbidden))
    assert denied.events == [], "one refused tick: nothing can be written yet"
    asyncio.run(api.succeeded(cast(Any, denied), denied.post, "ns", "tj"))
    [(kind, reason, message)] = denied.events
    assert (kind, reason) == ("Normal", "APIRecovered")
    assert "APIForbidden" in message
    asyncio.run(api.succeeded(cast(Any, denied), denied.post, "ns", "tj"))
    assert len(denied.events) == 1, "recorded once"
    blip = _Jobs("Running")
    api = faults.JobFaults()
    unavailable = KubeError("listing pods in ns: HTTP 503", status=503)
    asyncio.run(api.failed(cast(Any, blip), blip.post, "ns", "tj", unavailable))
    asyncio.run(api.succeeded(cast(Any, blip), blip.post, "ns", "tj"))
    assert blip.events == []


def test_a_fault_is_dated_from_the_start_of_the_tick_that_failed() -> None:
    """With the API server gone a call fails only at the client's timeout; the span reported
    on recovery starts when that tick began, not when its failure came back (a 60 s outage
    was reported as 47 s)."""
    jobs = _Jobs("Running")
    api = faults.JobFaults()
    gone = KubeError("get_job: HTTP 503: the API server is unavailable", status=503)
    began = datetime.now(tz=UTC) - timedelta(seconds=40)
    asyncio.run(api.failed(cast(Any, jobs), jobs.post, "ns", "tj", gone, began=began))
    asyncio.run(
        api.failed(cast(Any, jobs), jobs.post, "ns", "tj", gone, began=datetime.now(tz=UTC))
    )
    asyncio.run(api.succeeded(cast(Any, jobs), jobs.post, "ns", "tj"))
    recovered = [m for kind, reason, m in jobs.events if reason == "APIRecovered"]
    assert len(recovered) == 1, jobs.events
    assert "work again after 40s of" in recovered[0], recovered[0]


def test_healthz_fails_sooner_when_the_operator_lacks_rbac() -> None:
    now = [0.0]
    health = metrics.Health(grace_seconds=30.0, clock=lambda: now[0])
    health.failed("reading TrainingJob ns/job: HTTP 503", status=503)
    now[0] = metrics.DENIED_GRACE_SECONDS + 1
    assert health.problem() is None, "an API server restarting: the long grace"
    health.failed("reading TrainingJob ns/job: HTTP 403: forbidden", status=403)
    assert "HTTP 403" in (health.problem() or "")


class _OldCrdKube(FakeKube):
    """The fake API server with an installed CRD older than the operator: its ``status.phase``
    enum lacks ``Pending``, so the API server refuses (422) every status write that sets it,
    with the answer the real one gives (translated by the real client layer)."""

    def __init__(self) -> None:
        super().__init__(job_body())
        self.refused = 0
        self.crd_fixed = False

    async def patch_job_status(
        self,
        namespace: str,
        name: str,
        status: dict[str, Any],
        *,
        resource_version: str | None = None,
    ) -> str | None:
        if status.get("phase") == "Pending" and not self.crd_fixed:
            self.refused += 1
            e = ApiException(status=422, reason="Unprocessable Entity")
            # The real API server's answer (test_guarded_status_cluster.py gets it),
            # with its "<nil>" cause: CEL rules left unchecked, no field.
            unchecked = (
                "Invalid value: null: some validation rules were not checked because "
                "the object was invalid; correct the existing errors to complete "
                "validation"
            )
            e.body = json.dumps({
                "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Invalid",
                "code": 422,
                "message": f'TrainingJob.baton.dev "{name}" is invalid: [status.phase: '
                           'Unsupported value: "Pending": supported values: "Running", '
                           f"<nil>: {unchecked}]",
                "details": {"name": name, "group": "baton.dev", "kind": "TrainingJob",
                            "causes": [{"reason": "FieldValueNotSupported", "field": "status.phase",
                                        "message": 'Unsupported value: "Pending"'},
                                       {"reason": "FieldValueInvalid", "field": "<nil>",
                                        "message": unchecked}]},
            })  # fmt: skip
            raise kube_mod._translate(e, f"patching TrainingJob {namespace}/{name} status")
        return await super().patch_job_status(
            namespace, name, status, resource_version=resource_version
        )


class _StopWhen:
    """kopf's ``stopped`` flag, raised once ``done()`` holds."""

    def __init__(self, done: Callable[[], bool]) -> None:
        self._done = done

    def __bool__(self) -> bool:
        return self._done()


def _daemon(h: Harness, cache: WatchCache, stopped: Any) -> None:
    async def post(job: Any, kind: str, reason: str, message: str) -> None:
        h.events.append((kind, reason, message))

    memo = {"config": h.config, "reconciler": h.reconciler, "wakers": {}, "kube": h.kube,
            "post": post, "cache": cache}  # fmt: skip

    async def run() -> None:
        daemon = handlers._job_daemon(
            name=JOB, namespace=NS, memo=memo, stopped=stopped,
            logger=logging.getLogger("test-daemon"),
        )  # fmt: skip
        await asyncio.wait_for(daemon, timeout=10)

    asyncio.run(run())


def test_a_status_write_the_api_server_refuses_is_sent_once_and_names_the_field() -> None:
    """A 422 on a status write was retried forever, with backoff (issue 25): it can never
    succeed. The daemon stops after one try; the job says which field and what to do."""
    h = Harness(config=OperatorConfig(tick_seconds=0.01))
    h.kube = kube = _OldCrdKube()
    cache = WatchCache()
    h.build(cache=cache)
    _daemon(h, cache, stopped=_StopWhen(lambda: False))  # returns by itself: no retry loop
    assert kube.refused == 1, "the refused write is never sent again"
    degraded = kube.condition("Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "APIRejected")
    assert "(field status.phase)" in degraded["message"]
    assert 'Unsupported value: "Pending"' in degraded["message"]
    assert "install the CRD of the operator's version" in degraded["message"]
    assert ("Warning", "APIRejected", degraded["message"]) in h.events
    assert "phase" not in kube.status, "nothing else was written"
    # The CRD is upgraded and the operator restarted: its daemon drives the job and clears
    # the report once its first tick worked.
    kube.crd_fixed = True
    _daemon(h, cache, stopped=_StopWhen(lambda: kube.condition("Degraded")["status"] == "False"))
    assert kube.status["phase"] == "Pending"
    assert kube.condition("Degraded")["reason"] == "APIRecovered"
    assert h.events[-1][:2] == ("Normal", "APIRecovered")


def test_an_event_the_api_server_refuses_is_logged_with_its_reason_never_a_header(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A refused Event was logged as "could not post Event X" only: an RBAC loss on events
    never said so (issue 25)."""
    forbidden = ApiException(status=403, reason="Forbidden")
    forbidden.body = json.dumps({
        "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden",
        "code": 403,
        "message": 'events is forbidden: User "system:serviceaccount:baton-system:baton-operator"'
                   ' cannot create resource "events" in API group "" in the namespace "team"',
    })  # fmt: skip
    forbidden.headers = {"Authorization": "Bearer s3cr3t-token", "Audit-Id": "a-1"}
    translated = KubeError.from_answer("creating Event team/tj.1: HTTP 403: quota", status=403)
    refusals: list[Exception] = [forbidden, translated, RuntimeError("http://user:pw@host")]

    async def post(job: Any, kind: str, reason: str, message: str) -> None:
        raise refusals.pop(0)

    writer = StatusWriter(cast(Any, None), post)
    job = job_body()
    with caplog.at_level(logging.WARNING, logger="baton_operator.writing"):
        for _ in range(3):
            asyncio.run(writer.event(job, "Normal", "Created", "starting"))  # never raises
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3
    assert warnings[0] == (
        f"{NS}/{JOB}: could not post Event Created: HTTP 403: Forbidden: events is forbidden: "
        'User "system:serviceaccount:baton-system:baton-operator" cannot create resource '
        '"events" in API group "" in the namespace "team"'
    )
    assert warnings[1].endswith("creating Event team/tj.1: HTTP 403: quota")
    assert warnings[2].endswith("could not post Event Created: RuntimeError")
    logged = caplog.text
    assert "s3cr3t" not in logged
    assert "pw@" not in logged
    assert all(r.exc_info is None for r in caplog.records), "no traceback"
