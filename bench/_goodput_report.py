"""The goodput benchmark's report: goodput per row, the Markdown table and the plot.

``bench/goodput.py`` runs the methods and measures each run; this turns its ``goodput.json``
into ``goodput.md`` and ``goodput.png`` (also alone: ``bench/goodput.py --render FILE``).
"""

from __future__ import annotations

import statistics
import textwrap
from pathlib import Path
from typing import Any

PHASES = ("launch", "rendezvous", "setup", "restore")
"""Rank 0's trainer start-up, as tinylm logs it in its ``start`` event (``<phase>_seconds``):
interpreter and imports, ``init_process_group``, the script's set-up (data, model, DDP, the
Checkpointer), the restore."""


def add_goodput(rows: list[dict[str, Any]], steps: int) -> None:
    clean = next((r for r in rows if r["method"] == "no-interruptions"), None)
    step_s = clean["median_step_s"] if clean else None
    ref = clean["sha256"] if clean else None
    for r in rows:
        productive = steps * step_s if step_s else None
        r["goodput"] = productive / r["wall_s"] if productive and r["wall_s"] else None
        r["bitwise_equal"] = ref is not None and r["sha256"] == ref


def table(rows: list[dict[str, Any]]) -> str:
    clean = next((r for r in rows if r["method"] == "no-interruptions"), None)
    base = next((r for r in rows if r["method"] == "checkpoint-restart"), None)
    lines = [
        "| method | interruptions | wall time | vs uninterrupted | vs checkpoint-restart | "
        "goodput | steps recomputed | restart s (median / worst) | not training | "
        "median step | bytes written | bitwise equal |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rs = r["restart_s"]
        restart = f"{statistics.median(rs):.0f} / {max(rs):.0f}" if rs else "-"
        vs_clean = f"{r['wall_s'] / clean['wall_s']:.2f}x" if clean and r["wall_s"] else "-"
        vs_base = f"{r['wall_s'] / base['wall_s']:.2f}x" if base and r["wall_s"] else "-"
        kinds = ", ".join(i["kind"] for i in r["interruptions"]) or "none"
        good = f"{100 * r['goodput']:.0f} %" if r["goodput"] else "-"
        # Wall time minus the steps trained at this run's own median step time: start-up,
        # restarts and waits, apart from how loaded the machine was while it trained.
        step_s = r["median_step_s"] or 0.0
        idle = f"{r['wall_s'] - r['steps_trained'] * step_s:.0f} s"
        step = f"{step_s:.2f} s"
        lines.append(
            f"| {r['method']} | {len(r['interruptions'])} ({kinds}) | {r['wall_s']:.0f} s | "
            f"{vs_clean} | {vs_base} | {good} | {r['steps_recomputed']} | {restart} | "
            f"{idle} | {step} | "
            f"{r['bytes_written'] / 2**20:.1f} MiB | {'yes' if r['bitwise_equal'] else 'no'} |"
        )
    return "\n".join(lines)


def restart_table(rows: list[dict[str, Any]]) -> str:
    """Where the restarts' seconds went: rank 0's trainer start-up phases (medians over the
    run's restarts), and the rest of the restart (the save, the pods going and coming, the
    wait for a node judged lost, the first step); empty when no run logged them."""
    lines = [
        "| method | restarts | restart s | trainer: interpreter and imports | rendezvous | "
        "set-up (model, DDP, Checkpointer) | restore | the rest |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        measured = r.get("restart_phases") or []
        if not measured or len(measured) != len(r["restart_s"]):
            continue
        med = {k: statistics.median(m[k] for m in measured) for k in PHASES}
        rest = statistics.median(
            total - sum(m.values()) for total, m in zip(r["restart_s"], measured, strict=True)
        )
        cells = " | ".join(f"{med[k]:.1f} s" for k in PHASES)
        lines.append(
            f"| {r['method']} | {len(measured)} | {statistics.median(r['restart_s']):.1f} s | "
            f"{cells} | {rest:.1f} s |"
        )
    return "\n".join(lines) if len(lines) > 2 else ""


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    colors = {"no-interruptions": "0.5", "checkpoint-restart": "tab:red",
              "baton-durable": "tab:blue", "baton-memory": "tab:green"}  # fmt: skip
    others = iter(("tab:olive", "tab:purple", "tab:brown", "tab:cyan"))
    for r in rows:
        color = colors.get(r["method"]) or next(others, "k")  # e.g. "baton-memory, every 25"
        xs = [t / 60 for t, _ in r["curve"]]
        ys = [s for _, s in r["curve"]]
        ax.plot(xs, ys, ".", markersize=2, color=color, label=r["method"])
        for i in r["interruptions"]:
            t = (i["at_s"] + (r["curve"][0][0] if r["curve"] else 0)) / 60
            ax.axvline(t, color=color, linestyle=":", linewidth=0.8)
            ax.plot([t], [i["at_step"]], "x", color=color, markersize=7)
    ax.set_xlabel("wall time since the job was applied (min)")
    ax.set_ylabel("training step reached")
    ax.set_title(textwrap.fill(title, 100), fontsize=8)
    ax.legend(loc="lower right", fontsize=8, markerscale=4)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def render(data: dict[str, Any], out: Path) -> None:
    """``goodput.md`` and ``goodput.png`` from what ``goodput.json`` holds."""
    rows, args = data["rows"], data["args"]
    mix = args["mix"].replace(",", "/")
    sizes = [r["state_bytes"] for r in rows if r.get("state_bytes")]
    model = f"tinylm d{args.get('d_model', 64)} x {args.get('n_layers', 2)} layers"
    state = f", state {sizes[0] / 2**20:.0f} MiB" if sizes else ""
    title = (
        f"{model}{state}, 2 spot ranks, {args['steps']} steps; seed {args['seed']}, mean "
        f"{float(args['mtbi']):.0f}s between interruptions (aws/gke/none {mix}); x: interruption"
    )
    plot(rows, out / "goodput.png", title)
    parts = [f"# Goodput ({title})", "", table(rows), ""]
    restarts = restart_table(rows)
    if restarts:
        parts += ["Where the restarts went (medians; rank 0's trainer):", "", restarts, ""]
    text = "\n".join(parts)
    (out / "goodput.md").write_text(text)
    print(text)
