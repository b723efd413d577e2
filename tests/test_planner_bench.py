"""bench.planner's regimes JSON has the shape issue 16 asks for, and docs render from it."""

from __future__ import annotations

import numpy as np
import pytest

from bench.planner import METHODS, run_exact, run_regimes
from bench.planner_doc import render
from bench.regimes import REGIMES, regime_step

pytestmark = pytest.mark.timeout(300)

FIELDS = {"step_time", "step_time_over_best_lb", "plan_ms_p50", "items_per_step",
          "inter_node_vs_per_phase_lpt", "step_time_vs_best_baseline"}


def test_regimes_json_shape_and_docs():
    shape = dict(ranks_per_node=4, samples_per_rank=4, num_microbatches=2, seed=0)
    regimes = run_regimes(["speech", "video"], [8], {8: 2}, **shape)
    exact = run_exact(["speech"], 2, 0)
    for name in ("speech", "video"):
        methods = regimes[name]["8"]
        assert set(methods) == set(METHODS)
        for entry in methods.values():
            assert FIELDS <= set(entry)
            assert entry["step_time_over_best_lb"] >= 1 - 1e-9  # a bound is a bound
        assert methods["mmdispatch"]["inter_node_vs_per_phase_lpt"] is not None
    assert exact["speech"]["cases"] == 2
    assert {"exact_gap_mean", "exact_gap_max", "optimal_cases"} <= set(exact["speech"])
    doc = render({"config": {"regime_steps": {"8": 2}, "cpu_reference_ms": 77.6,
                             "exact": {"world_size": 4, "num_samples": 8,
                                       "num_microbatches": 2, "time_limit_s": 1.0}},
                  "regimes": regimes, "exact": exact})
    assert "| speech | 8 |" in doc and "| video | 8 |" in doc and "exact_gap_max" in doc
    assert "loop in 78 ms of CPU" in doc  # the machine's speed beside its times


@pytest.mark.parametrize("name", sorted(REGIMES))
def test_regimes_vary_between_steps(name):
    """Each regime draws several parameter settings, so steps differ in shape, not only in
    the random draw: item counts per sample spread across steps."""
    rng = np.random.default_rng(0)
    per_sample = []
    for _ in range(12):
        inp = regime_step(name, rng, 256)
        items = sum(len(inp.items(p)) for p in ("vision", "audio"))
        per_sample.append(items / 256)
        assert np.array_equal(inp.llm_len, inp.text_len + sum(
            np.bincount(inp.items(p).sample, weights=inp.items(p).llm_len, minlength=256)
            .astype(np.int64) for p in ("vision", "audio")))
    assert len(REGIMES[name][1]) == 1 or np.ptp(per_sample) > 0.05 * max(np.mean(per_sample),
                                                                            1e-9)
