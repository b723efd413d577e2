"""The dispatcher's parts on their own, without sockets: reader pool, credit control, delivery
and the replay source. (The step assembler's block paths are checked against a per-sample
reference in test_dispatch_hotpath.py.)"""

from __future__ import annotations

import random
from collections import deque

import pytest

from dispatcher_server.assembler import ShardProgress
from dispatcher_server.config import FlowConfig
from dispatcher_server.credits import Holdings, grants
from dispatcher_server.delivery import Delivery, RetainedStep
from dispatcher_server.journal import JournalError, StepEntry
from dispatcher_server.readerpool import Assignment, ReaderPool
from dispatcher_server.replay import ReplaySource


def test_pool_gives_every_reader_one_shard_before_any_gets_a_second():
    pool = ReaderPool()
    for name in (b"a", b"b"):
        pool.request(pool.join(name, name.decode(), 0.0), shards=2)
    made = pool.assign([0, 1, 2, 3, 4])
    assert [(r.ident, a.pos) for r, a in made] == [(b"a", 0), (b"b", 1), (b"a", 2), (b"b", 3)]
    assert not pool.has_free_slot() and pool.assign([4]) == []
    # ids are never reused, and another reader's id is not found
    assert len({a.id for _, a in made}) == 4
    a_reader = pool.readers[b"a"]
    assert pool.find(a_reader, made[1][1].id) is None


def test_pool_preempts_the_highest_position_only_for_a_lower_one():
    pool = ReaderPool()
    reader = pool.join(b"a", "a", 0.0)
    pool.request(reader, shards=1)
    (_, held), = pool.assign([5])
    assert pool.victim([7]) is None  # waiting position above the held one: keep reading
    assert pool.victim([2]) == (reader, held)
    assert pool.drop(reader) == [held] and not pool.assignments and not pool.readers


def _progress(pos: int, buffered: int = 0) -> ShardProgress:
    p = ShardProgress(pos=pos, url=f"s{pos}", next_index=0)
    p.buffer = deque(range(buffered))
    return p


def test_credits_stop_at_the_sample_bound_but_never_starve_the_head():
    flow = FlowConfig(max_buffered_samples=100, max_buffered_bytes=1000, credit_batch=8)
    a0, a1 = Assignment(id=1, pos=0, reader=b"r"), Assignment(id=2, pos=1, reader=b"r")
    progress = {0: _progress(0), 1: _progress(1)}
    # Room for everything: both topped up to two batches.
    got = grants([a0, a1], progress, heads={0}, held=Holdings(samples=0, nbytes=0),
                 sample_bytes=lambda pos: 10.0, flow=flow, shard_cap=50)
    assert [(a.id, n) for a, n in got] == [(1, 16), (2, 16)]
    # The byte bound is reached: only the empty head shard still gets credit (no deadlock).
    got = grants([a0, a1], progress, heads={0}, held=Holdings(samples=10, nbytes=1000),
                 sample_bytes=lambda pos: 10.0, flow=flow, shard_cap=50)
    assert [(a.id, n) for a, n in got] == [(1, 16)]
    # ... by a share of the byte bound at most: with 8 MiB samples at a 32 MiB bound, one.
    big = FlowConfig(max_buffered_samples=1000, max_buffered_bytes=32 << 20, credit_batch=64)
    got = grants([a0, a1], progress, heads={0}, held=Holdings(samples=4, nbytes=32 << 20),
                 sample_bytes=lambda pos: float(8 << 20), flow=big, shard_cap=500)
    assert [(a.id, n) for a, n in got] == [(1, 1)]
    # The sample bound is hard, head or not: 5 samples of room are all one shard may get ...
    got = grants([a0, a1], progress, heads={0}, held=Holdings(samples=95, nbytes=0),
                 sample_bytes=lambda pos: 10.0, flow=flow, shard_cap=50)
    assert [(a.id, n) for a, n in got] == [(1, 5)]
    # ... and none at the bound.
    got = grants([a0, a1], progress, heads={0}, held=Holdings(samples=100, nbytes=0),
                 sample_bytes=lambda pos: 10.0, flow=flow, shard_cap=50)
    assert got == []
    # A grant smaller than a batch to an assignment that still has credits is not worth a message.
    a1.credits = 12
    got = grants([a1], progress, heads={0}, held=Holdings(samples=0, nbytes=0),
                 sample_bytes=lambda pos: 0.0, flow=flow, shard_cap=50)
    assert got == []


