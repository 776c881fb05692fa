"""Operator settings: kopf is configured the way the field notes require, and the CLI."""

from __future__ import annotations

import subprocess
import sys

import kopf
import pytest
import yaml
from baton_operator import __main__ as cli
from baton_operator import handlers
from baton_operator.settings import OperatorConfig


def test_kopf_settings_from_config() -> None:
    settings = kopf.OperatorSettings()
    handlers.configure(settings, OperatorConfig(namespaces=("ml",), standalone=True))
    # Both watch timeouts set: unset, a watch can stall silently.
    assert settings.watching.server_timeout == 60
    assert isinstance(settings.watching.server_timeout, int), "timeoutSeconds=60.0 is refused"
    assert settings.watching.client_timeout == 90.0
    assert settings.watching.connect_timeout == 10.0
    assert isinstance(settings.persistence.progress_storage, kopf.AnnotationsProgressStorage)
    assert isinstance(settings.persistence.diffbase_storage, kopf.AnnotationsDiffBaseStorage)
    assert settings.persistence.finalizer == "baton.dev/operator"
    assert settings.scanning.disabled is True
    # kopf's peering is off: the Lease (leader.py) decides which replica runs kopf at all.
    assert settings.peering.standalone is True
    assert settings.peering.mandatory is False
    assert list(settings.watching.label_selectors.values()) == [
        "app.kubernetes.io/managed-by=baton"
    ]


def test_config_refuses_a_client_timeout_below_the_server_timeout() -> None:
    with pytest.raises(ValueError, match="raise the client timeout"):
        OperatorConfig(watch_server_timeout_seconds=60, watch_client_timeout_seconds=30)


def test_cli_flags_build_the_config() -> None:
    args = cli._parser().parse_args(
        ["run", "-n", "a", "-n", "b", "--standalone", "--grace", "gke=20", "--tick-seconds", "2"]
    )
    config = cli._config(args)
    assert config.namespaces == ("a", "b")
    assert config.standalone is True
    assert config.graces.gke == 20.0
    assert config.tick_seconds == 2.0
    assert config.identity  # the host name when not given
    assert config.pod_policy.allowed_service_accounts == ("default",)
    config = cli._config(
        cli._parser().parse_args(
            ["--identity", "op-1", "--operator-namespace", "ops", "--allow-service-account",
             "ci", "--lease-duration-seconds", "6"]
        )
    )  # fmt: skip
    assert (config.identity, config.operator_namespace) == ("op-1", "ops")
    assert config.pod_policy.allowed_service_accounts == ("default", "ci")
    assert config.lease_duration_seconds == 6
    with pytest.raises(SystemExit, match="NAME one of"):
        cli._config(cli._parser().parse_args(["--grace", "nope=1"]))


def test_manifests_subcommand_prints_crds_and_rbac() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "baton_operator", "manifests", "--namespace", "ops"],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    docs = list(yaml.safe_load_all(out.stdout))
    kinds = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert kinds == [
        ("CustomResourceDefinition", "trainingjobs.baton.dev"),
        ("ServiceAccount", "baton-operator"),
        ("ClusterRole", "baton-operator"),
        ("ClusterRoleBinding", "baton-operator"),
        ("Role", "baton-operator-self"),
        ("RoleBinding", "baton-operator-self"),
    ]
    assert docs[1]["metadata"]["namespace"] == "ops"
    assert docs[4]["metadata"]["namespace"] == "ops"


def test_kopf_never_peers() -> None:
    # kopf turns any peering name into *mandatory* peering (and two equal-priority peers
    # pause each other, kopf#734): the Lease elects the active operator instead.
    for config in (OperatorConfig(standalone=True), OperatorConfig(namespaces=("ml",))):
        args = cli.kopf_operator_args(config)
        assert "peering_name" not in args
        assert args["standalone"] is True
    assert cli.kopf_operator_args(OperatorConfig(namespaces=("ml",)))["namespaces"] == ["ml"]
    assert cli.kopf_operator_args(OperatorConfig())["clusterwide"] is True


def test_lease_timings_must_let_the_active_operator_stop_first() -> None:
    with pytest.raises(ValueError, match="lengthen the lease"):
        OperatorConfig(lease_duration_seconds=3, lease_renew_deadline_seconds=3.0)
    with pytest.raises(ValueError, match="lengthen the lease"):
        OperatorConfig(lease_renew_seconds=3.0, lease_renew_deadline_seconds=2.0)
