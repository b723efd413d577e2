"""`direct` payload mode: the dispatcher plans on references, trainers fetch the bytes from readers.

Held to inline mode's delivery (same steps, keys, text ids and byte-identical payloads), through
the cache and its miss path, across reader (killed or hung), dispatcher and trainer faults (the
fault runs of test_faults with `--payloads direct`, audited and compared with an undisturbed
inline run), under CurveZMQ, and refusing at start the shards it cannot read by offset.
"""

from __future__ import annotations

import queue
import shutil
import subprocess
import sys
import threading
import time

import pytest
import zmq

from dispatcher_server import protocol as P
from dispatcher_server.config import CurveConfig
from dispatcher_server.security import PeerCurve, create_keypair
from pipeline.payloads import PayloadCache, PayloadServer, advertised, bind_address
from pipeline.reader import iter_shard
from pipeline.service import FatalReaderError, ReaderServiceConfig, ReaderWorker
from tests import servicekit as K
from tests import test_faults as F
from tests.test_faults import corpus, keys, reference  # noqa: F401 - fixtures
from tests.test_reference_payloads import _contents, _deliver, _wait_for
from tests.test_service import consume, dispatcher, make_config, readers, shards  # noqa: F401
from trainer_client import fetch
from trainer_client.fetch import FetchConfig, FetchError, PayloadFetcher


# -- parts ------------------------------------------------------------------------------------
def test_step_holders_must_index_the_step_readers():
    def step(holders, readers):
        mb = {"arrays": [], "keys": [], "tokens": [], "items": [["image", "k", "jpg", {}]],
              "payloads": 1, "sizes": [1], "sources": b""}
        if holders is not None:
            mb[P.HOLDERS] = holders
        extra = {} if readers is None else {"readers": readers}
        return P.encode(P.STEP, frames=[b"x"], step=0, epoch=0, rank=0, world_size=1,
                        microbatches=[mb], **extra)

    msg = P.decode(step([0], [["tcp://h:1", ""]]))
    assert msg["readers"] == [P.ReaderEndpoint("tcp://h:1", "")]
    for holders, readers in (([1], [["tcp://h:1", ""]]), ([0], None), (None, [["tcp://h:1", ""]]),
                             ([0, 0], [["tcp://h:1", ""]]), ([0], [["tcp://h:1"]])):
        with pytest.raises(P.ProtocolError):
            P.decode(step(holders, readers))
    with pytest.raises(P.ProtocolError, match="sizes"):
        P.decode(P.encode(P.FETCH, frames=[b"abc"], id=1, sizes=[2]))
    for frames in ([b"ab", b"c"], [b"abc"]):  # one frame per item, or coalesced
        msg = P.decode(P.encode(P.PAYLOADS, frames=frames, id=1, sizes=[2, 1]))
        assert [bytes(v) for v in P.item_views(msg.frames, msg["sizes"])] == [b"ab", b"c"]
    for frames in ([b"a", b"bc"], [b"ab"], [b"a", b"b", b"c"]):
        with pytest.raises(P.ProtocolError):
            P.decode(P.encode(P.PAYLOADS, frames=frames, id=1, sizes=[2, 1]))


def test_cache_evicts_on_take_and_past_its_byte_cap():
    cache = PayloadCache(10)
    cache.put(b"a", b"1234")
    cache.put(b"b", b"5678")
    assert bytes(cache.take(b"a")) == b"1234" and cache.take(b"a") is None  # gone once fetched
    cache.put(b"c", b"901234")  # 10 bytes with b: fits
    cache.put(b"d", b"56")  # 12: the oldest (b) goes
    assert cache.take(b"b") is None and bytes(cache.take(b"c")) == b"901234"
    cache.put(b"e", b"x" * 11)  # larger than the cap: never held
    assert cache.take(b"e") is None and cache.nbytes == 2 and len(cache) == 1


def test_payload_endpoint_defaults():
    assert bind_address(None, "tcp://127.0.0.1:5555", 3) == "tcp://127.0.0.1:0"
    assert bind_address("tcp://0.0.0.0:7000", "tcp://127.0.0.1:5555", 2) == "tcp://0.0.0.0:7002"
    assert advertised("tcp://0.0.0.0:7002", None, "tcp://127.0.0.1:5555") == "tcp://127.0.0.1:7002"
    assert advertised("tcp://0.0.0.0:7002", "tcp://node7", "") == "tcp://node7:7002"
    assert advertised("tcp://10.1.2.3:7002", None, "") == "tcp://10.1.2.3:7002"


