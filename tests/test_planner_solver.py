"""The split's and the capacity repair's compiled kernels, each against its rule written
plainly (one micro-batch, one rank, one unit at a time)."""

from __future__ import annotations

import bisect

import numpy as np
import pytest

from dispatcher_server.planner.solver import (
    _FILL, _add_members, _best_fit, _by_decreasing_size, _by_length_rank, _greedy_blocks,
    _greedy_order, _group_max, _group_sums, _move_smallest_away, _polish_split, _top2,
)

pytestmark = pytest.mark.timeout(60)


def _greedy_blocks_by_the_rule(c, b, members, block, Tc, Lc, W, share, full):
    """Each block of `members` in turn to the micro-batch where it raises sum_p max(T/W, L)
    least (within 1e-9 x max(|least|, largest bound, 1)), then the lowest shr . T, then the
    lowest index; with `share`, among those whose capacities stay within _FILL x W (else the
    first whose fullest stays lowest)."""
    P, M = c.shape[0], len(Tc)
    T, L = Tc.tolist(), Lc.tolist()
    F = None if full is None else full.tolist()
    csum = c.sum(axis=1)
    shr = [1.0 / x if x > 0 else 0.0 for x in csum]

    def bound(t, lg):
        return [lg[q] if lg[q] > t[q] / W else t[q] / W for q in range(P)]

    out = []
    for start in range(0, len(members), block):
        blk = members[start:start + block]
        bs = [sum(float(c[q, u]) for u in blk) for q in range(P)]
        bx = [max(float(b[q, u]) for u in blk) for q in range(P)]
        cands = list(range(M))
        if F is not None:
            bf = [sum(float(share[u, j]) for u in blk) for j in range(share.shape[1])]
            after = [max(F[m][j] + bf[j] for j in range(len(bf))) for m in range(M)]
            cands = [m for m in range(M) if after[m] <= _FILL * W] or [after.index(min(after))]
        olds = [bound(T[m], L[m]) for m in range(M)]
        inc = {}
        for m in cands:
            new = bound([T[m][q] + bs[q] for q in range(P)],
                        [max(L[m][q], bx[q]) for q in range(P)])
            inc[m] = 0.0
            for q in range(P):
                inc[m] += new[q] - olds[m][q]
        lo = min(inc.values())
        bounds = [sum(om) for om in olds]
        eps = 1e-9 * max(abs(lo), max(bounds), 1.0)
        ties = {m: sum(shr[q] * T[m][q] for q in range(P)) for m in cands if inc[m] <= lo + eps}
        m = min(ties, key=lambda k: (ties[k], k))
        out += [m] * len(blk)
        T[m] = [T[m][q] + bs[q] for q in range(P)]
        L[m] = [max(L[m][q], bx[q]) for q in range(P)]
        if F is not None:
            F[m] = [F[m][j] + bf[j] for j in range(len(bf))]
    return np.array(out, dtype=np.int64), np.array(T), np.array(L), F and np.array(F)


@pytest.mark.parametrize("seed", range(40))
def test_greedy_blocks_places_each_block_where_the_bound_rises_least(seed):
    rng = np.random.default_rng(seed)
    P, n, M, W = 4, int(rng.integers(1, 200)), int(rng.integers(1, 6)), int(rng.integers(1, 9))
    # quarter-integers: block sums are exact in any order, and bounds and loads tie
    c = rng.integers(0, 12, (P, n)) * (rng.random((P, n)) < 0.6) / 4
    c[int(rng.integers(P))] = 0.0  # a phase no sample touches
    b = np.minimum(c, rng.integers(0, 6, (P, n)) / 4)
    members = rng.permutation(n)[:int(rng.integers(1, n + 1))]
    block = int(rng.integers(1, 6))
    Tc = rng.integers(0, 3, (M, P)) * rng.integers(0, 20) / 4
    Lc = np.minimum(Tc, rng.integers(0, 3, (M, P)) / 4)
    share = full = None
    if rng.random() < 0.5:
        share = rng.integers(0, 8, (n, int(rng.integers(1, 3)))) / 4
        full = rng.integers(0, 4 * W, (M, share.shape[1])) / 4
    want = _greedy_blocks_by_the_rule(c, b, members, block, Tc, Lc, W, share, full)
    got = _greedy_blocks(c, b, members, block, Tc, Lc, W, share, full)
    assert np.array_equal(got, want[0])
    assert np.array_equal(Tc, want[1]) and np.array_equal(Lc, want[2])
    assert full is None or np.array_equal(full, want[3])


