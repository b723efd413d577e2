"""Planner benchmark: mmdispatch's plan_step against the known baselines, W = 8 .. 2560, and
small worlds (W = 4 .. 16, the streaming shape).

Synthetic steps from a seeded long-tailed multimodal mixture; every method plans the same steps.
Ratios (max/LB, step time vs random, bytes vs per_phase_lpt) come from one run; plan times are
medians on one core, noisy on a shared machine. `python -m bench.planner [--json] [--quick]`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # plan time is measured on one core

import numpy as np  # noqa: E402

from bench.machine import cpu_reference_ms  # noqa: E402
from bench.regimes import REGIMES, regime_step  # noqa: E402
from dispatcher_server.planner import (  # noqa: E402
    BASELINES, DEFAULT_LLM_CAPACITY_FACTOR, ENCODER_PHASES, PHASES, EncoderItems, PlannerConfig,
    StepInputs, Topology,
    best_lower_bound, plan_step, validate,
)
from dispatcher_server.planner.exact import solve_exact  # noqa: E402

PATCHES_PER_TOKEN = 4  # 2x2 patch merge (Qwen2-VL)
FRAMES_PER_SECOND = 50  # Whisper encoder frames after its stride-2 conv
AUDIO_FRAMES_PER_TOKEN = 2  # pooled to 25 tokens/s (Qwen2-Audio)
MAX_PATCHES = 16384  # max_pixels 12.8 MP at 28x28 pixels per merged token


def synthetic_step(rng: np.random.Generator, num_samples: int,
                   max_patches: int = MAX_PATCHES) -> StepInputs:
    """One step's counts from a long-tailed mixture: 45% text-only, 40% images (1-8 per sample,
    0.5% at the `max_patches` maximum), 9% audio (2% of clips 1-10 minutes), 6% image+audio."""
    S = num_samples
    u = rng.random(S)
    has_img = (u >= 0.45) & (u < 0.85) | (u >= 0.94)
    has_aud = u >= 0.85
    text = np.where(
        has_img | has_aud,
        rng.lognormal(np.log(120), 1.0, S),
        rng.lognormal(np.log(500), 1.1, S),
    )
    text_len = np.clip(text, 4, 16384).astype(np.int64)
    # images per sample: mostly one, some multi-image documents
    per_sample = rng.choice([1, 2, 3, 4, 6, 8], S, p=[0.75, 0.1, 0.06, 0.05, 0.02, 0.02])
    k = np.where(has_img, per_sample, 0)
    vs = np.repeat(np.arange(S), k)
    patches = rng.lognormal(np.log(900), 0.8, len(vs))
    patches = np.where(rng.random(len(vs)) < 0.005, max_patches, patches)
    patches = np.clip(patches, 16, max_patches).astype(np.int64)
    patches = patches // PATCHES_PER_TOKEN * PATCHES_PER_TOKEN
    vis = EncoderItems(enc_len=patches, llm_len=patches // PATCHES_PER_TOKEN, sample=vs)
    a_s = np.flatnonzero(has_aud)
    dur = np.clip(rng.lognormal(np.log(8.0), 0.9, len(a_s)), 0.5, 30.0)
    dur = np.where(rng.random(len(a_s)) < 0.02, rng.uniform(60, 600, len(a_s)), dur)
    frames = np.maximum(2, (dur * FRAMES_PER_SECOND).astype(np.int64))
    aud = EncoderItems(enc_len=frames, llm_len=frames // AUDIO_FRAMES_PER_TOKEN, sample=a_s)
    llm = text_len + np.bincount(vs, weights=vis.llm_len, minlength=S).astype(np.int64) \
        + np.bincount(a_s, weights=aud.llm_len, minlength=S).astype(np.int64)
    return StepInputs(text_len=text_len, llm_len=llm, encoders={"vision": vis, "audio": aud})


METHODS = {**BASELINES, "mmdispatch": plan_step}


# (W, ranks per node, samples per step): the streaming benchmark's shape and its neighbours,
# where plan time is numpy per-call overhead rather than arithmetic
SMALL_WORLDS = [(4, 4, 512), (8, 8, 512), (8, 4, 512), (16, 8, 256)]


def run_small(num_steps: int, num_microbatches: int, seed: int) -> dict:
    """`run` for each of SMALL_WORLDS, keyed "W{W}_g{g}_S{S}"."""
    out = {}
    for W, g, S in SMALL_WORLDS:
        res = run([W], num_steps, ranks_per_node=g, samples_per_rank=S // W,
                  num_microbatches=num_microbatches, seed=seed)
        out[f"W{W}_g{g}_S{S}"] = res[str(W)]
    return out


def run(worlds: list[int], num_steps: int, ranks_per_node: int, samples_per_rank: int,
        num_microbatches: int, seed: int, max_patches: int = MAX_PATCHES) -> dict:
    results: dict = {}
    for W in worlds:
        topo = Topology(world_size=W, ranks_per_node=min(ranks_per_node, W))
        cfg = PlannerConfig(num_microbatches=num_microbatches, seed=seed)
        rng = np.random.default_rng([seed, W])
        steps = [synthetic_step(rng, samples_per_rank * W, max_patches)
                 for _ in range(num_steps)]
        acc = {name: _timed_plans(fn, steps, topo, cfg)[:2] for name, fn in METHODS.items()}
        random_step = np.array([p.metrics["step_time"] for p in acc["random"][0]])
        lpt_inter = sum(p.metrics["bytes"]["inter_node"] for p in acc["per_phase_lpt"][0])
        out = {}
        for name, (plans, times) in acc.items():
            ms = [p.metrics for p in plans]
            step = np.array([m["step_time"] for m in ms])
            lb = np.array([m["lb_step_time"] for m in ms])
            free = np.array([m["split_free_lb_step_time"] for m in ms])
            byts = {k: int(sum(m["bytes"][k] for m in ms)) for k in ms[0]["bytes"]}

            def phase_ratio(num, den):
                return {p: round(float(sum(m[num][p].sum() for m in ms)
                                       / max(sum(m[den][p].sum() for m in ms), 1e-300)), 4)
                        if sum(m[den][p].sum() for m in ms) > 0 else 1.0 for p in PHASES}

            entry = {
                "max_over_lb": phase_ratio("max", "lb"),
                "max_over_mean": phase_ratio("max", "mean"),
                "step_time_over_lb": round(float(step.sum() / lb.sum()), 4),
                "step_time_over_split_free_lb": round(float(step.sum() / free.sum()), 4),
                "speedup_vs_random": round(float(random_step.sum() / step.sum()), 4),
                "step_time": float(step.mean()),
                "lb_step_time": float(lb.mean()),
                "split_free_lb_step_time": float(free.mean()),
                "bytes": byts,
                "inter_node_vs_per_phase_lpt": round(byts["inter_node"] / lpt_inter, 4)
                if lpt_inter else None,
                "plan_ms_p50": round(float(np.percentile(times, 50)) * 1e3, 2),
                "plan_ms_p95": round(float(np.percentile(times, 95)) * 1e3, 2),
            }
            if name == "mmdispatch":
                t0 = time.perf_counter()
                plan = plans[0]
                for m in range(plan.num_microbatches):
                    for r in range(W):
                        plan.rank_microbatch(r, m)
                entry["all_rank_microbatch_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
            out[name] = entry
        results[str(W)] = out
    return results


REGIME_WORLDS = [8, 64, 512, 2560]
#: steps per regime and W: more where a step is cheap (p50 of plan time needs a few)
REGIME_STEPS = {8: 15, 64: 9, 512: 5, 2560: 3}


def _timed_plans(fn, steps, topo, cfg) -> tuple[list, list, list]:
    """(plans, CPU seconds of this thread per plan, wall seconds per plan). The planner is
    single-threaded, so its thread's CPU time is its cost on an idle core; wall time also
    counts the time other processes held the core."""
    fn(steps[0], topo, cfg)  # warm-up: imports, allocator
    plans, cpu, wall = [], [], []
    for inp in steps:
        t0, c0 = time.perf_counter(), time.thread_time()
        plan = fn(inp, topo, cfg)
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - t0)
        validate(plan, inp)
        plans.append(plan)
    return plans, cpu, wall


def run_regime(name: str, W: int, num_steps: int, *, ranks_per_node: int,
               samples_per_rank: int, num_microbatches: int, seed: int) -> dict:
    """Every method on the same `num_steps` steps of regime `name` at world size W."""
    topo = Topology(world_size=W, ranks_per_node=min(ranks_per_node, W))
    # serve's default capacity: the planner may not gather a rank's work in one micro-batch
    # (the baselines ignore capacities; `peak_llm_tokens_over_capacity` shows who holds it).
    cfg = PlannerConfig(num_microbatches=num_microbatches, seed=seed,
                        llm_capacity_factor=DEFAULT_LLM_CAPACITY_FACTOR)
    rng = np.random.default_rng([seed, W, sorted(REGIMES).index(name)])
    steps = [regime_step(name, rng, samples_per_rank * W) for _ in range(num_steps)]
    best_lb = np.array([best_lower_bound(inp, topo, cfg.cost, num_microbatches)
                        for inp in steps])
    items = float(np.mean([sum(len(inp.items(p)) for p in ENCODER_PHASES) for inp in steps]))
    acc = {m: _timed_plans(fn, steps, topo, cfg) for m, fn in METHODS.items()}
    step_of = {m: np.array([p.metrics["step_time"] for p in a[0]]) for m, a in acc.items()}
    inter_of = {m: sum(p.metrics["bytes"]["inter_node"] for p in a[0]) for m, a in acc.items()}
    caps = np.array([cfg.llm_capacity_for(inp, topo) for inp in steps], dtype=np.float64)
    best_base = min(step_of[m].sum() for m in BASELINES)
    lpt_inter = inter_of["per_phase_lpt"]
    out = {}
    for m, (plans, times, wall) in acc.items():
        out[m] = {
            "step_time": float(step_of[m].mean()),
            "step_time_vs_best_baseline": round(float(step_of[m].sum() / best_base), 4),
            "step_time_over_best_lb": round(float(step_of[m].sum() / best_lb.sum()), 4),
            "plan_ms_p50": round(float(np.percentile(times, 50)) * 1e3, 2),
            "plan_wall_ms_p50": round(float(np.percentile(wall, 50)) * 1e3, 2),
            "items_per_step": round(items),
            "samples_per_step": samples_per_rank * W,
            "inter_node_vs_per_phase_lpt": round(inter_of[m] / lpt_inter, 4)
            if lpt_inter else None,
            "max_over_mean": {p: round(float(np.mean([pl.metrics["max_over_mean"][p]
                                                      for pl in plans])), 4) for p in PHASES},
            "peak_llm_tokens": int(max(pl.metrics["peak_tokens"]["llm"] for pl in plans)),
            "peak_llm_tokens_over_capacity": round(float(max(
                pl.metrics["peak_tokens"]["llm"] / cap for pl, cap in zip(plans, caps))), 4),
        }
    return out


def run_regimes(regimes: list[str], worlds: list[int], steps: dict[int, int], **shape) -> dict:
    return {name: {str(W): run_regime(name, W, steps[W], **shape) for W in worlds}
            for name in regimes}


EXACT_SHAPE = {"world_size": 4, "ranks_per_node": 2, "num_samples": 8, "num_microbatches": 2,
               "time_limit_s": 1.0}


@contextlib.contextmanager
def _quiet_stdout():
    """HiGHS's C++ core may print to file descriptor 1; keep --json's stdout one object."""
    sys.stdout.flush()
    saved = os.dup(1)
    with open(os.devnull, "wb") as null:
        os.dup2(null.fileno(), 1)
        try:
            yield
        finally:
            os.dup2(saved, 1)
            os.close(saved)


def run_exact(regimes: list[str], cases: int, seed: int) -> dict:
    """plan_step against the MILP optimum (`planner.exact`) on `cases` small steps of every
    regime. Gaps are over the cases the MILP proved optimal within its time limit; for every
    case, `gap_to_proven_bound_max` bounds the true gap from above."""
    W, g, S, M = (EXACT_SHAPE[k] for k in ("world_size", "ranks_per_node", "num_samples",
                                           "num_microbatches"))
    topo = Topology(world_size=W, ranks_per_node=g)
    cfg = PlannerConfig(num_microbatches=M, seed=seed)
    out = {}
    for name in regimes:
        rng = np.random.default_rng([seed, 99, sorted(REGIMES).index(name)])
        gaps, upper = [], []
        for _ in range(cases):
            inp = regime_step(name, rng, S)
            with _quiet_stdout():
                ex = solve_exact(inp, W, M, cfg.cost, EXACT_SHAPE["time_limit_s"])
            ours = plan_step(inp, topo, cfg).metrics["step_time"]
            upper.append(ours / ex.lower - 1 if ex.lower > 0 else 0.0)
            if ex.optimal:
                gaps.append(ours / ex.step_time - 1 if ex.step_time > 0 else 0.0)
        out[name] = {
            "exact_gap_mean": round(float(np.mean(gaps)), 5) if gaps else None,
            "exact_gap_max": round(float(np.max(gaps)), 5) if gaps else None,
            "cases": cases, "optimal_cases": len(gaps),
            "gap_to_proven_bound_max": round(float(np.max(upper)), 5),
        }
    return out


def regimes_table(regimes: dict) -> str:
    lines = [f"{'regime':<14} {'W':>5} {'vs best base':>12} {'step/bestLB':>11} {'p50 ms':>8} "
             f"{'items':>8} {'inter/LPT':>9}   best baseline"]
    for name, by_w in regimes.items():
        for W, methods in by_w.items():
            e = methods["mmdispatch"]
            base = min(BASELINES, key=lambda m: methods[m]["step_time"])
            inter = e["inter_node_vs_per_phase_lpt"]
            lines.append(
                f"{name:<14} {W:>5} {e['step_time_vs_best_baseline']:>12.4f} "
                f"{e['step_time_over_best_lb']:>11.4f} {e['plan_ms_p50']:>8.1f} "
                f"{e['items_per_step']:>8} {'-' if inter is None else f'{inter:.3f}':>9}   "
                f"{base} ({methods[base]['plan_ms_p50']:.0f} ms)")
    return "\n".join(lines)


CONFIG_NOTE = {
    "regime_capacity": f"regimes: mmdispatch plans under serve's default llm_capacity_factor "
                       f"{DEFAULT_LLM_CAPACITY_FACTOR} (each rank's micro-batch at most that "
                       f"times the step's mean LLM tokens per (rank, micro-batch), at least the "
                       f"longest sample); the baselines ignore capacities. "
                       f"peak_llm_tokens_over_capacity: max over steps of the method's peak "
                       f"(rank, micro-batch) LLM tokens over that capacity",
    "cost_units": "training FLOPs (CostModel defaults)",
    "max_over_lb": "per phase: sum over steps and micro-batches of the slowest rank / sum of "
                   "the bound max(total/W, largest unit, s_W + s_(W+1)) of each micro-batch "
                   "of the method's own split",
    "lb_step_time": "mean over steps of sum over micro-batches and phases of that bound",
    "split_free_lb_step_time": "mean over steps of sum_p max(total_p/W, largest_p, "
                               "s_WM + s_(WM+1), the busiest rank's whole-step bound over W "
                               "bins): holds for every split",
    "capped_images": "second mixture, images capped at 2048 patches: bounds set by totals "
                     "rather than by single huge items (the regime where plain LPT ~1.05)",
    "small_worlds": "long-tailed mixture at small W (streaming shape W=4, one node, 512 "
                    "samples per step), keyed W{W}_g{g}_S{samples}; >= 50 steps each",
}


def _table(results: dict) -> str:
    lines = [f"{'W':>5} {'method':<14} {'vis/LB':>7} {'aud/LB':>7} {'llm/LB':>7} {'step/LB':>8} "
             f"{'step/free':>9} {'speedup':>8} {'inter GB':>9} {'intra GB':>9} {'p50 ms':>8} "
             f"{'p95 ms':>8}"]
    for W, methods in results.items():
        for name, e in methods.items():
            r = e["max_over_lb"]
            lines.append(
                f"{W:>5} {name:<14} {r['vision']:>7.3f} {r['audio']:>7.3f} {r['llm']:>7.3f} "
                f"{e['step_time_over_lb']:>8.3f} {e['step_time_over_split_free_lb']:>9.3f} "
                f"{e['speedup_vs_random']:>8.2f} {e['bytes']['inter_node'] / 1e9:>9.2f} "
                f"{e['bytes']['intra_node'] / 1e9:>9.2f} {e['plan_ms_p50']:>8.1f} "
                f"{e['plan_ms_p95']:>8.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.planner", description=__doc__)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="W in {8, 64, 512}, 3 steps")
    ap.add_argument("--steps", type=int, default=None, help="steps per W (default 7, quick 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--regimes", default=",".join(REGIMES),
                    help=f"comma-separated regimes (default all: {','.join(REGIMES)})")
    ap.add_argument("--worlds", default=None, help="comma-separated W for the regimes")
    ap.add_argument("--only-regimes", action="store_true", help="skip the other sections")
    ap.add_argument("--exact-cases", type=int, default=None,
                    help="small steps per regime solved exactly (default 200, quick 20; 0 = skip)")
    args = ap.parse_args(argv)
    worlds = [8, 64, 512] if args.quick else [8, 64, 512, 2560]
    steps = args.steps or (3 if args.quick else 7)
    shape = dict(ranks_per_node=8, samples_per_rank=8, num_microbatches=2, seed=args.seed)
    r_worlds = [int(w) for w in args.worlds.split(",")] if args.worlds else (
        [8, 64, 512] if args.quick else REGIME_WORLDS)
    r_steps = {W: (min(3, REGIME_STEPS.get(W, 3)) if args.quick else REGIME_STEPS.get(W, 3))
               for W in r_worlds}
    res = {"config": {"worlds": worlds, "num_steps": steps, "regime_worlds": r_worlds,
                      "regime_steps": r_steps, "cpu_reference_ms": cpu_reference_ms(),
                      **shape, **CONFIG_NOTE}}
    res["regimes"] = run_regimes(args.regimes.split(","), r_worlds, r_steps, **shape)
    exact_cases = args.exact_cases if args.exact_cases is not None else (20 if args.quick else 200)
    if exact_cases:
        res["config"]["exact"] = EXACT_SHAPE
        res["exact"] = run_exact(args.regimes.split(","), exact_cases, args.seed)
    if not args.only_regimes:
        res["results"] = run(worlds, steps, **shape)
        res["capped_images"] = run(worlds, max(3, steps // 2), max_patches=2048, **shape)
        res["small_worlds"] = run_small(max(steps, 50 if not args.quick else 10),
                                        shape["num_microbatches"], args.seed)
    if args.json:
        json.dump(res, sys.stdout)
        sys.stdout.write("\n")
    else:
        print("regimes: mmdispatch's step time vs the best baseline's and vs the best bound")
        print(regimes_table(res["regimes"]))
        if "exact" in res:
            print("\nagainst the exact optimum (small steps, MILP):")
            for name, e in res["exact"].items():
                print(f"{name:<14} gap mean {e['exact_gap_mean']} max {e['exact_gap_max']} "
                      f"({e['optimal_cases']}/{e['cases']} proven optimal; gap to the proven "
                      f"bound at most {e['gap_to_proven_bound_max']})")
        if args.only_regimes:
            return 0
        print("\nlong-tailed mixture (images up to 16384 patches)")
        print(_table(res["results"]))
        print("\ncapped_images mixture (images up to 2048 patches)")
        print(_table(res["capped_images"]))
        print("\nsmall worlds (W_g_S: world, ranks per node, samples per step)")
        print(_table(res["small_worlds"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
