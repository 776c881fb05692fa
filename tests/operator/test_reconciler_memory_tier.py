"""The memory tier's recovery from a lost node (replace only the lost pod, restart the
survivors in place), tick by tick against the fakes of ``baton_testing.reconciler_fakes`` (for
real: test_memory_tier_cluster.py)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from baton_operator.pure import manifests
from baton_operator.pure.reports import SidecarStatus
from baton_testing.reconciler_fakes import REPLICAS, Harness


def _lose_rank1_and_recover(h: Harness, *, tier: str) -> dict[str, Any]:
    h.use_memory_tier()
    h.running()
    kept_uids = {r: h.kube.pods[h.pod(0, r)]["metadata"]["uid"] for r in (0, 2)}
    h.node("n1", ready=False, for_seconds=h.config.node_lost_seconds + 1)
    h.restarted_in_place(h.pod(0, 0), 1)
    h.restarted_in_place(h.pod(0, 2), 1)
    h.tick()
    status = h.kube.status
    assert (status["phase"], status["attempt"], status["failures"]) == ("Running", 0, 1)
    recovery = status["recovery"]
    assert [(e["rank"], e["pod"], e["node"]) for e in recovery["replaced"]] == [
        (1, h.pod(0, 1), "n1")
    ]
    assert recovery["kept"] == [h.pod(0, 0), h.pod(0, 2)]
    assert "n1" in status["avoidNodes"]
    assert status["interruptions"][-1]["source"] == "node-lost"
    assert h.kube.deleted == [(h.pod(0, 1), 0)], "only the lost pod goes, at once"
    assert ("Warning", "Recovering") in [(k, r) for k, r, _ in h.events]
    h.tick()  # the replacement: the same name, the same attempt, no schedulingGroup
    assert h.kube.created.count(h.pod(0, 1)) == 2
    body = h.kube.pods[h.pod(0, 1)]
    assert body["metadata"]["labels"][manifests.ATTEMPT_LABEL] == "0"
    assert "n1" in str(body["spec"]["affinity"]), "the replacement avoids the lost node"
    trainer_env = {e["name"]: e.get("value") for e in body["spec"]["containers"][0]["env"]}
    assert trainer_env["MASTER_ADDR"] == status["masterAddr"]
    h.kube.run(h.pod(0, 1), node="n3", ip="10.0.0.9")
    h.node("n3")
    h.tick()
    assert h.kube.status.get("recovery"), "no rank has reported its restore yet"
    h.restored(["10.0.0.1", "10.0.0.9", "10.0.0.3"], step=7, tier=tier)
    h.tick()
    status = h.kube.status
    assert "recovery" not in status
    assert {r: h.kube.pods[h.pod(0, r)]["metadata"]["uid"] for r in (0, 2)} == kept_uids
    assert status["trainerRestarts"] == {h.pod(0, 0): 1, h.pod(0, 1): 0, h.pod(0, 2): 1}
    assert (status["attempt"], status["failures"], status["resumedFromStep"]) == (0, 1, 7)
    assert status["interruptions"][-1]["resumeStep"] == 7
    h.tick()  # the survivors' in-place restarts were the recovery's: no failure
    assert (h.kube.status["attempt"], h.kube.status["failures"]) == (0, 1)
    return status


def test_a_lost_node_with_the_memory_tier_replaces_only_its_pod() -> None:
    h = Harness(maxFailures=2)
    status = _lose_rank1_and_recover(h, tier="memory")
    last = status["lastRecovery"]
    assert (last["tier"], last["restoredStep"]) == ("memory", 7)
    assert h.kube.condition("Recovering")["status"] == "False"
    assert any(k == "Normal" and r == "Recovered" and "memory tier" in m for k, r, m in h.events)


def test_a_recovery_the_memory_tier_cannot_cover_says_it_used_the_durable_tier() -> None:
    h = Harness(maxFailures=2)
    status = _lose_rank1_and_recover(h, tier="durable")
    assert status["lastRecovery"]["tier"] == "durable"
    assert h.kube.condition("Recovering")["reason"] == "RecoveredFromDurable"
    warning = [m for k, r, m in h.events if (k, r) == ("Warning", "RecoveredFromDurable")]
    assert warning
    assert "durable tier" in warning[0]
    assert "step 7" in warning[0]


def test_rank_0_lost_while_ranks_reach_it_by_ip_starts_a_new_attempt() -> None:
    h = Harness(maxFailures=2)
    h.use_memory_tier()
    h.running()
    assert h.kube.status["masterAddr"] == "10.0.0.1"
    h.node("n0", ready=False, for_seconds=h.config.node_lost_seconds + 1)
    h.tick()
    status = h.kube.status
    assert (status["phase"], status["attempt"], status["failures"]) == ("Restarting", 1, 1)
    assert "recovery" not in status


def test_rank_0_lost_on_the_gang_path_is_replaced_under_its_dns_name() -> None:
    h = Harness(maxFailures=2)
    h.kube.pod_groups = {}
    h.use_memory_tier()
    for i in range(REPLICAS):
        h.node(f"n{i}")
    h.tick()
    h.tick()
    for rank in range(REPLICAS):
        h.kube.run(h.pod(0, rank), node=f"n{rank}", ip=f"10.0.0.{rank + 1}")
        h.sidecars.reports[f"10.0.0.{rank + 1}"] = SidecarStatus(state="idle")
    h.tick()
    master = h.kube.status["masterAddr"]
    assert master.startswith(h.pod(0, 0) + ".")
    h.node("n0", ready=False, for_seconds=h.config.node_lost_seconds + 1)
    h.tick()
    assert [e["rank"] for e in h.kube.status["recovery"]["replaced"]] == [0]
    h.tick()
    body = h.kube.pods[h.pod(0, 0)]
    assert "schedulingGroup" not in body["spec"], "the gang was admitted already"
    env = {e["name"]: e.get("value") for e in body["spec"]["containers"][0]["env"]}
    assert env["MASTER_ADDR"] == master


def test_a_trainer_restarted_in_place_without_a_node_loss_is_a_failure() -> None:
    h = Harness(maxFailures=2)
    h.use_memory_tier()
    h.running()
    h.restarted_in_place(h.pod(0, 2), 1, last_exit=3)
    h.tick()
    # A survivor restarts before its peer's node looks lost: not counted yet.
    assert (h.kube.status["attempt"], h.kube.status["failures"]) == (0, 0)
    assert h.memory.restart_seen_at is not None
    h.memory.restart_seen_at -= timedelta(
        seconds=h.config.node_lost_seconds + 61  # past lifecycle.restart_grace_seconds
    )
    h.tick()
    status = h.kube.status
    assert (status["phase"], status["attempt"], status["failures"]) == ("Restarting", 1, 1)
    assert "exited with code 3 and was restarted in place 1 time(s)" in status["message"]


def test_a_crash_loop_during_a_recovery_gives_it_up_for_a_new_attempt() -> None:
    h = Harness(maxFailures=3)
    h.use_memory_tier()
    h.running()
    h.node("n1", ready=False, for_seconds=h.config.node_lost_seconds + 1)
    h.tick()
    assert h.kube.status["recovery"]
    h.restarted_in_place(h.pod(0, 2), 4)
    h.tick()
    status = h.kube.status
    assert (status["phase"], status["attempt"], status["failures"]) == ("Restarting", 1, 2)
    assert "recovery" not in status
    assert any(r == "RecoveryFailed" and "crash loop" in m for _, r, m in h.events)


def test_without_the_memory_tier_a_lost_node_still_starts_a_new_attempt() -> None:
    h = Harness(maxFailures=2)
    h.running()
    h.node("n1", ready=False, for_seconds=h.config.node_lost_seconds + 1)
    h.tick()
    status = h.kube.status
    assert (status["phase"], status["attempt"], status["failures"]) == ("Restarting", 1, 1)
    assert "recovery" not in status


def test_a_second_node_lost_during_a_recovery_joins_it_while_a_survivor_remains() -> None:
    h = Harness(maxFailures=2)
    h.use_memory_tier()
    h.running()
    h.node("n1", ready=False, for_seconds=h.config.node_lost_seconds + 1)
    h.tick()
    h.node("n2", ready=False, for_seconds=h.config.node_lost_seconds + 1)
    h.tick()
    status = h.kube.status
    recovery = status["recovery"]
    assert [e["rank"] for e in recovery["replaced"]] == [1, 2]
    assert (recovery["kept"], recovery["nodes"]) == ([h.pod(0, 0)], ["n1", "n2"])
    assert (status["attempt"], status["failures"]) == (0, 1), "one recovery, counted once"
    assert status["interruptions"][-1]["nodes"] == ["n1", "n2"]
    assert (h.pod(0, 2), 0) in h.kube.deleted
    h.tick()
    assert h.kube.created.count(h.pod(0, 1)) == h.kube.created.count(h.pod(0, 2)) == 2
    # The last survivor lost too: nothing is left to keep, a new attempt.
    h.node("n0", ready=False, for_seconds=h.config.node_lost_seconds + 1)
    h.tick()
    status = h.kube.status
    assert (status["phase"], status["attempt"], status["failures"]) == ("Restarting", 1, 2)
    assert "recovery" not in status
