"""State the dispatcher keeps per reader, per shard being read, per trainer rank and per step.

Plain mutable records owned by the server's single loop thread; no behaviour beyond accessors,
so the server's rules stay in one place.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from dispatcher_server.batching import Sample, StepBatch
from dispatcher_server.protocol import reference_path


@dataclass(slots=True, kw_only=True)
class Assignment:
    """One shard handed to one reader; ids are never reused, so stale traffic is recognisable."""

    id: int
    pos: int
    reader: bytes
    credits: int = 0  # samples the reader may still send
    received: int = 0


@dataclass(slots=True, kw_only=True)
class Reader:
    ident: bytes
    name: str
    last_seen: float
    last_sent: float = 0.0
    ready: bool = False  # asked for shards (SHARD_REQUEST): assign whenever a slot is free
    slots: int = 1  # shards it holds at once: one being read, the rest queued behind it
    assignments: list[Assignment] = field(default_factory=list)  # in the order assigned


@dataclass(slots=True, kw_only=True)
class ShardProgress:
    """A shard position inside the window: received samples not yet consumed, and how far it got."""

    pos: int
    url: str
    next_index: int  # where a (re)assigned reader starts: one past the last sample received
    buffer: deque[Sample] = field(default_factory=deque)
    nbytes: int = 0
    assignment: int | None = None
    reader_done: bool = False

    @property
    def ref_path(self) -> bytes:
        """The file that `reference` payloads of this shard must name (see protocol.pack_ref)."""
        return reference_path(self.url).encode("utf-8", "surrogateescape")


@dataclass(slots=True, kw_only=True)
class TrainerSlot:
    """One data-parallel rank; survives its trainer reconnecting under a new socket identity."""

    rank: int
    ident: bytes | None = None
    last_seen: float = 0.0
    last_sent: float = 0.0
    next_send: int = 0  # next step to send
    received: int = 0  # steps below this were received (acknowledged)
    upto: int = 0  # credit: steps below this may be sent
    end_sent: bool = False


@dataclass(slots=True, kw_only=True)
class RetainedStep:
    """A planned step kept until every rank acknowledged it, so a reconnecting rank gets it again."""

    step: int
    epoch: int
    batch: StepBatch
    plan: object
    messages: list  # per rank, encoded lazily on first send
    num_samples: int
    nbytes: int  # bytes held: its samples' payloads, plus each rank message once encoded
