"""Operator settings: kopf is configured the way the field notes require, and the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO

import kopf
import pytest
import yaml
from baton_operator import __main__ as cli
from baton_operator import handlers
from baton_operator.pure.settings import OperatorConfig
from baton_testing.ports import free_port


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


def test_the_peer_lost_window_is_auto_seconds_or_off(capsys: pytest.CaptureFixture[str]) -> None:
    def window(*flag: str) -> float | None:
        return cli._config(cli._parser().parse_args(list(flag))).peer_lost_seconds

    assert window() is None
    assert window("--peer-lost-seconds", "auto") is None
    assert window("--peer-lost-seconds", "12.5") == 12.5
    assert window("--peer-lost-seconds", "0") == 0
    timeout = cli._parser().parse_args(["--sidecar-timeout-seconds", "1.5"])
    assert cli._config(timeout).sidecar_timeout_seconds == 1.5
    for bad, said in (("-1", "must be >= 0 (0: off)"), ("soon", "give seconds (e.g. 20) or auto")):
        with pytest.raises(SystemExit):
            cli._parser().parse_args(["--peer-lost-seconds", bad])
        assert said in capsys.readouterr().err


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
        ("Role", "baton-operator-node-leases"),
        ("RoleBinding", "baton-operator-node-leases"),
        ("Role", "baton-operator-self"),
        ("RoleBinding", "baton-operator-self"),
    ]
    assert docs[1]["metadata"]["namespace"] == "ops"
    assert docs[4]["metadata"]["namespace"] == "kube-node-lease"
    assert docs[6]["metadata"]["namespace"] == "ops"


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


def test_replicas_sharing_a_network_namespace_each_serve_their_probes(tmp_path: Path) -> None:
    """Two replicas, one port, two pod IPs (as on the local cluster, whose pods are host
    processes): each binds its own $POD_IP and answers its probes; on 0.0.0.0 the second
    exited with "address already in use" and crash-looped (CI, the demo's helm install)."""
    port = free_port()
    # An API server that is not there: the replicas serve their probes before the election,
    # and keep trying for the Lease; that is all this test needs of them.
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {"name": "c", "cluster": {"server": f"http://127.0.0.1:{free_port()}"}}
                ],
                "users": [{"name": "u", "user": {}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    replicas: dict[str, subprocess.Popen[bytes]] = {}
    logs: list[IO[bytes]] = []
    try:
        for ip in ("127.0.0.2", "127.0.0.3"):
            command = [
                sys.executable, "-m", "baton_operator", "run", "--all-namespaces",
                "--kubeconfig", str(kubeconfig), "--operator-namespace", "baton-system",
                "--identity", f"replica-{ip}", "--metrics-port", str(port),
            ]  # fmt: skip
            log = (tmp_path / f"{ip}.log").open("wb")
            logs.append(log)
            replicas[ip] = subprocess.Popen(
                command, env={**os.environ, "POD_IP": ip}, stdout=log, stderr=subprocess.STDOUT
            )
        for ip, proc in replicas.items():
            status = _wait_for_answer(f"http://{ip}:{port}/healthz", proc, deadline=120)
            assert status in (200, 503), (ip, status)
        # And they stand by: each retries the Lease through the missing API server (they
        # once exited on urllib3's MaxRetryError) and is still running after its retries.
        for ip, proc in replicas.items():
            log = tmp_path / f"{ip}.log"
            end = time.monotonic() + 120
            while log.read_text(errors="replace").count("; retrying") < 3:
                assert proc.poll() is None, log.read_text(errors="replace")
                assert time.monotonic() < end, log.read_text(errors="replace")
                time.sleep(0.2)
            assert proc.poll() is None, log.read_text(errors="replace")
    finally:
        for proc in replicas.values():
            proc.terminate()
        for proc in replicas.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for log in logs:
            log.close()


def _wait_for_answer(url: str, proc: subprocess.Popen[bytes], *, deadline: float) -> int:
    end = time.monotonic() + deadline
    while True:
        assert proc.poll() is None, f"the replica exited ({proc.returncode}) before serving {url}"
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as e:
            return int(e.code)
        except OSError:
            if time.monotonic() > end:
                raise
        time.sleep(0.2)
