"""Benchmark: the operator at scale, and notice-to-commit on the local cluster.

Two modes, each on its own local cluster (``tests/cluster``) with the real operator
(``baton-operator`` under its generated RBAC, default settings but for the sidecar command),
the real sidecar in every pod, and a real Node taint as the notice
(``aws-node-termination-handler/spot-itn``, as the AWS Node Termination Handler sets it)::

    flock /tmp/baton-heavy.lock .venv/bin/python bench/operator_scale.py scale --jobs 1 25 100
    flock /tmp/baton-heavy.lock .venv/bin/python bench/operator_scale.py commit --storage file s3

``scale``: N TrainingJobs of 2 pods each (N in ``--jobs``, run one after the other on the same
cluster and operator). Each trainer is :func:`trainer_main`: no torch, a 0.1 s step loop over the
SDK's real control channel (``trainer_sdk.control``): heartbeats like the SDK, and when the
sidecar's ``request.json`` appears it records the request, reports ``requested``, ``saving``,
``committed`` and exits 75, as the SDK does after a served notice. With every pod up, the
benchmark measures for ``--idle`` seconds the operator's RSS, its CPU, and the API requests it
makes (the API server's ``apiserver_flowcontrol_dispatched_requests_total`` for the
``service-accounts`` flow schema: the operator is the only ServiceAccount client here). Then it
taints the node that holds the most of the jobs' pods and takes, for every rank of every job
with a pod there, the time from the taint to the request's ``created`` (written by the sidecar
when the operator's request reached it). ``--rounds`` repeats the taint on another node.
Ratios against the first N.

``commit``: one job of 2 ranks (``baton_testing.trainer``: DDP over gloo, AdamW) whose state
is ``--mib`` MiB (weights plus AdamW moments), on the local filesystem and on versitygw (S3).
The time from the taint to the committed manifest is split with the timestamps the parts
record: the job status (``notice.receivedAt``: the operator decided), the request's
``created`` at each sidecar, the SDK's final status (``seconds`` from the agreed step to the
commit, and its phases) and the manifest's ``time``.

Not a test: timings are never assertions. Every figure is printed with the table that
``docs/performance.md`` holds.

Why one module of this size: both modes start the same cluster, operator and trainer pods,
take the same notice and read the same timestamps; they differ only in what they measure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TAINT_KEY = "aws-node-termination-handler/spot-itn"
STEP_SECONDS = 0.1
EXIT_STOPPED_AFTER_NOTICE = 75  # trainer_sdk.EXIT_STOPPED_AFTER_NOTICE (checked in main())


# ---- the cheap trainer (runs in the pods) --------------------------------------------------


def trainer_main(out: Path) -> int:
    """A training loop with no training: the SDK's control channel, as the Checkpointer uses it.

    Writes ``ready-a<attempt>-r<rank>`` once its first status is written, and
    ``request-a<attempt>-r<rank>.json`` (the request and when this process saw it) when a
    request arrives; then reports the save as the SDK does and exits 75.
    """
    from trainer_sdk import control

    chan = control.ControlChannel(os.environ["BATON_CONTROL_DIR"])
    rank, attempt = int(os.environ["RANK"]), int(os.environ.get("BATON_ATTEMPT", "0"))
    tag = f"a{attempt}-r{rank}"
    out.mkdir(parents=True, exist_ok=True)
    status = control.Status(state=control.State.IDLE)
    chan.write_status(status)
    (out / f"ready-{tag}").write_text(str(os.getpid()))
    step, last_beat = 0, time.monotonic()
    while True:
        time.sleep(STEP_SECONDS)
        step += 1
        request = chan.read_request()
        if request is None:
            if time.monotonic() - last_beat >= 5.0:  # the SDK beats at most every 5 s
                status = status.beat()
                chan.write_status(status)
                last_beat = time.monotonic()
            continue
        seen = control.utcnow()
        record = {"request": request.to_json(), "seen": control.format_rfc3339(seen)}
        (out / f"request-{tag}.json").write_text(json.dumps(record))
        common = {"request_id": request.id, "step": step, "trigger": "notice"}
        for state in (control.State.REQUESTED, control.State.SAVING):
            chan.write_status(control.Status(state=state, deadline=request.deadline, **common))
        chan.write_status(
            control.Status(
                state=control.State.COMMITTED,
                deadline=request.deadline,
                uri=f"{os.environ.get('BATON_CHECKPOINT_URI', '')}/step-{step:012d}",
                seconds=0.0,
                last_committed_step=step,
                **common,
            )
        )
        chan.clear_request(request.id)
        return EXIT_STOPPED_AFTER_NOTICE


# ---- measuring helpers ---------------------------------------------------------------------


def _ts(text: str | None) -> float | None:
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC).timestamp()


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    s = sorted(xs)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def _wait(what: str, predicate: Any, timeout: float, interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def _say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _log_time(log: Path, needle: str, after: float) -> float:
    """The time of the first line of the operator's log holding ``needle`` at or after
    ``after`` (its ``asctime`` is local time with milliseconds)."""
    for line in log.read_text(errors="replace").splitlines():
        if needle not in line:
            continue
        with contextlib.suppress(ValueError):
            t = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if t >= after - 0.001:
                return t
    raise RuntimeError(f"no line with {needle!r} after {after} in {log}")


def _bandwidth(storage: str, uri: str, s3: Any, nbytes: int) -> float:
    """Bytes/s of a plain write of ``nbytes`` to the storage, as the SDK's two ranks do it.

    file: two threads each writing half as one file in 8 MiB blocks, then fsync (file and
    directory). s3: plain boto3 ``put_object`` of 32 MiB objects from 4 threads, the
    concurrency at which ``bench/s3.py`` found the server's limit.
    """
    from concurrent.futures import ThreadPoolExecutor

    block = os.urandom(8 * 2**20)
    if storage == "file":
        root = Path(uri) / "bandwidth"
        root.mkdir(parents=True, exist_ok=True)

        def write(i: int) -> None:
            with (root / f"part-{i}").open("wb") as f:
                for _ in range(nbytes // 2 // len(block)):
                    f.write(block)
                f.flush()
                os.fsync(f.fileno())

        began = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(write, range(2)))
        fd = os.open(root, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        took = time.monotonic() - began
        for part in root.iterdir():
            part.unlink()
        return nbytes / took
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    client = s3.client()
    obj = block * 4

    def put(i: int) -> None:
        client.put_object(Bucket=bucket, Key=f"{prefix}/bandwidth/{i}", Body=obj)

    count = max(1, nbytes // len(obj))
    began = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(put, range(count)))
    took = time.monotonic() - began
    for i in range(count):
        client.delete_object(Bucket=bucket, Key=f"{prefix}/bandwidth/{i}")
    return count * len(obj) / took


def _mem_available_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def _pods_rss_mib(cluster_dir: Path) -> tuple[int, float]:
    """(pods, their processes' summed RSS in MiB) for every pod process of the cluster."""
    pods: set[str] = set()
    total = 0.0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes()
            marker = b"LOCALCLUSTER_POD_DIR=" + str(cluster_dir).encode()
            if marker not in env:
                continue
            pod = env.split(marker, 1)[1].split(b"\0", 1)[0]
            total += _rss_mib(int(proc.name))
            pods.add(pod.decode())
        except (OSError, RuntimeError):
            continue
    return len(pods), total


@dataclass
class Bench:
    """The cluster, the operator and the verbs both modes share."""

    work: Path
    nodes: int
    cluster: Any = None
    install: Any = None
    operator: Any = None
    started: list[Any] = field(default_factory=list)
    restarts: list[float] = field(default_factory=list)
    """When the operator exited and was started again (by the watchdog, as Kubernetes
    restarts a Deployment's container)."""
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        from baton_testing.cluster import ClusterConfig, LocalCluster
        from baton_testing.operator_harness import OperatorProcess, install_operator

        _say(f"starting a local cluster of {self.nodes} spot nodes in {self.work}")
        # Capacity far above what the pods ask for: the benchmark measures the operator, not
        # the scheduler's bin packing.
        config = ClusterConfig(
            nodes=self.nodes, spot_nodes=self.nodes, cpu="512", memory="2Ti", start_timeout_s=300
        )
        self.cluster = LocalCluster.start(self.work / "cluster", config)
        self.install = install_operator(self.cluster, self.work)
        # The operator's defaults (tick 1 s, progress poll 5 s, AWS grace 120 s); only the
        # sidecar runs as a local command and polls no cloud.
        self.operator = OperatorProcess(
            install=self.install,
            log=self.work / "operator.log",
            args=["--sidecar-command", "baton-sidecar", "--sidecar-cloud", "none"],
        )
        self.operator.start()
        _wait("the operator's /healthz", self._healthy, 120)
        _wait("the operator's Lease", self._leader, 120)
        threading.Thread(target=self._watchdog, daemon=True).start()

    def _watchdog(self) -> None:
        # An operator that cannot renew its Lease in time stops on purpose (leader.py), and
        # its Deployment starts it again; here, this thread does.
        while not self._stop.wait(0.2):
            proc = self.operator.proc
            if proc is not None and proc.poll() is not None:
                self.restarts.append(time.time())
                _say(f"the operator exited ({proc.returncode}); starting it again")
                self.operator.start()

    def _healthy(self) -> bool:
        try:
            return self.operator.healthz() == 200
        except OSError:
            return False

    def _leader(self) -> bool:
        try:
            return "baton_operator_leader 1.0" in self.operator.metrics()
        except OSError:
            return False

    def stop(self) -> None:
        self._stop.set()
        if self.operator is not None:
            self.operator.stop()
        if self.cluster is not None:
            self.cluster.stop()

    @property
    def pid(self) -> int:
        assert self.operator.proc is not None
        return int(self.operator.proc.pid)

    def kjson(self, *args: str) -> Any:
        return json.loads(self.cluster.kubectl(*args, "-o", "json", timeout=120).stdout)

    def apply(self, docs: list[dict[str, Any]]) -> None:
        import yaml

        self.cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs), timeout=300)

    def pods(self) -> list[dict[str, Any]]:
        from baton_testing.operator_harness import NAMESPACE

        data = self.kjson("get", "pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/managed-by")
        return list(data["items"])

    def jobs(self) -> list[dict[str, Any]]:
        from baton_testing.operator_harness import NAMESPACE

        return list(self.kjson("get", "trainingjobs", "-n", NAMESPACE)["items"])

    def api_requests(self) -> float:
        """Requests the API server dispatched for ServiceAccount clients (the operator)."""
        text = self.cluster.kubectl("get", "--raw", "/metrics", timeout=120).stdout
        total = 0.0
        for line in text.splitlines():
            if line.startswith("apiserver_flowcontrol_dispatched_requests_total{") and (
                'flow_schema="service-accounts"' in line
            ):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def taint(self, node: str, *, on: bool) -> float:
        """Set or remove the NTH spot taint through the API; returns the time before the call."""
        from kubernetes import client

        core = client.CoreV1Api(self.cluster.api)
        body = core.read_node(node)
        taints = [t for t in (body.spec.taints or []) if t.key != TAINT_KEY]
        if on:
            taints.append(client.V1Taint(key=TAINT_KEY, value="bench", effect="NoSchedule"))
        began = time.time()
        core.patch_node(node, {"spec": {"taints": [core.api_client.sanitize_for_serialization(
            t) for t in taints] or None}})  # fmt: skip
        return began

    def delete_jobs(self) -> None:
        from baton_testing.operator_harness import NAMESPACE

        self.cluster.kubectl("delete", "trainingjobs", "--all", "-n", NAMESPACE, "--wait=false")
        _wait("every job and pod to be gone", lambda: not self.jobs() and not self.pods(), 600, 2)


