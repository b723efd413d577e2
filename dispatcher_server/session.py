"""One peer session with the dispatcher, shared by readers and trainer clients.

A `PeerSession` owns the DEALER socket and everything about the connection: CurveZMQ, HELLO
matched to its WELCOME by sequence number, heartbeats, a liveness timeout that reconnects with
exponential backoff, non-blocking sends, a connect timeout, and BYE whenever it leaves a
welcomed session (stopped, told END, or on an error), so the dispatcher never waits out a
timeout. What a role does with the session (stream samples, receive steps) lives in a
`PeerRole` the session calls: one more call per message, for one copy of the mechanism.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

import zmq

from dispatcher_server import protocol as P
from dispatcher_server.endpoint import allow_ipv6
from dispatcher_server.security import PeerCurve

log = logging.getLogger("mmdispatch.session")

#: How long a closing socket may take to hand its BYE to the network.
_BYE_LINGER_MS = 250


@dataclass(kw_only=True, slots=True)
class SessionConfig:
    address: str  # tcp://HOST:PORT of the dispatcher endpoint
    heartbeat_s: float | None = None  # None: the interval the dispatcher's WELCOME says
    timeout_s: float = 5.0  # dispatcher silent this long: reconnect
    connect_timeout_s: float | None = 60.0  # no WELCOME this long after connecting starts: give up
    poll_ms: int = 50
    backoff_min_s: float = 0.1
    backoff_max_s: float = 5.0
    curve: PeerCurve | None = None

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s} must be > 0")
        if self.connect_timeout_s is not None and not self.connect_timeout_s > 0:
            raise ValueError(f"connect_timeout_s={self.connect_timeout_s} must be > 0 (or None)")
        if self.heartbeat_s is not None and not 0 < self.heartbeat_s < float("inf"):
            raise ValueError(f"heartbeat_s={self.heartbeat_s} must be a finite number > 0 (or None: "
                             f"the dispatcher's)")
        # zmq polls forever at -1: the session could then miss every timeout; 0 spins a core.
        if not isinstance(self.poll_ms, int) or self.poll_ms < 1:
            raise ValueError(f"poll_ms={self.poll_ms!r} must be an int >= 1")
        if not 0 <= self.backoff_min_s <= self.backoff_max_s:
            raise ValueError(f"need 0 <= backoff_min_s ({self.backoff_min_s}) <= backoff_max_s "
                             f"({self.backoff_max_s})")


class Disconnected(Exception):
    """A send found no live connection: the session drops the socket and reconnects."""


class Unreachable(ConnectionError):
    """No dispatcher welcomed this peer within the connect timeout (or the address is invalid)."""


class PeerRole(Protocol):
    """What a reader or trainer does with its session; the session calls these."""

    def hello_fields(self) -> dict[str, Any]:
        """HELLO's fields besides the version and seq (role, name, ...)."""

    def reset(self) -> None:
        """The dispatcher no longer knows this peer's state: a HELLO is about to go out."""

    def on_welcome(self, session: PeerSession, msg: P.Message) -> None:
        """The dispatcher accepted the HELLO; raise to end the session for good."""

    def on_message(self, session: PeerSession, msg: P.Message) -> bool:
        """Act on any other message; False drops the connection and reconnects."""

    def tick(self, session: PeerSession) -> bool:
        """Work between polls; True when more is ready at once (the next poll does not wait)."""

    # Optional: `bye_fields() -> dict`, BYE's fields besides the seq (a trainer's `next_step`).


