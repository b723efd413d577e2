"""Number-partitioning primitives, vectorised over bins and groups of bins (nodes).

`lpt_rounds` is LPT that assigns a whole round of B items at once (the B largest left go to the
B least-loaded bins), so it ranks the bins items/B times instead of once per item; `lpt_home`
is the same over all bins, bent toward each item's home bin; `refine` repairs what batching
lost with moves and swaps between heavy and light bins, all pairs at once; `relabel_bins`
permutes finished bins onto ranks to keep embeddings local. `lpt_heap` and `karmarkar_karp` are
the textbook versions (baselines, and the sequential yardstick). Each kernel exists once: as
whole-array numpy where that does the work in a few passes (sorts, np.unique), compiled
(`jit.kernel`) where numpy would make many passes over arrays it mostly does not change, or
Python would loop over rounds or pairs: the rounds of `lpt_rounds` and `lpt_home`, every
iteration of refine (in groups, global, all pairs: the stop tests, the choice of pairs and the
pair or all-pairs step), and `relabel_bins`' greedy passes. Refine's choice of pairs is defined
so that a kernel computes it exactly: the mean load is the plain sum in bin order over the
bins, heavy bins are taken by (load desc, index asc), light ones among the others by (load
asc, index asc) (`_num_heavy`, `_extremes`).
"""

from __future__ import annotations

import heapq

import numpy as np

from .jit import kernel


def lpt_heap(sizes: np.ndarray, num_bins: int, loads: np.ndarray | None = None) -> np.ndarray:
    """Textbook LPT: largest item first (ties: lowest index) onto the least-loaded bin (ties:
    lowest bin), from empty bins or from `loads` (float64[num_bins], updated in place).
    O(n log n): a compiled binary heap of (load, bin) (`_lpt_heap`)."""
    sz = np.ascontiguousarray(sizes, dtype=np.float64)
    load = np.zeros(num_bins) if loads is None else np.array(loads, dtype=np.float64)
    out = np.empty(len(sz), dtype=np.int64)
    if len(sz):
        _lpt_heap(sz, load, out)
    if loads is not None:
        loads[:] = load
    return out


@kernel
def _lpt_heap(sz, load, out):
    """Items by decreasing size (ties: lowest index; a stable radix sort, `_load_order`) each
    onto the bin of least (load, bin), through a binary min-heap of the bins keyed by (load,
    bin); `load` and `out` are filled in place."""
    heap = _load_order(load)  # the bins by (load, bin): a valid heap
    B = heap.shape[0]
    for i in _load_order(-sz):
        b = heap[0]
        out[i] = b
        load[b] += sz[i]
        p = 0  # sift the root down
        while True:
            c = 2 * p + 1
            if c >= B:
                break
            if c + 1 < B and (load[heap[c + 1]] < load[heap[c]] or (
                    load[heap[c + 1]] == load[heap[c]] and heap[c + 1] < heap[c])):
                c += 1
            if load[heap[c]] < load[b] or (load[heap[c]] == load[b] and heap[c] < b):
                heap[p] = heap[c]
                p = c
            else:
                break
        heap[p] = b


def karmarkar_karp(sizes: np.ndarray, num_bins: int) -> np.ndarray:
    """k-way largest differencing. States are seeded from blocks of k sorted items (one item
    per slot) rather than one state per item, which keeps memory O(n + k * n/k) at k = 2560."""
    n = len(sizes)
    out = np.zeros(n, dtype=np.int64)
    if n == 0 or num_bins == 1:
        return out
    order = np.argsort(-np.asarray(sizes, dtype=np.float64), kind="stable")
    # A slot is represented by one of its items; merging two slots links one tree under the
    # other in a parent forest resolved by pointer jumping at the end.
    heap = []
    for blk, start in enumerate(range(0, n, num_bins)):
        ids = order[start:start + num_bins]
        loads = np.zeros(num_bins)
        loads[:len(ids)] = sizes[ids]
        slots = np.full(num_bins, -1, dtype=np.int64)
        slots[:len(ids)] = ids
        heapq.heappush(heap, (-(loads[0] - loads[-1]), blk, loads, slots))
    parent_arr = np.arange(n, dtype=np.int64)
    seq = len(heap)
    while len(heap) > 1:
        _, _, la, sa = heapq.heappop(heap)
        _, _, lb, sb = heapq.heappop(heap)
        # heaviest slot of one state with the lightest of the other
        loads = la + lb[::-1]
        sb_r = sb[::-1]
        slots = sa.copy()
        empty_a = slots < 0
        slots[empty_a] = sb_r[empty_a]
        both = ~empty_a & (sb_r >= 0)
        parent_arr[sb_r[both]] = slots[both]
        o = np.argsort(-loads, kind="stable")
        seq += 1
        heapq.heappush(heap, (-(loads[o[0]] - loads[o[-1]]), seq, loads[o], slots[o]))
    _, _, _, slots = heap[0]
    root = parent_arr.copy()
    while True:  # pointer jumping to each item's slot root
        nxt = root[root]
        if np.array_equal(nxt, root):
            break
        root = nxt
    bin_of_root = np.full(n, -1, dtype=np.int64)
    valid = slots >= 0
    bin_of_root[slots[valid]] = np.flatnonzero(valid)
    out = bin_of_root[root]
    assert (out >= 0).all()
    return out


