"""`mmdispatch demo` end to end on a tiny dataset: per-step lines, report, figure, clean exit."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(300)
def test_demo_trains_reports_and_stops_everything(tmp_path):
    steps = 3
    out = subprocess.run(
        [sys.executable, "-m", "mmdispatch.cli", "demo", "--data", str(tmp_path / "data"), "--samples", "96",
         "--shards", "3", "--steps", str(steps), "--global-batch", "16", "--reports", str(tmp_path / "reports"),
         "--timeout", "240"],
        capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    step_lines = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    assert len(step_lines) == steps and all("loss" in line and "max/mean" in line for line in step_lines)
    assert "modality mix" in out.stdout  # the data node's inspect report of the generated data
    (run_dir,) = (tmp_path / "reports").iterdir()
    summary = json.loads((run_dir / "report.json").read_text())
    assert summary["num_steps"] == steps and summary["predicted_speedup_vs_random"] >= 1.0
    # A dataset file of three weighted sources: the realized mixture is printed and reported.
    assert set(summary["sources"]) == {"captions", "speech", "chat"}
    assert sum(s["samples"] for s in summary["sources"].values()) == steps * 16
    assert "realized mixture: captions" in out.stdout and "(weight 50.0%)" in out.stdout
    assert (run_dir / "demo.png").stat().st_size > 20_000
    # Every child was stopped: no process still runs from this run's folder.
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(run_dir) not in ps


def test_the_mixture_line_of_one_source_says_it_has_every_sample():
    from types import SimpleNamespace

    from mmdispatch.demo import _mixture_line

    one = [SimpleNamespace(name="only", weight=1.0)]
    assert _mixture_line({}, one) == "one source: only, every sample"
    two = [SimpleNamespace(name="a", weight=1.0), SimpleNamespace(name="b", weight=3.0)]
    line = _mixture_line({"sources": {"a": {"share": 0.25}, "b": {"share": 0.75}}}, two)
    assert line == "realized mixture: a 25.0% (weight 25.0%), b 75.0% (weight 75.0%)"
