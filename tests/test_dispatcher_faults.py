"""Regression tests for the dispatcher's fault paths: skips reported as they happen, index gaps
named, commits refused the same way with or without a journal, a failed journal write that
stops cleanly, a step the planner refuses that ends the job once, and a trainer restored from
another job's state refused. Parts are driven without peers where possible; sockets (a raw
DEALER on loopback) where the behaviour is what a peer sees.
"""

from __future__ import annotations

import errno
import logging
import random
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import msgpack
import pytest
import zmq

from dispatcher_server import protocol as P
from dispatcher_server.assembler import StepAssembler
from dispatcher_server.config import BatchConfig, FlowConfig, LivenessConfig, ServerConfig
from dispatcher_server.halt import HaltedJob
from dispatcher_server.journal import JournalError
from dispatcher_server.ordering import ShardOrder
from dispatcher_server.planner import PlannerConfig
from dispatcher_server.readerpool import Reader
from dispatcher_server.server import Dispatcher, Fatal
from tests import servicekit as K


def _header(key: str, index: int, llm: int = 9) -> P.SampleHeader:
    return P.SampleHeader(key, index, llm - 4, llm, P.blank_tokens(llm - 4),
                          [P.ItemHeader("image", "jpg", 16, 4, {})])


def _assembler() -> StepAssembler:
    a = StepAssembler(ShardOrder(["/d/s0.tar"], 0, 1), mode="deterministic",
                      batch=BatchConfig(global_batch=64), num_inflight_shards=1)
    a.open_window()
    return a


# -- defect 2: skips travel with samples and move the resume point ----------------------------
def test_skips_in_a_samples_message_move_the_resume_point_past_them():
    """10 good, 30 bad, then good: a reader that passed the bad run and died has already
    reported every skip, and its replacement starts after them (they are never lost)."""
    a = _assembler()
    good = [_header(f"g{i}", i) for i in range(10)] + [_header(f"g{i}", i) for i in range(40, 45)]
    skips = [P.SkipRecord(f"b{i}", "bad_image", i) for i in range(10, 40)]
    got = a.receive(0, good, [memoryview(b"x")] * len(good), [1] * len(good), skips)
    assert got.skipped == skips
    assert not got.gaps and got.kept == 15
    assert a.progress[0].next_index == 45  # a reassigned reader starts at 45
    # Heard of already: the same skips sent again (a re-read) are not reported twice.
    again = a.receive(0, [], [], [], skips)
    assert again.skipped == []


def test_trailing_skips_without_samples_still_advance_and_gaps_are_named():
    a = _assembler()
    a.receive(0, [_header("g0", 0)], [memoryview(b"x")], [1],
              [P.SkipRecord("b1", "bad_image", 1), P.SkipRecord("b2", "bad_audio", 2)])
    assert a.progress[0].next_index == 3
    # Index 3..6 neither delivered nor skipped: a gap, reported, never passed over in silence.
    got = a.receive(0, [_header("g7", 7)], [memoryview(b"x")], [1])
    assert got.gaps == [(3, 7)]
    # A hostile index far ahead costs one range, not a loop over it.
    far = a.receive(0, [_header("far", 2**62)], [memoryview(b"x")], [1])
    assert far.gaps == [(8, 2**62)] and a.progress[0].next_index == 2**62 + 1


def test_a_shard_level_skip_is_reported_without_moving_the_resume_point():
    a = _assembler()
    got = a.receive(0, [], [], [], [P.SkipRecord("", "shard_changed", -1)])
    assert got.skipped == [("", "shard_changed", -1)] and a.progress[0].next_index == 0


def _config(tmp_path=None, **kw) -> ServerConfig:
    planner = kw.pop("planner", PlannerConfig(num_microbatches=1))
    return ServerConfig(
        shuffle_buffer=0, shards=kw.pop("shards", ["/data/shard-0.tar"]), world_size=kw.pop("world_size", 1), batch=BatchConfig(global_batch=kw.pop("gb", 4)),
        planner=planner, max_epochs=kw.pop("max_epochs", 1), journal_fsync=False,
        journal_dir=None if tmp_path is None else str(tmp_path),
        flow=FlowConfig(max_buffered_samples=1_000, num_inflight_shards=1, credit_batch=8),
        liveness=LivenessConfig(heartbeat_s=0.2, timeout_s=1.5, poll_ms=10), **kw)


def _samples_msg(assign_id: int, headers: list, skipped=()) -> P.Message:
    payloads = [b"x" * 10 for h in headers for _ in h.items]
    return P.decode(P.encode(P.SAMPLES, frames=[b"".join(payloads)], assign_id=assign_id,
                             samples=[list(h[:5]) + [[list(it) for it in h.items]] for h in headers],
                             sizes=[len(p) for p in payloads],
                             skipped=[list(s) for s in skipped]))


def _with_reader(d: Dispatcher) -> tuple[Reader, object]:
    reader = d.pool.join(b"r", "r", 0.0)
    d._on_reader(reader.ident, P.decode(P.encode(P.SHARD_REQUEST)), 0.0)
    d._pump()
    (a,) = reader.assignments
    # Until a sample's size is known one sample is granted; these tests feed more at once, as
    # a reader holding two credit batches (what it is granted once sizes are known) does.
    a.credits = max(a.credits, 2 * d.config.flow.credit_batch)
    return reader, a


def test_skips_reach_the_journal_when_they_arrive_not_at_shard_done(tmp_path):
    d = Dispatcher(_config(tmp_path))
    try:
        reader, a = _with_reader(d)
        skips = [P.SkipRecord(f"b{i}", "bad_image", i) for i in range(1, 4)]
        d._on_samples(reader, _samples_msg(a.id, [_header("g0", 0), _header("g4", 4)], skips))
        assert d.journal.num_skipped == 3 and [k for k, _ in d.skipped] == ["b1", "b2", "b3"]
        d._drop_reader(reader, "timeout")  # the reader dies: nothing it reported is lost
        assert d.progress[0].next_index == 5 and d.journal.num_skipped == 3
        # The journal keeps each skip's index for the audit.
        assert sorted(k.index for k in d.journal.skipped_keys()) == [1, 2, 3]
    finally:
        d._close()


def _shard_done(assign_id: int, count: int, headers: str) -> P.Message:
    return P.decode(P.encode(P.SHARD_DONE, assign_id=assign_id, count=count, skipped=[],
                             identity={"size": 10240, "headers": headers}))


def test_a_reader_whose_copy_of_a_shard_differs_stops_the_job(tmp_path):
    """Readers on two nodes whose copies of one shard differ (a stale sync, a dataset regenerated
    on one node) were taken as one shard: a replay after a restart, the next epoch or a take-back
    then delivered other samples under the same shard and index. The copy first read whole is
    journaled; a later read of another copy, here a replay after a restart, stops the job with
    the shard, the readers and the fix named, before the shard counts as read."""
    d = Dispatcher(_config(tmp_path, max_epochs=2))
    try:
        reader, a = _with_reader(d)
        d._on_reader(reader.ident, _samples_msg(a.id, [_header("k0", 0)]), 0.0)
        d._on_reader(reader.ident, _shard_done(a.id, 1, "aa"), 0.0)
        d._pump()  # step 0 planned
        d._pump()  # the shard's next epoch assigned
        (again,) = reader.assignments
        d._on_reader(reader.ident, _samples_msg(again.id, [_header("k0", 0)]), 0.0)
        d._on_reader(reader.ident, _shard_done(again.id, 1, "aa"), 0.0)  # the same copy: read
        assert d.journal.identities["/data/shard-0.tar"]["headers"] == "aa"
    finally:
        d._close()
    d = Dispatcher(_config(tmp_path, max_epochs=2))  # restarted: step 0 replays
    try:
        reader, a = _with_reader(d)
        d._on_reader(reader.ident, _samples_msg(a.id, [_header("k0", 0)]), 0.0)
        with pytest.raises(Fatal) as stopped:
            d._on_reader(reader.ident, _shard_done(a.id, 1, "bb"), 0.0)
        why = str(stopped.value)
        assert "reader 'r' read another copy of shard /data/shard-0.tar" in why
        assert "headers bb where reader 'r' read aa" in why and "copy of the dataset the same" in why
        assert not d.progress[0].reader_done  # never counted as read: nothing more is planned
    finally:
        d._close()


def test_a_shard_read_by_one_node_is_assigned_to_another_with_the_copy_to_check(tmp_path):
    """SHARD_ASSIGN names the copy first read to a reader of another node (HELLO `node`),
    which checks its own before reading, not to another reader of the node that read it (the
    same files: two `read` processes of one host, or workers of one)."""
    d = Dispatcher(_config(tmp_path, max_epochs=3))
    sent = []
    d._send_reader = lambda reader, type_, **f: sent.append((reader.name, type_, f))
    try:
        first = d.pool.join(b"a0", "nodeA/0", 0.0, node="nodeA")
        d._on_reader(first.ident, P.decode(P.encode(P.SHARD_REQUEST, shards=1)), 0.0)
        d._pump()
        (a,) = first.assignments
        assert "identity" not in sent[-1][2]  # nothing read yet
        d._on_reader(first.ident, _samples_msg(a.id, [_header("k0", 0)]), 0.0)
        d._on_reader(first.ident, _shard_done(a.id, 1, "aa"), 0.0)
        d._drop_reader(first, "timeout")
        for name, expected in (("nodeA/1", None), ("nodeB/0", {"size": 10240, "headers": "aa"})):
            sent.clear()
            reader = d.pool.join(name.encode(), name, 0.0, node=name.split("/")[0])
            d._on_reader(reader.ident, P.decode(P.encode(P.SHARD_REQUEST, shards=1)), 0.0)
            d._pump()
            d._pump()
            (assign,) = [f for who, t, f in sent if who == name and t == P.SHARD_ASSIGN]
            assert assign.get("identity") == expected, name
            (a,) = reader.assignments
            d._on_reader(reader.ident, _samples_msg(a.id, [_header("k0", 0)]), 0.0)
            d._on_reader(reader.ident, _shard_done(a.id, 1, "aa"), 0.0)
            d._drop_reader(reader, "timeout")
    finally:
        d._close()


# -- defect 5: a huge commit without a journal ------------------------------------------------
def test_a_commit_of_a_step_never_planned_is_refused_with_or_without_a_journal(tmp_path):
    for directory in (None, tmp_path):
        d = Dispatcher(_config(directory))
        try:
            t0 = time.process_time()
            with pytest.raises(JournalError, match="never planned"):
                d.replay.commit(2**62)
            assert time.process_time() - t0 < 1.0  # refused, not a loop over 2**62 steps
        finally:
            d._close()


