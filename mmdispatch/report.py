"""Render a step log (the demo's, or a live dispatcher's `--step-log`) as a table and figures.

The step log is JSON lines: `{"kind": "plan", ...}` records written by the dispatcher for every
planned step (balanced plan and the random-assignment baseline side by side),
`{"kind": "measure", ...}` records it writes once every rank reported a step's measured phase
times (predicted beside measured slowest rank per phase), and `{"kind": "train", ...}` records
written by trainer rank 0 (loss, throughput). Figures are drawn headless with matplotlib; the
terminal table uses rich.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from pathlib import Path
from typing import NamedTuple

PHASE_ORDER = ("vision", "audio", "llm")
LOCALITY_ORDER = ("same_rank", "intra_node", "inter_node")

log = logging.getLogger("mmdispatch.report")


class StepRecords(NamedTuple):
    """A run's records by kind, each sorted by step."""

    plans: list[dict]
    trains: list[dict]
    measures: list[dict]


def load_step_log(paths: str | Path | list) -> StepRecords:
    """The plan, train and measure records of one or more logs, each sorted by step; the last
    record of a step wins (a resumed run replays steps)."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    plans: dict[int, dict] = {}
    trains: dict[int, dict] = {}
    measures: dict[int, dict] = {}
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
                torn = num == len(lines) and not line.endswith("\n")
                line = line.strip()
                if not line:
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    if torn:  # the record being written now, or one cut short by a kill
                        log.warning("%s:%d: left out an unfinished last record", path, num)
                        continue
                    raise ValueError(f"{path}:{num}: not a JSON line ({e.msg}); is this an mmdispatch "
                                     f"step log?") from None
                if not isinstance(rec, dict):
                    raise ValueError(f"{path}:{num}: not a step record (a JSON object)")
                kind = rec.get("kind")
                if kind == "plan":
                    plans[int(rec["step"])] = rec
                elif kind == "train":
                    trains[int(rec["step"])] = rec
                elif kind == "measure":
                    measures[int(rec["step"])] = rec
    if not plans:
        hint = ("only trainer records: pass the dispatcher's --step-log file too" if trains
                else "is this an mmdispatch step log? pass the file the dispatcher's --step-log wrote")
        raise ValueError(f"{', '.join(map(str, paths))}: no plan records ({hint})")
    return StepRecords([plans[s] for s in sorted(plans)], [trains[s] for s in sorted(trains)],
                       [measures[s] for s in sorted(measures)])


def summarize(records: StepRecords) -> dict:
    """Aggregate figures over all steps: the numbers the table and the JSON report show."""
    plans, trains = records.plans, records.trains

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
    mixture: dict[str, int] = {}
    for p in plans:
        for name, n in p.get("sources", {}).items():
            mixture[name] = mixture.get(name, 0) + n
    if mixture:  # a blend: samples and realized share per source
        total = sum(mixture.values()) or 1
        out["sources"] = {name: {"samples": n, "share": n / total} for name, n in mixture.items()}
    if trains:
        out["loss_first"] = trains[0]["loss"]
        out["loss_last"] = trains[-1]["loss"]
        rates = [t["samples_per_s"] for t in trains if t.get("samples_per_s")]
        out["samples_per_s_p50"] = statistics.median(rates) if rates else None
    if records.measures:
        out["measured"] = _measured(records.measures, phases)
    return out


def _measured(measures: list[dict], phases: list[str]) -> dict:
    """Means over the measured steps: per phase the measured max/mean, and how measured
    seconds of the slowest rank relate to the cost model's prediction for it."""
    out = {"num_steps": len(measures), "max_over_mean": {}, "measured_over_predicted": {}}
    for ph in phases:
        recs = [m["phases"][ph] for m in measures if ph in m["phases"]]
        out["max_over_mean"][ph] = statistics.fmean(r["measured_max_over_mean"] for r in recs)
        predicted = sum(r["predicted_max"] for r in recs)
        out["measured_over_predicted"][ph] = (sum(r["measured_max"] for r in recs) / predicted
                                              if predicted > 0 else None)
    out["step_seconds_p50"] = statistics.median(m["measured_step_s"] for m in measures)
    return out


def print_table(summary: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"mmdispatch: {summary['num_steps']} steps, W={summary['world_size']}")
    table.add_column("figure")
    table.add_column("random", justify="right")
    table.add_column("balanced", justify="right")
    measured = summary.get("measured", {}).get("max_over_mean", {})
    for ph, bal in summary["max_over_mean"]["balanced"].items():
        table.add_row(f"{ph} max/mean", f"{summary['max_over_mean']['random'][ph]:.3f}", f"{bal:.3f}")
        if ph in measured:
            table.add_row(f"  measured", "", f"{measured[ph]:.3f}")
    table.add_row("predicted step time", "1.00x", f"{1 / summary['predicted_speedup_vs_random']:.2f}x")
    for loc in LOCALITY_ORDER:
        table.add_row(f"exchange MB {loc}", f"{summary['bytes']['random'][loc] / 1e6:.1f}",
                      f"{summary['bytes']['balanced'][loc] / 1e6:.1f}")
    table.add_row("plan ms (p50)", "", f"{summary['plan_ms_p50']:.1f}")
    for name, src in summary.get("sources", {}).items():
        table.add_row(f"source {name}", "", f"{src['samples']} ({src['share']:.1%})")
    if "loss_last" in summary:
        table.add_row("loss first -> last", "", f"{summary['loss_first']:.3f} -> {summary['loss_last']:.3f}")
    console.print(table)


def render_figure(records: StepRecords, out_png: str | Path) -> Path:
    """Per-rank loads per phase (random vs balanced), imbalance over steps, bytes by locality,
    loss, and predicted against measured slowest rank per phase and step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    plans, trains = records.plans, records.trains
    phases = [ph for ph in PHASE_ORDER if ph in plans[0]["balanced"]["loads"]]
    fig, axes = plt.subplots(2, max(4, len(phases)), figsize=(19, 8), constrained_layout=True)
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
    _scatter(axes[1][3], records.measures, phases)
    for ax in axes[1][4:]:
        ax.axis("off")
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def _scatter(ax, measures: list[dict], phases: list[str]) -> None:
    """Predicted (cost-model units) against measured (seconds) slowest rank, per phase and step."""
    if not measures:
        ax.axis("off")
        return
    for ph, color in zip(phases, ("tab:green", "tab:orange", "tab:purple")):
        pts = [(m["phases"][ph]["predicted_max"], m["phases"][ph]["measured_max"])
               for m in measures if ph in m["phases"]]
        ax.scatter([p for p, _ in pts], [t for _, t in pts], s=12, color=color, label=ph)
    ax.set_title("slowest rank per step: predicted vs measured")
    ax.set_xlabel("predicted (cost-model units)")
    ax.set_ylabel("measured (s)")
    ax.legend(fontsize=8)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("step_log", nargs="+",
                        help="JSON-lines step logs: the dispatcher's --step-log, optionally the trainer's "
                             "--train-log")
    parser.add_argument("--out", default=None, help="figure path (PNG); default: next to the log")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")


def run(args: argparse.Namespace) -> int:
    records = load_step_log(args.step_log)
    summary = summarize(records)
    out = Path(args.out) if args.out else Path(args.step_log[0]).with_suffix(".png")
    summary["figure"] = str(render_figure(records, out))
    if args.json:
        print(json.dumps(summary))
    else:
        print_table(summary)
        print(f"figure: {summary['figure']}")
    return 0
