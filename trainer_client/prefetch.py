"""Prefetch pool: the model inputs of the micro-batches ahead, prepared off the training loop.

`PrefetchPool(steps)` wraps any iterator of `Step`s (a `DispatcherClient`): a feeder thread
takes the steps as they arrive and hands every encoder item of their micro-batches to a worker
pool, which turns its payload into a ready tensor (`pipeline.preprocess`: image patches and
audio log-mels with exactly the planned number of rows, or, for items a data node already
preprocessed (`--preprocess-on datanode`), a wrap of the shipped array). The training loop
iterates the pool and receives steps whose micro-batches carry `inputs` (`MicrobatchInputs`).

An item whose payload does not decode (a header that counted over a corrupt body: only the
decoder finds it, after the sample was planned into every rank's step) gets a blank input of
exactly its planned rows under `errors="warn"` (the default, as readers do with bad samples),
logged with its key as `event=undecodable_item`: every rank keeps the shapes the plan and the
exchange expect, and the sample trains with a blank item. More than `max_consecutive_errors`
in a row, or any item under `errors="raise"`, stops the loop with the error. An item that
decodes to other rows than the plan counted is recounted from its own bytes by the trainer's
rules (the function data nodes count with): a header that counts the planned length is a file
whose header states another length than it holds (it gets a blank input, as an undecodable
one); one that counts another is data nodes and trainer counting by other rules (that stops
the loop). Where no recount is possible (a header the trainer's rules refuse), the item is
taken for a lying file only once items of its modality decoded as planned.

At most `ahead` micro-batches are prepared or being prepared beyond the step the loop holds
(a step with more micro-batches is still prepared whole), which bounds memory. `workers=0`
preprocesses inside the loop, in `__next__` (the baseline `bench.feed` compares against).

Threads or processes: the work is Pillow decode/resize, libsndfile decode, scipy resampling
and numpy FFTs, which release the GIL for most of their time; on 2 cores `bench.feed` measured
threads preprocessing 1.2-1.9x faster than processes, or within noise of them (processes pay
for pickling every payload in and every float16 array out), so `kind="thread"` is the default.

DataLoader: none is needed. `DispatcherDataset` must run in the main process
(`num_workers=0`, one client per rank); preprocessing parallelism comes from this pool, which
`DispatcherDataset(preprocess=...)` applies.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch

from dispatcher_server import protocol as P
from pipeline.preprocess import (
    PREPROCESS_DTYPE, TENSOR_META, PreprocessConfig, PreprocessError, array_from_payload,
    check_rows, preprocess_item, row_dim,
)
from trainer_client.client import Interrupted, Microbatch, Step
from trainer_client.options import ERROR_MODES, POOL_KINDS

log = logging.getLogger("mmdispatch.prefetch")

_END = object()


@dataclass(kw_only=True, slots=True)
class PrefetchConfig:
    """How far ahead and with what the pool prepares model inputs.

    ahead: micro-batches prepared beyond the step the loop holds (default 4).
    workers: preprocessing workers (default 2; 0 preprocesses inside the loop).
    kind: "thread" (default, measured faster on 2 cores) or "process".
    preprocess: the counting rules the inputs must match (the data nodes').
    errors: "warn" (default: an undecodable item gets a blank input, logged) or "raise".
    max_consecutive_errors: undecodable items in a row that stop the loop under "warn" (a
        wrong setup, not bad data, makes every item fail).
    """

    ahead: int = 4
    workers: int = 2
    kind: str = "thread"
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)
    errors: str = "warn"
    max_consecutive_errors: int = 100

    def __post_init__(self) -> None:
        if not 1 <= self.ahead < P.MAX_AHEAD:  # the client says ahead + 1; the dispatcher caps it
            raise ValueError(f"preprocess ahead={self.ahead} must be 1 to {P.MAX_AHEAD - 1} "
                             "micro-batches")
        if self.workers < 0:
            raise ValueError(f"preprocess workers={self.workers} must be >= 0 (0: in the loop)")
        if self.kind not in POOL_KINDS:
            raise ValueError(f"preprocess pool kind {self.kind!r} must be one of {', '.join(POOL_KINDS)}")
        if self.errors not in ERROR_MODES:
            raise ValueError(f"preprocess errors={self.errors!r} must be one of {', '.join(ERROR_MODES)}")
        if self.max_consecutive_errors < 1:
            raise ValueError(f"preprocess max_consecutive_errors={self.max_consecutive_errors} "
                             "must be >= 1")


class Undecodable:
    """Blank inputs for items whose payload does not decode, under a `PrefetchConfig`'s policy;
    `count` says how many were stood in for. Shared by the pool's workers (thread-safe)."""

    def __init__(self, config: PrefetchConfig) -> None:
        self.config = config
        self.count = 0
        self._in_a_row = 0
        self._planned: set[str] = set()  # modalities an item of decoded to its planned rows
        self._lock = threading.Lock()

    def decoded(self, modality: str) -> None:
        self._in_a_row = 0
        if modality not in self._planned:
            with self._lock:
                self._planned.add(modality)

    def blank(self, error: BaseException, modality: str, enc_len: int) -> torch.Tensor:
        """The stand-in for an item that failed with `error`, or `error` raised (a rules
        mismatch, errors="raise", or too many in a row). Other rows than planned, where this
        trainer's rules count the item's header as planned (`PreprocessError.header_lies`), is
        the file's header lying: a blank input too. Where its header could not be recounted,
        items of the modality that decoded as planned before it say the rules agree."""
        lying = isinstance(error, PreprocessError) and error.mismatch and (
            modality in self._planned if error.header_lies is None else error.header_lies)
        if (not (isinstance(error, PreprocessError) and (error.undecodable or lying))
                or self.config.errors == "raise"):
            raise error
        with self._lock:
            self.count += 1
            self._in_a_row += 1
            in_a_row = self._in_a_row
        if in_a_row > self.config.max_consecutive_errors:
            raise PreprocessError(f"{in_a_row} items in a row did not decode, the last: {error}. "
                                  "A setup problem, not bad data? (raise "
                                  "max_consecutive_errors if the shards are this bad)",
                                  modality, undecodable=True) from error
        log.warning("mmdispatch event=undecodable_item %s; it trains on a blank input of its "
                    "%d planned rows", error, enc_len)
        return _tensor(np.zeros((enc_len, row_dim(modality, self.config.preprocess)), PREPROCESS_DTYPE))


def prepare_item(modality: str, payload, meta: dict, config: PreprocessConfig, *, enc_len: int,
                 key: str, member: str) -> np.ndarray:
    """One item's model input as an array with exactly `enc_len` rows (ValueError naming the
    sample key and member otherwise): a data node's shipped array, or preprocessed here."""
    if TENSOR_META in meta:
        try:
            arr = array_from_payload(payload, meta)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"sample {key!r} member {member!r}: {e}") from None
        check_rows(arr, enc_len, key=key, member=member, on_datanode=True)
        return arr
    return preprocess_item(modality, payload, config, enc_len=enc_len, key=key, member=member,
                           meta=meta)


