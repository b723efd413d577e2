"""Lower bounds on a step's predicted time: no placement can beat them.

One bound per group of units sharing `bins` bins (`unit_bound`), used per micro-batch by the
plan's metrics and over all W*M (rank, micro-batch) slots by the split-free bound, which holds
for every micro-batch split and so certifies the split itself. Each term is proven in its
docstring; all are whole-array numpy.
"""

from __future__ import annotations

import numpy as np

from .balance import order_by_key_then_size
from .cost import CostModel, phase_costs
from .types import LLM_PHASE, PHASES, StepInputs, Topology


def unit_bound(c: np.ndarray, group: np.ndarray, num_groups: int, bins: int,
               order: np.ndarray | None = None) -> np.ndarray:
    """Per group, a lower bound on the heaviest of `bins` bins holding the group's units `c`.

    max(total/bins, max over k >= 0 of s_(kB-k+1) + ... + s_(kB+1)) with B = bins and s the
    group's sizes sorted in decreasing order (1-indexed). Proof of the second term: of the kB+1
    largest units, some bin holds at least k+1 (pigeonhole); its load is at least the sum of
    the k+1 smallest of those kB+1 units (sizes are non-negative). k = 0 is the largest unit,
    k = 1 the classic s_B + s_(B+1); larger k count how many units must share a bin.
    Last, `_count_term`: how many units some bins must hold, at the sizes they can hold.
    When every size is a whole multiple of the smallest positive one q (a padded encoder's
    windows), every bin's load is too, so the bound rounds up to a multiple of q.
    `order`: `order_by_key_then_size(group, c)`, where the caller has it.
    """
    c = np.asarray(c, dtype=np.float64)
    total = np.bincount(group, weights=c, minlength=num_groups)
    lb = total / bins
    n = len(c)
    if n == 0:
        return lb
    if order is None:
        order = order_by_key_then_size(group, c)
    g, s = group[order], c[order]
    start = np.searchsorted(g, np.arange(num_groups))
    count = np.bincount(g, minlength=num_groups)
    prefix = np.concatenate(([0.0], np.cumsum(s)))
    kmax = (count - 1) // bins  # windows that fit: kB + 1 <= count
    grp = np.repeat(np.arange(num_groups), kmax + 1)
    k = np.arange(len(grp)) - np.repeat(np.cumsum(kmax + 1) - (kmax + 1), kmax + 1)
    hi = start[grp] + k * bins + 1  # exclusive end of the window
    window = prefix[hi] - prefix[hi - k - 1]
    np.maximum.at(lb, grp, window)
    np.maximum(lb, _count_term(prefix, start, count, bins), out=lb)
    return _round_to_quantum(c, lb)


def _count_term(prefix: np.ndarray, start: np.ndarray, count: np.ndarray, bins: int
                ) -> np.ndarray:
    """Per group, the counting bound for near-equal units: with n units and q = ceil(n/B),
    min over t of max(S_small(tq), total - S_large((B - t)(q - 1))) / t, t = 1..min(B, n//q)
    (S_small(j), S_large(j): sum of the j smallest, largest units; 0 for an empty group).

    Proof: let t be the number of bins holding q or more units. t >= 1, since B bins of at most
    q - 1 units hold fewer than n; and tq <= n. Those t bins hold at least tq units, so at least
    S_small(tq); the other B - t hold at most (B - t)(q - 1) units, so at most
    S_large((B - t)(q - 1)), and the t bins the rest. The heaviest of the t bins is at least
    their mean. Where units differ by less than a unit's share of a bin (coarse, near-equal
    encoder items), this is the count a bin must hold at the smallest sizes, well above
    total/B, which the windows reach only for one bin's worth of units."""
    out = np.zeros(len(count))
    has = np.flatnonzero(count)
    q = -(-count[has] // bins)
    tmax = np.minimum(bins, count[has] // q)
    grp = np.repeat(np.arange(len(has)), tmax)
    t = np.arange(len(grp)) - np.repeat(np.cumsum(tmax) - tmax, tmax) + 1
    st, n, qg = start[has][grp], count[has][grp], q[grp]
    total = prefix[st + n] - prefix[st]
    small = prefix[st + n] - prefix[st + n - t * qg]  # units sorted largest first
    large = prefix[st + np.minimum((bins - t) * (qg - 1), n)] - prefix[st]
    best = np.full(len(has), np.inf)
    np.minimum.at(best, grp, np.maximum(small, total - large) / t)
    out[has] = best
    return out


def _round_to_quantum(c: np.ndarray, lb: np.ndarray) -> np.ndarray:
    pos = c[c > 0]
    if len(pos) == 0:
        return lb
    q = pos.min()
    units = pos / q
    if np.any(np.abs(units - np.round(units)) > 1e-9 * units):
        return lb
    return np.ceil(lb / q * (1 - 1e-12)) * q


def split_free_bound(costs: dict[str, np.ndarray], W: int, M: int) -> float:
    """Sum over phases of `unit_bound` over all W*M (rank, micro-batch) slots, but at least
    total/W: a lower bound on the step time of every split into M micro-batches.

    Proof: a phase's step time is the sum over micro-batches of its slowest rank, which is at
    least each micro-batch's total / W, so at least total / W in all; and at least the slowest
    (rank, micro-batch) slot of the phase, which `unit_bound` bounds over W*M slots."""
    out = 0.0
    for p in PHASES:
        c = costs[p]
        one = unit_bound(c, np.zeros(len(c), dtype=np.int64), 1, W * M)[0]
        out += max(float(c.sum()) / W, float(one))
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
