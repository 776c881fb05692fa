"""Helpers of the operator's cluster tests: the operator as a real process under its own RBAC.

``operator_install`` (session) applies the CRDs and the generated RBAC to the local cluster and
writes a kubeconfig for the operator's ServiceAccount token (never admin), so that a verb
missing from ``rbac.py`` fails a test. ``baton`` (per test) starts ``baton-operator`` as a
subprocess and offers the helpers the tests share: submit a TrainingJob running the
deterministic trainer, wait for a phase, read pods and events, kill and restart the operator.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes.client
import urllib3
import yaml
from baton_operator import __main__ as operator_main
from baton_operator.pure import crd
from baton_testing.cluster import LocalCluster, Provider
from baton_testing.jobs import trainer_command, trainer_env, training_job
from baton_testing.ports import free_port

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "baton-test"
OPERATOR_NS = "baton-system"
SERVICE_ACCOUNT = "baton-operator"


@dataclass(frozen=True)
class OperatorInstall:
    """What the session fixture set up."""

    cluster: LocalCluster
    kubeconfig: Path
    """A kubeconfig holding the operator ServiceAccount's token (not admin)."""


def install_operator(local_cluster: LocalCluster, workdir: Path) -> OperatorInstall:
    """Apply the CRDs and generated RBAC; return a kubeconfig for the operator's token."""
    k = local_cluster.kubectl
    k("create", "namespace", OPERATOR_NS, check=False)
    k("apply", "-f", "-", input=operator_main.manifests_yaml(OPERATOR_NS, SERVICE_ACCOUNT))
    k("wait", "--for=condition=Established", "--timeout=120s", "crd/trainingjobs.baton.dev")
    # The test namespace enforces the restricted Pod Security profile: every pod the operator
    # builds must pass it.
    k("create", "namespace", NAMESPACE, check=False)
    k(
        "label",
        "--overwrite",
        "namespace",
        NAMESPACE,
        "pod-security.kubernetes.io/enforce=restricted",
    )
    token = k("create", "token", SERVICE_ACCOUNT, "-n", OPERATOR_NS, "--duration=6h").stdout.strip()
    info = json.loads((local_cluster.directory / "cluster.json").read_text())
    kubeconfig = workdir / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "local",
                        "cluster": {
                            "server": info["server"],
                            "certificate-authority": info["caFile"],
                        },
                    }
                ],
                "users": [{"name": "baton-operator", "user": {"token": token}}],
                "contexts": [
                    {"name": "operator", "context": {"cluster": "local", "user": "baton-operator"}}
                ],
                "current-context": "operator",
            }
        )
    )
    kubeconfig.chmod(0o600)
    return OperatorInstall(cluster=local_cluster, kubeconfig=kubeconfig)


def reinstall_operator(install: OperatorInstall) -> None:
    """Apply ``install`` again, with a new token in the same kubeconfig file.

    For a test that deletes what ``deploy/`` shares with this install (the ``baton-system``
    namespace, the operator's ServiceAccount and RBAC: same names): the token of a deleted
    ServiceAccount no longer authenticates (HTTP 401 on every call), so every operator started
    after that test would act on nothing.
    """
    install_operator(install.cluster, install.kubeconfig.parent)


@dataclass
class OperatorProcess:
    """One ``baton-operator`` subprocess (restartable)."""

    install: OperatorInstall
    log: Path
    args: list[str]
    proc: subprocess.Popen[bytes] | None = None
    metrics_port: int = field(default_factory=free_port)
    identity: str = field(default_factory=lambda: f"op-{uuid.uuid4().hex[:6]}")
    """Its name in the Lease; kept across restart() like a pod's name across container
    restarts. Two OperatorProcess objects are two replicas."""

    def start(self) -> None:
        cmd = [
            str(REPO / ".venv" / "bin" / "baton-operator"),
            "run",
            "--kubeconfig",
            str(self.install.kubeconfig),
            "--all-namespaces",
            "--operator-namespace",
            OPERATOR_NS,
            "--identity",
            self.identity,
            "--metrics-port",
            str(self.metrics_port),
            *self.args,
        ]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def kill(self) -> None:
        """SIGKILL: the operator dies mid-flow, as on a node loss or an OOM."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def metrics(self) -> str:
        """The text of its ``/metrics`` (raises when it does not answer)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as resp:
            return str(resp.read().decode())

    def healthz(self) -> int:
        """The HTTP status of its ``/healthz``."""
        url = f"http://127.0.0.1:{self.metrics_port}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as e:
            return int(e.code)

    def tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no operator log)"


