"""Shared fixtures: small generated shards that any test may read (never write)."""

from __future__ import annotations

import pytest

from pipeline.gendata import generate

SMALL_NUM_SAMPLES = 64
SMALL_NUM_SHARDS = 4


@pytest.fixture(scope="session")
def small_shards(tmp_path_factory) -> list[str]:
    """Paths of 4 generated shards holding 64 samples in total (seed 1); treat as read-only."""
    out = tmp_path_factory.mktemp("small_shards")
    return generate(str(out), num_samples=SMALL_NUM_SAMPLES, num_shards=SMALL_NUM_SHARDS, seed=1)


@pytest.fixture(autouse=True)
def _forget_counted_skip_warnings():
    """Skip warnings counted but not yet logged belong to the test that caused them: without
    this, the process's exit would log them to a capture stream pytest has closed."""
    yield
    from pipeline.errors import DIGEST

    with DIGEST.lock:
        DIGEST.pending.clear()
