"""`direct` payload mode, trainer side: fetch each step's payloads from the readers that hold them.

STEP messages carry references (protocol.pack_ref) and, per item, which reader holds it. A
`PayloadFetcher` thread takes the client's STEP messages in order, asks each holding reader
for all of the step's items it holds in one FETCH (the readers of a step in parallel), and
hands the decoded step on: the fetch of step N+1 overlaps the training of step N, and memory
stays bounded by the steps the client was granted. The thread owns the reader sockets.

A reader that answers with an error, or says nothing for `timeout_s` (5 s), is replaced by
another live reader from the dispatcher's table (any reader serves any reference from the shard file),
after a backoff; after `attempts` tries the step fails with one error naming the shards and
the readers tried. With no live reader listed at all, a retry waits up to `outage_s` for one. A reader that left a request unanswered, or that the table no longer lists,
is not asked first again (until it answers, or for SILENT_TIMEOUTS timeouts): after a reader
dies, only the first request to it waits. An endpoint ZeroMQ cannot connect to counts as a
silent reader, and the first time a reader is marked silent the log says so (WARNING, once per
endpoint): a reader no trainer reaches is routed around, never unseen. Pull keeps the readers stateless toward trainers: a
restarted trainer simply asks again.

Timing. `timeout_s` bounds a reader's silence, not its work: a reader reading a member back
from its shard file (a cache miss: a replay, `--payload-cache-mb 0`, a remote store that
trickles) sends a HEARTBEAT every second (`pipeline.payloads.KEEPALIVE_S`) until it answers,
and each one moves the request's deadline to `timeout_s` from then, up to `busy_max_s` (300 s)
after the request was sent; a slow store that makes progress is waited for, a dead or hung
reader is left after `timeout_s`. A reader's own read-back retries a failing remote read for
`pipeline.remote.READ_BACK_RETRY_S` (60 s, as a streaming read: an object store's short outage
loses nothing), then answers with the error; the trainer then asks the next reader after a
backoff of `backoff_min_s` doubling to `backoff_max_s`, `attempts` (4) times in all before the
step fails with a FetchError.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import zmq

from dispatcher_server import protocol as P
from dispatcher_server.cliopts import redact
from dispatcher_server.endpoint import allow_ipv6
from dispatcher_server.security import PeerCurve

log = logging.getLogger("mmdispatch.fetch")

#: How long (in timeouts) a reader that left a request unanswered is asked only as a last resort.
SILENT_TIMEOUTS = 6


class FetchError(RuntimeError):
    """No reader served some of a step's payloads within the attempts allowed. Its message names
    shard URLs with their credentials hidden (`cliopts.redact`): a training log is read by more
    people than the bucket's key."""

    def __init__(self, message: str) -> None:
        super().__init__(redact(message))


@dataclass(kw_only=True, slots=True)
class FetchConfig:
    timeout_s: float = 5.0  # a reader silent this long on a request: ask another
    busy_max_s: float = 300.0  # a reader still reading (HEARTBEATs) is waited on this long at most
    attempts: int = 4  # readers asked for one request before the step fails
    backoff_min_s: float = 0.1  # wait before a retry, doubling up to backoff_max_s
    backoff_max_s: float = 2.0
    # With no live reader listed (every one gone, replacements not yet connected: a reader
    # restarted, a pod rescheduled), a retry waits this long for one instead of spending its
    # attempts on endpoints known dead.
    outage_s: float = 300.0


@dataclass(slots=True)
class _Request:
    """The items of one step held by one reader: where they go and who was asked."""

    places: list  # (micro-batch, item) per reference
    refs: list  # memoryview per reference
    endpoint: P.ReaderEndpoint
    id: int = -1
    deadline: float = 0.0
    sent: float = 0.0  # when the current try was sent (busy_max_s runs from it)
    not_before: float = 0.0
    tried: list = field(default_factory=list)  # (endpoint, why) per failed try
    outage_since: float | None = None  # waiting for a live reader to be listed since then
    views: list | None = None


def _shards(refs: list) -> str:
    return ", ".join(sorted({P.unpack_ref(r)[0].decode(errors="replace") for r in refs}))


