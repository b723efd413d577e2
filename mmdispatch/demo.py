"""Run the whole product locally: data, dispatcher, readers and torchrun trainers, then a report.

One command for a new user: generate a small synthetic dataset of three weighted sources
(captions, speech with transcripts, conversations with images and short clips; a dataset file
with their weights and field maps) and its BPE tokenizer (once; readers tokenize with it, the
trainers' vocabulary is its size), or take the dataset file or the shards `--data` holds
(never writing shards beside them), start the dispatcher on it, R readers and two
torchrun "nodes" of G ranks each training the reference model on real token ids, image and
video patches and log-mel frames with the in-model exchange, print one line per step, and
finish with the realized mixture, a summary table, a JSON report and a PNG figure. Every child
runs in its own process group, so Ctrl-C, SIGTERM or SIGHUP stops them all.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from dispatcher_server.cliopts import check_output_dir, finite_float
from mmdispatch import report
from mmdispatch.serve import read_ready
from trainer_client.options import DEFAULT_HIDDEN

#: Demo-sized counting rules: images capped at 448x448 pixels (<= 1024 patches), video frames
#: at 64*28*28 pixels and audio at 5 encoder frames/s, so the CPU reference model stays fast;
#: the trainers take the same rules (their model inputs must have exactly the counted lengths).
DEMO_READER_ARGS = ("--max-pixels", str(448 * 448), "--video-max-pixels", str(64 * 28 * 28),
                    "--audio-frames-per-s", "5", "--audio-tokens-per-s", "2.5")


#: what `--samples` and `--shards` generate where `--data` holds no dataset yet
DEFAULT_SAMPLES, DEFAULT_SHARDS = 512, 8

#: signals that stop the demo and every process it started (Ctrl-C, `kill`, a closed terminal)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", default="demo-data",
                        help="dataset directory: its dataset.toml, else the shards in it (one "
                             "source), else (missing or empty) a blend generated into it")
    parser.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, help="samples to generate")
    parser.add_argument("--shards", type=int, default=DEFAULT_SHARDS, help="shards to generate")
    parser.add_argument("--steps", type=int, default=24, help="training steps")
    parser.add_argument("--global-batch", type=int, default=32, help="samples per step")
    parser.add_argument("--microbatches", type=int, default=2, help="micro-batches per step per rank")
    parser.add_argument("--nodes", type=int, default=2, help="torchrun agents ('nodes')")
    parser.add_argument("--ranks-per-node", type=int, default=2, help="trainer processes per node")
    parser.add_argument("--readers", type=int, default=2, help="reader processes")
    parser.add_argument("--reports", default="reports", help="parent folder of the run's report folder")
    parser.add_argument("--seed", type=int, default=0, help="dataset and shard-order seed")
    parser.add_argument("--timeout", type=finite_float, default=900.0, help="give up after this many seconds")


class Children:
    """The processes this demo started; all are stopped together, whatever happens."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, cmd: list[str], **kw) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "wb")
        proc = subprocess.Popen(cmd, stdout=kw.pop("stdout", log), stderr=log, start_new_session=True, **kw)
        self.procs.append((name, proc))
        return proc

    def failed(self, prefixes: tuple[str, ...] = ("dispatcher", "trainer")) -> list[str]:
        """Children that exited non-zero; readers are left out because they outlive a
        finished dispatcher by design (they reconnect with backoff until stopped)."""
        return [f"{n} (exit {p.returncode}, see {self.logs / (n + '.log')})"
                for n, p in self.procs if n.startswith(prefixes) and p.poll() not in (None, 0)]

    def stop(self, grace_s: float = 5.0) -> None:
        # A second Ctrl-C or SIGTERM (a supervisor repeating itself) must not cut the cleanup
        # short: the children live in their own sessions and would be orphaned.
        previous = {s: signal.signal(s, signal.SIG_IGN) for s in STOP_SIGNALS}
        try:
            self._stop(grace_s)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _stop(self, grace_s: float) -> None:
        for _, p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for _, p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)


