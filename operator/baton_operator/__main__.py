"""``baton-operator``: run the operator, or print its CRDs and RBAC (``manifests``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

import yaml

from . import crd, rbac
from .notices import Graces
from .settings import OperatorConfig

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
    p.add_argument("--standalone", action="store_true", help="run without kopf peering")
    p.add_argument("--peering", default=d.peering_name, help="ClusterKopfPeering name")
    p.add_argument("--metrics-port", type=int, default=d.metrics_port)
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
    p.add_argument("--delete-grace-seconds", type=int, default=d.delete_grace_seconds)
    p.add_argument(
        "--grace", action="append", default=[], metavar="NAME=SECONDS",
        help=f"override a notice grace period; names: {', '.join(f.name for f in fields(Graces))}",
    )  # fmt: skip
    p.add_argument("-v", "--verbose", action="store_true")


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
        peering_name=args.peering,
        metrics_port=args.metrics_port,
        kubeconfig=args.kubeconfig,
        sidecar_image=args.sidecar_image,
        sidecar_command=tuple(args.sidecar_command.split()),
        sidecar_cloud=args.sidecar_cloud,
        tick_seconds=args.tick_seconds,
        progress_poll_seconds=args.progress_poll_seconds,
        node_lost_seconds=args.node_lost_seconds,
        delete_grace_seconds=args.delete_grace_seconds,
        graces=Graces(**graces),
    )


def manifests_yaml(namespace: str, service_account: str) -> str:
    """The CRDs (TrainingJob and kopf's peering) and the RBAC, as one YAML stream."""
    docs = [
        crd.crd_manifest(),
        *crd.peering_crd_manifests(),
        *rbac.rbac_manifests(namespace, service_account),
    ]
    return yaml.safe_dump_all(docs, sort_keys=False)


def _run(config: OperatorConfig, verbose: bool) -> None:
    import asyncio

    import kopf

    from . import handlers  # noqa: F401  (registers the handlers)

    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if config.kubeconfig:
        # kopf's own login reads $KUBECONFIG; the operator's API client gets the path directly.
        os.environ["KUBECONFIG"] = config.kubeconfig
    asyncio.run(kopf.operator(memo=kopf.Memo(config=config), **kopf_operator_args(config)))


def kopf_operator_args(config: OperatorConfig) -> dict[str, Any]:
    """The arguments of ``kopf.operator`` for ``config``.

    kopf makes peering *mandatory* whenever a peering name is passed, even with
    ``standalone=True``, and then pauses every watch until a peering object shows up: so a
    standalone operator must pass no name at all.
    """
    args: dict[str, Any] = {
        "clusterwide": not config.namespaces,
        "namespaces": list(config.namespaces),
        "standalone": config.standalone,
    }
    if not config.standalone:
        args["peering_name"] = config.peering_name
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``baton-operator`` console script."""
    args = _parser().parse_args(argv)
    if args.command == "manifests":
        sys.stdout.write(manifests_yaml(args.namespace, args.service_account))
        return 0
    _run(_config(args), args.verbose)
    return 0


if __name__ == "__main__":
    sys.exit(main())
