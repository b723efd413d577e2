"""The exact optimum of a small step's predicted time, as a mixed-integer program (HiGHS).

Only for certifying the heuristic on small instances (W <= 8, a few dozen samples): binary
x[s, m, r] puts sample s's LLM sequence on rank r in micro-batch m, binary y[i, m, r] puts
encoder item i there (in its sample's micro-batch), and t[p, m] >= every rank's load of phase
p in micro-batch m; minimise sum t. The largest sample is fixed to (0, 0): micro-batches and
ranks are interchangeable, so that loses no optimum. Bytes are not part of this objective.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from .bounds import split_free_bound
from .cost import CostModel, phase_costs
from .types import ENCODER_PHASES, PHASES, StepInputs


@dataclass(frozen=True, slots=True)
class ExactResult:
    """`step_time` of the best plan found, `lower` its proven bound; `optimal` when equal."""

    step_time: float
    lower: float
    optimal: bool


def _units(inputs: StepInputs, cost: CostModel) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(phase index, owning sample, cost) of every unit: samples for the LLM, then items."""
    costs = phase_costs(inputs, cost)
    S = inputs.num_samples
    phase = [np.full(S, PHASES.index("llm"))]
    owner, c = [np.arange(S)], [costs["llm"]]
    for p in ENCODER_PHASES:
        it = inputs.items(p)
        phase.append(np.full(len(it), PHASES.index(p)))
        owner.append(it.sample)
        c.append(costs[p])
    return np.concatenate(phase), np.concatenate(owner), np.concatenate(c)


def solve_exact(inputs: StepInputs, world_size: int, num_microbatches: int, cost: CostModel,
                time_limit: float = 2.0) -> ExactResult:
    """Minimum predicted step time over every plan with `num_microbatches` micro-batches."""
    W, M, P = world_size, num_microbatches, len(PHASES)
    phase, owner, c = _units(inputs, cost)
    U = len(c)
    scale = c.max(initial=0.0) or 1.0
    c = c / scale  # well-conditioned coefficients for HiGHS
    nx = U * M * W  # unit u on (m, r): column (u * M + m) * W + r; then t[p, m]
    col = np.arange(nx).reshape(U, M, W)
    t_col = nx + np.arange(P * M).reshape(P, M)
    llm = np.flatnonzero(phase == PHASES.index("llm"))
    sample_unit = llm[np.argsort(owner[llm])]  # each sample's LLM unit
    A, lo, hi = _constraints(phase, owner, c, sample_unit, col, t_col, W, M)
    upper = np.r_[np.ones(nx), np.full(P * M, np.inf)]
    lower = np.zeros(nx + P * M)
    if len(llm):
        lower[col[sample_unit[int(np.argmax(c[sample_unit]))], 0, 0]] = 1.0
    res = milp(np.r_[np.zeros(nx), np.ones(P * M)],
               integrality=np.r_[np.ones(nx), np.zeros(P * M)],
               bounds=Bounds(lower, upper),
               constraints=LinearConstraint(A, lo, hi),
               options={"time_limit": time_limit, "disp": False})
    if res.x is None:
        raise RuntimeError(f"MILP found no plan: {res.message}")
    best = float(res.fun) * scale
    bound = float(getattr(res, "mip_dual_bound", res.fun)) * scale
    return ExactResult(step_time=best, lower=min(bound, best), optimal=res.status == 0)


def _constraints(phase: np.ndarray, owner: np.ndarray, c: np.ndarray, sample_unit: np.ndarray,
                 col: np.ndarray, t_col: np.ndarray, W: int, M: int
                 ) -> tuple[coo_array, list, list]:
    """(A, lower, upper) of the MILP's rows: every unit placed once, every item in its
    sample's micro-batch, every rank's phase load under t[p, m] (with the cuts t >= any unit
    in m, and sum_m t[p, m] >= the phase's split-free bound)."""
    P, nx = len(PHASES), col.size
    rows, cols, vals, lo, hi = [], [], [], [], []

    def add(row_cols, row_vals, lower, upper):
        rows.append(np.full(len(row_cols), len(lo)))
        cols.append(np.asarray(row_cols))
        vals.append(np.asarray(row_vals, dtype=np.float64))
        lo.append(lower)
        hi.append(upper)

    for u in range(len(c)):  # every unit placed once
        add(col[u].ravel(), np.ones(M * W), 1.0, 1.0)
    for u in np.flatnonzero(phase != PHASES.index("llm")):  # an item runs in its sample's m
        s = sample_unit[owner[u]]
        for m in range(M):
            add(np.r_[col[u, m], col[s, m]], np.r_[np.ones(W), -np.ones(W)], 0.0, 0.0)
    for p in range(P):  # every rank's load under t[p, m]
        mine = np.flatnonzero(phase == p)
        if len(mine) == 0:
            continue
        for m in range(M):
            for r in range(W):
                add(np.r_[col[mine, m, r], t_col[p, m]], np.r_[c[mine], -1.0], -np.inf, 0.0)
            # valid cuts that tighten the relaxation: t is at least any unit placed in m
            for u in mine:
                add(np.r_[col[u, m], t_col[p, m]], np.r_[np.full(W, c[u]), -1.0], -np.inf, 0.0)
        # and the phase's split-free bound, summed over micro-batches
        bound = split_free_bound({q: (c[mine] if q == PHASES[p] else np.zeros(0))
                                  for q in PHASES}, W, M)
        add(t_col[p], np.ones(M), bound, np.inf)
    A = coo_array((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                  shape=(len(lo), nx + P * M))
    return A, lo, hi
