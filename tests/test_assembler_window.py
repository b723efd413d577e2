"""The assembler's window opens positions only when it moved: on every other pump it does no
work, and it never leaves a position of its window unopened (checked against opening it whole
after every call, through blends, shuffle blocks, arrival order, epochs and resumes)."""

from __future__ import annotations

import random

import pytest

from dispatcher_server.assembler import SourceStream

from tests.test_blend import _assembler, _corpus, deliver_some


@pytest.mark.parametrize("mode,shuffle", [("deterministic", 0), ("deterministic", 6),
                                          ("arrival", 0), ("arrival", 6)])
def test_the_window_opens_what_a_whole_open_would_and_works_only_when_it_moved(
        monkeypatch, mode, shuffle):
    sizes = random.Random(3)
    sources = {"img": _corpus("img", 7, sizes), "asr": _corpus("asr", 4, sizes)}
    shards = {url: keys for src in sources.values() for url, keys in src.items()}
    a = _assembler(sources, [0.7, 0.3], shuffle=shuffle, mode=mode)
    walks = 0
    whole = SourceStream.open_window

    def counted(self, progress):
        nonlocal walks
        walks += 1
        whole(self, progress)

    monkeypatch.setattr(SourceStream, "open_window", counted)
    rng = random.Random(11)
    calls, steps, resumed = 0, 0, False
    for _ in range(100_000):
        a.open_window()
        calls += 1
        opened = set(a.progress)
        for st in a.streams:  # what opening every window whole would add: nothing
            whole(st, a.progress)
        assert set(a.progress) == opened
        a.fill()
        while a.step_ready():
            a.take_step()
            steps += 1
            if steps == 3 and not resumed:  # a rewind to the position journaled now
                a.reset(a.position())
                resumed = True
            a.fill()
        if a.exhausted:
            break
        deliver_some(a, shards, rng)
    else:
        pytest.fail("the stream did not finish")
    assert resumed and steps > 3
    # each source's window is walked when its base moved, not on each of the calls
    assert 0 < walks < calls / 2, (walks, calls)


def test_arrival_mode_opens_the_next_shard_when_one_above_a_slow_base_ends():
    """Arrival order has no order to wait for, yet the window was anchored at the lowest
    unfinished shard: one slow shard there kept every shard past the window closed, and the
    other readers idled until it ended (45 s in the probe's run). Now a shard ending above the
    base opens the next one, as in a shuffle block of several shards: `--inflight-shards`
    shards are read at once."""
    from dispatcher_server import protocol as P
    from dispatcher_server.assembler import StepAssembler
    from dispatcher_server.config import BatchConfig
    from dispatcher_server.ordering import ShardOrder

    a = StepAssembler(ShardOrder([f"/d/s{i}.tar" for i in range(6)], 0, 1), mode="arrival",
                      batch=BatchConfig(global_batch=2), num_inflight_shards=2)
    a.open_window()
    assert sorted(a.progress) == [0, 1]
    heads = [P.SampleHeader(f"s1-{i}", i, 5, 5, P.blank_tokens(5), []) for i in range(2)]
    a.receive(1, heads, [], [])
    a.reader_done(1)  # shard 1 is read whole while shard 0 (the base) is still being read
    a.fill()
    assert a.step_ready()
    a.take_step()
    a.fill()
    a.open_window()
    assert 0 in a.progress and 1 not in a.progress and 2 in a.progress, sorted(a.progress)
