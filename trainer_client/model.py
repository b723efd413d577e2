"""A small, CPU-friendly reference multimodal model and the glue that runs one micro-batch.

ViT-like vision encoder over patches (merge x merge patches -> 1 LLM token), audio encoder
over frames (adaptive pooling to the counted LLM length), projectors, and a decoder-only LLM
over packed variable-length sequences. Attention loops over the sequences of `cu_seqlens`
instead of building a block-diagonal mask: O(sum L^2) memory, exact per-sample isolation and
results independent of how samples were packed, which is what gradient-equality tests need.
Users replace it with anything satisfying `MultimodalModel`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dispatcher_server.planner.types import RankMicrobatch
from trainer_client.exchange import Exchanger, pack_llm_inputs, text_positions

#: Label value that the loss ignores (item embeddings, first token of a text-only sample).
IGNORE_INDEX = -100


class LLMOutput(NamedTuple):
    logits: Tensor  # [total_len, vocab]
    loss_sum: Tensor  # scalar: summed next-token cross-entropy over targets
    num_targets: int


@runtime_checkable
class MultimodalModel(Protocol):
    """What the trainer side needs from a model; all outputs are [tokens, hidden_size]."""

    hidden_size: int

    def encode_vision(self, items: Sequence[Tensor], llm_len: Sequence[int]) -> Tensor: ...

    def encode_audio(self, items: Sequence[Tensor], llm_len: Sequence[int]) -> Tensor: ...

    def embed_text(self, ids: Tensor) -> Tensor: ...

    def llm(self, packed: Tensor, cu_seqlens: Tensor, position_ids: Tensor, labels: Tensor | None = None) -> LLMOutput: ...


@dataclass(kw_only=True, slots=True)
class VisionConfig:
    patch_size: int  # pixels per patch side; a patch is 3 * temporal_patch * patch_size**2 values
    hidden: int
    num_layers: int = 1
    num_heads: int = 2
    merge: int = 2  # merge x merge patches become one LLM token
    temporal_patch: int = 1  # frames per patch (2 for Qwen2-VL inputs, `pipeline.preprocess`)

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch * self.patch_size**2


@dataclass(kw_only=True, slots=True)
class AudioConfig:
    frame_dim: int
    hidden: int
    num_layers: int = 1
    num_heads: int = 2


@dataclass(kw_only=True, slots=True)
class LLMConfig:
    vocab_size: int
    hidden: int
    num_layers: int = 2
    num_heads: int = 2
    mlp_ratio: int = 4
    rope_theta: float = 10000.0


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    vision: VisionConfig
    audio: AudioConfig
    llm: LLMConfig

    @staticmethod
    def tiny(*, patch_size: int = 4, frame_dim: int = 16, vocab_size: int = 97, hidden: int = 16,
             merge: int = 2, temporal_patch: int = 1) -> ModelConfig:
        """A few-thousand-parameter model for tests and the demo."""
        return ModelConfig(
            vision=VisionConfig(patch_size=patch_size, hidden=hidden, merge=merge, temporal_patch=temporal_patch),
            audio=AudioConfig(frame_dim=frame_dim, hidden=hidden),
            llm=LLMConfig(vocab_size=vocab_size, hidden=hidden),
        )


def _rope(x: Tensor, pos: Tensor, theta: float) -> Tensor:
    """Rotary position embedding on [T, heads, d] with integer positions [T]."""
    d = x.shape[-1]
    half = d // 2
    freq = theta ** (-torch.arange(half, dtype=x.dtype, device=x.device) / max(half, 1))
    ang = pos.to(x.dtype)[:, None] * freq[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    rot = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return torch.cat([rot, x[..., 2 * half :]], dim=-1)


class Block(nn.Module):
    """Pre-norm transformer block; attention restricted to each [cu[i], cu[i+1]) segment."""

    def __init__(self, hidden: int, num_heads: int, mlp_ratio: int = 4, rope_theta: float = 10000.0) -> None:
        super().__init__()
        if hidden % num_heads:
            raise ValueError(f"hidden={hidden} is not divisible by num_heads={num_heads}")
        self.num_heads, self.rope_theta = num_heads, rope_theta
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, mlp_ratio * hidden), nn.GELU(), nn.Linear(mlp_ratio * hidden, hidden))

    def forward(self, x: Tensor, cu: Sequence[int], pos: Tensor, causal: bool) -> Tensor:
        T, h = x.shape
        H = self.num_heads
        q, k, v = self.qkv(self.norm1(x)).view(T, 3, H, h // H).unbind(1)
        q, k = _rope(q, pos, self.rope_theta), _rope(k, pos, self.rope_theta)
        outs = []
        for a, b in zip(cu[:-1], cu[1:]):
            if b == a:
                continue
            qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))  # [H, L, d]
            # softmax(q k^T / sqrt(d)) v, causal for the LLM, in torch's fused kernel
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
            outs.append(out.transpose(0, 1).reshape(b - a, h))
        att = torch.cat(outs) if outs else x.new_zeros(0, h)
        x = x + self.proj(att)
        return x + self.mlp(self.norm2(x))


def _segments(lengths: Sequence[int]) -> tuple[list[int], Tensor]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + int(n))
    pos = torch.cat([torch.arange(int(n)) for n in lengths]) if lengths else torch.zeros(0, dtype=torch.long)
    return cu, pos


def _stack_items(items: Sequence[Tensor], dim: int, what: str, like: Tensor) -> Tensor:
    for i, t in enumerate(items):
        if t.dim() != 2 or t.shape[1] != dim:
            raise ValueError(f"{what} item {i} has shape {tuple(t.shape)}, expected [n, {dim}]")
    return torch.cat(list(items)).to(device=like.device, dtype=like.dtype) if items else like.new_zeros(0, dim)


class ReferenceModel(nn.Module):
    """The reference implementation of `MultimodalModel`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        v, a, l = config.vision, config.audio, config.llm
        self.hidden_size = l.hidden
        self.patch_embed = nn.Linear(v.patch_dim, v.hidden)
        self.vision_blocks = nn.ModuleList(Block(v.hidden, v.num_heads) for _ in range(v.num_layers))
        self.vision_proj = nn.Sequential(nn.Linear(v.merge**2 * v.hidden, l.hidden), nn.GELU(), nn.Linear(l.hidden, l.hidden))
        self.frame_embed = nn.Linear(a.frame_dim, a.hidden)
        self.audio_blocks = nn.ModuleList(Block(a.hidden, a.num_heads) for _ in range(a.num_layers))
        self.audio_proj = nn.Sequential(nn.Linear(a.hidden, l.hidden), nn.GELU(), nn.Linear(l.hidden, l.hidden))
        self.tok_embed = nn.Embedding(l.vocab_size, l.hidden)
        self.llm_blocks = nn.ModuleList(
            Block(l.hidden, l.num_heads, l.mlp_ratio, l.rope_theta) for _ in range(l.num_layers)
        )
        self.final_norm = nn.LayerNorm(l.hidden)
        self.lm_head = nn.Linear(l.hidden, l.vocab_size, bias=False)

    def encode_vision(self, items: Sequence[Tensor], llm_len: Sequence[int] | None = None) -> Tensor:
        """Patch features per image [enc_len, patch_dim] -> [sum(enc_len) / merge^2, hidden]."""
        m2 = self.config.vision.merge ** 2
        lens = [int(t.shape[0]) for t in items]
        for i, n in enumerate(lens):
            if n % m2:
                raise ValueError(f"vision item {i} has {n} patches, not a multiple of merge^2={m2}")
            if llm_len is not None and n // m2 != int(llm_len[i]):
                raise ValueError(f"vision item {i}: {n} patches give {n // m2} tokens but llm_len={int(llm_len[i])}")
        x = self.patch_embed(_stack_items(items, self.config.vision.patch_dim, "vision", self.patch_embed.weight))
        cu, pos = _segments(lens)
        for blk in self.vision_blocks:
            x = blk(x, cu, pos.to(x.device), causal=False)
        # consecutive merge^2 patches of an item form one token (pipeline.preprocess.patchify's order)
        return self.vision_proj(x.reshape(-1, m2 * x.shape[1]))

    def encode_audio(self, items: Sequence[Tensor], llm_len: Sequence[int]) -> Tensor:
        """Frame features per clip [enc_len, frame_dim] -> [sum(llm_len), hidden] by average pooling."""
        if len(llm_len) != len(items):
            raise ValueError(f"{len(items)} audio items but {len(llm_len)} llm lengths")
        lens = [int(t.shape[0]) for t in items]
        for i, (n, k) in enumerate(zip(lens, llm_len)):
            if n == 0 and int(k) > 0:
                raise ValueError(f"audio item {i} has 0 frames but llm_len={int(k)}")
        x = self.frame_embed(_stack_items(items, self.config.audio.frame_dim, "audio", self.frame_embed.weight))
        cu, pos = _segments(lens)
        for blk in self.audio_blocks:
            x = blk(x, cu, pos.to(x.device), causal=False)
        pooled = [
            F.adaptive_avg_pool1d(x[a:b].T[None], int(k))[0].T
            for a, b, k in zip(cu[:-1], cu[1:], llm_len)
            if int(k) > 0
        ]
        # x[:0], not a new tensor, where no clip has a token: the blocks stay in the output's
        # graph, so their backward (FSDP's all-gather and reduce-scatter) runs on every rank
        x = torch.cat(pooled) if pooled else x[:0]
        return self.audio_proj(x)

    def embed_text(self, ids: Tensor) -> Tensor:
        return self.tok_embed(ids)

    def llm(self, packed: Tensor, cu_seqlens: Tensor, position_ids: Tensor, labels: Tensor | None = None) -> LLMOutput:
        cu = [int(c) for c in cu_seqlens.tolist()]
        if not cu or cu[0] != 0 or cu[-1] != packed.shape[0]:
            raise ValueError(f"cu_seqlens {cu} do not cover the packed length {packed.shape[0]}")
        x = packed
        for blk in self.llm_blocks:
            x = blk(x, cu, position_ids, causal=True)
        logits = self.lm_head(self.final_norm(x))
        if labels is None:
            return LLMOutput(logits, logits.new_zeros(()), 0)
        # sum, not mean: ranks and micro-batches add up to the global batch's loss exactly
        loss = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
        return LLMOutput(logits, loss, int((labels != IGNORE_INDEX).sum()))