class PodWatcher:
    """Samples the job's pods in the background: for "no duplicate pods" and "attempts never
    overlap" checks."""

    def __init__(self, baton: Baton, job: str) -> None:
        self._baton = baton
        self._job = job
        self.samples: list[list[dict[str, Any]]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(self._baton.pods(self._job))
            except Exception as e:  # kept and reported by violations(), never dropped
                self.errors.append(f"{type(e).__name__}: {e}")
            self._stop.wait(0.3)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        assert not self._thread.is_alive(), "the pod watcher did not stop within 60 s"

    def violations(self, replicas: int, *, tolerate_errors: bool = False) -> list[str]:
        """Overlapping attempts, duplicate names or too many live pods in any sample.

        Fails (rather than finding nothing) when there were no samples, or when sampling
        failed and the test did not expect it (``tolerate_errors``: an API outage).
        """
        assert self.samples, f"the pod watcher took no sample; errors: {self.errors[-3:]}"
        assert tolerate_errors or not self.errors, f"pod sampling failed: {self.errors[-3:]}"
        found = []
        for sample in self.samples:
            live = [
                p
                for p in sample
                if p["status"].get("phase") in ("Pending", "Running")
                and not p["metadata"].get("deletionTimestamp")
            ]
            attempts = {p["metadata"]["labels"]["baton.dev/attempt"] for p in live}
            if len(attempts) > 1:
                found.append(f"pods of attempts {sorted(attempts)} live at once")
            names = [p["metadata"]["name"] for p in sample]
            if len(names) != len(set(names)):
                found.append(f"duplicate pod names {names}")
            if len(live) > replicas:
                found.append(f"{len(live)} live pods for {replicas} replicas")
        return found


@dataclass
class Baton:
    """Helpers for one test: an operator process and the job-level verbs."""

    install: OperatorInstall
    workdir: Path
    operator: OperatorProcess

    @property
    def cluster(self) -> LocalCluster:
        return self.install.cluster

    def kubectl_json(self, *args: str) -> Any:
        return json.loads(self.cluster.kubectl(*args, "-o", "json").stdout)

    def _get_json(self, call: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """One GET as admin through the session's API client, decoded as the API server
        sent it (what ``kubectl get -o json`` prints, less kubectl's own ``kind: List``).

        The helpers that tests poll (a job's status, its pods, its events) use this, not a
        kubectl process: a test waits on them several times a second while a PodWatcher
        samples, and a kubectl process per call cost about 0.1 s of CPU, a quarter of one
        of this machine's two cores taken from the trainers and the operator under test.
        """
        resp = call(*args, _preload_content=False, _request_timeout=30, **kw)
        return json.loads(resp.data)

    def job_manifest(
        self,
        name: str,
        *,
        steps: int = 40,
        replicas: int = 2,
        every_steps: int = 5,
        sleep: float = 0.25,
        command: list[str] | None = None,
        min_replicas: int | None = None,
        failure_policy: dict[str, Any] | None = None,
        node_selector: dict[str, str] | None = None,
        extra_spec: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        out = self.workdir / name
        out.mkdir(parents=True, exist_ok=True)
        pod: dict[str, Any] = {"terminationGracePeriodSeconds": 20}
        if node_selector:
            pod["nodeSelector"] = node_selector
        spec = dict(extra_spec or {})
        if min_replicas is not None:
            spec["minReplicas"] = min_replicas
            spec["elasticWaitSeconds"] = 5
        return training_job(
            name,
            NAMESPACE,
            command=command
            or trainer_command(out, steps=steps, every_steps=every_steps, sleep=sleep),
            env=trainer_env(),
            replicas=replicas,
            checkpoint={"uri": str(out / "ckpt"), "everySteps": every_steps},
            failure_policy=failure_policy or {"maxFailures": 0, "backoffSeconds": 1},
            # Pods share the host's network here: a port per job keeps rendezvous apart.
            master_port=free_port(),
            pod=pod,
            spec=spec,
        )

    def apply(self, manifest: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        return self.cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest), check=False)

    def submit(self, name: str, **kw: Any) -> dict[str, Any]:
        manifest = self.job_manifest(name, **kw)
        result = self.apply(manifest)
        assert result.returncode == 0, result.stderr
        return manifest

    def job(self, name: str) -> dict[str, Any]:
        api = kubernetes.client.CustomObjectsApi(self.cluster.api)
        return dict(
            self._get_json(
                api.get_namespaced_custom_object, crd.GROUP, crd.VERSION, NAMESPACE,
                crd.PLURAL, name,
            )
        )  # fmt: skip

    def status(self, name: str) -> dict[str, Any]:
        return dict(self.job(name).get("status") or {})

    def pods(self, job: str) -> list[dict[str, Any]]:
        core = kubernetes.client.CoreV1Api(self.cluster.api)
        data = self._get_json(
            core.list_namespaced_pod, NAMESPACE, label_selector=f"baton.dev/job={job}"
        )
        return list(data["items"])

    def events(self, job: str) -> list[str]:
        core = kubernetes.client.CoreV1Api(self.cluster.api)
        data = self._get_json(
            core.list_namespaced_event, NAMESPACE, field_selector=f"involvedObject.name={job}"
        )
        return [f"{e.get('reason')}: {e.get('message')}" for e in data["items"]]

    def diagnostics(self, job: str) -> str:
        pods = self.cluster.kubectl("get", "pods", "-n", NAMESPACE, "-o", "wide", check=False)
        return (
            f"\n--- status ---\n{json.dumps(self.status(job), indent=1)}"
            f"\n--- pods ---\n{pods.stdout}"
            f"\n--- events ---\n"
            + "\n".join(self.events(job))
            + f"\n--- operator log ---\n{self.operator.tail()}"
        )

    def wait_for(
        self,
        job: str,
        predicate: Callable[[dict[str, Any]], bool],
        *,
        timeout: float,
        what: str,
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        status: dict[str, Any] = {}
        while time.monotonic() < deadline:
            try:
                status = self.status(job)
            except (kubernetes.client.ApiException, urllib3.exceptions.HTTPError, ValueError):
                pass  # the API server is busy or restarting: ask again; the predicate decides
            else:
                # Outside the try: an assertion raised by the predicate (the job Failed while
                # the test waits for another phase) must reach the test.
                if predicate(status):
                    return status
            if self.operator.proc is not None and self.operator.proc.poll() is not None:
                raise AssertionError(
                    f"the operator exited while waiting for {what}" + self.diagnostics(job)
                )
            time.sleep(0.25)
        raise AssertionError(
            f"timed out after {timeout:.0f}s waiting for {what}" + self.diagnostics(job)
        )

    def wait_phase(self, job: str, phase: str, *, timeout: float = 240) -> dict[str, Any]:
        def done(s: dict[str, Any]) -> bool:
            if s.get("phase") == "Failed" and phase != "Failed":
                raise AssertionError(f"job Failed: {s.get('message')}" + self.diagnostics(job))
            return bool(s.get("phase") == phase)

        return self.wait_for(job, done, timeout=timeout, what=f"phase {phase}")

    def notice_while_held(
        self,
        job: str,
        out: Path,
        *,
        hold_at: int,
        replicas: int = 2,
        provider: Provider = "aws",
        grace_s: int = 40,
    ) -> tuple[str, dict[str, Any]]:
        """For a script that holds after step ``hold_at`` (each rank writes ``held-<rank>``
        into ``out`` and waits for the file ``out/release``), so that a notice always lands
        mid-run however slow the machine: wait until every rank holds, give rank 1's node a
        ``provider`` notice (an AWS spot one by default; the machine goes ``grace_s`` later),
        wait for the operator's checkpoint requests, release the ranks and wait for the next
        attempt. Returns the noticed node and the status at the restart."""

        def held(s: dict[str, Any]) -> bool:
            if s.get("phase") == "Failed":
                raise AssertionError(f"job Failed: {s.get('message')}" + self.diagnostics(job))
            return all((out / f"held-{rank}").exists() for rank in range(replicas))

        self.wait_for(job, held, timeout=300, what=f"every rank past step {hold_at}")
        node = self.node_of(job, 1)
        self.cluster.preempt(node, provider=provider, grace_s=grace_s)

        def requested(s: dict[str, Any]) -> bool:
            return bool((s.get("notice") or {}).get("requestedAt"))

        self.wait_for(job, requested, timeout=120, what="the checkpoint requests to the sidecars")
        (out / "release").write_text("")

        return node, self.wait_for(job, next_attempt, timeout=180, what="the next attempt")

    def wait_moved_once(
        self, job: str, noticed_node: str, watcher: Any, *, replicas: int, timeout: float = 240
    ) -> dict[str, Any]:
        """Wait until a job preempted once Succeeds; check that it counted one preemption and
        no failure, that attempt 1 ran off ``noticed_node``, and that ``watcher`` (stopped
        here) saw no overlapping or duplicate pods. Returns the final status."""
        final = self.wait_phase(job, "Succeeded", timeout=timeout)
        watcher.stop()
        assert (final["preemptions"], final["failures"]) == (1, 0), final
        for pod in self.pods(job):
            if pod["metadata"]["labels"]["baton.dev/attempt"] == "1":
                assert pod["spec"]["nodeName"] != noticed_node, "attempt 1 ran on the noticed node"
        assert watcher.violations(replicas=replicas) == []
        return final

    def wait_steps(self, job: str, steps: int, *, timeout: float = 120) -> None:
        log = self.workdir / job / "loss.log"

        def trained(_: dict[str, Any]) -> bool:
            return log.exists() and len(log.read_text().splitlines()) >= steps

        self.wait_for(job, trained, timeout=timeout, what=f"{steps} trained steps")

    def loss_steps(self, job: str) -> list[int]:
        """Steps rank 0 logged, in order (each appears once when no work was recomputed)."""
        lines = (self.workdir / job / "loss.log").read_text().splitlines()
        return [int(line.split()[0]) for line in lines]

    def node_of(self, job: str, rank: int) -> str:
        status = self.status(job)
        for p in self.pods(job):
            labels = p["metadata"]["labels"]
            if labels["baton.dev/rank"] == str(rank) and labels["baton.dev/attempt"] == str(
                status.get("attempt", 0)
            ):
                return str(p["spec"]["nodeName"])
        raise AssertionError(f"no pod for rank {rank}" + self.diagnostics(job))

    def resume_env(self, job: str, attempt: int) -> set[str | None]:
        values: set[str | None] = set()
        for p in self.pods(job):
            if p["metadata"]["labels"]["baton.dev/attempt"] != str(attempt):
                continue
            env = {
                e["name"]: e.get("value")
                for c in p["spec"]["containers"]
                if c["name"] == "trainer"
                for e in c.get("env", [])
            }
            values.add(env.get("BATON_RESUME_STEP"))
        return values

    def lease_holder(self) -> str:
        """Who holds the operators' Lease now ("" when nobody does, or there is none yet)."""
        found = self.cluster.kubectl(
            "get", "lease", "baton-operator", "-n", OPERATOR_NS, "-o", "json", check=False
        )
        if found.returncode != 0:
            assert "NotFound" in found.stderr, found.stderr
            return ""
        lease = json.loads(found.stdout)
        return str((lease.get("spec") or {}).get("holderIdentity") or "")

    def delete(self, job: str) -> None:
        self.cluster.kubectl(
            "delete", "trainingjob", job, "-n", NAMESPACE, "--wait=false", check=False
        )


def operator_process(install: OperatorInstall, workdir: Path) -> OperatorProcess:
    """An operator process with test-sized settings (not started)."""
    return OperatorProcess(
        install=install,
        log=workdir / "operator.log",
        args=[
            "--sidecar-command",
            "baton-sidecar",
            "--sidecar-cloud",
            "none",
            "--tick-seconds",
            "0.5",
            "--progress-poll-seconds",
            "0.5",
            "--node-lost-seconds",
            "10",
            "--delete-grace-seconds",
            "10",
            "--grace",
            "aws_spot=25",
            "--grace",
            "karpenter=25",
            "--grace",
            "autoscaler=25",
            "--grace",
            "cordon=25",
        ],
    )


def next_attempt(status: dict[str, Any]) -> bool:
    """A ``wait_for`` predicate: the job's next attempt (1 or later) is Pending or Running."""
    attempt = int(status.get("attempt", 0))
    return attempt >= 1 and status.get("phase") in ("Pending", "Running")


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:5]}"


def poll(
    predicate: Callable[[], bool], *, timeout: float, what: str, diag: Callable[[], str]
) -> float:
    """Poll ``predicate`` until it is true and return the seconds that took; on timeout fail
    naming ``what``, followed by ``diag()``. For conditions outside a job's status (the
    Lease, metrics, ``/healthz``); :meth:`Baton.wait_for` is the one for status."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}" + diag())


def api_errors(op: OperatorProcess, code: str) -> float:
    """The operator's ``baton_operator_api_errors_total`` for ``code``, summed over verbs."""
    total = 0.0
    for line in op.metrics().splitlines():
        if line.startswith("baton_operator_api_errors_total{") and f'code="{code}"' in line:
            total += float(line.split()[-1])
    return total
