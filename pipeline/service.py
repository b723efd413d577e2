"""Run a data-node reader: ask the dispatcher for shards, stream counted samples within credits.

Each worker is one peer (`dispatcher_server.session`) reading one shard at a time, with
`prefetch_shards` more assigned and queued behind it so the next one starts without a round
trip; it reads only as many samples as the dispatcher granted, so a data node never races ahead
of the trainers. Skipped samples travel with the samples after them, so a reader that dies
later has already reported them. The dispatcher decides where each shard (re)starts, so a
worker keeps no state worth saving; it stops when the dispatcher says the job is done (END).
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import multiprocessing
import multiprocessing.connection
import os
import secrets
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from multiprocessing import resource_tracker
from typing import Any
from urllib.parse import urlsplit

import zmq

from dispatcher_server import protocol as P
from dispatcher_server.security import PeerCurve, check_allowed_keys
from dispatcher_server.session import Disconnected, PeerSession, SessionConfig, Unreachable
from dispatcher_server.cliopts import (
    check_curve_pair, check_endpoint, check_malloc_keep_mb, finite_float, name_the_file, say,
    setup_logging,
)
from dispatcher_server.tuning import end_with_parent, keep_freed_memory, relax_gc
from pipeline import keepalive
from pipeline.errors import DIGEST, ErrorStats, SampleError, TooManyErrors
from pipeline.fieldmap import FieldMap
from pipeline.counting import CountingConfig, length_identity, placeholder_identity
from pipeline import remote
from pipeline.payloads import (DEFAULT_CACHE_MB, PayloadCache, PayloadServer, bind_address,
                               check_advertise, check_bind, worker_endpoint)
from pipeline.readahead import DEFAULT_AHEAD_MB, AheadBudget, ReadAhead, stalled_error
from pipeline.reader import (
    ReaderConfig, add_reader_arguments, counting_flag_errors, iter_shard, mapped_copy_identity,
    quoted_name, reader_config_from_args, sample_builder,
)
from pipeline.records import SampleRecord
from pipeline.shards import reads_can_wait, stream_stamp
from pipeline.tario import CopyIdentity
from pipeline.tokenize import ChatTemplate, chat_template_identity, tokenizer_identity

log = logging.getLogger("mmdispatch.reader")


@dataclass(kw_only=True, slots=True)
class ReaderServiceConfig:
    dispatcher: str  # tcp://HOST:PORT of the dispatcher's reader endpoint
    name: str = ""
    reader: ReaderConfig = field(default_factory=ReaderConfig)
    batch: int = 32  # most samples per SAMPLES message
    prefetch_shards: int = 1  # shards held assigned beyond the one being read
    timeout_s: float = 5.0  # dispatcher silent this long: reconnect
    connect_timeout_s: float | None = 60.0  # no WELCOME this long after connecting: give up
    poll_ms: int = 50
    stall_s: float = 300.0  # a shard that reads no byte this long is given up (rest skipped)
    backoff_min_s: float = 0.1
    backoff_max_s: float = 5.0
    secret_file: str | None = None  # CurveZMQ: this reader's key pair
    server_public_file: str | None = None  # CurveZMQ: the dispatcher's public key
    # "trainer": ship member bytes (trainers decode them); "datanode": ship the model inputs
    # (`pipeline.preprocess`: float16 arrays, shape and dtype in the item meta), inline only.
    preprocess_on: str = "trainer"
    # direct payload mode: where this reader serves payloads to trainers (None: an ephemeral
    # port on the interface that reaches the dispatcher), what it tells them, its cache's cap,
    # and (CurveZMQ) the directory of the trainers' allowed public keys.
    payload_bind: str | None = None
    payload_advertise: str | None = None
    payload_cache_mb: int = DEFAULT_CACHE_MB
    allowed_dir: str | None = None
    # MiB of records this worker's shard threads read ahead of what it sends, over all its
    # shards (remote, `pipe:` and preprocessed ones; local files are read as sent)
    read_ahead_mb: int = DEFAULT_AHEAD_MB

    def __post_init__(self) -> None:
        if self.batch < 1:  # 0 would send no sample ever: the job would wait forever
            raise ValueError(f"batch must be >= 1, got {self.batch}")
        if self.read_ahead_mb < 1:
            raise ValueError(f"read_ahead_mb must be >= 1 (MiB read ahead of the session), "
                             f"got {self.read_ahead_mb}")
        if self.allowed_dir is not None:  # a security option must never be dropped in silence
            if not self.secret_file:
                raise ValueError("--payload-allowed-dir needs --curve-secret and --curve-server-key: "
                                 "without CurveZMQ the payload socket checks no key")
            if not os.path.isdir(self.allowed_dir):
                raise ValueError(f"--payload-allowed-dir {self.allowed_dir!r} is not a directory "
                                 "(it holds the trainers' allowed public NAME.key files)")
            check_allowed_keys("--payload-allowed-dir", self.allowed_dir)

    def session(self) -> SessionConfig:
        return SessionConfig(address=self.dispatcher, timeout_s=self.timeout_s,
                             connect_timeout_s=self.connect_timeout_s, poll_ms=self.poll_ms,
                             backoff_min_s=self.backoff_min_s, backoff_max_s=self.backoff_max_s,
                             curve=PeerCurve.from_files(self.secret_file, self.server_public_file))


class FatalReaderError(RuntimeError):
    """The dispatcher refused this reader for a reason a reconnect cannot fix (e.g. version)."""


@dataclass(slots=True)
class _Assignment:
    id: int
    shard: str
    records: ReadAhead  # the shard's records and skips, read by a thread of their own
    credits: int = 0
    count: int = 0
    unsent: list = field(default_factory=list)  # P.SkipRecord not yet reported
    ref_path: bytes | None = None  # reference payload mode: the shard file references name
    stamp: int = 0  # that file's version as opened (protocol.file_stamp; 0: a remote object)
    ignored: Counter = field(default_factory=Counter)  # members no field map kind names
    # this copy of the shard, as walked (SHARD_DONE): the dispatcher compares every node's copy
    identity: CopyIdentity = field(default_factory=CopyIdentity)
    # This shard's error counters: its reading thread's own (the worker's totals add them up
    # when it ends), so two shards read at once never share a run of consecutive errors.
    stats: ErrorStats = field(default_factory=lambda: ErrorStats(dispatcher_decides=True))
    # the last entry taken (a record or a skip): SAMPLES' `resume` is where the sample after
    # it begins, once the message carrying it is sent
    last: Any = None

    def skipped(self, error: SampleError, index: int, at: int = -1) -> None:
        self.unsent.append(P.SkipRecord(error.key or "", error.reason, index))

    def resume_field(self) -> dict:
        """SAMPLES' optional `resume`: [index, offset] such that every sample before `index` has
        been sent or reported skipped and sample `index` begins at tar byte `offset`; absent
        when not known (a `pipe:` or gzip shard, a damaged one, a shard-level skip)."""
        last = self.last
        if type(last) is tuple:
            index, at = last[1], (last[2] if len(last) > 2 else -1)
        elif last is not None:
            index, at = last.index, last.next_at
        else:
            return {}
        return {"resume": [index + 1, at]} if index >= 0 and at > 0 else {}

    def take_unsent(self) -> list:
        out, self.unsent = self.unsent, []
        return out


#: Text token bytes a SAMPLES message carries at most (text tokens travel in its header): half
#: the protocol's header limit. A sample that would pass it goes in the next message, so a run
#: of long texts never makes a header the dispatcher refuses whole (and loses every sample of).
_MAX_TOKEN_BYTES = P.DEFAULT_LIMITS.max_header_bytes // 2
#: Token bytes past which one sample does not fit a message even alone (the rest of the header,
#: its key and items, gets the remaining MiB): skipped by its reader as text_too_large.
_MAX_SAMPLE_TOKEN_BYTES = P.DEFAULT_LIMITS.max_header_bytes - (1 << 20)


def sample_header(rec: SampleRecord, ref_path: bytes | None = None,
                  stamp: int = 0) -> tuple[list, list]:
    """(SAMPLES header entry, payload frames) of one record; payloads are the member buffers,
    or with `ref_path` (reference and direct modes) references to their bytes in that file,
    whose version (`protocol.file_stamp`) the reader read is `stamp`."""
    items = [[it.modality, it.member, int(it.enc_len), int(it.llm_len), dict(it.meta)]
             for it in rec.items]
    header = [rec.key, int(rec.index), int(rec.text_len), int(rec.llm_len),
              rec.tokens.to_wire(), items]
    if ref_path is not None:
        return header, [P.pack_ref(ref_path, *rec.spans[it.member], stamp) for it in rec.items]
    return header, [rec.members[it.member] for it in rec.items]


class ReaderWorker:
    """One reader peer. `run(stop)` until `stop` is set or the dispatcher ends the job; raises
    FatalReaderError on refusal, `Unreachable` when no dispatcher answers in time."""

    def __init__(self, config: ReaderServiceConfig, *, context: zmq.Context | None = None) -> None:
        # The tokenizer and chat template load first, before HELLO states their digest: a file
        # that is no tokenizer must not become the session's rules, refusing every good peer.
        encoder = sample_builder(config.reader).counter.encoder
        self.config = config
        self.session = PeerSession(config.session(), self, context=context, name="reader")
        self.assignments: list[_Assignment] = []  # in the order assigned
        self.stats = ErrorStats()  # this worker's counters over all its shards
        self.payloads = "inline"  # the dispatcher's choice, from WELCOME
        self.num_samples_sent = 0
        self.ended = False  # the dispatcher said the job is done
        self._configs: dict[str, ReaderConfig] = {}  # a source's field map -> reader config
        self._stall_warned = False
        # stated in HELLO, checked by the dispatcher; the template is the one just loaded
        self.inputs = input_rules(config.reader.counting, encoder.template if encoder else None,
                                  max_member_bytes=config.reader.max_member_bytes)
        # Said in every HELLO: a reconnect of this worker replaces its earlier session at once
        # (names may repeat across processes; this does not).
        self.instance = secrets.token_hex(8)
        self.payload_server: PayloadServer | None = None  # direct mode, from the first WELCOME
        self.ahead_budget = AheadBudget(config.read_ahead_mb << 20)  # shared by its shards' threads
        self._told_unused = False  # the direct-mode options set under another mode, said once

    def run(self, stop: threading.Event | None = None) -> None:
        # Local shards are counted in this thread: a long header walk heartbeats meanwhile.
        keepalive.install(self.session.keepalive)
        try:
            self.session.run(stop or threading.Event())
        finally:
            keepalive.install(None)
            if self.payload_server is not None:
                self.payload_server.close()

    # -- PeerRole ------------------------------------------------------------------------
    def hello_fields(self) -> dict:
        return {"role": "reader", "name": self.config.name or f"pid{os.getpid()}",
                "inputs": self.inputs, "instance": self.instance, "node": os.uname().nodename}

    def reset(self) -> None:
        for a in list(self.assignments):
            self._drop_assignment(a)

    def on_welcome(self, session: PeerSession, msg: P.Message) -> None:
        mode = msg.get("payloads", "inline")
        if mode not in P.PAYLOAD_MODES:
            raise FatalReaderError(f"dispatcher at {self.config.dispatcher} asks for unknown "
                                   f"payload mode {mode!r}")
        if mode != "inline" and self.config.preprocess_on == "datanode":
            raise FatalReaderError(f"dispatcher at {self.config.dispatcher} runs --payloads {mode}, "
                                   f"but --preprocess-on datanode ships tensors inline: serve with "
                                   f"--payloads inline or read with --preprocess-on trainer")
        self.payloads = mode
        if mode != "direct" and not self._told_unused:
            self._told_unused = True
            self._warn_unused_payload_options(mode)
        # A reader that reads says so once per session: otherwise it is silent until the end.
        log.info("mmdispatch event=reader_connected dispatcher=%s name=%s payloads=%s",
                 self.config.dispatcher, self.hello_fields()["name"], mode)
        if mode == "direct":
            self._serve_payloads(msg.get("shards", []))
        self._request_shards()

    def _warn_unused_payload_options(self, mode: str) -> None:
        """The --payloads direct options set, under another mode: said once, since the mode is
        the dispatcher's (known at WELCOME) and a reader may serve a direct job next time."""
        c = self.config
        unused = [flag for flag, value in (("--payload-bind", c.payload_bind),
                                           ("--payload-advertise", c.payload_advertise),
                                           ("--payload-allowed-dir", c.allowed_dir)) if value]
        if unused:
            log.warning("mmdispatch event=options_unused options=%s dispatcher=%s payloads=%s "
                        "why='they apply only when the dispatcher serves --payloads direct'",
                        ",".join(unused), c.dispatcher, mode)

    def _serve_payloads(self, shards: list) -> None:
        """Open the payload socket (once per worker) and let it serve the job's shard files."""
        c = self.config
        if self.payload_server is None:
            try:
                self.payload_server = PayloadServer(
                    bind_address(c.payload_bind, c.dispatcher, 0),
                    cache=PayloadCache(c.payload_cache_mb << 20),
                    advertise=c.payload_advertise, dispatcher=c.dispatcher,
                    secret_file=c.secret_file, allowed_dir=c.allowed_dir)
            except zmq.ZMQError as e:
                raise FatalReaderError(f"--payloads direct: cannot serve payloads at "
                                       f"{c.payload_bind or 'an ephemeral port'}: {e} "
                                       f"(see --payload-bind)") from None
            except ValueError as e:  # a setting, not the port: its message names the fix
                raise FatalReaderError(f"--payloads direct: {e}") from None
            log.info("mmdispatch event=payloads_bound endpoint=%s", self.payload_server.endpoint)
        self.payload_server.servable = frozenset(
            P.reference_path(url, "direct").encode("utf-8", "surrogateescape") for url in shards)

    def on_message(self, session: PeerSession, msg: P.Message) -> bool:
        if msg.type == P.SHARD_ASSIGN:
            self._assign(msg)
        elif msg.type == P.CREDIT and (a := self._find(msg.get("assign_id"))) is not None:
            a.credits += msg.get("samples", 0)
        elif msg.type == P.CANCEL and (a := self._find(msg["assign_id"])) is not None:
            self._drop_assignment(a)
            self._request_shards()
        elif msg.type == P.END:
            log.info("mmdispatch event=reader_end dispatcher=%s reason=%s",
                     self.config.dispatcher, msg["reason"])
            self.ended = True
            session.finish()
        elif msg.type == P.ERROR:
            if msg["code"] in ("version", "role", "inputs"):
                said = msg["message"]
                path = self.config.reader.counting.text.tokenizer_path
                if msg["code"] == "inputs" and "tokenizer:" in said:  # the refusal names hashes
                    said += f" (this reader's --tokenizer: {path or 'none, byte-level ids'})"
                raise FatalReaderError(f"dispatcher at {self.config.dispatcher} refused this "
                                       f"reader: {said}")
            if msg["code"] == "halted":  # it stopped the job (its journal's disk is full)
                raise FatalReaderError(f"dispatcher at {self.config.dispatcher} stopped the "
                                       f"job: {msg['message']}")
            log.warning("mmdispatch event=reader_error dispatcher=%s code=%s message=%r",
                        self.config.dispatcher, msg["code"], msg["message"])
        return True

    def tick(self, session: PeerSession) -> bool:
        DIGEST.flush_due()  # skips counted, said every DIGEST.every_s
        if not session.welcomed:
            return False
        # The oldest assignment with credits: usually the shard being read; another when
        # that one waits for credits the dispatcher gives a lower position first.
        work = next((a for a in self.assignments if a.credits > 0), None)
        if work is None:
            return False
        try:
            self._stream(work)
        except (SampleError, TooManyErrors) as e:
            self._stopped_by(e)
            raise
        return any(a.credits > 0 for a in self.assignments)

    def _stopped_by(self, e: SampleError | TooManyErrors) -> None:
        """Tell the dispatcher that this reader's error policy stops it on its data (it
        stops the job with this line; otherwise the next reader of the shard would stop the
        same way, and the job would wait on readers that are gone)."""
        message = f"on its data: {e} ({stop_fix(e)})"  # `e` names the shard (and key)
        try:
            self.session.send(P.ERROR, code=P.READER_STOPPED, message=message[:3000])
        except Disconnected:
            pass  # the dispatcher is gone: the worker's own line still says it

    # -- assignments ---------------------------------------------------------------------
    def _assign(self, msg: P.Message) -> None:
        if not self._same_copy(msg):
            return
        self._check_stall_timeout(msg["shard"])
        ref_path = None
        if self.payloads != "inline":
            ref_path = P.reference_path(msg["shard"], self.payloads).encode("utf-8", "surrogateescape")
        # Preprocessing decodes (a long clip: seconds) where a local read never waits: done in
        # the session thread, it starved the heartbeats and the dispatcher dropped the reader.
        ahead = ReadAhead(stall_s=self.config.stall_s,
                          threaded=(reads_can_wait(msg["shard"])
                                    or self.config.preprocess_on == "datanode"),
                          name=f"mmdispatch-read-{msg['assign_id']}", budget=self.ahead_budget)
        a = _Assignment(id=msg["assign_id"], shard=msg["shard"], records=ahead, ref_path=ref_path)
        def opened(stream):  # before any record: the version of the file its spans are in
            a.stamp = stream_stamp(stream)
            return ahead.watch(stream)

        records = iter_shard(msg["shard"], self._reader_config(msg.get("fields")),
                             start_index=msg["start_index"], stats=a.stats,
                             spans=ref_path is not None, on_skip=ahead.skip, ignored=a.ignored,
                             on_open=opened if ref_path is not None else ahead.watch,
                             identity=a.identity, offset=msg.get("offset"), resume_points=True)
        if self.config.preprocess_on == "datanode":
            records = self._preprocessed(ahead.skip, a.stats, records)
        if ref_path is None or self.payloads == "direct":  # payload bytes leave this reader
            if (self.config.preprocess_on == "datanode"
                    or self.config.reader.max_member_bytes > P.DEFAULT_LIMITS.max_frame_bytes):
                records = self._within_frames(ahead.skip, a.stats, records)
        ahead.start(records)
        self.assignments.append(a)

    def _check_stall_timeout(self, shard: str) -> None:
        """Say once that a --stall-timeout shorter than a remote read's retries gives up a
        remote shard on one hang the retries would ride out (the rest of it: shard_stalled)."""
        stall_s = self.config.stall_s
        if self._stall_warned or not stall_s or stall_s > remote.RETRY_S or not remote.scheme(shard):
            return
        self._stall_warned = True
        log.warning("mmdispatch event=stall_timeout_short stall_timeout_s=%g remote_retry_s=%g "
                    "fix='raise --stall-timeout above %g: a remote read retries for that long "
                    "before it gives up, and a stall gives up the rest of the shard sooner'",
                    stall_s, remote.RETRY_S, remote.RETRY_S)

    def _same_copy(self, msg: P.Message) -> bool:
        """Whether this node's copy of the assigned shard may be read: the dispatcher names the
        copy another reader read first (SHARD_ASSIGN `identity`), and a local mapped copy is
        checked against it before any sample of it leaves. Another copy is reported at once
        (SHARD_DONE of no samples, with its identity), which stops the job before a step
        carries any of it. Other shards are compared when read whole (SHARD_DONE)."""
        expected = msg.get("identity")
        if expected is None or not self.config.reader.map_shards:
            return True
        mine = mapped_copy_identity(msg["shard"])
        if mine is None or mine == expected:
            return True
        log.error("mmdispatch event=shard_copy_differs shard=%s size=%s expected_size=%s: this "
                  "node's copy is not the one another reader read; not reading it",
                  msg["shard"], mine["size"], expected["size"])
        self.session.send(P.SHARD_DONE, assign_id=msg["assign_id"], count=0, skipped=[],
                          identity=mine)
        return False

    def _reader_config(self, fields: dict | None) -> ReaderConfig:
        """This reader's rules with a source's field map (SHARD_ASSIGN `fields`), if it has one."""
        if not fields:
            return self.config.reader
        key = repr(sorted(fields.items()))
        config = self._configs.get(key)
        if config is None:
            try:
                fm = FieldMap.from_dict(fields)
            except ValueError as e:
                raise FatalReaderError(f"dispatcher at {self.config.dispatcher} sent a field map "
                                       f"this reader cannot use: {e}") from None
            config = self._configs[key] = replace(self.config.reader, fields=fm)
        return config

    def _preprocessed(self, skip, stats: ErrorStats, records):
        """`records` with model inputs in place of member bytes; an item that decodes badly is
        skipped (`skip`) under the error policy, as a bad header is (bad_image/bad_audio/bad_video)."""
        # imported here: scipy's signal module costs a reader that ships bytes a slower start
        from pipeline.preprocess import (
            PREPROCESS_DTYPE, PreprocessConfig, PreprocessError, preprocess_record, row_dim,
        )

        counting = self.config.reader.counting
        config = PreprocessConfig.of(counting)
        limit = P.DEFAULT_LIMITS.max_frame_bytes
        try:
            for rec in records:
                # An item's input has its counted rows: one too large for a frame is skipped
                # before it is decoded (a long clip: seconds of work only to be refused).
                big = [(it.member, n) for it in rec.items
                       if it.modality in ("image", "video", "audio")
                       and (n := it.enc_len * row_dim(it.modality, config)
                            * PREPROCESS_DTYPE.itemsize) > limit]
                if big:
                    self._too_large(skip, stats, rec, *big[0])
                    continue
                try:
                    preprocess_record(rec, config)
                except PreprocessError as e:
                    reason = f"bad_{e.modality}" if e.modality in ("audio", "video") else "bad_image"
                    error = SampleError(reason, rec.shard, rec.key, str(e))
                    stats.handle(error, self.config.reader.errors)  # raises under --errors raise
                    skip(error, rec.index)
                    continue
                yield rec
        finally:
            close = getattr(records, "close", None)
            if close is not None:
                close()

    def _within_frames(self, skip, stats: ErrorStats, records):
        """`records` less the samples with an item larger than a message frame carries
        (`Limits.max_frame_bytes`): the socket it went on would drop this reader, and the shard
        would go from reader to reader. Skipped as `member_too_large` under the error policy."""
        limit = P.DEFAULT_LIMITS.max_frame_bytes
        try:
            for rec in records:
                big = [(it.member, n) for it in rec.items
                       if (n := memoryview(rec.members[it.member]).nbytes) > limit]
                if not big:
                    yield rec
                    continue
                self._too_large(skip, stats, rec, *big[0])
        finally:
            close = getattr(records, "close", None)
            if close is not None:
                close()

    def _too_large(self, skip, stats: ErrorStats, rec, member: str, n: int) -> None:
        """Skip `rec` as `member_too_large` (its `member` is `n` bytes on the wire) under the
        error policy (which raises under --errors raise)."""
        limit = P.DEFAULT_LIMITS.max_frame_bytes
        made = " as the model input it preprocesses to" if self.config.preprocess_on == "datanode" else ""
        fix = ("" if made or self.payloads == "reference" else
               " (--payloads reference: trainers read it from the shard)")
        error = SampleError("member_too_large", rec.shard, rec.key,
                            f"member {quoted_name(f'{rec.key}.{member}')} is {n} bytes{made}, over the "
                            f"{limit >> 20} MiB a message frame carries{fix}")
        stats.handle(error, self.config.reader.errors)
        skip(error, rec.index)

    def _drop_assignment(self, a: _Assignment) -> None:
        a.records.close()  # its thread shuts the shard file
        self.stats.merge(a.stats)
        self.assignments.remove(a)

    def _find(self, assign_id) -> _Assignment | None:
        return next((a for a in self.assignments if a.id == assign_id), None)

    def _request_shards(self) -> None:
        served = self.payload_server
        where = ({} if self.payloads != "direct" or served is None else
                 {"payload_endpoint": served.endpoint,
                  **({"payload_key": served.public_key} if served.public_key else {})})
        self.session.send(P.SHARD_REQUEST, shards=min(1 + max(0, self.config.prefetch_shards),
                                                      P.MAX_READER_SHARDS), **where)

    def _stream(self, a: _Assignment) -> None:
        """Send up to min(credits, batch) samples of `a`'s shard, with the skips among them;
        finish the shard when exhausted."""
        headers, frames = [], []
        token_bytes = 0  # text tokens travel in the header: keep it well under its size limit
        full = False  # the next sample's tokens would pass _MAX_TOKEN_BYTES
        wait_s = self.config.poll_ms / 1000
        while len(headers) < min(a.credits, self.config.batch) and not full:
            entries = a.records.take(min(a.credits, self.config.batch) - len(headers), wait_s)
            if not entries:
                break
            wait_s = 0.0  # send what is ready rather than wait for more
            for k, entry in enumerate(entries):
                if isinstance(entry, tuple):
                    a.skipped(*entry)
                    a.last = entry
                    continue
                h, f = sample_header(entry, a.ref_path, a.stamp)
                n = len(h[4])
                if headers and token_bytes + n > _MAX_TOKEN_BYTES:
                    a.records.give_back(entries[k:])  # the next message's, in order
                    full = True
                    break
                a.last = entry
                if n > _MAX_SAMPLE_TOKEN_BYTES:
                    self._too_many_tokens(a, entry, n)
                    continue
                if self.payloads == "direct":
                    self.payload_server.keep(f, [entry.members[it.member] for it in entry.items])
                token_bytes += n
                headers.append(h)
                frames.extend(f)
        done = a.records.finished
        if not done and not headers and a.records.stalled():
            done = self._give_up(a)
        if headers:
            # Coalesced payload frames (one unless past a frame's limit): a memcpy of the
            # members costs less than a zmq frame per item here, in the dispatcher and in its
            # I/O threads.
            sizes = [memoryview(f).nbytes for f in frames]
            self.session.send(P.SAMPLES, frames=P.coalesce(frames, sizes), assign_id=a.id,
                              samples=headers, sizes=sizes, **_skipped_field(a.take_unsent()),
                              **a.resume_field())
            a.credits -= len(headers)
            a.count += len(headers)
            self.num_samples_sent += len(headers)
        if done:
            # the identity only of a walk that reached the archive's end (a failed one is not
            # the copy's)
            whole = {"identity": a.identity.to_wire()} if a.identity.complete else {}
            self.session.send(P.SHARD_DONE, assign_id=a.id, count=a.count,
                              skipped=a.take_unsent(), **ignored_field(a.ignored), **whole,
                              **_truncated_field(a.stats.num_truncated))
            self._drop_assignment(a)
            self._request_shards()


    def _too_many_tokens(self, a: _Assignment, rec, nbytes: int) -> None:
        """Skip a sample whose text tokens alone pass what a SAMPLES header may carry (a text
        within a raised --max-text-bytes): sent, the dispatcher would refuse its message whole."""
        error = SampleError("text_too_large", a.shard, rec.key,
                            f"its {rec.text_len} text tokens take {nbytes} bytes in a reader "
                            f"message, over the {_MAX_SAMPLE_TOKEN_BYTES} one sample may carry; "
                            "lower --max-text-bytes, or split such texts into several samples")
        a.stats.handle(error, self.config.reader.errors)
        a.skipped(error, rec.index)

    def _give_up(self, a: _Assignment) -> bool:
        """A shard whose reads made no progress for `stall_s`: the rest of it is reported as
        skipped (the dispatcher logs and journals it by shard and index), and it is finished."""
        log.warning("mmdispatch event=shard_stalled dispatcher=%s shard=%s after=%d stall_s=%g",
                    self.config.dispatcher, a.shard, a.count, self.config.stall_s)
        error = stalled_error(a.shard, self.config.stall_s, a.count)
        a.stats.handle(error, self.config.reader.errors)
        a.skipped(error, -1)
        a.records.close()
        return True


