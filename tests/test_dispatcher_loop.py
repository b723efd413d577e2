"""The dispatcher loop's own accounting: its CPU by part adds up to the loop thread's CPU.

`mmdispatch_loop_cpu_seconds_total{part}` splits the thread that runs `Dispatcher.run`; the
`loop` part is what no named part counted (polling, liveness, the window, eviction, reader
credits, bookkeeping), so the parts add up to the thread and bench.scale explains the process.
"""

from __future__ import annotations

import random
import threading
from time import thread_time

import pytest

from dispatcher_server import server
from dispatcher_server.config import BatchConfig, LivenessConfig, ServerConfig
from dispatcher_server.metrics import LOOP_PARTS
from dispatcher_server.planner import PlannerConfig
from dispatcher_server.server import Dispatcher

pytestmark = pytest.mark.timeout(60)


def _config(world_size: int = 2, **kw) -> ServerConfig:
    return ServerConfig(shuffle_buffer=0, shards=["/data/shard-0.tar"], world_size=world_size,
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


class _CountedScans(list):
    """A slot list that counts how often it is walked."""

    scans = 0

    def __iter__(self):
        self.scans += 1
        return super().__iter__()


def test_liveness_acts_as_a_scan_at_every_check_but_scans_only_when_a_peer_may_be_due(monkeypatch):
    """Random peers join, talk, receive steps, fall silent and rejoin; at every check the
    dispatcher heartbeats and expires exactly the peers a full scan finds due, and it walks
    the W slots only at the checks where one may be due (a heartbeat period, not a poll)."""
    import msgpack

    from dispatcher_server import protocol as P

    rng = random.Random(7)
    W, beat, timeout = 32, 0.3, 1.0
    d = Dispatcher(_config(world_size=W, liveness=LivenessConfig(heartbeat_s=beat,
                                                                 timeout_s=timeout)))
    sent: list[tuple[str, bytes, str]] = []  # (role, ident, type)

    def record(sock, frames):
        role = "reader" if sock is d.reader_sock else "trainer"
        sent.append((role, bytes(frames[0]), msgpack.unpackb(bytes(frames[1]))["type"]))

    monkeypatch.setattr(P, "send_frames", record)
    d.delivery.slots = slots = _CountedScans(d.delivery.slots)
    hello = lambda **kw: P.decode(P.encode(P.HELLO, seq=1, **kw))  # noqa: E731
    beat_msg = P.decode(P.encode(P.HEARTBEAT, seq=2))
    try:
        now, checks, scans, events = 100.0, 0, 0, 0
        quiet: set[bytes] = set()  # peers that stopped talking
        for _ in range(600):
            now += 0.05
            for rank in rng.sample(range(W), 3):  # (re)connects, some under a new identity
                if rng.random() < 0.03:
                    ident = f"t{rank}-{rng.randrange(2)}".encode()
                    d._on_trainer(ident, hello(role="trainer", rank=rank, world_size=W,
                                               next_step=None), now)
                    quiet.discard(ident)
            for slot in slots:
                if slot.ident is not None and slot.ident not in quiet and rng.random() < 0.2:
                    d._on_trainer(slot.ident, beat_msg, now)
                    if rng.random() < 0.02:
                        quiet.add(slot.ident)
            if rng.random() < 0.3:  # a step goes out to every connected rank
                for slot in slots:
                    if slot.ident is not None:
                        slot.last_sent = now
            if rng.random() < 0.03:
                name = f"r{rng.randrange(3)}"
                d._on_reader(name.encode(), hello(role="reader", name=name), now)
            for ident, reader in list(d.readers.items()):
                if rng.random() < 0.1 and ident not in quiet:
                    d._on_reader(ident, beat_msg, now)
                    if rng.random() < 0.05:
                        quiet.add(ident)
            # what a full scan does now
            live = {s.ident: s for s in slots if s.ident is not None}
            lost = {i for i, s in live.items() if now - s.last_seen > timeout}
            due = {i for i, s in live.items() if i not in lost and now - s.last_sent > beat}
            readers = dict(d.readers)
            r_lost = {i for i, r in readers.items() if now - r.last_seen > timeout}
            r_due = {i for i, r in readers.items() if i not in r_lost and now - r.last_sent > beat}
            events += len(lost) + len(due) + len(r_lost) + len(r_due)
            del sent[:]
            before = slots.scans
            d._liveness(now)
            checks += 1
            scans += slots.scans - before
            assert {i for role, i, t in sent if role == "trainer" and t == P.HEARTBEAT} == due
            assert {i for i in live if d.delivery.slot_of(i) is None} == lost
            assert {i for role, i, t in sent if role == "reader" and t == P.HEARTBEAT} == r_due
            assert set(readers) - set(d.readers) == r_lost
            assert all(t == P.HEARTBEAT for _, _, t in sent)
        assert d.metrics.registry.get_sample_value("mmdispatch_errors_total",
                                                   {"kind": "unknown_peer"}) is None
        assert events > 100  # heartbeats and expiries, trainers' and readers'

        assert 0 < scans < checks / 2, (scans, checks)
    finally:
        d._close()
