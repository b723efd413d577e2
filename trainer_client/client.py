"""Trainer side of the dispatcher: receive this rank's pre-packed micro-batches as torch tensors.

A background thread runs the peer session (`dispatcher_server.session`: HELLO with the step it
needs next and the dataset a restored state belongs to, heartbeats, reconnects with backoff),
receives and decodes STEP messages into tensors that are views over the received frames (no
extra copies) and grants K steps of credit as the trainer consumes. The training loop only iterates; the trade-off is that up to K decoded steps
wait in memory, which is what hides the dispatcher's latency.
"""

from __future__ import annotations

import logging
import math
import mmap
import operator
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
import zmq
from torch.utils.data._utils.collate import default_collate_fn_map

from dispatcher_server import protocol as P
from dispatcher_server.blend import differing
from dispatcher_server.cliopts import check_endpoint, check_malloc_keep_mb, event_line
from dispatcher_server.planner.types import ENCODER_PHASES, RankMicrobatch
from dispatcher_server.security import PeerCurve
from dispatcher_server.session import PeerSession, SessionConfig
from dispatcher_server.stepwire import SAMPLE_ARRAYS, unpack_microbatch
from dispatcher_server.tuning import keep_freed_memory
from trainer_client.fetch import FetchConfig, PayloadFetcher

log = logging.getLogger("mmdispatch.client")
_END = object()
# The heap setting this process's first starting client applied (None: none yet). mallopt is
# process-wide: a later client (a rebuilt DataLoader dataset, a second loop) must not change
# what the training job runs with halfway.
_heap_setting: int | None = None
_heap_lock = threading.Lock()


def _keep_freed_memory_once(threshold_mb: int) -> None:
    """Apply `ClientConfig.malloc_keep_mb` once per process; a later client asking for another
    value is told, in a warning, that it is ignored."""
    global _heap_setting
    with _heap_lock:
        if _heap_setting is None:
            _heap_setting = threshold_mb
            if not keep_freed_memory(threshold_mb) and threshold_mb:
                log.warning("%s", event_line(
                    "malloc_keep_ignored", malloc_keep_mb=threshold_mb,
                    why="this process's C library took no glibc mallopt for it, so the heap is "
                        "as it was"))
        elif threshold_mb != _heap_setting:
            log.warning("%s", event_line(
                "malloc_keep_ignored", malloc_keep_mb=threshold_mb, applied=_heap_setting,
                why="this process's first client set it, and glibc's setting is process-wide"))


