"""Render a step log (the demo's, or a live dispatcher's `--step-log`) as a table and figures.

The step log is JSON lines: `{"kind": "plan", ...}` records written by the dispatcher for every
planned step (balanced plan and the random-assignment baseline side by side),
`{"kind": "measure", ...}` records it writes once every rank reported a step's measured phase
times (predicted beside measured slowest rank per phase), and `{"kind": "train", ...}` records
written by trainer rank 0 (loss, throughput). A record that lacks a field the report needs is
skipped and counted, with a warning naming its line. Figures are drawn headless with matplotlib
(the `report` extra; without it the table and JSON still come); above 64 ranks they show each
micro-batch's loads as percentiles over ranks instead of a bar per rank. The table uses rich.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import NamedTuple

import numpy as np

from dispatcher_server.cliopts import check_output_file

PHASE_ORDER = ("vision", "audio", "llm")
LOCALITY_ORDER = ("same_rank", "intra_node", "inter_node")
MAX_RANKS_DRAWN = 64  # above this, a bar per rank gives way to percentiles over ranks
MAX_WARNINGS_PER_FILE = 10  # malformed records named one by one; the rest are counted
RUN_FIELDS = ("world_size", "ranks_per_node")  # plan fields two logs of one step must share

log = logging.getLogger("mmdispatch.report")


@dataclass(frozen=True, slots=True)
class StepRecords:
    """A run's records by kind, each sorted by step, and how many malformed records were
    skipped. Unpacks as `plans, trains, measures`."""

    plans: list[dict]
    trains: list[dict]
    measures: list[dict]
    skipped: int = 0

    def __iter__(self) -> Iterator[list[dict]]:
        return iter((self.plans, self.trains, self.measures))


class Segment(NamedTuple):
    """Consecutive planned steps at one topology: a run resumed at another size has several."""

    world_size: int
    ranks_per_node: int
    plans: list[dict]


# What each kind of record must hold for the report: a dict names required keys, `_Each` a
# mapping of any keys, `_Optional` a key that may be absent or null, a `_Leaf` a value test.
class _Leaf(NamedTuple):
    test: Callable[[object], bool]
    what: str


class _Each(NamedTuple):
    spec: object


class _Optional(NamedTuple):
    spec: object


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_matrix(v: object) -> bool:
    return (isinstance(v, list) and bool(v) and isinstance(v[0], list) and bool(v[0])
            and all(isinstance(row, list) and len(row) == len(v[0]) for row in v))


_NUMBER = _Leaf(_is_number, "a number")
_INT = _Leaf(lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer")
_METHOD = {
    "max_over_mean": _Each(_NUMBER), "step_time": _NUMBER,
    "bytes": {loc: _NUMBER for loc in LOCALITY_ORDER},
    "loads": _Optional(_Each(_Leaf(_is_matrix, "a list of micro-batches of per-rank loads"))),
}
REQUIRED = {
    "plan": {"step": _INT, "plan_ms": _NUMBER, "world_size": _INT, "ranks_per_node": _INT,
             "balanced": _METHOD, "random": _METHOD, "sources": _Optional(_Each(_INT)),
             "bytes_per_token": _Optional(_Each(_INT)),
             "bytes_assumed": _Optional(_Leaf(lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
                                              "a list of phase names"))},
    "train": {"step": _INT, "loss": _NUMBER, "samples_per_s": _Optional(_NUMBER)},
    "measure": {"step": _INT, "measured_step_s": _NUMBER,
                "phases": _Each({"predicted_max": _NUMBER, "measured_max": _NUMBER,
                                 "measured_max_over_mean": _NUMBER})},
}


def _fault(value: object, spec: object, where: str = "") -> str | None:
    """What makes `value` fail `spec` ("without 'balanced'", "with 'plan_ms' null"), or None."""
    if isinstance(spec, _Leaf):
        return None if spec.test(value) else f"with '{where}' not {spec.what}"
    if not isinstance(value, dict):
        return f"with '{where}' not an object"
    if isinstance(spec, _Each):
        items = [(key, spec.spec) for key in value]
    else:
        items = list(spec.items())
    for key, sub in items:
        path = f"{where}.{key}" if where else str(key)
        optional = isinstance(sub, _Optional)
        if optional:
            sub = sub.spec
        if value.get(key) is None:
            if optional:
                continue
            return f"without '{path}'" if key not in value else f"with '{path}' null"
        fault = _fault(value[key], sub, path)
        if fault:
            return fault
    return None


def _read_json_lines(path: str | Path) -> Iterator[tuple[int, dict]]:
    """(line number, record) of one log; a torn last line is left out with a warning."""
    p = Path(path)
    if p.is_dir():
        logs = sorted(str(q) for q in p.glob("*.jsonl"))
        hint = (f"pass the step log in it ({', '.join(logs[:4])}{', ...' if len(logs) > 4 else ''})"
                if logs else "pass the file the dispatcher's --step-log wrote")
        raise ValueError(f"step log {str(path)!r} is a directory: {hint}")
    if not p.is_file():
        raise ValueError(f"step log {str(path)!r} does not exist: pass the file the dispatcher's "
                         f"--step-log wrote (and optionally the trainer's --train-log)")
    with open(p, encoding="utf-8") as f:
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
        yield num, rec


def load_step_log(paths: str | Path | list) -> StepRecords:
    """The plan, train and measure records of one or more logs, each sorted by step; the last
    record of a step wins (a resumed run replays steps). Logs whose plans of one step differ in
    world size or ranks per node are of different runs and refused."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    by_kind: dict[str, dict[int, dict]] = {kind: {} for kind in REQUIRED}
    plan_file: dict[int, str | Path] = {}  # step -> the log its plan record came from
    first_dataset: tuple[str, str] | None = None  # the job's dataset id, and where it was read
    skipped = 0
    for path in paths:
        skipped_here = 0
        for num, rec in _read_json_lines(path):
            kind = rec.get("kind")
            if not isinstance(kind, str) or kind not in REQUIRED:
                continue  # a kind the report does not show
            fault = _fault(rec, REQUIRED[kind])
            if fault:
                skipped_here += 1
                if skipped_here <= MAX_WARNINGS_PER_FILE:
                    log.warning("%s:%d: skipped a %s record %s", path, num, kind, fault)
                continue
            step = rec["step"]
            if kind == "plan":
                _check_same_run(by_kind["plan"].get(step), plan_file.get(step), rec, path)
                dataset = rec.get("dataset")
                if dataset is not None:
                    if first_dataset is None:
                        first_dataset = (dataset, f"{path}:{num}")
                    elif dataset != first_dataset[0]:
                        raise ValueError(
                            f"{first_dataset[1]} and {path}:{num} are plans of two jobs (dataset "
                            f"{first_dataset[0]} vs {dataset}; a dispatcher appends to its "
                            "--step-log): report each job's log on its own")
                plan_file[step] = path
            by_kind[kind][step] = rec
        if skipped_here > MAX_WARNINGS_PER_FILE:
            log.warning("%s: skipped %d more malformed records", path,
                        skipped_here - MAX_WARNINGS_PER_FILE)
        skipped += skipped_here
    plans, trains, measures = ([recs[s] for s in sorted(recs)]
                               for recs in (by_kind["plan"], by_kind["train"], by_kind["measure"]))
    if not plans:
        if skipped:
            hint = f"skipped {skipped} malformed record{'s' * (skipped > 1)}: see the warnings above"
        elif trains:
            hint = "only trainer records: pass the dispatcher's --step-log file too"
        else:
            hint = "is this an mmdispatch step log? pass the file the dispatcher's --step-log wrote"
        raise ValueError(f"{', '.join(map(str, paths))}: no plan records ({hint})")
    return StepRecords(plans, trains, measures, skipped)


