"""Baton's demo: a 2-rank training job survives a spot interruption on a local Kubernetes.

It starts the local cluster (three tainted "spot" nodes and one on-demand node), an S3 server
with a bucket, installs the operator with the Helm chart into a namespace that enforces Pod
Security ``restricted``, applies a 2-replica TrainingJob of ``examples/tinylm/train.py``,
gives the node of one rank the provider's termination notice partway through, and lets the
operator checkpoint, reschedule and resume. Then it compares the final weights with a run that
was never interrupted and writes ``report.md``, ``report.json`` and ``loss.png``.

Run it with ``make demo`` (options through ``DEMO_ARGS``) or directly::

    .venv/bin/python examples/demo/run.py --provider gke --preemptions 2 --out demo-out

The exit status is 0 only when the job Succeeded and its weights are bitwise equal to the
reference's. See docs/demo.md.

This file holds what the demo is about: the job, how its node is taken away, and the report.
The machinery (the local cluster, the S3 server, the Helm install, following the job, the
uninterrupted reference run, the measurements and the plot) is the test helpers' driver,
``tests/baton_testing/demo.py``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any, cast

try:
    from baton_testing.cluster import LocalCluster, Provider
    from baton_testing.demo import (
        JOB,
        JOB_NS,
        NO_NOTICE,
        SPOT_TOLERATION,
        TRAIN,
        DemoConfig,
        run_demo,
        say,
    )
    from baton_testing.jobs import training_job
    from baton_testing.ports import free_port
except ModuleNotFoundError as e:
    if e.name != "baton_testing":
        raise
    sys.exit(
        "the demo drives the local cluster with the test helpers in tests/baton_testing, which "
        "this Python cannot import: run `make venv` (it names tests/ in .venv through a .pth "
        "file), then run the demo with .venv/bin/python or `make demo`"
    )

# The window from the notice until the machine is gone, per provider (what the clouds give).
PROVIDER_GRACE = {"aws": 120, "gke": 30, "karpenter": 120, "autoscaler": 120}
FAST_SIZE_LIMIT = "64Mi"
"""The memory tier's emptyDir for tinylm (``checkpoint.fastSizeLimit``)."""


# --------------------------------------------------------------------------- the job


def tinylm_job(
    cfg: DemoConfig,
    uri: str,
    storage_env: list[dict[str, Any]],
    loss_log: Path,
    fast_every_steps: int | None = None,
) -> dict[str, Any]:
    """The TrainingJob: 2 pods of ``examples/tinylm/train.py`` on spot nodes, restricted-ready;
    with ``fast_every_steps``, the memory tier on (a snapshot in pod memory, replicated to the
    other pod, every that many steps)."""
    checkpoint: dict[str, Any] = {"uri": uri, "everySteps": cfg.every_steps, "keepLast": 3}
    if fast_every_steps is not None:
        # tinylm's whole state is a few MiB: room for two snapshots and a peer's two.
        checkpoint |= {"fastEverySteps": fast_every_steps, "fastSizeLimit": FAST_SIZE_LIMIT}
    env = [
        {"name": "TINYLM_LOG", "value": str(loss_log)},
        {"name": "TINYLM_STEP_SLEEP", "value": str(cfg.step_sleep)},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        *storage_env,  # the S3 endpoint, region and the Secret's keys (none for --storage file)
    ]
    return training_job(
        JOB,
        JOB_NS,
        image="tinylm:demo",
        command=["python", str(TRAIN), "--steps", str(cfg.steps)],
        env=env,
        replicas=2,
        checkpoint=checkpoint,
        # A preemption never counts as a failure; 0 makes a miscounted one fail loudly.
        failure_policy={
            "maxFailures": cfg.preemptions if cfg.kill_node else 0,
            "backoffSeconds": 1,
        },
        # Pods share the host's network here: a free port keeps rendezvous apart.
        master_port=free_port(),
        restricted=True,
        pod={
            "nodeSelector": {"karpenter.sh/capacity-type": "spot"},
            "tolerations": [SPOT_TOLERATION],
        },
    )


# --------------------------------------------------------------------------- the preemption


