"""Count tokens per modality in shards, or in every source of a dataset file, and print
statistics: lengths, modality mix, errors, histogram. With `--dataset`, each source is read
with its own field map, and a mixture table shows what its weight makes of a step: its share
of the samples and of the LLM tokens, per modality.

The shard statistics themselves are `pipeline.inspect`'s; this module adds the dataset file,
which is read by the application layer (`mmdispatch.dataset`).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dispatcher_server.blend import normalized
from dispatcher_server.cliopts import say
from pipeline import inspect as shards
from pipeline.fieldmap import FieldMap
from pipeline.reader import reader_config_from_args

MODALITIES = ("text", "image", "video", "audio")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    shards.add_arguments(parser)
    parser.add_argument("--dataset", metavar="FILE", default=None,
                        help="a dataset file (TOML, as `serve --dataset` takes): inspect each "
                             "source with its field map and show the mixture its weights give; "
                             "instead of shard specs and --map")


def mixture(sources: list, reports: dict[str, dict]) -> dict[str, dict]:
    """Per source: its weight, and the share of a step's samples and LLM tokens (per modality
    too) that its weight gives, from the tokens per sample its shards hold."""
    share = dict(zip([s.name for s in sources], normalized([s.weight for s in sources])))
    per_sample = {}
    for s in sources:
        r = reports[s.name]
        n = max(1, r["num_samples"])
        per_sample[s.name] = {m: r["modalities"][m]["llm_len"].get("sum", 0.0) / n for m in MODALITIES}
    expected = {s.name: {m: share[s.name] * v for m, v in per_sample[s.name].items()}
                for s in sources}
    all_tokens = sum(sum(e.values()) for e in expected.values()) or 1.0
    return {s.name: {
        "weight": s.weight,
        "sample_share": round(share[s.name], 4),
        "llm_tokens_per_sample": round(sum(per_sample[s.name].values()), 1),
        "token_share": round(sum(expected[s.name].values()) / all_tokens, 4),
        "token_share_by_modality": {m: round(v / all_tokens, 4) for m, v in expected[s.name].items()},
    } for s in sources}


def render_mixture(mix: dict[str, dict], console: Console) -> None:
    table = Table(title="mixture (what the weights make of a step)")
    for col in ("source", "weight", "samples", "LLM tokens/sample", "LLM tokens", *MODALITIES):
        table.add_column(col, justify="left" if col == "source" else "right")
    for name, m in mix.items():
        by = m["token_share_by_modality"]
        table.add_row(escape(name), f"{m['weight']:g}", f"{m['sample_share']:.1%}",
                      f"{m['llm_tokens_per_sample']:.0f}", f"{m['token_share']:.1%}",
                      *(f"{by[k]:.1%}" for k in MODALITIES))
    console.print(table)


def run_dataset(args: argparse.Namespace) -> int:
    from mmdispatch.dataset import load_dataset

    if args.shards or args.map:
        raise ValueError("--dataset FILE names the shards and field maps itself: drop the shard "
                         "specs and --map, or drop --dataset")
    sources, _ = load_dataset(args.dataset)
    base = reader_config_from_args(args, keep_members=False)
    console = Console()
    reports = {}
    for src in sources:
        config = replace(base, fields=FieldMap.from_dict(src.fields) if src.fields else FieldMap())
        reports[src.name] = shards.collect(src.shards, config, show_progress=sys.stderr.isatty(),
                                           stall_s=args.stall_timeout)
        if not args.json:
            console.rule(escape(f"source {src.name!r}: {len(src.shards)} shards, weight {src.weight:g}"))
            shards.render(reports[src.name], console)
    mix = mixture(sources, reports)
    if args.json:
        print(json.dumps({"sources": reports, "mixture": mix}))
    else:
        render_mixture(mix, console)
    empty = [name for name, r in reports.items() if r["num_samples"] == 0]
    if empty:
        say(f"mmdispatch inspect: error: no readable sample in source(s) {', '.join(map(repr, empty))}; "
            f"the shards with errors above say why")  # JSON under --log-format json
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    if args.stall_timeout <= 0:
        raise ValueError(f"--stall-timeout must be > 0 seconds, got {args.stall_timeout:g}")
    if args.dataset is not None:
        return run_dataset(args)
    return shards.run(args)