def _check_same_run(prev: dict | None, prev_path: str | Path | None, rec: dict,
                    path: str | Path) -> None:
    """Refuse to merge a step planned in two logs for different topologies. Records carry no
    run id, so two runs of one topology still merge; within one log a change is a resume."""
    if prev is None or prev_path == path:
        return
    differ = [f"{key} {prev[key]} vs {rec[key]}" for key in RUN_FIELDS if prev[key] != rec[key]]
    if differ:
        raise ValueError(f"{prev_path} and {path} are step logs of different runs (step "
                         f"{rec['step']} planned with {', '.join(differ)}): report each on its own")


def segments(plans: list[dict]) -> list[Segment]:
    """The plans (sorted by step) cut where world size or ranks per node change."""
    return [Segment(w, r, list(group))
            for (w, r), group in groupby(plans, key=lambda p: (p["world_size"], p["ranks_per_node"]))]


def _phases(plans: list[dict]) -> list[str]:
    return [ph for ph in PHASE_ORDER if any(ph in p["balanced"]["max_over_mean"] for p in plans)]


def _balance(plans: list[dict], phases: list[str]) -> dict:
    """Mean max/mean per method and phase, and the predicted speedup, over `plans`."""
    step_bal = sum(p["balanced"]["step_time"] for p in plans)
    step_rnd = sum(p["random"]["step_time"] for p in plans)
    max_over_mean = {}
    for m in ("balanced", "random"):
        max_over_mean[m] = {}
        for ph in phases:
            values = [p[m]["max_over_mean"][ph] for p in plans if ph in p[m]["max_over_mean"]]
            if values:
                max_over_mean[m][ph] = statistics.fmean(values)
    return {"max_over_mean": max_over_mean,
            "predicted_speedup_vs_random": step_rnd / step_bal if step_bal > 0 else 1.0}


