"""Cost model of the three phases: what one sequence of length l costs a rank.

Packed variable-length attention makes each sequence cost `a*l + b*l^2 + c` on its own (c: the
per-sequence overhead of kernel launches and bookkeeping, 0 in the FLOP defaults); padded
(fixed-window) encoders cost every window in full. Defaults come from reference model shapes
via FLOP formulas, so relative phase weights are right out of the box; `fit` replaces them with
measured seconds when a calibration run exists (only ratios matter to the planner).

Default derivation (forward+backward = 3x forward; h hidden size, L layers):
    linear FLOPs per token    = 2 * 12 h^2 L = 24 h^2 L  (QKV+O = 4h^2, MLP 4x = 8h^2, 2 FLOP/MAC)
    attention FLOPs per token = 2 * 2 h L l  = 4 h L l   (QK^T and AV over the l keys)
    => a = 3 * 24 h^2 L,  b = 3 * 4 h L      (per sequence: a*l + b*l^2)
Reference shapes: vision = Qwen2-VL 675M ViT (h=1280, L=32, l in 14x14 patches);
audio = Whisper-large encoder (h=1280, L=32, window 1500 frames = 30 s, long clips cost
ceil(l/1500) full windows); llm = a 7B decoder (h=4096, L=32).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
from scipy.optimize import nnls

from .types import ENCODER_PHASES, LLM_PHASE, PHASES, StepInputs

_TRAIN_FACTOR = 3.0  # backward ~ 2x forward


def transformer_coefficients(hidden: int, layers: int) -> tuple[float, float]:
    """(a, b) of `a*l + b*l^2` training FLOPs for a dense transformer with `hidden`, `layers`."""
    return _TRAIN_FACTOR * 24.0 * hidden**2 * layers, _TRAIN_FACTOR * 4.0 * hidden * layers


@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseCost:
    """`a*l + b*l^2 + c` per sequence; with `window`, a sequence is cut into ceil(l/window)
    sequences of exactly `window` (padded encoders such as Whisper's 30 s window)."""

    a: float
    b: float
    c: float = 0.0
    window: int | None = None

    def __post_init__(self) -> None:
        if self.a < 0 or self.b < 0 or self.c < 0:
            raise ValueError(f"cost coefficients must be >= 0, got a={self.a}, b={self.b}, c={self.c}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")

    def effective(self, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(number of sequences, length of each) that `lengths` turn into for this phase."""
        lengths = np.asarray(lengths, dtype=np.float64)
        if self.window is None:
            return np.ones_like(lengths), lengths
        n = np.ceil(lengths / self.window)
        return n, np.where(n > 0, float(self.window), 0.0)

    def padded_len(self, lengths: np.ndarray) -> np.ndarray:
        """Tokens the encoder actually processes (what capacities count)."""
        n, l = self.effective(lengths)
        return (n * l).astype(np.int64)

    def __call__(self, lengths: np.ndarray) -> np.ndarray:
        n, l = self.effective(lengths)
        return n * (self.a * l + self.b * l * l + self.c)


def _default_phases() -> dict[str, PhaseCost]:
    va, vb = transformer_coefficients(1280, 32)
    la, lb = transformer_coefficients(4096, 32)
    return {
        "vision": PhaseCost(a=va, b=vb),
        "audio": PhaseCost(a=va, b=vb, window=1500),
        "llm": PhaseCost(a=la, b=lb),
    }


@dataclass(frozen=True, slots=True, kw_only=True)
class CostModel:
    """Per-phase `PhaseCost`; units are FLOPs by default, seconds after `fit` on timings."""

    phases: dict[str, PhaseCost] = field(default_factory=_default_phases)

    def __post_init__(self) -> None:
        unknown = set(self.phases) - set(PHASES)
        if unknown:
            raise ValueError(f"unknown phases in cost model: {sorted(unknown)}")

    def phase(self, phase: str) -> PhaseCost:
        try:
            return self.phases[phase]
        except KeyError:
            raise ValueError(f"cost model has no phase {phase!r}") from None

    def cost(self, phase: str, lengths) -> np.ndarray:
        """Cost of each sequence in `lengths` (float64 array, same shape)."""
        return self.phase(phase)(np.asarray(lengths))

    def fit(self, phase: str, lengths: Sequence, times: Sequence[float], *,
            weight_exponent: float = 0.0) -> CostModel:
        """A copy with `phase`'s a, b, c fitted (non-negative least squares) to measurements.

        `lengths[i]` is one measured run: a sequence length, or an array of the lengths packed
        into that run; `times[i]` its measured time. Each run contributes the sums over its
        sequences of [l, l^2, 1], so runs of several items of mixed lengths make the per-item
        constant c identifiable apart from a. Each run's error is weighted by
        time**-weight_exponent: 0 is plain least squares, 1 relative error, in between a
        compromise (timing noise grows with the time, so the longest runs' noise can drown the
        per-item constant that the shortest runs show). The window, if any, is kept.
        """
        if len(lengths) != len(times) or len(times) < 2:
            raise ValueError(f"need >= 2 (lengths, time) pairs of equal count, got "
                             f"{len(lengths)} lengths and {len(times)} times")
        pc = self.phase(phase)
        rows = []
        for run in lengths:
            n, l = pc.effective(np.atleast_1d(np.asarray(run, dtype=np.float64)))
            rows.append(((n * l).sum(), (n * l * l).sum(), n.sum()))
        design = np.asarray(rows)
        target = np.asarray(times, dtype=np.float64)
        if weight_exponent:
            if np.any(target <= 0):
                raise ValueError(f"weight_exponent={weight_exponent} needs every time > 0")
            w = target**-weight_exponent
            design, target = design * w[:, None], target * w
        scale = design.max(axis=0)
        scale[scale == 0] = 1.0  # a column of zeros: leave its coefficient at 0
        coef, _ = nnls(design / scale, target)
        coef = coef / scale
        phases = dict(self.phases)
        phases[phase] = replace(pc, a=float(coef[0]), b=float(coef[1]), c=float(coef[2]))
        return CostModel(phases=phases)

    def to_dict(self) -> dict:
        return {p: {"a": c.a, "b": c.b, "c": c.c, "window": c.window}
                for p, c in self.phases.items()}

    @staticmethod
    def from_dict(d: dict) -> CostModel:
        """Inverse of `to_dict`; a phase without "c" has c = 0."""
        return CostModel(phases={p: PhaseCost(**v) for p, v in d.items()})


def phase_costs(inputs: StepInputs, cost: CostModel) -> dict[str, np.ndarray]:
    """Cost of every unit each phase balances: items for encoders, samples for the LLM."""
    out = {p: cost.cost(p, inputs.items(p).enc_len) for p in ENCODER_PHASES}
    out[LLM_PHASE] = cost.cost(LLM_PHASE, inputs.llm_len)
    return out
