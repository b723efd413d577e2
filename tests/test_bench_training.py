"""bench.training in a tiny configuration: the documented JSON shape with finite numbers, the
exchange measurement over 2 gloo processes, and what the bench refuses."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench import training
from dispatcher_server.planner import PlannerConfig, Topology, plan_per_phase_lpt, plan_random

pytestmark = pytest.mark.timeout(180)

TINY = ["--world-size", "2", "--samples-per-rank", "3", "--steps", "1", "--repeats", "1", "--warmup", "0",
        "--hidden", "8", "--vocab-size", "32", "--calib-runs", "6", "--calib-repeats", "1",
        "--max-pixels", str(112 * 112), "--audio-frames-per-s", "0.5", "--max-text-tokens", "64"]


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def test_tiny_run_returns_the_documented_shape(tmp_path):
    res = training.run(training.bench_args([*TINY, "--exchange", "none", "--cost-out", str(tmp_path / "c.json")]))
    assert res["world_size"] == 2 and res["emulated"] is True
    assert "what 2 parallel ranks" in res["emulation"]
    assert set(res["cost_models"]) == {"default", "calibrated"}
    for cm in res["cost_models"].values():
        for key in ("predicted_speedup_vs_random", "measured_speedup_vs_random", "measured_over_predicted"):
            assert _finite(cm[key]) and cm[key] > 0, (key, cm)
    assert _finite(res["cost_models"]["calibrated"]["measured_over_predicted_step_time"])
    assert set(res["fit_r2"]) == {"vision", "audio", "llm"} and all(_finite(v) for v in res["fit_r2"].values())
    assert set(res["measured_imbalance"]) == {f"{cm}/{m}" for cm in ("default", "calibrated")
                                              for m in ("random", "per_phase_lpt", "mmdispatch")}
    for imb in res["measured_imbalance"].values():
        assert set(imb) == {"vision", "audio", "llm"} and all(_finite(v) and v >= 1.0 - 1e-9 for v in imb.values())
    for ms in res["methods"].values():
        for v in ms.values():
            assert _finite(v["measured_step_s"]) and v["measured_step_s"] > 0
            assert v["measured_exchange_s"] == 0.0  # --exchange none
    # the random plan does not depend on the cost model, so both runs of it measured the same
    assert res["methods"]["default"]["random"]["measured_step_s"] == res["methods"]["calibrated"]["random"]["measured_step_s"]
    assert all(isinstance(ok, bool) for ok in res["targets"].values())
    assert (tmp_path / "c.json").exists()


def test_exchange_sizes_follow_the_plan():
    steps = training.demo_steps(1, 8, training.counting_config(training.bench_args(TINY)), seed=3)
    topo = Topology(world_size=2, ranks_per_node=2)
    cfg = PlannerConfig(num_microbatches=2, bytes_per_token={"vision": 100, "audio": 100})
    # encoders run where their sample does: nothing crosses ranks
    assert training.exchange_sizes(plan_random(steps[0], topo, cfg)) == [0, 0, 0, 0]
    plan = plan_per_phase_lpt(steps[0], topo, cfg)
    sizes = training.exchange_sizes(plan)
    crossing = 0
    for m in range(2):
        for p in ("vision", "audio"):
            t = plan.exchange_table(m, p)
            crossing += int(t.bytes[t.src != t.dst].sum())
    assert sum(sizes) <= crossing and (crossing == 0) == (sum(sizes) == 0)
    assert all(n % 100 == 0 for n in sizes)


def test_exchange_is_measured_between_two_gloo_processes():
    times = training.measure_exchange({0, 4096, 1 << 20}, repeats=2)
    assert times[0] == 0.0
    assert all(_finite(times[n]) and times[n] > 0 for n in (4096, 1 << 20))


def test_demo_steps_are_consistent_counts():
    args = training.bench_args(TINY)
    steps = training.demo_steps(2, 16, training.counting_config(args), seed=0, max_text=64)
    for s in steps:
        items = sum(np.bincount(s.items(p).sample, weights=s.items(p).llm_len, minlength=16)
                    for p in ("vision", "audio"))
        assert np.array_equal(s.text_len + items.astype(np.int64), s.llm_len)
        assert s.text_len.max() <= 64 and s.num_samples == 16
    # the same seed gives the same steps
    again = training.demo_steps(2, 16, training.counting_config(args), seed=0, max_text=64)
    assert all(np.array_equal(a.llm_len, b.llm_len) for a, b in zip(steps, again))


def test_refuses_cuda_and_bad_values_in_one_line(capsys):
    for argv, match in ((["--device", "cuda"], "--device cuda"), (["--world-size", "0"], "--world-size"),
                        (["--threads", "2"], "--clock cpu needs --threads 1")):
        with pytest.raises(SystemExit) as e:
            training.bench_args(argv)
        assert e.value.code == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert match in last