def summarize(records: StepRecords) -> dict:
    """Aggregate figures over all steps: the numbers the table and the JSON report show.

    `world_size` and `ranks_per_node` are those of the last steps; `segments` says which steps
    ran at which size (several after a resume at another world size), with their balance."""
    plans, trains = records.plans, records.trains
    phases = _phases(plans)
    segs = segments(plans)
    out = {
        "num_steps": len(plans),
        "world_size": segs[-1].world_size,
        "ranks_per_node": segs[-1].ranks_per_node,
        "plan_ms_p50": statistics.median(p["plan_ms"] for p in plans),
        **_balance(plans, phases),
        "bytes": {
            m: {loc: sum(p[m]["bytes"][loc] for p in plans) for loc in LOCALITY_ORDER}
            for m in ("balanced", "random")
        },
        "segments": [
            {"world_size": s.world_size, "ranks_per_node": s.ranks_per_node,
             "first_step": s.plans[0]["step"], "last_step": s.plans[-1]["step"],
             "num_steps": len(s.plans), **_balance(s.plans, phases)}
            for s in segs
        ],
        "skipped_records": records.skipped,
    }
    weights, assumed = {}, set()
    for p in plans:  # step logs written before plans said it: left out
        weights.update(p.get("bytes_per_token", {}))
        assumed.update(p.get("bytes_assumed", ()))
    if weights:
        out["bytes_per_token"], out["bytes_assumed"] = weights, sorted(assumed)
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
        if not recs:
            continue
        out["max_over_mean"][ph] = statistics.fmean(r["measured_max_over_mean"] for r in recs)
        predicted = sum(r["predicted_max"] for r in recs)
        out["measured_over_predicted"][ph] = (sum(r["measured_max"] for r in recs) / predicted
                                              if predicted > 0 else None)
    out["step_seconds_p50"] = statistics.median(m["measured_step_s"] for m in measures)
    return out


def _relative_time(speedup: float) -> str:
    return f"{1 / speedup:.2f}x" if speedup > 0 else "-"


def _steps(seg: dict) -> str:
    first, last = seg["first_step"], seg["last_step"]
    return f"step {first}" if first == last else f"steps {first}-{last}"


