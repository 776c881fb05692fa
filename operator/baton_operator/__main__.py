"""``baton-operator``: run the operator, or print its CRDs and RBAC (``manifests``)."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
from collections.abc import Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, Any

import yaml

from . import rbac
from .pure import crd
from .pure.notices import Graces
from .pure.podpolicy import DEFAULT_SERVICE_ACCOUNTS, PodPolicy
from .pure.settings import LEASE_NAME, OperatorConfig

if TYPE_CHECKING:
    from .client.leader import LeaderElector

_SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="baton-operator",
        description="Run Baton's TrainingJob operator, or print its manifests.",
    )
    sub = p.add_subparsers(dest="command")
    run = sub.add_parser("run", help="run the operator (the default)")
    _run_flags(run)
    man = sub.add_parser("manifests", help="print the CRDs, ServiceAccount and RBAC as YAML")
    man.add_argument("--namespace", default="baton-system", help="the operator's namespace")
    man.add_argument("--service-account", default="baton-operator")
    man.add_argument(
        "--watch-namespace", action="append", default=[], dest="watch_namespaces",
        help="grant only namespaced Roles in this namespace (repeatable); default: cluster-wide",
    )  # fmt: skip
    _run_flags(p)
    return p


def _run_flags(p: argparse.ArgumentParser) -> None:
    d = OperatorConfig()
    scope = p.add_mutually_exclusive_group()
    scope.add_argument(
        "-n", "--namespace", action="append", dest="namespaces", default=None,
        help="serve this namespace (repeatable); the default is every namespace",
    )  # fmt: skip
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="serve every namespace")
    p.add_argument(
        "--standalone", action="store_true",
        help="run without leader election (only where nothing can start a second operator)",
    )  # fmt: skip
    p.add_argument(
        "--operator-namespace", default=None,
        help="where the Lease and the token-key Secret live (default: the pod's namespace, "
        f"else {d.operator_namespace})",
    )  # fmt: skip
    p.add_argument(
        "--identity", default=d.identity,
        help="this replica's name in the Lease (default: the host name, i.e. the pod name)",
    )  # fmt: skip
    p.add_argument("--lease-duration-seconds", type=int, default=d.lease_duration_seconds)
    p.add_argument("--lease-renew-seconds", type=float, default=d.lease_renew_seconds)
    p.add_argument(
        "--lease-renew-deadline-seconds", type=float, default=d.lease_renew_deadline_seconds
    )
    p.add_argument("--lease-retry-seconds", type=float, default=d.lease_retry_seconds)
    p.add_argument(
        "--allow-service-account", action="append", default=[], metavar="NAME",
        help="a ServiceAccount pod templates may name, besides "
        f"{', '.join(DEFAULT_SERVICE_ACCOUNTS)} (repeatable)",
    )  # fmt: skip
    p.add_argument("--metrics-port", type=int, default=d.metrics_port)
    p.add_argument(
        "--metrics-host", default=os.environ.get("POD_IP") or d.metrics_host,
        help=f"address of /metrics and /healthz (default: $POD_IP, else {d.metrics_host})",
    )  # fmt: skip
    p.add_argument("--kubeconfig", default=None, help="kubeconfig (default: in-cluster)")
    p.add_argument("--sidecar-image", default=d.sidecar_image)
    p.add_argument(
        "--sidecar-command", default=" ".join(d.sidecar_command),
        help="the sidecar container's command, split on spaces",
    )  # fmt: skip
    p.add_argument("--sidecar-cloud", default=d.sidecar_cloud)
    p.add_argument("--tick-seconds", type=float, default=d.tick_seconds)
    p.add_argument("--progress-poll-seconds", type=float, default=d.progress_poll_seconds)
    p.add_argument("--node-lost-seconds", type=int, default=d.node_lost_seconds)
    p.add_argument(
        "--peer-lost-seconds", type=_seconds_or_auto, default=d.peer_lost_seconds,
        metavar="SECONDS|auto",
        help="a node a job's ranks stopped hearing from is lost once its node Lease goes "
        "unrenewed this long (default auto: two of the kubelet's renew intervals, read from "
        "the Lease; 0: wait for NotReady and --node-lost-seconds)",
    )  # fmt: skip
    p.add_argument(
        "--sidecar-timeout-seconds", type=float, default=d.sidecar_timeout_seconds,
        help="per-request timeout of the operator's calls to a sidecar; a sidecar that had "
        "answered and then times out makes the operator suspect its node",
    )  # fmt: skip
    p.add_argument("--delete-grace-seconds", type=int, default=d.delete_grace_seconds)
    p.add_argument(
        "--grace", action="append", default=[], metavar="NAME=SECONDS",
        help=f"override a notice grace period; names: {', '.join(f.name for f in fields(Graces))}",
    )  # fmt: skip
    p.add_argument(
        "--cluster-domain", default=d.cluster_domain,
        help="the cluster's DNS domain (the kubelet's clusterDomain): gang-scheduled ranks "
        "meet at <rank 0>.<job>.<namespace>.svc.<domain>",
    )  # fmt: skip
    p.add_argument(
        "--gang-scheduling", action=argparse.BooleanOptionalAction, default=d.gang_scheduling,
        help="a scheduling.k8s.io/v1beta1 PodGroup per attempt, every rank created at once, "
        "where the API server serves PodGroups (--no-gang-scheduling: rank 0 first, its pod "
        "IP, everywhere)",
    )  # fmt: skip
    p.add_argument(
        "--interval-prior-seconds", type=float, default=d.interval_prior_seconds,
        help="everySeconds: auto: node seconds per interruption assumed before any is observed, "
        f"one pseudo-interval (default {d.interval_prior_seconds:.0f})",
    )  # fmt: skip
    p.add_argument("-v", "--verbose", action="store_true")


def _seconds_or_auto(value: str) -> float | None:
    """``auto`` (None) or a number of seconds >= 0."""
    if value == "auto":
        return None
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: give seconds (e.g. 20) or auto") from None
    if seconds < 0:
        raise argparse.ArgumentTypeError(f"{value!r}: seconds must be >= 0 (0: off)")
    return seconds


def _config(args: argparse.Namespace) -> OperatorConfig:
    graces: dict[str, float] = {}
    valid = {f.name for f in fields(Graces)}
    for item in args.grace:
        name, _, value = item.partition("=")
        if name not in valid or not value:
            raise SystemExit(f"--grace {item!r}: use NAME=SECONDS with NAME one of {sorted(valid)}")
        graces[name] = float(value)
    return OperatorConfig(
        namespaces=tuple(args.namespaces or ()),
        standalone=args.standalone,
        operator_namespace=args.operator_namespace or _own_namespace(),
        identity=args.identity or socket.gethostname(),
        lease_duration_seconds=args.lease_duration_seconds,
        lease_renew_seconds=args.lease_renew_seconds,
        lease_renew_deadline_seconds=args.lease_renew_deadline_seconds,
        lease_retry_seconds=args.lease_retry_seconds,
        pod_policy=PodPolicy(
            allowed_service_accounts=tuple(
                dict.fromkeys([*DEFAULT_SERVICE_ACCOUNTS, *args.allow_service_account])
            )
        ),
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        kubeconfig=args.kubeconfig,
        sidecar_image=args.sidecar_image,
        sidecar_command=tuple(args.sidecar_command.split()),
        sidecar_cloud=args.sidecar_cloud,
        tick_seconds=args.tick_seconds,
        progress_poll_seconds=args.progress_poll_seconds,
        node_lost_seconds=args.node_lost_seconds,
        peer_lost_seconds=args.peer_lost_seconds,
        sidecar_timeout_seconds=args.sidecar_timeout_seconds,
        delete_grace_seconds=args.delete_grace_seconds,
        graces=Graces(**graces),
        cluster_domain=args.cluster_domain,
        gang_scheduling=args.gang_scheduling,
        interval_prior_seconds=args.interval_prior_seconds,
    )


def _own_namespace() -> str:
    try:
        with open(_SA_NAMESPACE_FILE) as f:
            return f.read().strip() or OperatorConfig.operator_namespace
    except OSError:
        return OperatorConfig.operator_namespace


def manifests_yaml(
    namespace: str, service_account: str, watch_namespaces: Sequence[str] = ()
) -> str:
    """The CRD and the RBAC, as one YAML stream."""
    docs = [
        crd.crd_manifest(),
        *rbac.rbac_manifests(namespace, service_account, watch_namespaces=watch_namespaces),
    ]
    return yaml.safe_dump_all(docs, sort_keys=False)


def _run(config: OperatorConfig, verbose: bool) -> None:
    import asyncio

    from . import handlers  # noqa: F401  (registers the handlers)

    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if config.kubeconfig:
        # kopf's own login reads $KUBECONFIG; the operator's API client gets the path directly.
        os.environ["KUBECONFIG"] = config.kubeconfig
    asyncio.run(_operate(config))


async def _operate(config: OperatorConfig) -> None:
    """Serve the probes, win the Lease (unless standalone), then run kopf while leading."""
    import asyncio
    import signal

    import kopf

    from .client import faults, kube, leader, metrics

    registry, health = metrics.Metrics(), metrics.Health()
    runner = await metrics.serve(
        registry, port=config.metrics_port, host=config.metrics_host, health=health
    )
    memo = kopf.Memo(config=config, metrics=registry, health=health, metrics_runner=runner)
    if config.standalone:
        await kopf.operator(memo=memo, **kopf_operator_args(config))
        return
    elector = leader.LeaderElector(
        leader.LeaseClient(
            kube.load_client(config.kubeconfig),
            namespace=config.operator_namespace,
            name=LEASE_NAME,
            timeout=config.lease_renew_deadline_seconds,
        ),
        identity=config.identity,
        health=health,
        timings=leader.LeaseTimings(
            duration=config.lease_duration_seconds,
            renew=config.lease_renew_seconds,
            retry=config.lease_retry_seconds,
            renew_deadline=config.lease_renew_deadline_seconds,
        ),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    acquiring = asyncio.create_task(elector.acquire())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({acquiring, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not acquiring.done():
        acquiring.cancel()
        await runner.cleanup()
        return
    stopping.cancel()
    registry.leader.set(1)
    # An outage that ended the previous holder's leadership: every job records it (faults.py).
    memo["outage"] = faults.outage_after_takeover(health.last_outage, elector.previous_renew)
    stop_keeping, keeper = _keep_lease(elector)
    try:
        # kopf installs its own SIGTERM/SIGINT handlers (over the ones above) and stops on
        # them. No stop_flag: kopf would leave its waiter task pending after a signal and wait
        # 5 s for it on every stop (a rolling update's leaderless gap, measured in the tests).
        await kopf.operator(memo=memo, **kopf_operator_args(config))
    finally:
        # Renewals end before the release, or one could take the released Lease back.
        stop_keeping.set()
        await asyncio.to_thread(keeper.join, config.lease_renew_deadline_seconds + 2)
        await elector.release()


def _keep_lease(elector: LeaderElector) -> tuple[threading.Event, threading.Thread]:
    """Renew the Lease on a thread and event loop of its own.

    On the operator's loop a renewal would wait behind every job's reconciler; on a busy
    machine (100 jobs measured by bench/operator_scale.py) it then missed its deadline and
    the operator stopped itself for nothing. When the Lease is really lost, this thread ends
    the process at once, whatever the main loop is doing: a standby may act in (duration -
    renew deadline) seconds, and kopf's graceful shutdown could take longer. The kubelet
    starts the operator again, as a standby.
    """
    import asyncio

    from .client import leader

    stop = threading.Event()

    def run() -> None:
        try:
            asyncio.run(elector.keep(stop))
        except leader.LeadershipLostError as e:
            logging.getLogger(__name__).critical("%s", e)
        except BaseException:
            logging.getLogger(__name__).exception("the Lease keeper failed; stopping")
        else:
            return
        logging.shutdown()
        os._exit(3)

    thread = threading.Thread(target=run, name="lease-keeper", daemon=True)
    thread.start()
    return stop, thread


def kopf_operator_args(config: OperatorConfig) -> dict[str, Any]:
    """The arguments of ``kopf.operator`` for ``config``.

    Always standalone as far as kopf knows: the Lease (leader.py) decides which replica runs
    kopf at all. kopf makes peering *mandatory* whenever a peering name is passed, so none is.
    """
    return {
        "clusterwide": not config.namespaces,
        "namespaces": list(config.namespaces),
        "standalone": True,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``baton-operator`` console script."""
    args = _parser().parse_args(argv)
    if args.command == "manifests":
        sys.stdout.write(
            manifests_yaml(args.namespace, args.service_account, args.watch_namespaces)
        )
        return 0
    _run(_config(args), args.verbose)
    return 0


if __name__ == "__main__":
    sys.exit(main())
