"""Wire form of one rank's micro-batch: all `RankMicrobatch` arrays in one int64 frame.

One contiguous frame per micro-batch (lengths listed in the header) lets the trainer map it
with a single `np.frombuffer` / `torch.frombuffer` and slice views, instead of paying a frame
and an allocation per array; the dispatcher builds every rank's frame of a step in one buffer
with whole-array operations over the plan's group-ordered arrays (it reads the plan's exchange
layout, `StepPlan._exchange`, the one place outside the plan that does). The exchange's
per-peer token counts travel sparse, as (peer, tokens) pairs of the peers actually exchanged
with: dense they are W long per rank, so a step's messages would grow with W squared (420 MB a
step at 2,560 ranks); the trainer rebuilds the dense split sizes it hands to all-to-all.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dispatcher_server.planner.plan import StepPlan
from dispatcher_server.planner.types import ENCODER_PHASES, PhaseExchange, RankMicrobatch
from dispatcher_server.protocol import ProtocolError

SAMPLE_ARRAYS = ("samples", "sample_offsets", "sample_llm_len", "text_offsets", "text_len")
#: Per encoder phase on the wire: [W] (present, even with nothing to send or receive: every
#: rank joins the phase's all-to-all), the item arrays, then the sparse peer tables.
ITEM_ARRAYS = ("encode_items", "encode_enc_len", "encode_llm_len", "recv_items", "recv_llm_len",
               "recv_offsets")
PEER_ARRAYS = ("send_peers", "send_peer_tokens", "recv_peers", "recv_peer_tokens")
WIRE_EXCHANGE_ARRAYS = ("world",) + ITEM_ARRAYS + PEER_ARRAYS
NUM_ARRAYS = len(SAMPLE_ARRAYS) + len(ENCODER_PHASES) * len(WIRE_EXCHANGE_ARRAYS)
_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass(slots=True)
class PackedStep:
    """Every (rank, micro-batch)'s arrays of one step in one int64 buffer, rank by rank: group
    g = mb*W + rank is `buffer[starts[g]:stops[g]]`, holding `lengths[g]` (the header's
    `arrays`), and a rank's M groups lie one after another, micro-batch 0 first (`rank_frame`):
    its STEP's data frame starts with them in one piece."""

    buffer: np.ndarray
    starts: list[int]
    stops: list[int]
    lengths: list[list[int]]
    rank_starts: list[int]  # rank r's groups: buffer[rank_starts[r]:rank_starts[r + 1]]

    def frame(self, group: int) -> np.ndarray:
        return self.buffer[self.starts[group]:self.stops[group]]

    def rank_frame(self, rank: int) -> np.ndarray:
        return self.buffer[self.rank_starts[rank]:self.rank_starts[rank + 1]]


def rank_major(world_size: int, num_microbatches: int) -> np.ndarray:
    """The group g = mb*W + rank at each rank-major position p = rank*M + mb."""
    p = np.arange(world_size * num_microbatches)
    return (p % num_microbatches) * world_size + p // num_microbatches


def pack_step(plan: StepPlan) -> PackedStep:
    """All groups' wire arrays at once, from the plan's group-ordered arrays (CSR slices).

    Whole-array work (one scatter per wire array) instead of a slice, a concatenation and a
    dense W-long table per rank: at thousands of ranks the per-rank Python work was most of
    the dispatcher's time per step. The result equals packing `plan.rank_microbatch(r, m)`
    group by group (tested).
    """
    W, M = plan.topology.world_size, plan.num_microbatches
    columns = _columns(plan, W * M)
    counts = np.stack([np.diff(ptr) for _, ptr in columns])  # [arrays, groups]
    sizes = counts.sum(axis=0)
    group_at = rank_major(W, M)
    ends = np.zeros(W * M + 1, dtype=np.int64)  # rank-major
    np.cumsum(sizes[group_at], out=ends[1:])
    starts = np.empty(W * M, dtype=np.int64)
    starts[group_at] = ends[:-1]
    at = starts + (np.cumsum(counts, axis=0) - counts)  # where each array starts
    buffer = np.empty(int(ends[-1]), dtype=np.int64)
    for k, (values, ptr) in enumerate(columns):
        if len(values):
            buffer[np.repeat(at[k] - ptr[:-1], counts[k]) + np.arange(len(values))] = values
    return PackedStep(buffer=buffer, starts=starts.tolist(), stops=(starts + sizes).tolist(),
                      lengths=counts.T.tolist(), rank_starts=ends[::M].tolist())


