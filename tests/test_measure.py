"""Predicted beside measured: trainers' timings reach the dispatcher, are summarised per step in
the step log and the metrics, and the online refit uses only its bounded window."""

from __future__ import annotations

import json
import time

import pytest

from dispatcher_server import protocol as P
from dispatcher_server.config import BatchConfig, ServerConfig
from dispatcher_server.measure import RefitConfig, StepMeasurements, summarise
from dispatcher_server.planner import PlannerConfig
from dispatcher_server.planner.cost import CostModel, PhaseCost
from dispatcher_server.server import Dispatcher
from tests.test_service import shards  # noqa: F401  (fixture)

SECONDS = CostModel(phases={"vision": PhaseCost(a=1e-3, b=0.0), "audio": PhaseCost(a=2e-3, b=0.0),
                            "llm": PhaseCost(a=1e-4, b=1e-7)})


def _record(step: int, vision: list[int], seconds: float, llm=(100,), exchange=0.01) -> dict:
    return {"step": step, "mb": [{"vision": [seconds, list(vision)],
                                  "llm": [0.5 * seconds, list(llm)], "exchange": exchange}]}


def test_a_step_is_summarised_once_every_rank_reported():
    m = StepMeasurements(world_size=2)
    assert m.add(0, _record(5, [100, 200], 0.3), SECONDS) == []  # rank 1 still missing
    (rec,) = m.add(1, _record(5, [100], 0.1), SECONDS)
    v = rec["phases"]["vision"]
    assert rec["step"] == 5 and rec["ranks_reported"] == 2
    assert v["predicted_max"] == pytest.approx(0.3)  # 1e-3 * 300 on rank 0
    assert v["measured_max"] == pytest.approx(0.3)
    assert v["measured_max_over_mean"] == pytest.approx(0.3 / 0.2)
    assert rec["exchange_s"] == pytest.approx(0.01)
    assert rec["measured_over_predicted"] == pytest.approx(
        rec["measured_step_s"] / rec["predicted_step"])


def test_a_phase_no_rank_ran_is_not_reported_as_imbalanced():
    """A dataset without audio: each rank's empty audio phase timed a few microseconds of
    noise, and the metrics showed it as a 62% measured imbalance."""
    m = StepMeasurements(world_size=2)
    noise = [{"step": 3, "mb": [{"vision": [0.2, [100]], "audio": [t, []], "llm": [0.1, [100]]}]}
             for t in (3e-6, 9e-6)]
    m.add(0, noise[0], SECONDS)
    (rec,) = m.add(1, noise[1], SECONDS)
    assert rec["phases"]["audio"]["measured_max_over_mean"] == 1.0
    assert rec["phases"]["vision"]["measured_max_over_mean"] == pytest.approx(1.0)


def test_a_step_whose_last_rank_never_reports_is_summarised_from_the_others():
    m = StepMeasurements(world_size=2)
    out = []
    for step in range(70):
        out += m.add(0, _record(step, [10], 0.01), SECONDS)
    assert out and out[0]["step"] == 0 and out[0]["ranks_reported"] == 1


def test_refit_uses_only_its_window():
    """Timings of one model, then of another: after a full window of the second, the refit
    model is the second, whatever came before (bounded memory, bounded history)."""
    m = StepMeasurements(world_size=1, refit=RefitConfig(window=16, every=4))
    model = CostModel()

    def feed(a: float, steps: range) -> CostModel | None:
        nonlocal model
        for step in steps:
            lengths = [50 + 37 * (step % 7), 20 + 11 * (step % 5)]
            done = m.add(0, {"step": step, "mb": [{"vision": [a * sum(lengths), lengths]}]}, model)
            new = m.refitted(model, len(done))
            if new is not None:
                model = new
        return model

    feed(1e-3, range(0, 40))
    assert model.phase("vision").a == pytest.approx(1e-3, rel=1e-6)
    feed(5e-3, range(40, 56))  # exactly one window of the new timings
    assert model.phase("vision").a == pytest.approx(5e-3, rel=1e-6)
    assert model.phase("llm") == CostModel().phase("llm")  # phases never measured keep theirs


def _dispatcher(tmp_path, **kw) -> Dispatcher:
    return Dispatcher(ServerConfig(
        shuffle_buffer=0, shards=["/data/shard-0.tar"], world_size=2, batch=BatchConfig(global_batch=4),
        planner=PlannerConfig(num_microbatches=1, cost=SECONDS), max_epochs=1,
        step_log=str(tmp_path / "steps.jsonl"), **kw))


def test_timings_on_credit_reach_the_step_log_and_the_metrics(tmp_path):
    d = _dispatcher(tmp_path)
    try:
        for rank, ident in ((0, b"t0"), (1, b"t1")):
            d.delivery.connect(d.slots[rank], ident)
            if rank == 0:  # timings of a step not planned yet are dropped: no plan predicted them
                d._on_trainer(ident, P.decode(P.encode(P.CREDIT, upto=2, received=1, timings=[
                    _record(0, [999], 9.9)])), 0.0)
                d.delivery.next_plan = 1
            credit = P.decode(P.encode(P.CREDIT, upto=2, received=1,
                                       timings=[_record(0, [100 * (rank + 1)], 0.1 * (rank + 1))]))
            d._on_trainer(ident, credit, 0.0)
        d.step_log.close()
        records = [json.loads(line) for line in open(tmp_path / "steps.jsonl")]
        (rec,) = [r for r in records if r["kind"] == "measure"]
        assert rec["phases"]["vision"]["measured_max"] == pytest.approx(0.2)
        reg = d.metrics.registry
        assert reg.get_sample_value("mmdispatch_phase_slowest_rank",
                                    {"phase": "vision", "source": "measured"}) == pytest.approx(0.2)
        assert reg.get_sample_value("mmdispatch_measured_imbalance_max_over_mean",
                                    {"phase": "vision"}) == pytest.approx(0.2 / 0.15)
    finally:
        d._close()