def lpt_rounds(sizes: np.ndarray, groups: np.ndarray, loads: np.ndarray,
               cap: float | None = None) -> np.ndarray:
    """LPT within each group of bins, a round of B items per group at a time.

    `loads` is float64[G, B] (updated in place); returns each item's bin index within its group,
    or -1 for an item that would push its bin over `cap` (left for the caller to place).
    O(n log n + (n/B) * B log B).
    """
    out = np.zeros(len(sizes), dtype=np.int64)
    if len(sizes):
        _lpt_rounds(sizes, groups, order_by_key_then_size(groups, sizes), loads,
                    np.inf if cap is None else cap, cap is not None, out)
    return out


@kernel
def _lpt_rounds(sizes, groups, order, loads, cap, capped, out):
    """`lpt_rounds` over items in `order` (by group, then decreasing size): each group's items
    in rounds of B, the round's t-th item to the group's t-th least-loaded bin (stable: ties by
    bin) at the round's start, unless `capped` and that takes the bin over `cap` (then -1).
    Groups do not share bins, so each goes through its rounds on its own. `loads` and `out`
    are updated in place."""
    n, B = order.shape[0], loads.shape[1]
    by_load = np.empty(B, np.int64)
    start = 0
    while start < n:
        g, end = groups[order[start]], start
        while end < n and groups[order[end]] == g:
            end += 1
        for lo in range(start, end, B):
            _bins_by_load(loads[g], by_load)
            for t in range(lo, min(lo + B, end)):
                item, b = order[t], by_load[t - lo]
                if capped and not loads[g, b] + sizes[item] <= cap:
                    out[item] = -1
                else:
                    out[item] = b
                    loads[g, b] += sizes[item]
        start = end


def lpt_home(sizes: np.ndarray, home: np.ndarray, loads: np.ndarray, *, node_size: int,
             tol: float, round_size: int | None = None) -> np.ndarray:
    """Batched LPT over all bins that bends toward each item's home bin (then home node).

    Round r takes the next K largest items for the K least-loaded bins (K = `round_size`,
    default all bins; smaller rounds are closer to sequential LPT and cost more rounds);
    bins whose loads lie within `tol` of each other form a band, and inside a band an item
    takes its home bin if free, otherwise bins are matched to items in node order. So it loses
    at most about `tol` per round against batched LPT and keeps the big first-round items home.
    `loads` (float64[B]) is updated in place; returns each item's bin.
    """
    out = np.zeros(len(sizes), dtype=np.int64)
    K = min(len(loads), round_size or len(loads))
    _lpt_home(sizes, home, np.argsort(-sizes, kind="stable"), loads, node_size, tol, K, out)
    return out


