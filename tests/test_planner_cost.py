"""Cost model: FLOP-derived defaults, padded windows, and fitting a, b from timings."""

from __future__ import annotations

import numpy as np
import pytest

from dispatcher_server.planner import CostModel, PhaseCost, transformer_coefficients

pytestmark = pytest.mark.timeout(30)


def test_defaults_follow_the_stated_formula():
    a, b = transformer_coefficients(1280, 32)
    assert a == 3 * 24 * 1280**2 * 32 and b == 3 * 4 * 1280 * 32
    cm = CostModel()
    assert cm.phase("vision").a == a and cm.phase("vision").b == b
    la, lb = transformer_coefficients(4096, 32)
    assert cm.cost("llm", [1000])[0] == pytest.approx(la * 1000 + lb * 1000**2)
    # a token costs the LLM more than the ViT: wider and as deep
    assert cm.cost("llm", [100])[0] > cm.cost("vision", [100])[0]


def test_padded_phase_costs_whole_windows():
    pc = PhaseCost(a=2.0, b=0.5, window=1500)
    one = 2.0 * 1500 + 0.5 * 1500**2
    assert pc(np.array([1]))[0] == one
    assert pc(np.array([1500]))[0] == one
    assert pc(np.array([1501]))[0] == 2 * one
    assert pc(np.array([0]))[0] == 0
    assert list(pc.padded_len(np.array([1, 1500, 3001]))) == [1500, 1500, 4500]


@pytest.mark.parametrize("a,b", [(3.0e-6, 2.0e-10), (1.0e-5, 0.0), (0.0, 4.0e-9)])
def test_fit_recovers_known_coefficients(a, b):
    rng = np.random.default_rng(0)
    runs = [rng.integers(64, 8192, rng.integers(1, 6)) for _ in range(40)]
    times = [a * r.sum() + b * (r.astype(float) ** 2).sum() for r in runs]
    noisy = np.asarray(times) * rng.normal(1.0, 0.01, len(times))
    fitted = CostModel().fit("vision", runs, noisy).phase("vision")
    # each term within 5% of a 4096-token sequence's per-token cost
    scale = a + b * 4096
    assert fitted.a == pytest.approx(a, abs=0.05 * scale)
    assert fitted.b * 4096 == pytest.approx(b * 4096, abs=0.05 * scale)
    # other phases untouched
    assert CostModel().fit("vision", runs, noisy).phase("llm") == CostModel().phase("llm")


def test_fit_keeps_window_and_single_lengths_work():
    # with a window every sequence is `window` long: only the per-window cost is identifiable
    lengths = np.array([100, 1500, 1501, 4000])
    pc = PhaseCost(a=1.0, b=1e-3, window=1500)
    fitted = CostModel().fit("audio", list(lengths), pc(lengths)).phase("audio")
    assert fitted.window == 1500
    assert np.allclose(fitted(np.array([1, 1600, 9000])), pc(np.array([1, 1600, 9000])))


def test_bad_values_raise():
    with pytest.raises(ValueError, match="-1"):
        PhaseCost(a=-1, b=0)
    with pytest.raises(ValueError):
        CostModel().fit("vision", [np.array([1])], [1.0])
    with pytest.raises(ValueError, match="nope"):
        CostModel().cost("nope", [1])
    cm = CostModel()
    assert CostModel.from_dict(cm.to_dict()) == cm
