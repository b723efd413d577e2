"""Encoder-item placement strategies (planner/placement.py): their contracts, item by item."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatcher_server.planner.balance import lpt_heap
from dispatcher_server.planner.placement import (
    Items, _shed_excess, home_biased_lpt, node_first, node_lpt, place_items, sequential_lpt,
)

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