def print_table(summary: dict, console=None) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    segs = summary["segments"]
    sizes = (f"W={summary['world_size']}" if len(segs) == 1
             else ", ".join(f"W={s['world_size']} ({_steps(s)})" for s in segs))
    table = Table(title=f"mmdispatch: {summary['num_steps']} steps, {sizes}")
    table.add_column("figure")
    table.add_column("random", justify="right")
    table.add_column("balanced", justify="right")
    measured = summary.get("measured", {}).get("max_over_mean", {})
    for ph, bal in summary["max_over_mean"]["balanced"].items():
        rnd = summary["max_over_mean"]["random"].get(ph)
        table.add_row(f"{ph} max/mean", "" if rnd is None else f"{rnd:.3f}", f"{bal:.3f}")
        if ph in measured:
            table.add_row(f"  measured", "", f"{measured[ph]:.3f}")
    table.add_row("predicted step time", "1.00x", _relative_time(summary["predicted_speedup_vs_random"]))
    if len(segs) > 1:
        for s in segs:
            table.add_row(f"  W={s['world_size']}, {_steps(s)}", "1.00x",
                          _relative_time(s["predicted_speedup_vs_random"]))
    for loc in LOCALITY_ORDER:
        table.add_row(f"predicted exchange MB {loc}", f"{summary['bytes']['random'][loc] / 1e6:.1f}",
                      f"{summary['bytes']['balanced'][loc] / 1e6:.1f}")
    weights, assumed = summary.get("bytes_per_token"), summary.get("bytes_assumed")
    if weights:
        table.caption = "exchange predicted at " + ", ".join(
            f"{b} B per {p} token" + (f" (assumed: a {b // 2}-wide bf16 output)" if p in assumed else "")
            for p, b in weights.items())
        if assumed:
            table.caption += "; serve --exchange-bytes-per-token gives your model's"
    table.add_row("plan ms (p50)", "", f"{summary['plan_ms_p50']:.1f}")
    for name, src in summary.get("sources", {}).items():
        table.add_row(escape(f"source {name}"), "", f"{src['samples']} ({src['share']:.1%})")
    if "loss_last" in summary:
        table.add_row("loss first -> last", "", f"{summary['loss_first']:.3f} -> {summary['loss_last']:.3f}")
    if summary.get("skipped_records"):
        table.add_row("malformed records skipped", "", str(summary["skipped_records"]))
    console.print(table)


def draw_figure(records: StepRecords):
    """The report's matplotlib figure: per-rank loads per phase (random vs balanced),
    imbalance over steps, bytes by locality, loss, and predicted against measured slowest rank
    per phase and step. Raises ImportError without matplotlib."""
    plt = _pyplot()
    plans, trains = records.plans, records.trains
    phases = _phases(plans)
    fig, axes = plt.subplots(2, max(4, len(phases)), figsize=(19, 8), constrained_layout=True)
    # Top row: one representative step (the one where random was most imbalanced overall).
    # The dispatcher logs per-rank loads only up to some world size.
    with_loads = [p for p in plans if p["balanced"].get("loads") and p["random"].get("loads")]
    if with_loads:
        worst = max(with_loads,
                    key=lambda p: p["random"]["step_time"] / max(p["balanced"]["step_time"], 1e-30))
        for ax, ph in zip(axes[0], phases):
            _draw_loads(ax, worst, ph)
    else:
        axes[0][0].text(0.5, 0.5, "the step log has no per-rank loads\n(the dispatcher logs them "
                        "up to 64 ranks)", ha="center", va="center", transform=axes[0][0].transAxes)
        for ax in axes[0][:len(phases)]:
            ax.axis("off")
    for ax in axes[0][len(phases):]:
        ax.axis("off")
    ax = axes[1][0]
    for ph, color in zip(phases, ("tab:green", "tab:orange", "tab:purple")):
        for m, style in (("random", "--"), ("balanced", "-")):
            pts = [(p["step"], p[m]["max_over_mean"][ph]) for p in plans if ph in p[m]["max_over_mean"]]
            ax.plot([s for s, _ in pts], [v for _, v in pts], style, color=color, label=f"{ph} {m}")
    for seg in segments(plans)[1:]:  # a resume at another size: mark where each size starts
        ax.axvline(seg.plans[0]["step"] - 0.5, color="gray", lw=0.8, ls=":")
        ax.annotate(f" W={seg.world_size}", (seg.plans[0]["step"] - 0.5, 0.01),
                    xycoords=("data", "axes fraction"), fontsize=7, color="gray")
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
    return fig