def input_rules(counting: CountingConfig, template: ChatTemplate | None = None, *,
                max_member_bytes: int | None = None) -> dict:
    """The rules this data node's model inputs follow (`PreprocessConfig.identity`), with the
    tokenizer's identity and the chat template's (`chat_template`: readers render
    conversations into the ids they send; trainers, which receive ids, do not state it) and
    the placeholders items are placed at (`placeholders`: "none", or e.g. "image=<image>")
    and the length samples are held to (`max_seq_len`: "none", or e.g. "4096 truncate"),
    unless text is only estimated (then no ids are sent); and the limits past which a sample is
    skipped (`max_member_bytes`, `max_text_bytes`, `max_header_pixels`, `max_clip_seconds`):
    readers skipping other samples send other sequences, whichever reader reads which shard;
    and the JSON fields text is read from (`json_fields`: another picks another text).
    `template`: the one the reader loaded, if it has (else it is resolved from `counting`)."""
    from pipeline.preprocess import PreprocessConfig

    rules = PreprocessConfig.of(counting).identity()
    rules.update(json_fields=",".join(counting.text.json_fields),
                 max_text_bytes=counting.text.max_text_bytes,
                 max_header_pixels=counting.image.max_header_pixels,
                 max_clip_seconds=counting.audio.max_duration_s)
    if max_member_bytes is not None:
        rules["max_member_bytes"] = max_member_bytes
    if not counting.text.estimate:
        rules.update(tokenizer_identity(counting.text.tokenizer_path))
        rules.update({"chat_template": template.identity} if template is not None else
                     chat_template_identity(counting.text.chat_template, counting.text.tokenizer_path))
        rules["placeholders"] = placeholder_identity(counting.text)
        rules["max_seq_len"] = length_identity(counting.text)
    return rules


