"""The mmdispatch wire protocol: message types, header schemas, frame layout, version and limits.

Every message is a ZeroMQ multipart message: frame 0 is a msgpack header `{v, type, seq, ...}`,
the further frames are raw payloads that are never copied on receipt (`copy=False`). Payloads
of many items travel coalesced in one frame with their sizes in the header (v2): a frame costs
far more than a memcpy of a typical member, and receivers slice memoryviews out of it. In
`reference` payload mode (v3) an item's payload is not its bytes but a reference to them in
its shard file (`pack_ref`), which trainers read themselves; in `direct` mode the same
references travel, and trainers fetch the bytes from the readers (FETCH/PAYLOADS). Headers
are plain dicts checked against the schemas below on decode, so a peer can send anything and
`decode` still raises nothing but `ProtocolError`. Imports nothing of ours.
"""

from __future__ import annotations

import functools
import hashlib
import struct
import threading
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Iterable, NamedTuple

import msgpack

#: Bumped on any incompatible change of a header schema or the frame layout.
#: v2: SAMPLES and STEP carry their item payloads coalesced, one frame plus a `sizes` list.
#: v3: WELCOME says the session's payload mode; in `reference` mode payloads are references.
#: v4: skipped samples travel with SAMPLES as they happen, as (key, reason, index) records;
#:     HELLO/WELCOME carry the dataset fingerprint; END also tells readers the job is done.
#: v5: text travels as token ids plus loss mask (`tokens`, see TOKEN_WIDTHS), not raw text.
#:     The `direct` payload mode added optional fields and the READERS/FETCH/PAYLOADS types
#:     without a bump: none of them is sent unless the dispatcher runs --payloads direct.
#: v6: END of a halted job says why (`message`), so the trainer's error names the cause.
#:     A trainer's HELLO says `resume` when its next_step came from a checkpoint (optional,
#:     no bump: an older dispatcher ignores it and checks nothing).
#: v7: a payload reference also holds its shard file's stamp as the reader read it (`pack_ref`).
#: v8: a reader's HELLO says its process's `instance` (a reconnect replaces its earlier session;
#:     a v7 dispatcher refuses the field). A STEP micro-batch whose payloads exceed one frame
#:     says in how many frames they follow (`parts`; absent otherwise).
#: v9: a trainer's WELCOME says the dispatcher's `ranks_per_node`, so a trainer on a node of
#:     another size says so in its own log (a v8 trainer refuses the field).
#:     SHARD_DONE says the identity of the reader's copy of the shard (`identity`, see
#:     SHARD_IDENTITY; a v8 dispatcher refuses the field), and SHARD_ASSIGN the identity of
#:     the copy another reader read first, for a local copy to be checked before it is read.
#:     SHARD_DONE's `truncated`: samples cut to --max-seq-len (--over-length truncate). A
#:     reader's HELLO says its host (`node`): a node's readers share its copy of the shards.
#: v10: SAMPLES says where its reader would resume the shard (`resume`: [index, offset], see
#:     RESUME), and SHARD_ASSIGN may carry that `offset` with `start_index` == its index: the
#:     reader starts its tar walk there instead of walking the shard from byte 0 (a v9 peer
#:     refuses the fields; a v9 reader would drop the offset and walk from 0 anyway).
#: v12: a STEP carries all its micro-batches' arrays and payloads in one coalesced data frame
#:     (more only past `Limits.max_frame_bytes`), not two frames or more per micro-batch; the
#:     micro-batch's `parts` is gone (see `_check_step`).
#: v13: a STEP micro-batch says each sample's source (`sources`: uint16 per sample, an index
#:     into the job's source names, which a trainer's WELCOME lists as `sources`).
VERSION = 13

HELLO = "hello"  # peer -> dispatcher: version, role and who it is
WELCOME = "welcome"  # dispatcher -> peer: accepted, with the session parameters
ERROR = "error"  # either way: {code, message}; its schema never changes across versions
HEARTBEAT = "heartbeat"  # either way: liveness (any message counts as one)
SHARD_REQUEST = "shard_request"  # reader -> dispatcher: ready for shards, `shards` at a time
SHARD_ASSIGN = "shard_assign"  # dispatcher -> reader: read shard from start_index
CANCEL = "cancel"  # dispatcher -> reader: stop an assignment (reassigned or rewound)
SAMPLES = "samples"  # reader -> dispatcher: sample headers, skipped samples, items' payloads
SHARD_DONE = "shard_done"  # reader -> dispatcher: assignment finished, count + last skips
CREDIT = "credit"  # dispatcher -> reader: samples it may send; trainer -> dispatcher: steps
STEP = "step"  # dispatcher -> trainer: one rank's micro-batches of one step
END = "end"  # dispatcher -> peer: no more steps (trainers) / the job is done (readers)
COMMIT = "commit"  # trainer -> dispatcher: step checkpointed; echoed back once journaled
BYE = "bye"  # peer -> dispatcher: leaving on purpose
READERS = "readers"  # dispatcher -> trainer (direct mode): the live readers' payload endpoints
FETCH = "fetch"  # trainer -> reader's payload socket (direct mode): references, coalesced
PAYLOADS = "payloads"  # reader -> trainer (direct mode): the bytes of one FETCH
#: ERROR code a reader sends before it exits because its error policy stopped it on its data
#: (`--errors raise`, or more consecutive bad samples than `--max-consecutive-errors`): the
#: dispatcher stops the job with its message instead of handing the shard to the next reader.
READER_STOPPED = "reader_stopped"
#: ERROR code the dispatcher sends a trainer, after its WELCOME, where its HELLO took its rank
#: over from a connection still heard from (the older one gets `replaced`): a warning, not a
#: stop (a restarted trainer is fine), so a trainer of another job pointed here says so.
TOOK_OVER = "took_over"