def _draw_loads(ax, plan: dict, ph: str) -> None:
    """One step's loads of phase `ph`, random beside balanced: a bar per (micro-batch, rank)
    slot up to MAX_RANKS_DRAWN ranks, above that each micro-batch's loads as percentiles over
    ranks, so drawing time stays flat in the world size."""
    loads = [plan[m]["loads"].get(ph) for m in ("random", "balanced")]
    if any(x is None for x in loads) or np.shape(loads[0]) != np.shape(loads[1]):
        ax.axis("off")
        return
    # loads are [micro-batch][rank]; the step pays the slowest rank of each micro-batch.
    rnd, bal = (np.asarray(x, dtype=float) for x in loads)
    scale = max(np.nanmax(rnd), np.nanmax(bal), 1e-30)
    num_mb, num_ranks = rnd.shape
    if num_ranks <= MAX_RANKS_DRAWN:
        slots = np.arange(num_mb * num_ranks)
        ax.bar(slots - 0.2, rnd.reshape(-1) / scale, width=0.4, color="tab:red", alpha=0.7, label="random")
        ax.bar(slots + 0.2, bal.reshape(-1) / scale, width=0.4, color="tab:blue", alpha=0.8, label="balanced")
        for m in range(1, num_mb):
            ax.axvline(m * num_ranks - 0.5, color="gray", lw=0.8, ls=":")
        if len(slots) <= 32:
            ax.set_xticks(slots, [f"r{r}\nmb{m}" for m in range(num_mb) for r in range(num_ranks)], fontsize=7)
        ax.set_title(f"{ph}: load per rank and micro-batch, step {plan['step']}")
    else:
        share = np.linspace(0.0, 1.0, 101)
        for m in range(num_mb):
            for x, color, label in ((rnd, "tab:red", "random"), (bal, "tab:blue", "balanced")):
                ax.plot(m + share, np.nanquantile(x[m], 1.0 - share) / scale, color=color,
                        label=label if m == 0 else None)
            if m:
                ax.axvline(m, color="gray", lw=0.8, ls=":")
        ax.set_xlabel("share of ranks, most loaded first, per micro-batch")
        ax.set_title(f"{ph}: load over {num_ranks} ranks per micro-batch, step {plan['step']}")
    ax.set_ylabel("cost / largest")
    ax.legend(fontsize=8)


def render_figure(records: StepRecords, out_png: str | Path) -> Path:
    """`draw_figure` saved as a PNG; raises ImportError without matplotlib."""
    fig = draw_figure(records)
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    _pyplot().close(fig)
    return out_png


def _pyplot():
    """matplotlib's pyplot on its headless backend; ImportError without the `report` extra."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


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
    parser.add_argument("--out", default=None,
                        help="figure path: .png, or another format matplotlib writes (.pdf, .svg...); "
                             "default: the first log's path with .png")
    parser.add_argument("--json", action="store_true",
                        help="print the summary as one JSON object (default: off, the tables)")


def check_out(path: str) -> None:
    """ValueError naming --out when the figure cannot be written there or in that format: said
    before the logs are read, not as matplotlib's own error after."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:  # no figure is drawn without the extra (run says so)
        formats = None
    else:
        formats = sorted(FigureCanvasBase.get_supported_filetypes())
    suffix = Path(path).suffix.lower().lstrip(".")
    if formats is not None and suffix not in formats:
        raise ValueError(f"--out {path!r}: {'.' + suffix if suffix else 'no suffix'} is no figure format; "
                         f"end it in one of {', '.join('.' + f for f in formats)} (e.g. .png)")
    check_output_file("--out", path, makes_dirs=True)


def run(args: argparse.Namespace) -> int:
    if args.out:
        check_out(args.out)
    records = load_step_log(args.step_log)
    summary = summarize(records)
    out = Path(args.out) if args.out else Path(args.step_log[0]).with_suffix(".png")
    try:
        summary["figure"] = str(render_figure(records, out))
    except ImportError as e:  # matplotlib is an extra: the numbers stand without the figure
        summary["figure"] = None
        log.warning("no figure: %s is not installed (pip install 'mmdispatch[report]')",
                    e.name or "matplotlib")
    if args.json:
        print(json.dumps(summary))
    else:
        print_table(summary)
        if summary["figure"]:
            print(f"figure: {summary['figure']}")
    return 0
