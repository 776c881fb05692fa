"""The Helm chart lints, renders what its values say, rejects bad values, and is restricted.

Everything runs the real helm CLI (built from Go modules by tools/helm/build.sh) on the chart
directory; nothing here needs a cluster.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from baton_operator import rbac
from baton_operator.pure import crd
from baton_testing.podsecurity import pod_specs, restricted_violations

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "baton"
VALUES = Path(__file__).parent / "values"
NAMESPACE = "baton-system"


def _helm(helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=120, check=False)


def _render(helm: str, *args: str, release: str = "baton") -> list[dict[str, Any]]:
    result = _helm(helm, "template", release, str(CHART), "--namespace", NAMESPACE, *args)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def _name(doc: dict[str, Any]) -> str:
    return str(doc["metadata"]["name"])


def _kinds(docs: list[dict[str, Any]]) -> list[str]:
    return sorted(d["kind"] for d in docs)


CASES = {
    "defaults": [],
    "monitoring": ["-f", str(VALUES / "monitoring.yaml")],
    "custom": ["-f", str(VALUES / "custom.yaml")],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_lint_is_clean(helm: str, case: str) -> None:
    result = _helm(helm, "lint", "--strict", str(CHART), "--namespace", NAMESPACE, *CASES[case])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_pod_meets_pod_security_restricted(helm: str, case: str) -> None:
    docs = _render(helm, "--include-crds", *CASES[case])
    specs = [s for d in docs for s in pod_specs(d)]
    assert [name for name, _ in specs] == [
        f"Deployment/{_one(docs, 'Deployment')['metadata']['name']}"
    ]
    for name, spec in specs:
        assert restricted_violations(spec) == [], name


def test_restricted_checker_catches_what_the_profile_forbids() -> None:
    # The check above is only as good as the checker: break each rule once.
    good: dict[str, Any] = {
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [
            {
                "name": "c",
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "readOnlyRootFilesystem": True,
                    "capabilities": {"drop": ["ALL"]},
                },
            }
        ],
    }
    assert restricted_violations(good) == []
    breakages: dict[str, Callable[[dict[str, Any]], object]] = {
        "hostNetwork": lambda s: s.update(hostNetwork=True),
        "hostPath": lambda s: s.update(volumes=[{"name": "h", "hostPath": {"path": "/"}}]),
        "runAsNonRoot": lambda s: s["securityContext"].pop("runAsNonRoot"),
        "seccompProfile": lambda s: s["securityContext"].pop("seccompProfile"),
        "allowPrivilegeEscalation": lambda s: s["containers"][0]["securityContext"].pop(
            "allowPrivilegeEscalation"
        ),
        "capabilities.drop": lambda s: s["containers"][0]["securityContext"].pop("capabilities"),
        "capabilities.add": lambda s: s["containers"][0]["securityContext"]["capabilities"].update(
            add=["SYS_ADMIN"]
        ),
        "privileged": lambda s: s["containers"][0]["securityContext"].update(privileged=True),
        "readOnlyRootFilesystem": lambda s: s["containers"][0]["securityContext"].pop(
            "readOnlyRootFilesystem"
        ),
        "hostPort": lambda s: s["containers"][0].update(
            ports=[{"containerPort": 1, "hostPort": 1}]
        ),
    }
    for rule, breaks in breakages.items():
        spec = json.loads(json.dumps(good))
        breaks(spec)
        problems = restricted_violations(spec)
        assert len(problems) == 1, (rule, problems)
        assert rule.split(".")[0] in problems[0], (rule, problems)


def test_defaults_render_the_operator(helm: str) -> None:
    docs = _render(helm)
    assert _kinds(docs) == [
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
        "NetworkPolicy",
        "Role",
        "Role",
        "RoleBinding",
        "RoleBinding",
        "Service",
        "ServiceAccount",
    ]
    deployment = _one(docs, "Deployment")
    # Two replicas, one active through the Lease; a rolling update is safe with it.
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["baton-operator"]
    assert container["image"] == "baton-operator:0.1.0"
    assert {"containerPort": 8080, "name": "http", "protocol": "TCP"} in container["ports"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["resources"]["requests"] == {"cpu": "100m", "memory": "128Mi"}
    assert container["resources"]["limits"] == {"memory": "512Mi"}
    assert container["args"] == [
        "--metrics-port=8080",
        "--metrics-host=$(POD_IP)",
        "--sidecar-image=baton-sidecar:0.1.0",
        "--identity=$(POD_NAME)",
        f"--operator-namespace={NAMESPACE}",
        "--all-namespaces",
        "--cluster-domain=cluster.local",
        "--gang-scheduling",
    ]
    # Each replica serves its probes on its own pod IP: on 0.0.0.0, replicas that share a
    # network namespace (the local cluster's, a hostNetwork install) would take one port.
    assert container["env"] == [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    assert pod["serviceAccountName"] == _one(docs, "ServiceAccount")["metadata"]["name"]
    service = _one(docs, "Service")
    assert service["spec"]["ports"][0]["port"] == 8080


def test_rbac_rules_are_the_operators_own(helm: str) -> None:
    docs = _render(helm)
    assert _one(docs, "ClusterRole")["rules"] == rbac.rbac_rules()
    binding = _one(docs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == _one(docs, "ClusterRole")["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "baton", "namespace": NAMESPACE}
    ]
    roles = {d["metadata"]["namespace"]: d for d in docs if d["kind"] == "Role"}
    assert sorted(roles) == sorted([NAMESPACE, "kube-node-lease"])
    assert roles[NAMESPACE]["rules"] == rbac.self_rules()
    assert roles["kube-node-lease"]["rules"] == rbac.node_lease_rules()
    bindings = {d["metadata"]["namespace"]: d for d in docs if d["kind"] == "RoleBinding"}
    for ns, role in roles.items():
        assert bindings[ns]["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": _name(role),
        }


def test_watch_namespaces_grant_only_namespaced_roles_and_read_only_nodes(helm: str) -> None:
    docs = _render(helm, "--set", "operator.watchNamespaces={ml-a,ml-b}")
    (cluster_role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    assert cluster_role["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["list", "watch"]}
    ]
    roles = {(d["metadata"]["namespace"], _name(d)): d for d in docs if d["kind"] == "Role"}
    assert sorted(ns for ns, _ in roles) == ["baton-system", "kube-node-lease", "ml-a", "ml-b"]
    for (ns, _), role in roles.items():
        expected = {NAMESPACE: rbac.self_rules(), "kube-node-lease": rbac.node_lease_rules()}
        assert role["rules"] == expected.get(ns, rbac.workload_rules()), ns
    bindings = [d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")]
    assert len(bindings) == 5
    for b in bindings:
        assert b["subjects"] == [
            {"kind": "ServiceAccount", "name": "baton", "namespace": NAMESPACE}
        ]


def test_standalone_refuses_more_than_one_replica(helm: str) -> None:
    result = _helm(
        helm, "template", "baton", str(CHART), "--namespace", NAMESPACE,
        "--set", "operator.leaderElection=false", "--set", "replicas=2",
    )  # fmt: skip
    assert result.returncode != 0
    assert "set replicas: 1, or keep leader election on" in result.stderr


def test_crds_come_from_the_operator_and_render_only_on_request(helm: str) -> None:
    rendered = _render(helm, "--include-crds")
    with_crds = [d for d in rendered if d["kind"] == "CustomResourceDefinition"]
    expected = [crd.crd_manifest()]
    assert sorted(with_crds, key=_name) == sorted(expected, key=_name)
    # crds/ is not a template: `helm template` leaves it out unless asked, and `helm install`
    # applies it before the templates unless --skip-crds (tests/deploy/test_cluster.py).
    assert "CustomResourceDefinition" not in _kinds(_render(helm))
    assert [d for d in rendered if d["kind"] != "CustomResourceDefinition"] == _render(helm)


def test_monitoring_values_render_monitors_rules_and_dashboard(helm: str) -> None:
    docs = _render(helm, "-f", str(VALUES / "monitoring.yaml"))
    monitor = _one(docs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["honorLabels"] is True
    assert endpoint["interval"] == "15s"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= (
        _one(docs, "Service")["spec"]["selector"].items()
    )
    pod_monitor = _one(docs, "PodMonitor")
    assert pod_monitor["spec"]["jobLabel"] == "baton.dev/job"
    assert pod_monitor["spec"]["selector"] == {
        "matchLabels": {"app.kubernetes.io/managed-by": "baton"}
    }
    assert pod_monitor["spec"]["podMetricsEndpoints"][0]["targetPort"] == 9440
    rule = _one(docs, "PrometheusRule")
    plain = yaml.safe_load((ROOT / "deploy" / "prometheus" / "baton-rules.yaml").read_text())
    assert rule["spec"] == plain
    dashboard = _one(docs, "ConfigMap")
    assert dashboard["metadata"]["namespace"] == "monitoring"
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["metadata"]["annotations"] == {"grafana_folder": "Baton"}
    shipped = json.loads(dashboard["data"]["baton-dashboard.json"])
    assert shipped == json.loads((ROOT / "deploy" / "grafana" / "baton-dashboard.json").read_text())
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert sorted(p["metadata"]["namespace"] for p in policies) == ["ml-prod", "ml-research"]
    sidecar_rule = policies[0]["spec"]["ingress"][0]
    assert {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    } in (sidecar_rule["from"])


def test_network_policy_guards_only_the_sidecar_port(helm: str) -> None:
    docs = _render(helm)
    policy = _one(docs, "NetworkPolicy")
    spec = policy["spec"]
    assert policy["metadata"]["namespace"] == NAMESPACE
    assert spec["podSelector"] == {"matchLabels": {"app.kubernetes.io/managed-by": "baton"}}
    assert spec["policyTypes"] == ["Ingress"]
    sidecar, others = spec["ingress"]
    assert sidecar["ports"] == [{"protocol": "TCP", "port": 9440}]
    (peer,) = sidecar["from"]
    operator_labels = _one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert peer["podSelector"]["matchLabels"].items() <= operator_labels.items()
    assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}}
    # Every other port stays open to anyone (ranks talk to each other), and 9440 is not in it.
    assert "from" not in others
    tcp = sorted(
        (p["port"], p.get("endPort", p["port"])) for p in others["ports"] if p["protocol"] == "TCP"
    )
    assert tcp == [(1, 9439), (9441, 65535)]
    assert {p["protocol"] for p in others["ports"]} == {"TCP", "UDP", "SCTP"}


def test_custom_values_reach_the_deployment(helm: str) -> None:
    docs = _render(helm, "-f", str(VALUES / "custom.yaml"))
    assert "ServiceAccount" not in _kinds(docs)
    assert "NetworkPolicy" not in _kinds(docs)
    pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == (
        "registry.internal/ml/baton-operator:0.1.0@sha256:"
        "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
    )
    assert container["resources"] == {
        "requests": {"cpu": "250m", "memory": "256Mi"},
        "limits": {"cpu": "1", "memory": "1Gi"},
    }
    assert container["args"] == [
        "--metrics-port=8080",
        "--metrics-host=$(POD_IP)",
        "--sidecar-image=registry.internal/ml/baton-sidecar:0.1.0-patch1",
        "--standalone",
        "--namespace=ml-research",
        "--namespace=ml-prod",
        "--cluster-domain=k8s.corp.internal",
        "--no-gang-scheduling",
        "--verbose",
    ]
    assert container["env"][2:] == [{"name": "HTTPS_PROXY", "value": "http://proxy.internal:3128"}]
    assert pod["serviceAccountName"] == "platform-baton"
    assert pod["imagePullSecrets"] == [{"name": "internal-registry"}]
    assert pod["nodeSelector"] == {"karpenter.sh/capacity-type": "on-demand"}
    assert pod["priorityClassName"] == "system-cluster-critical"
    binding = _one(docs, "ClusterRoleBinding")
    assert binding["subjects"][0]["name"] == "platform-baton"
    assert _one(docs, "Deployment")["spec"]["replicas"] == 1


# (values, the error helm must print): each is a mistake the schema exists to catch.
BAD_VALUES = {
    "unknown key": (["--set", "replica=2"], "additional properties 'replica' not allowed"),
    "typo in a nested key": (
        ["--set", "metrics.serviceMonitor.enable=true"],
        "additional properties 'enable' not allowed",
    ),
    "pull policy": (
        ["--set", "image.pullPolicy=Sometimes"],
        "at '/image/pullPolicy': value must be one of 'Always', 'IfNotPresent', 'Never'",
    ),
    "privilege escalation": (
        ["--set", "securityContext.allowPrivilegeEscalation=true"],
        "at '/securityContext/allowPrivilegeEscalation': value must be false",
    ),
    "root": (
        ["--set", "podSecurityContext.runAsNonRoot=false"],
        "at '/podSecurityContext/runAsNonRoot': value must be true",
    ),
    "seccomp": (
        ["--set", "podSecurityContext.seccompProfile.type=Unconfined"],
        "at '/podSecurityContext/seccompProfile/type': value must be one of",
    ),
    "cpu quantity": (
        ["--set", "resources.requests.cpu=lots"],
        "'lots' does not match pattern",
    ),
    "interval type": (
        ["--set-json", "metrics.serviceMonitor.interval=30"],
        "at '/metrics/serviceMonitor/interval': got number, want string",
    ),
    "namespace name": (
        ["--set", "networkPolicy.namespaces[0]=Bad_NS"],
        "at '/networkPolicy/namespaces/0': 'Bad_NS' does not match pattern",
    ),
    "digest": (
        ["--set", "image.digest=sha256:xyz"],
        "at '/image/digest': 'sha256:xyz' does not match pattern",
    ),
    "service monitor without its service": (
        ["-f", str(VALUES / "no-monitoring-service.yaml")],
        "metrics.serviceMonitor.enabled needs metrics.service.enabled",
    ),
    "existing service account without a name": (
        ["--set", "serviceAccount.create=false"],
        "serviceAccount.name is required when serviceAccount.create is false",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_bad_values_are_rejected_with_a_clear_error(helm: str, case: str) -> None:
    args, message = BAD_VALUES[case]
    result = _helm(helm, "template", "baton", str(CHART), "--namespace", NAMESPACE, *args)
    assert result.returncode != 0, f"{case}: helm accepted it"
    assert message in result.stderr, result.stderr


def test_values_yaml_documents_every_key() -> None:
    # A key is documented by a comment right above it, or by a documented ancestor (a map
    # literal such as `resources:` documents its children). Every leaf must be documented.
    undocumented = []
    ancestors: list[tuple[int, bool]] = []  # (indent, documented) of the enclosing keys
    previous = ""
    for line in (CHART / "values.yaml").read_text().splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("#") or stripped.startswith("-"):
            previous = stripped
            continue
        indent = len(line) - len(line.lstrip())
        while ancestors and ancestors[-1][0] >= indent:
            ancestors.pop()
        key, _, value = stripped.partition(":")
        documented = previous.startswith("#") or any(d for _, d in ancestors)
        if value.strip() == "":
            ancestors.append((indent, documented))
        elif not documented:
            undocumented.append(key)
        previous = stripped
    assert undocumented == []
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(values) == set(schema["properties"])
