"""Lower bounds on a step's predicted time: no placement can beat them.

One bound per group of units sharing `bins` bins (`unit_bound`), used per micro-batch by the
plan's metrics (a bound for the plan's own split only) and, over all W*M (rank, micro-batch)
slots and over the W ranks' whole steps, by the split-free bound, which holds for every
micro-batch split and so certifies the split itself. Each term is proven in its
docstring; `unit_bound`'s terms are one compiled kernel (`_unit_bound`) over sizes sorted once.
"""

from __future__ import annotations

import numpy as np

from .balance import order_by_key_then_size
from .cost import CostModel, phase_costs
from .jit import kernel
from .types import LLM_PHASE, PHASES, StepInputs, Topology


def unit_bound(c: np.ndarray, group: np.ndarray, num_groups: int, bins: int,
               order: np.ndarray | None = None) -> np.ndarray:
    """Per group, a lower bound on the heaviest of `bins` bins holding the group's units `c`.

    max(total/bins, max over k >= 0 of s_(kB-k+1) + ... + s_(kB+1)) with B = bins and s the
    group's sizes sorted in decreasing order (1-indexed). Proof of the second term: of the kB+1
    largest units, some bin holds at least k+1 (pigeonhole); its load is at least the sum of
    the k+1 smallest of those kB+1 units (sizes are non-negative). k = 0 is the largest unit,
    k = 1 the classic s_B + s_(B+1); larger k count how many units must share a bin.
    Last, a counting term (`_unit_bound`): how many units some bins must hold, at the sizes
    they can hold.
    When every size is a whole multiple of the smallest positive one q (a padded encoder's
    windows), every bin's load is too, so the bound rounds up to a multiple of q.
    `order`: `order_by_key_then_size(group, c)`, where the caller has it.
    """
    c = np.ascontiguousarray(c, dtype=np.float64)
    group = np.ascontiguousarray(group, dtype=np.int64)
    if len(c) == 0:
        return np.zeros(num_groups)
    if order is None:
        order = order_by_key_then_size(group, c)
    return _unit_bound(c, group, np.ascontiguousarray(order, dtype=np.int64), num_groups, bins)


@kernel
def _unit_bound(c, group, order, num_groups, bins):
    """`unit_bound` of units `c` (n >= 1) in `order` (by group, then decreasing size), in one
    compiled pass per term, with numpy's operations in numpy's order (so the same floats):
    totals added in position order (np.bincount), the prefix sums of the sorted sizes left to
    right (np.cumsum), max and min as np.maximum and np.minimum (NaN wins, ties keep the first).

    Windows: with s the group's sorted sizes, s_(kB-k+1) + ... + s_(kB+1) for kB + 1 <= count.
    Counting term, per group with n units and q = ceil(n/B): min over t = 1..min(B, n//q) of
    max(S_small(tq), total - S_large((B - t)(q - 1))) / t: let t be the number of bins holding
    q or more units. t >= 1, since B bins of at most q - 1 units hold fewer than n; and
    tq <= n. Those t bins hold at least tq units, so at least S_small(tq); the other B - t hold
    at most (B - t)(q - 1) units, so at most S_large((B - t)(q - 1)), and the t bins the rest.
    The heaviest of the t bins is at least their mean. Where units differ by less than a
    unit's share of a bin (coarse, near-equal encoder items), this is the count a bin must
    hold at the smallest sizes, well above total/B, which the windows reach only for one
    bin's worth of units. Quantum: when every positive size is a whole multiple (within 1e-9)
    of the smallest, q, every bound rounds up to a multiple of q."""
    n = c.shape[0]
    total = np.zeros(num_groups)
    for i in range(n):
        total[group[i]] += c[i]
    lb = total / bins
    prefix = np.empty(n + 1)
    prefix[0] = 0.0
    start = np.zeros(num_groups, np.int64)
    count = np.zeros(num_groups, np.int64)
    for t in range(n):
        i = order[t]
        prefix[t + 1] = c[i] if t == 0 else prefix[t] + c[i]
        if count[group[i]] == 0:
            start[group[i]] = t
        count[group[i]] += 1
    for g in range(num_groups):
        w = _windows(prefix, start[g], count[g], bins)
        if not (lb[g] >= w or lb[g] != lb[g]):
            lb[g] = w
        best = _counting_term(prefix, start[g], count[g], bins)
        if not (lb[g] >= best or lb[g] != lb[g]):
            lb[g] = best
    _round_to_quantum(c, lb)
    return lb


