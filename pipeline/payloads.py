"""A reader's payload socket for `direct` payload mode: trainers fetch member bytes from it.

The dispatcher plans on headers and references only; each trainer asks a reader for the bytes
of the items it encodes (FETCH: references, one request per reader and step; PAYLOADS: the
bytes). Pull, by the trainer: it bounds its own memory and backpressure, readers need to know
nothing of trainer liveness, and a restarted trainer simply asks again.

A reader keeps the members it sent headers for in a bounded cache (evicted once fetched, and
oldest first past a byte cap); a miss, e.g. a replay after a trainer restarts or a reference
whose reader died, is read from the shard at its offset (a local file, or a ranged request to
a remote object), so any live reader serves any reference of a shard of the job (the
dispatcher's WELCOME lists them; no other shard is read).
A request with a miss is read back on a worker thread (`READ_BACK_WORKERS`), so a slow read
(a remote store that trickles) holds neither the socket nor other trainers' requests; while it
runs, the trainer that asked gets a HEARTBEAT every `KEEPALIVE_S` seconds on the same socket,
which tells its fetch the reader is working, not gone (`trainer_client.fetch`; a trainer that
predates this ignores it, and no protocol version changed: HEARTBEAT is any peer's "alive").
With CurveZMQ the socket is a CURVE server with the reader's key pair and admits only clients
whose public key is in the allowed directory (the same ZAP handler as the dispatcher's).

Memory. The bytes of replies a reader holds (read back, or handed to ZeroMQ and not yet sent)
are bounded over all trainers by `MAX_REPLY_BYTES`: past it, a trainer's request waits, its
trainer getting a HEARTBEAT every `KEEPALIVE_S` meanwhile, unless that trainer holds nothing
(so at most one reply per trainer passes the bound, and a trainer that stopped reading, whose
queued replies keep the bytes held, holds up nobody else). A trainer that asks and reads
nothing gets at most `REPLY_HWM` replies queued; more are dropped (its fetch times out and asks
again). A request naming a reference twice is refused. Without these,
a client that asks and never reads made the reader hold every reply it asked for.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import zmq

from dispatcher_server import protocol as P
from dispatcher_server.cliopts import check_ipc_bind, check_tcp_bind, redact, tcp_host_port
from dispatcher_server.endpoint import allow_ipv6
from pipeline.shards import read_range

log = logging.getLogger("mmdispatch.payloads")

#: Default byte cap of a reader's payload cache (`--payload-cache-mb`).
DEFAULT_CACHE_MB = 256
#: Threads reading members back from shard files (cache misses) for trainers, per reader.
READ_BACK_WORKERS = 4
#: While a request is read back, its trainer gets a HEARTBEAT this often: well inside the
#: trainer's silence timeout (`FetchConfig.timeout_s`, 5 s).
KEEPALIVE_S = 1.0
#: Reply bytes held at once (being read back, or queued in ZeroMQ), over all trainers.
MAX_REPLY_BYTES = 1 << 30
#: Replies queued to one trainer at once: a trainer has one request per step in flight to a
#: reader (two with prefetch), plus HEARTBEATs; one that reads nothing holds no more.
REPLY_HWM = 8


class PayloadCache:
    """Member buffers by reference (protocol.pack_ref), at most `max_bytes` of them: the oldest
    go first when more arrive, and each goes once fetched. Thread-safe (the reader puts, the
    payload thread takes)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._items: OrderedDict[bytes, memoryview] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, ref: bytes, data) -> None:
        view = memoryview(data)
        with self._lock:
            old = self._items.pop(ref, None)
            if old is not None:
                self.nbytes -= old.nbytes
            if view.nbytes > self.max_bytes:
                return
            self._items[ref] = view
            self.nbytes += view.nbytes
            while self.nbytes > self.max_bytes:
                self.nbytes -= self._items.popitem(last=False)[1].nbytes

    def take(self, ref: bytes) -> memoryview | None:
        with self._lock:
            view = self._items.pop(ref, None)
            if view is not None:
                self.nbytes -= view.nbytes
            return view

    def __len__(self) -> int:
        return len(self._items)


def local_address(dispatcher: str) -> str:
    """The address of this host's interface that reaches `dispatcher` (tcp://HOST:PORT): what
    trainers, which reach the dispatcher too, most likely reach. 127.0.0.1 for other transports."""
    parts = urlsplit(dispatcher)
    if parts.scheme != "tcp" or not parts.hostname:
        return "127.0.0.1"
    v6 = ":" in parts.hostname  # tcp://[::1]:5555 (an endpoint, so bracketed again)
    with socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((parts.hostname, parts.port or 9))  # UDP: nothing is sent
            return f"[{s.getsockname()[0]}]" if v6 else s.getsockname()[0]
        except OSError:
            return "[::1]" if v6 else "127.0.0.1"