def ignored_field(ignored: Counter) -> dict:
    """SHARD_DONE's optional `ignored` field: absent when nothing was ignored; suffixes beyond
    the protocol's limit are folded into `P.IGNORED_OTHER` (the most common kept by name)."""
    if not ignored:
        return {}
    named: dict[str, int] = {}
    other = 0
    for suffix, n in ignored.most_common():
        if len(named) < P.MAX_IGNORED_SUFFIXES - 1 and len(suffix) <= P.MAX_SUFFIX_CHARS:
            named[suffix] = n
        else:
            other += n
    return {"ignored": {**named, P.IGNORED_OTHER: other} if other else named}


def _truncated_field(truncated: int) -> dict:
    """SHARD_DONE's optional `truncated` field: absent when no sample was truncated."""
    return {"truncated": truncated} if truncated else {}


def _skipped_field(skipped: list) -> dict:
    """SAMPLES' optional `skipped` field: absent when there is nothing to report."""
    return {"skipped": skipped} if skipped else {}


# -- the `read` command ---------------------------------------------------------------------
_DEFAULTS = ReaderServiceConfig(dispatcher="")
PREPROCESS_ON = ("trainer", "datanode")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dispatcher", required=True,
                        help="the dispatcher's reader endpoint, tcp://HOST:PORT")
    parser.add_argument("--workers", type=int, default=1,
                        help="reader worker processes, 1 to 4 x this host's CPU count (more only "
                             "queue for the same CPUs)")
    parser.add_argument("--name", default="",
                        help="name shown in the dispatcher's logs, with /WORKER added (default: "
                             "this host's name and the read process's id, HOST:PID)")
    parser.add_argument("--batch", type=int, default=_DEFAULTS.batch, help="most samples per message")
    parser.add_argument("--prefetch-shards", type=int, default=_DEFAULTS.prefetch_shards,
                        help="shards held assigned beyond the one being read, so the next starts "
                             f"without a round trip to the dispatcher (0 to {P.MAX_READER_SHARDS - 1})")
    parser.add_argument("--timeout", type=finite_float, default=_DEFAULTS.timeout_s,
                        help="seconds of dispatcher silence before reconnecting")
    parser.add_argument("--connect-timeout", type=finite_float, default=_DEFAULTS.connect_timeout_s,
                        help="seconds to keep trying to reach the dispatcher (at start and after "
                             "losing it) before exiting with an error; 0 = keep trying forever")
    parser.add_argument("--stall-timeout", type=finite_float, default=_DEFAULTS.stall_s,
                        help="seconds a shard may read no byte (a pipe: command or server that "
                             "hangs) before the reader gives up on it and reports the rest of it "
                             "as skipped (shard_stalled); the reader stays up meanwhile")
    parser.add_argument("--malloc-keep-mb", type=int, default=16,
                        help="reuse freed heap blocks up to this size instead of fresh pages "
                             "(glibc; saves page faults on payload frames); 0 = off")
    parser.add_argument("--curve-secret", default=None,
                        help="CurveZMQ: this reader's NAME.key_secret file")
    parser.add_argument("--curve-server-key", default=None,
                        help="CurveZMQ: the dispatcher's public NAME.key file")
    parser.add_argument("--preprocess-on", choices=PREPROCESS_ON, default=_DEFAULTS.preprocess_on,
                        help="trainer: ship member bytes, trainers decode them; datanode: ship "
                             "the model inputs (float16 image patches and audio log-mels, larger "
                             "on the wire), for trainers short of CPU; needs --payloads inline")
    parser.add_argument("--payload-bind", default=None,
                        help="--payloads direct: endpoint this reader serves payloads to trainers "
                             "at (tcp://HOST:PORT; a fixed port P serves worker w at P + w, 0 an "
                             "ephemeral port); default an ephemeral port on the interface that "
                             "reaches the dispatcher")
    parser.add_argument("--payload-advertise", default=None,
                        help="--payloads direct: the endpoint trainers are told to fetch from "
                             "(tcp://HOST[:PORT], a host trainers connect to, not a wildcard; "
                             "a port P is worker w's P + w, no port: the bound one); default "
                             "the bound endpoint, a wildcard host replaced by that interface's "
                             "address")
    parser.add_argument("--payload-cache-mb", type=int, default=_DEFAULTS.payload_cache_mb,
                        help="--payloads direct: MiB of sent members held for trainers to fetch "
                             "(each dropped once fetched, oldest first past this cap; a miss is "
                             "read again from the shard)")
    parser.add_argument("--read-ahead-mb", type=int, default=_DEFAULTS.read_ahead_mb,
                        help="MiB of samples a worker reads ahead of what it sends, over all its "
                             "shards (object-store, http, pipe: and --preprocess-on datanode "
                             "shards are read ahead by a thread each; each may always hold one "
                             "sample)")
    parser.add_argument("--payload-allowed-dir", default=None,
                        help="CurveZMQ with --payloads direct: directory of the trainers' allowed "
                             "public NAME.key files (the payload socket refuses other clients)")
    add_reader_arguments(parser)  # counting rules and error policy, shared with `inspect`