# -- over sockets: what a trainer sees ----------------------------------------------------------
class _Peer:
    """A raw DEALER speaking the protocol to a running dispatcher."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.connect(endpoint)
        self.seq = 0

    def send(self, type_: str, **fields) -> int:
        self.seq += 1
        self.sock.send_multipart(P.encode(type_, seq=self.seq, **fields))
        return self.seq

    def expect(self, type_: str, timeout: float = 5.0) -> P.Message:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sock.poll(100):
                msg = P.decode(self.sock.recv_multipart())
                if msg.type == type_:
                    return msg
        raise AssertionError(f"no {type_} within {timeout} s")

    def close(self) -> None:
        self.sock.close(linger=0)


def _hello(peer: _Peer, **extra) -> int:
    return peer.send(P.HELLO, role="trainer", rank=0, world_size=1, next_step=None, prefetch=2,
                     **extra)


@contextmanager
def _welcomed_trainer(d: Dispatcher) -> Iterator[_Peer]:
    """`d` started, and rank 0 of its trainers welcomed; both stopped after."""
    d.start()
    peer = _Peer(d.trainer_endpoint)
    try:
        _hello(peer)
        peer.expect(P.WELCOME)
        yield peer
    finally:
        peer.close()
        d.stop()


def test_a_huge_commit_without_a_journal_is_refused_and_the_dispatcher_keeps_serving():
    with _welcomed_trainer(Dispatcher(_config())) as peer:
        seq = peer.send(P.COMMIT, step=2**62)
        err = peer.expect(P.ERROR, timeout=3)
        assert err["code"] == "commit" and err["ack"] == seq and "never planned" in err["message"]
        peer.send(P.HEARTBEAT)
        peer.expect(P.HEARTBEAT, timeout=3)  # still serving


def test_a_commit_after_the_job_stopped_on_an_error_is_refused_with_the_reason(tmp_path):
    """Probe: a commit that came after the dispatcher stopped on "journaled step 12 comes back
    with other samples" was journaled, so the restart the error advises resumed past the steps
    in question and failed again. After a fatal stop, commits are refused with its reason."""
    d = Dispatcher(_config(tmp_path))
    with _welcomed_trainer(d) as peer:
        d.fatal = "journaled step 12 comes back with other samples than it was planned with"
        seq = peer.send(P.COMMIT, step=0)
        err = peer.expect(P.ERROR, timeout=3)
        assert err["code"] == "commit" and err["ack"] == seq
        assert err["message"] == ("commit(0) refused: the job stopped (journaled step 12 comes "
                                  "back with other samples than it was planned with)")
        assert d.replay.committed == -1


@pytest.mark.timeout(60)
def test_a_dispatcher_busy_past_the_timeout_keeps_the_peers_whose_messages_wait():
    """A pump longer than the liveness timeout (a slow plan, a long pause) must not expire the
    peers that kept talking meanwhile: their messages wait in the socket, unread."""
    d = Dispatcher(_config())  # timeout 1.5 s
    stall, stalled = threading.Event(), threading.Event()
    open_window = d.assembler.open_window

    def slow_window():  # one pump of 2.5 s, in the dispatcher's thread
        if stall.is_set():
            stall.clear()
            time.sleep(2.5)
            stalled.set()
        open_window()

    d.assembler.open_window = slow_window
    with _welcomed_trainer(d) as peer:
        stall.set()
        deadline = time.monotonic() + 10
        while not stalled.is_set() and time.monotonic() < deadline:
            peer.send(P.HEARTBEAT)  # what a trainer's session sends while it waits
            time.sleep(0.2)
        assert stalled.is_set()
        for _ in range(5):  # after the pause, still a known peer
            peer.send(P.HEARTBEAT)
            time.sleep(0.2)
        assert d.delivery.connected() == 1
        assert d.metrics.registry.get_sample_value("mmdispatch_errors_total",
                                                   {"kind": "unknown_peer"}) is None


def test_idle_trainers_each_get_heartbeats_and_the_metrics_count_them():
    d = Dispatcher(_config(world_size=2)).start()
    peers = [_Peer(d.trainer_endpoint) for _ in range(2)]
    out = d.metrics.messages_of["trainer", "out"]
    before = out._value.get()
    try:
        for rank, peer in enumerate(peers):
            peer.send(P.HELLO, role="trainer", rank=rank, world_size=2, next_step=None, prefetch=2)
            peer.expect(P.WELCOME)
        for peer in peers:  # no step to send (no reader): only heartbeats keep them alive
            for _ in range(2):
                assert peer.expect(P.HEARTBEAT, timeout=3).type == P.HEARTBEAT
        deadline = time.monotonic() + 3  # a round's sends are counted after the round
        while out._value.get() - before < 2 + 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert out._value.get() - before >= 2 + 4  # two WELCOMEs, four heartbeats at least
    finally:
        for peer in peers:
            peer.close()
        d.stop()


def test_a_commit_whose_journal_write_fails_names_the_reason_and_stops_cleanly(tmp_path):
    d = Dispatcher(_config(tmp_path))
    _fill_and_plan(d, 4)
    assert d.journal.last_step == 0

    def full(step):
        raise OSError(errno.ENOSPC, "No space left on device")

    d.journal.commit = full
    with _welcomed_trainer(d) as peer:
        seq = peer.send(P.COMMIT, step=0)
        err = peer.expect(P.ERROR)
        assert err["code"] == "commit" and err["ack"] == seq
        assert "No space left on device" in err["message"]
        deadline = time.monotonic() + 5
        while d._thread is not None and d._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert d.fatal is not None and "No space left" in d.fatal


def _fill_and_plan(d: Dispatcher, n: int) -> tuple[Reader, object]:
    reader, a = _with_reader(d)
    d._on_samples(reader, _samples_msg(a.id, [_header(f"k{i}", i) for i in range(n)]))
    d._pump()
    return reader, a


# -- defect 6: disk full while journaling skipped keys -------------------------------------------
def test_a_failed_skip_write_stops_before_the_shard_counts_as_read(tmp_path):
    d = Dispatcher(_config(tmp_path, gb=64))
    try:
        reader, a = _fill_and_plan(d, 3)

        def full(shard, skipped):
            raise OSError(errno.ENOSPC, "No space left on device")

        d.journal.record_skipped = full
        done = P.decode(P.encode(P.SHARD_DONE, assign_id=a.id, count=3,
                                 skipped=[["bad", "bad_image", 3]]))
        with pytest.raises(Fatal, match="No space left on device"):
            d._on_shard_done(reader, done)
        # Nothing half-applied: the shard is not finished and its assignment still stands, so
        # the step that would follow is never planned from a state the journal does not know.
        assert not d.progress[0].reader_done and a.id in d.pool.assignments
        assert d.skipped == []
    finally:
        d._close()


def test_a_failed_skip_write_ends_the_run_loop_with_the_reason(tmp_path):
    d = Dispatcher(_config(tmp_path, gb=64))
    reader_sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        def full(shard, skipped):
            raise OSError(errno.ENOSPC, "No space left on device")

        d.journal.record_skipped = full
        d.start()
        reader_sock.connect(d.reader_endpoint)
        reader_sock.send_multipart(P.encode(P.HELLO, seq=1, role="reader", name="r"))
        reader_sock.send_multipart(P.encode(P.SHARD_REQUEST, seq=2))
        assign = None
        deadline = time.monotonic() + 5
        while assign is None and time.monotonic() < deadline:
            if reader_sock.poll(100):
                msg = P.decode(reader_sock.recv_multipart())
                assign = msg if msg.type == P.SHARD_ASSIGN else None
        assert assign is not None
        reader_sock.send_multipart(P.encode(P.SHARD_DONE, seq=3, assign_id=assign["assign_id"],
                                            count=0, skipped=[["k", "bad_image", 0]]))
        K.wait_for(lambda: d.fatal is not None, 5, "the failed journal write ending the job")
        assert "No space left on device" in d.fatal and "resumes from the journal" in d.fatal
        # No rank had connected: the dispatcher waits to tell them why (it exited at once,
        # leaving a trainer still starting only "no dispatcher answered"), then exits.
        time.sleep(0.5)
        assert d._thread.is_alive(), "the dispatcher exited before its ranks were told why"
        peer = _Peer(d.trainer_endpoint)
        try:
            _hello(peer)
            end = peer.expect(P.END)
            assert end["reason"] == "halted" and "No space left on device" in end["message"]
        finally:
            peer.close()
        K.wait_for(lambda: not d._thread.is_alive(), 5, "the dispatcher exiting once told")
    finally:
        reader_sock.close(linger=0)
        d.stop()


class _FullDisk:
    """`os` for dispatcher_server.files, on a disk that is full: every fsync fails."""

    def __getattr__(self, name):
        import os
        return getattr(os, name)

    def fsync(self, fd):
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_at_a_readers_hello_stops_the_job_and_tells_the_reader(tmp_path, monkeypatch,
                                                                            caplog):
    """The input rules a HELLO states are kept beside the journal (inputs.json): that write
    failing on a full disk was an internal error with a traceback, the dispatcher went on, the
    reader was told only `internal`, and an empty temporary file stayed in the journal."""
    from dispatcher_server import files
    d = Dispatcher(_config(tmp_path, gb=64)).start()
    assert d.metrics.registry.get_sample_value("mmdispatch_halted") == 0
    monkeypatch.setattr(files, "os", _FullDisk())
    reader = _Peer(d.reader_endpoint)
    try:
        with caplog.at_level(logging.INFO):
            seq = reader.send(P.HELLO, role="reader", name="r", inputs={"tokenizer": "t"})
            err = reader.expect(P.ERROR)
            K.wait_for(lambda: d.fatal is not None, 5, "the failed inputs write ending the job")
            # the dispatcher thread logs the halt after it tells the reader: read the log once
            # that line is in (it raced the end of this block)
            K.wait_for(lambda: "event=fatal" in caplog.text, 5, "the halt's log line")
        assert err["code"] == "halted" and err["ack"] == seq
        assert "No space left on device" in err["message"]
        assert "Free the space" in err["message"] and "resumes from the journal" in err["message"]
        assert "No space left on device" in d.fatal and "Free the space" in d.fatal
        assert d.metrics.registry.get_sample_value("mmdispatch_halted") == 1
        assert not any(r.exc_info for r in caplog.records), "a traceback was logged"
        assert "kind=internal" not in caplog.text and "event=fatal" in caplog.text
        # Its reason is a field, whole (probe: under --log-format json, only "event": "fatal").
        import json

        from dispatcher_server.cliopts import JsonFormatter

        (fatal,) = [r for r in caplog.records if "event=fatal" in r.getMessage()]
        fields = json.loads(JsonFormatter().format(fatal))
        assert fields["event"] == "fatal" and fields["why"] == d.fatal and fields["next_step"] == 0
        # Nothing left behind, nothing half-admitted.
        assert not [n for n in os.listdir(tmp_path) if ".tmp" in n]
        assert d.inputs.rules == {}
    finally:
        reader.close()
        d.stop()


def test_a_reader_told_the_job_halted_stops_with_the_dispatchers_reason():
    from pipeline.service import FatalReaderError, ReaderWorker
    svc = ReaderWorker.__new__(ReaderWorker)
    svc.config = type("C", (), {"dispatcher": "tcp://d:1"})()
    msg = P.decode(P.encode(P.ERROR, code="halted", message="journal write failed (disk full)"))
    with pytest.raises(FatalReaderError, match="tcp://d:1 stopped the job: journal write failed"):
        svc.on_message(None, msg)


def _ipv6_loopback() -> bool:
    import socket
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback")
def test_a_dispatcher_bound_to_an_ipv6_address_welcomes_a_peer_connecting_over_ipv6():
    """ZeroMQ sockets speak IPv4 only unless told: binding tcp://[::1]:PORT failed with "No such
    device", and a peer could not connect to one."""
    from dispatcher_server.session import PeerSession, SessionConfig

    d = Dispatcher(_config(reader_bind="tcp://[::1]:0", trainer_bind="tcp://[::1]:0")).start()
    welcomed, stop = threading.Event(), threading.Event()

    class Role:
        def hello_fields(self):
            return {"role": "reader", "name": "v6"}

        def reset(self):
            pass

        def on_welcome(self, session, msg):
            welcomed.set()
            session.finish()

        def on_message(self, session, msg):
            return True

        def tick(self, session):
            return False

    try:
        assert d.reader_endpoint.startswith("tcp://[::1]:")
        assert d.trainer_endpoint.startswith("tcp://[::1]:")
        session = PeerSession(SessionConfig(address=d.reader_endpoint, connect_timeout_s=5.0), Role())
        t = threading.Thread(target=session.run, args=(stop,), daemon=True)
        t.start()
        assert welcomed.wait(5), "no WELCOME over IPv6"
        t.join(5)
    finally:
        stop.set()
        d.stop()


