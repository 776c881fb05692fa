"""The driver of Baton's demo (``examples/demo/run.py``): everything but the job and the report.

The example says what a user would read: the TrainingJob, how its node is taken away, and the
report. This module does the rest, with the same parts the tests use: it builds and starts the
local cluster (three tainted spot nodes and one on-demand node), an S3 server with a bucket,
installs the operator with the Helm chart into namespaces that enforce Pod Security
``restricted``, applies the job, follows it (phases, training steps, the notices the operator
recorded), interrupts the node of one rank at the steps it is given, trains the same job
uninterrupted for the reference, measures every interruption and draws the loss plot.
:func:`run_demo` runs it all and returns the demo's exit status.

It is importable from the project's ``.venv`` (``make venv`` names ``tests/`` in it through a
``.pth`` file), as pytest's ``pythonpath`` makes it for the tests.

Why one module of this size: the demo, its goodput version (``bench/goodput.py``) and the
demo's test drive one sequence of the same processes (cluster, S3 server, operator, job,
interruptions, reference run, measurements, plot), and :class:`Demo` holds their handles and
their order; the reports those runs print are built from the same few records.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any, Final, cast

import kubernetes.client
import kubernetes.watch
import yaml
from baton_testing.cluster import ClusterConfig, LocalCluster, Provider, build_localcluster
from baton_testing.ports import free_port
from baton_testing.s3 import FAKE_KEY_ID, FAKE_SECRET, REGION, VersityServer

__all__ = [
    "JOB",
    "JOB_NS",
    "NO_NOTICE",
    "SPOT_TOLERATION",
    "TRAIN",
    "DemoConfig",
    "DemoError",
    "Interrupt",
    "JobBuilder",
    "Report",
    "run_demo",
    "say",
]

ROOT: Final = Path(__file__).resolve().parents[2]
TRAIN: Final = ROOT / "examples" / "tinylm" / "train.py"
CHART: Final = ROOT / "charts" / "baton"
HELM_BUILD: Final = ROOT / "tools" / "helm" / "build.sh"
CACHE: Final = Path(os.environ.get("BATON_CACHE_DIR", Path.home() / ".cache" / "baton"))

OPERATOR_NS: Final = "baton-system"
JOB_NS: Final = "ml"
JOB: Final = "tinylm"
RESTRICTED: Final = "pod-security.kubernetes.io/enforce=restricted"
# A spot node pool's taint (GKE's, as `gcloud ... --spot` pools are usually tainted): only
# workloads that tolerate it land on spot capacity.
SPOT_TAINT: Final = "cloud.google.com/gke-spot=true:NoSchedule"
SPOT_TOLERATION: Final[dict[str, str]] = {
    "key": "cloud.google.com/gke-spot",
    "operator": "Equal",
    "value": "true",
    "effect": "NoSchedule",
}
"""What a job needs in its pod template to land on the demo's spot nodes (``SPOT_TAINT``)."""
GROUP, VERSION, PLURAL = "baton.dev", "v1alpha1", "trainingjobs"


class DemoError(RuntimeError):
    """The demo could not run to the end; the message says which phase and why."""


@dataclass(kw_only=True, frozen=True)
class DemoConfig:
    """What one demo run does (the command-line options)."""

    goodput: bool = False
    """Run the goodput benchmark's short version instead (``examples/demo/run.py --goodput``)."""
    provider: Provider = "aws"
    """Whose notice the node gets: aws, gke, karpenter or autoscaler."""
    preemptions: int = 1
    """How many notices (or node losses), one per attempt."""
    kill_node: bool = False
    """Lose the node without notice instead (restore from the last periodic checkpoint)."""
    fast_every_steps: int | None = 1
    """With ``kill_node``: run the job a second time with the memory tier on
    (``checkpoint.fastEverySteps``), interrupted the same way, and report both paths side by
    side. None: only today's path."""
    storage: str = "s3"
    """Checkpoints in the demo's S3 server (s3) or on the local filesystem (file)."""
    out: Path = Path("demo-out")
    """Where the report, the plot and the logs go."""
    steps: int = 100
    """Training steps of the job."""
    every_steps: int = 10
    """Periodic checkpoint interval (what an unannounced loss falls back to)."""
    step_sleep: float = 0.25
    """Seconds each step sleeps, so that there is time to preempt mid-run."""
    timeout: float = 900.0
    """Seconds the job may take from apply to Succeeded."""