def _tried(req: _Request) -> str:
    """The readers asked and what each answered: a reason repeated by several tries is said
    once, after the readers that gave it ("... (4 tries, the same each time)")."""
    by_reason: dict[str, list[str]] = {}
    for endpoint, why in req.tried:
        by_reason.setdefault(why, []).append(endpoint)
    parts = []
    for why, endpoints in by_reason.items():
        said = f"{', '.join(dict.fromkeys(endpoints))}: {why}"
        parts.append(f"{said} ({len(endpoints)} tries, the same each time)" if len(endpoints) > 1 else said)
    return "; ".join(parts)


#: Seconds `PayloadFetcher.close` waits for its thread to leave.
CLOSE_WAIT_S = 10.0


class PayloadFetcher:
    """`put(msg)` STEP messages (or any other item, passed on in order); `decode(msg, fetched)`
    turns a message and its payloads (per micro-batch, one view per item) into what goes
    into `out`; a step that cannot be fetched goes there as its FetchError. An item put with
    a `stamp` goes out as `(stamp, result)`: the client tells a fetch that was under way when
    it rewound from the steps of its new position by it."""

    def __init__(self, *, decode: Callable, out: queue.Queue, curve: PeerCurve | None = None,
                 config: FetchConfig | None = None) -> None:
        self.decode, self.out, self.curve = decode, out, curve
        self.config = config or FetchConfig()
        self.readers: list[P.ReaderEndpoint] = []  # the live table, replaced whole
        # Endpoint -> when it left a request unanswered: asked only when no other live reader is
        # left, until it answers or SILENT_TIMEOUTS timeouts passed (a reader restarted at the
        # same endpoint is asked first again); set and read by the fetch thread alone.
        self._silent: dict[str, float] = {}
        self._warned: set[str] = set()  # endpoints said unreachable in the log (once each)
        self.num_retries = 0
        self._inbox: queue.Queue = queue.Queue()
        self._ctx = zmq.Context()
        self._socks: dict[P.ReaderEndpoint, zmq.Socket] = {}
        self._ids = itertools.count(1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mmdispatch-fetch", daemon=True)
        self._thread.start()

    def put(self, item, stamp=None) -> None:
        self._inbox.put((item, stamp))

    def clear(self) -> None:
        """Drop what is queued (a resync: those steps will come again)."""
        while True:
            try:
                self._inbox.get_nowait()
            except queue.Empty:
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(CLOSE_WAIT_S)
        if not self._thread.is_alive():
            self._ctx.term()
        # Else the thread is still inside a ZeroMQ call on one of its sockets: closing them
        # from here aborted the whole process (ZeroMQ sockets belong to one thread). It closes
        # them as it leaves; the context goes with the process.

    # -- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        finally:  # the sockets are this thread's: only it closes them
            for sock in self._socks.values():
                sock.close(linger=0)
            self._socks.clear()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                item, stamp = self._inbox.get(timeout=0.1)
            except queue.Empty:
                continue
            if not isinstance(item, P.Message):
                result = item
            else:
                try:
                    result = self.decode(item, self.fetch(item))
                except Exception as e:  # noqa: BLE001 - the training loop raises it
                    result = e
            self.out.put(result if stamp is None else (stamp, result))

    def fetch(self, msg: P.Message) -> list[list[memoryview]]:
        """Every item's bytes, per micro-batch in item order, from the readers holding them."""
        readers, out, groups = msg.get("readers"), [], {}
        if readers is None:
            raise P.ProtocolError("step: direct payloads need the step's readers")
        for m, (mb, (_, refs)) in enumerate(zip(msg["microbatches"], P.microbatch_frames(msg))):
            out.append([None] * len(refs))
            for k, (ref, h) in enumerate(zip(refs, mb[P.HOLDERS])):
                places, grouped = groups.setdefault(h, ([], []))
                places.append((m, k))
                grouped.append(ref)
        requests = [_Request(places, refs, self._first_choice(readers[h], h))
                    for h, (places, refs) in groups.items()]
        self._complete(requests)
        for req in requests:
            for (m, k), view in zip(req.places, req.views):
                out[m][k] = view
        return out

    def _first_choice(self, holder: P.ReaderEndpoint, spread: int) -> P.ReaderEndpoint:
        """The reader to ask first for what `holder` holds: the holder itself, unless the
        dispatcher's live table no longer lists it or it left a request unanswered; then
        another live reader (chosen by `spread`), which reads the bytes from the shard file.
        A dead reader stays the named holder of every buffered sample it sent and of every
        retained step: asking it first would cost each of those steps `timeout_s`."""
        live, silent = self.readers, self._silent_now()
        if not live or (holder in live and holder.endpoint not in silent):
            return holder
        others = [r for r in live if r.endpoint not in silent]
        return others[spread % len(others)] if others else holder

    def _silent_now(self):
        """The endpoints marked silent, less the marks older than SILENT_TIMEOUTS timeouts."""
        since = time.monotonic() - SILENT_TIMEOUTS * self.config.timeout_s
        for endpoint in [e for e, at in self._silent.items() if at < since]:
            del self._silent[endpoint]
        return self._silent.keys()

    def _complete(self, requests: list[_Request]) -> None:
        pending: dict[int, _Request] = {}
        waiting = list(requests)
        while waiting or pending:
            if self._stop.is_set():
                raise FetchError("the client closed while fetching payloads")
            now = time.monotonic()
            for req in [r for r in waiting if r.not_before <= now]:
                waiting.remove(req)
                if req.tried and not self._wait_for_a_reader(req, now):
                    waiting.append(req)
                    continue
                try:
                    self._send(req, now)
                except zmq.ZMQError as e:  # an endpoint ZeroMQ cannot connect to: unreachable
                    self._give_up_on(req.endpoint, now, f"cannot connect: {e}", pending, waiting)
                    self._failed(req, f"cannot connect to it ({e})", waiting)
                    continue
                pending[req.id] = req
            socks = {self._socks[r.endpoint] for r in pending.values()}
            wake = min([r.deadline for r in pending.values()] + [r.not_before for r in waiting])
            poller = zmq.Poller()
            for sock in socks:
                poller.register(sock, zmq.POLLIN)
            ready = dict(poller.poll(max(1, min(100, int((wake - now) * 1e3) + 1))))
            for sock in socks:
                if sock in ready:
                    for frames in P.pending(sock):
                        self._receive(frames, pending, waiting, sock)
            now = time.monotonic()
            for req in [r for r in pending.values() if r.deadline <= now]:
                if req.id in pending:  # not given up on with an earlier one to its reader
                    self._give_up_on(req.endpoint, now, f"no answer in {self.config.timeout_s} s",
                                     pending, waiting)

    def _give_up_on(self, reader: P.ReaderEndpoint, now: float, why: str, pending: dict,
                    waiting: list) -> None:
        """Drop `reader`'s socket, mark it silent, and ask elsewhere every request pending on
        it: their answers cannot arrive on a closed socket. One request timing out while a later
        one to the same reader waited left that one on a dropped socket (a KeyError)."""
        self._drop_socket(reader)
        self._mark_silent(reader.endpoint, now, why)
        for req in [r for r in pending.values() if r.endpoint == reader]:
            del pending[req.id]
            self._failed(req, why, waiting)

    def _mark_silent(self, endpoint: str, now: float, why: str) -> None:
        """Ask `endpoint` last for a while; the first time, say so in the log: a reader no
        trainer reaches is routed around, and would otherwise be routed around unseen."""
        self._silent[endpoint] = now
        if endpoint not in self._warned:
            self._warned.add(endpoint)
            log.warning("mmdispatch event=reader_unreachable endpoint=%s why=%r fix=%r (said once "
                        "per reader; its payloads are fetched from other readers)", endpoint, why,
                        "trainers cannot reach this reader's payload endpoint (unless it "
                        "died): check its --payload-advertise, the firewall between, and with "
                        "CurveZMQ its --payload-allowed-dir (this trainer's NAME.key)")

    def _wait_for_a_reader(self, req: _Request, now: float) -> bool:
        """Whether a retry may go now: a live reader is listed (the one to ask is then chosen
        among them), else it waits up to `outage_s` for one (FetchError past that)."""
        c = self.config
        if self.readers:
            if req.outage_since is not None:
                req.outage_since, req.endpoint = None, self._next_reader(req)
            return True
        if req.outage_since is None:
            req.outage_since = now
        elif now - req.outage_since >= c.outage_s:
            raise FetchError(f"payloads of shard(s) {_shards(req.refs)} could not be fetched: "
                             f"no live reader for {c.outage_s:g} s (tried {_tried(req)})")
        req.not_before = now + c.backoff_max_s
        return False

    def _send(self, req: _Request, now: float) -> None:
        req.id, req.deadline, req.sent = next(self._ids), now + self.config.timeout_s, now
        self._socket(req.endpoint).send_multipart(
            P.encode(P.FETCH, frames=[b"".join(req.refs)], id=req.id,
                     sizes=[r.nbytes for r in req.refs]), copy=False)

    def _receive(self, frames: list, pending: dict, waiting: list, sock: zmq.Socket | None = None) -> None:
        try:
            msg = P.decode(frames)
        except P.ProtocolError:
            return  # nothing to match it to: the request times out and is asked elsewhere
        if msg.type == P.HEARTBEAT:  # the reader is still reading what this socket asked it for
            now, c = time.monotonic(), self.config
            for req in pending.values():
                if self._socks.get(req.endpoint) is sock:
                    req.deadline = max(req.deadline, min(now + c.timeout_s, req.sent + c.busy_max_s))
            return
        req = pending.pop(msg.get("id", msg.get("ack")), None)
        if req is None:
            return  # the answer to a request already given up on
        if msg.type == P.PAYLOADS and msg["sizes"] == [P.unpack_ref(r)[2] for r in req.refs]:
            req.views = P.item_views(msg.frames, msg["sizes"])
            self._silent.pop(req.endpoint.endpoint, None)
        else:
            why = msg["message"] if msg.type == P.ERROR else f"a {msg.type} that does not match"
            self._failed(req, why, waiting)

    def _failed(self, req: _Request, why: str, waiting: list) -> None:
        """Ask another live reader after a backoff, or give up naming shards and readers."""
        req.tried.append((req.endpoint.endpoint, why))
        c = self.config
        if len(req.tried) >= c.attempts:
            hint = ""
            if self.curve is not None and all("no answer" in w for _, w in req.tried):
                # a CURVE socket drops a client whose key it does not allow, without a word
                hint = ("; with CurveZMQ, a reader that never answers may not allow this "
                        "trainer's key: its public NAME.key belongs in every reader's "
                        "--payload-allowed-dir")
            raise FetchError(f"payloads of shard(s) {_shards(req.refs)} could not be fetched "
                             f"from any reader (tried {_tried(req)}){hint}")
        self.num_retries += 1
        req.endpoint = self._next_reader(req)
        req.not_before = time.monotonic() + min(c.backoff_max_s,
                                                c.backoff_min_s * 2 ** (len(req.tried) - 1))
        waiting.append(req)

    def _next_reader(self, req: _Request) -> P.ReaderEndpoint:
        """A live reader not yet asked for `req` (silent ones last); once all were, the live
        ones in turn; with no live reader known (all gone, replacements not yet reported), the
        last one asked."""
        asked = {e for e, _ in req.tried}
        avoid = asked | self._silent_now()
        candidates = ([r for r in self.readers if r.endpoint not in avoid]
                      or [r for r in self.readers if r.endpoint not in asked] or self.readers)
        return candidates[len(req.tried) % len(candidates)] if candidates else req.endpoint

    def _socket(self, reader: P.ReaderEndpoint) -> zmq.Socket:
        sock = self._socks.get(reader)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            P.socket_limits(sock)
            if reader.key:
                if self.curve is None:
                    sock.close(linger=0)
                    raise FetchError(f"reader {reader.endpoint} requires CurveZMQ: give the "
                                     "trainer its key pair (ClientConfig.secret_file)")
                self.curve.apply(sock, reader.key.encode("ascii"))
            allow_ipv6(sock, reader.endpoint)
            try:
                sock.connect(reader.endpoint)
            except zmq.ZMQError:
                sock.close(linger=0)
                raise
            self._socks[reader] = sock
        return sock

    def _drop_socket(self, reader: P.ReaderEndpoint) -> None:
        """Forget a silent reader's socket: what it queued is dropped, a retry reconnects."""
        sock = self._socks.pop(reader, None)
        if sock is not None:
            sock.close(linger=0)
