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

import numpy as np

from dispatcher_server.planner.types import ENCODER_PHASES, EncoderItems, StepInputs
from dispatcher_server.protocol import HOLDERS, STEP, StepItemHeader, encode
from dispatcher_server.stepwire import pack_step

_PHASE_OF = {"image": "vision", "video": "vision", "audio": "audio"}


@dataclass(slots=True)
class Sample:
    """A sample held by the dispatcher: header fields plus its items' payload frames."""

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
    for it in items:
        if it.modality not in _PHASE_OF or it.enc_len < 0 or it.llm_len < 0:
            return "invalid_header"
        total += it.llm_len
    return "invalid_llm_len" if llm_len != total else None


@dataclass(slots=True)
class StepBatch:
    """The samples of one step, the planner inputs built from them, and item -> sample refs.

    Also, by item id per phase, each item's STEP header, payload and size, gathered once here
    so that a rank's message only selects the ids it encodes.
    """

    samples: list[Sample]
    inputs: StepInputs
    item_refs: dict[str, list[tuple[int, int]]]  # phase -> (sample id, item index) per item id
    keys: list[str]  # per sample id
    tokens: list[bytes]  # per sample id
    item_headers: dict[str, list[StepItemHeader]]  # phase -> header per item id
    item_payloads: dict[str, list]  # phase -> payload buffer per item id
    item_sizes: dict[str, list[int]]  # phase -> payload bytes per item id
    item_holders: dict[str, list[int]]  # phase -> holder per item id (direct mode; else -1)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.samples)

    def digest(self) -> str:
        """Hash of the keys, each followed by a NUL byte (one update: the same bytes hashed)."""
        h = hashlib.blake2b(digest_size=16)
        h.update("".join([k + "\0" for k in self.keys]).encode())
        return h.hexdigest()


def build_batch(samples: list[Sample]) -> StepBatch:
    """Planner inputs: per sample text/LLM length, per encoder phase its items in sample order."""
    # Per phase: refs, enc_len, llm_len, owner, header, payload, size of each item.
    cols = {p: ([], [], [], [], [], [], [], []) for p in ENCODER_PHASES}
    by_modality = {m: cols[p] for m, p in _PHASE_OF.items()}
    for si, s in enumerate(samples):
        if not s.items:
            continue
        key, payloads = s.key, s.payloads
        for ii, it in enumerate(s.items):
            c = by_modality.get(it.modality)
            if c is None:
                raise ValueError(f"unknown item modality {it.modality!r}")
            c[0].append((si, ii))
            c[1].append(it.enc_len)
            c[2].append(it.llm_len)
            c[3].append(si)
            c[4].append(StepItemHeader(it.modality, key, it.member, it.meta))
            p = payloads[ii]
            c[5].append(p)
            c[6].append(memoryview(p).nbytes)
            c[7].append(s.holder)
    encoders = {p: EncoderItems(enc_len=np.asarray(c[1], dtype=np.int64),
                                llm_len=np.asarray(c[2], dtype=np.int64),
                                sample=np.asarray(c[3], dtype=np.int64))
                for p, c in cols.items() if c[0]}
    inputs = StepInputs(
        text_len=np.asarray([s.text_len for s in samples], dtype=np.int64),
        llm_len=np.asarray([s.llm_len for s in samples], dtype=np.int64),
        encoders=encoders,
    )
    return StepBatch(samples=samples, inputs=inputs, item_refs={p: c[0] for p, c in cols.items()},
                     keys=[s.key for s in samples], tokens=[s.tokens for s in samples],
                     item_headers={p: c[4] for p, c in cols.items()},
                     item_payloads={p: c[5] for p, c in cols.items()},
                     item_sizes={p: c[6] for p, c in cols.items()},
                     item_holders={p: c[7] for p, c in cols.items()})


def step_messages(batch: StepBatch, plan, *, step: int, epoch: int, seq: int,
                  endpoints: list | None = None) -> list[list]:
    """The STEP message of every rank (rank r's has sequence number seq + r): exactly
    `plan.num_microbatches` micro-batches each, only that rank's part.

    With `endpoints` (direct payload mode: ReaderPool.endpoints) each micro-batch also names
    the holder of each item, as an index into the rank's `readers`: the endpoints it needs.

    The arrays of all ranks are packed at once (`stepwire.pack_step`); each rank's arrays frame
    is a view of that buffer. Keys, tokens and item headers are put in group order once, so a
    rank's lists are slices.
    """
    W, M = plan.topology.world_size, plan.num_microbatches
    packed = pack_step(plan)
    order = plan.sample_order.tolist()
    keys = [batch.keys[i] for i in order]
    tokens = [batch.tokens[i] for i in order]
    sample_ptr = plan.sample_ptr.tolist()
    heads, buffers, nbytes, holders, item_ptr = _items_by_group(batch, plan, W * M)
    out = []
    for rank in range(W):
        mbs, frames, table = [], [], {}
        for m in range(M):
            g = m * W + rank
            s0, s1 = sample_ptr[g], sample_ptr[g + 1]
            a, z = item_ptr[g], item_ptr[g + 1]
            mb = {"arrays": packed.lengths[g], "keys": keys[s0:s1], "tokens": tokens[s0:s1],
                  "items": heads[a:z], "payloads": z - a, "sizes": nbytes[a:z]}
            if endpoints is not None:
                mb[HOLDERS] = [table.setdefault(h, len(table)) for h in holders[a:z]]
            mbs.append(mb)
            frames.append(packed.frame(g))
            frames.append(b"".join(buffers[a:z]))
        direct = {} if endpoints is None else {"readers": [list(endpoints[h]) for h in table]}
        out.append(encode(STEP, seq=seq + rank, frames=frames, step=step, epoch=epoch, rank=rank,
                          world_size=W, microbatches=mbs, **direct))
    return out


def _items_by_group(batch: StepBatch, plan, num_groups: int) -> tuple[list, list, list, list,
                                                                       list[int]]:
    """(header, payload, size, holder) of every item in the order the STEP messages list them:
    by group g = mb * W + rank, then phase, then the phase's send order; and the CSR pointer
    over groups. The phases' columns are concatenated and gathered once in that order, so a
    group's items are one slice each."""
    columns, groups, ids, base = ([], [], [], []), [], [], 0
    for phase in ENCODER_PHASES:
        ex = plan._exchange(phase)
        groups.append(np.repeat(np.arange(num_groups), np.diff(ex.send_ptr)))
        ids.append(ex.send_order + base)
        for out, col in zip(columns, (batch.item_headers[phase], batch.item_payloads[phase],
                                      batch.item_sizes[phase], batch.item_holders[phase])):
            out.extend(col)
        base += len(batch.item_headers[phase])
    group = np.concatenate(groups)
    # stable: phases stay in order, each in its send order
    order = np.concatenate(ids)[np.argsort(group, kind="stable")].tolist()
    ptr = np.zeros(num_groups + 1, dtype=np.int64)
    np.cumsum(np.bincount(group, minlength=num_groups), out=ptr[1:])
    return (*([col[i] for i in order] for col in columns), ptr.tolist())


def rank_message(batch: StepBatch, plan, *, step: int, epoch: int, rank: int, seq: int) -> list:
    """One rank's STEP message (tests and tools; the dispatcher encodes whole steps at once)."""
    return step_messages(batch, plan, step=step, epoch=epoch, seq=seq - rank)[rank]
