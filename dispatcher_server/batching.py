"""From received samples to one step: planner inputs, and the per-rank STEP messages.

A step's samples keep their payloads as views of the frames that arrived from readers; each
rank's message carries only the items that rank encodes, coalesced per micro-batch into one
frame (one memcpy, instead of a zmq frame per item), so no rank receives the whole batch. The
cost is holding the received frames until every rank has acknowledged the step. All ranks'
messages of a step are encoded together, on the first send.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from itertools import chain, repeat
from operator import contains, itemgetter
from typing import NamedTuple

import numpy as np

from dispatcher_server.planner.types import ENCODER_PHASES, EncoderItems, StepInputs
from dispatcher_server.protocol import (ANCHOR, DEFAULT_LIMITS, HOLDERS, SOURCE_DTYPE, STEP,
                                        VERSION, coalesce, packer)
from dispatcher_server.stepwire import pack_step

_PHASE_OF = {"image": "vision", "video": "vision", "audio": "audio"}
_PHASE_CODE = {m: ENCODER_PHASES.index(p) for m, p in _PHASE_OF.items()}


class Sample(NamedTuple):
    """A sample held by the dispatcher: header fields plus its items' payload frames. A tuple:
    tens of thousands are made and dropped a step, and a step's columns come out of them in one
    C-level transpose (`build_batch`)."""

    key: str
    pos: int  # global shard position it came from
    index: int  # raw index in its shard
    text_len: int
    llm_len: int
    tokens: bytes  # text token ids and loss mask, as the reader sent them (protocol.TOKEN_WIDTHS)
    items: list  # ItemHeader per item
    payloads: list  # one buffer per item
    nbytes: int
    holder: int = -1  # direct payload mode: the reader holding the payloads (ReaderPool.endpoints)


def header_problem(text_len: int, llm_len: int, items: list) -> str | None:
    """Why a received sample header cannot be planned (a reader bug or a hostile peer), or None.

    Takes the header's fields, so a sample that will be refused is never built; `decode` has
    already checked their types (SAMPLE_FIELDS, ITEM_FIELDS), this checks their values.
    """
    if text_len < 0:
        return "invalid_header"
    total = text_len
    anchored = False
    for it in items:
        if it.modality not in _PHASE_OF or it.enc_len < 0 or it.llm_len < 0:
            return "invalid_header"
        total += it.llm_len
        anchored = anchored or ANCHOR in it.meta
    if anchored and _anchor_problem(text_len, items):
        return "invalid_header"
    return "invalid_llm_len" if llm_len != total else None


def _anchor_problem(text_len: int, items: list) -> bool:
    """Whether the anchors of a sample's items are not each its own place among the text and
    the placeholders (`protocol.ANCHOR`)."""
    anchors = [it.meta[ANCHOR] for it in items if ANCHOR in it.meta]
    return (any(type(a) is not int or not 0 <= a < text_len + len(anchors) for a in anchors)
            or len(set(anchors)) != len(anchors))


#: Marks a step digest that covers the samples' counted lengths too (`StepBatch.digest`).
DIGEST_PREFIX = "2:"


@dataclass(slots=True)
class StepBatch:
    """The samples of one step, the planner inputs built from them, and each item's STEP
    header, payload, size and holder, gathered once here so that a rank's message only selects
    the ids it encodes.

    Item columns run over all items in sample order (`flat`); `phase_items[phase]` are the
    flat positions of that phase's items, in item id order.
    """

    samples: list[Sample]
    inputs: StepInputs
    keys: list[str]  # per sample id
    tokens: list[bytes]  # per sample id
    sources: np.ndarray  # per sample id: its source's index (SOURCE_DTYPE)
    phase_items: dict[str, np.ndarray]  # phase -> flat position of each item id
    item_owner: np.ndarray  # flat -> sample id
    item_headers: list[tuple]  # flat -> STEP item header (StepItemHeader's fields)
    item_payloads: list  # flat -> payload buffer
    item_sizes: list[int]  # flat -> payload bytes

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.samples)

    @property
    def item_holders(self) -> list[int]:
        """flat -> the reader holding the item's payload (direct mode; else -1)."""
        return take([s.holder for s in self.samples], self.item_owner.tolist())

    @property
    def item_refs(self) -> dict[str, list[tuple[int, int]]]:
        """phase -> (sample id, index among its items) of each item id."""
        owner = self.item_owner  # non-decreasing: a sample's items sit together
        within = np.arange(len(owner)) - np.searchsorted(owner, owner)
        return {p: list(zip(owner[f].tolist(), within[f].tolist()))
                for p, f in self.phase_items.items()}

    def release_payloads(self) -> None:
        """Drop the samples and their payload buffers once the step's messages are encoded:
        inline messages hold a coalesced copy of every payload, so keeping both held each
        payload twice (and the received frames they are views of) until every rank had it."""
        self.samples, self.item_payloads = [], []

    def digest(self) -> str:
        """`DIGEST_PREFIX` and a hash of the keys and of the lengths they were counted with
        (text and LLM per sample; encoder and LLM per item, with its sample and its anchor
        where items are anchored): a journaled plan
        replays only over the same samples counted the same way (readers restarted with other
        counting rules or another tokenizer send other lengths, which the plan would not fit)."""
        return self.digests()[0]

    def digests(self) -> tuple[str, str]:
        """(`digest()`, `keys_digest()`), the keys joined once for both: the journal keeps the
        second to tell a replay over other samples from one over the same samples counted
        otherwise."""
        keys = self._keys_bytes()
        h = hashlib.blake2b(digest_size=16)
        h.update(keys)
        columns = [self.inputs.text_len, self.inputs.llm_len]
        for phase in sorted(self.inputs.encoders):
            e = self.inputs.encoders[phase]
            h.update(phase.encode())
            columns += [e.enc_len, e.llm_len, e.sample]
            if e.anchored:  # placed by other placeholders, the same lengths lay out otherwise
                columns.append(e.anchor)
        for column in columns:
            h.update(np.ascontiguousarray(column, dtype=np.int64).tobytes())
        return DIGEST_PREFIX + h.hexdigest(), hashlib.blake2b(keys, digest_size=16).hexdigest()

    def keys_digest(self) -> str:
        """The digest journals kept before `DIGEST_PREFIX`: a hash of the keys alone, each
        followed by a NUL byte."""
        h = hashlib.blake2b(digest_size=16)
        h.update(self._keys_bytes())
        return h.hexdigest()

    def _keys_bytes(self) -> bytes:
        """The keys, each followed by a NUL byte, as UTF-8 (one join: no string per key)."""
        return ("\0".join(self.keys) + "\0").encode() if self.keys else b""


