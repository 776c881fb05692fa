"""Gang scheduling (a PodGroup per attempt, shrinking to ``minReplicas``), tick by tick against
the fakes of ``baton_testing.reconciler_fakes`` (for real: test_gang_cluster.py)."""

from __future__ import annotations

from typing import Any, cast

from baton_operator.client.metrics import Metrics
from baton_operator.pure.errors import KubeError
from baton_operator.pure.reports import SidecarStatus
from baton_operator.pure.settings import OperatorConfig
from baton_operator.reconcile.controller import Reconciler
from baton_testing.reconciler_fakes import JOB, NS, REPLICAS, Harness
from prometheus_client import CollectorRegistry

GANG = OperatorConfig(gang_scheduling=True)
MASTER_NAME = f"{JOB}-a{{attempt}}-r0.{JOB}.{NS}.svc.cluster.local"


def _gang(h: Harness) -> None:
    """The API server serves scheduling.k8s.io/v1beta1 PodGroups (none exist yet)."""
    h.kube.pod_groups = {}
    for i in range(REPLICAS):
        h.node(f"n{i}")


def _assert_gang_attempt(h: Harness, attempt: int) -> None:
    """The attempt's PodGroup (all ranks, owned by the job) and every rank linked to it, all
    of them rendezvousing at rank 0's DNS name."""
    assert h.kube.pod_groups is not None
    group = h.kube.pod_groups[f"{JOB}-a{attempt}"]
    assert group["apiVersion"] == "scheduling.k8s.io/v1beta1"
    assert group["kind"] == "PodGroup"
    assert group["spec"] == {"schedulingPolicy": {"gang": {"minCount": REPLICAS}}}
    assert group["metadata"]["namespace"] == NS
    assert group["metadata"]["labels"]["baton.dev/attempt"] == str(attempt)
    assert [(o["kind"], o["uid"]) for o in group["metadata"]["ownerReferences"]] == [
        ("TrainingJob", "uid-1")
    ]
    master = MASTER_NAME.format(attempt=attempt)
    for rank in range(REPLICAS):
        pod = h.kube.pods[h.pod(attempt, rank)]
        assert pod["spec"]["schedulingGroup"] == {"podGroupName": f"{JOB}-a{attempt}"}
        assert (pod["spec"]["hostname"], pod["spec"]["subdomain"]) == (h.pod(attempt, rank), JOB)
        env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
        for name in ("MASTER_ADDR", "PET_MASTER_ADDR"):
            assert env[name] == {"name": name, "value": master}
    assert h.kube.status["masterAddr"] == master


def test_a_gang_attempt_creates_its_pod_group_then_every_rank_in_one_pass() -> None:
    h = Harness(config=GANG)
    _gang(h)
    h.tick()  # Secret, Service, Pending
    h.tick()
    # No pod has an IP (none is bound): every rank exists anyway, after the group.
    assert h.kube.created == [f"podgroup/{JOB}-a0", *(h.pod(0, r) for r in range(REPLICAS))]
    _assert_gang_attempt(h, 0)
    h.tick()
    assert len(h.kube.created) == 1 + REPLICAS, "nothing is created twice"
    assert h.kube.discoveries == 1, "the served APIs are discovered once, then cached"
    for rank in range(REPLICAS):
        h.kube.run(h.pod(0, rank), node=f"n{rank}", ip=f"10.0.0.{rank + 1}")
        h.sidecars.reports[f"10.0.0.{rank + 1}"] = SidecarStatus(state="idle")
    h.tick()
    assert h.kube.status["phase"] == "Running"
    assert h.kube.deleted_groups == []


def test_a_restart_drops_the_old_attempts_pod_group_and_gangs_the_new_one() -> None:
    h = Harness(config=GANG)
    _gang(h)
    h.tick()
    h.tick()
    for rank in range(REPLICAS):
        h.kube.run(h.pod(0, rank), node=f"n{rank}", ip=f"10.0.0.{rank + 1}")
        h.sidecars.reports[f"10.0.0.{rank + 1}"] = SidecarStatus(state="idle")
    h.tick()
    h.spot_notice("n1")
    h.tick()
    h.report_all(state="committed", step=40, trigger="notice", uri="s3://bucket/tj", seconds=1.5)
    h.tick()
    assert h.kube.status["phase"] == "Restarting"
    # The old attempt's pods and its gang go together (the group's finalizer keeps it
    # until the pods are gone).
    assert h.kube.deleted_groups == [f"{JOB}-a0"]
    assert "masterAddr" not in h.kube.status
    h.tick()  # Restarting -> Pending: the new attempt, all at once
    assert h.kube.status["phase"] == "Pending"
    _assert_gang_attempt(h, 1)
    for rank in range(REPLICAS):
        h.kube.run(h.pod(1, rank), node=f"n{rank}", ip=f"10.0.1.{rank + 1}")
        pod = h.kube.pods[h.pod(1, rank)]
        pod["status"]["phase"] = "Succeeded"
        pod["status"]["containerStatuses"][0]["state"] = {"terminated": {"exitCode": 0}}
    h.tick()
    assert h.kube.status["phase"] == "Succeeded"
    assert h.tick() is None
    assert h.kube.deleted_groups == [f"{JOB}-a0", f"{JOB}-a1"], "a finished gang goes too"
    assert h.kube.discoveries == 1


