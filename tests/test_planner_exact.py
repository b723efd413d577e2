"""The MILP optimum (planner.exact) against exhaustive search, and the bounds against it."""

from __future__ import annotations

import numpy as np
import pytest

from bench.regimes import REGIMES, regime_step
from dispatcher_server.planner import (
    PlannerConfig, Topology, best_lower_bound, lower_bound, plan_step,
)
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
