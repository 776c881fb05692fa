"""Kueue itself admits a queued TrainingJob's pods as one gang, on the local cluster.

Kueue's controller manager (``tools/kueue/build.sh``, the version in ``tools/kueue/go.mod``)
runs against the session's cluster with its plain-pod integration, scoped to this module's own
namespace (``baton_testing.kueue``). A 2-replica job labelled with a LocalQueue whose
ClusterQueue has 1 GPU of quota, one GPU per pod: the operator creates both pods, Kueue's
webhook gates them and composes one Workload of the pod group, which does not fit, so no pod is
bound and no step trained. Raising the quota to 2 GPUs admits the Workload: Kueue ungates both
pods, they are bound, the job trains to the end, Kueue marks the Workload Finished, and the
job's deletion completes although Kueue holds a finalizer on each pod. Then Kueue evicts a
running job's Workload: Baton checkpoints on the pods' ``DisruptionTarget``, and the next
attempt (a new pod group, so a new Workload) is admitted and resumes from that step.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import kubernetes.client
import pytest
from baton_testing.kueue import Kueue, running_kueue
from baton_testing.operator_harness import Baton, OperatorInstall, poll, unique

pytestmark = pytest.mark.cluster

NAMESPACE = "baton-kueue"
"""Kueue manages the pods of this namespace only (not the shared ``baton-test``)."""
GATE = {"name": "kueue.x-k8s.io/admission"}
FLAVOR, CLUSTER_QUEUE, QUEUE = "baton-default", "baton-gpus", "team-a"
STEPS = 12


@pytest.fixture(scope="module")
def kueue(
    operator_install: OperatorInstall, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Kueue]:
    cluster = operator_install.cluster
    cluster.kubectl("create", "namespace", NAMESPACE, check=False)
    # Pod Security "restricted", as in the operator's own test namespace.
    cluster.kubectl(
        "label", "--overwrite", "namespace", NAMESPACE,
        "pod-security.kubernetes.io/enforce=restricted",
    )  # fmt: skip
    with running_kueue(cluster, NAMESPACE, tmp_path_factory.mktemp("kueue")) as k:
        yield k


def _get(baton: Baton, *args: str) -> Any:
    return baton.kubectl_json("get", *args)


def _read(call: Any, *args: Any, **kw: Any) -> Any:
    """One GET through the session's API client, as JSON: the helpers that the test polls
    use this, not a kubectl process per call (a quarter of a core on this machine)."""
    resp = call(*args, _preload_content=False, _request_timeout=30, **kw)
    return json.loads(resp.data)


def _job_status(baton: Baton, job: str) -> dict[str, Any]:
    api = kubernetes.client.CustomObjectsApi(baton.cluster.api)
    got = _read(api.get_namespaced_custom_object, "baton.dev", "v1alpha1", NAMESPACE,
                "trainingjobs", job)  # fmt: skip
    return dict(got.get("status") or {})


def _pods(baton: Baton, job: str) -> list[dict[str, Any]]:
    core = kubernetes.client.CoreV1Api(baton.cluster.api)
    got = _read(core.list_namespaced_pod, NAMESPACE, label_selector=f"baton.dev/job={job}")
    return list(got["items"])


def _workloads(baton: Baton, job: str) -> list[dict[str, Any]]:
    """The Workloads of the job's pod groups (``<job>-a<attempt>``), by attempt."""
    api = kubernetes.client.CustomObjectsApi(baton.cluster.api)
    got = _read(api.list_namespaced_custom_object, "kueue.x-k8s.io", "v1beta2", NAMESPACE,
                "workloads")  # fmt: skip
    mine = [w for w in got["items"] if w["metadata"]["name"].startswith(f"{job}-a")]
    return sorted(mine, key=lambda w: int(w["metadata"]["name"].rsplit("-a", 1)[1]))


def _workload(baton: Baton, name: str) -> dict[str, Any]:
    job = name.rsplit("-a", 1)[0]
    found = [w for w in _workloads(baton, job) if w["metadata"]["name"] == name]
    return found[0] if found else {}


def _condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c["type"] == kind:
            return dict(c)
    return {}


def _queues(gpus: int) -> list[dict[str, Any]]:
    api = "kueue.x-k8s.io/v1beta2"
    return [
        {"apiVersion": api, "kind": "ResourceFlavor", "metadata": {"name": FLAVOR}},
        {
            "apiVersion": api,
            "kind": "ClusterQueue",
            "metadata": {"name": CLUSTER_QUEUE},
            "spec": {
                "namespaceSelector": {},
                "resourceGroups": [
                    {
                        "coveredResources": ["cpu", "memory", "nvidia.com/gpu"],
                        "flavors": [
                            {
                                "name": FLAVOR,
                                "resources": [
                                    {"name": "cpu", "nominalQuota": 16},
                                    {"name": "memory", "nominalQuota": "64Gi"},
                                    {"name": "nvidia.com/gpu", "nominalQuota": gpus},
                                ],
                            }
                        ],
                    }
                ],
            },
        },
        {
            "apiVersion": api,
            "kind": "LocalQueue",
            "metadata": {"name": QUEUE, "namespace": NAMESPACE},
            "spec": {"clusterQueue": CLUSTER_QUEUE},
        },
    ]


