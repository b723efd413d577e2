"""How closely a served blend follows its weights: `python -m bench.mixture --json`.

Drives the dispatcher's step assembler (the code that decides the global sample sequence)
with three sources of uneven shard sizes, some shards empty, delivered in random chunks as
readers would, shuffle on, for `--samples` samples; then measures, over every window of
`--window` consecutive samples of the realized sequence, the largest absolute difference
between a source's share and its weight (`mixture_max_abs_err`).
"""

from __future__ import annotations

import argparse
import json
import random
import time

import numpy as np

from dispatcher_server import protocol as P
from dispatcher_server.assembler import StepAssembler
from dispatcher_server.config import BatchConfig, ServerConfig, Source
from dispatcher_server.ordering import ShardOrder
from dispatcher_server.planner import PlannerConfig

#: Relative weights (normalized by the config); not round shares, so windows are not whole periods.
WEIGHTS = {"captions": 5.0, "speech": 3.0, "chat": 1.3}


def realized_sources(samples: int, *, seed: int = 0, shuffle: int = 1000,
                     global_batch: int = 256) -> tuple[list[int], list[float]]:
    """The source index of every sample of the served sequence, and the weights."""
    rng = random.Random(seed)
    names = list(WEIGHTS)
    shards = {n: {f"/{n}/{i}.tar": rng.choice([0, 40, 150, 400, 1200]) for i in range(24)}
              for n in names}
    config = ServerConfig(sources=[Source(name=n, shards=list(shards[n]), weight=WEIGHTS[n])
                                   for n in names],
                          world_size=1, batch=BatchConfig(global_batch=global_batch),
                          planner=PlannerConfig(num_microbatches=1), shuffle_buffer=shuffle,
                          seed=seed, max_epochs=None)
    orders = [ShardOrder(list(shards[n]), seed, None, salt=n) for n in names]
    a = StepAssembler(orders, mode="deterministic", batch=config.batch, names=names,
                      weights=config.weights, windows=config.windows,
                      block_sizes=config.block_sizes, seed=seed)
    sizes = {url: n for src in shards.values() for url, n in src.items()}
    out: list[int] = []
    while len(out) < samples:
        a.open_window()
        a.fill()
        while a.step_ready():
            out.extend(s.pos % len(names) for s in a.take_step().samples)
            a.fill()
        open_ = [p for p, pr in a.progress.items() if not pr.reader_done]
        if not open_:
            continue
        pos = rng.choice(open_)
        prog = a.progress[pos]
        start, n = prog.next_index, sizes[prog.url]
        chunk = range(start, min(n, start + rng.randint(1, 64)))
        a.receive(pos, [P.SampleHeader(f"k{pos}-{i}", i, 5, 5, b"", []) for i in chunk], [], [])
        if chunk.stop >= n:
            a.reader_done(pos)
    return out[:samples], config.weights


def max_abs_err(sources: list[int], weights: list[float], window: int) -> float:
    """Largest |share - weight| of any source over every window of `window` consecutive samples."""
    seq = np.asarray(sources)
    worst = 0.0
    for s, w in enumerate(weights):
        c = np.concatenate([[0], np.cumsum(seq == s)])
        shares = (c[window:] - c[:-window]) / window
        worst = max(worst, float(np.max(np.abs(shares - w))))
    return worst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=200_000)
    p.add_argument("--window", type=int, default=10_000)
    p.add_argument("--shuffle-buffer", type=int, default=1000)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    seq, weights = realized_sources(a.samples, shuffle=a.shuffle_buffer)
    out = {"samples": len(seq), "window": a.window, "weights": dict(zip(WEIGHTS, weights)),
           "mixture_max_abs_err": max_abs_err(seq, weights, a.window),
           "realized": {n: seq.count(i) / len(seq) for i, n in enumerate(WEIGHTS)},
           "seconds": time.perf_counter() - t0}
    print(json.dumps(out) if a.json else json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
