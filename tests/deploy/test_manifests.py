"""deploy/ installs the same operator as the chart, restricted, and its examples are sound.

The cluster tests (test_cluster.py) apply these for real; these checks are the offline part:
what kubectl would read, compared with what the chart renders.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from baton_testing.podsecurity import pod_specs, restricted_violations

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
EXAMPLES = sorted((DEPLOY / "examples").glob("*.yaml"))


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _kustomized() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    return [d for name in kustomization["resources"] for d in _docs(DEPLOY / name)]


def _deployment(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    return deployment


def test_kustomization_installs_crd_rbac_and_a_restricted_operator() -> None:
    docs = _kustomized()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds.count("CustomResourceDefinition") == 1
    for kind in (
        "Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
        "Service",
    ):  # fmt: skip
        assert kind in kinds
    (namespace,) = [d for d in docs if d["kind"] == "Namespace"]
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    ns = namespace["metadata"]["name"]
    namespaced = [d for d in docs if d["kind"] not in _CLUSTER_SCOPED]
    # Everything in the operator's namespace but the Role (and its binding) that reads the
    # nodes' Leases, which live in kube-node-lease.
    assert {d["metadata"]["namespace"] for d in namespaced} == {ns, "kube-node-lease"}
    assert {
        (d["kind"], d["metadata"]["name"])
        for d in namespaced
        if d["metadata"]["namespace"] == "kube-node-lease"
    } == {("Role", "baton-operator-node-leases"), ("RoleBinding", "baton-operator-node-leases")}
    deployment = _deployment(docs)
    (sa,) = [d for d in docs if d["kind"] == "ServiceAccount"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"]
    for name, spec in pod_specs(deployment):
        assert restricted_violations(spec) == [], name


_CLUSTER_SCOPED = {"Namespace", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding"}


def test_deploy_operator_matches_the_charts_default(helm: str) -> None:
    rendered = subprocess.run(
        [helm, "template", "baton", str(ROOT / "charts" / "baton"), "-n", "baton-system"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    chart = _deployment([d for d in yaml.safe_load_all(rendered) if d])
    ours = _deployment(_kustomized())
    assert (
        ours["spec"]["strategy"]
        == chart["spec"]["strategy"]
        == {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
        }
    )
    # Two replicas, one active through the Lease (docs/operator.md, "High availability").
    assert ours["spec"]["replicas"] == chart["spec"]["replicas"] == 2
    pod, chart_pod = ours["spec"]["template"]["spec"], chart["spec"]["template"]["spec"]
    assert pod["securityContext"] == chart_pod["securityContext"]
    assert pod["volumes"] == chart_pod["volumes"]
    (c,), (cc,) = pod["containers"], chart_pod["containers"]
    for field in (
        "command",
        "ports",
        "livenessProbe",
        "readinessProbe",
        "resources",
        "securityContext",
        "volumeMounts",
        "env",
    ):
        assert c[field] == cc[field], field
    assert c["args"] == cc["args"]
    assert "--identity=$(POD_NAME)" in c["args"]


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_trainingjobs_are_restricted_and_complete(path: Path) -> None:
    jobs = [d for d in _docs(path) if d["kind"] == "TrainingJob"]
    assert len(jobs) == 1
    (job,) = jobs
    assert job["apiVersion"] == "baton.dev/v1alpha1"
    spec = job["spec"]
    assert spec["replicas"] >= 1
    assert spec["checkpoint"]["uri"].startswith(("s3://", "file://", "/"))
    pod = spec["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["trainer"]
    # The operator adds the sidecar; what users write must already pass "restricted" (a
    # writable root filesystem is the user's choice).
    assert restricted_violations(pod, read_only_root=False) == []
    # Everything the job refers to by name is in the same file.
    names = {(d["kind"], d["metadata"]["name"]) for d in _docs(path)}
    for ref in _references(pod):
        assert ref in names, f"{path.name} refers to {ref} but does not define it"


def _references(pod: dict[str, Any]) -> list[tuple[str, str]]:
    refs = []
    if "serviceAccountName" in pod:
        refs.append(("ServiceAccount", pod["serviceAccountName"]))
    for volume in pod.get("volumes", []):
        if "persistentVolumeClaim" in volume:
            refs.append(("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]))
    for container in pod["containers"]:
        for source in container.get("envFrom", []):
            if "secretRef" in source:
                refs.append(("Secret", source["secretRef"]["name"]))
    return refs


def test_examples_cover_the_documented_setups() -> None:
    jobs = {p.stem: next(d for d in _docs(p) if d["kind"] == "TrainingJob") for p in EXAMPLES}
    assert set(jobs) == {"single-node", "multi-node-spot", "s3-secret", "s3-workload-identity"}
    assert jobs["single-node"]["spec"]["replicas"] == 1
    spot = jobs["multi-node-spot"]["spec"]
    assert spot["replicas"] > 1
    pod = spot["template"]["spec"]
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] > 0
    secret = jobs["s3-secret"]["spec"]["template"]["spec"]["containers"][0]["envFrom"]
    assert secret == [{"secretRef": {"name": "checkpoint-s3"}}]
    irsa = next(
        d
        for d in _docs(DEPLOY / "examples" / "s3-workload-identity.yaml")
        if d["kind"] == "ServiceAccount"
    )
    assert "eks.amazonaws.com/role-arn" in irsa["metadata"]["annotations"]
