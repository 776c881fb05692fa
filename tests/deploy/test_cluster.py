"""Install Baton the two documented ways onto the local cluster, run a job, and uninstall.

* ``helm install`` of charts/baton into a namespace that enforces Pod Security ``restricted``:
  the operator comes up as a pod run by the node agents, under the chart's RBAC (its kopf login
  is the pod's ServiceAccount token); a TrainingJob in another restricted namespace runs to
  Succeeded; ``helm uninstall`` leaves nothing but the CRDs.
* ``kubectl apply -k deploy/``: the same operator, the same job, the same clean removal.

The examples in deploy/examples/ are also validated by the real API server (CRD schema, CEL)
with a server-side dry run.
"""

from __future__ import annotations

import json
import math
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from baton_testing.cluster import LocalCluster
from baton_testing.jobs import trainer_command, trainer_env, training_job
from baton_testing.operator_harness import OperatorInstall, reinstall_operator
from baton_testing.prometheus import (
    PrometheusServer,
    ScrapeTarget,
    dashboard_queries,
    rule_queries,
    substitute,
)

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "baton"
DASHBOARD = ROOT / "deploy" / "grafana" / "baton-dashboard.json"
RULES = ROOT / "deploy" / "prometheus" / "baton-rules.yaml"
RESTRICTED = "pod-security.kubernetes.io/enforce=restricted"
# The local cluster has no cloud metadata service: the sidecars need not look for one.
NO_CLOUD = ("--set", "operator.extraArgs={--sidecar-cloud=none}")
CRDS = {"trainingjobs.baton.dev"}


def _json(cluster: LocalCluster, *args: str) -> Any:
    return json.loads(cluster.kubectl(*args, "-o", "json").stdout)


def _restricted_namespace(cluster: LocalCluster, name: str) -> None:
    cluster.kubectl("create", "namespace", name)
    cluster.kubectl("label", "namespace", name, RESTRICTED, "--overwrite")


def _delete_namespaces(cluster: LocalCluster, *names: str) -> None:
    """Delete the namespaces and wait until all are gone. One request for all of them: the
    namespace controller finalizes them side by side (about 5 s each, one after the other)."""
    cluster.kubectl("delete", "namespace", *names, "--ignore-not-found", "--wait", timeout=180)


def _delete_jobs(cluster: LocalCluster, namespace: str) -> None:
    """Delete the namespace's TrainingJobs while an operator may still release them.

    Each job carries kopf's finalizer; once the operator is gone nothing removes it, and the
    namespace would stay Terminating forever. After a bounded wait, the finalizers of jobs
    that are still there are dropped (the operator that owned them is being removed anyway).
    """
    cluster.kubectl("delete", "trainingjobs", "--all", "-n", namespace, "--wait=false", check=False)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        left = _json(cluster, "get", "trainingjobs", "-n", namespace)["items"]
        if not left:
            return
        time.sleep(1)
    for job in left:
        cluster.kubectl(
            "patch", "trainingjob", job["metadata"]["name"], "-n", namespace, "--type=merge",
            "-p", '{"metadata":{"finalizers":null}}', check=False,
        )  # fmt: skip


def _diagnostics(cluster: LocalCluster, namespaces: list[str]) -> str:
    out = []
    for ns in namespaces:
        for what in ("pods", "events", "trainingjobs"):
            result = cluster.kubectl("get", what, "-n", ns, "-o", "wide", check=False)
            out.append(f"--- {what} in {ns}:\n{result.stdout}{result.stderr}")
        logs = cluster.kubectl(
            "logs", "-n", ns, "-l", "app.kubernetes.io/component=operator", "--tail=2000",
            check=False,
        )  # fmt: skip
        # The probes' access log lines would hide everything else.
        lines = [line for line in logs.stdout.splitlines() if "aiohttp.access" not in line]
        out.append(f"--- operator logs in {ns}:\n" + "\n".join(lines[-80:]) + logs.stderr)
    return "\n".join(out)


