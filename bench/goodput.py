"""Benchmark: goodput under one seeded spot-interruption schedule, Baton against checkpoint-restart.

On the local cluster (real control plane, the operator installed by Helm, sidecars, versitygw
S3), the same fixed work (``examples/tinylm/train.py``, 2 data-parallel ranks on spot nodes) is
run by each method, and every interrupted method gets the same interruptions:

1. ``no-interruptions``: Baton, never interrupted; the lower bound of wall time and the
   reference weights. Its training time (first to last step) is the schedule's horizon.
2. ``checkpoint-restart``: what a team runs today: the same script with Baton off and a plain
   ``torch.save`` every ``--every-steps`` steps (tinylm's ``--plain-checkpoint-dir``), in a
   Kubernetes Indexed Job (``restartPolicy: Never``, a ``backoffLimit``) that replaces failed
   pods and resumes from the newest file; no notice handling.
3. ``baton-durable``: a TrainingJob with periodic saves every ``--every-steps`` steps plus the
   saves the operator asks for on a notice.
4. ``baton-memory``: the same plus the memory tier (``checkpoint.fastEverySteps``).

The schedule (``baton_testing.interruption_schedule``) is drawn from ``--seed``: Poisson
arrivals at ``--mtbi`` seconds mean, each an AWS 2-minute notice, a GKE 30-second notice or a
node lost without notice in ``--mix`` shares, the node's replacement added ``--replace-after``
seconds later. Times are wall seconds from the job's first step; an interruption that falls
while the job is still recovering from the last waits until it trains again (there is no pod to
lose before). It is written to ``OUT/schedule.json``; ``--schedule FILE`` replays one.

Reported per method (``OUT/goodput.md``, ``OUT/goodput.json``, ``OUT/goodput.png``): wall time
from applying the job to its last step; goodput, the productive step-seconds (the steps times
the uninterrupted run's median step time) over the node-seconds paid (2 nodes for the whole
wall time); steps recomputed (steps trained more than once); restart seconds per interruption
(from the interruption to the first step after the resume; median and worst); bytes written to
durable storage (Baton: the objects in the bucket, with ``keepLast`` high so that none is
deleted; the baseline: the ``torch.save`` files; memory-tier snapshots are not counted);
whether the final weights are bitwise equal to the uninterrupted run's; and where the
restarts went: rank 0's trainer start-up phases as tinylm logs them (interpreter and imports,
the rendezvous, the script's set-up, the restore; medians over the restarts) and the rest.

Usage (the run in docs/performance.md, a 290 MiB state: about 50 minutes on 2 cores, binaries
cached, and about 10 GiB of free disk for the checkpoints it keeps)::

    .venv/bin/python bench/goodput.py --out goodput-out --steps 1000 --step-sleep 0 \\
        --every-steps 100 --fast-every-steps 10 --fast-size-limit 1Gi --d-model 1024 \\
        --n-layers 2 --batch-size 2 --mtbi 240 --min-gap 120 --seed 30 \\
        [--methods ...] [--schedule FILE] [--stage-in-background]

The demo's small model (``--d-model 64 --n-layers 2``, the defaults) runs in minutes.

``--render OUT/goodput.json`` writes the table and the plot again from a finished run.

Not a test: the figures are printed and written, never asserted (``tests/e2e/
test_goodput_smoke.py`` runs a short version and checks only correctness).
"""

from __future__ import annotations

import argparse
import itertools
import json
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Final

import kubernetes.client
import yaml
from _goodput_report import PHASES, add_goodput, render  # bench/ is sys.path[0]
from baton_testing.demo import (
    JOB,
    JOB_NS,
    NO_NOTICE,
    SPOT_TOLERATION,
    TRAIN,
    Demo,
    DemoConfig,
    DemoError,
    Interruption,
    read_log,
    say,
)
from baton_testing.interruption_schedule import (
    NOTICE_SECONDS,
    Schedule,
    ScheduleModel,
    draw_schedule,
    load_schedule,
    save_schedule,
)
from baton_testing.jobs import RESTRICTED_CONTAINER, RESTRICTED_POD, training_job
from baton_testing.ports import free_port

METHODS = ("no-interruptions", "baton-durable", "baton-memory", "checkpoint-restart")
"""In the order they run (Baton's TrainingJobs first, then the plain Job)."""
RANKS = 2
PLAIN_JOB = "tinylm-plain"