@pytest.mark.parametrize("timings", [
    [{"step": 1}],
    [{"step": 1, "mb": [{"vision": [0.1]}]}],
    [{"step": 1, "mb": [{"vision": [-1.0, [3]]}]}],
    [{"step": 1, "mb": [{"vision": [0.1, [-3]]}]}],
    [{"step": 1, "mb": [{"video": [0.1, [3]]}]}],
    [{"step": "1", "mb": []}],
])
def test_malformed_timings_are_dropped_and_the_credit_kept(timings):
    msg = P.decode(P.encode(P.CREDIT, upto=1, received=0, timings=timings))
    assert msg["upto"] == 1 and msg["received"] == 0
    assert msg["timings"] == [] and "malformed" in msg["timings_error"]


def test_a_credit_with_malformed_timings_still_moves_the_rank_on(tmp_path):
    """Timings are telemetry: a CREDIT refused whole for them left its rank without a step."""
    d = _dispatcher(tmp_path)
    try:
        d.delivery.connect(d.slots[0], b"t0")
        bad = [{"step": 0, "mb": [{"vision": [0.1, [-3]]}]}]
        d._on_trainer(b"t0", P.decode(P.encode(P.CREDIT, upto=3, received=1, timings=bad)), 0.0)
        assert (d.slots[0].upto, d.slots[0].received) == (3, 1)
        assert d.metrics.registry.get_sample_value("mmdispatch_errors_total",
                                                   {"kind": "malformed"}) == 1
    finally:
        d._close()


def test_a_trainers_reported_timings_reach_the_step_log(tmp_path, shards):
    from tests.test_service import client_config, dispatcher, make_config, readers
    from trainer_client.client import DispatcherClient

    log = tmp_path / "steps.jsonl"
    with dispatcher(make_config(shards, world_size=1, global_batch=8, num_microbatches=1,
                                step_log=str(log))) as srv, readers(srv.reader_endpoint, 1):
        client = DispatcherClient(srv.trainer_endpoint, 0, 1, 1, config=client_config())
        try:
            step = next(client)
            client.report_timings(step.step, [{"vision": [0.25, [16, 64]], "llm": [0.5, [40]],
                                               "exchange": 0.01}])
            deadline = time.monotonic() + 10
            measured = []
            while not measured and time.monotonic() < deadline:
                time.sleep(0.05)
                measured = [json.loads(line) for line in log.read_text().splitlines()
                            if '"measure"' in line]
        finally:
            client.close()
    (rec,) = measured
    assert rec["step"] == step.step and rec["phases"]["vision"]["measured_max"] == 0.25
    assert rec["phases"]["llm"]["measured_max"] == 0.5 and rec["exchange_s"] == 0.01


def test_serve_refit_flag_turns_the_online_refit_on(tmp_path):
    from mmdispatch import serve
    from mmdispatch.cli import build_parser

    shard = tmp_path / "s.tar"
    shard.write_bytes(b"")
    base = ["--shards", str(shard), "--world-size", "2", "--global-batch", "4"]
    for flags, on in ((base, False), ([*base, "--refit"], True)):
        config = serve.build_config(serve.resolve(build_parser("serve").parse_args(flags)))
        assert (config.refit == RefitConfig()) if on else config.refit is None


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e300, -1.0])
def test_a_timing_that_is_no_duration_is_refused_at_the_client_and_dropped_at_the_dispatcher(bad):
    """A broken GPU timer's NaN was accepted: every later refit failed with a traceback (the
    NaN stayed in its window), the step log held NaN (not JSON) and the report showed perfect
    balance. The client refuses it in one line; a dispatcher drops such a record, not the credit."""
    from trainer_client.client import DispatcherClient

    for mb in ({"vision": [bad, [10]]}, {"llm": [0.1, [10]], "exchange": bad}):
        msg = P.decode(P.encode(P.CREDIT, upto=3, received=1, timings=[{"step": 0, "mb": [mb]}]))
        assert msg["upto"] == 3 and msg["timings"] == [] and "malformed" in msg["timings_error"]
        c = DispatcherClient("tcp://127.0.0.1:1", 0, 1, 1)
        try:
            with pytest.raises(ValueError, match=r"report_timings\(0\): malformed"):
                c.report_timings(0, [mb])
        finally:
            c.close()


def test_a_step_s_timings_are_logged_once():
    """A rank that reported a step twice logged it twice (the report's averages weighed it
    double); one reporting a step already logged logged it again."""
    m = StepMeasurements(world_size=2)
    assert m.add(0, _record(5, [100], 0.3), SECONDS) == []
    assert m.add(0, _record(5, [100], 9.9), SECONDS) == []  # again: dropped, the first stays
    (rec,) = m.add(1, _record(5, [100], 0.1), SECONDS)
    assert rec["phases"]["vision"]["measured_max"] == pytest.approx(0.3)
    assert m.add(1, _record(5, [100], 0.1), SECONDS) == [] and m.drain(SECONDS) == []