NO_NOTICE: Final = "no notice"
"""An :class:`Interruption`'s ``kind`` when the node was lost without notice (a notice's is
``"<provider> notice"``)."""


@dataclass
class Interruption:
    """What happened around one notice or node loss."""

    kind: str
    """``"aws notice"``, ``"gke notice"``, ...; :data:`NO_NOTICE` for a node lost without one."""
    node: str
    rank: int
    at_step: int
    injected_at: float
    notice: dict[str, Any] = field(default_factory=dict)
    committed: dict[str, Any] = field(default_factory=dict)
    resumed_step: int | None = None
    restore_seconds: float | None = None
    resumed_at: float | None = None
    last_step_before: int = 0


JobBuilder = Callable[[str, list[dict[str, Any]], Path, int | None], dict[str, Any]]
"""Builds the TrainingJob from the checkpoint URI, the trainer's storage env, the loss log and
the memory tier's interval (``checkpoint.fastEverySteps``; None: no memory tier)."""
Interrupt = Callable[[LocalCluster, str, int, int], str]
"""Takes a node away (cluster, node, rank, step) and names what it did ("aws notice")."""
Report = Callable[["DemoConfig", dict[str, Any], list[str]], str]
"""Renders the measured run (see :func:`measure`) and the job's Events as Markdown."""


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def _ts(value: str | None) -> float | None:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp() if value else None