def _tensor(arr: np.ndarray) -> torch.Tensor:
    # Shipped arrays are views of read-only message frames; torch wants writable memory.
    return torch.from_numpy(arr if arr.flags.writeable else arr.copy())


def _prepare_tensor(*args, **kwargs) -> torch.Tensor:
    return _tensor(prepare_item(*args, **kwargs))


class MicrobatchInputs:
    """The ready model inputs of one micro-batch: per phase, one tensor per item in encode order.

    Set as `mb.inputs`, it holds the micro-batch's encoder batches, never `mb` itself: the two
    would form a reference cycle, and a step's tensors would outlive the loop's use of it until
    a full garbage collection (tens of steps apart in a trainer: GBs of inputs held meanwhile).
    """

    def __init__(self, mb: Microbatch, tensors: dict[str, list[torch.Tensor]]) -> None:
        self.encoders = mb.encoders
        self.tensors = tensors
        self._where = {ph: {int(i): k for k, i in enumerate(eb.item_ids.tolist())}
                       for ph, eb in mb.encoders.items()}

    def item(self, phase: str, item_id: int) -> torch.Tensor:
        """The encoder input of item `item_id` (the `item_input` of `train_microbatch`)."""
        return self.tensors[phase][self._where[phase][int(item_id)]]

    def name(self, phase: str, item_id: int) -> str:
        """'sample KEY member M' of an item, for error messages (`item_name`)."""
        eb = self.encoders[phase]
        k = self._where[phase][int(item_id)]
        return f"sample {eb.sample_keys[k]!r} member {eb.members[k]!r}"