# ---- scale mode ------------------------------------------------------------------------------


def _scale_manifest(name: str, out: Path, port: int) -> dict[str, Any]:
    from baton_testing.jobs import training_job
    from baton_testing.operator_harness import NAMESPACE

    return training_job(
        name, NAMESPACE,
        command=["python", str(Path(__file__).resolve()), "trainer", "--out", str(out)],
        checkpoint={"uri": str(out / "ckpt"), "everySteps": 1000000},
        failure_policy={"maxFailures": 5, "backoffSeconds": 1},
        master_port=port,
        pod={"terminationGracePeriodSeconds": 10},
    )  # fmt: skip


def _ready(bench: Bench, outs: dict[str, Path], attempts: dict[str, int]) -> bool:
    """Every job Running, every trainer started, every sidecar answering /healthz."""
    jobs = {j["metadata"]["name"]: j for j in bench.jobs()}
    for name, out in outs.items():
        st = (jobs.get(name) or {}).get("status") or {}
        if st.get("phase") != "Running":
            return False
        attempts[name] = int(st.get("attempt", 0))
        for rank in (0, 1):
            if not (out / f"ready-a{attempts[name]}-r{rank}").exists():
                return False
    for pod in bench.pods():
        labels = pod["metadata"]["labels"]
        job = labels["baton.dev/job"]
        if job not in attempts or labels["baton.dev/attempt"] != str(attempts[job]):
            continue
        ip = (pod.get("status") or {}).get("podIP")
        try:
            with urllib.request.urlopen(f"http://{ip}:9440/healthz", timeout=5) as resp:
                if resp.status != 200:
                    return False
        except OSError:
            return False
    return True


