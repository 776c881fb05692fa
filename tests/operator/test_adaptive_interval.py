"""``checkpoint.everySeconds: auto``: Young's interval from the measured save cost and the
interruption rate over node time (the job's pool's, else the job's own, else a prior), within
bounds (interval.py), and how the ranks receive it.

The reconciler's use of it (recorded before the attempt's first pod, the same on every rank,
chosen afresh after a preemption) is in test_reconciler_hints.py.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from baton_operator.pure import interval, manifests
from baton_operator.pure.interval import (
    DEFAULT_SAVE_SECONDS,
    MAX_SECONDS,
    MIN_SECONDS,
    PRIOR_MTBI_SECONDS,
    Exposure,
    PoolLedger,
    choose,
    closed,
    opened,
    young_daly,
)
from baton_operator.pure.model import JobSpec
from baton_operator.pure.nodes import POOL_LABELS, ClusterView, node_pool
from baton_operator.pure.settings import OperatorConfig

HOUR = 3600.0


def test_the_formula_is_youngs_square_root() -> None:
    assert young_daly(30, 6 * HOUR) == pytest.approx(math.sqrt(2 * 30 * 6 * HOUR))
    assert young_daly(30, 6 * HOUR) == pytest.approx(1138.42, abs=0.01)
    # Four times the save cost or four times the MTBI: twice the interval.
    assert young_daly(120, 6 * HOUR) == pytest.approx(2 * young_daly(30, 6 * HOUR))
    assert young_daly(30, 24 * HOUR) == pytest.approx(2 * young_daly(30, 6 * HOUR))


@pytest.mark.parametrize(("save", "mtbi"), [(0, HOUR), (-1, HOUR), (10, 0), (10, -5)])
def test_the_formula_refuses_inputs_without_meaning(save: float, mtbi: float) -> None:
    with pytest.raises(ValueError, match="must both be > 0"):
        young_daly(save, mtbi)


def test_a_new_job_uses_the_default_save_cost_and_the_prior() -> None:
    choice = choose(save_seconds=None, seen=Exposure())
    assert choice.save_seconds == DEFAULT_SAVE_SECONDS
    assert not choice.save_measured
    assert (choice.source, choice.mtbi_seconds) == ("prior", PRIOR_MTBI_SECONDS)
    assert choice.seconds == round(young_daly(DEFAULT_SAVE_SECONDS, PRIOR_MTBI_SECONDS))
    assert choice.bounded is None
    # The prior is per node: a job on 4 nodes is interrupted 4 times as often.
    four = choose(save_seconds=None, seen=Exposure(), nodes=4)
    assert four.mtbi_seconds == PRIOR_MTBI_SECONDS / 4
    assert four.seconds == round(young_daly(DEFAULT_SAVE_SECONDS, PRIOR_MTBI_SECONDS / 4))


def test_repeated_preemptions_shorten_the_interval_and_a_quiet_pool_lengthens_it() -> None:
    measured = 20.0
    after = [
        choose(save_seconds=measured, seen=Exposure(node_seconds=2 * HOUR, interruptions=n))
        for n in range(5)
    ]
    assert [c.seconds for c in after] == sorted((c.seconds for c in after), reverse=True)
    assert len({c.seconds for c in after}) == 5, after
    quiet = [
        choose(save_seconds=measured, seen=Exposure(node_seconds=h * HOUR)).seconds
        for h in (0, 12, 48, 96)
    ]
    assert quiet == sorted(quiet)
    assert len(set(quiet)) == 4, quiet
    # The per-node MTBI is the node time seen plus the prior, shared among the interruptions,
    # and the job's is that over its nodes.
    c = choose(
        save_seconds=measured, seen=Exposure(node_seconds=2 * HOUR, interruptions=3), nodes=2
    )
    assert c.mtbi_seconds == pytest.approx((2 * HOUR + PRIOR_MTBI_SECONDS) / 4 / 2)
    assert c.seconds == round(young_daly(measured, c.mtbi_seconds))
    assert c.to_status(attempt=5) == {
        "seconds": c.seconds, "attempt": 5, "saveSeconds": 20.0, "saveMeasured": True,
        "mtbiSeconds": round(c.mtbi_seconds, 1), "source": "job", "interruptions": 3,
        "nodeSeconds": 2 * HOUR, "nodes": 2, "priorSeconds": PRIOR_MTBI_SECONDS,
    }  # fmt: skip


def test_the_bounds_hold_and_say_which_one_applied() -> None:
    fast = choose(save_seconds=0.5, seen=Exposure(node_seconds=HOUR, interruptions=50))
    assert young_daly(0.5, fast.mtbi_seconds) < MIN_SECONDS
    assert (fast.seconds, fast.bounded) == (MIN_SECONDS, "min")
    slow = choose(save_seconds=600, seen=Exposure(node_seconds=30 * 24 * HOUR))
    assert young_daly(600, slow.mtbi_seconds) > MAX_SECONDS
    assert (slow.seconds, slow.bounded) == (MAX_SECONDS, "max")
    for save in (0.01, 1, 10, 100, 1000, 10000):
        for n in (0, 1, 10, 1000):
            for observed in (0, HOUR, 1000 * HOUR):
                for nodes in (1, 64):
                    seen = Exposure(node_seconds=observed, interruptions=n)
                    s = choose(save_seconds=save, seen=seen, nodes=nodes).seconds
                    assert MIN_SECONDS <= s <= MAX_SECONDS


def test_a_zero_or_missing_save_time_is_not_a_measurement() -> None:
    assert not choose(save_seconds=0, seen=Exposure()).save_measured
    with pytest.raises(ValueError, match="interruptions"):
        choose(save_seconds=1, seen=Exposure(interruptions=-1))
    with pytest.raises(ValueError, match="nodes=0"):
        choose(save_seconds=1, seen=Exposure(), nodes=0)


def _job(**status: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "tj",
            "namespace": "team",
            "creationTimestamp": "2026-01-01T00:00:00Z",
        },
        "spec": {
            "replicas": 2,
            "template": {"spec": {"containers": [{"name": "trainer", "image": "t:1"}]}},
            "checkpoint": {"uri": "s3://b/tj", "everySeconds": "auto", "everySteps": 50},
        },
        "status": status,
    }


T0 = datetime(2026, 1, 1, tzinfo=UTC)
SPOT = "karpenter.sh/nodepool=spot"
OWN = "baton.dev/node-pool"


def _attempt(
    exposure: dict[str, Any] | None,
    *,
    start: float,
    hours: float,
    pools: list[str | None],
    interrupted: bool = True,
) -> dict[str, Any]:
    """``exposure`` after one attempt Running from ``start`` h for ``hours`` on nodes of
    ``pools`` (one entry per node)."""
    running = opened(exposure, since=T0 + timedelta(hours=start), node_pools=pools)
    end = T0 + timedelta(hours=start + hours)
    return closed(running, now=end, interrupted=interrupted)


def test_the_exposure_counts_node_time_and_interruptions_per_job_and_pool() -> None:
    running = opened(None, since=T0, node_pools=[SPOT, SPOT, None])
    assert running["current"] == {
        "since": "2026-01-01T00:00:00Z", "nodes": 3, "pools": [{"pool": SPOT, "nodes": 2}],
    }  # fmt: skip
    assert running["pool"] == SPOT
    assert (running["nodeSeconds"], running["interruptions"]) == (0, 0)
    done = closed(running, now=T0 + timedelta(hours=2), interrupted=True)
    assert done["current"] is None, "null: deleted by the status's merge patch"
    assert (done["nodeSeconds"], done["interruptions"]) == (3 * 2 * HOUR, 1)
    assert done["pools"] == [{"pool": SPOT, "nodeSeconds": 2 * 2 * HOUR, "interruptions": 1}]
    # A suspend or a success stops the clock without an interruption.
    again = _attempt(done, start=3, hours=1, pools=[SPOT], interrupted=False)
    assert (again["nodeSeconds"], again["interruptions"]) == (7 * HOUR, 1)
    assert again["pools"] == [{"pool": SPOT, "nodeSeconds": 5 * HOUR, "interruptions": 1}]
    # An attempt interrupted before it ran: no node time; the noticed node's pool counts it.
    early = closed(again, now=T0 + timedelta(hours=9), interrupted=True, noticed_pools=["p=b"])
    assert (early["nodeSeconds"], early["interruptions"]) == (7 * HOUR, 2)
    assert {p["pool"]: p["interruptions"] for p in early["pools"]} == {SPOT: 1, "p=b": 1}
    assert early["pool"] == SPOT, "the pool of the latest attempt that ran"
    # Closing what was never opened (an operator that restarted between the two) adds nothing.
    assert closed(early, now=T0 + timedelta(hours=99), interrupted=False) == early


def test_the_rate_is_over_time_so_a_long_job_is_not_undercounted() -> None:
    """25 preemptions, more than the history's 20, in 25 h on 2 nodes: the totals keep them."""
    exposure: dict[str, Any] | None = None
    for k in range(25):
        exposure = _attempt(exposure, start=k, hours=1, pools=[SPOT, SPOT])
    job = _job(exposure=exposure, replicas=2, lastCheckpoint={"seconds": 12.5})
    choice = interval.for_job(job, at=T0 + timedelta(hours=26))
    assert (choice.source, choice.pool) == ("job", SPOT)
    assert (choice.interruptions, choice.node_seconds) == (25, 50 * HOUR)
    assert choice.mtbi_seconds == pytest.approx((50 * HOUR + PRIOR_MTBI_SECONDS) / 26 / 2)
    assert choice.seconds == round(young_daly(12.5, choice.mtbi_seconds))