def _item_jobs(mb: Microbatch):
    """(phase, call arguments) of every encoder item of `mb`, in encode order."""
    for phase, eb in mb.encoders.items():
        enc_len = eb.enc_len.tolist()
        for k in range(len(eb.payloads)):
            yield phase, (eb.modalities[k], eb.payloads[k], eb.meta[k]), dict(
                enc_len=int(enc_len[k]), key=eb.sample_keys[k], member=eb.members[k])


def prepare_microbatch(mb: Microbatch, config: PreprocessConfig,
                       undecodable: Undecodable | None = None) -> Microbatch:
    """`mb` with its `inputs` prepared here and now (what the pool does with `workers=0`);
    with `undecodable`, items that do not decode get its blank inputs."""
    tensors: dict[str, list[torch.Tensor]] = {ph: [] for ph in mb.encoders}
    for phase, args, kw in _item_jobs(mb):
        tensors[phase].append(_prepare_or_blank(args, config, kw, undecodable))
    mb.inputs = MicrobatchInputs(mb, tensors)
    return mb


def _prepare_or_blank(args, config: PreprocessConfig, kw, undecodable: Undecodable | None):
    try:
        out = _prepare_tensor(*args, config, **kw)
    except PreprocessError as e:
        if undecodable is None:
            raise
        return undecodable.blank(e, args[0], kw["enc_len"])
    if undecodable is not None:
        undecodable.decoded(args[0])
    return out