def interruption_steps(cfg: DemoConfig) -> list[int]:
    """The training step of each interruption, one per attempt, spread over the run."""
    targets = [
        max(cfg.every_steps + 3, round(cfg.steps * (k + 1) / (cfg.preemptions + 1)) - 2)
        for k in range(cfg.preemptions)
    ]
    if cfg.kill_node:
        # Halfway between two periodic checkpoints, so that steps are visibly lost.
        targets = [t - t % cfg.every_steps + cfg.every_steps // 2 for t in targets]
    return targets


def interrupt(cfg: DemoConfig, cluster: LocalCluster, node: str, rank: int, step: int) -> str:
    """Take ``node`` away: the provider's notice, or (``--kill-node``) the machine just dies."""
    if cfg.kill_node:
        say(f"chaos: killing node {node} (rank {rank}) at step {step}, with no notice")
        cluster.kill_node(node)
        return NO_NOTICE
    grace = PROVIDER_GRACE[cfg.provider]
    say(
        f"chaos: preempt {node} (rank {rank}) at step {step}: "
        f"{cfg.provider} notice, the machine is gone in {grace}s"
    )
    # What the provider does to the node (AWS: the Node Termination Handler's taint, label,
    # cordon and drain); the machine stops `grace` seconds later (see docs/demo.md).
    cluster.preempt(node, provider=cfg.provider, grace_s=grace)
    return f"{cfg.provider} notice"


# --------------------------------------------------------------------------- the report


def _fmt(value: float | None, unit: str = "s") -> str:
    return "n/a" if value is None else f"{value:.1f} {unit}".strip()


def report(cfg: DemoConfig, data: dict[str, Any], events: list[str]) -> str:
    """``report.md``: one row per interruption, then the verdict and the job's Events."""
    lines = [
        "# Baton demo report",
        "",
        f"- job: 2-rank tinylm, {cfg.steps} steps, checkpoints every {cfg.every_steps} steps "
        f"in {'S3 (versitygw server)' if cfg.storage == 's3' else 'the local filesystem'}",
        f"- interruption: {'kill-node (no notice)' if cfg.kill_node else cfg.provider + ' notice'}"
        f" x {cfg.preemptions}",
        f"- final phase: **{data['phase']}** (preemptions {data['preemptions']}, "
        f"failures {data['failures']})",
        "",
        "| # | what | node (rank) | at step | notice lead | notice to commit | SDK save | "
        "margin left | checkpoint | resumed at | steps lost | restore | downtime |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["interruptions"]:
        ckpt = f"step {r['checkpoint_step']} ({r['checkpoint_trigger']})"
        lines.append(
            f"| {r['n']} | {r['kind']} | {r['node']} ({r['rank']}) | {r['at_step']} | "
            f"{_fmt(r['notice_lead_s'])} | {_fmt(r['notice_to_commit_s'])} | "
            f"{_fmt(r['sdk_save_s'])} | {_fmt(r['margin_s'])} | {ckpt} | {r['resumed_step']} | "
            f"{r['steps_lost']} | {_fmt(r['restore_s'])} | {_fmt(r['downtime_s'])} |"
        )
    verdict = "BITWISE EQUAL" if data["bitwise_equal"] else "DIFFERENT"
    memory = data.get("memory_tier")
    if memory:
        lines += ["", *_comparison(cfg, data, memory)]
    lines += [
        "",
        f"- steps lost in total: **{data['steps_lost']}**",
        f"- final weights sha256: `{data['sha256']}`",
        f"- reference sha256:     `{data['reference_sha256']}` (the same job, never interrupted)",
        f"- verdict: **{verdict}**",
        f"- wall time of the demo: {data['wall_seconds']:.0f} s",
        "",
        "Notice lead: the operator's deadline minus when it saw the notice. Notice to commit: "
        "until every rank's save was committed (the SDK's own save time beside it). Margin: "
        "deadline minus commit. Steps lost: steps trained before the interruption that the "
        "next attempt had to redo. Restore: the trainer's `restore()` time in the next attempt; "
        "downtime: from the interruption to the next attempt's first step.",
        "",
        "Events of the TrainingJob:",
        "",
    ]
    lines += [f"    {e}" for e in events]
    lines += ["", "![loss](loss.png)", ""]
    return "\n".join(lines)


def _comparison(cfg: DemoConfig, durable: dict[str, Any], memory: dict[str, Any]) -> list[str]:
    """The same job and the same loss, today's path beside the memory tier's."""
    lines = [
        f"## The same node loss with the memory tier (fastEverySteps {cfg.fast_every_steps})",
        "",
        "| path | final phase | restored from | steps lost | restore | to first new step | "
        "pods replaced | weights |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, d in (("durable checkpoints only", durable), ("memory tier", memory)):
        rows = d["interruptions"]
        restored = ", ".join(f"step {r['resumed_step']} ({r['checkpoint_trigger']})" for r in rows)
        to_first = ", ".join(_fmt(r["to_first_step_s"]) for r in rows)
        restore = ", ".join(_fmt(r["restore_s"]) for r in rows)
        verdict = "bitwise equal" if d["bitwise_equal"] else "DIFFERENT"
        lines.append(
            f"| {name} | {d['phase']} | {restored} | {d['steps_lost']} | {restore} | "
            f"{to_first} | {d.get('pods_replaced', 'n/a')} | {verdict} |"
        )
    lines += [
        "",
        "To first new step: from the node's loss to the first training step after the resume. "
        "Today's path restarts every pod and reloads the last periodic checkpoint; the memory "
        "tier replaces only the lost pod, and the ranks load the newest snapshot, the lost "
        "rank's from its replica in the other pod's memory.",
    ]
    return lines


# --------------------------------------------------------------------------- main


def parse(argv: list[str] | None) -> DemoConfig:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--provider", choices=sorted(PROVIDER_GRACE), default="aws")
    p.add_argument("--preemptions", type=int, default=1)
    p.add_argument(
        "--kill-node",
        action="store_true",
        help="lose the node with no notice; the job then runs twice, without and with the "
        "memory tier, and the report compares them",
    )
    p.add_argument(
        "--fast-every-steps",
        type=int,
        default=DemoConfig.fast_every_steps,
        help="with --kill-node: the second run's memory-tier interval (0: only the first run)",
    )
    p.add_argument("--storage", choices=["s3", "file"], default="s3")
    p.add_argument("--out", type=Path, default=Path("demo-out"))
    p.add_argument("--steps", type=int, default=DemoConfig.steps)
    p.add_argument("--every-steps", type=int, default=DemoConfig.every_steps)
    p.add_argument("--step-sleep", type=float, default=DemoConfig.step_sleep)
    p.add_argument("--timeout", type=float, default=DemoConfig.timeout)
    p.add_argument(
        "--goodput",
        action="store_true",
        help="instead: a short run of bench/goodput.py (Baton against checkpoint-restart on "
        "one seeded schedule of 2 interruptions), its table and plot in OUT/goodput",
    )
    a = p.parse_args(argv)
    if a.goodput and (a.kill_node or a.preemptions != 1 or a.provider != "aws"):
        p.error(
            "--goodput draws its own interruptions: drop --provider, --preemptions and --kill-node"
        )
    if a.preemptions < 1:
        p.error("--preemptions must be at least 1")
    if a.steps < (a.preemptions + 1) * (a.every_steps + 5):
        p.error("--steps is too small for that many interruptions at this --every-steps")
    return DemoConfig(
        goodput=a.goodput,
        provider=cast(Provider, a.provider), preemptions=a.preemptions, kill_node=a.kill_node,
        storage=a.storage, out=a.out, steps=a.steps, every_steps=a.every_steps,
        fast_every_steps=a.fast_every_steps or None,
        step_sleep=a.step_sleep, timeout=a.timeout,
    )  # fmt: skip


GOODPUT_SHORT = ["--steps", "60", "--every-steps", "10", "--step-sleep", "0.3", "--seed", "10"]
GOODPUT_SHORT += ["--mtbi", "12", "--min-gap", "10", "--max-interruptions", "2"]
"""The goodput benchmark's short version: 60 steps; seed 10 draws a GKE notice about 10 s into
training and a node lost without notice 10 s later (whatever the horizon between 25 and 40 s)."""


def goodput(cfg: DemoConfig) -> int:
    """Run ``bench/goodput.py``'s short version, as a user would run the benchmark itself."""
    bench = Path(__file__).resolve().parents[2] / "bench" / "goodput.py"
    command = [sys.executable, str(bench), "--out", str(cfg.out / "goodput"), *GOODPUT_SHORT]
    say(f"the goodput benchmark, short: {' '.join(command[1:])}")
    return subprocess.run(command, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    cfg = parse(argv)
    if cfg.goodput:
        return goodput(cfg)
    return run_demo(
        cfg,
        job=partial(tinylm_job, cfg),
        at_steps=interruption_steps(cfg),
        interrupt=partial(interrupt, cfg),
        report=report,
    )


if __name__ == "__main__":
    sys.exit(main())
