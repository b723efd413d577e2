"""The dispatcher: one ROUTER for readers, one for trainers, and a single poll loop between them.

This module is socket I/O and message dispatch only; the decisions live in parts that own
their state and are tested without sockets: the step assembler (window, shard progress,
cursor, the step being filled), the reader pool (who reads which shard), credit control,
delivery (retained steps, sends, END) and the replay source (journal, cursors, commits).
After every poll the loop pumps them in that order, expires silent peers and heartbeats. One
thread owns all state, so there are no locks; planning a step pauses receiving, which credits
absorb. A journal write that fails stops the loop (the journal on disk stays consistent and a
restart resumes from it); so does a step the planner refuses, once, with the samples named.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from time import thread_time

import zmq

from dispatcher_server import protocol as P
from dispatcher_server.assembler import StepAssembler
from dispatcher_server.batching import build_batch, step_messages
from dispatcher_server.blend import as_drawn, differing
from dispatcher_server.cliopts import event_line
from dispatcher_server.config import DATASET_FINGERPRINT_DEFAULTS, ServerConfig
from dispatcher_server.credits import Holdings, grants
from dispatcher_server.delivery import Delivery, RetainedStep, TrainerSlot
from dispatcher_server.endpoint import allow_ipv6
from dispatcher_server.halt import Halt, oversize_report
from dispatcher_server.inputs import InputRules
from dispatcher_server.journal import Journal, JournalError, JournalWriteError, StepEntry
from dispatcher_server.measure import StepMeasurements
from dispatcher_server.metrics import Metrics, SkipLog, event
from dispatcher_server.ordering import ShardOrder
from dispatcher_server.planner import OversizeWarning, PlanError, plan_step
from dispatcher_server.planner.plan import StepPlan
from dispatcher_server.planner.types import Topology
from dispatcher_server.readerpool import Assignment, Reader, ReaderPool, process
from dispatcher_server.replay import OTHER_SAMPLES, ReplaySource
from dispatcher_server.steplog import StepLog, plan_record

log = logging.getLogger("mmdispatch.server")

#: Steps without a commit after which the dispatcher warns (once) that the replay history it
#: keeps for them (memory; with a journal, plan files on disk too) keeps growing.
COMMITS_LAG_STEPS = 10_000
#: With --exit-when-done, how long a finished job whose rank was lost (no BYE) with steps after
#: its last commit waits for a restarted job to resume them from its checkpoint.
LOST_RANK_GRACE_S = 300.0
#: Steps planned before the token budget's empty micro-batches are said, with a budget advised
#: from the samples so far (a cut step's own lacks the sample that did not fit; a few steps'
#: samples gave an estimate that, followed, still cut a fifth to a half of the steps).
BUDGET_MEAN_STEPS = 16
#: How long a job that stopped on its own (`fatal`) waits for ranks not yet told why to
#: connect and be sent END with the reason, before it exits.
HALT_LINGER_S = 120.0
#: Factor past --max-buffered-bytes at which the bytes the assembler holds (shard buffers,
#: shuffle blocks, the step being filled) are worth a warning: credits in flight when the bound
#: is reached overshoot it a little; shuffle blocks larger than it overshoot it by far.
BYTES_OVER_WARN = 1.25
#: Seconds after the last reader joined from which a shard taken back for a starving head
#: means the readers have too few slots (and the dispatcher says so), not that they are joining.
SLOTS_WARN_AFTER_S = 5.0
#: How long a shard that a reader could not open (`open_failed`: a missing mount or file, or no
#: permission, on its node) waits for a reader that can, once every reader here failed on it,
#: before it is skipped as unreadable.
OPEN_RETRY_S = 30.0
#: No reader connected this long while input is left: said once an outage (`_check_readers`).
NO_READERS_WARN_S = 10.0
#: Complete shuffle blocks of a source drawn from one shard each before the dispatcher says so.
ONE_SHARD_BLOCKS_WARN = 3


class Fatal(Exception):
    """The dispatcher must stop: the message says why and what to do."""


def _bind_retrying(sock: zmq.Socket, addr: str, timeout_s: float = 5.0) -> None:
    """Bind, waiting out a previous owner of a fixed port whose close is still in flight."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            allow_ipv6(sock, addr)
            sock.bind(addr)
            return
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@dataclass(slots=True)
class _LengthTally:
    """Steps planned, and the count, sum and sum of squares of their samples' LLM lengths."""

    steps: int = 0
    samples: int = 0
    total: float = 0.0
    squares: float = 0.0

    def add(self, lengths) -> None:
        values = lengths.astype("float64")
        self.steps += 1
        self.samples += len(values)
        self.total += float(values.sum())
        self.squares += float(values @ values)

    def mean_std(self) -> tuple[float, float]:
        mean = self.total / self.samples
        return mean, math.sqrt(max(0.0, self.squares / self.samples - mean * mean))