# -- a step the planner refuses ends the job once ------------------------------------------------
def test_an_unplannable_step_ends_the_job_once_naming_its_samples(tmp_path):
    planner = PlannerConfig(num_microbatches=1, llm_capacity=20, oversize="error")
    d = Dispatcher(_config(tmp_path, planner=planner, gb=2))
    peer = None
    try:
        reader, a = _with_reader(d)
        d._on_samples(reader, _samples_msg(a.id, [_header("small", 0), _header("giant", 1, llm=500)]))
        with pytest.raises(Fatal, match="giant") as e:
            d._pump()
    finally:
        d._close()
    # in the service's terms: its flags, not the planner API's (oversize='isolate', {} capacities)
    assert "step 0 cannot be planned over --llm-capacity 20: sample giant fits no micro-batch " \
           "(500 LLM tokens); largest samples: giant (500 LLM tokens)" in str(e.value)
    assert "oversize='isolate'" not in str(e.value) and "{}" not in str(e.value)
    # A restart with the same planner settings refuses at once, with the same reason ...
    with pytest.raises(HaltedJob, match="step 0.*giant"):
        Dispatcher(_config(tmp_path, planner=planner, gb=2))
    # ... and with settings that can plan it, it resumes (the halt is forgotten).
    fixed = PlannerConfig(num_microbatches=1, llm_capacity=20, oversize="isolate")
    d = Dispatcher(_config(tmp_path, planner=fixed, gb=2))
    d._close()
    d = Dispatcher(_config(tmp_path, planner=fixed, gb=2))  # halted.json is gone for good
    d._close()


def test_a_step_too_large_for_its_microbatches_is_not_blamed_on_samples_that_fit():
    """No sample over --llm-capacity, but 2 x 15 tokens in 1 rank x 1 micro-batch of 20: the
    halt named the 'largest samples' (all fitting) and only --oversize isolate as the way out."""
    planner = PlannerConfig(num_microbatches=1, llm_capacity=20, oversize="error")
    d = Dispatcher(_config(planner=planner, gb=2))
    try:
        reader, a = _with_reader(d)
        d._on_samples(reader, _samples_msg(a.id, [_header("a", 0, llm=15), _header("b", 1, llm=15)]))
        with pytest.raises(Fatal) as err:
            d._pump()
    finally:
        d._close()
    assert "no sample is over it alone" in str(err.value)
    assert "30 LLM tokens do not pack into 1 rank x 1 micro-batch of 20 (20 in all)" in str(err.value)
    assert "Raise --num-microbatches or --llm-capacity" in str(err.value)

def test_an_unplannable_step_sends_trainers_end_and_stops_the_loop(tmp_path):
    planner = PlannerConfig(num_microbatches=1, llm_capacity=20, oversize="error")
    d = Dispatcher(_config(tmp_path, planner=planner, gb=2))
    reader, a = _with_reader(d)
    d._on_samples(reader, _samples_msg(a.id, [_header("giant", 0, llm=500), _header("s", 1)]))
    d.start()
    peer = _Peer(d.trainer_endpoint)
    try:
        _hello(peer)
        end = peer.expect(P.END)
        assert end["reason"] == "halted" and "giant" in end["message"]
        deadline = time.monotonic() + 5
        while d._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not d._thread.is_alive() and "giant" in d.fatal
    finally:
        peer.close()
        d.stop()


# -- a trainer restored from another job -------------------------------------------------------
def test_a_trainer_restored_from_another_dataset_is_refused_naming_the_difference():
    d = Dispatcher(_config()).start()
    peer = _Peer(d.trainer_endpoint)
    try:
        other = dict(d.dataset, seed=7)
        seq = _hello(peer, dataset=other)
        err = peer.expect(P.ERROR)
        assert err["code"] == "dataset" and err["ack"] == seq
        assert "seed: checkpoint 7, dispatcher 0" in err["message"]
        assert all(s.ident is None for s in d.slots)  # refused before anything moved
        _hello(peer, dataset=dict(d.dataset, shuffle_shards=3))  # a default is left out: said as 1
        assert "shuffle_shards: checkpoint 3, dispatcher 1" in peer.expect(P.ERROR)["message"]
        _hello(peer, dataset=dict(d.dataset))
        welcome = peer.expect(P.WELCOME)
        assert welcome["dataset"] == d.dataset
    finally:
        peer.close()
        d.stop()


def test_a_second_claim_of_a_rank_wins_and_the_first_is_told_to_stop(caplog):
    """Two processes of one rank used to take turns: each claim made the other unknown, whose
    next message drew unknown_peer and a new HELLO, and both got every step of the rank."""
    from trainer_client.client import _FATAL_CODES

    d = Dispatcher(_config()).start()
    first, second = _Peer(d.trainer_endpoint), _Peer(d.trainer_endpoint)
    try:
        with caplog.at_level(logging.WARNING, logger="mmdispatch"):
            _hello(first)
            first.expect(P.WELCOME)
            _hello(second)
            second.expect(P.WELCOME)
            told = first.expect(P.ERROR)
        assert told["code"] == "replaced" and "rank 0" in told["message"]
        assert told["code"] in _FATAL_CODES  # the client stops on it, no HELLO again
        assert d.slots[0].ident is not None and d.delivery.connected() == 1
        assert sum("rank_replaced" in r.getMessage() for r in caplog.records) == 1
        _hello(second)  # the same connection saying HELLO again replaces nothing
        second.expect(P.WELCOME)
        with pytest.raises(AssertionError, match="no error"):
            second.expect(P.ERROR, timeout=0.5)
    finally:
        first.close()
        second.close()
        d.stop()


def test_ranks_restarted_without_a_checkpoint_start_at_one_step(caplog):
    """Ranks restarted before their first checkpoint (no state to resume) each started at the
    step their own last connection had received: 2 and 4 here, so their collectives would
    pair different steps' plans. Then at the oldest step a rank had not received (2): steps
    0-1, sent to the old processes and never committed, were never trained by the job. They
    start together after the last commit: with none, at the job's first step."""
    from dispatcher_server.delivery import RetainedStep

    d = Dispatcher(_config(world_size=2))
    caplog.set_level(logging.WARNING, logger="mmdispatch")
    try:
        for step in range(4):
            d.delivery.add(RetainedStep(step=step, epoch=0, batch=None, plan=None, messages=None,
                                        num_samples=1, nbytes=0))
        s0, s1 = d.delivery.slots
        d.delivery.credit(s0, 4, received=2)
        d.delivery.credit(s1, 4, received=4)
        d.delivery.evict()
        assert d.delivery.lowest == 2
        for rank in (1, 0):  # fresh processes: no next_step
            d._on_trainer(b"new%d" % rank, P.decode(P.encode(
                P.HELLO, seq=1, role="trainer", rank=rank, world_size=2, next_step=None,
                prefetch=2)), 0.0)
        assert (s0.next_send, s1.next_send) == (0, 0) and d.next_plan == 0  # re-planned from 0
    finally:
        d._close()


def test_a_rank_without_a_checkpoint_is_told_which_steps_cannot_be_served_again(caplog):
    """A start after the last commit that the dispatcher can no longer serve (no journal, and
    not among the steps it keeps) was skipped to the oldest step held, silently. The trainer
    is refused naming the steps and --journal-dir."""
    from dispatcher_server.delivery import RetainedStep

    d = Dispatcher(_config())
    peer = _Peer(d.trainer_endpoint)
    try:
        for step in range(4, 6):
            d.delivery.next_plan = step
            d.delivery.add(RetainedStep(step=step, epoch=0, batch=None, plan=None, messages=None,
                                        num_samples=1, nbytes=0))
        d.replay.committed = 1  # as if the cursors after it were gone
        d.slots[0].heard = True  # its earlier process took steps from this dispatcher
        d.start()
        seq = _hello(peer)
        err = peer.expect(P.ERROR)
        assert err["code"] == "resume" and err["ack"] == seq
        assert "steps 2-3 cannot be served again" in err["message"]
        assert "--journal-dir" in err["message"]
        assert d.slots[0].ident is None
    finally:
        peer.close()
        d.stop()


def test_a_peer_at_the_other_roles_endpoint_is_refused_logged_and_counted_alike(caplog):
    """A reader at the trainer endpoint was logged and counted; a trainer at the reader
    endpoint heard the same ERROR, but the dispatcher's operator heard nothing of it."""
    d = Dispatcher(_config(world_size=2)).start()
    at_readers, at_trainers = _Peer(d.reader_endpoint), _Peer(d.trainer_endpoint)
    try:
        with caplog.at_level(logging.WARNING, logger="mmdispatch"):
            for peer, role in ((at_readers, "trainer"), (at_trainers, "reader")):
                seq = peer.send(P.HELLO, role=role, rank=0, world_size=2, name="x")
                err = peer.expect(P.ERROR)
                assert err["code"] == "role" and err["ack"] == seq
        lines = [r.getMessage() for r in caplog.records if "kind=role" in r.getMessage()]
        assert len(lines) == 2, lines
        assert any("'trainer' connected to the reader endpoint" in line for line in lines), lines
        assert any("'reader' connected to the trainer endpoint" in line for line in lines), lines
        assert d.metrics.registry.get_sample_value("mmdispatch_errors_total", {"kind": "role"}) == 2
        assert not d.pool.readers and d.delivery.connected() == 0
    finally:
        at_readers.close()
        at_trainers.close()
        d.stop()