# -- delivery ---------------------------------------------------------------------------------
def test_direct_mode_delivers_exactly_what_inline_delivers(shards):
    runs, bytes_in = {}, {}
    for mode in ("inline", "direct"):
        with dispatcher(make_config(shards, payloads=mode)) as srv, \
                readers(srv.reader_endpoint, 2) as workers:
            runs[mode] = _deliver(srv.trainer_endpoint, 3)
            bytes_in[mode] = srv.metrics.bytes_in.labels("reader")._value.get()
            served = sum(w.payload_server.num_served for w in workers) if mode == "direct" else 0
    assert runs["direct"] == runs["inline"]  # same steps, keys, text ids and payload bytes
    payload = sum(len(b) for got in runs["inline"].values() for *_, enc in got
                  for items in enc.values() for _, _, b in items)
    items = sum(len(items) for got in runs["inline"].values() for *_, enc in got
                for items in enc.values())
    assert payload > 100_000 and served == items  # every item came from a reader's cache
    assert bytes_in["direct"] < bytes_in["inline"] - 0.9 * payload  # not through the dispatcher


def test_cache_misses_and_replays_read_the_shard_and_give_the_same_bytes(shards, tmp_path):
    """No cache at all (every fetch a miss), then trainers restarted from a checkpoint: the
    replayed steps, fetched again, are byte-identical to an undisturbed inline run's."""
    with dispatcher(make_config(shards, world_size=2)) as srv, readers(srv.reader_endpoint, 2):
        inline = consume(srv.trainer_endpoint, 2, record=_contents)
    cfg = make_config(shards, world_size=2, payloads="direct", journal_dir=str(tmp_path / "j"))
    with dispatcher(cfg) as srv, readers(srv.reader_endpoint, 2, payload_cache_mb=0) as workers:
        first = consume(srv.trainer_endpoint, 2, max_steps=4, commit_at=1, record=_contents)
        states = {r: {"next_step": 2, "rank": r, "world_size": 2} for r in range(2)}
        second = consume(srv.trainer_endpoint, 2, states=states, record=_contents)
        missed = sum(w.payload_server.num_missed for w in workers)
        hits = sum(w.payload_server.num_served for w in workers)
    assert hits == 0 and missed > 20
    for r in range(2):
        assert first[r] == inline[r][:4]
        assert second[r] == inline[r][2:]  # steps 2 and 3 replayed, fetched again


#: A payload endpoint nothing listens on: a reader that died.
DEAD = P.ReaderEndpoint("tcp://127.0.0.1:9", "")
QUICK_FETCH = FetchConfig(timeout_s=0.3, attempts=3, backoff_min_s=0.01, backoff_max_s=0.05,
                          outage_s=0.5)


def _step_held_by_the_dead(shard: str, holder: P.ReaderEndpoint = DEAD) -> tuple[bytes, P.Message]:
    """(a member's bytes, a one-item STEP whose holder of that member is `holder`)."""
    rec = next(r for r in iter_shard(shard, spans=True) if r.items)
    it = rec.items[0]
    ref = P.pack_ref(shard.encode(), *rec.spans[it.member])
    msg = P.decode(P.encode(P.STEP, frames=[ref], step=0, epoch=0, rank=0, world_size=1,
                            readers=[list(holder)], microbatches=[
                                {"arrays": [], "keys": [], "tokens": [], "payloads": 1,
                                 "items": [[it.modality, rec.key, it.member, {}]],
                                 "sizes": [len(ref)], "sources": b"", P.HOLDERS: [0]}]))
    return bytes(rec.members[it.member]), msg


def _payload_server(shard: str) -> PayloadServer:
    server = PayloadServer("tcp://127.0.0.1:0", cache=PayloadCache(1 << 20))
    server.servable = frozenset({shard.encode()})
    return server


@pytest.mark.timeout(60)
def test_closing_a_fetcher_whose_thread_is_busy_leaves_its_sockets_to_it(shards, monkeypatch):
    """CI: a client closing while its fetch thread was still inside a ZeroMQ call (past the
    10 s join) closed that thread's sockets under it, and libzmq aborted the whole process.
    The sockets belong to the fetch thread: it closes them as it leaves."""
    from trainer_client import fetch

    monkeypatch.setattr(fetch, "CLOSE_WAIT_S", 0.2)
    member, msg = _step_held_by_the_dead(shards[0])
    server = _payload_server(shards[0])
    inside, leave = threading.Event(), threading.Event()

    def decode(m, fetched):  # the thread busy past close()'s wait, its sockets open
        inside.set()
        leave.wait(20)
        return fetched

    fetcher = PayloadFetcher(decode=decode, out=queue.Queue(), config=QUICK_FETCH)
    try:
        fetcher.readers = [P.ReaderEndpoint(server.endpoint, "")]
        fetcher.put(msg)
        assert inside.wait(20)
        socks = list(fetcher._socks.values())
        assert socks
        fetcher.close()  # returns with the thread still busy: its sockets untouched
        assert not any(sock.closed for sock in socks)
        leave.set()
        fetcher._thread.join(20)
        assert all(sock.closed for sock in socks)  # closed by the thread as it left
    finally:
        leave.set()
        server.close()


