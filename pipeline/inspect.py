"""Count tokens per modality in shards and print statistics: lengths, modality mix, errors, histogram.

Reads with the same reader and counting rules a data node uses, so what it reports is what the
dispatcher will plan with. Errors are accounted per shard: a shard that fails too often in a row
is listed as bad with its reasons and the next shard starts afresh. The report always prints
(human tables with rich progress on stderr, or one JSON object with `--json`); the exit status
is 1 only when no sample at all was readable.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter as Tally
from dataclasses import replace

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from dispatcher_server.cliopts import finite_float, redact, say
from pipeline.errors import DIGEST, ErrorStats, TooManyErrors
from pipeline.fieldmap import FieldMap
from pipeline.readahead import ReadAhead, stalled_error
from pipeline.reader import ReaderConfig, add_reader_arguments, iter_shard, reader_config_from_args
from pipeline.shards import expand_shards, reads_can_wait
from pipeline.tokenize import resolve_chat_template

_PERCENTILES = (50, 90, 99)
#: `--stall-timeout`'s default: a data node's (`read --stall-timeout`).
STALL_S = 300.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("shards", nargs="*", help="shard specs: paths, globs, {000..099} ranges, "
                                                  "pipe:/file: URLs, s3:// gs:// http(s):// URLs")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--estimate-text", action="store_true",
                        help="count text with the fast estimator instead of tokenizing it (quick; "
                             "the counts are approximate and the report says so)")
    parser.add_argument("--map", action="append", default=None, metavar="KIND=EXT[,EXT]",
                        help="field map: these extensions are KIND (image, audio, video, text, "
                             "conversation), as a dataset file's [sources.fields] would say; "
                             "repeatable; kinds not named keep their defaults")
    parser.add_argument("--stall-timeout", type=finite_float, default=STALL_S,
                        help="seconds a shard may read no byte (a pipe: command or server that "
                             "hangs) before inspect gives up on it, lists it as bad "
                             "(shard_stalled) and goes on with the next")
    add_reader_arguments(parser)


def field_map_from_args(specs: list[str] | None) -> FieldMap:
    """The FieldMap of `--map KIND=EXT[,EXT]` options (the default map without any)."""
    if not specs:
        return FieldMap()
    kinds: dict[str, list[str]] = {}
    for spec in specs:
        kind, sep, exts = spec.partition("=")
        if not sep:
            raise ValueError(f"--map {spec!r}: expected KIND=EXT[,EXT] (e.g. --map image=png,tif)")
        kinds.setdefault(kind.strip(), []).extend(e for e in exts.split(",") if e.strip())
    return FieldMap.from_dict(kinds)


def _summary(values: list[float] | np.ndarray) -> dict:
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        return {"count": 0}
    out = {"count": int(a.size), "mean": round(float(a.mean()), 3), "sum": float(a.sum())}
    for p, v in zip(_PERCENTILES, np.percentile(a, _PERCENTILES)):
        out[f"p{p}"] = round(float(v), 3)
    out["max"] = float(a.max())
    return out


def log_histogram(values: np.ndarray) -> list[dict]:
    """Counts in power-of-two buckets [2^k, 2^(k+1)) covering the values' range."""
    values = np.asarray(values, dtype=np.int64)
    if values.size == 0:
        return []
    exps = np.floor(np.log2(np.maximum(values, 1))).astype(np.int64)
    counts = np.bincount(exps - exps.min())
    return [
        {"lo": 2 ** int(k), "hi": 2 ** int(k + 1), "count": int(c)}
        for k, c in zip(range(int(exps.min()), int(exps.max()) + 1), counts)
    ]


def redacted(value):
    """`value` (a report: dicts, lists, strings) with every URL's password and signed-query
    values hidden (`cliopts.redact`): the report is printed and shared as the log lines are."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {redacted(k): redacted(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redacted(v) for v in value]
    return value


def _bad_shard(url: str, stats: ErrorStats, stopped: str | None) -> dict:
    first = stats.recent[0] if stats.recent else None
    return {"shard": url, "samples": stats.num_samples, "errors": stats.num_errors,
            "by_reason": dict(sorted(stats.by_reason.items())),
            "first_error": None if first is None else
            f"{first[0]}{f' (sample {first[2]!r})' if first[2] else ''}: {first[3]}",
            "stopped": stopped}


def text_counted_by(config: ReaderConfig) -> dict:
    """How text was counted: exact (the ids trainers receive) or the estimator's approximation."""
    t = config.counting.text
    if t.estimate:
        return {"exact": False, "how": "approximate (estimator; drop --estimate-text for the exact ids readers send)"}
    chosen = resolve_chat_template(t.chat_template, t.tokenizer_path)
    template = chosen.name + (f"; {chosen.tool_use.name} for samples with tools" if chosen.tool_use else "")
    return {"exact": True, "how": f"exact ({'tokenizer ' + t.tokenizer_path if t.tokenizer_path else 'byte-level ids'}, "
                                  f"chat template {template})"}