def test_a_pool_s_rate_counts_every_job_seen_on_it_running_attempts_included() -> None:
    ledger = PoolLedger()
    # Job a: preempted twice in 2 h on 2 spot nodes, then running again since 3 h.
    a = _attempt(None, start=0, hours=1, pools=[SPOT, SPOT])
    a = _attempt(a, start=1, hours=1, pools=[SPOT, SPOT])
    a = opened(a, since=T0 + timedelta(hours=3), node_pools=[SPOT, SPOT])
    ledger.observe(("ns", "a"), _job(exposure=a))
    # Job b: 10 quiet hours on 1 spot node, then 5 on another pool.
    b = _attempt(None, start=0, hours=10, pools=[SPOT], interrupted=False)
    b = _attempt(b, start=10, hours=5, pools=["p=other"], interrupted=False)
    ledger.observe(("ns", "b"), _job(exposure=b))
    ledger.observe(("ns", "c"), _job())  # nothing known yet
    at = T0 + timedelta(hours=4)
    assert ledger.totals(SPOT, now=at) == Exposure(
        node_seconds=(2 + 2 + 2 * 1 + 10) * HOUR, interruptions=2
    )
    assert ledger.totals("p=other", now=at) == Exposure(node_seconds=5 * HOUR)
    assert ledger.totals("p=none", now=at) == Exposure()
    # A new job on the spot pool (its nodeSelector names it) reads the pool's rate.
    new = _job()
    new["spec"]["template"]["spec"]["nodeSelector"] = {"karpenter.sh/nodepool": "spot"}
    choice = interval.for_job(new, at=at, pools=ledger)
    assert (choice.source, choice.pool, choice.interruptions) == ("pool", SPOT, 2)
    assert choice.node_seconds == 16 * HOUR
    ledger.forget(("ns", "b"))
    assert ledger.totals(SPOT, now=at).node_seconds == 6 * HOUR
    # Without a known pool (no label, no selector, no attempt run), the job's own: the prior.
    assert interval.for_job(_job(), at=at, pools=ledger).source == "prior"