def read_log(path: Path) -> list[dict[str, Any]]:
    """The trainer's JSON lines (a half-written last line is skipped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))
    return out


# --------------------------------------------------------------------------- reference


def _reference_key(cfg: DemoConfig) -> str:
    digest = hashlib.sha256()
    sources = [TRAIN, *sorted((ROOT / "trainer_sdk").rglob("*.py"))]
    for path in sources:
        digest.update(str(path.relative_to(ROOT)).encode())
        digest.update(path.read_bytes())
    import torch

    # The arguments that change the arithmetic (the step sleep does not); torch's version too.
    digest.update(json.dumps([cfg.steps, cfg.every_steps, 2, torch.__version__]).encode())
    return digest.hexdigest()[:16]


def reference_run(cfg: DemoConfig) -> tuple[str, list[dict[str, Any]]]:
    """The same job never interrupted: 2 local gloo processes with the env the pods get.

    Cached under ``$BATON_CACHE_DIR/demo-ref/<hash of train.py, the SDK and the args>``.
    """
    cached = CACHE / "demo-ref" / _reference_key(cfg)
    if (cached / "sha256").exists():
        say(f"reference: cached in {cached}")
        return (cached / "sha256").read_text().strip(), read_log(cached / "loss.jsonl")
    say(f"reference: training the same job uninterrupted ({cfg.steps} steps, 2 ranks)")
    with tempfile.TemporaryDirectory(prefix="baton-demo-ref-") as tmp:
        log = Path(tmp) / "loss.jsonl"
        port = str(free_port())
        procs = []
        for rank in (0, 1):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "BATON_CHECKPOINT_URI": str(Path(tmp) / "ckpt"),
                "BATON_EVERY_STEPS": str(cfg.every_steps),
                "BATON_ATTEMPT": "0",
                "TINYLM_LOG": str(log),
                "TINYLM_STEP_SLEEP": "0",
                "PYTHONUNBUFFERED": "1",
            }
            cmd = [sys.executable, str(TRAIN), "--steps", str(cfg.steps)]
            procs.append(
                subprocess.Popen(
                    cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
                )
            )
        try:
            outputs = [p.communicate(timeout=600)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(p.returncode for p in procs):
            raise DemoError("the reference run failed:\n" + "\n".join(o[-2000:] for o in outputs))
        done = [e for e in read_log(log) if e.get("event") == "done"]
        if not done:
            raise DemoError(f"the reference run logged no final sha256:\n{outputs[0][-2000:]}")
        cached.mkdir(parents=True, exist_ok=True)
        shutil.copy(log, cached / "loss.jsonl")
        (cached / "sha256").write_text(str(done[-1]["sha256"]) + "\n")
    return (cached / "sha256").read_text().strip(), read_log(cached / "loss.jsonl")


# --------------------------------------------------------------------------- the cluster side


class Demo:
    """The processes of one demo run; :meth:`close` stops all of them.

    Why one class of this size: it is the run's sequence (cluster, S3, operator, job,
    interruptions, reference), and each step uses the handles the ones before it started.
    """

    def __init__(self, cfg: DemoConfig) -> None:
        self.cfg = cfg
        self.out = cfg.out.resolve()
        self.work = self.out / "work"
        self.loss_log = self.out / "loss.jsonl"
        self.cluster: LocalCluster | None = None
        self.s3: VersityServer | None = None
        self.helm = ""
        self.bucket = "baton-demo"
        self.interruptions: list[Interruption] = []
        self.phases: list[tuple[float, str, int]] = []
        self.final_status: dict[str, Any] = {}
        self._threads: list[threading.Thread] = []
        self._binary = Path()
        self.saved_events: list[str] = []
        self._notices: dict[float, dict[str, Any]] = {}
        self._stop = threading.Event()
        self.label = "durable"
        self.job_uid = ""
        """Which path this run shows: ``durable`` (today's) or ``memory`` (the memory tier)."""
        self.replace_after_s: Callable[[int], float] = lambda k: 0.0
        """Seconds from the k-th interruption until its replacement node is added (the demo: at
        once; the goodput benchmark: its schedule's delay)."""

    def next_run(self, label: str) -> Demo:
        """Keep this run's record (returned) and start the next one on the same cluster: a
        fresh record, its own loss log, and the last run's TrainingJob deleted with its pods."""
        done = copy.copy(self)
        self.delete_job()
        self.label = label
        self.loss_log = self.out / f"loss-{label}.jsonl"
        self.interruptions, self.phases, self.saved_events = [], [], []
        self.final_status, self._notices, self.job_uid = {}, {}, ""
        return done

    def delete_job(self) -> None:
        assert self.cluster is not None
        self.cluster.kubectl(
            "delete", "trainingjob", JOB, "-n", JOB_NS, "--wait", "--timeout", "120s",
            "--ignore-not-found",
        )  # fmt: skip
        deadline = time.monotonic() + 120
        core = kubernetes.client.CoreV1Api(self.cluster.api)
        while core.list_namespaced_pod(JOB_NS, label_selector=f"baton.dev/job={JOB}").items:
            if time.monotonic() > deadline:
                raise DemoError(f"the first run's pods are still there\n{self.diagnostics()}")
            time.sleep(1)

    # -- setup

    def build(self) -> None:
        say("build: the local cluster binary and helm (cached after the first build)")
        binary = build_localcluster(echo=True)
        result = subprocess.run(
            [str(HELM_BUILD)], capture_output=True, text=True, check=False, timeout=3600
        )
        if result.returncode != 0:
            raise DemoError(f"{HELM_BUILD} failed:\n{result.stderr[-3000:]}")
        self.helm = result.stdout.strip().splitlines()[-1]
        self._binary = binary

    def start_cluster(self) -> LocalCluster:
        say("cluster: starting 3 spot nodes and 1 on-demand node")
        began = time.monotonic()
        if self.work.exists():
            shutil.rmtree(self.work)
        self.work.mkdir(parents=True)
        cluster = LocalCluster.start(
            self.work / "cluster",
            ClusterConfig(nodes=4, spot_nodes=3, gpus_per_node=0),
            binary=self._binary,
        )
        self.cluster = cluster
        for node in self.spot_nodes():
            cluster.kubectl("taint", "node", node, SPOT_TAINT, "--overwrite")
        say(f"cluster: ready in {time.monotonic() - began:.0f}s; nodes:\n{self.node_table()}")
        return cluster

    def node_labels(self) -> dict[str, dict[str, str]]:
        assert self.cluster is not None
        nodes: list[Any] = kubernetes.client.CoreV1Api(self.cluster.api).list_node().items
        return {str(n.metadata.name): dict(n.metadata.labels or {}) for n in nodes}

    def spot_nodes(self) -> list[str]:
        labels = self.node_labels()
        return sorted(
            n for n, lab in labels.items() if lab.get("karpenter.sh/capacity-type") == "spot"
        )

    def node_table(self) -> str:
        assert self.cluster is not None
        table = self.cluster.kubectl(
            "get",
            "nodes",
            "-L",
            "karpenter.sh/capacity-type",
            "-L",
            "eks.amazonaws.com/capacityType",
        ).stdout
        return "  " + str(table).rstrip().replace("\n", "\n  ")

    def start_storage(self) -> tuple[str, list[dict[str, Any]]]:
        """The checkpoint URI and the trainer env entries for it."""
        assert self.cluster is not None
        if self.cfg.storage == "file":
            uri = str(self.work / "checkpoints" / JOB)
            say(f"storage: local filesystem at {uri}")
            return uri, []
        # versitygw, a production S3 server (built by tools/versitygw/build.sh), which checks
        # signatures and checksums as S3 does; its data lives in a temporary directory.
        self.s3 = VersityServer()
        self.s3.start()
        self.s3.client().create_bucket(Bucket=self.bucket)
        secret = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "s3-credentials", "namespace": JOB_NS},
            "stringData": {"AWS_ACCESS_KEY_ID": FAKE_KEY_ID, "AWS_SECRET_ACCESS_KEY": FAKE_SECRET},
        }
        self.cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(secret))
        say(
            f"storage: versitygw S3 server at {self.s3.endpoint}, bucket {self.bucket}, "
            "Secret s3-credentials"
        )
        env: list[dict[str, Any]] = [
            {"name": "AWS_ENDPOINT_URL_S3", "value": self.s3.endpoint},
            {"name": "AWS_REGION", "value": REGION},
            # Never read a developer's ~/.aws files.
            {"name": "AWS_CONFIG_FILE", "value": os.devnull},
            {"name": "AWS_SHARED_CREDENTIALS_FILE", "value": os.devnull},
        ]
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            env.append(
                {"name": key, "valueFrom": {"secretKeyRef": {"name": "s3-credentials", "key": key}}}
            )
        return f"s3://{self.bucket}/{JOB}", env

    def namespaces(self) -> None:
        assert self.cluster is not None
        for ns in (OPERATOR_NS, JOB_NS):
            self.cluster.kubectl("create", "namespace", ns)
            self.cluster.kubectl("label", "namespace", ns, RESTRICTED, "--overwrite")

    def install_operator(self) -> None:
        assert self.cluster is not None
        say(
            f"operator: helm install baton charts/baton -n {OPERATOR_NS} (restricted namespace, "
            "on-demand node)"
        )
        began = time.monotonic()
        command = [
            self.helm, "install", "baton", str(CHART), "--namespace", OPERATOR_NS,
            "--kubeconfig", str(self.cluster.kubeconfig), "--wait", "--timeout", "5m",
            "--set", f"networkPolicy.namespaces={{{JOB_NS}}}",
            # The operator must outlive the preemptions it handles: keep it on on-demand.
            "--set-string", "nodeSelector.karpenter\\.sh/capacity-type=on-demand",
            # No cloud metadata service here: the notices come from the Node objects.
            "--set", "operator.extraArgs={--sidecar-cloud=none}",
        ]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True, timeout=400, check=False)
        if result.returncode != 0:
            raise DemoError(f"helm install failed:\n{result.stderr}\n{self.diagnostics()}")
        say(f"operator: running ({time.monotonic() - began:.0f}s)")

    # -- observing

    def status(self) -> dict[str, Any]:
        assert self.cluster is not None
        api = kubernetes.client.CustomObjectsApi(self.cluster.api)
        obj = cast(
            dict[str, Any], api.get_namespaced_custom_object(GROUP, VERSION, JOB_NS, PLURAL, JOB)
        )
        return dict(obj.get("status") or {})

    def pods(self, attempt: int) -> list[Any]:
        assert self.cluster is not None
        core = kubernetes.client.CoreV1Api(self.cluster.api)
        selector = f"baton.dev/job={JOB},baton.dev/attempt={attempt}"
        return list(core.list_namespaced_pod(JOB_NS, label_selector=selector).items)

    def events(self) -> list[str]:
        assert self.cluster is not None
        core = kubernetes.client.CoreV1Api(self.cluster.api)
        # This run's job only: a second run re-creates the job under the same name.
        fields = f"involvedObject.name={JOB},involvedObject.kind=TrainingJob"
        if self.job_uid:
            fields += f",involvedObject.uid={self.job_uid}"
        items: list[Any] = core.list_namespaced_event(JOB_NS, field_selector=fields).items
        items.sort(
            key=lambda e: str(e.last_timestamp or e.event_time or e.metadata.creation_timestamp)
        )
        return [f"{e.reason}: {e.message}" for e in items]

    def diagnostics(self) -> str:
        if self.cluster is None:
            return ""
        parts = []
        for ns in (OPERATOR_NS, JOB_NS):
            pods = self.cluster.kubectl("get", "pods", "-n", ns, "-o", "wide", check=False)
            parts.append(f"--- pods in {ns}:\n{pods.stdout}{pods.stderr}")
        logs = self.cluster.kubectl(
            "logs", "-n", OPERATOR_NS, "-l", "app.kubernetes.io/component=operator",
            "--tail=40", check=False,
        )  # fmt: skip
        parts.append(f"--- operator log:\n{logs.stdout}{logs.stderr}")
        with contextlib.suppress(Exception):
            parts.append("--- events:\n" + "\n".join(self.events()))
        return "\n".join(parts)

    def steps_done(self) -> int:
        steps = [int(e["step"]) for e in read_log(self.loss_log) if "loss" in e]
        return steps[-1] if steps else 0

    # -- the run

    def _interrupt(self, rank: int, attempt: int, take_node: Interrupt) -> None:
        assert self.cluster is not None
        pods = [
            p for p in self.pods(attempt) if p.metadata.labels.get("baton.dev/rank") == str(rank)
        ]
        if not pods or not pods[0].spec.node_name:
            raise DemoError(f"no running pod of rank {rank} in attempt {attempt}")
        node = pods[0].spec.node_name
        step = self.steps_done()
        kind = take_node(self.cluster, node, rank, step)
        self.interruptions.append(
            Interruption(kind=kind, node=node, rank=rank, at_step=step, injected_at=time.time())
        )
        # The cloud replaces lost spot capacity, as Karpenter or a node pool's autoscaler would.
        delay = self.replace_after_s(len(self.interruptions) - 1)
        thread = threading.Thread(
            target=self.replace_node, args=(delay,), name="replace-node", daemon=True
        )
        thread.start()
        self._threads.append(thread)

    def replace_node(self, delay_s: float = 0.0) -> None:
        """Add a tainted spot node, ``delay_s`` from now (what a node pool would do)."""
        assert self.cluster is not None
        self._stop.wait(delay_s)
        try:
            node = self.cluster.add_node(spot=True)
            self.cluster.kubectl("taint", "node", node, SPOT_TAINT, "--overwrite")
        except Exception as e:  # the job may still finish on the nodes left: say so, go on
            say(f"cluster: no replacement spot node: {e}")
            return
        say(f"cluster: replacement spot node {node} is Ready")

    def run_job(
        self,
        manifest: dict[str, Any],
        *,
        at_steps: Sequence[int],
        interrupt: Interrupt,
        due: Callable[[int, int], bool] | None = None,
        rank_of: Callable[[int], int] | None = None,
    ) -> dict[str, Any]:
        """Apply the job; interrupt it once per attempt at ``at_steps``; follow it to the end.

        ``due(k, step)``: whether the k-th interruption is due now (default: ``step`` reached
        ``at_steps[k]``; ``at_steps`` still counts the interruptions). ``rank_of(k)``: whose
        node it takes (default: rank 1, then 0, alternating). Either way the next one waits
        until the job trains again after the last.
        """
        assert self.cluster is not None
        cfg = self.cfg
        self.loss_log.unlink(missing_ok=True)
        watcher = threading.Thread(target=self._watch_notices, daemon=True)
        watcher.start()
        self._threads.append(watcher)
        self.cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest))
        api = kubernetes.client.CustomObjectsApi(self.cluster.api)
        obj = api.get_namespaced_custom_object(GROUP, VERSION, JOB_NS, PLURAL, JOB)
        self.job_uid = str(cast(dict[str, Any], obj)["metadata"]["uid"])
        replicas = manifest["spec"]["replicas"]
        say(f"job: TrainingJob {JOB_NS}/{JOB} applied ({replicas} replicas, {cfg.steps} steps)")
        targets = list(at_steps)
        began = time.monotonic()
        last_phase, last_step, last_print = "", -1, 0.0
        last_ok = time.monotonic()
        status: dict[str, Any] = {}
        while True:
            if time.monotonic() - began > cfg.timeout:
                raise DemoError(
                    f"the job did not finish within {cfg.timeout:.0f}s\n{self.diagnostics()}"
                )
            try:
                status = self.status()
                last_ok = time.monotonic()
            except Exception as e:  # the API server restarting, a dropped connection
                if time.monotonic() - last_ok > 30:
                    raise DemoError(f"the API server has not answered for 30s: {e}") from e
            phase = str(status.get("phase", "Pending"))
            attempt = int(status.get("attempt", 0))
            step = self.steps_done()
            now = time.monotonic()
            if phase != last_phase:
                self.phases.append((time.time(), phase, attempt))
                extra = f" ({status.get('message')})" if status.get("message") else ""
                say(f"job: phase {phase}, attempt {attempt}{extra}")
                last_phase = phase
            pending = self.interruptions[-1] if self.interruptions else None
            if pending is not None:
                last = status.get("lastCheckpoint") or {}
                if attempt >= len(self.interruptions) and not pending.committed:
                    pending.committed = dict(last)
                    pending.last_step_before = step
                if pending.resumed_step is None:
                    # A recovery that keeps the survivors stays in the same attempt: the
                    # trainers' first start after the interruption says it resumed.
                    self._fill_resume(pending)
                if not pending.committed:
                    # ... and the operator's record of it names the step and tier restored.
                    recovery = status.get("lastRecovery") or {}
                    decided = _ts(recovery.get("startedAt"))
                    if decided is not None and decided >= pending.injected_at - 5:
                        pending.committed = {
                            "step": recovery.get("restoredStep"),
                            "trigger": recovery.get("tier"),
                        }
                if pending.resumed_step is None and not pending.committed and now - last_print > 2:
                    waited = time.time() - pending.injected_at
                    if pending.kind == NO_NOTICE:  # nothing to commit: the node is gone
                        say(f"job: waiting for the operator to restart the job ({waited:.0f}s "
                            "since the node was lost)")  # fmt: skip
                    else:
                        say(f"job: waiting for every rank to commit the checkpoint "
                            f"({waited:.0f}s since the {pending.kind})")  # fmt: skip
                    last_print = now
            if step // 10 != last_step // 10 or (step == cfg.steps and last_step != step):
                say(f"train: step {step}/{cfg.steps}")
                last_step = step
            if phase in ("Succeeded", "Failed"):
                break
            k = len(self.interruptions)
            # The next interruption once the job trains again after the last one (a new
            # attempt, or the same attempt after a recovery that kept the survivors), and
            # never once the last step is done: a job that only has its exit left is not
            # interrupted by taking its node (the goodput schedule's times can fall there).
            resumed = k == 0 or self.interruptions[-1].resumed_step is not None
            ready = phase == "Running" and resumed and k < len(targets) and step < cfg.steps
            if ready and (due(k, step) if due else step >= targets[k]):
                rank = rank_of(k) if rank_of else 1 - k % 2
                self._interrupt(rank=rank, attempt=attempt, take_node=interrupt)
            time.sleep(0.5)
        self.final_status = status
        for event in self.interruptions:
            self._fill_resume(event)
            # The first notice the operator recorded after this interruption was injected.
            seen = [n for t, n in sorted(self._notices.items()) if t >= event.injected_at - 5]
            if seen:
                event.notice = seen[0]
        return status

    def _watch_notices(self) -> None:
        # status.notice lives only while the job is Checkpointing (often under a second), and
        # the restart clears it: a watch sees every status the operator wrote, a poll may not.
        assert self.cluster is not None
        api = kubernetes.client.CustomObjectsApi(self.cluster.api)
        while not self._stop.is_set():
            try:
                watch = kubernetes.watch.Watch()  # type: ignore[no-untyped-call]
                stream = watch.stream(  # type: ignore[no-untyped-call]
                    api.list_namespaced_custom_object, GROUP, VERSION, JOB_NS, PLURAL,
                    field_selector=f"metadata.name={JOB}", timeout_seconds=5,
                )  # fmt: skip
                for event in stream:
                    notice = (event["object"].get("status") or {}).get("notice") or {}
                    received = _ts(notice.get("receivedAt"))
                    if received is not None and notice.get("deadline"):
                        self._notices.setdefault(received, dict(notice))
            except Exception:  # the cluster stopping; the loop ends with _stop
                time.sleep(0.5)

    def _fill_resume(self, event: Interruption) -> None:
        starts = [e for e in read_log(self.loss_log) if e.get("event") == "start"]
        later = [s for s in starts if float(s["time"]) > event.injected_at]
        if later:
            event.resumed_step = int(later[0]["step"])
            event.restore_seconds = float(later[0]["restore_seconds"])
            event.resumed_at = float(later[0]["time"])
        before = [
            int(e["step"])
            for e in read_log(self.loss_log)
            if "loss" in e and float(e["time"]) < (event.resumed_at or float("inf"))
        ]
        event.last_step_before = max(before) if before else 0

    def close(self) -> None:
        self._stop.set()
        say("cleanup: stopping the cluster and the S3 server")
        if self.cluster is not None:
            try:
                self.cluster.stop()
            except Exception as e:  # report and carry on cleaning
                say(f"cleanup: {e}")
            self.cluster = None
        if self.s3 is not None:
            self.s3.stop()
            self.s3 = None


