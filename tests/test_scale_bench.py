"""bench.scale's per-thread CPU of the dispatcher process, read from /proc without running the
bench: the main thread is the loop, threads named ZMQbg* are zmq's I/O, the rest is other."""

from __future__ import annotations

import os
import threading
from time import thread_time

import pytest

from bench.scale import _thread_cpu_s

pytestmark = pytest.mark.timeout(60)


def _burn(cpu_s: float) -> None:
    end = thread_time() + cpu_s
    while thread_time() < end:
        pass


def test_thread_cpu_is_grouped_by_which_thread_spent_it():
    """Each group grows by what its threads spent (read while they live: a thread that ended
    is gone from /proc with its CPU)."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("the loop group is the process's main thread")
    pid = os.getpid()
    ready, done = threading.Event(), threading.Event()
    spent, lock = {}, threading.Lock()

    def worker(name: str | None):
        if name is not None:
            with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
                f.write(name)
        _burn(0.1)
        with lock:
            spent[name] = True
            if len(spent) == 2:
                ready.set()
        done.wait(30)

    before = _thread_cpu_s(pid)
    threads = [threading.Thread(target=worker, args=(n,)) for n in ("ZMQbg/IO/9", None)]
    for t in threads:
        t.start()
    try:
        assert ready.wait(30)
        _burn(0.1)  # the main thread: loop
        after = _thread_cpu_s(pid)
    finally:
        done.set()
        for t in threads:
            t.join(30)
    # 10 ms ticks: each group's 0.1 s shows, within a few ticks
    assert after["loop"] - before["loop"] >= 0.05
    assert after["zmq_io"] - before["zmq_io"] >= 0.05
    assert after["other"] - before["other"] >= 0.05


def _world(**extra) -> dict:
    return {"steps_per_s": 1.0, "dispatcher_cpu_ms_per_step": 700.0,
            "breakdown_ms": {p: 10.0 for p in ("intake", "acks", "assemble", "plan", "journal",
                                               "encode", "send")},
            "dispatcher_peak_rss_mb": 400.0, "rss_bound_mb": 500.0, "messages_per_step": 6000.0,
            "bytes_per_step": 10_000, **extra}


def test_docs_table_has_zmq_and_loop_columns_only_for_runs_that_recorded_them():
    from mmdispatch.docgen import _scale

    head = {"samples_per_rank": 8, "num_microbatches": 2, "ranks_per_node": 8,
            "payloads": "reference", "cpus": 2, "non_plan_cpu_fit": {
                "intercept_ms": 0.0, "per_rank_ms": 0.0, "r2": 1.0}}
    old = _scale({**head, "worlds": {"2560": _world()}})
    new_world = _world(zmq_io_ms_per_step=123.0)
    new_world["breakdown_ms"]["loop"] = 45.0
    new = _scale({**head, "worlds": {"2560": new_world}})
    assert "loop |" not in old[2] and "zmq I/O" not in old[2]
    header, rule, row = new[2:5]
    cells = [c.strip() for c in row.strip("|").split("|")]
    names = [c.strip() for c in header.strip("|").split("|")]
    assert len(cells) == len(names) == rule.count("---")
    assert dict(zip(names, cells))["zmq I/O"] == "123" and dict(zip(names, cells))["loop"] == "45"
