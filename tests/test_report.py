"""The step log and `mmdispatch report`: records from real plans, figures and summary numbers."""

from __future__ import annotations

import json
import logging
import sys

import matplotlib.pyplot as plt
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


def test_the_report_says_exchange_bytes_are_predicted_and_at_what_token_weight(tmp_path, capsys):
    """Probe: 'exchange MB' was 64x what the trainers exchanged: a prediction at the default
    8 KiB per token (a 4096-wide bf16 output), said nowhere."""
    rng = np.random.default_rng(2)
    topo = Topology(world_size=2, ranks_per_node=2)
    for name, config in (("default", PlannerConfig(num_microbatches=1)),
                         ("given", PlannerConfig(num_microbatches=1, bytes_per_token={"vision": 256, "audio": 512}))):
        log = StepLog(tmp_path / f"{name}.jsonl")
        log.write(plan_record(0, plan_step(synthetic_step(rng, 8), topo, config), config=config, plan_ms=1.0))
        log.close()
        s = report.summarize(report.load_step_log(tmp_path / f"{name}.jsonl"))
        report.print_table(s)
        out = " ".join(capsys.readouterr().out.split())
        assert "predicted exchange MB same_rank" in out
        if name == "default":
            assert s["bytes_assumed"] and "8192 B per vision token (assumed: a 4096-wide bf16 output)" in out
            assert "serve --exchange-bytes-per-token gives your model's" in out
        else:
            assert s["bytes_assumed"] == [] and "256 B per vision token" in out and "assumed" not in out


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


def test_a_step_log_another_dispatcher_appends_to_is_refused_in_one_line(tmp_path):
    """Probe: two jobs given one --step-log both ran, their plans interleaved, and only the
    report said so afterwards."""
    path = tmp_path / "steps.jsonl"
    first = StepLog(path)
    first.write({"kind": "plan", "step": 0})
    with pytest.raises(ValueError, match=r"--step-log '.*steps.jsonl' is appended to by another "
                                         r"dispatcher running now.*its own step log"):
        StepLog(path)
    first.write({"kind": "plan", "step": 1})
    first.close()
    again = StepLog(path)  # once the first has stopped, the log goes on (a restart of the job)
    again.write({"kind": "plan", "step": 2})
    again.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2]


def _write_plans(path, world_size: int, steps, *, seed: int = 0, **record_options) -> None:
    """Append real plan records of `steps` at `world_size` to the step log at `path`."""
    rng = np.random.default_rng(seed)
    config = PlannerConfig(num_microbatches=2)
    topo = Topology(world_size=world_size, ranks_per_node=min(4, world_size))
    log = StepLog(path)
    for step in steps:
        plan = plan_step(synthetic_step(rng, 8 * world_size), topo, config)
        log.write(plan_record(step, plan, config=config, plan_ms=1.0, **record_options))
    log.close()


def _num_artists(fig) -> int:
    return sum(len(ax.patches) + len(ax.lines) + len(ax.collections) for ax in fig.axes)