#: `--workers` above this many per CPU only queue for the same CPUs: a typo such as 100000
#: would fork until the host runs out of processes
WORKERS_PER_CPU = 4


def max_workers() -> int:
    return WORKERS_PER_CPU * (os.cpu_count() or 1)


def config_from_args(args: argparse.Namespace, worker: int = 0) -> ReaderServiceConfig:
    check_endpoint("--dispatcher", args.dispatcher, connect=True)
    if not 1 <= args.workers <= max_workers():
        raise ValueError(f"--workers must be 1 to {max_workers()} (4 x this host's "
                         f"{os.cpu_count() or 1} CPUs), got {args.workers}")
    if args.batch < 1:
        raise ValueError(f"--batch must be >= 1 (most samples per message), got {args.batch}")
    if not 0 <= args.prefetch_shards < P.MAX_READER_SHARDS:
        raise ValueError(f"--prefetch-shards must be 0 to {P.MAX_READER_SHARDS - 1}, "
                         f"got {args.prefetch_shards}")
    check_curve_pair(args.curve_secret, args.curve_server_key)
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {args.timeout}")
    check_malloc_keep_mb("--malloc-keep-mb", args.malloc_keep_mb)
    if args.payload_cache_mb < 0:
        raise ValueError(f"--payload-cache-mb must be >= 0, got {args.payload_cache_mb}")
    if args.read_ahead_mb < 1:
        raise ValueError(f"--read-ahead-mb must be >= 1 (MiB), got {args.read_ahead_mb}")
    for flag, value in (("--payload-bind", args.payload_bind),
                        ("--payload-advertise", args.payload_advertise)):
        if value:
            check_endpoint(flag, value)
            if flag == "--payload-bind":
                check_bind(value)
            else:
                check_advertise(value)
            port = urlsplit(value).port
            if port and port + args.workers - 1 > 65535:  # worker k binds and advertises port + k
                raise ValueError(f"{flag} {value} with --workers {args.workers}: worker k uses "
                                 f"port {port} + k, past 65535 for the last; give a port of at "
                                 f"most {65536 - args.workers}")
    if args.connect_timeout < 0:
        raise ValueError(f"--connect-timeout must be >= 0 (0 = forever), got {args.connect_timeout}")
    if args.stall_timeout <= 0:
        raise ValueError(f"--stall-timeout must be > 0 seconds, got {args.stall_timeout}")
    reader = reader_config_from_args(args)
    if args.preprocess_on == "datanode":
        from pipeline.preprocess import mel_stride

        with counting_flag_errors():
            mel_stride(reader.counting.audio)  # ValueError now, not at the first audio clip
    name = f"{args.name or os.uname().nodename}/{worker}"
    return ReaderServiceConfig(dispatcher=args.dispatcher, name=name, batch=args.batch,
                               prefetch_shards=args.prefetch_shards,
                               timeout_s=args.timeout, stall_s=args.stall_timeout,
                               connect_timeout_s=args.connect_timeout or None,
                               reader=reader, preprocess_on=args.preprocess_on,
                               secret_file=args.curve_secret, server_public_file=args.curve_server_key,
                               payload_bind=(bind_address(args.payload_bind, args.dispatcher, worker)
                                             if args.payload_bind else None),
                               payload_advertise=(worker_endpoint(args.payload_advertise, worker)
                                                  if args.payload_advertise else None),
                               payload_cache_mb=args.payload_cache_mb,
                               allowed_dir=args.payload_allowed_dir,
                               read_ahead_mb=args.read_ahead_mb)


