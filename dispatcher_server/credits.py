"""Credit control: how many more samples each reader may send, within the memory bounds.

Samples held anywhere in the dispatcher plus credits outstanding never exceed
`max_buffered_samples`; new credits stop at `max_buffered_bytes`, with each credit outstanding
counted at the average sample size of its shard's source so far (a blend of captions and video
clips differs by four orders of magnitude: one average for all granted the clips by the
captions' size). Before a source's first sample arrives its size is unknown, and one sample of
such sources is outstanding in all until one arrives: the bound holds from the first sample on,
at the price of a round trip at start per source. One exception keeps
the stream from deadlocking: the shard at the head of a source's order, when it has nothing
buffered and no credit, may always get samples, since every other buffer of that source waits
for it (and a shuffle block fills from it); past the byte bound, as many as a quarter of the
bound holds (HEAD_OVER_BOUND), and at least one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dispatcher_server.assembler import ShardProgress
from dispatcher_server.config import FlowConfig
from dispatcher_server.readerpool import Assignment


#: The share of `max_buffered_bytes` a starving head shard may be granted past the byte bound:
#: two credit batches of 8 MiB images held 240 MB against a 32 MiB bound.
HEAD_OVER_BOUND = 0.25


@dataclass(slots=True, kw_only=True)
class Holdings:
    """What the dispatcher holds right now, in samples and payload bytes."""

    samples: int
    nbytes: int


def grants(assignments: list[Assignment], progress: dict[int, ShardProgress], *, heads: set[int],
           held: Holdings, sample_bytes: Callable[[int], float], flow: FlowConfig,
           shard_cap: int) -> list[tuple[Assignment, int]]:
    """(assignment, samples) for every grant to make now, lowest position first.

    `sample_bytes(pos)` is the size a sample of shard `pos` is expected to have (its source's
    average; 0 while unknown). A grant tops an assignment up to two credit batches, and only by
    at least one batch (small grants cost a message each); `shard_cap` bounds one shard's
    buffer plus its credits.
    """
    sizes = [sample_bytes(a.pos) for a in assignments]
    outstanding = sum(a.credits for a in assignments)
    # Credits outstanding, in bytes where their source's size is known, in samples where not.
    pending = sum(a.credits * size for a, size in zip(assignments, sizes) if size > 0)
    probing = sum(a.credits for a, size in zip(assignments, sizes) if size <= 0)
    out = []
    for a, size in zip(assignments, sizes):
        prog = progress[a.pos]
        room = min(shard_cap - len(prog.buffer) - a.credits,
                   flow.max_buffered_samples - held.samples - outstanding)
        starving = a.pos in heads and not prog.buffer and not a.credits
        if size <= 0:
            # No sample of its source yet says how large they are: one sample in all until one
            # does. Two batches for every assignment held ten times --max-buffered-bytes of 1 MB
            # images before the first arrived; two batches in all, 64 clips of 50 MB (3.2 GB).
            room = min(room, 1 - probing)
        else:
            by_bytes = int((flow.max_buffered_bytes - held.nbytes - pending) / size)
            if starving:  # never stopped, but past the bound by a share of it at most
                by_bytes = max(1, by_bytes, int(HEAD_OVER_BOUND * flow.max_buffered_bytes / size))
            room = min(room, by_bytes)
        want = min(room, 2 * flow.credit_batch - a.credits)
        if want <= 0 or (a.credits > 0 and want < flow.credit_batch):
            continue
        outstanding += want
        if size > 0:
            pending += want * size
        else:
            probing += want
        out.append((a, want))
    return out
