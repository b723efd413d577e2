"""Partitioning primitives: valid assignments, known answers, refine never makes things worse."""

from __future__ import annotations

import numpy as np
import pytest

from dispatcher_server.planner.balance import (
    _affinities, _all_pairs_exchange, _extremes, _greedy_pairs, _key_order, _kth_smallest,
    _load_order, _members, _num_heavy, _pair_step, _refine_all_pairs, _refine_global,
    _refine_in_groups, _rotating_pairs, karmarkar_karp, lpt_heap, lpt_home, lpt_rounds,
    order_by_key_then_size, refine, relabel_bins, stable_order, swap_home,
)

pytestmark = pytest.mark.timeout(60)


def _loads(sizes, bins, k):
    return np.bincount(bins, weights=sizes, minlength=k)


def test_karmarkar_karp_known_answer():
    sizes = np.array([8.0, 7, 6, 5, 4])
    bins = karmarkar_karp(sizes, 2)
    # differencing: 8-7=1, 6-5=1, then {4,1,1} -> 4-1=3, 3-1=2: sums 16 and 14
    assert sorted(_loads(sizes, bins, 2)) == [14.0, 16.0]
    assert sorted(_loads(sizes, lpt_heap(sizes, 2), 2)) == [13.0, 17.0]


@pytest.mark.parametrize("k", [1, 3, 16, 100])
def test_partitions_use_every_item_once(k):
    rng = np.random.default_rng(k)
    sizes = rng.lognormal(0, 1, 500)
    for bins in (karmarkar_karp(sizes, k), lpt_heap(sizes, k)):
        assert bins.shape == (500,) and bins.min() >= 0 and bins.max() < k
        loads = _loads(sizes, bins, k)
        assert loads.sum() == pytest.approx(sizes.sum())
        assert loads.max() <= sizes.sum() / k + sizes.max() + 1e-9  # LPT/KK guarantee


def _textbook_lpt(sizes, k, loads=None):
    """The heap algorithm, item by item: the oracle lpt_heap's whole-array rounds must match."""
    import heapq

    heap = [(0.0 if loads is None else float(loads[b]), b) for b in range(k)]
    heapq.heapify(heap)
    out = [0] * len(sizes)
    for i in np.argsort(-np.asarray(sizes, dtype=np.float64), kind="stable").tolist():
        load, b = heap[0]
        out[i] = b
        heapq.heapreplace(heap, (load + float(sizes[i]), b))
    final = np.zeros(k)
    for load, b in heap:
        final[b] = load
    return np.array(out), final


@pytest.mark.parametrize("case", range(40))
def test_lpt_heap_is_exactly_the_textbook_algorithm(case):
    """Same bins, same final loads, bit for bit: long tails, equal sizes (ties everywhere),
    zeros, integers, few or many items per bin, from empty bins or given loads."""
    rng = np.random.default_rng(case)
    k = int(rng.choice([1, 2, 7, 64, 300, 2048]))
    n = int(rng.integers(0, 6 * k + 20))
    kind = case % 5
    sizes = (rng.lognormal(0, 1.5, n) if kind == 0 else np.full(n, 3.0) if kind == 1
             else rng.integers(0, 4, n).astype(float) if kind == 2
             else rng.choice([0.0, 1.0, 1000.0], n) if kind == 3 else rng.uniform(1, 1.01, n))
    start = None if case % 2 else rng.choice([0.0, 1.0, 5.0], k)
    loads = None if start is None else start.copy()
    bins = lpt_heap(sizes, k, loads)
    want, final = _textbook_lpt(sizes, k, start)
    assert bins.tolist() == want.tolist()
    if loads is not None:
        assert loads.tolist() == final.tolist()


def test_lpt_heap_from_loads_fills_the_lightest_bins():
    """From given loads, each item (largest first) lands on the then lightest bin, and the
    loads come back updated."""
    start = np.array([5.0, 0.0, 2.0])
    loads = start.copy()
    sizes = np.array([1.0, 4.0, 2.0])
    bins = lpt_heap(sizes, 3, loads)
    # 4 -> bin 1 (0), 2 -> bin 2 (2), 1 -> bin 1 (4; bin 2 holds 4 too, the lower bin wins)
    assert bins.tolist() == [1, 1, 2]
    assert np.allclose(loads, start + _loads(sizes, bins, 3))
    assert loads.tolist() == [5.0, 5.0, 4.0]


def test_lpt_rounds_groups_and_cap():
    rng = np.random.default_rng(1)
    sizes = rng.uniform(1, 10, 300)
    groups = rng.integers(0, 5, 300)
    loads = np.zeros((5, 4))
    bins = lpt_rounds(sizes, groups, loads)
    for g in range(5):
        sel = groups == g
        assert np.allclose(loads[g], _loads(sizes[sel], bins[sel], 4))
    capped = np.zeros((1, 4))
    bins = lpt_rounds(sizes, np.zeros(300, dtype=np.int64), capped, cap=50.0)
    assert capped.max() <= 50.0 and (bins == -1).any()
    assert np.allclose(capped[0], _loads(sizes[bins >= 0], bins[bins >= 0], 4))


