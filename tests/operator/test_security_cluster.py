"""The operator as a security boundary, on the local cluster.

In a namespace *without* Pod Security enforcement (so nothing but Baton stands in the way):
the API server refuses every escalating pod-template field through the CRD's CEL rules, and the
operator refuses a ServiceAccount it does not allow. ``kubectl auth can-i`` as the operator's
identity shows what its RBAC denies. An RBAC outage (the ClusterRoleBinding removed) is visible
in ``/healthz``, the metrics, the job's status and Events, and recovered from.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml
from baton_operator import __main__ as operator_main
from baton_operator import rbac
from baton_testing import escalations
from baton_testing.operator_harness import (
    NAMESPACE,
    OPERATOR_NS,
    SERVICE_ACCOUNT,
    Baton,
    OperatorInstall,
    api_errors,
    poll,
    unique,
)

pytestmark = pytest.mark.cluster
# One operator process for all of this module's tests (baton_testing.operator_fixtures: an
# operator's stop costs about 6 s of teardown, per test when each test had its own).
SHARED_OPERATOR = True

OPEN_NS = "baton-open"
"""No pod-security.kubernetes.io label: Pod Security admits anything here."""


@pytest.fixture(scope="module")
def open_namespace(operator_install: OperatorInstall) -> str:
    k = operator_install.cluster.kubectl
    k("create", "namespace", OPEN_NS, check=False)
    labels = yaml.safe_load(k("get", "namespace", OPEN_NS, "-o", "yaml").stdout)["metadata"]
    assert not any(
        key.startswith("pod-security.kubernetes.io/") for key in labels.get("labels") or {}
    ), f"{OPEN_NS} must not enforce Pod Security for these tests to mean anything"
    return OPEN_NS


def _open_job(baton: Baton, name: str) -> dict[str, Any]:
    manifest = baton.job_manifest(name, steps=5, every_steps=5, sleep=0.1)
    manifest["metadata"]["namespace"] = OPEN_NS
    return manifest


def test_the_api_server_refuses_every_escalating_field(baton: Baton, open_namespace: str) -> None:
    """Every Pod Security baseline/restricted field, in every container kind (containers, init
    containers, a native sidecar; ephemeral containers at all), is refused at apply in a
    namespace without Pod Security, naming the field; what restricted allows is admitted."""
    plain = _open_job(baton, unique("tj-plain"))
    plain["spec"]["template"] = escalations.plain_template()
    dry = ("apply", "--dry-run=server", "-f", "-")
    ok = baton.cluster.kubectl(*dry, input=yaml.safe_dump(plain), check=False)
    assert ok.returncode == 0, f"a plain job must be admitted: {ok.stderr}"
    for case, mutate in escalations.ALLOWED.items():
        job = copy.deepcopy(plain)
        mutate(job["spec"]["template"])
        result = baton.cluster.kubectl(*dry, input=yaml.safe_dump(job), check=False)
        assert result.returncode == 0, (
            f"{case}: refused, though restricted allows it: {result.stderr}"
        )
    for case, (mutate, field, cel_field) in escalations.ESCALATIONS.items():
        job = copy.deepcopy(plain)
        mutate(job["spec"]["template"])
        result = baton.cluster.kubectl(*dry, input=yaml.safe_dump(job), check=False)
        assert result.returncode != 0, f"{case}: admitted in a namespace without Pod Security"
        generic = cel_field or field.replace("[0]", "[]").replace("[1]", "[]")
        assert f"{generic} is not allowed" in result.stderr, (case, result.stderr)
        assert "Security policy" in result.stderr, (case, result.stderr)


def test_the_operator_refuses_a_service_account_it_does_not_allow(
    baton: Baton, open_namespace: str
) -> None:
    name = unique("tj-sa")
    manifest = _open_job(baton, name)
    manifest["spec"]["template"]["spec"]["serviceAccountName"] = "cluster-admin-ish"
    result = baton.apply(manifest)
    assert result.returncode == 0, f"CEL does not judge ServiceAccounts: {result.stderr}"
    k = baton.cluster.kubectl
    deadline = time.monotonic() + 180
    status: dict[str, Any] = {}
    while time.monotonic() < deadline and status.get("phase") != "Failed":
        job = yaml.safe_load(k("get", "trainingjob", name, "-n", OPEN_NS, "-o", "yaml").stdout)
        status = job.get("status") or {}
        time.sleep(0.5)
    assert status.get("phase") == "Failed", f"{status}\n{baton.operator.tail()}"
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "PodTemplateRefused"
    assert "spec.template.spec.serviceAccountName" in failed["message"]
    assert "'cluster-admin-ish' is not allowed" in failed["message"]
    # The row says why (the REASON column; a Failed job once showed an empty row).
    row = k("get", "trainingjob", name, "-n", OPEN_NS).stdout
    assert "REASON" in row.splitlines()[0], row
    assert "PodTemplateRefused" in row.splitlines()[1], row
    events = k(
        "get", "events", "-n", OPEN_NS, "--field-selector", f"involvedObject.name={name}",
        "-o", "yaml",
    ).stdout  # fmt: skip
    assert "PodTemplateRefused" in events
    pods = yaml.safe_load(
        k("get", "pods", "-n", OPEN_NS, "-l", f"baton.dev/job={name}", "-o", "yaml").stdout
    )
    assert pods["items"] == [], "a refused template must not produce a pod"
    k("delete", "trainingjob", name, "-n", OPEN_NS, "--wait=false", check=False)


def _can(baton: Baton, who: str, *args: str) -> bool:
    result = baton.cluster.kubectl("auth", "can-i", *args, "--as", who, check=False)
    answer = result.stdout.strip()
    assert answer in ("yes", "no"), f"kubectl auth can-i {args}: {result.stdout}{result.stderr}"
    return answer == "yes"


def test_auth_can_i_as_the_operator(baton: Baton) -> None:
    k = baton.cluster.kubectl
    # The install every other test uses: every namespace.
    op = f"system:serviceaccount:{OPERATOR_NS}:{SERVICE_ACCOUNT}"
    k("create", "secret", "generic", "planted", "-n", "kube-system",
      "--from-literal=password=x", check=False)  # fmt: skip
    assert not _can(baton, op, "get", "secret/planted", "-n", "kube-system")
    assert not _can(baton, op, "get", "secrets", "-n", NAMESPACE)
    assert not _can(baton, op, "list", "secrets", "-A")
    assert not _can(baton, op, "get", "secret/other", "-n", OPERATOR_NS)
    assert _can(baton, op, "get", "secret/baton-operator-token-key", "-n", OPERATOR_NS)
    assert _can(baton, op, "create", "pods", "-n", NAMESPACE)
    assert not _can(baton, op, "update", "nodes")
    assert not _can(baton, op, "update", "lease/someone-else", "-n", OPERATOR_NS)
    assert _can(baton, op, "update", "lease/baton-operator", "-n", OPERATOR_NS)
    # An install limited to two namespaces: nothing outside them but read-only Nodes.
    ops, sa = "baton-scoped", "baton-scoped-operator"
    for ns in (ops, "ml-a", "ml-b", "ml-other"):
        k("create", "namespace", ns, check=False)
    docs = yaml.safe_load_all(operator_main.manifests_yaml(ops, sa, ["ml-a", "ml-b"]))
    rbac_only = [d for d in docs if d["kind"] != "CustomResourceDefinition"]
    k("apply", "-f", "-", input=yaml.safe_dump_all(rbac_only))
    scoped = f"system:serviceaccount:{ops}:{sa}"
    for ns in ("ml-a", "ml-b"):
        assert _can(baton, scoped, "create", "pods", "-n", ns)
        assert _can(baton, scoped, "patch", "trainingjobs.baton.dev", "-n", ns)
        assert not _can(baton, scoped, "get", "secrets", "-n", ns)
    for verb, resource in (("create", "pods"), ("list", "pods"), ("create", "secrets"),
                           ("get", "trainingjobs.baton.dev"), ("create", "events")):  # fmt: skip
        assert not _can(baton, scoped, verb, resource, "-n", "ml-other"), (verb, resource)
        assert not _can(baton, scoped, verb, resource, "-n", "default"), (verb, resource)
    assert not _can(baton, scoped, "list", "pods", "-A")
    assert _can(baton, scoped, "list", "nodes")
    assert not _can(baton, scoped, "patch", "nodes")
    assert not _can(baton, scoped, "get", "secret/planted", "-n", "kube-system")
    cluster_roles = [d for d in rbac_only if d["kind"] == "ClusterRole"]
    assert [d["metadata"]["name"] for d in cluster_roles] == [rbac.NODES_ROLE_NAME]


@pytest.fixture
def binding_restored(baton: Baton) -> Iterator[None]:
    """Whatever happens, the operator's ClusterRoleBinding is back after the test."""
    yield
    docs = rbac.rbac_manifests(OPERATOR_NS, SERVICE_ACCOUNT)
    baton.cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))


