"""StepPlan: one step's placement, its packed layouts, exchange tables, metrics and checks.

A plan is stored as a few flat arrays (micro-batch and LLM rank per sample, encoder rank per
item); everything a rank needs is derived once into CSR orders sorted by (micro-batch, rank), so
slicing one rank's share is O(its items) and shipping a plan never needs W x W tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .balance import order_by_key_then_size, stable_order
from .bounds import split_free_bound, unit_bound
from .cost import CostModel, phase_costs  # noqa: F401  (phase_costs: part of this module's API)
from .jit import kernel
from .types import (
    ENCODER_PHASES, LLM_PHASE, PHASES, EncoderItems, ExchangeTable, PhaseExchange, PlanError,
    RankMicrobatch, StepInputs, Topology,
)


def _i64(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int64)


def group_excl_cumsum(keys: np.ndarray, values: np.ndarray, by_size: bool = False
                      ) -> tuple[np.ndarray, np.ndarray]:
    """(exclusive cumsum of `values` within equal `keys`, in original order; the order used).
    Within a key the order is by position, or by decreasing value with `by_size`. The sums
    are numpy's: a running sum over the whole order, less the value, less that at the key's
    first (`_excl_sums`, one compiled pass)."""
    order = order_by_key_then_size(keys, values) if by_size else stable_order(keys)
    out = np.empty_like(values)
    if len(order):
        _excl_sums(np.ascontiguousarray(keys, dtype=np.int64), values, order, out)
    return out, order


@kernel
def _excl_sums(keys, values, order, out):
    """out[i] = cs_t - cs_s for i = order[t], where cs = np.cumsum(values[order]) - values[order]
    and s is the first t' with the key of order[t] (keys are grouped along `order`):
    operation for operation what the numpy expression computes, so the same floats."""
    acc = values[order[0]] - values[order[0]]
    base = acc
    for t in range(order.shape[0]):
        i = order[t]
        v = values[i]
        acc = v if t == 0 else acc + v
        cs = acc - v
        if t == 0 or keys[i] != keys[order[t - 1]]:
            base = cs
        out[i] = cs - base


def _ptr(sorted_groups: np.ndarray, num_groups: int) -> np.ndarray:
    return np.searchsorted(sorted_groups, np.arange(num_groups + 1)).astype(np.int64)


@dataclass(slots=True)
class _Exchange:
    """Derived send/receive orders and sparse pairs of one encoder phase, all micro-batches."""

    send_order: np.ndarray  # items by (mb, src, dst, id)
    send_ptr: np.ndarray  # CSR over mb*W + src
    recv_order: np.ndarray  # items by (mb, dst, src, id)
    recv_ptr: np.ndarray  # CSR over mb*W + dst
    pair_mb: np.ndarray  # pairs by (mb, src, dst)
    pair_src: np.ndarray
    pair_dst: np.ndarray
    pair_items: np.ndarray
    pair_tokens: np.ndarray
    pair_src_ptr: np.ndarray  # CSR over mb*W + src into pairs
    pair_dst_perm: np.ndarray  # pairs by (mb, dst, src)
    pair_dst_ptr: np.ndarray  # CSR over mb*W + dst into pair_dst_perm
    # lengths and offsets pre-gathered in send/receive order, so a rank's share is a slice
    send_enc_len: np.ndarray
    send_llm_len: np.ndarray
    recv_llm_len: np.ndarray
    recv_offsets: np.ndarray
    pair_src_by_dst: np.ndarray  # pair_src[pair_dst_perm]
    pair_tokens_by_dst: np.ndarray
    ptr_lists: tuple  # send_ptr, recv_ptr, pair_src_ptr, pair_dst_ptr as Python lists


class StepPlan:
    """Placement of one step: micro-batch and LLM rank per sample, encoder rank per item.

    Layout of a (rank, micro-batch) packed LLM sequence: its samples in increasing sample id;
    inside a sample its vision items, then audio items (item order), then its text; or, where
    items are anchored in their text, as `anchored_layout` places them.
    """

    def __init__(self, *, inputs: StepInputs, topology: Topology, num_microbatches: int,
                 sample_mb, sample_rank, item_rank: dict[str, np.ndarray],
                 cost: CostModel, bytes_per_token: dict[str, int],
                 llm_capacity: int | None = None, encoder_capacity: dict[str, int] | None = None,
                 isolated_microbatches=()):
        self.inputs = inputs
        self.topology = topology
        self.num_microbatches = int(num_microbatches)
        self.sample_mb = _i64(sample_mb)
        self.sample_rank = _i64(sample_rank)
        self.item_rank = {p: _i64(item_rank.get(p, np.zeros(0))) for p in ENCODER_PHASES}
        self.cost = cost
        self.bytes_per_token = {p: int(bytes_per_token[p]) for p in ENCODER_PHASES}
        self.llm_capacity = llm_capacity
        self.encoder_capacity = dict(encoder_capacity or {})
        self.isolated_microbatches = _i64(isolated_microbatches)
        self._exchanges: dict[str, _Exchange] = {}
        self._sorted: tuple | None = None
        self._sample_order_ro: np.ndarray | None = None
        self._sample_ptr_l: list[int] = []
        self._ex_list: list = []
        self._metrics: dict | None = None
        self._layout()

    @property
    def metrics(self) -> dict:
        """`compute_metrics(self)`, computed on first use (the dispatcher's hot path and the
        capacity repair build plans whose metrics nobody reads)."""
        if self._metrics is None:
            self._metrics = compute_metrics(self)
        return self._metrics

    # ---- layout -------------------------------------------------------------------------
    def _layout(self) -> None:
        W, M = self.topology.world_size, self.num_microbatches
        if (self.sample_mb.shape != self.inputs.llm_len.shape
                or self.sample_rank.shape != self.inputs.llm_len.shape):
            raise PlanError("sample_mb/sample_rank do not match the number of samples")
        groups = self.sample_mb * W + self.sample_rank
        self.sample_offset, self.sample_order = group_excl_cumsum(groups, _i64(self.inputs.llm_len))
        self.sample_ptr = _ptr(groups[self.sample_order], W * M)
        if any(self.inputs.items(p).anchored for p in ENCODER_PHASES):
            self.item_offset, self.text_offset = anchored_layout(self.inputs, self.sample_offset)
            return
        prefix = self.sample_offset.copy()
        self.item_offset: dict[str, np.ndarray] = {}
        for p in ENCODER_PHASES:
            it = self.inputs.items(p)
            within, _ = group_excl_cumsum(_i64(it.sample), _i64(it.llm_len))
            self.item_offset[p] = prefix[it.sample] + within
            prefix = prefix + np.bincount(it.sample, weights=it.llm_len,
                                          minlength=len(prefix)).astype(np.int64)
        self.text_offset = prefix

    def _exchange(self, phase: str) -> _Exchange:
        ex = self._exchanges.get(phase)
        if ex is not None:
            return ex
        W, M = self.topology.world_size, self.num_microbatches
        it = self.inputs.items(phase)
        mb = self.sample_mb[it.sample]
        src, dst = self.item_rank[phase], self.sample_rank[it.sample]
        send_key = (mb * W + src) * W + dst
        send_order = np.argsort(send_key, kind="stable")
        sk = send_key[send_order]
        recv_key = (mb * W + dst) * W + src
        recv_order = np.argsort(recv_key, kind="stable")
        if len(sk):
            starts = np.flatnonzero(np.r_[True, sk[1:] != sk[:-1]])
            pair_key = sk[starts]
            pair_items = np.diff(np.r_[starts, len(sk)]).astype(np.int64)
            pair_tokens = np.add.reduceat(_i64(it.llm_len)[send_order], starts).astype(np.int64)
        else:
            pair_key = pair_items = pair_tokens = np.zeros(0, dtype=np.int64)
        pair_mb, rest = np.divmod(pair_key, W * W)
        pair_src, pair_dst = np.divmod(rest, W)
        dkey = (pair_mb * W + pair_dst) * W + pair_src
        perm = np.argsort(dkey, kind="stable")
        ex = _Exchange(
            send_order=send_order, send_ptr=_ptr(sk // W, W * M),
            recv_order=recv_order, recv_ptr=_ptr(recv_key[recv_order] // W, W * M),
            pair_mb=pair_mb, pair_src=pair_src, pair_dst=pair_dst, pair_items=pair_items,
            pair_tokens=pair_tokens, pair_src_ptr=_ptr(pair_key // W, W * M),
            pair_dst_perm=perm, pair_dst_ptr=_ptr(dkey[perm] // W, W * M),
            send_enc_len=_i64(it.enc_len)[send_order], send_llm_len=_i64(it.llm_len)[send_order],
            recv_llm_len=_i64(it.llm_len)[recv_order],
            recv_offsets=self.item_offset[phase][recv_order],
            pair_src_by_dst=pair_src[perm], pair_tokens_by_dst=pair_tokens[perm], ptr_lists=(),
        )
        ex.ptr_lists = tuple(a.tolist() for a in (ex.send_ptr, ex.recv_ptr, ex.pair_src_ptr,
                                                  ex.pair_dst_ptr))
        for name in ("send_order", "recv_order", "send_enc_len", "send_llm_len", "recv_llm_len",
                     "recv_offsets"):
            _readonly(getattr(ex, name))
        self._exchanges[phase] = ex
        return ex

    # ---- slicing ------------------------------------------------------------------------
    def _check_rank_mb(self, rank: int, mb: int) -> int:
        W, M = self.topology.world_size, self.num_microbatches
        if not (0 <= rank < W and 0 <= mb < M):
            raise ValueError(f"(rank={rank}, microbatch={mb}) outside W={W}, M={M}")
        return mb * W + rank

    def rank_microbatch(self, rank: int, mb: int) -> RankMicrobatch:
        """What `rank` runs in micro-batch `mb`: its samples and its side of each exchange.

        Arrays are read-only views into the plan (copy before modifying), so slicing all W*M
        shares costs O(W*M + samples + items) in total."""
        W, M = self.topology.world_size, self.num_microbatches
        if not (0 <= rank < W and 0 <= mb < M):
            raise ValueError(f"(rank={rank}, microbatch={mb}) outside W={W}, M={M}")
        g = mb * W + rank
        if self._sorted is None:
            o = self.sample_order
            self._sorted = tuple(_readonly(a) for a in (
                self.sample_offset[o], _i64(self.inputs.llm_len)[o], self.text_offset[o],
                _i64(self.inputs.text_len)[o]))
            self._sample_order_ro = _readonly(o.copy())
            self._sample_ptr_l = self.sample_ptr.tolist()  # Python ints slice fastest
            self._ex_list = [(p, self._exchange(p)) for p in ENCODER_PHASES]
        s0, s1 = self._sample_ptr_l[g], self._sample_ptr_l[g + 1]
        exchanges = {}
        for p, ex in self._ex_list:
            sp, rp, psp, pdp = ex.ptr_lists
            a, b, c, d = sp[g], sp[g + 1], rp[g], rp[g + 1]
            send_tokens = np.zeros(W, dtype=np.int64)
            e, f = psp[g], psp[g + 1]
            send_tokens[ex.pair_dst[e:f]] = ex.pair_tokens[e:f]
            recv_tokens = np.zeros(W, dtype=np.int64)
            e, f = pdp[g], pdp[g + 1]
            recv_tokens[ex.pair_src_by_dst[e:f]] = ex.pair_tokens_by_dst[e:f]
            exchanges[p] = PhaseExchange(
                phase=p, encode_items=ex.send_order[a:b], encode_enc_len=ex.send_enc_len[a:b],
                encode_llm_len=ex.send_llm_len[a:b], send_tokens=send_tokens,
                recv_items=ex.recv_order[c:d], recv_llm_len=ex.recv_llm_len[c:d],
                recv_offsets=ex.recv_offsets[c:d], recv_tokens=recv_tokens,
            )
        off, llm, text_off, text = self._sorted
        return RankMicrobatch(
            rank=rank, microbatch=mb, samples=self._sample_order_ro[s0:s1],
            sample_offsets=off[s0:s1], sample_llm_len=llm[s0:s1],
            text_offsets=text_off[s0:s1], text_len=text[s0:s1], exchanges=exchanges,
        )

    def exchange_table(self, mb: int, phase: str) -> ExchangeTable:
        """Sparse encoder->LLM traffic of `phase` in micro-batch `mb` (same-rank pairs included)."""
        if phase not in ENCODER_PHASES:
            raise ValueError(f"no exchange for phase {phase!r}")
        W = self.topology.world_size
        self._check_rank_mb(0, mb)
        ex = self._exchange(phase)
        a, b = ex.pair_src_ptr[mb * W], ex.pair_src_ptr[(mb + 1) * W]
        src, dst, tokens = ex.pair_src[a:b], ex.pair_dst[a:b], ex.pair_tokens[a:b]
        return ExchangeTable(
            src=src, dst=dst, items=ex.pair_items[a:b], tokens=tokens,
            bytes=tokens * self.bytes_per_token[phase],
            locality=_locality(src, dst, self.topology),
        )

    # ---- serialisation ------------------------------------------------------------------
    def to_dict(self) -> dict:
        """msgpack-ready dict (arrays as bytes + dtype + shape); `from_dict` rebuilds it exactly."""
        inp = self.inputs
        return {
            "version": 1,
            "topology": {"world_size": self.topology.world_size,
                         "ranks_per_node": self.topology.ranks_per_node},
            "num_microbatches": self.num_microbatches,
            "inputs": {
                "text_len": _enc(inp.text_len), "llm_len": _enc(inp.llm_len),
                "encoders": {p: {"enc_len": _enc(e.enc_len), "llm_len": _enc(e.llm_len),
                                 "sample": _enc(e.sample),
                                 **({"anchor": _enc(e.anchor)} if e.anchor is not None else {})}
                             for p, e in inp.encoders.items()},
            },
            "sample_mb": _enc(self.sample_mb), "sample_rank": _enc(self.sample_rank),
            "item_rank": {p: _enc(a) for p, a in self.item_rank.items()},
            "cost": self.cost.to_dict(), "bytes_per_token": dict(self.bytes_per_token),
            "llm_capacity": self.llm_capacity, "encoder_capacity": dict(self.encoder_capacity),
            "isolated_microbatches": _enc(self.isolated_microbatches),
        }

    @staticmethod
    def from_dict(d: dict) -> StepPlan:
        if d.get("version") != 1:
            raise ValueError(f"unsupported StepPlan version {d.get('version')!r}")
        i = d["inputs"]
        inputs = StepInputs(
            text_len=_dec(i["text_len"]), llm_len=_dec(i["llm_len"]),
            encoders={p: EncoderItems(enc_len=_dec(e["enc_len"]), llm_len=_dec(e["llm_len"]),
                                      sample=_dec(e["sample"]),
                                      anchor=_dec(e["anchor"]) if "anchor" in e else None)
                      for p, e in i["encoders"].items()},
        )
        return StepPlan(
            inputs=inputs, topology=Topology(**d["topology"]),
            num_microbatches=d["num_microbatches"], sample_mb=_dec(d["sample_mb"]),
            sample_rank=_dec(d["sample_rank"]),
            item_rank={p: _dec(a) for p, a in d["item_rank"].items()},
            cost=CostModel.from_dict(d["cost"]), bytes_per_token=d["bytes_per_token"],
            llm_capacity=d["llm_capacity"], encoder_capacity=d["encoder_capacity"],
            isolated_microbatches=_dec(d["isolated_microbatches"]),
        )


def anchored_layout(inputs: StepInputs, sample_offset: np.ndarray
                    ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """(item offsets per phase, text offsets) of samples whose items stand among their text.

    Within a sample, items go in (anchor, phase, item id) order: those without a placeholder
    (anchor -1) first, then each at its placeholder, at sample offset + the text tokens before it
    (its anchor less the placeholders before it) + the LLM tokens of the items before it; text
    fills the positions left, in order, so a sample's first text token stands after the items
    with no text before them."""
    sizes, sample, llm, anchor, phase, ident = _item_columns(inputs)
    order = np.lexsort((ident, phase, anchor, sample))
    placed = (anchor >= 0).astype(np.int64)
    before, placed_before = np.empty_like(llm), np.empty_like(llm)
    if len(order):
        # in (sample, anchor, phase, id) order a sample's items sit together, in place order
        before[order], _ = group_excl_cumsum(sample[order], llm[order])
        placed_before[order], _ = group_excl_cumsum(sample[order], placed[order])
    text_before = np.where(placed == 1, anchor - placed_before, 0)
    offset = sample_offset[sample] + text_before + before
    bounds = np.cumsum([0, *sizes])
    item_offset = {p: offset[bounds[k]:bounds[k + 1]] for k, p in enumerate(ENCODER_PHASES)}
    first = np.bincount(sample, weights=llm * (text_before == 0), minlength=len(sample_offset))
    return item_offset, sample_offset + first.astype(np.int64)


def _item_columns(inputs: StepInputs) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray,
                                                np.ndarray, np.ndarray]:
    """Every item of every phase in one set of columns, phase by phase: (items per phase, owning
    sample, LLM length, anchor (-1: none), phase index, item id within its phase)."""
    its = [inputs.items(p) for p in ENCODER_PHASES]
    sizes = [len(it) for it in its]
    return (sizes, np.concatenate([_i64(it.sample) for it in its]),
            np.concatenate([_i64(it.llm_len) for it in its]),
            np.concatenate([_anchors(it) for it in its]),
            np.repeat(np.arange(len(its), dtype=np.int64), sizes),
            np.concatenate([np.arange(n, dtype=np.int64) for n in sizes]))


def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _enc(a: np.ndarray) -> dict:
    a = np.ascontiguousarray(a)
    return {"dtype": a.dtype.str, "shape": list(a.shape), "data": a.tobytes()}


def _dec(d: dict) -> np.ndarray:
    return np.frombuffer(d["data"], dtype=np.dtype(d["dtype"])).reshape(d["shape"]).copy()


def _locality(src: np.ndarray, dst: np.ndarray, topology: Topology) -> np.ndarray:
    same_node = topology.node_of(src) == topology.node_of(dst)
    return np.where(src == dst, 0, np.where(same_node, 1, 2)).astype(np.int8)


# ---- metrics ------------------------------------------------------------------------------
def compute_metrics(plan: StepPlan) -> dict:
    """Loads per phase/micro-batch/rank, lower bounds, imbalance, step time, bytes, and
    `peak_tokens`: per phase, the most tokens any (rank, micro-batch) holds (LLM tokens; encoder
    tokens as processed, padded for windowed encoders) - what its memory must fit.

    lb[p][m] = `unit_bound` of micro-batch m's units over W ranks, for the plan's own
    micro-batch split: `max_over_lb`, `lb_step_time` and `step_time_over_lb` say how well the
    split was placed, not how good the split is (a poor split can score 1.000). The bound over
    every split is `bounds.split_free_bound`: `split_free_lb_step_time` and
    `step_time_over_split_free_lb`, the plan's honest distance from the optimum (an upper
    bound on it: the bound is not always reachable).
    """
    W, M = plan.topology.world_size, plan.num_microbatches
    costs = phase_costs(plan.inputs, plan.cost)
    loads, lb, mx, mean, peak = {}, {}, {}, {}, {}
    for p in PHASES:
        if p == LLM_PHASE:
            mb, rank = plan.sample_mb, plan.sample_rank
            tokens = plan.inputs.llm_len
        else:
            it = plan.inputs.items(p)
            mb, rank = plan.sample_mb[it.sample], plan.item_rank[p]
            tokens = plan.cost.phase(p).padded_len(it.enc_len) if p in plan.cost.phases \
                else it.enc_len
        c = costs[p]
        slot = mb * W + rank
        load = np.bincount(slot, weights=c, minlength=W * M).reshape(M, W)
        peak[p] = int(np.bincount(slot, weights=tokens, minlength=W * M).max(initial=0))
        loads[p], mean[p] = load, load.sum(axis=1) / W
        lb[p] = unit_bound(c, mb, M, W)
        mx[p] = load.max(axis=1)
    split_free = split_free_bound(costs, W, M)

    def ratio(num, den):
        d = float(den.sum())
        return float(num.sum()) / d if d > 0 else 1.0

    byts = dict.fromkeys(("same_rank", "intra_node", "inter_node"), 0)
    for p in ENCODER_PHASES:
        it = plan.inputs.items(p)
        loc = _locality(plan.item_rank[p], plan.sample_rank[it.sample], plan.topology)
        b = np.bincount(loc, weights=it.llm_len, minlength=3) * plan.bytes_per_token[p]
        for k, name in enumerate(byts):
            byts[name] += int(b[k])
    step = float(sum(mx[p].sum() for p in PHASES))
    lb_step = float(sum(lb[p].sum() for p in PHASES))
    return {
        "loads": loads, "lb": lb, "max": mx, "mean": mean,
        "max_over_lb": {p: ratio(mx[p], lb[p]) for p in PHASES},
        "max_over_mean": {p: ratio(mx[p], mean[p]) for p in PHASES},
        "step_time": step, "lb_step_time": lb_step, "split_free_lb_step_time": float(split_free),
        "step_time_over_lb": step / lb_step if lb_step > 0 else 1.0,
        "step_time_over_split_free_lb": step / split_free if split_free > 0 else 1.0,
        "bytes": byts,
        "peak_tokens": peak,
    }


# ---- validation ---------------------------------------------------------------------------
def validate(plan: StepPlan, inputs: StepInputs) -> None:
    """Prove the plan's post-conditions from scratch; raise PlanError on the first violation.

    Checks: the plan is for these inputs; every sample and item is placed exactly once in a
    valid (rank, micro-batch) and every rank has exactly M micro-batches; packed offsets are
    contiguous and follow the layout convention; capacities hold outside isolated micro-batches
    (the extra ones that run oversize samples alone, one per rank).
    """
    W, M = plan.topology.world_size, plan.num_microbatches
    if M < 1:
        raise PlanError(f"num_microbatches must be >= 1, got {M}")
    _check_same_inputs(plan, inputs)
    _check_ranges(plan, inputs)
    _check_packing(plan, inputs)
    _check_capacity(plan, inputs)


def _check_same_inputs(plan: StepPlan, inputs: StepInputs) -> None:
    """The plan is for these inputs, and they are consistent (else offsets cannot be)."""
    S = inputs.num_samples
    pi = plan.inputs
    if not (np.array_equal(pi.llm_len, inputs.llm_len)
            and np.array_equal(pi.text_len, inputs.text_len)):
        raise PlanError("plan was made for different samples")
    for p in ENCODER_PHASES:
        a, b = pi.items(p), inputs.items(p)
        if not all(np.array_equal(x, y) for x, y in
                   ((a.enc_len, b.enc_len), (a.llm_len, b.llm_len), (a.sample, b.sample),
                    (_anchors(a), _anchors(b)))):
            raise PlanError(f"plan was made for different {p} items")
    total = _i64(inputs.text_len).copy()
    for p in ENCODER_PHASES:
        it = inputs.items(p)
        if len(it) and (it.sample.min() < 0 or it.sample.max() >= S):
            raise PlanError(f"{p} item owned by a sample outside 0..{S - 1}")
        total += np.bincount(it.sample, weights=it.llm_len, minlength=S).astype(np.int64)
    if any(inputs.items(p).anchor is not None for p in ENCODER_PHASES):
        _check_anchor_values(inputs)
    if not np.array_equal(total, inputs.llm_len):
        bad = int(np.flatnonzero(total != inputs.llm_len)[0])
        raise PlanError(f"sample {bad}: llm_len {inputs.llm_len[bad]} != text + items {total[bad]}")


def _check_ranges(plan: StepPlan, inputs: StepInputs) -> None:
    W, M, S = plan.topology.world_size, plan.num_microbatches, inputs.num_samples

    def in_range(name, a, n, hi):
        if a.shape != (n,):
            raise PlanError(f"{name} has shape {a.shape}, expected ({n},)")
        if n and (a.min() < 0 or a.max() >= hi):
            raise PlanError(f"{name} outside [0, {hi}): min {a.min()}, max {a.max()}")

    in_range("sample_mb", plan.sample_mb, S, M)
    in_range("sample_rank", plan.sample_rank, S, W)
    for p in ENCODER_PHASES:
        in_range(f"item_rank[{p}]", plan.item_rank[p], len(inputs.items(p)), W)


def _check_packing(plan: StepPlan, inputs: StepInputs) -> None:
    """The packing order is a permutation of the samples grouped by (micro-batch, rank) and
    the offsets tile each packed sequence, items then text inside each sample
    (or, with anchors, as `anchored_layout` places them)."""
    W, M, S = plan.topology.world_size, plan.num_microbatches, inputs.num_samples
    # Packing order: a permutation of the samples, grouped by (mb, rank), W*M groups.
    order, ptr = plan.sample_order, plan.sample_ptr
    if ptr.shape != (W * M + 1,) or ptr[0] != 0 or ptr[-1] != S or np.any(np.diff(ptr) < 0):
        raise PlanError(f"packing index does not describe W*M={W * M} (rank, micro-batch) groups")
    if order.shape != (S,) or (S and np.bincount(order, minlength=S).max(initial=0) != 1):
        raise PlanError("packing order does not hold every sample exactly once")
    groups = plan.sample_mb * W + plan.sample_rank
    expect_group = np.repeat(np.arange(W * M), np.diff(ptr))
    if not np.array_equal(groups[order], expect_group):
        raise PlanError("packing order puts a sample in a (rank, micro-batch) it is not planned on")
    # Offsets: contiguous in packing order, items then text inside each sample.
    llm = _i64(inputs.llm_len)[order]
    cs = np.cumsum(llm) - llm
    start = cs[ptr[expect_group]]
    if not np.array_equal(plan.sample_offset[order], cs - start):
        raise PlanError("sample offsets are not contiguous in packing order")
    if any(inputs.items(p).anchored for p in ENCODER_PHASES):
        _check_anchored(plan, inputs)
        return
    prefix = plan.sample_offset.copy()
    for p in ENCODER_PHASES:
        it = inputs.items(p)
        within, _ = group_excl_cumsum(_i64(it.sample), _i64(it.llm_len))
        if not np.array_equal(plan.item_offset[p], prefix[it.sample] + within):
            raise PlanError(f"{p} item offsets break the layout convention")
        prefix = prefix + np.bincount(it.sample, weights=it.llm_len, minlength=S).astype(np.int64)
    if not np.array_equal(plan.text_offset, prefix):
        raise PlanError("text offsets break the layout convention")


def _check_anchor_values(inputs: StepInputs) -> None:
    """Each anchor is -1 or a place among its sample's text and placeholders, no two alike."""
    _, sample, _, anchor, _, _ = _item_columns(inputs)
    placed = anchor >= 0
    room = _i64(inputs.text_len) + np.bincount(sample[placed], minlength=inputs.num_samples)
    bad = np.flatnonzero((anchor < -1) | (anchor >= room[sample]))
    if len(bad):
        k = int(bad[0])
        raise PlanError(f"item {k} (in phase order): anchor {anchor[k]} outside its sample's "
                        f"{room[sample[k]]} text tokens and placeholders")
    pairs = sample[placed] * (int(room.max(initial=0)) + 1) + anchor[placed]
    if len(np.unique(pairs)) != len(pairs):
        raise PlanError("two items of a sample share an anchor (one placeholder each)")