def _apply(baton: Baton, objects: list[dict[str, Any]]) -> None:
    text = "\n---\n".join(json.dumps(o) for o in objects)
    got = baton.cluster.kubectl("apply", "-f", "-", input=text, check=False)
    assert got.returncode == 0, got.stderr


def _diag(baton: Baton, kueue: Kueue, job: str) -> str:
    pods = baton.cluster.kubectl("get", "pods", "-n", NAMESPACE, "-o", "wide", check=False)
    wls = baton.cluster.kubectl(
        "get", "workloads.kueue.x-k8s.io", "-n", NAMESPACE, "-o", "yaml", check=False
    )
    return (
        f"\n--- job status ---\n{json.dumps(_job_status(baton, job), indent=1)}"
        f"\n--- pods ---\n{pods.stdout}\n--- workloads ---\n{wls.stdout}"
        f"\n--- operator log ---\n{baton.operator.tail()}{kueue.tail()}"
    )


def _submit_queued(baton: Baton, job: str, *, steps: int, every: int, sleep: float) -> None:
    """A 2-replica job queued in the LocalQueue, one GPU per pod (an integer, as users write
    it)."""
    manifest = baton.job_manifest(job, steps=steps, every_steps=every, sleep=sleep)
    manifest["metadata"]["namespace"] = NAMESPACE
    manifest["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": QUEUE}
    trainer = manifest["spec"]["template"]["spec"]["containers"][0]
    trainer["resources"] = {"limits": {"nvidia.com/gpu": 1}}
    applied = baton.apply(manifest)
    assert applied.returncode == 0, applied.stderr


def _wait_active(baton: Baton, kueue: Kueue) -> None:
    poll(
        lambda: _condition(_get(baton, "clusterqueue", CLUSTER_QUEUE), "Active").get("status")
        == "True",
        timeout=60, what="the ClusterQueue Active", diag=kueue.tail,
    )  # fmt: skip


def _wait_succeeded(baton: Baton, kueue: Kueue, job: str) -> dict[str, Any]:
    def succeeded() -> bool:
        status = _job_status(baton, job)
        assert status.get("phase") != "Failed", (
            f"job Failed: {status.get('message')}{_diag(baton, kueue, job)}"
        )
        return status.get("phase") == "Succeeded"

    poll(succeeded, timeout=240, what="phase Succeeded", diag=lambda: _diag(baton, kueue, job))
    return _job_status(baton, job)


def test_kueue_admits_both_ranks_together_once_the_quota_fits(baton: Baton, kueue: Kueue) -> None:
    job = unique("tj-kueue")
    try:
        _queued_job_waits_for_quota_then_trains(baton, kueue, job)
    finally:
        # A job left behind (the test failed) must not keep pods in later tests' way.
        baton.cluster.kubectl(
            "delete", "trainingjob", job, "-n", NAMESPACE, "--ignore-not-found", "--wait=false"
        )


def _queued_job_waits_for_quota_then_trains(baton: Baton, kueue: Kueue, job: str) -> None:
    def diag() -> str:
        return _diag(baton, kueue, job)

    _apply(baton, _queues(gpus=1))
    _wait_active(baton, kueue)
    _submit_queued(baton, job, steps=STEPS, every=4, sleep=0.1)

    # Both pods exist, gated; Kueue composed their group's Workload and found no room for it.
    def refused() -> bool:
        wls = _workloads(baton, job)
        return (
            len(_pods(baton, job)) == 2
            and len(wls) == 1
            and bool(_condition(wls[0], "QuotaReserved").get("reason") == "Pending")
        )

    poll(refused, timeout=120, what="the Workload refused for quota", diag=diag)
    (workload,) = _workloads(baton, job)
    assert workload["metadata"]["name"] == f"{job}-a0", diag()
    pending = _condition(workload, "QuotaReserved")
    assert pending["status"] == "False", diag()
    assert "insufficient quota for nvidia.com/gpu" in pending["message"], diag()
    assert _condition(workload, "Admitted").get("status") != "True", diag()
    pods = _pods(baton, job)
    for pod in pods:
        assert GATE in (pod["spec"].get("schedulingGates") or []), diag()
        assert not pod["spec"].get("nodeName"), f"{pod['metadata']['name']} bound{diag()}"
        assert "kueue.x-k8s.io/managed" in pod["metadata"].get("finalizers", []), diag()
    assert not (baton.workdir / job / "loss.log").exists(), "a rank trained" + diag()
    assert _job_status(baton, job).get("phase") == "Pending", diag()

    # Room for both: the Workload is admitted, both pods are ungated and bound, the job runs.
    _apply(baton, _queues(gpus=2)[1:2])
    poll(
        lambda: _condition(_workload(baton, f"{job}-a0"), "Admitted").get("status") == "True",
        timeout=90, what="the Workload admitted", diag=diag,
    )  # fmt: skip
    # One Workload holds both pods (one gang): admitted with 2 pods and 2 GPUs.
    admission = _workload(baton, f"{job}-a0")["status"]["admission"]["podSetAssignments"]
    assert sum(int(a["count"]) for a in admission) == 2, diag()
    assert sum(int(a["resourceUsage"]["nvidia.com/gpu"]) for a in admission) == 2, diag()

    status = _wait_succeeded(baton, kueue, job)
    assert (status["attempt"], status["failures"], status["preemptions"]) == (0, 0, 0), diag()
    assert baton.loss_steps(job) == list(range(1, STEPS + 1)), diag()
    pods = _pods(baton, job)
    assert len(pods) == 2, diag()
    for pod in pods:
        assert not pod["spec"].get("schedulingGates"), diag()
        assert pod["spec"].get("nodeName"), diag()
        assert pod["status"]["phase"] == "Succeeded", diag()
    # Kueue sees the group finish and gives its quota back.
    poll(
        lambda: _condition(_workload(baton, f"{job}-a0"), "Finished").get("status") == "True",
        timeout=60, what="the Workload Finished", diag=diag,
    )  # fmt: skip

    # Kueue's finalizer on the pods does not hold up the job's deletion.
    baton.cluster.kubectl("delete", "trainingjob", job, "-n", NAMESPACE, "--wait=false")
    poll(lambda: _pods(baton, job) == [], timeout=90, what="the job's pods gone", diag=diag)


