"""Wire form of one rank's micro-batch: all `RankMicrobatch` arrays in one int64 frame.

One contiguous frame per micro-batch (lengths listed in the header) lets the trainer map it
with a single `np.frombuffer` / `torch.frombuffer` and slice views, instead of paying a frame
and an allocation per array; the price is one concatenation on the dispatcher.
"""

from __future__ import annotations

from operator import attrgetter

import numpy as np

from dispatcher_server.planner.types import ENCODER_PHASES, PhaseExchange, RankMicrobatch
from dispatcher_server.protocol import ProtocolError

SAMPLE_ARRAYS = ("samples", "sample_offsets", "sample_llm_len", "text_offsets", "text_len")
EXCHANGE_ARRAYS = ("encode_items", "encode_enc_len", "encode_llm_len", "send_tokens",
                   "recv_items", "recv_llm_len", "recv_offsets", "recv_tokens")
NUM_ARRAYS = len(SAMPLE_ARRAYS) + len(ENCODER_PHASES) * len(EXCHANGE_ARRAYS)
_EMPTY = np.zeros(0, dtype=np.int64)
_sample_arrays = attrgetter(*SAMPLE_ARRAYS)
_exchange_arrays = attrgetter(*EXCHANGE_ARRAYS)
_ABSENT = (_EMPTY,) * len(EXCHANGE_ARRAYS)


def pack_microbatch(rmb: RankMicrobatch) -> tuple[list[int], np.ndarray]:
    """(array lengths, one int64 buffer holding every array in the fixed order above)."""
    arrays = list(_sample_arrays(rmb))
    for phase in ENCODER_PHASES:
        ex = rmb.exchanges.get(phase)
        # An absent phase travels as all-empty arrays; a present one always has W-long tokens.
        arrays += _ABSENT if ex is None else _exchange_arrays(ex)
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


def unpack_microbatch(buffer, lengths: list[int], *, rank: int, microbatch: int) -> RankMicrobatch:
    """Rebuild the `RankMicrobatch` a dispatcher packed, as read-only views over `buffer`."""
    arrays = split_arrays(buffer, lengths)
    fields = dict(zip(SAMPLE_ARRAYS, arrays[: len(SAMPLE_ARRAYS)]))
    n = len(set(len(a) for a in fields.values()))
    if n > 1:
        raise ProtocolError("micro-batch sample arrays have different lengths")
    exchanges: dict[str, PhaseExchange] = {}
    at = len(SAMPLE_ARRAYS)
    for phase in ENCODER_PHASES:
        part = arrays[at: at + len(EXCHANGE_ARRAYS)]
        at += len(EXCHANGE_ARRAYS)
        if all(len(a) == 0 for a in part):
            continue
        exchanges[phase] = PhaseExchange(phase=phase, **dict(zip(EXCHANGE_ARRAYS, part)))
    return RankMicrobatch(rank=rank, microbatch=microbatch, exchanges=exchanges, **fields)
