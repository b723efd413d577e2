"""The global sample order: shard positions per epoch and the cursor that counts raw samples.

A position `pos = epoch * num_shards + i` names the i-th shard of that epoch's permutation,
which depends only on (shard list, seed, epoch). The cursor records which raw samples are
consumed as positions (base: everything before it; partial: next index per open position;
done: finished positions above base), so resuming never depends on who read what, and a resume
with another world size restarts planning from exactly the same sample.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field


def epoch_order(num_shards: int, seed: int, epoch: int, salt: str = "") -> list[int]:
    """Shard indices in the order epoch `epoch` reads them (portable: hash-sorted, not RNG);
    `salt` (a source's name) gives each source of a blend its own orders."""

    def rank(i: int) -> bytes:
        return hashlib.blake2b(f"{seed}:{salt}{epoch}:{i}".encode(), digest_size=8).digest()

    return sorted(range(num_shards), key=rank)


class ShardOrder:
    """Maps global positions to (epoch, shard URL), caching one permutation per epoch."""

    def __init__(self, shards: list[str], seed: int, max_epochs: int | None, salt: str = "") -> None:
        if not shards:
            raise ValueError("the shard list is empty")
        self.shards = list(shards)
        self.seed = seed
        self.salt = salt
        self.max_epochs = max_epochs
        # Plain attributes, not properties: the pump reads them for every block it moves.
        self.num_shards = len(self.shards)
        #: One past the last position, or None when epochs are unbounded.
        self.end = None if max_epochs is None else max_epochs * self.num_shards
        self._orders: dict[int, list[int]] = {}

    def epoch_of(self, pos: int) -> int:
        return pos // self.num_shards

    def epoch_end(self, pos: int) -> int:
        return (self.epoch_of(pos) + 1) * self.num_shards

    def url(self, pos: int) -> str:
        epoch, i = divmod(pos, self.num_shards)
        order = self._orders.get(epoch)
        if order is None:
            if len(self._orders) > 4:
                self._orders.clear()
            order = self._orders[epoch] = epoch_order(self.num_shards, self.seed, epoch, self.salt)
        return self.shards[order[i]]


@dataclass(slots=True)
class Cursor:
    """Consumed raw samples: all positions < base, `partial[pos]` first indices, `done` above base."""

    base: int = 0
    partial: dict[int, int] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)

    def consume(self, pos: int, index: int) -> None:
        assert pos >= self.base and pos not in self.done, (pos, self.base)
        self.partial[pos] = index + 1

    def finish(self, pos: int) -> None:
        self.partial.pop(pos, None)
        self.done.add(pos)
        while self.base in self.done:
            self.done.remove(self.base)
            self.base += 1

    def start_index(self, pos: int) -> int:
        """Where reading `pos` must start for nothing consumed to be read again."""
        return self.partial.get(pos, 0)

    def is_open(self, pos: int) -> bool:
        return pos >= self.base and pos not in self.done

    def copy(self) -> Cursor:
        return Cursor(self.base, dict(self.partial), set(self.done))

    def to_wire(self) -> dict:
        return {"base": self.base, "partial": sorted([p, i] for p, i in self.partial.items()),
                "done": sorted(self.done)}

    @staticmethod
    def from_wire(d: dict) -> Cursor:
        return Cursor(int(d["base"]), {int(p): int(i) for p, i in d["partial"]},
                      {int(p) for p in d["done"]})
