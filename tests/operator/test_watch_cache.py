"""The ticks read the job and its pods from the watch cache, and never act on a stale read.

The pure cache (ordering, LIST merges, the node index), then the Reconciler over it: the
watch simulated by delivering the fake API server's objects into the cache, on time or late.
"""

from __future__ import annotations

import copy
from datetime import timedelta
from typing import Any

from baton_operator.pure import manifests, watchcache
from baton_operator.pure.watchcache import WatchCache
from baton_testing.reconciler_fakes import JOB, NS, REPLICAS, FakeKube, Harness


def pod(name: str, version: int | str, *, job: str = "tj", node: str | None = "n1") -> dict:
    return {
        "metadata": {"name": name, "namespace": "team", "resourceVersion": str(version),
                     "labels": {"baton.dev/job": job}},
        "spec": {"nodeName": node} if node else {},
    }  # fmt: skip


def names(cache: WatchCache, job: str = "tj") -> list[str]:
    return [p["metadata"]["name"] for p in cache.pods("team", job)]


def test_the_job_label_is_the_pods_contract_label() -> None:
    assert watchcache.JOB_LABEL == manifests.JOB_LABEL


def test_an_older_version_never_replaces_a_newer_one() -> None:
    cache = WatchCache()
    cache.pod_event("ADDED", pod("p0", 7, node="n2"))
    cache.pod_event("MODIFIED", pod("p0", 5, node="n1"))
    assert cache.pods("team", "tj")[0]["spec"]["nodeName"] == "n2"
    job = {"metadata": {"name": "tj", "namespace": "team", "resourceVersion": "9"}}
    cache.job_event("MODIFIED", job)
    cache.put_job({"metadata": {**job["metadata"], "resourceVersion": "8"}})
    assert cache.job_at_least("team", "tj", "9")
    assert not cache.job_at_least("team", "tj", "10"), "the tick's own newer write"
    assert not cache.job_at_least("team", "other", None), "a job the watch has not delivered"


def test_a_version_that_is_not_a_number_is_never_trusted_as_new_enough() -> None:
    cache = WatchCache()
    cache.job_event("ADDED", {"metadata": {"name": "tj", "namespace": "team",
                                           "resourceVersion": "abc"}})  # fmt: skip
    assert cache.job_at_least("team", "tj", None)
    assert not cache.job_at_least("team", "tj", "abc"), "the tick then reads through the API"


def test_a_list_removes_a_pod_whose_deletion_the_watch_never_reported() -> None:
    cache = WatchCache()
    cache.pod_event(None, pod("ghost", 3))
    cache.pod_event(None, pod("alive", 4))
    since = cache.seq
    cache.merge_pods("team", "tj", [pod("alive", 4)], since=since)
    assert names(cache) == ["alive"]
    assert cache.jobs_on("n1") == {("team", "tj")}


def test_a_list_in_flight_neither_revives_a_deleted_pod_nor_drops_a_new_one() -> None:
    cache = WatchCache()
    cache.pod_event(None, pod("old", 3))
    since = cache.seq  # the LIST is sent here; its answer still holds "old" and not "new"
    cache.pod_event("DELETED", pod("old", 6))
    cache.pod_event("ADDED", pod("new", 7))
    cache.merge_pods("team", "tj", [pod("old", 3)], since=since)
    assert names(cache) == ["new"]
    assert cache.pods_known("team", "tj")


def test_a_list_answer_older_than_an_event_keeps_the_event() -> None:
    cache = WatchCache()
    since = cache.seq
    cache.pod_event("MODIFIED", pod("p0", 9, node="n2"))
    cache.merge_pods("team", "tj", [pod("p0", 8, node="n1")], since=since)
    assert cache.pods("team", "tj")[0]["spec"]["nodeName"] == "n2"
    assert cache.jobs_on("n1") == set()
    assert cache.jobs_on("n2") == {("team", "tj")}


def test_the_node_index_follows_binding_and_deletion() -> None:
    cache = WatchCache()
    cache.pod_event("ADDED", pod("a0", 1, node=None))
    cache.pod_event("ADDED", pod("b0", 2, job="other", node="n1"))
    assert cache.jobs_on("n1") == {("team", "other")}
    cache.pod_event("MODIFIED", pod("a0", 3, node="n1"))
    assert cache.jobs_on("n1") == {("team", "tj"), ("team", "other")}
    cache.pod_event("DELETED", pod("b0", 4, job="other", node="n1"))
    assert cache.jobs_on("n1") == {("team", "tj")}
    assert cache.pods("team", "other") == []


class CountingKube(FakeKube):
    """The fake API server, counting the reads that went through it."""

    def __init__(self, job: dict[str, Any]) -> None:
        super().__init__(job)
        self.gets = 0
        self.lists = 0

    async def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.gets += 1
        return await super().get_job(namespace, name)

    async def list_pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        self.lists += 1
        return await super().list_pods(namespace, label_selector)