# --------------------------------------------------------------------------- the jobs


def baton_job(
    args: argparse.Namespace, uri: str, storage_env: list[dict[str, Any]], log: Path, fast: bool
) -> dict[str, Any]:
    # keepLast high: every checkpoint stays in the bucket, so its bytes can be counted.
    checkpoint: dict[str, Any] = {"uri": uri, "everySteps": args.every_steps, "keepLast": 10_000}
    if fast:
        checkpoint |= {
            "fastEverySteps": args.fast_every_steps, "fastSizeLimit": args.fast_size_limit
        }  # fmt: skip
    env = [
        {"name": "TINYLM_LOG", "value": str(log)},
        *model_env(args),
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        *storage_env,
    ]
    if args.stage_in_background:  # the Checkpointer's copy beside the next steps
        env.append({"name": "BATON_STAGE_IN_BACKGROUND", "value": "1"})
    return training_job(
        JOB, JOB_NS, image="tinylm:bench",
        command=["python", str(TRAIN), "--steps", str(args.steps), *batch_args(args)],
        env=env, replicas=RANKS, checkpoint=checkpoint,
        failure_policy={"maxFailures": 100, "backoffSeconds": 1},
        master_port=free_port(), restricted=True,
        pod={"nodeSelector": {"karpenter.sh/capacity-type": "spot"},
             "tolerations": [SPOT_TOLERATION]},
    )  # fmt: skip


def model_env(args: argparse.Namespace) -> list[dict[str, str]]:
    """The model's size and the step's sleep, the same for every method, and one intra-op
    thread per rank: a node of the local cluster is not a CPU set, and two ranks of two
    threads each on two cores ran their steps 2-2.5x slower (measured: 1.1-1.2 s against 0.45-0.5
    s at 1024 x 2), and a Baton rank only until its first save (see docs/performance.md)."""
    return [
        {"name": "OMP_NUM_THREADS", "value": "1"},
        {"name": "TINYLM_STEP_SLEEP", "value": str(args.step_sleep)},
        {"name": "TINYLM_D_MODEL", "value": str(args.d_model)},
        {"name": "TINYLM_N_LAYERS", "value": str(args.n_layers)},
    ]


def batch_args(args: argparse.Namespace) -> list[str]:
    return ["--batch-size", str(args.batch_size)]