#: Hosts that bind every interface: no address a trainer can connect to.
WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::", "[::]"})
#: A host name, an IPv4 address, or an IPv6 address in brackets (what a trainer can connect to).
_HOST = re.compile(r"[A-Za-z0-9_.-]+|\[[0-9A-Za-z:.%]+\]")


def check_bind(bind: str, flag: str = "--payload-bind") -> None:
    """ValueError, one line naming `flag`, for a tcp:// endpoint without a port (ZeroMQ's bind
    says only "Invalid argument") or an ipc:// one in no directory it can make a socket in."""
    check_ipc_bind(flag, bind)
    check_tcp_bind(flag, bind, "give tcp://HOST:PORT (worker w of --workers binds PORT + w), or "
                               "tcp://HOST:0 for an ephemeral port", any_port=False)


def check_advertise(advertise: str, flag: str = "--payload-advertise") -> None:
    """ValueError, one line naming `flag`, the value and the fix, for a tcp:// endpoint no
    trainer can connect to: a wildcard host, port 0, or a host no host name or address spells."""
    if not advertise.startswith("tcp://"):
        return
    host, port = tcp_host_port(advertise)
    if host in WILDCARD_HOSTS:
        why = f"host {host} means every interface when binding, and no trainer can connect to it"
    elif not _HOST.fullmatch(host):
        why = f"{host!r} is no host name or address"
    elif port is not None and not (port.isdigit() and 0 < int(port) <= 65535):
        why = f"port {port} is no port a trainer can connect to (1 to 65535, or none: the bound one)"
    else:
        return
    raise ValueError(f"{flag} {advertise!r}: {why}; give the address trainers reach this host "
                     f"at, e.g. tcp://10.0.0.5 or tcp://reader-0.example:7555")


def worker_endpoint(endpoint: str, worker: int) -> str:
    """`endpoint` for worker `worker` of one `read --workers N`: a fixed tcp port P becomes
    P + worker (so the workers do not collide); port 0, no port and other transports stay."""
    parts = urlsplit(endpoint)
    if parts.scheme == "tcp" and parts.port:
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        return f"tcp://{host}:{parts.port + worker}"
    return endpoint


def bind_address(bind: str | None, dispatcher: str, worker: int) -> str:
    """Where worker `worker` binds: `bind` (a fixed port P becomes P + worker), default an
    ephemeral port on the interface that reaches the dispatcher."""
    if not bind:
        return f"tcp://{local_address(dispatcher)}:0"
    return worker_endpoint(bind, worker)


def advertised(bound: str, advertise: str | None, dispatcher: str) -> str:
    """The endpoint trainers are told: `advertise` (without a port: the bound one; ValueError
    for one no trainer can connect to), else the bound endpoint with a wildcard host replaced
    by the interface that reaches the dispatcher."""
    port = urlsplit(bound).port
    if advertise:
        check_advertise(advertise)
        if not advertise.startswith("tcp://") or tcp_host_port(advertise)[1] is not None:
            return advertise
        return f"{advertise.rstrip('/')}:{port}"
    host = urlsplit(bound).hostname
    if host in ("0.0.0.0", "*", "::", None) and bound.startswith("tcp://"):
        return f"tcp://{local_address(dispatcher)}:{port}"
    return bound


