"""The MILP optimum (planner.exact) against exhaustive search, and the bounds against it."""

from __future__ import annotations

import numpy as np
import pytest

from bench.regimes import REGIMES, regime_step
from dispatcher_server.planner import (
    PlannerConfig, Topology, best_lower_bound, lower_bound, plan_step,
)
from dispatcher_server.planner.balance import order_by_key_then_size
from dispatcher_server.planner.bounds import _unit_bound, unit_bound
from dispatcher_server.planner.exact import solve_exact
from tests.test_planner_optimal import optimum, tiny_step

pytestmark = pytest.mark.timeout(300)

CFG = PlannerConfig(num_microbatches=2)


@pytest.mark.parametrize("seed", range(6))
def test_milp_finds_the_exhaustive_optimum(seed):
    rng = np.random.default_rng(seed)
    inp = tiny_step(rng, int(rng.integers(3, 6)))
    W = 2
    exact = solve_exact(inp, W, 2, CFG.cost, time_limit=20.0)
    assert exact.optimal
    assert exact.step_time == pytest.approx(optimum(inp, W, 2, CFG), rel=1e-6)


@pytest.mark.parametrize("name", sorted(REGIMES))
def test_bounds_hold_and_plans_are_no_better_than_the_optimum(name):
    rng = np.random.default_rng(sorted(REGIMES).index(name))
    topo = Topology(world_size=4, ranks_per_node=2)
    for _ in range(3):
        inp = regime_step(name, rng, 8)
        exact = solve_exact(inp, 4, 2, CFG.cost, time_limit=2.0)
        ours = plan_step(inp, topo, CFG).metrics["step_time"]
        assert ours >= exact.lower * (1 - 1e-6)
        if exact.optimal:
            assert ours >= exact.step_time * (1 - 1e-6)
            assert best_lower_bound(inp, topo, CFG.cost, 2) <= exact.step_time * (1 + 1e-6)
            lb = lower_bound(inp, topo, CFG.cost, num_microbatches=2)
            assert lb["split_free_step_time"] <= exact.step_time * (1 + 1e-6)


def test_unit_bound_never_exceeds_the_best_partition():
    from dispatcher_server.planner import unit_bound
    from tests.test_planner_optimal import _minmax

    rng = np.random.default_rng(0)
    for _ in range(200):
        n, W = int(rng.integers(1, 8)), int(rng.integers(1, 4))
        c = rng.integers(1, 5, n) * 3.0 if rng.random() < 0.5 else rng.random(n)
        lb = unit_bound(c, np.zeros(n, dtype=np.int64), 1, W)[0]
        assert lb <= _minmax(c, W) * (1 + 1e-12)


def test_unit_bound_counts_units_that_must_share_a_bin():
    from dispatcher_server.planner import unit_bound

    zero = np.zeros(5, dtype=np.int64)
    # five equal units on two bins: some bin holds three (total/W says 2.5)
    assert unit_bound(np.ones(5), zero, 1, 2)[0] == 3.0
    # sizes 1.0 and 0.9: the three smallest of the top five share a bin
    c = np.array([1.0, 1.0, 0.9, 0.9, 0.9])
    assert unit_bound(c, zero, 1, 2)[0] == pytest.approx(2.7)
    # eight near-equal units on three bins (the counting term): one bin holding three takes at
    # least the three smallest (3.09), or two such bins share what the third cannot hold
    # (9.21 - 1.28 - 1.27 = 6.66, 3.33 each); every window stays at 3.16; the optimum is 3.34
    c = np.array([1.28, 1.27, 1.26, 1.23, 1.08, 1.05, 1.03, 1.01])
    assert unit_bound(c, np.zeros(8, dtype=np.int64), 1, 3)[0] == pytest.approx(3.33)