class Stopped(KeyboardInterrupt):
    """A stop signal arrived; a KeyboardInterrupt so that it unwinds as Ctrl-C does."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum: int, _frame) -> None:
    raise Stopped(signum)


def check_options(args: argparse.Namespace) -> None:
    """ValueError naming the first option out of range, before any data is generated: past
    that point a bad value shows only as a child that failed or a wait that never ends."""
    for flag, value, least, meaning in (
            ("--samples", args.samples, 1, "samples to generate"),
            ("--shards", args.shards, 1, "shards to generate"),
            ("--steps", args.steps, 1, "training steps"),
            ("--global-batch", args.global_batch, 1, "samples per step"),
            ("--microbatches", args.microbatches, 1, "micro-batches per step per rank"),
            ("--nodes", args.nodes, 1, "torchrun agents"),
            ("--ranks-per-node", args.ranks_per_node, 1, "trainer processes per node"),
            ("--readers", args.readers, 1, "reader processes; with none, no step is ever planned")):
        if value < least:
            raise ValueError(f"{flag} must be >= {least} ({meaning}), got {value}")
    if args.shards > args.samples:
        raise ValueError(f"--shards {args.shards} is more than --samples {args.samples}: every shard "
                         f"needs at least one sample")
    if args.microbatches > args.global_batch:
        raise ValueError(f"--microbatches {args.microbatches} is more than --global-batch "
                         f"{args.global_batch}: every rank would get empty micro-batches; lower it")
    if not 0 <= args.seed < 2**63:  # the generator's seed, and 64 bits in the dispatcher's fingerprint
        raise ValueError(f"--seed must be from 0 to 2**63 - 1, got {args.seed}")
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {args.timeout}")
    check_output_dir("--reports", args.reports)
    if not os.path.isdir(args.data):  # an existing one may be a read-only dataset, only read
        check_output_dir("--data", args.data)


def _free_port() -> int:
    """A free loopback port below the kernel's ephemeral range. One from bind(0) lies in that
    range, where every outgoing connection (dozens of ZeroMQ ones here) takes a port too, so it
    could be gone before the process meant to bind it did (torch's TCPStore then failed with
    EADDRINUSE); below it, only an explicit bind takes a port."""
    low = _ephemeral_low()
    for port in random.Random().sample(range(_LOW_PORT, low), min(64, max(0, low - _LOW_PORT))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # none free there: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: The lowest port `_free_port` picks: above the well-known and most registered services.
_LOW_PORT = 20000


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768 elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _read_new(path: Path, offset: int) -> tuple[list[dict], int]:
    if not path.exists():
        return [], offset
    with open(path, encoding="utf-8") as f:
        f.seek(offset)
        chunk = f.read()
    end = chunk.rfind("\n") + 1  # a half-written last line waits for the next poll
    return [json.loads(line) for line in chunk[:end].splitlines() if line.strip()], offset + end


def _step_line(plan: dict, train: dict) -> str:
    bal, rnd = plan["balanced"]["max_over_mean"], plan["random"]["max_over_mean"]
    phases = " ".join(f"{ph[0].upper()} {bal[ph]:.2f}/{rnd[ph]:.2f}" for ph in ("vision", "audio", "llm"))
    b = plan["balanced"]["bytes"]
    return (f"step {plan['step']:3d} | {train['samples_per_s']:6.1f} samples/s | plan {plan['plan_ms']:5.1f} ms | "
            f"max/mean balanced/random {phases} | predicted speedup {plan['predicted_speedup_vs_random']:.2f}x | "
            f"exchange MB intra {b['intra_node'] / 1e6:.2f} inter {b['inter_node'] / 1e6:.2f} | loss {train['loss']:.3f}")


def _inspect(shards: list[Path], reader_args: tuple[str, ...]) -> None:
    """The data node's view of the dataset, counted with the demo's rules (`mmdispatch inspect`)."""
    from rich.console import Console

    from pipeline import inspect
    from pipeline.reader import add_reader_arguments, reader_config_from_args

    parser = argparse.ArgumentParser()
    add_reader_arguments(parser)
    config = reader_config_from_args(parser.parse_args(list(reader_args)), keep_members=False)
    inspect.render(inspect.collect([str(s) for s in shards], config, show_progress=False), Console())


def _mixture_line(summary: dict, sources: list) -> str:
    """The realized share of each source beside its weight (a step log counts sources only for
    a blend: one source has every sample)."""
    if len(sources) == 1:
        return f"one source: {sources[0].name}, every sample"
    total = sum(s.weight for s in sources)
    got = summary.get("sources", {})
    return "realized mixture: " + ", ".join(
        f"{s.name} {got.get(s.name, {}).get('share', 0.0):.1%} (weight {s.weight / total:.1%})"
        for s in sources)


def _sizing_ignored(args: argparse.Namespace) -> str:
    """A note that --samples and --shards, set, are ignored: the demo generates no data."""
    if (args.samples, args.shards) == (DEFAULT_SAMPLES, DEFAULT_SHARDS):
        return ""
    return " (--samples and --shards size only data the demo generates)"


def choose_data(args: argparse.Namespace) -> tuple[list, list[str], bool]:
    """(sources, the dispatcher's flags naming them, whether --data is gen-data's directory):
    DATA/dataset.toml; else the shards in DATA, as one source (as `serve --shards DATA` reads
    them); else a blend generated into DATA, only where it is missing, empty or gen-data's own
    (ValueError otherwise): the demo never writes shards into a directory of the user's."""
    from dispatcher_server.config import Source
    from mmdispatch.dataset import load_dataset
    from pipeline.gendata import ForeignFiles, generate_blend, name_some, read_manifest
    from pipeline.shards import SHARD_SUFFIXES

    data = Path(args.data)
    dataset = data / "dataset.toml"
    ours = data.is_dir() and bool(read_manifest(str(data)))
    if dataset.exists():
        sources, _ = load_dataset(str(dataset))
        print(f"training on {dataset}: {len(sources)} sources{_sizing_ignored(args)}", flush=True)
        return sources, ["--dataset", str(dataset)], ours
    entries = sorted(data.iterdir()) if data.is_dir() else []
    shards = [str(p) for p in entries if p.name.endswith(SHARD_SUFFIXES) and p.is_file()]
    others = [p.name + "/" * p.is_dir() for p in entries if not p.name.startswith(".")]  # not .DS_Store
    if shards:
        print(f"training on the {len(shards)} shards in {data}/ as one source (no dataset.toml "
              f"there){_sizing_ignored(args)}", flush=True)
        return [Source(name=data.resolve().name, shards=shards)], ["--shards", str(data)], ours
    if others and not ours:
        raise ValueError(f"--data {str(data)!r} holds no dataset.toml and no shards, but other "
                         f"files ({name_some(others)}): pass a directory of shards, one with a "
                         "dataset.toml (docs/datasets.md), or a new or empty directory for the "
                         "demo to generate its data into")
    print(f"generating {args.samples} samples of 3 sources in {args.shards} shards into {data}/",
          flush=True)
    try:
        generate_blend(str(data), num_samples=args.samples, num_shards=args.shards, seed=args.seed)
    except ForeignFiles as e:  # gen-data's directory, with files of the user's added since
        raise ValueError(f"--data: {e}") from None
    return load_dataset(str(dataset))[0], ["--dataset", str(dataset)], True