def packed_labels(rank_mb: RankMicrobatch, text_ids: Sequence[Tensor] | Tensor,
                  loss_mask: Sequence[Tensor] | Tensor | None = None) -> Tensor:
    """Next-token targets of a packed micro-batch: position p predicts the text token at p+1.

    A text token is predicted from the position before it, an item's last embedding where an
    item precedes it; a token at its sample's first position is predicted by nothing. A token
    whose `loss_mask` is 0 (a conversation's non-assistant tokens) is no target either
    (label IGNORE_INDEX); no mask means every text token is a target.
    """
    ids = _flat(text_ids).long()
    if ids.shape[0] != int(np.sum(rank_mb.text_len)):
        raise ValueError(f"{ids.shape[0]} text ids given but the plan has {int(np.sum(rank_mb.text_len))} text tokens")
    if loss_mask is not None:
        mask = _flat(loss_mask).bool()
        if mask.shape != ids.shape:
            raise ValueError(f"loss mask of {mask.shape[0]} tokens for {ids.shape[0]} text ids")
        ids = ids.masked_fill(~mask, IGNORE_INDEX)
    labels = torch.full((rank_mb.total_len,), IGNORE_INDEX, dtype=torch.long)
    where = text_positions(rank_mb)
    # a token at its sample's first position (text-only, or text before any item) has no predictor
    starts = np.repeat(np.asarray(rank_mb.sample_offsets, dtype=np.int64),
                       np.asarray(rank_mb.text_len, dtype=np.int64))
    keep = where > starts
    labels[torch.as_tensor(where[keep] - 1)] = ids[torch.as_tensor(keep)]
    return labels


