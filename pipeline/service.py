"""Run a data-node reader: ask the dispatcher for shards, stream counted samples within credits.

Each worker is one DEALER peer reading one shard at a time, with `prefetch_shards` more assigned
and queued behind it so the next one starts without a round trip; it reads only as many samples
as the dispatcher granted, so a data node never races ahead of the trainers. Workers reconnect with
backoff when the dispatcher goes silent and say HELLO again; the dispatcher decides where each
shard (re)starts, so a worker keeps no state worth saving.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import signal
import threading
import time
from dataclasses import dataclass, field

import zmq
import zmq.auth

from dispatcher_server import protocol as P
from dispatcher_server.tuning import keep_freed_memory, relax_gc
from pipeline.errors import ErrorStats
from pipeline.reader import ReaderConfig, add_reader_arguments, iter_shard, reader_config_from_args
from pipeline.records import SampleRecord

log = logging.getLogger("mmdispatch.reader")


@dataclass(kw_only=True, slots=True)
class ReaderServiceConfig:
    dispatcher: str  # tcp://HOST:PORT of the dispatcher's reader endpoint
    name: str = ""
    reader: ReaderConfig = field(default_factory=ReaderConfig)
    batch: int = 32  # most samples per SAMPLES message
    prefetch_shards: int = 1  # shards held assigned beyond the one being read
    timeout_s: float = 5.0  # dispatcher silent this long: reconnect
    poll_ms: int = 50
    backoff_min_s: float = 0.1
    backoff_max_s: float = 5.0
    secret_file: str | None = None  # CurveZMQ: this reader's key pair
    server_public_file: str | None = None  # CurveZMQ: the dispatcher's public key


class _Disconnected(Exception):
    """A send found no live connection: drop this session and reconnect."""


class FatalReaderError(RuntimeError):
    """The dispatcher refused this reader for a reason a reconnect cannot fix (e.g. version)."""


@dataclass(slots=True)
class _Assignment:
    id: int
    shard: str
    records: object  # iterator of SampleRecord
    stats: ErrorStats
    credits: int = 0
    count: int = 0
    skipped: list = field(default_factory=list)
    ref_path: bytes | None = None  # reference payload mode: the shard file references name


def sample_header(rec: SampleRecord, ref_path: bytes | None = None) -> tuple[list, list]:
    """(SAMPLES header entry, payload frames) of one record; payloads are the member buffers,
    or with `ref_path` (reference payload mode) references to their bytes in that file."""
    items = [[it.modality, it.member, int(it.enc_len), int(it.llm_len), dict(it.meta)]
             for it in rec.items]
    header = [rec.key, int(rec.index), int(rec.text_len), int(rec.llm_len),
              rec.text.encode("utf-8"), items]
    if ref_path is not None:
        return header, [P.pack_ref(ref_path, *rec.spans[it.member]) for it in rec.items]
    return header, [rec.members[it.member] for it in rec.items]


class ReaderWorker:
    """One reader peer. `run(stop)` until `stop` is set; raises FatalReaderError on refusal."""

    def __init__(self, config: ReaderServiceConfig, *, context: zmq.Context | None = None) -> None:
        self.config = config
        self.ctx = context or zmq.Context.instance()
        self.sock: zmq.Socket | None = None
        self.assignments: list[_Assignment] = []  # in the order assigned
        self.welcomed = False
        self.heartbeat_s = 1.0
        self.payloads = "inline"  # the dispatcher's choice, from WELCOME
        self.num_samples_sent = 0
        self._seq = 0
        self._hello_seq = -1
        self._last_recv = self._last_sent = 0.0

    # -- connection ----------------------------------------------------------------------
    def _connect(self) -> None:
        cfg = self.config
        sock = self.ctx.socket(zmq.DEALER)
        P.socket_limits(sock)
        if cfg.secret_file:
            public, secret = zmq.auth.load_certificate(cfg.secret_file)
            server_public, _ = zmq.auth.load_certificate(cfg.server_public_file)
            sock.curve_publickey, sock.curve_secretkey = public, secret
            sock.curve_serverkey = server_public
        sock.connect(cfg.dispatcher)
        self.sock = sock
        self.welcomed = False
        self._last_recv = time.monotonic()
        self._hello_seq = self._send(P.HELLO, role="reader", name=cfg.name or f"pid{os.getpid()}")

    def _disconnect(self) -> None:
        for a in list(self.assignments):
            self._drop_assignment(a)
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None

    def _drop_assignment(self, a: _Assignment) -> None:
        close = getattr(a.records, "close", None)
        if close is not None:
            close()  # shuts the shard file if reading began
        self.assignments.remove(a)

    def _find(self, assign_id) -> _Assignment | None:
        return next((a for a in self.assignments if a.id == assign_id), None)

    def _request_shards(self) -> None:
        self._send(P.SHARD_REQUEST, shards=min(1 + max(0, self.config.prefetch_shards),
                                               P.MAX_READER_SHARDS))

    def _send(self, type_: str, frames=(), **fields) -> int:
        self._seq += 1
        try:
            # A DEALER with no live connection blocks on send; a reader must never hang there.
            self.sock.send_multipart(P.encode(type_, seq=self._seq, frames=frames, **fields),
                                     zmq.NOBLOCK, copy=False)
        except zmq.Again:
            raise _Disconnected(type_) from None
        self._last_sent = time.monotonic()
        return self._seq

    # -- main loop -----------------------------------------------------------------------
    def run(self, stop: threading.Event | None = None) -> None:
        stop = stop or threading.Event()
        backoff = self.config.backoff_min_s
        try:
            while not stop.is_set():
                try:
                    self._connect()
                    healthy = self._session(stop)
                except _Disconnected:
                    healthy = self.welcomed
                self._disconnect()
                if stop.is_set():
                    break
                backoff = self.config.backoff_min_s if healthy else min(
                    backoff * 2, self.config.backoff_max_s)
                log.warning("mmdispatch event=reader_reconnect dispatcher=%s backoff_s=%.2f",
                            self.config.dispatcher, backoff)
                stop.wait(backoff)
        finally:
            if self.sock is not None:
                try:
                    self._send(P.BYE)
                except (zmq.ZMQError, _Disconnected):
                    pass
            self._disconnect()

    def _session(self, stop: threading.Event) -> bool:
        """Serve one connection; returns whether it was welcomed (resets the backoff)."""
        cfg = self.config
        while not stop.is_set():
            # The oldest assignment with credits: usually the shard being read; another when
            # that one waits for credits the dispatcher gives a lower position first.
            work = next((a for a in self.assignments if a.credits > 0), None) if self.welcomed else None
            if self.sock.poll(0 if work else cfg.poll_ms, zmq.POLLIN):
                for frames in P.pending(self.sock):
                    self._last_recv = time.monotonic()
                    if not self._handle(frames):
                        return self.welcomed
            if work is not None and work in self.assignments and work.credits > 0:
                self._stream(work)
            now = time.monotonic()
            if now - self._last_recv > cfg.timeout_s:
                return self.welcomed
            if self.welcomed and now - self._last_sent > self.heartbeat_s:
                self._send(P.HEARTBEAT)
        return self.welcomed

    def _handle(self, frames) -> bool:
        """Act on one message; False means drop the connection and say HELLO again."""
        try:
            msg = P.decode(frames)
        except P.ProtocolError as e:
            log.warning("mmdispatch event=reader_bad_message detail=%r", str(e)[:200])
            return True
        if msg.type == P.WELCOME and msg["ack"] == self._hello_seq:
            if msg.get("payloads", "inline") not in P.PAYLOAD_MODES:
                raise FatalReaderError(f"dispatcher asks for unknown payload mode {msg['payloads']!r}")
            self.welcomed = True
            self.heartbeat_s = float(msg["heartbeat_s"])
            self.payloads = msg.get("payloads", "inline")
            self._request_shards()
        elif msg.type == P.SHARD_ASSIGN:
            stats = ErrorStats()
            ref_path = None
            if self.payloads == "reference":
                ref_path = P.reference_path(msg["shard"]).encode("utf-8", "surrogateescape")
            records = iter_shard(msg["shard"], self.config.reader, start_index=msg["start_index"],
                                 stats=stats, spans=ref_path is not None)
            self.assignments.append(_Assignment(id=msg["assign_id"], shard=msg["shard"],
                                                records=records, stats=stats, ref_path=ref_path))
        elif msg.type == P.CREDIT and (a := self._find(msg.get("assign_id"))) is not None:
            a.credits += msg.get("samples", 0)
        elif msg.type == P.CANCEL and (a := self._find(msg["assign_id"])) is not None:
            self._drop_assignment(a)
            self._request_shards()
        elif msg.type == P.ERROR:
            if msg["code"] in ("version", "role"):
                raise FatalReaderError(f"dispatcher refused this reader: {msg['message']}")
            log.warning("mmdispatch event=reader_error code=%s message=%r", msg["code"], msg["message"])
            return msg["code"] != "unknown_peer"
        return True

    def _stream(self, a: _Assignment) -> None:
        """Send up to min(credits, batch) samples of `a`'s shard; finish it when exhausted."""
        headers, frames = [], []
        done = False
        while len(headers) < min(a.credits, self.config.batch):
            before = a.stats.num_errors
            try:
                rec = next(a.records)
            except StopIteration:
                done = True
            self._collect_skipped(a, before)
            if done:
                break
            h, f = sample_header(rec, a.ref_path)
            headers.append(h)
            frames.extend(f)
        if headers:
            # One coalesced payload frame per message: a memcpy of the members costs less than
            # a zmq frame per item here, in the dispatcher and in its I/O threads.
            self._send(P.SAMPLES, frames=[b"".join(frames)], assign_id=a.id, samples=headers,
                       sizes=[memoryview(f).nbytes for f in frames])
            a.credits -= len(headers)
            a.count += len(headers)
            self.num_samples_sent += len(headers)
        if done:
            self._send(P.SHARD_DONE, assign_id=a.id, count=a.count, skipped=a.skipped)
            self._drop_assignment(a)
            self._request_shards()

    @staticmethod
    def _collect_skipped(a: _Assignment, before: int) -> None:
        new = a.stats.num_errors - before
        if new > 0:
            recent = list(a.stats.recent)[-new:]
            a.skipped.extend([key or "", reason, -1] for reason, _shard, key, _msg in recent)