@pytest.mark.parametrize("mode", [dict(), dict(all_pairs=True), dict(bins_per_group=4)])
def test_refine_lowers_the_max_and_keeps_loads_consistent(mode):
    rng = np.random.default_rng(2)
    sizes = rng.lognormal(0, 1, 400)
    bins = rng.integers(0, 32, 400)
    loads = _loads(sizes, bins, 32)
    before = loads.max()
    movable = rng.random(400) < 0.8
    fixed = bins[~movable].copy()
    refine(sizes, bins, loads, movable=movable, target=sizes.sum() / 32, **mode)
    assert np.allclose(loads, _loads(sizes, bins, 32))
    assert loads.max() < before
    assert np.array_equal(bins[~movable], fixed)


def _pair_step_by_the_rule(sizes, bin_of, loads, cand, heavy, light, swaps, max_cells):
    """The pair step's rule, one pair and one candidate exchange at a time."""
    members = {b: [c for c in cand if bin_of[c] == b] for b in list(heavy) + list(light)}
    if swaps and len(heavy) * max(len(members[h]) for h in heavy) * (
            max(len(members[lb]) for lb in light) + 1) > max_cells:
        swaps = False
    bin_of, loads, moved = bin_of.copy(), loads.copy(), False
    for h, lb in zip(heavy, light):
        lh, ll = loads[h], loads[lb]
        exchanges = [(i, j) for i in members[h] for j in [None] + (members[lb] if swaps else [])]
        best = None
        for i, j in exchanges:  # first of the smallest |d - (lh - ll) / 2| with d > 0
            d = sizes[i] - (sizes[j] if j is not None else 0.0)
            if d > 0 and (best is None or abs(d - (lh - ll) / 2) < best[0]):
                best = (abs(d - (lh - ll) / 2), i, j, d)
        if best is None or max(lh - best[3], ll + best[3]) >= lh * (1 - 1e-12):
            continue
        _, i, j, d = best
        bin_of[i] = lb
        if j is not None:
            bin_of[j] = h
        loads[h] -= d
        loads[lb] += d
        moved = True
    return moved, bin_of, loads


def _random_bins(seed: int, min_bins: int):
    """(rng, sizes, bin_of, loads, bins in random order) of a random instance with tied sizes."""
    rng = np.random.default_rng(seed)
    nb, n = int(rng.integers(min_bins, 40)), int(rng.integers(1, 300))
    sizes = np.round(rng.lognormal(0, 1, n), int(rng.integers(0, 3)))  # ties when rounded
    bin_of = rng.integers(0, nb, n)
    return rng, sizes, bin_of, _loads(sizes, bin_of, nb), rng.permutation(nb)