class PrefetchPool:
    """Iterator of `steps` whose micro-batches carry ready `inputs`, prepared `ahead` of the loop.

    `wait_s` accumulates the time `__next__` spent blocked (on the dispatcher or on
    preprocessing not yet done): the loop's data wait. Close it (or use `with`) to stop the
    feeder thread and the workers; the source is not closed, and the steps taken from it ahead
    of the loop go back to it (a `DispatcherClient`'s `unread`), so a later loop over the source
    loses none. A closed pool hands out no more steps (`next()` raises RuntimeError).

    Rewind with `pool.load_state_dict(state)`, or the client's own `load_state_dict`: either
    way the steps prepared ahead (of the old position) are dropped, and the pool's next step is
    `state['next_step']`.
    """

    def __init__(self, steps: Iterable[Step], config: PrefetchConfig | None = None) -> None:
        self.config = config or PrefetchConfig()
        self.undecodable = Undecodable(self.config)  # .count: items given a blank input
        self.source: Iterator[Step] = iter(steps)
        self.wait_s = 0.0
        self.next_step: int | None = None  # after the last step handed to the loop
        self._holding = False  # the loop has a step it took and has not asked past yet
        self._executor: Executor | None = None
        self._ready: queue.Queue = queue.Queue()
        self._slots = threading.Semaphore(self.config.ahead)
        self._closing = threading.Event()
        self._feeder: threading.Thread | None = None
        self._held: Step | None = None  # taken from the source, waiting for preparation slots
        self._ended = False
        self._closed = False
        # close() gave up waiting for the feeder: it gives back what it took itself on its way out
        self._orphaned = False
        self._giving_back = threading.Lock()  # close() and an orphaned feeder, one at a time
        add_listener = getattr(self.source, "add_rewind_listener", None)
        if add_listener is not None:
            add_listener(self._drop_prepared)
        taken_ahead = getattr(self.source, "taken_ahead", None)
        if taken_ahead is not None:  # its `ahead` micro-batches, and the step waiting for room
            taken_ahead(self.config.ahead + 1 if self.config.workers else 0,
                        lambda: self.next_step, lambda: self._holding)

    # -- iteration -----------------------------------------------------------------------
    def __iter__(self) -> PrefetchPool:
        return self

    def __next__(self) -> Step:
        if self._closed:
            # Its feeder is gone: a next step would wait forever (and a feeder started again
            # would take steps from the source that nothing gives back).
            raise RuntimeError("next() on a closed PrefetchPool: create a new one over its "
                               "source (the steps it prepared ahead went back to it)")
        if self._ended:
            raise StopIteration
        self._holding = False  # asking for the next step: the loop is done with the last one
        superseded = getattr(self.source, "superseded", lambda: None)()
        if superseded is not None:  # the steps it prepared are another connection's now
            raise superseded
        t0 = time.perf_counter()
        try:
            if self.config.workers == 0:
                step = next(self.source, None)
                if step is None:
                    self._ended = True
                    raise StopIteration
                for mb in step.microbatches:
                    prepare_microbatch(mb, self.config.preprocess, self.undecodable)
            else:
                step = self._next_prepared()
        finally:
            self.wait_s += time.perf_counter() - t0
        self.next_step = step.step + 1
        self._holding = True
        return step

    def _next_prepared(self) -> Step:
        self._start()
        got = self._ready.get()
        if got is _END:
            self._ended = True
            raise StopIteration
        if isinstance(got, BaseException):
            self._ended = True
            raise got
        step, futures, slots = got
        try:
            for mb, per_phase in zip(step.microbatches, futures):
                mb.inputs = MicrobatchInputs(mb, {ph: [f.result() for f in fs] for ph, fs in per_phase.items()})
        except BaseException:
            self._ended = True
            raise
        finally:
            for _ in range(slots):
                self._slots.release()
        return step

    # -- the feeder ----------------------------------------------------------------------
    def _start(self) -> None:
        if self._feeder is not None:
            return
        if self._executor is None:
            self._executor = self._new_executor()
        self._feeder = threading.Thread(target=self._feed, name="mmdispatch-prefetch", daemon=True)
        self._feeder.start()

    def _new_executor(self) -> Executor:
        if self.config.kind == "process":
            import multiprocessing

            # forkserver: the trainer holds threads (ZeroMQ, the client) that fork would copy
            return ProcessPoolExecutor(self.config.workers,
                                       mp_context=multiprocessing.get_context("forkserver"))
        return ThreadPoolExecutor(self.config.workers, thread_name_prefix="mmdispatch-preprocess")

    def _submit(self, args, kw) -> Future:
        if self.config.kind == "process":
            modality, payload, meta = args
            # processes get copies (a view of a message frame does not pickle); arrays come back
            fut = self._executor.submit(prepare_item, modality, bytes(payload), meta,
                                        self.config.preprocess, **kw)
            out: Future = Future()

            def done(f: Future) -> None:
                if f.cancelled():
                    out.cancel()
                elif f.exception() is not None:
                    try:
                        out.set_result(self.undecodable.blank(f.exception(), modality, kw["enc_len"]))
                    except BaseException as e:  # noqa: BLE001 - the loop raises it
                        out.set_exception(e)
                else:
                    self.undecodable.decoded(modality)
                    out.set_result(_tensor(f.result()))
            fut.add_done_callback(done)
            return out
        return self._executor.submit(_prepare_or_blank, args, self.config.preprocess, kw,
                                     self.undecodable)

    def _feed(self) -> None:
        try:
            for step in self.source:
                self._held = step
                slots = min(len(step.microbatches), self.config.ahead)
                for taken in range(slots):
                    while not self._slots.acquire(timeout=0.1):
                        if self._closing.is_set():
                            for _ in range(taken):
                                self._slots.release()
                            return
                if self._closing.is_set():
                    return
                self._held = None
                futures = []
                for mb in step.microbatches:
                    per_phase: dict[str, list[Future]] = {ph: [] for ph in mb.encoders}
                    for phase, args, kw in _item_jobs(mb):
                        per_phase[phase].append(self._submit(args, kw))
                    futures.append(per_phase)
                self._ready.put((step, futures, slots))
            self._ready.put(_END)
        except Interrupted:
            # A rewind drops what this thread took (the next step starts another feeder); a
            # close gives it back to the source.
            return
        except BaseException as e:  # noqa: BLE001 - the loop raises it at its next step
            self._ready.put(e)
        finally:
            if self._orphaned:  # close() is done: nobody else gives back what this one took
                try:
                    self._give_back()
                except ValueError as e:  # the source moved on meanwhile: say what is lost
                    log.warning("mmdispatch event=prefetched_steps_dropped %s", e)

    # -- lifecycle -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The source's `state_dict()` with `next_step` after the last step handed to the loop
        (the feeder has taken steps beyond it from the source)."""
        state = dict(self.source.state_dict())  # type: ignore[attr-defined]
        if self.next_step is not None:
            state["next_step"] = self.next_step
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume at `state` (a `state_dict()` of this pool or its client): the steps prepared
        ahead are dropped, the source is rewound, and the next step is `state['next_step']`."""
        if not hasattr(self.source, "add_rewind_listener"):
            self._drop_prepared()  # a client calls it itself, once its waiting __next__ gave up
        self.source.load_state_dict(state)  # type: ignore[attr-defined]

    def _drop_prepared(self) -> None:
        """Stop the feeder and forget the steps it took: the source is about to move (its
        `load_state_dict`), and they belong to the old position. The next step starts a new
        feeder from the new one."""
        self._stop_feeder()
        self._ready = queue.Queue()
        self._held = None
        self._slots = threading.Semaphore(self.config.ahead)
        self._closing.clear()
        self._ended = False
        self.next_step = None  # the source's state_dict() says where the pool is until then
        self._holding = False

    def _stop_feeder(self) -> None:
        self._closing.set()
        if self._feeder is not None:
            self._feeder.join(5)
            if self._feeder.is_alive():
                # Only a source that ignores the rewind blocks it this long; steps it takes
                # later would belong to the old position.
                raise RuntimeError("the prefetch feeder did not stop within 5 s: its source "
                                   "does not return a step")
            self._feeder = None

    def close(self) -> None:
        remove_listener = getattr(self.source, "remove_rewind_listener", None)
        if remove_listener is not None:
            remove_listener(self._drop_prepared)
        self._closed = True
        self._closing.set()
        if self._feeder is not None:
            # A feeder waiting in a client's __next__ (for a step a peer rank holds back) would
            # take that step after this returned: it gives up now, and the step stays there.
            interrupt = getattr(self.source, "interrupt_waits", None)
            with interrupt() if interrupt is not None else nullcontext():
                self._feeder.join(5)
            # A source that does not return a step (not a client) keeps its feeder: the step it
            # takes once the source returns goes back from the feeder, as this one's go below.
            self._orphaned = self._feeder.is_alive()
            self._feeder = None
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        self._give_back()

    def _give_back(self) -> None:
        """Return the steps taken from the source and never handed to the loop: dropped, they
        were lost to every later loop over the source (it had counted them consumed)."""
        steps = []
        with self._giving_back:
            while True:
                try:
                    got = self._ready.get_nowait()
                except queue.Empty:
                    break
                if isinstance(got, tuple):
                    steps.append(got[0])
            if self._held is not None:
                steps.append(self._held)
                self._held = None
        if not steps:
            return
        unread = getattr(self.source, "unread", None)
        if unread is not None:
            unread(steps)
        else:
            log.warning("mmdispatch event=prefetched_steps_dropped steps=%s: the source cannot "
                        "take them back", ",".join(str(s.step) for s in steps))

    def __enter__(self) -> PrefetchPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
