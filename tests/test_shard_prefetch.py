"""Readers hold more than one shard: one being read, the next queued (no round trip between).

The dispatcher side runs a real `Dispatcher` (loopback sockets, no peers) pumped by hand; the
reader side runs a real `ReaderWorker` against a scripted ROUTER (tests.servicekit), so every
message either way is checked. Every receive carries a timeout.
"""

from __future__ import annotations

import threading

import pytest

from dispatcher_server import protocol as P
from dispatcher_server.config import BatchConfig, FlowConfig, ServerConfig
from dispatcher_server.readerpool import Reader
from dispatcher_server.planner import PlannerConfig
from dispatcher_server.server import Dispatcher
from pipeline.gendata import generate
from pipeline.service import ReaderServiceConfig, ReaderWorker
from tests.servicekit import ScriptedRouter


def _dispatcher(num_shards: int, *, mode: str = "deterministic", epochs: int = 1,
                inflight: int = 4) -> Dispatcher:
    return Dispatcher(ServerConfig(
        shuffle_buffer=0, shards=[f"/data/shard-{i}.tar" for i in range(num_shards)], world_size=1,
        batch=BatchConfig(global_batch=4), planner=PlannerConfig(num_microbatches=1), mode=mode,
        max_epochs=epochs, flow=FlowConfig(max_buffered_samples=10_000, num_inflight_shards=inflight)))


def _ready(d: Dispatcher, name: str, shards: int) -> Reader:
    reader = Reader(ident=name.encode(), name=name, last_seen=0.0)
    d.readers[reader.ident] = reader
    d._on_reader(reader.ident, P.decode(P.encode(P.SHARD_REQUEST, shards=shards)), 0.0)
    return reader


def _held(reader: Reader) -> list[int]:
    return [a.pos for a in reader.assignments]


@pytest.mark.parametrize("mode", ["deterministic", "arrival"])
def test_a_shard_finished_hands_out_the_next_in_the_same_pump(mode):
    """The window moved only at the pump after the one whose steps consumed its base: with
    --inflight-shards 1 each shard waited a poll interval (50 ms) for its assignment, and
    5,000 tiny shards took 205 s instead of 7 (probe)."""
    d = _dispatcher(3, mode=mode, inflight=1)
    try:
        r1 = _ready(d, "r1", 2)
        d._pump()
        assert _held(r1) == [0]
        for pos in (0, 1):
            first = r1.assignments[0]
            d._on_reader(r1.ident, P.decode(P.encode(P.SHARD_DONE, assign_id=first.id, count=0,
                                                     skipped=[])), 0.0)
            d._pump()  # one pump: drained, the window moves, and its next shard goes out
            assert _held(r1) == [pos + 1]
    finally:
        d._close()


def test_every_reader_gets_one_shard_before_any_gets_a_second():
    d = _dispatcher(6)
    try:
        r1, r2 = _ready(d, "r1", 2), _ready(d, "r2", 2)
        d._pump()
        assert (_held(r1), _held(r2)) == ([0, 2], [1, 3])
        assert {a.id for a in (*r1.assignments, *r2.assignments)} == set(d.pool.assignments)
        assert all(d.progress[a.pos].assignment == a.id for a in d.pool.assignments.values())
        # Finishing a shard frees its slot: the next position goes there without a new request.
        first = r1.assignments[0]
        d._on_reader(r1.ident, P.decode(P.encode(P.SHARD_DONE, assign_id=first.id, count=0,
                                                 skipped=[])), 0.0)
        d._pump()  # position 0 is drained: the window moves on, and its new position fills the slot
        assert _held(r1) == [2, 4]
    finally:
        d._close()


def test_slots_are_capped_and_a_plain_request_means_one():
    d = _dispatcher(8, inflight=8)
    try:
        greedy, plain = _ready(d, "greedy", 99), _ready(d, "plain", 1)
        assert greedy.slots == P.MAX_READER_SHARDS and plain.slots == 1
        d._pump()
        assert len(greedy.assignments) == P.MAX_READER_SHARDS and len(plain.assignments) == 1
    finally:
        d._close()


def test_a_lost_readers_lower_shard_preempts_the_highest_held_one():
    d = _dispatcher(4)
    try:
        r1, r2 = _ready(d, "r1", 2), _ready(d, "r2", 2)
        d._pump()
        assert (_held(r1), _held(r2)) == ([0, 2], [1, 3])
        d._drop_reader(r2, "timeout")  # positions 1 and 3 are free again, below r1's 2
        d._pump()  # r1 is full: its highest (2) is cancelled ...
        d._pump()  # ... and the lowest free position takes the slot
        assert _held(r1) == [0, 1]
        assert sorted(p for p, pr in d.progress.items() if pr.assignment is None) == [2, 3]
    finally:
        d._close()


@pytest.mark.parametrize("mode, opens_next_epoch", [("deterministic", True), ("arrival", False)])
def test_the_window_runs_into_the_next_epoch_only_in_deterministic_mode(mode, opens_next_epoch):
    d = _dispatcher(3, mode=mode, epochs=2, inflight=5)
    try:
        d._pump()
        assert sorted(d.progress) == ([0, 1, 2, 3, 4] if opens_next_epoch else [0, 1, 2])
    finally:
        d._close()


# -- the reader side --------------------------------------------------------------------------
def test_reader_reads_whichever_held_shard_has_credits_and_requests_the_freed_slot(tmp_path):
    shards = generate(str(tmp_path), num_samples=12, num_shards=2, seed=3)
    fake = ScriptedRouter()
    stop = threading.Event()
    worker = ReaderWorker(ReaderServiceConfig(dispatcher=fake.endpoint, name="r", batch=4,
                                              prefetch_shards=1, timeout_s=5.0))
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    try:
        hello = fake.expect(P.HELLO)
        fake.welcome(hello)
        assert fake.expect(P.SHARD_REQUEST)["shards"] == 2
        for assign_id, shard in ((1, shards[0]), (2, shards[1])):
            fake.send(P.SHARD_ASSIGN, assign_id=assign_id, shard=shard, pos=assign_id - 1,
                      epoch=0, start_index=0)
        # Only the queued shard has credits: the reader reads it, not the one it holds first.
        fake.send(P.CREDIT, assign_id=2, samples=3)
        got = fake.expect(P.SAMPLES)
        assert got["assign_id"] == 2 and [s[1] for s in got["samples"]] == [0, 1, 2]
        assert fake.recv(0.2) is None  # credits spent: nothing more until granted
        # Now the first shard: read to its end, finished, and its slot asked for again.
        fake.send(P.CREDIT, assign_id=1, samples=100)
        indices = []
        while True:
            msg = fake.expect(P.SAMPLES if len(indices) < 6 else P.SHARD_DONE)
            if msg.type == P.SHARD_DONE:
                assert msg["assign_id"] == 1 and msg["count"] == 6
                break
            assert msg["assign_id"] == 1
            indices += [s[1] for s in msg["samples"]]
        assert indices == list(range(6))
        assert fake.expect(P.SHARD_REQUEST)["shards"] == 2
        # A cancelled shard is dropped at once (its later credits are ignored) and re-requested.
        fake.send(P.CANCEL, assign_id=2)
        assert fake.expect(P.SHARD_REQUEST)["shards"] == 2
        fake.send(P.CREDIT, assign_id=2, samples=10)
        assert fake.recv(0.2) is None
        assert worker.assignments == []
    finally:
        stop.set()
        thread.join(10)
        fake.close()
    assert not thread.is_alive()