def run_scale(bench: Bench, sizes: list[int], idle: float, rounds: int) -> list[dict[str, Any]]:
    from baton_testing.ports import free_port

    results = []
    per_pod_mib = 80.0  # before the first size measured it: a sidecar and a trainer
    for n in sizes:
        need, have = 2 * n * per_pod_mib + 2048, _mem_available_mib()
        if need > have:
            _say(
                f"--- {n} jobs skipped: {2 * n} pods need about {need:.0f} MiB "
                f"({per_pod_mib:.0f} MiB per pod measured, 2 GiB kept free); "
                f"{have:.0f} MiB available"
            )
            results.append({"jobs": n, "skipped": f"needs {need:.0f} MiB, {have:.0f} available"})
            break
        _say(f"--- {n} job(s) of 2 pods")
        outs = {f"s{n}-{i:03d}": bench.work / f"s{n}" / f"j{i:03d}" for i in range(n)}
        began, restarts0 = time.monotonic(), len(bench.restarts)
        attempts: dict[str, int] = {}
        names = list(outs)
        # Submitted 5 at a time, each batch running before the next: on 2 cores, 200 Python
        # processes starting at once starve everything, the operator's Lease renewal included.
        for i in range(0, n, 5):
            batch = {k: outs[k] for k in names[i : i + 5]}
            bench.apply([_scale_manifest(k, out, free_port()) for k, out in batch.items()])
            _wait(
                f"jobs {i}..{i + len(batch) - 1} running",
                lambda batch=batch, att=attempts: _ready(bench, batch, att),  # type: ignore[misc]
                300,
                1,
            )

        def ready(outs: dict[str, Path] = outs, attempts: dict[str, int] = attempts) -> bool:
            return _ready(bench, outs, attempts)

        _wait(f"{n} jobs running", ready, 300, 2)
        startup_s = time.monotonic() - began
        _say(f"all {n} jobs running after {startup_s:.0f}s; idle {idle:.0f}s")
        idle_restarts = len(bench.restarts)
        cpu0, api0, t0 = _cpu_seconds(bench.pid), bench.api_requests(), time.monotonic()
        time.sleep(idle)
        cpu1, api1, t1 = _cpu_seconds(bench.pid), bench.api_requests(), time.monotonic()
        if len(bench.restarts) != idle_restarts:
            _say("the operator restarted during the idle window: its CPU figure is not valid")
            cpu1 = float("nan")
        rss = _rss_mib(bench.pid)
        npods, pods_mib = _pods_rss_mib(bench.work / "cluster")
        per_pod_mib = pods_mib / max(1, npods)
        _say(f"{npods} pods use {pods_mib:.0f} MiB ({per_pod_mib:.0f} MiB each)")
        reactions: list[float] = []
        taint_cpu = 0.0
        tainted: list[str] = []
        for r in range(rounds):
            if r:
                _wait(f"{n} jobs running again", ready, 600, 2)
            by_node: dict[str, list[tuple[str, int]]] = {}
            for pod in bench.pods():
                labels = pod["metadata"]["labels"]
                job = labels["baton.dev/job"]
                if job in attempts and labels["baton.dev/attempt"] == str(attempts[job]):
                    node = pod["spec"]["nodeName"]
                    by_node.setdefault(node, []).append((job, int(labels["baton.dev/rank"])))
            node = max((n_ for n_ in by_node if n_ not in tainted), key=lambda k: len(by_node[k]))
            tainted.append(node)
            hit = sorted({job for job, _ in by_node[node]})
            files = [outs[j] / f"request-a{attempts[j]}-r{rk}.json" for j in hit for rk in (0, 1)]
            c0, restarts_before = _cpu_seconds(bench.pid), len(bench.restarts)
            when = bench.taint(node, on=True)
            _wait(
                f"{len(files)} requests",
                lambda files=files: all(f.exists() for f in files),  # type: ignore[misc]
                120,
                0.1,
            )
            # A restarted operator is a new process: its CPU is not comparable, so unknown.
            restarted = len(bench.restarts) != restarts_before
            taint_cpu += float("nan") if restarted else _cpu_seconds(bench.pid) - c0
            for f in files:
                created = _ts(json.loads(f.read_text())["request"]["created"])
                assert created is not None
                reactions.append(created - when)
            _say(
                f"round {r}: {node} ({len(hit)} jobs, {len(files)} ranks): reaction p50 "
                f"{statistics.median(reactions):.2f}s max {max(reactions):.2f}s"
            )
            bench.taint(node, on=False)
        results.append(
            {
                "jobs": n,
                "pods": 2 * n,
                "rss_mib": rss,
                "cpu_pct": 100 * (cpu1 - cpu0) / (t1 - t0),
                "api_per_min": 60 * (api1 - api0) / (t1 - t0),
                "reaction_p50": statistics.median(reactions),
                "reaction_p99": _pct(reactions, 99),
                "reaction_max": max(reactions),
                "samples": len(reactions),
                "taint_cpu_s": taint_cpu,
                "pod_rss_mib": per_pod_mib,
                "operator_restarts": len(bench.restarts) - restarts0,
                "startup_s": startup_s,
                "mem_available_mib": _mem_available_mib(),
            }
        )
        _say(json.dumps(results[-1]))
        bench.delete_jobs()
    return results