# -- the `read` command ---------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dispatcher", required=True,
                        help="the dispatcher's reader endpoint, tcp://HOST:PORT")
    parser.add_argument("--workers", type=int, default=1, help="reader worker processes")
    parser.add_argument("--name", default="", help="name shown in the dispatcher's logs")
    parser.add_argument("--batch", type=int, default=32, help="most samples per message")
    parser.add_argument("--prefetch-shards", type=int, default=1,
                        help="shards held assigned beyond the one being read, so the next starts "
                             f"without a round trip to the dispatcher (0 to {P.MAX_READER_SHARDS - 1})")
    parser.add_argument("--timeout", type=float, default=5.0,
                        help="seconds of dispatcher silence before reconnecting")
    parser.add_argument("--malloc-keep-mb", type=int, default=16,
                        help="reuse freed heap blocks up to this size instead of fresh pages "
                             "(glibc; saves page faults on payload frames); 0 = off")
    parser.add_argument("--curve-secret", default=None,
                        help="CurveZMQ: this reader's NAME.key_secret file")
    parser.add_argument("--curve-server-key", default=None,
                        help="CurveZMQ: the dispatcher's public NAME.key file")
    add_reader_arguments(parser)  # counting rules and error policy, shared with `inspect`


def config_from_args(args: argparse.Namespace, worker: int = 0) -> ReaderServiceConfig:
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    if not 0 <= args.prefetch_shards < P.MAX_READER_SHARDS:
        raise ValueError(f"--prefetch-shards must be 0 to {P.MAX_READER_SHARDS - 1}, "
                         f"got {args.prefetch_shards}")
    if bool(args.curve_secret) != bool(args.curve_server_key):
        raise ValueError("--curve-secret and --curve-server-key go together")
    name = f"{args.name or os.uname().nodename}/{worker}"
    return ReaderServiceConfig(dispatcher=args.dispatcher, name=name, batch=args.batch,
                               prefetch_shards=args.prefetch_shards,
                               timeout_s=args.timeout,
                               reader=reader_config_from_args(args),
                               secret_file=args.curve_secret, server_public_file=args.curve_server_key)


def _worker_main(args: argparse.Namespace, worker: int) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    keep_freed_memory(getattr(args, "malloc_keep_mb", 0))
    relax_gc()
    ReaderWorker(config_from_args(args, worker)).run(stop)


def run(args: argparse.Namespace) -> int:
    config_from_args(args)  # validate before forking
    if args.workers == 1:
        _worker_main(args, 0)
        return 0
    mp = multiprocessing.get_context("spawn")
    procs = [mp.Process(target=_worker_main, args=(args, w), name=f"reader-{w}")
             for w in range(args.workers)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join()
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
    return max((p.exitcode or 0) for p in procs)