def take(col: list, idx: list[int]) -> list:
    """[col[i] for i in idx] at C speed (one itemgetter over all of them)."""
    if len(idx) > 1:
        return list(itemgetter(*idx)(col))
    return [col[i] for i in idx]


def build_batch(samples: list[Sample], num_sources: int = 1) -> StepBatch:
    """Planner inputs: per sample text/LLM length, per encoder phase its items in sample order;
    each sample's source, of `num_sources` (a shard position's source is its position modulo
    their number, `StepAssembler.stream_of`).

    Whole-step columns, no per-sample or per-item Python step: the fields come out of the
    sample and item records in one transpose each (a step at 2,560 ranks holds tens of thousands
    of samples and items).
    """
    keys, pos, _, text_len, llm_len, tokens, items, payloads, _, _ = (
        zip(*samples) if samples else ((),) * len(Sample._fields))
    keys, tokens = list(keys), list(tokens)
    flat = list(chain.from_iterable(items))
    n = len(flat)
    modality, member, enc_len, item_llm_len, meta = zip(*flat) if n else ((),) * 5
    try:
        phase = np.fromiter(map(_PHASE_CODE.__getitem__, modality), dtype=np.int8, count=n)
    except KeyError as e:
        raise ValueError(f"unknown item modality {e.args[0]!r}") from None
    owner = np.repeat(np.arange(len(samples), dtype=np.int64), list(map(len, items)))
    enc_len = np.array(enc_len, dtype=np.int64)
    item_llm_len = np.array(item_llm_len, dtype=np.int64)
    payloads = list(chain.from_iterable(payloads))
    phase_items = {p: np.flatnonzero(phase == k) for k, p in enumerate(ENCODER_PHASES)}
    anchor = None
    if any(map(contains, meta, repeat(ANCHOR))):  # a C-level scan: placeholders are opt-in
        anchor = np.fromiter((m.get(ANCHOR, -1) for m in meta), dtype=np.int64, count=n)
    encoders = {p: EncoderItems(enc_len=enc_len[f], llm_len=item_llm_len[f], sample=owner[f],
                                anchor=None if anchor is None else anchor[f])
                for p, f in phase_items.items() if len(f)}
    inputs = StepInputs(text_len=np.array(text_len, dtype=np.int64),
                        llm_len=np.array(llm_len, dtype=np.int64), encoders=encoders)
    return StepBatch(
        samples=samples, inputs=inputs, keys=keys, tokens=tokens,
        sources=(np.array(pos, dtype=np.int64) % num_sources).astype(SOURCE_DTYPE),
        phase_items=phase_items, item_owner=owner,
        item_headers=list(zip(modality, take(keys, owner.tolist()), member, meta)),
        item_payloads=payloads, item_sizes=[memoryview(p).nbytes for p in payloads])


