"""The kopf handlers: thin. They wire kopf's watches to the Reconciler and decide nothing.

- One daemon per TrainingJob runs ``Reconciler.tick`` about once a second, until the job
  is Succeeded, Failed or deleted. kopf restarts the daemons when the operator restarts, and
  the tick carries on from the job's status (the controller's docstring says how). A write
  the API server refuses for good (``KubeRejectedError``) is never sent again: the daemon
  reports it (``faults.rejected``) and stops, until the next operator start.
- The TrainingJob and Pod watches (Baton's pods only) feed :class:`WatchCache`, which the
  ticks read instead of a GET and a LIST per tick (watchcache.py says when they still read
  through the API).
- The Node watch feeds :class:`ClusterView` (readiness and notices), and a node's new notice
  or readiness change wakes the daemons of the jobs with a pod on that node, only those.
- The Pod watch wakes a job's daemon as soon as a pod gets a ``DisruptionTarget`` condition,
  instead of at its next tick.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Final, cast

import kopf

from .client import faults, tokens
from .client import kube as kube_mod
from .client import metrics as metrics_mod
from .client.sidecars import SidecarClient
from .pure import nodes as nodes_mod
from .pure import notices, watches
from .pure.errors import BatonOperatorError, KubeError, KubeRejectedError
from .pure.pods import trainer_ended
from .pure.settings import KEY_SECRET_NAME, OperatorConfig
from .pure.watchcache import WatchCache
from .reconcile.controller import ClusterView, JobMemory, Reconciler

_log = logging.getLogger(__name__)

__all__ = ["configure"]

_ANNOTATION_PREFIX = "baton.dev"


def configure(settings: kopf.OperatorSettings, config: OperatorConfig) -> None:
    """Apply ``config`` to kopf's settings (also used by the tests to check them)."""
    # Watches stall silently without both timeouts (kopf#955, #957, #585).
    # Whole seconds: the API server refuses timeoutSeconds=60.0 (strconv.ParseInt).
    settings.watching.server_timeout = config.watch_server_timeout_seconds
    settings.watching.client_timeout = config.watch_client_timeout_seconds
    settings.watching.connect_timeout = config.watch_connect_timeout_seconds
    # Only Baton's pods are watched, filtered by the API server rather than in the operator.
    pods: tuple[str, str] = (watches.PODS.version, watches.PODS.plural)  # core: "v1", plural
    settings.watching.label_selectors[pods] = ",".join(
        f"{k}={v}" for k, v in watches.MANAGED_BY.items()
    )
    # kopf's bookkeeping goes to annotations, so status holds only what the CRD declares.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=_ANNOTATION_PREFIX
    )
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=_ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{_ANNOTATION_PREFIX}/operator"
    # No CRD/namespace scanning: it would need list/watch on both, and Baton's resources are
    # known at startup.
    settings.scanning.disabled = True
    # One active operator is chosen by the Lease in leader.py before kopf starts, not by
    # kopf's peering (whose equal-priority replicas pause each other, kopf#734).
    settings.peering.standalone = True
    settings.peering.mandatory = False
    settings.peering.clusterwide = not config.namespaces
    # Our Events are written on purpose (kopf.event); kopf's own log lines are not turned
    # into Events, so nothing from a traceback or a request can leak into one.
    settings.posting.level = logging.CRITICAL
    settings.posting.reporting_component = "baton-operator"


def _config(memo: Mapping[str, Any]) -> OperatorConfig:
    config = memo.get("config")
    if not isinstance(config, OperatorConfig):
        raise kopf.PermanentError("baton-operator started without its config in the memo")
    return config


@kopf.on.login()
def _login(memo: Any, **_: Any) -> kopf.ConnectionInfo:
    # The same credentials as the operator's own API client (kube.py), loaded when needed:
    # kopf's default login reads $KUBECONFIG through a module constant fixed at import time,
    # and its own kubeconfig parser ignores tokenFile (projected ServiceAccount tokens).
    c = kube_mod.load_configuration(_config(memo).kubeconfig)
    header = c.get_api_key_with_prefix("BearerToken") or c.get_api_key_with_prefix("authorization")
    scheme, _sep, token = (header or "").rpartition(" ")
    return kopf.ConnectionInfo(
        server=c.host,
        ca_path=c.ssl_ca_cert,
        insecure=not c.verify_ssl,
        username=c.username or None,
        password=c.password or None,
        scheme=scheme or None,
        token=token or None,
        certificate_path=c.cert_file,
        private_key_path=c.key_file,
    )


