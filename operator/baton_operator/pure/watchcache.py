"""The latest TrainingJobs and Baton pods that kopf's watches delivered, for the ticks to read.

Pure state (no I/O). Without it every tick of every job made a GET of its TrainingJob and a
LIST of its pods, about 2 API requests per job per second, though the operator's watches
already deliver both objects: at 100 jobs the API server answered 11,000 requests a minute
and a notice's calls waited behind them (docs/performance.md, Operator scale).

The watch handlers (``handlers.py``) feed it; ``Reconciler.tick`` reads it and falls back to
the API (which then refreshes it) whenever the cache cannot be trusted to be at least as new as
what the tick must know:

- a job the cache has not seen, or older than the tick's own last status write
  (:meth:`WatchCache.job_at_least`: a daemon never reads back less than it wrote);
- the pods of a job no complete read has covered yet (:meth:`WatchCache.pods_known`: the pod
  watch's first listing may come after the job's daemon starts);
- every ``resync`` seconds and after a lost write race (the controller decides when).

Ordering: the watch delivers one object's versions in order, but a LIST or GET answer can
overtake or trail the watch. Each entry keeps its ``resourceVersion`` and is replaced only by a
newer one; versions are compared as integers (what every etcd-backed API server serves). Where a
version is not an integer the cache does not guess: :meth:`job_at_least` says no and the tick
reads through the API. A deleted pod leaves a tombstone for a while, so that a LIST answered
before the deletion cannot bring it back.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = ["JOB_LABEL", "WatchCache"]

JOB_LABEL: Final = "baton.dev/job"
"""The label naming a pod's TrainingJob (the contract label, manifests.JOB_LABEL)."""

_TOMBSTONES_KEPT: Final = 4096
"""Deleted pods remembered (oldest dropped first): far more than the deletions that can be in
flight during one LIST."""

JobKey = tuple[str, str]
"""(namespace, name)"""


def _version(body: Mapping[str, Any]) -> int | None:
    raw = (body.get("metadata") or {}).get("resourceVersion")
    try:
        return int(str(raw))
    except ValueError:
        return None


def _older(a: int | None, b: int | None) -> bool:
    """``a`` is known to be older than ``b`` (False when either cannot be compared)."""
    return a is not None and b is not None and a < b


@dataclass
class _Entry:
    body: Mapping[str, Any]
    version: int | None
    seq: int
    """The cache's update counter when this entry was written."""


@dataclass
class _Pod:
    entry: _Entry
    job: JobKey
    node: str | None


def _meta(body: Mapping[str, Any]) -> Mapping[str, Any]:
    return body.get("metadata") or {}


def _pod_job(body: Mapping[str, Any]) -> JobKey | None:
    meta = _meta(body)
    job = (meta.get("labels") or {}).get(JOB_LABEL)
    if not job:
        return None
    return (str(meta.get("namespace") or ""), str(job))