class PeerSession:
    """`run(stop)` until `stop` is set or the role calls `finish()`; raises what the role raises
    (a refusal) and `Unreachable`. Any other ERROR than `unknown_peer` goes to the role."""

    def __init__(self, config: SessionConfig, role: PeerRole, *, context: zmq.Context | None = None,
                 name: str = "peer") -> None:
        self.config = config
        self.role = role
        self.name = name  # in log events: reader, client
        self.ctx = context or zmq.Context.instance()
        self.sock: zmq.Socket | None = None
        self.welcomed = False
        self.num_reconnects = 0
        self._heartbeat_s = config.heartbeat_s or 1.0
        # Silence before reconnecting: `timeout_s`, or more once the dispatcher's WELCOME says it
        # heartbeats more slowly (serve --heartbeat 6 made idle peers rejoin every 5 s).
        self._silence_s = config.timeout_s
        self._seq = 0
        self._hello_seq = -1
        self._last_recv = self._last_sent = 0.0
        self._since = 0.0  # since when no WELCOME holds (run() sets it)
        self._finished = False

    # -- used by roles ---------------------------------------------------------------------
    def send(self, type_: str, frames=(), **fields) -> int:
        """Send one message without blocking; its seq. Raises Disconnected when it cannot go."""
        self._seq += 1
        try:
            # A DEALER with no live connection blocks on send; a peer must never hang there.
            self.sock.send_multipart(P.encode(type_, seq=self._seq, frames=frames, **fields),
                                     zmq.NOBLOCK, copy=False)
        except zmq.Again:
            raise Disconnected(type_) from None
        self._last_sent = time.monotonic()
        return self._seq

    def keepalive(self) -> None:
        """A heartbeat if one is due, from a long step inside this session's own thread (a
        long header walk, `pipeline.keepalive`): the dispatcher hears the peer is alive."""
        if self.welcomed and time.monotonic() - self._last_sent > self._heartbeat_s:
            try:
                self.send(P.HEARTBEAT)
            except Disconnected:
                pass

    def hello(self) -> None:
        """Say HELLO again on this connection (the dispatcher forgot us, or the role resyncs)."""
        if self.welcomed:
            self._since = time.monotonic()  # the connect timeout counts from losing the welcome
        self.welcomed = False
        self.role.reset()
        self._hello_seq = self.send(P.HELLO, **self.role.hello_fields())

    def finish(self) -> None:
        """End the session cleanly after the current message (BYE, then `run` returns)."""
        self._finished = True

    # -- the loop --------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        cfg = self.config
        backoff = cfg.backoff_min_s
        self._since = time.monotonic()  # when this attempt to get welcomed began
        try:
            while not self._done(stop):
                try:
                    self._connect()
                    why = self._serve(stop)
                except Disconnected as e:
                    why = f"{e} could not be sent: no connection to the dispatcher"
                if self._done(stop):
                    break
                healthy = self.welcomed
                self._close(bye=False)
                if healthy:
                    self._since, backoff = time.monotonic(), cfg.backoff_min_s
                else:
                    backoff = min(2 * backoff, cfg.backoff_max_s)
                self._check_connect_timeout()
                self.num_reconnects += 1
                log.warning("mmdispatch event=%s_reconnect dispatcher=%s backoff_s=%.2f why=%r",
                            self.name, cfg.address, backoff, why)
                stop.wait(backoff)
        finally:
            self._close(bye=True)  # leaving on purpose or for a reason: the dispatcher hears it now

    def _done(self, stop: threading.Event) -> bool:
        return self._finished or stop.is_set()

    def _connect(self) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        P.socket_limits(sock)
        try:
            if self.config.curve is not None:
                self.config.curve.apply(sock)
            allow_ipv6(sock, self.config.address)
            sock.connect(self.config.address)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            raise Unreachable(f"cannot connect to dispatcher at {self.config.address!r}: {e}") from None
        self.sock = sock
        self._last_recv = time.monotonic()
        self.hello()

    def _close(self, *, bye: bool) -> None:
        sock, self.sock = self.sock, None
        if sock is None:
            return
        linger = 0
        if bye and self.welcomed:
            try:
                fields = getattr(self.role, "bye_fields", dict)()
                sock.send_multipart(P.encode(P.BYE, seq=self._seq + 1, **fields), zmq.NOBLOCK)
                linger = _BYE_LINGER_MS  # time for the BYE to leave; never longer
            except zmq.ZMQError:
                pass
        sock.close(linger=linger)
        self.welcomed = False
        self.role.reset()

    def _serve(self, stop: threading.Event) -> str:
        """One connection, until it goes silent, a role drops it, or the session ends; why it
        ended, for the reconnect line."""
        cfg = self.config
        busy = False
        while not self._done(stop):
            if self.sock.poll(0 if busy else cfg.poll_ms, zmq.POLLIN):
                for frames in P.pending(self.sock):
                    self._last_recv = time.monotonic()
                    if not self._handle(frames):
                        return "its role dropped the connection on the dispatcher's last message"
                    if self._finished:
                        return "finished"
            busy = self.role.tick(self)
            now = time.monotonic()
            # Messages waiting were heard: a tick that took long (a long header walk, which
            # heartbeats through `keepalive`) read none of them yet.
            if now - self._last_recv > self._silence_s and not self.sock.poll(0, zmq.POLLIN):
                heard = "no WELCOME" if not self.welcomed else "nothing"
                return (f"{heard} from the dispatcher for {self._silence_s:g} s (stopped, "
                        "restarted, or unreachable)")
            if not self.welcomed:
                self._check_connect_timeout()
            elif now - self._last_sent > self._heartbeat_s:
                self.send(P.HEARTBEAT)
        return "finished"

    def _check_connect_timeout(self) -> None:
        """Unreachable once no WELCOME came for `connect_timeout_s` since the session started,
        or since it last lost one (a dropped connection, or a dispatcher that forgot it)."""
        limit = self.config.connect_timeout_s
        if limit is not None and time.monotonic() - self._since > limit:
            raise Unreachable(f"no dispatcher answered at {self.config.address} within "
                              f"{limit:g} s (check the address, that the dispatcher runs, and "
                              f"its CurveZMQ keys; raise --connect-timeout, connect_timeout_s "
                              f"from Python, to wait longer)")

    def _handle(self, frames) -> bool:
        try:
            msg = P.decode(frames)
        except P.ProtocolError as e:
            log.warning("mmdispatch event=%s_bad_message dispatcher=%s detail=%r",
                        self.name, self.config.address, str(e)[:200])
            return True
        if msg.type == P.WELCOME:
            if msg["ack"] == self._hello_seq:
                self.welcomed = True
                if self.config.heartbeat_s is None:
                    self._heartbeat_s = float(msg["heartbeat_s"])
                # three of the dispatcher's heartbeats may go by before it counts as silent
                self._silence_s = max(self.config.timeout_s, 3.0 * float(msg["heartbeat_s"]))
                self.role.on_welcome(self, msg)
            return True
        if msg.type == P.ERROR and msg["code"] == "unknown_peer":
            # The dispatcher restarted or timed us out: introduce ourselves again, once. Each
            # message sent before that HELLO draws its own refusal (`ack`: the message's seq),
            # and a HELLO for each made a restarted dispatcher take the peer up to 8 times.
            refused = msg.get("ack")
            if refused is None or refused > self._hello_seq:
                self.hello()
            return True
        return self.role.on_message(self, msg)