@pytest.mark.parametrize("field,value,words", [
    ("local_world_size", 0, "local_world_size 0 is outside [1, 2]"),
    ("local_world_size", -3, "local_world_size -3 is outside [1, 2]"),
    ("local_world_size", 3, "local_world_size 3 is outside [1, 2]"),
    ("prefetch", -1, f"prefetch -1 is outside [1, {P.MAX_PREFETCH}]"),
    ("prefetch", 0, f"prefetch 0 is outside [1, {P.MAX_PREFETCH}]"),
    ("prefetch", 10**12, f"prefetch {10**12} is outside [1, {P.MAX_PREFETCH}]"),
    ("ahead", -7, f"ahead -7 is outside [0, {P.MAX_AHEAD}]"),
    ("ahead", P.MAX_AHEAD + 1, f"ahead {P.MAX_AHEAD + 1} is outside [0, {P.MAX_AHEAD}]"),
])
def test_a_trainer_hello_with_a_field_out_of_range_is_refused_as_malformed(field, value, words):
    """Welcomed before: a node of 0 ranks (the log advised --ranks-per-node 0), negative or
    10**12 steps of credit."""
    d = Dispatcher(_config(world_size=2)).start()
    peer = _Peer(d.trainer_endpoint)
    try:
        hello = dict(role="trainer", rank=0, world_size=2, local_world_size=2, next_step=None,
                     prefetch=2, ahead=0)
        seq = peer.send(P.HELLO, **{**hello, field: value})
        err = peer.expect(P.ERROR)
        assert err["code"] == "malformed" and err["ack"] == seq
        assert words in err["message"], err["message"]
        assert d.delivery.connected() == 0
        assert d.metrics.registry.get_sample_value("mmdispatch_errors_total",
                                                   {"kind": "malformed"}) == 1
        # the bounds themselves are welcome
        peer.send(P.HELLO, **{**hello, "local_world_size": 1, "prefetch": P.MAX_PREFETCH,
                              "ahead": P.MAX_AHEAD})
        peer.expect(P.WELCOME)
    finally:
        peer.close()
        d.stop()


def _topology_warnings(caplog, ranks_per_node: int, hellos: list[tuple[int, int]]) -> list[str]:
    """The topology_mismatch lines a dispatcher for 2 ranks, `ranks_per_node` a node, logs
    while welcoming each (rank, local_world_size) of `hellos` in turn."""
    d = Dispatcher(_config(world_size=2, ranks_per_node=ranks_per_node)).start()
    peer = _Peer(d.trainer_endpoint)
    try:
        with caplog.at_level(logging.WARNING, logger="mmdispatch"):
            for rank, local in hellos:
                peer.send(P.HELLO, role="trainer", rank=rank, world_size=2,
                          local_world_size=local, next_step=None, prefetch=2)
                peer.expect(P.WELCOME)
        return [r.getMessage() for r in caplog.records if "topology_mismatch" in r.getMessage()]
    finally:
        peer.close()
        d.stop()


def test_a_trainer_on_nodes_of_another_size_is_welcomed_with_one_warning_naming_the_fix(caplog):
    warned = _topology_warnings(caplog, 1, [(0, 2), (1, 2)])  # said once, not per rank
    assert len(warned) == 1 and "--ranks-per-node 2" in warned[0]


def test_trainers_on_nodes_of_the_planned_size_are_not_warned(caplog):
    assert _topology_warnings(caplog, 2, [(0, 2), (1, 2)]) == []


@pytest.mark.timeout(30)
def test_a_trainer_on_a_node_of_another_size_says_so_in_its_own_log(caplog):
    """Whoever launched the trainers reads their logs, not the dispatcher's: the trainer's
    client warns once, naming both sizes and the fix; a trainer of the planned size does not."""
    from trainer_client.client import ClientConfig, DispatcherClient

    def client_warnings(ranks_per_node: int, local: int) -> list[str]:
        caplog.clear()
        d = Dispatcher(_config(world_size=2, ranks_per_node=ranks_per_node)).start()
        client = DispatcherClient(d.trainer_endpoint, 0, 2, local,
                                  config=ClientConfig(connect_timeout_s=10)).start()
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and client._peer.consumed is None:
                time.sleep(0.02)  # the client's thread takes its position from the WELCOME
            assert client._peer.consumed == 0, "the trainer was never welcomed"
            return [r.getMessage() for r in caplog.records if r.name == "mmdispatch.client"
                    and "topology_mismatch" in r.getMessage()]
        finally:
            client.close()
            d.stop()

    with caplog.at_level(logging.WARNING, logger="mmdispatch"):
        warned = client_warnings(ranks_per_node=1, local=2)
        assert len(warned) == 1, warned
        assert "local_world_size=2 ranks_per_node=1" in warned[0]
        assert "--ranks-per-node 2" in warned[0]
        assert client_warnings(ranks_per_node=2, local=2) == []


def test_the_dataset_fingerprint_names_what_a_resume_depends_on():
    base = _config()
    fp = base.dataset_fingerprint()
    assert set(fp) == {"shards", "num_shards", "seed", "mode", "global_batch", "token_budget",
                       "shuffle_buffer"}
    other = ServerConfig(shuffle_buffer=0, shards=["/data/shard-1.tar"], world_size=1, batch=base.batch,
                         planner=base.planner)
    assert other.dataset_fingerprint()["shards"] != fp["shards"]
    assert len(msgpack.packb(fp)) < 200  # small on the wire whatever the shard count


# -- an epoch with no usable sample ends the job instead of looping ----------------------------
def _empty_run(d: Dispatcher, epochs: int) -> None:
    """Readers report every shard of `epochs` epochs done with one bad sample each."""
    reader = d.pool.join(b"r", "r", 0.0)
    d._on_reader(reader.ident, P.decode(P.encode(P.SHARD_REQUEST, shards=4)), 0.0)
    for _ in range(4 * epochs):
        d._pump()
        for a in list(reader.assignments):
            d._on_shard_done(reader, P.decode(P.encode(P.SHARD_DONE, assign_id=a.id, count=1,
                                                       skipped=[["bad", "bad_image", 0]])))


def test_an_epoch_without_a_usable_sample_ends_the_job_naming_why():
    d = Dispatcher(_config(max_epochs=None))  # unbounded epochs: it must not loop
    try:
        with pytest.raises(Fatal, match=r"epoch 0 of the 1 shards yielded no usable sample "
                                        r"\(skipped: \d+ bad_image\)"):
            _empty_run(d, epochs=3)
        assert d.next_plan == 0
    finally:
        d._close()


def test_an_empty_epoch_names_a_failing_shard_without_its_credentials():
    """`skipped: 2 open_failed` alone sent the operator looking for which shard and why."""
    shard = "http://bob:pw123@127.0.0.1:9/shard-0.tar?token=TOK123"
    d = Dispatcher(_config(max_epochs=None, shards=[shard]))
    try:
        reader = d.pool.join(b"r", "r", 0.0)
        d._on_reader(reader.ident, P.decode(P.encode(P.SHARD_REQUEST, shards=4)), 0.0)
        with pytest.raises(Fatal) as caught:
            for _ in range(12):
                d._pump()
                for a in list(reader.assignments):
                    d._on_shard_done(reader, P.decode(P.encode(
                        P.SHARD_DONE, assign_id=a.id, count=0, skipped=[["", "shard_failed", -1]])))
        said = str(caught.value)
        assert "(skipped: 1 shard_failed); first shard_failed: shard 'http://bob:***@127.0.0.1:9/" \
               "shard-0.tar?token=***', its reader's log says why" in said, said
    finally:
        d._close()


def test_an_epoch_resumed_midway_is_not_called_empty():
    """A restart inside an epoch saw only its tail: that tail yielding nothing proves nothing."""
    from dispatcher_server.ordering import Cursor

    d = Dispatcher(ServerConfig(
        shuffle_buffer=0, shards=["/data/s0.tar", "/data/s1.tar"], world_size=1, batch=BatchConfig(global_batch=4),
        planner=PlannerConfig(num_microbatches=1), max_epochs=None, journal_fsync=False))
    try:
        d.assembler.reset(Cursor(base=1))  # position 0 (epoch 0) consumed before the restart
        d.assembler.open_window()
        reader = d.pool.join(b"r", "r", 0.0)
        d._on_reader(reader.ident, P.decode(P.encode(P.SHARD_REQUEST)), 0.0)
        d._pump()
        (a,) = reader.assignments
        assert a.pos == 1
        d._on_shard_done(reader, P.decode(P.encode(P.SHARD_DONE, assign_id=a.id, count=0,
                                                   skipped=[])))
        d._pump()  # epoch 0 ends here, having yielded nothing in this run: not a verdict
        assert d.assembler.empty_epoch is None and d.fatal is None
    finally:
        d._close()


# -- arrival mode: a restart re-plans the journaled steps from the samples they took -----------
_ARRIVAL_SHARDS = [f"/data/arrival-{i}.tar" for i in range(3)]


def _arrival_config(tmp_path, shuffle: int) -> ServerConfig:
    return ServerConfig(
        shards=_ARRIVAL_SHARDS, mode="arrival", shuffle_buffer=shuffle, world_size=1,
        batch=BatchConfig(global_batch=4), planner=PlannerConfig(num_microbatches=1),
        journal_dir=str(tmp_path), journal_fsync=False,
        flow=FlowConfig(max_buffered_samples=1_000, num_inflight_shards=3, credit_batch=8,
                        max_retained_steps=16),
        liveness=LivenessConfig(heartbeat_s=0.2, timeout_s=1.5, poll_ms=10))


def _arrival_life(d: Dispatcher, order: list[tuple[int, int]]) -> list[list[str]]:
    """Read the three 6-sample shards in `order` ((shard, samples) chunks, each shard from where
    the dispatcher resumes it) and return the keys of every step it plans."""
    reader = d.pool.join(b"r", "r", 0.0)
    d._on_reader(reader.ident, P.decode(P.encode(P.SHARD_REQUEST, shards=3)), 0.0)
    d._pump()
    by_shard = {d.progress[a.pos].url: a for a in reader.assignments}
    for a in reader.assignments:
        # A reader holding credit on all three shards at once (the dispatcher grants one
        # batch in all until a first sample says how large they are): flow control is not
        # what this tests, the order samples arrive in is.
        a.credits = max(a.credits, 6 - d.progress[a.pos].next_index)
    for shard, n in order:
        a = by_shard.get(_ARRIVAL_SHARDS[shard])
        if a is None:
            continue  # read whole before the restart
        start = d.progress[a.pos].next_index
        stem = _ARRIVAL_SHARDS[shard].rsplit("/", 1)[1]
        todo = range(start, min(start + n, 6))
        d._on_samples(reader, _samples_msg(a.id, [_header(f"{stem}-{i}", i) for i in todo]))
        if todo.stop == 6:
            d._on_shard_done(reader, P.decode(P.encode(P.SHARD_DONE, assign_id=a.id,
                                                       count=a.received, skipped=[])))
        d._pump()
    return [list(rs.batch.keys) for rs in d.retained]


