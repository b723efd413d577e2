"""Render a step log (the demo's, or a live dispatcher's `--step-log`) as a table and figures.

The step log is JSON lines: `{"kind": "plan", ...}` records written by the dispatcher for every
planned step (balanced plan and the random-assignment baseline side by side) and
`{"kind": "train", ...}` records written by trainer rank 0 (loss, throughput). Figures are
drawn headless with matplotlib; the terminal table uses rich.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

PHASE_ORDER = ("vision", "audio", "llm")
LOCALITY_ORDER = ("same_rank", "intra_node", "inter_node")


def load_step_log(paths: str | Path | list) -> tuple[list[dict], list[dict]]:
    """(plan records, train records) from one or more logs, each sorted by step; the last
    record of a step wins (a resumed run replays steps)."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    plans: dict[int, dict] = {}
    trains: dict[int, dict] = {}
    for path in paths:
        if not Path(path).is_file():
            raise ValueError(f"step log {str(path)!r} does not exist: pass the file the dispatcher's "
                             f"--step-log wrote (and optionally the trainer's --train-log)")
        with open(path, encoding="utf-8") as f:
            try:
                lines = list(enumerate(f, 1))
            except UnicodeDecodeError:
                raise ValueError(f"{path} is a binary file, not a JSON-lines step log: pass the "
                                 f"dispatcher's --step-log file (and optionally the trainer's "
                                 f"--train-log)") from None
            for num, line in lines:
                line = line.strip()
                if not line:
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{num}: not a JSON line ({e.msg}); is this an mmdispatch "
                                     f"step log?") from None
                if not isinstance(rec, dict):
                    raise ValueError(f"{path}:{num}: not a step record (a JSON object)")
                kind = rec.get("kind")
                if kind == "plan":
                    plans[int(rec["step"])] = rec
                elif kind == "train":
                    trains[int(rec["step"])] = rec
    if not plans:
        hint = ("only trainer records: pass the dispatcher's --step-log file too" if trains
                else "is this an mmdispatch step log? pass the file the dispatcher's --step-log wrote")
        raise ValueError(f"{', '.join(map(str, paths))}: no plan records ({hint})")
    return [plans[s] for s in sorted(plans)], [trains[s] for s in sorted(trains)]


def summarize(plans: list[dict], trains: list[dict]) -> dict:
    """Aggregate figures over all steps: the numbers the table and the JSON report show."""

    def mean_of(key: str, method: str, phase: str) -> float:
        return statistics.fmean(p[method][key][phase] for p in plans)

    phases = [ph for ph in PHASE_ORDER if ph in plans[0]["balanced"]["max_over_mean"]]
    step_bal = sum(p["balanced"]["step_time"] for p in plans)
    step_rnd = sum(p["random"]["step_time"] for p in plans)
    out = {
        "num_steps": len(plans),
        "world_size": plans[0].get("world_size"),
        "ranks_per_node": plans[0].get("ranks_per_node"),
        "plan_ms_p50": statistics.median(p["plan_ms"] for p in plans),
        "max_over_mean": {
            m: {ph: mean_of("max_over_mean", m, ph) for ph in phases} for m in ("balanced", "random")
        },
        "predicted_speedup_vs_random": step_rnd / step_bal if step_bal > 0 else 1.0,
        "bytes": {
            m: {loc: sum(p[m]["bytes"][loc] for p in plans) for loc in LOCALITY_ORDER}
            for m in ("balanced", "random")
        },
    }
    if trains:
        out["loss_first"] = trains[0]["loss"]
        out["loss_last"] = trains[-1]["loss"]
        rates = [t["samples_per_s"] for t in trains if t.get("samples_per_s")]
        out["samples_per_s_p50"] = statistics.median(rates) if rates else None
    return out


def print_table(summary: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"mmdispatch: {summary['num_steps']} steps, W={summary['world_size']}")
    table.add_column("figure")
    table.add_column("random", justify="right")
    table.add_column("balanced", justify="right")
    for ph, bal in summary["max_over_mean"]["balanced"].items():
        table.add_row(f"{ph} max/mean", f"{summary['max_over_mean']['random'][ph]:.3f}", f"{bal:.3f}")
    table.add_row("predicted step time", "1.00x", f"{1 / summary['predicted_speedup_vs_random']:.2f}x")
    for loc in LOCALITY_ORDER:
        table.add_row(f"exchange MB {loc}", f"{summary['bytes']['random'][loc] / 1e6:.1f}",
                      f"{summary['bytes']['balanced'][loc] / 1e6:.1f}")
    table.add_row("plan ms (p50)", "", f"{summary['plan_ms_p50']:.1f}")
    if "loss_last" in summary:
        table.add_row("loss first -> last", "", f"{summary['loss_first']:.3f} -> {summary['loss_last']:.3f}")
    console.print(table)