def stop_fix(e: SampleError | TooManyErrors) -> str:
    """What to do about a reader stopped by its error policy on its data."""
    if isinstance(e, SampleError):
        return "mmdispatch read --errors skip (or warn) counts bad samples and reads on"
    return ("so many failures in a row usually mean wrong counting settings or field map; "
            "raise --max-consecutive-errors if the data is that bad")


def _log_format(args: argparse.Namespace) -> str:
    return getattr(args, "log_format", "text")


#: A worker's status when Ctrl-C came before it began to read (`mmdispatch read: interrupted`).
INTERRUPTED = 130


def _worker_main(args: argparse.Namespace, worker: int, failures=None,
                 supervisor: int | None = None) -> int:
    """One worker until it is stopped or the job is done (0), or cannot go on (1, one line;
    sent on the `failures` connection instead, when given, for the supervisor to say once for
    all workers), or a SIGINT came while it started (`INTERRUPTED`; said by the supervisor,
    when there is one). `supervisor`: its pid, if any (its death stops the worker with
    SIGHUP, `_process_main`)."""
    # Workers of `--workers N` are fresh processes: they log as the command was told to.
    log_format = _log_format(args)
    setup_logging(log_format, getattr(args, "log_level", "INFO"))
    stop = threading.Event()
    signals: list[str] = []

    def stopped_by(sig: int, _frame) -> None:
        signals.append(signal.Signals(sig).name)
        stop.set()

    # SIGHUP as SIGTERM: a hangup, or (a worker of `--workers N`) its supervisor's death
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stopped_by)
    # A worker process starts with SIGINT blocked (`_supervise`), so that a Ctrl-C during its
    # imports waits for this handler instead of printing their traceback: it comes now.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    faulthandler.enable()  # a worker the kernel kills (SIGBUS, SIGSEGV) leaves its Python stack
    keep_freed_memory(getattr(args, "malloc_keep_mb", 0))
    relax_gc()
    try:
        reader = ReaderWorker(config_from_args(args, worker))
        if "SIGINT" in signals:  # Ctrl-C during start-up: one line, as before the handler
            if failures is None:
                say("mmdispatch read: interrupted", log_format)
            return INTERRUPTED
        reader.run(stop)
        # Its own line: an operator reading the reader's log sees why it ended, not only
        # the dispatcher's reader_left.
        reason = signals[0] if signals else "done"
        if reason == "SIGHUP" and supervisor is not None and _gone(supervisor):
            reason = "read_process_gone"  # end_with_parent's signal: the supervisor died
        log.info("mmdispatch event=stopped worker=%d reason=%s samples_sent=%d", worker,
                 reason, reader.num_samples_sent)
        if signals and reason != "read_process_gone" and failures is not None:
            # A signal to this worker alone (the supervisor passes its own stop on as SIGTERM,
            # and then reads no more of this): it says so, or `read` ran on one short, silent.
            _sent(failures, f"stopped by {reason} sent to it alone; the other workers read on "
                            "(a signal to `mmdispatch read` itself stops them all)")
    except (FatalReaderError, Unreachable, SampleError, TooManyErrors, ValueError) as e:
        # Refusals, an unreachable dispatcher and bad input under --errors raise: the reason
        # is the whole story, a traceback would only bury it.
        fix = f" ({stop_fix(e)})" if isinstance(e, (SampleError, TooManyErrors)) else ""
        if failures is None or not _sent(failures, f"{e}{fix}"):
            say(f"mmdispatch read: worker {worker}: {e}{fix}", log_format)
        return 1
    return 0


