"""Measure each phase of your model on this device and write a cost file for `serve --cost-model`.

Runs the vision encoder, audio encoder and LLM of a `trainer_client.model.MultimodalModel`
(the reference model sized by the flags, or yours with --model module:factory) forward and
backward over a grid of runs of mixed item lengths, fits `a*l + b*l^2 + c` seconds per item
for every phase, prints the fit (R^2, worst relative error) and writes the cost file.
Set the length ranges to your data's (`mmdispatch inspect SHARDS --json` shows them).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys

from dispatcher_server.cliopts import check_output_file
from dispatcher_server.costfile import save_cost_file
from dispatcher_server.planner.types import PHASES

#: phase -> default (min, max) item length of the grid: the ranges `make demo` produces
#: (images up to 448x448 pixels at 14-pixel patches, clips up to 600 s at 5 frames/s).
DEFAULT_LENGTHS = {"vision": (16, 1024), "audio": (2, 3000), "llm": (16, 4096)}


def _length_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not MIN:MAX (two integers)") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= MIN <= MAX")
    return lo, hi


def _window(text: str) -> tuple[str, int | str | None]:
    phase, sep, value = text.partition("=")
    if not sep or phase not in PHASES:
        raise argparse.ArgumentTypeError(f"{text!r} is not PHASE=auto|none|N with PHASE in {list(PHASES)}")
    if value in ("auto", "none"):
        return phase, None if value == "none" else "auto"
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the window is auto, none or an integer >= 1")
    return phase, n


def add_arguments(parser: argparse.ArgumentParser) -> None:
    m = parser.add_argument_group("model")
    m.add_argument("--model", default=None, metavar="MODULE:FACTORY",
                   help="your model: FACTORY() in MODULE returns a MultimodalModel (default: the "
                        "reference model sized by the flags below)")
    m.add_argument("--hidden", type=int, default=64, help="reference model: hidden size of every tower")
    m.add_argument("--encoder-layers", type=int, default=1, help="reference model: vision and audio encoder layers")
    m.add_argument("--llm-layers", type=int, default=2, help="reference model: LLM layers")
    m.add_argument("--heads", type=int, default=1, help="reference model: attention heads of every tower")
    m.add_argument("--vocab-size", type=int, default=512, help="reference model: vocabulary size")
    m.add_argument("--patch-size", type=int, default=14, help="reference model: image patch side in pixels")
    m.add_argument("--merge", type=int, default=2, help="patches merged per side into one LLM token")
    m.add_argument("--frame-dim", type=int, default=64, help="features per audio frame")
    m.add_argument("--patch-dim", type=int, default=None,
                   help="your model: features per vision patch (default: read from model.config)")
    m.add_argument("--audio-frames-per-token", type=int, default=2, help="audio frames pooled into one LLM token")
    g = parser.add_argument_group("measurement")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the phases run")
    g.add_argument("--threads", type=int, default=1, help="torch CPU threads (pinned: timings depend on it)")
    g.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="CPU timing: wall (perf_counter) on a machine of your own; cpu (this process's CPU "
                        "time, with --threads 1) on a machine shared with other work")
    for phase, (lo, hi) in DEFAULT_LENGTHS.items():
        unit = {"vision": "patches", "audio": "frames", "llm": "tokens"}[phase]
        g.add_argument(f"--{phase}-lengths", type=_length_range, default=(lo, hi), metavar="MIN:MAX",
                       help=f"{phase} item lengths to measure, in {unit} (default: {lo}:{hi})")
    g.add_argument("--runs", type=int, default=32, help="runs per phase, at least 4")
    g.add_argument("--max-items", type=int, default=8, help="most items in one run, at least 2")
    g.add_argument("--repeats", type=int, default=3, help="timed repeats per run (the fastest counts)")
    g.add_argument("--warmup", type=int, default=1, help="untimed calls before each timed one")
    g.add_argument("--window", type=_window, action="append", default=[], metavar="PHASE=auto|none|N",
                   help="padded-window rule per phase, repeatable (default: audio=auto): auto keeps "
                        "the default model's window (audio: 1500 frames) only if the timings fit it "
                        "better; none; or N frames (audio) or patches (vision) per window")
    g.add_argument("--seed", type=int, default=0, help="seed of the grid and the inputs")
    o = parser.add_argument_group("output")
    o.add_argument("--out", default="cost-model.json", help="cost file to write (for serve --cost-model)")
    o.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def load_model(spec: str):
    """FACTORY() from MODULE for a 'MODULE:FACTORY' string; ValueError naming what is wrong."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--model {spec!r} is not MODULE:FACTORY (e.g. mypkg.models:build)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"--model {spec!r}: cannot import {module_name!r} ({e}); is it on PYTHONPATH?") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"--model {spec!r}: {module_name} has no callable {attr!r}")
    try:
        return factory()
    except Exception as e:  # noqa: BLE001 - the user's code: said in one line, as its other mistakes
        raise ValueError(f"--model {spec!r}: {attr}() raised {type(e).__name__}: {e} (call it "
                         f"in Python to see where)") from None


