"""The step log and `mmdispatch report`: records from real plans, figures and summary numbers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench.planner import synthetic_step
from dispatcher_server.planner import PlannerConfig, Topology, plan_step
from dispatcher_server.measure import summarise
from dispatcher_server.steplog import StepLog, plan_record
from mmdispatch import cli, report


@pytest.fixture
def step_logs(tmp_path):
    rng = np.random.default_rng(0)
    config = PlannerConfig(num_microbatches=2)
    topo = Topology(world_size=8, ranks_per_node=4)
    log = StepLog(tmp_path / "steps.jsonl")
    for step in range(3):
        plan = plan_step(synthetic_step(rng, 64), topo, config)
        log.write(plan_record(step, plan, config=config, plan_ms=1.5 + step))
        # what the dispatcher writes once every rank reported the step's measured times
        by_rank = {r: {"step": step, "mb": [{"vision": [0.01 * (r + 1), [64]], "llm": [0.02, [100]]}]}
                   for r in range(8)}
        log.write(summarise(step, by_rank, config.cost, 8))
    log.close()
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"kind": "train", "step": s, "loss": 5.0 - s, "samples": 64,
                                         "samples_per_s": 10.0 * (s + 1)}) + "\n" for s in range(3)))
    return tmp_path / "steps.jsonl", train


def test_plan_record_compares_balanced_with_random(step_logs):
    plans, trains, _ = report.load_step_log(list(step_logs))
    assert [p["step"] for p in plans] == [0, 1, 2] and len(trains) == 3
    for p in plans:
        assert p["balanced"]["step_time"] <= p["random"]["step_time"]
        assert p["predicted_speedup_vs_random"] == pytest.approx(p["random"]["step_time"] / p["balanced"]["step_time"])
        assert np.asarray(p["balanced"]["loads"]["llm"]).shape == (2, 8)
        # random keeps encoders with their samples, so it moves nothing off-rank
        assert p["random"]["bytes"]["intra_node"] == p["random"]["bytes"]["inter_node"] == 0


def test_summary_aggregates_over_steps(step_logs):
    records = report.load_step_log(list(step_logs))
    plans = records.plans
    s = report.summarize(records)
    expected = sum(p["random"]["step_time"] for p in plans) / sum(p["balanced"]["step_time"] for p in plans)
    assert s["predicted_speedup_vs_random"] == pytest.approx(expected)
    assert s["plan_ms_p50"] == pytest.approx(2.5)
    assert (s["loss_first"], s["loss_last"], s["samples_per_s_p50"]) == (5.0, 3.0, 20.0)
    # measured beside predicted: rank 7's vision took 0.08 s against a mean of 0.045 s
    m = s["measured"]
    assert m["num_steps"] == 3 and m["max_over_mean"]["vision"] == pytest.approx(0.08 / 0.045)
    assert m["max_over_mean"]["llm"] == pytest.approx(1.0) and m["step_seconds_p50"] == pytest.approx(0.1)


def test_report_command_writes_a_figure_and_json(step_logs, tmp_path, capsys):
    out = tmp_path / "fig.png"
    assert cli.main(["report", *map(str, step_logs), "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["figure"] == str(out) and summary["num_steps"] == 3
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000


def test_a_log_without_plans_is_refused(tmp_path):
    bad = tmp_path / "x.jsonl"
    bad.write_text('{"kind": "train", "step": 0, "loss": 1.0}\n')
    with pytest.raises(ValueError, match="no plan records"):
        report.load_step_log(bad)
    bad.write_text("not json\n")
    with pytest.raises(ValueError, match="x.jsonl:1"):
        report.load_step_log(bad)


def test_the_report_shows_a_blend_s_realized_mixture(tmp_path, capsys):
    rng = np.random.default_rng(1)
    config = PlannerConfig(num_microbatches=1)
    topo = Topology(world_size=2, ranks_per_node=2)
    log = StepLog(tmp_path / "steps.jsonl")
    counts = [{"img": 5, "asr": 3}, {"img": 4, "asr": 4}]
    for step, sources in enumerate(counts):
        plan = plan_step(synthetic_step(rng, 8), topo, config)
        log.write(plan_record(step, plan, config=config, plan_ms=1.0, sources=sources))
    log.close()
    s = report.summarize(report.load_step_log(tmp_path / "steps.jsonl"))
    assert s["sources"] == {"img": {"samples": 9, "share": 9 / 16}, "asr": {"samples": 7, "share": 7 / 16}}
    report.print_table(s)
    out = capsys.readouterr().out
    assert "source img" in out and "56.2%" in out


def test_a_record_being_written_or_torn_by_a_kill_is_left_out_not_fatal(step_logs):
    # `report` reads the log live, and a killed dispatcher leaves its last record cut short:
    # that line ends without a newline; every complete record before it still counts.
    steps, _ = step_logs
    whole = steps.read_text()
    steps.write_text(whole[: whole.rindex("{") + 40])
    plans, _, measures = report.load_step_log(steps)
    assert [p["step"] for p in plans] == [0, 1, 2] and [m["step"] for m in measures] == [0, 1]
    # A dispatcher resumed on the same --step-log drops the torn piece before it appends: the
    # next record starts its own line instead of gluing onto the torn one.
    config = PlannerConfig(num_microbatches=2)
    plan = plan_step(synthetic_step(np.random.default_rng(1), 16), Topology(world_size=2, ranks_per_node=1), config)
    log = StepLog(steps)
    log.write(plan_record(3, plan, config=config, plan_ms=1.0))
    log.close()
    plans, _, _ = report.load_step_log(steps)
    assert [p["step"] for p in plans] == [0, 1, 2, 3]


def test_a_step_log_that_cannot_be_written_stops_logging_and_lets_the_job_go_on(caplog):
    import logging

    log = StepLog("/dev/full")  # every write fails with ENOSPC
    with caplog.at_level(logging.WARNING, logger="mmdispatch"):
        log.write({"kind": "plan", "step": 0})
        log.write({"kind": "plan", "step": 1})
    log.close()
    warned = [r.getMessage() for r in caplog.records if "step_log_failed" in r.getMessage()]
    assert len(warned) == 1 and "/dev/full" in warned[0] and "step=0" in warned[0]
    assert log.failed is not None
