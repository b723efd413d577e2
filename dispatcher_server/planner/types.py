"""Data types of the planner contract: what a step looks like going in and coming out.

Everything is flat numpy arrays indexed by sample id (0..S-1 within the step) or item id
(0..N-1 within one encoder phase), so plans for 2560 ranks stay cheap to build, slice and ship.
Layout of one sample's LLM sequence (fixed convention, relied on by the trainer): its items
ordered by (anchor, phase, item id), each after `anchor` of the sample's text tokens, and its
text tokens in order at the positions the items leave. With no anchors (the default): its vision
items in item order, then its audio items in item order, then its text tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

#: Encoder phases, in the order they run inside a micro-batch; the LLM phase runs last.
ENCODER_PHASES: tuple[str, ...] = ("vision", "audio")
LLM_PHASE = "llm"
PHASES: tuple[str, ...] = (*ENCODER_PHASES, LLM_PHASE)

#: Exchange locality classes, in increasing cost.
LOCALITIES: tuple[str, ...] = ("same_rank", "intra_node", "inter_node")


class PlanError(ValueError):
    """A step cannot be planned as configured, or a plan violates its post-conditions.
    `sample`: the index into the step of a sample that fits no capacity, where that is why (a
    service names it by key and by its own settings, not by this message's PlannerConfig terms)."""

    def __init__(self, message: str, sample: int | None = None) -> None:
        super().__init__(message)
        self.sample = sample


class OversizeWarning(UserWarning):
    """`oversize="isolate"` planned a step in more micro-batches than configured: `samples`
    (indices into the step) fit no capacity and run alone, or none did and the step did not
    pack in M (empty)."""

    def __init__(self, message: str, samples: list[int] | None = None,
                 reason: str | None = None) -> None:
        super().__init__(message)
        self.samples = list(samples or [])
        self.reason = reason  # why the step did not pack in fewer micro-batches (a retry's)


@dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    """Data-parallel layout: `world_size` ranks, `ranks_per_node` consecutive ranks per node."""

    world_size: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise ValueError(
                f"ranks_per_node={self.ranks_per_node} must divide world_size={self.world_size}"
            )

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_of(self, rank):
        """Node index of a rank (works elementwise on arrays)."""
        return rank // self.ranks_per_node


@dataclass(frozen=True, slots=True, kw_only=True)
class EncoderItems:
    """The items of one encoder phase in a step (images for vision, clips for audio).

    Item ids are positions in these arrays. Items of one sample appear in sample order.
    `anchor` places items among their sample's text: the position its placeholder held in the
    sample's text ids, placeholders counted (`protocol.ANCHOR`); -1, or None for all, puts an
    item before the text.
    """

    enc_len: np.ndarray  # int64[N]: sequence length the encoder attends over
    llm_len: np.ndarray  # int64[N]: embeddings the item becomes in the LLM sequence
    sample: np.ndarray  # int64[N]: owning sample id
    anchor: np.ndarray | None = None  # int64[N]: its placeholder's position; -1: before the text

    @property
    def anchored(self) -> bool:
        """Whether some item stands at a placeholder (else the default layout)."""
        return self.anchor is not None and bool((self.anchor >= 0).any())

    @staticmethod
    def empty() -> EncoderItems:
        z = np.zeros(0, dtype=np.int64)
        return EncoderItems(enc_len=z, llm_len=z, sample=z)

    def __len__(self) -> int:
        return int(self.enc_len.shape[0])


@dataclass(frozen=True, slots=True, kw_only=True)
class StepInputs:
    """One step's global batch as arrays. `llm_len[s] = text_len[s] + sum of its items' llm_len`."""

    text_len: np.ndarray  # int64[S]
    llm_len: np.ndarray  # int64[S]
    encoders: dict[str, EncoderItems] = field(default_factory=dict)  # keyed by ENCODER_PHASES

    @property
    def num_samples(self) -> int:
        return int(self.llm_len.shape[0])

    def items(self, phase: str) -> EncoderItems:
        return self.encoders.get(phase) or EncoderItems.empty()


@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseExchange:
    """One rank's part of one encoder phase's encoder->LLM exchange in one micro-batch.

    The rank encodes `encode_items` in that order, which is grouped by destination rank
    (ascending), so its concatenated encoder outputs are already the send buffer of an
    `all_to_all_single` with `send_tokens` as split sizes. It receives `recv_items` grouped by
    source rank (ascending, each source in its own send order) and writes each received item's
    `recv_llm_len` embeddings at `recv_offsets` in its packed LLM sequence.
    """

    phase: str
    encode_items: np.ndarray  # int64[n]: item ids encoded here, in send order
    encode_enc_len: np.ndarray  # int64[n]
    encode_llm_len: np.ndarray  # int64[n]
    send_tokens: np.ndarray  # int64[W]: embeddings sent to each rank (same rank included)
    recv_items: np.ndarray  # int64[k]
    recv_llm_len: np.ndarray  # int64[k]
    recv_offsets: np.ndarray  # int64[k]: offset in this rank's packed LLM sequence
    recv_tokens: np.ndarray  # int64[W]: embeddings received from each rank


@dataclass(frozen=True, slots=True, kw_only=True)
class RankMicrobatch:
    """Everything one rank needs for one micro-batch, and nothing about other ranks' work."""

    rank: int
    microbatch: int
    samples: np.ndarray  # int64[s]: LLM sample ids in packing order
    sample_offsets: np.ndarray  # int64[s]: start of each sample in the packed LLM sequence
    sample_llm_len: np.ndarray  # int64[s]
    text_offsets: np.ndarray  # int64[s]: where each sample's first text token stands
    text_len: np.ndarray  # int64[s]
    exchanges: dict[str, PhaseExchange]  # keyed by ENCODER_PHASES

    @property
    def total_len(self) -> int:
        return int(self.sample_llm_len.sum())

    @property
    def cu_seqlens(self) -> np.ndarray:
        return np.concatenate(([0], np.cumsum(self.sample_llm_len))).astype(np.int64)


@dataclass(frozen=True, slots=True, kw_only=True)
class ExchangeTable:
    """Sparse encoder->LLM traffic of one phase in one micro-batch: only pairs that exchange."""

    src: np.ndarray  # int64[P]
    dst: np.ndarray  # int64[P]
    items: np.ndarray  # int64[P]
    tokens: np.ndarray  # int64[P]
    bytes: np.ndarray  # int64[P]
    locality: np.ndarray  # int8[P]: index into LOCALITIES

    def for_rank(self, rank: int) -> tuple[ExchangeTable, ExchangeTable]:
        """(what `rank` sends, what `rank` receives), as tables."""
        return self._select(self.src == rank), self._select(self.dst == rank)

    def _select(self, mask: np.ndarray) -> ExchangeTable:
        return ExchangeTable(
            src=self.src[mask], dst=self.dst[mask], items=self.items[mask],
            tokens=self.tokens[mask], bytes=self.bytes[mask], locality=self.locality[mask],
        )

    def bytes_by_locality(self) -> dict[str, int]:
        sums = np.bincount(self.locality.astype(np.int64), weights=self.bytes, minlength=3)
        return {name: int(sums[i]) for i, name in enumerate(LOCALITIES)}
