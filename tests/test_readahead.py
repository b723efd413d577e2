"""A reader never waits on a shard in its session thread: slow shards keep it alive, hung ones
are given up and reported, and what is read arrives in shard order with its skips."""

from __future__ import annotations

import logging
import os
import time

import pytest

from pipeline.errors import SampleError
from pipeline.readahead import CHUNK, AheadBudget, ReadAhead
from tests.test_service import all_keys, consume, dispatcher, flat_keys, make_config, readers, shards  # noqa: F401


def _entries(ahead: ReadAhead) -> list:
    out = []
    while not ahead.finished:
        out += ahead.take(7, 1.0)
    return out


@pytest.mark.parametrize("threaded", [True, False])
def test_records_and_skips_arrive_in_shard_order_and_errors_are_raised_in_the_taker(threaded):
    ahead = ReadAhead(stall_s=60, threaded=threaded)
    error = SampleError("bad_image", "s.tar", "k3", "broken")

    def records():
        for i in range(3 * CHUNK + 5):
            if i % 10 == 3 or i > 3 * CHUNK:  # the shard ends in a run of skips
                ahead.skip(error, i)
                continue
            yield i

    got = _entries(ahead.start(records()))
    assert got == [(error, i) if i % 10 == 3 or i > 3 * CHUNK else i for i in range(3 * CHUNK + 5)]
    assert not ahead.stalled()

    failing = ReadAhead(stall_s=60, threaded=threaded)

    def broken():
        yield 1
        raise OSError("disk gone")

    failing.start(broken())
    with pytest.raises(OSError, match="disk gone"):
        _entries(failing)


def test_records_read_ahead_stay_within_the_byte_budget_and_no_shard_waits_on_another():
    """64 records of 50 MB clips from an object store were 3.2 GB a shard: the shard threads of
    a reader share a byte budget now. A thread past it waits until the session takes records,
    unless its own shard has none ahead: each shard may hold one record, whatever the others."""
    from types import SimpleNamespace

    MB = 1 << 20
    budget = AheadBudget(3 * MB)
    read = {"a": 0, "b": 0}

    def records(name: str, n: int):
        for i in range(n):
            read[name] += 1
            yield SimpleNamespace(key=f"{name}{i}", members={"mp4": bytes(MB)})

    def settle() -> None:  # until neither thread reads on
        while True:
            before = dict(read)
            time.sleep(0.3)
            if read == before:
                return

    a = ReadAhead(stall_s=60, budget=budget).start(records("a", 20))
    settle()
    assert read["a"] <= 4 and budget.used <= 4 * MB, (read, budget.used)  # 3 MB and one record
    b = ReadAhead(stall_s=60, budget=budget).start(records("b", 20))
    settle()
    assert read["b"] == 1  # the budget is spent, but shard b may hold one record
    got = [r.key for r in a.take(2, 1.0)]
    assert got == ["a0", "a1"]
    settle()
    assert budget.used <= 4 * MB + MB, (read, budget.used)
    keys = got + [r.key for r in _entries(a)]
    assert keys == [f"a{i}" for i in range(20)]  # taken in order, none lost
    assert [r.key for r in _entries(b)] == [f"b{i}" for i in range(20)]
    assert budget.used == 0
    c = ReadAhead(stall_s=60, budget=budget).start(records("c" if "c" in read else "a", 0))
    c.close()
    assert budget.used == 0


def test_a_slow_shard_keeps_its_reader_alive(shards, caplog):
    """A shard command that pauses longer than the dispatcher's liveness timeout (1.5 s here):
    the reader keeps heartbeating, so it is not dropped, and every sample arrives once."""
    slow = [f"pipe:sleep 2.5; cat {shards[0]}", *shards[1:]]
    with caplog.at_level(logging.INFO, logger="mmdispatch"):
        with dispatcher(make_config(slow, world_size=2)) as srv, readers(srv.reader_endpoint, 1):
            got = consume(srv.trainer_endpoint, 2)
    assert sorted(flat_keys(got)) == sorted(all_keys(shards))
    assert "why=timeout" not in caplog.text  # the reader was never taken for dead


@pytest.mark.timeout(60)
def test_a_hung_shard_is_given_up_and_reported_and_its_command_killed(shards, tmp_path):
    with open(shards[1], "rb") as f:
        size = len(f.read())
    pidfile = tmp_path / "pid"
    hung = f"pipe:echo $$ > {pidfile}; head -c {size // 2} {shards[1]}; sleep 600"
    with dispatcher(make_config([shards[0], hung, *shards[2:]], world_size=2)) as srv, \
            readers(srv.reader_endpoint, 1, stall_s=1.0):
        got = consume(srv.trainer_endpoint, 2)
        skipped = list(srv.skipped)
    keys = flat_keys(got)
    assert len(keys) == len(set(keys))
    others = [k for s in [shards[0], *shards[2:]] for k in all_keys([s])]
    assert set(others) <= set(keys)
    of_hung = [k for k in all_keys([shards[1]]) if k in keys]
    assert 0 < len(of_hung) < len(all_keys([shards[1]]))  # what was read before the stall
    assert of_hung == all_keys([shards[1]])[:len(of_hung)]  # a prefix, in order
    assert [reason for _, reason in skipped] == ["shard_stalled"]
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    assert not _alive(pid), "the hung shard command was left running"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1][0] != "Z"