def test_a_dead_holder_is_replaced_by_another_reader(shards):
    """A reference fetched from a reader that does not answer is served by another one from its
    shard file; with no reader left the step fails with one error naming shard and readers."""
    member, msg = _step_held_by_the_dead(shards[0])
    server = _payload_server(shards[0])
    fetcher = PayloadFetcher(decode=lambda m, f: f, out=queue.Queue(), config=QUICK_FETCH)
    try:
        fetcher.readers = [P.ReaderEndpoint(server.endpoint, "")]
        (views,) = fetcher.fetch(msg)
        assert bytes(views[0]) == member and server.num_missed == 1
        fetcher.readers = []
        with pytest.raises(FetchError, match=f"{shards[0]}.*{DEAD.endpoint}"):
            fetcher.fetch(msg)
    finally:
        fetcher.close()
        server.close()


def test_a_reader_timing_out_with_two_requests_pending_fails_both_over(tmp_path):
    """Request A waits on a silent reader X; B, refused by W, is retried at X. A's timeout
    dropped X's socket under B, and the next poll raised a bare KeyError out of the training
    loop. Every request pending on a reader given up on is asked elsewhere now: here, with no
    reader left that serves it, the step fails with the FetchError naming shard and readers."""
    from trainer_client.fetch import _Request

    ctx = zmq.Context.instance()
    silent, refusing = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    x = P.ReaderEndpoint(f"tcp://127.0.0.1:{silent.bind_to_random_port('tcp://127.0.0.1')}", "")
    w = P.ReaderEndpoint(f"tcp://127.0.0.1:{refusing.bind_to_random_port('tcp://127.0.0.1')}", "")
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if silent.poll(20):
                silent.recv_multipart()  # taken, never answered: a SIGSTOPped reader
            if refusing.poll(20):
                ident, *frames = refusing.recv_multipart()
                refusing.send_multipart([ident, *P.encode(P.ERROR, code="fetch", message="cannot "
                                                          "read it back", ack=P.decode(frames)["id"])])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    fetcher = PayloadFetcher(decode=lambda m, f: f, out=queue.Queue(),
                             config=FetchConfig(timeout_s=1.0, attempts=4, backoff_min_s=0.1))
    ref = memoryview(P.pack_ref(str(tmp_path / "shard.tar").encode(), 0, 10))
    try:
        fetcher.readers = [x, w]
        with pytest.raises(FetchError, match=f"shard.tar.*{x.endpoint}: no answer"):
            fetcher._complete([_Request(places=[(0, 0)], refs=[ref], endpoint=x),
                               _Request(places=[(0, 1)], refs=[ref], endpoint=w)])
    finally:
        stop.set()
        thread.join(5)
        fetcher.close()
        silent.close(linger=0)
        refusing.close(linger=0)


def test_a_fetch_waits_out_a_time_with_no_live_reader(shards):
    """Every reader gone (one reader, restarted): the retries went to the dead endpoint and the
    step failed after `attempts` tries, about 20 s with the defaults, killing every trainer;
    the other payload modes wait for the new reader. A retry now waits for a live one."""
    member, msg = _step_held_by_the_dead(shards[0])
    server = _payload_server(shards[0])
    config = FetchConfig(timeout_s=0.3, attempts=2, backoff_min_s=0.01, backoff_max_s=0.05,
                         outage_s=30)
    fetcher = PayloadFetcher(decode=lambda m, f: f, out=queue.Queue(), config=config)
    got: list = []
    try:
        fetcher.readers = []
        worker = threading.Thread(target=lambda: got.append(fetcher.fetch(msg)), daemon=True)
        worker.start()
        time.sleep(1.5)  # five timeouts: the attempts alone would have failed the step
        assert worker.is_alive() and not got
        fetcher.readers = [P.ReaderEndpoint(server.endpoint, "")]  # the replacement is listed
        worker.join(10)
        assert got and bytes(got[0][0][0]) == member
    finally:
        fetcher.close()
        server.close()


def test_a_silent_holder_is_waited_on_once_then_asked_last(shards, monkeypatch):
    """A reader killed before the dispatcher noticed is still in the live table and still the
    holder the steps name: the first request to it waits out the timeout, the steps after go
    straight to another reader, until the mark expires (a reader restarted at the same endpoint
    is its own holders' first choice again). Once the table drops it, no fetcher waits on it."""
    member, msg = _step_held_by_the_dead(shards[0])
    server = _payload_server(shards[0])
    live = P.ReaderEndpoint(server.endpoint, "")
    fetchers = [PayloadFetcher(decode=lambda m, f: f, out=queue.Queue(), config=QUICK_FETCH)
                for _ in range(2)]
    try:
        first, second = fetchers
        first.readers = [DEAD, live]  # the dispatcher has not noticed the death yet
        for step in range(4):
            (views,) = first.fetch(msg)
            assert bytes(views[0]) == member
            assert first.num_retries == 1, f"step {step} waited on the silent holder again"
        monkeypatch.setattr(fetch, "SILENT_TIMEOUTS", 0)  # the mark has expired
        first.fetch(msg)
        assert first.num_retries == 2
        second.readers = [live]  # it has: the dead holder is not asked at all
        second.fetch(msg)
        assert second.num_retries == 0
    finally:
        for f in fetchers:
            f.close()
        server.close()


