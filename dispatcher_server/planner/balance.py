"""Number-partitioning primitives, vectorised over bins and groups of bins (nodes).

`lpt_rounds` is LPT that assigns a whole round of B items at once (the B largest left go to the
B least-loaded bins), so its Python loop runs items/B times instead of items times; `lpt_home`
is the same over all bins, bent toward each item's home bin; `refine` repairs what batching
lost with moves and swaps between heavy and light bins, all pairs at once; `relabel_bins`
permutes finished bins onto ranks to keep embeddings local. `lpt_heap` and `karmarkar_karp` are
the textbook versions (baselines, and the sequential yardstick). With few bins (small worlds) the
first three run as plain-Python loops that make exactly the vectorised versions' choices: there
a round or refine iteration is tens of numpy calls on a handful of numbers.
"""

from __future__ import annotations

import bisect
import heapq

import numpy as np

# Up to this many bins, the kernels run in plain Python: numpy's per-call cost (~1-5 us) times
# the ~10-40 calls of a round or refine iteration outweighs the O(bins) Python work. Same result.
_PY_MAX_BINS = 32

def np_mean(values: list[float]) -> float:
    """`float(np.mean(values))`, bit for bit, without numpy's call cost for short lists: numpy
    adds fewer than 8 numbers left to right (pairwise summation starts at 8)."""
    if len(values) >= 8:
        return float(np.mean(values))
    total = 0.0
    for x in values:
        total += x
    return total / len(values)