def build(args: argparse.Namespace):
    """(model on its device, input spec) for the arguments."""
    import torch

    from trainer_client.calibrate import InputSpec
    from trainer_client.model import (
        AudioConfig, LLMConfig, ModelConfig, MultimodalModel, ReferenceModel, VisionConfig,
    )

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device here; use --device cpu")
    torch.manual_seed(args.seed)
    if args.model is None:
        model = ReferenceModel(ModelConfig(
            vision=VisionConfig(patch_size=args.patch_size, hidden=args.hidden, num_layers=args.encoder_layers,
                                num_heads=args.heads, merge=args.merge),
            audio=AudioConfig(frame_dim=args.frame_dim, hidden=args.hidden, num_layers=args.encoder_layers,
                              num_heads=args.heads),
            llm=LLMConfig(vocab_size=args.vocab_size, hidden=args.hidden, num_layers=args.llm_layers,
                          num_heads=args.heads),
        ))
    else:
        model = load_model(args.model)
        if not isinstance(model, MultimodalModel):
            raise ValueError(f"--model {args.model!r} returned a {type(model).__name__}, which lacks the "
                             "MultimodalModel methods (encode_vision, encode_audio, embed_text, llm)")
    found = InputSpec.of(model)
    patch_dim = args.patch_dim or (found.patch_dim if found else None)
    if patch_dim is None:
        raise ValueError("--patch-dim is required: the model has no config.vision to read it from")
    spec = InputSpec(patch_dim=patch_dim, merge=found.merge if found and args.model else args.merge,
                     frame_dim=found.frame_dim if found and args.model else args.frame_dim,
                     audio_frames_per_token=args.audio_frames_per_token)
    if hasattr(model, "to"):
        model = model.to(args.device)
    if hasattr(model, "train"):
        model.train()
    return model, spec


def grids(args: argparse.Namespace):
    """Per phase, the `GridConfig` the arguments ask for."""
    from trainer_client.calibrate import GridConfig

    return {p: GridConfig(min_len=getattr(args, f"{p}_lengths")[0], max_len=getattr(args, f"{p}_lengths")[1],
                          num_runs=args.runs, max_items=args.max_items) for p in PHASES}


def check_clock(args: argparse.Namespace) -> None:
    if args.clock == "cpu" and args.threads != 1 and args.device == "cpu":
        raise ValueError(f"--clock cpu needs --threads 1 (CPU time of {args.threads} threads is not "
                         "their wall time)")


def metadata(args: argparse.Namespace, cal, threads: int) -> dict:
    """What a cost file records about how it was measured."""
    import torch

    return {
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
        "timer": "cuda events" if args.device == "cuda" else
                 f"{'perf_counter' if args.clock == 'wall' else 'process_time'}, {threads} torch thread(s)",
        "torch": torch.__version__,
        "model": args.model or (f"ReferenceModel(hidden={args.hidden}, encoder_layers={args.encoder_layers}, "
                                f"llm_layers={args.llm_layers}, heads={args.heads}, vocab={args.vocab_size}, "
                                f"patch={args.patch_size}, merge={args.merge}, frame_dim={args.frame_dim})"),
        "grid": {p: {"min_len": g.min_len, "max_len": g.max_len, "runs": g.num_runs,
                     "max_items": g.max_items} for p, g in grids(args).items()},
        "repeats": args.repeats, "warmup": args.warmup, "fit": cal.summary(),
        "measurements": {p: {"lengths": cal.runs[p], "seconds": cal.times[p]} for p in cal.runs},
    }


