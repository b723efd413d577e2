"""Move encoder outputs to the ranks that run their samples' LLM sequences, and pack them.

The planner already ordered every rank's encoder items by destination, so the exchange is
one `all_to_all_single` with uneven splits (gloo and NCCL alike), its backward the transposed
one. Same-rank rows are copied locally and never sent. The optional two-stage mode (intra-node
aggregation, then inter-node) trades extra intra-node copies for fewer, larger inter-node
messages. Plans are checked before the data collective: locally always, and by default also
with a tiny metadata collective, so a plan that disagrees across ranks raises on every rank
instead of hanging or silently scrambling embeddings.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist

from dispatcher_server.planner.types import ENCODER_PHASES, LOCALITIES, PhaseExchange, RankMicrobatch
from trainer_client.dist import SAME_RANK, NodeGroups, RankContext, node_groups

__all__ = [
    "ExchangeConfig",
    "ExchangeStats",
    "Exchanger",
    "exchange_embeddings",
    "pack_llm_inputs",
    "text_positions",
]


@dataclass(kw_only=True, slots=True)
class ExchangeConfig:
    """How embeddings travel.

    mode: "single" (one all_to_all over the world) or "two_stage" (intra-node, then inter-node
    between ranks of the same local rank). Both give bit-identical results.
    validate: "collective" checks the phases exchanged (their names), split sizes, row width,
    dtype size and requires_grad against every peer with small metadata collectives (all_gather,
    all_to_all, all_gather) before sending data, and raises ValueError on all ranks together.
    "local" skips it: only what one rank can see alone is checked (tensor rows vs plan, world
    size, non-negative splits); a plan that is locally consistent but disagrees with a peer's
    then hangs until the process-group timeout or delivers wrong rows.
    """

    mode: Literal["single", "two_stage"] = "single"
    validate: Literal["collective", "local"] = "collective"

    def __post_init__(self) -> None:
        if self.mode not in ("single", "two_stage"):
            raise ValueError(f"mode must be 'single' or 'two_stage', got {self.mode!r}")
        if self.validate not in ("collective", "local"):
            raise ValueError(f"validate must be 'collective' or 'local', got {self.validate!r}")


@dataclass(slots=True)
class ExchangeStats:
    """Bytes this rank moved, by locality (keys of planner.types.LOCALITIES).

    `payload_bytes` classifies each embedding by (encoding rank, LLM rank), exactly what the
    planner predicts; summed over ranks it equals `ExchangeTable.bytes_by_locality()`.
    `wire_bytes` classifies what this rank actually handed to each link: equal to the payload
    in single mode; in two-stage mode rows bound for another node first cross the node's
    intra links, so intra grows while the inter total (over ranks) stays the same.
    Same-rank bytes are local copies, never sent. Counters accumulate over calls; `reset()`
    (or diff two `as_dict()` snapshots) for per-call numbers.
    """

    payload_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LOCALITIES, 0))
    wire_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LOCALITIES, 0))
    backward_wire_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LOCALITIES, 0))
    num_calls: int = 0

    def reset(self) -> None:
        for d in (self.payload_bytes, self.wire_bytes, self.backward_wire_bytes):
            for k in d:
                d[k] = 0
        self.num_calls = 0

    def as_dict(self) -> dict:
        return {
            "payload_bytes": dict(self.payload_bytes),
            "wire_bytes": dict(self.wire_bytes),
            "backward_wire_bytes": dict(self.backward_wire_bytes),
            "num_calls": self.num_calls,
        }


def _a2a_blocks(
    send_blocks: list[list[torch.Tensor]],
    recv_sizes: list[list[int]],
    *,
    group,
    me: int,
    locality: Sequence[int | None],
    like: torch.Tensor,
    counter: dict[str, int],
) -> list[list[torch.Tensor]]:
    """One all_to_all over `group` of row blocks: `send_blocks[peer]` go to `peer`, in order.

    Returns, per source peer, its blocks as views of one receive buffer (`recv_sizes[peer]`
    rows each); this rank's own blocks are handed back untouched, never sent. One copy in
    (packing the send buffer), none out: callers concatenate the views where they need them.
    """
    h = like.shape[1]
    row_b = h * like.element_size()
    for peer, blocks in enumerate(send_blocks):
        if locality[peer] is not None:  # None: the caller counts these rows itself
            counter[LOCALITIES[locality[peer]]] += sum(int(b.shape[0]) for b in blocks) * row_b
    if len(send_blocks) == 1:
        return [send_blocks[0]]
    net_send = [0 if p == me else sum(int(b.shape[0]) for b in blocks) for p, blocks in enumerate(send_blocks)]
    net_recv = [0 if p == me else sum(sizes) for p, sizes in enumerate(recv_sizes)]
    flat = [b for p, blocks in enumerate(send_blocks) if p != me for b in blocks]
    send_buf = torch.cat(flat) if flat else like.new_empty((0, h))
    # Ship bytes, not elements: any dtype (bf16, complex, bool) goes through any backend.
    send_u8 = send_buf.reshape(-1).view(torch.uint8).reshape(sum(net_send), row_b)
    out_u8 = torch.empty((sum(net_recv), row_b), dtype=torch.uint8, device=like.device)
    dist.all_to_all_single(out_u8, send_u8, net_recv, net_send, group=group)
    out = out_u8.reshape(-1).view(like.dtype).reshape(sum(net_recv), h)
    result: list[list[torch.Tensor]] = []
    row = 0
    for p, sizes in enumerate(recv_sizes):
        if p == me:
            assert [int(b.shape[0]) for b in send_blocks[me]] == list(sizes), (send_blocks[me], sizes)
            result.append(send_blocks[me])
            continue
        views = []
        for n in sizes:
            views.append(out[row:row + n])
            row += n
        result.append(views)
    return result


@dataclass(frozen=True, slots=True)
class _Plan:
    """Everything one fused exchange needs; `transposed()` is its backward."""

    sends: tuple[tuple[int, ...], ...]  # per phase, rows to each world rank
    recvs: tuple[tuple[int, ...], ...]  # per phase, rows from each world rank
    mode: str
    ctx: RankContext
    groups: NodeGroups | None
    node_peers: np.ndarray | None  # two-stage: int64[2, g, P, W] send/recv vectors of node peers

    def transposed(self) -> _Plan:
        peers = None if self.node_peers is None else self.node_peers[::-1]
        return _Plan(self.recvs, self.sends, self.mode, self.ctx, self.groups, peers)


def _split_rows(t: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    return list(torch.split(t, list(sizes))) if len(sizes) else []


def _execute(plan: _Plan, tensors: Sequence[torch.Tensor], counter: dict[str, int]) -> list[torch.Tensor]:
    ctx, P = plan.ctx, len(tensors)
    like = tensors[0]
    by_dst = [_split_rows(t, s) for t, s in zip(tensors, plan.sends)]  # [phase][world rank]
    if plan.mode == "single" or ctx.world_size == 1:
        loc = tuple(ctx.locality(r) for r in range(ctx.world_size))
        got = _a2a_blocks(
            [[by_dst[p][d] for p in range(P)] for d in range(ctx.world_size)],
            [[plan.recvs[p][s] for p in range(P)] for s in range(ctx.world_size)],
            group=None, me=ctx.rank, locality=loc, like=like, counter=counter,
        )
        return [torch.cat([got[s][p] for s in range(ctx.world_size)]) for p in range(P)]

    g, N, ml, mn = ctx.local_world_size, ctx.num_nodes, ctx.local_rank, ctx.node
    peer_send = plan.node_peers[0]  # [g local sources, P, W]

    def rank(node: int, local: int) -> int:
        return node * g + local

    # The blocks a stage keeps (its own) cross no link there: the rows this rank both encodes
    # and runs the LLM for are its same-rank bytes, counted once (each stage counted them, and
    # its stage-1 block also holds rows that then cross nodes, and its stage-2 one rows that
    # crossed the node's intra links, both counted where they move).
    counter[LOCALITIES[SAME_RANK]] += sum(int(by_dst[p][ctx.rank].shape[0]) for p in range(P)) \
        * like.shape[1] * like.element_size()
    # Stage 1, intra-node: local rank l collects everything bound for (any node, l).
    got1 = _a2a_blocks(
        [[by_dst[p][rank(n, l)] for n in range(N) for p in range(P)] for l in range(g)],
        [[int(peer_send[s, p, rank(n, ml)]) for n in range(N) for p in range(P)] for s in range(g)],
        group=plan.groups.intra, me=ml, locality=[None if l == ml else 1 for l in range(g)],
        like=like, counter=counter,
    )  # got1[s][n * P + p]: rows from (mn, s) to (n, ml)
    # Stage 2, inter-node between equal local ranks: one message per node pair.
    got2 = _a2a_blocks(
        [[got1[s][n * P + p] for s in range(g) for p in range(P)] for n in range(N)],
        [[plan.recvs[p][rank(n, s)] for s in range(g) for p in range(P)] for n in range(N)],
        group=plan.groups.inter, me=mn, locality=[None if n == mn else 2 for n in range(N)],
        like=like, counter=counter,
    )  # got2[n][s * P + p]: rows from (n, s) to me, i.e. source-rank order
    return [torch.cat([got2[n][s * P + p] for n in range(N) for s in range(g)]) for p in range(P)]


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: _Plan, stats: ExchangeStats, *tensors: torch.Tensor):
        ctx.plan, ctx.stats = plan, stats
        return tuple(_execute(plan, tensors, stats.wire_bytes))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        # The transposed exchange returns every row's gradient to the rank that encoded it.
        return (None, None, *_execute(ctx.plan.transposed(), grads, ctx.stats.backward_wire_bytes))


#: What to do when ranks' encoder outputs disagree on requires_grad.
_GRAD_FIX = ("an encoder output without grad, e.g. torch.zeros(0, H) for a rank with no items of "
             "a phase, or a frozen encoder, must still take part in backward: pass "
             "t.requires_grad_() for it, or run the micro-batch with forward_microbatch or "
             "train_microbatch, which do")


def _phases_without_grad(phases: Sequence[str]) -> str:
    return f" (its {', '.join(phases)} output{'s' * (len(phases) > 1)})" if phases else ""


def _phase_header(phases: Sequence[str]) -> list[int]:
    """A call's phases in two numbers, the same on every rank that passes the same phases: how
    many, and a digest of their names (a mismatch gathers the names themselves to say so)."""
    return [len(phases), zlib.crc32("\0".join(phases).encode())]


def _as_splits(a, what: str, world_size: int) -> tuple[int, ...]:
    arr = np.asarray(a, dtype=np.int64).reshape(-1)
    if arr.shape[0] != world_size:
        raise ValueError(f"{what} has {arr.shape[0]} entries but the world size is {world_size}")
    if (arr < 0).any():
        raise ValueError(f"{what} has negative split sizes: {arr.tolist()}")
    return tuple(int(v) for v in arr)


class Exchanger:
    """Runs planned encoder->LLM exchanges for one rank; accumulates `stats` over calls.

    Every rank of the world must make the same sequence of calls (the exchange and its
    backward are collectives). Use `exchange_phases` to move all encoder phases of a
    micro-batch in one collective: fewer launches, and the backward order cannot diverge
    between ranks.
    """

    def __init__(
        self,
        config: ExchangeConfig | None = None,
        ctx: RankContext | None = None,
        groups: NodeGroups | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialized: call init_process_group first")
        self.config = config or ExchangeConfig()
        self.ctx = ctx or RankContext.from_process_group()
        if dist.get_world_size() != self.ctx.world_size or dist.get_rank() != self.ctx.rank:
            raise ValueError(
                f"RankContext(rank={self.ctx.rank}, world_size={self.ctx.world_size}) does not "
                f"match the process group (rank={dist.get_rank()}, world_size={dist.get_world_size()})"
            )
        self._groups = groups
        if self.config.mode == "two_stage" and self._groups is None:
            self._groups = node_groups(self.ctx)  # collective: build up front, on every rank
        self.stats = ExchangeStats()
        self._world_locality = tuple(self.ctx.locality(p) for p in range(self.ctx.world_size))

    # ---------------------------------------------------------------- public API
    def exchange(self, enc_outputs: torch.Tensor, px: PhaseExchange) -> torch.Tensor:
        """Encoder outputs [sum(px.send_tokens), h] -> received rows [sum(px.recv_tokens), h].

        Received rows are grouped by source rank (ascending), each source in its send order,
        i.e. `px.recv_items` order with `px.recv_llm_len` rows each.
        """
        return self.exchange_phases({px.phase: enc_outputs}, {px.phase: px})[px.phase]

    def exchange_phases(
        self, enc_outputs: Mapping[str, torch.Tensor], exchanges: Mapping[str, PhaseExchange]
    ) -> dict[str, torch.Tensor]:
        """Exchange several phases (same hidden size and dtype) in one collective."""
        phases = [p for p in ENCODER_PHASES if p in exchanges] + sorted(set(exchanges) - set(ENCODER_PHASES))
        if set(enc_outputs) != set(exchanges):
            raise ValueError(
                f"encoder outputs for phases {sorted(enc_outputs)} but exchanges for {sorted(exchanges)}"
            )
        if not phases:
            raise ValueError("exchange_phases needs at least one phase")
        W = self.ctx.world_size
        problems: list[str] = []
        sends: list[tuple[int, ...]] = []
        recvs: list[tuple[int, ...]] = []
        for p in phases:
            try:
                s, r = self._check_local(enc_outputs[p], exchanges[p])
            except ValueError as e:
                problems.append(str(e))
                s = r = (0,) * W
            sends.append(s)
            recvs.append(r)
        tensors = [enc_outputs[p] for p in phases]
        if not problems:
            widths = {(t.shape[1], t.dtype, t.device) for t in tensors if isinstance(t, torch.Tensor)}
            if len(widths) > 1:
                problems.append(f"phases {phases} differ in (hidden, dtype, device): {sorted(map(str, widths))}")
        row_bytes = tensors[0].shape[1] * tensors[0].element_size() if not problems else -1
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors) if not problems else False
        if self.config.validate == "collective":
            no_grad = [p for p, t in zip(phases, tensors) if not problems and not t.requires_grad]
            self._check_collective(phases, sends, recvs, row_bytes, needs_grad, problems, no_grad)
        elif problems:
            raise ValueError(f"rank {self.ctx.rank}: " + "; ".join(problems))

        send = tuple(int(v) for v in np.sum(sends, axis=0))
        self._count_payload(send, row_bytes)
        plan = _Plan(tuple(sends), tuple(recvs), self.config.mode, self.ctx, self._groups,
                     self._node_peers(sends, recvs) if self.config.mode == "two_stage" else None)
        outs = _Exchange.apply(plan, self.stats, *tensors)
        return dict(zip(phases, outs))

    # ---------------------------------------------------------------- internals
    def _check_local(self, t: torch.Tensor, px: PhaseExchange) -> tuple[tuple[int, ...], tuple[int, ...]]:
        W = self.ctx.world_size
        name = f"phase {px.phase!r}"
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: encoder outputs must be a 2-D tensor [tokens, hidden], got {shape}")
        send = _as_splits(px.send_tokens, f"{name} send_tokens", W)
        recv = _as_splits(px.recv_tokens, f"{name} recv_tokens", W)
        if t.shape[0] != sum(send):
            raise ValueError(
                f"{name}: encoder outputs have {t.shape[0]} rows but the plan sends {sum(send)} tokens"
            )
        if int(np.sum(px.encode_llm_len)) != sum(send):
            raise ValueError(
                f"{name}: encode_llm_len sums to {int(np.sum(px.encode_llm_len))} but send_tokens to {sum(send)}"
            )
        me = self.ctx.rank
        if send[me] != recv[me]:
            raise ValueError(f"{name}: plan keeps {send[me]} tokens on this rank but receives {recv[me]} from itself")
        if int(np.sum(px.recv_llm_len)) != sum(recv):
            raise ValueError(
                f"{name}: recv_llm_len sums to {int(np.sum(px.recv_llm_len))} but recv_tokens to {sum(recv)}"
            )
        return send, recv

    def _check_collective(self, phases: Sequence[str], sends, recvs, row_bytes: int,
                          needs_grad: bool, problems: list[str], no_grad: Sequence[str] = ()) -> None:
        """Every rank tells every peer what it will send it; all ranks learn who disagrees."""
        W, P = self.ctx.world_size, len(sends)
        device = self._meta_device()
        self._check_phases(phases, problems, device)
        meta = np.zeros((W, P + 3), dtype=np.int64)
        meta[:, :P] = np.asarray(sends, dtype=np.int64).T
        meta[:, P] = row_bytes
        meta[:, P + 1] = int(needs_grad)
        meta[:, P + 2] = 0 if problems else 1
        send_meta = torch.as_tensor(meta.reshape(-1), device=device)
        got = torch.empty_like(send_meta)
        dist.all_to_all_single(got, send_meta)
        got = got.cpu().numpy().reshape(W, P + 3)
        mine: list[str] = list(problems)
        if not problems:
            expect = np.asarray(recvs, dtype=np.int64).T
            for src in range(W):
                if not got[src, P + 2]:
                    continue  # that rank reports its own problem
                if (got[src, :P] != expect[src]).any():
                    mine.append(f"rank {src} will send {got[src, :P].tolist()} tokens here but the plan expects {expect[src].tolist()}")
                if got[src, P] != row_bytes:
                    mine.append(f"rank {src} sends rows of {got[src, P]} bytes but this rank's rows are {row_bytes} bytes (hidden size or dtype differ)")
                if bool(got[src, P + 1]) != needs_grad:
                    mine.append(f"rank {src} has requires_grad={bool(got[src, P + 1])} but this rank "
                                f"{needs_grad}{'' if needs_grad else _phases_without_grad(no_grad)}: "
                                f"backward would hang ({_GRAD_FIX})")
        flag = torch.tensor([1 if mine else 0], dtype=torch.int64, device=device)
        flags = [torch.empty_like(flag) for _ in range(W)]
        dist.all_gather(flags, flag)
        bad = [r for r, f in enumerate(flags) if int(f.item())]
        if bad:
            detail = "; ".join(mine) if mine else "this rank's own plan is consistent"
            raise ValueError(f"exchange plan mismatch on ranks {bad} (rank {self.ctx.rank}: {detail})")

    def _check_phases(self, phases: Sequence[str], problems: list[str], device: torch.device) -> None:
        """ValueError on every rank unless all pass the same phases. First, in a fixed-size
        collective: the metadata below has a row per phase, and collectives of other sizes on
        different ranks abort the process (gloo) or hang; rows of equal counts under other
        names (one rank's vision outputs to another's audio) were exchanged, silently mixed."""
        header = torch.tensor(_phase_header(phases), dtype=torch.int64, device=device)
        headers = [torch.empty_like(header) for _ in range(self.ctx.world_size)]
        dist.all_gather(headers, header)
        by_header: dict[tuple[int, ...], list[int]] = {}
        for r, h in enumerate(torch.stack(headers).cpu().tolist()):  # one copy to the host
            by_header.setdefault(tuple(h), []).append(r)
        if len(by_header) == 1:
            return
        # Every rank is here (each saw the same headers differ): the names themselves, for the
        # message, where the headers name only the known phases.
        names: list = [None] * self.ctx.world_size
        dist.all_gather_object(names, list(phases))
        ranks = "; ".join(f"ranks {rs}: {names[rs[0]]}" for rs in by_header.values())
        also = f" (rank {self.ctx.rank} also: {'; '.join(problems)})" if problems else ""
        raise ValueError(f"exchange phases differ across ranks ({ranks}){also}: every rank must "
                         "exchange the same phases in each call, every phase of the micro-batch's "
                         "plan (mb.plan.exchanges), with a [0, hidden] tensor for a phase it "
                         "encodes nothing of")

    def _meta_device(self) -> torch.device:
        if dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _count_payload(self, send: Sequence[int], row_bytes: int) -> None:
        self.stats.num_calls += 1
        for peer, rows in enumerate(send):
            self.stats.payload_bytes[LOCALITIES[self._world_locality[peer]]] += rows * row_bytes

    def _node_peers(self, sends, recvs) -> np.ndarray:
        """[send|recv, local source, phase, world rank] of every rank on this node."""
        mine = np.stack([np.asarray(sends, dtype=np.int64), np.asarray(recvs, dtype=np.int64)])
        g = self.ctx.local_world_size
        if g == 1:
            return mine[:, None]
        t = torch.as_tensor(mine, device=self._meta_device())
        parts = [torch.empty_like(t) for _ in range(g)]
        dist.all_gather(parts, t, group=self._groups.intra)
        return np.stack([p.cpu().numpy() for p in parts], axis=1)


def exchange_embeddings(
    enc_outputs: torch.Tensor, px: PhaseExchange, *, exchanger: Exchanger | None = None
) -> torch.Tensor:
    """One phase's planned exchange; see `Exchanger.exchange`. Creates a default Exchanger
    (single stage, collective validation, context from the process group) when none is given."""
    return (exchanger or Exchanger()).exchange(enc_outputs, px)


def pack_llm_inputs(
    rank_mb: RankMicrobatch,
    text_embeds: torch.Tensor,
    exchanged: Mapping[str, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Place text and received item embeddings at their planned offsets: one packed sequence.

    `text_embeds` holds the micro-batch's samples' text tokens in `rank_mb.samples` order;
    `exchanged[phase]` the rows `exchange` returned for that phase (a phase may be missing
    when the plan receives nothing for it). Returns (packed [total_len, h], cu_seqlens int32
    [s+1], position_ids int64 [total_len], restarting at 0 per sample). One gather moves
    everything, so the backward is one scatter and every exchanged tensor stays in the graph
    (a rank that receives nothing still joins the exchange's backward collective).
    """
    total = rank_mb.total_len
    cu = rank_mb.cu_seqlens
    if not np.array_equal(np.asarray(rank_mb.sample_offsets, dtype=np.int64), cu[:-1]):
        raise ValueError(f"rank {rank_mb.rank} mb {rank_mb.microbatch}: sample_offsets "
                         f"{np.asarray(rank_mb.sample_offsets).tolist()} are not the prefix sums of sample_llm_len")
    if text_embeds.dim() != 2:
        raise ValueError(f"text_embeds must be [tokens, hidden], got shape {tuple(text_embeds.shape)}")
    parts = [text_embeds]
    positions = [text_positions(rank_mb)]
    if text_embeds.shape[0] != positions[0].shape[0]:
        raise ValueError(f"text_embeds has {text_embeds.shape[0]} rows but the plan has "
                         f"{positions[0].shape[0]} text tokens")
    unknown = set(exchanged) - set(rank_mb.exchanges)
    if unknown:
        raise ValueError(f"exchanged phases {sorted(unknown)} are not in the plan")
    for phase, px in rank_mb.exchanges.items():
        pos = _ranges(px.recv_offsets, px.recv_llm_len)
        t = exchanged.get(phase)
        if t is None:
            if pos.shape[0]:
                raise ValueError(f"phase {phase!r}: plan receives {pos.shape[0]} tokens but none were given")
            continue
        if t.dim() != 2 or t.shape[0] != pos.shape[0] or t.shape[1] != text_embeds.shape[1]:
            raise ValueError(f"phase {phase!r}: exchanged tensor has shape {tuple(t.shape)}, expected "
                             f"({pos.shape[0]}, {text_embeds.shape[1]})")
        parts.append(t.to(text_embeds.dtype))
        positions.append(pos)
    where = np.concatenate(positions)
    if where.shape[0] != total or (total and (where.min() < 0 or where.max() >= total
                                              or np.bincount(where, minlength=total).max() != 1)):
        raise ValueError(f"rank {rank_mb.rank} mb {rank_mb.microbatch}: text and item offsets do not "
                         f"tile the packed sequence of length {total} exactly once")
    src_of_pos = np.empty(total, dtype=np.int64)
    src_of_pos[where] = np.arange(total)
    dev = text_embeds.device
    packed = torch.cat(parts).index_select(0, torch.as_tensor(src_of_pos, device=dev))
    lens = np.asarray(rank_mb.sample_llm_len, dtype=np.int64)
    pos_ids = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1], lens)
    return (
        packed,
        torch.as_tensor(cu, dtype=torch.int32, device=dev),
        torch.as_tensor(pos_ids, device=dev),
    )


