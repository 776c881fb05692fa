"""Checkpoint-then-reschedule on the real control plane, for every notice source.

Each test runs a 2-replica TrainingJob of the deterministic trainer with ``maxFailures: 0``:
a preemption counted as a failure would fail the job at once. It gives one node a notice and
checks that the ranks committed one step, that the next attempt runs on other nodes with
``BATON_RESUME_STEP`` equal to that step, that no step was lost or recomputed, and that the
job Succeeds. The node-notice test also watches the disruption hints come and go.
"""

from __future__ import annotations

import json
import threading
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

import kubernetes.client
import kubernetes.watch
import pytest
from baton_testing.operator_harness import NAMESPACE, Baton, PodWatcher, unique

pytestmark = pytest.mark.cluster
# One operator process for all of this module's tests (baton_testing.operator_fixtures: an
# operator's stop costs about 6 s of teardown, per test when each test had its own).
SHARED_OPERATOR = True
# The adaptive interval's prior (node seconds per interruption before any is seen): 200 s, not
# the production 6 h, so that the node time of one short job visibly lengthens the interval's
# mean time between interruptions, while the first attempt's interval (default 30 s save
# cost: sqrt(2 x 30 x 200 / 2 nodes) = 77 s) stays above the 60 s lower bound that the test
# model's sub-second measured saves clamp to. Only `everySeconds: auto` jobs read it: the
# module's other tests do not.
PRIOR_SECONDS = 200
OPERATOR_ARGS = ["--interval-prior-seconds", str(PRIOR_SECONDS)]

STEPS = 40
HINTS = {
    "karpenter.sh/do-not-disrupt": "true",
    "cluster-autoscaler.kubernetes.io/safe-to-evict": "false",
}


