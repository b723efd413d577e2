"""mmdispatch's per-step planner: micro-batch split, node-aware LLM placement, encoder rebalance.

Algorithm (n samples/items, W ranks, g per node, N = W/g nodes, M micro-batches; vectorised):
1. Split to minimise sum_m,p bound_pm, bound = max(total/W, largest unit, ceil(units/W) x
   smallest unit: units are whole). Three candidate splits, the lowest sum of bounds wins:
   all samples through a block greedy on all phases (giants first, then largest first; each
   block goes where it raises the bound least, so the room a giant leaves in its
   micro-batch fills with every phase's work), and two class passes (giants greedy, then
   audio, vision and text-only samples to targets that fill the room under giant-set
   bounds, then level the totals). A polish pass moves a micro-batch's largest unit away
   when it alone sets that micro-batch's bound; a split in whole rows of W samples
   (`_split_rows`) replaces the result where its bound is lower (near-equal samples, where
   an even split puts ceil(n/W) on some rank in every micro-batch). Capacities, when set (or
   derived by `llm_capacity_factor`, serve's default), can overrule it: `_splits` then
   offers splits held to them (the greedy with room per micro-batch, an LPT over all rank x
   micro-batch bins, the whole-row split, fallbacks), and the first whose ranks can hold it
   is planned.
2. Per micro-batch, `placement.place_samples`: samples to nodes by class, to ranks by LLM cost.
3. Per micro-batch and encoder phase, `placement.place_items` (items largest first):
   node-first (items stay home up to the bound, a node's excess goes to the lightest nodes,
   then single moves across nodes each followed by a refine inside nodes), and while no
   placement is within `balance_tolerance` of the bound, node LPT (the same nodes, each
   node's items packed afresh), then whole-cluster LPT strategies relabelled onto ranks and
   swapped home (an item away from its node trades places with one of like size that sits
   on that node away from its own); with a few items a rank, where local moves seldom
   reach the bound, home-biased LPT alone follows node-first. The fewest inter-node bytes
   among the best-balanced wins; off-node items then return home wherever that raises no
   rank above the maximum.
4. Guard (`_no_slower_than_drawn`): the random baseline's assignment replaces the plan where
   it is predicted faster and holds the capacities (O(samples + items)).
Why: plain LPT per phase balances well but ships ~all embeddings across nodes; the node
strategies move little, and the cluster-wide ones restore balance where they cannot, then
win most of the bytes back by swaps.
Cost: one sort a step of each phase's items and of the samples by size (a counting sort over
their lengths: a unit's cost is a function of its length), the later sorts by size run on
sorted data (a counting sort by key), O(n/B) batched-LPT rounds, refine iterations of O(n +
pairs x items^2). The loops that go element by element (refine, the LPT rounds and heap,
the split's block greedy and polish, the capacity repair, the swaps home, unit bounds,
counting and radix sorts) are compiled (`jit.kernel`), the rest is numpy. What
`bench.planner` measured (CPU ms per plan, p50, on a shared 2-core VM whose reference loop
took 71 ms; all figures in docs/planner.md, generated from docs/bench/planner.json; regimes
under serve's default capacity): W=4, 512 samples: 3.2 ms; W=64: 3.5-5.8 ms in every regime;
W=2560: 24-53 ms for 1.5k-28k encoder items a step, 78 ms for document pages (37k near-equal
items) and 90 ms for 104k interleaved images. The VM's speed varies from run to run: two more
runs of the same interleaved plans, with the reference loop at 106 and 128 ms, took 95 and
92 ms.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import replace

import numpy as np

from .balance import _load_order, _members, lpt_heap, lpt_rounds
from .config import PlannerConfig
from .cost import phase_costs
from .jit import kernel
from .placement import Items, place_items, place_samples
from .plan import StepPlan
from .types import (
    ENCODER_PHASES, LLM_PHASE, PHASES, OversizeWarning, PlanError, StepInputs, Topology,
)


def check_inputs(inputs: StepInputs) -> None:
    """ValueError naming the first inconsistency in a step's arrays."""
    S = inputs.num_samples
    if inputs.text_len.shape != (S,):
        raise ValueError(f"text_len has shape {inputs.text_len.shape}, llm_len has ({S},)")
    for p, it in inputs.encoders.items():
        if p not in ENCODER_PHASES:
            raise ValueError(f"unknown encoder phase {p!r}")
        n = len(it)
        if it.llm_len.shape != (n,) or it.sample.shape != (n,):
            raise ValueError(f"{p} item arrays differ in length")
        if n and (it.sample.min() < 0 or it.sample.max() >= S):
            raise ValueError(f"{p} item owned by sample outside 0..{S - 1}")
        if n and (it.enc_len.min() < 0 or it.llm_len.min() < 0):
            raise ValueError(f"{p} item with negative length")
    if S and inputs.text_len.min() < 0:
        raise ValueError("negative text_len")
    total = np.asarray(inputs.text_len, dtype=np.int64).copy()
    for p in ENCODER_PHASES:
        it = inputs.items(p)
        total += np.bincount(it.sample, weights=it.llm_len, minlength=S).astype(np.int64)
    bad = np.flatnonzero(total != inputs.llm_len)
    if len(bad):
        s = int(bad[0])
        raise ValueError(f"sample {s}: llm_len {inputs.llm_len[s]} != text + item tokens "
                         f"{total[s]}")


def sample_phase_costs(inputs: StepInputs, unit_costs: dict[str, np.ndarray]
                       ) -> tuple[np.ndarray, np.ndarray]:
    """(cost[P, S] per sample and phase, largest unit cost[P, S] per sample and phase)."""
    S = inputs.num_samples
    cost = np.zeros((len(PHASES), S))
    big = np.zeros((len(PHASES), S))
    for k, p in enumerate(PHASES):
        if p == LLM_PHASE:
            cost[k] = big[k] = unit_costs[p]
        else:
            it = inputs.items(p)
            cost[k] = np.bincount(it.sample, weights=unit_costs[p], minlength=S)
            np.maximum.at(big[k], it.sample, unit_costs[p])
    return cost, big


def sample_unit_counts(inputs: StepInputs, unit_costs: dict[str, np.ndarray]
                       ) -> tuple[np.ndarray, np.ndarray]:
    """(units[P, S]: how many units of positive cost each sample has per phase, smallest[P, S]:
    the smallest of them, inf where none): what the split's whole-unit term needs (a sample is
    one LLM unit; each encoder item one unit of its phase)."""
    S = inputs.num_samples
    count = np.zeros((len(PHASES), S))
    small = np.full((len(PHASES), S), np.inf)
    for k, p in enumerate(PHASES):
        u = unit_costs[p]
        if p == LLM_PHASE:
            pos = u > 0
            count[k] = pos
            small[k] = np.where(pos, u, np.inf)
        else:
            _unit_stats(np.ascontiguousarray(u, dtype=np.float64),
                        np.ascontiguousarray(inputs.items(p).sample, dtype=np.int64),
                        count[k], small[k])
    return count, small


@kernel
def _unit_stats(u, owner, count, small):
    """Per sample, in place: how many of the units `u` (owned by `owner`) have positive cost,
    and the smallest of those."""
    for i in range(u.shape[0]):
        if u[i] > 0:
            s = owner[i]
            count[s] += 1
            if u[i] < small[s]:
                small[s] = u[i]


def _waterfill(total: np.ndarray, largest: np.ndarray, amount: float, W: int,
               pad: float) -> np.ndarray:
    """Amount per micro-batch: fill the free room under each micro-batch's bound first (minus
    `pad` per rank, what packing needs), then level the totals."""
    room = np.maximum(0.0, W * (largest - pad) - total)
    if room.sum() >= amount:
        return amount * room / room.sum() if amount > 0 else np.zeros_like(total)
    rest = amount - room.sum()
    level = total + room
    srt = np.sort(level)
    # smallest lambda with sum(max(0, lambda - level)) = rest
    k = np.arange(1, len(srt) + 1)
    cand = (rest + np.cumsum(srt)) / k
    ok = np.r_[cand[:-1] <= srt[1:], True]
    lam = cand[np.argmax(ok)]
    return room + np.maximum(0.0, lam - level)


