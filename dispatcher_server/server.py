"""The dispatcher: one ROUTER for readers, one for trainers, and a single poll loop between them.

After every poll it handles messages, then pumps: open shards in the order window, assign them
to idle readers, move samples into the step being filled, plan and journal full steps, send each
rank its part within its credits, drop steps every rank acknowledged, grant reader credits,
expire silent peers and send heartbeats. One thread owns all state, so there are no locks; the
price is that planning a step pauses receiving, which credits absorb.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import zmq

from dispatcher_server import protocol as P
from dispatcher_server.batching import Sample, header_problem
from dispatcher_server.config import ServerConfig
from dispatcher_server.journal import Journal, JournalError, unpack_cursor
from dispatcher_server.metrics import Metrics, event
from dispatcher_server.ordering import Cursor, ShardOrder
from dispatcher_server.peers import Assignment, Reader, RetainedStep, ShardProgress, TrainerSlot
from dispatcher_server.planner.types import Topology
from dispatcher_server.pump import Pump
from dispatcher_server.steplog import StepLog


def _bind_retrying(sock: zmq.Socket, addr: str, timeout_s: float = 5.0) -> None:
    """Bind, waiting out a previous owner of a fixed port whose close is still in flight."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock.bind(addr)
            return
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class Dispatcher(Pump):
    """Bind, then `run()` (blocking) or `start()` (background thread); `stop()` ends the loop."""

    def __init__(self, config: ServerConfig, *, context: zmq.Context | None = None) -> None:
        self.config = config
        self.ctx = context or zmq.Context.instance()
        self.order = ShardOrder(config.shards, config.seed, config.max_epochs)
        self.topology = Topology(world_size=config.world_size, ranks_per_node=config.ranks_per_node)
        # The journal first: a restore that cannot be honoured fails before anything is opened.
        self.journal = (Journal(config.journal_dir, config.fingerprint(), fsync=config.journal_fsync,
                                plan_file_bytes=config.journal_plan_file_bytes)
                        if config.journal_dir else None)
        self.metrics = Metrics(config.metrics_port, config.metrics_host)
        self.step_log = StepLog(config.step_log) if config.step_log else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._auth = None
        self._seq = 0
        self._next_assign = 1
        self.readers: dict[bytes, Reader] = {}
        self.slots = [TrainerSlot(rank=r) for r in range(config.world_size)]
        # Without a journal: step -> cursor after it, packed, from the last commit on (with one
        # the journal keeps them, on disk for all but the uncommitted steps).
        self.cursors: dict[int, bytes] = {}
        self._committed = -1
        self.skipped: list[tuple[str, str]] = []
        self._bytes_seen = self._samples_seen = 0
        start = 0
        if self.journal is not None:
            start = self.journal.last_committed + 1
        try:
            self._reset(start, Cursor.from_wire(self._cursor_before(start)))
            self._bind()
        except BaseException:
            for sock in (getattr(self, "reader_sock", None), getattr(self, "trainer_sock", None)):
                if sock is not None:
                    sock.close(linger=0)
            if self._auth is not None:
                self._auth.stop()
            self.metrics.close()
            if self.journal is not None:
                self.journal.close()
            raise

    # -- setup ------------------------------------------------------------------------
    def _bind(self) -> None:
        cfg = self.config
        curve = cfg.curve
        if curve is not None:
            from dispatcher_server.security import apply_server_curve, start_authenticator

            self._auth = start_authenticator(self.ctx, curve.allowed_keys_dir)
        self.reader_sock = self.ctx.socket(zmq.ROUTER)
        self.trainer_sock = self.ctx.socket(zmq.ROUTER)
        for sock, addr in ((self.reader_sock, cfg.reader_bind), (self.trainer_sock, cfg.trainer_bind)):
            P.socket_limits(sock, cfg.limits)
            if curve is not None:
                apply_server_curve(sock, curve.server_secret_file)
            _bind_retrying(sock, addr)
        self.reader_endpoint = self.reader_sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.trainer_endpoint = self.trainer_sock.getsockopt_string(zmq.LAST_ENDPOINT)
        event("bound", readers=self.reader_endpoint, trainers=self.trainer_endpoint,
              next_step=self.next_plan, metrics_port=self.metrics.port)

    def _cursor_before(self, step: int) -> dict:
        if step == 0:
            return Cursor().to_wire()
        if self.journal is not None:
            return self.journal.cursor_after(step - 1)
        if step - 1 not in self.cursors:
            raise JournalError(f"cannot resume at step {step}: without a journal the dispatcher "
                               f"knows the steps from the last commit on "
                               f"({min(self.cursors, default=0)}..{max(self.cursors, default=-1)}); "
                               "run it with --journal-dir to resume further back")
        return unpack_cursor(self.cursors[step - 1])

    def _reset(self, step: int, cursor: Cursor) -> None:
        """Start (or rewind) delivery at `step` whose first sample is at `cursor`."""
        for r in self.readers.values():
            for a in r.assignments:
                self._send_reader(r, P.CANCEL, assign_id=a.id)
            r.assignments.clear()
        self.cursor = cursor
        self.progress: dict[int, ShardProgress] = {}
        self.assignments: dict[int, Assignment] = {}
        self.arrival: deque[list[int]] = deque()  # [pos, count] runs, in arrival order
        self.acc: list[Sample] = []
        self.acc_tokens = self.acc_bytes = 0
        self.acc_cut = False
        self.retained: deque[RetainedStep] = deque()
        self.next_plan = step
        for slot in self.slots:
            # A rank already past `step` (its credits say so) keeps its place: lowering it would
            # hold every later step until that rank, which never asks again, acknowledged them.
            slot.next_send = slot.received = max(step, slot.received)
            slot.end_sent = False
        self.replay = {}
        if self.journal is not None:
            # A dict of its own: a commit arriving before a step is replayed (a rank ahead of
            # another) drops the journal's entries up to it, and the step must still replay.
            self.replay = {s: e for s, e in self.journal.pending.items()
                           if s >= step and e.plan is not None
                           and e.world_size == self.config.world_size}

    # -- lifecycle --------------------------------------------------------------------
    def start(self) -> Dispatcher:
        self._thread = threading.Thread(target=self.run, name="mmdispatch-server", daemon=True)
        self._thread.start()
        return self

    def stop_soon(self) -> None:
        """Ask the loop to end after its current iteration (signal-handler safe)."""
        self._stop.set()

    def done(self) -> bool:
        """The stream ended, every rank was told so and acknowledged its last step. (END queued
        is not enough: a server exiting then drops what a slow rank has not yet read.)"""
        return self._finished() and all(s.end_sent and s.received >= self.next_plan
                                        for s in self.slots)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def run(self, until_done: bool = False) -> None:
        poller = zmq.Poller()
        poller.register(self.reader_sock, zmq.POLLIN)
        poller.register(self.trainer_sock, zmq.POLLIN)
        live = self.config.liveness
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(live.poll_ms))
                if self.reader_sock in ready:
                    self._drain(self.reader_sock, self._on_reader)
                if self.trainer_sock in ready:
                    self._drain(self.trainer_sock, self._on_trainer)
                self._pump()
                self._liveness(time.monotonic())
                if until_done and self.done():
                    break
        finally:
            # After the end of the stream, give the queued END messages a moment to leave.
            self._close(linger_ms=2000 if until_done and self.done() else 0)

    def _close(self, linger_ms: int = 0) -> None:
        for sock in (self.reader_sock, self.trainer_sock):
            sock.close(linger=linger_ms)
        if self._auth is not None:
            self._auth.stop()
        if self.journal is not None:
            self.journal.close()
        if self.step_log is not None:
            self.step_log.close()
        self.metrics.close()

    # -- receiving --------------------------------------------------------------------
    def _drain(self, sock: zmq.Socket, handler, budget: int = 256) -> None:
        role = "reader" if sock is self.reader_sock else "trainer"
        for frames in P.pending(sock, budget):
            ident, body = frames[0].bytes, frames[1:]
            self.metrics.bytes_in_of[role].inc(sum(len(f) for f in body))
            try:
                msg = P.decode(body, self.config.limits)
            except P.ProtocolError as e:
                self.metrics.error(e.code, role=role, detail=str(e)[:200])
                if e.code == "version":
                    msg_text = (f"protocol version mismatch: peer speaks v{e.peer_version}, "
                                f"dispatcher speaks v{P.VERSION}")
                else:
                    msg_text = str(e)
                self._send(sock, ident, P.ERROR, code=e.code, message=msg_text)
                continue
            try:
                handler(ident, msg, time.monotonic())
            except Exception as e:  # noqa: BLE001 - one odd message must not stop the service
                logging.getLogger("mmdispatch.server").exception("handling %s failed", msg.type)
                self.metrics.error("internal", role=role, type=msg.type, detail=repr(e)[:200])
                self._send(sock, ident, P.ERROR, code="internal",
                           message=f"{msg.type} could not be handled: {e!r}"[:500])

    def _on_reader(self, ident: bytes, msg: P.Message, now: float) -> None:
        reader = self.readers.get(ident)
        if msg.type == P.HELLO:
            if msg["role"] != "reader":
                self._send(self.reader_sock, ident, P.ERROR, code="role", ack=msg.seq,
                           message=f"role {msg['role']!r} connected to the reader endpoint")
                return
            if reader is not None:
                self._drop_reader(reader, "re-hello")
            self.readers[ident] = Reader(ident=ident, name=msg.get("name", ""), last_seen=now)
            self.metrics.peers.labels("reader").set(len(self.readers))
            event("reader_joined", name=msg.get("name", ""))
            self._send(self.reader_sock, ident, P.WELCOME, role="reader", ack=msg.seq,
                       heartbeat_s=float(self.config.liveness.heartbeat_s),
                       payloads=self.config.payloads)
            return
        if reader is None:
            self._refuse_unknown(self.reader_sock, ident, "reader", msg)
            return
        reader.last_seen = now
        if msg.type == P.SHARD_REQUEST:
            reader.ready = True
            reader.slots = max(1, min(int(msg.get("shards", 1)), P.MAX_READER_SHARDS))
        elif msg.type == P.SAMPLES:
            self._on_samples(reader, msg)
        elif msg.type == P.SHARD_DONE:
            self._on_shard_done(reader, msg)
        elif msg.type == P.BYE:
            self._drop_reader(reader, "bye")
        elif msg.type != P.HEARTBEAT:
            self.metrics.error("unexpected", role="reader", type=msg.type)
            self._send(self.reader_sock, ident, P.ERROR, code="unexpected",
                       message=f"{msg.type} is not a reader message")

    def _assignment_of(self, reader: Reader, assign_id: int) -> Assignment | None:
        a = self.assignments.get(assign_id)
        return a if a is not None and a.reader == reader.ident else None

    def _on_samples(self, reader: Reader, msg: P.Message) -> None:
        a = self._assignment_of(reader, msg["assign_id"])
        if a is None:
            self.metrics.error("stale_samples", reader=reader.name, assign_id=msg["assign_id"])
            self._send_reader(reader, P.CANCEL, assign_id=msg["assign_id"])
            return
        prog = self.progress[a.pos]
        if len(msg["samples"]) > a.credits:
            self.metrics.error("credit_overrun", reader=reader.name, sent=len(msg["samples"]),
                               credits=a.credits)
            # Refused whole, shard taken back (it restarts at next_index): a reader ignoring
            # credits must not grow the dispatcher past its memory bounds.
            self._take_back(reader, a)
            return
        sizes = msg.get("sizes")
        # Coalesced payloads: every item is a view of the one frame (no copy, no frame per item).
        views = msg.frames if sizes is None else P.split_payload(msg.frames[0], sizes)
        if self.config.payloads == "reference" and not P.refs_point_into(views, prog.ref_path):
            # Trainers read what references name: only the assigned shard's file may be named.
            self.metrics.error("bad_reference", reader=reader.name, shard=prog.url)
            self._take_back(reader, a)
            return
        # The message as one block: its samples move into the shard's buffer in a loop over
        # header fields (checked by decode), and the counters are updated once at the end.
        pos, append, next_index = a.pos, prog.buffer.append, prog.next_index
        item_bytes = sizes if sizes is not None else [v.nbytes for v in views]
        at = received = nbytes = 0
        bad: list[tuple[str, str]] = []
        for key, index, text_len, llm_len, text, items in msg["samples"]:  # P.SampleHeader
            start, at = at, at + len(items)
            if index < next_index:
                self.metrics.error("out_of_order", key=key, index=index)
                continue
            next_index = index + 1
            received += 1
            problem = header_problem(text_len, llm_len, items)
            if problem is not None:  # counted as read, reported as skipped: never planned
                bad.append((key, problem))
                continue
            size = len(text) + sum(item_bytes[start:at])
            append(Sample(key, pos, index, text_len, llm_len, text, items, views[start:at], size))
            nbytes += size
        kept = received - len(bad)
        prog.next_index = next_index
        prog.nbytes += nbytes
        a.received += received
        self._bytes_seen += nbytes
        self._samples_seen += kept
        if kept and self.config.mode == "arrival":
            runs = self.arrival
            if runs and runs[-1][0] == pos:
                runs[-1][1] += kept
            else:
                runs.append([pos, kept])
        a.credits = max(0, a.credits - len(msg["samples"]))
        self.metrics.samples_in.inc(len(msg["samples"]))
        if bad:
            self._skip(prog.url, bad)

    def _take_back(self, reader: Reader, a) -> None:
        """Cancel `a` and free its shard (it restarts at next_index: nothing is lost)."""
        self._send_reader(reader, P.CANCEL, assign_id=a.id)
        self._release(reader, a)

    def _release(self, reader: Reader, a: Assignment) -> None:
        """Forget assignment `a` (its shard's buffer and next_index stay: nothing is lost)."""
        prog = self.progress.get(a.pos)
        if prog is not None and prog.assignment == a.id:
            prog.assignment = None
        self.assignments.pop(a.id, None)
        reader.assignments.remove(a)

    def _on_shard_done(self, reader: Reader, msg: P.Message) -> None:
        a = self._assignment_of(reader, msg["assign_id"])
        if a is None:
            return
        prog = self.progress[a.pos]
        if msg["count"] != a.received:
            self.metrics.error("count_mismatch", shard=prog.url, sent=msg["count"], got=a.received)
        self._skip(prog.url, [(s.key, s.reason) for s in msg["skipped"]])
        prog.reader_done = True
        self._release(reader, a)

    def _skip(self, url: str, skipped: list[tuple[str, str]]) -> None:
        """Bad samples: reported by key (log, metrics, journal), so none is silently lost."""
        if not skipped:
            return
        self.skipped.extend(skipped)
        self.metrics.skipped.inc(len(skipped))
        for key, reason in skipped:
            event("sample_skipped", logging.WARNING, shard=url, key=key, reason=reason)
        if self.journal is not None:
            self.journal.record_skipped(url, skipped)

    def _refuse_unknown(self, sock: zmq.Socket, ident: bytes, role: str, msg: P.Message) -> None:
        self.metrics.error("unknown_peer", role=role, type=msg.type)
        self._send(sock, ident, P.ERROR, code="unknown_peer",
                   message="say hello first (the dispatcher may have restarted)")

    def _on_trainer(self, ident: bytes, msg: P.Message, now: float) -> None:
        if msg.type == P.HELLO:
            self._trainer_hello(ident, msg, now)
            return
        slot = next((s for s in self.slots if s.ident == ident), None)
        if slot is None:
            self._refuse_unknown(self.trainer_sock, ident, "trainer", msg)
            return
        slot.last_seen = now
        if msg.type == P.CREDIT:
            slot.upto = msg.get("upto", slot.upto)
            slot.received = max(slot.received, msg.get("received", slot.received))
        elif msg.type == P.COMMIT:
            self._commit(slot, msg["step"])
        elif msg.type == P.BYE:
            slot.ident = None
            self.metrics.peers.labels("trainer").set(sum(s.ident is not None for s in self.slots))
        elif msg.type != P.HEARTBEAT:
            self.metrics.error("unexpected", role="trainer", type=msg.type)
            self._send(self.trainer_sock, ident, P.ERROR, code="unexpected",
                       message=f"{msg.type} is not a trainer message")

    def _trainer_hello(self, ident: bytes, msg: P.Message, now: float) -> None:
        W = self.config.world_size

        def refuse(code: str, text: str) -> None:
            self.metrics.error(code, role="trainer", detail=text)
            self._send(self.trainer_sock, ident, P.ERROR, code=code, message=text, ack=msg.seq)

        rank, world = msg.get("rank"), msg.get("world_size")
        if msg["role"] != "trainer" or rank is None or world is None:
            return refuse("role", "trainer hello needs role='trainer', rank and world_size")
        if world != W:
            return refuse("world_size", f"trainer says world_size={world}, dispatcher plans for "
                          f"world_size={W}; restart the dispatcher with --world-size {world}")
        if not 0 <= rank < W:
            return refuse("rank", f"rank {rank} is outside [0, {W})")
        slot = self.slots[rank]
        want = msg.get("next_step")
        want = slot.received if want is None else want
        lowest = self.retained[0].step if self.retained else self.next_plan
        target = want
        if want > self.next_plan:
            # A reset moves every rank to its step: never past a connected rank that is behind.
            target = min([want] + [s.received for s in self.slots
                                   if s.ident is not None and s is not slot])
        if not lowest <= target <= self.next_plan:
            try:
                cursor = Cursor.from_wire(self._cursor_before(target))
            except JournalError as e:
                return refuse("resume", str(e))
            event("rewind", step=target, requested_by=rank)
            self._reset(target, cursor)
        slot.ident, slot.last_seen, slot.end_sent = ident, now, False
        slot.next_send = slot.received = want
        slot.upto = want + max(1, msg.get("prefetch", 1))
        self.metrics.peers.labels("trainer").set(sum(s.ident is not None for s in self.slots))
        event("trainer_joined", rank=rank, next_step=want)
        self._send(self.trainer_sock, ident, P.WELCOME, role="trainer", ack=msg.seq,
                   heartbeat_s=float(self.config.liveness.heartbeat_s), world_size=W,
                   next_step=want, num_microbatches=self.config.planner.num_microbatches,
                   payloads=self.config.payloads)

    def _commit(self, slot: TrainerSlot, step: int) -> None:
        try:
            if self.journal is not None and self.journal.commit(step):
                event("commit", step=step, rank=slot.rank)
            elif self.journal is None and step > self._committed:
                # Steps before a commit are never resumed from: their cursors go.
                for s in range(max(0, self._committed), step):
                    self.cursors.pop(s, None)
                self._committed = step
        except JournalError as e:
            self.metrics.error("commit", detail=str(e))
            self._send(self.trainer_sock, slot.ident, P.ERROR, code="commit", message=str(e))
            return
        self._send(self.trainer_sock, slot.ident, P.COMMIT, step=step)  # durable now: tell it

    # -- liveness and sending -------------------------------------------------------
    def _liveness(self, now: float) -> None:
        live = self.config.liveness
        for reader in list(self.readers.values()):
            if now - reader.last_seen > live.timeout_s:
                self._drop_reader(reader, "timeout")
            elif now - reader.last_sent > live.heartbeat_s:
                self._send_reader(reader, P.HEARTBEAT)
        for slot in self.slots:
            if slot.ident is None:
                continue
            if now - slot.last_seen > live.timeout_s:
                event("trainer_lost", logging.WARNING, rank=slot.rank)
                slot.ident = None
                self.metrics.peers.labels("trainer").set(sum(s.ident is not None for s in self.slots))
            elif now - slot.last_sent > live.heartbeat_s:
                self._send(self.trainer_sock, slot.ident, P.HEARTBEAT)
                slot.last_sent = now

    def _drop_reader(self, reader: Reader, why: str) -> None:
        shards = [self.order.url(a.pos) for a in reader.assignments]
        for a in list(reader.assignments):
            self._release(reader, a)
        self.readers.pop(reader.ident, None)
        self.metrics.peers.labels("reader").set(len(self.readers))
        event("reader_left", logging.WARNING if why == "timeout" else logging.INFO,
              name=reader.name, why=why, shards=",".join(shards) or None)

    def _send_reader(self, reader: Reader, type_: str, **fields) -> None:
        self._send(self.reader_sock, reader.ident, type_, **fields)
        reader.last_sent = time.monotonic()

    def _send(self, sock: zmq.Socket, ident: bytes, type_: str, **fields) -> None:
        self._seq += 1
        role = "reader" if sock is self.reader_sock else "trainer"
        self._send_frames(sock, ident, P.encode(type_, seq=self._seq, **fields), role)

    def _send_frames(self, sock: zmq.Socket, ident: bytes, frames: list, role: str) -> None:
        self.metrics.bytes_out_of[role].inc(sum(memoryview(f).nbytes for f in frames))
        sock.send_multipart([ident, *frames], copy=False)