def test_an_rbac_outage_is_visible_and_recovered_from(baton: Baton, binding_restored: None) -> None:
    job = unique("tj-rbac")
    baton.submit(job, steps=60, every_steps=5, sleep=0.3)
    baton.wait_phase(job, "Running", timeout=240)
    # The operator may have counted 403s in an earlier test of this module: only new ones
    # count here.
    forbidden_before = api_errors(baton.operator, "403")
    baton.cluster.kubectl("delete", "clusterrolebinding", rbac.CLUSTER_ROLE_NAME)

    def forbidden_counted() -> bool:
        return api_errors(baton.operator, "403") > forbidden_before

    diag: Callable[[], str] = lambda: baton.diagnostics(job)  # noqa: E731
    poll(forbidden_counted, timeout=120, what="403s in the API error metric", diag=diag)
    # Health fails once every call has failed for 30 s: the kubelet would restart it.
    poll(lambda: baton.operator.healthz() == 503, timeout=180, what="/healthz 503", diag=diag)
    baton.cluster.kubectl(
        "apply",
        "-f",
        "-",
        input=yaml.safe_dump_all(rbac.rbac_manifests(OPERATOR_NS, SERVICE_ACCOUNT)),
    )
    poll(lambda: baton.operator.healthz() == 200, timeout=180, what="/healthz 200", diag=diag)

    def recovered(s: dict[str, Any]) -> bool:
        degraded = [c for c in s.get("conditions") or [] if c.get("type") == "Degraded"]
        return bool(degraded) and degraded[0]["reason"] == "APIRecovered"

    status = baton.wait_for(job, recovered, timeout=180, what="Degraded=False/APIRecovered")
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "False"
    assert "APIForbidden" in degraded["message"], degraded
    # The Event follows the status write (faults._report patches, then posts): awaited, not
    # read once the condition shows.
    poll(
        lambda: any(e.startswith("APIRecovered:") for e in baton.events(job)),
        timeout=60, what="the APIRecovered Event", diag=diag,
    )  # fmt: skip
    final = baton.wait_phase(job, "Succeeded", timeout=360)
    assert final["failures"] == 0
    baton.delete(job)
