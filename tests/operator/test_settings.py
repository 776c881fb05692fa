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
    assert settings.peering.name == "baton"
    assert settings.peering.standalone is True
    assert settings.peering.clusterwide is False
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
        ("CustomResourceDefinition", "clusterkopfpeerings.kopf.dev"),
        ("CustomResourceDefinition", "kopfpeerings.kopf.dev"),
        ("ServiceAccount", "baton-operator"),
        ("ClusterRole", "baton-operator"),
        ("ClusterRoleBinding", "baton-operator"),
    ]
    assert docs[3]["metadata"]["namespace"] == "ops"


def test_standalone_passes_no_peering_name_to_kopf() -> None:
    # kopf turns any peering name into *mandatory* peering, which pauses every watch of a
    # standalone operator (deploy/'s kubectl -k install) until a peering object exists.
    standalone = cli.kopf_operator_args(OperatorConfig(standalone=True))
    assert "peering_name" not in standalone
    assert standalone["standalone"] is True
    assert standalone["clusterwide"] is True
    peered = cli.kopf_operator_args(OperatorConfig(namespaces=("ml",), peering_name="baton"))
    assert peered["peering_name"] == "baton"
    assert peered["standalone"] is False
    assert peered["namespaces"] == ["ml"]
    assert peered["clusterwide"] is False
