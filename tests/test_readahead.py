"""A reader never waits on a shard in its session thread: slow shards keep it alive, hung ones
are given up and reported, and what is read arrives in shard order with its skips."""

from __future__ import annotations

import logging
import os
import time

import pytest

from pipeline.errors import SampleError
from pipeline.readahead import CHUNK, ReadAhead
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
