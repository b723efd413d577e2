"""The blend: which source each next sample of the global sequence comes from, and the seeded
shuffle of each source's samples in blocks.

The schedule is deterministic and low-discrepancy: draw t goes to the source furthest behind its
weight (`w_s * (t + 1) + phase_s - drawn_s` largest, phases seeded), so after any number of draws
every source's count is within about one sample of `w_s * t`, and the share of any window of n
consecutive samples is within about 2/n of the weight. Its whole state is the per-source counts,
which the cursor journals: a resume, at any world size, continues the same sequence.

The phases lie within 1/(2S) above 1/2 for S sources (`_phases`), which makes whole quotas exact:
after t draws where every `w_s * t` is a whole number, each source holds exactly that many. So
weights equal to the sources' sizes read every sample once before any source starts its second
epoch, however small a source is.
"""

from __future__ import annotations

import hashlib
from fractions import Fraction

import numpy as np


def _unit(*parts: object) -> float:
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def normalized(weights: list[float]) -> list[float]:
    """`weights` scaled to sum to 1, each the float nearest its exact share of the weights as
    written (their shortest decimal form, which is what a dataset file holds): so weights written
    another way in proportion (6/3/1, 0.6/0.3/0.1, 1.2/0.6/0.2) normalize to the very same
    floats, draw the same sequence and resume one another's journals. Float division gave
    0.09999999999999999 for 1/10 of 6/3/1 and 0.1 for 0.1 of 0.6/0.3/0.1. Exact arithmetic
    also keeps finite weights whose float sum overflows (1e308 + 1e308) apart from 0."""
    exact = [Fraction(repr(float(w))) for w in weights]
    total = sum(exact)
    return [float(w / total) for w in exact]


def same_setting(name: str, a: object, b: object) -> bool:
    """Whether two fingerprints' values of field `name` make the same sample sequence. A
    dataset's `sources` ([name, weight, shards] each) compare their weights as the blend draws
    them, normalized: weights 5/3/2 and 0.5/0.3/0.2 are one blend."""
    if name != "sources" or a == b:
        return a == b
    try:
        return _drawn_as(a) == _drawn_as(b)
    except (TypeError, ValueError, IndexError):  # not a sources list: as written
        return False


def _drawn_as(sources: list) -> list:
    shares = normalized([float(s[1]) for s in sources])
    return [[s[0], w, *s[2:]] for s, w in zip(sources, shares)]


def as_drawn(fingerprint: dict) -> dict:
    """`fingerprint` with its sources' weights normalized: one form for each blend."""
    if not fingerprint.get("sources"):
        return fingerprint
    return {**fingerprint, "sources": _drawn_as(fingerprint["sources"])}


def differing(a: dict, b: dict) -> list[str]:
    """The fields in which two fingerprints make another sample sequence (`same_setting`)."""
    return [n for n in sorted(set(a) | set(b)) if not same_setting(n, a.get(n), b.get(n))]


def _phases(seed: int, num_sources: int) -> list[float]:
    """Each source's seeded phase, in [1/2, 1/2 + 1/(2S)). The seed orders sources of equal
    weight; the narrow range keeps whole quotas exact: before each draw t the gaps sum to
    sum(phases) + 1, so their largest is at least 1/2 + 1/S, while a source that already holds
    its quota w_s * t has a gap of at most its phase, under 1/2 + 1/(2S): it is never drawn
    before the others reach theirs. Phases spread over [0, 1) let a tiny source run up to a
    whole sample ahead, which for a source of 2 samples weighted by its size ended a
    --max-epochs 1 job at 91% of the other sources' epochs."""
    return [0.5 + _unit("blend", seed, s) / (2 * num_sources) for s in range(num_sources)]


class Blend:
    """Weighted, seeded, deterministic source schedule; `drawn` is its state."""

    def __init__(self, weights: list[float], seed: int, drawn: list[int] | None = None) -> None:
        if not weights or not all(0 < w < float("inf") for w in weights):
            raise ValueError(f"blend weights must be finite and positive, got {weights}")
        self.weights = normalized(weights)
        self.phases = _phases(seed, len(weights))
        self.drawn = list(drawn) if drawn is not None else [0] * len(weights)
        if len(self.drawn) != len(weights):
            raise ValueError(f"a blend position of {len(self.drawn)} sources cannot resume a "
                             f"dataset of {len(weights)}")

    @property
    def total(self) -> int:
        return sum(self.drawn)

    def next_source(self) -> int:
        """The source the next draw comes from (does not draw)."""
        if len(self.weights) == 1:
            return 0
        t = self.total + 1
        best, best_gap = 0, -1e300
        for s, (w, ph, n) in enumerate(zip(self.weights, self.phases, self.drawn)):
            gap = w * t + ph - n
            if gap > best_gap:
                best, best_gap = s, gap
        return best

    def run(self, limit: int) -> tuple[int, int]:
        """(source, n): the next source and how many of the next `limit` draws in a row go to it."""
        s = self.next_source()
        if len(self.weights) == 1:
            return s, limit
        n = 1
        self.drawn[s] += 1
        while n < limit and self.next_source() == s:
            self.drawn[s] += 1
            n += 1
        self.drawn[s] -= n
        return s, n

    def draw(self, source: int, n: int) -> None:
        self.drawn[source] += n


def block_permutation(seed: int, source: str, pos: int, index: int, n: int) -> list[int]:
    """The order a shuffle block of `n` samples is emitted in, a function of the block's first
    sample (its global shard position and index) and the seed only: never of reader timing."""
    digest = hashlib.blake2b(f"shuffle:{seed}:{source}:{pos}:{index}".encode(), digest_size=8).digest()
    rng = np.random.Generator(np.random.PCG64(int.from_bytes(digest, "little")))
    return rng.permutation(n).tolist()
