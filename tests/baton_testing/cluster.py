"""A real local Kubernetes cluster for tests and the demo: the driver for ``localcluster``.

Why a local build rather than kind or k3s: neither Docker nor downloaded Kubernetes binaries are
available, and the operator must meet the real API server (watches, 409 conflicts, CRD schema and
CEL validation, RBAC, garbage collection, taints, node lifecycle, PodSecurity). ``localcluster``
(``tests/cluster/``) is built from ``k8s.io/kubernetes`` and runs each pod's containers as local
processes; see ``tests/cluster/README.md`` for what is real and what is simulated.

Fixtures (registered through ``pytest_plugins`` in ``tests/conftest.py``):

* ``local_cluster`` (session): one cluster of :data:`DEFAULT_CONFIG` nodes in a temporary
  directory, stopped (with no process left behind) at the end of the session. Tests that break
  nodes should add their own with :meth:`LocalCluster.add_node` rather than break shared ones.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import kubernetes.client
import pytest

__all__ = [
    "DEFAULT_CONFIG",
    "ClusterConfig",
    "LocalCluster",
    "LocalClusterError",
    "Provider",
    "build_localcluster",
    "local_cluster",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO_ROOT / "tests" / "cluster" / "build.sh"

Provider = Literal["aws", "gke", "karpenter", "autoscaler"]


class LocalClusterError(RuntimeError):
    """The local cluster could not be built, started, driven or stopped cleanly."""


@dataclass(kw_only=True, frozen=True)
class ClusterConfig:
    """What ``localcluster up`` is asked for."""

    nodes: int = 3
    """Nodes registered at start; more can be added with :meth:`LocalCluster.add_node`."""
    spot_nodes: int = 0
    """How many of the first nodes carry spot capacity-type labels."""
    gpus_per_node: int = 2
    """``nvidia.com/gpu`` capacity per node (nothing backs it: it lets GPU requests schedule)."""
    cpu: str = "8"
    """CPU capacity per node (a quantity); raise it to schedule GPU-node-sized requests."""
    memory: str = "32Gi"
    """Memory capacity per node (a quantity)."""
    toleration_seconds: int = 10
    """Default not-ready/unreachable toleration: how long after node loss pods are evicted.
    Kubernetes' default is 300 s; 10 s keeps node-loss tests short."""
    start_timeout_s: float = 180.0
    """How long to wait for every node to be Ready (a warm start takes seconds)."""

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError(f"nodes={self.nodes}: a cluster needs at least one node")
        if not 0 <= self.spot_nodes <= self.nodes:
            raise ValueError(f"spot_nodes={self.spot_nodes} must be between 0 and nodes")


DEFAULT_CONFIG = ClusterConfig()


