"""Guarded status writes on the real API server: a write against an old resourceVersion is
refused, and nothing of it is applied.

The reconciler guards every status write with the resourceVersion its tick read
(``writing.py``); a refused write ends the tick with ``KubeConflictError`` and the tick starts
again from a fresh read (test_reconciler.py drives that against a fake of the client layer).
This test checks the part a fake cannot prove: that the API server itself treats
``metadata.resourceVersion`` in a merge patch of the status subresource as a precondition.
No operator runs; the job is created and deleted here (a few seconds on the session cluster).
"""

from __future__ import annotations

import asyncio
import json

import pytest
from baton_operator.client import faults
from baton_operator.client.kube import Kube, load_client
from baton_operator.pure.errors import KubeConflictError, KubeRejectedError
from baton_testing.jobs import training_job
from baton_testing.operator_harness import NAMESPACE, OperatorInstall, unique

pytestmark = pytest.mark.cluster


def test_a_status_write_against_an_old_version_is_refused(
    operator_install: OperatorInstall,
) -> None:
    cluster = operator_install.cluster
    name = unique("guarded")
    manifest = training_job(
        name,
        NAMESPACE,
        command=["true"],
        checkpoint={"uri": "file:///tmp/unused"},
        failure_policy={"maxFailures": 0},
        restricted=True,
    )
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))
    try:

        async def race() -> None:
            # The operator's own identity: what it may do is what it does here.
            kube = Kube(load_client(str(operator_install.kubeconfig)))
            job = await kube.get_job(NAMESPACE, name)
            assert job is not None
            read = str(job["metadata"]["resourceVersion"])
            mine = await kube.patch_job_status(
                NAMESPACE, name, {"message": "first writer"}, resource_version=read
            )
            assert mine is not None
            assert mine != read
            with pytest.raises(KubeConflictError) as lost:
                await kube.patch_job_status(
                    NAMESPACE, name, {"message": "stale writer"}, resource_version=read
                )
            assert lost.value.status == 409
            after = await kube.get_job(NAMESPACE, name)
            assert after is not None
            assert after["status"]["message"] == "first writer"
            assert after["metadata"]["resourceVersion"] == mine
            # With the version it now holds, the same writer goes through.
            again = await kube.patch_job_status(
                NAMESPACE, name, {"message": "second write"}, resource_version=mine
            )
            assert again not in (None, mine)

        asyncio.run(race())
    finally:
        cluster.kubectl("delete", "trainingjob", name, "-n", NAMESPACE, "--wait=false")


def test_a_status_value_the_crd_refuses_is_a_permanent_error_naming_the_field(
    operator_install: OperatorInstall,
) -> None:
    """A real 422: the API server's schema check of the status subresource. The client layer
    makes it a permanent error with the field the API server named (the job's daemon then
    stops: test_api_faults.py), and the report of it goes through where the write did not."""
    cluster = operator_install.cluster
    name = unique("refused")
    manifest = training_job(
        name,
        NAMESPACE,
        command=["true"],
        checkpoint={"uri": "file:///tmp/unused"},
        failure_policy={"maxFailures": 0},
        restricted=True,
    )
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))
    try:

        async def refused() -> None:
            kube = Kube(load_client(str(operator_install.kubeconfig)))
            with pytest.raises(KubeRejectedError) as info:
                await kube.patch_job_status(NAMESPACE, name, {"phase": "Bogus"})
            assert info.value.status == 422
            assert info.value.fields == ("status.phase",)
            events: list[tuple[str, str, str]] = []

            async def post(job: object, kind: str, reason: str, message: str) -> None:
                events.append((kind, reason, message))

            assert await faults.rejected(kube, post, NAMESPACE, name, info.value)
            job = await kube.get_job(NAMESPACE, name)
            assert job is not None
            assert job["status"].get("phase") != "Bogus"
            [degraded] = [c for c in job["status"]["conditions"] if c["type"] == "Degraded"]
            assert (degraded["status"], degraded["reason"]) == ("True", "APIRejected")
            assert "(field status.phase)" in degraded["message"]
            assert events == [("Warning", "APIRejected", degraded["message"])]

        asyncio.run(refused())
    finally:
        cluster.kubectl("delete", "trainingjob", name, "-n", NAMESPACE, "--wait=false")
