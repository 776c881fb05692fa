"""API faults are counted by verb and code, fail /healthz when they persist, and back off.

A real API client against a port where nothing listens (a refused connection, as when the API
server is down), and the real /healthz server; the cluster tests produce 403s for real.
"""

from __future__ import annotations

import asyncio
import urllib.request
from urllib.error import HTTPError

import pytest
from baton_operator import faults, metrics
from baton_operator.errors import KubeError
from baton_operator.kube import Kube
from baton_testing.ports import free_port
from kubernetes import client as k8s_client


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