def _columns(plan: StepPlan, num_groups: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(values in group order, CSR pointer over groups) of every wire array, in wire order."""
    order, ptr = plan.sample_order, plan.sample_ptr
    columns = [(order, ptr), (plan.sample_offset[order], ptr), (plan.inputs.llm_len[order], ptr),
               (plan.text_offset[order], ptr), (plan.inputs.text_len[order], ptr)]
    one_each = np.arange(num_groups + 1)
    for phase in ENCODER_PHASES:
        ex = plan._exchange(phase)
        sent, got = ex.pair_tokens > 0, ex.pair_tokens_by_dst > 0
        send_ptr, recv_ptr = _kept(ex.pair_src_ptr, sent), _kept(ex.pair_dst_ptr, got)
        columns += [
            (np.full(num_groups, plan.topology.world_size), one_each),
            (ex.send_order, ex.send_ptr), (ex.send_enc_len, ex.send_ptr),
            (ex.send_llm_len, ex.send_ptr), (ex.recv_order, ex.recv_ptr),
            (ex.recv_llm_len, ex.recv_ptr), (ex.recv_offsets, ex.recv_ptr),
            (ex.pair_dst[sent], send_ptr), (ex.pair_tokens[sent], send_ptr),
            (ex.pair_src_by_dst[got], recv_ptr), (ex.pair_tokens_by_dst[got], recv_ptr),
        ]
    return columns


def _kept(ptr: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """The CSR pointer of the elements `keep` selects (pairs of zero tokens are not sent)."""
    before = np.zeros(len(keep) + 1, dtype=np.int64)
    np.cumsum(keep, out=before[1:])
    return before[ptr]


def split_arrays(buffer, lengths: list[int]) -> list[np.ndarray]:
    """Views into `buffer` (no copies), one per length; ProtocolError if the sizes disagree."""
    if len(lengths) != NUM_ARRAYS:
        raise ProtocolError(f"micro-batch has {len(lengths)} arrays, expected {NUM_ARRAYS}")
    flat = np.frombuffer(buffer, dtype=np.uint8)
    if flat.nbytes != 8 * sum(lengths):
        raise ProtocolError(f"arrays frame of {flat.nbytes} bytes, lengths say {8 * sum(lengths)}")
    flat = flat.view(np.int64) if flat.nbytes else _EMPTY
    bounds = np.cumsum([0, *lengths])
    return [flat[bounds[i]:bounds[i + 1]] for i in range(len(lengths))]


def _dense(peers: np.ndarray, tokens: np.ndarray, world_size: int) -> np.ndarray:
    if len(peers) != len(tokens) or (len(peers) and (peers.min() < 0 or peers.max() >= world_size)):
        raise ProtocolError(f"exchange peers outside [0, {world_size}) or unpaired")
    out = np.zeros(world_size, dtype=np.int64)
    out[peers] = tokens
    return out


def unpack_microbatch(buffer, lengths: list[int], *, rank: int, microbatch: int,
                      world_size: int) -> RankMicrobatch:
    """Rebuild the `RankMicrobatch` a dispatcher packed: views over `buffer`, except the dense
    per-peer token counts (W long), rebuilt from their sparse pairs."""
    arrays = split_arrays(buffer, lengths)
    fields = dict(zip(SAMPLE_ARRAYS, arrays[: len(SAMPLE_ARRAYS)]))
    n = len(set(len(a) for a in fields.values()))
    if n > 1:
        raise ProtocolError("micro-batch sample arrays have different lengths")
    exchanges: dict[str, PhaseExchange] = {}
    at = len(SAMPLE_ARRAYS)
    for phase in ENCODER_PHASES:
        part = arrays[at: at + len(WIRE_EXCHANGE_ARRAYS)]
        at += len(WIRE_EXCHANGE_ARRAYS)
        if all(len(a) == 0 for a in part):
            continue
        wire = dict(zip(WIRE_EXCHANGE_ARRAYS, part))
        if wire["world"].tolist() != [world_size]:
            raise ProtocolError(f"{phase} exchange planned for world {wire['world'].tolist()}, "
                                f"not {world_size}")
        exchanges[phase] = PhaseExchange(
            phase=phase, **{k: wire[k] for k in ITEM_ARRAYS},
            send_tokens=_dense(wire["send_peers"], wire["send_peer_tokens"], world_size),
            recv_tokens=_dense(wire["recv_peers"], wire["recv_peer_tokens"], world_size))
    return RankMicrobatch(rank=rank, microbatch=microbatch, exchanges=exchanges, **fields)