@pytest.mark.parametrize("shuffle", [0, 6])
@pytest.mark.parametrize("committed", [None, 1])
def test_arrival_mode_restart_replays_the_journaled_steps_whatever_the_new_arrival_order(
        tmp_path, shuffle, committed):
    """Arrival mode plans in the order samples came in, which a restart cannot reproduce from
    a cursor: the steps trainers already received must still come back with the same samples
    (a re-plan from other samples delivers some twice and loses others)."""
    first = [(0, 2), (1, 3), (2, 1), (0, 2), (2, 5), (1, 3), (0, 2)]
    d = Dispatcher(_arrival_config(tmp_path, shuffle))
    try:
        before = _arrival_life(d, first)
        if committed is not None:
            assert d.replay.commit(committed)
    finally:
        d._close()  # killed: the journal is all that survives
    assert len(before) == 5 and sorted(k for s in before for k in s) == sorted(
        f"{p.rsplit('/', 1)[1]}-{i}" for p in _ARRIVAL_SHARDS for i in range(6))
    d = Dispatcher(_arrival_config(tmp_path, shuffle))
    try:
        resumed = 0 if committed is None else committed + 1
        assert d.next_plan == resumed
        # Samples come back in another order: shard 2 first, then 1, then 0.
        after = _arrival_life(d, [(2, 6), (1, 6), (0, 6)])
    finally:
        d._close()
    assert after == before[resumed:]


def test_arrival_mode_steps_planned_after_a_restart_replay_after_the_next_one(tmp_path):
    """A restart inside a shuffle block pulls the block again; the steps planned after that
    (new ones, journaled by the second life) must replay verbatim in a third life as well."""
    d = Dispatcher(_arrival_config(tmp_path, 6))
    try:
        first = _arrival_life(d, [(0, 2), (1, 3), (2, 1), (0, 2)])  # 8 of 18 samples
    finally:
        d._close()
    d = Dispatcher(_arrival_config(tmp_path, 6))
    try:
        second = _arrival_life(d, [(1, 6), (2, 6), (0, 6)])
        assert second[:len(first)] == first and len(second) == 5
    finally:
        d._close()
    d = Dispatcher(_arrival_config(tmp_path, 6))
    try:
        assert _arrival_life(d, [(2, 6), (0, 6), (1, 6)]) == second
    finally:
        d._close()


def test_arrival_mode_replay_is_not_stalled_by_a_reader_full_of_other_shards(tmp_path):
    """The replayed order waits on one shard; a reader whose slots hold other shards, each
    filled to its cap and waiting for credit, gives one of them up for it instead of stalling."""
    shards = [f"/data/big-{i}.tar" for i in range(4)]

    def config() -> ServerConfig:
        # shard cap: (40 - (1 + 1) * 4) // 4 = 8 samples buffered or credited per shard
        return ServerConfig(
            shards=shards, mode="arrival", shuffle_buffer=0, world_size=1,
            batch=BatchConfig(global_batch=4), planner=PlannerConfig(num_microbatches=1),
            journal_dir=str(tmp_path), journal_fsync=False,
            flow=FlowConfig(max_buffered_samples=40, num_inflight_shards=4, credit_batch=4,
                            max_retained_steps=1),
            liveness=LivenessConfig(heartbeat_s=0.2, timeout_s=1.5, poll_ms=10))

    def feed(d: Dispatcher, reader: Reader, a, n: int) -> None:
        prog = d.progress[a.pos]
        stem = prog.url.rsplit("/", 1)[1]
        start = prog.next_index
        d._on_samples(reader, _samples_msg(a.id, [_header(f"{stem}-{i}", i)
                                                 for i in range(start, start + n)]))
        d._pump()

    d = Dispatcher(config())
    try:
        reader = d.pool.join(b"r", "r", 0.0)
        d._on_reader(reader.ident, P.decode(P.encode(P.SHARD_REQUEST, shards=4)), 0.0)
        d._pump()
        last = max(reader.assignments, key=lambda a: a.pos)
        # Its reader holds credit there (before a first sample says how large samples are,
        # only the lowest position is granted any): the highest position arrives first.
        last.credits = max(last.credits, 4)
        feed(d, reader, last, 4)  # step 0 is all of it
        (first,) = [list(rs.batch.keys) for rs in d.retained]
    finally:
        d._close()
    d = Dispatcher(config())
    try:
        reader = d.pool.join(b"r", "r", 0.0)
        d._on_reader(reader.ident, P.decode(P.encode(P.SHARD_REQUEST, shards=2)), 0.0)
        for _ in range(6):  # the reader sends all its credits allow, the replay waits
            d._pump()
            for a in list(reader.assignments):
                if a.credits:
                    feed(d, reader, a, a.credits)
            if d.retained:
                break
        assert [list(rs.batch.keys) for rs in d.retained] == [first]
    finally:
        d._close()


def test_an_isolated_oversize_sample_is_logged_by_step_and_key_and_the_warm_up_warns_of_none(
        tmp_path, caplog, recwarn):
    """`--oversize isolate` printed raw Python warnings about the warm-up's synthetic samples,
    then named the real one by its index in the step alone."""
    import logging

    from dispatcher_server.planner import OversizeWarning, Topology
    from dispatcher_server.planner.warm import warm_up

    planner = PlannerConfig(num_microbatches=1, llm_capacity=20, oversize="isolate")
    warm_up(Topology(world_size=1, ranks_per_node=1), planner)
    assert not [w for w in recwarn if issubclass(w.category, OversizeWarning)]
    d = Dispatcher(_config(tmp_path, planner=planner, gb=2))
    try:
        reader, a = _with_reader(d)
        d._on_samples(reader, _samples_msg(a.id, [_header("small", 0), _header("giant", 1, llm=500)]))
        with caplog.at_level(logging.WARNING, logger="mmdispatch"):
            d._pump()
    finally:
        d._close()
    (line,) = [r.getMessage() for r in caplog.records if "oversize_isolated" in r.getMessage()]
    assert "step=0 microbatches=2 configured=1 keys=giant" in line and "fits no capacity" in line
    assert not [w for w in recwarn if issubclass(w.category, OversizeWarning)]


def test_a_step_isolated_and_planned_again_in_more_microbatches_is_one_line_that_agrees_with_its_plan(
        caplog):
    """The planner warns at each attempt: an isolated sample made it warn "2 -> 3", a retry in
    more micro-batches "3 -> 4", and the retry's own "3 instead of 2" came last, all for a step
    planned in 4 (probe repro); a step with nothing isolated logged `keys=None`. One line a
    step now names the isolated keys, the micro-batches the ranks get and why."""
    import logging

    planner = PlannerConfig(num_microbatches=2, llm_capacity=100, oversize="isolate")
    d = Dispatcher(_config(planner=planner, gb=8, world_size=3))
    try:
        reader, a = _with_reader(d)
        sizes = [60] * 7 + [6000]
        d._on_samples(reader, _samples_msg(a.id, [_header(f"t{i:03d}", i, llm=n)
                                                  for i, n in enumerate(sizes)]))
        with caplog.at_level(logging.WARNING, logger="mmdispatch"):
            d._pump()
        (rs,) = d.delivery.retained
    finally:
        d._close()
    lines = [r.getMessage() for r in caplog.records if "oversize_isolated" in r.getMessage()]
    assert len(lines) == 1, lines
    M = rs.plan.num_microbatches
    assert M > 3 and f"step=0 microbatches={M} configured=2 keys=t007 " in lines[0], lines[0]
    assert "did not pack" in lines[0] and "capacity 100" in lines[0] and "None" not in lines[0]


def test_a_peer_unknown_after_a_restart_is_counted_not_warned_of(caplog):
    """After a dispatcher restart every reader's and trainer's next message draws unknown_peer
    (and the peer says HELLO again): one warning per peer was noise on every normal restart."""
    d = Dispatcher(_config()).start()
    peer = _Peer(d.trainer_endpoint)
    try:
        with caplog.at_level(logging.INFO, logger="mmdispatch"):
            peer.send(P.HEARTBEAT)
            told = peer.expect(P.ERROR)
        assert told["code"] == "unknown_peer"
        assert d.metrics.registry.get_sample_value("mmdispatch_errors_total",
                                                   {"kind": "unknown_peer"}) == 1
        lines = [r for r in caplog.records if "kind=unknown_peer" in r.getMessage()]
        assert [r.levelno for r in lines] == [logging.INFO]
    finally:
        peer.close()
        d.stop()


def test_samples_of_an_assignment_no_longer_held_are_counted_not_warned_of(caplog):
    """A reader's samples in flight for a shard taken back, or sent before a dispatcher
    restart, are expected: the reader is told to drop them, and no warning (an alert on
    warnings fired on every routine restart)."""
    d = Dispatcher(_config()).start()
    peer = _Peer(d.reader_endpoint)
    try:
        with caplog.at_level(logging.INFO, logger="mmdispatch"):
            peer.send(P.HELLO, role="reader", name="r")
            peer.expect(P.WELCOME)
            peer.sock.send_multipart(P.encode(P.SAMPLES, seq=peer.seq + 1, frames=[b""], assign_id=99,
                                              samples=[], sizes=[]))
            told = peer.expect(P.CANCEL)
        assert told["assign_id"] == 99
        lines = [r for r in caplog.records if "kind=stale_samples" in r.getMessage()]
        assert [r.levelno for r in lines] == [logging.INFO]
    finally:
        peer.close()
        d.stop()


def test_a_done_job_whose_rank_was_lost_waits_for_its_restart_before_exiting(caplog):
    """--exit-when-done left as soon as every rank was gone, also when a rank crashed with
    steps after the last commit: the job restored from its checkpoint found no dispatcher to
    resume them from. A loss (no BYE) with uncommitted steps now waits LOST_RANK_GRACE_S,
    saying so; a job that rejoins decides again by its own end."""
    import dispatcher_server.server as server_module

    d = Dispatcher(_config())
    try:
        d.replay.committed, d.delivery.next_plan = 0, 4  # steps 1-3 after the last commit
        assert not d._resumable_after_loss(100.0)  # every rank said BYE: exits at once
        d.delivery.slots[0].lost = True
        with caplog.at_level(logging.WARNING, logger="mmdispatch"):
            assert d._resumable_after_loss(100.0)
            assert d._resumable_after_loss(100.0 + server_module.LOST_RANK_GRACE_S - 1)
            assert d.resume_wait_over is None
            assert not d._resumable_after_loss(100.0 + server_module.LOST_RANK_GRACE_S)
        (line,) = [r.getMessage() for r in caplog.records if "waiting_for_resume" in r.getMessage()]
        assert "steps=1-3" in line
        # The wait ran out: serve exits 1 saying so, not as a job done (probe: reason=done, 0).
        assert d.resume_wait_over == "1-3"
        d.replay.committed = 3  # every step committed: nothing to resume
        assert not d._resumable_after_loss(100.0)
    finally:
        d._close()


def _trainer_says(d: Dispatcher, ident: bytes, type_: str, **fields) -> None:
    d._on_trainer(ident, P.decode(P.encode(type_, seq=1, **fields)), time.monotonic())


