"""The dispatcher loop's own accounting: its CPU by part adds up to the loop thread's CPU.

`mmdispatch_loop_cpu_seconds_total{part}` splits the thread that runs `Dispatcher.run`; the
`loop` part is what no named part counted (polling, liveness, the window, eviction, reader
credits, bookkeeping), so the parts add up to the thread and bench.scale explains the process.
"""

from __future__ import annotations

import threading
from time import thread_time

import pytest

from dispatcher_server import server
from dispatcher_server.config import BatchConfig, LivenessConfig, ServerConfig
from dispatcher_server.metrics import LOOP_PARTS
from dispatcher_server.planner import PlannerConfig
from dispatcher_server.server import Dispatcher

pytestmark = pytest.mark.timeout(60)


def _config(**kw) -> ServerConfig:
    return ServerConfig(shuffle_buffer=0, shards=["/data/shard-0.tar"], world_size=2,
                        batch=BatchConfig(global_batch=4),
                        planner=PlannerConfig(num_microbatches=1), max_epochs=1, **kw)


def _exported(d: Dispatcher) -> dict[str, float]:
    return {part: d.metrics.registry.get_sample_value("mmdispatch_loop_cpu_seconds_total",
                                                      {"part": part}) or 0.0
            for part in LOOP_PARTS}


def test_loop_part_is_the_thread_cpu_no_other_part_counted(monkeypatch):
    d = Dispatcher(_config())
    try:
        clock = iter([12.0, 15.5])
        monkeypatch.setattr(server, "thread_time", lambda: next(clock))
        d._cpu_mark = 10.0
        d._cpu["intake"], d._cpu["send"] = 0.5, 0.25
        d._export_cpu()  # 2.0 s of thread CPU since the mark, 0.75 s of it in named parts
        assert _exported(d) == {**dict.fromkeys(LOOP_PARTS, 0.0), "intake": 0.5, "send": 0.25,
                                "loop": 1.25}
        d._cpu["plan"] = 3.0
        d._export_cpu()  # the next interval starts at the last export: 3.5 s, 3.0 s planning
        got = _exported(d)
        assert got["plan"] == 3.0 and got["loop"] == pytest.approx(1.75)
        assert sum(got.values()) == pytest.approx(5.5)  # = 15.5 - 10.0: all of the thread
        assert all(v == 0.0 for v in d._cpu.values())
    finally:
        d._close()


def test_parts_of_a_run_add_up_to_the_cpu_of_the_thread_that_ran_it():
    """run() on this thread, with no peers, until stopped: every poll is `loop` work, and what
    the parts say is all within the thread's CPU over run() (the last interval included)."""
    d = Dispatcher(_config(liveness=LivenessConfig(heartbeat_s=0.05, timeout_s=1.0, poll_ms=5)))
    timer = threading.Timer(0.3, d.stop_soon)
    timer.start()
    t0 = thread_time()
    try:
        d.run()
    finally:
        timer.cancel()
    spent = thread_time() - t0
    got = _exported(d)
    assert got["loop"] > 0
    assert 0 < sum(got.values()) <= spent
