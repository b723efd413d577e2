"""A shard's records read so that the reader's session never waits on a shard for long.

The reader's session thread polls the dispatcher, heartbeats and sends samples. If it also read
a shard whose reads can wait (a `pipe:` command, a server that pauses), one read longer than the
liveness timeout would make the dispatcher drop a healthy reader and hand its shard to another,
and a shard that never answers would hang the reader for good. Such shards are read by a thread
of their own, ahead and in order, into a bounded queue of chunks; the session takes what is
ready, waiting at most a poll interval, and keeps serving the dispatcher meanwhile. So are the
shards of a reader that preprocesses (`--preprocess-on datanode`): decoding a long clip takes
seconds. A local file cannot keep a read waiting, so otherwise it is read in the session thread
as it asks: a thread handing records over costs the reader about a quarter more CPU a sample
(measured on 2 cores).

Records read ahead are bounded in bytes as well as in number: a reader's shard threads share an
`AheadBudget` (`read --read-ahead-mb`), and a thread that finds it spent waits before its next
read until the session takes records, unless its own shard has nothing ahead (each shard may
always hold one record, so no shard waits on another's). 64 records of 50 MB clips from an
object store were 3.2 GB a shard.

Skips travel in the same queue, in order with the records, so a skip is always reported with
(or before) the samples after it. A shard whose reads make no progress (no byte read, no record
produced) for `stall_s` seconds is given up: `take` says so, the shard command is killed, and
the caller reports the rest of the shard as skipped (`shard_stalled`), never silently lost.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from pipeline.errors import SampleError

#: Records per chunk handed from the reading thread to the session (one queue operation each).
CHUNK = 16
#: Chunks held ready beyond what the session took: with CHUNK, at most 64 records read ahead.
DEPTH = 4
#: MiB a reader worker's shard threads may read ahead in all (`read --read-ahead-mb`).
DEFAULT_AHEAD_MB = 256


def stalled_error(shard: str, stall_s: float, sent: int | None = None) -> SampleError:
    """The `shard_stalled` skip of a shard given up after `stall_s` without a byte (`sent`:
    samples of it already sent on, where the caller streams them)."""
    after = f", after the {sent} samples sent," if sent is not None else ""
    return SampleError("shard_stalled", shard, None,
                       f"no byte read for {stall_s:g} s (see --stall-timeout): the rest of the "
                       f"shard{after} is not read")


def record_bytes(entry: Any) -> int:
    """Bytes a read-ahead entry holds: its members' (a skip holds none)."""
    members = getattr(entry, "members", None)
    if not members:
        return 0
    return sum(v.nbytes if hasattr(v, "nbytes") else len(v) for v in members.values())


class AheadBudget:
    """Bytes of records the shard threads of one reader read ahead of its session: past
    `limit`, a thread waits before its next read while its own shard has any ahead."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"read-ahead budget must be >= 1 byte, got {limit}")
        self.limit, self.used = limit, 0
        self.cond = threading.Condition()

    def wait_for_room(self, ahead: ReadAhead) -> None:
        with self.cond:
            while self.used >= self.limit and ahead._ahead > 0 and not ahead._closed.is_set():
                self.cond.wait(0.1)

    def add(self, ahead: ReadAhead, n: int) -> None:
        with self.cond:
            if ahead._closed.is_set():  # `close` gave back all it held; nothing counts since
                return
            ahead._ahead += n
            self.used += n
            if n < 0:
                self.cond.notify_all()

    def release(self, ahead: ReadAhead) -> None:
        """Give back all that `ahead` (closed) holds: nothing of a closed shard counts."""
        with self.cond:
            self.used -= ahead._ahead
            ahead._ahead = 0
            self.cond.notify_all()


class Abandoned(Exception):
    """A read of a shard its reader gave up on: the reading thread unwinds without reporting
    what the cut-off stream would look like (a truncated tar), since nobody takes it any more."""


class _Watched:
    """A shard stream whose reads mark progress; everything else is the stream's own."""

    def __init__(self, stream: Any, progress: Callable[[], None], closed: threading.Event) -> None:
        self._stream, self._progress, self._closed = stream, progress, closed

    def read(self, size: int = -1):
        data = self._stream.read(size)
        if self._closed.is_set():
            raise Abandoned(f"the shard was given up while read ({len(data)} bytes discarded)")
        self._progress()
        return data

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