def test_a_suspend_drops_the_gang_and_the_unsuspended_attempt_gets_a_new_one() -> None:
    h = Harness(config=GANG)
    _gang(h)
    h.tick()
    h.tick()
    _assert_gang_attempt(h, 0)
    h.suspend(True)  # Pending, nothing trained: stops at once
    h.tick()
    assert h.kube.status["phase"] == "Suspended"
    assert h.kube.deleted_groups == [f"{JOB}-a0"]
    h.suspend(False)
    h.tick()
    assert h.kube.status["phase"] == "Pending"
    _assert_gang_attempt(h, 1)


def test_without_the_pod_group_api_rank_0_comes_first_and_its_ip_is_the_master() -> None:
    h = Harness(config=GANG)  # the fake serves no scheduling.k8s.io/v1beta1
    h.tick()
    h.tick()
    assert h.kube.created == [h.pod(0, 0)], "the others wait for rank 0's IP"
    h.tick()
    assert h.kube.created == [h.pod(0, 0)]
    h.kube.run(h.pod(0, 0), node="n0", ip="10.0.0.1")
    h.tick()
    assert h.kube.created == [h.pod(0, r) for r in range(REPLICAS)]
    assert h.kube.status["masterAddr"] == "10.0.0.1"
    for rank in range(REPLICAS):
        pod = h.kube.pods[h.pod(0, rank)]
        assert "schedulingGroup" not in pod["spec"]
        if rank:
            assert h.env_of(0, rank)["MASTER_ADDR"] == "10.0.0.1"
    assert h.kube.discoveries == 1


def test_gang_scheduling_off_never_asks_for_the_api() -> None:
    h = Harness(config=OperatorConfig(gang_scheduling=False))
    _gang(h)
    h.tick()
    h.tick()
    assert h.kube.created == [h.pod(0, 0)]
    assert h.kube.pod_groups == {}
    assert h.kube.discoveries == 0


def test_an_attempt_begun_without_a_pod_group_ends_the_way_it_began() -> None:
    """An operator upgraded (or switched on) mid-attempt finds rank 0 without a group: the
    attempt keeps the rank-0-first path; a gang of n whose rank 0 is outside it never binds."""
    h = Harness(config=OperatorConfig(gang_scheduling=False))
    h.tick()
    h.tick()
    assert h.kube.created == [h.pod(0, 0)]
    served = Harness(config=GANG)
    served.kube = h.kube
    served.memory = h.memory
    served.reconciler = Reconciler(
        kube=cast(Any, h.kube), sidecars=cast(Any, h.sidecars), cluster=h.cluster,
        metrics=Metrics(CollectorRegistry()), config=GANG, post_event=_no_event,
        token_for=lambda spec: "token",
    )  # fmt: skip
    _gang(served)
    served.tick()
    assert served.kube.created == [h.pod(0, 0)]
    served.kube.run(h.pod(0, 0), node="n0", ip="10.0.0.1")
    served.tick()
    assert served.kube.created == [h.pod(0, r) for r in range(REPLICAS)]
    assert served.kube.pod_groups == {}
    assert served.kube.status["masterAddr"] == "10.0.0.1"


async def _no_event(job: Any, kind: str, reason: str, message: str) -> None:
    return None


def test_a_refused_pod_group_fails_the_job_naming_it() -> None:
    h = Harness(config=GANG)
    _gang(h)
    h.tick()

    async def refuse(namespace: str, body: dict[str, Any]) -> bool:
        raise KubeError.from_answer(
            "creating PodGroup team/tj-a0: HTTP 422: PodGroup.scheduling.k8s.io \"tj-a0\" is "
            "invalid: spec.schedulingPolicy.gang.minCount: Invalid value",
            status=422, fields=("spec.schedulingPolicy.gang.minCount",),
        )  # fmt: skip

    h.kube.create_pod_group = refuse  # type: ignore[method-assign]
    h.tick()
    assert h.kube.status["phase"] == "Failed"
    assert h.kube.condition("Failed")["reason"] == "PodGroupRejected"
    assert "spec.schedulingPolicy.gang.minCount" in h.kube.status["message"]
    assert h.kube.created == [], "no rank is created without its gang"


def test_a_gang_that_does_not_fit_shrinks_one_replica_at_a_time_to_min_replicas() -> None:
    """A gang binds all or none, so "how many could be placed" is unknown: each elastic step
    tries one replica fewer (not straight to minReplicas), and that attempt is a gang too."""
    h = Harness(config=GANG)
    h.kube.job["spec"].update(minReplicas=1, elasticWaitSeconds=0)
    _gang(h)
    h.tick()
    h.tick()
    for rank in range(REPLICAS):
        h.kube.pods[h.pod(0, rank)]["status"] = {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}],
        }
    h.tick()  # unschedulableSince
    h.tick()  # the wait (0 s) is over: shrink
    status = h.kube.status
    assert (status["phase"], status["restartReason"]) == ("Restarting", "elastic"), status
    assert status["replicas"] == REPLICAS - 1
    assert "a gang: none is bound until all fit" in status["message"]
    assert h.kube.deleted_groups == [f"{JOB}-a0"]
    h.tick()  # the old pods are gone: the smaller attempt, as a gang of its own
    group = (h.kube.pod_groups or {})[f"{JOB}-a1"]
    assert group["spec"]["schedulingPolicy"]["gang"]["minCount"] == REPLICAS - 1
    assert sorted(n for n in h.kube.pods if "-a1-" in n) == [h.pod(1, r) for r in range(2)]