def test_a_quiet_pool_gives_a_longer_interval_than_a_preempted_one() -> None:
    ledger = PoolLedger()
    quiet = _attempt(None, start=0, hours=48, pools=[f"{OWN}=quiet"] * 2, interrupted=False)
    ledger.observe(("ns", "quiet"), _job(exposure=quiet))
    busy: dict[str, Any] | None = None
    for k in range(12):  # preempted every hour: more often than the prior's 6 h
        busy = _attempt(busy, start=k, hours=1, pools=[f"{OWN}=busy"] * 2)
    ledger.observe(("ns", "busy"), _job(exposure=busy))
    at = T0 + timedelta(hours=48)

    def on(pool: str) -> interval.IntervalChoice:
        job = _job(lastCheckpoint={"seconds": 20.0})
        job["spec"]["template"]["spec"]["nodeSelector"] = {OWN: pool}
        return interval.for_job(job, at=at, pools=ledger)

    prior = interval.for_job(_job(lastCheckpoint={"seconds": 20.0}), at=at, pools=ledger)
    q, b = on("quiet"), on("busy")
    assert (q.source, b.source, prior.source) == ("pool", "pool", "prior")
    assert b.seconds < prior.seconds < q.seconds, (b, prior, q)


def test_a_job_an_older_operator_ran_reads_its_life_and_counts() -> None:
    job = _job(
        preemptions=2, failures=1, replicas=2, lastCheckpoint={"step": 40, "seconds": 12.5},
        attemptStartedAt="2026-01-01T03:00:00Z",
    )  # fmt: skip
    assert interval.job_exposure(job) == Exposure(node_seconds=2 * 3 * HOUR, interruptions=3)
    choice = interval.for_job(job, at=T0 + timedelta(hours=3))
    assert (choice.save_seconds, choice.save_measured) == (12.5, True)
    assert (choice.source, choice.interruptions, choice.nodes) == ("job", 3, 2)
    status = choice.to_status(attempt=3)
    assert status["attempt"] == 3
    assert status["seconds"] == choice.seconds
    job["status"]["checkpointInterval"] = status
    assert interval.recorded(job, 3) == choice.seconds
    assert interval.recorded(job, 4) is None, "a new attempt chooses afresh"