def lpt_heap(sizes: np.ndarray, num_bins: int) -> np.ndarray:
    """Textbook LPT: largest item first onto the least-loaded bin (ties: lowest bin). O(n log n)."""
    heap = [(0.0, b) for b in range(num_bins)]
    sz = np.asarray(sizes, dtype=np.float64)
    out = [0] * len(sz)
    szl = sz.tolist()
    for i in np.argsort(-sz, kind="stable").tolist():
        load, b = heap[0]
        out[i] = b
        heapq.heapreplace(heap, (load + szl[i], b))
    return np.asarray(out, dtype=np.int64)


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
    O(n log n + (n/B) * G B log B).
    """
    n = len(sizes)
    G, B = loads.shape
    out = np.zeros(n, dtype=np.int64)
    if n == 0:
        return out
    if G * B <= _PY_MAX_BINS:
        return _lpt_rounds_py(sizes, groups, loads, cap)
    order = np.lexsort((-sizes, groups))
    g = groups[order]
    pos = np.arange(n) - np.searchsorted(g, g)
    rnd, slot = np.divmod(pos, B)
    by_round = np.argsort(rnd, kind="stable")
    bounds = np.searchsorted(rnd[by_round], np.arange(rnd.max() + 2))
    for r in range(len(bounds) - 1):
        sel = by_round[bounds[r]:bounds[r + 1]]
        gs = g[sel]
        rank_of = np.argsort(loads, axis=1, kind="stable")
        b = rank_of[gs, slot[sel]]
        add = sizes[order[sel]]
        if cap is not None:
            fits = loads[gs, b] + add <= cap
            b = np.where(fits, b, -1)
            gs, add = gs[fits], add[fits]
        out[order[sel]] = b
        loads[gs, b[b >= 0]] += add  # (group, bin) pairs are unique within a round
    return out


def _lpt_rounds_py(sizes, groups, loads, cap) -> np.ndarray:
    """`lpt_rounds` for few bins, in plain Python: the same assignment (groups never interact,
    and a round's bins are distinct, so each group is a sequence of B-item rounds)."""
    G, B = loads.shape
    n = len(sizes)
    order = np.lexsort((-sizes, groups))
    ptr = np.searchsorted(groups[order], np.arange(G + 1)).tolist()
    szs = sizes[order].tolist()
    rows = loads.tolist()
    res = [0] * n
    bins = range(B)
    for gi in range(G):
        row, end = rows[gi], ptr[gi + 1]
        for r0 in range(ptr[gi], end, B):
            rank_of = sorted(bins, key=row.__getitem__)
            r1 = min(r0 + B, end)
            if cap is None:
                res[r0:r1] = rank_of[:r1 - r0]
                for b, x in zip(rank_of, szs[r0:r1]):
                    row[b] += x
            else:
                for j, b in zip(range(r0, r1), rank_of):
                    if row[b] + szs[j] <= cap:
                        res[j] = b
                        row[b] += szs[j]
                    else:
                        res[j] = -1
    loads[...] = rows
    out = np.empty(n, dtype=np.int64)
    out[order] = res
    return out


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
    n, nb = len(sizes), len(loads)
    if nb <= _PY_MAX_BINS:
        return _lpt_home_py(sizes, home, loads, node_size, tol, round_size)
    out = np.zeros(n, dtype=np.int64)
    order = np.argsort(-sizes, kind="stable")
    pos_of_bin = np.full(nb, -1, dtype=np.int64)
    K = min(nb, round_size or nb)
    is_home = np.zeros(nb, dtype=bool)
    for start in range(0, n, K):
        items = order[start:start + K]
        k = len(items)
        if k < nb:
            # the k least-loaded bins, but among bins tied within `tol` of the k-th, this
            # round's home bins first
            kth = np.partition(loads, k - 1)[k - 1]
            is_home[home[items]] = True
            near = loads <= kth + tol
            pick = np.lexsort((np.arange(nb), ~(is_home & near), np.where(near, 0.0, loads)))
            bo = pick[:k]
            bo = bo[np.argsort(loads[bo], kind="stable")]
            is_home[home[items]] = False
        else:
            bo = np.argsort(loads, kind="stable")
        bl = loads[bo]
        band = ((bl - bl[0]) // tol).astype(np.int64) if tol > 0 else np.arange(k)
        pos_of_bin[bo] = np.arange(k)
        hp = pos_of_bin[home[items]]
        claim = (hp >= 0) & (band[np.maximum(hp, 0)] == band)
        take = np.zeros(k, dtype=np.int64) - 1
        ci = np.flatnonzero(claim)
        _, first = np.unique(hp[ci], return_index=True)
        ci = ci[first]
        take[ci] = hp[ci]
        free_bin = np.ones(k, dtype=bool)
        free_bin[hp[ci]] = False
        ri = np.flatnonzero(take < 0)
        rb = np.flatnonzero(free_bin)
        if node_size > 1 and len(ri):
            # same band and node first: join on (band, node, rank among equals)
            ki = _ranked(band[ri] * nb + home[items[ri]] // node_size)
            kb = _ranked(band[rb] * nb + bo[rb] // node_size)
            _, a, b = np.intersect1d(ki, kb, assume_unique=True, return_indices=True)
            take[ri[a]] = rb[b]
            ri, rb = np.delete(ri, a), np.delete(rb, b)
        ri = ri[np.argsort(band[ri], kind="stable")]
        rb = rb[np.argsort(band[rb], kind="stable")]
        take[ri] = rb
        out[items] = bo[take]
        loads[bo[take]] += sizes[items]
        pos_of_bin[bo] = -1
    return out


def _lpt_home_py(sizes, home, loads, node_size, tol, round_size) -> np.ndarray:
    """`lpt_home` for few bins, in plain Python: the same assignment, step for step."""
    n, nb = len(sizes), len(loads)
    order = np.argsort(-sizes, kind="stable").tolist()
    szl, hml = sizes.tolist(), home.tolist()
    ld = loads.tolist()
    out = [0] * n
    K = min(nb, round_size or nb)
    bins = range(nb)
    if K == 1:  # sequential: home if within tol of the lightest bin, else the first such bin
        for i in order:
            h = hml[i]
            near = min(ld) + tol
            b = h if ld[h] <= near else next(b for b in bins if ld[b] <= near)
            out[i] = b
            ld[b] += szl[i]
        loads[:] = ld
        return np.asarray(out, dtype=np.int64)
    for start in range(0, n, K):
        items = order[start:start + K]
        k = len(items)
        homes = [hml[i] for i in items]
        if k < nb:
            kth = sorted(ld)[k - 1]
            hset = set(homes)
            near = [b for b in bins if ld[b] <= kth + tol]  # at least k bins
            # home bins first, then by index; then in order of load (stable)
            bo = [b for b in near if b in hset] + [b for b in near if b not in hset]
            bo = sorted(bo[:k], key=ld.__getitem__)
        else:
            bo = sorted(bins, key=ld.__getitem__)
        bl0 = ld[bo[0]]
        band = [(ld[b] - bl0) // tol for b in bo] if tol > 0 else list(range(k))
        pos = {b: j for j, b in enumerate(bo)}
        take = [-1] * k
        free = [True] * k
        for j in range(k):  # an item takes its home bin if it lies in the item's band
            hp = pos.get(homes[j], -1)
            if hp >= 0 and free[hp] and band[hp] == band[j]:
                take[j] = hp
                free[hp] = False
        ri = [j for j in range(k) if take[j] < 0]
        rb = [j for j in range(k) if free[j]]
        if node_size > 1 and ri:
            # same band and node first, the m-th such item with the m-th such bin
            slots: dict = {}
            for j in rb:
                slots.setdefault((band[j], bo[j] // node_size), []).append(j)
            rest = []
            for j in ri:
                q = slots.get((band[j], homes[j] // node_size))
                if q:
                    take[j] = q.pop(0)
                    free[take[j]] = False
                else:
                    rest.append(j)
            ri = rest
            rb = [j for j in rb if free[j]]
        ri.sort(key=band.__getitem__)
        rb.sort(key=band.__getitem__)
        for j, b in zip(ri, rb):
            take[j] = b
        for j, i in enumerate(items):
            b = bo[take[j]]
            out[i] = b
            ld[b] += szl[i]
    loads[:] = ld
    return np.asarray(out, dtype=np.int64)


def relabel_bins(bin_of: np.ndarray, home: np.ndarray, weight: np.ndarray, num_bins: int,
                 node_size: int) -> np.ndarray:
    """Which rank should hold each bin so that most `weight` stays on its home node, then on
    its home rank: a permutation (bins are interchangeable for balance, so loads keep).

    Greedy on (bin, node) affinities, heaviest first, each node taking `node_size` bins; then
    the same inside each node for (bin, rank). Affinities are sparse (one per distinct home of
    a bin's items), so this is O(n log n) plus a Python pass over the pairs. Returns
    new_rank[bin]."""
    N = num_bins // node_size
    node_arr = np.zeros(num_bins, dtype=np.int64)  # one node: every bin is on it
    if N > 1:
        node_of_bin = [-1] * num_bins
        room = [node_size] * N
        b, h = _affinities(bin_of, home // node_size, weight, N)
        for bb, hh in zip(b.tolist(), h.tolist()):
            if node_of_bin[bb] < 0 and room[hh]:
                node_of_bin[bb] = hh
                room[hh] -= 1
        node_arr = np.asarray(node_of_bin, dtype=np.int64)
        left = np.flatnonzero(node_arr < 0)
        node_arr[left] = np.repeat(np.arange(N), room)[:len(left)]
    # inside nodes: bins to ranks by same-rank affinity, only with ranks of the bin's node
    new_rank = [-1] * num_bins
    taken = [False] * num_bins
    b, r = _affinities(bin_of, home, weight, num_bins)
    ok = node_arr[b] == r // node_size
    for bb, rr in zip(b[ok].tolist(), r[ok].tolist()):
        if new_rank[bb] < 0 and not taken[rr]:
            new_rank[bb] = rr
            taken[rr] = True
    out = np.asarray(new_rank, dtype=np.int64)
    # every node has as many unplaced bins as free ranks: match them in node order
    bins_left = np.flatnonzero(out < 0)
    bins_left = bins_left[np.argsort(node_arr[bins_left], kind="stable")]
    out[bins_left] = np.flatnonzero(~np.asarray(taken))  # free ranks, already in node order
    return out


def _affinities(bin_of, target, weight, num_targets):
    """(bin, target) pairs with positive summed weight, heaviest first (ties: bin, target)."""
    key = bin_of * num_targets + target
    uk, inv = np.unique(key, return_inverse=True)
    w = np.bincount(inv, weights=weight)
    order = np.lexsort((uk, -w))
    order = order[w[order] > 0]
    return uk[order] // num_targets, uk[order] % num_targets


def _ranked(keys: np.ndarray) -> np.ndarray:
    """Unique int keys: key * n + rank of the element among equal keys."""
    n = len(keys)
    order = np.argsort(keys, kind="stable")
    k = keys[order]
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n) - np.searchsorted(k, k)
    return keys * n + rank


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
    if swaps is None:
        swaps = len(cand) <= _SWAP_ITEMS_PER_BIN * nb
    if nb <= _PY_MAX_BINS:
        _refine_py(sizes, bin_of, loads, cand, bins_per_group, target, max_iter, swaps,
                   all_pairs and bins_per_group is None)
        return
    # An iteration that moves nothing leaves the state as it was, and the pairs depend only on
    # the state and the rotation: once every rotation has moved nothing, nothing ever will.
    idle = still = 0
    for it in range(max_iter):
        top = loads.max()
        if top <= target * (1 + 1e-12):
            break
        if bins_per_group is None and all_pairs:
            moved = _all_pairs_step(sizes, bin_of, loads, cand, target)
            idle = 0 if moved and loads.max() < top * (1 - 1e-12) else idle + 1
            if idle >= 3 or not moved:
                break
            continue
        if bins_per_group is None:
            mean = loads.mean()
            cut = max(target, mean + 0.25 * (top - mean))
            k = int(min(nb // 2, max(1, (loads > cut).sum())))
            heavy, pool = _extremes(loads, k, min(nb - k, 4 * k))
            rotations = -(-len(pool) // k)
            light = pool[(np.arange(k) + (it % rotations) * k) % len(pool)]
        else:
            B = bins_per_group
            grid = loads.reshape(-1, B)
            busy = np.flatnonzero(grid.max(axis=1) > target * (1 + 1e-12))
            if len(busy) == 0:
                break
            o = np.argsort(grid[busy], axis=1, kind="stable") + (busy * B)[:, None]
            h = B // 2
            rotations = h
            heavy = o[:, ::-1][:, :h].ravel()
            light = o[:, (np.arange(h) + it) % h].ravel()
        moved = _pair_step(sizes, bin_of, loads, cand, heavy, light, swaps)
        idle = 0 if moved and loads.max() < top * (1 - 1e-12) else idle + 1
        still = 0 if moved else still + 1
        if idle >= rotations + 2 or still >= rotations:
            break


def _refine_py(sizes, bin_of, loads, cand, bins_per_group, target, max_iter, swaps,
               all_pairs) -> None:
    """`refine` for few bins, in plain Python: the same pairs, the same moves (ties go to the
    first light bin, then the first heavy item, then the first light one, in item order)."""
    nb = len(loads)
    ld = loads.tolist()
    szl = sizes.tolist()
    swaps = swaps or all_pairs
    if swaps:  # candidates per bin in item order; a pair tries every move and swap
        members: list[list] = [[] for _ in range(nb)]
        for i, b in zip(cand.tolist(), bin_of[cand].tolist()):
            members[b].append(i)
    else:  # (size, item) per bin, sorted: the best move is found by bisection
        order = cand[np.lexsort((cand, sizes[cand], bin_of[cand]))]
        ptr = np.searchsorted(bin_of[order], np.arange(nb + 1)).tolist()
        pairs = list(zip(sizes[order].tolist(), order.tolist()))
        members = [pairs[ptr[b]:ptr[b + 1]] for b in range(nb)]
    bins = range(nb)
    stop = target * (1 + 1e-12)
    idle = still = 0
    for it in range(max_iter):
        top = max(ld)
        if top <= stop:
            break
        if all_pairs:
            moved = _all_pairs_py(members, szl, ld, bin_of, target)
            idle = 0 if moved and max(ld) < top * (1 - 1e-12) else idle + 1
            if idle >= 3 or not moved:
                break
            continue
        if bins_per_group is None:
            mean = np_mean(ld)
            cut = max(target, mean + 0.25 * (top - mean))
            k = int(min(nb // 2, max(1, sum(x > cut for x in ld))))
            num_light = min(nb - k, 4 * k)
            if k + num_light >= nb // 2:
                order = sorted(bins, key=ld.__getitem__)
                heavy, pool = order[::-1][:k], order[:num_light]
            else:
                h_arr, p_arr = _extremes(np.asarray(ld), k, num_light)
                heavy, pool = h_arr.tolist(), p_arr.tolist()
            rotations = -(-len(pool) // k)
            shift = (it % rotations) * k
            light = [pool[(a + shift) % len(pool)] for a in range(k)]
        else:
            B = bins_per_group
            h = B // 2
            rotations = h
            heavy, light = [], []
            for g0 in range(0, nb, B):
                row = ld[g0:g0 + B]
                if max(row) <= stop:
                    continue
                o = sorted(range(B), key=row.__getitem__)
                heavy += [g0 + b for b in o[::-1][:h]]
                light += [g0 + o[(a + it) % h] for a in range(h)]
            if not heavy:
                break
        moved = False
        for hb, lb in zip(heavy, light):
            lh, ll = ld[hb], ld[lb]
            if swaps:
                best, bi, bj = _best_swap(members[hb], members[lb], szl, lh, ll)
            else:
                best, bi = _best_move(members[hb], lh, ll)
                bj = -1
            if not best < lh * (1 - 1e-12):
                continue
            moved = True
            d = szl[bi] - (szl[bj] if bj >= 0 else 0.0)
            ld[hb] = lh - d
            ld[lb] = ll + d
            bin_of[bi] = lb
            if swaps:
                members[hb].remove(bi)
                bisect.insort(members[lb], bi)
                if bj >= 0:
                    members[lb].remove(bj)
                    bisect.insort(members[hb], bj)
                    bin_of[bj] = hb
            else:
                e = (szl[bi], bi)
                del members[hb][bisect.bisect_left(members[hb], e)]
                bisect.insort(members[lb], e)
        idle = 0 if moved and max(ld) < top * (1 - 1e-12) else idle + 1
        still = 0 if moved else still + 1
        if idle >= rotations + 2 or still >= rotations:
            break
    loads[:] = ld


def _all_pairs_py(members, szl, ld, bin_of, target) -> bool:
    """`_all_pairs_step` in plain Python on per-bin item lists (item order); same choices."""
    nb = len(ld)
    top = max(ld)
    mean = np_mean(ld)
    cut = max(target, mean + 0.25 * (top - mean))
    kh = int(min(nb // 2, _MAX_HEAVY, max(1, sum(x > cut for x in ld))))
    kl = int(min(nb - kh, _MAX_LIGHT))
    order = sorted(range(nb), key=ld.__getitem__)  # kh + kl = nb: _extremes sorts all
    heavy, light = order[::-1][:kh], order[:kl]
    if not any(members[h] for h in heavy):
        return False
    C = max(len(members[h]) for h in heavy)
    D = max(len(members[b]) for b in light)
    while kh * kl * C * (D + 1) > _CELLS and kl > 1:
        kl //= 2  # keep the lightest half, as the vectorised step does
        light = light[:kl]
        D = max(len(members[b]) for b in light)
    picks = []
    taken = set()
    for hb in heavy:  # heaviest first; a light bin goes to the first heavy bin that picks it
        lh = ld[hb]
        best, bl, bi, bj = np.inf, -1, -1, -1
        for lb in light:
            v, i, j = _best_swap(members[hb], members[lb], szl, lh, ld[lb], best)
            if v < best:
                best, bl, bi, bj = v, lb, i, j
        if best < lh * (1 - 1e-12) and bl not in taken:
            taken.add(bl)
            picks.append((hb, bl, bi, bj))
    for hb, lb, bi, bj in picks:
        d = szl[bi] - (szl[bj] if bj >= 0 else 0.0)
        ld[hb] -= d
        ld[lb] += d
        bin_of[bi] = lb
        members[hb].remove(bi)
        bisect.insort(members[lb], bi)
        if bj >= 0:
            bin_of[bj] = hb
            members[lb].remove(bj)
            bisect.insort(members[hb], bj)
    return bool(picks)


def _best_move(heavy: list, lh: float, ll: float) -> tuple[float, int]:
    """(lowest max(lh - x, ll + x) over (x, item) in `heavy`, sorted; its lowest item).

    In float arithmetic lh - x falls and ll + x rises with x, so the maximum falls then rises
    along the sorted list: its minimum sits where ll + x first reaches lh - x, and the items
    that attain it form one run around there."""
    lo, hi = 0, len(heavy)
    while lo < hi:
        mid = (lo + hi) // 2
        x = heavy[mid][0]
        if ll + x >= lh - x:
            hi = mid
        else:
            lo = mid + 1
    best = np.inf
    if lo > 0:
        best = lh - heavy[lo - 1][0]
    if lo < len(heavy):
        best = min(best, ll + heavy[lo][0])
    if best == np.inf:
        return best, -1
    item = -1
    k = lo - 1
    while k >= 0 and lh - heavy[k][0] == best:
        if item < 0 or heavy[k][1] < item:
            item = heavy[k][1]
        k -= 1
    k = lo
    while k < len(heavy) and ll + heavy[k][0] == best:
        if item < 0 or heavy[k][1] < item:
            item = heavy[k][1]
        k += 1
    return best, item


def _best_swap(heavy: list, light: list, szl: list, lh: float, ll: float,
               bound: float = np.inf) -> tuple[float, int, int]:
    """Lowest max(lh - d, ll + d) below `bound` over moves (d = x) and swaps (d = x - y > 0),
    heavy items then (move, light items) in item order, first wins: (value, heavy item, light
    item or -1); (bound, -1, -1) if none is below it."""
    best, bi, bj = bound, -1, -1
    others = [(szl[j], j) for j in light]
    for i in heavy:
        x = szl[i]
        v = lh - x  # a plain move (x > 0)
        w = ll + x
        if w > v:
            v = w
        if v < best:
            best, bi, bj = v, i, -1
        # a swap lowers the heavy bin by d < x, so it ends at >= lh - x
        if lh - x >= best:
            continue
        for y, j in others:
            if y < x:  # d > 0
                d = x - y
                v = lh - d
                w = ll + d
                if w > v:
                    v = w
                if v < best:
                    best, bi, bj = v, i, j
    return best, bi, bj


def _extremes(loads: np.ndarray, num_heavy: int, num_light: int) -> tuple[np.ndarray, np.ndarray]:
    """(the num_heavy heaviest bins, heaviest first; the num_light lightest, lightest first):
    O(nb) selection plus a sort of the few selected, ties broken by bin index."""
    nb = len(loads)
    if num_heavy + num_light >= nb // 2:
        order = np.argsort(loads, kind="stable")
        return order[::-1][:num_heavy], order[:num_light]
    top = np.argpartition(loads, nb - num_heavy)[nb - num_heavy:]
    top = top[np.lexsort((top, -loads[top]))]
    low = np.argpartition(loads, num_light)[:num_light]
    low = low[np.lexsort((low, loads[low]))]
    return top, low


_MAX_HEAVY, _MAX_LIGHT, _CELLS = 32, 64, 100_000

_ALL_PAIRS_ITEMS_PER_BIN = 8
_SWAP_ITEMS_PER_BIN = 16


def _all_pairs_step(sizes, bin_of, loads, cand, target) -> bool:
    """Heaviest bins x lightest bins: best move/swap for each heavy bin; False if none helps."""
    nb = len(loads)
    top, mean = loads.max(), loads.mean()
    cut = max(target, mean + 0.25 * (top - mean))
    kh = int(min(nb // 2, _MAX_HEAVY, max(1, (loads > cut).sum())))
    kl = int(min(nb - kh, _MAX_LIGHT))
    heavy, light = _extremes(loads, kh, kl)
    role = np.full(nb, -1, dtype=np.int64)
    role[heavy] = np.arange(kh)
    role[light] = kh + np.arange(kl)
    sel = cand[role[bin_of[cand]] >= 0]
    rs = role[bin_of[sel]]
    hv = rs < kh
    if not hv.any():
        return False
    hs, ls = sel[hv], sel[~hv]
    C, hpos = _padded(rs[hv], kh)
    lr = rs[~hv] - kh
    D, lpos = _padded(lr, kl)
    while kh * kl * C * (D + 1) > _CELLS and kl > 1:
        kl //= 2  # keep the lightest half
        keep = lr < kl
        ls, lr, lpos = ls[keep], lr[keep], lpos[keep]
        D = int(lpos.max()) + 1 if len(lpos) else 0
        light = light[:kl]
    Sh = np.full((kh, C), np.nan)
    Sh[rs[hv], hpos] = sizes[hs]
    Ih = np.full((kh, C), -1, dtype=np.int64)
    Ih[rs[hv], hpos] = hs
    Sl = np.zeros((kl, D + 1))  # column 0 is "nothing": a plain move
    Sl[lr, lpos + 1] = sizes[ls]
    Il = np.full((kl, D + 1), -1, dtype=np.int64)
    Il[lr, lpos + 1] = ls
    d = Sh[:, None, :, None] - Sl[None, :, None, :]  # heavy, light, heavy item, light item
    lh = loads[heavy][:, None, None, None]
    ll = loads[light][None, :, None, None]
    with np.errstate(invalid="ignore"):
        new = np.where(d > 0, np.maximum(lh - d, ll + d), np.inf)  # also drops NaN padding
    flat = new.reshape(kh, kl, -1)
    best_ij = np.argmin(flat, axis=2)
    v = np.take_along_axis(flat, best_ij[:, :, None], axis=2)[:, :, 0]
    best_l = np.argmin(v, axis=1)
    hk = np.flatnonzero(v[np.arange(kh), best_l] < loads[heavy] * (1 - 1e-12))
    if len(hk) == 0:
        return False
    _, first = np.unique(best_l[hk], return_index=True)  # heaviest bin wins a shared partner
    hk = hk[np.sort(first)]
    lk = best_l[hk]
    i, j = np.divmod(best_ij[hk, lk], D + 1)
    delta = d[hk, lk, i, j]
    mi, mj = Ih[hk, i], Il[lk, j]
    bin_of[mi] = light[lk]
    has = mj >= 0
    bin_of[mj[has]] = heavy[hk][has]
    loads[heavy[hk]] -= delta
    loads[light[lk]] += delta
    return True


def _pair_step(sizes, bin_of, loads, cand, heavy, light, swaps: bool = True) -> bool:
    """Best move or swap for every (heavy[k], light[k]) pair at once; False if none helps."""
    nb, K = len(loads), len(heavy)
    pair_of = np.full(nb, -1, dtype=np.int64)
    pair_of[heavy] = np.arange(K)
    pair_of[light] = np.arange(K)
    is_heavy = np.zeros(nb, dtype=bool)
    is_heavy[heavy] = True
    sel = cand[pair_of[bin_of[cand]] >= 0]
    if len(sel) == 0:
        return False
    pk = pair_of[bin_of[sel]]
    hv = is_heavy[bin_of[sel]]
    if not swaps:  # light bins' items are not candidates: moves only
        sel, pk, hv = sel[hv], pk[hv], hv[hv]
    hs, ls = sel[hv], sel[~hv]
    H, hpos = _padded(pk[hv], K)
    Lm, lpos = _padded(pk[~hv], K)
    Sh = np.full((K, max(H, 1)), np.nan)
    Sh[pk[hv], hpos] = sizes[hs]
    Sl = np.zeros((K, Lm + 1))  # column 0 is "nothing": a plain move
    Sl[pk[~hv], lpos + 1] = sizes[ls]
    Ih = np.full((K, max(H, 1)), -1, dtype=np.int64)
    Ih[pk[hv], hpos] = hs
    Il = np.full((K, Lm + 1), -1, dtype=np.int64)
    Il[pk[~hv], lpos + 1] = ls
    lh, ll = loads[heavy][:, None, None], loads[light][:, None, None]
    d = Sh[:, :, None] - Sl[:, None, :]
    with np.errstate(invalid="ignore"):
        new = np.where(d > 0, np.maximum(lh - d, ll + d), np.inf)  # also drops NaN padding
    flat = new.reshape(K, -1)
    best = np.argmin(flat, axis=1)
    bestv = flat[np.arange(K), best]
    ok = bestv < loads[heavy] * (1 - 1e-12)
    if not ok.any():
        return False
    ki = np.flatnonzero(ok)
    i, j = np.divmod(best[ki], Lm + 1)
    mi, mj = Ih[ki, i], Il[ki, j]
    delta = d.reshape(K, -1)[ki, best[ki]]
    bin_of[mi] = light[ki]
    has = mj >= 0
    bin_of[mj[has]] = heavy[ki][has]
    loads[heavy[ki]] -= delta
    loads[light[ki]] += delta
    return True


def _padded(keys: np.ndarray, num_keys: int) -> tuple[int, np.ndarray]:
    """(max count per key, position of each element among equal keys)."""
    if len(keys) == 0:
        return 0, np.zeros(0, dtype=np.int64)
    order = np.argsort(keys, kind="stable")
    k = keys[order]
    pos_sorted = np.arange(len(k)) - np.searchsorted(k, k)
    pos = np.empty(len(k), dtype=np.int64)
    pos[order] = pos_sorted
    return int(pos.max()) + 1, pos