def _gone(supervisor: int, wait_s: float = 0.5) -> bool:
    """Whether this worker's `supervisor` died (or is dying): a SIGHUP came from its death
    (`end_with_parent`), not from someone hanging up this worker alone. Its threads may still
    be exiting as the signal lands, so a supervisor still there is asked again for `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        if os.getppid() != supervisor:
            return True
        try:
            with open(f"/proc/{supervisor}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except FileNotFoundError:
            # Gone; or no /proc at all, where the parent pid above is all there is to ask.
            return os.path.isdir("/proc/self")
        except (OSError, IndexError):
            return True
        if state in (b"Z", b"X", b"x"):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _sent(pipe, why: str) -> bool:
    """Whether `why` reached the supervisor's end of `pipe` (False: the supervisor is gone)."""
    try:
        pipe.send(why)
    except OSError:
        return False
    return True


def _process_main(args: argparse.Namespace, worker: int, supervisor: int, failures) -> None:
    # SIGHUP (BYE, then leave) when the supervisor dies, SIGKILL included: orphaned workers
    # would go on reading beside those of a restarted `mmdispatch read`. Not SIGTERM: the
    # worker's log says which it was (its parent pid may still read as the supervisor's then).
    end_with_parent(supervisor, signal.SIGHUP)
    sys.exit(_worker_main(args, worker, failures, supervisor))