class ReadAhead:
    """Records (and skips) of one shard, read by a daemon thread or, `threaded=False`, in the
    caller's thread as `take` asks; see the module docstring.

    Use: `skip` as the shard reader's `on_skip` and `watch` as its `on_open`, then `start(records)`.
    `take` returns entries in shard order: a `SampleRecord`, or `(SampleError, index)` for a skip
    (`(SampleError, index, next_at)` where the skip says where the next sample begins).
    """

    def __init__(self, *, stall_s: float, threaded: bool = True,
                 name: str = "mmdispatch-readahead", budget: AheadBudget | None = None) -> None:
        self.stall_s, self.threaded = stall_s, threaded
        self.name = name
        # Threaded only: bytes of this shard's records read and not yet taken by the session,
        # counted in `budget` too (shared by the reader's shards).
        self.budget = budget if threaded else None
        self._ahead = 0
        self._queue: queue.Queue = queue.Queue(maxsize=DEPTH)
        self._ready: deque = deque()  # entries taken off the queue, not yet handed out
        self._chunk: list = []  # entries the thread gathers before queueing them
        self._stream: Any = None
        self._closed = threading.Event()
        self._reading_since: float | None = None  # the thread waits on the shard since then
        self._progress_at = time.monotonic()
        self._ended = False  # the shard ended (entries may still wait in `_ready`)
        self._thread: threading.Thread | None = None
        self._records: Iterator | None = None  # read in the caller's thread (threaded=False)

    # -- the reading thread's side -------------------------------------------------------
    def skip(self, error: SampleError, index: int, at: int = -1) -> None:
        """A skipped sample's entry; `at`: where the next sample begins (`SampleRecord.next_at`),
        kept in the entry when known."""
        (self._chunk if self.threaded else self._ready).append((error, index) if at < 0 else (error, index, at))

    def watch(self, stream: Any) -> Any:
        """The shard stream to read through (its reads mark progress); kept to kill on a stall."""
        self._stream = stream
        if hasattr(stream, "on_bytes"):  # a remote shard: bytes arriving within a read count
            stream.on_bytes = self._mark
        return _Watched(stream, self._mark, self._closed) if self.threaded else stream

    def _mark(self) -> None:
        self._progress_at = time.monotonic()

    def start(self, records: Iterator) -> ReadAhead:
        if not self.threaded:
            self._records = records
            return self
        self._thread = threading.Thread(target=self._run, args=(records,), name=self.name, daemon=True)
        self._thread.start()
        return self

    @property
    def finished(self) -> bool:
        """The shard ended and every entry was handed out."""
        return self._ended and not self._ready

    def _run(self, records: Iterator) -> None:
        end: tuple = ("end", None)
        budget = self.budget
        try:
            while not self._closed.is_set():
                if budget is not None:
                    budget.wait_for_room(self)
                self._reading_since = time.monotonic()
                try:
                    rec = next(records)
                except StopIteration:
                    break
                finally:
                    self._reading_since = None
                self._mark()
                self._chunk.append(rec)
                spent = False
                if budget is not None:
                    budget.add(self, record_bytes(rec))
                    spent = budget.used >= budget.limit
                if len(self._chunk) >= CHUNK or spent or self._queue.empty():
                    # Full, out of budget, or the session has nothing ready: hand it over now
                    # rather than hold records back while the next read may wait (on the
                    # shard, or for the budget the session frees by taking these).
                    self._put(self._flush())
        except BaseException as e:  # noqa: BLE001 - handed to the session thread, raised there
            end = ("error", e)
        finally:
            close = getattr(records, "close", None)
            if close is not None:
                close()  # in this thread: the generator shuts its shard file
        self._put(self._flush())
        self._put(end)

    def _flush(self) -> tuple:
        chunk, self._chunk = self._chunk, []
        return ("entries", chunk)

    def _put(self, item: tuple) -> None:
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    # -- the session's side --------------------------------------------------------------
    def take(self, limit: int, wait_s: float) -> list:
        """Up to `limit` records (with the skips among them), waiting at most `wait_s` for the
        first; [] when none is ready yet. Raises what the reading failed with."""
        out: list = []
        n = 0
        deadline = time.monotonic() + wait_s
        while n < limit:
            if not self._ready and (self._ended or not (
                    self._next() if self._records is not None
                    else self._fill(deadline if not out else None))):
                break
            entry = self._ready.popleft()
            out.append(entry)
            if not isinstance(entry, tuple):
                n += 1
        if self.budget is not None and out:
            self.budget.add(self, -sum(map(record_bytes, out)))
        return out

    def give_back(self, entries: list) -> None:
        """Put `entries`, the tail of what `take` returned, back in front: the next `take`
        returns them first, in order."""
        self._ready.extendleft(reversed(entries))
        if self.budget is not None and entries:
            self.budget.add(self, sum(map(record_bytes, entries)))

    def _next(self) -> bool:
        """Read the next record in this thread (its skips land in `_ready` first, in order)."""
        try:
            self._ready.append(next(self._records))
        except StopIteration:
            self._ended = True
            return bool(self._ready)  # the shard's last skips
        return True

    def _fill(self, deadline: float | None) -> bool:
        """Move the next queued chunk to `_ready`; False when none came in time."""
        while True:
            try:
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                kind, value = self._queue.get(block=deadline is not None, timeout=timeout)
            except queue.Empty:
                return False
            if kind == "entries":
                self._ready.extend(value)
                if value:
                    return True
            elif kind == "error":
                raise value
            else:
                self._ended = True
                return False

    def stalled(self, now: float | None = None) -> bool:
        """The thread has waited on the shard, with no byte read, for over `stall_s` seconds."""
        since = self._reading_since
        now = time.monotonic() if now is None else now
        return since is not None and now - max(since, self._progress_at) > self.stall_s

    def close(self, wait_s: float = 0.0) -> None:
        """Stop reading (a shard command still running is killed); the thread ends on its own,
        waited for up to `wait_s`. What it read ahead no longer counts against the budget."""
        self._closed.set()
        if self.budget is not None:
            self.budget.release(self)
        if self._records is not None:
            close = getattr(self._records, "close", None)
            if close is not None:
                close()  # shuts the shard file if reading began
            return
        if self._reading_since is not None:
            kill = getattr(self._stream, "kill", None)
            if kill is not None:
                kill()
        try:
            while True:
                self._queue.get_nowait()  # a thread blocked on a full queue wakes and sees closed
        except queue.Empty:
            pass
        if wait_s > 0 and self._thread is not None:
            self._thread.join(wait_s)