def test_before_any_sample_arrives_one_sample_is_outstanding_in_all():
    """The byte bound needs the average sample size; before the first sample it was skipped,
    and every assignment of every reader got two batches at once (250 MB held against a 32 MiB
    bound with 1 MB images); then one grant of two batches in all (64 samples of 50 MB video:
    3.2 GB against 256 MiB). Until a size is known, one sample is outstanding in all, the first
    assignment's; once it arrives, grants follow the byte bound."""
    flow = FlowConfig(max_buffered_samples=1000, max_buffered_bytes=1000, credit_batch=8)
    assigned = [Assignment(id=i, pos=i, reader=b"r") for i in range(6)]
    progress = {i: _progress(i) for i in range(6)}
    got = grants(assigned, progress, heads={0, 3}, held=Holdings(samples=0, nbytes=0),
                 sample_bytes=lambda pos: 0.0, flow=flow, shard_cap=50)
    assert [(a.id, n) for a, n in got] == [(0, 1)]
    assigned[0].credits = 1  # granted, nothing arrived yet: nothing more, heads included
    assert grants(assigned, progress, heads={0, 3}, held=Holdings(samples=0, nbytes=0),
                  sample_bytes=lambda pos: 0.0, flow=flow, shard_cap=50) == []
    assigned[0].credits = 0  # it arrived: 10 bytes a sample, so 100 fit the bound
    got = grants(assigned, progress, heads={0, 3}, held=Holdings(samples=1, nbytes=10),
                 sample_bytes=lambda pos: 10.0, flow=flow, shard_cap=50)
    assert [(a.id, n) for a, n in got] == [(i, 16) for i in range(6)]


def test_credits_count_each_source_at_its_own_sample_size():
    """A blend of captions (1 KB) and clips (1 MiB): one average over both, the captions', granted
    the clips two batches (16 MiB against a 4 MiB bound) and counted what they had outstanding
    at a caption's size. Each source's own average bounds its grants now."""
    from dispatcher_server import protocol as P
    from dispatcher_server.assembler import StepAssembler
    from dispatcher_server.config import BatchConfig
    from dispatcher_server.ordering import ShardOrder

    asm = StepAssembler([ShardOrder(["/d/captions.tar"], 0, 1), ShardOrder(["/d/clips.tar"], 0, 1)],
                        mode="deterministic", batch=BatchConfig(global_batch=64), num_inflight_shards=1)
    asm.open_window()

    def headers(n: int, first: int = 0) -> list:
        return [P.SampleHeader(f"k{i}", i, 5, 9, P.blank_tokens(5), [P.ItemHeader("image", "jpg", 16, 4, {})])
                for i in range(first, first + n)]

    assert asm.sample_bytes(0) == asm.sample_bytes(1) == 0.0  # nothing seen: unknown
    asm.receive(0, headers(30), [memoryview(b"c" * 1000)] * 30, [1000] * 30)
    asm.receive(1, headers(1), [memoryview(b"v" * (1 << 20))], [1 << 20])
    captions, clips = asm.sample_bytes(0), asm.sample_bytes(1)
    assert 1000 < captions < 3000 and clips > 1 << 20
    assert asm.avg_sample_bytes < 40_000  # the one average the clips were granted by

    flow = FlowConfig(max_buffered_samples=1000, max_buffered_bytes=4 << 20, credit_batch=8)
    a0, a1 = Assignment(id=1, pos=0, reader=b"r"), Assignment(id=2, pos=1, reader=b"r")
    progress = {0: _progress(0), 1: _progress(1)}
    got = grants([a0, a1], progress, heads=set(), held=Holdings(samples=0, nbytes=0),
                 sample_bytes=asm.sample_bytes, flow=flow, shard_cap=100)
    assert [(a.id, n) for a, n in got] == [(1, 16), (2, 3)]  # 3 clips: what the bound holds
    a0.credits, a1.credits = 16, 3
    # Outstanding clips count at their size: the bound is full, no caption credit fits either.
    a0.credits = 0
    got = grants([a0, a1], progress, heads=set(), held=Holdings(samples=0, nbytes=1 << 20),
                 sample_bytes=asm.sample_bytes, flow=flow, shard_cap=100)
    assert got == []
    # A source of unknown size gets one sample in all, whatever the others' sizes.
    got = grants([a0, a1], progress, heads=set(), held=Holdings(samples=0, nbytes=0),
                 sample_bytes=lambda pos: 0.0 if pos == 0 else asm.sample_bytes(pos), flow=flow,
                 shard_cap=100)
    assert [(a.id, n) for a, n in got] == [(1, 1)]