def _wait_operator_ready(
    cluster: LocalCluster, namespace: str, deployment: str, *, replicas: int = 2
) -> None:
    result = cluster.kubectl(
        "rollout", "status", f"deployment/{deployment}", "-n", namespace, "--timeout=180s",
        check=False, timeout=200,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr + _diagnostics(cluster, [namespace])

    def list_pods() -> list[dict[str, Any]]:
        selector = ("-l", "app.kubernetes.io/name")
        items: list[dict[str, Any]] = _json(cluster, "get", "pods", "-n", namespace, *selector)[
            "items"
        ]
        return items

    def all_ready(pods: list[dict[str, Any]]) -> bool:
        return len(pods) == replicas and all(
            s["ready"] for p in pods for s in p["status"].get("containerStatuses") or [{"ready": 0}]
        )

    # `rollout status` saw every replica available once; an operator that lost its Lease on a
    # loaded machine exits and is restarted (leader.py), so wait (bounded) for all to be Ready.
    deadline = time.monotonic() + 120
    pods = list_pods()
    while not all_ready(pods) and time.monotonic() < deadline:
        time.sleep(1)
        pods = list_pods()
    states = {
        p["metadata"]["name"]: [
            (s["ready"], s["restartCount"]) for s in p["status"].get("containerStatuses") or []
        ]
        for p in pods
    }
    # The chart's two replicas (one active through the Lease, one standing by), all Ready.
    assert all_ready(pods), f"(ready, restarts) per pod: {states}" + _diagnostics(
        cluster, [namespace]
    )
    for pod in pods:
        assert pod["status"]["phase"] == "Running"
        # Run by a node agent as a local process, and admitted under "restricted".
        assert pod["spec"]["nodeName"]
        assert pod["spec"]["containers"][0]["command"] == ["baton-operator"]
    names = {p["metadata"]["name"] for p in pods}
    deadline = time.monotonic() + 60
    holder = ""
    while time.monotonic() < deadline and holder not in names:
        lease = cluster.kubectl("get", "lease", "baton-operator", "-n", namespace, "-o", "json",
                                check=False)  # fmt: skip
        if lease.returncode == 0:
            holder = json.loads(lease.stdout)["spec"].get("holderIdentity") or ""
        time.sleep(0.5)
    assert holder in names, f"the Lease is held by {holder!r}, not by one of {sorted(names)}"


def _training_job(
    name: str,
    namespace: str,
    workdir: Path,
    *,
    steps: int = 12,
    sleep: float = 0.05,
    max_failures: int = 1,
) -> dict[str, Any]:
    """A two-pod TrainingJob running the project's deterministic trainer, restricted-ready."""
    out = workdir / name
    out.mkdir(parents=True)
    return training_job(
        name,
        namespace,
        image="my-training-image:1.0",
        command=trainer_command(out, steps=steps, every_steps=5, sleep=sleep),
        env=trainer_env(),
        replicas=2,
        checkpoint={"uri": str(out / "ckpt"), "everySteps": 5, "keepLast": 2},
        failure_policy={"maxFailures": max_failures, "backoffSeconds": 1},
        restricted=True,
    )


def _run_job_to_success(cluster: LocalCluster, job: dict[str, Any], watch: list[str]) -> None:
    name, namespace = job["metadata"]["name"], job["metadata"]["namespace"]
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(job))
    deadline = time.monotonic() + 300
    phase = None
    while time.monotonic() < deadline:
        status = _json(cluster, "get", "trainingjob", name, "-n", namespace).get("status", {})
        phase = status.get("phase")
        if phase in ("Succeeded", "Failed"):
            break
        time.sleep(1)
    assert phase == "Succeeded", (
        f"TrainingJob {namespace}/{name} ended in {phase!r}:\n"
        + _diagnostics(cluster, [*watch, namespace])
    )
    result = json.loads((Path(job["spec"]["checkpoint"]["uri"]).parent / "result.json").read_text())
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert result["step"] == int(command[command.index("--steps") + 1])
    cluster.kubectl("delete", "trainingjob", name, "-n", namespace, "--wait", timeout=120)


def _leftovers(cluster: LocalCluster, selector: str, namespace: str) -> list[str]:
    kinds = (
        "deployments,replicasets,pods,services,serviceaccounts,networkpolicies,configmaps,secrets,"
        "roles,rolebindings"
    )
    left = [
        f"{i['kind']}/{i['metadata']['name']}"
        for i in _json(cluster, "get", kinds, "-n", namespace, "-l", selector)["items"]
    ]
    cluster_kinds = "clusterroles,clusterrolebindings"
    left += [
        f"{i['kind']}/{i['metadata']['name']}"
        for i in _json(cluster, "get", cluster_kinds, "-l", selector)["items"]
    ]
    return left


