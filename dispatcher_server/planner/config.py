"""Configuration of the planner: micro-batch rule, capacities, oversize policy, cost model.

Capacities are per rank per micro-batch and count tokens a rank holds at once (LLM tokens;
encoder tokens as the encoder processes them, i.e. padded for windowed encoders).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from .cost import CostModel
from .types import ENCODER_PHASES, StepInputs, Topology

#: Embedding bytes per LLM token: a 4096-wide LLM in bf16.
DEFAULT_BYTES_PER_TOKEN = 4096 * 2

OVERSIZE_POLICIES = ("error", "isolate")

#: serve's default `llm_capacity_factor`: a rank's micro-batch holds at most 1.25x the step's
#: mean LLM tokens per (rank, micro-batch), or its longest sample. M micro-batches then need
#: about the memory of an even split: the step-time model alone never rewards spreading a
#: rank's work over its micro-batches, and uncapped puts most steps whole into one.
DEFAULT_LLM_CAPACITY_FACTOR = 1.25


@dataclass(kw_only=True, slots=True)
class PlannerConfig:
    """How to plan a step. Set exactly one of `num_microbatches`, `microbatch_token_budget`."""

    num_microbatches: int | None = None
    microbatch_token_budget: int | None = None  # LLM tokens per rank per micro-batch -> M
    llm_capacity: int | None = None  # LLM tokens per rank per micro-batch
    # Without llm_capacity: a capacity derived from the step, this many times its mean LLM
    # tokens per (rank, micro-batch) and at least its longest sample, so that no micro-batch
    # gathers the giants while another stays nearly empty (a GPU would run out of memory).
    # None: no capacity (the cost model alone decides; it may concentrate work).
    llm_capacity_factor: float | None = None
    encoder_capacity: dict[str, int] = field(default_factory=dict)  # phase -> tokens
    # A sample no (rank, micro-batch) can hold: "error" raises PlanError naming it; "isolate"
    # warns and runs it alone on one rank in an extra micro-batch (up to W such samples share
    # one extra micro-batch, one per rank; M grows for every rank alike). Never dropped.
    oversize: str = "error"
    cost: CostModel = field(default_factory=CostModel)
    bytes_per_token: dict[str, int] = field(default_factory=dict)  # phase -> bytes
    seed: int = 0
    # Tuning of the solver (solver.py, placement.py); the defaults are what bench.planner
    # measures. A giant-dominated micro-batch is filled up to `room_slack` x a mean sample
    # below its bound (room left for packing).
    room_slack: float = 0.5
    # Encoder placements whose slowest rank is within this fraction of each other count as
    # equally balanced (the one moving fewer inter-node bytes wins); node-first placement
    # within it of the bound is kept without trying the LPT strategies.
    balance_tolerance: float = 0.005
    # Home-biased LPT treats rank loads within this fraction of the bound (spread over a
    # rank's items) as equal, so an item may take its home rank.
    home_band: float = 0.02
    # Encoder placement with at most this many items a rank counts as coarse: local moves
    # seldom bring a node strategy to the bound there, so where node-first misses it,
    # home-biased LPT (balanced over the cluster, then swapped home) is the one alternative.
    # Up to 16: with 1-4 near-equal pages a sample (~12 a rank) node LPT and sequential LPT
    # came no closer to the bound than those two and doubled the placement's time.
    coarse_items_per_rank: float = 16.0

    def __post_init__(self) -> None:
        if (self.num_microbatches is None) == (self.microbatch_token_budget is None):
            raise ValueError("set exactly one of num_microbatches and microbatch_token_budget, "
                             f"got {self.num_microbatches} and {self.microbatch_token_budget}")
        if self.num_microbatches is not None and self.num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {self.num_microbatches}")
        if self.microbatch_token_budget is not None and self.microbatch_token_budget < 1:
            raise ValueError(f"microbatch_token_budget must be >= 1, "
                             f"got {self.microbatch_token_budget}")
        if self.llm_capacity_factor is not None and not 1 <= self.llm_capacity_factor < math.inf:
            raise ValueError(f"llm_capacity_factor must be a finite number >= 1, got "
                             f"{self.llm_capacity_factor}")
        if self.llm_capacity is not None and self.llm_capacity < 1:
            raise ValueError(f"llm_capacity must be >= 1, got {self.llm_capacity}")
        for phase, cap in self.encoder_capacity.items():
            if phase not in ENCODER_PHASES or cap < 1:
                raise ValueError(f"bad encoder_capacity entry {phase!r}: {cap}")
        for phase, bpt in self.bytes_per_token.items():
            if phase not in ENCODER_PHASES or bpt < 0:
                raise ValueError(f"bad bytes_per_token entry {phase!r}: {bpt}")
        if not 0 <= self.room_slack < 1:
            raise ValueError(f"room_slack must be in [0, 1), got {self.room_slack}")
        if self.balance_tolerance < 0 or self.home_band < 0 or self.coarse_items_per_rank < 0:
            raise ValueError(f"need balance_tolerance, home_band, coarse_items_per_rank >= 0; "
                             f"got {self.balance_tolerance}, {self.home_band}, "
                             f"{self.coarse_items_per_rank}")
        if self.oversize not in OVERSIZE_POLICIES:
            raise ValueError(f"oversize must be one of {OVERSIZE_POLICIES}, got {self.oversize!r}")

    def settings(self) -> dict:
        """Every setting plans depend on, as plain values (msgpack and JSON ready): a journal
        records them, so a restart knows which journaled plans were made under other ones."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["cost"] = self.cost.to_dict()
        out["encoder_capacity"] = dict(self.encoder_capacity)
        out["bytes_per_token"] = dict(self.bytes_per_token)
        return out

    def bytes_for(self, phase: str) -> int:
        return self.bytes_per_token.get(phase, DEFAULT_BYTES_PER_TOKEN)

    def llm_capacity_for(self, inputs: StepInputs, topology: Topology) -> int | None:
        """`llm_capacity`, else the one `llm_capacity_factor` derives from this step."""
        if self.llm_capacity is not None or self.llm_capacity_factor is None:
            return self.llm_capacity
        if inputs.num_samples == 0:
            return None
        slots = topology.world_size * self.microbatches_for(inputs, topology)
        mean = float(inputs.llm_len.sum()) / slots
        return max(int(inputs.llm_len.max()), math.ceil(self.llm_capacity_factor * mean), 1)

    def microbatches_for(self, inputs: StepInputs, topology: Topology) -> int:
        """M for this step, the same for every rank."""
        if self.num_microbatches is not None:
            return self.num_microbatches
        total, W = int(inputs.llm_len.sum()), topology.world_size
        # Past one sample per (rank, micro-batch) slot a smaller budget only adds empty
        # micro-batches (a budget under a sample's tokens is met by no M): every rank would run
        # them all, thousands a step at a budget of a few tokens.
        return max(1, min(math.ceil(total / (W * self.microbatch_token_budget)),
                          math.ceil(inputs.num_samples / W)))