@kernel
def _lpt_home(sizes, home, order, loads, node_size, tol, K, out):
    """`lpt_home`'s rounds over the items in `order` (largest first): the round's bins
    (`_round_bins`), their bands (bin t of the round: (load_t - load_0) // tol, or t with no
    `tol`), items matched to bins (`_match_in_bands`). `loads` and `out` are updated in place."""
    nb = loads.shape[0]
    is_home = np.zeros(nb, np.bool_)
    pos_of_bin = np.full(nb, -1, np.int64)
    for start in range(0, order.shape[0], K):
        items = order[start:start + K]
        k = items.shape[0]
        bo = _round_bins(loads, home, items, tol, is_home)
        band = np.arange(k)
        if tol > 0:
            for t in range(k):
                band[t] = np.int64((loads[bo[t]] - loads[bo[0]]) // tol)
        for t in range(k):
            pos_of_bin[bo[t]] = t
        take = _match_in_bands(home, items, bo, band, pos_of_bin, node_size, nb)
        for t in range(k):
            pos_of_bin[bo[t]] = -1
            out[items[t]] = bo[take[t]]
            loads[bo[take[t]]] += sizes[items[t]]


@kernel
def _round_bins(loads, home, items, tol, is_home):
    """The bins of a round of k = len(items) items, by load (stable): all bins if k is their
    number, else the k least-loaded where, among bins within `tol` of the k-th lowest load,
    the round's home bins come first, then the others by index (bins further off, if needed,
    by load then index). `is_home` is all False, and left so."""
    nb, k = loads.shape[0], items.shape[0]
    if k >= nb:
        return _load_order(loads)
    kth = _kth_smallest(loads, k - 1)
    for it in items:
        is_home[home[it]] = True
    bo = np.empty(k, np.int64)
    m = 0
    for want_home in (True, False):
        for b in range(nb):
            if m < k and loads[b] <= kth + tol and is_home[b] == want_home:
                bo[m] = b
                m += 1
    for it in items:
        is_home[home[it]] = False
    if m < k:  # fewer than k bins near the k-th load (only with tol < 0)
        far = np.flatnonzero(~(loads <= kth + tol))
        bo[m:] = far[_load_order(loads[far])][:k - m]
    return bo[_load_order(loads[bo])]


@kernel
def _kth_smallest(values, k):
    """The k-th smallest of `values` (k from 0): quickselect (Hoare) on a copy. A value, so
    the same whichever selection finds it (np.partition's takes ~10x longer to compile)."""
    a = values.copy()
    lo, hi = 0, a.shape[0] - 1
    while lo < hi:
        pivot, i, j = a[(lo + hi) // 2], lo, hi
        while i <= j:
            while a[i] < pivot:
                i += 1
            while a[j] > pivot:
                j -= 1
            if i <= j:
                a[i], a[j] = a[j], a[i]
                i, j = i + 1, j - 1
        if k <= j:
            hi = j
        elif k >= i:
            lo = i
        else:
            return a[k]
    return a[k]


@kernel
def _match_in_bands(home, items, bo, band, pos_of_bin, node_size, nb):
    """Round position of the bin each item t of the round takes: its home bin if that is in the
    round (`pos_of_bin`) and in the band of position t, the first such item winning; else, with
    nodes (`node_size` > 1), the r-th item left of a (band, node) takes the r-th bin left of it;
    last, items and bins left, each by band (stable), pairwise."""
    k = items.shape[0]
    take = np.full(k, -1, np.int64)
    free = np.ones(k, np.bool_)
    for t in range(k):
        hp = pos_of_bin[home[items[t]]]
        if hp >= 0 and band[hp] == band[t] and free[hp]:
            take[t] = hp
            free[hp] = False
    ri, rb = np.flatnonzero(take < 0), np.flatnonzero(free)
    if node_size > 1 and ri.shape[0] > 0:
        ki = band[ri] * nb + home[items[ri]] // node_size
        kb = band[rb] * nb + bo[rb] // node_size
        oi, ob = np.argsort(ki, kind="mergesort"), np.argsort(kb, kind="mergesort")
        p = q = 0
        while p < oi.shape[0] and q < ob.shape[0]:
            if ki[oi[p]] != kb[ob[q]]:
                p, q = (p + 1, q) if ki[oi[p]] < kb[ob[q]] else (p, q + 1)
                continue
            take[ri[oi[p]]] = rb[ob[q]]
            free[rb[ob[q]]] = False
            p, q = p + 1, q + 1
        ri, rb = np.flatnonzero(take < 0), np.flatnonzero(free)
    ri = ri[np.argsort(band[ri], kind="mergesort")]
    rb = rb[np.argsort(band[rb], kind="mergesort")]
    take[ri] = rb
    return take


def relabel_bins(bin_of: np.ndarray, home: np.ndarray, weight: np.ndarray, num_bins: int,
                 node_size: int) -> np.ndarray:
    """Which rank should hold each bin so that most `weight` stays on its home node, then on
    its home rank: a permutation (bins are interchangeable for balance, so loads keep).

    Greedy on (bin, node) affinities, heaviest first, each node taking `node_size` bins; then
    the same inside each node for (bin, rank). Affinities are sparse (one per distinct home of
    a bin's items), so this is O(n log n) plus a compiled pass over the pairs. Returns
    new_rank[bin]."""
    N = num_bins // node_size
    node_arr = np.zeros(num_bins, dtype=np.int64)  # one node: every bin is on it
    if N > 1:
        node_arr -= 1
        room = np.full(N, node_size, dtype=np.int64)
        _greedy_pairs(*_affinities(bin_of, home // node_size, weight, N), room, node_arr)
        left = np.flatnonzero(node_arr < 0)
        node_arr[left] = np.repeat(np.arange(N), room)[:len(left)]
    # inside nodes: bins to ranks by same-rank affinity, only with ranks of the bin's node
    out = np.full(num_bins, -1, dtype=np.int64)
    free = np.ones(num_bins, dtype=np.int64)
    b, r = _affinities(bin_of, home, weight, num_bins)
    ok = node_arr[b] == r // node_size
    _greedy_pairs(b[ok], r[ok], free, out)
    # every node has as many unplaced bins as free ranks: match them in node order
    bins_left = np.flatnonzero(out < 0)
    bins_left = bins_left[np.argsort(node_arr[bins_left], kind="stable")]
    out[bins_left] = np.flatnonzero(free)  # free ranks, already in node order
    return out


def swap_home(size: np.ndarray, home: np.ndarray, nbytes: np.ndarray, rank: np.ndarray,
              loads: np.ndarray, node_size: int, cap: float, passes: int = 2) -> int:
    """Swap pairs of items so that more `nbytes` stay on their home node, no rank going above
    `cap`: an item x away from its home node trades places with an item y that sits on x's
    home node away from its own (y's bytes cross either way, unless y lands home too), if both
    ranks stay at or under `cap`. Ranks of a node are interchangeable for bytes, so a
    balanced placement whose ranks mostly mix homes keeps its loads' spread and loses most of
    its crossing bytes. `rank` and `loads` are updated in place; returns the swaps made."""
    if len(size) == 0 or len(loads) <= node_size:
        return 0
    return int(_swap_home(np.ascontiguousarray(size, dtype=np.float64),
                          np.ascontiguousarray(home // node_size, dtype=np.int64),
                          np.ascontiguousarray(nbytes, dtype=np.float64), rank, loads,
                          node_size, float(cap), passes))


@kernel
def _swap_home(size, home_node, nbytes, rank, loads, g, cap, passes):
    """`swap_home`'s passes, until one swaps nothing or after `passes`. Each pass takes the
    items away from their home node by decreasing bytes (ties by index); x still away swaps
    with its `_best_partner` on its home node, if it has one."""
    N = loads.shape[0] // g
    total = 0
    for _ in range(passes):
        off = np.flatnonzero(rank // g != home_node)
        start, slots, s_size, s_bytes, s_home, s_rank, pos = _off_home_slots(
            off, rank, size, nbytes, home_node, g, N)
        swaps = 0
        for x in off[np.argsort(-nbytes[off], kind="mergesort")]:
            if pos[x] < 0:
                continue
            rx = rank[x]
            b = rx // g
            at = _best_partner(rx, b, size[x], nbytes[x], loads, cap,
                               start[home_node[x]], start[home_node[x] + 1], slots, s_size,
                               s_bytes, s_home, s_rank)
            if at < 0:
                continue
            y = slots[at]
            ry = rank[y]
            d = size[x] - size[y]
            loads[ry] += d
            loads[rx] -= d
            rank[x], rank[y] = ry, rx
            slots[at] = -1  # x is home now; y takes x's place on node b
            if home_node[y] == b:
                slots[pos[x]], pos[y] = -1, -1
            else:
                p = pos[x]
                slots[p], pos[y] = y, p
                s_size[p], s_bytes[p], s_home[p], s_rank[p] = size[y], nbytes[y], home_node[y], rx
            pos[x] = -1
            swaps += 1
        total += swaps
        if swaps == 0:
            break
    return total


@kernel
def _off_home_slots(off, rank, size, nbytes, home_node, g, N):
    """The items `off` (away from their home node) as slots grouped by the node they sit on,
    in index order: (start, slots, and each slot's size, bytes, home node and rank beside it,
    so that a scan reads one node's slots in a row; pos, each item's slot or -1). Node k's
    slots are start[k]:start[k + 1]."""
    start = np.zeros(N + 1, np.int64)
    for i in off:
        start[rank[i] // g + 1] += 1
    for k in range(N):
        start[k + 1] += start[k]
    fill = start[:N].copy()
    m = off.shape[0]
    slots = np.empty(m, np.int64)
    s_size, s_bytes = np.empty(m), np.empty(m)
    s_home, s_rank = np.empty(m, np.int64), np.empty(m, np.int64)
    pos = np.full(rank.shape[0], -1, np.int64)
    for i in off:
        b = rank[i] // g
        slots[fill[b]], pos[i] = i, fill[b]
        s_size[fill[b]], s_bytes[fill[b]] = size[i], nbytes[i]
        s_home[fill[b]], s_rank[fill[b]] = home_node[i], rank[i]
        fill[b] += 1
    return start, slots, s_size, s_bytes, s_home, s_rank, pos


@kernel
def _best_partner(rx, b, sx, bx, loads, cap, lo, hi, slots, s_size, s_bytes, s_home, s_rank):
    """The slot in lo..hi-1 (item x's home node) whose item y, still away from home, x should
    swap with, or -1: the one that saves the most bytes (x's `bx`, plus y's if y's home is
    x's node `b`), then changes the loads least (|sx - size y|), then has the lowest index, of
    those keeping both ranks at or under `cap` (none if it saves no bytes). x sits on rank
    `rx` with size `sx`."""
    best, at, gain_best, d_best = -1, -1, 0.0, 0.0
    for s in range(lo, hi):
        y = slots[s]
        if y < 0:
            continue
        d = sx - s_size[s]
        if loads[s_rank[s]] + d > cap or loads[rx] - d > cap:
            continue
        gain = bx + (s_bytes[s] if s_home[s] == b else 0.0)
        if gain > gain_best or (best >= 0 and gain == gain_best and (
                abs(d) < d_best or (abs(d) == d_best and y < best))):
            best, at, gain_best, d_best = y, s, gain, abs(d)
    return at


@kernel
def _greedy_pairs(bins, targets, room, out):
    """In the pairs' order, bin b takes target t where b has none yet (out[b] < 0) and t has
    room left (room[t] > 0, one less after). `room` and `out` are updated in place."""
    for x in range(bins.shape[0]):
        b, t = bins[x], targets[x]
        if out[b] < 0 and room[t] > 0:
            out[b] = t
            room[t] -= 1


def _affinities(bin_of, target, weight, num_targets):
    """(bin, target) pairs with positive summed weight, heaviest first (ties: bin, target)."""
    return _pair_weights(np.ascontiguousarray(bin_of, dtype=np.int64),
                         np.ascontiguousarray(target, dtype=np.int64),
                         np.ascontiguousarray(weight, dtype=np.float64), num_targets)


@kernel
def _pair_weights(bin_of, target, weight, num_targets):
    """`_affinities`' pairs: each (bin, target) pair's weight summed over its
    items in index order; the pairs with a positive sum by decreasing sum, ties by (bin,
    target). One counting sort of the items by bin, a pass per bin over its items, a stable
    radix sort of the sums (`_load_order`)."""
    n = bin_of.shape[0]
    nb = bin_of.max() + 1 if n else 0
    ptr = np.zeros(nb + 1, np.int64)
    for i in range(n):
        ptr[bin_of[i] + 1] += 1
    for k in range(nb):
        ptr[k + 1] += ptr[k]
    by_bin, fill = np.empty(n, np.int64), ptr[:nb].copy()
    for i in range(n):
        by_bin[fill[bin_of[i]]] = i
        fill[bin_of[i]] += 1
    acc, seen = np.zeros(num_targets), np.full(num_targets, -1, np.int64)
    pb, pt, pw = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n)
    m = 0
    for k in range(nb):
        first = m
        for x in range(ptr[k], ptr[k + 1]):
            t = target[by_bin[x]]
            if seen[t] != k:
                seen[t], acc[t] = k, 0.0
                pt[m] = t
                m += 1
            acc[t] += weight[by_bin[x]]
        pt[first:m] = np.sort(pt[first:m])
        for x in range(first, m):
            pb[x], pw[x] = k, acc[pt[x]]
    keep = np.flatnonzero(pw[:m] > 0)
    order = keep[_load_order(-pw[keep])]
    return pb[order], pt[order]


def refine(sizes: np.ndarray, bin_of: np.ndarray, loads: np.ndarray, *,
           movable: np.ndarray | None = None, bins_per_group: int | None = None,
           target: float = 0.0, max_iter: int = 64, all_pairs: bool = False,
           swaps: bool | None = None) -> None:
    """Lower the heaviest bins by moving one item or swapping two between paired bins.

    Each iteration pairs heavy bins with light ones, inside each group of `bins_per_group`
    consecutive bins or globally, the partner rotating over iterations among the lightest bins;
    with `all_pairs` (global only, for few items per bin) each of the heaviest bins is tried
    against each of the lightest bins at once and conflicts go to the heaviest. Every chosen
    pair applies the move or swap that most lowers its maximum (swaps only with few items per
    bin, unless `swaps` says otherwise). Stops at `target`, after `max_iter`, or when nothing
    more helps.
    `bin_of` and `loads` are updated in place.
    """
    nb = len(loads)
    if nb < 2 or len(sizes) == 0:
        return
    if movable is None:
        movable = np.ones(len(sizes), dtype=bool)
    cand = np.flatnonzero(movable & (sizes > 0))
    if len(cand) == 0 or (bins_per_group is not None and bins_per_group < 2):
        return
    # all pairs costs items_per_bin^2 per pair of bins: worth it only for coarse bins
    all_pairs = all_pairs and len(cand) <= _ALL_PAIRS_ITEMS_PER_BIN * nb
    # with many items per bin, single moves suffice and swaps cost items_per_bin^2 per pair
    if swaps is None:  # a swap search costs about items^2 / (2 bins) cells an iteration
        swaps = (len(cand) <= _SWAP_ITEMS_PER_BIN * nb
                 or len(cand) ** 2 <= 2 * nb * _SWAP_CELLS)
    if bins_per_group is not None:
        _refine_in_groups(sizes, bin_of, loads, cand, bins_per_group, target, max_iter, swaps,
                          _SWAP_CELLS)
        return
    if all_pairs:
        _refine_all_pairs(sizes, bin_of, loads, cand, float(target), int(max_iter), _MAX_HEAVY,
                          _MAX_LIGHT, _CELLS)
    else:
        _refine_global(sizes, bin_of, loads, cand, float(target), int(max_iter), bool(swaps),
                       _SWAP_CELLS)


@kernel
def _refine_global(sizes, bin_of, loads, cand, target, max_iter, swaps, max_cells):
    """`refine`'s global iterations from its candidate items `cand`: each pairs the heavy bins
    with light partners that rotate over iterations (`_rotating_pairs`) for `_pair_step`;
    without `swaps`, items of at least the top load minus the lowest drop out of `cand` first
    (a move of d helps only if d < lh - ll <= top - min). Stops at `target` (the top load at
    most target * (1 + 1e-12)), after `max_iter`, or once `rotations` iterations in a row moved
    nothing or `rotations` + 2 lowered the top load by no more than 1e-12 of it. An iteration
    that moves nothing leaves the state as it was, and the pairs depend only on the state and
    the rotation: once every rotation has moved nothing, nothing ever will. `bin_of` and
    `loads` are updated in place."""
    idle = still = 0
    for it in range(max_iter):
        top = loads.max()
        if top <= target * (1 + 1e-12):
            break
        heavy, light, rotations = _rotating_pairs(loads, target, it)
        if not swaps:
            cand = cand[sizes[cand] < top - loads.min()]
        moved = _pair_step(sizes, bin_of, loads, cand, heavy, light, swaps, max_cells)
        idle = 0 if moved and loads.max() < top * (1 - 1e-12) else idle + 1
        still = 0 if moved else still + 1
        if idle >= rotations + 2 or still >= rotations:
            break


@kernel
def _refine_all_pairs(sizes, bin_of, loads, cand, target, max_iter, max_heavy, max_light,
                      max_cells):
    """`refine`'s all-pairs iterations: the heavy bins (`_num_heavy`, at most `max_heavy`)
    against the lightest others (at most `max_light`, `_extremes`), each heavy bin's best
    exchange (`_all_pairs_exchange`). Stops at `target`, after `max_iter`, at an iteration
    that moves nothing or after 3 in a row that lowered the top load by no more than 1e-12 of
    it. `bin_of` and `loads` are updated in place."""
    nb, idle = loads.shape[0], 0
    for _ in range(max_iter):
        top = loads.max()
        if top <= target * (1 + 1e-12):
            break
        kh = _num_heavy(loads, target, min(nb // 2, max_heavy))
        heavy, light = _extremes(loads, kh, min(nb - kh, max_light))
        moved = _all_pairs_exchange(sizes, bin_of, loads, cand, heavy, light, max_cells)
        idle = 0 if moved and loads.max() < top * (1 - 1e-12) else idle + 1
        if idle >= 3 or not moved:
            break


@kernel
def _refine_in_groups(sizes, bin_of, loads, cand, B, target, max_iter, swaps, max_cells):
    """`refine`'s iterations in groups of B consecutive bins, from its candidate items `cand`:
    each group above `target` pairs its heavier half with its lighter half (`_group_pairs`)
    for `_pair_step`; stops as `refine` does (at `target`, after `max_iter`, or once every
    rotation has moved nothing or lowered nothing). `bin_of` and `loads` are updated in
    place."""
    idle = still = 0
    for it in range(max_iter):
        top = loads.max()
        if top <= target * (1 + 1e-12):
            break
        heavy, light = _group_pairs(loads, B, target, it)
        if heavy.shape[0] == 0:
            break
        if not swaps:  # a move of d helps only if d < lh - ll <= top - min: drop larger items
            cand = cand[sizes[cand] < top - loads.min()]
        moved = _pair_step(sizes, bin_of, loads, cand, heavy, light, swaps, max_cells)
        idle = 0 if moved and loads.max() < top * (1 - 1e-12) else idle + 1
        still = 0 if moved else still + 1
        if idle >= B // 2 + 2 or still >= B // 2:
            break


@kernel
def _bins_by_load(loads, out):
    """Into `out`, the positions of `loads` by (load, position): a stable insertion sort in
    place for a node's few bins, a merge sort above 16."""
    if loads.shape[0] > 16:
        out[:] = np.argsort(loads, kind="mergesort")
        return
    for k in range(loads.shape[0]):
        j = k
        while j > 0 and loads[out[j - 1]] > loads[k]:
            out[j] = out[j - 1]
            j -= 1
        out[j] = k


@kernel
def _group_pairs(loads, B, target, it):
    """(heavy bins, their light partners in iteration `it`) of the groups of B bins whose
    heaviest is above `target`, group by group: with the group's bins by load (stable) as
    o_0..o_{B-1} and h = B // 2, heavy o_{B-1-j} pairs with light o_{(j + it) % h}."""
    G, h = loads.shape[0] // B, B // 2
    busy = np.zeros(G, np.bool_)
    for g in range(G):
        busy[g] = loads[g * B:(g + 1) * B].max() > target * (1 + 1e-12)
    heavy = np.empty(busy.sum() * h, np.int64)
    light = np.empty(busy.sum() * h, np.int64)
    x = 0
    o = np.empty(B, np.int64)
    for g in np.flatnonzero(busy):
        _bins_by_load(loads[g * B:(g + 1) * B], o)
        o += g * B
        for j in range(h):
            heavy[x + j], light[x + j] = o[B - 1 - j], o[(j + it) % h]
        x += h
    return heavy, light


@kernel
def _rotating_pairs(loads, target, it):
    """(heavy bins, their light partners in iteration `it`, rotations before partners repeat):
    the k = `_num_heavy` (at most half the bins) heaviest against a pool of the m = min(bins -
    k, 4k) lightest others (`_extremes`): heavy bin j pairs with pool[(j + (it % rotations) *
    k) % m], rotations = ceil(m / k)."""
    nb = loads.shape[0]
    k = _num_heavy(loads, target, nb // 2)
    heavy, pool = _extremes(loads, k, min(nb - k, 4 * k))
    m = pool.shape[0]
    rotations = -(-m // k)
    light = np.empty(k, np.int64)
    for j in range(k):
        light[j] = pool[(j + (it % rotations) * k) % m]
    return heavy, light, rotations


@kernel
def _num_heavy(loads, target, most):
    """How many bins count as heavy: those above cut = max(target, mean + (top - mean) / 4),
    at least 1 and at most `most`; the mean is the loads' plain sum in bin order over the
    number of bins."""
    top, total = loads[0], 0.0
    for x in loads:
        total += x
        top = max(top, x)
    mean = total / loads.shape[0]
    cut = max(target, mean + 0.25 * (top - mean))
    above = 0
    for x in loads:
        if x > cut:
            above += 1
    return min(most, max(1, above))


@kernel
def _extremes(loads, num_heavy, num_light):
    """(the num_heavy heaviest bins by (load desc, index asc); the num_light lightest of the
    other bins by (load asc, index asc)), each in that order, so disjoint; num_heavy +
    num_light <= bins. From the bins by (load, index) (`_load_order`): the heavy ones are its
    runs of equal loads from the last, each run from its first."""
    o = _load_order(loads)
    heavy = np.empty(num_heavy, np.int64)
    x, end, start, took = 0, o.shape[0], o.shape[0], 0
    while x < num_heavy:
        start = end - 1
        while start > 0 and loads[o[start - 1]] == loads[o[end - 1]]:
            start -= 1
        took = min(end - start, num_heavy - x)
        heavy[x:x + took] = o[start:start + took]
        x, end = x + took, start
    # the others by (load, index): o[:start], then what the last run taken left
    light = np.empty(num_light, np.int64)
    for r in range(num_light):
        light[r] = o[r] if r < start else o[r + took]
    return heavy, light


@kernel
def _load_order(loads):
    """The bins by (load, index): a stable LSD radix sort, a byte a pass, of the loads' bits
    mapped to an unsigned order (-0.0 as 0.0); passes where every bin has the same byte are
    skipped (most, for loads of one magnitude). About 3x faster than numba's quicksort on
    2,560 loads, and stable, which its quicksort is not."""
    n = loads.shape[0]
    keys = np.empty(n, np.uint64)
    bits = (loads + 0.0).view(np.uint64)
    for i in range(n):
        keys[i] = ~bits[i] if bits[i] >> np.uint64(63) else bits[i] | (np.uint64(1) << np.uint64(63))
    o, o2 = np.arange(n), np.empty(n, np.int64)
    k2 = np.empty(n, np.uint64)
    count = np.empty(257, np.int64)
    for shift in range(0, 64, 8):
        sh = np.uint64(shift)
        count[:] = 0
        for i in range(n):
            count[np.int64((keys[i] >> sh) & np.uint64(255)) + 1] += 1
        if count.max() == n:
            continue
        for d in range(256):
            count[d + 1] += count[d]
        for i in range(n):
            d = np.int64((keys[i] >> sh) & np.uint64(255))
            o2[count[d]], k2[count[d]] = o[i], keys[i]
            count[d] += 1
        o, o2, keys, k2 = o2, o, k2, keys
    return o


_MAX_HEAVY, _MAX_LIGHT, _CELLS = 32, 64, 100_000

_ALL_PAIRS_ITEMS_PER_BIN = 8
_SWAP_ITEMS_PER_BIN = 16
_SWAP_CELLS = 250_000


@kernel
def _all_pairs_exchange(sizes, bin_of, loads, cand, heavy, light, max_cells):
    """Each heavy bin's best exchange with any light bin, applied; False if none helps.

    `heavy` and `light` are disjoint bins, heaviest and lightest first. While heavy bins x
    light bins x the fullest heavy bin x (the fullest light bin + 1) exceeds `max_cells`, only
    the lighter half of the light bins stays. For heavy bin h and light bin l the candidates
    are h's items of `cand` i (in `cand` order), each for nothing (a move) then for each of l's
    items j: the first smallest |d - (lh - ll) / 2| over d = s_i - s_j > 0, leaving the pair's
    maximum at (lh + ll) / 2 + that; h takes the first light bin with the lowest such maximum,
    if below lh. A light bin wanted by several goes to the heaviest of them. `bin_of` and
    `loads` are updated in place."""
    kh, kl = heavy.shape[0], light.shape[0]
    role = np.full(loads.shape[0], -1, np.int64)  # k: heavy[k]; kh + k: light[k]
    for k in range(kh):
        role[heavy[k]] = k
    for k in range(kl):
        role[light[k]] = kh + k
    ptr, item = _members(cand, bin_of, role, kh + kl)
    count = ptr[1:] - ptr[:-1]
    fullest_h = count[:kh].max()
    if fullest_h == 0:
        return False
    while kl > 1 and kh * kl * fullest_h * (count[kh:kh + kl].max() + 1) > max_cells:
        kl //= 2  # keep the lightest half
    choice = np.full((kh, 3), -1, np.int64)  # light bin, heavy item, light item (-1: move)
    for h in range(kh):
        lh, top = loads[heavy[h]], np.inf
        for lb in range(kl):
            ll = loads[light[lb]]
            half, best, bi, bj = (lh - ll) / 2, np.inf, -1, -1
            for i in range(ptr[h], ptr[h + 1]):
                sh = sizes[item[i]]
                if sh > 0 and abs(sh - half) < best:
                    best, bi, bj = abs(sh - half), item[i], -1
                for j in range(ptr[kh + lb], ptr[kh + lb + 1]):
                    d = sh - sizes[item[j]]
                    if d > 0 and abs(d - half) < best:
                        best, bi, bj = abs(d - half), item[i], item[j]
            if (lh + ll) / 2 + best < top:
                top, choice[h, 0], choice[h, 1], choice[h, 2] = (lh + ll) / 2 + best, lb, bi, bj
        if not top < lh * (1 - 1e-12):
            choice[h, 0] = -1
    return _apply_choices(sizes, bin_of, loads, heavy, light, choice)


@kernel
def _apply_choices(sizes, bin_of, loads, heavy, light, choice):
    """Applies heavy bin h's exchange `choice[h]` = (light bin, its item, light item or -1 for
    a move; light bin -1: none), heaviest first, skipping a light bin already taken; False if
    none applies."""
    taken = np.zeros(light.shape[0], np.bool_)
    moved = False
    for h in range(heavy.shape[0]):
        lb, i, j = choice[h, 0], choice[h, 1], choice[h, 2]
        if lb < 0 or taken[lb]:
            continue
        taken[lb] = moved = True
        delta = sizes[i] - (sizes[j] if j >= 0 else 0.0)
        bin_of[i] = light[lb]
        if j >= 0:
            bin_of[j] = heavy[h]
        loads[heavy[h]] -= delta
        loads[light[lb]] += delta
    return moved


@kernel
def _pair_step(sizes, bin_of, loads, cand, heavy, light, swaps, max_cells):
    """Best move or swap for every (heavy[k], light[k]) pair; False if none helps.

    Pairs are disjoint bins. For pair k the candidates are the heavy bin's items of `cand` (in
    `cand` order) and, with `swaps`, the light bin's: the exchange of heavy item i for light
    item j (or for nothing: a move) that leaves the pair's maximum lowest, i.e. the smallest
    |d - (lh - ll) / 2| over d = s_i - s_j > 0, the first in (i, then nothing, then j) order on
    ties; applied only if it lowers the pair's maximum. With more than `max_cells` cells
    (pairs x the fullest heavy bin x the fullest light bin + 1), moves only. `bin_of` and `loads`
    are updated in place."""
    K = heavy.shape[0]
    if K == 0:
        return False
    role = np.full(loads.shape[0], -1, np.int64)  # k: heavy bin of pair k, K + k: its light bin
    for k in range(K):
        role[light[k]] = K + k
    for k in range(K):
        role[heavy[k]] = k
    ptr, item = _members(cand, bin_of, role, 2 * K)
    count = ptr[1:] - ptr[:-1]
    fullest_h, fullest_l = count[:K].max(), count[K:].max()
    if fullest_h == 0:
        return False
    swaps = swaps and K * fullest_h * (fullest_l + 1) <= max_cells
    moved = False
    for k in range(K):
        lh, ll = loads[heavy[k]], loads[light[k]]
        half = (lh - ll) / 2
        best, bi, bj = np.inf, -1, -1
        for i in range(ptr[k], ptr[k + 1]):
            sh = sizes[item[i]]
            if sh > 0 and abs(sh - half) < best:
                best, bi, bj = abs(sh - half), i, -1
            if swaps:
                for j in range(ptr[K + k], ptr[K + k + 1]):
                    d = sh - sizes[item[j]]
                    if d > 0 and abs(d - half) < best:
                        best, bi, bj = abs(d - half), i, j
        if bi < 0:
            continue
        delta = sizes[item[bi]] - (sizes[item[bj]] if bj >= 0 else 0.0)
        if max(lh - delta, ll + delta) >= lh * (1 - 1e-12):
            continue
        bin_of[item[bi]] = light[k]
        if bj >= 0:
            bin_of[item[bj]] = heavy[k]
        loads[heavy[k]] -= delta
        loads[light[k]] += delta
        moved = True
    return moved


@kernel
def _members(cand, bin_of, role, num_roles):
    """(ptr, items): the items c of `cand` whose bin has a role r = role[bin_of[c]] >= 0,
    grouped by role, each group in `cand` order: role r's are items[ptr[r]:ptr[r + 1]]. One
    pass over `cand`, then a counting sort of the few that have a role."""
    sel, sel_role = np.empty(cand.shape[0], np.int64), np.empty(cand.shape[0], np.int64)
    ptr = np.zeros(num_roles + 1, np.int64)
    m = 0
    for c in cand:
        r = role[bin_of[c]]
        if r >= 0:
            sel[m], sel_role[m] = c, r
            ptr[r + 1] += 1
            m += 1
    ptr = np.cumsum(ptr)
    items, fill = np.empty(m, np.int64), ptr[:-1].copy()
    for x in range(m):
        items[fill[sel_role[x]]] = sel[x]
        fill[sel_role[x]] += 1
    return ptr, items


def stable_order(keys: np.ndarray, num_keys: int | None = None) -> np.ndarray:
    """`np.argsort(keys, kind="stable")` for non-negative int keys: a counting sort (`_key_order`,
    one compiled pass to count, one to place) where the largest key is below max(4n, 2**16),
    else numpy's sort. `num_keys` (an upper bound on the keys) is accepted for the callers that
    know it; the kernel finds the range itself."""
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    out = np.empty(len(keys), dtype=np.int64)
    if _key_order(keys, _NO_SIZES, False, out):
        return out
    return np.argsort(keys, kind="stable")


def order_by_key_then_size(keys: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """`np.lexsort((-sizes, keys))`: by key, then decreasing size, then position. Where the
    sizes come sorted either way (a micro-batch's items do: the planner orders them largest
    first once, and subsets keep that order) and the keys are small, one compiled counting
    sort by key (`_key_order`); else a stable sort by size, then that counting sort by key."""
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    sizes = np.ascontiguousarray(sizes, dtype=np.float64)
    out = np.empty(len(keys), dtype=np.int64)
    if _key_order(keys, sizes, True, out):
        return out
    first = np.argsort(-sizes, kind="stable")
    return first[stable_order(keys[first])]


_NO_SIZES = np.zeros(0)


@kernel
def _key_order(keys, sizes, by_size, out):
    """Into `out`, the positions ordered by key, stably; with `by_size`, by key then decreasing
    size then position. True if done; False (`out` untouched) where a key is negative or not
    below max(4n, 2**16), or with `by_size` where `sizes` are neither non-increasing (then
    positions in order are already by decreasing size) nor non-decreasing (then runs of equal
    sizes last to first, each in position order). A counting sort: O(n + largest key); keys
    that come sorted (items by their sample), with sizes non-increasing or ignored, are already
    in order."""
    hi, grouped = _key_range(keys)
    if hi < -1 or hi >= max(4 * keys.shape[0], 1 << 16):
        return False
    rising = False
    if by_size:
        trend = _size_trend(sizes)
        if trend == 0:
            return False
        rising = trend < 0
    if grouped and not rising:
        for i in range(keys.shape[0]):
            out[i] = i
        return True
    _counting_sort(keys, sizes, hi, rising, out)
    return True


@kernel
def _key_range(keys):
    """(largest key, or -2 if some key is negative; whether the keys are non-decreasing)."""
    hi, grouped = -1, True
    for i in range(keys.shape[0]):
        k = keys[i]
        if k < 0:
            return -2, False
        if k < hi:
            grouped = False
        if k > hi:
            hi = k
    return hi, grouped


@kernel
def _size_trend(sizes):
    """1 if `sizes` are non-increasing, else -1 if non-decreasing, else 0."""
    dec, inc = True, True
    for i in range(sizes.shape[0] - 1):
        if not sizes[i] >= sizes[i + 1]:
            dec = False
        if not sizes[i] <= sizes[i + 1]:
            inc = False
    return 1 if dec else (-1 if inc else 0)


@kernel
def _counting_sort(keys, sizes, hi, rising, out):
    """Into `out`, the positions by key (0..hi), stably; with `rising` (sizes non-decreasing)
    each key's positions by decreasing size: runs of equal sizes last to first, each in
    position order."""
    n = keys.shape[0]
    fill = np.zeros(hi + 2, np.int64)
    for i in range(n):
        fill[keys[i] + 1] += 1
    for k in range(1, hi + 2):
        fill[k] += fill[k - 1]
    if not rising:
        for i in range(n):
            k = keys[i]
            out[fill[k]] = i
            fill[k] += 1
        return
    end = n
    while end > 0:
        start = end - 1
        while start > 0 and sizes[start - 1] == sizes[end - 1]:
            start -= 1
        for i in range(start, end):
            k = keys[i]
            out[fill[k]] = i
            fill[k] += 1
        end = start