def _flat(parts: Sequence[Tensor] | Tensor) -> Tensor:
    return parts if isinstance(parts, Tensor) else torch.cat([*parts, torch.zeros(0, dtype=torch.long)])


def forward_microbatch(
    model: MultimodalModel,
    rank_mb: RankMicrobatch,
    *,
    item_input: Callable[[str, int], Tensor],
    text_ids: Callable[[int], Tensor],
    exchanger: Exchanger,
    loss_mask: Callable[[int], Tensor] | None = None,
    item_name: Callable[[str, int], str] | None = None,
) -> LLMOutput:
    """Encode this rank's items, exchange them to their LLM ranks, pack, run the LLM.

    `item_input(phase, item_id)` gives an item's encoder input, `text_ids(sample_id)` a
    sample's token ids and `loss_mask(sample_id)` (optional: all targets) which of them are
    targets. Every item input must have exactly the planned encoder length of rows (ValueError
    naming the item by `item_name(phase, item_id)`, e.g. its sample key, otherwise). Every rank
    of the world must call this for the same micro-batch. An encoder output without grad (a
    `torch.zeros(0, H)` for no items, a frozen encoder) still takes part in the backward.
    """
    enc = _with_grad(_encode(model, rank_mb, item_input, _untimed, item_name))
    exchanged = exchanger.exchange_phases(enc, rank_mb.exchanges) if enc else {}
    return _llm(model, rank_mb, text_ids, loss_mask, exchanged)


