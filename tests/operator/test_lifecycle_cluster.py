"""The TrainingJob lifecycle on the real control plane, with the operator under its own RBAC.

Success and the printer columns, CEL refusals, the failure budget, a node lost without notice,
an operator killed in the middle of a checkpoint-then-reschedule, and an elastic shrink.
"""

from __future__ import annotations

import time
import urllib.request
from typing import Any

import pytest
from baton_testing.operator_harness import NAMESPACE, Baton, PodWatcher, unique

pytestmark = pytest.mark.cluster
# One operator process for all of this module's tests (baton_testing.operator_fixtures: an
# operator's stop costs about 6 s of teardown, per test when each test had its own).
SHARED_OPERATOR = True
OPERATOR_ARGS = ["--node-lost-seconds", "2"]
"""A node is called lost 2 s after it turns NotReady (the local cluster's node-monitor grace
is 8 s), not the harness's 10 s: the node-lost test's new attempt, which waits until the dead
node's pod is force-deleted, starts 8 s sooner. The module's notices end before their nodes
die, so nothing else here waits on it."""


def test_two_replicas_run_to_succeeded_and_columns_say_so(baton: Baton) -> None:
    job = unique("tj-ok")
    baton.submit(job, steps=20, every_steps=5, sleep=0.05)
    final = baton.wait_phase(job, "Succeeded", timeout=180)
    assert final["worldSize"] == 2
    assert final["preemptions"] == 0
    assert final["failures"] == 0
    assert baton.loss_steps(job) == list(range(1, 21))
    out = baton.cluster.kubectl("get", "trainingjobs", "-n", NAMESPACE, job).stdout
    header, row = out.splitlines()[:2]
    names = header.split()
    assert names == [
        "NAME",
        "PHASE",
        "WORLD",
        "CHECKPOINT",
        "STEP",
        "PREEMPTIONS",
        "FAILURES",
        "REASON",
        "AGE",
    ]
    # Cut the row at the header's column starts: an empty cell would shift a split().
    starts = [header.index(n) for n in names] + [len(row) + 1]
    cells = {n: row[a:b].strip() for n, a, b in zip(names, starts, starts[1:], strict=False)}
    assert (cells["NAME"], cells["PHASE"], cells["WORLD"]) == (job, "Succeeded", "2")
    assert (cells["PREEMPTIONS"], cells["FAILURES"]) == ("0", "0")
    assert cells["REASON"] == "Succeeded"
    assert cells["STEP"].isdigit(), cells  # the last step reported while it ran
    conditions = {c["type"]: c for c in final["conditions"]}
    assert conditions["Succeeded"]["status"] == "True"
    assert "finished training" in conditions["Succeeded"]["message"]
    short = baton.cluster.kubectl("get", "tj", "-n", NAMESPACE, job).stdout
    assert "Succeeded" in short
    explained = baton.cluster.kubectl("explain", "trainingjob.spec.checkpoint.uri").stdout
    assert "s3://" in explained

    def job_series() -> list[str]:
        url = f"http://127.0.0.1:{baton.operator.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        assert "baton_jobs{" in text
        return [line for line in text.splitlines() if f'job="{job}"' in line]

    def until(predicate: Any, what: str, timeout: float = 30.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while True:
            series = job_series()
            if predicate(series):
                return series
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {series}"
            time.sleep(0.2)

    # Succeeded: the gauges are gone (no false BatonNoRecentCheckpoint an hour later), the
    # counters stay, at 0 for a job that was never preempted.
    series = until(
        lambda ss: not any(s.startswith("baton_last_checkpoint_timestamp_seconds") for s in ss),
        "the finished job's last-checkpoint gauge to go",
    )
    assert not any(s.startswith("baton_failure_budget_remaining") for s in series)
    assert f'baton_preemptions_total{{job="{job}",namespace="{NAMESPACE}"}} 0.0' in series
    # Deleted: nothing of it is left.
    baton.delete(job)
    until(lambda ss: ss == [], "every series of the deleted job to go")


INVALID: list[tuple[str, Any, str]] = [
    ("replicas", lambda s: s.update(replicas=0), "spec.replicas must be at least 1"),
    ("min", lambda s: s.update(minReplicas=3), "spec.minReplicas must be between 1 and"),
    (
        "scheme",
        lambda s: s["checkpoint"].update(uri="gs://bucket/x"),
        "spec.checkpoint.uri must start with s3:// or file://",
    ),
    (
        "every",
        lambda s: s["checkpoint"].update(everySteps=0),
        "spec.checkpoint.everySteps must be greater than 0",
    ),
    (
        "trainer",
        lambda s: s["template"]["spec"]["containers"][0].update(name="main"),
        "spec.template.spec.containers must include a container named `trainer`",
    ),
    ("procs", lambda s: s.update(procsPerReplica=1000), "spec.procsPerReplica must be at most 64"),
    (
        "gpus",
        lambda s: (
            s.update(procsPerReplica=4),
            s["template"]["spec"]["containers"][0].update(
                resources={"limits": {"nvidia.com/gpu": 2}}
            ),
        ),
        "spec.procsPerReplica must not exceed the trainer container's "
        "resources.limits[nvidia.com/gpu]",
    ),
    (
        "fast-size",
        lambda s: s["checkpoint"].update(fastEverySteps=1),
        "spec.checkpoint.fastSizeLimit is required with fastEverySteps",
    ),
    (
        "fast-quantity",
        lambda s: s["checkpoint"].update(fastEverySteps=1, fastSizeLimit="4GB"),
        "spec.checkpoint.fastSizeLimit must be a positive byte quantity",
    ),
]


@pytest.mark.parametrize(("label", "mutate", "message"), INVALID, ids=[i[0] for i in INVALID])
def test_invalid_jobs_are_refused_naming_the_field(
    baton: Baton, label: str, mutate: Any, message: str
) -> None:
    manifest = baton.job_manifest(unique(f"tj-bad-{label}"))
    mutate(manifest["spec"])
    result = baton.apply(manifest)
    assert result.returncode != 0, f"the API server accepted an invalid job: {result.stdout}"
    assert message in result.stderr


def test_immutable_fields_are_refused_once_started(baton: Baton) -> None:
    job = unique("tj-immutable")
    baton.submit(job, steps=400, sleep=0.2)
    baton.wait_for(job, lambda s: bool(s.get("phase")), timeout=60, what="a phase")
    for patch, message in (
        ('{"spec":{"replicas":3}}', "spec.replicas is immutable once the job has started"),
        (
            '{"spec":{"checkpoint":{"uri":"/elsewhere"}}}',
            "spec.checkpoint.uri is immutable once the job has started",
        ),
    ):
        result = baton.cluster.kubectl(
            "patch", "trainingjob", job, "-n", NAMESPACE, "--type=merge", "-p", patch, check=False
        )
        assert result.returncode != 0
        assert message in result.stderr
    baton.delete(job)


def test_exhausting_max_failures_fails_with_a_clear_condition(baton: Baton) -> None:
    job = unique("tj-crash")
    baton.submit(
        job,
        command=["python", "-c", "import sys; sys.exit(3)"],
        failure_policy={"maxFailures": 1, "backoffSeconds": 1},
    )
    final = baton.wait_phase(job, "Failed", timeout=180)
    assert final["failures"] == 2
    assert final["preemptions"] == 0
    failed = {c["type"]: c for c in final["conditions"]}["Failed"]
    assert failed["status"] == "True"
    assert failed["reason"] == "FailureBudgetExhausted"
    assert "2 failures > maxFailures 1" in failed["message"]
    assert "exited with code 3" in failed["message"]
    assert any("exited with code 3" in e for e in baton.events(job))
    baton.delete(job)


def test_node_lost_without_notice_restarts_from_the_last_periodic_checkpoint(
    baton: Baton,
) -> None:
    baton.cluster.add_node()
    job = unique("tj-lost")
    baton.submit(
        job,
        steps=40,
        every_steps=5,
        sleep=0.3,
        failure_policy={"maxFailures": 2, "backoffSeconds": 1},
    )
    baton.wait_phase(job, "Running", timeout=120)
    before = baton.wait_for(
        job,
        lambda s: (s.get("lastCheckpoint") or {}).get("step", 0) >= 5,
        timeout=120,
        what="a periodic checkpoint",
    )
    assert before["lastCheckpoint"]["trigger"] == "periodic"
    baton.cluster.kill_node(baton.node_of(job, 1))
    restarted = baton.wait_for(
        job,
        lambda s: int(s.get("attempt", 0)) >= 1,
        timeout=120,
        what="a restart after the node loss",
    )
    assert restarted["failures"] == 1
    assert restarted["preemptions"] == 0
    assert restarted["restartReason"] == "failure"
    assert restarted["resumedFromStep"] == restarted["lastCheckpoint"]["step"]
    assert restarted["resumedFromStep"] >= before["lastCheckpoint"]["step"]
    final = baton.wait_phase(job, "Succeeded", timeout=240)
    assert final["failures"] == 1
    steps = baton.loss_steps(job)
    assert sorted(set(steps)) == list(range(1, 41)), "a step never ran"
    baton.delete(job)


def test_operator_killed_mid_checkpoint_still_completes(baton: Baton) -> None:
    baton.cluster.add_node()
    job = unique("tj-opkill")
    baton.submit(job, steps=40, every_steps=5, sleep=0.3)
    watcher = PodWatcher(baton, job)
    baton.wait_phase(job, "Running", timeout=120)
    baton.wait_steps(job, 8)
    baton.cluster.preempt(baton.node_of(job, 1), provider="karpenter", grace_s=40)
    baton.wait_for(
        job, lambda s: s.get("phase") == "Checkpointing", timeout=60, what="Checkpointing"
    )
    baton.operator.kill()  # returns once the process is gone; no fixed wait
    baton.operator.start()
    final = baton.wait_phase(job, "Succeeded", timeout=240)
    watcher.stop()
    assert final["preemptions"] == 1
    assert final["failures"] == 0
    assert baton.loss_steps(job) == list(range(1, 41)), "a step was lost or recomputed"
    assert watcher.violations(replicas=2) == []
    baton.delete(job)


def test_elastic_shrink_to_one_replica_from_the_committed_step(baton: Baton) -> None:
    # Two fresh nodes in a pool of their own, so "one node left" is true for this job.
    pool = unique("pool")
    nodes = [baton.cluster.add_node(), baton.cluster.add_node()]
    for node in nodes:
        baton.cluster.kubectl("label", "node", node, f"baton.dev/test-pool={pool}")
    job = unique("tj-elastic")
    baton.submit(
        job,
        steps=40,
        every_steps=5,
        sleep=0.3,
        min_replicas=1,
        node_selector={"baton.dev/test-pool": pool},
    )
    baton.wait_phase(job, "Running", timeout=120)
    baton.wait_steps(job, 8)
    baton.cluster.preempt(baton.node_of(job, 1), provider="aws", grace_s=30)
    shrunk = baton.wait_for(
        job,
        lambda s: s.get("restartReason") == "elastic",
        timeout=180,
        what="an elastic shrink",
    )
    assert shrunk["replicas"] == 1
    assert shrunk["worldSize"] == 1
    assert shrunk["resumedFromStep"] == shrunk["lastCheckpoint"]["step"]
    final = baton.wait_phase(job, "Succeeded", timeout=240)
    assert final["worldSize"] == 1
    assert final["preemptions"] == 1
    steps = baton.loss_steps(job)
    assert sorted(set(steps)) == list(range(1, 41))
    baton.delete(job)