# --------------------------------------------------------------------------- measurements, plot


def measure(demo: Demo, ref_sha: str, started: float) -> dict[str, Any]:
    """The run in numbers (``report.json``): per interruption, and the verdict."""
    cfg = demo.cfg
    log = read_log(demo.loss_log)
    done = [e for e in log if e.get("event") == "done"]
    sha = str(done[-1]["sha256"]) if done else None
    status = demo.final_status
    rows: list[dict[str, Any]] = []
    for i, ev in enumerate(demo.interruptions, 1):
        notice, commit = ev.notice, ev.committed
        received = _ts(notice.get("receivedAt"))
        deadline = _ts(notice.get("deadline"))
        completed = _ts(commit.get("completedAt")) if commit.get("trigger") == "notice" else None
        lost = None
        if ev.resumed_step is not None:
            lost = max(0, ev.last_step_before - ev.resumed_step)
        rows.append(
            {
                "n": i,
                "kind": ev.kind,
                "node": ev.node,
                "rank": ev.rank,
                "at_step": ev.at_step,
                "notice_source": notice.get("source"),
                "notice_lead_s": (deadline - received) if deadline and received else None,
                "notice_seen_after_s": (received - ev.injected_at) if received else None,
                "notice_to_commit_s": (completed - received) if completed and received else None,
                "sdk_save_s": commit.get("seconds") if completed else None,
                "margin_s": (deadline - completed) if deadline and completed else None,
                "checkpoint_step": commit.get("step"),
                "checkpoint_trigger": commit.get("trigger"),
                "last_step_before": ev.last_step_before,
                "resumed_step": ev.resumed_step,
                "steps_lost": lost,
                "restore_s": ev.restore_seconds,
                "downtime_s": (ev.resumed_at - ev.injected_at) if ev.resumed_at else None,
                "to_first_step_s": _first_step_after(log, ev),
            }
        )
    # The operator's own notice-to-commit figure (its status times are whole seconds).
    for r in rows:
        for e in demo.saved_events:
            m = re.search(r"committed step (\d+) ([\d.]+)s after the notice", e)
            if m and r["checkpoint_trigger"] == "notice" and int(m[1]) == r["checkpoint_step"]:
                r["notice_to_commit_s"] = float(m[2])
                if r["notice_lead_s"] is not None:
                    r["margin_s"] = r["notice_lead_s"] - float(m[2])
    steps_lost = sum(r["steps_lost"] or 0 for r in rows)
    equal = sha is not None and sha == ref_sha
    recovery = status.get("lastRecovery") or {}
    return {
        "path": demo.label,
        # A recovery that kept the survivors names the pods it replaced; a restart replaces all.
        "pods_replaced": len(recovery.get("replaced") or []) if recovery else "all",
        "provider": cfg.provider,
        "kill_node": cfg.kill_node,
        "storage": cfg.storage,
        "steps": cfg.steps,
        "phase": status.get("phase"),
        "preemptions": status.get("preemptions"),
        "failures": status.get("failures"),
        "interruptions": rows,
        "steps_lost": steps_lost,
        "sha256": sha,
        "reference_sha256": ref_sha,
        "bitwise_equal": equal,
        "wall_seconds": time.monotonic() - started,
    }