@kopf.on.startup()
async def _startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    config = _config(memo)
    configure(settings, config)
    # __main__ serves /metrics and /healthz from before the leader election (a standby
    # must answer its probes too); a kopf run without __main__ (tests) serves them here.
    metrics = memo.get("metrics")
    health = memo.get("health")
    if not isinstance(metrics, metrics_mod.Metrics) or not isinstance(health, metrics_mod.Health):
        metrics, health = metrics_mod.Metrics(), metrics_mod.Health()
        memo["metrics"], memo["health"] = metrics, health
        memo["metrics_runner"] = await metrics_mod.serve(
            metrics, port=config.metrics_port, host=config.metrics_host, health=health
        )
    sidecars = SidecarClient(
        port=config.sidecar_port, timeout_seconds=config.sidecar_timeout_seconds
    )
    memo["sidecars"] = sidecars
    cluster = ClusterView(config=config)
    memo["cluster"] = cluster
    memo["wakers"] = {}
    cache = WatchCache()
    memo["cache"] = cache

    async def post(job: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
        # kopf only needs the object reference fields (apiVersion, kind, metadata).
        kopf.event(
            kopf.Body(cast(kopf.RawBody, dict(job))), type=kind, reason=reason, message=message
        )

    kube = kube_mod.Kube(kube_mod.load_client(config.kubeconfig))
    faults.instrument(kube, metrics, health)
    memo["kube"], memo["post"] = kube, post
    sweeps: set[asyncio.Task[None]] = set()

    def sweep_after_outage(lasted: float) -> None:
        if lasted >= _SWEEP_AFTER_SECONDS:
            task = asyncio.get_running_loop().create_task(_sweep_nodes(memo))
            sweeps.add(task)  # a reference until it ends (the loop keeps only weak ones)
            task.add_done_callback(sweeps.discard)

    health.on_recovered(sweep_after_outage)
    key = await tokens.load_or_create_key(kube, config.operator_namespace, KEY_SECRET_NAME)
    memo["reconciler"] = Reconciler(
        kube=kube,
        sidecars=sidecars,
        cluster=cluster,
        metrics=metrics,
        config=config,
        post_event=post,
        token_for=lambda spec: tokens.derive(key, spec),
        cache=cache,
    )


@kopf.on.cleanup()
async def _cleanup(memo: kopf.Memo, **_: Any) -> None:
    sidecars = memo.get("sidecars")
    if isinstance(sidecars, SidecarClient):
        await sidecars.close()
    runner = memo.get("metrics_runner")
    if runner is not None:
        await runner.cleanup()


@kopf.daemon(*watches.JOBS.selector(), cancellation_timeout=10.0)
async def _job_daemon(
    *,
    name: str,
    namespace: str | None,
    memo: Any,
    stopped: kopf.DaemonStopped,
    logger: logging.Logger | logging.LoggerAdapter[Any],
    **_: Any,
) -> None:
    assert namespace is not None, "TrainingJob is namespaced"
    config = _config(memo)
    reconciler: Reconciler = memo["reconciler"]
    wakers: dict[tuple[str, str], asyncio.Event] = memo["wakers"]
    wake = wakers.setdefault((namespace, name), asyncio.Event())
    memory = JobMemory()
    api = faults.JobFaults()
    kube: kube_mod.Kube = memo["kube"]
    outage: faults.Outage | None = memo.get("outage")
    cache: WatchCache | None = memo.get("cache")
    cleared = False
    if outage is not None:
        # This operator took the Lease after an API outage: the job's record of it.
        await faults.record_outage(kube, memo["post"], namespace, name, outage)
    try:
        while not stopped:
            # Cleared before the tick, not after: an event that arrives while the tick runs
            # (a notice, a pod going away) makes the next tick start at once.
            wake.clear()
            began = datetime.now(tz=UTC)
            try:
                delay = await reconciler.tick(namespace, name, memory)
            except KubeRejectedError as e:
                # Permanent: the same write can never succeed, so it is not sent again. Say
                # which field was refused and stop; the next operator start tries again.
                await faults.rejected(kube, memo["post"], namespace, name, e)
                return
            except KubeError as e:
                # The API server refused or did not answer: back off, and once the fault
                # persists say so in the job's status and Events (faults.py).
                delay = api.backoff(config.tick_seconds)
                logger.warning("reconcile failed, retrying in %.1fs: %s", delay, e)
                await api.failed(kube, memo["post"], namespace, name, e, began=began)
            except BatonOperatorError as e:
                # Retry at the next tick: a sidecar may be back by then.
                logger.warning("reconcile failed, retrying: %s", e)
                delay = config.tick_seconds
            except Exception:
                # A bug must be loud, not fatal: log the traceback and keep the job driven.
                logger.exception("unexpected error while reconciling; retrying")
                delay = config.tick_seconds * 5
            else:
                await api.succeeded(kube, memo["post"], namespace, name)
                if not cleared and cache is not None:
                    # The tick's read is in the cache: a refusal a stopped daemon reported
                    # is cleared without another read.
                    job = cache.job(namespace, name)
                    cleared = await faults.clear_rejection(kube, memo["post"], namespace, name, job)
            if delay is None:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), timeout=delay)
    finally:
        wakers.pop((namespace, name), None)