class CachedHarness(Harness):
    """The Reconciler with a watch cache; before each tick the watch delivers what the fake
    API server holds, unless ``lagging`` (the watch is behind)."""

    def __init__(self) -> None:
        super().__init__()
        self.kube = CountingKube(self.kube.job)
        self.cache = WatchCache()
        self.lagging = False
        self.build(cache=self.cache)
        self.delivered: set[str] = set()

    def deliver(self) -> None:
        """The watch catches up with the fake API server (the job and every pod)."""
        self.cache.job_event("MODIFIED", copy.deepcopy(self.kube.job))
        for name in self.delivered - set(self.kube.pods):
            self.cache.pod_event("DELETED", {"metadata": {"name": name, "namespace": NS}})
        for body in self.kube.pods.values():
            self.cache.pod_event("MODIFIED", copy.deepcopy(body))
        self.delivered = set(self.kube.pods)

    def tick(self) -> float | None:
        if not self.lagging:
            self.deliver()
        return super().tick()

    def reads(self) -> tuple[int, int]:
        return self.kube.gets, self.kube.lists


def test_idle_ticks_read_nothing_through_the_api_and_a_notice_is_served_from_the_cache() -> None:
    h = CachedHarness()
    h.running()
    before = h.reads()
    for _ in range(5):
        h.tick()
    assert h.reads() == before, "a running job's ticks come from the watch cache"
    h.spot_notice("n1")
    h.tick()
    assert h.kube.status["phase"] == "Checkpointing"
    h.report_all(state="requested")
    h.tick()
    assert len(h.sidecars.requests) == REPLICAS, "one request per rank"
    h.report_all(state="committed", step=40, trigger="notice", uri="s3://bucket/tj")
    h.tick()
    assert h.kube.status["phase"] == "Restarting"
    assert h.kube.status["lastCheckpoint"]["step"] == 40
    assert len(h.sidecars.requests) == REPLICAS, "no request was sent twice"
    h.tick()  # the old pods' deletions reach the cache: the new attempt starts
    assert h.kube.status["phase"] == "Pending"
    trainer = h.kube.pods[h.pod(1, 0)]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert env["BATON_RESUME_STEP"] == "40"
    assert h.kube.phases() == ["Pending", "Running", "Checkpointing", "Restarting", "Pending"]


def test_a_watch_behind_the_ticks_own_write_is_read_through_the_api_once() -> None:
    h = CachedHarness()
    h.running()
    h.spot_notice("n1")
    h.tick()
    assert h.kube.status["phase"] == "Checkpointing"
    # The watch has not delivered the Checkpointing write: the cache still says Running.
    h.lagging = True
    gets = h.kube.gets
    h.tick()
    assert h.kube.gets == gets + 1, "the cache is older than the daemon's own write: a GET"
    assert len(h.sidecars.requests) == REPLICAS
    # That GET refreshed the cache: the requests' write is the newest; the next tick reads
    # through the API again (its write is newer than the cache) and sends nothing again.
    h.tick()
    h.tick()
    assert len(h.sidecars.requests) == REPLICAS, "no request was sent twice on a stale read"
    assert h.kube.status["phase"] == "Checkpointing"


def test_a_write_made_on_a_stale_cache_loses_its_race_and_the_notice_is_still_served() -> None:
    h = CachedHarness()
    h.running()
    h.tick()  # the watch has delivered the daemon's last write
    # Another writer (the user, an API-fault report) changed the job; the watch is behind.
    h.lagging = True
    h.kube.status["message"] = "written by someone else"
    h.kube.bump()
    h.spot_notice("n1")
    gets = h.kube.gets
    h.tick()
    assert h.kube.conflicts == 1, "the guarded write on the stale read was refused"
    assert h.kube.gets == gets + 1, "and the tick decided again from a read through the API"
    assert h.kube.status["phase"] == "Checkpointing", "the notice was not lost"
    assert h.kube.status["notice"]["source"] == "aws"


def test_a_ghost_pod_the_watch_never_deleted_is_gone_after_the_resync() -> None:
    h = CachedHarness()
    h.running()
    # A pod of attempt 0 that the watch saw and whose deletion it missed (a watch gap).
    ghost = h.pod(0, REPLICAS + 3)
    body = copy.deepcopy(h.kube.pods[h.pod(0, 0)])
    body["metadata"]["name"] = ghost
    body["metadata"]["labels"][manifests.RANK_LABEL] = str(REPLICAS + 3)
    h.cache.pod_event("ADDED", body)
    assert ghost in names(h.cache, JOB)
    lists = h.kube.lists
    h.tick()
    assert h.kube.lists == lists, "within the resync period the cache is read"
    assert h.memory.synced_at is not None
    h.memory.synced_at -= timedelta(seconds=31)
    h.tick()
    assert h.kube.lists == lists + 1
    assert ghost not in names(h.cache, JOB)