def plain_job(args: argparse.Namespace, directory: Path, log: Path) -> dict[str, Any]:
    """The baseline: an Indexed Job of 2 pods, rank = completion index, that replaces a failed
    pod (``restartPolicy: Never``, ``backoffLimit``) and resumes from the newest file.

    A lost node's pods are evicted 10 s after it stops answering (the default is 300 s, which
    few teams change; 10 s favours the baseline).
    """
    container = {
        "name": "trainer",
        "image": "tinylm:bench",
        "command": [
            "python", str(TRAIN), "--steps", str(args.steps),
            "--plain-checkpoint-dir", str(directory),
            "--plain-every-steps", str(args.every_steps), *batch_args(args),
        ],
        "env": [
            {"name": "TINYLM_LOG", "value": str(log)},
            *model_env(args),
            {"name": "PYTHONUNBUFFERED", "value": "1"},
            {"name": "WORLD_SIZE", "value": str(RANKS)},
            {"name": "RANK", "valueFrom": {"fieldRef": {
                "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
            {"name": "LOCAL_RANK", "value": "0"},
            {"name": "LOCAL_WORLD_SIZE", "value": "1"},
            # The local cluster's pods share the host's network.
            {"name": "MASTER_ADDR", "value": "127.0.0.1"},
            {"name": "MASTER_PORT", "value": str(free_port())},
        ],
        "securityContext": dict(RESTRICTED_CONTAINER),
    }  # fmt: skip
    lost = [
        {"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 10}
        for key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
    ]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": PLAIN_JOB, "namespace": JOB_NS},
        "spec": {
            "completionMode": "Indexed",
            "completions": RANKS,
            "parallelism": RANKS,
            "backoffLimit": 100,
            "template": {
                "metadata": {"labels": {"app": PLAIN_JOB}},
                "spec": {
                    "restartPolicy": "Never",
                    "securityContext": dict(RESTRICTED_POD),
                    "nodeSelector": {"karpenter.sh/capacity-type": "spot"},
                    "tolerations": [SPOT_TOLERATION, *lost],
                    "containers": [container],
                },
            },
        },
    }


# --------------------------------------------------------------------------- interruptions


DOOMED: dict[str, float] = {}
"""Nodes given a notice, by when they go away (this process's runs: one benchmark)."""


def take_node(cluster: Any, node: str, kind: str) -> str:
    if kind == "kill":
        cluster.kill_node(node)
        return NO_NOTICE
    grace = NOTICE_SECONDS[kind]  # type: ignore[index]
    cluster.preempt(node, provider=kind, grace_s=grace)
    DOOMED[node] = time.time() + grace
    return f"{kind} notice"


def wait_doomed(cluster: Any) -> None:
    """Wait until every node given a notice is gone, so that the next method's pods cannot land
    on a node that the last method's schedule condemned (a pod of the baseline, which ignores
    notices, would die there: an interruption that is not in the schedule)."""
    while DOOMED:
        alive = set(cluster.nodes())
        for node in [n for n in DOOMED if n not in alive]:
            del DOOMED[node]
        if DOOMED:
            left = max(DOOMED.values()) - time.time()
            say(f"waiting for {len(DOOMED)} node(s) under notice to go ({max(left, 0):.0f}s)")
            time.sleep(min(max(left, 1.0), 10.0))


def first_step_time(log: Path) -> float | None:
    steps = [float(e["time"]) for e in read_log(log) if "loss" in e]
    return steps[0] if steps else None


def make_due(schedule: Schedule, log: Path) -> Any:
    def due(k: int, step: int) -> bool:
        t0 = first_step_time(log)
        return t0 is not None and time.time() - t0 >= schedule.interruptions[k].at_seconds

    return due


def run_baton(
    demo: Demo, args: argparse.Namespace, schedule: Schedule, manifest: dict[str, Any]
) -> dict[str, Any]:
    events = schedule.interruptions
    demo.replace_after_s = lambda k: events[k].replace_after_seconds
    applied = time.time()

    def interrupt(cluster: Any, node: str, rank: int, step: int) -> str:
        ev = events[len(demo.interruptions)]
        say(f"chaos: {ev.kind} on {node} (rank {rank}) at step {step}")
        return take_node(cluster, node, ev.kind)

    status = demo.run_job(
        manifest,
        at_steps=[0] * len(events),
        interrupt=interrupt,
        due=make_due(schedule, demo.loss_log),
        rank_of=lambda k: events[k].rank,
    )
    return {"applied": applied, "phase": status.get("phase"), "status": status}


def run_plain(
    demo: Demo, args: argparse.Namespace, schedule: Schedule, directory: Path
) -> dict[str, Any]:
    """Apply the baseline's Indexed Job and interrupt it on the schedule; follow it to the end."""
    assert demo.cluster is not None
    cluster = demo.cluster
    events = schedule.interruptions
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o777)
    demo.loss_log.unlink(missing_ok=True)
    cluster.kubectl(
        "apply", "-f", "-", input=yaml.safe_dump(plain_job(args, directory, demo.loss_log))
    )
    applied = time.time()
    batch = kubernetes.client.BatchV1Api(cluster.api)
    core = kubernetes.client.CoreV1Api(cluster.api)
    due = make_due(schedule, demo.loss_log)
    phase, last_step = "Running", -1
    while True:
        if time.time() - applied > args.timeout:
            raise DemoError(f"the baseline Job did not finish within {args.timeout:.0f}s")
        job: Any = batch.read_namespaced_job_status(PLAIN_JOB, JOB_NS)
        conditions = {c.type: c.status for c in (job.status.conditions or [])}
        # SuccessCriteriaMet: every index succeeded. (Complete follows only once no pod is
        # terminating, and a pod on a node lost without notice terminates for good.)
        if conditions.get("SuccessCriteriaMet") == "True" or conditions.get("Complete") == "True":
            phase = "Succeeded"
            break
        if conditions.get("Failed") == "True":
            phase = "Failed"
            break
        log = read_log(demo.loss_log)
        steps = [int(e["step"]) for e in log if "loss" in e]
        step = steps[-1] if steps else 0  # the newest, which is lower after a restart
        if step // 20 != last_step // 20:
            say(f"train: step {step}/{args.steps} (checkpoint-restart)")
            last_step = step
        k = len(demo.interruptions)
        trains = k == 0 or _resumed_after(log, demo.interruptions[-1])
        if k < len(events) and trains and step < args.steps and due(k, step):
            ev = events[k]
            selector = f"batch.kubernetes.io/job-completion-index={ev.rank},app={PLAIN_JOB}"
            pods = [
                p for p in core.list_namespaced_pod(JOB_NS, label_selector=selector).items
                if p.status.phase == "Running" and p.spec.node_name
                and not p.metadata.deletion_timestamp
            ]  # fmt: skip
            if pods:
                node = pods[0].spec.node_name
                say(f"chaos: {ev.kind} on {node} (rank {ev.rank}) at step {step}")
                kind = take_node(cluster, node, ev.kind)
                demo.interruptions.append(
                    Interruption(
                        kind=kind, node=node, rank=ev.rank, at_step=step, injected_at=time.time()
                    )
                )
                thread = threading.Thread(
                    target=demo.replace_node, args=(ev.replace_after_seconds,),
                    name="replace-node", daemon=True,
                )  # fmt: skip
                thread.start()
                demo._threads.append(thread)
        time.sleep(0.5)
    cluster.kubectl("delete", "job", PLAIN_JOB, "-n", JOB_NS, "--cascade=foreground",
                    "--wait=false", "--ignore-not-found")  # fmt: skip
    return {"applied": applied, "phase": phase, "status": {}}


def _resumed_after(log: list[dict[str, Any]], ev: Interruption) -> bool:
    starts = [float(e["time"]) for e in log if e.get("event") == "start"]
    later = [t for t in starts if t > ev.injected_at]
    return bool(later) and any("loss" in e and float(e["time"]) > later[0] for e in log)


# --------------------------------------------------------------------------- measurement


def bucket_bytes(demo: Demo, prefix: str) -> int:
    assert demo.s3 is not None
    client = demo.s3.client()
    total = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=demo.bucket, Prefix=prefix):
        total += sum(int(o["Size"]) for o in page.get("Contents", []))
    return total


def restart_phases(log: list[dict[str, Any]]) -> list[dict[str, float]]:
    """The start-up phases of every start after the first (a restart), in seconds."""
    starts = sorted((e for e in log if e.get("event") == "start"), key=lambda e: float(e["time"]))
    return [
        {k: float(e[f"{k}_seconds"]) for k in PHASES}
        for e in starts[1:]
        if all(e.get(f"{k}_seconds") is not None for k in PHASES)
    ]


def measure_run(
    label: str, demo: Demo, run: dict[str, Any], steps: int, bytes_written: int
) -> dict[str, Any]:
    log = read_log(demo.loss_log)
    losses = [e for e in log if "loss" in e]
    done = [e for e in log if e.get("event") == "done"]
    restarts = []
    starts = sorted(float(e["time"]) for e in log if e.get("event") == "start")
    for ev in demo.interruptions:
        later = [t for t in starts if t > ev.injected_at]
        if later:
            after = [float(e["time"]) for e in losses if float(e["time"]) > later[0]]
            if after:
                restarts.append(min(after) - ev.injected_at)
    times = [float(e["time"]) for e in losses]
    gaps = sorted(b - a for a, b in itertools.pairwise(times) if b > a)
    status = run["status"]
    return {
        "method": label,
        "phase": run["phase"],
        "wall_s": (max(times) - run["applied"]) if times else None,
        "train_s": (max(times) - min(times)) if times else None,
        "median_step_s": statistics.median(gaps) if gaps else None,
        "steps_trained": len(losses),
        "steps_recomputed": max(0, len(losses) - steps),
        "interruptions": [
            {
                "kind": ev.kind,
                "node": ev.node,
                "rank": ev.rank,
                "at_step": ev.at_step,
                "at_s": ev.injected_at - (min(times) if times else run["applied"]),
            }
            for ev in demo.interruptions
        ],
        "restart_s": restarts,
        "restart_phases": restart_phases(log),
        "bytes_written": bytes_written,
        "sha256": str(done[-1]["sha256"]) if done else None,
        "state_bytes": int(done[-1].get("state_bytes", 0)) if done else None,
        "status_interruptions": status.get("interruptions") or [],
        "curve": [(float(e["time"]) - run["applied"], int(e["step"])) for e in losses],
    }


# --------------------------------------------------------------------------- the run


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("goodput-out"))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--step-sleep", type=float, default=0.3)
    p.add_argument("--every-steps", type=int, default=25, help="periodic checkpoints (all)")
    p.add_argument("--fast-every-steps", type=int, default=1, help="baton-memory's interval")
    p.add_argument(
        "--fast-size-limit", default="64Mi",
        help="baton-memory's checkpoint.fastSizeLimit (docs/operator.md: (2 + 2 x replicas) x "
        "the state / 2, and the whole state for a restore from memory)",
    )  # fmt: skip
    p.add_argument(
        "--stage-in-background", action="store_true",
        help="Baton's jobs copy their saves and snapshots beside the next steps "
        "($BATON_STAGE_IN_BACKGROUND=1, docs/checkpointer.md)",
    )  # fmt: skip
    p.add_argument("--d-model", type=int, default=64, help="tinylm's width")
    p.add_argument("--n-layers", type=int, default=2, help="tinylm's depth")
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--seed", type=int, default=30)
    p.add_argument("--mtbi", type=float, default=60.0, help="mean seconds between interruptions")
    p.add_argument("--mix", default="0.4,0.3,0.3", help="shares of aws, gke, no-notice")
    p.add_argument("--replace-after", type=float, default=20.0, help="seconds to a new node")
    p.add_argument("--min-gap", type=float, default=30.0, help="seconds between interruptions")
    p.add_argument("--max-interruptions", type=int, default=None)
    p.add_argument("--schedule", type=Path, default=None, help="replay this schedule file")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument(
        "--render", type=Path, nargs="+", default=None,
        help="only write goodput.md, goodput.png and goodput.json into --out from these "
        "goodput.json files: the methods of runs made one at a time (each alone on the "
        "machine) on the same schedule and job, in one table and plot",
    )  # fmt: skip
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per method")
    args = p.parse_args(argv)
    asked = args.methods.split(",")
    args.methods = [m for m in METHODS if m in asked]
    if not args.methods or len(args.methods) != len(asked):
        p.error(f"--methods: a comma-separated subset of {', '.join(METHODS)}")
    if "no-interruptions" not in args.methods and args.schedule is None:
        p.error("without no-interruptions, the horizon is unknown: pass --schedule FILE")
    return args