@pytest.mark.parametrize("left_at,waits", [(1, True), (3, True), (4, False), (None, False)])
def test_a_done_job_waits_for_a_rank_that_said_bye_before_its_loop_ended(caplog, left_at, waits):
    """Trainers SIGTERM'd (preempted) after step 0's commit said BYE with steps 1-3 received
    ahead but untrained, and `--exit-when-done` exited as done: the job restored from its
    checkpoint found no dispatcher. A BYE saying its loop stopped before the last step now
    waits as a lost rank does; one past the last step (a loop that broke after it, not
    waiting for the end), or that says nothing (an older client), ends it at once."""
    d = Dispatcher(_config())
    try:
        _fill_and_plan(d, 16)  # steps 0-3
        _trainer_says(d, b"t0", P.HELLO, role="trainer", rank=0, world_size=1, next_step=None,
                      prefetch=4)
        _trainer_says(d, b"t0", P.COMMIT, step=0)
        with caplog.at_level(logging.INFO, logger="mmdispatch"):
            _trainer_says(d, b"t0", P.BYE, **({} if left_at is None else {"next_step": left_at}))
            assert d._resumable_after_loss(100.0) is waits
        left = [r.getMessage() for r in caplog.records if "trainer_left" in r.getMessage()]
        assert len(left) == 1 and (f"next_step={left_at}" in left[0]) is (left_at is not None)
        resume = [r.getMessage() for r in caplog.records if "waiting_for_resume" in r.getMessage()]
        assert [("steps=1-3" in line) for line in resume] == ([True] if waits else [])
    finally:
        d._close()

@pytest.mark.parametrize("received", [4, 2])
def test_a_done_job_waits_for_a_rank_that_left_early_also_before_any_commit_or_the_end(
        caplog, received):
    """Probe: a rank whose loop stopped at step 3 of 0-3 with no commit yet said BYE
    next_step=3, and `--exit-when-done` exited at once (the wait asked for a commit >= 0): a
    job restarted from no checkpoint starts at step 0 and found no dispatcher. A rank that left
    before the last steps even reached it held the exit for good instead, saying nothing. Both
    now wait LOST_RANK_GRACE_S with event=waiting_for_resume, then exit."""
    import dispatcher_server.server as server_module

    d = Dispatcher(_config())
    try:
        _fill_and_plan(d, 16)  # steps 0-3
        _trainer_says(d, b"t0", P.HELLO, role="trainer", rank=0, world_size=1, next_step=None,
                      prefetch=4)
        d.delivery.credit(d.delivery.slots[0], received + 2, received)
        _trainer_says(d, b"t0", P.BYE, next_step=min(received, 3))
        d.finished = lambda: True  # the stream ended after step 3
        with caplog.at_level(logging.WARNING, logger="mmdispatch"):
            assert d._leaving(True, 100.0) is None
            assert d._leaving(True, 100.0 + server_module.LOST_RANK_GRACE_S - 1) is None
            assert d._leaving(True, 100.0 + server_module.LOST_RANK_GRACE_S) is not None
        (line,) = [r.getMessage() for r in caplog.records if "waiting_for_resume" in r.getMessage()]
        assert "steps=0-3" in line
    finally:
        d._close()


def _plan_for_ranks(d: Dispatcher, prefetch: int) -> None:
    """Steps 0-3 planned, and every rank of `d` connected (socket t<rank>) from the start."""
    _fill_and_plan(d, 16)
    assert d.next_plan == 4
    for rank in range(d.config.world_size):
        _trainer_says(d, b"t%d" % rank, P.HELLO, role="trainer", rank=rank,
                      world_size=d.config.world_size, next_step=None, prefetch=prefetch)


def test_a_done_job_still_waits_for_a_lost_rank_after_another_rank_rejoined_and_finished(caplog):
    """Probe: rank 0 was SIGKILLed after its commit of step 0 (it had received every step and
    the end); rank 1 reconnected, trained to the end and said BYE, and the dispatcher exited
    64 ms later: rank 1's HELLO had forgotten that a rank was lost, and rank 0, restored from
    its checkpoint a moment later, found no dispatcher for steps 1-3."""
    d = Dispatcher(_config(world_size=2))
    try:
        _plan_for_ranks(d, prefetch=4)
        for rank in (0, 1):
            _trainer_says(d, b"t%d" % rank, P.COMMIT, step=0)
        s0, s1 = d.delivery.slots
        d.delivery.credit(s0, 6, 4)
        s0.end_sent = True
        s0.last_seen = 0.0
        s1.last_seen = 1000.0
        with caplog.at_level(logging.WARNING, logger="mmdispatch"):
            d._liveness(1000.0, 1000.0, 1000.0)  # rank 0: silent past its timeout
            assert s0.lost and "trainer_lost rank=0" in caplog.text
            _trainer_says(d, b"t1b", P.HELLO, role="trainer", rank=1, world_size=2,
                          next_step=1, prefetch=4)  # rank 1 reconnects ...
            d.delivery.credit(s1, 6, 4)
            s1.end_sent = True
            _trainer_says(d, b"t1b", P.COMMIT, step=3)
            _trainer_says(d, b"t1b", P.BYE, next_step=4)  # ... and finishes
            d.finished = lambda: True
            d._started_at, d._unheard_said = 0.0, False  # (run() sets them)
            assert d.done(2000.0)
            assert d._leaving(True, 2000.0) is None, "exited with rank 0's steps 1-3 untrained"
        (line,) = [r.getMessage() for r in caplog.records if "waiting_for_resume" in r.getMessage()]
        assert "steps=1-3" in line
    finally:
        d._close()


def test_every_rank_gone_before_the_end_of_the_data_is_said_once(caplog):
    """Probe: trainers SIGTERM'd mid-epoch said BYE, and the dispatcher, keeping the job's
    place for a restart without a bound, said nothing more after their trainer_left lines."""
    d = Dispatcher(_config(world_size=2))
    try:
        _fill_and_plan(d, 16)  # steps 0-3 of more data
        d.finished = lambda: False
        with caplog.at_level(logging.WARNING, logger="mmdispatch"):
            for rank in (0, 1):
                _trainer_says(d, b"t%d" % rank, P.HELLO, role="trainer", rank=rank, world_size=2,
                              next_step=None, prefetch=2)
            _trainer_says(d, b"t0", P.BYE, next_step=2)
            d._check_ranks_gone()  # rank 1 still there: nothing to say
            _trainer_says(d, b"t1", P.BYE, next_step=2)
            for _ in range(3):
                d._check_ranks_gone()
            said = [r.getMessage() for r in caplog.records if "ranks_gone" in r.getMessage()]
            assert len(said) == 1 and "next_step=2 last_commit=-1" in said[0], said
            _trainer_says(d, b"t0b", P.HELLO, role="trainer", rank=0, world_size=2,
                          next_step=2, prefetch=2)
            _trainer_says(d, b"t0b", P.BYE, next_step=3)
            d._check_ranks_gone()  # a rank came back and left again: said again
        said = [r.getMessage() for r in caplog.records if "ranks_gone" in r.getMessage()]
        assert len(said) == 2
    finally:
        d._close()


def test_ranks_gone_names_the_step_after_the_last_commit_as_where_to_resume(caplog):
    """Probe: loops that left holding their committed step said that step, and the line read
    `next_step=2 last_commit=2` while the restore from that checkpoint resumes at step 3."""
    d = Dispatcher(_config(world_size=2))
    try:
        _fill_and_plan(d, 16)
        d.finished = lambda: False
        with caplog.at_level(logging.WARNING, logger="mmdispatch"):
            for rank in (0, 1):
                _trainer_says(d, b"t%d" % rank, P.HELLO, role="trainer", rank=rank, world_size=2,
                              next_step=None, prefetch=2)
                d.delivery.credit(d.slots[rank], 4, received=3)
                _trainer_says(d, b"t%d" % rank, P.COMMIT, step=2)
            for rank in (0, 1):
                _trainer_says(d, b"t%d" % rank, P.BYE, next_step=2)
            d._check_ranks_gone()
        (said,) = [r.getMessage() for r in caplog.records if "ranks_gone" in r.getMessage()]
        assert "next_step=3 last_commit=2" in said, said
    finally:
        d._close()


def test_a_done_job_waits_for_a_lost_rank_whose_own_last_commit_is_older(caplog):
    """Rank 1 committed step 1, then died; rank 0 committed step 3, the last, and said BYE. The
    job's checkpoint is step 1 (rank 1 has no later one), but the wait looked at the latest
    commit of any rank, 3, and the dispatcher exited 1.5 s after the loss: the job restored
    from its checkpoint found none to replay steps 2-3."""
    d = Dispatcher(_config(world_size=2))
    try:
        _plan_for_ranks(d, prefetch=2)
        _trainer_says(d, b"t1", P.COMMIT, step=1)
        _trainer_says(d, b"t0", P.COMMIT, step=1)
        _trainer_says(d, b"t0", P.COMMIT, step=3)
        assert d.replay.committed == 3
        d.delivery.slots[1].lost = True
        with caplog.at_level(logging.WARNING, logger="mmdispatch"):
            assert d._resumable_after_loss(100.0)
        (line,) = [r.getMessage() for r in caplog.records if "waiting_for_resume" in r.getMessage()]
        assert "steps=2-3" in line
        _trainer_says(d, b"t1", P.COMMIT, step=3)  # every rank has step 3: nothing to resume
        d._done_at = None
        assert not d._resumable_after_loss(100.0)
    finally:
        d._close()