def split_microbatches(cost: np.ndarray, big: np.ndarray, idx: np.ndarray, M: int, W: int,
                       rng: np.random.Generator, slack: float,
                       greedy_order: tuple[np.ndarray, np.ndarray] | None = None,
                       units: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Micro-batch of each sample in `idx` (see module docstring, step 1).

    A unit counts as a giant above the mean rank load of the step; a second pass lowers that
    to the lowest mean rank load any micro-batch got in the first (concentrating giants can
    leave other micro-batches so light that mid-size units set their bound), and the pass with
    the smaller sum of bounds wins. `greedy_order`: `_greedy_order` of these samples, if the
    caller has it. `units`: `sample_unit_counts` of all samples; with them the bounds count
    whole units (`_split_bound`) and the whole-row split (`_split_rows`, in the greedy's order
    of the samples) replaces the polished best where its bound is lower: with near-equal
    units the totals-based candidates tie an even split (5/5 of 10 samples on 4 ranks: two
    on some rank in both micro-batches) with one that fills whole rows of W (4/6: two once)."""
    if M == 1 or len(idx) == 0:
        return np.zeros(len(idx), dtype=np.int64)
    c, b = cost.take(idx, axis=1), big.take(idx, axis=1)  # C order: row sums 10x faster
    u = None if units is None else (np.ascontiguousarray(units[0].take(idx, axis=1)),
                                     np.ascontiguousarray(units[1].take(idx, axis=1)))
    seed = rng.integers(2**63)
    first = _split_pass(c, b, c.sum(axis=1) / (W * M), M, W, np.random.default_rng(seed), slack)
    best, best_bound = first, _split_bound(c, b, first, M, W, u)
    T = np.stack([np.bincount(first, weights=ck, minlength=M) for ck in c])
    lowest, tau = T.min(axis=1) / W, c.sum(axis=1) / (W * M)
    if slack < 1 and np.any(lowest < 0.9 * tau):
        second = _split_pass(c, b, lowest, M, W, np.random.default_rng(seed), slack)
        bound = _split_bound(c, b, second, M, W, u)
        if bound < best_bound:
            best, best_bound = second, bound
    if slack < 1:
        if greedy_order is None:
            greedy_order = _greedy_order(c, b, c.sum(axis=1) / (W * M), M, W)
        third = _split_greedy(c, b, c.sum(axis=1) / (W * M), M, W, order=greedy_order)
        bound = _split_bound(c, b, third, M, W, u)
        if bound < best_bound * (1 - 1e-9):
            best, best_bound = third, bound
    _polish_split(c, b, best, M, W, np.zeros((len(best), 0)), 0.0)
    if u is not None and slack < 1:
        rows = _split_rows(np.concatenate(greedy_order), M, W)
        if _split_bound(c, b, rows, M, W, u) < _split_bound(c, b, best, M, W, u) * (1 - 1e-9):
            best = rows
    return best


def _split_rows(order: np.ndarray, M: int, W: int) -> np.ndarray:
    """Micro-batch of each sample (`order`: largest first) in whole rows of W: of the n // W
    full rows, micro-batch m gets n // W // M, one more for the first (n // W) % M, and the
    last, which has the fewest, the n % W samples left too. So every micro-batch but the last
    holds a multiple of W samples, and the rows a rank's busiest slots hold sum to
    ceil(n / W) over the micro-batches, the least any split can give. Samples of like size
    share a micro-batch, the micro-batches with the fewest samples the largest ones (ties:
    the lower first), so the fullest holds the smallest (its ranks' memory holds it best)."""
    n = len(order)
    full, rest = divmod(n, W)
    count = (full // M + (np.arange(M) < full % M)) * W
    count[-1] += rest
    by_count = np.argsort(count, kind="stable")
    out = np.empty(n, dtype=np.int64)
    out[order] = np.repeat(by_count, count[by_count])
    return out


def _split_greedy(c: np.ndarray, b: np.ndarray, threshold: np.ndarray, M: int,
                  W: int, share: np.ndarray | None = None,
                  order: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Every sample through `_greedy_blocks`, all phases at once: giants first (as in
    `_split_pass`), then the rest largest first, about 64 blocks per micro-batch. Unlike the
    class-by-class pass, a sample counts in every phase it touches, so the room a giant of
    one phase leaves in its micro-batch fills with the other phases' work too.

    With `share` (samples x capacities: each sample's tokens over each capacity), a block
    only goes where every capacity's micro-batch total stays within `_FILL` x W (see
    `_greedy_blocks`). `order`: `_greedy_order(c, b, threshold, M, W)`, if already made."""
    P, n = c.shape
    giants, rest = _greedy_order(c, b, threshold, M, W) if order is None else order
    Tc, Lc = np.zeros((M, P)), np.zeros((M, P))
    full = None if share is None else np.zeros((M, share.shape[1]))
    out = np.zeros(n, dtype=np.int64)
    if len(giants):
        out[giants] = _greedy_blocks(c, b, giants, max(1, W // 16), Tc, Lc, W, share, full)
    if len(rest):
        block = max(1, len(rest) // (64 * M))
        out[rest] = _greedy_blocks(c, b, rest, block, Tc, Lc, W, share, full)
    return out


def _greedy_order(c: np.ndarray, b: np.ndarray, threshold: np.ndarray, M: int, W: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(giants, rest): the order in which `_split_greedy` takes the samples, giants by
    decreasing score, then the rest by decreasing size (all phases, each over its mean rank
    load). The same for every split of a step, with or without capacities."""
    csum = c.sum(axis=1)
    return _giants_then_rest(c, b, threshold, np.where(csum > 0, csum / (W * M), 1.0))


@kernel
def _giants_then_rest(c, b, threshold, tau):
    """`_greedy_order` once its phases' mean rank loads `tau` (1 for a phase without work) are
    known: a giant has a unit above its phase's `threshold` (>= 0: a phase without work has no
    unit above it, as units cost at most their sample's phase cost, >= 0); giants
    by decreasing max_p b[p] / tau[p], the rest by decreasing sum_p c[p] / tau[p] (summed in
    phase order), ties by index (stable radix sorts, `_load_order`)."""
    P, n = c.shape
    giant = np.zeros(n, np.bool_)
    for i in range(n):
        for k in range(P):
            if b[k, i] > threshold[k]:
                giant[i] = True
    giants, rest = np.flatnonzero(giant), np.flatnonzero(~giant)
    score, size = np.empty(giants.shape[0]), np.empty(rest.shape[0])
    for j in range(giants.shape[0]):
        score[j] = b[0, giants[j]] / tau[0]
        for k in range(1, P):
            score[j] = max(score[j], b[k, giants[j]] / tau[k])
    for j in range(rest.shape[0]):
        size[j] = c[0, rest[j]] / tau[0]
        for k in range(1, P):
            size[j] += c[k, rest[j]] / tau[k]
    return giants[_load_order(-score)], rest[_load_order(-size)]


def _split_bound(c: np.ndarray, b: np.ndarray, mb: np.ndarray, M: int, W: int,
                 units: tuple[np.ndarray, np.ndarray] | None = None) -> float:
    """sum_m,p max(total_pm/W, largest unit_pm) of the split `mb`; with `units` (per phase
    and sample: units of positive cost, the smallest of them; `sample_unit_counts` of these
    samples), also at least ceil(n_pm / W) x smallest unit_pm for the n_pm units of the
    micro-batch's phase: units are whole, so some rank holds that many of them."""
    bound = np.maximum(_group_sums(c, mb, M) / W, _group_max(b, mb, M))
    if units is not None:
        bound = np.maximum(bound, _whole_units(units[0], units[1], mb, M, W))
    return float(bound.sum())


@kernel
def _whole_units(count, small, mb, M, W):
    """Per phase and micro-batch: ceil(n / W) x the smallest unit for its n units (per
    sample: `count` units of positive cost, the smallest `small`); 0 where it has none."""
    P = count.shape[0]
    n, lo = np.zeros((P, M)), np.full((P, M), np.inf)
    for i in range(count.shape[1]):
        for k in range(P):
            if count[k, i] > 0:
                n[k, mb[i]] += count[k, i]
                if small[k, i] < lo[k, mb[i]]:
                    lo[k, mb[i]] = small[k, i]
    out = np.zeros((P, M))
    for k in range(P):
        for m in range(M):
            if n[k, m] > 0:
                out[k, m] = np.ceil(n[k, m] / W) * lo[k, m]
    return out


@kernel
def _group_sums(x, mb, M):
    """Per row of `x` and micro-batch: the sum of its columns in that micro-batch, added in
    column order (what np.bincount(mb, weights=row, minlength=M) gives)."""
    out = np.zeros((x.shape[0], M))
    for i in range(x.shape[1]):
        for k in range(x.shape[0]):
            out[k, mb[i]] += x[k, i]
    return out


@kernel
def _group_max(x, mb, M):
    """Per row of `x` and micro-batch: the largest of its columns in that micro-batch, at
    least 0."""
    out = np.zeros((x.shape[0], M))
    for i in range(x.shape[1]):
        for k in range(x.shape[0]):
            if x[k, i] > out[k, mb[i]]:
                out[k, mb[i]] = x[k, i]
    return out


def _greedy_blocks(c: np.ndarray, b: np.ndarray, members: np.ndarray, block: int,
                   Tc: np.ndarray, Lc: np.ndarray, W: int, share: np.ndarray | None = None,
                   full: np.ndarray | None = None) -> np.ndarray:
    """Micro-batch of each of `members`, taken in order in blocks of `block`: each block goes
    where it raises sum_p max(total_p/W, largest_p) least (ties: the lighter micro-batch).
    `Tc`, `Lc` (micro-batches x phases: totals, largest units) are updated in place.

    With `share` and `full` (micro-batches x capacities: the shares taken so far, updated in
    place), only micro-batches whose every capacity stays within `_FILL` x W after the block
    are candidates; when none is, the block goes where the fullest capacity stays lowest.

    The blocks' sums and largest units are numpy passes; their placement, one block after
    the other over a state of M x P numbers, is the compiled `_place_blocks`."""
    csum = c.sum(axis=1)
    shr = np.where(csum > 0, 1.0 / np.maximum(csum, 1e-300), 0.0)
    starts = np.arange(0, len(members), block)
    bsum = np.ascontiguousarray(np.add.reduceat(c.take(members, axis=1), starts, axis=1).T)
    bmax = np.ascontiguousarray(np.maximum.reduceat(b.take(members, axis=1), starts, axis=1).T)
    if share is not None and share.shape[1]:
        bshare = np.add.reduceat(share[members], starts, axis=0)
        chosen = _place_blocks(bsum, bmax, bshare, shr, Tc, Lc, full, W, _FILL * W)
    else:
        none = np.zeros((len(starts), 0))
        chosen = _place_blocks(bsum, bmax, none, shr, Tc, Lc, np.zeros((len(Tc), 0)), W, 0.0)
    return np.repeat(chosen, block)[:len(members)]


@kernel
def _place_blocks(bsum, bmax, bshare, shr, Tc, Lc, full, W, limit):
    """Micro-batch of each block i (per phase: total `bsum[i]`, largest unit `bmax[i]`; per
    capacity: shares `bshare[i]`), in order: among the micro-batches `_with_room` offers (all
    where `full` has no columns), those whose `_bound_increase` is within 1e-9 x max(|lowest|,
    largest bound, 1) of the lowest; of these the lowest shr . Tc (the lighter), then the
    lowest index. `Tc`, `Lc`, `full` get the block added in place."""
    nblk, P = bsum.shape
    M = Tc.shape[0]
    olds, ties, bounds = np.empty((M, P)), np.zeros(M), np.zeros(M)
    for m in range(M):
        for q in range(P):
            t = Tc[m, q] / W
            olds[m, q] = Lc[m, q] if Lc[m, q] > t else t
            ties[m] += shr[q] * Tc[m, q]
            bounds[m] += olds[m, q]
    chosen = np.empty(nblk, np.int64)
    inc = np.empty(M)
    ok = np.ones(M, np.bool_)
    for i in range(nblk):
        if full.shape[1]:
            ok = _with_room(full, bshare[i], limit)
        lo = np.inf
        for m in range(M):
            if ok[m]:
                inc[m] = _bound_increase(Tc[m], Lc[m], olds[m], bsum[i], bmax[i], W)
                lo = min(lo, inc[m])
        eps = 1e-9 * max(abs(lo), bounds.max(), 1.0)
        m = -1
        for k in range(M):
            if ok[k] and inc[k] <= lo + eps and (m < 0 or ties[k] < ties[m]):
                m = k
        chosen[i] = m
        tie = bnd = 0.0
        for q in range(P):
            Tc[m, q] += bsum[i, q]
            if bmax[i, q] > Lc[m, q]:
                Lc[m, q] = bmax[i, q]
            t = Tc[m, q] / W
            olds[m, q] = Lc[m, q] if Lc[m, q] > t else t
            tie += shr[q] * Tc[m, q]
            bnd += olds[m, q]
        ties[m], bounds[m] = tie, bnd
        full[m] += bshare[i]
    return chosen


@kernel
def _bound_increase(Tm, Lm, om, bs, bx, W):
    """How much a block (per phase: total `bs`, largest unit `bx`) raises one micro-batch's
    sum_p max(total_p/W, largest_p), from its totals `Tm`, largest units `Lm`, bounds `om`."""
    inc = 0.0
    for q in range(Tm.shape[0]):
        t = (Tm[q] + bs[q]) / W
        l = bx[q] if bx[q] > Lm[q] else Lm[q]
        inc += (l if l > t else t) - om[q]
    return inc


@kernel
def _with_room(full, block, limit):
    """Mask of the micro-batches (rows of `full`) whose every capacity stays within `limit`
    with the block's shares added; where none does, the first whose fullest capacity stays
    lowest."""
    M = full.shape[0]
    after = np.empty(M)
    for m in range(M):
        a = full[m, 0] + block[0]
        for j in range(1, full.shape[1]):
            a = max(a, full[m, j] + block[j])
        after[m] = a
    room = after <= limit
    if not room.any():
        room[np.argmin(after)] = True
    return room


def _split_pass(c: np.ndarray, b: np.ndarray, threshold: np.ndarray, M: int, W: int,
                rng: np.random.Generator, slack: float) -> np.ndarray:
    P, n = c.shape
    out = np.zeros(n, dtype=np.int64)
    csum = c.sum(axis=1)
    has = csum > 0
    # slack >= 1 is the capacity fallback: no concentrating, only level the totals
    is_giant = ((b > threshold[:, None]) & has[:, None]).any(axis=0) if slack < 1 \
        else np.zeros(n, dtype=bool)
    giants = np.flatnonzero(is_giant)
    Tc, Lc = np.zeros((M, P)), np.zeros((M, P))
    if len(giants):
        tau = np.where(has, csum / (W * M), 1.0)
        score = (b[:, giants] / tau[:, None]).max(axis=0)
        giants = giants[np.argsort(-score, kind="stable")]
        out[giants] = _greedy_blocks(c, b, giants, max(1, W // 16), Tc, Lc, W)
    T, L = Tc.T.copy(), Lc.T.copy()
    rest = ~is_giant
    k_vis, k_aud, k_llm = PHASES.index("vision"), PHASES.index("audio"), PHASES.index(LLM_PHASE)
    has_a = rest & (c[k_aud] > 0)
    has_v = rest & ~has_a & (c[k_vis] > 0)
    text = rest & ~has_a & ~has_v
    for mask, k in ((has_a, k_aud), (has_v, k_vis), (text, k_llm)):
        members = np.flatnonzero(mask)
        if len(members) == 0:
            continue
        ck = c[k, members]
        amount = float(ck.sum())
        pad = np.inf if slack >= 1 else slack * amount / len(members)
        x = _waterfill(T[k], L[k], amount, W, pad)
        # Large members (above half the lowest per-rank level) go first, largest first, to the
        # micro-batches with the largest bound, where they raise no bound; the rest in random
        # order so every micro-batch gets a representative mix.
        level = ((T[k] + x) / W).min()
        big_first = ck > 0.5 * level
        large = members[big_first]
        large = large[np.argsort(-ck[big_first], kind="stable")]
        members = np.concatenate([large, rng.permutation(members[~big_first])])
        ck = c[k, members]
        mb_order = np.argsort(-L[k], kind="stable")
        pos = np.searchsorted(np.cumsum(x[mb_order])[:-1], np.cumsum(ck) - ck / 2)
        m = mb_order[np.minimum(pos, M - 1)]
        out[members] = m
        _add_members(c, b, members, m, T, L)
    return out


@kernel
def _add_members(c, b, members, mb, T, L):
    """T[p, m] += the sum of c[p] over the members going to micro-batch m (summed apart, in
    member order, then added), L[p, m] = max(L[p, m], their largest b[p]); in place."""
    acc = np.zeros(T.shape)
    for j in range(members.shape[0]):
        for k in range(T.shape[0]):
            acc[k, mb[j]] += c[k, members[j]]
            L[k, mb[j]] = max(L[k, mb[j]], b[k, members[j]])
    T += acc


@kernel
def _top2(b, mb, M):
    """Per phase and micro-batch: (largest unit, at least 0; its sample, the lowest on ties,
    -1 where no unit is positive; the largest of the other units, at least 0)."""
    P, S = b.shape
    first, who, second = _group_max(b, mb, M), np.full((P, M), -1, np.int64), np.zeros((P, M))
    for k in range(P):
        for i in range(S):
            if b[k, i] > 0 and b[k, i] == first[k, mb[i]] and who[k, mb[i]] < 0:
                who[k, mb[i]] = i
        for i in range(S):
            if i != who[k, mb[i]] and b[k, i] > second[k, mb[i]]:
                second[k, mb[i]] = b[k, i]
    return first, who, second


@kernel
def _polish_split(c, b, mb, M, W, share, limit, max_iter=4):
    """Move a micro-batch's largest unit elsewhere when it alone sets that micro-batch's bound
    and moving it lowers sum_m,p max(total/W, largest) (the class split above ignores sizes);
    only where the destination's capacities (`share`: samples x capacities, maybe none) stay
    within `limit`. In each of at most `max_iter` rounds, the first (phase, micro-batch) in
    order whose best move gains more than 1e-9 x its bound moves; a round without one ends.
    Sums over the phases are taken in phase order, as numpy sums fewer than 8 numbers."""
    for _ in range(max_iter):
        T, F = _group_sums(c, mb, M), _group_sums(share.T, mb, M)
        first, who, second = _top2(b, mb, M)
        moved = False
        for k in range(c.shape[0]):
            for m in range(M):
                s = who[k, m]
                if not first[k, m] > T[k, m] / W or s < 0 or mb[s] != m:
                    continue
                m2, gain, before = _best_move(c, b, T, F, share[s], limit, first, who, second,
                                              s, m, W)
                if gain > 1e-9 * before:
                    mb[s], moved = m2, True
                    break  # totals changed: recompute
            if moved:
                break
        if not moved:
            return


@kernel
def _best_move(c, b, T, F, share_s, limit, first, who, second, s, m, W):
    """(destination, gain, bound of m before) of moving sample s, largest unit of micro-batch
    m, to the micro-batch d != m whose capacities stay within `limit` where the sum of the
    two micro-batches' bounds drops most (the first on ties; -inf where none may take it)."""
    P, M = T.shape
    before = after_m = 0.0
    for q in range(P):
        t = T[q, m] / W
        before += first[q, m] if first[q, m] > t else t
        lwo = second[q, m] if who[q, m] == s else first[q, m]
        t = (T[q, m] - c[q, s]) / W
        after_m += lwo if lwo > t else t
    best, dst = -np.inf, 0
    for d in range(M):
        if d == m or np.any(F[:, d] + share_s > limit):
            continue
        old2 = new2 = 0.0
        for q in range(P):
            t = T[q, d] / W
            old2 += first[q, d] if first[q, d] > t else t
            big = b[q, s] if b[q, s] > first[q, d] else first[q, d]
            t = (T[q, d] + c[q, s]) / W
            new2 += big if big > t else t
        gain = before + old2 - after_m - new2
        if gain > best:
            best, dst = gain, d
    return dst, best, before


def _place_microbatch(cost: np.ndarray, samp: np.ndarray, unit_costs: dict[str, np.ndarray],
                      items_in: dict[str, np.ndarray], inputs: StepInputs, topology: Topology,
                      config: PlannerConfig, samp_by_size: np.ndarray
                      ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(LLM rank of each of `samp`, encoder rank of each item in `items_in` per phase): steps
    2-3 of the module docstring for one micro-batch. `samp_by_size`: positions in `samp` by
    decreasing LLM cost, ties by position."""
    W, g = topology.world_size, topology.ranks_per_node
    rank = place_samples(cost.take(samp, axis=1), W, g, config.balance_tolerance, samp_by_size)
    if config.llm_capacity is not None:
        # held to the capacity before the items are placed, so they follow where samples are
        rank = _repair_units(np.zeros(len(samp), dtype=np.int64), rank,
                             inputs.llm_len[samp].astype(np.float64), config.llm_capacity,
                             np.ones(1, dtype=bool), topology, "LLM")
    sample_rank = np.zeros(inputs.num_samples, dtype=np.int64)
    sample_rank[samp] = rank
    out = {}
    for p in ENCODER_PHASES:
        it = items_in[p]
        if len(it) == 0:
            out[p] = np.zeros(0, dtype=np.int64)
            continue
        items = Items.make(unit_costs[p][it], sample_rank[inputs.items(p).sample[it]],
                           inputs.items(p).llm_len[it].astype(np.float64), W, g)
        out[p] = place_items(items, tolerance=config.balance_tolerance, band=config.home_band,
                             coarse_per_rank=config.coarse_items_per_rank)
    return rank, out


def plan_step(inputs: StepInputs, topology: Topology, config: PlannerConfig) -> StepPlan:
    """Balanced, node-aware plan of one step (see module docstring). Deterministic in `seed`.

    With `oversize="isolate"`, a step whose M micro-batches cannot be packed under the
    capacities gets more (M + 1, + 2, + 4, ... for every rank alike, with a warning) rather
    than a PlanError: like an isolated sample, it runs in more, smaller micro-batches."""
    check_inputs(inputs)
    M = config.microbatches_for(inputs, topology)
    capacity = config.llm_capacity_for(inputs, topology)
    if capacity != config.llm_capacity:
        return _plan_derived(inputs, topology, replace(config, llm_capacity=capacity), M)
    try:
        return _plan_with(inputs, topology, config, M)
    except PlanError as refused:
        if config.oversize != "isolate":
            raise
        extra = 1
        while extra <= inputs.num_samples:
            try:
                plan = _plan_with(inputs, topology, config, M + extra)
            except PlanError:
                extra *= 2
                continue
            warnings.warn(OversizeWarning(f"{refused}: planned the step in {M + extra} "
                                          f"micro-batches instead of {M}", reason=str(refused)),
                          stacklevel=2)
            return plan
        raise


def _plan_derived(inputs: StepInputs, topology: Topology, config: PlannerConfig,
                  M: int) -> StepPlan:
    """Plan under a capacity derived by `llm_capacity_factor` (a default, not the user's
    memory): where its ranks cannot hold the step (few samples per micro-batch: 5 equal
    samples in 4 slots of 1.25x the mean fit no two to a slot), it grows by 25% until they
    can, at most to the step's total, which holds any placement."""
    total = int(inputs.llm_len.sum())
    while True:
        try:
            return _plan_with(inputs, topology, config, M)
        except PlanError:
            if config.llm_capacity >= total:
                raise
            config = replace(config, llm_capacity=min(total, -(-config.llm_capacity * 5 // 4)))


def _plan_with(inputs: StepInputs, topology: Topology, config: PlannerConfig, M: int) -> StepPlan:
    W = topology.world_size
    S = inputs.num_samples
    rng = np.random.default_rng(config.seed)
    unit_costs = phase_costs(inputs, config.cost)
    cost, big = sample_phase_costs(inputs, unit_costs)
    units = sample_unit_counts(inputs, unit_costs)
    oversize = find_oversize(inputs, config)
    if len(oversize) and config.oversize == "error":
        s = int(oversize[0])
        raise PlanError(f"sample {s} fits no capacity (llm_len {inputs.llm_len[s]}, "
                        f"llm_capacity {config.llm_capacity}, encoder capacity "
                        f"{config.encoder_capacity}); set oversize='isolate' to run it alone",
                        sample=s)
    regular = np.ones(S, dtype=bool)
    regular[oversize] = False
    idx = np.flatnonzero(regular)
    if len(oversize):
        first, total = _isolated_span(len(oversize), len(idx), M, W)
        shown = oversize[:8].tolist()  # the warning carries them all; its line, a few
        listed = str(shown) if len(oversize) <= 8 else f"{str(shown)[:-1]}, ... ({len(oversize)} in all)]"
        where = (f"in an extra micro-batch ({M} -> {total} micro-batches)" if first else
                 f"from micro-batch 0, as no sample of the step fits ({M} -> {total} micro-batches)")
        warnings.warn(OversizeWarning(f"samples {listed} exceed capacity: each runs "
                                      f"alone on a rank {where}", oversize.tolist()),
                      stacklevel=2)
    refused = None
    by_size = {p: _by_decreasing_size(unit_costs[p], inputs.items(p).enc_len) for p in
               ENCODER_PHASES}  # once a step: every split places the same items
    by_size[LLM_PHASE] = _by_decreasing_size(unit_costs[LLM_PHASE], inputs.llm_len)
    if len(oversize):
        by_size = {p: o[regular[inputs.items(p).sample[o] if p != LLM_PHASE else o]]
                   for p, o in by_size.items()}
    at = np.zeros(S, dtype=np.int64)
    at[idx] = np.arange(len(idx))
    for split in _splits(cost, big, idx, inputs, config, M, W, rng, at[by_size[LLM_PHASE]],
                         units):
        sample_mb = np.zeros(S, dtype=np.int64)
        sample_mb[idx] = split
        try:
            plan = _place_split(inputs, topology, config, cost, unit_costs, sample_mb, regular,
                                oversize, M, by_size)
        except PlanError as e:  # its ranks cannot hold it: the next split
            refused = e
            continue
        if len(oversize) == 0:
            plan = _no_slower_than_drawn(plan, unit_costs)
        return plan
    raise refused


def _step_time(plan: StepPlan, unit_costs: dict[str, np.ndarray], sample_mb: np.ndarray,
               sample_rank: np.ndarray, item_rank: dict[str, np.ndarray] | None) -> float:
    """Predicted step time (as `compute_metrics` adds it up) of an assignment of `plan`'s
    step: per phase, the slowest rank of each micro-batch, summed. `item_rank` None: every
    encoder item where its sample runs."""
    W, M = plan.topology.world_size, plan.num_microbatches
    total = 0.0
    for p in PHASES:
        if p == LLM_PHASE:
            load = np.bincount(sample_mb * W + sample_rank, weights=unit_costs[p],
                               minlength=W * M)
        else:
            it = plan.inputs.items(p)
            rank = sample_rank if item_rank is None else item_rank[p]
            load = _slot_loads(np.ascontiguousarray(unit_costs[p], dtype=np.float64),
                               np.ascontiguousarray(it.sample, dtype=np.int64),
                               np.ascontiguousarray(sample_mb, dtype=np.int64),
                               np.ascontiguousarray(rank, dtype=np.int64), item_rank is None,
                               W, M)
        total += float(load.reshape(M, W).max(axis=1).sum())
    return total


@kernel
def _slot_loads(u, owner, sample_mb, rank, by_owner, W, M):
    """Per (micro-batch, rank) slot, the cost of the units `u` there: unit i runs in its
    owner's micro-batch, on rank[owner[i]] (`by_owner`: encoders where their sample runs)
    or rank[i]; added in unit order (what np.bincount gives)."""
    load = np.zeros(W * M)
    for i in range(u.shape[0]):
        s = owner[i]
        load[sample_mb[s] * W + (rank[s] if by_owner else rank[i])] += u[i]
    return load


def _no_slower_than_drawn(plan: StepPlan, unit_costs: dict[str, np.ndarray]) -> StepPlan:
    """`plan`, or the random baseline's assignment of its step (`baselines.plan_random`:
    samples as drawn, encoders where their sample runs) where that is predicted faster and
    holds the plan's capacities. A guard, O(samples + items): the split's bounds and the
    placement are heuristics, and on a few near-equal samples a rank (seen: 9 samples within
    5% on 4 ranks, 1.2% slower) the draw can pair them better."""
    from .baselines import _as_drawn  # (baselines imports this module)

    inp, topo, M = plan.inputs, plan.topology, plan.num_microbatches
    W = topo.world_size
    mb, rank = _as_drawn(inp.num_samples, W, M)
    ours = _step_time(plan, unit_costs, plan.sample_mb, plan.sample_rank, plan.item_rank)
    drawn = _step_time(plan, unit_costs, mb, rank, None)
    if not drawn < ours * (1 - 1e-12):
        return plan
    item_rank = {p: rank[inp.items(p).sample] for p in ENCODER_PHASES}
    if plan.llm_capacity is not None and np.bincount(
            mb * W + rank, weights=inp.llm_len, minlength=W * M).max() > plan.llm_capacity:
        return plan
    for p, cap in plan.encoder_capacity.items():
        it = inp.items(p)
        tok = plan.cost.phase(p).padded_len(it.enc_len)
        if len(it) and np.bincount(mb[it.sample] * W + item_rank[p], weights=tok,
                                   minlength=W * M).max() > cap:
            return plan
    return StepPlan(
        inputs=inp, topology=topo, num_microbatches=M, sample_mb=mb, sample_rank=rank,
        item_rank=item_rank, cost=plan.cost, bytes_per_token=plan.bytes_per_token,
        llm_capacity=plan.llm_capacity, encoder_capacity=plan.encoder_capacity,
        isolated_microbatches=plan.isolated_microbatches,
    )


def _place_split(inputs: StepInputs, topology: Topology, config: PlannerConfig,
                 cost: np.ndarray, unit_costs: dict[str, np.ndarray], sample_mb: np.ndarray,
                 regular: np.ndarray, oversize: np.ndarray, M: int,
                 by_size: dict[str, np.ndarray]) -> StepPlan:
    """The plan of one split: regular samples placed, oversize ones isolated, then capacities
    repaired (PlanError if some rank cannot be brought under them). `by_size`: per phase, the
    regular samples' items, largest first (`_place_regular`)."""
    sample_rank, item_rank = _place_regular(inputs, topology, config, cost, unit_costs,
                                            sample_mb, regular, M, by_size)
    first, total = _isolated_span(len(oversize), int(regular.sum()), M, topology.world_size)
    isolated = np.arange(first, first + -(-len(oversize) // topology.world_size), dtype=np.int64)
    if len(oversize):
        _place_isolated(inputs, topology, oversize, first, unit_costs, sample_mb, sample_rank,
                        item_rank)
    plan = StepPlan(
        inputs=inputs, topology=topology, num_microbatches=total,
        sample_mb=sample_mb, sample_rank=sample_rank, item_rank=item_rank, cost=config.cost,
        bytes_per_token={p: config.bytes_for(p) for p in ENCODER_PHASES},
        llm_capacity=config.llm_capacity, encoder_capacity=config.encoder_capacity,
        isolated_microbatches=isolated,
    )
    if config.encoder_capacity:
        plan = repair_capacity(plan)
    return plan


def _splits(cost: np.ndarray, big: np.ndarray, idx: np.ndarray, inputs: StepInputs,
            config: PlannerConfig, M: int, W: int, rng: np.random.Generator,
            llm_order: np.ndarray, units: tuple[np.ndarray, np.ndarray] | None = None
            ) -> Iterator[np.ndarray]:
    """Micro-batch of each sample in `idx`, best first: the cost split if it fits the
    capacities (`_split_fits`); else the greedy split held to them (`_split_greedy` with
    shares, filling micro-batches to each of `_HELD_FILLS` in turn; the first and an LPT
    over all rank x micro-batch bins in order of their bound), the split without
    concentrating, and the split by capacity shares alone, each that fits and then, whatever
    fits, the last. `_plan_with` takes the first its ranks can hold. `llm_order`: positions
    in `idx` by decreasing LLM cost (ties by position). `units`: `sample_unit_counts` of all
    samples (the bounds then count whole units, and the whole-row split joins the held ones
    where it fits; see `split_microbatches`)."""
    c, b = cost.take(idx, axis=1), big.take(idx, axis=1)  # C order: row sums 10x faster
    u = None if units is None else (np.ascontiguousarray(units[0].take(idx, axis=1)),
                                     np.ascontiguousarray(units[1].take(idx, axis=1)))
    # the greedy split's order of the samples: split_microbatches' greedy and the held ones
    # below take them in the same order
    greedy = _greedy_order(c, b, c.sum(axis=1) / (W * M), M, W) \
        if M > 1 and len(idx) and config.room_slack < 1 else None
    mb = split_microbatches(cost, big, idx, M, W, rng, slack=config.room_slack,
                            greedy_order=greedy, units=units)
    share = raw = _capacity_shares(inputs, config, idx)
    if share.shape[1]:
        # Samples over half a capacity cannot share a rank's micro-batch: at most W of them
        # fit one. A column worth _FILL each holds a split to that count like a capacity.
        large = (share > 0.5).any(axis=1) * _FILL
        share = np.column_stack([share, large])
    if _split_fits(share, mb, M, W):
        yield mb
        if not share.shape[1]:
            return
    first, rows = [], None
    for fill in _HELD_FILLS:  # fuller micro-batches are harder to pack on ranks: less, then
        scaled = share * (_FILL / fill)
        if greedy is None:
            greedy = _greedy_order(c, b, c.sum(axis=1) / (W * M), M, W)
        held = _split_greedy(c, b, c.sum(axis=1) / (W * M), M, W, scaled, order=greedy)
        if _split_fits(scaled, held, M, W):
            _polish_split(c, b, held, M, W, scaled, _FILL * W)
            first.append(held)
        if fill == _HELD_FILLS[0]:
            # LPT of the LLM cost over all W x M (rank, micro-batch) bins, kept if its bins
            # hold the capacities (a packing comes with it); it and the fullest held split
            # go first in order of their bound, sum_m,p max(total/W, largest).
            # (its input largest first: LPT takes the samples in the same order, and the
            # sort it starts with is then O(n))
            bins = np.empty(len(idx), dtype=np.int64)
            bins[llm_order] = lpt_heap(c[PHASES.index(LLM_PHASE), llm_order], W * M)
            if all(np.bincount(bins, weights=raw[:, j], minlength=W * M).max() <= 1
                   for j in range(raw.shape[1])):
                first.append(bins // W)
            bounds = [_split_bound(c, b, split, M, W, u) for split in first]
            if u is not None and M > 1 and len(idx):
                # the whole-row split, after those its bound ties; its exact fit is checked
                # only when its turn comes (the ones before it seldom all fail)
                rows = _split_rows(np.concatenate(greedy), M, W)
                first.append(rows)
                bounds.append(_split_bound(c, b, rows, M, W, u))
            for k in np.argsort(bounds, kind="stable"):
                if first[k] is rows and not (_split_fits(share, rows, M, W) or _rows_fit(
                        inputs, config, idx, raw, rows, M, W)):
                    continue
                yield first[k]
            first = []
            continue
        yield from first
        first = []
    level = split_microbatches(cost, big, idx, M, W, rng, slack=1.0)
    if _split_fits(share, level, M, W):
        yield level
    yield _split_by_capacity(share, M)


def _place_regular(inputs: StepInputs, topology: Topology, config: PlannerConfig,
                   cost: np.ndarray, unit_costs: dict[str, np.ndarray], sample_mb: np.ndarray,
                   regular: np.ndarray, M: int, by_size: dict[str, np.ndarray]
                   ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(LLM rank of every sample, encoder rank of every item per phase) for the `regular`
    samples, micro-batch by micro-batch. Each micro-batch's items go in largest first (the
    order `by_size` has them in: per encoder phase, the regular samples' items by decreasing
    cost, ties by index): the placement orders them by size many times, and on sizes that
    come sorted that is one counting sort (`balance.order_by_key_then_size`). by_size[LLM]:
    the regular samples by decreasing LLM cost, whose sort `place_samples` takes."""
    sample_rank = np.zeros(inputs.num_samples, dtype=np.int64)
    item_rank = {p: np.zeros(len(inputs.items(p)), dtype=np.int64) for p in ENCODER_PHASES}
    mb_of = {p: sample_mb[inputs.items(p).sample[o]] for p, o in by_size.items()
             if p != LLM_PHASE}
    llm_order = by_size[LLM_PHASE]
    llm_mb = sample_mb[llm_order]
    at = np.zeros(inputs.num_samples, dtype=np.int64)
    for m in range(M):
        samp = np.flatnonzero(regular & (sample_mb == m))
        items_in = {p: by_size[p][mb_of[p] == m] for p in ENCODER_PHASES}
        at[samp] = np.arange(len(samp))
        sample_rank[samp], ranks = _place_microbatch(cost, samp, unit_costs, items_in, inputs,
                                                     topology, config,
                                                     at[llm_order[llm_mb == m]])
        for p in ENCODER_PHASES:
            item_rank[p][items_in[p]] = ranks[p]
    return sample_rank, item_rank


def _by_decreasing_size(sizes: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """`np.argsort(-sizes, kind="stable")` for an encoder's items, whose cost is a function of
    their length: a counting sort over their few distinct lengths (`_by_length_rank`), else
    (a cost that is not, lengths out of its range) numpy's sort."""
    out = np.empty(len(sizes), dtype=np.int64)
    if _by_length_rank(np.ascontiguousarray(sizes, dtype=np.float64),
                       np.ascontiguousarray(lens, dtype=np.int64), out):
        return out
    return np.argsort(-sizes, kind="stable")


@kernel
def _by_length_rank(sizes, lens, out):
    """Into `out`, the positions by decreasing size, ties by position, where sizes[i] depends on
    lens[i] only (checked: equal lengths, equal sizes) and lengths lie in [0, max(4n, 2**16)):
    the distinct lengths ranked by decreasing size (equal sizes, one rank), then a counting sort
    of the positions by their length's rank. True if done; False (`out` untouched) if not."""
    n = lens.shape[0]
    hi = -1
    for i in range(n):
        if lens[i] < 0:
            return False
        hi = max(hi, lens[i])
    if hi >= max(4 * n, 1 << 16):
        return False
    size_of = np.zeros(hi + 1)
    seen = np.zeros(hi + 1, np.bool_)
    for i in range(n):
        ln = lens[i]
        if not seen[ln]:
            seen[ln] = True
            size_of[ln] = sizes[i]
        elif not size_of[ln] == sizes[i]:  # (a NaN size fails here too)
            return False
    lengths = np.flatnonzero(seen)
    distinct = size_of[lengths]
    for v in distinct:
        if v != v:
            return False
    by_size = np.argsort(-distinct, kind="mergesort")
    rank = np.zeros(hi + 1, np.int64)
    r = -1
    for t in range(by_size.shape[0]):
        if t == 0 or distinct[by_size[t]] != distinct[by_size[t - 1]]:
            r += 1
        rank[lengths[by_size[t]]] = r
    fill = np.zeros(r + 2, np.int64)
    for i in range(n):
        fill[rank[lens[i]] + 1] += 1
    for k in range(1, r + 2):
        fill[k] += fill[k - 1]
    for i in range(n):
        k = rank[lens[i]]
        out[fill[k]] = i
        fill[k] += 1
    return True


def find_oversize(inputs: StepInputs, config: PlannerConfig) -> np.ndarray:
    """Samples that fit no (rank, micro-batch): too many LLM tokens or one item too large."""
    S = inputs.num_samples
    bad = np.zeros(S, dtype=bool)
    if config.llm_capacity is not None:
        bad |= inputs.llm_len > config.llm_capacity
    for p, cap in config.encoder_capacity.items():
        it = inputs.items(p)
        padded = config.cost.phase(p).padded_len(it.enc_len)
        bad[it.sample[padded > cap]] = True
    return np.flatnonzero(bad)


def _capacity_shares(inputs: StepInputs, config: PlannerConfig, idx: np.ndarray) -> np.ndarray:
    """(len(idx), capacities): each sample's tokens of every capped phase over its capacity."""
    shares = []
    if config.llm_capacity is not None:
        shares.append(inputs.llm_len[idx] / config.llm_capacity)
    pos = np.full(inputs.num_samples, -1, dtype=np.int64)
    pos[idx] = np.arange(len(idx))
    for p, cap in config.encoder_capacity.items():
        it = inputs.items(p)
        at = pos[it.sample]
        keep = at >= 0
        tok = config.cost.phase(p).padded_len(it.enc_len)[keep]
        shares.append(np.bincount(at[keep], weights=tok, minlength=len(idx)) / cap)
    return np.stack(shares, axis=1) if shares else np.zeros((len(idx), 0))


def _split_by_capacity(share: np.ndarray, M: int) -> np.ndarray:
    """Micro-batch of each sample by its `share` of each capacity: heaviest first, into
    the micro-batch whose fullest phase stays lowest. For steps whose cost-balanced splits
    crowd one micro-batch past what its ranks can hold (the step-time optimum often puts the
    heavy samples together)."""
    full = np.zeros((M, share.shape[1]))
    mb = np.empty(len(share), dtype=np.int64)
    for i in np.argsort(-share.max(axis=1, initial=0), kind="stable"):
        m = int(np.argmin((full + share[i]).max(axis=1, initial=0)))
        mb[i] = m
        full[m] += share[i]
    return mb


#: A split may fill a micro-batch's capacities up to this fraction of W x capacity: the rest
#: is the room its placement on ranks needs.
_FILL = 0.9
#: The fills the capacity-held greedy split tries in turn, when its ranks cannot hold the
#: previous one (bin packing of near-capacity samples can fail well under W x capacity).
_HELD_FILLS = (0.9, 0.8, 0.7)


def _rows_fit(inputs: StepInputs, config: PlannerConfig, idx: np.ndarray, raw: np.ndarray,
              mb: np.ndarray, M: int, W: int) -> bool:
    """Whether the ranks can hold the split exactly where `_split_fits`' room is too coarse
    (near-equal samples of most of a capacity each, `_split_rows`): under an LLM capacity,
    each micro-batch's samples pack under it (`_repack`, the packing `_place_microbatch`'s
    repair falls back to, so placing it cannot fail on it), and the encoder capacities'
    micro-batch totals within `_FILL` x W (`raw`: `_capacity_shares`)."""
    if config.llm_capacity is None:
        return False
    if not _split_fits(raw[:, 1:], mb, M, W):
        return False
    tok = inputs.llm_len[idx].astype(np.float64)
    cap = config.llm_capacity
    # what no packing can beat first: W x capacity, and no two over half a capacity on a rank
    if (np.bincount(mb, weights=tok, minlength=M).max() > W * cap
            or np.bincount(mb[tok > cap / 2], minlength=M).max(initial=0) > W):
        return False
    return all(_repack(tok[mb == m], W, cap) is not None for m in range(M))


def _split_fits(share: np.ndarray, mb: np.ndarray, M: int, W: int) -> bool:
    """Whether the split leaves every micro-batch's tokens comfortably under W x capacity."""
    return all(np.bincount(mb, weights=share[:, k], minlength=M).max(initial=0) <= _FILL * W
               for k in range(share.shape[1]))


def _isolated_span(n_oversize: int, n_regular: int, M: int, W: int) -> tuple[int, int]:
    """The first isolated micro-batch and the step's micro-batches: oversize samples fill
    micro-batches of their own after the M regular ones, W to each; in a step where no sample
    is regular, they take the first ones (M stays the least, as every step's)."""
    extra = -(-n_oversize // W)
    if n_regular == 0 and n_oversize:
        return 0, max(M, extra)
    return M, M + extra


def _place_isolated(inputs, topology, oversize, first_mb, unit_costs, sample_mb, sample_rank,
                    item_rank) -> None:
    """Oversize samples alone on a rank each, W per extra micro-batch, spread over nodes first;
    a sample's encoder items are spread over its node's ranks."""
    W, g = topology.world_size, topology.ranks_per_node
    rank_seq = np.arange(W).reshape(W // g, g).T.ravel()  # node-major interleave
    for k, s in enumerate(oversize):
        r = int(rank_seq[k % W])
        sample_mb[s], sample_rank[s] = first_mb + k // W, r
        base = (r // g) * g
        for p in ENCODER_PHASES:
            it = inputs.items(p)
            sel = np.flatnonzero(it.sample == s)
            if len(sel):
                loads = np.zeros((1, g))
                item_rank[p][sel] = base + lpt_rounds(unit_costs[p][sel],
                                                      np.zeros(len(sel), dtype=np.int64), loads)


def _repack(tok: np.ndarray, W: int, cap: float) -> np.ndarray | None:
    """Ranks for units of sizes `tok` over W ranks of capacity `cap`, largest first: into the
    roomiest rank that fits (balanced), else into the fullest that fits (packs tighter);
    None if neither fits them all."""
    load = np.zeros(W)
    out = lpt_heap(tok, W, load)  # roomiest first is LPT: it fits iff the lightest rank did
    if load.max(initial=0) <= cap:
        return out
    # best fit decreasing: each unit onto the fullest rank it fits
    return out if _best_fit(tok, np.argsort(-tok, kind="stable"), W, float(cap), out) else None


@kernel
def _best_fit(tok, order, W, cap, out):
    """Units in `order`, each onto the fullest of W ranks it fits (`out[u]` its rank); False
    at the first unit that fits none: Python's bisect on a list of (load, -rank) that starts
    as [(0.0, 0), (0.0, -1), ..., (0.0, -(W - 1))], each unit popping the entry left of
    bisect_right(list, (cap - size, 1)) and insort-ing it back with its new load. So among
    equal loads above 0 the lowest rank; where no loaded rank fits, the highest rank never
    used; where none is left, the rank a unit of size 0 last left at load 0 (those go to the
    front of the list, each after the previous). The loaded ranks are kept sorted in blocks
    (`_fullest_fitting`, `_insert_sorted`): a unit costs a scan of ~sqrt(W) blocks and a shift
    inside one, not a shift of up to W entries in one list."""
    B = max(4, int(np.sqrt(W)))  # entries a block holds after a rebalance; at most 2B
    blocks = -(-W // B)
    bl, bn = np.empty((blocks, 2 * B)), np.empty((blocks, 2 * B), np.int64)
    cnt = np.zeros(blocks, np.int64)
    unused, parked, top = W, np.empty(W, np.int64), 0  # ranks unused - 1 .. 0: never used
    for u in order:
        if tok[u] > cap:
            return False
        load, neg = _fullest_fitting(bl, bn, cnt, cap - tok[u])
        if neg > 0:  # no loaded rank fits: one at load 0
            if unused:
                unused -= 1
                neg = -unused
            elif top:
                top -= 1
                neg = -parked[top]
            else:
                return False
            if tok[u] == 0:
                parked[top] = -neg
                top += 1
                out[u] = -neg
                continue
        out[u] = -neg
        _insert_sorted(bl, bn, cnt, B, load + tok[u], neg)
    return True


@kernel
def _fullest_fitting(bl, bn, cnt, room):
    """Remove and return the largest (load, -rank) entry with load <= `room` from the blocks
    (in block order, each sorted; empty blocks skipped); (0.0, 1) if there is none."""
    jb = -1
    for b in range(cnt.shape[0]):
        if cnt[b]:
            if bl[b, 0] > room:
                break
            jb = b
    if jb < 0:
        return 0.0, 1
    lo, hi = 0, cnt[jb]
    while lo < hi:  # bisect_right on the loads
        mid = (lo + hi) // 2
        if room < bl[jb, mid]:
            hi = mid
        else:
            lo = mid + 1
    k, n = lo - 1, cnt[jb] - 1
    load, neg = bl[jb, k], bn[jb, k]
    for i in range(k, n):
        bl[jb, i], bn[jb, i] = bl[jb, i + 1], bn[jb, i + 1]
    cnt[jb] = n
    return load, neg


@kernel
def _insert_sorted(bl, bn, cnt, B, load, neg):
    """Insert (load, neg) into the first block whose last entry is larger (else the last
    non-empty block), in order; a full block (2B entries) first spreads every entry over the
    blocks again, B a block."""
    while True:
        jb, last = -1, 0
        for b in range(cnt.shape[0]):
            if cnt[b]:
                last, x = b, cnt[b] - 1
                if bl[b, x] > load or (bl[b, x] == load and bn[b, x] > neg):
                    jb = b
                    break
        jb = last if jb < 0 else jb
        if cnt[jb] < bl.shape[1]:
            break
        _rebalance(bl, bn, cnt, B)
    n = cnt[jb]
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        if load < bl[jb, mid] or (load == bl[jb, mid] and neg < bn[jb, mid]):
            hi = mid
        else:
            lo = mid + 1
    for i in range(n, lo, -1):
        bl[jb, i], bn[jb, i] = bl[jb, i - 1], bn[jb, i - 1]
    bl[jb, lo], bn[jb, lo] = load, neg
    cnt[jb] = n + 1


@kernel
def _rebalance(bl, bn, cnt, B):
    """Every entry of the blocks, in order, spread again B a block from the first (the blocks
    hold at most W <= B x blocks entries)."""
    total = cnt.sum()
    fl, fn = np.empty(total), np.empty(total, np.int64)
    x = 0
    for b in range(cnt.shape[0]):
        for i in range(cnt[b]):
            fl[x], fn[x] = bl[b, i], bn[b, i]
            x += 1
    cnt[:] = 0
    for x in range(total):
        b = x // B
        bl[b, cnt[b]], bn[b, cnt[b]] = fl[x], fn[x]
        cnt[b] += 1


def repair_capacity(plan: StepPlan) -> StepPlan:
    """Move encoder items off (rank, micro-batch)s over their phase's capacity onto the roomiest
    rank of the same micro-batch (same node first); where moving items one by one does not get
    there, pack the micro-batch's items of that phase again, largest first (`_repack`);
    PlanError if some rank still cannot be brought under capacity. (The LLM capacity is held
    by `_place_microbatch`, before the items are placed, so they follow their samples.)"""
    inp, topo = plan.inputs, plan.topology
    free = np.ones(plan.num_microbatches, dtype=bool)
    free[plan.isolated_microbatches] = False
    item_rank = dict(plan.item_rank)
    for p, cap in plan.encoder_capacity.items():
        it = inp.items(p)
        tok = plan.cost.phase(p).padded_len(it.enc_len).astype(np.float64)
        item_rank[p] = _repair_units(plan.sample_mb[it.sample], item_rank[p], tok, cap, free,
                                     topo, p)
    if all(item_rank[p] is plan.item_rank[p] for p in item_rank):
        return plan
    return StepPlan(
        inputs=inp, topology=topo, num_microbatches=plan.num_microbatches,
        sample_mb=plan.sample_mb, sample_rank=plan.sample_rank, item_rank=item_rank,
        cost=plan.cost, bytes_per_token=plan.bytes_per_token, llm_capacity=plan.llm_capacity,
        encoder_capacity=plan.encoder_capacity, isolated_microbatches=plan.isolated_microbatches,
    )


def _repair_units(mb: np.ndarray, rank: np.ndarray, tok: np.ndarray, cap: float,
                  free: np.ndarray, topo: Topology, what: str) -> np.ndarray:
    """`rank` if every (rank, free micro-batch) holds at most `cap` tokens, else a repaired
    copy (see `repair_capacity`)."""
    W, M = topo.world_size, len(free)
    load = np.bincount(mb * W + rank, weights=tok, minlength=W * M)
    over = [int(grp) for grp in np.flatnonzero(load > cap) if free[grp // W]]
    if not over:
        return rank
    rank = rank.copy()
    # a move only lands where it fits, so no unit enters a group still over: each group's
    # units are those it started with, until a repack reshuffles the micro-batch
    role = np.full(W * M, -1, dtype=np.int64)
    role[over] = np.arange(len(over))
    every = np.arange(len(rank))
    ptr, units = _members(every, mb * W + rank, role, len(over))
    for k, grp in enumerate(over):
        m, r = divmod(grp, W)
        _move_smallest_away(rank, tok, load, float(cap), units[ptr[k]:ptr[k + 1]], m, r, W,
                            topo.ranks_per_node)
        if load[grp] > cap:
            in_mb = np.flatnonzero(mb == m)
            packed = _repack(tok[in_mb], W, cap)
            if packed is not None:
                rank[in_mb] = packed
                load[m * W:(m + 1) * W] = np.bincount(packed, weights=tok[in_mb], minlength=W)
                ptr, units = _members(every, mb * W + rank, role, len(over))
        if load[grp] > cap:
            raise PlanError(f"rank {r} micro-batch {m}: cannot bring {what} tokens "
                            f"{int(load[grp])} under capacity {cap}")
    return rank


@kernel
def _move_smallest_away(rank, tok, load, cap, members, m, r, W, g):
    """`members`, the units of (rank r, micro-batch m) in index order, smallest first (ties:
    lowest index), while r holds more than `cap`: each to the rank d != r of m with the most
    room cap - load that fits it (room >= its size), of r's node (d // g == r // g) if one
    fits there (ties: lowest d); a unit that fits nowhere stays. Updates the repair's own
    `rank` and `load` (W per micro-batch) in place."""
    grp, first = m * W + r, r // g * g
    for u in members[np.argsort(tok[members], kind="mergesort")]:
        if load[grp] <= cap:
            break
        dst = _roomiest(load[m * W:(m + 1) * W], cap, tok[u], first, first + g, r)  # r's node
        if dst < 0:
            dst = _roomiest(load[m * W:(m + 1) * W], cap, tok[u], 0, W, r)
        if dst < 0:
            continue
        rank[u] = dst
        load[grp] -= tok[u]
        load[m * W + dst] += tok[u]


@kernel
def _roomiest(load, cap, size, lo, hi, skip):
    """The rank d in lo..hi-1, not `skip`, with the most room cap - load[d] >= `size`, the
    first on ties; -1 if none."""
    best, most = -1, 0.0
    for d in range(lo, hi):
        room = cap - load[d]
        if d != skip and room >= size and (best < 0 or room > most):
            best, most = d, room
    return best