def _retained(step: int) -> RetainedStep:
    return RetainedStep(step=step, epoch=0, batch=None, plan=None, messages=None,
                        num_samples=3, nbytes=30)


def test_delivery_sends_within_credits_once_and_evicts_what_every_rank_received():
    d = Delivery(world_size=2, max_retained_steps=2)
    for step in (0, 1):
        d.add(_retained(step))
    assert not d.has_room()
    s0, s1 = d.slots
    d.connect(s0, b"t0")
    d.connect(s1, b"t1")
    s0.upto, s1.upto = 2, 1
    assert d.slot_of(b"t1") is s1 and d.slot_of(b"nobody") is None
    encoded = []

    def encode(rs):
        encoded.append(rs.step)
        return [[b"m%d%d" % (rs.step, rank)] for rank in range(2)]

    sent = [(slot.rank, frames) for slot, frames in d.sends(encode)]
    assert sent == [(0, [b"m00"]), (0, [b"m10"]), (1, [b"m01"])]
    assert encoded == [0, 1]  # each step encoded once, for every rank
    assert d.retained[0].nbytes == 6  # once encoded, a step holds its messages' bytes
    # A rank reconnecting gets the same bytes again, not a new encoding.
    d.rewind_slot(s1, 0, prefetch=1)
    again = [frames for _, frames in d.sends(lambda rs: pytest.fail("encoded twice"))]
    assert again == [[b"m01"]]
    d.credit(s0, 2, received=2)
    d.evict()
    assert [rs.step for rs in d.retained] == [0, 1]  # rank 1 has received neither
    d.credit(s1, 1, received=1)
    d.evict()
    assert [rs.step for rs in d.retained] == [1]
    assert d.ends_due() == [s0] and not d.all_received()


def test_delivery_plans_ahead_within_the_byte_bound_and_always_one_step():
    """Steps of 12.8 MB inline samples were planned 4 ahead by count alone: the dispatcher held
    680 MB of payloads under --max-buffered-bytes 256 MiB, and as much under 64 MiB (probe)."""
    d = Delivery(world_size=1, max_retained_steps=4, max_bytes=100)
    assert d.has_room()
    big = _retained(0)
    big.nbytes = 250  # one step over the whole bound: still planned, or nothing would move
    d.add(big)
    assert not d.has_room()
    d.retained.popleft()
    for step in (1, 2, 3):
        small = _retained(step)
        small.nbytes = 40
        d.add(small)
        assert d.has_room() is (step < 3)  # 40 and 80 held are under the bound, 120 is not
    assert Delivery(world_size=1, max_retained_steps=4).has_room()  # no bound given: by count