def _move_smallest_away_by_the_rule(mb, rank, tok, load, cap, m, r, W, g):
    """Rank r's units in micro-batch m, smallest first, each to the roomiest rank that fits it
    (its node's first, then any; ties: lowest rank), until r holds at most `cap`."""
    rank, load = rank.copy(), load.copy()
    units = sorted((u for u in range(len(mb)) if mb[u] == m and rank[u] == r),
                   key=lambda u: (tok[u], u))
    for u in units:
        if load[m * W + r] <= cap:
            break
        fits = [d for d in range(W) if d != r and cap - load[m * W + d] >= tok[u]]
        pick = [d for d in fits if d // g == r // g] or fits
        if pick:
            dst = max(pick, key=lambda d: (cap - load[m * W + d], -d))
            rank[u] = dst
            load[m * W + r] -= tok[u]
            load[m * W + dst] += tok[u]
    return rank, load


@pytest.mark.parametrize("seed", range(40))
def test_move_smallest_away_moves_units_to_the_roomiest_fitting_rank(seed):
    rng = np.random.default_rng(seed)
    g = int(rng.choice([1, 2, 4]))
    W, M, n = g * int(rng.integers(1, 5)), int(rng.integers(1, 3)), int(rng.integers(1, 120))
    m, r = int(rng.integers(M)), int(rng.integers(W))
    mb, rank = rng.integers(0, M, n), rng.integers(0, W, n)
    rank[rng.random(n) < 0.5] = r  # r over capacity, the other ranks with room
    tok = rng.integers(0, 10, n).astype(np.float64)  # integers: sizes and rooms tie
    load = np.bincount(mb * W + rank, weights=tok, minlength=W * M)
    top = int(load[m * W + r])
    cap = float(rng.integers(min(top, int(load[m * W:(m + 1) * W].max(initial=0) / 2)), top + 1))
    want_rank, want_load = _move_smallest_away_by_the_rule(mb, rank, tok, load, cap, m, r, W, g)
    _move_smallest_away(rank, tok, load, cap, np.flatnonzero((mb == m) & (rank == r)), m, r,
                        W, g)
    assert np.array_equal(rank, want_rank)
    assert np.array_equal(load, want_load)


def _best_fit_by_the_rule(tok, order, W, cap):
    """Each unit onto the entry of a bisect-ordered list of (load, -rank) left of where
    (cap - size, 1) would go, the list starting as [(0.0, 0), (0.0, -1), ...]; None at the
    first unit with no such entry."""
    bins, out = [(0.0, -r) for r in range(W)], {}
    for u in order:
        k = bisect.bisect_right(bins, (cap - tok[u], 1)) - 1
        if k < 0:
            return None
        load, neg = bins.pop(k)
        out[u] = -neg
        bisect.insort(bins, (load + tok[u], neg))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_best_fit_takes_the_fullest_rank_that_fits_in_bisect_order(seed):
    rng = np.random.default_rng(seed)
    # few ranks, and enough for the kernel's blocks to fill and be spread again
    W = int(rng.integers(1, 12)) if seed % 2 else int(rng.integers(12, 400))
    n = int(rng.integers(1, 80 if seed % 2 else 8 * W))
    tok = rng.integers(0, 8, n).astype(np.float64)  # integers: loads tie
    order = rng.permutation(n)
    if rng.random() < 0.5:
        order = np.argsort(-tok, kind="stable")
    cap = float(rng.integers(int(tok.max()), max(int(tok.max()), int(tok.sum() / W * 1.3)) + 2))
    want = _best_fit_by_the_rule(tok.tolist(), order.tolist(), W, cap)
    out = np.full(n, -1, dtype=np.int64)
    assert _best_fit(tok, order, W, cap, out) == (want is not None)
    if want is not None:
        assert out.tolist() == [want[u] for u in range(n)]


def _largest(b, mb, q, m, without=-1):
    """The largest unit of phase q in micro-batch m (0 if none), leaving out sample `without`."""
    return max([0.0] + [float(b[q, i]) for i in range(len(mb)) if mb[i] == m and i != without])


@pytest.mark.parametrize("seed", range(20))
def test_group_sums_and_maxima_add_in_sample_order(seed):
    rng = np.random.default_rng(seed)
    R, n, M = int(rng.integers(1, 4)), int(rng.integers(0, 300)), int(rng.integers(1, 5))
    x, mb = rng.lognormal(0, 2, (R, n)) * (rng.random((R, n)) < 0.8), rng.integers(0, M, n)
    sums = np.zeros((R, M))
    for i in range(n):  # in sample order, as np.bincount adds its weights
        for k in range(R):
            sums[k, mb[i]] += x[k, i]
    assert np.array_equal(_group_sums(x, mb, M), sums)
    assert np.array_equal(_group_sums(np.ascontiguousarray(x.T).T, mb, M), sums)  # a view
    assert np.array_equal(_group_max(x, mb, M), [[_largest(x, mb, k, m) for m in range(M)]
                                                 for k in range(R)])


@pytest.mark.parametrize("seed", range(20))
def test_top2_names_the_lowest_sample_among_equal_largest_units(seed):
    rng = np.random.default_rng(seed)
    P, n, M = 3, int(rng.integers(0, 60)), int(rng.integers(1, 5))
    b, mb = rng.integers(0, 4, (P, n)).astype(np.float64), rng.integers(0, M, n)  # ties
    first, who, second = _top2(b, mb, M)
    for q in range(P):
        for m in range(M):
            top = _largest(b, mb, q, m)
            owner = min((i for i in range(n) if mb[i] == m and b[q, i] == top and top > 0),
                        default=-1)
            assert (first[q, m], who[q, m]) == (top, owner)
            assert second[q, m] == _largest(b, mb, q, m, without=owner)


def _polish_split_by_the_rule(c, b, mb, M, W, share, limit, max_iter=4):
    """Up to `max_iter` times: the first (phase, micro-batch m), in order, whose largest unit
    exceeds its total/W and belongs to a sample s (the lowest on ties) moves s to the first
    micro-batch d != m with capacities within `limit` that lowers bound_m + bound_d most, if
    that gains more than 1e-9 x bound_m; none: stop. (Sizes exact: any order of sums.)"""
    mb, (P, n) = mb.copy(), c.shape
    for _ in range(max_iter):
        T = [[sum(c[q, i] for i in range(n) if mb[i] == m) for m in range(M)] for q in range(P)]
        F = [[sum(share[i, j] for i in range(n) if mb[i] == m) for m in range(M)]
             for j in range(share.shape[1])]

        def bound(m, add=-1, drop=-1):
            return sum(max((T[q][m] + (c[q, add] if add >= 0 else 0) - (c[q, drop] if drop >= 0
                            else 0)) / W, _largest(b, mb, q, m, without=drop),
                           b[q, add] if add >= 0 else 0.0) for q in range(P))
        move = None
        for q, m in ((q, m) for q in range(P) for m in range(M)):
            top = _largest(b, mb, q, m)
            s = min((i for i in range(n) if mb[i] == m and b[q, i] == top and top > 0),
                    default=-1)
            if s < 0 or not top > T[q][m] / W:
                continue
            gains = [-np.inf if d == m or any(F[j][d] + share[s, j] > limit
                                              for j in range(share.shape[1]))
                     else bound(m) + bound(d) - bound(m, drop=s) - bound(d, add=s)
                     for d in range(M)]
            d = gains.index(max(gains))
            if gains[d] > 1e-9 * bound(m):
                move = s, d
                break
        if move is None:
            break
        mb[move[0]] = move[1]
    return mb


@pytest.mark.parametrize("seed", range(40))
def test_polish_split_moves_a_bound_setting_unit_where_the_bounds_drop_most(seed):
    rng = np.random.default_rng(seed)
    P, n, M, W = 3, int(rng.integers(1, 40)), int(rng.integers(1, 5)), int(rng.choice([1, 2, 4]))
    # quarter-integers over a power of two: every sum exact, so gains tie exactly
    c = rng.integers(0, 8, (P, n)) * (rng.random((P, n)) < 0.7) / 4
    giants = rng.random(n) < 0.15
    c[:, giants] *= 8
    b = np.minimum(c, rng.integers(0, 3, (P, n)) / 4 + c * (rng.random((P, n)) < 0.5))
    mb = rng.integers(0, M, n)
    share, limit = np.zeros((n, 0)), 0.0
    if rng.random() < 0.5:
        share = rng.integers(0, 4, (n, int(rng.integers(1, 3)))) / 4
        limit = float(rng.integers(0, 2 * n)) / 4
    max_iter = int(rng.integers(1, 6))
    want = _polish_split_by_the_rule(c, b, mb, M, W, share, limit, max_iter)
    _polish_split(c, b, mb, M, W, share, limit, max_iter)
    assert np.array_equal(mb, want)


def _by_length_rank_by_the_rule(sizes, lens):
    """Positions by decreasing size, ties by position; None where the kernel must decline: a
    negative length, one at or above max(4n, 2**16), two equal lengths with different sizes,
    or a NaN size."""
    n = len(lens)
    if n and (min(lens) < 0 or max(lens) >= max(4 * n, 1 << 16)):
        return None
    size_of = {}
    for s, ln in zip(sizes, lens):
        if s != s or size_of.setdefault(ln, s) != s:
            return None
    return sorted(range(n), key=lambda i: (-sizes[i], i))


@pytest.mark.parametrize("seed", range(30))
def test_by_length_rank_orders_items_by_decreasing_size_of_their_length(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 300))
    lens = rng.integers(0, int(rng.choice([3, 40, 1 << 17])), n)
    # a cost of the length: strictly rising, flat in windows (equal sizes for several
    # lengths), or not monotone at all
    table = rng.choice([np.arange(1 << 17) * 1.5, np.ceil(np.arange(1 << 17) / 7) * 2.0,
                        rng.integers(0, 5, 1 << 17).astype(np.float64)])
    sizes = table[lens]
    if n and rng.random() < 0.2:
        sizes[int(rng.integers(n))] = float(rng.choice([np.nan, 0.25]))  # not the length's
    if n and rng.random() < 0.1:
        lens[int(rng.integers(n))] = -1
    want = _by_length_rank_by_the_rule(sizes.tolist(), lens.tolist())
    out = np.full(n, -7, dtype=np.int64)
    done = _by_length_rank(sizes, lens, out)
    if want is None:
        assert not done and (out == -7).all()
    else:
        assert done and out.tolist() == want
    if not np.isnan(sizes).any():
        assert np.array_equal(_by_decreasing_size(sizes, lens), np.argsort(-sizes, kind="stable"))