class DispatcherError(RuntimeError):
    """The dispatcher refused this trainer (version, world size, resume point...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"dispatcher refused trainer ({code}): {message}")
        self.code = code


class Interrupted(RuntimeError):
    """A `__next__` waiting in another thread (a `PrefetchPool`'s feeder) gave up: the consumer
    it took steps for is closing (`DispatcherClient.interrupt_waits`), and the step it waited
    for stays with the client for whoever iterates it next."""


class Rewound(Interrupted):
    """`DispatcherClient.load_state_dict` moved the client while another thread (a
    `PrefetchPool`'s feeder) waited in `__next__`: the step it waited for is not one of the new
    position's, so it gets none."""


@dataclass(slots=True)
class EncoderBatch:
    """The items this rank encodes for one phase in one micro-batch, in encode (send) order."""

    phase: str
    item_ids: torch.Tensor  # int64[n], ids within the step's phase items
    enc_len: torch.Tensor  # int64[n]
    llm_len: torch.Tensor  # int64[n]
    # raw member bytes (jpg/png/wav...): views over received frames (inline payloads, and
    # direct payloads fetched from the readers) or over the shard files' pages (reference
    # payloads, mapped; read-only either way)
    payloads: list[memoryview]
    modalities: list[str]
    sample_keys: list[str]  # owning sample of each item
    members: list[str]
    meta: list[dict]


@dataclass(slots=True)
class Microbatch:
    """One rank's micro-batch: its LLM samples, its encoder items and its exchange plan."""

    step: int
    index: int
    plan: RankMicrobatch  # numpy views; the exchange tables live in plan.exchanges
    keys: list[str]  # LLM samples in packing order
    sources: list[str]  # per sample, in packing order: the name of the dataset source it came from
    # per sample, in packing order: the text's token ids as the data node tokenized them
    # (int32[text_len]) and its loss mask (bool[text_len], True on training targets)
    text_ids: list[torch.Tensor]
    loss_mask: list[torch.Tensor]
    text_len: torch.Tensor  # int64[s]
    sample_llm_len: torch.Tensor  # int64[s]
    cu_seqlens: torch.Tensor  # int32[s+1], varlen-attention boundaries of the packed sequence
    encoders: dict[str, EncoderBatch]
    tensors: dict[str, torch.Tensor]  # every plan array by name, as views
    inputs: object = None  # ready model inputs (`prefetch.MicrobatchInputs`), set by a PrefetchPool


@dataclass(slots=True)
class Step:
    step: int
    epoch: int
    rank: int
    microbatches: list[Microbatch] = field(default_factory=list)


def _tensor(view: np.ndarray) -> torch.Tensor:
    if view.size == 0:
        return torch.zeros(0, dtype=torch.int64)
    # The frame outlives the tensor (the tensor keeps the buffer alive); no copy is made.
    return torch.frombuffer(view, dtype=torch.int64)


class ShardFiles:
    """Reads `reference` payloads: each item's bytes straight from its shard file.

    Mapped (the default): every item is a read-only view of its shard file's pages, so the
    payload is never copied and ranks on one node share the page cache instead of holding
    copies; views stay valid as long as they are held. Shards must then not be truncated
    while trainers read them (a mapped file that shrinks kills the process with SIGBUS).
    `mapped=False` copies each micro-batch's items into one buffer with `os.preadv` instead.
    The most recently used files stay open (or mapped). Only the paths the dispatcher
    accepted from its readers (the configured shards) ever arrive here.
    """

    def __init__(self, max_open: int = 64, *, mapped: bool = True) -> None:
        self.max_open = max_open
        self.mapped = mapped
        self._fds: dict[bytes, int] = {}  # insertion order = recency
        # the same for mapped files, with the (inode, size, mtime) they were mapped at
        self._maps: dict[bytes, tuple[memoryview, tuple]] = {}

    def read(self, refs: list[memoryview]) -> list[memoryview]:
        """The bytes each reference in `refs` names, one view per item."""
        spans = [P.unpack_ref(r) for r in refs]
        if self.mapped:
            out, views = [], {}
            for ref in spans:
                path, offset, n, _ = ref
                view = views.get(path)
                if view is None:  # once per file and call: is the map still the file?
                    view, sig = self._map(path)
                    views[path] = view
                    P.check_stamp(ref, sig[1], sig[2])  # the version its reader counted
                if offset + n > len(view):
                    self._changed(path, max(0, min(n, len(view) - offset)), n, offset)
                out.append(view[offset:offset + n])
            return out
        buf = memoryview(bytearray(sum(ref.size for ref in spans)))
        out, at, checked = [], 0, set()
        for ref in spans:
            path, offset, n, _ = ref
            fd = self._fd(path)
            if path not in checked:  # once per file and call
                checked.add(path)
                st = os.fstat(fd)
                P.check_stamp(ref, st.st_size, st.st_mtime_ns)
            got = os.preadv(fd, [buf[at:at + n]], offset) if n else 0
            if got != n:
                self._changed(path, got, n, offset)
            out.append(buf[at:at + n])
            at += n
        return out

    @staticmethod
    def _changed(path: bytes, got: int, n: int, offset: int) -> None:
        raise OSError(f"shard {path.decode(errors='replace')!r} holds {got} of the {n} "
                      f"bytes at offset {offset} its reader counted: changed on disk?")

    def _map(self, path: bytes) -> tuple[memoryview, tuple]:
        """The file mapped whole, and its (inode, size, mtime) as mapped; mapped again if it
        was replaced or resized since (a map longer than its file would hand out views that
        fault)."""
        held = self._maps.pop(path, None)
        try:
            st = os.stat(path)
            sig = (st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            sig = None  # _open below says why
        if held is None or held[1] != sig:
            fd = self._open(path)
            try:
                st = os.fstat(fd)
                sig = (st.st_ino, st.st_size, st.st_mtime_ns)
                view = (memoryview(mmap.mmap(fd, st.st_size, access=mmap.ACCESS_READ))
                        if st.st_size else memoryview(b""))
            finally:
                os.close(fd)  # the map keeps the file
            if len(self._maps) >= self.max_open:
                # Dropped, not closed: payload views still held keep their map alive.
                self._maps.pop(next(iter(self._maps)))
            held = (view, sig)
        self._maps[path] = held
        return held

    @staticmethod
    def _open(path: bytes) -> int:
        try:
            return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise OSError(f"payloads='reference': this trainer cannot open shard "
                          f"{path.decode(errors='replace')!r} ({e.strerror}): it is not mounted "
                          "here at the same path as on the data nodes, or it was removed or "
                          "renamed since its reader read it (leave shards in place while a job "
                          "reads them)") from None

    def _fd(self, path: bytes) -> int:
        fd = self._fds.pop(path, None)
        if fd is None:
            fd = self._open(path)
            if len(self._fds) >= self.max_open:
                os.close(self._fds.pop(next(iter(self._fds))))
        self._fds[path] = fd
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._maps.clear()  # unmapped once no payload view refers to them


_EXCHANGE_FIELDS = ("encode_items", "encode_enc_len", "encode_llm_len", "send_tokens",
                   "recv_items", "recv_llm_len", "recv_offsets", "recv_tokens")


def _plan_tensors(plan: RankMicrobatch) -> dict[str, torch.Tensor]:
    """Every plan array by name ("samples", "vision.send_tokens", ...) as a tensor view."""
    out = {n: _tensor(getattr(plan, n)) for n in SAMPLE_ARRAYS}
    for p in ENCODER_PHASES:
        ex = plan.exchanges.get(p)
        for n in _EXCHANGE_FIELDS:
            out[f"{p}.{n}"] = _tensor(getattr(ex, n)) if ex is not None else _tensor(np.zeros(0))
    return out


def text_tensors(tokens: list[bytes], text_len: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per sample (int32 ids, bool loss mask) from the wire's `tokens`; ProtocolError when a
    sample's token count is not its planned text length.

    Decoded for the whole micro-batch at once (one array per id width, one for the masks) and
    split into per-sample views: per-sample numpy and torch calls cost the trainer ~10 us a
    sample, more than the rest of a step's decoding.
    """
    lengths = [int(n) for n in text_len]
    groups: dict[int, list] = {}
    bits: list = []
    for k, (data, n) in enumerate(zip(tokens, lengths)):
        if not P.tokens_ok(data, n):
            raise P.ProtocolError(f"step: a sample's {len(data)} token bytes are not the wire form "
                                  f"of its planned {n} text tokens")
        width, raw_ids, raw_bits = P.split_tokens(data, n)
        groups.setdefault(width, []).append((k, raw_ids, n))
        bits.append(raw_bits)
    ids: list = [None] * len(lengths)
    for width, group in groups.items():
        flat = np.frombuffer(b"".join(raw for _, raw, _ in group), P.TOKEN_DTYPES[width]).astype(np.int32)
        for (k, _, _), t in zip(group, torch.from_numpy(flat).split([n for _, _, n in group])):
            ids[k] = t
    # Each sample's mask bits start on a byte boundary: unpacked per sample, joined, split once.
    flat_mask = np.concatenate([np.unpackbits(np.frombuffer(b, np.uint8), count=n, bitorder="little")
                                for b, n in zip(bits, lengths)]) if lengths else np.zeros(0, np.uint8)
    masks = list(torch.from_numpy(flat_mask.astype(bool)).split(lengths))
    return ids, masks


def decode_step(msg: P.Message, files: ShardFiles | None = None,
                fetched: list[list[memoryview]] | None = None,
                sources: Sequence[str] = (P.DEFAULT_SOURCE,)) -> Step:
    """Tensors and views over `msg`'s frames; ProtocolError if the frames disagree with the header.

    With `files` (reference payload mode) the payload frames hold references, read from disk;
    `fetched` (direct mode) holds the bytes they name, per micro-batch (`fetch.PayloadFetcher`).
    `sources`: the job's source names (WELCOME's), which the samples' source indices name.
    """
    out = Step(step=msg["step"], epoch=msg["epoch"], rank=msg["rank"])
    for m, (mb, (buf, items)) in enumerate(zip(msg["microbatches"], P.microbatch_frames(msg))):
        # Views of the coalesced data frame (sizes checked on decode), no copies.
        payloads = (fetched[m] if fetched is not None else items if files is None
                    else files.read(items))
        plan = unpack_microbatch(buf, mb["arrays"], rank=msg["rank"], microbatch=m,
                                 world_size=msg["world_size"])
        tensors = _plan_tensors(plan)
        encoders, k = {}, 0
        for phase in ENCODER_PHASES:
            ex = plan.exchanges.get(phase)
            n = 0 if ex is None else len(ex.encode_items)
            heads = mb["items"][k:k + n]
            if len(heads) != n:
                raise P.ProtocolError("step: fewer item headers than encode items")
            if ex is not None:
                encoders[phase] = EncoderBatch(
                    phase=phase, item_ids=tensors[f"{phase}.encode_items"],
                    enc_len=tensors[f"{phase}.encode_enc_len"],
                    llm_len=tensors[f"{phase}.encode_llm_len"], payloads=list(payloads[k:k + n]),
                    modalities=[h.modality for h in heads], sample_keys=[h.key for h in heads],
                    members=[h.member for h in heads], meta=[h.meta for h in heads])
            k += n
        if k != len(payloads) or len(mb["keys"]) != len(plan.samples):
            raise P.ProtocolError("step: payload or key counts disagree with the plan arrays")
        cu = torch.zeros(len(plan.samples) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(tensors["sample_llm_len"], 0)
        text_ids, loss_mask = text_tensors(mb["tokens"], plan.text_len.tolist())
        out.microbatches.append(Microbatch(
            step=out.step, index=m, plan=plan, keys=list(mb["keys"]),
            sources=_source_names(mb["sources"], sources), text_ids=text_ids, loss_mask=loss_mask,
            text_len=tensors["text_len"], sample_llm_len=tensors["sample_llm_len"],
            cu_seqlens=cu, encoders=encoders, tensors=tensors))
    return out


def _source_names(raw: bytes, names: Sequence[str]) -> list[str]:
    """Each sample's source name, from a micro-batch's `sources` (indices into `names`)."""
    index = np.frombuffer(raw, P.SOURCE_DTYPE)
    if len(index) and int(index.max()) >= len(names):
        raise P.ProtocolError(f"step: source index {int(index.max())} is not among the "
                              f"{len(names)} sources the dispatcher named")
    if len(names) == 1:
        return [names[0]] * len(index)
    return [names[i] for i in index.tolist()]


def loop_stopped_at(next_step: int | None, holding: bool) -> int | None:
    """The step after the last a training loop finished, as a client or its consumer says it
    leaves: `next_step` (the step after the last handed to the loop), or the step handed last
    when the loop is still `holding` it: it never asked past that step, so nothing says it
    trained it (an exception in the step, handled or not, a SIGTERM's SystemExit, a `break`
    before or after training it). `DispatcherClient.close` counts it trained when the loop
    committed it or reported its timings. The dispatcher waits for a resume of a job left so
    before it exits."""
    if next_step is not None and holding:
        return next_step - 1
    return next_step


@dataclass(kw_only=True, slots=True)
class ClientConfig:
    prefetch: int = 2  # K: steps granted ahead of the one being consumed
    heartbeat_s: float = 1.0
    timeout_s: float = 5.0  # dispatcher silent this long: reconnect
    # No WELCOME this long after (re)connecting starts: iteration raises `Unreachable`.
    connect_timeout_s: float | None = 60.0
    poll_ms: int = 10
    backoff_min_s: float = 0.1
    backoff_max_s: float = 5.0
    step_timeout_s: float | None = 600.0  # longest wait for one step before TimeoutError
    # Reference payloads as views of the mapped shard files (no copy); False copies them with
    # os.preadv, for shard files that may be truncated while read (see ShardFiles).
    map_shards: bool = True
    secret_file: str | None = None  # CurveZMQ: this trainer's key pair
    server_public_file: str | None = None  # CurveZMQ: the dispatcher's public key
    # Direct payloads: a reader silent this long on a fetch is replaced by another live one,
    # at most `fetch_attempts` readers per request (see fetch.PayloadFetcher).
    fetch_timeout_s: float = 5.0
    fetch_attempts: int = 4
    # glibc reuses freed heap blocks up to this many MiB instead of fresh pages, set once per
    # process by the first client that starts (`keep_freed_memory`); 0 leaves glibc's own
    # thresholds. Off by default, unlike serve's and read's 16: a fixed threshold trades the
    # trainer's step time for its RSS (see docs/configuration.md, --malloc-keep-mb).
    malloc_keep_mb: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.prefetch <= P.MAX_PREFETCH:  # the dispatcher refuses a HELLO past it
            raise ValueError(f"prefetch must be 1 to {P.MAX_PREFETCH}, got {self.prefetch}")
        check_malloc_keep_mb("malloc_keep_mb", self.malloc_keep_mb)
        if self.step_timeout_s is not None and not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s={self.step_timeout_s} must be > 0 seconds (or None)")
        if not self.fetch_timeout_s > 0 or self.fetch_attempts < 1:
            raise ValueError(f"need fetch_timeout_s > 0 and fetch_attempts >= 1, got "
                             f"{self.fetch_timeout_s} and {self.fetch_attempts}")
        self.session("tcp://127.0.0.1:1")  # the session's own checks, now rather than at start()

    def session(self, address: str) -> SessionConfig:
        return SessionConfig(address=address, heartbeat_s=self.heartbeat_s,
                             timeout_s=self.timeout_s, connect_timeout_s=self.connect_timeout_s,
                             poll_ms=self.poll_ms, backoff_min_s=self.backoff_min_s,
                             backoff_max_s=self.backoff_max_s,
                             curve=PeerCurve.from_files(self.secret_file, self.server_public_file))

    def fetcher(self, out: queue.Queue, decode) -> PayloadFetcher:
        """The direct-mode payload fetcher of a client whose steps go to `out`, decoded by
        `decode(msg, fetched)`."""
        return PayloadFetcher(decode=decode,
                              out=out, curve=PeerCurve.from_files(self.secret_file,
                                                                  self.server_public_file),
                              config=FetchConfig(timeout_s=self.fetch_timeout_s,
                                                 attempts=self.fetch_attempts,
                                                 backoff_min_s=self.backoff_min_s,
                                                 backoff_max_s=self.backoff_max_s))


def _step_number(step) -> int | None:
    """A saved `next_step` as an int: a numpy or tensor integer (a checkpoint that went through
    either) is one, as `commit` takes it; ValueError for anything else."""
    if step is None:
        return None
    number = _integral(step)
    if number < 0:
        raise ValueError(f"state next_step must be a non-negative int, got {step!r}")
    return number


def _integral(step) -> int:
    """`step` as an int if it is an integer other than a bool (numpy and tensor integers
    included), else -1."""
    try:
        return _checked_index(step)
    except TypeError:
        return -1


def _checked_index(value) -> int:
    """`value` as an int if it is an integer other than a bool (numpy and tensor integers
    included), else TypeError."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise TypeError(f"{value!r} is a bool")
    return operator.index(value)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


#: ERROR codes a reconnect cannot fix: the training loop sees them as DispatcherError.
_FATAL_CODES = ("version", "world_size", "rank", "role", "resume", "dataset", "inputs", "replaced",
                "halted")


def halted_error(step: int, why: str) -> DispatcherError:
    """The error a rank's loop raises when the dispatcher halted the job before `step`."""
    # The reason usually says how to start the dispatcher again (a full journal disk): not twice.
    fix = ("Then resume the trainers from the last commit" if "dispatcher again" in why
           else "Fix it and restart the dispatcher, then resume from the last commit")
    return DispatcherError("halted", f"the dispatcher stopped the job on an error before step "
                                     f"{step}: {why}. {fix}")


def dataset_difference(saved: dict, served: dict) -> str:
    """The fields in which two dataset fingerprints differ, as 'name: saved X, dispatcher Y'."""
    return "; ".join(f"{n}: saved {saved.get(n)!r}, dispatcher {served.get(n)!r}"
                     for n in differing(saved, served))


@dataclass(slots=True)
class _Commit:
    step: int
    seq: int  # of the COMMIT last sent for it: an ERROR acking it fails this commit
    done: threading.Event
    error: list


#: The keys of `DispatcherClient.state_dict()`.
_STATE_KEYS = frozenset({"next_step", "rank", "world_size", "dataset"})

#: Measured steps a client holds while it cannot send them.
MAX_PENDING_TIMINGS = 16
#: Seconds a training loop waits for a step before its client says so (a warning line), then
#: again every WAIT_SAY_EVERY_S: the reason (no reader connected, a rank stopped) is in the
#: dispatcher's log, which runs elsewhere; the trainers' log said nothing until step_timeout_s.
WAIT_SAY_S = 30.0
WAIT_SAY_EVERY_S = 120.0


class _TrainerPeer:
    """The client thread's side of the session: receives steps, grants credits, sends commits.

    It owns everything the thread touches; the training loop talks to it only through the
    `commands` queue (consumed steps, commits, resyncs) and reads `steps` and `dataset`.
    """

    def __init__(self, *, hello: dict, prefetch: int, map_shards: bool, next_step: int | None,
                 dataset: dict | None, steps: queue.Queue, commands: queue.Queue,
                 fetcher=None, generation: int = 0) -> None:
        self.hello = hello
        self.prefetch = prefetch
        self.map_shards = map_shards
        self.next_expected = next_step  # next step to receive
        # next_step came from a checkpoint, until a WELCOME took it: the dispatcher checks that
        # every rank of a restart resumes at one step (a reconnect says where it is, not this).
        self.resuming = next_step is not None
        self.consumed = next_step  # next step the training loop takes
        self.restored = dataset  # the fingerprint of the job a restored state came from
        self.dataset: dict | None = None  # the dispatcher's, from WELCOME
        self.sources: list[str] = [P.DEFAULT_SOURCE]  # the job's source names, from WELCOME
        self.steps = steps
        self.commands = commands
        # The client's rewind count as of the last resync this thread carried out: stamped on
        # every item it delivers, so the loop drops what was on its way before a rewind.
        self.generation = generation
        self.commits: list[_Commit] = []
        self.halted: DispatcherError | None = None  # the END that stopped the job on an error
        self.files: ShardFiles | None = None  # reference payload mode
        self.make_fetcher = fetcher  # out queue -> PayloadFetcher (direct mode)
        self.fetcher: PayloadFetcher | None = None  # direct payload mode
        self.credit_sent: tuple | None = None
        self.timings: list[dict] = []  # measured steps not yet sent (bounded)
        self.topology_warned = False
        # The step after the last the training loop took (set by DispatcherClient.close): a BYE
        # before the end of the stream says the steps from there are untrained.
        self.left_at: int | None = None

    # -- PeerRole ------------------------------------------------------------------------
    def hello_fields(self) -> dict:
        fields = dict(self.hello, next_step=self.next_expected, prefetch=self.prefetch)
        if self.resuming:
            fields["resume"] = True
        if self.restored is not None:
            fields["dataset"] = self.restored
        return fields

    def reset(self) -> None:
        self.credit_sent = None

    def bye_fields(self) -> dict:
        return {} if self.left_at is None else {"next_step": self.left_at}

    def on_welcome(self, session: PeerSession, msg: P.Message) -> None:
        self._check_dataset(msg.get("dataset"))
        self._payload_mode(msg.get("payloads", "inline"))
        self._check_topology(msg.get("ranks_per_node"))
        self.sources = [str(n) for n in msg.get("sources", [P.DEFAULT_SOURCE])] or [P.DEFAULT_SOURCE]
        if self.fetcher is not None:
            self.fetcher.readers = msg.get("readers", [])
        self.next_expected = msg["next_step"]
        self.resuming = False
        self.halted = None  # a dispatcher welcoming it serves (a halted one sends END again)
        if self.consumed is None:
            self.consumed = msg["next_step"]
        for c in self.commits:
            # Sent to a dispatcher that died or forgot us: the new session journals it.
            c.seq = session.send(P.COMMIT, step=c.step)

    def _check_topology(self, ranks_per_node: int | None) -> None:
        """Say in the trainer's own log (once) that its node holds another number of ranks
        than the dispatcher plans node-local exchanges for: the dispatcher's log says it too,
        but whoever launched the trainers reads theirs."""
        local = self.hello["local_world_size"]
        if ranks_per_node is None or ranks_per_node == local or self.topology_warned:
            return
        self.topology_warned = True
        log.warning("mmdispatch event=topology_mismatch rank=%s local_world_size=%s "
                    "ranks_per_node=%s why='the dispatcher plans node-local exchanges for nodes of "
                    "%s ranks: training stays correct, but bytes planned to stay on a node cross "
                    "nodes' fix='restart the dispatcher with --ranks-per-node %s, or launch the "
                    "trainers with torchrun --nproc-per-node %s'",
                    self.hello["rank"], local, ranks_per_node, ranks_per_node, local, ranks_per_node)

    def on_message(self, session: PeerSession, msg: P.Message) -> bool:
        if msg.type == P.STEP and session.welcomed:
            if msg["step"] > self.next_expected:
                session.hello()  # a step was lost (peer reconnected): ask again from ours
            elif msg["step"] == self.next_expected:
                self._deliver(msg)
                self.next_expected += 1
        elif (msg.type == P.END and session.welcomed
              and msg.get("next_step", self.next_expected) == self.next_expected):
            # Stopped on an error, not at the end of the data: the training loop must fail,
            # not finish as if the job were complete.
            why = msg.get("message") or "its log says why: event=fatal"
            if msg["reason"] != "halted":
                self._deliver(_END)
            else:
                halted = halted_error(self.next_expected, why)
                self._deliver(halted)
                # A commit it did not answer before END goes unanswered: a halted dispatcher
                # exits once every rank was told, and the caller of commit() waited out its
                # whole timeout, then blamed the address. It hears the reason now, as do later
                # ones (the checkpoint resumes from the last commit acknowledged).
                self.halted = halted
                self.fail_commits(halted)
        elif msg.type == P.READERS and self.fetcher is not None:
            self.fetcher.readers = msg["readers"]
        elif msg.type == P.COMMIT:
            for c in [c for c in self.commits if c.step <= msg["step"]]:
                self.commits.remove(c)
                c.done.set()
        elif msg.type == P.ERROR:
            self._on_error(session, msg)
        return True

    def tick(self, session: PeerSession) -> bool:
        self._do_commands(session)
        if session.welcomed:
            credit = (self.consumed + self.prefetch, self.next_expected)
            if credit != self.credit_sent or self.timings:
                extra = {"timings": self.timings} if self.timings else {}
                session.send(P.CREDIT, upto=credit[0], received=credit[1], **extra)
                self.credit_sent, self.timings = credit, []
        return False

    # -- parts ---------------------------------------------------------------------------
    def _deliver(self, item) -> None:
        """A STEP message (decoded, payloads read or fetched) or the end, in order, stamped
        with the generation it belongs to."""
        if self.fetcher is not None:
            # It passes the end on after the steps before it, each with this stamp: a fetch
            # still running when a rewind comes lands in the queue after the rewind.
            self.fetcher.put(item, stamp=self.generation)
        elif isinstance(item, P.Message):
            self.steps.put((self.generation, self.decode(item)))
        else:
            self.steps.put((self.generation, item))

    def decode(self, msg: P.Message, fetched: list[list[memoryview]] | None = None) -> Step:
        """`decode_step` with this session's payload mode and source names."""
        return decode_step(msg, self.files, fetched, self.sources)

    def _check_dataset(self, served: dict | None) -> None:
        if self.restored is not None and served is not None and differing(self.restored, served):
            raise DispatcherError("dataset", "the restored state belongs to another dataset ("
                                  f"{dataset_difference(self.restored, served)})")
        self.dataset = served

    def _payload_mode(self, mode: str) -> None:
        if mode not in P.PAYLOAD_MODES:
            raise DispatcherError("payloads", f"unknown payload mode {mode!r}")
        if mode == "reference" and self.files is None:
            self.files = ShardFiles(mapped=self.map_shards)
        elif mode != "reference" and self.files is not None:
            self.files.close()
            self.files = None
        if mode == "direct" and self.fetcher is None:
            self.fetcher = self.make_fetcher(self.steps, self.decode)
        elif mode != "direct" and self.fetcher is not None:
            self.fetcher.close()
            self.fetcher = None

    def _do_commands(self, session: PeerSession) -> None:
        while True:
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "consumed":
                self.consumed = cmd[1]
            elif cmd[0] == "timings":
                # Measurements are best effort: a dispatcher away for long loses the oldest.
                self.timings = [*self.timings[-(MAX_PENDING_TIMINGS - 1):], cmd[1]]
            elif cmd[0] == "commit":
                c = _Commit(step=cmd[1], seq=-1, done=cmd[2], error=cmd[3])
                if self.halted is not None:
                    c.error.append(self.halted)
                    c.done.set()
                    continue
                self.commits.append(c)
                c.seq = session.send(P.COMMIT, step=c.step)
            elif cmd[0] == "resync":
                if self.fetcher is not None:
                    self.fetcher.clear()
                while not self.steps.empty():
                    self.steps.get_nowait()  # memory: the loop skips them by their stamp anyway
                self.next_expected = self.consumed = cmd[1]
                self.resuming = cmd[1] is not None
                self.restored = cmd[2]
                self.generation = cmd[3]
                session.hello()

    def _on_error(self, session: PeerSession, msg: P.Message) -> None:
        code, text, ack = msg["code"], msg["message"], msg.get("ack")
        if ack is not None:
            failed = [c for c in self.commits if c.seq == ack]
        else:
            failed = list(self.commits) if code == "commit" else []
        if failed:
            # A commit the dispatcher could not journal: its caller hears why, at once.
            for c in failed:
                self.commits.remove(c)
                c.error.append(DispatcherError(code, f"commit({c.step}) failed: {text}"))
                c.done.set()
            return
        if code in _FATAL_CODES:
            raise DispatcherError(code, text)
        if code == P.TOOK_OVER:
            # After a reconnect of its own, the live connection was most likely this trainer's
            # earlier one (the dispatcher heard it until it gave up): not worth a warning.
            level = logging.INFO if session.num_reconnects else logging.WARNING
            log.log(level, "mmdispatch event=rank_taken_over dispatcher=%s rank=%s why=%r",
                    session.config.address, self.hello.get("rank"), text)
            return
        log.warning("mmdispatch event=client_error dispatcher=%s rank=%s code=%s message=%r",
                    session.config.address, self.hello.get("rank"), code, text)

    def fail_commits(self, error: Exception) -> None:
        for c in self.commits:
            c.error.append(error)
            c.done.set()
        self.commits.clear()

    def close(self) -> None:
        if self.files is not None:
            self.files.close()
            self.files = None
        if self.fetcher is not None:
            self.fetcher.close()
            self.fetcher = None


class DispatcherClient:
    """Iterator of this rank's steps; each `Step` holds exactly M micro-batches.

    rank / world_size / local_world_size default to torchrun's RANK, WORLD_SIZE,
    LOCAL_WORLD_SIZE. Restore with `load_state_dict()` before iterating; call `commit(step)`
    when the checkpoint holding `state_dict()` is durable.

    `inputs`: the rules this trainer's model inputs follow (`PreprocessConfig.identity()`,
    `pipeline.tokenize.tokenizer_identity()`); the dispatcher refuses the rank in one line if
    the data nodes count by other rules. Unset: nothing is checked.
    """

    def __init__(self, address: str, rank: int | None = None, world_size: int | None = None,
                 local_world_size: int | None = None, *, config: ClientConfig | None = None,
                 context: zmq.Context | None = None, inputs: dict | None = None) -> None:
        # ZeroMQ's own word for an address without a transport is "Invalid argument".
        self.address = check_endpoint("DispatcherClient address", address, connect=True)
        self.inputs = inputs
        self.rank = _env_int("RANK", 0) if rank is None else rank
        self.world_size = _env_int("WORLD_SIZE", 1) if world_size is None else world_size
        self.local_world_size = (_env_int("LOCAL_WORLD_SIZE", self.world_size)
                                 if local_world_size is None else local_world_size)
        for name in ("rank", "world_size", "local_world_size"):
            value = getattr(self, name)
            try:  # a numpy or tensor integer is one, as commit() takes it; a bool is not
                setattr(self, name, _checked_index(value))
            except TypeError:
                raise ValueError(f"{name}={value!r} must be an int") from None
        if self.world_size < 1:
            raise ValueError(f"world_size={self.world_size} must be >= 1 (the number of trainer ranks)")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank} must be in [0, world_size={self.world_size})")
        if self.local_world_size < 1 or self.world_size % self.local_world_size:
            raise ValueError(f"local_world_size={self.local_world_size} must divide "
                             f"world_size={self.world_size} (ranks per node, the same on every node)")
        self.config = config or ClientConfig()
        self.ctx = context or zmq.Context.instance()
        # (generation, Step | _END | Exception): the client thread's deliveries, stamped with
        # the rewind they follow (None: the thread died, whatever the position)
        self._steps: queue.Queue = queue.Queue()
        self._commands: queue.Queue = queue.Queue()
        self._consumed: int | None = None  # next step to hand to the trainer
        self._restored: dict | None = None  # dataset fingerprint of a loaded state
        self._fatal: Exception | None = None
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._peer: _TrainerPeer | None = None
        self._session: PeerSession | None = None
        self._ended = False
        self._returned: deque[Step] = deque()  # handed out, then given back (`unread`)
        # Consumers holding steps taken ahead (a PrefetchPool), told before a rewind; while it
        # runs, a `__next__` waiting in their thread gives up (`Rewound`).
        self._rewind_listeners: list = []
        self._rewinding = threading.Event()
        self._interrupting = threading.Event()  # see interrupt_waits
        # load_state_dict calls so far: a delivery stamped with an older count belongs to a
        # position the loop has left (a step, or the END of the stream, queued before a rewind
        # that the client thread has not carried out yet) and is never handed out
        self._generation = 0
        self._ahead = 0  # steps a consumer (a PrefetchPool) takes ahead of the loop
        self._loop_position = None  # the consumer's: the step after the last its loop took
        self._loop_holding = None  # the consumer's: whether its loop still holds that step
        self._holding = False  # the loop has a step it took and has not asked past yet
        # The latest step the loop said it trained: it committed it, or reported its timings.
        self._trained: int | None = None

    def taken_ahead(self, steps: int, position=None, holding=None) -> None:
        """A consumer of this client (a `PrefetchPool`) takes up to `steps` steps from it ahead
        of the training loop; `position()`, the step after the last it handed to the loop (None
        before the first), and `holding()`, whether the loop still holds that last step (it
        never asked past it). The dispatcher hears of both: a rank resumed from a checkpoint is
        at its first step until its credits pass these steps too (else a peer restored from
        another checkpoint, joining while this rank waits in that step's collectives, is not
        refused), and a rank that leaves says where its loop stopped, not where the consumer
        had read to. `commit` takes only steps handed to the loop."""
        self._ahead = max(0, int(steps))
        self._loop_position = position
        self._loop_holding = holding
        if self._peer is not None:  # the next HELLO (a reconnect) says it
            self._peer.hello["ahead"] = self._ahead

    @property
    def num_reconnects(self) -> int:
        return 0 if self._session is None else self._session.num_reconnects

    # -- trainer-facing API --------------------------------------------------------------
    def start(self) -> DispatcherClient:
        if self._thread is None:
            _keep_freed_memory_once(self.config.malloc_keep_mb)
            self._peer = _TrainerPeer(
                hello={"role": "trainer", "name": f"rank{self.rank}", "rank": self.rank,
                       "world_size": self.world_size, "local_world_size": self.local_world_size,
                       **({"ahead": self._ahead} if self._ahead else {}),
                       **({} if self.inputs is None else {"inputs": self.inputs})},
                prefetch=self.config.prefetch, map_shards=self.config.map_shards,
                next_step=self._consumed, dataset=self._restored, steps=self._steps,
                commands=self._commands, fetcher=self.config.fetcher,
                generation=self._generation)
            self._session = PeerSession(self.config.session(self.address), self._peer,
                                        context=self.ctx, name="client")
            self._thread = threading.Thread(target=self._run, name=f"mmdispatch-client-{self.rank}",
                                            daemon=True)
            self._thread.start()
        return self

    def __iter__(self):
        return self

    def superseded(self) -> DispatcherError | None:
        """The error this client stopped with where another connection claimed its rank (ERROR
        `replaced`), else None: the steps it took ahead now go to that connection, so none of
        them is handed out here (a pool over the client asks too)."""
        fatal = self._fatal
        return fatal if isinstance(fatal, DispatcherError) and fatal.code == "replaced" else None

    def __next__(self) -> Step:
        self._check_open("next()")
        self._holding = False  # asking for the next step: the loop is done with the last one
        superseded = self.superseded()
        if superseded is not None:  # probe: two steps were trained twice after it
            raise superseded
        if self._returned:  # the dispatcher was told of them when they were first handed out
            step = self._returned.popleft()
            self._consumed = step.step + 1
            self._holding = True
            return step
        if self._ended:
            raise StopIteration
        thread = self.start()._thread  # close() from another thread may clear the attribute
        limit = self.config.step_timeout_s
        waiting_since = time.monotonic()
        deadline = None if limit is None else waiting_since + limit
        say_at = waiting_since + WAIT_SAY_S
        while True:
            if self._rewinding.is_set():
                raise Rewound("load_state_dict moved the client while this thread waited for a step")
            if self._interrupting.is_set():
                raise Interrupted("the consumer this thread waited for a step for is closing")
            try:
                generation, item = self._steps.get(timeout=0.1)
            except queue.Empty:
                if self._fatal is not None:
                    raise self._fatal
                if thread is None or not thread.is_alive():
                    raise RuntimeError("dispatcher client closed" if self._closing.is_set()
                                       else "dispatcher client thread stopped")
                now = time.monotonic()
                if now >= say_at and (deadline is None or now < deadline):
                    self._say_waiting(now - waiting_since)
                    say_at = now + WAIT_SAY_EVERY_S
                if deadline is not None and now > deadline:
                    raise TimeoutError(
                        f"no step from {self.address} within {limit} s: the dispatcher plans "
                        "ahead only as far as every rank has taken its steps, so a rank that "
                        "stopped (its log: event=trainer_lost) or readers that deliver nothing "
                        "hold the others")
                continue
            if generation is not None and generation != self._generation:
                continue  # queued before a rewind: another position's step or END
            if item is _END:
                self._ended = True
                raise StopIteration
            if isinstance(item, Exception):
                raise item
            if self._consumed is not None and item.step != self._consumed:
                continue  # not the step the loop is at: never handed out of order
            self._consumed = item.step + 1
            self._commands.put(("consumed", self._consumed))
            self._holding = True
            return item

    def _say_waiting(self, seconds: float) -> None:
        """One line: the loop has waited `seconds` for its next step, and where to look why.
        Not while a consumer taking steps ahead (a PrefetchPool) still holds steps its loop has
        not taken: that loop is training, slower than steps come, not waiting."""
        handed = self._handed()
        if self._loop_position is not None and self._consumed is not None and (
                handed is not None and handed < self._consumed):
            return
        session = self._session
        connected = session is not None and session.welcomed
        step = self._consumed
        if step is None and self._peer is not None:  # the WELCOME's: where the job starts
            step = self._peer.consumed
        if connected:
            why = ("the dispatcher has sent no step: it sends one once readers deliver its "
                   "samples and every rank has taken the steps before it")
            fix = ("see the dispatcher's log: event=no_readers (start mmdispatch read), "
                   "event=trainer_lost (a rank stopped)")
        else:
            why = "no dispatcher has answered"
            fix = "check that the dispatcher runs at that address, and its CurveZMQ keys"
        log.warning("mmdispatch event=waiting_for_step rank=%s step=%s dispatcher=%s seconds=%d "
                    "why='%s' fix='%s'", self.rank, "first" if step is None else step,
                    self.address, seconds, why, fix)

    def unread(self, steps: list[Step]) -> None:
        """Hand `steps` out again, before any other: the last steps this client handed out, in
        order, none of them trained (a `PrefetchPool` closed with steps prepared ahead gives
        them back here, so the next loop over this client starts at the first of them)."""
        if not steps:
            return
        expected = list(range(steps[0].step, steps[0].step + len(steps)))
        if [s.step for s in steps] != expected or self._consumed != expected[-1] + 1:
            raise ValueError(f"unread takes back the last steps handed out, in order: got steps "
                             f"{[s.step for s in steps]}, and the next step is {self._consumed}")
        self._returned.extendleft(reversed(steps))
        self._consumed = steps[0].step

    def report_timings(self, step: int, microbatches: list[dict]) -> None:
        """Send this rank's measured phase times of `step` with the next acknowledgement: per
        micro-batch {phase: [seconds, [sequence lengths run]], ..., "exchange": seconds}
        (phases "vision", "audio", "llm"; see `trainer_client.calibrate.PhaseTimer`)."""
        # A closed client's thread is gone: queued, the timings would vanish without a word.
        self._check_open(f"report_timings({step!r})")
        if not isinstance(step, bool) and hasattr(step, "__index__"):
            step = operator.index(step)  # a numpy or tensor integer: msgpack packs only int
        record = {"step": step, "mb": microbatches}
        # Checked here as the dispatcher will: it drops a malformed record (the caller would
        # never learn why its timings are missing), and an unpackable one killed the client thread.
        try:
            problem = P.decode(P.encode(P.CREDIT, upto=0, received=0, timings=[record])).get(
                "timings_error")
        except (P.ProtocolError, TypeError, ValueError) as e:
            problem = str(e).removeprefix("credit: ")
        if problem is not None:
            raise ValueError(f"report_timings({step!r}): {problem}: give per micro-batch "
                             f"{{phase: [seconds, [sequence lengths]], ..., 'exchange': seconds}} "
                             f"(trainer_client.model.microbatch_timings)")
        self._commands.put(("timings", record))
        self._said_trained(step)

    def state_dict(self) -> dict:
        """Where to resume, and the dataset (fingerprint) this position belongs to."""
        served = self._peer.dataset if self._peer is not None else None
        return {"next_step": self._consumed, "rank": self.rank, "world_size": self.world_size,
                "dataset": served if served is not None else self._restored}

    def load_state_dict(self, state: dict) -> None:
        """Resume at `state['next_step']` (replayed exactly as the first run delivered it);
        a state of another dataset is refused with DispatcherError naming the difference.
        `{}` (no checkpoint yet) starts after the job's last commit (none: at its first step),
        the same step for every rank restarted that way. Also a rewind while running: a
        `PrefetchPool` over this client drops the steps it prepared ahead, and its next step
        is `state['next_step']` (`PrefetchPool.load_state_dict` does the same)."""
        if not isinstance(state, dict):
            raise ValueError(f"load_state_dict takes the dict state_dict() returned, got "
                             f"{type(state).__name__}")
        unknown = sorted(map(str, set(state) - _STATE_KEYS))
        if unknown:  # another component's state (the model's?) would silently restart the data
            raise ValueError(f"load_state_dict got keys {', '.join(unknown[:5])}: not a "
                             f"DispatcherClient.state_dict() (its keys: {', '.join(sorted(_STATE_KEYS))})")
        if state.get("world_size") not in (None, self.world_size):
            log.warning("mmdispatch event=resume_world_size_changed saved=%s now=%s: the dispatcher "
                        "re-plans from the same sample position", state["world_size"], self.world_size)
        self._check_open("load_state_dict")
        if self._fatal is not None:  # its thread is gone: nothing would move
            raise RuntimeError(f"load_state_dict on a DispatcherClient that stopped ({self._fatal}): "
                               "create a new DispatcherClient and load the state into it")
        step = _step_number(state.get("next_step"))
        dataset = state.get("dataset")
        if dataset is not None and not isinstance(dataset, dict):
            raise ValueError(f"state dataset must be a dict (from state_dict()), got {dataset!r}")
        self._rewinding.set()
        try:
            for listener in list(self._rewind_listeners):
                listener()  # steps taken ahead belong to the old position: dropped first
            self._generation += 1
            self._consumed = step
            self._restored = dataset
            self._ended = False
            self._holding = False
            self._trained = None  # steps of the old position
            self._returned.clear()
            if self._thread is not None:
                self._commands.put(("resync", step, dataset, self._generation))
        finally:
            self._rewinding.clear()

    def add_rewind_listener(self, listener) -> None:
        """Call `listener()` at the start of every `load_state_dict`, before the position moves:
        a consumer that took steps ahead (a `PrefetchPool`) stops taking and drops them. A
        `__next__` it waits in meanwhile raises `Rewound`."""
        self._rewind_listeners.append(listener)

    @contextmanager
    def interrupt_waits(self):
        """While in this block, a `__next__` waiting for a step in another thread raises
        `Interrupted` within a poll: a consumer that takes steps in its own thread (a closing
        `PrefetchPool`) joins that thread here. Left waiting, it would take the next step once
        one came, after its consumer closed, and nothing would give that step back."""
        self._interrupting.set()
        try:
            yield
        finally:
            self._interrupting.clear()

    def remove_rewind_listener(self, listener) -> None:
        if listener in self._rewind_listeners:
            self._rewind_listeners.remove(listener)

    def commit(self, step: int, timeout: float | None = None) -> None:
        """Tell the dispatcher `step` is checkpointed (a step this client handed out: the
        checkpoint's state_dict() resumes after it); returns once it is journaled, raises
        DispatcherError with the dispatcher's reason when it could not be. It waits up to
        `timeout` seconds, by default as long as for a step (`step_timeout_s`): a dispatcher
        restarting from its journal must not end a job at its checkpoint that it would have
        survived between two."""
        self._check_open(f"commit({step!r})")
        number = _integral(step)
        if number < 0:
            # A float or string came back as a malformed-message warning after the whole timeout,
            # and a tensor could not be sent at all: the client thread died with it.
            raise ValueError(f"commit(step) takes a step number >= 0 (a Step's .step), got {step!r}")
        handed = self._handed()
        if handed is None or number >= handed:
            # Journaled, it would resume every rank after steps this one never trained.
            said = "no step yet" if handed is None else f"steps up to {handed - 1}"
            who = ("this client's consumer has handed its loop" if self._loop_position is not None
                   else "this client has handed out")
            raise ValueError(f"commit({number}): {who} {said}; commit the .step of a step the "
                             "checkpoint holds the training of")
        if self._fatal is not None:
            raise self._fatal
        self._said_trained(number)
        done, error = threading.Event(), []
        thread = self.start()._thread
        self._commands.put(("commit", number, done, error))
        if timeout is None:
            timeout = self.config.step_timeout_s if self.config.step_timeout_s is not None else math.inf
        deadline = time.monotonic() + timeout
        while not done.wait(min(0.1, max(0.0, deadline - time.monotonic()))):
            if self._fatal is not None:
                raise self._fatal
            if thread is None or not thread.is_alive():
                raise RuntimeError(f"commit({number}): the dispatcher client "
                                   f"{'is closed' if self._closing.is_set() else 'thread stopped'}")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"commit({number}) not acknowledged by {self.address} "
                                   f"within {timeout} s: no dispatcher answered (restarting, or "
                                   "gone?); wait longer with commit(step, timeout=...) or "
                                   "ClientConfig(step_timeout_s=...)")
        if error:
            raise error[0]

    def _handed(self) -> int | None:
        """The step after the last this client handed to the training loop (None before the
        first). Behind a consumer taking steps ahead (a PrefetchPool), the step after the last
        the consumer handed to its loop: the steps it holds ahead were never trained."""
        return self._loop_position() if self._loop_position is not None else self._consumed

    def _said_trained(self, step: int) -> None:
        """The loop trained `step` (it commits or times it): its BYE counts it trained, also
        when it leaves holding it (a `break` after its step limit). Behind a consumer, only a
        step it handed to the loop."""
        handed = self._handed()
        if handed is not None and step < handed and (self._trained is None or step > self._trained):
            self._trained = step

    def _check_open(self, what: str) -> None:
        """RuntimeError for `what` called after `close()`: the stopped client would answer with
        whatever it last held (an old error, a step taken back), not with what happened."""
        if self._closing.is_set():
            raise RuntimeError(f"{what} on a closed DispatcherClient: create a new one")

    def close(self) -> None:
        if self._peer is not None:  # read by the client thread as it says BYE
            at = (loop_stopped_at(self._loop_position(), bool(self._loop_holding and self._loop_holding()))
                  if self._loop_position is not None else loop_stopped_at(self._consumed, self._holding))
            if at is not None and self._trained is not None:
                at = max(at, self._trained + 1)  # a step committed or timed was trained
            self._peer.left_at = self._consumed if at is None else at
        self._closing.set()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None

    def __enter__(self) -> DispatcherClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- background thread ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._session.run(self._closing)
        except Exception as e:  # noqa: BLE001 - surfaced to the training loop
            self._fatal = e
            self._steps.put((None, e))
            self._peer.fail_commits(e)
        finally:
            self._peer.close()


def _collate_steps(batch: list, *, collate_fn_map=None) -> Step:
    """DataLoader's default collation of a batch of `Step`s: a step is already a batch, so
    `batch_size=1` (DataLoader's default) hands it over as it came; more cannot be merged."""
    if len(batch) == 1:
        return batch[0]
    raise TypeError(f"DispatcherDataset yields whole steps (each one a rank's batch), and "
                    f"DataLoader(batch_size={len(batch)}) cannot merge {len(batch)} of them: use "
                    f"DataLoader(ds, batch_size=None)")


# DataLoader's default collate looks a type up in this map: a Step passes through it whole.
default_collate_fn_map[Step] = _collate_steps


#: DispatcherDataset's `tokenizer` left out (None is a value: byte-level ids).
_UNSTATED = object()


class DispatcherDataset(torch.utils.data.IterableDataset):
    """DataLoader adapter: yields `Step`s; use `DataLoader(ds, batch_size=None, num_workers=0)`
    (DataLoader's default `batch_size=1` hands each step over as it came, too).

    One client per rank lives in the main process (DataLoader workers would each be another
    trainer of the same rank, so a worker refuses to iterate it). With `preprocess` (a
    `prefetch.PrefetchConfig`) the steps come through a `PrefetchPool`, whose workers prepare
    the model inputs ahead: that pool is the parallelism DataLoader workers would give.
    The client is created lazily in `__iter__`, so the dataset itself pickles (no sockets).
    Checkpoint it with `state_dict()` / `load_state_dict()` (before the first iteration too)
    and commit through `client.commit(step)`; `close()` ends the pool and the client.

    `tokenizer`: the tokenizer file the model's text ids are of (None: byte-level ids); with
    `preprocess` it is required (or `inputs=` stating the rules yourself): the dispatcher refuses
    readers that tokenize otherwise, where unstated a reader without `--tokenizer` gave the
    model byte values for ids, silently.
    """

    def __init__(self, address: str, *, preprocess=None, tokenizer=_UNSTATED, **client_kwargs) -> None:
        super().__init__()
        if preprocess is not None and tokenizer is _UNSTATED and "inputs" not in client_kwargs:
            raise ValueError("DispatcherDataset(preprocess=...) needs tokenizer=: the tokenizer "
                             "file your model's text ids are of (None for byte-level ids), so "
                             "that readers tokenizing otherwise are refused")
        if tokenizer is not _UNSTATED and "inputs" in client_kwargs:
            raise ValueError("DispatcherDataset: give tokenizer= or inputs=, not both (inputs= "
                             "states every rule, the tokenizer's too)")
        self.address = address
        self.preprocess = preprocess
        self.tokenizer = tokenizer
        self.client_kwargs = client_kwargs
        self.client: DispatcherClient | None = None
        self.pool = None
        self._restore: dict | None = None  # a state loaded before the client exists
        self._closed = False

    def _check_open(self, what: str) -> None:
        if self._closed:  # its client is closed: a user never made one to create anew
            raise RuntimeError(f"{what} on a closed DispatcherDataset: create a new one (load "
                               "this one's state_dict() into it to resume where it stopped)")

    def state_dict(self) -> dict:
        """Where to resume: after the last step handed to the loop. With `preprocess`, the
        pool's position: the client's is ahead by the steps the pool prepared."""
        if self.pool is not None:
            return self.pool.state_dict()
        if self.client is not None:
            return self.client.state_dict()
        return dict(self._restore or {})

    def load_state_dict(self, state: dict) -> None:
        """Resume at a `state_dict()` (see `DispatcherClient.load_state_dict`), also while a
        DataLoader iterates it: its next step is `state['next_step']` (a rollback). Steps a pool
        prepared ahead are dropped; a state loaded before the first iteration is checked and
        applied when the client starts."""
        if not isinstance(state, dict):
            raise ValueError(f"load_state_dict takes the dict state_dict() returned, got "
                             f"{type(state).__name__}")
        self._check_open("load_state_dict")
        if self.client is None:
            self._restore = dict(state)
            return
        if self.pool is not None:
            # Rewound, not closed: the DataLoader's iterator is this pool, and goes on from
            # `state` (closed, it died naming a PrefetchPool its user never made).
            self.pool.load_state_dict(state)
            return
        self.client.load_state_dict(state)

    def close(self) -> None:
        self._closed = True
        if self.client is not None:  # first: the pool's feeder waiting on it stops at once
            self.client.close()
        if self.pool is not None:
            self.pool.close()

    def __iter__(self):
        self._check_open("iterating")
        if torch.utils.data.get_worker_info() is not None:
            raise ValueError("DispatcherDataset runs in the main process: use DataLoader(ds, "
                             "batch_size=None, num_workers=0) and PrefetchConfig(workers=N) to "
                             "preprocess in parallel")
        if self.client is None:
            kwargs = self.client_kwargs
            if "inputs" not in kwargs and (self.preprocess is not None or self.tokenizer is not _UNSTATED):
                # The rules the pool prepares inputs by and the text ids are of: the dispatcher
                # refuses a mismatch.
                from pipeline.tokenize import tokenizer_identity

                rules = {} if self.preprocess is None else self.preprocess.preprocess.identity()
                if self.tokenizer is not _UNSTATED:
                    rules.update(tokenizer_identity(self.tokenizer))
                kwargs = {**kwargs, "inputs": rules}
            client = DispatcherClient(self.address, **kwargs)
            if self._restore is not None:
                try:
                    client.load_state_dict(self._restore)
                except BaseException:
                    client.close()
                    raise
                self._restore = None
            self.client = client
        if self.preprocess is None:
            return iter(self.client)
        if self.pool is None:
            from trainer_client.prefetch import PrefetchPool

            self.pool = PrefetchPool(self.client, self.preprocess)
        return self.pool
