"""Lower bounds on a step's predicted time: no placement can beat them.

Per phase and micro-batch, the slowest rank carries at least max(total/W, largest unit, sum of
the W-th and (W+1)-th largest units). That bound depends on the micro-batch split, so a bad split
can make it look small; the split-free bound (see `compute_metrics`) holds for every split.
"""

from __future__ import annotations

import numpy as np

from .cost import CostModel
from .plan import phase_costs, unit_bound
from .types import LLM_PHASE, PHASES, StepInputs, Topology


def lower_bound(inputs: StepInputs, topology: Topology, cost: CostModel,
                sample_mb: np.ndarray | None = None, num_microbatches: int | None = None) -> dict:
    """{"per_microbatch": {phase: float[M]} (only with a split), "step_time": float (with a
    split: sum over micro-batches and phases), "split_free_step_time": float}."""
    W = topology.world_size
    costs = phase_costs(inputs, cost)
    M0 = num_microbatches if num_microbatches is not None else (
        int(np.max(sample_mb, initial=-1)) + 1 if sample_mb is not None else 1)
    split_free = 0.0
    for p in PHASES:
        c = costs[p]
        one = unit_bound(c, np.zeros(len(c), dtype=np.int64), 1, W * max(M0, 1))[0]
        split_free += max(float(c.sum()) / W, float(one))
    out: dict = {"split_free_step_time": float(split_free)}
    if sample_mb is None:
        return out
    sample_mb = np.asarray(sample_mb, dtype=np.int64)
    M = int(num_microbatches if num_microbatches is not None else sample_mb.max(initial=-1) + 1)
    if len(sample_mb) and (sample_mb.min() < 0 or sample_mb.max() >= M):
        raise ValueError(f"sample_mb outside 0..{M - 1}")
    per = {}
    for p in PHASES:
        mb = sample_mb if p == LLM_PHASE else sample_mb[inputs.items(p).sample]
        per[p] = unit_bound(costs[p], mb, M, W)
    out["per_microbatch"] = per
    out["step_time"] = float(sum(v.sum() for v in per.values()))
    return out