@kopf.on.event(*watches.JOBS.selector())
async def _job_event(
    event: kopf.RawEvent, name: str, namespace: str | None, memo: Any, **_: Any
) -> None:
    # A raw watch event, not kopf.on.delete: a finished job's daemon has exited and its
    # finalizer is gone, and kopf calls on.delete handlers only for objects it still holds.
    # A deletion this operator misses (it was down) only leaves that job's metric series
    # until the operator restarts.
    cache: WatchCache | None = memo.get("cache")
    if cache is not None:
        cache.job_event(event.get("type"), event.get("object") or {})
    if event.get("type") == "DELETED" and namespace is not None:
        reconciler: Reconciler = memo["reconciler"]
        reconciler.forget(namespace, name)


@kopf.on.event(*watches.NODES.selector())
async def _node_event(
    event: Mapping[str, Any], body: kopf.Body, memo: kopf.Memo, logger: Any, **_: Any
) -> None:
    cluster: ClusterView = memo["cluster"]
    name = str(body.get("metadata", {}).get("name", ""))
    if event.get("type") == "DELETED":
        cluster.remove_node(name, now=datetime.now(tz=UTC))
        changed = True
    else:
        was_ready = cluster.node_ready(name)
        fresh = cluster.update_node(body, now=datetime.now(tz=UTC))
        for notice in fresh:
            memo["metrics"].notices.labels(notice.source).inc()
            logger.info("notice on node %s: %s (deadline %s)", name, notice.reason, notice.deadline)
        changed = bool(fresh) or cluster.node_ready(name) != was_ready
    # Only a new notice, a readiness change or a deletion wakes daemons early (a node's
    # routine status updates would otherwise tick jobs on every node's heartbeat), and only
    # the daemons of the jobs with a pod on the node (the watch cache's node index): the
    # others' next regular tick sees nothing new, so waking them would only put the
    # affected jobs' ticks in a queue that grows with the number of jobs.
    if changed:
        _wake_jobs_on(memo, name)


def _wake_jobs_on(memo: kopf.Memo, node: str) -> None:
    """Wake the daemons of the jobs with a pod on ``node`` (the watch cache's node index)."""
    cache: WatchCache = memo["cache"]
    wakers = memo["wakers"]
    for key in cache.jobs_on(node):
        waker = wakers.get(key)
        if waker is not None:
            waker.set()


_SWEEP_AFTER_SECONDS: Final = 2.0
"""An API outage at least this long may have hidden a Node's deletion from the watch."""


async def _sweep_nodes(memo: kopf.Memo) -> None:
    """After an API outage: forget the Nodes deleted meanwhile (ClusterView.sweep) and wake
    their jobs, whose pods there are then lost, not merely being deleted."""
    cluster: ClusterView = memo["cluster"]
    kube: kube_mod.Kube = memo["kube"]
    try:
        present = await kube.list_node_names()
    except KubeError as e:
        _log.warning("could not list nodes after the API outage: %s", e)
        return
    for name in cluster.sweep(present, now=datetime.now(tz=UTC)):
        _log.warning("%s", nodes_mod.UNSEEN_DELETION.format(node=name, when="after an API outage"))
        _wake_jobs_on(memo, name)


@kopf.on.event(*watches.PODS.selector(), labels=dict(watches.MANAGED_BY))
async def _pod_event(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    cache: WatchCache | None = memo.get("cache")
    meta = body.get("metadata", {})
    namespace = str(meta.get("namespace") or "")
    old = cache.pod(namespace, str(meta.get("name") or "")) if cache is not None else None
    if cache is not None:
        cache.pod_event(event.get("type"), event.get("object") or {})
    config = _config(memo)
    notice = notices.pod_notice(body, now=datetime.now(tz=UTC), graces=config.graces)
    # A notice, or a trainer that exited or restarted (the first sign of a peer's lost
    # node), wakes the job's daemon at once rather than at its next tick.
    if notice is None and (event.get("type") == "DELETED" or not trainer_ended(old, body)):
        return
    job = str(meta.get("labels", {}).get("baton.dev/job", ""))
    waker = memo["wakers"].get((namespace, job))
    if waker is not None:
        waker.set()