def test_payload_socket_serves_only_the_job_shards(shards, tmp_path):
    """Requests for other files, impossible ranges or garbage get an ERROR; serving goes on."""
    other = tmp_path / "secret.tar"
    other.write_bytes(b"not training data" * 64)
    rec = next(r for r in iter_shard(shards[0], spans=True) if r.items)
    good = P.pack_ref(shards[0].encode(), *rec.spans[rec.items[0].member])
    server = PayloadServer("tcp://127.0.0.1:0", cache=PayloadCache(1 << 20))
    server.servable = frozenset({shards[0].encode()})
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 5000)  # a hang fails the test instead
    sock.connect(server.endpoint)
    try:
        for i, ref in enumerate((P.pack_ref(str(other).encode(), 0, 17),
                                 P.pack_ref(shards[0].encode(), 0, 1 << 40),
                                 P.pack_ref(shards[0].encode(), 1 << 63, 1))):
            sock.send_multipart(P.encode(P.FETCH, frames=[ref], id=i, sizes=[len(ref)]))
            reply = P.decode(sock.recv_multipart())
            assert reply.type == P.ERROR and reply["ack"] == i and reply["code"] == "fetch"
        sock.send_multipart([b"garbage"])
        assert P.decode(sock.recv_multipart()).type == P.ERROR
        sock.send_multipart(P.encode(P.FETCH, frames=[good], id=9, sizes=[len(good)]))
        reply = P.decode(sock.recv_multipart())
        assert reply.type == P.PAYLOADS and bytes(reply.frames[0]) == bytes(rec.members[rec.items[0].member])
    finally:
        sock.close(linger=0)
        server.close()


def _deaf_and_reader(tmp_path, size: int) -> tuple:
    """(member, its reference, a payload server of the one-member shard holding it, a client
    that reads nothing (a receive queue of one, a 4 KiB socket buffer), a client that reads)."""
    import io
    import os
    import tarfile

    member = os.urandom(size)
    shard = tmp_path / "big.tar"
    with tarfile.open(shard, "w") as tar:
        info = tarfile.TarInfo("k.bin")
        info.size = len(member)
        tar.addfile(info, io.BytesIO(member))
    with tarfile.open(shard) as tar:
        info = tar.getmember("k.bin")
    ref = P.pack_ref(str(shard).encode(), info.offset_data, info.size)
    ctx = zmq.Context.instance()
    deaf, reader = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    deaf.setsockopt(zmq.RCVHWM, 1)
    deaf.setsockopt(zmq.RCVBUF, 4096)
    return member, ref, _payload_server(str(shard)), deaf, reader


def test_a_client_that_reads_no_reply_holds_a_bounded_number_of_them(tmp_path):
    """A client asking a reader again and again and reading nothing: every reply stayed queued
    (1.2 GB after four requests naming one shard 1,500 times). A request naming a reference
    twice is refused now, replies queued to one client stop at REPLY_HWM (the rest are
    dropped), and a client that reads is served meanwhile."""
    from pipeline.payloads import REPLY_HWM

    member, ref, server, deaf, reader = _deaf_and_reader(tmp_path, 1 << 20)
    reader.setsockopt(zmq.RCVTIMEO, 10_000)  # a hang fails the test instead
    try:
        deaf.connect(server.endpoint)
        reader.connect(server.endpoint)
        reader.send_multipart(P.encode(P.FETCH, frames=[ref + ref], id=1, sizes=[len(ref)] * 2))
        reply = P.decode(reader.recv_multipart())
        assert reply.type == P.ERROR and "more than once" in reply["message"]
        for i in range(40):
            deaf.send_multipart(P.encode(P.FETCH, frames=[ref], id=i, sizes=[len(ref)]))
        deadline = time.monotonic() + 30
        while server.num_dropped == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.num_dropped > 0
        time.sleep(0.5)
        # REPLY_HWM replies in its queue, and what the kernel's socket buffers took
        assert sum(server.held_bytes().values()) <= (REPLY_HWM + 4) * len(member) < 40 * len(member)
        reader.send_multipart(P.encode(P.FETCH, frames=[ref], id=2, sizes=[len(ref)]))
        reply = P.decode(reader.recv_multipart())
        assert reply.type == P.PAYLOADS and reply["id"] == 2 and bytes(reply.frames[0]) == member
    finally:
        deaf.close(linger=0)
        reader.close(linger=0)
        server.close()