def print_scale(results: list[dict[str, Any]], argv: str) -> None:
    skipped = [r for r in results if "skipped" in r]
    results = [r for r in results if "skipped" not in r]
    base = results[0]
    print(f"\nOperator scale (`{argv}`), cluster of the operator's defaults:\n")
    print(
        "| jobs (pods) | operator RSS MiB | operator CPU % (idle) | API requests/min (idle) "
        "| reaction p50 s | reaction p99 s | samples | RSS ratio | reaction p50 ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['jobs']} ({r['pods']}) | {r['rss_mib']:.0f} | {r['cpu_pct']:.1f} | "
            f"{r['api_per_min']:.0f} | {r['reaction_p50']:.2f} | {r['reaction_p99']:.2f} | "
            f"{r['samples']} | {r['rss_mib'] / base['rss_mib']:.2f}x | "
            f"{r['reaction_p50'] / base['reaction_p50']:.2f}x |"
        )
    for r in results:
        print(
            f"\n{r['jobs']} jobs: operator CPU during the taint rounds {r['taint_cpu_s']:.1f} s; "
            f"{r['pod_rss_mib']:.0f} MiB per pod (sidecar + trainer); all running after "
            f"{r['startup_s']:.0f} s; operator restarts (Lease not renewed in time) "
            f"{r['operator_restarts']}; "
            f"{r['mem_available_mib']:.0f} MiB left available"
        )
    for r in skipped:
        print(f"\n{r['jobs']} jobs not run: {r['skipped']}")