def _anchors(it: EncoderItems) -> np.ndarray:
    return _i64(it.anchor) if it.anchor is not None else np.full(len(it), -1, np.int64)


def _check_anchored(plan: StepPlan, inputs: StepInputs) -> None:
    """Items anchored in their text: taken in place order within each sample (unplaced ones
    first, then by anchor; equal anchors, only -1, by phase and item id), no two overlap, each
    lies inside its sample with exactly as many text positions of it before as its anchor less
    the placeholders before it, and a sample's text starts after its items with none before."""
    S = inputs.num_samples
    sizes, sample, llm, anchor, phase, ident = _item_columns(inputs)
    start = np.concatenate([_i64(plan.item_offset[p]) for p in ENCODER_PHASES]) - plan.sample_offset[sample]
    by_place = np.lexsort((ident, phase, anchor, start, sample))
    if not np.array_equal(by_place, np.lexsort((ident, phase, anchor, sample))):
        raise PlanError("anchored item offsets do not follow (anchor, phase, item) order")
    s, a, n, at = sample[by_place], anchor[by_place], llm[by_place], start[by_place]
    items_before, _ = group_excl_cumsum(s, n)
    placed_before, _ = group_excl_cumsum(s, (a >= 0).astype(np.int64))
    text = np.where(a >= 0, a - placed_before, 0)
    first = np.r_[True, s[1:] != s[:-1]] if len(s) else np.zeros(0, dtype=bool)
    prev_end = np.r_[0, at[:-1] + n[:-1]] if len(s) else np.zeros(0, np.int64)
    if np.any(at - items_before != text) or np.any(~first & (at < prev_end)):
        raise PlanError("anchored item offsets break the layout convention")
    if len(s) and np.any(at + n > _i64(inputs.llm_len)[s]):
        raise PlanError("an anchored item reaches past its sample")
    text_before = np.empty_like(text)
    text_before[by_place] = text
    lead = np.bincount(sample, weights=llm * (text_before == 0), minlength=S).astype(np.int64)
    if not np.array_equal(plan.text_offset, plan.sample_offset + lead):
        raise PlanError("text offsets break the layout convention")


