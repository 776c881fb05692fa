"""A 60 s API-server outage that begins while a preempted job is in ``Checkpointing``.

The real kube-apiserver of the shared local cluster is stopped (``localcluster
stop-apiserver``: its port refuses connections, every watch ends, etcd keeps the data) and
started again 60 s later. The operator runs ``--standalone``: with leader election the active
replica stops within ``lease_renew_deadline_seconds`` of an unrenewable Lease, by design, and
its restart is a standby until the API server is back (docs/operator.md, "Faults"); that
path's recovery is the one ``test_ha_cluster.py`` tests after ``kill -9``.

What is asserted: the operator process lives through the outage, counts the refused calls in
``baton_operator_api_errors_total{code="0"}`` and fails ``/healthz`` while it lasts; afterwards
``/healthz`` recovers, the job's ``Degraded`` condition and an ``APIRecovered`` Event give the
outage's cause and length, and the preemption ends as without the outage: one attempt
increment, every rank loads the notice save (read from the trainers' own ``RESUMED_FROM``
lines) and the final status reports that step, no duplicate or overlapping pods, no lost or
recomputed step. What differs is the report at the restart: the sidecars that saw the commit
have exited by the time the API server is back (their linger is 15 s), so the operator posts
``CheckpointFallback`` with the last step it knew and corrects ``resumedFromStep`` once the new
ranks report what they loaded (``ResumeStepCorrected``); unless it learnt the commit before
the port closed. On the way, the sidecar token file of a real pod
is checked as the node agent wrote it: mode 0440, group the pod's ``fsGroup``.

Cost: about 60 s of outage plus one short 2-rank job (see the report in the test's output),
about 160 s in all; the controller-manager's watches come back (up to a minute after the
outage) while the test goes on, and the fixture waits for them before the next test.
"""

from __future__ import annotations

import os
import re
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from baton_operator.pure import manifests
from baton_testing.operator_harness import (
    NAMESPACE,
    Baton,
    OperatorInstall,
    PodWatcher,
    api_errors,
    next_attempt,
    operator_process,
    poll,
    unique,
)

pytestmark = pytest.mark.cluster

STEPS = 40
OUTAGE_S = 60.0
NOTICE_GRACE_S = 40
"""When the noticed machine goes: during the outage, as a spot machine does whatever the API
server is doing. Its Node is deleted while the operator's Node watch is down or still refused
after the restart, so the watch never tells: the operator finds the Node gone by itself (a
list after the outage, or a lookup when the old pod's graceful deletion is overdue) and
removes the pod at once; before it did, the restart waited 137 s for the pod garbage
collector (docs/operator.md, Faults)."""


@pytest.fixture
def standalone(operator_install: OperatorInstall, tmp_path: Path) -> Iterator[Baton]:
    """One operator without leader election (the process that must live through the outage)."""
    op = operator_process(operator_install, tmp_path)
    op.args.append("--standalone")
    op.start()
    try:
        yield Baton(install=operator_install, workdir=tmp_path, operator=op)
    finally:
        op.stop()
        # The test does not wait for the controller-manager after the API server's restart
        # (nothing it checks needs it); the next test's cluster does.
        operator_install.cluster.wait_controller_manager()


def _token_file(baton: Baton, job: str) -> tuple[Path, dict[str, Any]]:
    """The token file the node agent wrote for rank 0's pod, and that pod."""
    pod = next(p for p in baton.pods(job) if p["metadata"]["labels"]["baton.dev/rank"] == "0")
    meta = pod["metadata"]
    pod_dir = baton.cluster.directory / "pods" / f"{meta['namespace']}_{meta['name']}_{meta['uid']}"
    return pod_dir / "volumes" / manifests.TOKEN_VOLUME / manifests.TOKEN_KEY, pod


def _loaded_steps(baton: Baton, job: str, *, attempt: int, replicas: int) -> list[int]:
    """The step each rank of ``attempt`` restored, from its trainer's ``RESUMED_FROM`` line."""
    names: list[str] = []

    def all_created() -> bool:
        names[:] = sorted(
            p["metadata"]["name"]
            for p in baton.pods(job)
            if p["metadata"]["labels"]["baton.dev/attempt"] == str(attempt)
        )
        return len(names) == replicas

    poll(all_created, timeout=240, what=f"the {replicas} pods of attempt {attempt}",
         diag=lambda: baton.diagnostics(job))  # fmt: skip
    steps: dict[str, int] = {}

    def all_resumed() -> bool:
        for name in names:
            if name in steps:
                continue
            out = baton.cluster.kubectl(
                "logs", "-n", NAMESPACE, name, "-c", manifests.TRAINER_NAME, check=False
            ).stdout
            lines = [ln for ln in out.splitlines() if ln.startswith("RESUMED_FROM ")]
            if lines:
                steps[name] = int(lines[0].split()[1])
        return len(steps) == len(names)

    poll(all_resumed, timeout=240, what="every rank's RESUMED_FROM line",
         diag=lambda: f"\nfound: {steps}" + baton.diagnostics(job))  # fmt: skip
    return [steps[n] for n in names]