def test_kueue_eviction_checkpoints_and_the_next_attempt_queues_again(
    baton: Baton, kueue: Kueue
) -> None:
    # Every eviction keeps its nodes out of the next attempt (status.avoidNodes), and the
    # ranks take one node each: 2 nodes for the first attempt and 2 more for the next one.
    while len(baton.cluster.nodes()) < 4:
        baton.cluster.add_node()
    job = unique("tj-kevict")
    try:
        _evicted_job_checkpoints_and_resumes(baton, kueue, job)
    finally:
        baton.cluster.kubectl(
            "delete", "trainingjob", job, "-n", NAMESPACE, "--ignore-not-found", "--wait=false"
        )


def _evicted_job_checkpoints_and_resumes(baton: Baton, kueue: Kueue, job: str) -> None:
    """Kueue evicts the admitted Workload (deactivated here; a preemption takes the same path,
    with another reason): it marks both pods ``DisruptionTarget`` and deletes them. Baton takes
    that as a preemption: every rank commits one step, the next attempt's pods form a new
    group, hence a new Workload, admitted once the first one's quota is free, and the job
    resumes from the saved step with no step lost or trained twice."""

    def diag() -> str:
        return _diag(baton, kueue, job)

    steps = 40
    _apply(baton, _queues(gpus=2))
    _wait_active(baton, kueue)
    # 0.3 s a step: about 9 s of training left when the eviction comes, however loaded.
    _submit_queued(baton, job, steps=steps, every=5, sleep=0.3)
    log = baton.workdir / job / "loss.log"
    poll(
        lambda: log.exists() and len(log.read_text().splitlines()) >= 8,
        timeout=180, what="8 trained steps", diag=diag,
    )  # fmt: skip
    patch = json.dumps({"spec": {"active": False}})
    baton.cluster.kubectl(
        "patch", "workloads.kueue.x-k8s.io", f"{job}-a0", "-n", NAMESPACE, "--type", "merge",
        "-p", patch,
    )  # fmt: skip

    status = _wait_succeeded(baton, kueue, job)
    assert (status["attempt"], status["preemptions"], status["failures"]) == (1, 1, 0), diag()
    (entry,) = status["interruptions"]
    # Kueue sets the pods' DisruptionTarget and deletes them at once: the operator's notice
    # save ("disruption-target") or the ranks' own save on the SIGTERM that follows
    # ("eviction"), whichever comes first; either commits the step the ranks are at.
    assert entry["source"] in ("disruption-target", "eviction"), diag()
    assert entry["stepsLost"] == 0, diag()
    assert status["resumedFromStep"] >= 8, diag()
    assert status["resumedFromStep"] == entry["resumeStep"], diag()
    assert baton.loss_steps(job) == list(range(1, steps + 1)), "steps lost or redone" + diag()

    # The next attempt's group is a Workload of its own, admitted and run to the end.
    poll(
        lambda: _condition(_workload(baton, f"{job}-a1"), "Finished").get("status") == "True",
        timeout=60, what="the second Workload Finished", diag=diag,
    )  # fmt: skip
    for pod in _pods(baton, job):
        assert pod["metadata"]["labels"]["baton.dev/attempt"] == "1", diag()
    baton.cluster.kubectl("delete", "trainingjob", job, "-n", NAMESPACE, "--wait=false")
    poll(lambda: _pods(baton, job) == [], timeout=90, what="the job's pods gone", diag=diag)