def _check_capacity(plan: StepPlan, inputs: StepInputs) -> None:
    W, M = plan.topology.world_size, plan.num_microbatches
    groups = plan.sample_mb * W + plan.sample_rank
    # Isolated micro-batches hold at most one sample per rank; capacities hold elsewhere.
    iso = plan.isolated_microbatches
    if len(iso) and (iso.min() < 0 or iso.max() >= M):
        raise PlanError(f"isolated micro-batches {iso} outside 0..{M - 1}")
    per_slot = np.bincount(groups, minlength=W * M).reshape(M, W)
    if len(iso) and (np.any(per_slot[iso] > 1) or np.any(per_slot[iso].sum(axis=1) == 0)):
        raise PlanError("an isolated micro-batch must hold at most one sample per rank")
    free = np.ones(M, dtype=bool)
    free[iso] = False
    if plan.llm_capacity is not None:
        tok = np.bincount(groups, weights=inputs.llm_len, minlength=W * M).reshape(M, W)
        over = np.argwhere((tok > plan.llm_capacity) & free[:, None])
        if len(over):
            m, r = over[0]
            raise PlanError(f"rank {r} micro-batch {m}: {int(tok[m, r])} LLM tokens > "
                            f"capacity {plan.llm_capacity}")
    for p, cap in plan.encoder_capacity.items():
        it = inputs.items(p)
        g = plan.sample_mb[it.sample] * W + plan.item_rank[p]
        padded = plan.cost.phase(p).padded_len(it.enc_len) if p in plan.cost.phases else it.enc_len
        tok = np.bincount(g, weights=padded, minlength=W * M).reshape(M, W)
        over = np.argwhere((tok > cap) & free[:, None])
        if len(over):
            m, r = over[0]
            raise PlanError(f"rank {r} micro-batch {m}: {int(tok[m, r])} {p} tokens > "
                            f"capacity {cap}")
