"""Credit control: how many more samples each reader may send, within the memory bounds.

Samples held anywhere in the dispatcher plus credits outstanding never exceed
`max_buffered_samples`; new credits stop at `max_buffered_bytes` (estimated from the average
sample size so far). Before any sample has arrived, that size is unknown, and the credits
outstanding stop at two credit batches in all (one assignment's grant). One exception keeps the stream from deadlocking:
the shard at the head of a source's order, when it has nothing buffered and no credit, may
always get samples, since every other buffer of that source waits for it (and a shuffle block
fills from it).
"""

from __future__ import annotations

from dataclasses import dataclass

from dispatcher_server.assembler import ShardProgress
from dispatcher_server.config import FlowConfig
from dispatcher_server.readerpool import Assignment


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
            # No sample yet says how large they are: two batches for every assignment of every
            # reader held ten times --max-buffered-bytes of 1 MB images before the first arrived.
            room = min(room, 2 * flow.credit_batch - outstanding)
        elif not starving:
            room = min(room, int((flow.max_buffered_bytes - held.nbytes) / avg_sample_bytes)
                       - outstanding)
        want = min(room, 2 * flow.credit_batch - a.credits)
        if want <= 0 or (a.credits > 0 and want < flow.credit_batch):
            continue
        outstanding += want
        out.append((a, want))
    return out
