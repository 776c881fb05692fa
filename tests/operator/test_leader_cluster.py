"""Leader election on a real Lease (the local cluster's API server), in one process.

Two :class:`LeaderElector` s race for one Lease: exactly one holds it; a holder that stops
renewing (as after ``kill -9``) is replaced once its Lease has not changed for the lease
duration by the standby's own clock; the same identity takes its Lease back at once; a
released Lease is taken without waiting; and an active elector whose Lease was taken raises
instead of carrying on. Times are printed, never asserted.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from baton_operator.client import faults
from baton_operator.client.leader import (
    LeaderElector,
    LeadershipLostError,
    LeaseClient,
    LeaseTimings,
)
from baton_operator.client.metrics import Health
from baton_testing.cluster import LocalCluster

pytestmark = pytest.mark.cluster

TIMINGS = LeaseTimings(duration=3, renew=0.5, retry=0.25, renew_deadline=2.0)


@pytest.fixture
def lease(local_cluster: LocalCluster) -> tuple[LocalCluster, str, str]:
    namespace = "baton-leader-test"
    local_cluster.kubectl("create", "namespace", namespace, check=False)
    return local_cluster, namespace, f"lease-{uuid.uuid4().hex[:6]}"


def _elector(lease: tuple[LocalCluster, str, str], identity: str) -> LeaderElector:
    cluster, namespace, name = lease
    client = LeaseClient(cluster.api, namespace=namespace, name=name, timeout=10.0)
    return LeaderElector(client, identity=identity, timings=TIMINGS)


def _holder(lease: tuple[LocalCluster, str, str]) -> dict[str, Any]:
    cluster, namespace, name = lease
    client = LeaseClient(cluster.api, namespace=namespace, name=name, timeout=10.0)
    found = asyncio.run(client.get())
    assert found is not None
    spec: dict[str, Any] = found["spec"]
    return spec


def test_one_holder_and_a_standby_that_takes_over_a_silent_lease(
    lease: tuple[LocalCluster, str, str],
) -> None:
    a, b = _elector(lease, "a"), _elector(lease, "b")

    async def run() -> float:
        assert await a.try_acquire_or_renew()
        assert not await b.try_acquire_or_renew(), "two holders at once"
        assert await a.try_acquire_or_renew(), "the holder renews"
        assert not await b.try_acquire_or_renew()
        # a goes silent (kill -9): b takes over only after a whole duration of silence.
        silent = time.monotonic()
        await asyncio.wait_for(b.acquire(), timeout=60)
        return time.monotonic() - silent

    took = asyncio.run(run())
    print(f"standby took a silent Lease after {took:.1f}s (duration {TIMINGS.duration}s)")
    assert took >= TIMINGS.duration - TIMINGS.retry, "taken while the holder was still live"
    spec = _holder(lease)
    assert spec["holderIdentity"] == "b"
    assert spec["leaseTransitions"] == 1
    assert spec["leaseDurationSeconds"] == TIMINGS.duration


def test_a_restarted_holder_takes_its_own_lease_back_at_once(
    lease: tuple[LocalCluster, str, str],
) -> None:
    first = _elector(lease, "op-0")

    async def run() -> None:
        assert await first.try_acquire_or_renew()
        # The same identity in a new process (a container restarted after kill -9): a new
        # elector that has never seen the Lease acquires it on its first try.
        again = _elector(lease, "op-0")
        assert await again.try_acquire_or_renew()
        assert not await _elector(lease, "op-1").try_acquire_or_renew()

    asyncio.run(run())
    assert _holder(lease)["leaseTransitions"] == 0


def test_a_released_lease_is_taken_without_waiting(lease: tuple[LocalCluster, str, str]) -> None:
    a, b = _elector(lease, "a"), _elector(lease, "b")

    async def run() -> None:
        assert await a.try_acquire_or_renew()
        await a.release()
        assert not a.leading
        assert await b.try_acquire_or_renew(), "a released Lease must be free at once"

    asyncio.run(run())
    assert _holder(lease)["holderIdentity"] == "b"


def test_an_active_elector_whose_lease_was_taken_stops(
    lease: tuple[LocalCluster, str, str],
) -> None:
    a = _elector(lease, "a")

    async def run() -> None:
        assert await a.try_acquire_or_renew()
        keeping = asyncio.create_task(a.keep())
        # Someone else writes the Lease (an operator that judged a silent; here by force).
        cluster, namespace, name = lease
        cluster.kubectl(
            "patch", "lease", name, "-n", namespace, "--type=merge",
            "-p", '{"spec": {"holderIdentity": "intruder"}}',
        )  # fmt: skip
        with pytest.raises(LeadershipLostError, match="two operators never act at once"):
            await asyncio.wait_for(keeping, timeout=60)
        assert not a.leading

    asyncio.run(run())


def test_the_lease_is_kept_while_the_operators_loop_is_busy(
    lease: tuple[LocalCluster, str, str],
) -> None:
    # __main__ renews on a thread and loop of its own: an operator whose event loop is busy
    # (here: blocked outright) for longer than the renew deadline keeps its Lease, and a
    # standby never sees it go silent. Setting the stop flag ends the renewals before release.
    from baton_operator.__main__ import _keep_lease

    a, b = _elector(lease, "a"), _elector(lease, "b")
    assert asyncio.run(a.try_acquire_or_renew())
    stop, keeper = _keep_lease(a)
    try:
        version = _holder(lease)["renewTime"]

        async def busy_then_standby() -> bool:
            assert not await b.try_acquire_or_renew()  # b starts its clock on this version
            time.sleep(TIMINGS.duration * 2)  # the loop does nothing else meanwhile
            return await b.try_acquire_or_renew()

        assert not asyncio.run(busy_then_standby()), "the standby took a Lease still renewed"
        assert _holder(lease)["renewTime"] != version, "no renewal while the loop was busy"
        assert a.leading
    finally:
        stop.set()
        keeper.join(timeout=30)
    assert not keeper.is_alive(), "the keeper did not stop when asked"
    asyncio.run(a.release())
    assert asyncio.run(b.try_acquire_or_renew()), "a released Lease must be free at once"


def test_a_renewal_is_one_request_and_a_conflict_still_reads_the_lease(
    lease: tuple[LocalCluster, str, str],
) -> None:
    # The holder renews with a replace guarded by its own last write's resourceVersion: no
    # read, so a slow API server costs one round trip per renewal. A write by someone else in
    # between makes that replace conflict, and the holder then reads the Lease as usual.
    cluster, namespace, name = lease

    class CountingClient(LeaseClient):
        reads = 0

        async def get(self) -> dict[str, Any] | None:
            CountingClient.reads += 1
            return await super().get()

    client = CountingClient(cluster.api, namespace=namespace, name=name, timeout=10.0)
    a = LeaderElector(client, identity="a", timings=TIMINGS)

    async def renew(times: int) -> None:
        for _ in range(times):
            assert await a.try_acquire_or_renew()

    asyncio.run(renew(1))
    assert CountingClient.reads == 1  # acquiring reads once
    before = _holder(lease)["renewTime"]
    asyncio.run(renew(3))
    assert CountingClient.reads == 1, "a renewal read the Lease"
    assert _holder(lease)["renewTime"] != before
    # Someone writes the Lease without taking it (a label, say): the next renewal conflicts,
    # reads it, still finds itself the holder, and renews.
    cluster.kubectl("label", "lease", name, "-n", namespace, "touched=yes")
    asyncio.run(renew(1))
    assert CountingClient.reads == 2
    spec = _holder(lease)
    assert (spec["holderIdentity"], spec["leaseTransitions"]) == ("a", 0)


def test_whichever_replica_leads_after_an_api_outage_knows_when_it_began(
    lease: tuple[LocalCluster, str, str],
) -> None:
    """The API server stops while "a" holds the Lease (issue 31, section 3). "a" exits for its
    Lease; its restart (a fresh process, same identity) and the standby "b" both wait through
    the outage, failing /healthz. Whichever takes the Lease afterwards knows the outage's
    start, though the restarted one never saw it begin: it survives in the Lease."""
    cluster, namespace, name = lease
    # A fresh cluster's controller-manager exits if the API server goes while it starts.
    cluster.wait_controller_manager()
    down = [False]
    a = _elector(lease, "a")
    b_health, a2_health = Health(grace_seconds=0.0), Health(grace_seconds=0.0)

    def elector(identity: str, health: Health) -> LeaderElector:
        client = LeaseClient(cluster.api, namespace=namespace, name=name, timeout=2.0)
        return LeaderElector(client, identity=identity, timings=TIMINGS, health=health)

    b = elector("b", b_health)

    async def run() -> tuple[datetime, LeaderElector, Health]:
        assert await a.try_acquire_or_renew()
        assert not await b.try_acquire_or_renew()
        standby = asyncio.create_task(b.acquire())
        stopped = datetime.now(tz=UTC)
        down[0] = True
        await asyncio.to_thread(cluster.stop_apiserver)
        a2 = elector("a", a2_health)  # "a" restarted after exiting for its Lease
        restarted = asyncio.create_task(a2.acquire())
        while b_health.problem() is None or a2_health.problem() is None:
            await asyncio.sleep(0.25)
        assert "Lease" in (b_health.problem() or ""), "a standby's /healthz names its cause"
        await asyncio.to_thread(cluster.start_apiserver, wait_controllers=False)
        down[0] = False
        done, pending = await asyncio.wait(
            {standby, restarted}, return_when=asyncio.FIRST_COMPLETED, timeout=120
        )
        assert done, "nobody took the Lease after the outage"
        for task in pending:
            task.cancel()
        winner = b if standby in done else a2
        return stopped, winner, (b_health if winner is b else a2_health)

    try:
        stopped, winner, health = asyncio.run(run())
    finally:
        if down[0]:
            cluster.start_apiserver(wait_controllers=False)  # the shared cluster stays usable
        cluster.wait_controller_manager()
    outage = faults.outage_after_takeover(health.last_outage, winner.previous_renew)
    assert outage is not None, (winner.identity, health.last_outage, winner.previous_renew)
    print(f"{winner.identity} leads; outage recorded from {outage.began} for {outage.seconds:.1f}s")
    assert outage.began <= stopped, "the record starts no later than the outage did"
    assert "Lease" in outage.last_error