def test_without_matplotlib_the_numbers_still_come_and_one_line_names_the_extra(
        step_logs, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails, as uninstalled
    out = tmp_path / "fig.png"
    assert cli.main(["report", *map(str, step_logs), "--out", str(out), "--json"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert summary["num_steps"] == 3 and summary["figure"] is None and not out.exists()
    assert captured.err.count("\n") == 1 and "pip install 'mmdispatch[report]'" in captured.err
    assert cli.main(["report", *map(str, step_logs), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "predicted step time" in captured.out and "figure:" not in captured.out
    assert captured.err.count("\n") == 1 and "matplotlib is not installed" in captured.err


def test_a_record_missing_a_field_is_skipped_counted_and_named_by_line(step_logs, caplog, capsys):
    steps, train = step_logs
    lines = [json.loads(line) for line in steps.read_text().splitlines()]  # plan, measure per step
    del lines[0]["balanced"]
    lines[2]["plan_ms"] = None
    lines[3]["measured_step_s"] = None
    del lines[5]["phases"]["vision"]["measured_max"]
    steps.write_text("".join(json.dumps(rec) + "\n" for rec in lines))
    trains = [json.loads(line) for line in train.read_text().splitlines()]
    trains[1]["loss"] = None
    train.write_text("".join(json.dumps(rec) + "\n" for rec in trains))
    with caplog.at_level(logging.WARNING, logger="mmdispatch.report"):
        records = report.load_step_log([steps, train])
    assert records.skipped == 5 and [p["step"] for p in records.plans] == [2]
    assert [m["step"] for m in records.measures] == [0] and [t["step"] for t in records.trains] == [0, 2]
    assert [r.getMessage() for r in caplog.records] == [
        f"{steps}:1: skipped a plan record without 'balanced'",
        f"{steps}:3: skipped a plan record with 'plan_ms' null",
        f"{steps}:4: skipped a measure record with 'measured_step_s' null",
        f"{steps}:6: skipped a measure record without 'phases.vision.measured_max'",
        f"{train}:2: skipped a train record with 'loss' null"]
    assert cli.main(["report", str(steps), str(train), "--out", str(steps.with_suffix(".png")), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_steps"] == 1 and summary["skipped_records"] == 5


def test_a_log_of_malformed_records_names_ten_and_counts_the_rest(tmp_path, caplog):
    steps = tmp_path / "steps.jsonl"
    _write_plans(steps, 2, range(1))
    good = steps.read_text()
    steps.write_text(good + '{"kind": "plan", "step": 1}\n' * 25)
    with caplog.at_level(logging.WARNING, logger="mmdispatch.report"):
        records = report.load_step_log(steps)
    assert records.skipped == 25 and len(records.plans) == 1
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 11 and warned[-1] == f"{steps}: skipped 15 more malformed records"
    steps.write_text('{"kind": "plan", "step": 1}\n')
    with pytest.raises(ValueError, match="skipped 1 malformed record: see the warnings"):
        report.load_step_log(steps)


def test_thousands_of_ranks_draw_as_many_artists_as_eight(step_logs, tmp_path):
    # A bar per (micro-batch, rank) slot made W=4096 take minutes and GBs; above 64 ranks each
    # micro-batch's loads are drawn as percentiles over ranks, so the figure's size is flat in W.
    steps, _ = step_logs
    small = report.load_step_log(steps)
    rng = np.random.default_rng(2)
    wide = tmp_path / "wide.jsonl"
    with open(wide, "w") as f:
        for p in small.plans:
            p = json.loads(json.dumps(p))
            for m in ("balanced", "random"):
                p[m]["loads"] = {ph: rng.random((2, 4096)).tolist() for ph in p[m]["loads"]}
            f.write(json.dumps({**p, "world_size": 4096}) + "\n")
    large = report.load_step_log(wide)
    counts = []
    for records in (small, large):
        fig = report.draw_figure(records)
        counts.append(_num_artists(fig))
        plt.close(fig)
    assert counts[1] <= counts[0]
    assert report.render_figure(large, tmp_path / "wide.png").stat().st_size > 20_000


def test_a_log_without_per_rank_loads_renders_the_rest(tmp_path):
    # the dispatcher logs per-rank loads only up to 64 ranks
    steps = tmp_path / "steps.jsonl"
    _write_plans(steps, 8, range(2), max_ranks_with_loads=4)
    records = report.load_step_log(steps)
    assert "loads" not in records.plans[0]["balanced"]
    assert report.render_figure(records, tmp_path / "fig.png").stat().st_size > 20_000


def test_logs_of_different_runs_are_refused_naming_both(step_logs, tmp_path):
    steps, train = step_logs
    other = tmp_path / "other.jsonl"
    _write_plans(other, 4, range(2))
    with pytest.raises(ValueError, match=r"steps.jsonl and .*other.jsonl are step logs of different "
                                         r"runs \(step 0 planned with world_size 8 vs 4"):
        report.load_step_log([steps, train, other])


def test_plans_of_two_jobs_appended_to_one_log_are_refused_naming_both_lines(tmp_path):
    """A dispatcher appends to its --step-log: a second job's steps replaced the first's."""
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _write_plans(first, 4, range(3))
    _write_plans(second, 4, range(3), seed=1)
    records = [dict(json.loads(line), dataset=job)
               for job, path in (("aaaa", first), ("bbbb", second))
               for line in path.read_text().splitlines()]
    steps = tmp_path / "steps.jsonl"
    steps.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(ValueError, match=r"steps.jsonl:1 and .*steps.jsonl:4 are plans of two jobs "
                                         r"\(dataset aaaa vs bbbb; a dispatcher appends"):
        report.load_step_log(steps)
    steps.write_text("".join(json.dumps(r) + "\n" for r in records[:3]))
    assert len(report.load_step_log(steps).plans) == 3


def test_a_run_resumed_at_another_world_size_is_summarized_per_size(tmp_path, capsys):
    steps = tmp_path / "steps.jsonl"
    _write_plans(steps, 8, range(4))
    _write_plans(steps, 4, range(2, 6), seed=1)  # resumed at step 2 on 4 ranks: 2 and 3 replayed
    s = report.summarize(report.load_step_log(steps))
    assert (s["num_steps"], s["world_size"]) == (6, 4)
    assert [(g["world_size"], g["first_step"], g["last_step"], g["num_steps"]) for g in s["segments"]] == [
        (8, 0, 1, 2), (4, 2, 5, 4)]
    plans = report.load_step_log(steps).plans
    for seg, group in zip(s["segments"], (plans[:2], plans[2:])):
        expected = (sum(p["random"]["step_time"] for p in group)
                    / sum(p["balanced"]["step_time"] for p in group))
        assert seg["predicted_speedup_vs_random"] == pytest.approx(expected)
    report.print_table(s)
    out = capsys.readouterr().out
    assert "W=8 (steps 0-1), W=4 (steps 2-5)" in " ".join(out.split())
    assert "W=8, steps 0-1" in out and "W=4, steps 2-5" in out


def test_a_directory_is_named_as_one_with_the_log_in_it(step_logs, tmp_path):
    with pytest.raises(ValueError, match=r"is a directory: pass the step log in it \(.*steps.jsonl"):
        report.load_step_log(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="is a directory: pass the file the dispatcher's --step-log wrote"):
        report.load_step_log(empty)