class HintRecorder:
    """Every change of a job's pods, as (event, pod, attempt, node, its disruption hints).

    A watch, not sampling: a notice save of the test model lasts about a second, and every
    version of a pod object reaches a watch. Errors are kept and asserted, never dropped.
    """

    def __init__(self, baton: Baton, job: str) -> None:
        self._core = kubernetes.client.CoreV1Api(baton.cluster.api)
        self._selector = f"baton.dev/job={job}"
        listed = self._core.list_namespaced_pod(NAMESPACE, label_selector=self._selector)
        self._version: str = listed.metadata.resource_version
        self.seen: list[tuple[str, str, str, str, dict[str, str]]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            watch = kubernetes.watch.Watch()
            try:
                for event in watch.stream(
                    self._core.list_namespaced_pod, NAMESPACE, label_selector=self._selector,
                    resource_version=self._version, timeout_seconds=5,
                ):  # fmt: skip
                    meta = event["object"].metadata
                    node = event["object"].spec.node_name or ""
                    self._version = meta.resource_version
                    annotations = meta.annotations or {}
                    hints = {k: annotations[k] for k in HINTS if k in annotations}
                    attempt = (meta.labels or {}).get("baton.dev/attempt", "")
                    self.seen.append((event["type"], meta.name, attempt, node, hints))
                    if self._stop.is_set():
                        watch.stop()
            except Exception as e:  # kept and asserted by stop()
                self.errors.append(f"{type(e).__name__}: {e}")
                self._stop.wait(0.5)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        assert not self._thread.is_alive(), "the pod watch did not stop within 60 s"
        assert not self.errors, f"watching the pods failed: {self.errors[-3:]}"

    def problems(self, noticed_node: str) -> list[str]:
        """Attempt 0's rank off the noticed node carried both hints during the notice save
        (the noticed node's own pod may be drained, i.e. deleting, and a pod being deleted
        gets none); every attempt-0 pod was without them when last seen; no pod of a later
        attempt (no notice) ever had one."""
        found = []
        first = {pod for _, pod, attempt, _, _ in self.seen if attempt == "0"}
        elsewhere = {
            pod for _, pod, attempt, node, _ in self.seen
            if attempt == "0" and node and node != noticed_node
        }  # fmt: skip
        hinted = {pod for _, pod, attempt, _, h in self.seen if attempt == "0" and h == HINTS}
        if len(first) != 2 or not elsewhere or not elsewhere <= hinted:
            found.append(
                f"hints seen on {sorted(hinted)} of attempt 0's {sorted(first)} "
                f"({sorted(elsewhere)} off the noticed node {noticed_node})"
            )
        return found + self.leftovers()

    def leftovers(self, *, drained_node: str | None = None) -> list[str]:
        """Hints that outlived their reason: an attempt-0 pod that still carried them when last
        seen, or a pod of a later attempt (no notice) that ever had one.

        ``drained_node``: the noticed node, when no operator was alive to take its pod's hints
        off (an operator killed during the save). A live operator takes the hints off a pod
        once it is being deleted; a killed one cannot, and when the node remover has drained
        the noticed node's pod and it is gone before the standby's first tick, that pod was
        deleted carrying them. Those held nothing back: their node is the one being removed.
        So a pod on ``drained_node`` whose last event is its deletion is not counted; every
        other pod is, the noticed node's pod too while it exists."""
        found = []
        for pod in sorted({pod for _, pod, attempt, _, _ in self.seen if attempt == "0"}):
            kind, node, last = [(k, n, h) for k, name, _, n, h in self.seen if name == pod][-1]
            drained = drained_node is not None and kind == "DELETED" and node == drained_node
            if last and not drained:
                found.append(f"{pod} still carried {last} when last seen")
        later = [(pod, h) for _, pod, attempt, _, h in self.seen if attempt != "0" and h]
        if later:
            found.append(f"pods of later attempts carried hints: {later}")
        return found


def _restarted_after(attempt: int, status: dict[str, Any]) -> bool:
    return int(status.get("attempt", 0)) > attempt and status.get("phase") in ("Pending", "Running")


def _restarted(status: dict[str, Any]) -> bool:
    return int(status.get("attempt", 0)) >= 1 and status.get("phase") in ("Pending", "Running")


def _time(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def _check_economics(
    at_restart: dict[str, Any],
    final: dict[str, Any],
    *,
    source: str,
    node: str,
    before: datetime,
    seen_restart: datetime,
    seen_final: datetime,
) -> None:
    """The interruption history and goodput say what happened (operator.md, "Interruption
    history and goodput"): one notice from ``source`` on ``node`` between ``before`` (just
    before the notice was given) and ``seen_restart``, whose save committed the step the next
    attempt resumed from, so no step was lost; times within those bounds, never exact."""
    earliest = before.replace(microsecond=0)  # status times are whole seconds
    (entry,) = at_restart["interruptions"]
    assert (entry["attempt"], entry["source"]) == (0, source), entry
    assert node in entry["nodes"], entry
    assert earliest <= _time(entry["noticeAt"]) <= _time(entry["at"]) <= seen_restart, entry
    assert (
        entry["leadSeconds"]
        == (_time(entry["deadline"]) - _time(entry["noticeAt"])).total_seconds()
    )
    assert entry["leadSeconds"] > 0, entry
    assert 0 <= entry["noticeToDurableSeconds"] <= (seen_restart - earliest).total_seconds(), entry
    # The notice save's step is the last step: the sidecars reported no step beyond it.
    assert entry["resumeStep"] == at_restart["resumedFromStep"], entry
    assert 1 <= entry["lastGoodStep"] <= entry["resumeStep"], entry
    assert (entry["stepsLost"], entry["gpus"], entry["gpuSecondsLost"]) == (0, 0, 0.0), entry
    assert entry["stepSeconds"] > 0, entry
    assert final["stepsLost"] == 0, final
    (done,) = final["interruptions"]
    # From the last good step (before the notice) to attempt 1's first step (before success).
    restart = done["restartSeconds"]
    assert 0 < restart <= (seen_final - _time(entry["lastGoodStepAt"])).total_seconds() + 1, done
    goodput = final["goodput"]
    assert 0 < goodput["ratio"] <= 1, goodput
    assert 1 <= goodput["step"] <= STEPS, goodput
    assert goodput["productiveSeconds"] <= goodput["wallSeconds"] + 1, goodput
    assert abs(goodput["productiveSeconds"] - goodput["step"] * goodput["stepSeconds"]) <= 0.1


def _check_moved_and_exact(
    baton: Baton,
    job: str,
    noticed_node: str,
    watcher: PodWatcher,
    said: str,
    *,
    source: str,
    before: datetime,
) -> None:
    at_restart = baton.wait_for(job, _restarted, timeout=120, what="the next attempt")
    seen_restart = datetime.now(tz=UTC) + timedelta(seconds=1)
    last = at_restart.get("lastCheckpoint") or {}
    diag = baton.diagnostics(job)
    assert last.get("trigger") == "notice", f"the restart did not follow a notice save{diag}"
    assert at_restart.get("resumedFromStep") == last.get("step"), diag
    assert at_restart["preemptions"] == 1, diag
    assert at_restart["failures"] == 0, diag
    assert baton.resume_env(job, 1) <= {str(last["step"])}, diag
    final = baton.wait_moved_once(job, noticed_node, watcher, replicas=2)
    seen_final = datetime.now(tz=UTC) + timedelta(seconds=1)
    steps = baton.loss_steps(job)
    assert steps == list(range(1, STEPS + 1)), (
        f"steps lost or recomputed around the notice at {last.get('step')}: {steps}"
    )
    events = "\n".join(baton.events(job))
    notices = [e for e in baton.events(job) if e.startswith("EvictionNotice")]
    assert notices, events
    assert said in notices[0], f"the Event should name the source ({said}): {notices[0]}"
    assert "CheckpointCommitted" in events
    _check_economics(
        at_restart, final, source=source, node=noticed_node, before=before,
        seen_restart=seen_restart, seen_final=seen_final,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("provider", "rank", "said"),
    [
        ("aws", 0, "AWS Node Termination Handler: spot interruption notice"),
        ("karpenter", 1, "Karpenter is disrupting the node"),
        ("gke", 1, "GKE: impending node termination"),
        ("autoscaler", 0, "cluster autoscaler is removing the node"),
    ],
)
def test_node_notice_checkpoints_and_moves_the_job(
    baton: Baton, provider: str, rank: int, said: str
) -> None:
    baton.cluster.add_node()  # replaces the node this test takes away
    job = unique(f"tj-{provider}")
    baton.submit(job, steps=STEPS, every_steps=5, sleep=0.3)
    hints = HintRecorder(baton, job)
    watcher = PodWatcher(baton, job)
    baton.wait_phase(job, "Running", timeout=120)
    baton.wait_steps(job, 8)
    node = baton.node_of(job, rank)
    before = datetime.now(tz=UTC)
    baton.cluster.preempt(node, provider=provider, grace_s=30)  # type: ignore[arg-type]
    _check_moved_and_exact(baton, job, node, watcher, said, source=provider, before=before)
    hints.stop()
    problems = hints.problems(node)
    assert not problems, f"{problems}\n{hints.seen}{baton.diagnostics(job)}"
    baton.delete(job)


def test_pod_disruption_target_checkpoints_and_moves_the_job(baton: Baton) -> None:
    job = unique("tj-disrupt")
    baton.submit(job, steps=STEPS, every_steps=5, sleep=0.3)
    watcher = PodWatcher(baton, job)
    baton.wait_phase(job, "Running", timeout=120)
    baton.wait_steps(job, 8)
    # An eviction through the Eviction API sets DisruptionTarget (EvictionByEvictionAPI) on
    # the pod and nothing on the node.
    node, before = _evict(baton, job, 1)
    _check_moved_and_exact(
        baton, job, node, watcher, "pod disruption: EvictionByEvictionAPI",
        source="disruption-target", before=before,
    )  # fmt: skip
    baton.delete(job)


def _evict(baton: Baton, job: str, rank: int) -> tuple[str, datetime]:
    """Evict the current attempt's ``rank`` through the Eviction API (the pod's
    DisruptionTarget condition is the notice): its node, and a time just before."""
    status = baton.status(job)
    pod = next(
        p["metadata"]["name"]
        for p in baton.pods(job)
        if p["metadata"]["labels"]["baton.dev/rank"] == str(rank)
        and p["metadata"]["labels"]["baton.dev/attempt"] == str(status.get("attempt", 0))
    )
    node = baton.node_of(job, rank)
    core = kubernetes.client.CoreV1Api(baton.cluster.api)
    before = datetime.now(tz=UTC)
    core.create_namespaced_pod_eviction(
        pod,
        NAMESPACE,
        kubernetes.client.V1Eviction(metadata=kubernetes.client.V1ObjectMeta(name=pod)),
    )
    return node, before


def _label_pool(baton: Baton, pool: str | None) -> None:
    """Put every live node in node pool ``pool`` (``baton.dev/node-pool``; None: take it off)."""
    core = kubernetes.client.CoreV1Api(baton.cluster.api)
    for node in baton.cluster.nodes():
        core.patch_node(node, {"metadata": {"labels": {"baton.dev/node-pool": pool}}})


def test_two_preemptions_are_recorded_and_shorten_the_auto_interval(baton: Baton) -> None:
    """A job with ``everySeconds: auto`` on one node pool is first suspended and resumed
    (a new attempt, no interruption), then preempted twice (two pod evictions, the cheapest
    notice: no node dies). The interval is chosen once per attempt, at its start. The
    resumed attempt's, from the quiet pool (node time, no interruption), has a longer mean
    time between interruptions than the first attempt's prior (``PRIOR_SECONDS``, the
    operator's ``--interval-prior-seconds``); the one chosen after the evictions, from the
    pool's two interruptions, a shorter one than that quiet value, and a shorter interval than
    the first attempt's. The status shows the inputs. The history holds exactly the two
    evictions, as the test saw them; goodput agrees. (The interval *seconds* of the quiet
    attempt are not compared with the first's: the first uses the 30 s default save cost,
    the later ones the test model's measured sub-second save, which the 60 s lower bound
    clamps; the unit tests compare seconds at equal save costs.)"""
    # Each eviction keeps its node out of later attempts: 2 + 2 nodes at least.
    while len(baton.cluster.nodes()) < 4:
        baton.cluster.add_node()
    pool = unique("pool")
    _label_pool(baton, pool)
    try:
        job = unique("tj-twice")
        manifest = baton.job_manifest(job, steps=STEPS, every_steps=5, sleep=0.3)
        manifest["spec"]["checkpoint"]["everySeconds"] = "auto"
        assert baton.apply(manifest).returncode == 0
        first = baton.wait_phase(job, "Running", timeout=120)["checkpointInterval"]
        # A quiet pool: a suspend and a resume start attempt 1 without an interruption.
        baton.wait_steps(job, 5)
        for value in (True, False):
            patch = json.dumps({"spec": {"suspend": value}})
            baton.cluster.kubectl(
                "patch", "trainingjob", job, "-n", NAMESPACE, "--type", "merge", "-p", patch
            )
            if value:
                baton.wait_phase(job, "Suspended", timeout=120)
        quiet = baton.wait_phase(job, "Running", timeout=180)["checkpointInterval"]
        seen: list[tuple[str, datetime, datetime, dict[str, Any]]] = []
        for attempt, at_step in ((1, 14), (2, 24)):
            baton.wait_steps(job, at_step)
            node, before = _evict(baton, job, 1)
            at_restart = baton.wait_for(
                job, partial(_restarted_after, attempt), timeout=120,
                what=f"attempt {attempt + 1}",
            )  # fmt: skip
            seen.append((node, before, datetime.now(tz=UTC) + timedelta(seconds=1), at_restart))
        final = baton.wait_phase(job, "Succeeded", timeout=240)
        done = datetime.now(tz=UTC) + timedelta(seconds=1)
        diag = baton.diagnostics(job)
    finally:
        _label_pool(baton, None)
    steps = baton.loss_steps(job)
    assert steps == list(range(1, STEPS + 1)), f"steps lost or recomputed: {steps}{diag}"
    assert (final["preemptions"], final["failures"], final["stepsLost"]) == (2, 0, 0), diag
    history = final["interruptions"]
    assert len(history) == 2, history
    for k, (entry, observed) in enumerate(zip(history, seen, strict=True)):
        node, before, seen_restart, at_restart = observed
        assert (entry["attempt"], entry["source"]) == (k + 1, "disruption-target"), entry
        assert node in entry["nodes"], (node, entry)
        earliest = before.replace(microsecond=0)  # status times are whole seconds
        assert earliest <= _time(entry["noticeAt"]) <= _time(entry["at"]) <= seen_restart, entry
        assert entry["leadSeconds"] > 0, entry
        assert 0 <= entry["noticeToDurableSeconds"] <= (seen_restart - earliest).total_seconds()
        # The notice save's step is the last step the ranks reported: nothing lost.
        assert entry["resumeStep"] == at_restart["resumedFromStep"], (entry, at_restart)
        assert entry["resumeStep"] == at_restart["lastCheckpoint"]["step"], entry
        assert 1 <= entry["lastGoodStep"] <= entry["resumeStep"], entry
        assert (entry["stepsLost"], entry["gpus"], entry["gpuSecondsLost"]) == (0, 0, 0.0), entry
        assert entry["stepSeconds"] > 0, entry
        # From the last good step (before the eviction) to the next attempt's first step.
        end = seen[k + 1][1] if k + 1 < len(seen) else done
        limit = (end - _time(entry["lastGoodStepAt"])).total_seconds() + 1
        assert 0 < entry["restartSeconds"] <= limit, entry
    assert history[0]["resumeStep"] < history[1]["resumeStep"], history
    goodput = final["goodput"]
    assert 0 < goodput["ratio"] <= 1, goodput
    assert 1 <= goodput["step"] <= STEPS, goodput
    assert goodput["productiveSeconds"] <= goodput["wallSeconds"] + 1, goodput
    assert abs(goodput["productiveSeconds"] - goodput["step"] * goodput["stepSeconds"]) <= 0.1
    # The interval: the prior for attempt 0; the quiet pool's node time for attempt 1 (after
    # the resume); the pool's two interruptions for attempt 3.
    last = final["checkpointInterval"]
    assert (first["attempt"], first["source"], first["saveMeasured"]) == (0, "prior", False)
    assert (first["priorSeconds"], first["mtbiSeconds"]) == (PRIOR_SECONDS, PRIOR_SECONDS / 2)
    assert "bounded" not in first, first
    labelled = f"baton.dev/node-pool={pool}"
    assert (quiet["attempt"], quiet["source"], quiet["pool"]) == (1, "pool", labelled), quiet
    assert (quiet["interruptions"], quiet["nodes"], quiet["saveMeasured"]) == (0, 2, True)
    assert quiet["nodeSeconds"] > 0, quiet
    # Per node: (node seconds + prior) / (0 + 1); the job's: that over its 2 nodes.
    expected = (quiet["nodeSeconds"] + PRIOR_SECONDS) / 2
    assert abs(quiet["mtbiSeconds"] - expected) <= 0.2, (quiet, expected)
    assert quiet["mtbiSeconds"] > first["mtbiSeconds"], (first, quiet)
    assert (last["attempt"], last["source"], last["pool"]) == (3, "pool", labelled), last
    assert (last["interruptions"], last["nodes"], last["saveMeasured"]) == (2, 2, True), last
    assert last["nodeSeconds"] > quiet["nodeSeconds"], (quiet, last)
    assert last["mtbiSeconds"] < quiet["mtbiSeconds"], (quiet, last)
    assert last["mtbiSeconds"] < first["mtbiSeconds"], (first, last)
    assert last["seconds"] < first["seconds"], (first, last)
    exposure = final["exposure"]
    assert exposure["interruptions"] == 2, exposure
    assert exposure["pools"][0]["pool"] == labelled, exposure
    assert "current" not in exposure, "the clock stopped when the job succeeded"
    baton.delete(job)