@dataclass
class WatchCache:
    """The jobs and pods the watches delivered, and which nodes hold which jobs' pods."""

    _jobs: dict[JobKey, _Entry] = field(default_factory=dict)
    _pods: dict[tuple[str, str], _Pod] = field(default_factory=dict)
    """(namespace, pod name) -> the pod."""
    _job_pods: dict[JobKey, set[str]] = field(default_factory=dict)
    _node_pods: dict[str, set[tuple[str, str]]] = field(default_factory=dict)
    _tombstones: dict[tuple[str, str], _Entry] = field(default_factory=dict)
    _listed: set[JobKey] = field(default_factory=set)
    """Jobs whose pods a complete read (a LIST) has covered."""
    seq: int = 0
    """Counts every update; a LIST notes it before it is sent (:meth:`merge_pods`)."""

    # ----------------------------------------------------------------- jobs

    def job_event(self, kind: str | None, body: Mapping[str, Any]) -> None:
        """A TrainingJob watch event (``kind`` None: kopf's initial listing)."""
        meta = _meta(body)
        key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        if kind == "DELETED":
            self._jobs.pop(key, None)
            return
        self.put_job(body)

    def put_job(self, body: Mapping[str, Any]) -> None:
        """Record a job (an event or a GET's answer) unless a newer version is known."""
        meta = _meta(body)
        key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        version = _version(body)
        old = self._jobs.get(key)
        if old is not None and _older(version, old.version):
            return
        self.seq += 1
        self._jobs[key] = _Entry(body=body, version=version, seq=self.seq)

    def job(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """The newest known body of a job, or None when the cache has none."""
        entry = self._jobs.get((namespace, name))
        return None if entry is None else entry.body

    def job_at_least(self, namespace: str, name: str, version: str | None) -> bool:
        """The cached job is known to be ``version`` or newer (None: any cached version)."""
        entry = self._jobs.get((namespace, name))
        if entry is None:
            return False
        if version is None:
            return True
        try:
            wanted = int(version)
        except ValueError:
            return False
        return entry.version is not None and entry.version >= wanted

    # ----------------------------------------------------------------- pods

    def pod_event(self, kind: str | None, body: Mapping[str, Any]) -> None:
        """A watch event of a Baton pod (``kind`` None: kopf's initial listing)."""
        meta = _meta(body)
        key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        self.seq += 1
        if kind == "DELETED":
            self._drop(key)
            self._bury(key, _Entry(body=body, version=_version(body), seq=self.seq))
            return
        old = self._pods.get(key)
        if old is not None and _older(_version(body), old.entry.version):
            return
        self._put(key, body)

    def merge_pods(
        self, namespace: str, job: str, items: Iterable[Mapping[str, Any]], *, since: int
    ) -> None:
        """Merge a LIST of one job's pods, sent when :attr:`seq` was ``since``.

        The LIST is newer than every entry recorded before it was sent: a cached pod it does
        not hold is gone. An event that arrived while it was in flight may be newer than it:
        such a pod (or tombstone) is kept unless the LIST shows a newer version.
        """
        jkey = (namespace, job)
        listed: set[str] = set()
        for body in items:
            name = str(_meta(body).get("name") or "")
            key = (namespace, name)
            listed.add(name)
            version = _version(body)
            grave = self._tombstones.get(key)
            if grave is not None and grave.seq > since and not _older(grave.version, version):
                continue  # deleted while the LIST was in flight
            old = self._pods.get(key)
            if old is not None and old.entry.seq > since and not _older(old.entry.version, version):
                continue  # an event newer than the LIST
            if old is not None and _older(version, old.entry.version):
                continue
            self._tombstones.pop(key, None)
            self.seq += 1
            self._put(key, body)
        for name in list(self._job_pods.get(jkey, ())):
            pod = self._pods.get((namespace, name))
            if name not in listed and pod is not None and pod.entry.seq <= since:
                self._drop((namespace, name))
        self._listed.add(jkey)

    def pods_known(self, namespace: str, job: str) -> bool:
        """A complete read of the job's pods has been merged (the cache holds them all)."""
        return (namespace, job) in self._listed

    def pods(self, namespace: str, job: str) -> list[Mapping[str, Any]]:
        """The job's pods, as the watch last delivered them."""
        names = self._job_pods.get((namespace, job), ())
        return [self._pods[(namespace, n)].entry.body for n in sorted(names)]

    def pod(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """One pod as the watch last delivered it, or None."""
        found = self._pods.get((namespace, name))
        return found.entry.body if found else None

    def jobs_on(self, node: str) -> set[JobKey]:
        """The jobs with a pod bound to ``node``: those a notice on it concerns."""
        return {self._pods[key].job for key in self._node_pods.get(node, ()) if key in self._pods}

    def forget_job(self, namespace: str, name: str) -> None:
        """The job is gone: drop it and stop trusting its pods (they are deleted with it)."""
        self._jobs.pop((namespace, name), None)
        self._listed.discard((namespace, name))

    # ----------------------------------------------------------------- internals

    def _put(self, key: tuple[str, str], body: Mapping[str, Any]) -> None:
        job = _pod_job(body)
        if job is None:
            self._drop(key)
            return
        self._drop(key)
        node = (body.get("spec") or {}).get("nodeName") or None
        entry = _Entry(body=body, version=_version(body), seq=self.seq)
        self._pods[key] = _Pod(entry=entry, job=job, node=node)
        self._job_pods.setdefault(job, set()).add(key[1])
        if node:
            self._node_pods.setdefault(node, set()).add(key)

    def _drop(self, key: tuple[str, str]) -> None:
        pod = self._pods.pop(key, None)
        if pod is None:
            return
        names = self._job_pods.get(pod.job)
        if names is not None:
            names.discard(key[1])
            if not names:
                del self._job_pods[pod.job]
        if pod.node:
            keys = self._node_pods.get(pod.node)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._node_pods[pod.node]

    def _bury(self, key: tuple[str, str], entry: _Entry) -> None:
        self._tombstones.pop(key, None)
        self._tombstones[key] = entry
        while len(self._tombstones) > _TOMBSTONES_KEPT:
            del self._tombstones[next(iter(self._tombstones))]