def test_a_60s_api_server_outage_at_checkpointing(standalone: Baton) -> None:
    baton = standalone
    began = time.monotonic()
    baton.cluster.add_node()  # replaces the node this test takes away
    job = unique("tj-outage")
    baton.submit(job, steps=STEPS, every_steps=5, sleep=0.3)
    watcher = PodWatcher(baton, job)
    baton.wait_phase(job, "Running", timeout=240)
    baton.wait_steps(job, 8, timeout=180)

    # The sidecar token file as written for a real pod: group-only, the pod's fsGroup.
    token, pod = _token_file(baton, job)
    st = token.stat()
    fs_group = pod["spec"]["securityContext"]["fsGroup"]
    assert fs_group == manifests.DEFAULT_FS_GROUP
    assert stat.S_IMODE(st.st_mode) == 0o440, oct(st.st_mode)
    # Only root can give a file a group it is not in (tests/cluster/README.md, "Limitations").
    assert st.st_gid == (fs_group if os.geteuid() == 0 else os.getegid())

    # The machine goes NOTICE_GRACE_S after the notice, during the outage.
    noticed = baton.node_of(job, 1)
    baton.cluster.preempt(noticed, provider="karpenter", grace_s=NOTICE_GRACE_S)
    baton.wait_for(
        job, lambda s: s.get("phase") == "Checkpointing", timeout=180, what="Checkpointing"
    )
    op = baton.operator

    def log() -> str:
        return f"\n--- operator log ---\n{op.tail()}"

    refused_before = api_errors(op, "0")
    # Started again without waiting for the controller-manager's informers (up to a minute
    # after this outage): the fixture waits for them once the test is done.
    with baton.cluster.apiserver_down(wait_controllers=False):
        down = time.monotonic()
        poll(
            lambda: api_errors(op, "0") > refused_before,
            timeout=OUTAGE_S,
            what='refused API calls in baton_operator_api_errors_total{code="0"}',
            diag=log,
        )
        # /healthz fails once every call has failed for its 30 s grace.
        took = poll(lambda: op.healthz() == 503, timeout=OUTAGE_S, what="/healthz 503", diag=log)
        print(f"/healthz failed {took:.1f}s into the outage")
        # The rest of the 60 s: the outage is the stimulus, not a wait for a condition.
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - down)))
        assert op.proc is not None
        assert op.proc.poll() is None, "the operator died during the outage" + log()
    outage = time.monotonic() - down
    poll(lambda: op.healthz() == 200, timeout=180, what="/healthz 200 again", diag=log)

    def recovered(s: dict[str, Any]) -> bool:
        degraded = [c for c in s.get("conditions") or [] if c.get("type") == "Degraded"]
        return bool(degraded) and degraded[0]["reason"] == "APIRecovered"

    status = baton.wait_for(job, recovered, timeout=240, what="Degraded=False/APIRecovered")
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "False", degraded
    # The reason named is the last error seen: refused calls while it is down, and often a
    # 403 for a moment after the restart, before the API server's RBAC caches are filled.
    lasted = re.search(r"work again after (\d+)s of API\w+", degraded["message"])
    assert lasted, degraded
    assert int(lasted.group(1)) >= OUTAGE_S - 10, degraded

    at_restart = baton.wait_for(job, next_attempt, timeout=240, what="the next attempt")
    diag = baton.diagnostics(job)
    last = at_restart.get("lastCheckpoint") or {}
    assert last.get("step") is not None, f"no committed step known at the restart{diag}"
    assert at_restart.get("resumedFromStep") == last.get("step"), diag
    assert baton.resume_env(job, 1) == {str(last.get("step"))}, diag
    assert at_restart.get("preemptions") == 1, diag
    assert at_restart.get("failures") == 0, diag
    loaded = _loaded_steps(baton, job, attempt=1, replicas=2)
    final = baton.wait_phase(job, "Succeeded", timeout=360)
    watcher.stop()
    diag = baton.diagnostics(job)
    # The trainers load the notice save (committed while the API server was down; the
    # notice came after step 8, the last periodic save before it is step 5), every rank the
    # same, and the status ends up saying so: at the restart the operator may only know the
    # older step (the sidecars that saw the commit were gone when the API server came back),
    # and corrects it from what the new ranks report (ResumeStepCorrected).
    assert len(set(loaded)) == 1, f"the ranks loaded different steps {loaded}{diag}"
    assert loaded[0] >= 8, f"the ranks loaded step {loaded[0]}, not the notice save{diag}"
    assert final.get("resumedFromStep") == loaded[0], diag
    print("events:\n" + "\n".join(baton.events(job)))
    assert final["attempt"] == 1, f"one preemption, one attempt increment{diag}"
    # Sampling pods fails while the API server is down; what was sampled must be clean.
    assert watcher.violations(replicas=2, tolerate_errors=True) == [], diag
    assert baton.loss_steps(job) == list(range(1, STEPS + 1)), (
        f"a step was lost or recomputed around the notice at {last.get('step')}{diag}"
    )
    # Acted on once: the operator logs every Event it posts, also one the API server never
    # got (Events are best effort: a commit that lands just before the outage has its
    # Restarting Event posted, and given up on by kopf, while the API server is down).
    restarts = [
        line
        for line in op.log.read_text(errors="replace").splitlines()
        if f"{NAMESPACE}/{job}: Restarting: " in line
    ]
    assert len(restarts) == 1, f"the restart was acted on {len(restarts)} times{diag}"
    # The APIRecovered Event: posted when the calls work again, and retried by kopf while the
    # restarted API server still refuses it (403 until its RBAC caches are filled), so it may
    # land well after the condition; checked last, so the job's restart runs meanwhile.
    poll(lambda: any(e.startswith("APIRecovered:") for e in baton.events(job)), timeout=180,
         what="the APIRecovered Event", diag=lambda: baton.diagnostics(job))  # fmt: skip
    unseen = [ln for ln in op.tail(100000).splitlines() if "was not seen by the Node watch" in ln]
    print(f"outage {outage:.1f}s; test wall time {time.monotonic() - began:.0f}s; "
          f"unseen deletions: {unseen}")  # fmt: skip
    baton.delete(job)
    # The noticed machine is gone before the next test (the test's added node replaces it).
    poll(lambda: noticed not in baton.cluster.nodes(), timeout=NOTICE_GRACE_S + 60,
         what=f"node {noticed}'s machine gone", diag=log)  # fmt: skip
