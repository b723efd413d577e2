"""Where each sample runs its LLM sequence and each encoder item runs, inside one micro-batch.

Samples go to nodes, then ranks (`place_samples`). Encoder items then have a home, their
sample's LLM rank, and four named strategies place them: `node_first` keeps items home and
moves only the excess, same node first (fewest bytes); `node_lpt` sends the same excess to
other nodes but packs each node's items afresh; `home_biased_lpt` and `sequential_lpt` balance
over the whole cluster, are relabelled so each rank's items mostly go to its own node, then
swap items home where loads allow. The node strategies cross nodes by single moves, each
followed by a refine inside nodes, before they swap across nodes. `choose_placement` is the
one scoring rule: balance first, then bytes crossing nodes. Every strategy returns new
arrays; none writes into its arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .balance import lpt_heap, lpt_home, lpt_rounds, refine, relabel_bins, swap_home
from .bounds import unit_bound
from .jit import kernel
from .plan import group_excl_cumsum
from .types import LLM_PHASE, PHASES

K_VIS, K_AUD, K_LLM = PHASES.index("vision"), PHASES.index("audio"), PHASES.index(LLM_PHASE)


@dataclass(frozen=True, slots=True)
class Placement:
    """Rank of every item and the resulting load of every rank, from one strategy."""

    name: str
    rank: np.ndarray  # int64[n]
    loads: np.ndarray  # float64[W]


@dataclass(frozen=True, slots=True)
class Items:
    """One phase's items in one micro-batch: cost, home rank, bytes, and the world's shape."""

    size: np.ndarray  # float64[n]: cost
    home: np.ndarray  # int64[n]: LLM rank of the owning sample
    nbytes: np.ndarray  # float64[n]: embeddings the item sends to its home
    world_size: int
    ranks_per_node: int
    bound: float  # `unit_bound` of the items over the W ranks

    @staticmethod
    def make(size: np.ndarray, home: np.ndarray, nbytes: np.ndarray, world_size: int,
             ranks_per_node: int) -> Items:
        bound = float(unit_bound(size, np.zeros(len(size), dtype=np.int64), 1, world_size)[0])
        return Items(size=size, home=home, nbytes=nbytes, world_size=world_size,
                     ranks_per_node=ranks_per_node, bound=bound)

    def inter_node_bytes(self, rank: np.ndarray) -> float:
        g = self.ranks_per_node
        return float(self.nbytes[rank // g != self.home // g].sum())


# ---- samples -------------------------------------------------------------------------------
def _nodes_by_class(c: np.ndarray, N: int) -> np.ndarray:
    """Node of each sample: one class per phase (audio on audio cost, vision on vision cost,
    text-only on LLM cost), batched LPT then refine, so every node holds ~1/N of each phase."""
    node = np.zeros(c.shape[1], dtype=np.int64)
    has_a = c[K_AUD] > 0
    has_v = ~has_a & (c[K_VIS] > 0)
    text = ~has_a & ~has_v
    node_load = np.zeros((len(PHASES), N))
    for mask, k in ((has_a, K_AUD), (has_v, K_VIS), (text, K_LLM)):
        sel = np.flatnonzero(mask)
        if len(sel) == 0:
            continue
        row = node_load[k][None, :].copy()
        nsel = lpt_rounds(c[k, sel], np.zeros(len(sel), dtype=np.int64), row)
        # batched LPT is coarse with few samples per node: even it out, per node load
        refine(c[k, sel], nsel, row[0], target=row[0].mean() * 1.001, max_iter=8)
        node[sel] = nsel
        for q in range(len(PHASES)):
            node_load[q] += np.bincount(nsel, weights=c[q, sel], minlength=N)
    return node


def place_samples(c: np.ndarray, W: int, g: int, tolerance: float,
                  by_size: np.ndarray | None = None) -> np.ndarray:
    """LLM rank of each sample of one micro-batch, given its per-phase costs c[P, n]: nodes
    by class, ranks in each node by batched LPT on LLM cost (on one node, sequential LPT:
    no bytes to keep local, and its one Python pass over the samples costs less than
    numpy's rounds of a few bins each), then LLM refine in nodes, across nodes with samples
    that carry no embeddings, then any: each within a quarter of `tolerance` above the
    bound; last, a refine over all pairs of ranks (coarse bins only) aims at the bound.
    `by_size`: np.argsort(-c[LLM], kind="stable"), where the caller has it."""
    N = W // g
    llm = np.ascontiguousarray(c[K_LLM])  # one array layout for the compiled kernels
    if by_size is None:  # once, for the LPT and the bound
        by_size = np.argsort(-llm, kind="stable")
    if N > 1:
        node = _nodes_by_class(c, N)
        # LPT over the samples largest first takes them in the same order (by node, then
        # decreasing size, then index) with its sort by size an O(n) check
        rank = np.empty(len(llm), dtype=np.int64)
        rank[by_size] = node[by_size] * g + lpt_rounds(llm[by_size], node[by_size],
                                                       np.zeros((N, g)))
    else:
        rank = lpt_heap(llm, W)
    loads = np.bincount(rank, weights=llm, minlength=W)
    llm_lb = float(unit_bound(llm, np.zeros(len(llm), dtype=np.int64), 1, W, order=by_size)[0])
    good = llm_lb * (1 + tolerance / 4)
    refine(llm, rank, loads, bins_per_group=g, target=good, max_iter=4)
    no_items = (c[K_VIS] == 0) & (c[K_AUD] == 0)
    if N > 1:
        refine(llm, rank, loads, movable=no_items, target=good, max_iter=16)
        refine(llm, rank, loads, target=good, max_iter=16)
    # last, all pairs (coarse bins only) to the bound itself; across nodes only samples
    # without embeddings
    refine(llm, rank, loads, movable=no_items if N > 1 else None, target=llm_lb,
           all_pairs=True, max_iter=8)
    return rank


# ---- encoder items -------------------------------------------------------------------------
def _export_excess(items: Items, pool: np.ndarray, node_load: np.ndarray, cap: float
                   ) -> np.ndarray:
    """Node of each `pool` item: its home node, except that a node over `cap` exports its
    largest pool items until the excess is covered, to the least-loaded nodes (batched LPT
    under `cap` first)."""
    g, sz = items.ranks_per_node, items.size[pool]
    node = items.home[pool] // g
    excess = np.maximum(0.0, node_load - cap)
    if not excess.any():
        return node
    before, order = group_excl_cumsum(node, sz, by_size=True)  # larger first within a node
    out = np.flatnonzero(before < excess[node])
    if len(out):
        loads = node_load.copy()
        np.subtract.at(loads, node[out], sz[out])
        node[out] = _capped_lpt(sz[out], np.zeros(len(out), dtype=np.int64), loads[None, :],
                                cap)
    return node


def _shed_excess(sz: np.ndarray, r: np.ndarray, loads: np.ndarray, good: float
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(ranks, loads) after every rank above `good` sheds its smallest items until it is at or
    under `good`, and the shed items, largest first, fill the room under `good` of the
    roomiest ranks in turn (an item lands where its stretch of the cumulative room lies within
    one rank's room, so no rank goes above `good`; one that straddles two ranks, or finds no
    room, stays). One pass (`_shed_and_fill`)."""
    on_heavy = np.flatnonzero(loads[r] - good > 0)
    if len(on_heavy) == 0:
        return r, loads
    before, _ = group_excl_cumsum(r[on_heavy], -sz[on_heavy], by_size=True)  # smallest first
    r, loads = r.copy(), loads.copy()
    _shed_and_fill(sz, r, loads, float(good), on_heavy, before)
    return r, loads


@kernel
def _shed_and_fill(sz, r, loads, good, on_heavy, before):
    """`_shed_excess` after its sums: item on_heavy[t] is shed if the items of its rank smaller
    than it (ties: earlier) sum to less than the rank's excess, -before[t] < loads - good. The
    shed items leave largest first (ties: lowest index); the ranks by room under `good`
    (largest first, ties: lowest rank; a rank that sheds has none) lay out their rooms end to
    end, the shed items theirs likewise, and an item lands on the rank whose room holds its
    whole stretch. `r` and `loads` are updated in place."""
    W = loads.shape[0]
    keep = np.empty(on_heavy.shape[0], np.bool_)
    for t in range(on_heavy.shape[0]):
        keep[t] = -before[t] < loads[r[on_heavy[t]]] - good
    shed = on_heavy[keep]
    shed = shed[np.argsort(-sz[shed], kind="mergesort")]
    sheds = np.zeros(W, np.bool_)
    for i in shed:
        loads[r[i]] -= sz[i]
        sheds[r[i]] = True
    room = np.maximum(0.0, good - loads)
    room[sheds] = 0.0
    by_room = np.argsort(-room, kind="mergesort")
    cum_room = np.cumsum(room[by_room])
    rooms = np.count_nonzero(room)
    end = np.cumsum(sz[shed])
    dest = np.empty(shed.shape[0], np.int64)
    for j in range(shed.shape[0]):
        i = shed[j]
        pos = np.searchsorted(cum_room, end[j])
        fits = pos == np.searchsorted(cum_room, end[j] - sz[i], side="right") and pos < rooms
        dest[j] = by_room[min(pos, W - 1)] if fits else r[i]
    for j in range(shed.shape[0]):
        loads[dest[j]] += sz[shed[j]]
        r[shed[j]] = dest[j]


def _capped_lpt(sz: np.ndarray, group: np.ndarray, grid: np.ndarray, cap: float) -> np.ndarray:
    """Bin within its group of each item: batched LPT under `cap`, twice (a round hands every
    bin of a group one item, so an item that does not fit its match may fit another bin in
    the next pass), then plain batched LPT for what is left. `grid` (group x bin loads) is
    updated in place."""
    local = lpt_rounds(sz, group, grid, cap=cap * (1 + 1e-9))
    for c in (cap * (1 + 1e-9), None):
        left = np.flatnonzero(local < 0)
        if len(left) == 0:
            break
        local[left] = lpt_rounds(sz[left], group[left], grid, cap=c)
    return local


def node_first(items: Items, good: float) -> Placement:
    """Each rank keeps its largest items up to the bound (zero bytes, and large items carry
    the most bytes); a node over its ranks' bound exports its excess to the lightest nodes;
    the rest is LPT over the ranks of its node (capped batched LPT; on one node, sequential
    LPT); refine in nodes down to `good`, then `_across_nodes` (few items cross)."""
    sz, home, W, g = items.size, items.home, items.world_size, items.ranks_per_node
    lb = items.bound
    within, _ = group_excl_cumsum(home, sz, by_size=True)
    keep = within + sz <= lb * (1 + 1e-9)
    r = home.copy()
    loads = np.bincount(home[keep], weights=sz[keep], minlength=W)
    pool = np.flatnonzero(~keep)
    if len(pool) and W > g:
        node_load = np.bincount(home // g, weights=sz, minlength=W // g)
        node = _export_excess(items, pool, node_load, g * lb)
        r[pool] = node * g + _capped_lpt(sz[pool], node, loads.reshape(W // g, g), lb)
    elif len(pool):  # one node: sequential LPT (one Python pass beats numpy rounds of g items)
        r[pool] = lpt_heap(sz[pool], W, loads)
    # across nodes, only the pool moves here (each rank keeps its largest items); on one node
    # this refine is the last: every item, more iterations
    refine(sz, r, loads, movable=~keep if W > g else None, bins_per_group=g, target=good,
           max_iter=4 if W > g else 8)
    if W > g and loads.max() > good:
        r, loads = _across_nodes(sz, r, loads, g, good)
    return Placement("node_first", r, loads)


def node_lpt(items: Items, good: float) -> Placement:
    """Items to nodes as node-first does (home node; a node over its ranks' bound exports
    items, largest first, to the lightest nodes), then LPT of each node's items over its
    ranks from scratch, refine in nodes, `_across_nodes`: where keeping each rank's largest
    items home leaves too little to pack with."""
    sz, home, W, g = items.size, items.home, items.world_size, items.ranks_per_node
    node_load = np.bincount(home // g, weights=sz, minlength=W // g)
    node = _export_excess(items, np.arange(len(sz)), node_load, g * items.bound)
    loads = np.zeros((W // g, g))
    r = node * g + lpt_rounds(sz, node, loads)
    loads = loads.ravel()
    refine(sz, r, loads, bins_per_group=g, target=good, max_iter=8)
    if W > g and loads.max() > good:
        r, loads = _across_nodes(sz, r, loads, g, good)
    return Placement("node_lpt", r, loads)


def _across_nodes(sz: np.ndarray, r: np.ndarray, loads: np.ndarray, g: int, good: float,
                  rounds: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """(ranks, loads) balanced across nodes with few items crossing: heavy ranks shed to
    roomy ones (`_shed_excess`); then rounds of single moves across nodes (one item crosses
    per move), each followed by a refine in nodes (moves and swaps, nothing crosses); last,
    moves and swaps across nodes (a swap sends two items across), then over all pairs of
    ranks for coarse items. Every step stops at `good`."""
    r, loads = _shed_excess(sz, r.copy(), loads.copy(), good)
    for _ in range(rounds):
        top = loads.max()
        if top <= good:
            break
        refine(sz, r, loads, target=good, max_iter=4, swaps=False)
        refine(sz, r, loads, bins_per_group=g, target=good, max_iter=4)
        if loads.max() >= top * (1 - 1e-12):
            break
    refine(sz, r, loads, target=good, max_iter=4, swaps=True)
    if loads.max() > good:
        refine(sz, r, loads, target=good, all_pairs=True, max_iter=4)
    return r, loads


def _relabelled(name: str, items: Items, r: np.ndarray, loads: np.ndarray,
                target: float, tolerance: float) -> Placement:
    """Refine a whole-cluster placement down to `target`, then hand each bin to the rank
    (node first) where most of its embeddings go anyway (ranks are interchangeable for
    balance), then swap items that are still away from home with items that sit on their
    home node away from their own (`swap_home`), no rank above the slowest x (1 +
    `tolerance`): placements that close count as equally balanced (`choose_placement`)."""
    W, g = items.world_size, items.ranks_per_node
    refine(items.size, r, loads, target=target, max_iter=8)
    new_rank = relabel_bins(r, items.home, items.nbytes, W, g)
    moved = np.empty(W)
    moved[new_rank] = loads
    rank = new_rank[r]
    swap_home(items.size, items.home, items.nbytes, rank, moved, g,
              moved.max() * (1 + max(tolerance, 1e-12)))
    return Placement(name, rank, moved)


def home_biased_lpt(items: Items, band: float, target: float,
                    tolerance: float = 0.0) -> Placement:
    """LPT over all ranks in rounds of W/4 items, bent toward home ranks: loads within
    `band` x the bound / items-per-rank of each other count as equal (`balance.lpt_home`);
    relabelled and swapped home within `tolerance` (`_relabelled`)."""
    W = items.world_size
    per_rank = -(-len(items.size) // W)
    loads = np.zeros(W)
    r = lpt_home(items.size, items.home, loads, node_size=items.ranks_per_node,
                 tol=band * items.bound / per_rank, round_size=max(1, W // 4))
    return _relabelled("home_biased_lpt", items, r, loads, target, tolerance)


def sequential_lpt(items: Items, target: float, tolerance: float = 0.0) -> Placement:
    """Textbook LPT over all ranks (the yardstick; O(n log W) in Python), relabelled and
    swapped home within `tolerance` (`_relabelled`)."""
    r = lpt_heap(items.size, items.world_size)
    loads = np.bincount(r, weights=items.size, minlength=items.world_size)
    return _relabelled("sequential_lpt", items, r, loads, target, tolerance)


def choose_placement(cands: list[Placement], items: Items, tolerance: float) -> Placement:
    """Balance first, then bytes: among placements whose slowest rank is within `tolerance`
    of the lowest, the one moving the fewest bytes across nodes (then the earliest)."""
    best = min(c.loads.max() for c in cands)
    ok = [c for c in cands if c.loads.max() <= best * (1 + tolerance) + 1e-300]
    return ok[0] if len(ok) == 1 else min(ok, key=lambda c: items.inter_node_bytes(c.rank))


def pull_home(items: Items, placed: Placement, max_rounds: int = 4) -> Placement:
    """Items off their home node go back to it (home rank, else the node's least-loaded rank),
    then off-home items to their home rank, wherever that keeps every rank at or under the
    current maximum: bytes drop, the slowest rank does not get slower (`_pull_home`)."""
    r, loads = placed.rank.copy(), placed.loads.copy()
    if len(r):
        _pull_home(items.size, items.home, r, loads, items.ranks_per_node,
                   loads.max() * (1 + 1e-12), max_rounds)
    return Placement(placed.name, r, loads)


@kernel
def _pull_home(sz, home, r, loads, g, cap, max_rounds):
    """`pull_home`'s rounds, first for items off their home node, then for items off their home
    rank, at most `max_rounds` each and until a round moves nothing. In a round every such item
    has a destination: its home rank, or (off its node) its node's least-loaded rank (the first
    on ties) where the home rank has no room; it qualifies if the destination stays at or under
    `cap` with it, on the loads as the round found them. Each destination takes the largest
    qualifying item (ties: the lowest index); the moves leave their ranks in order of
    destination, then arrive. `r` and `loads` are updated in place."""
    W = loads.shape[0]
    pick = np.empty(W, np.int64)
    lightest = np.empty(W // g, np.int64)
    for same_node in (False, True):
        off = np.flatnonzero(r != home) if same_node else np.flatnonzero(r // g != home // g)
        for _ in range(max_rounds):
            if not same_node:
                for k in range(W // g):
                    lightest[k] = k * g + np.argmin(loads[k * g:(k + 1) * g])
            pick[:] = -1
            found = False
            for i in off:  # in index order; the items a round brings home drop out below
                h = home[i]
                if (r[i] == h) if same_node else (r[i] // g == h // g):
                    continue
                found = True
                d = h if same_node or loads[h] + sz[i] <= cap else lightest[h // g]
                if loads[d] + sz[i] <= cap and (pick[d] < 0 or sz[i] > sz[pick[d]]):
                    pick[d] = i
            if not found or pick.max() < 0:
                break
            for d in range(W):
                if pick[d] >= 0:
                    loads[r[pick[d]]] -= sz[pick[d]]
            for d in range(W):
                if pick[d] >= 0:
                    loads[d] += sz[pick[d]]
                    r[pick[d]] = d
            off = off[(r[off] != home[off]) if same_node else (r[off] // g != home[off] // g)]


def place_items(items: Items, *, tolerance: float, band: float,
                coarse_per_rank: float) -> np.ndarray:
    """Rank of each encoder item: node-first, and while no placement so far is within
    `tolerance` of the bound, node LPT, home-biased LPT and sequential LPT in turn;
    `choose_placement` picks; `pull_home` last. With at most `coarse_per_rank` items a rank,
    single moves and swaps seldom bring a node strategy to the bound (a rank's load is a
    handful of items: it must hold the right count of them, not just the right total), so
    home-biased LPT alone follows node-first there: balanced over the whole cluster, then
    swapped home (`_relabelled`)."""
    good = items.bound * (1 + tolerance)  # within it, no strategy is better balanced
    coarse = len(items.size) <= coarse_per_rank * items.world_size
    cands = [node_first(items, good)]
    for name in ("home_biased",) if coarse else ("node", "home_biased", "sequential"):
        if min(c.loads.max() for c in cands) <= good:
            break
        cands.append(node_lpt(items, good) if name == "node" else
                     home_biased_lpt(items, band, good, tolerance) if name == "home_biased"
                     else sequential_lpt(items, good, tolerance))
    return pull_home(items, choose_placement(cands, items, tolerance)).rank
