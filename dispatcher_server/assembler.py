"""The step assembler: the order window, each open shard's progress, the cursor and the step being filled.

It owns every sample the dispatcher holds before planning and decides which one comes next:
in deterministic mode the global order (shard position, then index) whatever the readers'
timing; in arrival mode the order the samples came in. Samples move as blocks (one per
message, one per take) because per-sample work here is the dispatcher's hottest path. No
sockets: the server feeds it decoded messages and asks it for full steps.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from dispatcher_server.batching import Sample, header_problem
from dispatcher_server.config import BatchConfig
from dispatcher_server.ordering import Cursor, ShardOrder
from dispatcher_server.protocol import SampleHeader, SkipRecord, reference_path


@dataclass(slots=True, kw_only=True)
class ShardProgress:
    """A shard position inside the window: received samples not yet consumed, and how far it got."""

    pos: int
    url: str
    next_index: int  # where a (re)assigned reader starts: one past the last sample accounted for
    buffer: deque[Sample] = field(default_factory=deque)
    nbytes: int = 0
    assignment: int | None = None
    reader_done: bool = False

    @property
    def ref_path(self) -> bytes:
        """The file that `reference` payloads of this shard must name (see protocol.pack_ref)."""
        return reference_path(self.url).encode("utf-8", "surrogateescape")


@dataclass(slots=True)
class Received:
    """What one SAMPLES message changed: samples read, their skips, and indices nobody explained."""

    read: int = 0  # samples the message accounts for, kept or refused
    kept: int = 0
    skipped: list[SkipRecord] = field(default_factory=list)
    out_of_order: list[tuple[str, int]] = field(default_factory=list)
    gaps: list[tuple[int, int]] = field(default_factory=list)  # [first, last) unaccounted indices


@dataclass(slots=True)
class FilledStep:
    """A full step taken out of the assembler, ready to plan."""

    samples: list[Sample]
    epoch: int
    nbytes: int


class StepAssembler:
    """Window -> shard buffers -> step, with the cursor recording what was consumed."""

    def __init__(self, order: ShardOrder, *, mode: str, batch: BatchConfig,
                 num_inflight_shards: int) -> None:
        self.order = order
        self.mode = mode
        self.batch = batch
        self.num_inflight_shards = num_inflight_shards
        self.bytes_seen = self.samples_seen = 0
        self.reset(Cursor())

    def reset(self, cursor: Cursor) -> None:
        """Start again at `cursor`: every buffer and the step being filled are dropped."""
        self.cursor = cursor
        # Epochs read whole from here on, and the samples each yielded: one that yields none
        # (every shard empty, every sample skipped) ends the job instead of looping over epochs.
        self.kept_by_epoch: dict[int, int] = {}
        self.empty_epoch: int | None = None
        epoch = self.order.epoch_of(cursor.base)
        touched = any(self.order.epoch_of(p) == epoch for p in (*cursor.partial, *cursor.done))
        at_start = cursor.base == epoch * self.order.num_shards and not touched
        self._first_whole_epoch = epoch if at_start else epoch + 1
        self.progress: dict[int, ShardProgress] = {}
        self.arrival: deque[list[int]] = deque()  # [pos, count] runs, in arrival order
        self.acc: list[Sample] = []
        self.acc_tokens = self.acc_bytes = 0
        self.acc_cut = False

    # -- the window --------------------------------------------------------------------
    @property
    def exhausted(self) -> bool:
        """Every position of the last epoch is consumed and no step is being filled."""
        end = self.order.end
        return end is not None and self.cursor.base >= end and not self.acc

    def window_end(self) -> int:
        base = self.cursor.base
        end = base + self.num_inflight_shards
        # Deterministic mode takes positions in order, so the window may run on into the next
        # epoch (readers do not idle while an epoch's last shards drain; its samples wait in
        # their buffers, since steps never span epochs). Arrival mode plans in arrival order:
        # it opens an epoch only once the last one is consumed.
        if self.mode != "deterministic":
            end = min(end, self.order.epoch_end(base))
        return end if self.order.end is None else min(end, self.order.end)

    def open_window(self) -> None:
        for pos in range(self.cursor.base, self.window_end()):
            if pos not in self.progress and self.cursor.is_open(pos):
                self.progress[pos] = ShardProgress(pos=pos, url=self.order.url(pos),
                                                   next_index=self.cursor.start_index(pos))

    def unassigned(self) -> list[int]:
        """Open positions no reader holds, lowest first."""
        return sorted(p for p, pr in self.progress.items()
                      if pr.assignment is None and not pr.reader_done)

    # -- intake ------------------------------------------------------------------------
    def receive(self, pos: int, headers: list[SampleHeader], views: list, item_bytes: list[int],
                skipped: list[SkipRecord] = ()) -> Received:
        """Move one message's samples into shard `pos`'s buffer, in a loop over header fields.

        Skips advance the shard's resume point like samples do: a skip the dispatcher has heard
        of is never read again, and one it has not is re-read (and re-reported) by the next
        reader of the shard, so none is lost with a reader that dies. Indices that neither a
        sample nor a skip accounts for are reported as gaps, never passed over in silence.
        """
        prog = self.progress[pos]
        out = Received()
        out.skipped = self.unheard(pos, skipped)
        skip_at = {s.index for s in out.skipped}
        next_index = prog.next_index
        append, at, nbytes = prog.buffer.append, 0, 0
        for key, index, text_len, llm_len, text, items in headers:
            start, at = at, at + len(items)
            if index < next_index:
                out.out_of_order.append((key, index))
                continue
            if index != next_index:
                _gap(next_index, index, skip_at, out)
            next_index = index + 1
            out.read += 1
            problem = header_problem(text_len, llm_len, items)
            if problem is not None:  # counted as read, reported as skipped: never planned
                out.skipped.append(SkipRecord(key, problem, index))
                continue
            size = len(text) + sum(item_bytes[start:at])
            append(Sample(key, pos, index, text_len, llm_len, text, items, views[start:at], size))
            nbytes += size
            out.kept += 1
        last_skip = max(skip_at, default=-1)
        if last_skip >= next_index:
            _gap(next_index, last_skip, skip_at, out)
            next_index = last_skip + 1
        prog.next_index = next_index
        prog.nbytes += nbytes
        if out.kept:
            epoch = self.order.epoch_of(pos)
            self.kept_by_epoch[epoch] = self.kept_by_epoch.get(epoch, 0) + out.kept
        self.bytes_seen += nbytes
        self.samples_seen += out.kept
        if out.kept and self.mode == "arrival":
            runs = self.arrival
            if runs and runs[-1][0] == pos:
                runs[-1][1] += out.kept
            else:
                runs.append([pos, out.kept])
        return out

    def unheard(self, pos: int, skipped: list[SkipRecord]) -> list[SkipRecord]:
        """The skips of shard `pos` not accounted for yet: shard-level ones (index -1) and those
        at or past its resume point (a re-read reports again what the dispatcher has heard)."""
        start = self.progress[pos].next_index
        return [s for s in skipped if s.index < 0 or s.index >= start]

    def reader_done(self, pos: int) -> None:
        self.progress[pos].reader_done = True

    # -- filling a step ----------------------------------------------------------------
    def fill(self) -> None:
        """Take samples in order into the step being filled, up to the global batch or a cut."""
        G = self.batch.global_batch
        while len(self.acc) < G and not self.acc_cut:
            self._finish_drained()
            if self.mode == "deterministic":
                prog = self.progress.get(self.cursor.base)
                if prog is None or not prog.buffer or not self._take(prog, G - len(self.acc)):
                    return
            else:
                if not self.arrival:
                    return
                run = self.arrival[0]  # [pos, count]: that many of pos's buffer, in order
                moved = self._take(self.progress[run[0]], min(G - len(self.acc), run[1]))
                if not moved:
                    return
                run[1] -= moved
                if not run[1]:
                    self.arrival.popleft()
        self._finish_drained()

    def step_ready(self) -> bool:
        if not self.acc:
            return False
        if len(self.acc) >= self.batch.global_batch or self.acc_cut:
            return True
        # The epoch's positions are all consumed: its last, smaller step goes out now.
        return self.cursor.base >= self.order.epoch_end(self.acc[0].pos)

    def take_step(self) -> FilledStep:
        step = FilledStep(samples=self.acc, epoch=self.order.epoch_of(self.acc[0].pos),
                          nbytes=self.acc_bytes)
        self.acc, self.acc_tokens, self.acc_bytes, self.acc_cut = [], 0, 0, False
        return step

    def _finish_drained(self) -> None:
        before = self.order.epoch_of(self.cursor.base)
        for pos in [p for p, pr in self.progress.items() if pr.reader_done and not pr.buffer]:
            del self.progress[pos]
            self.cursor.finish(pos)
        for epoch in range(before, self.order.epoch_of(self.cursor.base)):
            if epoch >= self._first_whole_epoch and not self.kept_by_epoch.pop(epoch, 0):
                self.empty_epoch = epoch

    def _take(self, prog: ShardProgress, limit: int) -> int:
        """Move up to `limit` head samples of `prog` into the step being filled, as one block;
        how many moved (0 if the head must wait).

        The block shares one position, hence one epoch, so only its head is checked against the
        step's epoch; the token budget is checked sample by sample and cuts the step where the
        next sample would exceed it, exactly as taking one sample at a time would.
        """
        buf = prog.buffer
        head = buf[0]
        budget = self.batch.token_budget
        tokens = self.acc_tokens
        if self.acc:
            if budget is not None and tokens + head.llm_len > budget:
                self.acc_cut = True
                return 0
            if self.order.epoch_of(head.pos) != self.order.epoch_of(self.acc[0].pos):
                return 0  # steps never span epochs
        n = min(limit, len(buf))
        if budget is not None:
            n = self._fitting(buf, n, tokens, budget)
            if n == 0:
                return 0
        if n == len(buf):
            taken = list(buf)
            buf.clear()
        else:
            taken = [buf.popleft() for _ in range(n)]
        nbytes = sum(s.nbytes for s in taken)
        prog.nbytes -= nbytes
        self.cursor.consume(head.pos, taken[-1].index)
        self.acc.extend(taken)
        self.acc_tokens = tokens + sum(s.llm_len for s in taken)
        self.acc_bytes += nbytes
        return n

    def _fitting(self, buf: deque[Sample], n: int, tokens: int, budget: int) -> int:
        """How many of the first `n` samples of `buf` fit the token budget (cutting the step at
        the first that does not; the first sample of a step always fits)."""
        fits = 0
        for s in buf:
            if fits == n:
                break
            if (fits or self.acc) and tokens + s.llm_len > budget:
                self.acc_cut = True
                break
            tokens += s.llm_len
            fits += 1
        return fits

    # -- accounting --------------------------------------------------------------------
    def held(self) -> tuple[int, int]:
        """Samples and payload bytes buffered here (shard buffers plus the step being filled)."""
        progress = self.progress.values()
        return (sum(len(p.buffer) for p in progress) + len(self.acc),
                sum(p.nbytes for p in progress) + self.acc_bytes)

    @property
    def avg_sample_bytes(self) -> float:
        return self.bytes_seen / self.samples_seen if self.samples_seen else 0.0


def _gap(lo: int, hi: int, accounted: set[int], out: Received) -> None:
    """Record [lo, hi) as a gap unless skips account for every index in it (bounded work: a
    hostile index far ahead costs one range, not a loop over it)."""
    if hi - lo > sum(1 for i in accounted if lo <= i < hi):
        out.gaps.append((lo, hi))