def _unit_bound_as_numpy(c, group, num_groups, bins):
    """unit_bound as whole-array numpy (4da0342's): the floats the kernel must reproduce."""
    total = np.bincount(group, weights=c, minlength=num_groups)
    lb = total / bins
    order = np.lexsort((-c, group))
    g, s = group[order], c[order]
    start = np.searchsorted(g, np.arange(num_groups))
    count = np.bincount(g, minlength=num_groups)
    prefix = np.concatenate(([0.0], np.cumsum(s)))
    kmax = (count - 1) // bins
    grp = np.repeat(np.arange(num_groups), kmax + 1)
    k = np.arange(len(grp)) - np.repeat(np.cumsum(kmax + 1) - (kmax + 1), kmax + 1)
    hi = start[grp] + k * bins + 1
    np.maximum.at(lb, grp, prefix[hi] - prefix[hi - k - 1])
    term = np.zeros(num_groups)
    has = np.flatnonzero(count)
    q = -(-count[has] // bins)
    tmax = np.minimum(bins, count[has] // q)
    grp = np.repeat(np.arange(len(has)), tmax)
    t = np.arange(len(grp)) - np.repeat(np.cumsum(tmax) - tmax, tmax) + 1
    st, n, qg = start[has][grp], count[has][grp], q[grp]
    whole = prefix[st + n] - prefix[st]
    small = prefix[st + n] - prefix[st + n - t * qg]
    large = prefix[st + np.minimum((bins - t) * (qg - 1), n)] - prefix[st]
    best = np.full(len(has), np.inf)
    np.minimum.at(best, grp, np.maximum(small, whole - large) / t)
    term[has] = best
    np.maximum(lb, term, out=lb)
    pos = c[c > 0]
    if len(pos) == 0:
        return lb
    units = pos / pos.min()
    if np.any(np.abs(units - np.round(units)) > 1e-9 * units):
        return lb
    return np.ceil(lb / pos.min() * (1 - 1e-12)) * pos.min()


def _unit_bound_by_the_rule(c, group, num_groups, bins):
    """Per group, with s its sizes largest first: max of total/B, every window
    s_(kB-k+1) + ... + s_(kB+1), and the counting term; rounded up to the quantum. Sizes are
    quarter-integers here, so every sum is exact in any order."""
    out = []
    pos = [x for x in c if x > 0]
    q = min(pos) if pos else None
    whole_units = q is not None and all(abs(x / q - round(x / q)) <= 1e-9 * x / q for x in pos)
    for g in range(num_groups):
        s = sorted((x for x, h in zip(c, group) if h == g), reverse=True)
        n = len(s)
        best = sum(s) / bins
        for k in range((n - 1) // bins + 1 if n else 0):
            best = max(best, sum(s[k * bins - k:k * bins + 1]))
        if n:
            qq = -(-n // bins)
            best = max(best, min(
                max(sum(s[n - t * qq:]), sum(s) - sum(s[:min((bins - t) * (qq - 1), n)])) / t
                for t in range(1, min(bins, n // qq) + 1)))
        out.append(np.ceil(best / q * (1 - 1e-12)) * q if whole_units else best)
    return np.array(out)


@pytest.mark.parametrize("seed", range(30))
def test_unit_bound_kernel_is_the_rule_and_numpys_floats(seed):
    rng = np.random.default_rng(seed)
    n, G, B = int(rng.integers(1, 200)), int(rng.integers(1, 5)), int(rng.integers(1, 12))
    group = rng.integers(0, G, n)
    quarters = rng.integers(0, int(rng.choice([3, 40])), n) / 4  # ties, zeros, exact sums
    if rng.random() < 0.3:
        quarters = quarters * 0 + rng.integers(1, 4, n) * 1.5  # whole multiples of a quantum
    got = _unit_bound(quarters, group, order_by_key_then_size(group, quarters), G, B)
    assert np.array_equal(got, _unit_bound_by_the_rule(quarters.tolist(), group.tolist(), G, B))
    floats = rng.random(n) * 10.0 ** rng.integers(-2, 9, n)  # sums that round
    for c in (quarters, floats):
        want = _unit_bound_as_numpy(c, group, G, B)
        assert np.array_equal(_unit_bound(c, group, order_by_key_then_size(group, c), G, B), want)
        assert np.array_equal(unit_bound(c, group, G, B), want)