def run(args: argparse.Namespace) -> int:
    from pipeline.gendata import write_tokenizer

    check_options(args)
    sources, data_flags, ours = choose_data(args)
    shards = [Path(u) for src in sources for u in src.shards]
    out = Path(args.reports) / time.strftime("demo-%Y%m%d-%H%M%S")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    tokenizer = Path(args.data) / "tokenizer.json"
    if not tokenizer.exists():
        # Beside the demo's own data it is kept for the next run; a user's directory is not
        # written to, so the run's folder gets it.
        tokenizer = Path(write_tokenizer(str(Path(args.data) if ours else out), [str(s) for s in shards]))
    reader_args = (*DEMO_READER_ARGS, "--tokenizer", str(tokenizer))
    _inspect(shards, reader_args)
    steps_log, train_log = out / "steps.jsonl", out / "train.jsonl"
    world = args.nodes * args.ranks_per_node
    kids = Children(out / "logs")
    # SIGINT raises KeyboardInterrupt already; the others would end this process and leave
    # the children (in their own sessions) running
    previous = {s: signal.signal(s, _raise_stopped) for s in STOP_SIGNALS[1:]}
    try:
        dispatcher = kids.start("dispatcher", [
            sys.executable, "-m", "mmdispatch.cli", "serve", *data_flags,
            "--world-size", str(world), "--ranks-per-node", str(args.ranks_per_node),
            "--global-batch", str(args.global_batch), "--num-microbatches", str(args.microbatches),
            "--seed", str(args.seed), "--max-epochs", "0", "--max-steps", str(args.steps), "--exit-when-done",
            "--journal-dir", str(out / "journal"), "--step-log", str(steps_log),
            # the reference model's encoder outputs, float32: the bytes the exchange moves
            "--exchange-bytes-per-token", str(DEFAULT_HIDDEN * 4)],
            stdout=subprocess.PIPE, text=True)
        try:
            endpoints = read_ready(dispatcher.stdout, timeout=60)
        except RuntimeError as e:
            raise ChildProcessError(f"{e}: {kids.failed()}") from None
        print(f"dispatcher: readers {endpoints['readers']}, trainers {endpoints['trainers']}", flush=True)
        for r in range(args.readers):
            kids.start(f"reader{r}", [sys.executable, "-m", "mmdispatch.cli", "read", "--dispatcher",
                                      endpoints["readers"], "--name", f"reader{r}", *reader_args])
        port = _free_port()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for node in range(args.nodes):
            kids.start(f"trainer-node{node}", [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", str(args.nodes),
                "--node-rank", str(node), "--nproc-per-node", str(args.ranks_per_node),
                "--master-addr", "127.0.0.1", "--master-port", str(port),
                "-m", "trainer_client.train", "--dispatcher", endpoints["trainers"],
                "--tokenizer", str(tokenizer), "--steps", str(args.steps),
                "--train-log", str(train_log), *DEMO_READER_ARGS], env=env)
        print(f"training {args.steps} steps on {args.nodes} nodes x {args.ranks_per_node} ranks "
              f"(logs in {out / 'logs'})", flush=True)
        _follow(kids, steps_log, train_log, args)
    except KeyboardInterrupt as e:
        signum = e.signum if isinstance(e, Stopped) else signal.SIGINT
        what = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
        print(f"\n{what}: stopping every process the demo started", file=sys.stderr)
        return 128 + signum
    finally:
        kids.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    records = report.load_step_log([p for p in (steps_log, train_log) if p.exists()])
    summary = report.summarize(records)
    summary["figure"] = str(report.render_figure(records, out / "demo.png"))
    (out / "report.json").write_text(json.dumps(summary, indent=2))
    report.print_table(summary)
    print(_mixture_line(summary, sources))
    print(f"report: {out}/report.json\nfigure: {summary['figure']}")
    return 0


def _follow(kids: Children, steps_log: Path, train_log: Path, args: argparse.Namespace) -> None:
    """Print a line per step as plan and train records arrive, until the trainers finish."""
    plans: dict[int, dict] = {}
    offsets = {steps_log: 0, train_log: 0}
    printed = 0
    deadline = time.monotonic() + args.timeout
    trainers = [p for n, p in kids.procs if n.startswith("trainer")]
    finished = False
    while not finished:
        finished = all(p.poll() == 0 for p in trainers)  # then read once more, to the end
        for path in (steps_log, train_log):
            recs, offsets[path] = _read_new(path, offsets[path])
            for rec in recs:
                if rec["kind"] == "plan":
                    plans[rec["step"]] = rec
                elif rec["kind"] == "train" and rec["step"] in plans:
                    print(_step_line(plans[rec["step"]], rec), flush=True)
                    printed += 1
        if kids.failed():
            raise ChildProcessError("a demo process failed: " + "; ".join(kids.failed()))
        if time.monotonic() > deadline:
            raise TimeoutError(f"demo did not finish within {args.timeout} s ({printed} steps done)")
        time.sleep(0.2)