def _wait_no_leftovers(cluster: LocalCluster, selector: str, namespace: str) -> None:
    # Pods go last (the garbage collector removes them after their ReplicaSet), so poll.
    deadline = time.monotonic() + 120
    while (left := _leftovers(cluster, selector, namespace)) and time.monotonic() < deadline:
        time.sleep(1)
    assert left == []


def test_helm_install_runs_a_job_and_uninstall_leaves_only_crds(
    local_cluster: LocalCluster, helm: str, tmp_path: Path
) -> None:
    cluster = local_cluster
    suffix = uuid.uuid4().hex[:6]
    release, ns, ml = f"baton-{suffix}", f"baton-helm-{suffix}", f"ml-helm-{suffix}"
    _restricted_namespace(cluster, ns)
    _restricted_namespace(cluster, ml)

    def run_helm(*args: str) -> subprocess.CompletedProcess[str]:
        command = [helm, *args, "--kubeconfig", str(cluster.kubeconfig)]
        return subprocess.run(command, capture_output=True, text=True, timeout=400, check=False)

    try:
        installed = run_helm(
            "install", release, str(CHART), "--namespace", ns, "--wait", "--timeout", "5m",
            "--set", f"networkPolicy.namespaces={{{ml}}}",
            "--set", "grafanaDashboard.enabled=true",
            *NO_CLOUD,
        )  # fmt: skip
        assert installed.returncode == 0, installed.stderr + _diagnostics(cluster, [ns])
        assert "Baton 0.1.0 is installed" in installed.stdout  # NOTES.txt
        for crd in CRDS:
            cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=60s")
        _wait_operator_ready(cluster, ns, release)
        policy = _json(cluster, "get", "networkpolicy", "-n", ml)["items"]
        assert [p["metadata"]["name"] for p in policy] == [f"{release}-sidecar"]

        _run_job_to_success(cluster, _training_job("helm-job", ml, tmp_path), [ns])

        removed = run_helm("uninstall", release, "--namespace", ns, "--wait")
        assert removed.returncode == 0, removed.stderr
        _wait_no_leftovers(cluster, f"app.kubernetes.io/instance={release}", ns)
        assert _leftovers(cluster, f"app.kubernetes.io/instance={release}", ml) == []
        assert _json(cluster, "get", "secrets", "-n", ns, "-l", f"name={release}")["items"] == []
        names = {c["metadata"]["name"] for c in _json(cluster, "get", "crds")["items"]}
        assert names >= CRDS, "helm uninstall must keep the CRDs (and so users' TrainingJobs)"

        # A second install over the CRDs that are still there, told to leave them alone.
        again = run_helm(
            "install", release, str(CHART), "--namespace", ns, "--skip-crds", "--wait",
            "--timeout", "5m", *NO_CLOUD,
        )  # fmt: skip
        assert again.returncode == 0, again.stderr
        _wait_operator_ready(cluster, ns, release)
        assert run_helm("uninstall", release, "--namespace", ns, "--wait").returncode == 0
        _wait_no_leftovers(cluster, f"app.kubernetes.io/instance={release}", ns)
    finally:
        _delete_jobs(cluster, ml)
        run_helm("uninstall", release, "--namespace", ns, "--wait", "--ignore-not-found")
        _delete_namespaces(cluster, ml, ns)


@pytest.fixture
def operator_install_restored(operator_install: OperatorInstall) -> Iterator[None]:
    """The session's operator install, applied again after the test.

    deploy/ and the install share the ``baton-system`` namespace, the ServiceAccount and the
    RBAC names; deleting deploy/ deletes them, and the install's token then fails every call
    with HTTP 401. Serially no operator test had run before this module, so the loss went
    unseen; run in another order (pytest-xdist's per-file workers) six operator tests that
    came after it timed out with their operator refused on every call.
    """
    yield
    reinstall_operator(operator_install)


