"""Credit control: how many more samples each reader may send, within the memory bounds.

Samples held anywhere in the dispatcher plus credits outstanding never exceed
`max_buffered_samples`; new credits stop at `max_buffered_bytes` (estimated from the average
sample size so far). Before any sample has arrived, that size is unknown, and one sample is
outstanding in all (the first assignment's) until one arrives: the bound holds from the first
sample on, at the price of one round trip at start. One exception keeps
the stream from deadlocking: the shard at the head of a source's order, when it has nothing
buffered and no credit, may always get samples, since every other buffer of that source waits
for it (and a shuffle block fills from it); past the byte bound, as many as a quarter of the
bound holds (HEAD_OVER_BOUND), and at least one.
"""

from __future__ import annotations

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
           held: Holdings, avg_sample_bytes: float, flow: FlowConfig,
           shard_cap: int) -> list[tuple[Assignment, int]]:
    """(assignment, samples) for every grant to make now, lowest position first.

    A grant tops an assignment up to two credit batches, and only by at least one batch (small
    grants cost a message each); `shard_cap` bounds one shard's buffer plus its credits.
    """
    outstanding = sum(a.credits for a in assignments)
    out = []
    for a in assignments:
        prog = progress[a.pos]
        room = min(shard_cap - len(prog.buffer) - a.credits,
                   flow.max_buffered_samples - held.samples - outstanding)
        starving = a.pos in heads and not prog.buffer and not a.credits
        if avg_sample_bytes <= 0:
            # No sample yet says how large they are: one sample in all until one does. Two
            # batches for every assignment held ten times --max-buffered-bytes of 1 MB images
            # before the first arrived; two batches in all, 64 clips of 50 MB (3.2 GB).
            room = min(room, 1 - outstanding)
        else:
            by_bytes = int((flow.max_buffered_bytes - held.nbytes) / avg_sample_bytes) - outstanding
            if starving:  # never stopped, but past the bound by a share of it at most
                by_bytes = max(1, by_bytes,
                               int(HEAD_OVER_BOUND * flow.max_buffered_bytes / avg_sample_bytes))
            room = min(room, by_bytes)
        want = min(room, 2 * flow.credit_batch - a.credits)
        if want <= 0 or (a.credits > 0 and want < flow.credit_batch):
            continue
        outstanding += want
        out.append((a, want))
    return out
