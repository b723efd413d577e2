"""Predicted beside measured: trainers' per-phase timings, gathered per step, and the online refit.

Each rank reports, per micro-batch and phase, the seconds its forward and backward took and the
lengths of the sequences it ran (`timings` on CREDIT), plus its exchange time. Once every rank
reported a step (or the step falls out of a bounded window), the step's record compares, per
phase, the slowest rank as the cost model predicted it with the slowest rank as measured, and
the measured imbalance. Predictions use the cost model's units: seconds once calibrated, FLOPs
with the default model (then only the imbalances compare). With a refit window, the cost model
is refitted from the last `window` measurements per phase every `every` completed steps.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from dispatcher_server.planner.cost import CostModel
from dispatcher_server.planner.types import PHASES

#: Steps held waiting for their last rank's timings; older ones are summarised as they are.
PENDING_STEPS = 64


@dataclass(kw_only=True, slots=True)
class RefitConfig:
    """Refit the cost model online from the last `window` (run, seconds) pairs per phase,
    every `every` completed steps."""

    window: int = 512
    every: int = 20

    def __post_init__(self) -> None:
        if self.window < 8 or self.every < 1:
            raise ValueError(f"refit needs window >= 8 and every >= 1, got {self.window}, {self.every}")


class StepMeasurements:
    """Timings by step and rank until a step is complete; refit window per phase."""

    def __init__(self, world_size: int, refit: RefitConfig | None = None) -> None:
        self.world_size = world_size
        self.refit = refit
        self._pending: dict[int, dict[int, dict]] = {}  # step -> rank -> timings record
        self._summarised: deque[int] = deque(maxlen=2 * PENDING_STEPS)  # recent steps logged
        self._runs: dict[str, deque] = {p: deque(maxlen=refit.window if refit else 1) for p in PHASES}
        self._completed = 0

    def add(self, rank: int, record: dict, cost: CostModel) -> list[dict]:
        """Take one rank's timings of one step; the records of steps now complete. A rank's
        second record of a step, or one of a step already logged, is dropped: it would log the
        step twice and weigh it twice in the report."""
        step = record["step"]
        if step in self._summarised or rank in self._pending.get(step, ()):
            return []
        self._pending.setdefault(step, {})[rank] = record
        if self.refit is not None:
            for mb in record["mb"]:
                for p in PHASES:
                    if p in mb and mb[p][1]:
                        self._runs[p].append((mb[p][1], mb[p][0]))
        done = [s for s, ranks in self._pending.items() if len(ranks) == self.world_size]
        if len(self._pending) > PENDING_STEPS:
            done.append(min(self._pending))
        self._summarised.extend(sorted(set(done)))
        return [summarise(s, self._pending.pop(s), cost, self.world_size)
                for s in sorted(set(done))]

    def drain(self, cost: CostModel) -> list[dict]:
        """The records of every step still waiting for a rank (at shutdown: partial ones)."""
        steps, self._pending = self._pending, {}
        return [summarise(s, steps[s], cost, self.world_size) for s in sorted(steps)]

    def refitted(self, cost: CostModel, completed: int) -> CostModel | None:
        """A refitted cost model when one is due (every `every` completed steps), else None."""
        if self.refit is None:
            return None
        before = self._completed // self.refit.every
        self._completed += completed
        if self._completed // self.refit.every == before:
            return None
        model = cost
        for p in PHASES:
            runs = self._runs[p]
            if len(runs) >= 8:
                model = model.fit(p, [r[0] for r in runs], [r[1] for r in runs])
        return model if model != cost else None


def summarise(step: int, by_rank: dict[int, dict], cost: CostModel, world_size: int) -> dict:
    """The step-log record of one step's timings: per phase predicted and measured slowest rank
    (summed over micro-batches, as the plan's step time is) and the measured max/mean (1.0 for a
    phase no rank ran an item of: its timer noise is no imbalance)."""
    M = max(len(r["mb"]) for r in by_rank.values())
    phases = {}
    for p in PHASES:
        measured = np.zeros((M, world_size))
        predicted = np.zeros((M, world_size))
        ran = False
        for rank, rec in by_rank.items():
            for m, mb in enumerate(rec["mb"]):
                if p in mb:
                    measured[m, rank] = mb[p][0]
                    predicted[m, rank] = float(cost.cost(p, mb[p][1]).sum()) if mb[p][1] else 0.0
                    ran = ran or bool(mb[p][1])
        mean = measured.sum(axis=1) / len(by_rank)
        phases[p] = {"predicted_max": float(predicted.max(axis=1).sum()),
                     "measured_max": float(measured.max(axis=1).sum()),
                     "measured_max_over_mean": (float(measured.max(axis=1).sum() / mean.sum())
                                                if ran and mean.sum() > 0 else 1.0)}
    exchange = np.zeros((M, world_size))
    for rank, rec in by_rank.items():
        for m, mb in enumerate(rec["mb"]):
            exchange[m, rank] = mb.get("exchange", 0.0)
    predicted_step = sum(v["predicted_max"] for v in phases.values())
    measured_step = sum(v["measured_max"] for v in phases.values())
    return {"kind": "measure", "step": step, "ranks_reported": len(by_rank), "phases": phases,
            "exchange_s": float(exchange.max(axis=1).sum()),
            "predicted_step": predicted_step, "measured_step_s": measured_step,
            "measured_over_predicted": measured_step / predicted_step if predicted_step > 0 else None}
