"""Feeding benchmark: how long the reference training loop waits for its next micro-batch, with
model inputs prepared by the prefetch pool and inside the loop, and what each `--preprocess-on`
choice costs on the wire.

The demo's data (`gen-data --blend`: captions, speech, and conversations with images and short
MP4 clips, three weighted sources in a dataset file, with its BPE tokenizer; counted with the
demo's rules) is served by a real `mmdispatch serve --dataset` and `mmdispatch read` to one
`python -m trainer_client.train` process (world size 1, gloo), each a process on 127.0.0.1, four times in the same bench: readers shipping
member bytes (`--preprocess-on trainer`) to a trainer with its prefetch pool of threads, with
preprocessing inside the loop (`--preprocess-workers 0`, what the loop did before the pool), and
with a pool of processes; then readers shipping model inputs (`--preprocess-on datanode`) to a
trainer whose pool only wraps them.
`data_wait_fraction` is, over the trainer's steps after the first `--warmup-steps`, the time
the loop spent waiting for its next step (`data_wait_s` of the train log) over the loop's time
(wait plus the step's own seconds).

`loop_s_per_step_*` are the loop's seconds per step (wait included) of each run: on a machine
with no spare core, the pool's workers take CPU from the training step itself.

`mixture_max_abs_err` is `bench.mixture`'s: over every window of 10,000 consecutive samples of
a served three-source blend (200,000 samples through the dispatcher's assembler), the largest
difference between a source's share and its weight.

`bytes_per_sample` is the payload a reader ships per sample, over the whole generated dataset:
the members' bytes (`trainer`) or the float16 model inputs (`datanode`). `pool_items_per_s_*`
time preprocessing (up to 96 of) the dataset's items alone: in one thread, and with the pool's
workers as threads or as processes (payloads pickled to them, arrays back). On 2 cores threads
preprocessed faster than processes (1.2-1.9x) or within noise of them in every run, so they
are the pool's default kind; the loop's step times with either pool differed by less than the
shared machine's noise.

    python -m bench.feed [--json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

from mmdispatch.demo import DEMO_READER_ARGS, _free_port
from mmdispatch.serve import read_ready

TARGETS = {"data_wait_fraction": 0.05, "mixture_max_abs_err": 0.02}


def bench_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.feed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="a small run for tests: a few steps, its four runs side by side (checks the plumbing, not the figures)")
    ap.add_argument("--samples", type=int, default=192, help="samples generated")
    ap.add_argument("--steps", type=int, default=10, help="training steps per run")
    ap.add_argument("--warmup-steps", type=int, default=2, help="first steps left out of the fraction")
    ap.add_argument("--global-batch", type=int, default=16, help="samples per step")
    ap.add_argument("--microbatches", type=int, default=2, help="micro-batches per step")
    ap.add_argument("--workers", type=int, default=2, help="the pool's --preprocess-workers")
    ap.add_argument("--ahead", type=int, default=4, help="the pool's --preprocess-ahead")
    ap.add_argument("--hidden", type=int, default=32, help="reference model hidden size")
    ap.add_argument("--repeats", type=int, default=2, help="rounds of the pool-kind comparison (best counts)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mixture-samples", type=int, default=200_000,
                    help="samples of the served blend whose mixture is measured")
    ap.add_argument("--timeout", type=float, default=120.0, help="longest run of one trainer, seconds")
    args = ap.parse_args(argv)
    if args.quick:
        args.samples, args.steps, args.warmup_steps, args.global_batch, args.repeats = 24, 3, 1, 8, 1
        args.mixture_samples = 20_000
    for name in ("samples", "steps", "global_batch", "microbatches", "workers", "ahead", "hidden", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.warmup_steps < args.steps:
        ap.error(f"--warmup-steps must be in [0, --steps={args.steps}), got {args.warmup_steps}")
    return args


def _counting():
    from pipeline.reader import add_reader_arguments, reader_config_from_args

    parser = argparse.ArgumentParser()
    add_reader_arguments(parser)
    return reader_config_from_args(parser.parse_args(list(DEMO_READER_ARGS))).counting


def _items(shards: list[str]) -> list[tuple]:
    """(modality, member bytes, meta, enc_len, key, member) of every item, with samples' count."""
    from pipeline.reader import ReaderConfig, iter_samples

    out = []
    for rec in iter_samples(shards, ReaderConfig(counting=_counting())):
        for it in rec.items:
            out.append((it.modality, bytes(rec.members[it.member]), dict(it.meta), it.enc_len, rec.key, it.member))
    return out