class PayloadServer:
    """The ROUTER payload socket and its thread; `close()` stops both.

    `servable` (set by the reader from WELCOME) holds the shard files this reader may read
    for a reference; `cache` the members it sent headers for.
    """

    def __init__(self, bind: str, *, cache: PayloadCache, advertise: str | None = None,
                 dispatcher: str = "", secret_file: str | None = None,
                 allowed_dir: str | None = None, poll_ms: int = 100) -> None:
        self.cache = cache
        self.servable: frozenset[bytes] = frozenset()
        self.public_key = ""
        self.poll_ms = poll_ms
        self.num_served = self.num_missed = self.num_dropped = 0
        self._missed_lock = threading.Lock()  # num_missed counts on the read-back threads
        self.failed_shards: set[str] = set()  # shards a read-back failed for, logged once each
        # Its own context: a ZAP handler is per context, and a reader's session is a client.
        self.ctx = zmq.Context()
        self._auth = None
        self.sock = self.ctx.socket(zmq.ROUTER)
        try:
            P.socket_limits(self.sock)
            # A full queue to one trainer raises instead of growing (or dropping unseen).
            self.sock.setsockopt(zmq.SNDHWM, REPLY_HWM)
            self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            if secret_file:
                from dispatcher_server.security import (
                    PAYLOAD_HANDSHAKE_FIX, apply_server_curve, start_authenticator,
                )

                if not allowed_dir:
                    raise ValueError("CurveZMQ payload sockets need --payload-allowed-dir (the "
                                     "trainers' public NAME.key files)")
                self._auth = start_authenticator(self.ctx, allowed_dir,
                                                 allow_list="this reader's --payload-allowed-dir",
                                                 peers="trainers'")
                self.public_key = apply_server_curve(self.sock, secret_file,
                                                     fix=PAYLOAD_HANDSHAKE_FIX).decode("ascii")
            allow_ipv6(self.sock, bind)
            self.sock.bind(bind)
            self.endpoint = advertised(self.sock.getsockopt_string(zmq.LAST_ENDPOINT), advertise,
                                       dispatcher)
        except BaseException:
            self.close()
            raise
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(READ_BACK_WORKERS, thread_name_prefix="mmdispatch-readback")
        # Requests being read back: future -> [trainer identity, request id, last HEARTBEAT,
        # bytes asked]
        self._working: dict[Future, list] = {}
        # Requests past MAX_REPLY_BYTES: [trainer identity, request id, refs, bytes asked, last
        # HEARTBEAT] (a waiting trainer hears the reader is busy, as during a read-back)
        self._waiting: deque[list] = deque()
        # (trainer identity, tracker, bytes) of replies handed to ZeroMQ and not known sent
        self._queued: list[tuple[bytes, Any, int]] = []
        self._deaf: set[bytes] = set()  # trainers a reply was dropped for, logged once each
        self._thread = threading.Thread(target=self._run, name="mmdispatch-payloads", daemon=True)
        self._thread.start()

    def keep(self, refs: list, members: list) -> None:
        """Cache the members whose references were just sent to the dispatcher."""
        for ref, data in zip(refs, members):
            self.cache.put(bytes(ref), data)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                wait = min(self.poll_ms, 50) if self._working or self._waiting else self.poll_ms
                if self.sock.poll(wait):
                    for frames in P.pending(self.sock, 64):
                        try:
                            self._serve(frames[0].bytes, frames[1:])
                        except Exception:  # noqa: BLE001 - one odd request must not end serving
                            log.exception("mmdispatch event=payload_request_failed")
                if self._working:
                    self._answer_read_backs()
                if self._waiting:
                    self._start_waiting()
        except zmq.ZMQError:
            if not self._stop.is_set():
                raise

    def _serve(self, ident: bytes, body: list) -> None:
        try:
            msg = P.decode(body)
        except P.ProtocolError as e:
            self._send(ident, P.ERROR, code=e.code, message=str(e))
            return
        if msg.type != P.FETCH:
            self._send(ident, P.ERROR, code="unexpected", message=f"{msg.type} is not a fetch")
            return
        try:
            refs = P.split_payload(msg.frames[0], msg["sizes"])
            asked = sum(P.unpack_ref(ref).size for ref in refs)
        except P.ProtocolError as e:
            self._send(ident, P.ERROR, code="fetch", message=str(e), ack=msg["id"])
            return
        if len(set(map(bytes, refs))) != len(refs):  # a trainer asks each item once
            self._send(ident, P.ERROR, code="fetch", ack=msg["id"],
                       message="a request names the same reference more than once")
            return
        self._waiting.append([ident, msg["id"], refs, asked, time.monotonic()])
        self._start_waiting()

    def held_bytes(self) -> dict[bytes, int]:
        """Reply bytes held now, by trainer: being read back, or queued in ZeroMQ and not yet
        sent. Reads only: tests and tools may call it from another thread."""
        held: dict[bytes, int] = {}
        for ident, tracker, n in list(self._queued):
            if not tracker.done:
                held[ident] = held.get(ident, 0) + n
        for work in self._working.values():
            held[work[0]] = held.get(work[0], 0) + work[3]
        return held

    def _start_waiting(self) -> None:
        """Serve the waiting requests in order, each while its bytes fit MAX_REPLY_BYTES or
        its trainer holds nothing; a HEARTBEAT to those left waiting."""
        self._queued = [q for q in self._queued if not q[1].done]
        held = self.held_bytes()
        total = sum(held.values())
        now = time.monotonic()
        left: deque[list] = deque()
        for wait in self._waiting:
            ident, request, refs, asked, beat = wait
            if held.get(ident) and (total + asked > MAX_REPLY_BYTES
                                    or any(w[0] == ident for w in left)):  # its order kept
                if now - beat >= KEEPALIVE_S:
                    wait[4] = now
                    self._send(ident, P.HEARTBEAT)
                left.append(wait)
                continue
            held[ident] = held.get(ident, 0) + asked
            total += asked
            self._serve_now(ident, request, refs, asked)
        self._waiting = left

    def _serve_now(self, ident: bytes, request: int, refs: list, asked: int) -> None:
        """Answer from the cache, or read the misses back on a worker thread."""
        out = [self.cache.take(bytes(ref)) for ref in refs]
        self.num_served += sum(b is not None for b in out)
        if all(b is not None for b in out):
            self._reply(ident, request, out)
            return
        future = self._pool.submit(self._read_back_all, refs, out)
        self._working[future] = [ident, request, time.monotonic(), asked]

    def _read_back_all(self, refs: list, out: list) -> list:
        """`out` with its misses (None) read from their shard files (on a worker thread)."""
        return [self._read_back(ref) if b is None else b for ref, b in zip(refs, out)]

    def _answer_read_backs(self) -> None:
        """Answer the requests whose read-back ended; a HEARTBEAT to those still reading."""
        now = time.monotonic()
        for future, work in list(self._working.items()):
            ident, request, beat, _ = work
            if not future.done():
                if now - beat >= KEEPALIVE_S:
                    work[2] = now
                    self._send(ident, P.HEARTBEAT)
                continue
            del self._working[future]
            try:
                out = future.result()
            except (OSError, ValueError, P.ProtocolError) as e:
                # The trainer's log is no place for a shard URL's password or token either.
                self._send(ident, P.ERROR, code="fetch", message=redact(str(e)), ack=request)
                continue
            except Exception as e:  # noqa: BLE001 - answered all the same: the trainer asks elsewhere
                log.exception("mmdispatch event=payload_request_failed")
                self._send(ident, P.ERROR, code="fetch", message=redact(f"{type(e).__name__}: {e}"),
                           ack=request)
                continue
            self._reply(ident, request, out)

    def _reply(self, ident: bytes, request: int, out: list) -> None:
        # Coalesced frames (one unless past a frame's limit): a memcpy of the members costs
        # less than a zero-copy frame per item, each of whose release wakes pyzmq's
        # garbage-collector thread (and the trainer receives one frame, not one per item).
        sizes = [memoryview(b).nbytes for b in out]
        tracker = self._send(ident, P.PAYLOADS, frames=P.coalesce(out, sizes), id=request,
                             sizes=sizes, track=True)
        if tracker is not None:
            self._queued.append((ident, tracker, sum(sizes)))

    def _read_back(self, ref: memoryview):
        """A reference's bytes read from its shard file (a cache miss; on a worker thread)."""
        path, offset, size, stamp = P.unpack_ref(ref)
        if path not in self.servable:
            raise ValueError(f"{path.decode(errors='replace')!r} is not a shard of this job")
        if size > P.DEFAULT_LIMITS.max_frame_bytes or offset >= 1 << 62:
            raise ValueError(f"{size} bytes at offset {offset} is no member of a shard")
        with self._missed_lock:
            self.num_missed += 1
        url = path.decode("utf-8", "surrogateescape")
        try:
            return read_range(url, offset, size, stamp)
        except (OSError, ValueError) as e:
            # The trainer gets the reason in its ERROR; the reader's log says it once per shard,
            # where the shard's owner looks (every later member of the shard fails the same way).
            if url not in self.failed_shards:
                self.failed_shards.add(url)
                log.warning("mmdispatch event=payload_read_failed shard=%s reason=%r (later failures "
                            "of this shard are answered, not logged)", url, str(e))
            raise

    def _send(self, ident: bytes, type_: str, track: bool = False, **fields):
        """Send to trainer `ident`; the reply's MessageTracker with `track`. None when the
        trainer is gone, or its queue is full (it reads nothing: the reply is dropped, and its
        fetch asks again)."""
        try:
            return self.sock.send_multipart([ident, *P.encode(type_, **fields)], copy=False,
                                            track=track, flags=zmq.NOBLOCK)
        except zmq.Again:
            self.num_dropped += 1
            if ident not in self._deaf:
                if len(self._deaf) >= 4096:
                    self._deaf.clear()
                self._deaf.add(ident)
                log.warning("mmdispatch event=payload_reply_dropped peer=%s queued=%d: a client "
                            "of this payload socket reads none of its replies; replies past "
                            "that many to it are dropped (it is logged once)", ident.hex(),
                            REPLY_HWM)
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:  # gone: nobody is waiting for it
                raise
        return None

    def close(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
            self._thread.join(5)
        pool = getattr(self, "_pool", None)
        if pool is not None:  # a read-back under way ends at its own timeout, unanswered
            pool.shutdown(wait=False, cancel_futures=True)
        self.sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self.ctx.term()