def test_a_rank_that_never_joined_starts_at_the_first_step_after_a_dispatcher_restart(caplog):
    """Rank 0 took steps 0-3 while rank 1 was still starting; the dispatcher restarted from
    its journal, rank 0 came back at step 4 and committed step 3. Rank 1, starting without a
    position, was started at step 4 (where rank 0's rewind had moved every rank): steps 0-3
    were never trained by it, their samples lost for it and rank 0's steps without partner.
    Before the restart those steps waited for it; they still do, replayed from the journal."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        d = Dispatcher(_config(tmp, world_size=2))
        try:
            _fill_and_plan(d, 16)  # steps 0-3, journaled
            assert d.journal.last_step == 3
        finally:
            d._close()
        d = Dispatcher(_config(tmp, world_size=2))  # restarted: nothing committed
        caplog.set_level(logging.WARNING, logger="mmdispatch")
        try:
            s0, s1 = d.slots
            _trainer_says(d, b"t0", P.HELLO, role="trainer", rank=0, world_size=2, next_step=4,
                          prefetch=2)
            _trainer_says(d, b"t0", P.COMMIT, step=3)
            assert d.replay.committed == 3
            _trainer_says(d, b"t1", P.HELLO, role="trainer", rank=1, world_size=2,
                          next_step=None, prefetch=2)
            assert (s0.next_send, s1.next_send) == (4, 0)
            assert d.next_plan == 0  # the steps before 4 are planned again for it
            assert not [r for r in caplog.records
                        if "uncommitted_steps_not_served_again" in r.getMessage()]
            # A rank this dispatcher has heard from starts, without a position, where the
            # others are (its earlier process got the steps before): as before the restart.
            _trainer_says(d, b"t0b", P.HELLO, role="trainer", rank=0, world_size=2,
                          next_step=None, prefetch=2)
            assert s0.next_send == 0  # rank 1's restart start is held: they start together
        finally:
            d._close()


def test_a_reader_reconnecting_from_a_new_socket_replaces_its_earlier_session(caplog):
    """After the dispatcher stalled past the readers' timeout, each reader came back on a new
    socket and was counted twice until its old session timed out, then logged as left (a
    warning) while it was reading. The same process (HELLO `instance`) now replaces its earlier
    session at once; two processes that share a name stay two readers."""
    d = Dispatcher(_config()).start()
    peers = [_Peer(d.reader_endpoint) for _ in range(3)]
    try:
        with caplog.at_level(logging.INFO, logger="mmdispatch"):
            for peer, instance in zip(peers, ("a1", "a1", "b2")):
                peer.send(P.HELLO, role="reader", name="r", instance=instance)
                peer.expect(P.WELCOME)
        assert sorted(r.instance for r in d.pool.readers.values()) == ["a1", "b2"]
        assert d.metrics.registry.get_sample_value("mmdispatch_peers_connected",
                                                   {"role": "reader"}) == 2
        left = [r for r in caplog.records if "reader_left" in r.getMessage()]
        assert [(r.levelno, "why=reconnected" in r.getMessage()) for r in left] == [(logging.INFO, True)]
    finally:
        for peer in peers:
            peer.close()
        d.stop()


def test_a_trainer_of_another_world_size_is_told_both_ways_out():
    d = Dispatcher(_config()).start()
    peer = _Peer(d.trainer_endpoint)
    try:
        peer.send(P.HELLO, role="trainer", rank=0, world_size=3, next_step=None, prefetch=2)
        told = peer.expect(P.ERROR)
        assert told["code"] == "world_size"
        assert "launch 1 trainer rank, or" in told["message"] and "--world-size 3" in told["message"]
    finally:
        peer.close()
        d.stop()


# -- a shard one reader cannot open goes to another ---------------------------------------------
class _RawReader:
    """A reader speaking the protocol by hand: HELLO (with its process `instance`), then asks
    for `slots` shards; `assigned()` waits for the next SHARD_ASSIGN."""

    def __init__(self, endpoint: str, name: str, slots: int = 1) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.connect(endpoint)
        self.seq = 0
        self.send(P.HELLO, role="reader", name=name, instance=name)
        self.send(P.SHARD_REQUEST, shards=slots)

    def send(self, type_: str, **fields) -> None:
        self.seq += 1
        self.sock.send_multipart(P.encode(type_, seq=self.seq, **fields))

    def assigned(self, timeout: float = 5.0) -> P.Message | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sock.poll(50):
                msg = P.decode(self.sock.recv_multipart())
                if msg.type == P.SHARD_ASSIGN:
                    return msg
        return None

    def cannot_open(self, assign: P.Message) -> None:
        self.send(P.SHARD_DONE, assign_id=assign["assign_id"], count=0,
                  skipped=[["", "open_failed", -1]])

    def close(self) -> None:
        self.sock.close(linger=0)


def test_a_shard_one_reader_cannot_open_is_read_by_another(tmp_path):
    """A node missing a mount or a file (a partly synced copy) reported its shards open_failed,
    and the dispatcher skipped each whole, while other readers could read them: silent loss,
    the job exiting 0. The shard now goes to a reader that has not failed on it."""
    d = Dispatcher(_config(None))
    d.start()
    bad = _RawReader(d.reader_endpoint, "node-b")
    good = None
    try:
        first = bad.assigned()
        assert first is not None and first["shard"] == "/data/shard-0.tar"
        bad.cannot_open(first)
        good = _RawReader(d.reader_endpoint, "node-a")
        again = good.assigned()
        assert again is not None and again["shard"] == first["shard"], "the shard was not retried"
        assert again["start_index"] == 0
        bad.send(P.SHARD_REQUEST, shards=1)  # asks again: it is not given the shard it failed on
        assert bad.assigned(timeout=0.5) is None
        assert not d.skip_log.keys, "the shard was reported skipped while a reader could read it"
    finally:
        bad.close()
        if good is not None:
            good.close()
        d.stop()


@contextmanager
def _one_reader(monkeypatch, retry_s: float, **config) -> Iterator[tuple[Dispatcher, _RawReader]]:
    """A started dispatcher (OPEN_RETRY_S = `retry_s`) and one raw reader; both stopped after."""
    from dispatcher_server import server

    monkeypatch.setattr(server, "OPEN_RETRY_S", retry_s)
    d = Dispatcher(_config(**config))
    d.start()
    reader = _RawReader(d.reader_endpoint, "node-b")
    try:
        yield d, reader
    finally:
        reader.close()
        d.stop()


def test_a_shard_no_reader_can_open_is_skipped_after_a_wait(tmp_path, monkeypatch):
    """Every reader failing on a shard and none coming that can: OPEN_RETRY_S after the first
    failure it is tried once more, then skipped as open_failed (journaled, named), so the job
    goes on."""
    with _one_reader(monkeypatch, 0.5, tmp_path=tmp_path) as (d, bad):
        bad.cannot_open(bad.assigned())
        time.sleep(0.2)
        assert not d.skip_log.keys, "skipped before the wait for a reader that can open it"
        last = bad.assigned()  # once the wait is over, one last try (a file may have appeared)
        assert last is not None and last["shard"] == "/data/shard-0.tar"
        assert not d.skip_log.keys
        bad.cannot_open(last)
        K.wait_for(lambda: d.skip_log.keys, 5, "the unopenable shard skipped")
        assert [reason for _, reason in d.skip_log.keys] == ["open_failed"]


def test_a_shard_that_appears_during_the_wait_is_read_on_its_last_try(tmp_path, monkeypatch):
    """A reader that failed to open a shard was never offered it again, so a file that appeared
    during the wait (a late sync, a mount back) was skipped all the same, its samples lost."""
    with _one_reader(monkeypatch, 0.3, tmp_path=tmp_path) as (d, bad):
        bad.cannot_open(bad.assigned())
        last = bad.assigned()
        assert last is not None, "no last try"
        bad.send(P.SHARD_DONE, assign_id=last["assign_id"], count=0, skipped=[])  # read it now
        time.sleep(0.3)
        assert not d.skip_log.keys


def test_shards_failing_after_the_wait_wait_no_more(tmp_path, monkeypatch):
    """The wait is one for every shard no reader here can open: the ones further on, which
    enter the window only as earlier ones are settled, each waited its own 30 s, so a source
    with many missing shards stalled the job past the trainers' step timeout."""
    shards = [f"/data/shard-{i}.tar" for i in range(4)]
    with _one_reader(monkeypatch, 1.0, tmp_path=tmp_path, shards=shards) as (d, bad):
        t0 = time.monotonic()
        for _ in range(8):  # each shard: its first failure, then its last try's
            bad.cannot_open(bad.assigned())
        K.wait_for(lambda: len(d.skip_log.keys) == 4, 5, "every unopenable shard skipped")
        assert time.monotonic() - t0 < 3.0, "each shard waited its own OPEN_RETRY_S"


def test_a_restarted_dispatcher_keeps_the_open_failed_skips_its_journal_holds(tmp_path, monkeypatch):
    """A dispatcher restarted on its journal tried again the shards it had skipped as
    open_failed, waiting OPEN_RETRY_S for each once more (and a replay that then read one would
    differ from the steps trainers saw). The journaled decision now holds for the epoch it was
    made in; the next epoch tries the shard afresh."""
    shards = ["/data/shard-0.tar", "/data/shard-1.tar"]
    with _one_reader(monkeypatch, 0.2, tmp_path=tmp_path, shards=shards) as (d, bad):
        for _ in range(2):  # its first failure, then its last try's
            assign = bad.assigned()
            assert assign is not None and assign["pos"] == 0
            bad.cannot_open(assign)
        K.wait_for(lambda: d.skip_log.keys, 5, "the unopenable shard skipped")
        assert bad.assigned()["pos"] == 1  # held unread: the epoch goes on, no step planned
    with _one_reader(monkeypatch, 30.0, tmp_path=tmp_path, shards=shards) as (d, bad):
        first = bad.assigned()
        assert first is not None, "the restarted dispatcher assigned nothing"
        assert first["pos"] == 1, "the journaled skip was tried again"


def test_ranks_unheard_since_a_restart_count_as_finished_only_after_the_grace(caplog):
    """The job's last step committed (rank 0 had finished and said BYE to the dispatcher before
    a restart, and never comes back): a restarted dispatcher waited on its slot forever. It now
    counts it as finished after LOST_RANK_GRACE_S, not at once: the journal keeps only the
    latest commit of any rank, and rank 1 may be restored from an older checkpoint of its own,
    which the probe saw the dispatcher exit under when unheard ranks counted at once."""
    from dispatcher_server import server

    d = Dispatcher(_config(world_size=2))
    try:
        _fill_and_plan(d, 16)  # steps 0-3
        _trainer_says(d, b"t1", P.HELLO, role="trainer", rank=1, world_size=2, next_step=None, prefetch=2)
        _trainer_says(d, b"t1", P.COMMIT, step=3)
        d._started_at, d._unheard_said = 0.0, False
        assert d.replay.committed == d.next_plan - 1 == 3
        with caplog.at_level(logging.WARNING, logger="mmdispatch"):
            assert not d._finished_before(10.0)  # rank 0 may still come back
        (line,) = [r.getMessage() for r in caplog.records if "waiting_for_ranks" in r.getMessage()]
        assert "ranks=0" in line
        assert d._finished_before(server.LOST_RANK_GRACE_S + 1)
        assert not d._finished_before(None)  # no clock, no grace over
    finally:
        d._close()


# -- a restart under other plan settings plans the journaled steps anew ---------------------------
#: LLM tokens of the 32 samples (4 steps of 8, two ranks): uneven, so that an uncapped plan
#: crowds some (rank, micro-batch) past what a lowered capacity allows.
_SIZES = [5 + (7 * i) % 23 for i in range(32)]
_LOWERED = 40  # LLM tokens per (rank, micro-batch): above each step's mean of 4 slots, with room


def _settings_config(tmp_path, planner: PlannerConfig) -> ServerConfig:
    return _config(tmp_path, world_size=2, gb=8, planner=planner)


def _plan_all(d: Dispatcher) -> dict[int, tuple[list[str], object]]:
    """Feed the 32 samples and plan; step -> (its keys, its plan)."""
    reader, a = _with_reader(d)
    for start in range(0, len(_SIZES), 8):  # a step at a time, within the reader's credits
        d._on_samples(reader, _samples_msg(a.id, [_header(f"k{i}", i, llm=_SIZES[i])
                                                  for i in range(start, start + 8)]))
        d._pump()
    return {rs.step: (list(rs.batch.keys), rs.plan) for rs in d.retained}


def _fullest(plan) -> int:
    """The most LLM tokens one (rank, micro-batch) of `plan` holds."""
    import numpy as np

    W = plan.topology.world_size
    return int(np.bincount(plan.sample_mb * W + plan.sample_rank,
                           weights=plan.inputs.llm_len).max())


def _planned_anew_events(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if "event=journaled_steps_planned_anew" in r.getMessage()]