def bytes_per_sample(shards: list[str]) -> dict[str, float]:
    """Payload bytes a reader ships per sample, members as read and preprocessed."""
    from pipeline.preprocess import PreprocessConfig, preprocess_record
    from pipeline.reader import ReaderConfig, iter_samples

    counting = _counting()
    config = PreprocessConfig.of(counting)
    raw = tensor = samples = 0
    for rec in iter_samples(shards, ReaderConfig(counting=counting)):
        samples += 1
        raw += sum(memoryview(rec.members[it.member]).nbytes for it in rec.items)
        preprocess_record(rec, config)
        tensor += sum(memoryview(rec.members[it.member]).nbytes for it in rec.items)
    return {"trainer": round(raw / samples, 1), "datanode": round(tensor / samples, 1)}


def pool_rates(items: list[tuple], workers: int, repeats: int) -> dict[str, float]:
    """Items per second preprocessed in this thread, by `workers` threads and by `workers`
    processes: the best of `repeats` rounds that alternate the three (a shared machine's noise
    then spoils one round, not one kind)."""
    import multiprocessing
    from concurrent.futures import Future

    from pipeline.preprocess import PreprocessConfig
    from trainer_client.prefetch import prepare_item

    counting = _counting()
    config = PreprocessConfig.of(counting)

    def inline(fn, *a, **kw):
        f: Future = Future()
        f.set_result(fn(*a, **kw))
        return f

    def rate(submit, todo=items) -> float:
        t0 = time.perf_counter()
        futures = [submit(prepare_item, m, data, meta, config, enc_len=n, key=k, member=mem)
                   for m, data, meta, n, k, mem in todo]
        [f.result() for f in futures]
        return len(todo) / (time.perf_counter() - t0)

    best = dict.fromkeys(("inloop", "thread", "process"), 0.0)
    with ThreadPoolExecutor(workers) as threads, \
            ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("forkserver")) as procs:
        rate(procs.submit, items[:workers])  # workers start outside the timing
        for _ in range(repeats):
            for kind, submit in (("inloop", inline), ("thread", threads.submit), ("process", procs.submit)):
                best[kind] = max(best[kind], rate(submit))
    return {k: round(v, 1) for k, v in best.items()}


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "mmdispatch.cli", *args]


