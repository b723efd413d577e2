"""From received samples to one step: planner inputs, and the per-rank STEP messages.

A step's samples keep their payloads as views of the frames that arrived from readers; each
rank's message carries only the items that rank encodes, coalesced per micro-batch into one
frame (one memcpy, instead of a zmq frame per item), so no rank receives the whole batch. The
cost is holding the received frames until every rank has acknowledged the step.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from dispatcher_server.planner.types import ENCODER_PHASES, EncoderItems, StepInputs
from dispatcher_server.protocol import SAMPLE_FIELDS, STEP, encode
from dispatcher_server.stepwire import pack_microbatch

_PHASE_OF = {"image": "vision", "audio": "audio"}


@dataclass(slots=True)
class Sample:
    """A sample held by the dispatcher: header fields plus its items' payload frames."""

    key: str
    pos: int  # global shard position it came from
    index: int  # raw index in its shard
    text_len: int
    llm_len: int
    text: bytes
    items: list  # [modality, member, enc_len, llm_len, meta] per item
    payloads: list  # one buffer per item
    nbytes: int

    @staticmethod
    def from_wire(header: list, pos: int, payloads: list) -> Sample:
        f = dict(zip(SAMPLE_FIELDS, header))
        nbytes = len(f["text"]) + sum(p.nbytes for p in payloads)
        return Sample(key=f["key"], pos=pos, index=f["index"], text_len=f["text_len"],
                      llm_len=f["llm_len"], text=f["text"], items=f["items"],
                      payloads=payloads, nbytes=nbytes)


def sample_problem(s: Sample) -> str | None:
    """Why a received sample cannot be planned (a reader bug or a hostile peer), or None."""
    if s.text_len < 0 or any(it[0] not in _PHASE_OF or it[2] < 0 or it[3] < 0 for it in s.items):
        return "invalid_header"
    if s.llm_len != s.text_len + sum(it[3] for it in s.items):
        return "invalid_llm_len"
    return None


def phase_of(modality: str) -> str:
    phase = _PHASE_OF.get(modality)
    if phase is None:
        raise ValueError(f"unknown item modality {modality!r}")
    return phase


@dataclass(slots=True)
class StepBatch:
    """The samples of one step, the planner inputs built from them, and item -> sample refs."""

    samples: list[Sample]
    inputs: StepInputs
    item_refs: dict[str, list[tuple[int, int]]]  # phase -> (sample id, item index) per item id

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.samples)

    def digest(self) -> str:
        h = hashlib.blake2b(digest_size=16)
        for s in self.samples:
            h.update(s.key.encode())
            h.update(b"\0")
        return h.hexdigest()


def build_batch(samples: list[Sample]) -> StepBatch:
    """Planner inputs: per sample text/LLM length, per encoder phase its items in sample order."""
    refs: dict[str, list[tuple[int, int]]] = {p: [] for p in ENCODER_PHASES}
    cols: dict[str, tuple[list, list, list]] = {p: ([], [], []) for p in ENCODER_PHASES}
    for si, s in enumerate(samples):
        for ii, it in enumerate(s.items):
            phase = phase_of(it[0])
            refs[phase].append((si, ii))
            enc, llm, owner = cols[phase]
            enc.append(it[2])
            llm.append(it[3])
            owner.append(si)
    encoders = {p: EncoderItems(enc_len=np.asarray(c[0], dtype=np.int64),
                                llm_len=np.asarray(c[1], dtype=np.int64),
                                sample=np.asarray(c[2], dtype=np.int64))
                for p, c in cols.items() if c[0]}
    inputs = StepInputs(
        text_len=np.asarray([s.text_len for s in samples], dtype=np.int64),
        llm_len=np.asarray([s.llm_len for s in samples], dtype=np.int64),
        encoders=encoders,
    )
    return StepBatch(samples=samples, inputs=inputs, item_refs=refs)


def rank_message(batch: StepBatch, plan, *, step: int, epoch: int, rank: int, seq: int) -> list:
    """The STEP message for one rank: exactly `plan.num_microbatches` micro-batches, only its part."""
    mbs, frames = [], []
    samples = batch.samples
    for m in range(plan.num_microbatches):
        rmb = plan.rank_microbatch(rank, m)
        lengths, arrays = pack_microbatch(rmb)
        items, payloads = [], []
        for phase in ENCODER_PHASES:
            ex = rmb.exchanges.get(phase)
            if ex is None:
                continue
            refs = batch.item_refs[phase]
            for item_id in ex.encode_items.tolist():
                si, ii = refs[item_id]
                s = samples[si]
                it = s.items[ii]
                items.append([it[0], s.key, it[1], it[4]])
                payloads.append(s.payloads[ii])
        ids = rmb.samples.tolist()
        mbs.append({"arrays": lengths, "keys": [samples[i].key for i in ids],
                    "texts": [samples[i].text for i in ids], "items": items,
                    "payloads": len(payloads), "sizes": [memoryview(p).nbytes for p in payloads]})
        frames.append(arrays)
        frames.append(b"".join(payloads))
    return encode(STEP, seq=seq, frames=frames, step=step, epoch=epoch, rank=rank,
                  world_size=plan.topology.world_size, microbatches=mbs)
