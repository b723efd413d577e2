"""Per-step balanced planner: pure numpy functions from a step's counts to a StepPlan.

`plan_step` is mmdispatch's planner; the baselines return StepPlans too, so metrics, `validate`
and the exchange tables compare like with like.
"""

from .baselines import (
    BASELINES, plan_encoder_only, plan_llm_kk, plan_per_phase_lpt, plan_random, plan_verl_kk,
)
from .bounds import best_lower_bound, lower_bound, split_free_bound, unit_bound
from .config import DEFAULT_BYTES_PER_TOKEN, DEFAULT_LLM_CAPACITY_FACTOR, PlannerConfig
from .cost import CostModel, PhaseCost, transformer_coefficients
from .plan import StepPlan, compute_metrics, validate
from .solver import plan_step
from .types import (
    ENCODER_PHASES, LLM_PHASE, LOCALITIES, PHASES, EncoderItems, ExchangeTable, OversizeWarning,
    PhaseExchange, PlanError, RankMicrobatch, StepInputs, Topology,
)

__all__ = [
    "BASELINES", "DEFAULT_BYTES_PER_TOKEN", "DEFAULT_LLM_CAPACITY_FACTOR", "ENCODER_PHASES",
    "LLM_PHASE", "LOCALITIES", "PHASES",
    "CostModel", "EncoderItems", "ExchangeTable", "OversizeWarning", "PhaseCost", "PhaseExchange",
    "PlanError",
    "PlannerConfig", "RankMicrobatch", "StepInputs", "StepPlan", "Topology", "compute_metrics",
    "best_lower_bound", "lower_bound", "split_free_bound", "unit_bound", "plan_encoder_only", "plan_llm_kk", "plan_per_phase_lpt", "plan_random",
    "plan_step", "plan_verl_kk", "transformer_coefficients", "validate",
]