_SAME_JOB: Final = ("steps", "every_steps", "d_model", "n_layers", "batch_size",
                    "step_sleep", "seed", "mtbi", "mix")  # fmt: skip
"""The arguments that make two runs' rows comparable (the job and the schedule's model).
``fast_every_steps`` is not one: it is baton-memory's setting, and memory-tier runs of
several intervals go in one table, each labelled with its interval."""


def merge_runs(runs: list[dict[str, Any]], paths: list[Path]) -> dict[str, Any]:
    """One ``goodput.json`` from the runs of several commands: their rows in method order
    (a method in two runs: the later file's), goodput and bitwise equality computed again
    against the merged uninterrupted row. Refuses runs of another job or schedule."""
    first = runs[0]
    for data, path in zip(runs[1:], paths[1:], strict=True):
        differ = [k for k in _SAME_JOB if data["args"].get(k) != first["args"].get(k)]
        if data["schedule"]["interruptions"] != first["schedule"]["interruptions"]:
            differ.append("schedule")
        if differ:
            raise SystemExit(
                f"--render: {path} was run with other {', '.join(differ)} than {paths[0]}; "
                "only runs of the same job on the same schedule (--schedule FILE) go in one table"
            )
    memory = {data["args"]["fast_every_steps"] for data in runs
              if any(r["method"] == "baton-memory" for r in data["rows"])}  # fmt: skip
    by_label: dict[tuple[int, int], dict[str, Any]] = {}
    for data in runs:
        for r in data["rows"]:
            every = int(data["args"]["fast_every_steps"]) if r["method"] == "baton-memory" else 0
            label = f"baton-memory, every {every}" if every and len(memory) > 1 else r["method"]
            by_label[METHODS.index(r["method"]), every] = {**r, "method": label}
    rows = [by_label[k] for k in sorted(by_label)]
    add_goodput(rows, int(first["args"]["steps"]))
    return {**first, "rows": rows, "seconds": sum(float(d["seconds"]) for d in runs),
            "merged_from": [str(p) for p in paths]}  # fmt: skip