def test_delivery_floor_follows_credits_and_rewinds_without_recounting():
    """The lowest acknowledged step is kept in O(1) per credit and per reconnect (a HELLO storm
    at thousands of ranks must not recount every rank each time): after any sequence of
    credits and rewinds the floor is never above any rank's, is exact while ranks sit on it,
    and evict keeps exactly the steps some rank has not received."""
    rng = random.Random(5)
    d = Delivery(world_size=6, max_retained_steps=64)
    for step in range(40):
        d.add(_retained(step))
    for n in range(600):
        slot = rng.choice(d.slots)
        if rng.random() < 0.2:
            # a rank may come back at any step still retained (older ones need a reset)
            d.rewind_slot(slot, rng.randrange(d.lowest, slot.received + 4), prefetch=2)
        else:
            d.credit(slot, slot.received + 3, received=slot.received + rng.randrange(0, 3))
        received = [s.received for s in d.slots]
        assert d._floor <= min(received)
        if d._at_floor:
            assert (d._floor, d._at_floor) == (min(received), received.count(min(received)))
        if n % 3:
            d.evict()
            assert d.lowest == min(min(received), d.next_plan), received


def test_delivery_reset_keeps_a_rank_that_is_already_past_the_rewind():
    d = Delivery(world_size=2, max_retained_steps=4)
    for step in range(3):
        d.add(_retained(step))
    d.credit(d.slots[1], 4, received=3)
    d.reset(1)
    assert d.next_plan == 1 and not d.retained
    assert [s.next_send for s in d.slots] == [1, 3]


def test_replay_source_without_a_journal_keeps_cursors_from_the_last_commit_on():
    r = ReplaySource(None, world_size=2)
    for step in range(4):
        r.record(StepEntry(step=step, epoch=0, world_size=2,
                           cursor_after={"base": 0, "partial": [[0, step + 1]], "done": []},
                           num_samples=1, digest="d"), plan=None, verbatim=False)
    assert r.cursor_before(2)["partial"] == [[0, 2]]
    assert r.commit(2) and not r.commit(1)
    with pytest.raises(JournalError, match="never planned"):
        r.commit(10)
    with pytest.raises(JournalError, match="--journal-dir"):
        r.cursor_before(2)
    assert r.cursor_before(4)["partial"] == [[0, 4]]
    # Ranks ahead of every planned step kept running across a restart, or restored another
    # run's checkpoint: the line names both (it said "the checkpoint" with none involved).
    with pytest.raises(JournalError, match=r"up to 3 only, so that position \(a checkpoint, or "
                                           r"trainers that kept running while it restarted\)"):
        r.cursor_before(12)
    restarted = ReplaySource(None, world_size=2)  # a restart without a journal knows nothing
    with pytest.raises(JournalError, match=r"cannot resume at step 3: without a journal the "
                                           r"dispatcher knows no step before its first one"):
        restarted.cursor_before(3)


def test_skip_log_names_a_new_shard_and_reason_at_once_then_counts_repeats(caplog):
    import logging

    from dispatcher_server.metrics import Metrics, SkipLog

    metrics = Metrics()
    skips = SkipLog(metrics, every_s=5.0)
    with caplog.at_level(logging.WARNING, logger="mmdispatch.server"):
        skips.add("a.tar", [("k1", "bad_image", 1), ("k2", "bad_image", 2), ("k3", "bad_image", 3)])
        skips.add("b.tar", [("k9", "bad_audio", 9)])
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 2  # each new (shard, reason) at once, repeats held back
        assert "shard=a.tar reason=bad_image count=1 keys=k1" in lines[0]
        skips.flush(1.0)  # the interval is not over: nothing more
        assert len(caplog.records) == 2
        skips.flush(6.0)
        assert "shard=a.tar reason=bad_image count=2 keys=k2,k3" in caplog.records[-1].getMessage()
        skips.add("c.tar", [("", "truncated_tar", -1)])  # shard level: no key to name
        # Its sample count is unknown: not counted as one sample (probe: 10 lost, count=1).
        assert ("reason=truncated_tar rest_of_shard=unread keys='(the rest of the shard)'"
                in caplog.records[-1].getMessage())
        mixed = SkipLog(Metrics(), every_s=5.0)
        mixed.add("c.tar", [("k5", "truncated_tar", 5), ("k6", "truncated_tar", 6)])
        mixed.add("c.tar", [("", "truncated_tar", -1)])
        mixed.flush(12.0)
        assert ("reason=truncated_tar count=1 rest_of_shard=unread keys='k6,(the rest of "
                "the shard)'" in caplog.records[-1].getMessage()), caplog.records[-1].getMessage()
        skips.add("d.tar", [("", "bad_image", 4)])  # a sample whose key is empty: its index
        assert "reason=bad_image count=1 keys='(sample #4)'" in caplog.records[-1].getMessage()
        # Keys come from the data: a newline or a terminal escape cannot forge or colour a line.
        skips.add("e.tar", [("k\nmmdispatch event=forged\x1b[31m", "bad_key", 0)])
        assert "keys='k\\nmmdispatch event=forged\\x1b[31m'" in caplog.records[-1].getMessage()
        assert len(caplog.records[-1].getMessage().splitlines()) == 1
    assert skips.keys == [("k1", "bad_image"), ("k2", "bad_image"), ("k3", "bad_image"),
                          ("k9", "bad_audio"), ("", "truncated_tar"), ("", "bad_image"),
                          ("k\nmmdispatch event=forged\x1b[31m", "bad_key")]
    assert metrics.registry.get_sample_value("mmdispatch_samples_skipped_total") == 7