@pytest.mark.parametrize("seed", range(30))
def test_pair_step_applies_the_best_exchange_of_every_pair(seed):
    rng, sizes, bin_of, loads, order = _random_bins(seed, 4)
    nb, n = len(loads), len(sizes)
    K = int(rng.integers(1, nb // 2 + 1))
    heavy, light = order[:K], order[K:2 * K]
    cand = np.flatnonzero(rng.random(n) < 0.9)
    swaps, cells = bool(rng.random() < 0.7), int(rng.choice([10, 10**6]))
    moved, want_bins, want_loads = _pair_step_by_the_rule(sizes, bin_of, loads, cand, heavy,
                                                          light, swaps, cells)
    assert _pair_step(sizes, bin_of, loads, cand, heavy, light, swaps, cells) == moved
    assert np.array_equal(bin_of, want_bins)
    assert np.array_equal(loads, want_loads)


def _all_pairs_by_the_rule(sizes, bin_of, loads, cand, heavy, light, max_cells):
    """The all-pairs step's rule, one heavy bin, light bin and candidate exchange at a time."""
    members = {b: [c for c in cand if bin_of[c] == b] for b in list(heavy) + list(light)}
    fullest_h = max(len(members[h]) for h in heavy)
    if fullest_h == 0:
        return False, bin_of, loads
    while len(light) > 1 and len(heavy) * len(light) * fullest_h * (
            max(len(members[lb]) for lb in light) + 1) > max_cells:
        light = light[:len(light) // 2]
    chosen = []  # (heavy bin, light bin, item, light item or None), heaviest first
    for h in heavy:
        lh, top = loads[h], None
        for lb in light:
            ll, best = loads[lb], None
            for i in members[h]:  # first of the smallest |d - (lh - ll) / 2| with d > 0
                for j in [None] + members[lb]:
                    d = sizes[i] - (sizes[j] if j is not None else 0.0)
                    if d > 0 and (best is None or abs(d - (lh - ll) / 2) < best[0]):
                        best = (abs(d - (lh - ll) / 2), i, j)
            # first light bin whose best exchange leaves the lowest maximum
            if best is not None and (top is None or (lh + ll) / 2 + best[0] < top[0]):
                top = ((lh + ll) / 2 + best[0], lb, best[1], best[2])
        if top is not None and top[0] < lh * (1 - 1e-12):
            chosen.append((h,) + top[1:])
    bin_of, loads, taken = bin_of.copy(), loads.copy(), set()
    for h, lb, i, j in chosen:
        if lb in taken:  # the heaviest bin that wants a light bin gets it
            continue
        taken.add(lb)
        d = sizes[i] - (sizes[j] if j is not None else 0.0)
        bin_of[i] = lb
        if j is not None:
            bin_of[j] = h
        loads[h] -= d
        loads[lb] += d
    return bool(taken), bin_of, loads


@pytest.mark.parametrize("seed", range(30))
def test_all_pairs_exchange_gives_each_heavy_bin_its_best_exchange(seed):
    rng, sizes, bin_of, loads, order = _random_bins(seed, 2)
    nb, n = len(loads), len(sizes)
    kh = int(rng.integers(1, nb // 2 + 1))
    heavy, light = order[:kh], order[kh:kh + int(rng.integers(1, nb - kh + 1))]
    cand = np.flatnonzero((rng.random(n) < 0.9) & (sizes > 0))
    cells = int(rng.choice([10, 1000, 10**6]))
    moved, want_bins, want_loads = _all_pairs_by_the_rule(sizes, bin_of, loads, cand, heavy,
                                                          light, cells)
    assert _all_pairs_exchange(sizes, bin_of, loads, cand, heavy, light, cells) == moved
    assert np.array_equal(bin_of, want_bins)
    assert np.array_equal(loads, want_loads)


def _lpt_rounds_by_the_rule(sizes, groups, loads, cap):
    """Batched LPT's rule, one group, round and item at a time."""
    loads, out = loads.copy(), [0] * len(sizes)
    B = loads.shape[1]
    for g in sorted(set(groups.tolist())):
        # the group's items, largest first (ties: first given first)
        items = sorted((i for i in range(len(sizes)) if groups[i] == g), key=lambda i: -sizes[i])
        for lo in range(0, len(items), B):
            ranked = sorted(range(B), key=lambda b: (loads[g, b], b))  # as the round starts
            for item, b in zip(items[lo:lo + B], ranked):
                if cap is not None and not loads[g, b] + sizes[item] <= cap:
                    out[item] = -1
                else:
                    out[item] = b
                    loads[g, b] += sizes[item]
    return np.array(out, dtype=np.int64), loads


@pytest.mark.parametrize("seed", range(30))
def test_lpt_rounds_hands_each_round_to_the_least_loaded_bins(seed):
    rng = np.random.default_rng(seed)
    G, n = int(rng.integers(1, 5)), int(rng.integers(0, 200))
    B = int(rng.choice([1, 3, 8, 11, 24, 40]))  # a radix sort of the bins above 16
    sizes = np.round(rng.lognormal(0, 1, n), int(rng.integers(0, 2)))  # ties when rounded
    groups = rng.integers(0, G, n)
    loads = np.round(rng.random((G, B)) * float(rng.choice([0, 2, 10])))  # tied loads too
    cap = None if rng.random() < 0.4 else float(rng.uniform(1, 3) * (sizes.sum() / (G * B) + 1))
    want_bins, want_loads = _lpt_rounds_by_the_rule(sizes, groups, loads, cap)
    assert np.array_equal(lpt_rounds(sizes, groups, loads, cap=cap), want_bins)
    assert np.array_equal(loads, want_loads)


def _lpt_home_by_the_rule(sizes, home, loads, node_size, tol, K):
    """lpt_home's rule, one round, item and bin at a time."""
    loads, out, nb = loads.copy(), [0] * len(sizes), len(loads)
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])  # ties: first given first
    for start in range(0, len(order), K):
        items = order[start:start + K]
        k, homes = len(items), {home[i] for i in items}
        bins = list(range(nb))
        if k < nb:  # near the k-th load: home bins first, then by index; then by load, index
            near = loads <= sorted(loads)[k - 1] + tol
            bins = sorted(bins, key=lambda b: (0.0 if near[b] else loads[b],
                                               not (near[b] and b in homes), b))[:k]
        bins.sort(key=lambda b: loads[b])
        band = [int((loads[b] - loads[bins[0]]) // tol) if tol > 0 else t
                for t, b in enumerate(bins)]
        take, pos = [None] * k, {b: t for t, b in enumerate(bins)}
        for t, i in enumerate(items):  # the home bin, if in the round and the item's band
            hp = pos.get(home[i])
            if hp is not None and band[hp] == band[t] and hp not in take:
                take[t] = hp
        if node_size > 1:  # then a bin left of the same band and node, in order
            free = {}
            for p in range(k):
                if p not in take:
                    free.setdefault((band[p], bins[p] // node_size), []).append(p)
            for t, i in enumerate(items):
                q = free.get((band[t], home[i] // node_size))
                if take[t] is None and q:
                    take[t] = q.pop(0)
        left = sorted((t for t in range(k) if take[t] is None), key=lambda t: band[t])
        for t, p in zip(left, sorted((p for p in range(k) if p not in take),
                                     key=lambda p: band[p])):
            take[t] = p
        for t, i in enumerate(items):
            out[i] = bins[take[t]]
            loads[bins[take[t]]] += sizes[i]
    return np.array(out, dtype=np.int64), loads


@pytest.mark.parametrize("seed", range(30))
def test_lpt_home_is_batched_lpt_bent_home_by_the_rule(seed):
    rng = np.random.default_rng(seed)
    nb, n = int(rng.choice([2, 4, 6, 8, 16, 24])), int(rng.integers(0, 200))
    sizes = np.round(rng.lognormal(0, 1, n), int(rng.integers(0, 2)))  # ties when rounded
    home = rng.integers(0, nb, n)
    loads = np.round(rng.random(nb) * float(rng.choice([0, 2, 10])))  # tied loads too
    node = int(rng.choice([d for d in (1, 2, 4) if nb % d == 0]))
    tol = float(rng.choice([0.0, 0.3, 1.0, 2.5, -0.5]))
    K = int(rng.integers(1, nb + 1))
    want_bins, want_loads = _lpt_home_by_the_rule(sizes, home, loads, node, tol, K)
    assert np.array_equal(lpt_home(sizes, home, loads, node_size=node, tol=tol, round_size=K),
                          want_bins)
    assert np.array_equal(loads, want_loads)


@pytest.mark.parametrize("seed", range(10))
def test_greedy_pairs_gives_each_bin_its_first_target_with_room(seed):
    rng = np.random.default_rng(seed)
    nb, nt, m = int(rng.integers(1, 20)), int(rng.integers(1, 10)), int(rng.integers(0, 100))
    bins, targets = rng.integers(0, nb, m), rng.integers(0, nt, m)  # repeats on both sides
    room = rng.integers(0, 4, nt)
    want_out, want_room = [-1] * nb, room.tolist()
    for b, t in zip(bins.tolist(), targets.tolist()):  # the rule: in order, first come
        if want_out[b] < 0 and want_room[t] > 0:
            want_out[b] = t
            want_room[t] -= 1
    out = np.full(nb, -1, dtype=np.int64)
    _greedy_pairs(bins, targets, room, out)
    assert out.tolist() == want_out and room.tolist() == want_room


def _refine_by_the_rule(sizes, bin_of, loads, cand, target, max_iter, swaps, max_cells, pairs):
    """Refine's rule, one iteration at a time: `pairs(loads, it)` gives the iteration's heavy
    bins, their light partners and the rotations before partners repeat (None: stop)."""
    idle = still = 0
    for it in range(max_iter):
        top = max(loads)
        if top <= target * (1 + 1e-12):
            break
        chosen = pairs(loads, it)
        if chosen is None:
            break
        heavy, light, rotations = chosen
        if not swaps:
            cand = np.array([c for c in cand if sizes[c] < top - min(loads)], dtype=np.int64)
        moved, bin_of, loads = _pair_step_by_the_rule(sizes, bin_of, loads, cand, heavy, light,
                                                      swaps, max_cells)
        idle = 0 if moved and max(loads) < top * (1 - 1e-12) else idle + 1
        still = 0 if moved else still + 1
        if idle >= rotations + 2 or still >= rotations:
            break
    return bin_of, loads


def _refine_in_groups_by_the_rule(sizes, bin_of, loads, cand, B, target, max_iter, swaps,
                                  max_cells):
    """Refine's rule in groups of B bins: each busy group's heavier half against its lighter
    half, the partner rotating."""
    h = B // 2

    def pairs(loads, it):
        heavy, light = [], []
        for g in range(len(loads) // B):
            if max(loads[g * B:(g + 1) * B]) > target * (1 + 1e-12):
                o = sorted(range(g * B, (g + 1) * B), key=lambda b: loads[b])  # ties: by bin
                heavy += [o[B - 1 - j] for j in range(h)]
                light += [o[(j + it) % h] for j in range(h)]
        return (heavy, light, h) if heavy else None

    return _refine_by_the_rule(sizes, bin_of, loads, cand, target, max_iter, swaps, max_cells,
                               pairs)


@pytest.mark.parametrize("seed", range(20))
def test_refine_in_groups_iterates_pair_steps_by_the_rule(seed):
    rng = np.random.default_rng(seed)
    B = int(rng.choice([2, 3, 4, 8, 18, 24]))
    nb, n = B * int(rng.integers(1, 6)), int(rng.integers(1, 150))
    sizes = np.round(rng.lognormal(0, 1, n), int(rng.integers(0, 2)))  # ties when rounded
    bin_of = np.minimum(rng.integers(0, nb, n), rng.integers(0, nb, n))  # skewed
    loads = _loads(sizes, bin_of, nb)
    cand = np.flatnonzero((rng.random(n) < 0.9) & (sizes > 0))
    target = float(rng.choice([0.0, sizes.sum() / nb]))
    max_iter, swaps = int(rng.choice([1, 4, 16])), bool(rng.random() < 0.6)
    cells = int(rng.choice([10, 10**6]))
    want_bins, want_loads = _refine_in_groups_by_the_rule(sizes, bin_of, loads, cand, B, target,
                                                          max_iter, swaps, cells)
    _refine_in_groups(sizes, bin_of, loads, cand, B, target, max_iter, swaps, cells)
    assert np.array_equal(bin_of, want_bins)
    assert np.array_equal(loads, want_loads)


def _heavy_and_pool_by_the_rule(loads, target, most, pool_per_heavy, most_light):
    """Refine's choice of bins: k heavy ones (above max(target, mean + (top - mean) / 4), the
    mean a plain sum in bin order / bins; 1 <= k <= most) by (load desc, index), then the m
    lightest others by (load asc, index)."""
    total = 0.0
    for x in loads.tolist():  # not sum(): Python's sum of floats is compensated
        total += x
    mean = total / len(loads)
    cut = max(target, mean + 0.25 * (max(loads) - mean))
    k = min(most, max(1, sum(1 for x in loads if x > cut)))
    heavy = sorted(range(len(loads)), key=lambda b: (-loads[b], b))[:k]
    rest = sorted((b for b in range(len(loads)) if b not in heavy), key=lambda b: (loads[b], b))
    return heavy, rest[:min(len(loads) - k, pool_per_heavy * k, most_light)]


def _tied_loads(rng, nb):
    return np.round(rng.random(nb) * float(rng.choice([1, 3, 1000])), int(rng.integers(0, 3)))


@pytest.mark.parametrize("seed", range(20))
def test_rotating_pairs_and_extremes_choose_bins_by_the_rule(seed):
    rng = np.random.default_rng(seed)
    for _ in range(20):
        nb = int(rng.integers(2, 60))
        loads = _tied_loads(rng, nb)  # many exact ties
        target = float(rng.choice([0.0, loads.mean(), 2 * loads.max()]))
        it = int(rng.integers(0, 10))
        heavy, pool = _heavy_and_pool_by_the_rule(loads, target, nb // 2, 4, nb)
        k, m = len(heavy), len(pool)
        assert _num_heavy(loads, target, nb // 2) == k
        rotations = -(-m // k)
        got_h, got_l, got_r = _rotating_pairs(loads, target, it)
        assert got_h.tolist() == heavy and got_r == rotations
        assert got_l.tolist() == [pool[(j + (it % rotations) * k) % m] for j in range(k)]
        kh = min(nb // 2, 3)
        nl = int(rng.integers(0, nb - kh + 1))
        heavy = sorted(range(nb), key=lambda b: (-loads[b], b))[:kh]
        light = sorted((b for b in range(nb) if b not in heavy), key=lambda b: (loads[b], b))[:nl]
        assert [x.tolist() for x in _extremes(loads, kh, nl)] == [heavy, light]


@pytest.mark.parametrize("seed", range(10))
def test_load_order_sorts_bins_by_load_then_index(seed):
    rng = np.random.default_rng(seed)
    for _ in range(50):
        n = int(rng.integers(1, 300))
        loads = _tied_loads(rng, n) * float(rng.choice([1, -1, 1e-300, 1e300]))  # ties, signs
        loads[rng.random(n) < 0.1] = float(rng.choice([0.0, -0.0, np.inf]))
        assert _load_order(loads).tolist() == sorted(range(n), key=lambda b: (loads[b], b))


def _refine_global_by_the_rule(sizes, bin_of, loads, cand, target, max_iter, swaps, max_cells):
    """Refine's global rule: the heavy bins against partners that rotate through a pool of 4x
    as many light ones."""
    def pairs(loads, it):
        heavy, pool = _heavy_and_pool_by_the_rule(loads, target, len(loads) // 2, 4, len(loads))
        k, m = len(heavy), len(pool)
        rotations = -(-m // k)
        return heavy, [pool[(j + (it % rotations) * k) % m] for j in range(k)], rotations

    return _refine_by_the_rule(sizes, bin_of, loads, cand, target, max_iter, swaps, max_cells,
                               pairs)


def _refine_all_pairs_by_the_rule(sizes, bin_of, loads, cand, target, max_iter, max_heavy,
                                  max_light, max_cells):
    idle = 0
    for _ in range(max_iter):
        top = max(loads)
        if top <= target * (1 + 1e-12):
            break
        heavy, light = _heavy_and_pool_by_the_rule(loads, target, min(len(loads) // 2, max_heavy),
                                                   len(loads), max_light)
        moved, bin_of, loads = _all_pairs_by_the_rule(sizes, bin_of, loads, cand,
                                                      np.array(heavy), np.array(light), max_cells)
        idle = 0 if moved and max(loads) < top * (1 - 1e-12) else idle + 1
        if idle >= 3 or not moved:
            break
    return bin_of, loads


@pytest.mark.parametrize("seed", range(40))
def test_refine_global_and_all_pairs_iterate_by_the_rule(seed):
    rng = np.random.default_rng(seed)
    nb, n = int(rng.integers(2, 40)), int(rng.integers(1, 200))
    sizes = _tie_heavy_sizes(rng, n)  # tied top loads: moves that do not lower the top
    bin_of = np.minimum(rng.integers(0, nb, n), rng.integers(0, nb, n))  # skewed
    loads = _loads(sizes, bin_of, nb)
    cand = np.flatnonzero((rng.random(n) < 0.9) & (sizes > 0))
    target = float(rng.choice([0.0, sizes.sum() / nb]))
    max_iter, swaps = int(rng.choice([1, 4, 16, 64])), bool(rng.random() < 0.6)
    cells = int(rng.choice([10, 10**6]))
    if seed % 3 == 0:
        args = (target, max_iter, int(rng.integers(1, 5)), int(rng.integers(1, 8)), cells)
        want_bins, want_loads = _refine_all_pairs_by_the_rule(sizes, bin_of, loads, cand, *args)
        _refine_all_pairs(sizes, bin_of, loads, cand, *args)
    else:
        args = (target, max_iter, swaps, cells)
        want_bins, want_loads = _refine_global_by_the_rule(sizes, bin_of, loads, cand, *args)
        _refine_global(sizes, bin_of, loads, cand, *args)
    assert np.array_equal(bin_of, want_bins)
    assert np.array_equal(loads, want_loads)


def test_refine_global_runs_to_its_stops_by_the_rule():
    """Few bins, tied sizes, target 0, many iterations: the runs end at the idle and still
    stops (moves that leave the top load where it was), not at max_iter."""
    for seed in range(250):
        rng = np.random.default_rng(seed)
        nb, n = int(rng.integers(2, 12)), int(rng.integers(1, 60))
        sizes = _tie_heavy_sizes(rng, n)
        bin_of = np.minimum(rng.integers(0, nb, n), rng.integers(0, nb, n))
        loads = _loads(sizes, bin_of, nb)
        cand = np.flatnonzero((rng.random(n) < 0.7) & (sizes > 0))
        args = (0.0, 64, bool(rng.random() < 0.5), 10**6)
        want_bins, want_loads = _refine_global_by_the_rule(sizes, bin_of, loads, cand, *args)
        _refine_global(sizes, bin_of, loads, cand, *args)
        assert np.array_equal(bin_of, want_bins) and np.array_equal(loads, want_loads), seed


@pytest.mark.parametrize("seed", range(10))
def test_members_groups_items_by_their_bins_role_in_cand_order(seed):
    rng = np.random.default_rng(seed)
    nb, n, R = int(rng.integers(1, 30)), int(rng.integers(0, 300)), int(rng.integers(1, 10))
    bin_of = rng.integers(0, nb, n)
    role = np.where(rng.random(nb) < 0.5, rng.integers(0, R, nb), -1)
    cand = rng.permutation(n)[:int(rng.integers(0, n + 1))]  # any order, some items
    ptr, items = _members(cand, bin_of, role, R)
    for r in range(R):  # the rule: role r's items, as cand lists them
        assert items[ptr[r]:ptr[r + 1]].tolist() == [c for c in cand if role[bin_of[c]] == r]
    assert ptr[R] == len(items)


@pytest.mark.parametrize("seed", range(10))
def test_kth_smallest_is_the_sorted_values_kth(seed):
    rng = np.random.default_rng(seed)
    for _ in range(50):
        n = int(rng.integers(1, 300))
        values = np.round(rng.random(n) * float(rng.choice([1, 3, 100])))  # many ties
        k = int(rng.integers(0, n))
        assert _kth_smallest(values, k) == sorted(values.tolist())[k]


def test_refine_in_groups_never_crosses_groups():
    rng = np.random.default_rng(3)
    sizes = rng.lognormal(0, 1, 200)
    bins = rng.integers(0, 16, 200)
    group_before = bins // 4
    loads = _loads(sizes, bins, 16)
    refine(sizes, bins, loads, bins_per_group=4, target=0.0)
    assert np.array_equal(bins // 4, group_before)


def test_lpt_home_keeps_first_round_at_home_when_loads_tie():
    sizes = np.array([10.0, 9, 8, 7])
    home = np.array([3, 2, 1, 0])
    loads = np.zeros(4)
    bins = lpt_home(sizes, home, loads, node_size=2, tol=1.0)
    assert np.array_equal(bins, home)
    assert np.allclose(loads, _loads(sizes, bins, 4))


def test_relabel_bins_is_a_permutation_that_brings_weight_home():
    rng = np.random.default_rng(4)
    W, g = 32, 4
    home = rng.integers(0, W, 300)
    # bins filled with items of one home node each, but sitting on the wrong nodes
    bins = (home // g * g + rng.integers(0, g, 300) + g) % W
    weight = rng.uniform(1, 5, 300)
    new_rank = relabel_bins(bins, home, weight, W, g)
    assert sorted(new_rank.tolist()) == list(range(W))
    before = weight[bins // g != home // g].sum()
    after = weight[new_rank[bins] // g != home // g].sum()
    assert before > 0 and after == 0.0


def _tie_heavy_sizes(rng, n):
    """Sizes with many exact ties (integer costs) or long tails: where tie-breaks decide."""
    if rng.random() < 0.5:
        return rng.integers(1, 5, n).astype(np.float64)
    return np.round(rng.lognormal(0, 2, n), 1) + 0.1


@pytest.mark.parametrize("seed", range(4))
def test_kernels_on_few_bins_keep_their_contracts(seed):
    """Small worlds run the same numpy kernels: on few bins and tie-heavy sizes, refine never
    raises the maximum and keeps loads equal to the items' sums; lpt_home and lpt_rounds
    place every item (or mark it -1 over `cap`) and report the loads they produced."""
    rng = np.random.default_rng(seed)
    for _ in range(150):
        nb = int(rng.choice([2, 3, 4, 8, 16]))
        n = int(rng.integers(1, 40 * nb))
        sizes = _tie_heavy_sizes(rng, n)
        bins0 = np.minimum(rng.integers(0, nb, n), rng.integers(0, nb, n))  # skewed start
        mode = [dict(), dict(all_pairs=True), dict(bins_per_group=2 if nb % 2 == 0 else nb),
                dict(movable=rng.random(n) < 0.7)][int(rng.integers(4))]
        b, ld = bins0.copy(), _loads(sizes, bins0, nb)
        top = ld.max()
        refine(sizes, b, ld, target=sizes.sum() / nb, **mode)
        assert np.allclose(ld, _loads(sizes, b, nb)) and ld.max() <= top * (1 + 1e-12)
        if "bins_per_group" in mode:
            B = mode["bins_per_group"]
            assert np.array_equal(b // B, bins0 // B)
        if "movable" in mode:
            assert np.array_equal(b[~mode["movable"]], bins0[~mode["movable"]])

        home = rng.integers(0, nb, n)
        node = int(rng.choice([d for d in (1, 2, 4) if nb % d == 0]))
        ld = np.zeros(nb)
        h = lpt_home(sizes, home, ld, node_size=node, tol=float(rng.choice([0.0, 0.5, 2.0])),
                     round_size=int(rng.choice([1, 2, nb])))
        assert h.min() >= 0 and h.max() < nb and np.allclose(ld, _loads(sizes, h, nb))

        groups = rng.integers(0, 2, n)
        cap = None if rng.random() < 0.5 else float(sizes.sum() / nb)
        ld = np.zeros((2, max(1, nb // 2)))
        r = lpt_rounds(sizes, groups, ld, cap=cap)
        placed = r >= 0
        assert cap is not None or placed.all()
        got = np.zeros_like(ld)
        np.add.at(got, (groups[placed], r[placed]), sizes[placed])
        assert np.allclose(got, ld)
        if cap is not None:
            assert ld.max() <= cap * (1 + 1e-12)


def _key_order_by_the_rule(keys, sizes, by_size):
    """Positions sorted by (key, -size, position), or (key, position); None where the kernel
    must decline: a negative key, one at or above max(4n, 2**16), or with `by_size` sizes
    neither non-increasing nor non-decreasing (NaN included)."""
    n = len(keys)
    if n and (min(keys) < 0 or max(keys) >= max(4 * n, 1 << 16)):
        return None
    if by_size:
        pairs = list(zip(sizes[:-1], sizes[1:]))
        if not (all(a >= b for a, b in pairs) or all(a <= b for a, b in pairs)):
            return None
        return sorted(range(n), key=lambda i: (keys[i], -sizes[i], i))
    return sorted(range(n), key=lambda i: (keys[i], i))


@pytest.mark.parametrize("seed", range(60))
def test_key_order_is_a_counting_sort_by_key_then_decreasing_size(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 200))
    hi = int(rng.choice([1, 5, 1000, 1 << 16, 1 << 20]))
    keys = rng.integers(0, hi, n) - (rng.random() < 0.1)  # sometimes a -1 key
    if rng.random() < 0.4:
        keys = np.sort(keys)  # grouped already, as items by their sample come
    sizes = rng.integers(0, int(rng.choice([2, 5, 50])), n).astype(np.float64)  # many ties
    shape = rng.integers(4)
    if shape == 0:
        sizes = np.sort(sizes)[::-1].copy()
    elif shape == 1:
        sizes = np.sort(sizes)
    elif shape == 2 and n:
        sizes = np.sort(sizes)
        sizes[int(rng.integers(n))] = np.nan
    by_size = bool(rng.random() < 0.7)
    want = _key_order_by_the_rule(keys.tolist(), sizes.tolist(), by_size)
    out = np.full(n, -7, dtype=np.int64)
    done = _key_order(keys, sizes if by_size else np.zeros(0), by_size, out)
    if want is None:
        assert not done and (out == -7).all()
    else:
        assert done and out.tolist() == want
    if (keys >= 0).all() and not np.isnan(sizes).any():  # the wrappers, whichever way they go
        assert np.array_equal(stable_order(keys), np.argsort(keys, kind="stable"))
        assert np.array_equal(order_by_key_then_size(keys, sizes), np.lexsort((-sizes, keys)))


def _swap_home_by_the_rule(size, home_node, nbytes, rank, loads, g, cap, passes):
    """`swap_home`'s rule on lists: passes over the items away from their home node, by
    decreasing bytes then index; each still away takes, among the items away from home that
    sit on its home node (by index), the one saving the most bytes, then changing the loads
    least, then first, that keeps both ranks at or under cap; none if nothing is saved."""
    rank, loads, total = list(rank), list(loads), 0
    for _ in range(passes):
        away = [i for i in range(len(size)) if rank[i] // g != home_node[i]]
        gone, swaps = set(), 0
        for x in sorted(away, key=lambda i: (-nbytes[i], i)):
            if x in gone or rank[x] // g == home_node[x]:
                continue
            b, best = rank[x] // g, None
            for y in sorted(i for i in away if i not in gone and rank[i] // g == home_node[x]
                            and rank[i] // g != home_node[i]):
                d = size[x] - size[y]
                if loads[rank[y]] + d > cap or loads[rank[x]] - d > cap:
                    continue
                key = (nbytes[x] + (nbytes[y] if home_node[y] == b else 0.0), -abs(d))
                if key[0] > 0 and (best is None or key > best[0]):
                    best = (key, y)
            if best is None:
                continue
            y = best[1]
            d = size[x] - size[y]
            loads[rank[y]] += d
            loads[rank[x]] -= d
            rank[x], rank[y] = rank[y], rank[x]
            gone.add(x)
            swaps += 1
        total += swaps
        if not swaps:
            break
    return rank, loads, total


@pytest.mark.parametrize("seed", range(40))
def test_swap_home_swaps_items_home_by_the_rule(seed):
    rng = np.random.default_rng(seed)
    g = int(rng.choice([1, 2, 4]))
    W = g * int(rng.integers(2, 6))
    n = int(rng.integers(0, 60))
    size = rng.integers(1, int(rng.choice([2, 4, 20])), n).astype(np.float64)  # ties
    home = rng.integers(0, W, n)
    nbytes = rng.integers(0, 4, n).astype(np.float64)  # ties, and items of no bytes
    rank = rng.integers(0, W, n)
    loads = np.bincount(rank, weights=size, minlength=W)
    cap = float(loads.max() + rng.choice([0.0, 1.0, 3.0]))
    passes = int(rng.integers(1, 4))
    want_rank, want_loads, want = _swap_home_by_the_rule(
        size.tolist(), (home // g).tolist(), nbytes.tolist(), rank.tolist(), loads.tolist(), g,
        cap, passes)
    before = nbytes[rank // g != home // g].sum()
    got = swap_home(size, home, nbytes, rank, loads, g, cap, passes)
    if W > g:
        assert (got, rank.tolist(), loads.tolist()) == (want, want_rank, want_loads)
    else:
        assert got == 0
    assert np.allclose(loads, np.bincount(rank, weights=size, minlength=W))
    assert loads.max() <= max(cap, np.bincount(rank, weights=size, minlength=W).max())
    assert nbytes[rank // g != home // g].sum() <= before


@pytest.mark.parametrize("seed", range(30))
def test_affinities_are_pairs_by_decreasing_summed_weight(seed):
    """The rule in numpy: sum each (bin, target) pair's weight (np.unique, np.bincount), keep
    the positive sums, order by decreasing sum, ties by (bin, target)."""
    rng = np.random.default_rng(seed)
    n, nb, nt = int(rng.integers(0, 200)), int(rng.integers(1, 12)), int(rng.integers(1, 12))
    bin_of, target = rng.integers(0, nb, n), rng.integers(0, nt, n)
    weight = rng.integers(0, 4, n) * float(rng.choice([1.0, 0.1]))  # ties and zero weights
    key = bin_of * nt + target
    uk, inv = np.unique(key, return_inverse=True)
    w = np.bincount(inv, weights=weight)
    order = np.lexsort((uk, -w))
    order = order[w[order] > 0]
    b, t = _affinities(bin_of, target, weight, nt)
    assert b.tolist() == (uk[order] // nt).tolist() and t.tolist() == (uk[order] % nt).tolist()