def _first_step_after(log: list[dict[str, Any]], ev: Interruption) -> float | None:
    """Seconds from the interruption to the first training step after the resume."""
    if ev.resumed_at is None:
        return None
    later = [float(e["time"]) for e in log if "loss" in e and float(e["time"]) > ev.resumed_at]
    return min(later) - ev.injected_at if later else None


def plot(demo: Demo, ref_log: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.8))
    ref = [e for e in ref_log if "loss" in e]
    ax.plot(
        [e["step"] for e in ref], [e["loss"] for e in ref],
        color="0.6", linewidth=5, alpha=0.6, label="reference (never interrupted)",
    )  # fmt: skip
    log = [e for e in read_log(demo.loss_log) if "loss" in e]
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"]
    for attempt in sorted({str(e["attempt"]) for e in log}, key=int):
        part = [e for e in log if str(e["attempt"]) == attempt]
        ax.plot(
            [e["step"] for e in part], [e["loss"] for e in part],
            color=colors[int(attempt) % len(colors)], linewidth=1.4,
            label=f"demo job, attempt {attempt}",
        )  # fmt: skip
    for ev in demo.interruptions:
        ax.axvline(ev.at_step, color="red", linestyle="--", linewidth=1)
        ax.annotate(
            f"{ev.kind}\n({ev.node})", (ev.at_step, 1), xycoords=("data", "axes fraction"),
            xytext=(-4, -4), textcoords="offset points", ha="right", va="top", color="red",
            fontsize=8,
        )  # fmt: skip
        if ev.resumed_step is not None and ev.last_step_before > ev.resumed_step:
            ax.axvspan(
                ev.resumed_step, ev.last_step_before, color="orange", alpha=0.15,
                label=f"steps {ev.resumed_step + 1}-{ev.last_step_before} trained twice",
            )  # fmt: skip
        if ev.resumed_step is not None:
            ax.axvline(ev.resumed_step, color="green", linestyle=":", linewidth=1.2)
            ax.annotate(
                f"resumed at {ev.resumed_step}", (ev.resumed_step, 0.75),
                xycoords=("data", "axes fraction"), xytext=(4, 0), textcoords="offset points",
                color="green", fontsize=8,
            )  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (rank 0)")
    ax.set_title("tinylm on 2 spot ranks: interrupted run over the uninterrupted reference")
    ax.legend(loc="upper right", bbox_to_anchor=(1.0, 0.7), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- the whole run


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def run_demo(
    cfg: DemoConfig,
    *,
    job: JobBuilder,
    at_steps: Sequence[int],
    interrupt: Interrupt,
    report: Report,
) -> int:
    """Run the demo end to end; 0 only when the job Succeeded with bitwise-equal weights.

    Writes ``report.md`` (from ``report``), ``report.json``, ``loss.png``, ``loss.jsonl`` and
    ``events.txt`` to ``cfg.out``; stops everything it started, also on Ctrl-C and SIGTERM.
    """
    started = time.monotonic()
    signal.signal(signal.SIGTERM, _on_sigterm)
    demo = Demo(cfg)
    demo.out.mkdir(parents=True, exist_ok=True)
    try:
        demo.build()
        demo.start_cluster()
        demo.namespaces()
        uri, storage_env = demo.start_storage()
        demo.install_operator()
        runs: list[Demo] = []
        # Today's path, then (a node lost without notice) the same job with the memory tier.
        paths = [("durable", None)]
        if cfg.kill_node and cfg.fast_every_steps:
            paths.append(("memory", cfg.fast_every_steps))
        for i, (label, fast) in enumerate(paths):
            if i:
                say(f"job: again, with the memory tier (fastEverySteps {fast}), on the same nodes")
                runs.append(demo.next_run(label))
            # Each run its own checkpoints: the second must not resume from the first's.
            run_uri = uri if fast is None else f"{uri}-{label}"
            demo.run_job(
                job(run_uri, storage_env, demo.loss_log, fast),
                at_steps=at_steps,
                interrupt=interrupt,
            )
            demo.saved_events = demo.events()
            suffix = "" if label == "durable" else f"-{label}"
            (demo.out / f"events{suffix}.txt").write_text("\n".join(demo.saved_events) + "\n")
        runs.append(demo)
        demo.close()  # frees the CPU for the reference run
        ref_sha, ref_log = reference_run(cfg)
        data = measure(runs[0], ref_sha, started)
        if len(runs) > 1:
            data["memory_tier"] = measure(runs[1], ref_sha, started)
        text = report(cfg, data, runs[0].saved_events)
        for run in runs:
            suffix = "" if run.label == "durable" else f"-{run.label}"
            plot(run, ref_log, demo.out / f"loss{suffix}.png")
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    except DemoError as e:
        say(f"error: {e}")
        return 1
    finally:
        demo.close()
    (demo.out / "report.md").write_text(text)
    (demo.out / "report.json").write_text(json.dumps(data, indent=1) + "\n")
    print("\n" + text)
    say(f"report: {demo.out / 'report.md'}, plot: {demo.out / 'loss.png'}")
    ok = all(
        d["phase"] == "Succeeded" and d["bitwise_equal"]
        for d in (data, data.get("memory_tier") or data)
    )
    for d in (data, data.get("memory_tier") or data):
        if d["phase"] != "Succeeded" or not d["bitwise_equal"]:
            why = "the job did not Succeed" if d["phase"] != "Succeeded" else "weights differ"
            say(f"FAILED ({d['path']} path): {why}")
    return 0 if ok else 1