ROLES = ("reader", "trainer")
#: Most shards a reader holds at once (SHARD_REQUEST `shards`, default 1): it reads one and
#: keeps the rest queued, so finishing a shard never waits on a round trip to the dispatcher.
#: It reads whichever of them has credits, oldest first; the dispatcher assigns a free slot
#: without being asked again and may CANCEL any of them.
MAX_READER_SHARDS = 4
#: inline: payload frames hold the members' bytes, reader -> dispatcher -> trainer.
#: reference: they hold (offset, size, path) of each member in its shard file; trainers read
#: the bytes from a filesystem they share with the data nodes, so payloads skip both hops.
#: direct: they hold references too; trainers fetch the bytes from the reader that counted them
#: (any live reader serves any reference from its shard file when that one is gone).
PAYLOAD_MODES = ("inline", "reference", "direct")
_INT = int
_OPT_INT = (int, type(None))
#: Most steps of credit a trainer's HELLO may ask for (`prefetch`; the client sends 2 by
#: default), and most a consumer of its client may take ahead (`ahead`; a PrefetchPool says
#: its micro-batches ahead plus one, 5 by default): far past any use, and short of a credit so
#: far ahead that the dispatcher would hold steps for it without bound.
MAX_PREFETCH = 4096
MAX_AHEAD = 4096