def step_messages(batch: StepBatch, plan, *, step: int, epoch: int, seq: int,
                  endpoints: list | None = None) -> list[list]:
    """The STEP message of every rank (rank r's has sequence number seq + r): exactly
    `plan.num_microbatches` micro-batches each, only that rank's part.

    With `endpoints` (direct payload mode: ReaderPool.endpoints) each micro-batch also names
    the holder of each item, as an index into the rank's `readers`: the endpoints it needs.

    The arrays of all ranks are packed at once, rank by rank (`stepwire.pack_step`); keys,
    tokens and item headers are put in order once, items rank by rank too, so a rank's lists
    are slices and its data frame is one join of its arrays and its payloads. The headers are
    packed by one reused packer (`protocol.packer`): this runs for every rank of every step.
    """
    W, M = plan.topology.world_size, plan.num_microbatches
    packed = pack_step(plan)
    order = plan.sample_order.tolist()
    keys, tokens = take(batch.keys, order), take(batch.tokens, order)
    sources = batch.sources[plan.sample_order].tobytes()
    width = batch.sources.itemsize
    sample_ptr = plan.sample_ptr.tolist()
    heads, buffers, nbytes, holders, item_ptr, rank_bytes = _items_by_rank(
        batch, plan, holders=endpoints is not None)
    lengths, pack = packed.lengths, packer().pack
    out = []
    for rank in range(W):
        mbs, table = [], {}
        for m in range(M):
            g, p = m * W + rank, rank * M + m
            s0, s1 = sample_ptr[g], sample_ptr[g + 1]
            a, z = item_ptr[p], item_ptr[p + 1]
            mb = {"arrays": lengths[g], "keys": keys[s0:s1], "tokens": tokens[s0:s1],
                  "items": heads[a:z], "payloads": z - a, "sizes": nbytes[a:z],
                  "sources": sources[s0 * width:s1 * width]}
            if endpoints is not None:
                mb[HOLDERS] = [table.setdefault(h, len(table)) for h in holders[a:z]]
            mbs.append(mb)
        header = {"v": VERSION, "type": STEP, "seq": seq + rank, "step": step, "epoch": epoch,
                  "rank": rank, "world_size": W, "microbatches": mbs}
        if endpoints is not None:
            header["readers"] = [list(endpoints[h]) for h in table]
        arrays = packed.rank_frame(rank)
        a, z = item_ptr[rank * M], item_ptr[rank * M + M]
        data = buffers[a:z]
        if arrays.nbytes + rank_bytes[rank] <= FRAME_LIMIT:
            data.insert(0, arrays)
            out.append([pack(header), b"".join(data)])
        else:  # split at item boundaries, the arrays whole and first
            out.append([pack(header), *coalesce([arrays.tobytes(), *data],
                                                [arrays.nbytes, *nbytes[a:z]], FRAME_LIMIT)])
    return out


#: The most bytes a STEP data frame holds (a receiving socket drops a peer sending more).
FRAME_LIMIT = DEFAULT_LIMITS.max_frame_bytes


def _items_by_rank(batch: StepBatch, plan, *, holders: bool
                   ) -> tuple[list, list, list, list | None, list[int], list[int]]:
    """(header, payload, size, holder) of every item in the order the STEP messages list them:
    by rank, then micro-batch, then phase, then the phase's send order; the CSR pointer over
    the rank-major groups p = rank * M + mb, and each rank's payload bytes. Each column is
    gathered once in that order, so a rank's items are one slice each; holders only if asked
    (direct mode), else None."""
    W, M = plan.topology.world_size, plan.num_microbatches
    groups, ids = [], []
    for phase in ENCODER_PHASES:
        ex = plan._exchange(phase)
        groups.append(np.repeat(np.arange(W * M), np.diff(ex.send_ptr)))
        ids.append(batch.phase_items[phase][ex.send_order])
    group = np.concatenate(groups)
    position = (group % W) * M + group // W  # rank-major
    # stable: phases stay in order, each in its send order
    by_position = np.argsort(position, kind="stable")
    order = np.concatenate(ids)[by_position].tolist()
    ptr = np.zeros(W * M + 1, dtype=np.int64)
    np.cumsum(np.bincount(position, minlength=W * M), out=ptr[1:])
    sizes = take(batch.item_sizes, order)
    cum = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(np.asarray(sizes, dtype=np.int64), out=cum[1:])
    rank_bytes = np.diff(cum[ptr[::M]])
    return (take(batch.item_headers, order), take(batch.item_payloads, order), sizes,
            take(batch.item_holders, order) if holders else None, ptr.tolist(),
            rank_bytes.tolist())


def rank_message(batch: StepBatch, plan, *, step: int, epoch: int, rank: int, seq: int) -> list:
    """One rank's STEP message (tests and tools; the dispatcher encodes whole steps at once)."""
    return step_messages(batch, plan, step=step, epoch=epoch, seq=seq - rank)[rank]