def text_positions(rank_mb: RankMicrobatch) -> np.ndarray:
    """Where each text token of the micro-batch stands in the packed sequence (samples in
    `rank_mb.samples` order, each's tokens in order): the positions of its samples that no
    received item covers. Text that closes every sample (no item anchored among it, the
    default layout) is one range from `text_offsets` per sample, found without that scan."""
    starts = np.asarray(rank_mb.text_offsets, dtype=np.int64)
    lengths = np.asarray(rank_mb.text_len, dtype=np.int64)
    ends = np.asarray(rank_mb.sample_offsets, dtype=np.int64) + np.asarray(rank_mb.sample_llm_len, dtype=np.int64)
    if np.all((starts + lengths == ends) | (lengths == 0)):
        return _ranges(starts, lengths)
    covered = np.zeros(rank_mb.total_len, dtype=bool)
    for px in rank_mb.exchanges.values():
        covered[_ranges(px.recv_offsets, px.recv_llm_len)] = True
    where = np.flatnonzero(~covered)
    if where.shape[0] != int(lengths.sum()):
        raise ValueError(f"rank {rank_mb.rank} mb {rank_mb.microbatch}: items leave {where.shape[0]} "
                         f"positions for {int(lengths.sum())} text tokens")
    return where


def _ranges(starts, lengths) -> np.ndarray:
    """Concatenation of arange(s, s + n) for each (s, n)."""
    starts = np.asarray(starts, dtype=np.int64).reshape(-1)
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if starts.shape != lengths.shape:
        raise ValueError(f"{starts.shape[0]} offsets but {lengths.shape[0]} lengths")
    if (lengths < 0).any():
        raise ValueError(f"negative lengths: {lengths.tolist()}")
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    return np.repeat(starts - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths) + np.arange(total)