#: type -> field -> (accepted python types, required). `v`, `type`, `seq` are always required.
SCHEMAS: dict[str, dict[str, tuple[Any, bool]]] = {
    # a trainer's `ahead`: steps a consumer of its client (a PrefetchPool) takes ahead of the
    # training loop, beyond the client's own `prefetch`
    HELLO: {"role": (str, True), "name": (str, False), "rank": (_INT, False),
            "world_size": (_INT, False), "local_world_size": (_INT, False),
            "next_step": (_OPT_INT, False), "prefetch": (_INT, False),
            "dataset": (dict, False), "inputs": (dict, False), "resume": (bool, False),
            "instance": (str, False), "node": (str, False), "ahead": (_INT, False)},
    # direct mode: `readers` (trainers) is the live reader table, `shards` (readers) the files
    # whose bytes a reader may serve.
    WELCOME: {"role": (str, True), "ack": (_INT, True), "heartbeat_s": (float, True),
              "world_size": (_INT, False), "next_step": (_INT, False),
              "num_microbatches": (_OPT_INT, False), "payloads": (str, False),
              "dataset": (dict, False), "readers": (list, False), "shards": (list, False),
              "ranks_per_node": (_INT, False), "sources": (list, False)},
    ERROR: {"code": (str, True), "message": (str, True), "ack": (_OPT_INT, False)},
    HEARTBEAT: {},
    # direct mode: where the reader serves payloads, and its CurveZMQ public key (z85) if any
    SHARD_REQUEST: {"shards": (_INT, False), "payload_endpoint": (str, False),
                    "payload_key": (str, False)},
    SHARD_ASSIGN: {"assign_id": (_INT, True), "shard": (str, True), "pos": (_INT, True),
                   "epoch": (_INT, True), "start_index": (_INT, True), "source": (str, False),
                   "fields": (dict, False), "identity": (dict, False), "offset": (_INT, False)},
    CANCEL: {"assign_id": (_INT, True)},
    SAMPLES: {"assign_id": (_INT, True), "samples": (list, True), "sizes": (list, False),
              "skipped": (list, False), "resume": (list, False)},
    SHARD_DONE: {"assign_id": (_INT, True), "count": (_INT, True), "skipped": (list, True),
                 "ignored": (dict, False), "identity": (dict, False), "truncated": (_INT, False)},
    CREDIT: {"assign_id": (_INT, False), "samples": (_INT, False),
             "upto": (_INT, False), "received": (_INT, False), "timings": (list, False)},
    STEP: {"step": (_INT, True), "epoch": (_INT, True), "rank": (_INT, True),
           "world_size": (_INT, True), "microbatches": (list, True), "readers": (list, False)},
    END: {"next_step": (_INT, False), "reason": (str, True), "message": (str, False)},
    COMMIT: {"step": (_INT, True)},
    # a trainer's `next_step`: the step after the last its training loop took (a rank leaving
    # before the end of the stream, by a signal or a break, left the steps after it untrained)
    BYE: {"next_step": (_OPT_INT, False)},
    READERS: {"readers": (list, True)},
    FETCH: {"id": (_INT, True), "sizes": (list, True)},
    PAYLOADS: {"id": (_INT, True), "sizes": (list, True)},
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """Size limits. `max_frame_bytes` (plus WIRE_SLACK) is also set as zmq.MAXMSGSIZE: a socket
    drops a peer that sends a larger frame, so senders split payloads into frames within it
    (`coalesce`).
    `max_message_bytes` bounds a whole message once received: a rank's step of inline media
    may hold many frames (credits bound what is in flight)."""

    max_frames: int = 1 << 16
    max_header_bytes: int = 32 << 20
    max_frame_bytes: int = 256 << 20
    max_message_bytes: int = 64 << 30


DEFAULT_LIMITS = Limits()
#: What ZMQ_MAXMSGSIZE allows past `max_frame_bytes`: CurveZMQ checks the size of a frame's box
#: (its MESSAGE command: name, nonce, MAC and flags, 33 bytes more than the frame), so a frame
#: filled to the limit was dropped, and its sender reconnected for ever, only where it was
#: encrypted. A peer gains these few bytes a frame, nothing more.
WIRE_SLACK = 4096


class ProtocolError(Exception):
    """A message that does not follow this protocol (bad layout, schema, version or size)."""

    def __init__(self, message: str, *, code: str = "malformed", peer_version: Any = None):
        super().__init__(message)
        self.code = code
        self.peer_version = peer_version


@dataclass(slots=True)
class Message:
    """A decoded message: its type, the sender's sequence number, header fields and payloads."""

    type: str
    seq: int
    header: dict[str, Any]
    frames: list[memoryview] = field(default_factory=list)

    def __getitem__(self, name: str) -> Any:
        return self.header[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.header.get(name, default)


_packers = threading.local()


def packer() -> msgpack.Packer:
    """This thread's msgpack packer. `msgpack.packb` builds a Packer per call, which costs as
    much as packing a STEP header (~9 us of 18): a dispatcher sends thousands a step."""
    try:
        return _packers.packer
    except AttributeError:
        _packers.packer = p = msgpack.Packer(use_bin_type=True)
        return p


def encode(type_: str, *, seq: int = 0, frames: Iterable[Any] = (), **fields: Any) -> list[Any]:
    """Frames of one message: the msgpack header, then the payloads untouched (no copies)."""
    if type_ not in SCHEMAS:
        raise ValueError(f"unknown message type {type_!r}")
    header = {"v": VERSION, "type": type_, "seq": seq}
    header.update(fields)
    return [packer().pack(header), *frames]


def _exact_types(types: Any) -> frozenset:
    """The exact Python types msgpack yields that `_is(x, types)` accepts (bool is never an
    int; a float field also takes an int): one set lookup per field on decode."""
    wanted = types if isinstance(types, tuple) else (types,)
    out = {t for t in wanted if t is not float}
    if float in wanted:
        out |= {int, float}
    return frozenset(out)


#: type -> (field -> exact accepted types, required field names): SCHEMAS compiled for decode.
_COMPILED = {t: ({name: _exact_types(types) for name, (types, _) in schema.items()},
                 frozenset(name for name, (_, required) in schema.items() if required))
             for t, schema in SCHEMAS.items()}


def decode(frames: Iterable[Any], limits: Limits = DEFAULT_LIMITS) -> Message:
    """Parse and validate one multipart message; any defect raises `ProtocolError`, nothing else.

    Every message the dispatcher receives passes here (thousands a step at thousands of ranks),
    so the schema check is set operations on the compiled schemas, not a loop of isinstance.
    """
    try:  # a zmq.Frame exposes .buffer; bytes/bytearray/memoryview convert directly
        views = [memoryview(getattr(f, "buffer", f)).cast("B") for f in frames]
    except Exception as e:  # noqa: BLE001 - fuzzed input: anything odd is a protocol error
        raise ProtocolError(f"frames are not buffers: {e}") from None
    if not views:
        raise ProtocolError("empty message")
    if len(views) > limits.max_frames:
        raise ProtocolError(f"{len(views)} frames > limit {limits.max_frames}", code="too_large")
    head = views[0]
    if head.nbytes > limits.max_header_bytes:
        raise ProtocolError(f"header of {head.nbytes} bytes > limit", code="too_large")
    total = sum([v.nbytes for v in views]) if len(views) > 1 else head.nbytes
    if total > limits.max_message_bytes:
        raise ProtocolError(f"message of {total} bytes > limit", code="too_large")
    try:
        header = msgpack.unpackb(head, raw=False, strict_map_key=False)
    except Exception as e:  # noqa: BLE001
        raise ProtocolError(f"header is not msgpack: {type(e).__name__}") from None
    if type(header) is not dict:
        raise ProtocolError("header is not a map")
    type_, v, seq = header.pop("type", None), header.pop("v", None), header.pop("seq", None)
    if type(type_) is not str or type_ not in SCHEMAS:
        raise ProtocolError(f"unknown message type {str(type_)[:40]!r}", code="unknown_type")
    # ERROR keeps its schema forever, so a peer of another version can still read why.
    if v != VERSION and type_ != ERROR:
        raise ProtocolError(
            f"protocol version mismatch: peer speaks v{v}, this side speaks v{VERSION}",
            code="version", peer_version=v if isinstance(v, (int, str)) else None)
    if type(seq) is not int:
        raise ProtocolError("seq must be an integer")
    _check_fields(type_, header)
    payloads = views[1:]
    _CHECKS.get(type_, _no_payload)(header, payloads)
    return Message(type_, seq, header, payloads)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is(x: Any, types: Any) -> bool:
    if isinstance(x, bool):
        return types is bool or (isinstance(types, tuple) and bool in types)
    if types is float:
        return isinstance(x, (int, float))
    return isinstance(x, types)


def _check_fields(type_: str, fields: dict[str, Any]) -> None:
    types, required = _COMPILED[type_]
    if not fields.keys() <= types.keys():  # a subset test builds no set
        name = next(n for n in fields if n not in types)
        raise ProtocolError(f"{type_}: unknown field {str(name)[:40]!r}")
    if not required <= fields.keys():
        name = min(required - fields.keys())
        raise ProtocolError(f"{type_}: missing field {name!r}")
    for name, value in fields.items():
        if type(value) not in types[name]:
            raise ProtocolError(f"{type_}: field {name!r} has type {type(value).__name__}")


def _no_payload(fields: dict, payloads: list) -> None:
    if payloads:
        raise ProtocolError(f"{len(payloads)} unexpected payload frames")


def _check_hello(fields: dict, payloads: list) -> None:
    _no_payload(fields, payloads)
    if fields["role"] not in ROLES:
        raise ProtocolError(f"hello: unknown role {fields['role'][:40]!r}")


def _list_of(x: Any, n: int, types: tuple, what: str) -> list:
    if not isinstance(x, list) or len(x) != n or not all(_is(a, t) for a, t in zip(x, types)):
        raise ProtocolError(f"malformed {what}")
    return x


#: SAMPLES: one sample header per sample; the payloads follow in (sample, item) order, either
#: one frame per item (no `sizes`), or coalesced in exactly one frame sliced by `sizes` (bytes
#: per item), which is what readers send: one frame per message instead of one per item.
#: On the wire headers are msgpack arrays (compact); `decode` hands them out as the named
#: records below, so no code indexes a header by position.
class ItemHeader(NamedTuple):
    """One image/audio item of a sample, as a reader counted it."""

    modality: str
    member: str  # member suffix inside the sample, e.g. "0.jpg"
    enc_len: int
    llm_len: int
    meta: dict  # header facts; ANCHOR where the item stands among the text


#: An item's `meta` key placing it among its sample's text: the position its placeholder (which
#: the reader removed) held in the sample's text ids, placeholders counted, so the anchored
#: items of a sample have distinct anchors in the order their placeholders were written.
#: Absent: the item comes before the text. It rides in meta, which readers already send and the journal's
#: plans and a replay's re-read keep, so peers without it are unchanged.
ANCHOR = "anchor"


class SampleHeader(NamedTuple):
    """One counted sample: its place in the shard, its lengths, its text tokens and its items."""

    key: str
    index: int  # raw index in its shard
    text_len: int
    llm_len: int
    tokens: bytes  # text_len token ids and their loss mask (see TOKEN_WIDTHS)
    items: list  # of ItemHeader


class SkipRecord(NamedTuple):
    """A sample a reader could not use: reported by key and index, never silently lost.
    `index` is -1 for shard-level failures (the rest of the shard is unreadable)."""

    key: str
    reason: str
    index: int


SAMPLE_FIELDS = SampleHeader._fields
#: A sample's text on the wire (`tokens`): no bytes for no text; else one byte w, the narrowest
#: width in TOKEN_WIDTHS that holds its largest id, then its ids as w-byte little-endian integers,
#: then its loss mask as bits (1: a target), least significant bit first, ceil(n/8) bytes. Byte-
#: level ids cost 1.125 bytes a token, a vocabulary up to 65,536 ids 2.125.
TOKEN_WIDTHS = (1, 2, 4)
_WIDTH_SET = frozenset(TOKEN_WIDTHS)
#: numpy dtype string of the ids at each width.
TOKEN_DTYPES = {1: "<u1", 2: "<u2", 4: "<i4"}


def token_width(largest_id: int) -> int:
    """The narrowest width in TOKEN_WIDTHS that holds ids up to `largest_id`."""
    return 1 if largest_id < 1 << 8 else 2 if largest_id < 1 << 16 else 4


def tokens_size(n: int, width: int) -> int:
    """Bytes of `n` tokens of `width`-byte ids on the wire."""
    return 1 + width * n + (n + 7) // 8 if n else 0


def tokens_ok(tokens: bytes | memoryview, n: int) -> bool:
    """Whether `tokens` is a well-formed wire form of exactly `n` tokens."""
    if not n:
        return len(tokens) == 0
    return len(tokens) > 0 and tokens[0] in _WIDTH_SET and len(tokens) == tokens_size(n, tokens[0])


def blank_tokens(n: int, width: int = 1) -> bytes:
    """The wire form of `n` tokens of id 0, all targets (for tests and synthetic headers)."""
    if not n:
        return b""
    full, rest = divmod(n, 8)
    return bytes([width]) + bytes(width * n) + b"\xff" * full + (bytes([(1 << rest) - 1]) if rest else b"")


def split_tokens(tokens: bytes | memoryview, n: int) -> tuple[int, memoryview, memoryview]:
    """(width, ids bytes, mask bits) of a sample's `tokens` of `n` tokens (checked on decode)."""
    view = memoryview(tokens)
    if not n:
        return 1, view[:0], view[:0]
    width = view[0]
    return width, view[1:1 + width * n], view[1 + width * n:]


ITEM_FIELDS = ItemHeader._fields


def _check_samples(fields: dict, payloads: list) -> None:
    # The dispatcher's hottest check (every sample passes here): exact type tests on fields
    # unpacked once, no helpers, and records made with tuple.__new__ (lengths checked first).
    num_items = 0
    headers = []
    record = tuple.__new__
    for s in fields["samples"]:
        if type(s) is not list or len(s) != 6:
            raise ProtocolError("malformed sample header")
        key, index, text_len, llm_len, tokens, items = s
        if (type(key) is not str or type(index) is not int or type(text_len) is not int
                or type(llm_len) is not int or type(tokens) is not bytes or type(items) is not list):
            raise ProtocolError("malformed sample header")
        if text_len > 0:  # ids of a width, then the loss mask's bits (tokens_size)
            if (not tokens or tokens[0] not in _WIDTH_SET
                    or len(tokens) != 1 + tokens[0] * text_len + (text_len + 7) // 8):
                raise ProtocolError("malformed sample header")
        elif text_len < 0 or tokens:
            raise ProtocolError("malformed sample header")
        if items:
            for k, it in enumerate(items):
                if type(it) is not list or len(it) != 5:
                    raise ProtocolError("malformed item header")
                modality, member, enc_len, llm_len_, meta = it
                if (type(modality) is not str or type(member) is not str
                        or type(enc_len) is not int or type(llm_len_) is not int
                        or type(meta) is not dict):
                    raise ProtocolError("malformed item header")
                items[k] = record(ItemHeader, it)
            num_items += len(items)
        headers.append(record(SampleHeader, s))
    fields["samples"] = headers
    if "skipped" in fields:
        fields["skipped"] = _skip_records(fields["skipped"])
    resume = fields.get("resume")
    if resume is not None and (len(resume) != 2 or type(resume[0]) is not int
                               or type(resume[1]) is not int or resume[0] < 1 or resume[1] < 1):
        raise ProtocolError("samples: malformed resume (want [index > 0, offset > 0])")
    sizes = fields.get("sizes")
    if sizes is None:
        if num_items != len(payloads):
            raise ProtocolError(f"samples: {num_items} items but {len(payloads)} payload frames")
        return
    _check_sizes(sizes, num_items, payloads, "samples")


def _skip_records(entries: list) -> list[SkipRecord]:
    return [SkipRecord(*_list_of(e, 3, (str, str, int), "skipped entry")) for e in entries]


def _check_sizes(sizes: Any, num_items: int | None, payloads: list, what: str) -> None:
    """Coalesced payload frames (`coalesce`): one frame, or several that each end where an item
    does, whose bytes are exactly the items' sizes (`num_items` of them, unless None)."""
    if ((num_items is not None and len(sizes) != num_items)
            or not all(type(n) is int and n >= 0 for n in sizes)):
        raise ProtocolError(f"{what}: {len(sizes)} sizes for "
                            f"{'its' if num_items is None else num_items} items, or a bad size")
    if len(payloads) == 1 and payloads[0].nbytes == sum(sizes):
        return
    if not payloads or len(_frame_ends(payloads, sizes)) != len(payloads):
        raise ProtocolError(f"{what}: sizes add up to {sum(sizes)} bytes but the payload frames "
                            f"hold {sum(p.nbytes for p in payloads)} in {len(payloads)} frames, "
                            "or an item spans two frames")


def _frame_ends(frames: list, sizes: list[int]) -> list[int]:
    """Where each frame's items end (an index into `sizes`), for the frames that hold whole
    items from the start on; all of them exactly when the items line up with the frames."""
    ends, k = [], 0
    for frame in frames:
        n, have = memoryview(frame).nbytes, 0
        if n == 0:  # `coalesce` makes an empty frame only alone
            break
        while k < len(sizes) and have + sizes[k] <= n and (have < n or sizes[k] == 0):
            have += sizes[k]
            k += 1
        if have != n:
            break
        ends.append(k)
    return ends if k == len(sizes) else []


def coalesce(buffers: list, sizes: list[int], limit: int = DEFAULT_LIMITS.max_frame_bytes) -> list:
    """`buffers` (of `sizes` bytes) in as few frames as keep each within `limit`, in order and
    each buffer whole: one frame unless they exceed it. A buffer over `limit` is a frame of its
    own, which the receiver refuses: senders skip such items first."""
    if sum(sizes) <= limit:
        return [b"".join(buffers)]
    frames, start, run = [], 0, 0
    for k, n in enumerate(sizes):
        if run and run + n > limit:
            frames.append(b"".join(buffers[start:k]))
            start, run = k, 0
        run += n
    frames.append(b"".join(buffers[start:]))
    return frames


def split_frames(frames: list, sizes: list[int]) -> list[memoryview]:
    """Views (no copies) of each item in checked coalesced payload frames (`coalesce`)."""
    if len(frames) == 1:
        return split_payload(frames[0], sizes)
    out, k = [], 0
    for frame, end in zip(frames, _frame_ends(frames, sizes)):
        out.extend(split_payload(memoryview(frame), sizes[k:end]))
        k = end
    return out


# member data offset in the shard file, member size, the file's stamp as its reader read it
_REF = struct.Struct("<QQQ")


class Ref(NamedTuple):
    path: bytes
    offset: int
    size: int
    stamp: int  # file_stamp of the shard as its reader read it; 0: unknown (a remote object)


def file_stamp(size: int, mtime_ns: int) -> int:
    """A shard file's version as 64 bits, from its size and modification time (what any mount
    of it reports alike; never 0): a reference is read only from the file its reader counted,
    not from one replaced or rewritten since, whose bytes at the offset are others."""
    digest = hashlib.blake2b(f"{size}:{mtime_ns}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


def reference_path(url: str, mode: str = "reference") -> str:
    """The file (or, in `direct` mode, the remote object) whose bytes `reference` or `direct`
    payloads of shard `url` point into; ValueError naming the shard and the fix if none.

    Only plain (uncompressed) tars qualify: a gzip shard's offsets are not file offsets, and a
    `pipe:` stream has none anyone could read at. `reference` needs a file the trainers mount;
    `direct` also takes a remote URL (`s3://`, `http(s)://`, ...), which the readers read at an
    offset with a ranged request. A path is the same in both modes, so the direct rule serves
    to read back what either mode sent.
    """
    # file:///data/a.tar and file:/data/a.tar (what the readers accept) name /data/a.tar
    path = (url[len("file://"):] if url.startswith("file://")
            else url[len("file:"):] if url.startswith("file:") else url)
    if url.startswith("pipe:"):
        raise ValueError(f"--payloads {mode} needs shards that can be read at an offset; {url!r} "
                         f"is a command's stream (use --payloads inline)")
    if "://" in path and mode != "direct":
        raise ValueError(f"--payloads {mode} needs shards on a filesystem the trainers mount; "
                         f"{url!r} is remote storage (use --payloads direct, where the readers "
                         f"serve its bytes, or --payloads inline)")
    name = path.split("?", 1)[0] if "://" in path else path  # a remote URL's query aside
    if name.lower().endswith((".gz", ".tgz")):
        raise ValueError(f"--payloads {mode} needs uncompressed tars; {url!r} is gzip "
                         f"(its member offsets are not file offsets; use --payloads inline)")
    return path


def pack_ref(path: bytes, offset: int, size: int, stamp: int = 0) -> bytes:
    """The payload standing for `size` bytes at `offset` of file `path` (reference and direct
    modes), read by its reader from the file version `stamp` (`file_stamp`; 0: unknown)."""
    return _REF.pack(offset, size, stamp) + path


def unpack_ref(ref: memoryview | bytes) -> Ref:
    """The fields of a reference payload; ProtocolError if it is too short."""
    if len(ref) <= _REF.size:
        raise ProtocolError(f"a payload reference holds {len(ref)} bytes, not "
                            "offset+size+stamp+path")
    offset, size, stamp = _REF.unpack_from(ref)
    return Ref(bytes(ref[_REF.size:]), offset, size, stamp)


def check_stamp(ref: Ref, size: int, mtime_ns: int) -> None:
    """OSError unless the file `ref` points into (now `size` bytes, modified at `mtime_ns`) is
    the version its reader read; a reference of unknown version passes."""
    if ref.stamp and file_stamp(size, mtime_ns) != ref.stamp:
        # The version is size and modification time: a copy of the file on another node
        # differs too unless copied with its times (cp -p, rsync -a), however like its bytes.
        raise OSError(f"shard {ref.path.decode(errors='replace')!r} changed on disk since its "
                      f"reader read it (replaced or rewritten: it is {size} bytes, modified at "
                      f"{mtime_ns / 1e9:.3f}): its bytes at the reader's offsets may be others; "
                      "leave shards in place while a job reads them. A node's own copy of the "
                      "shards counts as another version unless copied with its modification "
                      "times (cp -p, rsync -a): copy them so, or mount one shared copy")


def refs_point_into(views: list, path: bytes) -> bool:
    """Whether every reference payload in `views` names exactly the file `path`."""
    n = _REF.size + len(path)
    return all(len(v) == n and v[_REF.size:] == path for v in views)


def split_payload(frame: memoryview, sizes: list[int]) -> list[memoryview]:
    """Views (no copies) of each item in a coalesced payload frame; sizes were checked on decode."""
    out, at = [], 0
    for n in sizes:
        out.append(frame[at:at + n])
        at += n
    return out


#: SHARD_DONE's optional `ignored`: {suffix: count} of the shard's members no field map kind
#: names ("" for names without a suffix); readers fold suffixes beyond the most common
#: MAX_IGNORED_SUFFIXES - 1 into IGNORED_OTHER, so metric labels stay few.
MAX_IGNORED_SUFFIXES = 64
MAX_SUFFIX_CHARS = 64
IGNORED_OTHER = "(other)"


#: SHARD_DONE's optional `identity`: the reader's copy of the shard as it walked it whole, {"size":
#: tar bytes, "headers": hex digest of its header blocks} (`pipeline.tario.CopyIdentity`); absent
#: when the walk did not reach the archive's end.
SHARD_IDENTITY = {"size": int, "headers": str}
MAX_IDENTITY_CHARS = 64


def _check_identity(type_: str, identity: dict | None) -> None:
    if identity is not None and (
            set(identity) != set(SHARD_IDENTITY)
            or not all(type(identity[k]) is t for k, t in SHARD_IDENTITY.items())
            or identity["size"] < 0 or len(identity["headers"]) > MAX_IDENTITY_CHARS):
        raise ProtocolError(f"{type_}: malformed identity (size >= 0 and a digest of at most "
                            f"{MAX_IDENTITY_CHARS} characters)")


#: SAMPLES' optional `resume`: [index, offset]: every sample of the shard before `index` has been
#: sent or reported skipped, and sample `index` begins at byte `offset` of the shard's tar (its
#: first header block, extension headers included). The dispatcher keeps the latest one of the
#: assignment, and a reassignment of the shard at `start_index` == index carries SHARD_ASSIGN
#: `offset`: the reader starts walking the tar there (and walks from byte 0 if it finds no
#: header there). Absent when the reader cannot tell (a `pipe:` or gzip shard).
RESUME = ("index", "offset")


def _check_shard_assign(fields: dict, payloads: list) -> None:
    _no_payload(fields, payloads)
    _check_identity(SHARD_ASSIGN, fields.get("identity"))
    if fields.get("offset", 1) < 1 or ("offset" in fields and fields["start_index"] < 1):
        raise ProtocolError("shard_assign: offset must be > 0, with start_index > 0")


def _check_shard_done(fields: dict, payloads: list) -> None:
    _no_payload(fields, payloads)
    _check_identity(SHARD_DONE, fields.get("identity"))
    fields["skipped"] = _skip_records(fields["skipped"])
    ignored = fields.get("ignored")
    if ignored is not None and (
            len(ignored) > MAX_IGNORED_SUFFIXES
            or not all(type(k) is str and len(k) <= MAX_SUFFIX_CHARS and type(n) is int and n > 0
                       for k, n in ignored.items())):
        raise ProtocolError(f"shard_done: malformed ignored counts (at most {MAX_IGNORED_SUFFIXES} "
                            f"suffixes of at most {MAX_SUFFIX_CHARS} characters, counts > 0)")
    # samples of the shard sent with their text cut to the readers' --max-seq-len; absent: none
    if fields.get("truncated", 1) < 1:
        raise ProtocolError(f"shard_done: truncated={fields['truncated']} must be > 0 (absent: none)")


#: STEP: per micro-batch header fields. One data frame follows the header: every micro-batch's
#: int64 arrays (`arrays` lengths each, in micro-batch order), then every micro-batch's payloads
#: (those of the encoder items this rank encodes, in encode order, phases in ENCODER_PHASES
#: order), `sizes` bytes each; `payloads` counts them. Frames past `Limits.max_frame_bytes`
#: split the data at item boundaries (`coalesce`), the arrays counting as its first item.
#: Each entry of `items` is a StepItemHeader. One frame, not two per micro-batch: each ZeroMQ
#: frame costs a send call and I/O-thread work (about 3 us on the benchmark VM, far more than
#: copying a rank's few kilobytes of arrays into one), and a dispatcher sends a STEP per rank
#: per step.
class StepItemHeader(NamedTuple):
    """An encoder item as a trainer receives it: what it is and which sample owns it."""

    modality: str
    key: str  # the owning sample's key
    member: str
    meta: dict


MICROBATCH_FIELDS = {"arrays": list, "keys": list, "tokens": list, "items": list, "payloads": int,
                     "sizes": list, "sources": bytes}
#: A STEP micro-batch's `sources`: each sample's source, as an index into WELCOME's `sources`
#: (SOURCE_WIDTH bytes, little-endian).
SOURCE_WIDTH = 2
SOURCE_DTYPE = f"<u{SOURCE_WIDTH}"
#: The name of the one source of a job served from `--shards` (no dataset file).
DEFAULT_SOURCE = "default"
#: direct mode: a micro-batch also says, per item, which entry of the STEP's `readers` holds it.
HOLDERS = "holders"


def _check_step(fields: dict, payloads: list) -> None:
    for mb in fields["microbatches"]:
        if not isinstance(mb, dict) or set(mb) - {HOLDERS} != set(MICROBATCH_FIELDS):
            raise ProtocolError("step: malformed micro-batch header")
        for name, t in MICROBATCH_FIELDS.items():
            if not _is(mb[name], t):
                raise ProtocolError(f"step: micro-batch field {name!r} malformed")
        _check_holders(mb, fields)
        if not all(_is_int(n) and n >= 0 for n in mb["arrays"]) or mb["payloads"] < 0:
            raise ProtocolError("step: negative counts")
        if len(mb["keys"]) != len(mb["tokens"]) or not all(isinstance(k, str) for k in mb["keys"]):
            raise ProtocolError("step: keys and tokens disagree")
        if len(mb["sources"]) != SOURCE_WIDTH * len(mb["keys"]):
            raise ProtocolError("step: keys and sources disagree")
        if not all(isinstance(t, bytes) and (not t or t[0] in _WIDTH_SET) for t in mb["tokens"]):
            raise ProtocolError("step: tokens must be bytes, empty or led by a width of "
                                f"{'/'.join(map(str, TOKEN_WIDTHS))}")
        if len(mb["items"]) != mb["payloads"] or len(mb["sizes"]) != mb["payloads"]:
            raise ProtocolError("step: item headers, sizes and payload count disagree")
        mb["items"] = [StepItemHeader(*_list_of(it, 4, (str, str, str, dict), "step item header"))
                       for it in mb["items"]]
    _check_sizes(step_data_sizes(fields["microbatches"]), None, payloads, "step")
    _check_readers(fields)


def step_data_sizes(microbatches: list[dict]) -> list[int]:
    """The items of a STEP's data frames: every micro-batch's arrays as one, then each payload."""
    return [8 * sum(sum(mb["arrays"]) for mb in microbatches),
            *chain.from_iterable(mb["sizes"] for mb in microbatches)]


def microbatch_frames(msg: Message) -> list[tuple[memoryview, list[memoryview]]]:
    """Per micro-batch of a checked STEP: (its arrays bytes, its payload views), no copies."""
    mbs = msg["microbatches"]
    views = split_frames(msg.frames, step_data_sizes(mbs))
    out, arrays, at = [], views[0], 1
    for mb in mbs:
        n = 8 * sum(mb["arrays"])
        out.append((arrays[:n], views[at:at + mb["payloads"]]))
        arrays, at = arrays[n:], at + mb["payloads"]
    return out


def _check_holders(mb: dict, fields: dict) -> None:
    """direct mode: one holder per item, each an index into the STEP's `readers`, or neither."""
    holders, readers = mb.get(HOLDERS), fields.get("readers")
    if holders is None and readers is None:
        return
    if holders is None or readers is None:
        raise ProtocolError("step: holders and readers go together")
    if (type(holders) is not list or len(holders) != mb["payloads"]
            or not all(_is_int(h) and 0 <= h < len(readers) for h in holders)):
        raise ProtocolError("step: holders must index the step's readers, one per item")


class ReaderEndpoint(NamedTuple):
    """A reader's payload socket (direct mode): its endpoint and CurveZMQ public key (z85, or
    "" without CurveZMQ)."""

    endpoint: str
    key: str


def _check_readers(fields: dict) -> None:
    if "readers" in fields:
        fields["readers"] = [ReaderEndpoint(*_list_of(e, 2, (str, str), "reader endpoint"))
                             for e in fields["readers"]]


def _check_table(fields: dict, payloads: list) -> None:
    _no_payload(fields, payloads)
    _check_readers(fields)


def _check_fetch(fields: dict, payloads: list) -> None:
    """FETCH: references (see pack_ref) coalesced in one frame."""
    _check_sizes(fields["sizes"], len(fields["sizes"]), payloads, "fetch")


def _check_payloads(fields: dict, payloads: list) -> None:
    """PAYLOADS: the bytes coalesced in one frame, or one frame per item (a reader sends mapped
    members so, uncopied); `sizes` either way."""
    sizes = fields["sizes"]
    if len(payloads) == 1 or len(payloads) != len(sizes):
        _check_sizes(sizes, len(sizes), payloads, "payloads")
    elif not all(type(n) is int and f.nbytes == n for f, n in zip(payloads, sizes)):
        raise ProtocolError("payloads: a frame's bytes differ from its size")


def item_views(frames: list, sizes: list[int]) -> list[memoryview]:
    """The items of a checked PAYLOADS message, coalesced or one frame each (no copies)."""
    return list(frames) if len(frames) == len(sizes) and len(frames) != 1 else split_frames(frames, sizes)


#: CREDIT from a trainer may carry `timings`: per computed step {"step": int, "mb": [per
#: micro-batch {PHASE: [seconds, [sequence lengths run]], ..., "exchange": seconds}]}, the
#: measured forward+backward time of each phase on that rank and what it ran.
TIMING_PHASES = ("vision", "audio", "llm")
MAX_TIMED_MICROBATCHES = 1024


def _check_credit(fields: dict, payloads: list) -> None:
    """A CREDIT's `upto` and `received` are what keep a rank served; its `timings` are
    telemetry. Malformed timings are dropped (`timings` empty, the reason in `timings_error`),
    never the credit with them: that rank would get no further step."""
    _no_payload(fields, payloads)
    problem = _timings_problem(fields.get("timings", ()))
    if problem is not None:
        fields["timings"], fields["timings_error"] = [], problem


#: Longest phase time a timings record may give (a day): a broken timer's NaN, inf or 1e300
#: would poison the step log and the refit window.
MAX_TIMING_S = 86400.0


def _seconds(value: Any) -> bool:
    """A phase time: a finite float in [0, MAX_TIMING_S] (NaN fails every comparison)."""
    return _is(value, float) and 0.0 <= value <= MAX_TIMING_S


def _timings_problem(timings: list) -> str | None:
    for rec in timings:
        if (type(rec) is not dict or set(rec) != {"step", "mb"} or not _is_int(rec["step"])
                or type(rec["mb"]) is not list or len(rec["mb"]) > MAX_TIMED_MICROBATCHES):
            return "malformed timings record"
        for mb in rec["mb"]:
            if type(mb) is not dict or not set(mb) <= {*TIMING_PHASES, "exchange"}:
                return "malformed micro-batch timings"
            if not _seconds(mb.get("exchange", 0.0)):
                return f"malformed exchange time (seconds in [0, {MAX_TIMING_S:g}])"
            for phase in TIMING_PHASES:
                t = mb.get(phase)
                if t is not None and (type(t) is not list or len(t) != 2 or not _seconds(t[0])
                                      or type(t[1]) is not list
                                      or not all(_is_int(n) and n >= 0 for n in t[1])):
                    return f"malformed {phase} timing"
    return None


_CHECKS = {HELLO: _check_hello, SAMPLES: _check_samples, SHARD_DONE: _check_shard_done,
           SHARD_ASSIGN: _check_shard_assign,
           STEP: _check_step, CREDIT: _check_credit, WELCOME: _check_table,
           READERS: _check_table, FETCH: _check_fetch, PAYLOADS: _check_payloads}


def socket_limits(sock: Any, limits: Limits = DEFAULT_LIMITS, *, linger_ms: int = 0) -> None:
    """Options every mmdispatch socket gets: refuse oversized frames, never block on close."""
    import zmq

    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_frame_bytes + WIRE_SLACK)
    sock.setsockopt(zmq.LINGER, linger_ms)
    # Credits bound what is in flight; high-water marks would only add silent drops or stalls.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)


@functools.cache
def _backend() -> tuple:
    """pyzmq's compiled send/recv and flags. The `zmq.Socket` wrappers (`send_multipart`,
    `recv_multipart`) add a Python layer per frame (type checks, enum flag arithmetic,
    routing-id handling): at thousands of ranks, ~6 us of 11.5 per message sent and ~1.8 of
    3.3 per message received; these call the compiled methods directly, with the same
    semantics (zero-copy for frames above the socket's copy threshold)."""
    import zmq
    from zmq.backend import Socket

    return Socket.send, Socket.recv, int(zmq.SNDMORE), int(zmq.NOBLOCK), zmq.Again


def send_frames(sock: Any, frames: list) -> None:
    """`sock.send_multipart(frames, copy=False)`, at half its cost (see `_backend`)."""
    send, _, more, _, _ = _backend()
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        send(sock, frame, more if i < last else 0, False, False)


def pending(sock: Any, budget: int | None = None):
    """Yield the multipart messages already waiting on `sock` (zero-copy frames), never blocking;
    at most `budget` of them, so one busy socket cannot starve the rest of a poll loop."""
    _, recv, _, noblock, again = _backend()
    count = 0
    while budget is None or count < budget:
        try:
            frame = recv(sock, noblock, False, False)
        except again:
            return
        parts = [frame]
        while frame.more:  # a multipart message arrives whole: its other parts are there
            frame = recv(sock, 0, False, False)
            parts.append(frame)
        yield parts
        count += 1