class Dispatcher:
    """Bind, then `run()` (blocking) or `start()` (background thread); `stop()` ends the loop.

    After `run()` returns, `fatal` holds the reason if the dispatcher stopped on its own
    (a failed journal write, a step the planner refused); None otherwise.
    """

    def __init__(self, config: ServerConfig, *, context: zmq.Context | None = None) -> None:
        self.config = config
        self.ctx = context or zmq.Context.instance()
        self.topology = Topology(world_size=config.world_size, ranks_per_node=config.ranks_per_node)
        self.dataset = config.dataset_fingerprint()
        # In every step log plan record: `mmdispatch report` refuses to merge logs of two jobs
        # (a job resumed with its weights written another way is the same job).
        self._dataset_id = hashlib.blake2b(
            json.dumps(as_drawn(self.dataset), sort_keys=True).encode(), digest_size=6).hexdigest()
        self.inputs = InputRules()  # the rules model inputs follow, as the first peers state them
        self.fatal: str | None = None
        self._halt = Halt(config.journal_dir, config.planner) if config.journal_dir else None
        if self._halt is not None:
            self._halt.check()  # a job the planner ended does not start into the same step
        # The journal first: a restore that cannot be honoured fails before anything is opened.
        journal = (Journal(config.journal_dir, config.fingerprint(), fsync=config.journal_fsync,
                           plan_file_bytes=config.journal_plan_file_bytes,
                           journal_file_bytes=config.journal_file_bytes,
                           keep_commits=config.journal_keep_commits)
                   if config.journal_dir else None)
        self.journal = journal
        try:
            if journal is not None:
                self.inputs.keep_beside(config.journal_dir, resume=journal.last_step >= 0)
            self.step_log = StepLog(config.step_log) if config.step_log else None
            self.metrics = Metrics(config.metrics_port, config.metrics_host)
        except BaseException:
            if journal is not None:
                journal.close()
            if getattr(self, "step_log", None) is not None:
                self.step_log.close()
            raise
        self.skip_log = SkipLog(self.metrics)
        # members no field map names, by source, then suffix (the step log shows the totals)
        self.ignored_members: dict[str, Counter] = {}
        # samples readers cut to their --max-seq-len, by source (the step log shows the totals)
        self.truncated_samples: Counter = Counter()
        one = len(config.sources) == 1
        orders = [ShardOrder(src.shards, config.seed, config.max_epochs, salt="" if one else src.name)
                  for src in config.sources]
        self.assembler = StepAssembler(orders, mode=config.mode, batch=config.batch,
                                       names=[src.name for src in config.sources],
                                       weights=config.weights, windows=config.windows,
                                       block_sizes=config.block_sizes, seed=config.seed,
                                       mixes=config.mixes)
        # Positions drain in order (one source, a shuffle block's shards one after another):
        # a lower position waiting takes a higher one's reader slot (`_assign`).
        self._in_order = len(config.sources) == 1 and config.mixes == [1]
        # A shard's buffer cap, derived from the flow bounds, weights and windows: taken once,
        # not at every pump's credit grants.
        self._shard_cap = config.shard_cap
        # What readers need to read a source's shards: its name and field map (SHARD_ASSIGN).
        self._source_fields = [({"source": src.name} if not one else {})
                               | ({"fields": src.fields} if src.fields else {})
                               for src in config.sources]
        self.pool = ReaderPool()
        self.delivery = Delivery(config.world_size, config.flow.max_retained_steps,
                                 config.flow.max_buffered_bytes)
        # Before any refit moves the cost model: the settings as started, as a restart compares.
        self.replay = ReplaySource(journal, config.world_size, config.plan_settings())
        if self.replay.anew is not None:
            step, diff = self.replay.anew
            event("journaled_steps_planned_anew", logging.WARNING, from_step=step,
                  settings="; ".join(diff),
                  detail="the journal's steps from there on were planned under other settings: "
                         "each is planned anew from the same samples as it is replayed")
        self.measurements = StepMeasurements(config.world_size, config.refit)
        # Loop CPU by part, in plain floats on the hot path; exported once a poll interval.
        self._cpu = dict.fromkeys(self.metrics.cpu_of, 0.0)
        self._cpu_mark = thread_time()  # the loop thread's CPU when the parts were last exported
        self._stop = threading.Event()
        # Set once the planner's kernels are loaded: `serve` compiles them (half a minute on a
        # fresh install) while this loop already answers HELLO and heartbeats, so peers join
        # once and wait, instead of timing out and rejoining; steps are planned once it is set.
        self.planner_ready = threading.Event()
        self.planner_ready.set()
        self._thread: threading.Thread | None = None
        self._auth = None
        self._seq = 0
        self._readers_ended = False
        self._topology_warned = False  # a trainer's local_world_size differs from ranks_per_node
        self._slots_warned = False  # a blend has more sources than reader slots
        self._reader_joined_at = 0.0  # monotonic: the last reader HELLO
        self._no_readers_since: float | None = None  # monotonic: no reader connected since then
        self._no_readers_said = False  # event=no_readers said for this outage
        self._ranks_gone_said = False  # event=ranks_gone said since a rank last joined
        # The steps ("A-B") a done job waited LOST_RANK_GRACE_S for a restart to resume, in
        # vain: it exits with them untrained, and says so (not as a job done).
        self.resume_wait_over: str | None = None
        # position -> [its skip records, last try granted]: shards no reader opened yet, and
        # since when some have waited (a wait counts from then, or from a later reader join)
        self._unopened: dict[int, list] = {}
        self._unopened_since = 0.0
        self._unopened_none_at = -math.inf  # when the last of them was settled
        self._commits_lag_warned = False  # no commit for COMMITS_LAG_STEPS steps
        self._done_at: float | None = None  # when done() was first seen with that grace due
        self._one_shard_warned: set[str] = set()  # sources whose shuffle blocks hold one shard each
        self._budget_warned: set[str] = set()  # token-budget events said once a run
        self._budget_seen = _LengthTally()  # steps planned and their samples' LLM lengths
        self._budget_cut: tuple | None = None  # (step, samples, M): the first the budget cut
        self._block_bytes_warned = False  # shuffle blocks held past max_buffered_bytes (_gauges)
        self._stream_end_said = False  # event=stream_end logged (_send_ends); _reset clears it
        # The newest step handed out this run, across rewinds, and the commits of steps past
        # the newest planned since a rewind (a rank ahead of another restarted from an older
        # checkpoint): (trainer identity, rank, HELLO seq, step), answered once it is planned.
        self._planned_high = -1
        self._held_commits: list[tuple[bytes, int, int, int]] = []
        self._live_due = 0.0  # before this moment no peer is silent or idle long enough (_liveness)
        start = self.replay.committed + 1
        self._first_step = start  # where ranks not heard from yet may start (_fresh_step)
        try:
            self._reset(start)
            self._bind()
        except BaseException:
            self._close()
            raise

    # -- views of the parts, for operators and tests ---------------------------------
    @property
    def next_plan(self) -> int:
        return self.delivery.next_plan

    @property
    def slots(self) -> list[TrainerSlot]:
        return self.delivery.slots

    @property
    def retained(self):
        return self.delivery.retained

    @property
    def readers(self) -> dict[bytes, Reader]:
        return self.pool.readers

    @property
    def progress(self):
        return self.assembler.progress

    @property
    def skipped(self) -> list[tuple[str, str]]:
        return self.skip_log.keys

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

    def _reset(self, step: int) -> None:
        """Start (or rewind) delivery at `step`; JournalError if its cursor is not known."""
        cursor = self.replay.cursor_before(step)
        for reader in self.pool.readers.values():
            for a in list(reader.assignments):
                self._take_back(reader, a)
        # Arrival mode: the recorded steps are taken again in the order they took their samples.
        self.assembler.reset(cursor, self.replay.took_from(step))
        self.delivery.reset(step)
        self.replay.reset(step)
        self._stream_end_said = False  # a rewind reads to the end again, and says so again

    # -- lifecycle --------------------------------------------------------------------
    def start(self) -> Dispatcher:
        self._thread = threading.Thread(target=self.run, name="mmdispatch-server", daemon=True)
        self._thread.start()
        return self

    def stop_soon(self) -> None:
        """Ask the loop to end after its current iteration (signal-handler safe)."""
        self._stop.set()

    def finished(self) -> bool:
        """No step will ever be planned again (data or step budget exhausted, or halted)."""
        max_steps = self.config.max_steps
        return (self.fatal is not None or self.assembler.exhausted
                or (max_steps is not None and self.next_plan >= max_steps))

    def done(self, now: float | None = None) -> bool:
        """The stream ended, every rank was told so, acknowledged its last step and left (BYE,
        or silence past the timeout). END queued is not enough: a server exiting then drops
        what a slow rank has not yet read; nor is the last step received: a rank still training
        on its prefetched steps commits them later, and the commit must find the dispatcher."""
        return (self.finished() and self.delivery.all_received(self._finished_before(now))
                and self.delivery.connected() == 0)

    def _finished_before(self, now: float | None) -> bool:
        """Whether ranks this dispatcher never heard from count as finished: the journal's commit
        covers the last step, and LOST_RANK_GRACE_S passed since it started, so a rank that
        finished with the dispatcher before a restart (it said BYE there and will not come back)
        does not hold the exit for good, while one restored from an older checkpoint of its own
        (the journal keeps only the latest commit of any rank) has that long to come back."""
        if now is None or not 0 <= self.next_plan - 1 <= self.replay.committed:
            return False
        if now - self._started_at < LOST_RANK_GRACE_S:
            if not self._unheard_said and any(not s.heard for s in self.delivery.slots):
                self._unheard_said = True
                event("waiting_for_ranks", logging.WARNING,
                      ranks=",".join(str(s.rank) for s in self.delivery.slots if not s.heard),
                      seconds=int(LOST_RANK_GRACE_S),
                      why="the job's last step is committed, but these ranks were not heard "
                          "since the restart: one restored from an older checkpoint resumes here")
            return False
        return True

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def run(self, until_done: bool = False) -> None:
        poller = zmq.Poller()
        poller.register(self.reader_sock, zmq.POLLIN)
        poller.register(self.trainer_sock, zmq.POLLIN)
        self._checked = self._halted_at = 0.0
        self._started_at, self._unheard_said = time.monotonic(), False
        self._heard = dict.fromkeys(("reader", "trainer"), time.monotonic())
        # (role, socket, handler, loop CPU part) of each socket the loop drains
        self._inputs = (("reader", self.reader_sock, self._on_reader, "intake"),
                        ("trainer", self.trainer_sock, self._on_trainer, "acks"))
        self._cpu_mark = thread_time()  # this thread's: run() may not be on the constructor's
        linger = None
        try:
            while not self._stop.is_set() and linger is None:
                self._iterate(poller)
                linger = self._leaving(until_done, time.monotonic())
        finally:
            self.skip_log.flush(None)
            self._log_measured(self.measurements.drain(self.config.planner.cost))
            self._export_cpu()
            self._close(linger_ms=linger or 0)

    def _iterate(self, poller: zmq.Poller) -> None:
        """One poll: take what arrived, pump, and (once a poll interval) check every peer."""
        live = self.config.liveness
        ready = dict(poller.poll(live.poll_ms))
        polled = time.monotonic()
        try:
            for role, sock, handler, part in self._inputs:
                emptied = True
                if sock in ready:
                    t0 = thread_time()
                    emptied = self._drain(sock, role, handler)
                    self._cpu[part] += thread_time() - t0
                # A socket found empty, or drained empty, holds nothing its peers sent before
                # the poll: their silence is measured up to then (`_liveness`), not up to a
                # moment after a long pump whose messages still wait to be read.
                if emptied:
                    self._heard[role] = polled
            self._pump()
        except Fatal as e:
            self._halt_now(str(e))
        now = time.monotonic()
        if now - self._checked >= live.poll_ms / 1000:
            # Not after every message burst: that is O(W) each time at thousands of ranks.
            self._liveness(now, self._heard["reader"], self._heard["trainer"])
            self._check_readers(now)
            self._check_ranks_gone()
            self.skip_log.flush(now)
            self._export_cpu()
            self._checked = now

    def _check_ranks_gone(self) -> None:
        """Say once when every rank has left (BYE, or lost) before the end of the data: the
        dispatcher keeps the job's place for its restart, without a bound, and nothing said
        so after the ranks' trainer_left lines (probe: a SIGTERM'd job left it silent)."""
        if (self._ranks_gone_said or self.delivery.connected() or self.finished()
                or not all(s.heard for s in self.slots)):
            return
        self._ranks_gone_said = True
        left = [s.left_at for s in self.slots if s.said_bye and s.left_at is not None]
        committed = self._checkpointed()
        # A restore from the checkpoint resumes after the commit, wherever the loops said they
        # stopped (a loop that left holding its committed step said that step).
        event("ranks_gone", logging.WARNING,
              next_step=max(min(left, default=self.next_plan), committed + 1),
              last_commit=committed,
              why="every rank has left before the end of the data: the dispatcher keeps the "
                  "job's place and waits, without a bound, for the job restored from its "
                  "checkpoint to resume here",
              fix="restart the trainers from their checkpoint; or stop the dispatcher "
                  "(SIGTERM) to end the job here (with --journal-dir it resumes later)")

    def _check_readers(self, now: float) -> None:
        """Say once an outage when no reader has been connected for NO_READERS_WARN_S while
        input is left: no sample arrives, the ranks wait for steps until their timeouts, and
        the log said nothing after the last reader_left (or, at start, ever)."""
        if self.pool.readers:
            self._no_readers_since, self._no_readers_said = None, False
            return
        if self._no_readers_since is None:
            self._no_readers_since = now
        elif (not self._no_readers_said and now - self._no_readers_since >= NO_READERS_WARN_S
              and not self.finished() and not self.assembler.exhausted):
            self._no_readers_said = True
            event("no_readers", logging.WARNING, seconds=int(now - self._no_readers_since),
                  endpoint=self.reader_endpoint,
                  why="no reader is connected: no sample arrives, and ranks wait for steps",
                  fix="start (or restart) mmdispatch read --dispatcher pointing at this "
                      "endpoint (its host's address for readers on other hosts)")

    def _export_cpu(self) -> None:
        now = thread_time()
        # `loop` is what no other part counted since the last export: one clock read per poll
        # interval, instead of one around each small piece, and the parts add up to the thread.
        self._cpu["loop"] += max(0.0, now - self._cpu_mark - sum(self._cpu.values()))
        self._cpu_mark = now
        for part, seconds in self._cpu.items():
            if seconds:
                self.metrics.cpu_of[part].inc(seconds)
                self._cpu[part] = 0.0

    def _leaving(self, until_done: bool, now: float) -> int | None:
        """The linger (ms) to close with if the loop ends now, else None."""
        if until_done and self.done(now) and not self._resumable_after_loss(now):
            # The job is done: readers may exit too (a Job or `compose up` completes).
            # Without until_done the dispatcher stays, and so do readers, for a rewind.
            self._end_readers()
            return 2000  # give the queued END messages a moment to leave
        if self.fatal is not None:
            # Stopped on its own: every rank is sent END with the reason, those that connect
            # later too (a trainer still starting would otherwise find no dispatcher and say
            # only that), then it leaves; at most HALT_LINGER_S after the halt.
            if not self._halted_at:
                self._halted_at = now
                untold = sum(not s.end_sent for s in self.delivery.slots)
                if untold:
                    event("telling_ranks", logging.WARNING, ranks=untold,
                          seconds=int(HALT_LINGER_S),
                          why="the job stopped; ranks that connect are told why, then it exits")
            told = all(s.end_sent for s in self.delivery.slots)
            if told or now - self._halted_at > HALT_LINGER_S:
                return 2000
        return None

    def _resumable_after_loss(self, now: float) -> bool:
        """Whether a done job waits (LOST_RANK_GRACE_S) for a restart: a rank was lost (no
        BYE) or left before its loop took the last step (its BYE's `next_step`: SIGTERM'd, or
        stopped by its own step limit, with steps received ahead untrained), with steps after
        the checkpoint every rank has. Exiting then left a job restored from its checkpoint no
        dispatcher to resume those steps from."""
        committed, last = self._checkpointed(), self.next_plan - 1
        early = any(s.said_bye and s.left_at is not None and s.left_at <= last for s in self.slots)
        lost = any(s.lost for s in self.slots)
        if not (lost or early) or not committed < last:  # -1: no commit yet
            return False
        if self._done_at is None:
            self._done_at = now
            event("waiting_for_resume", logging.WARNING, steps=f"{committed + 1}-{last}",
                  seconds=int(LOST_RANK_GRACE_S),
                  why="a rank was lost or stopped early with steps after the last commit: a "
                      "job restored from its checkpoint resumes them here")
        if now - self._done_at < LOST_RANK_GRACE_S:
            return True
        self.resume_wait_over = f"{committed + 1}-{last}"  # serve says so as it exits
        return False

    def _checkpointed(self) -> int:
        """The latest step every rank committed: where a job restored from its checkpoints
        resumes. The journal's commit is the latest of any rank's (a rank that died before its
        own commit of that step restores an earlier one); a rank this dispatcher heard no
        commit from counts as at the journal's."""
        journal = self.replay.committed
        return min((journal if s.committed is None else s.committed for s in self.slots),
                   default=journal)

    def _halt_now(self, why: str) -> None:
        if self.fatal is None:
            self.fatal = why
            self.metrics.halted.set(1)  # /metrics still answers while ranks are told why
            # `why` a field (a key under --log-format json), whole: event_line would cut it
            log.error("%s why=%r", event_line("fatal", next_step=self.next_plan), why)
            self._send_ends()

    def _close(self, linger_ms: int = 0) -> None:
        for name in ("reader_sock", "trainer_sock"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close(linger=linger_ms)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self.journal is not None:
            self.journal.close()
        if self.step_log is not None:
            self.step_log.close()
        self.metrics.close()

    # -- the pump ---------------------------------------------------------------------
    def _pump(self) -> None:
        """Open shards, assign them, plan every full step there is room for, send, evict, grant."""
        if self._unopened:
            self._settle_unopened(time.monotonic())
        if not self.finished():
            self.assembler.open_window()
        if self.replay.unopenable:
            self._skip_known_unopenable()
        self._assign()
        while not self.finished() and self.delivery.has_room() and self.planner_ready.is_set():
            t0 = thread_time()
            self.assembler.fill()
            ready = self.assembler.step_ready()
            self._cpu["assemble"] += thread_time() - t0
            if not ready:
                break
            self._plan()
        if not self.finished() and self.assembler.open_window():
            # The steps just filled consumed past a window's base: its next shard goes out
            # now, not at the next pump, a poll interval away when no message comes (with
            # --inflight-shards 1 every shard waited 50 ms for its assignment).
            self._assign()
        if self.assembler.empty_epoch is not None and self.fatal is None:
            # Once: later pumps still send the steps planned before it, then END with the
            # reason (a rank waiting on a planned step was told nothing, then timed out).
            raise Fatal(self._empty_epoch_message(self.assembler.empty_epoch))
        self._send_steps()
        self.delivery.evict()
        self._grant()

    def _empty_epoch_message(self, epoch: int) -> str:
        reasons = Counter(reason for _, reason in self.skip_log.keys)
        why = (", ".join(f"{n} {r}" for r, n in reasons.most_common(5)) if reasons
               else "every shard was empty")
        source, epoch = epoch
        st = next(st for st in self.assembler.streams if st.name == source)
        which = f"source {source!r}: " if len(self.assembler.streams) > 1 else ""
        ignored = self.ignored_members.get(source)
        found = (f"; members no field map names: "
                 + ", ".join(f"{s or '(no suffix)'} {n}" for s, n in ignored.most_common(5))
                 if ignored else "")
        top = reasons.most_common(1)[0][0] if reasons else None
        first = self.skip_log.first_shard.get(top) if top else None
        example = (f"; first {top}: shard {first!r}, its reader's log says why" if first else "")
        return (f"{which}epoch {epoch} of the {st.order.num_shards} shards yielded no usable sample "
                f"(skipped: {why}{found}){example}; check them with `mmdispatch inspect` and the counting "
                "options (field map, --errors): serving would only loop over empty epochs")

    def _assign(self) -> None:
        needed = self.assembler.replay_heads()
        starving = self._starving_heads()
        # Lowest first, but a position a replayed order waits on before all, then a blend
        # source's head with nothing buffered (the step waits on it).
        todo = sorted(self.assembler.unassigned(), key=lambda p: (p not in needed, p not in starving))
        if self._unopened:  # a shard no reader here can open takes no other's slot
            todo = [p for p in todo if p not in self._unopened or self.pool.can_open(p)]
            starving = {p for p in starving if p not in self._unopened or self.pool.can_open(p)}
        made = self.pool.assign(todo)
        for reader, a in made:
            prog = self.assembler.progress[a.pos]
            prog.assignment = a.id
            # Where the last reader of the shard stopped, if it said so: the next one starts
            # its tar walk there instead of at byte 0 (a resumed shard cost quadratic time).
            resume = prog.resume
            at = ({"offset": resume[1]} if resume is not None and resume[0] == prog.next_index
                  and resume[0] > 0 else {})
            self._send_reader(reader, P.SHARD_ASSIGN, assign_id=a.id, shard=prog.url, pos=a.pos,
                              epoch=self.assembler.epoch_of(a.pos), start_index=prog.next_index,
                              **self._source_fields[a.pos % len(self._source_fields)],
                              **self._copy_to_check(reader, prog.url), **at)
            event("shard_assigned", shard=prog.url, pos=a.pos, start=prog.next_index,
                  reader=reader.name, **at)
        if made:
            return
        # One source drains its positions in order, so a lower one waiting may take a higher
        # one's slot; a blend's sources drain side by side, and so do the shards a shuffle
        # block mixes, so there a starving head may.
        in_order = self._in_order or (todo and todo[0] in needed)
        victim = (self.pool.victim(todo, needed) if in_order
                  else self._starved_head_victim(starving, needed))
        if victim is not None:
            reader, a = victim
            self._take_back(reader, a)
            event("shard_preempted", shard=self.assembler.url(a.pos), pos=a.pos, reader=reader.name)

    def _starving_heads(self) -> set[int]:
        """A blend's source heads (or the shard a shuffle block waits on, where blocks mix
        shards) that no reader holds and that have nothing buffered."""
        if self._in_order:
            return set()
        progress = self.assembler.progress
        return {p for p in self.assembler.heads() if p in progress and progress[p].assignment is None
                and not progress[p].buffer and not progress[p].reader_done}

    def _starved_head_victim(self, starving: set[int], needed: set[int]):
        """(reader, assignment) to take back so that a blend's starving source gets read.

        Positions of one source drain in order, but a blend needs every source's head at once:
        with more sources than reader slots, readers full of other sources' shards (stopped at
        their buffer caps) and a head nobody holds planned no step, ever. When a head waits
        with nothing buffered, the held shard with the most samples buffered is taken back (the
        starving head gets its slot first): its source reads on from its buffer, and the shard
        resumes where it stopped once its own buffer runs dry."""
        if not starving:
            return None
        progress = self.assembler.progress
        held = [a for a in self.pool.assignments.values() if a.pos not in needed
                and self._opens_any(a.reader, starving)]
        a = max(held, key=lambda a: len(progress[a.pos].buffer) if a.pos in progress else 0,
                default=None)
        # Too little buffered to live on: taking it back would only move the wait. A shard full
        # at its cap lives on it, however small the cap (below a credit batch with a large
        # global batch or a small --max-buffered-samples).
        enough = min(self.config.flow.credit_batch, self._shard_cap)
        if a is None or a.pos not in progress or len(progress[a.pos].buffer) < enough:
            return None
        reader = self.pool.readers.get(a.reader)
        if reader is None:
            return None
        # Said once, when it holds: not for take-backs while readers are still joining (the
        # workers of one `read --workers N` connect one by one, and the first alone is short).
        settled = time.monotonic() - self._reader_joined_at >= SLOTS_WARN_AFTER_S
        if not self._slots_warned and settled:
            self._slots_warned = True
            slots = sum(r.slots for r in self.pool.readers.values())
            mixed = max(self.config.mixes)
            together = {"shards_read_together": sum(self.config.mixes)} if mixed > 1 else {}
            event("blend_short_of_reader_slots" if mixed == 1 else "short_of_reader_slots",
                  logging.WARNING, sources=len(self.assembler.streams), **together,
                  reader_slots=slots,
                  fix="start more readers, or more --workers or --prefetch-shards per reader: "
                      "each source's shard" + (" (each of a shuffle block's --shuffle-shards)"
                                               if mixed > 1 else "")
                      + " needs a slot, or shards are taken back and resumed")
        return reader, a

    def _opens_any(self, ident: bytes, positions: set[int]) -> bool:
        """Whether reader `ident` did not fail to open at least one of `positions`."""
        reader, refused = self.pool.readers.get(ident), self.pool.refused
        return reader is not None and any(process(reader) not in refused.get(p, ()) for p in positions)

    def _plan(self) -> None:
        c0 = thread_time()
        filled = self.assembler.take_step()
        if len(self._one_shard_warned) < len(self.assembler.streams):
            self._warn_one_shard_blocks()
        step, batch = self.next_plan, build_batch(filled.samples, len(self.assembler.streams))
        digest, keys = batch.digests()
        c1 = thread_time()
        self._cpu["assemble"] += c1 - c0
        t0 = time.perf_counter()
        journaled, mismatch = self.replay.journaled_plan(step, digest, lambda: keys)
        if mismatch == OTHER_SAMPLES and self.config.mode == "deterministic":
            self._other_samples(step)
        if mismatch and self.config.mode == "deterministic":
            self.metrics.error("replay_mismatch", step=step,
                               detail="samples, or the lengths they were counted with, differ "
                                      "from the journal (shards changed on disk, or readers "
                                      "count by other rules or tokenizer): planned anew")
        try:
            if journaled is not None:
                plan = StepPlan.from_dict(journaled)
            else:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always", OversizeWarning)
                    plan = plan_step(batch.inputs, self.topology, self.config.planner)
                self._isolated(step, batch, plan, [w.message for w in caught])
        except PlanError as e:
            why = oversize_report(step, batch, self.config.planner, e, self.topology)
            if self._halt is not None:
                self._halt.record(step, why)
            raise Fatal(why) from e
        plan_ms = (time.perf_counter() - t0) * 1e3
        c2 = thread_time()
        self._cpu["plan"] += c2 - c1
        cursor = self.assembler.position()
        if self.config.mode != "deterministic":  # the order to take its samples in again
            if self.replay.records(step, verbatim=journaled is not None):
                cursor["took"] = self.assembler.took()
            else:
                self.assembler.journaled(self.replay.took_of(step))
        entry = StepEntry(step=step, epoch=filled.epoch, world_size=self.config.world_size,
                          cursor_after=cursor,
                          num_samples=len(batch.samples), digest=digest, keys=keys)
        try:
            self.replay.record(entry, plan, verbatim=journaled is not None)
        except OSError as e:
            raise Fatal(f"journal write failed at step {step} ({e}); stopping. Free the space "
                        "(or fix the journal directory) and start the dispatcher again: it "
                        "resumes from the journal") from e
        self._cpu["journal"] += thread_time() - c2
        self._planned_high = max(self._planned_high, step)
        if self._held_commits:
            self._answer_held_commits()
        self._check_commits_lag(step)
        self.delivery.add(RetainedStep(step=step, epoch=filled.epoch, batch=batch, plan=plan,
                                       messages=None,
                                       num_samples=len(batch.samples), nbytes=filled.nbytes))
        self._observe(step, filled.epoch, plan, plan_ms, self._by_source(batch.samples))
        if self.config.batch.token_budget is not None and len(self._budget_warned) < 2:
            self._check_budget(step, filled, batch, plan)

    def _check_budget(self, step: int, filled, batch, plan) -> None:
        """Say once a run what `--token-budget` does that a user would not see otherwise: a
        sample over it is planned as a step of its own (over the budget), and steps it cuts
        short of W x M samples leave ranks empty micro-batches (serve's start-up check of
        --global-batch cannot know)."""
        budget, W = self.config.batch.token_budget, self.config.world_size
        tokens = int(batch.inputs.llm_len.sum())
        if tokens > budget and "over" not in self._budget_warned:
            self._budget_warned.add("over")
            event("sample_over_token_budget", logging.WARNING, step=step, key=batch.keys[0],
                  llm_tokens=tokens, token_budget=budget,
                  why="a sample with more LLM tokens than the budget is planned as a step of its "
                      "own, over the budget (it is never dropped); said for the first only",
                  fix="raise --token-budget above the longest sample (or cap samples with the "
                      "readers' --max-seq-len)")
        S, M = len(batch.keys), plan.num_microbatches
        seen = self._budget_seen
        seen.add(batch.inputs.llm_len)
        if "empty" in self._budget_warned:
            return
        if (filled.cut and S < W * M and self._budget_cut is None
                and self.config.batch.global_batch >= W * M):
            # (A global batch below W x M leaves micro-batches empty anyway: serve said so.)
            self._budget_cut = (step, S, M)
        if self._budget_cut is not None and seen.steps >= BUDGET_MEAN_STEPS:
            # Said from the mean of several steps: a cut step's own mean lacks the sample that
            # did not fit, and advised about the budget already set.
            self._budget_warned.add("empty")
            cut, cut_samples, cut_M = self._budget_cut
            self._budget_cut = None
            # W x M samples hold n x mean tokens on average, and their sum varies by sqrt(n)
            # standard deviations of a sample: a budget of the mean alone still cut about half
            # the steps (probe), two deviations over it hold all but a few.
            n, (mean, std) = W * cut_M, seen.mean_std()
            holds = math.ceil(n * mean + 2 * math.sqrt(n) * std)
            fix = (f"a --token-budget of at least about {holds}" if holds > budget else
                   f"a --token-budget above {budget} with room for steps of longer samples")
            event("empty_microbatches", logging.WARNING, step=cut, samples=cut_samples,
                  token_budget=budget, world_size=W, num_microbatches=cut_M,
                  why=f"--token-budget {budget} cut step {cut} at {cut_samples} samples for "
                      f"{W} ranks x {cut_M} micro-batches: ranks run empty micro-batches in "
                      f"such steps; said once",
                  fix=f"{fix} (W x M samples in most steps, by the {seen.samples} samples planned so "
                      f"far: {holds} tokens), or fewer --num-microbatches")

    def _isolated(self, step: int, batch, plan, caught: list[Warning]) -> None:
        """One line for a step `oversize="isolate"` planned in more micro-batches than
        configured: its isolated samples by key, the micro-batches it has and why. The planner
        warns at each attempt (each isolation, each retry in more micro-batches), which
        logged as lines whose counts contradicted each other and the plan."""
        found = []
        for warning in caught:
            if isinstance(warning, OversizeWarning):
                found.append(warning)
            else:
                warnings.warn(warning, stacklevel=2)  # not ours to log: passed on as it came
        if not found:
            return
        keys = [batch.keys[i] for i in sorted({i for w in found for i in w.samples})]
        shown = ({"keys": ",".join(keys[:5]) + (f",... ({len(keys)} samples)" if len(keys) > 5
                                                else "")} if keys else {})
        reasons = [w.reason for w in found if w.reason]
        M = self.config.planner.microbatches_for(batch.inputs, self.topology)
        why = " ".join(filter(None, [
            "each sample named fits no capacity and runs alone on a rank;" if keys else "",
            f"the {'other ' if keys else ''}samples did not pack under the capacities in fewer "
            "micro-batches" if reasons else ""])).rstrip(";")
        event("oversize_isolated", logging.WARNING, step=step, microbatches=plan.num_microbatches,
              configured=M, **shown, why=why, **({"detail": reasons[-1]} if reasons else {}))

    def _check_commits_lag(self, step: int) -> None:
        """Say once when trainers have not committed for COMMITS_LAG_STEPS steps: what is kept
        to replay every step since the last commit (cursors; with a journal, plans on disk and
        its records) only goes at a commit."""
        lag = step - self.replay.committed
        self.metrics.uncommitted_steps.set(lag)
        if lag >= COMMITS_LAG_STEPS and not self._commits_lag_warned:
            self._commits_lag_warned = True
            event("commits_lag", logging.WARNING, steps=lag, last_commit=self.replay.committed,
                  journal=self.config.journal_dir or "none",
                  fix="call client.commit(step) once each checkpoint is durable (train.py: "
                      "--commit-every): the dispatcher keeps what replays every step since the "
                      "last commit, and it grows until one comes")

    def _by_source(self, samples: list) -> dict[str, int]:
        """Samples per source of a blend (empty for one source)."""
        streams = self.assembler.streams
        if len(streams) == 1:
            return {}
        counts = Counter(s.pos % len(streams) for s in samples)
        return {st.name: counts.get(i, 0) for i, st in enumerate(streams)}

    def _observe(self, step: int, epoch: int, plan: StepPlan, plan_ms: float,
                 sources: dict[str, int]) -> None:
        if self.step_log is not None:
            record = plan_record(step, plan, config=self.config.planner, plan_ms=plan_ms,
                                 epoch=epoch, sources=sources)
            record["dataset"] = self._dataset_id
            if self.ignored_members:  # so far in this run, by source and suffix
                record["ignored_members"] = {src: dict(sorted(c.items()))
                                             for src, c in sorted(self.ignored_members.items())}
            if self.truncated_samples:  # so far in this run, by source
                record["truncated_samples"] = dict(sorted(self.truncated_samples.items()))
            self.step_log.write(record)
        m = self.metrics
        m.steps_served.inc()
        for name, n in (sources or {self.assembler.streams[0].name: plan.inputs.num_samples}).items():
            m.source_samples.labels(name).inc(n)
        m.plan_ms.observe(plan_ms)
        for phase, value in plan.metrics.get("max_over_mean", {}).items():
            m.imbalance.labels(phase).set(value)
        event("step_planned", step=step, epoch=epoch, samples=plan.inputs.num_samples,
              microbatches=plan.num_microbatches, plan_ms=f"{plan_ms:.2f}",
              lb_ratio=f"{plan.metrics.get('step_time_over_split_free_lb', 0):.3f}",
              **({"sources": ",".join(f"{k}:{v}" for k, v in sources.items())} if sources else {}))

    def _send_steps(self) -> None:
        encoding = 0.0
        direct = self.config.payloads == "direct"

        def encode(rs: RetainedStep) -> list:
            nonlocal encoding
            e0 = thread_time()
            msgs = step_messages(rs.batch, rs.plan, step=rs.step, epoch=rs.epoch, seq=self._seq + 1,
                                 endpoints=self.pool.endpoints if direct else None)
            rs.batch.release_payloads()  # the messages hold (or name) every payload now
            self._seq += len(msgs)
            encoding += thread_time() - e0
            return msgs

        t0 = thread_time()
        now = time.monotonic()
        sock, send = self.trainer_sock, P.send_frames
        count = nbytes = 0
        for slot, frames in self.delivery.sends(encode):
            send(sock, [slot.ident, *frames])
            slot.last_sent = now
            count += 1
            nbytes += sum(map(len, frames))  # bytes (the packed header, the joined data)
        if count:  # counted once per pump, as _send_frames counts each other message
            self.metrics.bytes_out_of["trainer"].inc(nbytes)
            self.metrics.messages_of["trainer", "out"].inc(count)
        self._cpu["encode"] += encoding
        self._cpu["send"] += thread_time() - t0 - encoding
        if self.finished():
            self._send_ends()

    def _send_ends(self) -> None:
        max_steps = self.config.max_steps
        reason = ("halted" if self.fatal is not None
                  else "max_steps" if max_steps is not None and self.next_plan >= max_steps
                  else "max_epochs")
        why = {} if self.fatal is None else {"message": self.fatal[:4000]}
        if reason != "halted" and not self._stream_end_said:  # halted: event=fatal says why
            self._stream_end_said = True
            self._say_stream_end(reason)
        for slot in self.delivery.ends_due():
            self._send(self.trainer_sock, slot.ident, P.END, next_step=self.next_plan,
                       reason=reason, **why)
            slot.end_sent = True

    def _say_stream_end(self, reason: str) -> None:
        """One line on why no step follows: with `max_epochs`, the source the blend needed next
        and had read its last epoch; per source, the samples the blend drew and the epochs read
        whole (weights, not source sizes, decide which source ends the job first)."""
        a = self.assembler
        ended = {}
        if reason == "max_epochs":
            ended = {"source": a.streams[a.blend.next_source()].name,
                     "max_epochs": self.config.max_epochs}
        event("stream_end", reason=reason, **ended, steps=self.next_plan,
              drawn=",".join(f"{st.name}:{n}" for st, n in zip(a.streams, a.blend.drawn)),
              epochs=",".join(f"{st.name}:{st.order.epoch_of(st.cursor.base)}" for st in a.streams))

    def _end_readers(self) -> None:
        self._readers_ended = True
        for reader in list(self.pool.readers.values()):
            self._send_reader(reader, P.END, reason="done")

    def _grant(self) -> None:
        held = self._gauges()
        if self.finished() or not self.pool.assignments:
            return
        todo = grants(self.pool.by_position(), self.assembler.progress,
                      heads=self.assembler.heads(), held=held,
                      sample_bytes=self.assembler.sample_bytes, flow=self.config.flow,
                      shard_cap=self._shard_cap)
        for a, n in todo:
            a.credits += n
            reader = self.pool.readers.get(a.reader)
            if reader is not None:
                self._send_reader(reader, P.CREDIT, assign_id=a.id, samples=n)

    def _gauges(self) -> Holdings:
        samples, nbytes = self.assembler.held()
        if (nbytes > BYTES_OVER_WARN * self.config.flow.max_buffered_bytes
                and not self._block_bytes_warned):
            self._warn_block_bytes(nbytes)
        r_samples, r_bytes = self.delivery.held()
        held = Holdings(samples=samples + r_samples, nbytes=nbytes + r_bytes)
        self.metrics.buffered_samples.set(held.samples)
        self.metrics.buffered_bytes.set(held.nbytes)
        self.metrics.retained_steps.set(len(self.delivery.retained))
        return held

    def _other_samples(self, step: int) -> None:
        """Stop the job: journaled step `step` comes back with other samples than it was
        planned with. Its samples follow from the shards and the readers' rules (which they
        keep and skip, and so how shuffle blocks fill), so one of those changed since: the
        steps after the last commit would train some samples a second time and others never.
        Planning it anew, as for other lengths, broke exactly-once without a word."""
        why = (f"journaled step {step} comes back with other samples than it was planned with: "
               "the readers keep or skip other samples than then (their rules changed, e.g. "
               "--max-seq-len, placeholders, fields or a limit such as --max-member-bytes after "
               "inputs.json was removed, or the shards changed), so resuming would train some samples again and others never. "
               "Give the readers the job's rules and shards and start the dispatcher again, or "
               "start a new job (a new --journal-dir, trainers without their data state)")
        raise Fatal(why)  # not a halt (halted.json): the same settings resume once readers agree

    def _warn_one_shard_blocks(self) -> None:
        """Once a source: its full shuffle blocks keep coming from one shard each (its shards
        are as large as its block), so its steps hold one or two shards, the same groups every
        epoch. A source of one shard can only be written as more (or shuffled in larger blocks)."""
        for st in self.assembler.streams:
            if st.one_shard_blocks < ONE_SHARD_BLOCKS_WARN or st.name in self._one_shard_warned:
                continue
            self._one_shard_warned.add(st.name)
            fix = ("--shuffle-shards N draws each block from N shards side by side (give the "
                   "readers N slots per source), or write shards smaller than the block"
                   if st.order.num_shards > 1 else
                   "its one shard is shuffled only within blocks of block_size samples read in "
                   "order: write it as several shards (then --shuffle-shards N), or raise "
                   "--shuffle-buffer")
            event("shuffle_blocks_of_one_shard", logging.WARNING, source=st.name,
                  blocks=st.one_shard_blocks, block_size=st.block_size, fix=fix)

    def _warn_block_bytes(self, nbytes: int) -> None:
        """Once: shuffle blocks hold more bytes than --max-buffered-bytes. A block is emitted only
        once complete, and a source waiting on its block takes credits past the byte bound (or
        it would stall), so that bound cannot hold below one block's bytes."""
        self._block_bytes_warned = True
        if self.config.shuffle_buffer <= 1:
            return  # without a shuffle only the heads' credits pass the bound, briefly
        # block_bytes: what a whole block will hold; the held bytes at the warning are only
        # how far past the bound the first block had come.
        event("shuffle_block_over_bytes", logging.WARNING, held_bytes=nbytes,
              block_bytes=self.assembler.block_bytes(), max_buffered_bytes=self.config.flow.max_buffered_bytes,
              shuffle_buffer=self.config.shuffle_buffer,
              fix="a shuffle block holds the bytes of its samples until it is complete: use "
                  "--payloads reference or direct, a smaller --shuffle-buffer, or a larger "
                  "--max-buffered-bytes")

    # -- receiving --------------------------------------------------------------------
    def _drain(self, sock: zmq.Socket, role: str, handler, budget: int = 256) -> bool:
        """Take up to `budget` waiting messages of `role`'s socket; whether it was left empty."""
        count = nbytes = 0
        try:
            for frames in P.pending(sock, budget):
                count += 1
                nbytes += sum(map(len, frames)) - len(frames[0])
                self._take(sock, role, frames[0].bytes, frames[1:], handler)
        finally:  # counted once per drain: two metric updates a message cost ~1 us each
            self.metrics.bytes_in_of[role].inc(nbytes)
            self.metrics.messages_of[role, "in"].inc(count)
        return count < budget

    def _take(self, sock: zmq.Socket, role: str, ident: bytes, body: list, handler) -> None:
        """Decode one message and hand it to `handler`; a bad one is answered, never fatal."""
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
            return
        try:
            handler(ident, msg, time.monotonic())
        except Fatal:
            raise
        except JournalWriteError as e:
            # Disk full or a broken journal directory (a HELLO keeping the input rules): the
            # job stops as it does on a plan's write, and the peer hears why, not "internal".
            why = (f"journal write failed handling {msg.type} ({e}); stopping. Free the space "
                   "(or fix the journal directory) and start the dispatcher again: it "
                   "resumes from the journal")
            self._send(sock, ident, P.ERROR, code="halted", ack=msg.seq, message=why[:4000])
            raise Fatal(why) from e
        except Exception as e:  # noqa: BLE001 - one odd message must not stop the service
            log.exception("handling %s failed", msg.type)
            self.metrics.error("internal", role=role, type=msg.type, detail=repr(e)[:200])
            self._send(sock, ident, P.ERROR, code="internal", ack=msg.seq,
                       message=f"{msg.type} could not be handled: {e!r}"[:500])

    def _on_reader(self, ident: bytes, msg: P.Message, now: float) -> None:
        reader = self.pool.readers.get(ident)
        if msg.type == P.HELLO:
            self._reader_hello(ident, reader, msg, now)
            return
        if reader is None:
            self._refuse_unknown(self.reader_sock, ident, "reader", msg)
            return
        reader.last_seen = now
        if msg.type == P.SHARD_REQUEST:
            if self._serves_payloads(reader, msg):
                self.pool.request(reader, int(msg.get("shards", 1)))
        elif msg.type == P.SAMPLES:
            self._on_samples(reader, msg)
        elif msg.type == P.SHARD_DONE:
            self._on_shard_done(reader, msg)
        elif msg.type == P.BYE:
            self._drop_reader(reader, "bye")
        elif msg.type == P.ERROR:
            self._reader_error(reader, msg)
        elif msg.type != P.HEARTBEAT:
            self.metrics.error("unexpected", role="reader", type=msg.type)
            self._send(self.reader_sock, ident, P.ERROR, code="unexpected",
                       message=f"{msg.type} is not a reader message")

    def _reader_error(self, reader: Reader, msg: P.Message) -> None:
        """A reader's ERROR: one its error policy stopped on its data ends the job with the
        reader's line (the next reader of that shard would stop the same way, and the job would
        wait on readers that are gone); any other is counted and logged, never answered."""
        if msg["code"] == P.READER_STOPPED:
            raise Fatal(f"reader {reader.name!r} stopped {msg['message']}; fix it and start the "
                        "job again (a dispatcher with --journal-dir resumes where it stopped)")
        self.metrics.error("reader_error", role="reader", name=reader.name, code=msg["code"],
                           detail=msg["message"][:500])

    def _reader_hello(self, ident: bytes, reader: Reader | None, msg: P.Message, now: float) -> None:
        if msg["role"] != "reader":
            # Logged and counted as a reader at the trainer endpoint is: the peer stops on the
            # ERROR, and the operator of the dispatcher hears of the miswired one too.
            why = (f"role {msg['role']!r} connected to the reader endpoint: point it at the "
                   "dispatcher's trainer endpoint (serve --trainer-bind)")
            self.metrics.error("role", role="reader", detail=why)
            self._send(self.reader_sock, ident, P.ERROR, code="role", ack=msg.seq, message=why)
            return
        why = self.inputs.admit(f"reader {msg.get('name', '')!r}", msg.get("inputs"), self._peers)
        if why is not None:
            self.metrics.error("inputs", role="reader", detail=why)
            self._send(self.reader_sock, ident, P.ERROR, code="inputs", ack=msg.seq, message=why)
            return
        if reader is not None:
            self._drop_reader(reader, "re-hello")
        instance = msg.get("instance", "")
        earlier = self.pool.earlier_session(ident, instance)
        if earlier is not None:  # the same process on a new socket: not a second reader
            self._drop_reader(earlier, "reconnected")
        reader = self.pool.join(ident, msg.get("name", ""), now, instance, msg.get("node", ""))
        self._reader_joined_at = now
        self._live_due = 0.0  # it was sent nothing yet: its heartbeat is due at the next check
        self.metrics.peers.labels("reader").set(len(self.pool.readers))
        event("reader_joined", name=reader.name)
        # direct mode: the shard files whose bytes a reader may serve to trainers
        direct = ({"shards": [P.reference_path(u, "direct") for u in self.config.shards]}
                  if self.config.payloads == "direct" else {})
        self._send_reader(reader, P.WELCOME, role="reader", ack=msg.seq,
                          heartbeat_s=float(self.config.liveness.heartbeat_s),
                          payloads=self.config.payloads, **direct)
        if self._readers_ended:
            self._send_reader(reader, P.END, reason="done")

    def _serves_payloads(self, reader: Reader, msg: P.Message) -> bool:
        """direct mode: note where `reader` serves payloads (SHARD_REQUEST); False when it does not
        say, so it gets no shard (trainers could not fetch what it read)."""
        if self.config.payloads != "direct":
            return True
        endpoint = msg.get("payload_endpoint")
        if endpoint is None:
            self.metrics.error("no_payload_endpoint", reader=reader.name)
            self._send_reader(reader, P.ERROR, code="payloads", message="the dispatcher runs "
                              "--payloads direct: shard_request needs payload_endpoint")
            return False
        if self.pool.serves(reader, endpoint, msg.get("payload_key", "")):
            event("reader_payloads", name=reader.name, endpoint=endpoint)
            self._send_reader_table()
        return True

    def _reader_table(self) -> dict:
        """WELCOME's and READERS' `readers` field: the live payload endpoints (direct mode)."""
        return {"readers": [list(e) for e in self.pool.live_endpoints()]}

    def _send_reader_table(self) -> None:
        """Tell every connected trainer the live payload endpoints (direct mode)."""
        table = self._reader_table()
        for slot in self.delivery.slots:
            if slot.ident is not None:
                self._send(self.trainer_sock, slot.ident, P.READERS, **table)

    def _on_samples(self, reader: Reader, msg: P.Message) -> None:
        a = self.pool.find(reader, msg["assign_id"])
        if a is None:
            # Samples of a shard taken back, or sent before a dispatcher restart: expected in
            # flight, so counted at INFO (the reader is told to drop the assignment).
            self.metrics.error("stale_samples", logging.INFO, reader=reader.name,
                               assign_id=msg["assign_id"])
            self._send_reader(reader, P.CANCEL, assign_id=msg["assign_id"])
            return
        prog = self.assembler.progress[a.pos]
        headers = msg["samples"]
        if len(headers) > a.credits:
            self.metrics.error("credit_overrun", reader=reader.name, sent=len(headers),
                               credits=a.credits)
            # Refused whole, shard taken back (it restarts at next_index): a reader ignoring
            # credits must not grow the dispatcher past its memory bounds.
            self._take_back(reader, a)
            return
        sizes = msg.get("sizes")
        # Coalesced payloads: every item is a view of a frame (no copy, no frame per item).
        views = msg.frames if sizes is None else P.split_frames(msg.frames, sizes)
        if self.config.payloads != "inline" and not P.refs_point_into(views, prog.ref_path):
            # Trainers read what references name: only the assigned shard's file may be named.
            self.metrics.error("bad_reference", reader=reader.name, shard=prog.url)
            self._take_back(reader, a)
            return
        item_bytes = sizes if sizes is not None else [v.nbytes for v in views]
        got = self.assembler.receive(a.pos, headers, views, item_bytes, msg.get("skipped", ()),
                                     reader.payload)
        for key, index in got.out_of_order:
            self.metrics.error("out_of_order", key=key, index=index)
        a.received += got.read
        resume = msg.get("resume")
        if resume is not None:
            prog.resume = (resume[0], resume[1])
        a.credits = max(0, a.credits - len(headers))
        self.metrics.samples_in.inc(len(headers))
        self._skip(prog.url, got.skipped + [P.SkipRecord(f"{prog.url}#{lo}..{hi - 1}",
                                                         "unaccounted", lo) for lo, hi in got.gaps])

    def _take_back(self, reader: Reader, a: Assignment) -> None:
        """Cancel `a` and free its shard (it restarts at next_index: nothing is lost)."""
        self._send_reader(reader, P.CANCEL, assign_id=a.id)
        self._release(reader, a)

    def _release(self, reader: Reader, a: Assignment) -> None:
        """Forget assignment `a` (its shard's buffer and next_index stay: nothing is lost)."""
        prog = self.assembler.progress.get(a.pos)
        if prog is not None and prog.assignment == a.id:
            prog.assignment = None
        self.pool.release(reader, a)

    def _on_shard_done(self, reader: Reader, msg: P.Message) -> None:
        a = self.pool.find(reader, msg["assign_id"])
        if a is None:
            return
        prog = self.assembler.progress[a.pos]
        if self._open_failed(reader, a, msg["skipped"]):
            return
        if msg["count"] != a.received:
            self.metrics.error("count_mismatch", shard=prog.url, sent=msg["count"], got=a.received)
        self._check_copy(reader, prog.url, msg.get("identity"))
        if a.pos in self._unopened:  # another reader opened it after all
            self._forget_unopened(a.pos)
        # The skips first (journaled), then the state: a failed journal write stops the
        # dispatcher before the shard counts as read, so a restart reads it again.
        self._skip(prog.url, self.assembler.unheard(a.pos, msg["skipped"]))
        self._ignored(self.assembler.stream_of(a.pos).name, prog.url, msg.get("ignored"))
        self._truncated(self.assembler.stream_of(a.pos).name, prog.url, msg.get("truncated"))
        self.assembler.reader_done(a.pos)
        self._release(reader, a)

    def _copy_to_check(self, reader: Reader, url: str) -> dict:
        """SHARD_ASSIGN's `identity`: the copy of `url` another reader read first, which a
        reader with a local copy checks before it sends a sample of it (`_check_copy` alone
        stops the job only once the shard is read, after steps may have carried its samples)."""
        known = self.replay.identities.get(url)
        # A node's readers share its files: only another node's copy is walked to be checked.
        if known is None or known.get("node", known.get("reader")) == reader.node:
            return {}
        return {"identity": {k: known[k] for k in P.SHARD_IDENTITY}}

    def _check_copy(self, reader: Reader, url: str, identity: dict | None) -> None:
        """The first copy of shard `url` read whole defines it (journaled); any later read of it,
        by any reader, in any epoch, replay or restart, must find the same copy, or the job stops
        before the shard counts as read (its samples still buffered are never planned).

        Stopping, rather than giving the shard to another reader: a node whose copy differs
        (a stale sync, a dataset regenerated there) was also the first to read other shards,
        whose copies then define them, and nothing tells which copy is right; serving on would
        train on two datasets under one set of keys, and break replays and exactly-once."""
        if identity is None:  # a walk cut short (stalled): nothing to compare
            return
        known = self.replay.identities.get(url)
        if known is None:
            try:
                self.replay.record_identity(url, {**identity, "reader": reader.name, "node": reader.node})
            except OSError as e:
                raise Fatal(f"journal write failed recording the copy of {url} read ({e}); "
                            "stopping. Free the space and start the dispatcher again: it resumes "
                            "from the journal") from e
            return
        differs = [f"{k} {identity[k]} where reader {known.get('reader', '?')!r} read {known.get(k)}"
                   for k in P.SHARD_IDENTITY if known.get(k) != identity[k]]
        if differs:  # counted; event=fatal is the one line
            self.metrics.errors.labels("shard_copy_differs").inc()
            raise Fatal(f"reader {reader.name!r} read another copy of shard {url} than the one "
                        f"first read: its tar {', its '.join(differs)}. Make every node's copy of "
                        "the dataset the same (sync them from one source) and start the job "
                        "again (a dispatcher with --journal-dir resumes where it stopped); a "
                        "shard rewritten since this job first read it makes another sample "
                        "sequence: restore the shard the job was started with, or start a new "
                        "job (a new --journal-dir, trainers without their data state)")

    def _open_failed(self, reader: Reader, a: Assignment, skipped: list[P.SkipRecord]) -> bool:
        """A reader that could not open its shard leaves it to the others (a node missing a
        mount, a partly synced copy, no permission there): before, the shard was skipped whole
        while other readers could read it. Skipped once every reader here failed on it and
        none that can came within OPEN_RETRY_S (`_settle_unopened`)."""
        if not any(s.reason == "open_failed" for s in skipped):
            return False
        self._release(reader, a)
        pending = self._unopened.get(a.pos)
        if pending is not None and pending[1]:  # its last try failed too: unreadable here
            self._give_up_unopened(a.pos, skipped)
            return True
        now = time.monotonic()
        if not self._unopened and now - self._unopened_none_at >= OPEN_RETRY_S:
            # a new spell of them (one right after the last was settled is the same spell:
            # a window of one shard empties between them)
            self._unopened_since = now
        self.pool.refused.setdefault(a.pos, set()).add(process(reader))
        self._unopened.setdefault(a.pos, [skipped, False])
        event("shard_open_failed", logging.WARNING, shard=self.assembler.url(a.pos),
              reader=reader.name,
              then=("another reader reads it" if self.pool.can_open(a.pos) else
                    f"held for a reader that can open it (up to {OPEN_RETRY_S:.0f} s from the "
                    "first such failure), tried once more, then skipped"),
              fix="see that reader's log for why; every reader must see every shard")
        return True

    def _forget_unopened(self, pos: int) -> None:
        """`pos` was read or skipped: no longer waited on, nor refused by any reader."""
        self._unopened.pop(pos, None)
        self.pool.refused.pop(pos, None)
        if not self._unopened:
            self._unopened_none_at = time.monotonic()

    def _give_up_unopened(self, pos: int, skipped: list[P.SkipRecord]) -> None:
        """Skip shard `pos` as unreadable (`open_failed`), journaled like any skip, and the
        decision too (`_skip_known_unopenable`)."""
        self._forget_unopened(pos)
        url = self.assembler.url(pos)
        self._skip(url, self.assembler.unheard(pos, skipped))
        try:
            self.replay.record_unopenable(pos, url)
        except OSError as e:
            raise Fatal(f"journal write failed recording that no reader could open {url} ({e}); "
                        "stopping. Free the space and start the dispatcher again: it resumes "
                        "from the journal and the shard is tried again") from e
        self.assembler.reader_done(pos)

    def _skip_known_unopenable(self) -> None:
        """Skip again, at once, the shard positions a rewind or a restart reopens that were
        skipped as unopenable before (the journal keeps that decision; skipped.mmd is never
        read at a restart): the steps after them were planned without their samples, so a
        replay that read them would differ from what trainers saw, and trying them again cost
        another OPEN_RETRY_S wait. A position is a shard in one epoch: later epochs try the
        shard afresh."""
        progress = self.assembler.progress
        for pos in self.replay.unopenable.intersection(progress):
            prog = progress[pos]
            if prog.reader_done or prog.assignment is not None:
                continue
            self.assembler.reader_done(pos)
            event("shard_skipped_again", shard=prog.url, pos=pos, reason="open_failed",
                  why="no reader could open it in this epoch before the restart or rewind "
                      "(journaled); its next epoch tries it again")

    def _settle_unopened(self, now: float) -> None:
        """Shards every connected reader failed to open, OPEN_RETRY_S after the first of them
        failed (or after a reader last joined), get one last try by any reader (a file that
        appeared since, a mount back), and are skipped if it fails too (`_open_failed`). The
        wait is one for all of them: shards further on in the order, which enter the window
        only as earlier ones are settled, wait no more once it is over."""
        over = now - max(self._unopened_since, self._reader_joined_at) >= OPEN_RETRY_S
        for pos, entry in list(self._unopened.items()):
            prog = self.assembler.progress.get(pos)
            if prog is None or prog.reader_done:
                self._forget_unopened(pos)
            elif over and not entry[1] and prog.assignment is None and not self.pool.can_open(pos):
                entry[1] = True
                self.pool.refused.pop(pos, None)

    def _ignored(self, source: str, url: str, ignored: dict[str, int] | None) -> None:
        """Members of a finished shard that no field map kind names: metrics, log, step log."""
        if not ignored:
            return
        # Names past the job's first MAX_IGNORED_SUFFIXES - 1 of a source count as IGNORED_OTHER
        # in the metric and the step log (a reader caps each shard's only: a sidecar suffix per
        # sample made a series per sample); the per-shard line names them all.
        seen = self.ignored_members.setdefault(source, Counter())
        folded: Counter = Counter()
        for suffix, n in ignored.items():
            known = suffix in seen or len(seen) < P.MAX_IGNORED_SUFFIXES - 1
            folded[suffix if known or suffix == P.IGNORED_OTHER else P.IGNORED_OTHER] += n
            if known:
                seen[suffix] += 0  # held by name from here on
        for suffix, n in folded.items():
            self.metrics.ignored(source, suffix, n)
        seen.update(folded)
        event("members_ignored", source=source, shard=url,
              suffixes=",".join(f"{s or '(no suffix)'}={n}" for s, n in sorted(ignored.items())))

    def _truncated(self, source: str, url: str, truncated: int | None) -> None:
        """Samples of a finished shard sent with their text cut to the readers' --max-seq-len:
        trained on, but not whole, so a run says how many (metrics, log, step log)."""
        if not truncated:
            return
        self.metrics.samples_truncated.labels(source).inc(truncated)
        self.truncated_samples[source] += truncated
        event("samples_truncated", source=source, shard=url, samples=truncated)

    def _skip(self, url: str, skipped: list[P.SkipRecord]) -> None:
        """Bad samples: reported by key (log, metrics, journal), so none is silently lost."""
        if not skipped:
            return
        try:
            self.replay.record_skipped(url, skipped)
        except OSError as e:
            raise Fatal(f"journal write failed recording {len(skipped)} skipped samples of "
                        f"{url} ({e}); stopping. Free the space and start the dispatcher again: "
                        "it resumes from the journal and the shard is read again") from e
        self.skip_log.add(url, skipped)

    def _refuse_unknown(self, sock: zmq.Socket, ident: bytes, role: str, msg: P.Message) -> None:
        # What every peer's next message draws after a dispatcher restart, and the peer says
        # HELLO again: counted, but no warning an operator should act on.
        self.metrics.error("unknown_peer", logging.INFO, role=role, type=msg.type)
        self._send(sock, ident, P.ERROR, code="unknown_peer", ack=msg.seq,
                   message="say hello first (the dispatcher may have restarted)")

    def _on_trainer(self, ident: bytes, msg: P.Message, now: float) -> None:
        if msg.type == P.HELLO:
            self._trainer_hello(ident, msg, now)
            return
        slot = self.delivery.slot_of(ident)
        if slot is None:
            self._refuse_unknown(self.trainer_sock, ident, "trainer", msg)
            return
        slot.last_seen = now
        if msg.type == P.CREDIT:
            self.delivery.credit(slot, msg.get("upto", slot.upto),
                                 msg.get("received", slot.received))
            for record in msg.get("timings", ()):
                self._measured(slot.rank, record)
            if "timings_error" in msg.header:  # the credit counts; the timings could not
                self.metrics.error("malformed", role="trainer", type=msg.type,
                                   detail=f"rank {slot.rank}: {msg['timings_error']}, dropped")
        elif msg.type == P.COMMIT:
            self._commit(slot, msg)
        elif msg.type == P.BYE:
            self.delivery.disconnect(slot, bye=True)
            self.metrics.peers.labels("trainer").set(self.delivery.connected())
            slot.left_at = msg.get("next_step")  # None: an older client, taken as at the end
            event("trainer_left", rank=slot.rank, why="bye",
                  **({} if slot.left_at is None else {"next_step": slot.left_at}))
        elif msg.type != P.HEARTBEAT:
            self.metrics.error("unexpected", role="trainer", type=msg.type)
            self._send(self.trainer_sock, ident, P.ERROR, code="unexpected",
                       message=f"{msg.type} is not a trainer message")

    def _hello_problem(self, msg: P.Message) -> tuple[str, str] | None:
        """(code, message) refusing a trainer's HELLO, or None to accept it."""
        W = self.config.world_size
        rank, world = msg.get("rank"), msg.get("world_size")
        if msg["role"] != "trainer":
            return "role", (f"role {msg['role']!r} connected to the trainer endpoint: point it at "
                            "the dispatcher's reader endpoint (serve --reader-bind)")
        if rank is None or world is None:
            return "role", "trainer hello needs role='trainer', rank and world_size"
        if world != W:
            return "world_size", (f"trainer says world_size={world}, dispatcher plans for "
                                  f"world_size={W}; launch {W} trainer rank{'s' * (W != 1)}, "
                                  f"or restart the dispatcher with --world-size {world}")
        if not 0 <= rank < W:
            return "rank", f"rank {rank} is outside [0, {W})"
        # Refused as malformed: the client never sends these, and taken as they came a 0 node
        # size was advised as --ranks-per-node 0, and a huge prefetch granted unbounded credit.
        for field, low, high, meaning in (
                ("local_world_size", 1, W, "ranks on the trainer's node, at most its world_size"),
                ("prefetch", 1, P.MAX_PREFETCH, "steps of credit ahead of the one being consumed"),
                ("ahead", 0, P.MAX_AHEAD, "steps a consumer of the client takes ahead")):
            value = msg.get(field)
            if value is not None and not low <= value <= high:
                return "malformed", (f"trainer hello: {field} {value} is outside [{low}, {high}] "
                                     f"({meaning})")
        theirs = msg.get("dataset")
        if theirs is not None and (fields := differing(theirs, self.dataset)):
            shown = DATASET_FINGERPRINT_DEFAULTS  # what a field left out stands for
            diff = ", ".join(f"{k}: checkpoint {theirs.get(k, shown.get(k))!r}, "
                             f"dispatcher {self.dataset.get(k, shown.get(k))!r}" for k in fields)
            return "dataset", (f"rank {rank} was restored from a checkpoint of another dataset "
                               f"({diff}); restore a checkpoint of this job or start the "
                               "dispatcher with that job's settings")
        why = self.inputs.admit(f"rank {rank}", msg.get("inputs"), self._peers)
        return None if why is None else ("inputs", why)

    def _peers(self) -> set[str]:
        """The peers connected now, as `InputRules` names them."""
        return ({f"reader {r.name!r}" for r in self.pool.readers.values()}
                | {f"rank {s.rank}" for s in self.slots if s.ident is not None})

    def _trainer_hello(self, ident: bytes, msg: P.Message, now: float) -> None:
        problem = self._hello_problem(msg)
        if problem is not None:
            self.metrics.error(problem[0], role="trainer", detail=problem[1])
            self._send(self.trainer_sock, ident, P.ERROR, code=problem[0], message=problem[1],
                       ack=msg.seq)
            return
        rank = msg["rank"]
        slot = self.delivery.slots[rank]
        want = msg.get("next_step")
        resumed = want if msg.get("resume") else None
        if resumed is not None and self._resumed_elsewhere(ident, msg, slot, resumed, now):
            return
        if (want is not None and resumed is None and not slot.heard
                and self._holds_plans_made_otherwise(ident, msg, want)):
            return
        # A process without a position (a trainer restarted before its first checkpoint) starts
        # after the last commit, or where another rank of its restart started so (held for
        # it): ranks restarted together (torchrun restarts them all) start together, where
        # their own positions would part them.
        fresh = want is None
        if fresh:
            start = self.delivery.fresh_start(slot, now - 2 * self.config.liveness.heartbeat_s)
            want = start if start is not None and start >= self.delivery.lowest else self._fresh_step(slot)
            if self._unservable_fresh(ident, msg, rank, want):
                return
        target = want
        if want > self.next_plan:
            # A reset moves every rank to its step: never past a connected rank that is behind.
            target = min([want] + [s.received for s in self.delivery.slots
                                   if s.ident is not None and s is not slot])
        if not self.delivery.lowest <= target <= self.next_plan:
            try:
                self._reset(target)
            except JournalError as e:
                self._refuse_resume(ident, msg, str(e))
                return
            event("rewind", step=target, requested_by=rank)
        took_over = None
        if slot.ident is not None and slot.ident != ident:
            # The newer claim wins (a restarted process must not wait out the old one's
            # timeout); the older connection is told, so two processes of one rank stop
            # instead of taking turns, each re-introduced by the other's unknown_peer.
            heard = now - slot.last_seen
            event("rank_replaced", logging.WARNING, rank=rank, heard_s=round(heard, 1))
            self._send(self.trainer_sock, slot.ident, P.ERROR, code="replaced", message=(
                f"rank {rank} was claimed by another connection, so this one stops: a restarted "
                f"trainer of rank {rank} is fine; otherwise two processes have rank {rank} "
                "(check each one's RANK)"))
            if heard < 2 * self.config.liveness.heartbeat_s:
                took_over = heard
        self.delivery.connect(slot, ident)
        slot.last_seen = now
        self._live_due = 0.0  # its last_sent may be old: a heartbeat may be due at the next check
        self.delivery.rewind_slot(slot, want, msg.get("prefetch", 1))
        # Its credits run ahead of its loop by its prefetch and what a pool over its client
        # takes: a rank still inside its first step is not past it until beyond both.
        ahead = max(1, msg.get("prefetch", 1)) + max(0, msg.get("ahead", 0))
        self.delivery.mark_resumed(slot, resumed, ahead)
        self.delivery.mark_fresh(slot, want if fresh else None, ahead)
        self.metrics.peers.labels("trainer").set(self.delivery.connected())
        event("trainer_joined", rank=rank, next_step=want)
        # A job (re)joined: its own end decides. A rank lost before and not back yet is still
        # waited for (before, any rank's HELLO forgot it, and the dispatcher exited as soon as
        # one restored rank finished, before the lost one came back).
        self._done_at = None
        self._ranks_gone_said = False
        local, g = msg.get("local_world_size"), self.topology.ranks_per_node
        if local is not None and local != g and not self._topology_warned:
            # The exchange follows the trainers' own topology and stays correct; what was
            # planned node-local may cross nodes, and the step log's byte figures mislead.
            # Said once: at thousands of ranks every HELLO would say it again.
            self._topology_warned = True
            event("topology_mismatch", logging.WARNING, rank=rank, local_world_size=local,
                  ranks_per_node=g, fix=f"restart the dispatcher with --ranks-per-node {local} "
                                        "(or launch the trainers with that many per node)")
        self._send(self.trainer_sock, ident, P.WELCOME, role="trainer", ack=msg.seq,
                   heartbeat_s=float(self.config.liveness.heartbeat_s),
                   world_size=self.config.world_size, next_step=want,
                   num_microbatches=self.config.planner.num_microbatches,
                   payloads=self.config.payloads, dataset=self.dataset, ranks_per_node=g,
                   sources=[st.name for st in self.assembler.streams],
                   **(self._reader_table() if self.config.payloads == "direct" else {}))
        if took_over is not None:
            # Said to the new claim too (a warning, not a stop): a trainer of another job
            # pointed here by mistake would otherwise train this job's data without a word.
            self._send(self.trainer_sock, ident, P.ERROR, code=P.TOOK_OVER, message=(
                f"rank {rank} of this job was held by a live connection (heard {took_over:.1f} s "
                f"ago), which now stops; this trainer goes on at step {want} of the job: a "
                "restarted trainer is fine, but one of another job pointed at this dispatcher "
                "by mistake trains this job's data: stop it"))

    def _refuse_resume(self, ident: bytes, msg: P.Message, why: str) -> None:
        """Answer a trainer's HELLO with ERROR `resume` (it stops with `why`), counted."""
        self.metrics.error("resume", role="trainer", detail=why)
        self._send(self.trainer_sock, ident, P.ERROR, code="resume", message=why, ack=msg.seq)

    def _holds_plans_made_otherwise(self, ident: bytes, msg: P.Message, want: int) -> bool:
        """Refuse a rank that kept running through this dispatcher's restart holding journaled
        steps this one plans anew (`ReplaySource.anew`): its peers would get those steps planned
        otherwise, and their collectives would pair two plans of one step."""
        anew = self.replay.anew
        if anew is None or want <= anew[0]:
            return False
        why = (f"rank {msg['rank']} holds steps {anew[0]}..{want - 1} as the journal planned "
               f"them ({'; '.join(anew[1])}), and this dispatcher plans them anew: restart the "
               "trainers from their last checkpoint, or this dispatcher with the journal's "
               "settings")
        self._refuse_resume(ident, msg, why)
        return True

    def _fresh_step(self, slot: TrainerSlot) -> int:
        """Where a rank without a position starts when no rank of its restart is held: the step
        after the last commit (the job's first step when there is none). A process without a
        checkpoint trained nothing a commit does not cover, whatever its previous process was
        sent: steps prefetched, or trained and lost with it, are served again (journaled, or
        re-planned from the cursors kept since the commit). A rank this dispatcher has not
        heard from since it started may be one that never started: the steps from the one this
        dispatcher started at wait for it, as they waited in the dispatcher before a restart,
        and the journal replays them."""
        start, first = self.replay.committed + 1, self._first_step
        if not slot.heard and first < start and self.replay.resumable(first):
            return first
        return start

    def _unservable_fresh(self, ident: bytes, msg: P.Message, rank: int, start: int) -> bool:
        """Refuse a rank without a position whose start (`_fresh_step`) can no longer be served:
        skipping to the oldest step still held would silently leave the steps between untrained.
        The trainer's error names the steps and the fix."""
        lowest = self.delivery.lowest
        if start >= lowest:
            return False
        try:
            self.replay.cursor_before(start)
        except JournalError as e:
            why = (f"rank {rank} has no checkpoint (no state_dict() loaded), so it starts at step "
                   f"{start}, the first after the last commit, but steps {start}-{lowest - 1} "
                   f"cannot be served again: {e}")
            event("fresh_start_refused", logging.WARNING, rank=rank, steps=f"{start}-{lowest - 1}")
            self._refuse_resume(ident, msg, why)
            return True
        return False

    def _resumed_elsewhere(self, ident: bytes, msg: P.Message, slot: TrainerSlot, step: int,
                           now: float) -> bool:
        """Refuse a rank resuming at `step` from a checkpoint while a live peer resumed at
        another step and has not trained past it: their collectives would pair different steps
        (each rank's share of one step is planned with the others'). Both are told, so neither
        trains on; a peer silent for two heartbeats is a process that is gone, not a peer."""
        other = self.delivery.resumed_elsewhere(
            slot, step, now - 2 * self.config.liveness.heartbeat_s)
        if other is None:
            return False
        why = (f"rank {slot.rank} resumes at step {step} but rank {other.rank} resumed at step "
               f"{other.resumed}: they were restored from different checkpoints and would train "
               "different steps together. Restore every rank from one checkpoint (each rank's "
               "saved state_dict()['next_step'] must be the same)")
        event("resume_mismatch", logging.WARNING, rank=slot.rank, step=step, peer=other.rank,
              peer_step=other.resumed)
        self._refuse_resume(ident, msg, why)
        self._send(self.trainer_sock, other.ident, P.ERROR, code="resume", message=why)
        self.delivery.disconnect(other)
        self.metrics.peers.labels("trainer").set(self.delivery.connected())
        return True

    def _measured(self, rank: int, record: dict) -> None:
        """A rank's timings of one step: log every step now complete, refit when due. Timings
        of a step not planned yet are dropped: no plan predicted them."""
        if not 0 <= record["step"] < self.next_plan:
            return
        planner = self.config.planner
        done = self.measurements.add(rank, record, planner.cost)
        self._log_measured(done)
        refitted = self.measurements.refitted(planner.cost, len(done))
        if refitted is not None:
            planner.cost = refitted
            event("cost_refit", **{f"{p}_{k}": f"{v:.4g}" for p, c in refitted.to_dict().items()
                                   for k, v in c.items() if k != "window"})

    def _log_measured(self, summaries: list[dict]) -> None:
        for summary in summaries:
            if self.step_log is not None:
                self.step_log.write(summary)
            self.metrics.measured(summary)

    def _commit(self, slot: TrainerSlot, msg: P.Message) -> None:
        step = msg["step"]
        if self.fatal is None and self.replay.last_step < step <= self._planned_high:
            # Handed out before a rewind (another rank resumed from an older checkpoint) and
            # not planned again yet: answered once it is, not refused as never planned (the
            # rank stopped on it, and its checkpoint could not be resumed from).
            self._held_commits.append((slot.ident, slot.rank, msg.seq, step))
            return
        self._commit_step(slot.ident, slot.rank, msg.seq, step)

    def _answer_held_commits(self) -> None:
        """Commit the held commits of steps planned again by now (`_commit`)."""
        held, self._held_commits = self._held_commits, []
        for ident, rank, seq, step in held:
            if step <= self.replay.last_step:
                self._commit_step(ident, rank, seq, step)
            else:
                self._held_commits.append((ident, rank, seq, step))

    def _commit_step(self, ident: bytes, rank: int, seq: int, step: int) -> None:
        """Journal the commit of `step` by the trainer at `ident` and answer it (COMMIT, or ERROR
        `commit` with the reason)."""
        if self.fatal is not None:
            # The job stopped on an error, which may concern the steps handed out before it
            # (a step replayed with other samples): journaled now, a commit would make the
            # restart that the error advises resume past them, and fail again.
            why = f"commit({step}) refused: the job stopped ({self.fatal})"
            self.metrics.error("commit", detail=why)
            self._send(self.trainer_sock, ident, P.ERROR, code="commit", message=why,
                       ack=seq)
            return
        try:
            if self.replay.commit(step):
                event("commit", step=step, rank=rank)
        except JournalError as e:
            self.metrics.error("commit", detail=str(e))
            self._send(self.trainer_sock, ident, P.ERROR, code="commit", message=str(e),
                       ack=seq)
            return
        except OSError as e:
            why = (f"commit({step}) was not made durable: the journal write failed ({e}); "
                   "the dispatcher stops and resumes from its journal once restarted")
            self._send(self.trainer_sock, ident, P.ERROR, code="commit", message=why,
                       ack=seq)
            raise Fatal(why) from e
        slot = self.delivery.slots[rank]
        if slot.ident == ident:
            slot.committed = step if slot.committed is None else max(slot.committed, step)
        self._send(self.trainer_sock, ident, P.COMMIT, step=step)  # durable now: tell it
        self.metrics.uncommitted_steps.set(max(0, self.next_plan - 1 - self.replay.committed))

    # -- liveness and sending -------------------------------------------------------
    def _liveness(self, now: float, readers_heard: float | None = None,
                  trainers_heard: float | None = None) -> None:
        """Expire silent peers, heartbeat idle ones. A peer is silent when nothing came from it
        for the timeout up to `*_heard` (default `now`): the last moment its socket was found
        empty, so a dispatcher that was busy itself (a long plan) does not expire peers whose
        messages are waiting to be read. The scan is O(W), so it is skipped until the first
        moment the last scan saw that any peer could be due (`*_heard` <= `now`): a peer's times
        only move forward and a HELLO clears that moment, so skipping changes nothing the scan
        would do."""
        if now < self._live_due:
            return
        live = self.config.liveness
        timeout, beat = live.timeout_s, live.heartbeat_s
        r_heard = now if readers_heard is None else readers_heard
        t_heard = now if trainers_heard is None else trainers_heard
        for reader in list(self.pool.readers.values()):
            if r_heard - reader.last_seen > timeout:
                self._drop_reader(reader, "timeout")
            elif now - reader.last_sent > beat:
                self._send_reader(reader, P.HEARTBEAT)
        readers = self.pool.readers.values()
        seen = min((r.last_seen for r in readers), default=math.inf)
        sent_at = min((r.last_sent for r in readers), default=math.inf)
        # One HEARTBEAT for every idle rank of this round (receivers read no seq from it): at
        # thousands of ranks, encoding and counting each one cost more than sending it.
        heartbeat, sent = None, 0
        for slot in self.delivery.slots:
            if slot.ident is None:
                continue
            if t_heard - slot.last_seen > timeout:
                event("trainer_lost", logging.WARNING, rank=slot.rank)
                slot.lost = True
                self.delivery.disconnect(slot)
                self.metrics.peers.labels("trainer").set(self.delivery.connected())
                continue
            if now - slot.last_sent > beat:
                if heartbeat is None:
                    self._seq += 1
                    heartbeat = P.encode(P.HEARTBEAT, seq=self._seq)
                P.send_frames(self.trainer_sock, [slot.ident, *heartbeat])
                slot.last_sent = now
                sent += 1
            if slot.last_seen < seen:
                seen = slot.last_seen
            if slot.last_sent < sent_at:
                sent_at = slot.last_sent
        if sent:
            self.metrics.bytes_out_of["trainer"].inc(sent * len(heartbeat[0]))
            self.metrics.messages_of["trainer", "out"].inc(sent)
        # A microsecond early: the checks above subtract and this adds, which may round apart.
        self._live_due = min(seen + timeout, sent_at + beat) - 1e-6

    def _drop_reader(self, reader: Reader, why: str) -> None:
        # Only a reader with credit was reading its shard's next sample: one lost while it
        # waited for credit (trainers behind) says nothing about that sample.
        if why == "timeout" and reader.assignments and reader.assignments[0].credits > 0:
            self._reader_lost_in(reader.assignments[0])  # the shard it was reading
        shards = [self.assembler.url(a.pos) for a in reader.assignments]
        for a in list(reader.assignments):
            self._release(reader, a)
        self.pool.drop(reader)
        if reader.payload >= 0:
            self._send_reader_table()
        self.metrics.peers.labels("reader").set(len(self.pool.readers))
        event("reader_left", logging.WARNING if why == "timeout" else logging.INFO,
              name=reader.name, why=why, **({"shards": ",".join(shards)} if shards else {}))

    def _reader_lost_in(self, a: Assignment) -> None:
        """Count a reader lost while reading `a`'s shard; once `max_shard_losses` were lost in
        a row at the same sample, that sample is skipped (`readers_lost`: logged and journaled
        by shard and index, as a reader's own skip is) and the next reader starts after it,
        instead of being handed the sample that took the others down."""
        prog = self.assembler.progress.get(a.pos)
        if prog is None or prog.reader_done:
            return
        if prog.lost_at == prog.next_index:
            prog.losses += 1
        else:
            prog.lost_at, prog.losses = prog.next_index, 1
        limit = self.config.liveness.max_shard_losses
        if prog.losses < limit:
            return
        event("sample_abandoned", logging.WARNING, shard=prog.url, index=prog.next_index,
              readers_lost=prog.losses)
        lost = P.SkipRecord(f"{prog.url}#{prog.next_index}", "readers_lost", prog.next_index)
        self._skip(prog.url, self.assembler.receive(a.pos, [], [], [], [lost]).skipped)

    def _send_reader(self, reader: Reader, type_: str, **fields) -> None:
        self._send(self.reader_sock, reader.ident, type_, **fields)
        reader.last_sent = time.monotonic()

    def _send(self, sock: zmq.Socket, ident: bytes, type_: str, **fields) -> None:
        self._seq += 1
        role = "reader" if sock is self.reader_sock else "trainer"
        self._send_frames(sock, ident, P.encode(type_, seq=self._seq, **fields), role)

    def _send_frames(self, sock: zmq.Socket, ident: bytes, frames: list, role: str) -> None:
        self.metrics.bytes_out_of[role].inc(sum(memoryview(f).nbytes for f in frames))
        self.metrics.messages_of[role, "out"].inc()
        P.send_frames(sock, [ident, *frames])