# ---- commit mode -----------------------------------------------------------------------------


class ControlPoller:
    """Keeps the newest ``request.json`` and ``status.json`` of each of a job's pods.

    The pods' control directories (emptyDirs, host directories under the cluster's pod
    directories) vanish with the pods, and the SDK removes ``request.json`` once served, so
    they are read while the save runs.
    """

    def __init__(self, pods_dir: Path, job: str) -> None:
        self.pods_dir, self.job = pods_dir, job
        self.requests: dict[str, dict[str, Any]] = {}
        self.statuses: dict[str, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for ctl in self.pods_dir.glob(f"*_{self.job}-*/volumes/baton-control"):
                pod = ctl.parent.parent.name.split("_")[1]
                for name, into in (("request.json", self.requests), ("status.json", self.statuses)):
                    with contextlib.suppress(OSError, ValueError):
                        into[pod] = json.loads((ctl / name).read_text())
            self._stop.wait(0.01)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def _commit_manifest(
    name: str, uri: str, env: list[dict[str, Any]], hidden: int, out: Path, port: int
) -> dict[str, Any]:
    from baton_testing.jobs import training_job
    from baton_testing.operator_harness import NAMESPACE

    cmd = [
        "python", "-m", "baton_testing.trainer", "--steps", "100000", "--hidden", str(hidden),
        "--loss-log", str(out / "loss.log"), "--timeout", "120",
    ]  # fmt: skip
    return training_job(
        name, NAMESPACE,
        command=cmd,
        env=[
            {"name": "PYTHONPATH", "value": f"{REPO / 'tests'}:{REPO}"},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
            *env,
        ],
        checkpoint={"uri": uri, "everySteps": 1000000},
        failure_policy={"maxFailures": 0, "backoffSeconds": 1},
        master_port=port,
        pod={"terminationGracePeriodSeconds": 60},
    )  # fmt: skip


def _read_manifest(step_uri: str, s3: Any) -> dict[str, Any]:
    if step_uri.startswith("s3://"):
        bucket, _, key = step_uri[len("s3://") :].partition("/")
        body = s3.client().get_object(Bucket=bucket, Key=f"{key}/manifest.json")["Body"]
        return dict(json.loads(body.read()))
    path = Path(step_uri.removeprefix("file://").removeprefix("file:"))
    return dict(json.loads((path / "manifest.json").read_text()))


def run_commit(bench: Bench, storage: str, mib: int) -> dict[str, Any]:
    from baton_testing.operator_harness import NAMESPACE
    from baton_testing.ports import free_port
    from baton_testing.s3 import FAKE_KEY_ID, FAKE_SECRET, REGION, VersityServer

    # baton_testing.trainer: Linear(8, h), ReLU, Dropout, Linear(h, 1): 10h + 1 parameters;
    # AdamW keeps two moments: about 12 bytes per parameter in float32 -> 120 h bytes.
    hidden = mib * 2**20 // 120
    name = f"commit-{storage}"
    out = bench.work / name
    out.mkdir(parents=True, exist_ok=True)
    s3 = None
    env: list[dict[str, Any]] = []
    if storage == "s3":
        s3 = VersityServer()
        s3.start()
        bench.started.append(s3)
        s3.client().create_bucket(Bucket="bench")
        uri = f"s3://bench/{name}"
        env = [
            {"name": "AWS_ENDPOINT_URL_S3", "value": s3.endpoint},
            {"name": "AWS_REGION", "value": REGION},
            {"name": "AWS_ACCESS_KEY_ID", "value": FAKE_KEY_ID},
            {"name": "AWS_SECRET_ACCESS_KEY", "value": FAKE_SECRET},
            {"name": "AWS_CONFIG_FILE", "value": os.devnull},
            {"name": "AWS_SHARED_CREDENTIALS_FILE", "value": os.devnull},
        ]
    else:
        uri = str(out / "ckpt")
    _say(f"--- notice to commit, {storage}, {mib} MiB (hidden {hidden})")
    bench.apply([_commit_manifest(name, uri, env, hidden, out, free_port())])
    poller = ControlPoller(bench.work / "cluster" / "pods", name)
    try:

        def trained() -> bool:
            log = out / "loss.log"
            return log.exists() and len(log.read_text().splitlines()) >= 3

        _wait("3 trained steps", trained, 600, 1)
        lines0, t0 = len((out / "loss.log").read_text().splitlines()), time.monotonic()
        time.sleep(5)
        lines1, t1 = len((out / "loss.log").read_text().splitlines()), time.monotonic()
        step_s = (t1 - t0) / max(1, lines1 - lines0)
        pods = [p for p in bench.pods() if p["metadata"]["labels"]["baton.dev/job"] == name]
        rank0 = next(p for p in pods if p["metadata"]["labels"]["baton.dev/rank"] == "0")
        node = rank0["spec"]["nodeName"]
        before = {p["metadata"]["name"] for p in pods}
        when = bench.taint(node, on=True)

        from kubernetes import client

        crds = client.CustomObjectsApi(bench.cluster.api)
        seen: dict[str, Any] = {}

        def committed() -> dict[str, Any] | None:
            # The Python client, not kubectl: the notice stays in the status only while the
            # job is Checkpointing, which can be shorter than a second.
            body = crds.get_namespaced_custom_object(
                "baton.dev", "v1alpha1", NAMESPACE, "trainingjobs", name
            )
            st = dict(body.get("status") or {})
            if (st.get("notice") or {}).get("receivedAt"):
                seen.update(st["notice"])
            last = st.get("lastCheckpoint") or {}
            if st.get("phase") == "Failed":
                raise RuntimeError(f"job failed: {st.get('message')}")
            return st if last.get("trigger") == "notice" else None

        status = _wait("the notice's commit", committed, 600, 0.05)
    finally:
        poller.stop()
    bench.taint(node, on=False)
    notice = seen
    received = _ts(notice.get("receivedAt"))  # whole seconds: the log gives the milliseconds
    oplog = bench.work / "operator.log"
    watched = _log_time(oplog, f"notice on node {node}:", when)
    decided = _log_time(oplog, f"{NAMESPACE}/{name}: EvictionNotice", when)
    step_uri = status["lastCheckpoint"]["uri"]
    manifest = _read_manifest(step_uri, s3)
    commit_t = _ts(manifest["time"])
    created = [_ts(r.get("created")) for p, r in poller.requests.items() if p in before]
    sdk = poller.statuses.get(rank0["metadata"]["name"])  # rank 0 commits the manifest
    if sdk is None or sdk.get("state") != "committed":
        raise RuntimeError(f"rank 0's last status was not 'committed': {sdk}")
    if received is None or commit_t is None or len(created) != 2 or not all(created):
        raise RuntimeError(f"missing timestamps: {notice}, {manifest}, {poller.requests}")
    handed = max(c for c in created if c is not None)
    save_start = (_ts(sdk["updated"]) or 0.0) - float(sdk["seconds"])
    phases = {k: float(v) for k, v in (sdk.get("phases") or {}).items()}
    nbytes = int(sdk.get("bytes") or 0)
    bandwidth = _bandwidth(storage, uri, s3, nbytes)
    result = {
        "storage": storage,
        "mib": mib,
        "bytes": nbytes,
        "step": manifest["step"],
        "step_seconds": step_s,
        "operator_watch": watched - when,
        "operator_decision": decided - watched,
        "operator_reaction": decided - when,
        "sidecar_handoff": handed - decided,
        "step_boundary_wait": save_start - handed,
        "phases": phases,
        "save_total": float(sdk["seconds"]),
        "manifest_after_status": commit_t - (_ts(sdk["updated"]) or 0.0),
        "taint_to_commit": commit_t - when,
        "bandwidth_mib_s": bandwidth / 2**20,
        "goal": 3.0 + nbytes / bandwidth,
    }
    _say(json.dumps(result))
    # The job moves off the node and resumes; the benchmark is done with it.
    bench.cluster.kubectl("delete", "trainingjob", name, "-n", NAMESPACE, "--wait=false")
    _wait("the job's pods to be gone", lambda: not [
        p for p in bench.pods() if p["metadata"]["labels"]["baton.dev/job"] == name
    ], 300, 2)  # fmt: skip
    if s3 is not None:
        s3.stop()
        bench.started.remove(s3)
    return result


def print_commit(results: list[dict[str, Any]], argv: str) -> None:
    print(f"\nNotice to commit on the cluster (`{argv}`):\n")
    cols = ["drain", "plan", "write", "hash", "commit"]
    print(
        "| storage | MiB | taint to commit s | goal s | operator: watch + decision | "
        "sidecar hand-off | step-boundary wait (step s) | "
        + " | ".join(cols)
        + " | SDK save total | storage MiB/s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(cols) + "---:|---:|")
    for r in results:
        ph = " | ".join(f"{r['phases'].get(c, 0.0):.2f}" for c in cols)
        print(
            f"| {r['storage']} | {r['bytes'] / 2**20:.0f} | {r['taint_to_commit']:.2f} | "
            f"{r['goal']:.2f} | {r['operator_watch']:.2f} + {r['operator_decision']:.2f} | "
            f"{r['sidecar_handoff']:.2f} | {r['step_boundary_wait']:.2f} "
            f"({r['step_seconds']:.2f}) | {ph} | {r['save_total']:.2f} | "
            f"{r['bandwidth_mib_s']:.0f} |"
        )
    print(
        "\nhash overlaps write; the phases' sum can exceed the total. Goal: 3 s plus the bytes "
        "at the storage MiB/s measured in this run (a plain write of the same bytes)."
    )


# ---- entry point -----------------------------------------------------------------------------


@contextlib.contextmanager
def _bench(work_root: str | None, nodes: int) -> Iterator[Bench]:
    work = Path(tempfile.mkdtemp(prefix="baton-opscale-", dir=work_root))
    bench = Bench(work=work, nodes=nodes)
    try:
        bench.start()
        yield bench
    except BaseException:
        tail = bench.operator.tail() if bench.operator else "(no operator)"
        _say(f"failed; the operator log ends with:\n{tail}")
        raise
    finally:
        for server in bench.started:
            server.stop()
        bench.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    sc = sub.add_parser("scale", help="operator RSS, CPU, API rate and reaction vs job count")
    sc.add_argument("--jobs", type=int, nargs="+", default=[1, 25, 100])
    sc.add_argument("--idle", type=float, default=60.0, help="seconds of idle measurement")
    sc.add_argument("--rounds", type=int, default=3, help="taints per size, each on a new node")
    sc.add_argument("--nodes", type=int, default=5)
    sc.add_argument("--dir", default=None, help="work directory root (default: $TMPDIR)")
    sc.add_argument("--json", default=None, help="also write the results here")
    cm = sub.add_parser("commit", help="taint to committed manifest, 2 ranks")
    cm.add_argument("--storage", nargs="+", choices=["file", "s3"], default=["file", "s3"])
    cm.add_argument("--mib", type=int, default=512, help="state size (weights + AdamW moments)")
    cm.add_argument("--dir", default=None)
    cm.add_argument("--json", default=None)
    tr = sub.add_parser("trainer", help="(runs in the pods) the control-channel trainer")
    tr.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if args.mode == "trainer":
        return trainer_main(args.out)
    from trainer_sdk import control

    assert control.EXIT_STOPPED_AFTER_NOTICE == EXIT_STOPPED_AFTER_NOTICE
    shown = "bench/operator_scale.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.mode == "scale":
        if args.rounds >= args.nodes:
            p.error("--rounds must be below --nodes: every round taints a node not yet tainted")
        with _bench(args.dir, args.nodes) as bench:
            results = run_scale(bench, args.jobs, args.idle, args.rounds)
        print_scale(results, shown)
    else:
        with _bench(args.dir, 3) as bench:
            results = [run_commit(bench, s, args.mib) for s in args.storage]
        print_commit(results, shown)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
