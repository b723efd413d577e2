"""The step assembler: the order window, each open shard's progress, the cursor and the step being filled.

It owns every sample the dispatcher holds before planning and decides which one comes next.
A dataset is one or more sources, each a `SourceStream`: its own shard order and epochs, its own
window of open shards and cursor, and optionally a seeded shuffle in blocks. A `Blend` picks the
source of each next sample by weight. Within a source, deterministic mode takes the global order
(shard position, then index) whatever the readers' timing, arrival mode the order samples came
in. Samples move as blocks (one per message, one per take) because per-sample work here is the
dispatcher's hottest path. No sockets: the server feeds it decoded messages and asks it for full
steps.

Positions: source s of S reads its local shard position p as global position `p * S + s`, so
one integer names a shard (and its epoch) everywhere: in assignments, buffers and samples. With
one source the two are equal.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import accumulate

from dispatcher_server.batching import Sample, header_problem
from dispatcher_server.blend import Blend, block_permutation
from dispatcher_server.config import BatchConfig
from dispatcher_server.ordering import Cursor, ShardOrder
from dispatcher_server.protocol import SampleHeader, SkipRecord, reference_path

#: What the dispatcher holds for each item of a buffered sample beside its payload bytes: its
#: header (a tuple, its member name and meta dict) and its payload view, about 740 bytes
#: measured. Counted into a sample's bytes, so --max-buffered-bytes bounds samples of hundreds of
#: tiny items too (200 82-byte images a sample held 9 times their payload bytes uncounted).
ITEM_HELD_BYTES = 768


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
    lost_at: int = -1  # next_index when a reader reading this shard was last lost
    # (index, tar offset) where the latest reader of this shard would resume it (SAMPLES
    # `resume`): a reassignment at next_index == index starts its walk at the offset
    resume: tuple[int, int] | None = None
    losses: int = 0  # readers lost in a row at lost_at

    @property
    def ref_path(self) -> bytes:
        """The file or object that `reference` or `direct` payloads of this shard must name (see
        protocol.pack_ref); the configuration refused at start what its mode cannot name."""
        return reference_path(self.url, "direct").encode("utf-8", "surrogateescape")


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
    cut: bool = False  # the token budget ended it before the global batch


class SourceStream:
    """One source's samples in its own order: shard order and epochs, window, cursor, shuffle.

    Without shuffle (`block_size` 1) samples leave their shard buffers in order and the cursor
    counts exactly what left. With shuffle, samples are pulled in order into a block of
    `block_size` (never across one of the source's epochs) and, once the block is complete,
    emitted in a seeded permutation that depends on the block's first sample only. Its position
    for a resume is the cursor where the block began plus how many it emitted: a restart re-reads
    the block, derives the same permutation and skips what was emitted, whatever the timing.

    Arrival mode has no order to derive, so it is recorded: the samples pulled out of the shard
    buffers form one sequence of [pos, count] runs, which each journaled step extends (`took`:
    the runs from the previous journaled step's end to its own) and its position ends in
    (`runs`: from where its block began). A resume takes the samples in exactly the recorded
    order, waiting for them, and goes on in arrival order after it; so a rewind or a restart
    re-plans the journaled steps from the same samples, in the same blocks.
    """

    def __init__(self, index: int, num_sources: int, name: str, order: ShardOrder, *, mode: str,
                 window: int, block_size: int, seed: int, mix: int = 1) -> None:
        self.index, self.S, self.name, self.order = index, num_sources, name, order
        self.mode, self.block_size, self.seed = mode, block_size, seed
        self.configured_window = window
        # Shards a deterministic shuffle block draws from side by side (`_Fill`); 1: one after
        # another. A stream resumed from a position takes the number the position was written
        # with (the fingerprint refuses a resume with another `shuffle_shards`).
        self.configured_mix = mix if mode == "deterministic" and block_size > 1 else 1
        # Bytes and samples received from this source's shards: its average sample size, which
        # credits are granted by (a blend's sources differ by orders of magnitude).
        self.bytes_seen = self.samples_seen = 0
        self.reset(Cursor(), 0)

    @property
    def mean_sample_bytes(self) -> float:
        """The mean size of this source's samples so far; 0 before its first."""
        return self.bytes_seen / self.samples_seen if self.samples_seen else 0.0

    def reset(self, cursor: Cursor, emitted: int, pulled: list[list[int]] = (),
              replay: list[list[int]] = (), mix: int | None = None) -> None:
        """Resume at `cursor` with `emitted` samples of its block out (`mix`: the shards that
        block drew from side by side, as its position says; None: as configured); arrival mode:
        `pulled` are the runs that block (and the next) were pulled in, `replay` the runs of the
        steps to replay, taken first in that order."""
        self.mix = self.configured_mix if mix is None else max(1, int(mix))
        # Every shard a block draws from must be open at once: the window holds them.
        self.window = max(self.configured_window, self.mix)
        self.cursor = cursor  # live: what has left the shard buffers
        self.start = cursor.copy()  # where the current block began
        self.fill = _Fill.of(self, self.start) if self.mix > 1 else None  # how `block` fills
        self.next_fill: _Fill | None = None  # how `next_block` fills, once it begins
        self.block: list[Sample] = []
        self.perm: list[int] | None = None  # set once the block is complete
        self.emitted = 0
        # The next block fills while the current one is emitted (readers never wait for a
        # block to drain); it starts where the current block was complete.
        self.next_block: list[Sample] = []
        self.next_start: Cursor | None = None
        self.block_bytes = 0  # of both blocks' samples not emitted yet
        self._skip = emitted  # of the first block after a reset: emitted before the restart
        self.arrival: deque[list[int]] = deque()  # [global pos, count] runs, in arrival order
        # Arrival mode after a resume: the recorded runs to take first, in this order, and per
        # position how many of their samples have not arrived yet (those never enter `arrival`).
        self.replay: deque[list[int]] = deque([int(p), int(n)] for p, n in [*pulled, *replay]
                                              if n > 0)
        self.replay_left = sum(n for _, n in self.replay)
        self.owed: dict[int, int] = {}
        for p, n in self.replay:
            self.owed[p] = self.owed.get(p, 0) + n
        # The pull sequence, numbered from the first run of `pulled` (where the resumed block
        # began): `pulled_count` pulled so far, the runs from `log_at` on kept in `log`, and
        # `mark`, the end of the sequence the journal holds (the position resumed from).
        self.pulled_count = 0
        self.log: list[list[int]] = []
        self.log_at = 0
        self.mark = sum(int(n) for _, n in pulled)
        self.block_runs: list[list[int]] = []  # runs pulled into `block`, then `next_block`
        self.next_runs: list[list[int]] = []
        # Epochs read whole from here on, and the samples each yielded: one that yields none
        # (every shard empty, every sample skipped) ends the job instead of looping over epochs.
        self.kept_by_epoch: dict[int, int] = {}
        self.one_shard_blocks = 0  # full blocks whose samples all came from one shard
        self.empty_epoch: int | None = None
        epoch = self.order.epoch_of(cursor.base)
        touched = any(self.order.epoch_of(p) == epoch for p in (*cursor.partial, *cursor.done))
        at_start = cursor.base == epoch * self.order.num_shards and not touched and not emitted
        self._first_whole_epoch = epoch if at_start else epoch + 1

    # -- positions ---------------------------------------------------------------------
    def gpos(self, local: int) -> int:
        return local * self.S + self.index

    def epoch_of_sample(self, sample: Sample) -> int:
        return self.order.epoch_of(sample.pos // self.S)

    def position(self) -> dict:
        """This source's part of the cursor a resume starts from; in arrival mode with `runs`,
        the recorded order a resume takes first: the runs its blocks were pulled in, then those
        of a replay not taken yet."""
        if self.block_size <= 1:
            if self.mode == "deterministic" or not self.replay:
                return self.cursor.to_wire()
            return {**self.cursor.to_wire(), "runs": [list(r) for r in self.replay]}
        runs = ({"runs": self.block_runs + self.next_runs + [list(r) for r in self.replay]}
                if self.mode != "deterministic" else {})
        mixed = {"mix": self.mix} if self.mix > 1 else {}
        return {**self.start.to_wire(), "emitted": self.emitted, **runs, **mixed}

    def took(self) -> list[list[int]]:
        """Arrival mode: the runs of the pull sequence from the end of the last journaled step to
        the end of this one (pulled, then recorded but not pulled yet); the journal has them now."""
        end = self.pulled_count + self.replay_left
        out: list[list[int]] = []
        at = self.log_at
        for p, n in [*self.log, *self.replay]:
            lo, hi = max(at, self.mark), min(at + n, end)
            if hi > lo:
                _add_run(out, p, hi - lo)
            at += n
        self.mark = max(self.mark, end)
        self._trim()
        return out

    def journaled(self, runs: list[list[int]]) -> None:
        """Arrival mode: a step was replayed as journaled, its `took` being `runs`."""
        self.mark += sum(n for _, n in runs)
        self._trim()

    def _trim(self) -> None:
        """Forget the pulls the journal holds."""
        upto = min(self.mark, self.pulled_count)
        while self.log and self.log_at + self.log[0][1] <= upto:
            self.log_at += self.log.pop(0)[1]
        if self.log and self.log_at < upto:
            self.log[0][1] -= upto - self.log_at
            self.log_at = upto

    @property
    def heads(self) -> set[int]:
        """The global positions the source's order waits on."""
        if self.fill is not None and self.perm is None:
            waits = self.fill.waits_on()
            return {self.gpos(waits if waits is not None else self.cursor.base)}
        heads = {self.gpos(self.cursor.base)}
        if self.replay:
            heads.add(self.replay[0][0])
        return heads

    def arrived(self, pos: int, count: int) -> None:
        """Arrival mode: `count` samples of `pos` entered its buffer; those a replayed run waits
        for are taken by that run, the rest in arrival order."""
        owed = self.owed.get(pos, 0)
        if owed:
            n = min(owed, count)
            self.owed[pos] = owed - n
            count -= n
        if count:
            runs = self.arrival
            if runs and runs[-1][0] == pos:
                runs[-1][1] += count
            else:
                runs.append([pos, count])

    def _drop_replay(self) -> None:
        """The order to replay cannot be followed (a sample of it will never come: skipped by
        readers lost, or its shard changed): what of it arrived goes first, in arrival order."""
        got = [[p, n - self.owed.get(p, 0)] for p, n in _merged(self.replay)]
        self.arrival.extendleft(reversed([r for r in got if r[1] > 0]))
        self.replay.clear()
        self.replay_left = 0
        self.owed.clear()

    # -- the window --------------------------------------------------------------------
    @property
    def opens_past_done(self) -> bool:
        """Whether positions done above the base widen the window (`window_end`): a block's
        shards finish in any order, and so do shards taken in arrival order; the next one must
        open when one does (a slow one at the base held every later one back, readers idle)."""
        return self.mix > 1 or self.mode != "deterministic"

    def window_end(self) -> int:
        base = self.cursor.base
        end = base + self.window
        if self.opens_past_done and self.cursor.done:
            # `window` open positions, however many above base are done
            while True:
                wider = base + self.window + sum(1 for p in self.cursor.done if p < end)
                if wider == end:
                    break
                end = wider
        # Deterministic mode takes positions in order, so the window may run on into the next
        # epoch (readers do not idle while an epoch's last shards drain; its samples wait in
        # their buffers). Arrival mode plans in arrival order: it opens an epoch only once the
        # last one is consumed.
        if self.mode != "deterministic":
            end = min(end, self.order.epoch_end(base))
        return end if self.order.end is None else min(end, self.order.end)

    def open_window(self, progress: dict[int, ShardProgress]) -> None:
        for local in range(self.cursor.base, self.window_end()):
            g = self.gpos(local)
            if g not in progress and self.cursor.is_open(local):
                progress[g] = ShardProgress(pos=g, url=self.order.url(local),
                                            next_index=self.cursor.start_index(local))

    def finish_drained(self, progress: dict[int, ShardProgress]) -> None:
        before = self.order.epoch_of(self.cursor.base)
        for local in range(self.cursor.base, self.window_end()):
            g = self.gpos(local)
            pr = progress.get(g)
            if pr is not None and pr.reader_done and not pr.buffer:
                del progress[g]
                self.cursor.finish(local)
        for epoch in range(before, self.order.epoch_of(self.cursor.base)):
            if epoch >= self._first_whole_epoch and not self.kept_by_epoch.pop(epoch, 0):
                self.empty_epoch = epoch

    # -- state -------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Samples pulled into the blocks and not emitted yet."""
        return len(self.block) - self.emitted + len(self.next_block)

    @property
    def exhausted(self) -> bool:
        """Every position of the last epoch is consumed and the blocks are emitted."""
        end = self.order.end
        return (end is not None and self.cursor.base >= end and not self.block
                and not self.next_block)

    def drained(self, epoch: int) -> bool:
        """Nothing of `epoch` is left: its positions are consumed and no block holds any."""
        if not self.drained_positions(epoch):
            return False
        return all(not b or self.epoch_of_sample(b[0]) != epoch
                   for b in (self.block, self.next_block))

    # -- taking samples ----------------------------------------------------------------
    def take(self, progress: dict[int, ShardProgress], limit: int, *, epoch: int | None,
             tokens: int, budget: int | None, first: bool) -> tuple[list[Sample], bool]:
        """Up to `limit` next samples of this source in its final order, and whether the token
        budget cut the step there. `epoch`: only samples of that epoch (None: any). `tokens`:
        LLM tokens in the step so far; `first`: the step is empty (its first sample always
        fits, even past the budget)."""
        self.finish_drained(progress)
        if self.block_size <= 1:
            return self._take_in_order(progress, limit, epoch, tokens, budget, first)
        if self.perm is None and not self._fill_block(progress):
            return [], False
        block, perm = self.block, self.perm
        if epoch is not None and self.epoch_of_sample(block[0]) != epoch:
            return [], False  # steps never span epochs
        out: list[Sample] = []
        cut = False
        k = self.emitted
        while len(out) < limit and k < len(block):
            s = block[perm[k]]
            if budget is not None and (out or not first) and tokens + s.llm_len > budget:
                cut = True
                break
            tokens += s.llm_len
            out.append(s)
            k += 1
        self.emitted = k
        self.block_bytes -= sum(s.nbytes for s in out)
        if k == len(block):
            self._next()
        else:
            self._prefill(progress)
        return out, cut

    def _next(self) -> None:
        """The current block is emitted: the next one (perhaps partly filled) takes its place."""
        self.block, self.next_block = self.next_block, []
        self.block_runs, self.next_runs = self.next_runs, []
        self.start = self.next_start if self.next_start is not None else self.cursor.copy()
        if self.mix > 1:
            self.fill = self.next_fill if self.next_fill is not None else _Fill.of(self, self.start)
        self.perm, self.next_start, self.next_fill, self.emitted = None, None, None, 0

    def _pull(self, progress: dict[int, ShardProgress], into: list[Sample]) -> None:
        """Move samples in order into a block, up to its size, never across an epoch."""
        epoch = (self.epoch_of_sample(into[0]) if into
                 else self.order.epoch_of(self.cursor.base))
        runs = self.block_runs if into is self.block else self.next_runs
        fill = self.fill if into is self.block else self.next_fill
        if fill is not None and not fill.shards and not into:
            # Every shard of the epoch it began in had ended (unknown yet when it began): the
            # block begins in the next epoch, as it would have begun had that been known.
            fill = _Fill.of(self, self.cursor)
            if into is self.block:
                self.fill = fill
            else:
                self.next_fill = fill
        while len(into) < self.block_size:
            got = (fill.take(progress, self.block_size - len(into)) if fill is not None else
                   self._take_in_order(progress, self.block_size - len(into), epoch, 0, None, True)[0])
            if not got:
                break
            if self.mode != "deterministic":
                _add_run(runs, got[0].pos, len(got))
            into.extend(got)
            self.block_bytes += sum(s.nbytes for s in got)
            self.finish_drained(progress)

    def _prefill(self, progress: dict[int, ShardProgress]) -> None:
        if self.next_start is not None:
            self._pull(progress, self.next_block)

    def _fill_block(self, progress: dict[int, ShardProgress]) -> bool:
        """Pull in order until the block is complete; False while it waits for samples."""
        block = self.block
        self._pull(progress, block)
        if not block:
            return False
        if (len(block) < self.block_size
                and not self.drained_positions(self.epoch_of_sample(block[0]))):
            return False
        first = block[0]
        # Pulled in order, a full block from one shard: the shard is as large as the block. (A
        # block the epoch's end cut short holds all its source has left: nothing to mix with.)
        if self.mix == 1 and len(block) == self.block_size > 1 and first.pos == block[-1].pos:
            self.one_shard_blocks += 1
        self.perm = block_permutation(self.seed, self.name, first.pos, first.index, len(block))
        self.next_start = self.cursor.copy()
        if self.mix > 1:
            self.next_fill = _Fill.of(self, self.next_start)
        self.emitted, self._skip = self._skip, 0
        # Samples emitted before a restart left the dispatcher's memory but not its order.
        self.block_bytes -= sum(block[i].nbytes for i in self.perm[:self.emitted])
        if self.emitted >= len(block):  # all of it was emitted before the restart
            self._next()
            return self._fill_block(progress)
        return True

    def drained_positions(self, epoch: int) -> bool:
        return self.cursor.base >= self.order.epoch_end(epoch * self.order.num_shards)

    def _take_from(self, prog: ShardProgress, local: int, n: int) -> list[Sample]:
        """The next `n` samples of a shard's buffer (local position `local`), consumed."""
        buf = prog.buffer
        if n == len(buf):
            taken = list(buf)
            buf.clear()
        else:
            taken = [buf.popleft() for _ in range(n)]
        prog.nbytes -= sum(s.nbytes for s in taken)
        self.cursor.consume(local, taken[-1].index)
        return taken

    def _take_in_order(self, progress: dict[int, ShardProgress], limit: int, epoch: int | None,
                       tokens: int, budget: int | None, first: bool) -> tuple[list[Sample], bool]:
        """Move up to `limit` samples out of the shard buffers in this source's order, as one
        block from one position (deterministic: the head; arrival: the oldest run).

        The block shares one position, hence one epoch, so only its head is checked against
        `epoch`; the token budget is checked sample by sample and cuts where the next sample
        would exceed it, exactly as taking one sample at a time would.
        """
        run = runs = None
        if self.mode == "deterministic":
            prog = progress.get(self.gpos(self.cursor.base))
            if prog is None or not prog.buffer:
                return [], False
            n = min(limit, len(prog.buffer))
        else:
            if self.replay:
                runs = self.replay
                prog = progress.get(runs[0][0])
                if prog is None and not self.cursor.is_open(runs[0][0] // self.S):
                    self._drop_replay()  # its shard is finished: the rest never comes
                elif prog is None or not prog.buffer:
                    if prog is not None and prog.reader_done:
                        self._drop_replay()
                    else:
                        return [], False  # waits for the sample the replayed order names
                if self.replay:
                    runs = self.replay
            if not self.replay:
                runs = self.arrival
                if not runs:
                    return [], False
            run = runs[0]  # [pos, count]: that many of pos's buffer, in order
            prog = progress[run[0]]
            n = min(limit, run[1], len(prog.buffer))
        buf = prog.buffer
        head = buf[0]
        if epoch is not None and self.epoch_of_sample(head) != epoch:
            return [], False
        cut = False
        if budget is not None:
            n, cut = _fitting(buf, n, tokens, budget, first)
            if n == 0:
                return [], cut
        taken = self._take_from(prog, head.pos // self.S, n)
        if run is not None:
            run[1] -= n
            if not run[1]:
                runs.popleft()
            if runs is self.replay:
                self.replay_left -= n
            self.pulled_count += n
            _add_run(self.log, head.pos, n)
        return taken, cut


class _Fill:
    """How one deterministic shuffle block draws from `mix` of its source's shards side by side.

    A block pulled one shard after another holds one or two shards whenever shards are as large
    as the block, so its steps do too, every epoch. Instead the block takes `chunk` samples in
    turn from each of the first `mix` open positions of its epoch (from the cursor the block
    began at), in position order, until it is full. A position that ends is dropped where it
    stands in the turn and the next open position of the epoch joins at the end; one that has
    nothing buffered yet is waited for. Those are facts of the data (what a shard holds, what
    its readers skipped), never of reader timing: a position found ended at a block's start
    and one found ended at its turn give the same turns, so a restart from the block's cursor
    pulls the same block in the same order.
    """

    __slots__ = ("stream", "shards", "turn", "taken", "chunk", "end")

    def __init__(self, stream: SourceStream, shards: list[int], end: int) -> None:
        self.stream, self.shards, self.end = stream, shards, end
        self.turn = 0  # index in `shards` of the position whose turn it is
        self.taken = 0  # samples of the current turn taken
        self.chunk = max(1, -(-stream.block_size // stream.mix))

    @staticmethod
    def of(stream: SourceStream, cursor: Cursor) -> _Fill:
        """The fill of a block that begins at `cursor`: the first `mix` open positions of the
        epoch it is in."""
        order = stream.order
        end = order.epoch_end(cursor.base)
        if order.end is not None:
            end = min(end, order.end)
        fill = _Fill(stream, [], end)
        fill._join(cursor, cursor.base - 1, stream.mix)
        return fill

    def _join(self, cursor: Cursor, after: int, n: int) -> None:
        """Add up to `n` open positions above `after`, in order, at the end of the turns."""
        p = after + 1
        while n and p < self.end:
            if cursor.is_open(p):
                self.shards.append(p)
                n -= 1
            p += 1

    def waits_on(self) -> int | None:
        """The local position whose turn it is (None: the block's epoch has no open one)."""
        return self.shards[self.turn] if self.shards else None

    def take(self, progress: dict[int, ShardProgress], limit: int) -> list[Sample]:
        """Up to `limit` next samples of the block, taking turns; [] while the position whose
        turn it is has nothing buffered (or none is left in the epoch)."""
        st = self.stream
        out: list[Sample] = []
        while len(out) < limit and self.shards:
            local = self.shards[self.turn]
            if not st.cursor.is_open(local):  # it ended: the next open position joins
                self.shards.pop(self.turn)
                self._join(st.cursor, max(self.shards, default=local), 1)
                self.taken = 0
                if self.turn >= len(self.shards):
                    self.turn = 0
                continue
            prog = progress.get(st.gpos(local))
            if prog is None or not prog.buffer:
                break
            n = min(limit - len(out), self.chunk - self.taken, len(prog.buffer))
            out.extend(st._take_from(prog, local, n))
            self.taken += n
            if self.taken == self.chunk:
                self.taken = 0
                self.turn = (self.turn + 1) % len(self.shards)
            st.finish_drained(progress)
        return out


class StepAssembler:
    """Shard buffers -> sources (blend, shuffle) -> step, with the cursor recording what was
    consumed.

    `order` is one ShardOrder (one source) or a list, one per source, with `names`, `weights`,
    `windows` (open shards per source) and `block_sizes` (shuffle block per source, 1: none).
    """

    def __init__(self, order: ShardOrder | list[ShardOrder], *, mode: str, batch: BatchConfig,
                 num_inflight_shards: int = 8, names: list[str] | None = None,
                 weights: list[float] | None = None, windows: list[int] | None = None,
                 block_sizes: list[int] | None = None, seed: int = 0,
                 mixes: list[int] | None = None) -> None:
        orders = [order] if isinstance(order, ShardOrder) else list(order)
        S = len(orders)
        names = names or (["default"] if S == 1 else [f"source{i}" for i in range(S)])
        windows = windows or [num_inflight_shards] * S
        block_sizes = block_sizes or [1] * S
        mixes = mixes or [1] * S
        self.mode = mode
        self.batch = batch
        self.seed = seed
        self.weights = weights or [1.0] * S
        self.streams = [SourceStream(i, S, names[i], orders[i], mode=mode, window=windows[i],
                                     block_size=block_sizes[i], seed=seed, mix=mixes[i])
                        for i in range(S)]
        self.reset(None)

    def reset(self, position: dict | Cursor | None, replay: list | None = None) -> None:
        """Start again at `position` (a cursor's wire form, as `position()` gives): every buffer
        and the step being filled are dropped. Arrival mode: `replay` (per source, the `took`
        runs of the journaled steps after `position`) is taken first, after the position's own."""
        if isinstance(position, Cursor):
            position = position.to_wire()
        parts: list = [None] * len(self.streams)
        drawn = None
        if position and "streams" in position:
            parts, drawn = list(position["streams"]), position.get("blend")
        elif position:
            parts = [position]
        if len(parts) != len(self.streams):
            raise ValueError(f"a cursor of {len(parts)} sources cannot resume a dataset of "
                             f"{len(self.streams)}: the dataset file changed since the journal")
        replay = replay or [[] for _ in self.streams]
        for stream, part, runs in zip(self.streams, parts, replay):
            arrival = stream.mode != "deterministic"
            # A block begun before is pulled again as it was: side by side from as many shards
            # as its position says (none: one after another, as positions written before).
            stream.reset(Cursor.from_wire(part) if part else Cursor(),
                         int(part.get("emitted", 0)) if part else 0,
                         part.get("runs", ()) if part and arrival else (), runs if arrival else (),
                         mix=part.get("mix", 1) if part and "emitted" in part else None)
        self.blend = Blend(self.weights, self.seed, drawn)
        self.progress: dict[int, ShardProgress] = {}
        self._opened: list | None = None  # each source's (cursor base, done count) when its window opened
        self.acc: list[Sample] = []
        self.acc_tokens = self.acc_bytes = 0
        self.acc_cut = False

    def position(self) -> dict:
        """The cursor after the samples taken so far, in wire form (what the journal keeps)."""
        if len(self.streams) == 1 and self.streams[0].block_size <= 1:
            return self.streams[0].cursor.to_wire()
        return {"streams": [s.position() for s in self.streams], "blend": list(self.blend.drawn)}

    # -- one source's views, kept for single-source callers ----------------------------
    @property
    def cursor(self) -> Cursor:
        return self.streams[0].cursor

    @property
    def arrival(self) -> deque[list[int]]:
        return self.streams[0].arrival

    # -- positions ---------------------------------------------------------------------
    def stream_of(self, pos: int) -> SourceStream:
        return self.streams[pos % len(self.streams)]

    def url(self, pos: int) -> str:
        st = self.stream_of(pos)
        return st.order.url(pos // st.S)

    def epoch_of(self, pos: int) -> int:
        st = self.stream_of(pos)
        return st.order.epoch_of(pos // st.S)

    def source_of(self, pos: int) -> str:
        return self.stream_of(pos).name

    def heads(self) -> set[int]:
        """The positions the order waits on: credit control lets these have samples even past
        the memory bounds, or the stream would stall. A source emitting a complete shuffle block
        waits on nothing: the next block it prefills takes credits within the bounds."""
        return {h for st in self.streams if st.block_size <= 1 or st.perm is None
                for h in st.heads}

    # -- the window --------------------------------------------------------------------
    @property
    def exhausted(self) -> bool:
        """No step can be filled any more: a source the blend needs has read its last epoch
        (with one source: every position consumed) and no step is being filled."""
        if self.acc:
            return False
        return self.streams[self.blend.next_source()].exhausted

    @property
    def empty_epoch(self) -> tuple[str, int] | None:
        """(source, epoch) of a source epoch read whole that yielded no usable sample."""
        for st in self.streams:
            if st.empty_epoch is not None:
                return st.name, st.empty_epoch
        return None

    def open_window(self) -> bool:
        """Open every position of each source's window that is not open yet; whether a window
        moved. Called on every pump, it works only when one did: nothing but this opens a
        position, and one closed inside the window (finished, or consumed past) stays closed
        until a reset."""
        # (A source whose done positions widen its window also opens one when any ends.)
        bases = [(st.cursor.base, len(st.cursor.done) if st.opens_past_done else 0)
                 for st in self.streams]
        if bases == self._opened:
            return False
        for st in self.streams:
            st.open_window(self.progress)
        self._opened = bases
        return True

    def replay_heads(self) -> set[int]:
        """Arrival mode: the positions the replayed orders wait on (their shards are read before
        any other, or a reader full of other shards stalls the replay)."""
        return {st.replay[0][0] for st in self.streams if st.replay}

    def unassigned(self) -> list[int]:
        """Open positions no reader holds, lowest first."""
        return sorted(p for p, pr in self.progress.items()
                      if pr.assignment is None and not pr.reader_done)

    # -- intake ------------------------------------------------------------------------
    def receive(self, pos: int, headers: list[SampleHeader], views: list, item_bytes: list[int],
                skipped: list[SkipRecord] = (), holder: int = -1) -> Received:
        """Move one message's samples into shard `pos`'s buffer, in a loop over header fields.

        Skips advance the shard's resume point like samples do: a skip the dispatcher has heard
        of is never read again, and one it has not is re-read (and re-reported) by the next
        reader of the shard, so none is lost with a reader that dies. Indices that neither a
        sample nor a skip accounts for are reported as gaps, never passed over in silence.
        `holder` is the sending reader's payload endpoint (direct payload mode).
        """
        prog = self.progress[pos]
        out = Received()
        out.skipped = self.unheard(pos, skipped)
        skip_at = {s.index for s in out.skipped}
        next_index = prog.next_index
        append, at, nbytes = prog.buffer.append, 0, 0
        record = tuple.__new__  # a Sample without the Python-level __new__ of a NamedTuple
        before = [0, *accumulate(item_bytes)]  # payload bytes of the items before each
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
            size = len(text) + before[at] - before[start] + ITEM_HELD_BYTES * (at - start)
            append(record(Sample, (key, pos, index, text_len, llm_len, text, items,
                                   views[start:at], size, holder)))
            nbytes += size
            out.kept += 1
        last_skip = max(skip_at, default=-1)
        if last_skip >= next_index:
            _gap(next_index, last_skip, skip_at, out)
            next_index = last_skip + 1
        prog.next_index = next_index
        prog.nbytes += nbytes
        if out.kept:
            st = self.stream_of(pos)
            epoch = st.order.epoch_of(pos // st.S)
            st.kept_by_epoch[epoch] = st.kept_by_epoch.get(epoch, 0) + out.kept
            if self.mode == "arrival":
                st.arrived(pos, out.kept)
            st.bytes_seen += nbytes
            st.samples_seen += out.kept
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
        """Take samples in order into the step being filled, up to the global batch or a cut:
        the blend names the source of each next sample, the source gives its next ones."""
        G = self.batch.global_batch
        single = len(self.streams) == 1
        budget = self.batch.token_budget
        while len(self.acc) < G and not self.acc_cut:
            s, n = self.blend.run(G - len(self.acc))
            st = self.streams[s]
            # One source: steps never span its epochs. A blend mixes sources at their own epochs.
            epoch = st.epoch_of_sample(self.acc[0]) if single and self.acc else None
            taken, cut = st.take(self.progress, n, epoch=epoch, tokens=self.acc_tokens,
                                 budget=budget, first=not self.acc)
            if cut:
                self.acc_cut = True
            if not taken:
                break
            self.blend.draw(s, len(taken))
            self.acc.extend(taken)
            self.acc_tokens += sum(x.llm_len for x in taken)
            self.acc_bytes += sum(x.nbytes for x in taken)
        for st in self.streams:
            st.finish_drained(self.progress)

    def step_ready(self) -> bool:
        if not self.acc:
            return False
        if len(self.acc) >= self.batch.global_batch or self.acc_cut:
            return True
        if len(self.streams) == 1:
            # The epoch's positions are all consumed: its last, smaller step goes out now.
            st = self.streams[0]
            return st.drained(st.epoch_of_sample(self.acc[0]))
        # A blend ends when a source it needs has read its last epoch: the rest goes out now.
        return self.streams[self.blend.next_source()].exhausted

    def take_step(self) -> FilledStep:
        if len(self.streams) == 1:
            epoch = self.streams[0].epoch_of_sample(self.acc[0])
        else:
            epoch = min(self.stream_of(s.pos).epoch_of_sample(s) for s in self.acc)
        step = FilledStep(samples=self.acc, epoch=epoch, nbytes=self.acc_bytes, cut=self.acc_cut)
        self.acc, self.acc_tokens, self.acc_bytes, self.acc_cut = [], 0, 0, False
        return step

    def took(self) -> list[list[list[int]]]:
        """Arrival mode, for the journal: per source, the runs the step being journaled extends
        the recorded pull sequence by (`SourceStream.took`)."""
        return [st.took() for st in self.streams]

    def journaled(self, took: list[list[list[int]]] | None) -> None:
        """Arrival mode: a step was replayed as journaled, extending the sequence by `took`."""
        for st, runs in zip(self.streams, took or [[] for _ in self.streams]):
            st.journaled(runs)

    # -- accounting --------------------------------------------------------------------
    def held(self) -> tuple[int, int]:
        """Samples and payload bytes buffered here (shard buffers, shuffle blocks and the step
        being filled)."""
        progress = self.progress.values()
        return (sum(len(p.buffer) for p in progress) + len(self.acc)
                + sum(st.pending for st in self.streams),
                sum(p.nbytes for p in progress) + self.acc_bytes
                + sum(st.block_bytes for st in self.streams))

    @property
    def samples_seen(self) -> int:
        """Samples received from every source (each stream counts its own)."""
        return sum(st.samples_seen for st in self.streams)

    @property
    def avg_sample_bytes(self) -> float:
        """The average sample size over every source (credits use each source's own)."""
        seen = self.samples_seen
        return sum(st.bytes_seen for st in self.streams) / seen if seen else 0.0

    def block_bytes(self) -> int:
        """What the largest whole shuffle block of a source holds, at its mean sample size."""
        return int(max((st.block_size * st.mean_sample_bytes for st in self.streams), default=0))

    def sample_bytes(self, pos: int) -> float:
        """The bytes a sample of shard `pos` is expected to hold: its source's average so far,
        or the average of what the shard holds now where that is larger (a source can mix
        small and large samples by shard); 0 while its source has sent none."""
        avg = self.stream_of(pos).mean_sample_bytes
        if not avg:
            return 0.0
        prog = self.progress.get(pos)
        if prog is not None and prog.buffer:
            avg = max(avg, prog.nbytes / len(prog.buffer))
        return avg


def _fitting(buf: deque[Sample], n: int, tokens: int, budget: int, first: bool) -> tuple[int, bool]:
    """How many of the first `n` samples of `buf` fit the token budget, and whether the step is
    cut at the first that does not (the first sample of a step always fits)."""
    fits = 0
    for s in buf:
        if fits == n:
            break
        if (fits or not first) and tokens + s.llm_len > budget:
            return fits, True
        tokens += s.llm_len
        fits += 1
    return fits, False


def _add_run(runs: list[list[int]], pos: int, n: int) -> None:
    if runs and runs[-1][0] == pos:
        runs[-1][1] += n
    else:
        runs.append([pos, n])


def _merged(runs) -> list[list[int]]:
    """Counts per position, in order of first appearance."""
    out: dict[int, int] = {}
    for p, n in runs:
        out[p] = out.get(p, 0) + n
    return [[p, n] for p, n in out.items()]


def _gap(lo: int, hi: int, accounted: set[int], out: Received) -> None:
    """Record [lo, hi) as a gap unless skips account for every index in it (bounded work: a
    hostile index far ahead costs one range, not a loop over it)."""
    if hi - lo > sum(1 for i in accounted if lo <= i < hi):
        out.gaps.append((lo, hi))