@pytest.mark.usefixtures("operator_install_restored")
def test_kubectl_apply_k_runs_a_job_and_deletes_cleanly(
    local_cluster: LocalCluster, tmp_path: Path
) -> None:
    cluster = local_cluster
    ml = f"ml-kustomize-{uuid.uuid4().hex[:6]}"
    # The examples are valid against the real API server's schema and CEL rules.
    _restricted_namespace(cluster, ml)
    try:
        applied = cluster.kubectl("apply", "-k", str(ROOT / "deploy"), check=False, timeout=120)
        assert applied.returncode == 0, applied.stderr
        namespace = _json(cluster, "get", "namespace", "baton-system")
        assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
        _wait_operator_ready(cluster, "baton-system", "baton-operator")
        for example in sorted((ROOT / "deploy" / "examples").glob("*.yaml")):
            dry = cluster.kubectl(
                "apply", "--dry-run=server", "-n", ml, "-f", str(example), check=False
            )
            assert dry.returncode == 0, f"{example.name}: {dry.stderr}"

        _run_job_to_success(cluster, _training_job("kustomize-job", ml, tmp_path), ["baton-system"])
    finally:
        _delete_jobs(cluster, ml)
        # Everything but the CRDs (deleting a CRD deletes every TrainingJob with it), in one
        # request, while the job's namespace goes too: each namespace takes seconds to finalize.
        cluster.kubectl("delete", "namespace", ml, "--ignore-not-found", "--wait=false")
        parts = ("operator.yaml", "rbac.yaml", "namespace.yaml")
        cluster.kubectl(
            "delete", *(a for part in parts for a in ("-f", str(ROOT / "deploy" / part))),
            "--ignore-not-found", "--wait", check=False, timeout=180,
        )  # fmt: skip
        _delete_namespaces(cluster, ml)
    assert (
        _json(cluster, "get", "namespaces", "--field-selector", "metadata.name=baton-system")[
            "items"
        ]
        == []
    )
    names = {c["metadata"]["name"] for c in _json(cluster, "get", "crds")["items"]}
    assert names >= CRDS


def _helm_install(cluster: LocalCluster, helm: str, release: str, ns: str, *extra: str) -> None:
    command = [helm, "install", release, str(CHART), "--namespace", ns, "--wait"]
    command += ["--timeout", "5m", "--kubeconfig", str(cluster.kubeconfig), *NO_CLOUD, *extra]
    result = subprocess.run(command, capture_output=True, text=True, timeout=400, check=False)
    assert result.returncode == 0, result.stderr + _diagnostics(cluster, [ns])


class _Targets:
    """Keeps Prometheus' targets on the operator pod and the job's live sidecars (by pod IP)."""

    def __init__(
        self, cluster: LocalCluster, prom: PrometheusServer, operator: ScrapeTarget, ml: str
    ) -> None:
        self._cluster, self._prom, self._operator, self._ml = cluster, prom, operator, ml
        self._current: list[ScrapeTarget] = [operator]
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.wait(1.0):
                pods = _json(self._cluster, "get", "pods", "-n", self._ml, "-l", "baton.dev/job")
                targets = [self._operator] + [
                    ScrapeTarget(
                        name=f"sidecar-{p['metadata']['name']}",
                        address=f"{p['status']['podIP']}:9440",
                        labels={
                            "namespace": self._ml,
                            "job": p["metadata"]["labels"]["baton.dev/job"],
                        },
                    )
                    for p in pods["items"]
                    if p["status"].get("phase") == "Running" and p["status"].get("podIP")
                ]
                if targets != self._current:
                    self._prom.set_targets(targets)
                    self._current = targets
        except BaseException as e:  # surfaced by stop(): a dead refresher must fail the test
            self.error = e

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        if self.error is not None:
            raise AssertionError(f"the target refresher failed: {self.error!r}") from self.error