def run_trainer(data: tuple[str, str], args: argparse.Namespace, *, where: str, workers: int,
                tmp: str, kind: str = "thread") -> dict:
    """One serve + read + train run; the trainer's wait and step times after the warm-up."""
    name = f"{where}-{kind if workers else 'inloop'}"
    dataset, tokenizer = data
    log = os.path.join(tmp, f"{name}.train.jsonl")
    procs: list[subprocess.Popen] = []
    errs = {n: open(os.path.join(tmp, f"{name}.{n}.log"), "wb") for n in ("serve", "read", "train")}
    try:
        # fixed ports, so the three processes start (and import) side by side
        ends = {"readers": f"tcp://127.0.0.1:{_free_port()}", "trainers": f"tcp://127.0.0.1:{_free_port()}"}
        serve = subprocess.Popen(_cli(
            "serve", "--dataset", dataset, "--world-size", "1", "--global-batch", str(args.global_batch),
            "--num-microbatches", str(args.microbatches), "--max-epochs", "0",
            "--max-steps", str(args.steps), "--exit-when-done", "--seed", str(args.seed),
            "--reader-bind", ends["readers"], "--trainer-bind", ends["trainers"]),
            stdout=subprocess.PIPE, stderr=errs["serve"], text=True)
        procs.append(serve)
        procs.append(subprocess.Popen(_cli("read", "--dispatcher", ends["readers"], "--preprocess-on", where,
                                           "--tokenizer", tokenizer, *DEMO_READER_ARGS), stdout=subprocess.DEVNULL, stderr=errs["read"]))
        env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1"}
        train = subprocess.Popen(
            [sys.executable, "-m", "trainer_client.train", "--dispatcher", ends["trainers"],
             "--steps", str(args.steps), "--train-log", log, "--commit-every", "0", "--progress-every", "0",
             "--hidden", str(args.hidden), "--preprocess-workers", str(workers), "--preprocess-pool", kind,
             "--preprocess-ahead", str(args.ahead), "--tokenizer", tokenizer, *DEMO_READER_ARGS],
            env=env, stdout=subprocess.DEVNULL, stderr=errs["train"])
        procs.append(train)
        read_ready(serve.stdout, timeout=60)
        if train.wait(args.timeout) != 0:
            raise RuntimeError(f"trainer of run {name} exited {train.returncode}: see {errs['train'].name}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        for f in errs.values():
            f.close()
    with open(log, encoding="utf-8") as f:
        recs = [json.loads(line) for line in f if line.strip()]
    if len(recs) < args.steps:
        raise RuntimeError(f"run {name}: the trainer logged {len(recs)} of {args.steps} steps")
    timed = recs[args.warmup_steps:]
    wait = sum(r["data_wait_s"] for r in timed)
    busy = sum(r["seconds"] for r in timed)
    return {"data_wait_fraction": round(wait / (wait + busy), 4), "loop_s": round(wait + busy, 3),
            "wait_s": round(wait, 3), "steps": len(timed)}


def run(args: argparse.Namespace, progress=None) -> dict:
    from bench.mixture import max_abs_err, realized_sources
    from pipeline.gendata import generate_blend, write_tokenizer

    say = progress or (lambda line: None)
    t_say = time.perf_counter()
    say0 = say
    say = lambda line: say0(f"[{time.perf_counter() - t_say:5.1f} s] {line}")  # noqa: E731
    t_start = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="bench-feed-")
    data_dir = os.path.join(tmp, "data")
    dataset, shards = generate_blend(data_dir, num_samples=args.samples,
                                     num_shards=max(3, min(6, args.samples // 16)), seed=args.seed)
    data = (dataset, write_tokenizer(data_dir, shards))
    say(f"generated {args.samples} samples of 3 sources")
    sources, weights = realized_sources(args.mixture_samples)
    mixture = max_abs_err(sources, weights, min(10_000, args.mixture_samples // 4))
    say(f"mixture max abs err {mixture:.5f}")
    sizes = bytes_per_sample(shards)
    say(f"bytes per sample {sizes}")
    items = _items(shards)
    rates = pool_rates(items[:96], args.workers, args.repeats)
    say(f"items/s {rates}")
    # datanode in the loop is left out: with tensors shipped, the pool only wraps them
    configs = (("trainer", args.workers, "thread"), ("trainer", 0, "thread"),
               ("trainer", args.workers, "process"), ("datanode", args.workers, "thread"))

    def one(config: tuple[str, int, str]) -> tuple[str, dict]:
        where, workers, kind = config
        key = f"{where}/{kind if workers else 'inloop'}"
        got = run_trainer(data, args, where=where, workers=workers, tmp=tmp, kind=kind)
        say(f"{key}: {got}")
        return key, got

    # --quick checks the plumbing, not the figures: its runs go side by side (each is mostly
    # process start-up), sharing the cores; a full run times each alone.
    with ThreadPoolExecutor(len(configs) if args.quick else 1) as pool:
        runs = dict(pool.map(one, configs))
    res = {
        "data_wait_fraction": runs["trainer/thread"]["data_wait_fraction"],
        "data_wait_fraction_inloop": runs["trainer/inloop"]["data_wait_fraction"],
        "data_wait_fraction_process_pool": runs["trainer/process"]["data_wait_fraction"],
        "data_wait_fraction_datanode": runs["datanode/thread"]["data_wait_fraction"],
        "mixture_max_abs_err": round(mixture, 6),
        "bytes_per_sample": sizes,
        "pool_items_per_s_inloop": rates["inloop"],
        "pool_items_per_s_thread": rates["thread"],
        "pool_items_per_s_process": rates["process"],
        **{f"loop_s_per_step_{name}": round(runs[f"trainer/{kind}"]["loop_s"] / runs[f"trainer/{kind}"]["steps"], 4)
           for name, kind in (("pool", "thread"), ("inloop", "inloop"), ("process_pool", "process"))},
        "loop_s_per_step_datanode": round(runs["datanode/thread"]["loop_s"] / runs["datanode/thread"]["steps"], 4),
        "items": len(items),
        "config": (f"{args.samples} gen-data --blend samples counted with the demo's rules ({' '.join(DEMO_READER_ARGS)}); "
                   f"1 reader, world size 1, global batch {args.global_batch}, {args.microbatches} "
                   f"micro-batches, {args.steps} steps ({args.warmup_steps} warm-up), pool of "
                   f"{args.workers} threads {args.ahead} micro-batches ahead, reference model hidden "
                   f"{args.hidden}; {os.cpu_count()} CPUs"),
        "bench_wall_s": round(time.perf_counter() - t_start, 1),
    }
    res["targets"] = {
        "data_wait_fraction<=0.05": res["data_wait_fraction"] <= TARGETS["data_wait_fraction"],
        "data_wait_fraction_datanode<=0.05": (res["data_wait_fraction_datanode"]
                                              <= TARGETS["data_wait_fraction"]),
        "mixture_max_abs_err<=0.02": res["mixture_max_abs_err"] <= TARGETS["mixture_max_abs_err"]}
    return res


def main(argv: list[str] | None = None) -> int:
    args = bench_args(argv)
    res = run(args, lambda line: print(f"  {line}", file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