def test_delivery_counts_connected_ranks_through_reconnects():
    """`connected` is read on every HELLO: kept as a count (a scan of W slots per HELLO was
    O(W^2) when thousands of ranks connect), equal to the slots that have a socket."""
    d = Delivery(world_size=4, max_retained_steps=2)
    d.connect(d.slots[0], b"a")
    d.connect(d.slots[1], b"b")
    d.connect(d.slots[0], b"a2")  # a reconnect replaces the socket: still one rank
    assert d.connected() == 2 == sum(s.ident is not None for s in d.slots)
    assert d.slot_of(b"a") is None and d.slot_of(b"a2") is d.slots[0]
    d.disconnect(d.slots[1])
    d.disconnect(d.slots[1])  # twice: counted once
    d.disconnect(d.slots[3])  # never connected
    assert d.connected() == 1 == sum(s.ident is not None for s in d.slots)


def test_errors_of_one_kind_are_all_counted_but_logged_at_a_bounded_rate(caplog, monkeypatch):
    """5,000 malformed frames from one peer were 5,000 warning lines (625 KB of log)."""
    import logging

    from dispatcher_server import metrics as M

    now = [0.0]
    monkeypatch.setattr(M.time, "monotonic", lambda: now[0])
    m = M.Metrics()
    with caplog.at_level(logging.WARNING, logger="mmdispatch.server"):
        for _ in range(5000):
            m.error("malformed", role="trainer")
        m.error("inputs", role="reader")  # another kind is logged as ever
        now[0] = 61.0
        m.error("malformed", role="trainer")
    lines = [r.getMessage() for r in caplog.records]
    assert m.registry.get_sample_value("mmdispatch_errors_total", {"kind": "malformed"}) == 5001
    assert sum("kind=malformed" in x for x in lines) == M.ERROR_LINES_PER_MINUTE + 1
    assert any("kind=inputs" in x for x in lines)
    assert f"not_logged_before={5000 - M.ERROR_LINES_PER_MINUTE}" in lines[-1]


def test_a_metrics_port_in_use_is_one_line_without_an_errno_prefix():
    import errno
    import socket

    from dispatcher_server import metrics as M

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        with pytest.raises(OSError) as got:
            M.Metrics(port=held.getsockname()[1])
    assert str(got.value).startswith("metrics endpoint 127.0.0.1:") and "[Errno" not in str(got.value)
    assert got.value.errno == errno.EADDRINUSE and "--metrics-port" in str(got.value)


def test_a_field_map_kind_that_is_not_a_list_is_shown_in_toml():
    from pipeline.fieldmap import FieldMap

    with pytest.raises(ValueError, match=r'image = \["jpg"\]'):
        FieldMap.from_dict({"image": "jpg"})