def _with_grad(enc: dict[str, Tensor]) -> dict[str, Tensor]:
    """Encoder outputs that all require grad while grad is enabled. The exchange's backward is a
    collective: a rank whose output has no grad (no item of a phase here, returned as a bare
    `torch.zeros(0, H)`; a frozen encoder) would sit it out while its peers wait, so the
    exchange refuses it on every rank. A leaf copy takes part, as train_microbatch's cut
    copies do; its gradient goes nowhere."""
    if not torch.is_grad_enabled():
        return enc
    return {p: t if t.requires_grad else t.detach().requires_grad_() for p, t in enc.items()}


def check_item_lengths(phase: str, items: Sequence[Tensor], item_ids, enc_len, item_name=None) -> None:
    """The model boundary: every item input has exactly its planned encoder length of rows.

    ValueError naming the item (`item_name(phase, item_id)`, e.g. its sample key and member)
    otherwise: the data node counted one length and the model would attend over another.
    """
    for t, i, n in zip(items, item_ids, enc_len):
        if t.dim() < 1 or t.shape[0] != int(n):
            name = item_name(phase, int(i)) if item_name is not None else f"{phase} item {int(i)}"
            raise ValueError(f"{name}: {phase} input has shape {tuple(t.shape)} but the plan "
                             f"counted enc_len={int(n)} rows")


def _encode(model: MultimodalModel, rank_mb: RankMicrobatch, item_input, span,
            item_name=None) -> dict[str, Tensor]:
    """Every encoder phase's outputs for this rank's items, each phase inside `span(phase)`."""
    encoders = {"vision": model.encode_vision, "audio": model.encode_audio}
    enc: dict[str, Tensor] = {}
    for phase, px in rank_mb.exchanges.items():
        if phase not in encoders:
            raise ValueError(f"no encoder for phase {phase!r}")
        with span(phase):
            items = [item_input(phase, int(i)) for i in px.encode_items]
            check_item_lengths(phase, items, px.encode_items, px.encode_enc_len, item_name)
            enc[phase] = encoders[phase](items, [int(n) for n in px.encode_llm_len])
    return enc


def _llm(model: MultimodalModel, rank_mb: RankMicrobatch, text_ids, loss_mask, exchanged) -> LLMOutput:
    """Text embeddings and exchanged item embeddings packed, through the LLM."""
    flat = _flat([text_ids(int(s)) for s in rank_mb.samples]).long()
    mask = None if loss_mask is None else _flat([loss_mask(int(s)) for s in rank_mb.samples])
    packed, cu, pos = pack_llm_inputs(rank_mb, model.embed_text(flat), exchanged)
    return model.llm(packed, cu, pos, packed_labels(rank_mb, flat, mask).to(packed.device))


