"""The readers the dispatcher knows and the shards each one holds.

Decides who reads what: the lowest unassigned positions go to the ready readers holding the
fewest shards, and a lost reader's low position may preempt the highest held one (only lower
positions drain in deterministic order). Returns what must be said to readers instead of
saying it, so it is tested without sockets; assignment ids are never reused, so stale
traffic is recognisable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dispatcher_server.protocol import MAX_READER_SHARDS, ReaderEndpoint


@dataclass(slots=True, kw_only=True)
class Assignment:
    """One shard position handed to one reader."""

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
    payload: int = -1  # direct payload mode: its entry in ReaderPool.endpoints
    instance: str = ""  # its process's HELLO `instance`: a reconnect of it says the same
    node: str = ""  # its host (HELLO `node`; "" before v9 HELLOs said it): readers of one node share files


def process(reader: Reader) -> str | bytes:
    """A reader's process: its HELLO `instance` (kept across reconnects), else its socket."""
    return reader.instance or reader.ident


class ReaderPool:
    """Readers by socket identity and their assignments by id."""

    def __init__(self) -> None:
        self.readers: dict[bytes, Reader] = {}
        self.assignments: dict[int, Assignment] = {}
        self.next_id = 1
        # direct payload mode: every payload endpoint ever reported, never reused or removed, so
        # a sample's holder (an index here) stays valid while its step is retained
        self.endpoints: list[ReaderEndpoint] = []
        self._endpoint_index: dict[ReaderEndpoint, int] = {}
        # position -> the readers (by `process`) that could not open its shard: it is not
        # assigned to them again, so a node missing a mount or a file leaves it to the others
        self.refused: dict[int, set] = {}

    def join(self, ident: bytes, name: str, now: float, instance: str = "",
             node: str = "") -> Reader:
        reader = self.readers[ident] = Reader(ident=ident, name=name, last_seen=now,
                                              instance=instance, node=node or name)
        return reader

    def earlier_session(self, ident: bytes, instance: str) -> Reader | None:
        """The reader that process `instance` connected as before, from another socket (it
        reconnected, e.g. after the dispatcher stalled past its timeout), if still here."""
        if not instance:
            return None
        return next((r for r in self.readers.values()
                     if r.instance == instance and r.ident != ident), None)

    def request(self, reader: Reader, shards: int) -> None:
        reader.ready = True
        reader.slots = max(1, min(shards, MAX_READER_SHARDS))

    def serves(self, reader: Reader, endpoint: str, key: str) -> bool:
        """`reader` serves payloads at `endpoint`; True when the live table changed."""
        entry = ReaderEndpoint(endpoint, key)
        index = self._endpoint_index.setdefault(entry, len(self.endpoints))
        if index == len(self.endpoints):
            self.endpoints.append(entry)
        changed, reader.payload = reader.payload != index, index
        return changed

    def live_endpoints(self) -> list[ReaderEndpoint]:
        """The payload endpoints of the readers connected now, each once."""
        return list(dict.fromkeys(self.endpoints[r.payload] for r in self.readers.values()
                                  if r.payload >= 0))

    def find(self, reader: Reader, assign_id: int) -> Assignment | None:
        """`reader`'s assignment `assign_id`, or None if it is stale or someone else's."""
        a = self.assignments.get(assign_id)
        return a if a is not None and a.reader == reader.ident else None

    def assign(self, todo: list[int]) -> list[tuple[Reader, Assignment]]:
        """Hand positions `todo` (lowest first) to ready readers with a free slot, each to the one
        holding the fewest shards (every reader gets one to read before any gets one queued)."""
        free = [r for r in self.readers.values() if r.ready and len(r.assignments) < r.slots]
        made = []
        for pos in todo:
            if not free:
                break
            refused = self.refused.get(pos)
            able = [r for r in free if process(r) not in refused] if refused else free
            if not able:
                continue
            reader = min(able, key=lambda r: len(r.assignments))
            a = Assignment(id=self.next_id, pos=pos, reader=reader.ident)
            self.next_id += 1
            reader.assignments.append(a)
            if len(reader.assignments) >= reader.slots:
                free.remove(reader)
            self.assignments[a.id] = a
            made.append((reader, a))
        return made

    def can_open(self, pos: int) -> bool:
        """Whether a connected reader that asked for shards has not failed to open `pos`'s."""
        refused = self.refused.get(pos, ())
        return any(r.ready and process(r) not in refused for r in self.readers.values())

    def has_free_slot(self) -> bool:
        return any(len(r.assignments) < r.slots for r in self.readers.values())

    def victim(self, todo: list[int], needed: set[int] = frozenset()
               ) -> tuple[Reader, Assignment] | None:
        """The assignment to cancel so that the first waiting position gets read when every
        reader is full: the highest held one, if it lies above it or the order needs that
        position first (`needed`: arrival mode replaying its recorded order); a needed
        position is never the one cancelled."""
        if not todo or not self.assignments or self.has_free_slot():
            return None
        refused = self.refused.get(todo[0], ())  # a reader that cannot open it frees no slot for it
        held = [a for a in self.assignments.values() if a.pos not in needed
                and not (refused and a.reader in self.readers
                         and process(self.readers[a.reader]) in refused)]
        if not held:
            return None
        a = max(held, key=lambda a: a.pos)
        reader = self.readers.get(a.reader)
        if (a.pos < todo[0] and todo[0] not in needed) or reader is None:
            return None
        return reader, a

    def release(self, reader: Reader, a: Assignment) -> None:
        self.assignments.pop(a.id, None)
        reader.assignments.remove(a)

    def drop(self, reader: Reader) -> list[Assignment]:
        """Forget `reader`; returns the assignments it held (their shards are free again)."""
        held = list(reader.assignments)
        for a in held:
            self.release(reader, a)
        self.readers.pop(reader.ident, None)
        return held

    def by_position(self) -> list[Assignment]:
        return sorted(self.assignments.values(), key=lambda a: a.pos)
