"""Encoder-item placement strategies (planner/placement.py): their contracts, item by item."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatcher_server.planner.balance import lpt_heap
from dispatcher_server.planner.placement import (
    Items, Placement, _shed_excess, home_biased_lpt, node_first, node_lpt, place_items,
    pull_home, sequential_lpt,
)
from dispatcher_server.planner.plan import group_excl_cumsum

pytestmark = pytest.mark.timeout(120)


def _items(rng, n, W, g, coarse=False):
    size = rng.uniform(0.9, 1.1, n) if coarse else rng.lognormal(0.0, 0.8, n)
    size = -np.sort(-size)  # the solver hands items over largest first
    home = rng.integers(0, W, n)
    return Items.make(size, home, size * 10, W, g)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 60), st.sampled_from([4, 8, 16]),
       st.floats(0.5, 1.5))
def test_shedding_never_lifts_a_rank_above_the_target(seed, n, W, frac):
    """Ranks over `good` shed items; an item moves only where it fits whole, so no rank that
    was at or under `good` ends above it, and the loads stay the sums of the items."""
    rng = np.random.default_rng(seed)
    sz = rng.lognormal(0.0, 1.0, n)
    r = rng.integers(0, W, n)
    loads = np.bincount(r, weights=sz, minlength=W)
    good = frac * loads.mean()
    r_in, loads_in = r.copy(), loads.copy()
    r2, loads2 = _shed_excess(sz, r, loads, good)
    assert np.array_equal(r, r_in) and np.array_equal(loads, loads_in)  # inputs untouched
    assert np.allclose(loads2, np.bincount(r2, weights=sz, minlength=W))
    was_ok = loads <= good
    assert (loads2[was_ok] <= good * (1 + 1e-9)).all()
    assert (loads2[~was_ok] <= loads[~was_ok] * (1 + 1e-9)).all()


@pytest.mark.parametrize("coarse", [False, True])
def test_strategies_return_new_arrays_with_matching_loads(coarse):
    rng = np.random.default_rng(3)
    items = _items(rng, 400 if not coarse else 96, 32, 8, coarse)
    home_before = items.home.copy()
    good = items.bound * 1.005
    for placed in (node_first(items, good), node_lpt(items, good),
                   home_biased_lpt(items, 0.02, good), sequential_lpt(items, good)):
        assert placed.rank is not items.home
        assert placed.rank.min() >= 0 and placed.rank.max() < 32
        assert np.allclose(placed.loads, np.bincount(placed.rank, weights=items.size,
                                                     minlength=32)), placed.name
    assert np.array_equal(items.home, home_before)


def test_node_strategies_keep_coarse_items_on_their_node():
    """Coarse, near-equal items (a few per rank, homes spread evenly): the chosen placement is
    as balanced as sequential LPT's (within the tolerance) and sends far fewer bytes across
    nodes than plain LPT over the ranks."""
    rng = np.random.default_rng(7)
    W, g = 64, 8
    home = np.repeat(np.arange(W), 6)
    rng.shuffle(home)
    size = -np.sort(-rng.uniform(0.95, 1.05, len(home)))
    items = Items.make(size, home, size * 10, W, g)
    rank = place_items(items, tolerance=0.005, band=0.02, coarse_per_rank=8.0)
    loads = np.bincount(rank, weights=size, minlength=W)
    lpt = sequential_lpt(items, items.bound * 1.005)
    assert loads.max() <= lpt.loads.max() * 1.005 + 1e-12
    assert items.inter_node_bytes(rank) < 0.3 * items.inter_node_bytes(lpt_heap(size, W))


def _shed_excess_by_the_rule(sz, r, loads, good):
    """`_shed_excess` as whole-array numpy: heavy ranks shed their smallest items, the shed
    items (largest first) laid end to end over the rooms of the roomiest ranks."""
    over = loads - good
    on_heavy = np.flatnonzero(over[r] > 0)
    if len(on_heavy) == 0:
        return r, loads
    before, _ = group_excl_cumsum(r[on_heavy], -sz[on_heavy], by_size=True)
    shed = on_heavy[-before < over[r[on_heavy]]]
    shed = shed[np.argsort(-sz[shed], kind="stable")]
    r, loads = r.copy(), loads.copy()
    np.subtract.at(loads, r[shed], sz[shed])
    room = np.maximum(0.0, good - loads)
    room[np.unique(r[shed])] = 0.0
    by_room = np.argsort(-room, kind="stable")
    cum_room, end = np.cumsum(room[by_room]), np.cumsum(sz[shed])
    pos = np.searchsorted(cum_room, end)
    fits = (pos == np.searchsorted(cum_room, end - sz[shed], side="right")) \
        & (pos < np.count_nonzero(room))
    dest = np.where(fits, by_room[np.minimum(pos, len(room) - 1)], r[shed])
    np.add.at(loads, dest, sz[shed])
    r[shed] = dest
    return r, loads


def _pull_home_by_the_rule(sz, home, r, loads, g, max_rounds):
    """`pull_home` as whole-array numpy rounds: per destination the largest qualifying item."""
    r, loads = r.copy(), loads.copy()
    cap = loads.max() * (1 + 1e-12)
    W = len(loads)
    for same_node in (False, True):
        for _ in range(max_rounds):
            off = np.flatnonzero(r != home) if same_node else np.flatnonzero(r // g != home // g)
            if len(off) == 0:
                break
            h = home[off]
            dest = h
            if not same_node:
                lightest = loads.reshape(W // g, g).argmin(axis=1) + np.arange(0, W, g)
                dest = np.where(loads[h] + sz[off] <= cap, h, lightest[h // g])
            ok = loads[dest] + sz[off] <= cap
            off, dest = off[ok], dest[ok]
            if len(off) == 0:
                break
            order = np.argsort(-sz[off], kind="stable")
            _, first = np.unique(dest[order], return_index=True)
            pick = order[first]
            off, dest = off[pick], dest[pick]
            np.subtract.at(loads, r[off], sz[off])
            loads[dest] += sz[off]
            r[off] = dest
    return r, loads


def _tied_items(rng, n, W):
    """Sizes with exact ties (integers) or a long tail; ranks and homes drawn at random."""
    sz = rng.integers(1, int(rng.choice([3, 10, 100])), n).astype(np.float64) \
        if rng.random() < 0.5 else rng.lognormal(0.0, 1.0, n)
    return sz, rng.integers(0, W, n), rng.integers(0, W, n)


@pytest.mark.parametrize("seed", range(40))
def test_shed_excess_is_the_whole_array_rule(seed):
    rng = np.random.default_rng(seed)
    W = int(rng.choice([1, 3, 8, 16]))
    sz, r, _ = _tied_items(rng, int(rng.integers(0, 120)), W)
    loads = np.bincount(r, weights=sz, minlength=W)
    good = float(rng.choice([0.5, 0.9, 1.0, 1.2])) * loads.mean() if len(sz) else 1.0
    want_r, want_loads = _shed_excess_by_the_rule(sz, r, loads, good)
    got_r, got_loads = _shed_excess(sz, r, loads, good)
    assert got_r.tolist() == want_r.tolist() and got_loads.tolist() == want_loads.tolist()


@pytest.mark.parametrize("seed", range(40))
def test_pull_home_is_the_whole_array_rule(seed):
    rng = np.random.default_rng(seed)
    g = int(rng.choice([1, 2, 4]))
    W = g * int(rng.integers(1, 6))
    sz, r, home = _tied_items(rng, int(rng.integers(1, 120)), W)
    loads = np.bincount(r, weights=sz, minlength=W)
    items = Items.make(sz, home, sz, W, g)
    rounds = int(rng.integers(1, 5))
    want_r, want_loads = _pull_home_by_the_rule(sz, home, r, loads, g, rounds)
    got = pull_home(items, Placement("x", r, loads), max_rounds=rounds)
    assert got.rank.tolist() == want_r.tolist() and got.loads.tolist() == want_loads.tolist()
    assert r is not got.rank and loads is not got.loads