def test_prometheus_scrapes_a_preempted_job_and_every_query_runs(
    local_cluster: LocalCluster,
    helm: str,
    prometheus_server: Callable[..., PrometheusServer],
    tmp_path: Path,
) -> None:
    cluster = local_cluster
    suffix = uuid.uuid4().hex[:6]
    release, ns, ml = f"baton-{suffix}", f"baton-prom-{suffix}", f"ml-prom-{suffix}"
    _restricted_namespace(cluster, ns)
    _restricted_namespace(cluster, ml)
    targets: _Targets | None = None
    try:
        # networkPolicy off: there is no CNI here to enforce it, and Prometheus runs on the host.
        # One replica: this test follows one operator's metrics through a preemption, and the
        # notice must not take that operator's node (two replicas are test_ha_cluster.py's).
        _helm_install(
            cluster, helm, release, ns, "--set", "networkPolicy.enabled=false",
            "--set", "replicas=1",
        )  # fmt: skip
        _wait_operator_ready(cluster, ns, release, replicas=1)
        (operator_pod,) = _json(cluster, "get", "pods", "-n", ns)["items"]
        operator = ScrapeTarget(
            name="baton-operator",
            address=f"{operator_pod['status']['podIP']}:8080",
            honor_labels=True,
        )
        prom = prometheus_server([operator], rule_files=[RULES])
        targets = _Targets(cluster, prom, operator, ml)
        cluster.add_node()  # replaces the node the notice takes away

        # 44 steps: the notice comes after the first checkpoint (step 5), so 11 s or more of
        # training are left to save, move and resume in (the preemption tests leave 9.6 s).
        job = _training_job("prom-job", ml, tmp_path, steps=44, sleep=0.3, max_failures=0)
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(job))
        name = job["metadata"]["name"]

        def status() -> dict[str, Any]:
            return dict(_json(cluster, "get", "trainingjob", name, "-n", ml).get("status", {}))

        _wait_status(
            lambda s: bool(s.get("lastCheckpoint")), status, "a first checkpoint", cluster, [ns, ml]
        )
        pods = _json(cluster, "get", "pods", "-n", ml, "-l", f"baton.dev/job={name}")["items"]
        victim = next(
            p["spec"]["nodeName"]
            for p in pods
            if p["spec"]["nodeName"] != operator_pod["spec"]["nodeName"]
        )
        cluster.preempt(victim, provider="aws", grace_s=30)
        _wait_status(
            lambda s: int(s.get("preemptions", 0)) >= 1 and s.get("phase") == "Running",
            status, "the job to resume after the notice", cluster, [ns, ml],
        )  # fmt: skip

        latency = [
            (w, e)
            for w, e in dashboard_queries(DASHBOARD)
            if "baton_checkpoint_seconds_bucket" in e
        ]
        assert len(latency) == 2
        for where, expr in latency:

            def finite(expr: str = expr) -> bool:
                values = [float(r["value"][1]) for r in prom.query(substitute(expr))]
                return any(math.isfinite(v) for v in values)

            _wait_until(finite, f"{where} to have a value", timeout=120)
        failures = []
        for where, expr in dashboard_queries(DASHBOARD) + rule_queries(RULES):
            try:
                prom.query(substitute(expr))
            except Exception as e:
                failures.append(f"{where}: {e}")
        assert failures == []
        notice = prom.query("sum(baton_checkpoint_notice_to_commit_seconds_count)")
        assert notice, "the operator's notice-to-commit histogram was not scraped"
        assert float(notice[0]["value"][1]) >= 1

        final = _wait_status(
            lambda s: s.get("phase") in ("Succeeded", "Failed"),
            status,
            "the end",
            cluster,
            [ns, ml],
        )
        assert final["phase"] == "Succeeded", _diagnostics(cluster, [ns, ml])
    finally:
        _delete_jobs(cluster, ml)
        if targets is not None:
            targets.stop()
        uninstall = [helm, "uninstall", release, "-n", ns, "--wait"]
        uninstall += ["--kubeconfig", str(cluster.kubeconfig)]
        subprocess.run(uninstall, capture_output=True, timeout=300, check=False)
        _delete_namespaces(cluster, ml, ns)


def _wait_until(predicate: Callable[[], bool], what: str, *, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(1)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def _wait_status(
    done: Callable[[dict[str, Any]], bool],
    status: Callable[[], dict[str, Any]],
    what: str,
    cluster: LocalCluster,
    namespaces: list[str],
    timeout: float = 240,
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    current: dict[str, Any] = {}
    while time.monotonic() < deadline:
        current = status()
        if done(current):
            return current
        time.sleep(1)
    raise AssertionError(
        f"timed out waiting for {what}; status {current}\n" + _diagnostics(cluster, namespaces)
    )