def records_of(url: str, config: ReaderConfig, stats: ErrorStats, stall_s: float):
    """The counted records of shard `url`, as `iter_shard` gives them. A shard whose reads can
    wait (`pipe:`, remote) is read by a thread, and given up as `shard_stalled` (the rest of it
    unread, counted in `stats`) once it reads no byte for `stall_s`."""
    if not reads_can_wait(url):
        yield from iter_shard(url, config, stats=stats)
        return
    ahead = ReadAhead(stall_s=stall_s, name="mmdispatch-inspect-read")
    ahead.start(iter_shard(url, config, stats=stats, on_skip=ahead.skip, on_open=ahead.watch))
    try:
        while not ahead.finished:
            entries = ahead.take(64, 0.2)
            if not entries and ahead.stalled():
                stats.handle(stalled_error(url, stall_s), config.errors)
                return
            yield from (e for e in entries if not isinstance(e, tuple))
    finally:
        ahead.close(wait_s=5.0)  # its thread touches `stats` no more once the next shard starts


def collect(urls: list[str], config: ReaderConfig, *, show_progress: bool,
            stall_s: float = STALL_S) -> dict:
    """Read every shard and return the statistics report as a JSON-ready dict."""
    stats = ErrorStats()
    bad_shards: list[dict] = []
    lens: dict[str, dict[str, list]] = {m: {"enc_len": [], "llm_len": []} for m in ("image", "video", "audio")}
    durations: list[float] = []
    text_lens: list[int] = []
    sample_lens: list[int] = []
    mixes: Tally = Tally()
    images_per_sample: Tally = Tally()
    start = time.perf_counter()
    progress = Progress(
        TextColumn("[bold]inspect"), BarColumn(), MofNCompleteColumn(), TextColumn("shards"),
        TextColumn("{task.fields[samples]} samples"), TimeElapsedColumn(),
        console=Console(stderr=True), transient=True, disable=not show_progress,
    )
    with progress:
        task = progress.add_task("read", total=len(urls), samples=0)
        for url in urls:
            shard = ErrorStats()
            stopped = None
            try:
                for rec in records_of(url, config, shard, stall_s):
                    for it in rec.items:
                        lens[it.modality]["enc_len"].append(it.enc_len)
                        lens[it.modality]["llm_len"].append(it.llm_len)
                        if it.modality == "audio":
                            durations.append(it.meta["duration_s"])
                    if rec.text_len:
                        text_lens.append(rec.text_len)
                    sample_lens.append(rec.llm_len)
                    mixes[rec.modality_mix] += 1
                    images_per_sample[sum(it.modality == "image" for it in rec.items)] += 1
            except TooManyErrors as e:
                stopped = str(e)
            stats.merge(shard)
            if shard.num_errors:
                bad_shards.append(_bad_shard(url, shard, stopped))
            progress.update(task, advance=1, samples=stats.num_samples)
    DIGEST.flush()
    elapsed = time.perf_counter() - start
    num_samples = len(sample_lens)
    modalities = {
        m: {"count": len(v["enc_len"]), "enc_len": _summary(v["enc_len"]), "llm_len": _summary(v["llm_len"])}
        for m, v in lens.items()
    }
    modalities["audio"]["duration_s"] = _summary(durations)
    modalities["text"] = {"count": len(text_lens), "llm_len": _summary(text_lens),
                          "counted_by": text_counted_by(config)}
    return redacted({
        "num_shards": len(urls),
        "num_samples": num_samples,
        "samples": {"llm_len": _summary(sample_lens)},
        "modalities": modalities,
        "mix": {k: round(v / max(1, num_samples), 4) for k, v in mixes.most_common()},
        "mix_counts": dict(mixes.most_common()),
        "images_per_sample": {str(k): v for k, v in sorted(images_per_sample.items())},
        "errors": stats.as_dict(),
        "bad_shards": bad_shards,
        "histogram": log_histogram(np.asarray(sample_lens)),
        "elapsed_s": round(elapsed, 3),
        "samples_per_s": round(num_samples / elapsed, 1) if elapsed > 0 else None,
    })