#: A worker the kernel kills (SIGBUS from a mapped shard truncated in place, SIGSEGV in a
#: decoder, the OOM killer) is started again, at most this many times in a row; a run of
#: RESTART_RESET_S without dying starts the count over. Its shards have moved to other readers
#: already (the dispatcher drops a silent reader), and one sample that kills every reader that
#: reads it is skipped after --max-shard-losses of them.
MAX_RESTARTS = 5
RESTART_RESET_S = 60.0
_HINTS = {signal.SIGBUS: " (a mapped shard truncated while read? --no-map-shards reads shards "
                          "that change in place)"}


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        config.session()  # validate before forking
        # The tokenizer loads now (a mistake is one start-up line, not one per worker); a lone
        # worker, in this process, finds it loaded (`sample_builder` keeps it).
        sample_builder(config.reader)
    except ValueError as e:
        say(f"mmdispatch read: error: {name_the_file(str(e), args)}", _log_format(args))
        return 2
    if not args.name:  # two `read`s on one host must not both log as HOST/0
        args.name = f"{os.uname().nodename}:{os.getpid()}"
    if args.workers == 1:
        return _worker_main(args, 0)
    return _supervise(args, multiprocessing.get_context("spawn"))


def _supervise(args: argparse.Namespace, mp) -> int:
    """Run `args.workers` worker processes until each has ended; start again one the kernel
    killed. SIGTERM, SIGINT or SIGHUP stops them all (each says BYE). The exit code is the
    worst."""
    stopping = threading.Event()
    log_format = _log_format(args)
    stopped_by = [signal.SIGTERM]  # what the workers are stopped with: the signal `read` got

    def stop(sig: int, _frame) -> None:
        if sig == signal.SIGHUP:
            # Passed on as SIGTERM: a worker takes SIGHUP for its supervisor's death, and
            # cannot tell the two apart while a dying supervisor's threads still exit.
            if not stopping.is_set():
                say("mmdispatch read: hung up (SIGHUP); stopping the workers", log_format)
            sig = signal.SIGTERM
        stopped_by[0] = sig
        stopping.set()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)

    # Workers send why they failed on a pipe each: N workers that cannot reach the dispatcher
    # are one line, not N identical ones. Pipes, not a multiprocessing Queue: a Queue's
    # semaphores outlive a `read` that is SIGKILLed, and multiprocessing's resource tracker
    # printed a raw "leaked semaphore objects" warning into its log.
    failures: dict[int, multiprocessing.connection.Connection] = {}
    said: set[str] = set()

    def say_failures(w: int, quiet: bool = False) -> None:
        """Say what worker `w` sent; `quiet`: not that a signal stopped it alone when `read`
        got that very signal too (a Ctrl-C or a kill of the process group reaches them all)."""
        pipe = failures.get(w)
        own = f"stopped by {signal.Signals(stopped_by[0]).name} sent to it alone"
        while pipe is not None and pipe.poll(0.2):
            try:
                why = pipe.recv()
            except (EOFError, OSError):
                return
            if quiet and why.startswith(own):
                continue
            if why not in said:
                said.add(why)
                say(f"mmdispatch read: worker {w}: {why}", log_format)

    # Started now, not by the first worker's start: starting it unblocks SIGINT in this
    # process (multiprocessing's own signal handling), which would undo the block below.
    resource_tracker.ensure_running()

    def start(w: int) -> multiprocessing.Process:
        if w in failures:
            failures.pop(w).close()
        failures[w], sending = mp.Pipe(duplex=False)
        p = mp.Process(target=_process_main, args=(args, w, os.getpid(), sending),
                       name=f"reader-{w}")
        # The signal mask outlives exec: the worker's interpreter holds a Ctrl-C back until
        # its handler is set (`_worker_main`), where one would interrupt its imports halfway
        # and print their traceback. This process takes its own once the worker is started.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            p.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
            sending.close()  # the worker holds its end: its death reads as the pipe's end
        started[w] = time.monotonic()
        return p

    started: dict[int, float] = {}
    restarts: Counter = Counter()
    procs: dict[int, multiprocessing.Process] = {}
    codes: list[int] = []
    try:
        for w in range(args.workers):  # a signal during start-up starts no more of them
            if stopping.is_set():
                break
            procs[w] = start(w)
        while procs and not stopping.is_set():
            multiprocessing.connection.wait([p.sentinel for p in procs.values()], timeout=0.5)
            for w, p in list(procs.items()):
                if p.exitcode is None:
                    continue
                del procs[w]
                if p.exitcode == INTERRUPTED:  # a worker got Ctrl-C as it started: stop them all
                    stopped_by[0] = signal.SIGINT
                    stopping.set()
                if p.exitcode >= 0 or stopping.is_set():
                    codes.append(p.exitcode)
                    # A failure, or a worker stopped by its own signal, also when `read` was
                    # stopped since (its workers are stopped below: none has been yet). A worker
                    # done says nothing: its pipe reads as ended at once.
                    say_failures(w, quiet=p.exitcode == 0 and stopping.is_set())
                    if p.exitcode > 0 and procs and not stopping.is_set():
                        # it said why (one line): the others would read on short of a worker,
                        # and `read` would run on with an exit status hiding the failure. A
                        # moment first for workers failing alike (an unreachable dispatcher
                        # times out in each) to end so: their reason is the one said.
                        until = time.monotonic() + 0.5
                        while (alive := [q.sentinel for q in procs.values() if q.exitcode is None]
                               ) and time.monotonic() < until:
                            multiprocessing.connection.wait(alive, until - time.monotonic())
                        if alive:
                            say(f"mmdispatch read: worker {w} failed; stopping the other "
                                "workers", log_format)
                        stopping.set()
                    continue
                if time.monotonic() - started[w] >= RESTART_RESET_S:
                    restarts[w] = 0
                sig = signal.Signals(-p.exitcode)
                killed = f"mmdispatch read: worker {w} was killed by {sig.name}{_HINTS.get(sig, '')}"
                if restarts[w] >= MAX_RESTARTS:
                    say(f"{killed}; {MAX_RESTARTS} times in a row, not started again",
                        log_format)
                    codes.append(1)
                    continue
                restarts[w] += 1
                say(f"{killed}; starting it again ({restarts[w]}/{MAX_RESTARTS})", log_format,
                    level="WARNING")
                procs[w] = start(w)
    finally:
        # Workers that ended before `read` stopped them, and were not yet seen to: one stopped
        # by a signal to it alone says so now (under load a SIGTERM to `read` right after it
        # came before the loop woke, and the line was lost).
        ended = [w for w, p in procs.items() if not p.is_alive()]
        for p in procs.values():
            if p.is_alive():  # the worker says BYE and leaves, logging the signal `read` got
                try:
                    os.kill(p.pid, stopped_by[0])
                except ProcessLookupError:
                    pass
        for w, p in procs.items():
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
                say(f"mmdispatch read: worker {w} did not stop within 10 s of SIGTERM (a "
                    "stopped or hung process?); killed", log_format)
                codes.append(1)
                continue
            codes.append(max(p.exitcode or 0, 0))
            if p.exitcode and p.exitcode > 0:
                say_failures(w)
            elif w in ended and p.exitcode == 0:
                say_failures(w, quiet=True)
    if INTERRUPTED in codes:  # Ctrl-C while workers started: as a start-up interrupt ends
        say("mmdispatch read: interrupted", log_format)
        return INTERRUPTED
    return max(codes, default=0)
