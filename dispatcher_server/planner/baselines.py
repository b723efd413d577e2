"""The balancing schemes mmdispatch is measured against, as StepPlans (metrics, validate and the
exchange work on them unchanged). They take the same PlannerConfig but ignore capacities and the
oversize policy: they model what existing loaders do, not what they should do.
"""

from __future__ import annotations

import numpy as np

from .balance import karmarkar_karp, lpt_heap, lpt_rounds
from .config import PlannerConfig
from .plan import StepPlan, phase_costs
from .solver import check_inputs
from .types import ENCODER_PHASES, LLM_PHASE, StepInputs, Topology


def _plan(inputs, topology, config, M, sample_mb, sample_rank, item_rank=None) -> StepPlan:
    if item_rank is None:  # encoders follow their sample
        item_rank = {p: sample_rank[inputs.items(p).sample] for p in ENCODER_PHASES}
    return StepPlan(
        inputs=inputs, topology=topology, num_microbatches=M, sample_mb=sample_mb,
        sample_rank=sample_rank, item_rank=item_rank, cost=config.cost,
        bytes_per_token={p: config.bytes_for(p) for p in ENCODER_PHASES},
    )


def _as_drawn(S: int, W: int, M: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron-style: contiguous equal (+-1) chunks per rank, then per micro-batch."""
    s = np.arange(S, dtype=np.int64)
    rank = s * W // max(S, 1)
    start = np.searchsorted(rank, np.arange(W))
    count = np.bincount(rank, minlength=W)
    j = s - start[rank]
    mb = j * M // np.maximum(count[rank], 1)
    return mb, rank


def plan_random(inputs: StepInputs, topology: Topology, config: PlannerConfig) -> StepPlan:
    """Samples as drawn, equal counts per rank; encoders run where their sample does."""
    check_inputs(inputs)
    M = config.microbatches_for(inputs, topology)
    mb, rank = _as_drawn(inputs.num_samples, topology.world_size, M)
    return _plan(inputs, topology, config, M, mb, rank)


def plan_llm_kk(inputs: StepInputs, topology: Topology, config: PlannerConfig) -> StepPlan:
    """verl-style: Karmarkar-Karp of LLM cost over ranks, then each rank's samples over its
    M micro-batches by LPT; encoders follow their sample."""
    check_inputs(inputs)
    W = topology.world_size
    M = config.microbatches_for(inputs, topology)
    c = phase_costs(inputs, config.cost)[LLM_PHASE]
    rank = karmarkar_karp(c, W)
    mb = lpt_rounds(c, rank, np.zeros((W, M)))
    return _plan(inputs, topology, config, M, mb, rank)


#: verl's `calculate_workload`: 24576 * l + l^2 per sequence of length l (linear layers of a
#: ~7B model against its attention, in units of l^2).
VERL_LINEAR_PER_TOKEN = 24576


def plan_verl_kk(inputs: StepInputs, topology: Topology, config: PlannerConfig) -> StepPlan:
    """verl's sequence balancing: Karmarkar-Karp over ranks with equal sample counts on
    verl's workload `24576*l + l^2` of each sample's LLM length, then each rank's samples over
    its M micro-batches by LPT on the same workload; encoders follow their sample."""
    check_inputs(inputs)
    W = topology.world_size
    M = config.microbatches_for(inputs, topology)
    length = inputs.llm_len.astype(np.float64)
    work = VERL_LINEAR_PER_TOKEN * length + length * length
    rank = karmarkar_karp(work, W)
    mb = lpt_rounds(work, rank, np.zeros((W, M)))
    return _plan(inputs, topology, config, M, mb, rank)


def plan_encoder_only(inputs: StepInputs, topology: Topology, config: PlannerConfig) -> StepPlan:
    """VeOmni-style: LLM as drawn; vision items per micro-batch by greedy on enc_len^2."""
    check_inputs(inputs)
    W = topology.world_size
    M = config.microbatches_for(inputs, topology)
    mb, rank = _as_drawn(inputs.num_samples, W, M)
    item_rank = {p: rank[inputs.items(p).sample] for p in ENCODER_PHASES}
    vis = inputs.items("vision")
    vmb = mb[vis.sample]
    l2 = vis.enc_len.astype(np.float64) ** 2
    for m in range(M):
        sel = np.flatnonzero(vmb == m)
        item_rank["vision"][sel] = lpt_heap(l2[sel], W)
    return _plan(inputs, topology, config, M, mb, rank, item_rank)


def plan_per_phase_lpt(inputs: StepInputs, topology: Topology, config: PlannerConfig) -> StepPlan:
    """OrchMLLM without its node-wise step: every phase balanced on its own by LPT, bin i on
    rank i, no regard for where a sample's embeddings must go."""
    check_inputs(inputs)
    W = topology.world_size
    M = config.microbatches_for(inputs, topology)
    costs = phase_costs(inputs, config.cost)
    b = lpt_heap(costs[LLM_PHASE], W * M)
    mb, rank = b // W, b % W
    item_rank = {}
    for p in ENCODER_PHASES:
        it = inputs.items(p)
        imb = mb[it.sample]
        r = np.zeros(len(it), dtype=np.int64)
        for m in range(M):
            sel = np.flatnonzero(imb == m)
            r[sel] = lpt_heap(costs[p][sel], W)
        item_rank[p] = r
    return _plan(inputs, topology, config, M, mb, rank, item_rank)


BASELINES = {
    "random": plan_random,
    "llm_kk": plan_llm_kk,
    "verl_kk": plan_verl_kk,
    "encoder_only": plan_encoder_only,
    "per_phase_lpt": plan_per_phase_lpt,
}