def format_ignored(counts: dict[str, int]) -> str:
    """"cls 90, npy 3" (most first; "(no suffix)" for members named without one), or "none"."""
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(f"{sfx or '(no suffix)'} {n}" for sfx, n in ranked) or "none"


def render(report: dict, console: Console) -> None:
    """Print the report as tables and a terminal histogram."""
    console.print(
        f"[bold]{report['num_samples']}[/] samples from {report['num_shards']} shards "
        f"in {report['elapsed_s']:.2f} s ({report['samples_per_s']} samples/s)"
    )
    table = Table(title="lengths per modality (tokens)")
    for col in ("modality", "length", "count", "p50", "p90", "p99", "max"):
        table.add_column(col, justify="left" if col in ("modality", "length") else "right")

    def row(name: str, what: str, s: dict) -> None:
        if s.get("count"):
            table.add_row(name, what, str(s["count"]), *(f"{s[k]:.0f}" for k in ("p50", "p90", "p99", "max")))

    for m in ("image", "video", "audio"):
        row(m, "encoder", report["modalities"][m]["enc_len"])
        row(m, "llm", report["modalities"][m]["llm_len"])
    text = report["modalities"]["text"]
    row("text" if text["counted_by"]["exact"] else "text (approx.)", "llm", text["llm_len"])
    row("sample", "llm total", report["samples"]["llm_len"])
    console.print(table)
    console.print(f"text tokens: {text['counted_by']['how']}")
    dur = report["modalities"]["audio"]["duration_s"]
    if dur.get("count"):
        console.print(f"audio duration s: p50 {dur['p50']:.1f}  p90 {dur['p90']:.1f}  p99 {dur['p99']:.1f}  max {dur['max']:.1f}")
    mix = Table(title="modality mix")
    mix.add_column("mix")
    mix.add_column("samples", justify="right")
    mix.add_column("share", justify="right")
    for name, count in report["mix_counts"].items():
        mix.add_row(escape(name), str(count), f"{report['mix'][name]:.1%}")
    console.print(mix)
    per = report["images_per_sample"]
    console.print("images per sample: " + ", ".join(f"{k}: {v}" for k, v in per.items()))
    errors = report["errors"]
    reasons = ", ".join(f"{k}={v}" for k, v in errors["by_reason"].items()) or "none"
    truncated = (f"; samples truncated to --max-seq-len: {errors['num_truncated']}"
                 if errors["num_truncated"] else "")
    console.print(escape(f"errors: {errors['num_errors']} ({reasons}); "
                         f"ignored members: {format_ignored(errors['ignored_members'])}{truncated}"),
                  highlight=False)
    if report["bad_shards"]:
        bad = Table(title="shards with errors")
        for col in ("shard", "samples read", "errors", "reasons", "first error"):
            bad.add_column(col, overflow="fold")
        for b in report["bad_shards"]:
            reasons = ", ".join(f"{k}={v}" for k, v in b["by_reason"].items())
            first = (b["first_error"] or "") + (" (stopped: too many in a row)" if b["stopped"] else "")
            # shard names and messages as written: `[...]` in them is no console markup
            bad.add_row(escape(b["shard"]), str(b["samples"]), str(b["errors"]), escape(reasons),
                        escape(first))
        console.print(bad)
    hist = report["histogram"]
    if hist:
        console.print("[bold]sample LLM length histogram[/] (log2 buckets)")
        peak = max(b["count"] for b in hist)
        width = 50
        for b in hist:
            bar = "█" * math.ceil(width * b["count"] / peak) if b["count"] else ""
            console.print(f"{b['lo']:>8}-{b['hi']:<8} {b['count']:>7} {bar}", highlight=False)


def run(args: argparse.Namespace) -> int:
    if not args.shards:
        raise ValueError("no shards to inspect: give shard specs (paths, globs, {000..099} ranges) "
                         "or a dataset file with --dataset FILE")
    urls = expand_shards(args.shards)
    config = replace(reader_config_from_args(args, keep_members=False),
                     fields=field_map_from_args(args.map))
    report = collect(urls, config, show_progress=sys.stderr.isatty(), stall_s=args.stall_timeout)
    if args.json:
        print(json.dumps(report))
    else:
        render(report, Console())
    if report["num_samples"] == 0:
        say(f"mmdispatch inspect: error: no readable sample in {len(urls)} shard(s); the "
            f"shards with errors above say why")  # JSON under --log-format json
        return 1
    return 0