@pytest.mark.parametrize("seed", range(40))
def test_greedy_order_takes_giants_by_score_then_the_rest_by_size(seed):
    """The rule in numpy: giants (a unit above the threshold in a phase with work) by
    decreasing max_p b / tau, then the rest by decreasing sum_p c / tau, ties by index."""
    rng = np.random.default_rng(seed)
    P, n, M, W = 3, int(rng.integers(0, 80)), int(rng.integers(1, 4)), int(rng.integers(1, 9))
    c = rng.integers(0, int(rng.choice([2, 5, 50])), (P, n)).astype(np.float64)  # ties
    c[int(rng.integers(P))] *= rng.random() < 0.3  # sometimes a phase without work
    b = np.minimum(c, rng.integers(0, 30, (P, n)))
    threshold = rng.uniform(0, 40, P) if rng.random() < 0.5 else rng.integers(0, 30, P) * 1.0
    csum = c.sum(axis=1)
    tau = np.where(csum > 0, csum / (W * M), 1.0)
    is_giant = ((b > threshold[:, None]) & (csum > 0)[:, None]).any(axis=0)
    giants, rest = np.flatnonzero(is_giant), np.flatnonzero(~is_giant)
    score = (b[:, giants] / tau[:, None]).max(axis=0)
    size = (c[:, rest] / tau[:, None]).sum(axis=0)
    got_giants, got_rest = _greedy_order(c, b, threshold, M, W)
    assert got_giants.tolist() == giants[np.argsort(-score, kind="stable")].tolist()
    assert got_rest.tolist() == rest[np.argsort(-size, kind="stable")].tolist()


@pytest.mark.parametrize("seed", range(20))
def test_add_members_adds_each_micro_batchs_sums_and_maxima(seed):
    """The rule in numpy: one bincount per (phase, micro-batch) in member order, added to T;
    L raised to the largest unit of each."""
    rng = np.random.default_rng(seed)
    P, M, n = 3, int(rng.integers(1, 5)), int(rng.integers(0, 60))
    c = rng.lognormal(0.0, 2.0, (P, n)) * (rng.random((P, n)) < 0.7)
    b = c * rng.random((P, n))
    members = rng.permutation(n)[:int(rng.integers(0, n + 1))]
    mb = rng.integers(0, M, len(members))
    T, L = rng.lognormal(3.0, 1.0, (P, M)), rng.lognormal(1.0, 1.0, (P, M))
    key = (np.arange(P)[:, None] * M + mb).ravel()
    want_T = T + np.bincount(key, weights=c[:, members].ravel(), minlength=P * M).reshape(P, M)
    want_L = L.copy()
    np.maximum.at(want_L.reshape(-1), key, b[:, members].ravel())
    _add_members(c, b, members, mb, T, L)
    assert T.tolist() == want_T.tolist() and L.tolist() == want_L.tolist()
