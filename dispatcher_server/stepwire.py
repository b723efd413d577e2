"""Wire form of one rank's micro-batch: all `RankMicrobatch` arrays in one int64 frame.

One contiguous frame per micro-batch (lengths listed in the header) lets the trainer map it
with a single `np.frombuffer` / `torch.frombuffer` and slice views, instead of paying a frame
and an allocation per array; the price is one concatenation on the dispatcher. The exchange's
per-peer token counts travel sparse, as (peer, tokens) pairs of the peers actually exchanged
with: dense they are W long per rank, so a step's messages would grow with W squared (420 MB a
step at 2,560 ranks); the trainer rebuilds the dense split sizes it hands to all-to-all.
"""

from __future__ import annotations

from operator import attrgetter

import numpy as np

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
_sample_arrays = attrgetter(*SAMPLE_ARRAYS)
_item_arrays = attrgetter(*ITEM_ARRAYS)
_ABSENT = (_EMPTY,) * len(WIRE_EXCHANGE_ARRAYS)


def _pairs(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    peers = np.flatnonzero(tokens)
    return peers, tokens[peers]


def pack_microbatch(rmb: RankMicrobatch) -> tuple[list[int], np.ndarray]:
    """(array lengths, one int64 buffer holding every array in the fixed order above)."""
    arrays = list(_sample_arrays(rmb))
    for phase in ENCODER_PHASES:
        ex = rmb.exchanges.get(phase)
        if ex is None:
            arrays += _ABSENT  # an absent phase travels as all-empty arrays
            continue
        arrays.append(np.array([len(ex.send_tokens)]))
        arrays += _item_arrays(ex)
        arrays += _pairs(ex.send_tokens)
        arrays += _pairs(ex.recv_tokens)
    # axis=None ravels every array; unsafe casting converts as np.asarray(a, dtype=int64) does.
    return ([a.size for a in arrays],
            np.concatenate(arrays, axis=None, dtype=np.int64, casting="unsafe"))


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
