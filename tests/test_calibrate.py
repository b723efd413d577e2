"""Calibration: recovering known costs from synthetic timings, the cost file, `serve` loading it,
and `mmdispatch calibrate` on a tiny reference model."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import numpy as np
import pytest

from dispatcher_server.costfile import CostFileError, load_cost_file, save_cost_file
from dispatcher_server.planner import CostModel, PhaseCost
from trainer_client.calibrate import GridConfig, PhaseTimer, calibrate, grid_runs

pytestmark = pytest.mark.timeout(120)

TRUE = {  # seconds per token, per token^2, per item
    "vision": PhaseCost(a=2.0e-6, b=3.0e-9, c=4.0e-4),
    "audio": PhaseCost(a=5.0e-6, b=1.0e-9, c=1.0e-3),
    "llm": PhaseCost(a=1.0e-5, b=2.0e-8, c=2.0e-4),
}
GRIDS = {"vision": GridConfig(min_len=16, max_len=4096), "audio": GridConfig(min_len=2, max_len=3000),
         "llm": GridConfig(min_len=16, max_len=4096)}
MULTIPLES = {"vision": 4}


def synthetic(truth: dict[str, PhaseCost], noise: float, seed: int = 0):
    """A timing function: the true cost, plus (like a busy machine) only ever extra time."""
    rng = np.random.default_rng(seed)

    def measure(phase: str, lengths: np.ndarray) -> float:
        exact = float(truth[phase](np.asarray(lengths)).sum())
        return exact * (1.0 + noise * abs(float(rng.standard_normal())))
    return measure


def test_recovers_known_coefficients_exactly_without_noise():
    cal = calibrate(synthetic(TRUE, 0.0), GRIDS, multiples=MULTIPLES, repeats=1)
    for p, true in TRUE.items():
        got = cal.cost.phase(p)
        assert got.a == pytest.approx(true.a, rel=1e-6)
        assert got.b == pytest.approx(true.b, rel=1e-6)
        assert got.c == pytest.approx(true.c, rel=1e-6)
        assert cal.fits[p].r2 == pytest.approx(1.0, abs=1e-9)
        assert cal.fits[p].worst_rel_error < 1e-6
    # audio's default window (1500) was tried and dropped: this "model" attends over real lengths
    assert cal.cost.phase("audio").window is None
    assert set(cal.fits["audio"].window_candidates) == {"1500", "None"}
    assert cal.fits["audio"].window_candidates["1500"] < 0.99


def test_recovers_known_coefficients_with_noise():
    cal = calibrate(synthetic(TRUE, 0.05, seed=1), GRIDS, multiples=MULTIPLES, repeats=3)
    for p, true in TRUE.items():
        got = cal.cost.phase(p)
        assert cal.fits[p].r2 > 0.99
        assert got.c == pytest.approx(true.c, rel=0.25)
        # the cost of items across the range: within 5% of the truth
        for n in (16, 256, 1024, 3000):
            assert float(got(np.array([n]))[0]) == pytest.approx(float(true(np.array([n]))[0]), rel=0.05)
    # a per-item constant matters where items are many and small: 64 items of 16 tokens
    small = np.full(64, 16)
    assert float(cal.cost.cost("vision", small).sum()) == pytest.approx(float(TRUE["vision"](small).sum()), rel=0.1)


def test_a_padded_model_keeps_its_window():
    padded = dict(TRUE, audio=PhaseCost(a=5.0e-6, b=1.0e-9, c=1.0e-3, window=1500))
    cal = calibrate(synthetic(padded, 0.0), {"audio": GridConfig(min_len=2, max_len=4500)}, repeats=1)
    got = cal.cost.phase("audio")
    assert got.window == 1500
    # every window is 1500 long, so only the cost of one window is identifiable, not a, b, c apart
    probe = np.array([1, 1500, 1501, 4000])
    assert np.allclose(got(probe), padded["audio"](probe), rtol=1e-6)
    assert cal.fits["audio"].r2 == pytest.approx(1.0, abs=1e-9)
    # and an explicit choice is obeyed
    forced = calibrate(synthetic(padded, 0.0), {"audio": GridConfig(min_len=2, max_len=4500)}, repeats=1,
                       windows={"audio": None})
    assert forced.cost.phase("audio").window is None
    assert forced.fits["audio"].r2 < cal.fits["audio"].r2 and forced.fits["audio"].worst_rel_error > 0.2


def test_grid_mixes_single_and_many_item_runs_in_range():
    grid = GridConfig(min_len=16, max_len=1024, num_runs=32, max_items=8)
    runs = grid_runs(grid, 4, np.random.default_rng(0))
    assert len(runs) == 32
    sizes = [len(r) for r in runs]
    assert sizes.count(1) >= 8 and max(sizes) == 8
    every = np.concatenate(runs)
    assert every.min() >= 16 and every.max() <= 1024 and np.all(every % 4 == 0)
    assert max(int(r.max()) for r in runs if len(r) == 1) == 1024
    # runs as large as a rank's share (several long items) and runs of small items only
    assert any(len(r) > 1 and int(r.sum()) > 1024 for r in runs)
    assert any(len(r) == 8 and int(r.max()) <= 4 * 16 for r in runs)
    with pytest.raises(ValueError, match="max_items"):
        GridConfig(min_len=1, max_len=10, max_items=1)


def test_phase_timer_sums_spans_and_refuses_misuse():
    timer = PhaseTimer("cpu")
    for _ in range(2):
        with timer.span("vision"):
            time.sleep(0.01)
    with timer.span("llm"):
        pass
    got = timer.seconds()
    assert set(got) == {"vision", "llm"} and got["vision"] >= 0.02 and got["llm"] < got["vision"]
    timer.reset()
    assert timer.seconds() == {}
    timer.start("audio")
    with pytest.raises(ValueError, match="already open"):
        timer.start("audio")
    with pytest.raises(ValueError, match="still open"):
        timer.reset()
    timer.stop("audio")
    with pytest.raises(ValueError, match="not started"):
        timer.stop("audio")


# ------------------------------------------------------------------------------ cost file
def test_cost_file_round_trips(tmp_path):
    cost = CostModel(phases=dict(TRUE, audio=PhaseCost(a=1e-6, b=0.0, c=2e-3, window=1500)))
    path = str(tmp_path / "cost.json")
    save_cost_file(path, cost, {"device": "cpu"})
    assert load_cost_file(path) == cost
    data = json.loads(open(path).read())
    assert data["calibration"] == {"device": "cpu"} and data["units"] == "seconds"
    # files written before the per-item constant existed load with c = 0
    for v in data["phases"].values():
        del v["c"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = load_cost_file(str(tmp_path / "old.json"))
    assert all(old.phase(p).c == 0.0 for p in TRUE) and old.phase("vision").a == TRUE["vision"].a


def _good(tmp_path) -> dict:
    path = str(tmp_path / "good.json")
    save_cost_file(path, CostModel(phases=dict(TRUE)))
    return json.loads(open(path).read())


@pytest.mark.parametrize("mutate, match", [
    (lambda d: "{not json", "not valid JSON"),
    (lambda d: {**d, "format": "other"}, "not an mmdispatch cost file"),
    (lambda d: {**d, "version": 99}, "version 99"),
    (lambda d: {**d, "phases": {k: v for k, v in d["phases"].items() if k != "llm"}}, "llm"),
    (lambda d: {**d, "phases": {**d["phases"], "llm": {"a": -1.0, "b": 0.0}}}, "must be >= 0"),
    (lambda d: {**d, "phases": {**d["phases"], "llm": {"a": "fast", "b": 0.0}}}, "finite numbers"),
    (lambda d: {**d, "phases": {**d["phases"], "llm": {"a": 1.0, "b": 0.0, "d": 1}}}, "bad cost model"),
    (lambda d: {**d, "phases": {**d["phases"], "video": {"a": 1.0, "b": 0.0}}}, "unknown phases"),
])
def test_malformed_cost_files_give_one_line_naming_the_file(tmp_path, mutate, match):
    bad = mutate(_good(tmp_path))
    path = tmp_path / "bad.json"
    path.write_text(bad if isinstance(bad, str) else json.dumps(bad))
    with pytest.raises(CostFileError, match=match) as err:
        load_cost_file(str(path))
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_missing_cost_file_names_it(tmp_path):
    with pytest.raises(CostFileError, match="cannot read cost file") as err:
        load_cost_file(str(tmp_path / "nope.json"))
    assert "nope.json" in str(err.value)


# ------------------------------------------------------------------------------ serve
def test_serve_config_loads_the_cost_file(tmp_path, small_shards):
    import argparse

    from mmdispatch import serve

    cost = CostModel(phases=dict(TRUE))
    path = str(tmp_path / "cost.json")
    save_cost_file(path, cost)
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    base = ["--shards", *small_shards, "--world-size", "2", "--global-batch", "8"]
    with_file = serve.build_config(serve.resolve(parser.parse_args([*base, "--cost-model", path])))
    assert with_file.planner.cost == cost
    without = serve.build_config(serve.resolve(parser.parse_args(base)))
    assert without.planner.cost == CostModel()
    # the same key from a TOML settings file
    toml = tmp_path / "settings.toml"
    toml.write_text(f'[serve]\ncost_model = "{path}"\n')
    from_toml = serve.build_config(serve.resolve(parser.parse_args([*base, "--config", str(toml)])))
    assert from_toml.planner.cost == cost


def test_serve_refuses_a_malformed_cost_file_in_one_line(tmp_path, small_shards):
    bad = tmp_path / "broken-cost.json"
    bad.write_text('{"format": "mmdispatch-cost-model", "version": 1, "phases": {"llm": {"a": 1}}}')
    proc = subprocess.run(
        [sys.executable, "-m", "mmdispatch.cli", "serve", "--shards", *small_shards, "--world-size", "2",
         "--global-batch", "8", "--cost-model", str(bad)],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "broken-cost.json" in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert "READY" not in proc.stdout


# ------------------------------------------------------------------------------ the command
def tiny_model():
    """A zero-argument factory, as `--model tests.test_calibrate:tiny_model` imports it."""
    import torch

    from trainer_client.model import ModelConfig, ReferenceModel

    torch.manual_seed(0)
    return ReferenceModel(ModelConfig.tiny(patch_size=2, frame_dim=8, hidden=8))


TINY = ["--runs", "4", "--max-items", "2", "--repeats", "1", "--warmup", "0", "--vision-lengths", "4:32",
        "--audio-lengths", "2:24", "--llm-lengths", "4:32"]


def test_calibrate_command_writes_a_cost_file_serve_reads(tmp_path, capsys):
    from mmdispatch.cli import main

    out = tmp_path / "cm.json"
    rc = main(["calibrate", "--hidden", "8", "--frame-dim", "8", "--patch-size", "2", *TINY,
               "--out", str(out), "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    cost = load_cost_file(str(out))
    for p in ("vision", "audio", "llm"):
        pc = cost.phase(p)
        assert all(math.isfinite(x) and x >= 0 for x in (pc.a, pc.b, pc.c))
        assert pc.a + pc.b + pc.c > 0  # something was measured
        fit = report["fit"][p]
        assert math.isfinite(fit["r2"]) and fit["num_runs"] == 4
    assert report["timer"].startswith("perf_counter, 1 torch thread")


def test_calibrate_takes_a_user_model_by_import_path(tmp_path, capsys):
    from mmdispatch.cli import main

    out = tmp_path / "user.json"
    assert main(["calibrate", "--model", "tests.test_calibrate:tiny_model", *TINY, "--out", str(out),
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "tests.test_calibrate:tiny_model"
    assert set(load_cost_file(str(out)).phases) == {"vision", "audio", "llm"}


@pytest.mark.parametrize("spec, match", [
    ("no_colon", "not MODULE:FACTORY"),
    ("no.such.module:f", "cannot import 'no.such.module'"),
    ("tests.test_calibrate:nothing_here", "no callable 'nothing_here'"),
    ("tests.test_calibrate:synthetic_model_without_methods", "lacks the MultimodalModel methods"),
    # a factory that raises: its error, not a traceback of the command
    ("json:dumps", "dumps() raised TypeError: dumps() missing 1 required positional argument"),
])
def test_calibrate_names_a_bad_model_in_one_line(tmp_path, capsys, spec, match):
    from mmdispatch.cli import main

    assert main(["calibrate", "--model", spec, *TINY, "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mmdispatch calibrate: error: ") and match in err and "\n" not in err
    assert not (tmp_path / "x.json").exists()


def synthetic_model_without_methods():
    return object()


def test_per_item_constant_counts_once_per_item_and_per_window():
    pc = PhaseCost(a=1.0, b=0.0, c=5.0)
    assert list(pc(np.array([10, 20]))) == [15.0, 25.0]
    assert PhaseCost(a=1.0, b=0.0).c == 0.0  # existing costs are unchanged
    windowed = PhaseCost(a=1.0, b=0.0, c=5.0, window=100)
    assert list(windowed(np.array([0, 1, 100, 101]))) == [0.0, 105.0, 105.0, 210.0]
    with pytest.raises(ValueError, match="c=-1"):
        PhaseCost(a=1.0, b=0.0, c=-1.0)


def test_calibrate_warns_of_a_fit_that_explains_too_little(tmp_path, capsys, monkeypatch):
    """Timings the cost model cannot follow (noise) still give a cost file, with one warning
    line per phase naming its R^2 and what to change; a clean fit gives none."""
    import trainer_client.calibrate as tc
    from mmdispatch.cli import main

    rng = np.random.default_rng(0)

    def noisy(model, spec, device, **kw):
        return lambda phase, lengths: float(rng.uniform(1e-3, 2e-3))  # unrelated to the lengths

    def clean(model, spec, device, **kw):
        return lambda phase, lengths: float(1e-6 * np.sum(lengths) + 1e-4 * len(lengths))

    for measure, expect_poor in ((noisy, True), (clean, False)):
        monkeypatch.setattr(tc, "model_measure", measure)
        out = tmp_path / f"{measure.__name__}.json"
        assert main(["calibrate", "--hidden", "8", "--frame-dim", "8", "--patch-size", "2", *TINY,
                     "--out", str(out), "--json"]) == 0
        captured = capsys.readouterr()
        report = json.loads(captured.out)
        warned = [line for line in captured.err.splitlines() if "event=calibration_poor_fit" in line]
        assert out.exists()
        if expect_poor:
            assert set(report["poor_fits"]) == {"vision", "audio", "llm"}
            assert all(r2 < tc.POOR_FIT_R2 for r2 in report["poor_fits"].values())
            assert len(warned) == 3 and all("--repeats (now 1)" in w and "--clock cpu --threads 1" in w
                                            for w in warned)
            assert any("phase=llm" in w and "--llm-lengths (4:32 now)" in w for w in warned)
        else:
            assert report["poor_fits"] == {} and warned == []