def train_microbatch(
    model: MultimodalModel,
    rank_mb: RankMicrobatch,
    *,
    item_input: Callable[[str, int], Tensor],
    text_ids: Callable[[int], Tensor],
    exchanger: Exchanger,
    loss_mask: Callable[[int], Tensor] | None = None,
    loss_scale: float = 1.0,
    timer=None,
    item_name: Callable[[str, int], str] | None = None,
) -> LLMOutput:
    """`forward_microbatch`, then the backward of `loss_sum * loss_scale`, stage by stage.

    The graph is cut at the encoder outputs and at the exchanged embeddings, and each stage's
    backward runs alone with the gradient the stage after it sent back, so `timer` (a
    `calibrate.PhaseTimer`, optional) times every phase's forward plus backward apart, and the
    exchange (both directions) apart from them. The gradients are those of one backward
    through the whole graph. Every rank of the world must call this for the same micro-batch.
    """
    span = timer.span if timer is not None else _untimed
    enc = _encode(model, rank_mb, item_input, span, item_name)
    # Cut copies always require grad, so the exchange's backward (a collective) runs on every
    # rank, also where an encoder's output does not (no item on this rank).
    enc_cut = {p: t.detach().requires_grad_() for p, t in enc.items()}
    exchanged: dict[str, Tensor] = {}
    if enc:
        with span("exchange"):
            exchanged = exchanger.exchange_phases(enc_cut, rank_mb.exchanges)
    ex_cut = {p: t.detach().requires_grad_() for p, t in exchanged.items()}
    with span("llm"):
        out = _llm(model, rank_mb, text_ids, loss_mask, ex_cut)
        (out.loss_sum * loss_scale).backward()
    _backward_stage(span, "exchange", exchanged, ex_cut)
    for phase in enc:
        _backward_stage(span, phase, {phase: enc[phase]}, enc_cut)
    return LLMOutput(out.logits.detach(), out.loss_sum.detach(), out.num_targets)


@contextmanager
def _untimed(name: str):
    yield


def _backward_stage(span, name: str, outputs: dict[str, Tensor], cut: dict[str, Tensor]) -> None:
    """Backward through `outputs` with the gradients their cut copies received (zeros where a
    cut copy got none: a stage with a collective inside runs on every rank all the same)."""
    roots = [(outputs[p], cut[p]) for p in outputs if outputs[p].requires_grad]
    if not roots:
        return
    with span(name):
        torch.autograd.backward([t for t, _ in roots],
                                [c.grad if c.grad is not None else torch.zeros_like(c)
                                 for _, c in roots])


def microbatch_timings(rank_mb: RankMicrobatch, seconds: dict[str, float]) -> dict:
    """The `report_timings` record of one micro-batch: per phase [seconds, sequence lengths]."""
    out = {"exchange": seconds.get("exchange", 0.0),
           "llm": [seconds.get("llm", 0.0), [int(n) for n in rank_mb.sample_llm_len]]}
    for phase, px in rank_mb.exchanges.items():
        out[phase] = [seconds.get(phase, 0.0), [int(n) for n in px.encode_enc_len]]
    return out


# ------------------------------------------------------------------ encoder inputs from items
def _seed(*parts: object) -> int:
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def synthetic_features(seed: int, phase: str, item: int, rows: int, dim: int, dtype=torch.float32) -> Tensor:
    """Deterministic N(0,1) encoder input for (seed, phase, item): same on every rank and run."""
    gen = torch.Generator().manual_seed(_seed(seed, phase, item))
    return torch.randn(rows, dim, generator=gen, dtype=torch.float64).to(dtype)


def synthetic_text_ids(seed: int, sample: int, text_len: int, vocab_size: int) -> Tensor:
    gen = torch.Generator().manual_seed(_seed(seed, "text", sample))
    return torch.randint(0, vocab_size, (text_len,), generator=gen)