def test_node_pools_come_from_the_known_labels_first_match_wins() -> None:
    assert node_pool({"karpenter.sh/nodepool": "gpu", "baton.dev/node-pool": "x"}) == (
        "karpenter.sh/nodepool=gpu"
    )
    assert node_pool({"cloud.google.com/gke-nodepool": "a"}) == "cloud.google.com/gke-nodepool=a"
    assert node_pool({"eks.amazonaws.com/nodegroup": "g"}) == "eks.amazonaws.com/nodegroup=g"
    assert node_pool({"kubernetes.io/hostname": "n1"}) is None
    assert node_pool(None) is None
    assert POOL_LABELS[-1] == "baton.dev/node-pool"
    view = ClusterView(config=OperatorConfig())
    view.update_node({"metadata": {"name": "n1", "labels": {"baton.dev/node-pool": "p"}}},
                     now=T0)  # fmt: skip
    assert view.pool_of("n1") == "baton.dev/node-pool=p"
    view.update_node({"metadata": {"name": "n1", "labels": {}}}, now=T0)
    assert view.pool_of("n1") is None


def test_auto_gives_the_ranks_the_chosen_interval_and_keeps_every_steps() -> None:
    spec = JobSpec.from_body(_job())
    assert spec.auto_interval
    assert spec.every_seconds is None
    kw: dict[str, Any] = {
        "attempt": 0,
        "rank": 0,
        "replicas": 2,
        "master_addr": None,
        "resume_step": None,
    }
    with pytest.raises(ValueError, match="everySeconds is auto: pass the interval"):
        manifests.pod_manifest(spec, OperatorConfig(), **kw)
    pod = manifests.pod_manifest(spec, OperatorConfig(), every_seconds=321, **kw)
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["BATON_EVERY_SECONDS"] == "321"
    assert env["BATON_EVERY_STEPS"] == "50"
    fixed = JobSpec.from_body(
        {**_job(), "spec": {**_job()["spec"], "checkpoint": {"uri": "s3://b", "everySeconds": 90}}}
    )
    assert not fixed.auto_interval
    pod = manifests.pod_manifest(fixed, OperatorConfig(), **kw)
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["BATON_EVERY_SECONDS"] == "90"


def test_the_prior_is_an_operator_setting_that_reaches_the_choice() -> None:
    """``--interval-prior-seconds`` (default: :data:`PRIOR_MTBI_SECONDS`, 6 h) is the node
    time assumed per interruption: a small one lets a short quiet time lengthen the interval."""
    from baton_operator.__main__ import _config, _parser

    assert OperatorConfig().interval_prior_seconds == PRIOR_MTBI_SECONDS == 6 * HOUR
    args = _parser().parse_args(["run", "--interval-prior-seconds", "30"])
    assert _config(args).interval_prior_seconds == 30.0
    with pytest.raises(ValueError, match="--interval-prior-seconds"):
        OperatorConfig(interval_prior_seconds=0)
    job = {"spec": {"replicas": 2}, "status": {"lastCheckpoint": {"seconds": 600.0}}}
    prior = interval.for_job(job, at=datetime.now(tz=UTC), prior_seconds=30)
    assert (prior.source, prior.mtbi_seconds) == ("prior", 15.0)
    assert prior.to_status(0)["priorSeconds"] == 30
    # 60 s of quiet node time (2 nodes x 30 s) outweigh a 30 s prior: a longer interval.
    quiet = choose(save_seconds=600.0, seen=Exposure(node_seconds=60), nodes=2, prior_seconds=30)
    assert quiet.mtbi_seconds == 45.0
    assert quiet.seconds > prior.seconds
    assert quiet.bounded is None
    assert prior.bounded is None
    with pytest.raises(ValueError, match="prior_seconds"):
        choose(save_seconds=None, seen=Exposure(), prior_seconds=0)