def measure_and_fit(args: argparse.Namespace, progress=None):
    """Calibrate the model the arguments describe; returns (Calibration, metadata)."""
    from trainer_client.calibrate import calibrate, model_measure, pin_threads

    check_clock(args)
    threads = pin_threads(args.device, args.threads)
    model, spec = build(args)
    cal = calibrate(model_measure(model, spec, args.device, warmup=args.warmup, seed=args.seed,
                                  clock=args.clock), grids(args),
                    multiples={p: spec.multiple(p) for p in PHASES}, windows=dict(args.window),
                    repeats=args.repeats, seed=args.seed, progress=progress)
    return cal, metadata(args, cal, threads)


def _table(cal) -> str:
    lines = [f"{'phase':<7} {'a (s/token)':>12} {'b (s/token^2)':>14} {'c (s/item)':>11} {'window':>7} "
             f"{'R^2':>7} {'worst err':>10} {'runs':>5}"]
    for p, f in cal.fits.items():
        pc = cal.cost.phase(p)
        lines.append(f"{p:<7} {pc.a:>12.3e} {pc.b:>14.3e} {pc.c:>11.3e} {str(pc.window or '-'):>7} "
                     f"{f.r2:>7.4f} {100 * f.worst_rel_error:>9.1f}% {f.num_runs:>5}")
    return "\n".join(lines)


def check_options(args: argparse.Namespace) -> None:
    """ValueError naming the first flag out of range or an --out that cannot be written: said
    at start, not after minutes of measuring."""
    from trainer_client.calibrate import MIN_ITEMS_PER_RUN, MIN_RUNS

    for name, least, meaning in (
            ("runs", MIN_RUNS, "runs per phase: the fit needs several"),
            ("max_items", MIN_ITEMS_PER_RUN, "several items per run make the per-item cost identifiable"),
            ("repeats", 1, "timed repeats per run"), ("threads", 1, "torch CPU threads"),
            ("hidden", 1, "hidden size")):
        if getattr(args, name) < least:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {least} ({meaning}), got "
                             f"{getattr(args, name)}")
    check_output_file("--out", args.out)


def warn_poor_fits(args: argparse.Namespace, cal) -> dict[str, float]:
    """One warning line per phase whose fit explains too little of its timings (R^2 below
    POOR_FIT_R2): the cost file is written all the same (the measurements are in it), but
    steps planned by it balance a poor estimate."""
    from dispatcher_server.metrics import event
    from trainer_client.calibrate import POOR_FIT_R2

    poor = cal.poor_fits()
    quiet = ("with --clock cpu --threads 1 (CPU time, which other processes do not inflate)"
             if args.device == "cpu" and args.clock == "wall" else "on a device no other job shares")
    for phase, r2 in poor.items():
        lo, hi = getattr(args, f"{phase}_lengths")
        event("calibration_poor_fit", logging.WARNING, phase=phase, r2=f"{r2:.3f}",
              least=POOR_FIT_R2, out=args.out,
              fix=f"the fit explains too little of the {phase} timings to plan by: measure "
                  f"{quiet}, with more --repeats (now {args.repeats}) and --runs (now "
                  f"{args.runs}), and --{phase}-lengths ({lo}:{hi} now) no wider than your "
                  "data holds, then run calibrate again")
    return poor


def run(args: argparse.Namespace) -> int:
    check_options(args)
    progress = None if args.json else (lambda line: print(f"  {line}", file=sys.stderr, flush=True))
    cal, meta = measure_and_fit(args, progress)
    save_cost_file(args.out, cal.cost, meta)
    poor = warn_poor_fits(args, cal)
    if args.json:
        print(json.dumps({"out": args.out, "units": "seconds", "poor_fits": poor,
                          **{k: v for k, v in meta.items() if k != "measurements"}}))
    else:
        print(_table(cal))
        print(f"wrote {args.out} (seconds per item on {meta['device']}, {meta['timer']}); "
              f"use it with: mmdispatch serve --cost-model {args.out} ...")
    return 0
