"""Measure what each phase of a model costs on this device and fit the planner's cost model.

Every phase (vision encoder, audio encoder, LLM) runs forward and backward alone over a grid of
runs, each a few items of mixed lengths, so the fit of `a*l + b*l^2 + c` per item separates the
per-item constant c from the per-token cost a. Timing is `PhaseTimer`: CUDA events on a GPU
(no synchronisation inside the timed work), `perf_counter` (or the process's CPU time, on a
shared machine) on CPU with the thread count pinned; every run is warmed up and repeated, and
its fastest repeat kept (noise only ever adds time).
The training loop and `bench.training` time phases with the same `PhaseTimer` and `PhaseRunner`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import Tensor

from dispatcher_server.planner.cost import CostModel
from dispatcher_server.planner.types import PHASES
from trainer_client.model import MultimodalModel


# ------------------------------------------------------------------------------ timing
#: CPU clocks: "wall" (perf_counter) is what a dedicated machine's step takes; "cpu"
#: (process_time) is this process's CPU time, which time-slicing by other processes on a shared
#: machine does not inflate (with one torch thread the work runs on the calling thread).
CLOCKS = ("wall", "cpu")


class PhaseTimer:
    """Sums the time of named spans of work on one device.

    On CUDA each span records a pair of events and nothing waits for the GPU until `seconds()`
    (call it once per step, after the step's work was queued); on CPU a span reads `clock`
    (see CLOCKS) around synchronous work.

        timer = PhaseTimer(device)
        with timer.span("vision"):
            out = model.encode_vision(items, llm_len)
            out.sum().backward()
        timer.seconds()  # {"vision": 0.012}; timer.reset() before the next step
    """

    def __init__(self, device: torch.device | str = "cpu", clock: str = "wall") -> None:
        if clock not in CLOCKS:
            raise ValueError(f"clock must be one of {CLOCKS}, got {clock!r}")
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._now = time.perf_counter if clock == "wall" else time.process_time
        self._open: dict[str, object] = {}
        self._events: list[tuple[str, object, object]] = []
        self._totals: dict[str, float] = {}

    @contextmanager
    def span(self, name: str):
        self.start(name)
        try:
            yield self
        finally:
            self.stop(name)

    def start(self, name: str) -> None:
        if name in self._open:
            raise ValueError(f"span {name!r} is already open")
        if self._cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(self.device))
            self._open[name] = ev
        else:
            self._open[name] = self._now()

    def stop(self, name: str) -> None:
        try:
            begin = self._open.pop(name)
        except KeyError:
            raise ValueError(f"span {name!r} was not started") from None
        if self._cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record(torch.cuda.current_stream(self.device))
            self._events.append((name, begin, end))
        else:
            self._add(name, self._now() - begin)

    def _add(self, name: str, seconds: float) -> None:
        self._totals[name] = self._totals.get(name, 0.0) + seconds

    def seconds(self) -> dict[str, float]:
        """Total seconds per span name since the last `reset` (waits for the GPU on CUDA)."""
        if self._events:
            self._events[-1][2].synchronize()
            for name, begin, end in self._events:
                self._add(name, begin.elapsed_time(end) / 1e3)
            self._events.clear()
        return dict(self._totals)

    def reset(self) -> None:
        if self._open:
            raise ValueError(f"spans still open: {sorted(self._open)}")
        self._events.clear()
        self._totals.clear()


def pin_threads(device: torch.device | str, threads: int | None) -> int:
    """Fix torch's CPU thread count (timings on CPU depend on it); returns the count in use."""
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def best_of(fn: Callable[[], object], timer: PhaseTimer, *, warmup: int, repeats: int) -> float:
    """Fastest of `repeats` timed calls of `fn` after `warmup` untimed ones (seconds)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
    for _ in range(warmup):
        fn()
    best = math.inf
    for _ in range(repeats):
        timer.reset()
        with timer.span("run"):
            fn()
        best = min(best, timer.seconds()["run"])
    return best


# ------------------------------------------------------------------------------ phase work
@dataclass(frozen=True, slots=True, kw_only=True)
class InputSpec:
    """Shapes of a model's encoder inputs: what one item of length l looks like."""

    patch_dim: int  # features per vision patch (3 * patch_size^2 for RGB)
    merge: int  # merge x merge patches become one LLM token
    frame_dim: int  # features per audio frame
    audio_frames_per_token: int = 2  # frames pooled into one LLM token

    def __post_init__(self) -> None:
        for name in ("patch_dim", "merge", "frame_dim", "audio_frames_per_token"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @staticmethod
    def of(model: object) -> InputSpec | None:
        """The spec of a `ReferenceModel`-like model (one with `config.vision`/`config.audio`)."""
        cfg = getattr(model, "config", None)
        v, a = getattr(cfg, "vision", None), getattr(cfg, "audio", None)
        if v is None or a is None:
            return None
        return InputSpec(patch_dim=int(v.patch_dim), merge=int(v.merge), frame_dim=int(a.frame_dim))

    def multiple(self, phase: str) -> int:
        """Encoder lengths of `phase` are multiples of this (whole merged tokens for vision)."""
        return self.merge**2 if phase == "vision" else 1


class PhaseRunner:
    """Builds the inputs of one phase's run (untimed) and returns the work to time: forward
    and backward of that phase alone over items of the given lengths.

    The LLM runs on random embeddings that require grad (in training its input comes from the
    encoders and text embeddings, so backward reaches it) with random next-token labels.
    """

    def __init__(self, model: MultimodalModel, spec: InputSpec, device: torch.device | str,
                 seed: int = 0) -> None:
        self.model, self.spec, self.device = model, spec, torch.device(device)
        self.gen = torch.Generator().manual_seed(seed)
        self._vocab: int | None = None

    def _randn(self, *shape: int, grad: bool = False) -> Tensor:
        t = torch.randn(*shape, generator=self.gen).to(self.device)
        return t.requires_grad_(grad)

    def vocab_size(self) -> int:
        if self._vocab is None:  # the protocol does not expose it: ask the model's logits
            x = self._randn(2, self.model.hidden_size)
            with torch.no_grad():
                out = self.model.llm(x, torch.tensor([0, 2], device=self.device),
                                     torch.arange(2, device=self.device))
            self._vocab = int(out.logits.shape[-1])
        return self._vocab

    def work(self, phase: str, lengths: Sequence[int]) -> Callable[[], None]:
        lengths = [int(n) for n in lengths]
        if any(n < 1 for n in lengths):
            raise ValueError(f"{phase} lengths must be >= 1, got {lengths}")
        if phase == "vision":
            m2 = self.spec.merge**2
            bad = [n for n in lengths if n % m2]
            if bad:
                raise ValueError(f"vision lengths {bad} are not multiples of merge^2={m2}")
            items = [self._randn(n, self.spec.patch_dim) for n in lengths]
            llm_len = [n // m2 for n in lengths]

            def run() -> None:
                self.model.encode_vision(items, llm_len).float().sum().backward()
            return run
        if phase == "audio":
            items = [self._randn(n, self.spec.frame_dim) for n in lengths]
            k = self.spec.audio_frames_per_token
            llm_len = [max(1, -(-n // k)) for n in lengths]

            def run() -> None:
                self.model.encode_audio(items, llm_len).float().sum().backward()
            return run
        if phase == "llm":
            total = sum(lengths)
            packed = self._randn(total, self.model.hidden_size, grad=True)
            cu = torch.tensor(np.concatenate(([0], np.cumsum(lengths))), dtype=torch.int64,
                              device=self.device)
            pos = torch.cat([torch.arange(n) for n in lengths]).to(self.device) if lengths \
                else torch.zeros(0, dtype=torch.int64, device=self.device)
            labels = torch.randint(0, self.vocab_size(), (total,), generator=self.gen).to(self.device)

            def run() -> None:
                self.model.llm(packed, cu, pos, labels).loss_sum.backward()
            return run
        raise ValueError(f"unknown phase {phase!r}; phases are {list(PHASES)}")


# ------------------------------------------------------------------------------ calibration
#: Fewest runs a phase's fit takes (a, b, c and a check of them), and fewest items a run may
#: hold (several items per run make the per-item constant identifiable).
MIN_RUNS = 4
MIN_ITEMS_PER_RUN = 2


@dataclass(frozen=True, slots=True, kw_only=True)
class GridConfig:
    """Runs of one phase: `num_runs` runs of 1..max_items items, lengths log-uniform in
    [min_len, max_len] (rounded to the phase's multiple)."""

    min_len: int
    max_len: int
    num_runs: int = 32
    max_items: int = 8

    def __post_init__(self) -> None:
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"need 1 <= min_len={self.min_len} <= max_len={self.max_len}")
        if self.num_runs < MIN_RUNS or self.max_items < MIN_ITEMS_PER_RUN:
            raise ValueError(f"need num_runs >= {MIN_RUNS} and max_items >= {MIN_ITEMS_PER_RUN} "
                             f"(several items per run make "
                             f"the per-item constant identifiable), got {self.num_runs}, {self.max_items}")


def grid_runs(grid: GridConfig, multiple: int, rng: np.random.Generator) -> list[np.ndarray]:
    """The item lengths of every run: single items spanning the range (the l^2 term) and runs
    of 2..max_items mixed lengths (the per-item constant), in a shuffled order."""
    lo = max(grid.min_len, multiple)
    hi = max(lo, grid.max_len)

    def draw(k: int, top: int) -> np.ndarray:
        x = np.exp(rng.uniform(np.log(lo), np.log(top), k))
        return np.clip(np.round(x / multiple) * multiple, lo, max(lo, top // multiple * multiple)).astype(np.int64)

    counts = [1] + [int(k) for k in np.unique(np.geomspace(2, grid.max_items, 3).round())]
    runs = []
    singles = np.unique(np.geomspace(lo, hi, max(2, grid.num_runs // 4)).round())
    for n in singles:
        runs.append(np.array([max(lo, int(round(n / multiple)) * multiple)], dtype=np.int64))
    while len(runs) < grid.num_runs:
        k = counts[len(runs) % len(counts)]
        # multi-item runs alternate between three kinds: items over the whole range (runs as
        # large as a rank's share of a step, where per-token costs drift with the total), items
        # up to max_len/k, and only small items (where the per-item constant shows most)
        kind = (len(runs) // len(counts)) % 3 if k > 1 else 0
        runs.append(draw(k, hi if kind == 0 else max(lo, hi // k) if kind == 1 else max(lo, min(4 * lo, hi))))
    order = rng.permutation(len(runs))
    return [runs[i] for i in order]


#: Runs' errors weigh time**-0.5 in the fit: plain least squares (0) lets the longest runs'
#: noise hide the per-item constant; relative error (1) lets the many short runs outvote the
#: long ones, which set the step time (and where caches make real kernels grow faster than l^2).
FIT_WEIGHT_EXPONENT = 0.5
#: A phase's fit below this R^2 explains too little of its timings to plan by: `calibrate`
#: warns (noise on the device, too few repeats, or a grid past what the model's cost follows).
#: Quiet devices fit 0.99 and more; the reference model on a busy 2-core CPU fits 0.95 and more.
POOR_FIT_R2 = 0.9


@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseFit:
    """How well the fitted cost explains one phase's measured runs."""

    r2: float  # 1 - residual / total sum of squares over the runs
    worst_rel_error: float  # max over runs of |predicted - measured| / measured
    num_runs: int
    window_candidates: dict[str, float] = field(default_factory=dict)  # window -> r2 when auto


@dataclass(frozen=True, slots=True, kw_only=True)
class Calibration:
    cost: CostModel  # seconds
    fits: dict[str, PhaseFit]
    runs: dict[str, list[list[int]]]  # phase -> item lengths of each run
    times: dict[str, list[float]]  # phase -> measured seconds of each run

    def poor_fits(self) -> dict[str, float]:
        """Phase -> R^2 of the phases whose fit is below POOR_FIT_R2."""
        return {p: f.r2 for p, f in self.fits.items() if not f.r2 >= POOR_FIT_R2}

    def summary(self) -> dict:
        """JSON-ready: coefficients and fit quality per phase."""
        out = {}
        for p, f in self.fits.items():
            pc = self.cost.phase(p)
            out[p] = {"a": pc.a, "b": pc.b, "c": pc.c, "window": pc.window, "r2": f.r2,
                      "worst_rel_error": f.worst_rel_error, "num_runs": f.num_runs}
            if f.window_candidates:
                out[p]["r2_by_window"] = f.window_candidates
        return out


def fit_quality(cost: CostModel, phase: str, runs: Sequence, times: Sequence[float]) -> tuple[float, float]:
    """(R^2, worst relative error) of `cost`'s predictions for measured runs of `phase`."""
    t = np.asarray(times, dtype=np.float64)
    pred = np.array([float(cost.cost(phase, np.atleast_1d(r)).sum()) for r in runs])
    ss_tot = float(((t - t.mean()) ** 2).sum())
    ss_res = float(((t - pred) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    return r2, float(np.max(np.abs(pred - t) / np.maximum(t, 1e-12)))


def fit_phase(base: CostModel, phase: str, runs: Sequence, times: Sequence[float],
              window: int | str | None = "auto") -> tuple[CostModel, PhaseFit]:
    """`base` with `phase` fitted to the runs.

    `window`: "auto" fits with `base`'s window for the phase (if it has one) and without, and
    keeps whichever explains the timings better (a model that really pads to windows keeps
    it; one that attends over the real length drops it); None fits without; an int fits with
    that window.
    """
    pc = base.phase(phase)
    if window == "auto":
        options = [pc.window, None] if pc.window is not None else [None]
    elif window is None or (isinstance(window, int) and window >= 1):
        options = [window]
    else:
        raise ValueError(f"window must be 'auto', None or an int >= 1, got {window!r}")
    best, candidates = None, {}
    for w in options:
        phases = dict(base.phases)
        phases[phase] = replace(pc, window=w)
        fitted = CostModel(phases=phases).fit(phase, list(runs), list(times), weight_exponent=FIT_WEIGHT_EXPONENT)
        r2, worst = fit_quality(fitted, phase, runs, times)
        candidates[str(w)] = r2
        if best is None or r2 > best[1]:
            best = (fitted, r2, worst)
    fitted, r2, worst = best
    return fitted, PhaseFit(r2=r2, worst_rel_error=worst, num_runs=len(runs),
                            window_candidates=candidates if len(options) > 1 else {})


def calibration_runs(grids: dict[str, GridConfig], multiples: dict[str, int] | None = None,
                     seed: int = 0) -> dict[str, list[np.ndarray]]:
    """The runs `calibrate` measures: per phase, `grid_runs` of its grid."""
    rng = np.random.default_rng(seed)
    multiples = multiples or {}
    return {phase: grid_runs(grid, multiples.get(phase, 1), rng) for phase, grid in grids.items()}


def fit_calibration(runs: dict[str, list], times: dict[str, Sequence[float]], *,
                    base: CostModel | None = None,
                    windows: dict[str, int | str | None] | None = None,
                    progress: Callable[[str], None] | None = None) -> Calibration:
    """Fit every phase of `runs` to its measured `times` (seconds, one per run).

    Phases absent from `runs` keep `base`'s cost (which is in different units: calibrate all
    three for a cost file)."""
    cost, fits = base or CostModel(), {}
    windows = windows or {}
    for phase, rs in runs.items():
        cost, fits[phase] = fit_phase(cost, phase, rs, times[phase], windows.get(phase, "auto"))
        if progress is not None:
            pc, fit = cost.phase(phase), fits[phase]
            progress(f"{phase}: {len(rs)} runs, R^2 {fit.r2:.4f}, a={pc.a:.3e} b={pc.b:.3e} "
                     f"c={pc.c:.3e} window={pc.window}")
    return Calibration(cost=cost, fits=fits,
                       runs={p: [[int(x) for x in r] for r in rs] for p, rs in runs.items()},
                       times={p: [float(t) for t in times[p]] for p in runs})


def calibrate(measure: Callable[[str, np.ndarray], float], grids: dict[str, GridConfig], *,
              multiples: dict[str, int] | None = None, base: CostModel | None = None,
              windows: dict[str, int | str | None] | None = None, repeats: int = 3,
              seed: int = 0, progress: Callable[[str], None] | None = None) -> Calibration:
    """Measure every phase of `grids` with `measure(phase, lengths) -> seconds` and fit it.

    `measure` is called `repeats` times per run, the runs of a phase interleaved so a burst of
    machine noise spreads over many runs instead of spoiling one; each run keeps its fastest.
    """
    runs = calibration_runs(grids, multiples, seed)
    times = {}
    for phase, rs in runs.items():
        best = np.full(len(rs), np.inf)
        for _ in range(repeats):
            for i, r in enumerate(rs):
                best[i] = min(best[i], float(measure(phase, r)))
        times[phase] = best
    return fit_calibration(runs, times, base=base, windows=windows, progress=progress)


def model_measure(model: MultimodalModel, spec: InputSpec, device: torch.device | str, *,
                  warmup: int = 1, seed: int = 0, clock: str = "wall") -> Callable[[str, np.ndarray], float]:
    """`measure` for `calibrate`: one timed forward+backward of a phase over items of the given
    lengths on `device` (inputs built outside the timed span, `warmup` untimed calls first)."""
    runner = PhaseRunner(model, spec, device, seed=seed)
    timer = PhaseTimer(device, clock)

    def measure(phase: str, lengths: np.ndarray) -> float:
        work = runner.work(phase, lengths)
        return best_of(work, timer, warmup=warmup, repeats=1)
    return measure