def build_localcluster(*, echo: bool = True) -> Path:
    """Build (or find in the cache) the ``localcluster`` binary and return its path.

    The first build compiles Kubernetes (10-25 minutes on 2 cores); later calls return at once.
    """
    if not BUILD_SCRIPT.exists():
        raise LocalClusterError(f"{BUILD_SCRIPT} is missing: run from a full checkout")
    lines: list[str] = []
    with subprocess.Popen(
        [str(BUILD_SCRIPT)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if echo:
                print(line, end="", file=sys.stderr, flush=True)
    if proc.returncode != 0 or not lines:
        tail = "\n".join(lines[-30:])
        raise LocalClusterError(
            f"{BUILD_SCRIPT} failed (exit {proc.returncode}); install Go 1.26+ and check:\n{tail}"
        )
    binary = Path(lines[-1])
    if not binary.is_file():
        raise LocalClusterError(f"{BUILD_SCRIPT} printed {binary}, which is not a file")
    return binary


def _pod_path_prefix() -> str:
    # The project's venv comes first on every container's PATH, so `python`, `baton-sidecar`
    # and `baton-operator` in pod commands are the ones under test.
    venv_bin = REPO_ROOT / ".venv" / "bin"
    if venv_bin.is_dir():
        return str(venv_bin)
    return str(Path(sys.executable).parent)


_EXEC_READ_SECONDS = 1.0
"""How long an empty environment is read again (see :func:`_read_environ`)."""


def _read_environ(pid: int) -> dict[str, str]:
    """The process's environment from /proc, ``{}`` if it is gone or a kernel thread.

    A process in the middle of ``execve`` reads as an empty environment: the file is opened
    against the old image and read after it is gone. Every container passes through that: the
    local cluster's init shim (``localcluster _container``) execs the container's command right
    after the agent reports the pod Running, and a test that looked then found the pod with no
    process (test_deleting_owner_garbage_collects_owned_pods, fresh-clone run of 7ee5fe3;
    reproduced: about 1 read in 1,000 around the shim's exec is empty, never partial). So an
    empty read of a live user-space process is read again until the new image has its
    environment (or ``_EXEC_READ_SECONDS`` pass: a process really started with an empty one).
    """
    path = Path(f"/proc/{pid}/environ")
    deadline = time.monotonic() + _EXEC_READ_SECONDS
    while True:
        try:
            raw = path.read_bytes()
        except OSError:
            return {}
        if raw or time.monotonic() > deadline or not _is_user_process(pid):
            break
        time.sleep(0.002)
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def _read_cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return ""


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _proc_state(pid: int) -> str:
    """The process's state letter from /proc (R, S, D, Z...), or "gone"."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    return stat.rsplit(")", 1)[-1].split()[0]


def _is_zombie(pid: int) -> bool:
    return _proc_state(pid) in ("Z", "gone")


def _is_user_process(pid: int) -> bool:
    """A live process with a program (kernel threads and zombies have no ``exe``)."""
    try:
        os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return False
    return True


class LocalCluster:
    """One running ``localcluster up`` process and the means to drive it.

    Start it with :meth:`start` (or use the ``local_cluster`` fixture), stop it with :meth:`stop`
    or a ``with`` block.
    """

    def __init__(self, *, binary: Path, directory: Path, config: ClusterConfig) -> None:
        self.binary = binary
        self.directory = directory
        self.config = config
        self.kubeconfig = directory / "kubeconfig"
        self.kubectl_path = binary.parent / "kubectl"
        self.log_path = directory / "up.log"
        self.startup_s: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._api: kubernetes.client.ApiClient | None = None

    @classmethod
    def start(
        cls, directory: Path, config: ClusterConfig = DEFAULT_CONFIG, *, binary: Path | None = None
    ) -> LocalCluster:
        """Start a cluster in ``directory`` and wait until every node is Ready."""
        cluster = cls(binary=binary or build_localcluster(), directory=directory, config=config)
        cluster._start()
        return cluster

    def _start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        cfg = self.config
        args = [
            str(self.binary), "up", "--dir", str(self.directory),
            "--nodes", str(cfg.nodes), "--spot-nodes", str(cfg.spot_nodes),
            "--gpus-per-node", str(cfg.gpus_per_node), "--cpu", cfg.cpu, "--memory", cfg.memory,
            "--toleration-seconds", str(cfg.toleration_seconds),
            "--pod-path-prefix", _pod_path_prefix(),
        ]  # fmt: skip
        began = time.monotonic()
        with self.log_path.open("ab") as log:
            # A session of its own, so the whole tree can be signalled and nothing inherits
            # the test runner's terminal signals.
            self._proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        ready = self.directory / "ready"
        while not ready.exists():
            if self._proc.poll() is not None:
                raise LocalClusterError(
                    f"localcluster up exited with {self._proc.returncode} before nodes were "
                    f"Ready; its log ({self.log_path}) ends with:\n{self._log_tail()}"
                )
            if time.monotonic() - began > cfg.start_timeout_s:
                self.stop()
                raise LocalClusterError(
                    f"nodes not Ready within {cfg.start_timeout_s:.0f}s; raise "
                    f"ClusterConfig.start_timeout_s or read {self.log_path}:\n{self._log_tail()}"
                )
            time.sleep(0.1)
        self.startup_s = time.monotonic() - began

    def _log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    @property
    def api(self) -> kubernetes.client.ApiClient:
        """A ``kubernetes`` client configured as the cluster admin."""
        if self._api is None:
            # cluster.json names the admin credentials as files; reading them directly keeps
            # this independent of kubeconfig parsing (the kubeconfig holds the same values).
            info = json.loads((self.directory / "cluster.json").read_text())
            conf = kubernetes.client.Configuration(
                host=info["server"],
                ssl_ca_cert=info["caFile"],
                cert_file=info["adminCertFile"],
                key_file=info["adminKeyFile"],
            )
            self._api = kubernetes.client.ApiClient(conf)
        return self._api

    def kubectl(
        self,
        *args: str,
        check: bool = True,
        input: str | None = None,
        timeout: float = 60.0,
    ) -> subprocess.CompletedProcess[str]:
        """Run the version-matched kubectl against this cluster as admin."""
        cmd = [str(self.binary), "kubectl", "--kubeconfig", str(self.kubeconfig), *args]
        result = subprocess.run(
            cmd, input=input, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and result.returncode != 0:
            raise LocalClusterError(
                f"kubectl {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}"
            )
        return result

    def _control(self, command: str, extra: Sequence[str]) -> str:
        result = subprocess.run(
            [str(self.binary), command, *extra, "--dir", str(self.directory)],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if result.returncode != 0:
            raise LocalClusterError(f"localcluster {command} failed: {result.stderr.strip()}")
        return result.stdout.strip()

    def preempt(
        self,
        node: str,
        *,
        provider: Provider = "aws",
        grace_s: int = 120,
        wait: bool = False,
        cordon_only: bool = False,
    ) -> None:
        """Give ``node`` the provider's termination notice; the machine dies after ``grace_s``.

        Returns once the notice is on the Node (or, with ``wait``, once the machine is gone).
        """
        extra = [node, "--provider", provider, "--grace", str(grace_s)]
        if wait:
            extra.append("--wait")
        if cordon_only:
            extra.append("--cordon-only")
        self._control("preempt", extra)

    def kill_node(self, node: str) -> None:
        """Lose ``node`` without notice: processes die, heartbeats stop, the Node stays."""
        self._control("kill-node", [node])

    def freeze_node(self, node: str, seconds: float, *, wait: bool = False) -> None:
        """Cut ``node`` off for ``seconds``, then bring it back, as a network blip looks from
        outside: its Lease is not renewed nor its status posted, every process of its pods is
        stopped (SIGSTOP: a sidecar does not answer, a trainer does not step) and no container
        starts; then the processes continue (SIGCONT) and the Lease is renewed and the node
        status posted at once. Nothing is killed; a node killed while frozen stays dead.
        Returns once the processes are stopped and no renewal is in flight (the thaw happens
        in the cluster), or with ``wait`` once the node is back. A dead or already frozen node
        raises :class:`LocalClusterError`."""
        extra = [node, "--seconds", str(seconds)]
        if wait:
            extra.append("--wait")
        self._control("freeze-node", extra)

    def add_node(self, *, spot: bool = False) -> str:
        """Add a node, wait until it is Ready, and return its name."""
        return self._control("add-node", ["--spot"] if spot else [])

    def nodes(self) -> list[str]:
        """Names of the nodes whose agents are alive."""
        return [n for n in self._control("nodes", []).splitlines() if n]

    def stop_apiserver(self) -> None:
        """Stop kube-apiserver as a restart does (SIGTERM, graceful shutdown, watches end).

        Returns once it has exited: its port then refuses connections. etcd (with the data),
        the scheduler, the controller-manager and the node agents keep running and retry.
        """
        self._control("stop-apiserver", [])

    def start_apiserver(self, *, timeout_s: float = 180.0, wait_controllers: bool = True) -> None:
        """Start the stopped kube-apiserver again (same address, certificates and data).

        Returns once it answers ``/readyz`` and (unless ``wait_controllers`` is false) the
        controller-manager watches again: see :meth:`wait_controller_manager`.
        """
        self._control("start-apiserver", [])
        if wait_controllers:
            self.wait_controller_manager(timeout_s=timeout_s)

    def wait_controller_manager(self, *, timeout_s: float = 180.0) -> None:
        """Wait until kube-controller-manager watches again after an API server restart, which
        can take a while: its informers retry with a back-off that grew during the outage
        (up to about a minute after a 60 s one), and until then, for example, a new namespace
        gets no ``default`` ServiceAccount and pods cannot be created in it. The sign awaited
        is exactly that: a new namespace's ``default`` ServiceAccount.
        """
        core = kubernetes.client.CoreV1Api(self.api)
        probe = f"localcluster-restarted-{os.getpid()}-{time.monotonic_ns()}"
        core.create_namespace(
            kubernetes.client.V1Namespace(metadata=kubernetes.client.V1ObjectMeta(name=probe))
        )
        try:
            deadline = time.monotonic() + timeout_s
            while not core.list_namespaced_service_account(probe).items:
                if time.monotonic() > deadline:
                    raise LocalClusterError(
                        f"kube-controller-manager did not resume within {timeout_s:.0f}s of the "
                        f"API server's restart (no ServiceAccount in namespace {probe}); see "
                        f"{self.directory / 'logs' / 'kube-controller-manager.log'}"
                    )
                time.sleep(0.5)
        finally:
            core.delete_namespace(probe)

    @contextlib.contextmanager
    def apiserver_down(self, *, wait_controllers: bool = True) -> Iterator[None]:
        """Keep kube-apiserver stopped for the body of a ``with`` block, then start it again.

        It is started again even when the body raises, so the shared cluster stays usable.
        With ``wait_controllers`` false the block ends before the controller-manager watches
        again; the caller then owes the cluster a :meth:`wait_controller_manager`.
        """
        self.stop_apiserver()
        try:
            yield
        finally:
            self.start_apiserver(wait_controllers=wait_controllers)

    def pod_processes(self, pod_uid: str) -> list[int]:
        """PIDs of live processes that belong to the pod with this UID (found via /proc)."""
        pids = []
        for pid in _pids():
            pod_dir = _read_environ(pid).get("LOCALCLUSTER_POD_DIR", "")
            mine = pod_dir.startswith(str(self.directory)) and pod_dir.endswith(pod_uid)
            if mine and not _is_zombie(pid):
                pids.append(pid)
        return pids

    def processes(self) -> list[int]:
        """PIDs of every live process this cluster started (control plane and pods)."""
        mine = []
        d = str(self.directory)
        for pid in _pids():
            if pid == os.getpid() or _is_zombie(pid):
                continue
            if d in _read_cmdline(pid) or _read_environ(pid).get(
                "LOCALCLUSTER_POD_DIR", ""
            ).startswith(d):
                mine.append(pid)
        return mine

    def rss_bytes(self) -> int:
        """Sum of the resident memory of every process of this cluster."""
        total = 0
        for pid in self.processes():
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            except OSError:
                continue
        return total

    def stop(self) -> None:
        """Stop the cluster and check that none of its processes is left behind."""
        self._api = None
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        leftovers: list[int] = []
        # Every container had SIGKILL sent by now (the agent's stop, or its parent-death
        # signal); on a loaded machine a large process can take seconds to be reaped, so only
        # one that outlives a generous wait is left behind.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            leftovers = self.processes()
            if not leftovers:
                return
            time.sleep(0.2)
        # Described before the kill: a killed process's cmdline and environ read back empty.
        described = {
            pid: f"{_read_cmdline(pid)[:160]} (state {_proc_state(pid)}, pod dir "
            f"{_read_environ(pid).get('LOCALCLUSTER_POD_DIR', '-')})"
            for pid in leftovers
        }
        for pid in leftovers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        raise LocalClusterError(
            f"processes left behind after stop (now killed): {json.dumps(described)}; "
            f"see {self.log_path}"
        )

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture(scope="session")
def local_cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    """One cluster for the whole session (see the module docstring)."""
    capture = request.config.pluginmanager.getplugin("capturemanager")
    # A cold build runs for many minutes: show its progress instead of swallowing it.
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        binary = build_localcluster()
    cluster = LocalCluster.start(tmp_path_factory.mktemp("localcluster"), binary=binary)
    try:
        yield cluster
    finally:
        cluster.stop()