def _on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns what it wrote to ``goodput.json``."""
    args = parse(argv)
    if args.render is not None:
        data = merge_runs([json.loads(path.read_text()) for path in args.render], args.render)
        args.out.mkdir(parents=True, exist_ok=True)
        if len(args.render) > 1:
            (args.out / "goodput.json").write_text(json.dumps(data, indent=1) + "\n")
        render(data, args.out.resolve())
        return data
    signal.signal(signal.SIGTERM, _on_sigterm)  # stop the cluster and the S3 server on exit
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    cfg = DemoConfig(out=out, steps=args.steps, every_steps=args.every_steps,
                     step_sleep=args.step_sleep, timeout=args.timeout)  # fmt: skip
    demo = Demo(cfg)
    rows: list[dict[str, Any]] = []
    schedule = load_schedule(args.schedule) if args.schedule else None
    started = time.time()
    try:
        demo.build()
        demo.start_cluster()
        demo.namespaces()
        _, storage_env = demo.start_storage()
        demo.install_operator()
        for i, method in enumerate(args.methods):
            if i:
                wait_doomed(demo.cluster)
                demo.next_run(method)
            else:
                demo.label, demo.loss_log = method, out / f"loss-{method}.jsonl"
            empty = Schedule(model={}, interruptions=[])
            plan = empty if method == "no-interruptions" else schedule
            assert plan is not None
            say(f"method {method}: {len(plan.interruptions)} interruptions scheduled")
            if method == "checkpoint-restart":
                directory = out / "work" / "plain-checkpoints"
                result = run_plain(demo, args, plan, directory)
                saved = [e for e in read_log(demo.loss_log) if e.get("event") == "saved"]
                written = sum(int(e["bytes"]) for e in saved)
            else:
                prefix = f"{JOB}-{method}"
                manifest = baton_job(
                    args, f"s3://{demo.bucket}/{prefix}", storage_env, demo.loss_log,
                    fast=method == "baton-memory",
                )  # fmt: skip
                result = run_baton(demo, args, plan, manifest)
                written = bucket_bytes(demo, prefix)
            rows.append(measure_run(method, demo, result, args.steps, written))
            if len(rows[-1]["interruptions"]) < len(plan.interruptions):
                say(
                    f"method {method}: {len(rows[-1]['interruptions'])} of "
                    f"{len(plan.interruptions)} scheduled interruptions made; the others fell "
                    "after the last step"
                )
            if method == "no-interruptions" and schedule is None:
                horizon = rows[-1]["train_s"]
                shares = tuple(float(x) for x in args.mix.split(","))
                model = ScheduleModel(
                    seed=args.seed, mean_seconds_between=args.mtbi, proportions=shares,  # type: ignore[arg-type]
                    replace_after_seconds=args.replace_after, horizon_seconds=horizon,
                    ranks=RANKS, max_interruptions=args.max_interruptions,
                    min_gap_seconds=args.min_gap,
                )  # fmt: skip
                schedule = draw_schedule(model)
                save_schedule(schedule, out / "schedule.json")
                say(
                    f"schedule: {len(schedule.interruptions)} interruptions over {horizon:.0f}s "
                    f"(seed {args.seed}, mean {args.mtbi:.0f}s between) -> schedule.json"
                )
            # Wait for the replacement nodes, so that the next method starts with 3 spot nodes.
            for t in demo._threads:
                if t.name == "replace-node":
                    t.join(timeout=300)
    finally:
        demo.close()
    add_goodput(rows, args.steps)
    assert schedule is not None
    data = {
        "args": {k: str(v) for k, v in vars(args).items() if k != "render"},
        "schedule": json.loads(json.dumps(schedule, default=lambda o: o.__dict__)),
        "rows": rows,
        "seconds": time.time() - started,
    }
    (out / "goodput.json").write_text(json.dumps(data, indent=1) + "\n")
    render(data, out)
    return data


def main(argv: list[str] | None = None) -> int:
    try:
        data = run(argv)
    except DemoError as e:
        say(f"error: {e}")
        return 1
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    rows = data["rows"]
    return 0 if all(r["phase"] == "Succeeded" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