def test_reply_bytes_past_the_bound_wait_but_a_client_holding_none_is_served(tmp_path, monkeypatch):
    """Past MAX_REPLY_BYTES held (read back, or queued to clients), a client already holding
    replies waits its turn; one holding none is served at once: a client that stopped reading
    (a frozen trainer) kept every other trainer waiting while its queued reply held the bytes."""
    from pipeline import payloads

    size = 8 << 20  # past what loopback's socket buffers take in
    monkeypatch.setattr(payloads, "MAX_REPLY_BYTES", size * 3 // 2)
    member, ref, server, deaf, reader = _deaf_and_reader(tmp_path, size)
    reader.setsockopt(zmq.RCVTIMEO, 20_000)  # a hang fails the test instead
    try:
        deaf.connect(server.endpoint)
        reader.connect(server.endpoint)
        for i in range(3):
            deaf.send_multipart(P.encode(P.FETCH, frames=[ref], id=i, sizes=[len(ref)]))
        # Its ZeroMQ takes the first reply in whole (a queue of one), the second is held and
        # the third waits; between the first and the second nothing is held, for a moment.
        deadline = time.monotonic() + 20
        while not (server._waiting and sum(server.held_bytes().values()) >= len(member)) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server._waiting
        assert len(member) <= sum(server.held_bytes().values()) <= payloads.MAX_REPLY_BYTES
        for request in (7, 8):  # served at once, each time: this client holds nothing
            reader.send_multipart(P.encode(P.FETCH, frames=[ref], id=request, sizes=[len(ref)]))
            reply = P.decode(reader.recv_multipart())
            assert reply.type == P.PAYLOADS and reply["id"] == request
            assert bytes(reply.frames[0]) == member
        assert server._waiting
        deaf.close(linger=0)  # its queue goes, and the bytes with it: its waiting requests go
        deadline = time.monotonic() + 20
        while server._waiting and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not server._waiting
    finally:
        deaf.close(linger=0)
        reader.close(linger=0)
        server.close()


def test_dispatcher_tells_trainers_the_live_readers_and_gives_none_a_shard_without_an_endpoint(shards):
    """A reader's endpoint reaches connected trainers (READERS) when it asks for shards, and leaves
    the table when it goes; a reader that names no endpoint gets an ERROR and no shard."""
    cfg = make_config(shards, world_size=1, payloads="direct")
    ctx = zmq.Context.instance()
    with dispatcher(cfg) as srv:
        trainer, reader = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        try:
            trainer.connect(srv.trainer_endpoint)
            trainer.send_multipart(P.encode(P.HELLO, seq=1, role="trainer", rank=0, world_size=1))
            welcome = _wait_for(trainer, P.WELCOME)
            assert welcome["payloads"] == "direct" and welcome["readers"] == []
            reader.connect(srv.reader_endpoint)
            reader.send_multipart(P.encode(P.HELLO, seq=1, role="reader", name="r"))
            assert _wait_for(reader, P.WELCOME)["shards"] == [str(s) for s in shards]
            reader.send_multipart(P.encode(P.SHARD_REQUEST, seq=2))
            assert _wait_for(reader, P.ERROR)["code"] == "payloads"
            reader.send_multipart(P.encode(P.SHARD_REQUEST, seq=3, payload_endpoint="tcp://h:7"))
            assert _wait_for(reader, P.SHARD_ASSIGN)["start_index"] == 0
            table = _wait_for(trainer, P.READERS)["readers"]
            assert table == [P.ReaderEndpoint("tcp://h:7", "")]
            reader.send_multipart(P.encode(P.BYE, seq=4))
            assert _wait_for(trainer, P.READERS)["readers"] == []
        finally:
            trainer.close(linger=0)
            reader.close(linger=0)


# -- faults, as in test_faults, with direct payloads ------------------------------------------
@pytest.fixture
def direct(monkeypatch, reference):  # noqa: F811 - the undisturbed run is inline, made first
    monkeypatch.setattr(K, "FLOW", [*K.FLOW, "--payloads", "direct"])


@pytest.mark.timeout(180)
def test_reader_sigkill_mid_shard(direct, corpus, keys, reference, tmp_path):  # noqa: F811
    F.test_reader_sigkill_mid_shard(corpus, keys, reference, tmp_path)
    assert "event=reader_payloads" in (tmp_path / "serve.log").read_text()


@pytest.mark.timeout(180)
def test_dispatcher_sigkill_restarts_from_journal(direct, corpus, keys, reference, tmp_path):  # noqa: F811
    F.test_dispatcher_sigkill_mid_step_restarts_from_journal(corpus, keys, reference, tmp_path)
    assert "event=reader_payloads" in (tmp_path / "serve.log").read_text()


@pytest.mark.timeout(180)
def test_trainer_killed_and_restarted_from_checkpoint(direct, corpus, keys, reference, tmp_path):  # noqa: F811
    F.test_trainer_process_killed_and_restarted_from_its_checkpoint(corpus, keys, reference, tmp_path)
    assert "event=reader_payloads" in (tmp_path / "serve.log").read_text()


@pytest.mark.timeout(180)
def test_hung_reader_times_out_and_others_serve_its_payloads(direct, corpus, keys, reference,  # noqa: F811
                                                             tmp_path):
    F.test_hung_reader_is_detected_and_its_shard_reassigned(corpus, keys, reference, tmp_path)


# -- CurveZMQ ---------------------------------------------------------------------------------
def test_curve_payload_sockets_refuse_trainers_without_the_right_keys(shards, tmp_path):
    keys_dir, allowed, readers_allow = tmp_path / "keys", tmp_path / "allowed", tmp_path / "ra"
    allowed.mkdir()
    readers_allow.mkdir()
    for name in ("server", "reader", "trainer", "outsider"):
        create_keypair(str(keys_dir), name)
    for name in ("reader", "trainer", "outsider"):  # the dispatcher admits all three...
        shutil.copy(keys_dir / f"{name}.key", allowed)
    shutil.copy(keys_dir / "trainer.key", readers_allow)  # ...the readers' payloads only one
    server_public = str(keys_dir / "server.key")
    curve = CurveConfig(server_secret_file=str(keys_dir / "server.key_secret"),
                        allowed_keys_dir=str(allowed))
    cfg = make_config(shards, world_size=1, curve=curve, max_steps=2, payloads="direct",
                      journal_dir=str(tmp_path / "journal"))

    def trainer(name: str, **kw) -> dict:
        return consume(srv.trainer_endpoint, 1, secret_file=str(keys_dir / f"{name}.key_secret"),
                       server_public_file=server_public, record=_contents, **kw)

    with dispatcher(cfg) as srv, readers(srv.reader_endpoint, 1,
                                         secret_file=str(keys_dir / "reader.key_secret"),
                                         server_public_file=server_public,
                                         allowed_dir=str(readers_allow)) as (worker,):
        got = trainer("trainer")
        assert worker.payload_server.public_key  # a CURVE server, its key in the table
        assert sum(len(b) for step in got[0] for *_, enc in step for items in enc.values()
                   for *_, b in items) > 0
        with pytest.raises(FetchError, match="could not be fetched"):
            trainer("outsider", fetch_timeout_s=0.3, fetch_attempts=2,
                    states={0: {"next_step": 0, "rank": 0, "world_size": 1}})
        # A plaintext client on the payload socket hears nothing either.
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(worker.payload_server.endpoint)
        ref = P.pack_ref(shards[0].encode(), 0, 10)
        sock.send_multipart(P.encode(P.FETCH, frames=[ref], id=1, sizes=[len(ref)]))
        assert not sock.poll(500)
        sock.close(linger=0)


def test_curve_client_needs_a_key_pair_for_a_keyed_reader():
    fetcher = PayloadFetcher(decode=lambda m, f: f, out=queue.Queue(), curve=None)
    try:
        with pytest.raises(FetchError, match="requires CurveZMQ"):
            fetcher._socket(P.ReaderEndpoint("tcp://127.0.0.1:9", "x" * 40))
    finally:
        fetcher.close()
    assert PeerCurve.from_files(None, None) is None


# -- refusals ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["shard.tgz", "pipe:cat shard.tar"])
def test_serve_refuses_shards_direct_mode_cannot_read_by_offset(shards, tmp_path, bad):
    if bad.endswith(".tgz"):
        (tmp_path / bad).write_bytes(b"")
        bad = str(tmp_path / bad)
    proc = subprocess.run([sys.executable, "-m", "mmdispatch.cli", "serve", "--shards", bad,
                           "--world-size", "1", "--global-batch", "4", "--payloads", "direct"],
                          capture_output=True, text=True, timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "--payloads direct" in lines[0] and bad in lines[0] and "--payloads inline" in lines[0]


def test_datanode_preprocessing_is_refused_with_direct_payloads(shards):
    with dispatcher(make_config(shards, world_size=1, payloads="direct")) as srv:
        worker = ReaderWorker(ReaderServiceConfig(dispatcher=srv.reader_endpoint, timeout_s=1.5,
                                                  connect_timeout_s=10, preprocess_on="datanode"))
        with pytest.raises(FatalReaderError, match="--payloads direct.*--preprocess-on datanode"):
            worker.run()
        assert worker.payload_server is None  # refused before opening a port


def test_a_payload_allowed_dir_that_cannot_take_effect_is_refused_not_dropped(tmp_path):
    """A security option is never ignored in silence: without CurveZMQ the payload socket
    checks no key, and a directory that is not there allows nobody it names."""
    with pytest.raises(ValueError, match="needs --curve-secret"):
        ReaderServiceConfig(dispatcher="tcp://127.0.0.1:9", allowed_dir=str(tmp_path))
    with pytest.raises(ValueError, match="is not a directory"):
        ReaderServiceConfig(dispatcher="tcp://127.0.0.1:9", secret_file="r.key_secret",
                            allowed_dir=str(tmp_path / "missing"))
    out = subprocess.run([sys.executable, "-m", "mmdispatch.cli", "read", "--dispatcher",
                          "tcp://127.0.0.1:9", "--payload-allowed-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("mmdispatch read: error: --payload-allowed-dir")


def test_direct_only_options_under_another_payload_mode_are_warned_once(caplog, monkeypatch):
    """`read --payload-bind` against a dispatcher serving --payloads inline binds nothing: said
    once (the mode is the dispatcher's, known at WELCOME; a reconnect says nothing more)."""
    worker = ReaderWorker(ReaderServiceConfig(dispatcher="tcp://127.0.0.1:9",
                                              payload_bind="tcp://127.0.0.1:7000"))
    monkeypatch.setattr(worker, "_request_shards", lambda: None)
    with caplog.at_level("WARNING", logger="mmdispatch"):
        worker.on_welcome(None, {"payloads": "inline"})
        worker.on_welcome(None, {"payloads": "inline"})
    assert caplog.text.count("event=options_unused") == 1, caplog.text
    assert "options=--payload-bind" in caplog.text and "payloads=inline" in caplog.text
    plain = ReaderWorker(ReaderServiceConfig(dispatcher="tcp://127.0.0.1:9"))
    monkeypatch.setattr(plain, "_request_shards", lambda: None)
    caplog.clear()
    with caplog.at_level("WARNING", logger="mmdispatch"):
        plain.on_welcome(None, {"payloads": "reference"})
    assert "options_unused" not in caplog.text


# -- endpoints trainers cannot reach ----------------------------------------------------------
def _read_args(*argv: str):
    import argparse

    from pipeline.service import add_arguments
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--dispatcher", "tcp://127.0.0.1:9", *argv])


@pytest.mark.parametrize("flag, value, says", [
    ("--payload-advertise", "tcp://*:7555", "every interface"),
    ("--payload-advertise", "tcp://0.0.0.0", "every interface"),
    ("--payload-advertise", "tcp://[::]:7555", "every interface"),
    ("--payload-advertise", "tcp://127.0.0.1:0", "port 0"),
    ("--payload-advertise", "tcp://no such host", "no host name"),
    ("--payload-bind", "tcp://127.0.0.1", "no port"),
    ("--payload-bind", "tcp://127.0.0.1:abc", "is no number"),
])
def test_payload_endpoints_no_trainer_can_use_are_refused_at_parse_time(flag, value, says):
    from pipeline.service import config_from_args

    with pytest.raises(ValueError, match=says) as e:
        config_from_args(_read_args(flag, value))
    assert value in str(e.value) and flag in str(e.value) and "\n" not in str(e.value)
    if flag == "--payload-advertise":  # and where the server is built without the CLI
        with pytest.raises(ValueError, match=says):
            advertised("tcp://0.0.0.0:7555", value, "")


def test_a_wildcard_payload_advertise_is_one_line_from_the_cli():
    out = subprocess.run([sys.executable, "-m", "mmdispatch.cli", "read", "--dispatcher",
                          "tcp://127.0.0.1:9", "--payload-advertise", "tcp://*:7555"],
                         capture_output=True, text=True, timeout=60)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "--payload-advertise 'tcp://*:7555'" in lines[-1]


def test_advertised_port_zero_is_not_taken_for_no_port():
    assert advertised("tcp://0.0.0.0:7002", "tcp://node7:7100", "") == "tcp://node7:7100"
    with pytest.raises(ValueError, match="port 0"):
        advertised("tcp://0.0.0.0:7002", "tcp://node7:0", "")


def test_each_worker_advertises_the_port_it_binds(shards):
    """`read --workers 2 --payload-bind tcp://127.0.0.1:P --payload-advertise tcp://127.0.0.1:P`:
    worker 1 binds P + 1 and must advertise P + 1, not worker 0's P."""
    from pipeline.service import config_from_args

    port = K.free_port()
    while port + 1 > 65535:
        port = K.free_port()
    with dispatcher(make_config(shards, world_size=1, payloads="direct")) as srv:
        args = _read_args("--workers", "2", "--payload-bind", f"tcp://127.0.0.1:{port}",
                          "--payload-advertise", f"tcp://127.0.0.1:{port}")
        args.dispatcher = srv.reader_endpoint
        configs = [config_from_args(args, w) for w in range(2)]
        assert [c.payload_advertise for c in configs] == [f"tcp://127.0.0.1:{port + w}"
                                                          for w in range(2)]
        stop = threading.Event()
        workers = [ReaderWorker(c) for c in configs]
        threads = [threading.Thread(target=w.run, args=(stop,), daemon=True) for w in workers]
        for t in threads:
            t.start()
        try:
            deadline = time.monotonic() + 20
            while any(w.payload_server is None for w in workers) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert [w.payload_server.endpoint for w in workers] == [
                f"tcp://127.0.0.1:{port + w}" for w in range(2)]
        finally:
            stop.set()
            for t in threads:
                t.join(10)


def test_a_reader_endpoint_zeromq_cannot_connect_to_is_an_unreachable_reader(shards, caplog):
    """A reader advertising tcp://*:7555 made ZeroMQ's connect raise in the fetch thread: every
    trainer died with a raw ZMQError while other readers were healthy. It is now asked last, like
    a silent reader, said once in the log, and the step fails naming it only if nobody else serves."""
    bad = P.ReaderEndpoint("tcp://*:7555", "")
    member, msg = _step_held_by_the_dead(shards[0], bad)
    server = _payload_server(shards[0])
    fetcher = PayloadFetcher(decode=lambda m, f: f, out=queue.Queue(), config=QUICK_FETCH)
    try:
        fetcher.readers = [bad, P.ReaderEndpoint(server.endpoint, "")]
        with caplog.at_level("WARNING", logger="mmdispatch"):
            for _ in range(3):
                (views,) = fetcher.fetch(msg)
                assert bytes(views[0]) == member
        assert caplog.text.count("event=reader_unreachable") == 1, caplog.text
        assert "endpoint=tcp://*:7555" in caplog.text and "--payload-advertise" in caplog.text
        fetcher.readers = [bad]
        with pytest.raises(FetchError, match=r"tcp://\*:7555: cannot connect"):
            fetcher.fetch(msg)
    finally:
        fetcher.close()
        server.close()


def test_a_silent_reader_is_warned_about_once(shards, caplog):
    member, msg = _step_held_by_the_dead(shards[0])
    server = _payload_server(shards[0])
    fetcher = PayloadFetcher(decode=lambda m, f: f, out=queue.Queue(), config=QUICK_FETCH)
    try:
        fetcher.readers = [DEAD, P.ReaderEndpoint(server.endpoint, "")]
        with caplog.at_level("WARNING", logger="mmdispatch"):
            for _ in range(2):
                fetcher._silent.clear()  # the mark expired: the dead holder is asked first again
                fetcher.fetch(msg)
        assert fetcher.num_retries == 2
        assert caplog.text.count("event=reader_unreachable") == 1, caplog.text
        assert f"endpoint={DEAD.endpoint}" in caplog.text and "firewall" in caplog.text
    finally:
        fetcher.close()
        server.close()


# -- allow-lists ------------------------------------------------------------------------------
def test_a_bad_key_file_in_an_allow_list_is_refused_at_start(tmp_path):
    """pyzmq's authenticator logs an error for one unreadable NAME.key and configures none of the
    directory: every allowed peer was refused, with a fix that sent the user to copy keys."""
    from dispatcher_server.security import start_authenticator

    keys_dir, allowed = tmp_path / "keys", tmp_path / "allowed"
    allowed.mkdir()
    create_keypair(str(keys_dir), "reader")
    create_keypair(str(keys_dir), "trainer")
    shutil.copy(keys_dir / "trainer.key", allowed)
    (allowed / "notes.key").write_text("not a key\n")
    ctx = zmq.Context()
    try:
        with pytest.raises(ValueError, match="notes.key"):
            start_authenticator(ctx, str(allowed), allow_list="--payload-allowed-dir")
    finally:
        ctx.term()
    with pytest.raises(ValueError, match="--payload-allowed-dir.*notes.key.*keygen"):
        ReaderServiceConfig(dispatcher="tcp://127.0.0.1:9", secret_file=str(keys_dir / "reader.key_secret"),
                            allowed_dir=str(allowed))
    out = subprocess.run([sys.executable, "-m", "mmdispatch.cli", "serve", "--shards", "x.tar",
                          "--world-size", "1", "--global-batch", "4",
                          "--curve-secret", str(keys_dir / "reader.key_secret"),
                          "--curve-allowed-dir", str(allowed)],
                         capture_output=True, text=True, timeout=60)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "--curve-allowed-dir" in lines[0] and "notes.key" in lines[0]


def test_a_curve_reader_without_an_allowed_dir_is_told_just_that(tmp_path):
    """The reason was wrapped in 'cannot serve payloads at an ephemeral port ... (see
    --payload-bind)': neither the port nor --payload-bind has anything to do with it."""
    for name in ("reader", "server"):
        create_keypair(str(tmp_path), name)
    worker = ReaderWorker(ReaderServiceConfig(dispatcher="tcp://127.0.0.1:9",
                                              secret_file=str(tmp_path / "reader.key_secret"),
                                              server_public_file=str(tmp_path / "server.key")))
    with pytest.raises(FatalReaderError) as e:
        worker._serve_payloads([])
    assert "--payload-allowed-dir" in str(e.value)
    assert "ephemeral" not in str(e.value) and "--payload-bind" not in str(e.value)