def test_delivery_rewind_after_a_rank_left_told_of_the_end_can_still_finish():
    """A rewind for a rank restored from its checkpoint cleared every rank's END, also that of
    a rank that had received every step, been told the end and said BYE: never connected
    again, it was never told again, so `all_received` stayed false and `--exit-when-done`
    never exited once the restored rank finished."""
    d = Delivery(world_size=2, max_retained_steps=4)
    for step in range(3):
        d.add(_retained(step))
    s0, s1 = d.slots
    d.connect(s0, b"t0")
    d.connect(s1, b"t1")
    for slot in (s0, s1):
        d.credit(slot, 5, received=3)
    assert len(list(d.sends(lambda rs: [[b"m"], [b"m"]]))) == 6
    for slot in d.ends_due():
        slot.end_sent = True
    assert s0.end_sent and s1.end_sent
    d.disconnect(s0)  # BYE: done
    d.disconnect(s1)  # lost; its trainer restarts from a checkpoint of step 0
    d.reset(1)
    d.connect(s1, b"t1b")
    d.rewind_slot(s1, 1, prefetch=2)
    for step in range(1, 3):
        d.add(_retained(step))
    assert [(slot.rank, f) for slot, f in d.sends(lambda rs: [[b"m"], [b"m"]])] == [(1, [b"m"])] * 2
    d.credit(s1, 5, received=3)
    assert d.ends_due() == [s1]  # the connected rank is told the end again, the gone one not
    s1.end_sent = True
    assert d.all_received()


@pytest.mark.parametrize("bye", [True, False])
def test_delivery_a_rank_that_left_past_the_end_needs_no_end_again(bye):
    """A dispatcher killed at the end of the stream and restarted at once replays the last
    steps for the slower rank; the faster one comes back past the end (its earlier dispatcher
    told it END), commits and says BYE before the replay ends the stream again. It was never
    sent END by this dispatcher, so `all_received` stayed false and `--exit-when-done` never
    exited. A rank lost without BYE still holds the exit (its END may not have reached it)."""
    d = Delivery(world_size=2, max_retained_steps=8)
    d.reset(2)  # restarted from the journal at step 2; the stream ends after step 3
    s0, s1 = d.slots
    d.connect(s0, b"t0")
    d.rewind_slot(s0, 2, prefetch=2)
    d.connect(s1, b"t1")
    d.rewind_slot(s1, 4, prefetch=2)  # past the end
    d.disconnect(s1, bye=bye)
    for step in (2, 3):
        d.add(_retained(step))
    assert [slot.rank for slot, _ in d.sends(lambda rs: [[b"m"], [b"m"]])] == [0, 0]
    d.credit(s0, 6, received=4)
    assert d.ends_due() == [s0]
    s0.end_sent = True
    d.disconnect(s0, bye=True)
    assert d.all_received() is bye


def test_delivery_a_rank_that_finished_with_the_dispatcher_before_a_restart_holds_no_exit():
    """Rank 0 trained to the end, committed the last step and said BYE to the dispatcher; rank 1
    was lost behind it, the dispatcher (waiting for it to resume) was restarted on its journal,
    and rank 1 came back, trained the rest and said BYE. Rank 0 never comes to the restarted
    dispatcher, so its slot was never told: `--exit-when-done` waited forever. A rank never
    heard from counts as finished once the journal's commit covers the last step."""
    d = Delivery(world_size=2, max_retained_steps=8)
    d.reset(2)
    s0, s1 = d.slots
    d.connect(s1, b"t1")
    d.rewind_slot(s1, 2, prefetch=2)
    for step in (2, 3):
        d.add(_retained(step))
    assert [slot.rank for slot, _ in d.sends(lambda rs: [[b"m"], [b"m"]])] == [1, 1]
    d.credit(s1, 6, received=4)
    s1.end_sent = True
    d.disconnect(s1, bye=True)
    assert not d.all_received()  # rank 0 may still come: nothing says it finished
    assert d.all_received(finished_before=True)  # the job's checkpoint covers the last step
    d.connect(s0, b"t0")  # one that does come back is held to its steps as before
    assert not d.all_received(finished_before=True)