def render_figure(plans: list[dict], trains: list[dict], out_png: str | Path) -> Path:
    """Per-rank loads per phase (random vs balanced), imbalance over steps, bytes by locality."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    phases = [ph for ph in PHASE_ORDER if ph in plans[0]["balanced"]["loads"]]
    fig, axes = plt.subplots(2, max(3, len(phases)), figsize=(15, 8), constrained_layout=True)
    # Top row: one representative step (the one where random was most imbalanced overall).
    worst = max(plans, key=lambda p: p["random"]["step_time"] / max(p["balanced"]["step_time"], 1e-30))
    for ax, ph in zip(axes[0], phases):
        # loads are [micro-batch][rank]; the step pays the slowest rank of each micro-batch,
        # so every (micro-batch, rank) slot gets its own pair of bars.
        rnd = np.asarray(worst["random"]["loads"][ph], dtype=float)
        bal = np.asarray(worst["balanced"]["loads"][ph], dtype=float)
        scale = max(rnd.max(), bal.max(), 1e-30)
        num_mb, num_ranks = rnd.shape
        slots = np.arange(num_mb * num_ranks)
        ax.bar(slots - 0.2, rnd.reshape(-1) / scale, width=0.4, color="tab:red", alpha=0.7, label="random")
        ax.bar(slots + 0.2, bal.reshape(-1) / scale, width=0.4, color="tab:blue", alpha=0.8, label="balanced")
        for m in range(1, num_mb):
            ax.axvline(m * num_ranks - 0.5, color="gray", lw=0.8, ls=":")
        if len(slots) <= 32:
            ax.set_xticks(slots, [f"r{r}\nmb{m}" for m in range(num_mb) for r in range(num_ranks)], fontsize=7)
        ax.set_title(f"{ph}: load per rank and micro-batch, step {worst['step']}")
        ax.set_ylabel("cost / largest")
        ax.legend(fontsize=8)
    for ax in axes[0][len(phases):]:
        ax.axis("off")
    steps = [p["step"] for p in plans]
    ax = axes[1][0]
    for ph, color in zip(phases, ("tab:green", "tab:orange", "tab:purple")):
        ax.plot(steps, [p["random"]["max_over_mean"][ph] for p in plans], "--", color=color, label=f"{ph} random")
        ax.plot(steps, [p["balanced"]["max_over_mean"][ph] for p in plans], "-", color=color, label=f"{ph} balanced")
    ax.set_title("max/mean per phase over steps (1.0 = perfect)")
    ax.set_xlabel("step")
    ax.legend(fontsize=7, ncol=2)
    ax = axes[1][1]
    methods = ("random", "balanced")
    bottom = np.zeros(2)
    for loc, color in zip(LOCALITY_ORDER, ("tab:gray", "tab:cyan", "tab:red")):
        vals = np.array([sum(p[m]["bytes"][loc] for p in plans) / 1e6 for m in methods])
        ax.bar(methods, vals, bottom=bottom, color=color, label=loc)
        bottom += vals
    ax.set_title("encoder->LLM exchange bytes by locality (MB, all steps)")
    ax.legend(fontsize=8)
    ax = axes[1][2]
    if trains:
        ax.plot([t["step"] for t in trains], [t["loss"] for t in trains], color="tab:blue")
        ax.set_title("training loss (reference model)")
        ax.set_xlabel("step")
    else:
        ax.axis("off")
    for ax in axes[1][3:]:
        ax.axis("off")
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("step_log", nargs="+",
                        help="JSON-lines step logs: the dispatcher's --step-log, optionally the trainer's "
                             "--train-log")
    parser.add_argument("--out", default=None, help="figure path (PNG); default: next to the log")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")


def run(args: argparse.Namespace) -> int:
    plans, trains = load_step_log(args.step_log)
    summary = summarize(plans, trains)
    out = Path(args.out) if args.out else Path(args.step_log[0]).with_suffix(".png")
    summary["figure"] = str(render_figure(plans, trains, out))
    if args.json:
        print(json.dumps(summary))
    else:
        print_table(summary)
        print(f"figure: {summary['figure']}")
    return 0
