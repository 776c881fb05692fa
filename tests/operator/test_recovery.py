"""The pure parts of the memory tier's recovery: which pods it replaces, the trainer's restart
rules, and in-place restarts read from the pod (the reconciler's side is in
test_reconciler_memory_tier.py, the real thing in test_recovery_cluster.py)."""

from __future__ import annotations

from typing import Any

from baton_operator.pure import lifecycle, manifests
from baton_operator.pure.lifecycle import RankView
from baton_operator.pure.model import JobSpec
from baton_operator.pure.pods import PodView, restarted
from baton_operator.pure.settings import EMERGENCY_EXIT_CODE, OperatorConfig


def _views(**changes: dict[str, Any]) -> list[RankView]:
    """Three running ranks on n0..n2; ``r1={"node_lost": True}`` changes rank 1."""
    out = []
    for rank in range(3):
        fields: dict[str, Any] = {"rank": rank, "pod": f"j-a0-r{rank}", "node": f"n{rank}",
                                  "running": True, "phase": "Running"}  # fmt: skip
        fields.update(changes.get(f"r{rank}", {}))
        out.append(RankView(**fields))
    return out


def test_the_lost_ranks_are_replaced_and_the_others_kept() -> None:
    plan, why = lifecycle.plan_recovery(
        _views(r1={"node_lost": True}, r2={"exists": False}), memory_tier=True,
        master_is_name=False,
    )  # fmt: skip
    assert plan is not None, why
    assert (plan.replace, plan.keep, plan.nodes) == ((1, 2), (0,), ("n1",))


def test_a_recovery_is_declined_with_the_reason() -> None:
    lost = {"node_lost": True}
    cases = [
        (_views(r1=lost), False, True, "no memory tier"),
        (_views(), True, True, "no pod was lost"),
        (_views(r0=lost, r1=lost, r2=lost), True, True, "no survivor"),
        (_views(r1=lost, r2={"exit_code": 0}), True, True, "rank 2 (pod j-a0-r2) exited"),
        (_views(r1=lost, r2={"disrupted": True}), True, True, "given notice"),
        (_views(r0=lost), True, False, "pod IP"),
    ]
    for views, tier, named, reason in cases:
        plan, why = lifecycle.plan_recovery(views, memory_tier=tier, master_is_name=named)
        assert plan is None, reason
        assert reason in why, (reason, why)
    plan, _ = lifecycle.plan_recovery(_views(r0=lost), memory_tier=True, master_is_name=True)
    assert plan is not None
    assert plan.replace == (0,)


def test_an_in_place_restart_waits_past_the_node_monitor_grace() -> None:
    assert lifecycle.restart_grace_seconds(20) == 20 + lifecycle.NODE_NOT_READY_SECONDS


def _spec(**checkpoint: Any) -> JobSpec:
    return JobSpec.from_body(
        {
            "metadata": {"name": "j", "namespace": "ml"},
            "spec": {
                "replicas": 2,
                "template": {"spec": {"containers": [{"name": "trainer", "image": "t:1"}]}},
                "checkpoint": {"uri": "s3://b/p", **checkpoint},
            },
        }
    )


def _trainer(spec: JobSpec) -> dict[str, Any]:
    pod = manifests.pod_manifest(
        spec, OperatorConfig(), attempt=0, rank=1, replicas=2, master_addr="10.0.0.1",
        resume_step=None,
    )  # fmt: skip
    assert pod["spec"]["restartPolicy"] == "Never"
    return next(c for c in pod["spec"]["containers"] if c["name"] == "trainer")


def test_a_memory_tier_trainer_restarts_in_place_except_after_success_or_a_notice_save() -> None:
    trainer = _trainer(_spec(fastEverySteps=1, fastSizeLimit="64Mi"))
    assert trainer["restartPolicy"] == "Never"
    assert trainer["restartPolicyRules"] == [
        {"action": "Restart", "exitCodes": {"operator": "NotIn", "values": [0, 75]}}
    ]
    assert EMERGENCY_EXIT_CODE == 75
    plain = _trainer(_spec())
    assert "restartPolicy" not in plain
    assert "restartPolicyRules" not in plain


def _pod(name: str, restarts: int, last_exit: int | None) -> PodView:
    status: dict[str, Any] = {"name": "trainer", "state": {"running": {}},
                              "restartCount": restarts}  # fmt: skip
    if last_exit is not None:
        status["lastState"] = {"terminated": {"exitCode": last_exit}}
    return PodView.from_body(
        {
            "metadata": {
                "name": name,
                "uid": f"u-{name}",
                "labels": {manifests.RANK_LABEL: name[-1]},
            },
            "status": {"phase": "Running", "containerStatuses": [status]},
        }
    )


def test_in_place_restarts_beyond_those_explained_are_found() -> None:
    a, b, c = _pod("j-a0-r0", 0, None), _pod("j-a0-r1", 2, 1), _pod("j-a0-r2", 1, 3)
    assert (b.uid, b.trainer_restarts, b.trainer_last_exit, b.trainer_running) == (
        "u-j-a0-r1", 2, 1, True,
    )  # fmt: skip
    assert b.trainer_exit_code is None, "a restarted trainer has not ended"
    assert restarted([a, b, c], {"j-a0-r1": 2}) == [c]
    assert [p.name for p in restarted([c, b, a], {})] == ["j-a0-r1", "j-a0-r2"]