@kernel
def _windows(prefix, st, cnt, bins):
    """The largest window term of one group (its sorted sizes' prefix sums from `prefix[st]`,
    `cnt` of them; -inf for none): max over k of s_(kB-k+1) + ... + s_(kB+1), NaN winning
    as np.maximum's does."""
    best = -np.inf
    for k in range((cnt - 1) // bins + 1):
        hi = st + k * bins + 1
        w = prefix[hi] - prefix[hi - k - 1]
        if not (best >= w or best != best):
            best = w
    return best


@kernel
def _counting_term(prefix, st, cnt, bins):
    """The counting term of one group (0 for an empty one): min over t of max(S_small(tq),
    total - S_large((B - t)(q - 1))) / t, see `_unit_bound`."""
    if cnt == 0:
        return 0.0
    q = -(-cnt // bins)
    best = np.inf
    whole = prefix[st + cnt] - prefix[st]
    for t in range(1, min(bins, cnt // q) + 1):
        small = prefix[st + cnt] - prefix[st + cnt - t * q]  # sorted largest first
        rest = whole - (prefix[st + min((bins - t) * (q - 1), cnt)] - prefix[st])
        v = (small if small >= rest or small != small else rest) / t
        if not (best <= v or best != best):
            best = v
    return best


@kernel
def _round_to_quantum(c, lb):
    """When every positive size in `c` is a whole multiple (within 1e-9) of the smallest, q,
    round each bound in `lb` up to a multiple of q, in place."""
    quantum = np.inf
    for i in range(c.shape[0]):
        if c[i] > 0 and c[i] < quantum:
            quantum = c[i]
    if quantum == np.inf:
        return
    for i in range(c.shape[0]):
        if c[i] > 0:
            u = c[i] / quantum
            if np.abs(u - np.rint(u)) > 1e-9 * u:
                return
    for g in range(lb.shape[0]):
        lb[g] = np.ceil(lb[g] / quantum * (1 - 1e-12)) * quantum


def split_free_bound(costs: dict[str, np.ndarray], W: int, M: int) -> float:
    """Sum over phases of the largest of total/W, `unit_bound` over all W*M (rank,
    micro-batch) slots and `unit_bound` over W ranks: a lower bound on the step time of every
    split into M micro-batches.

    Proof: a phase's step time is the sum over micro-batches of its slowest rank, which is at
    least each micro-batch's total / W, so at least total / W in all; at least the slowest
    (rank, micro-batch) slot of the phase, which `unit_bound` bounds over W*M slots; and at
    least any one rank's work summed over the micro-batches (in each it is at most the
    slowest), so at least the busiest rank's, which `unit_bound` bounds over W bins. The last
    counts whole units: 10 equal samples on 4 ranks take 3 units in any split, where
    total/W says 2.5."""
    out = 0.0
    for p in PHASES:
        c = np.ascontiguousarray(costs[p], dtype=np.float64)
        if len(c) == 0:
            continue
        group = np.zeros(len(c), dtype=np.int64)
        order = order_by_key_then_size(group, c)
        slot = unit_bound(c, group, 1, W * M, order)[0]
        rank = unit_bound(c, group, 1, W, order)[0]
        out += max(float(c.sum()) / W, float(slot), float(rank))
    return out


def lower_bound(inputs: StepInputs, topology: Topology, cost: CostModel,
                sample_mb: np.ndarray | None = None, num_microbatches: int | None = None) -> dict:
    """{"per_microbatch": {phase: float[M]} (only with a split), "step_time": float (with a
    split: sum over micro-batches and phases), "split_free_step_time": float}."""
    W = topology.world_size
    costs = phase_costs(inputs, cost)
    M0 = num_microbatches if num_microbatches is not None else (
        int(np.max(sample_mb, initial=-1)) + 1 if sample_mb is not None else 1)
    out: dict = {"split_free_step_time": split_free_bound(costs, W, max(M0, 1))}
    if sample_mb is None:
        return out
    sample_mb = np.asarray(sample_mb, dtype=np.int64)
    M = int(num_microbatches if num_microbatches is not None else sample_mb.max(initial=-1) + 1)
    if len(sample_mb) and (sample_mb.min() < 0 or sample_mb.max() >= M):
        raise ValueError(f"sample_mb outside 0..{M - 1}")
    per = {}
    for p in PHASES:
        mb = sample_mb if p == LLM_PHASE else sample_mb[inputs.items(p).sample]
        per[p] = unit_bound(costs[p], mb, M, W)
    out["per_microbatch"] = per
    out["step_time"] = float(sum(v.sum() for v in per.values()))
    return out


def best_lower_bound(inputs: StepInputs, topology: Topology, cost: CostModel,
                     num_microbatches: int) -> float:
    """The tightest proven lower bound on the step time of any plan of this step in
    `num_microbatches` micro-batches."""
    return lower_bound(inputs, topology, cost, num_microbatches=num_microbatches)[
        "split_free_step_time"]