@pytest.mark.parametrize("changed, differs", [
    (PlannerConfig(num_microbatches=4), "num_microbatches: journal 2, now 4"),
    (PlannerConfig(num_microbatches=2, llm_capacity=_LOWERED),
     f"llm_capacity: journal None, now {_LOWERED}"),
])
def test_a_restart_under_other_plan_settings_plans_the_journaled_steps_anew(
        tmp_path, caplog, changed, differs):
    """Restarted with more micro-batches or a lower capacity (after running out of memory), the
    dispatcher replayed the journaled steps with their old plans, silently: 2 micro-batches,
    or micro-batches over the new capacity, until the first step past the journal. Now each is
    planned anew from the same samples under the settings in force, journaled under them (a
    third start replays those verbatim), and one line says so at start."""
    from dispatcher_server.planner import validate

    d = Dispatcher(_settings_config(tmp_path, PlannerConfig(num_microbatches=2)))
    try:
        before = _plan_all(d)
    finally:
        d._close()
    assert sorted(before) == [0, 1, 2, 3]
    if changed.llm_capacity is not None:  # the old plans break the new capacity
        assert max(_fullest(plan) for _, plan in before.values()) > _LOWERED
    caplog.set_level(logging.INFO, logger="mmdispatch")
    config = _settings_config(tmp_path, changed)
    d = Dispatcher(config)
    try:
        (said,) = _planned_anew_events(caplog)
        assert "from_step=0" in said and differs in said
        after = _plan_all(d)
        assert sorted(after) == sorted(before)
        for step, (keys, plan) in after.items():
            assert keys == before[step][0]  # the same samples, in the same order
            assert plan.num_microbatches == (changed.num_microbatches or 2)
            validate(plan, d.retained[step].batch.inputs)  # capacities held
            assert _fullest(plan) <= (changed.llm_capacity or _fullest(plan))
            entry = d.journal.read_entry(step)  # journaled under the settings in force
            assert entry.plan == plan.to_dict()
            assert d.journal.plan_settings[entry.settings] == config.plan_settings()
    finally:
        d._close()
    caplog.clear()
    d = Dispatcher(_settings_config(tmp_path, changed))
    try:
        assert not _planned_anew_events(caplog)
        again = _plan_all(d)
        assert {s: (k, p.to_dict()) for s, (k, p) in again.items()} == {
            s: (k, p.to_dict()) for s, (k, p) in after.items()}
    finally:
        d._close()


def test_a_restart_under_the_same_plan_settings_replays_the_journaled_plans_verbatim(
        tmp_path, caplog):
    planner = PlannerConfig(num_microbatches=2, llm_capacity=_LOWERED)
    d = Dispatcher(_settings_config(tmp_path, planner))
    try:
        before = _plan_all(d)
        journaled = {s: d.journal.read_entry(s).plan for s in before}
    finally:
        d._close()
    size = (tmp_path / "journal.mmd").stat().st_size
    caplog.set_level(logging.INFO, logger="mmdispatch")
    d = Dispatcher(_settings_config(tmp_path, planner))
    try:
        after = _plan_all(d)
        assert {s: p.to_dict() for s, (_, p) in after.items()} == journaled
        assert (tmp_path / "journal.mmd").stat().st_size == size  # replayed, not planned anew
        assert not _planned_anew_events(caplog)
    finally:
        d._close()


def test_a_rank_holding_steps_the_restart_plans_anew_is_refused_by_name(tmp_path):
    """A trainer that kept running through the restart holds the journal's plans of the steps
    before its next one; its peers would get those steps planned anew, and their collectives
    would pair two plans of one step. It is told to resume from its checkpoint instead."""
    d = Dispatcher(_settings_config(tmp_path, PlannerConfig(num_microbatches=2)))
    try:
        _plan_all(d)
    finally:
        d._close()
    d = Dispatcher(_settings_config(tmp_path, PlannerConfig(num_microbatches=4)))
    try:
        s0, s1 = d.slots
        _trainer_says(d, b"t0", P.HELLO, role="trainer", rank=0, world_size=2, next_step=2,
                      prefetch=2)
        assert s0.ident is None
        assert d.metrics.registry.get_sample_value("mmdispatch_errors_total",
                                                   {"kind": "resume"}) == 1
        # Restored from its checkpoint (or holding none of them), a rank is served.
        _trainer_says(d, b"t0", P.HELLO, role="trainer", rank=0, world_size=2, next_step=0,
                      prefetch=2, resume=True)
        _trainer_says(d, b"t1", P.HELLO, role="trainer", rank=1, world_size=2, next_step=0,
                      prefetch=2)
        assert (s0.ident, s1.ident) == (b"t0", b"t1")
    finally:
        d._close()


def test_buffered_bytes_count_what_each_item_holds_beside_its_payload():
    """Samples of 200 82-byte images held 9 times their payload bytes, and --max-buffered-bytes
    counted only the payload: memory grew past every bound the operator set."""
    from dispatcher_server.assembler import ITEM_HELD_BYTES

    a = _assembler()
    items = [P.ItemHeader("image", f"{j}.png", 16, 4, {"anchor": j}) for j in range(200)]
    headers = [P.SampleHeader(f"s{i}", i, 5, 5 + 4 * 200, P.blank_tokens(5), items) for i in range(3)]
    a.receive(0, headers, [memoryview(b"x" * 82)] * 600, [82] * 600)
    samples, nbytes = a.held()
    assert samples == 3
    assert nbytes >= 3 * 200 * (82 + ITEM_HELD_BYTES) >= 3 * 200 * 700  # what one item holds
    assert a.avg_sample_bytes == nbytes / 3


def _budget_run(caplog, sizes, *, budget, global_batch, world_size=3, microbatches=4):
    """The retained steps' sample counts and the budget's warnings, `sizes` (LLM tokens) planned
    under `budget` on `world_size` ranks x `microbatches`."""
    config = _config(planner=PlannerConfig(num_microbatches=microbatches), world_size=world_size)
    config.batch = BatchConfig(global_batch=global_batch, token_budget=budget)
    config.flow = FlowConfig(max_buffered_samples=10_000, num_inflight_shards=1, credit_batch=8,
                             max_retained_steps=1000)  # every step planned in one pump
    d = Dispatcher(config)
    try:
        reader, a = _with_reader(d)
        a.credits = max(a.credits, len(sizes))
        d._on_samples(reader, _samples_msg(a.id, [_header(f"t{i:03d}", i, llm=n)
                                                  for i, n in enumerate(sizes)]))
        with caplog.at_level(logging.WARNING, logger="mmdispatch"):
            d._pump()
        steps = [len(rs.batch.keys) for rs in d.delivery.retained]
    finally:
        d._close()
    said = {name: [r.getMessage() for r in caplog.records if f"event={name}" in r.getMessage()]
            for name in ("sample_over_token_budget", "empty_microbatches")}
    return steps, said


def test_the_token_budget_says_once_when_a_sample_exceeds_it_and_when_its_steps_leave_ranks_empty(
        caplog):
    """Probe repros: a sample over --token-budget became a step of its own, far over the budget,
    with no word; steps the budget cut to one sample left 3 of 4 micro-batches empty on every
    rank while serve's start-up check (of --global-batch only) advised a larger global batch,
    which changed nothing. Each is said once a run, with a fix that works."""
    sizes = [60, 60, 6000, 60, 60, 6000, 60] * 3
    steps, said = _budget_run(caplog, sizes, budget=100, global_batch=12)
    assert steps and set(steps) == {1}  # 60 + 60 > 100: one sample a step
    (over,) = said["sample_over_token_budget"]
    assert "key=t002 llm_tokens=6000 token_budget=100" in over
    (empty,) = said["empty_microbatches"]
    # Said once BUDGET_MEAN_STEPS steps are planned, from the samples planned so far.
    assert "step=0 samples=1" in empty and "--token-budget of at least about " in empty, empty


def _advised(line: str) -> int:
    return int(line.split("--token-budget of at least about ")[1].split()[0])


def test_the_token_budget_s_advice_followed_cuts_few_steps_and_is_said_once(caplog):
    """Probe: the budget advised (W x M samples at the mean) still cut about half the steps
    once followed, and the line that says 'said once' came back at every later cut step."""
    rng = random.Random(7)
    sizes = [int(rng.lognormvariate(6, 0.6)) + 1 for _ in range(400)]
    steps, said = _budget_run(caplog, sizes, budget=800, global_batch=4, world_size=2,
                              microbatches=2)
    assert sum(n < 4 for n in steps) > len(steps) // 2  # most steps cut...
    (line,) = said["empty_microbatches"]  # ... and said once
    budget = _advised(line)
    caplog.clear()
    steps, said = _budget_run(caplog, sizes, budget=budget, global_batch=4, world_size=2,
                              microbatches=2)
    assert len(steps) >= 90 and sum(n < 4 for n in steps[:-1]) <= len(steps) // 4, (budget, steps)
    assert len(said["empty_microbatches"]) <= 1


def test_the_token_budget_s_advice_is_a_budget_other_than_the_one_set(caplog):
    """Probe: with --token-budget 2356 the advice was 'a --token-budget of about 2356', from
    the cut step's own mean, which lacks the sample that did not fit; and with a global batch
    below W x M (which serve warns of at start) it was said a second time."""
    sizes = [500, 500, 1900] * 16
    steps, said = _budget_run(caplog, sizes, budget=2000, global_batch=4, world_size=2,
                              microbatches=2)
    assert steps[:2] == [2, 1]  # 500 + 500 + 1900 > 2000: cut at 2
    (empty,) = said["empty_microbatches"]  # 4 samples at their mean, 967 tokens, and more
    assert "step=0 samples=2" in empty and _advised(empty) > 3868, empty
    caplog.clear()
    # W x M samples hold the budget in most steps: only the rare steps of long ones are cut.
    steps, said = _budget_run(caplog, [1000, 1000, 150] + [100] * 61, budget=2200,
                              global_batch=4, world_size=2, microbatches=2)
    assert steps[0] == 3
    (empty,) = said["empty_microbatches"]
    assert "--token-budget above 2200 with room" in empty and "about" not in empty, empty
    caplog.clear()
    steps, said = _budget_run(caplog, sizes, budget=2000, global_batch=3, world_size=2,
                              microbatches=2)
    assert said["empty_microbatches"] == []  # below W x M: serve's start-up line says it


def test_no_reader_connected_is_said_once_an_outage(caplog):
    """Every reader killed: after their reader_left lines the dispatcher said nothing for as
    long as none came back, and the ranks only timed out waiting for steps (probe)."""
    d = Dispatcher(_config())
    try:
        with caplog.at_level(logging.WARNING, logger="mmdispatch"):
            for now in (100.0, 105.0, 110.5, 130.0):  # none ever connected: said once
                d._check_readers(now)
            reader = d.pool.join(b"r", "r", 131.0)
            d._check_readers(131.0)
            d._check_readers(200.0)  # connected: nothing to say
            d._drop_reader(reader, "timeout")
            for now in (201.0, 205.0, 211.5, 230.0):  # the next outage: said once again
                d._check_readers(now)
    finally:
        d._close()
    lines = [r.getMessage() for r in caplog.records if "event=no_readers" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "seconds=10" in lines[0] and f"endpoint={d.reader_endpoint}" in lines[0]
    assert "mmdispatch read --dispatcher" in lines[1]
