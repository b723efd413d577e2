"""Loading (or, on a machine that has not run them yet, compiling) the planner's kernels before
a service serves, so that its first step is planned as fast as the rest."""

from __future__ import annotations

import warnings

import numpy as np

from . import jit
from .config import DEFAULT_LLM_CAPACITY_FACTOR, PlannerConfig
from .solver import _repack, plan_step
from .types import EncoderItems, OversizeWarning, PlanError, StepInputs, Topology


def synthetic_step(num_samples: int, seed: int = 0) -> StepInputs:
    """A step shaped like multimodal training data: long-tailed text, images on about half the
    samples (some several), audio on a quarter."""
    rng = np.random.default_rng(seed)
    text = np.minimum(8192, rng.lognormal(5.5, 1.0, num_samples)).astype(np.int64) + 1
    vis_sample = np.sort(rng.choice(num_samples, num_samples, replace=True)[: num_samples // 2 + 1])
    vis = rng.choice([64, 256, 576, 1024, 4096], len(vis_sample)).astype(np.int64)
    aud_sample = np.sort(rng.choice(num_samples, num_samples // 4 + 1, replace=False))
    aud = rng.integers(50, 1500, len(aud_sample)).astype(np.int64)
    encoders = {"vision": EncoderItems(enc_len=vis, llm_len=vis // 4, sample=vis_sample),
                "audio": EncoderItems(enc_len=aud, llm_len=aud // 2, sample=aud_sample)}
    llm = text.copy()
    for e in encoders.values():
        np.add.at(llm, e.sample, e.llm_len)
    return StepInputs(text_len=text, llm_len=llm, encoders=encoders)


def warm_up(topology: Topology, config: PlannerConfig, samples_per_rank: int = 8) -> None:
    """Plan synthetic steps at `topology` under `config`, then, for the kernels those did not
    reach (real steps reach more: a capacity repair, equal lengths, another node count), the
    steps `warm_everything` plans: every kernel is loaded from numba's cache or compiled now
    (seconds on a fresh machine), not on a later step. A config the synthetic steps do not
    fit (capacities below their samples) warms what ran."""
    _plan_synthetic(topology, config, samples_per_rank)
    if jit.not_run():
        _warm_all()


def _plan_synthetic(topology: Topology, config: PlannerConfig, samples_per_rank: int) -> None:
    for seed in range(2):
        # The synthetic steps are no one's data: what they do not fit is neither an error nor
        # worth a warning (`oversize="isolate"` warns of each sample it isolates).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OversizeWarning)
            try:
                plan_step(synthetic_step(samples_per_rank * topology.world_size, seed), topology,
                          config)
            except PlanError:
                pass
    # the capacity repack's best fit, which only steps packed near their capacity reach
    _repack(np.array([3.0, 3.0, 2.0, 2.0, 2.0]), 2, 6.0)


def warm_everything() -> list[str]:
    """Every kernel loaded or compiled (`make install` and the data-node image fill numba's
    cache with it); returns the kernels still not reached (none, or a warm-up to extend)."""
    _warm_all()
    return jit.not_run()


def _warm_all() -> None:
    for world in (8, 64):
        for factor in (None, DEFAULT_LLM_CAPACITY_FACTOR):
            _plan_synthetic(Topology(world_size=world, ranks_per_node=8),
                            PlannerConfig(num_microbatches=2, llm_capacity_factor=factor), 8)


if __name__ == "__main__":
    missed = warm_everything()
    if missed:
        raise SystemExit(f"planner warm-up reached no call of {', '.join(missed)}")
