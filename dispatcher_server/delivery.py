"""Delivery: planned steps kept until every rank acknowledged them, sent within each rank's credits.

A rank's STEP message is encoded on its first send and kept with the step, so a rank that
reconnects gets the same bytes again; a step is evicted once every rank's credits say it was
received. The stream ends for a rank (END) once no step will ever be planned again and it was
sent every planned one. No sockets: `sends` yields what to send to whom.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator

from dispatcher_server.batching import StepBatch


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
    # Its trainer said BYE: it left on purpose (not lost); `left_at`, the step after the last its
    # loop took, where it said (steps from there untrained: it stopped early, if the stream
    # went on past it).
    said_bye: bool = False
    left_at: int | None = None
    # Its trainer went silent (no BYE) since it last connected: a done job waits for its restart
    # while steps after the last commit may be untrained there (`Dispatcher._resumable_after_loss`).
    lost: bool = False
    # The step its trainer resumed at from a checkpoint, until its credit shows it trained
    # that step (`upto` past `resumed_until`): ranks of one restart must resume at one step.
    resumed: int | None = None
    resumed_until: int = 0
    # The step its trainer started at without a position (no checkpoint), until it trained that
    # step: the other ranks of its restart start there too, and that step is kept for them.
    fresh: int | None = None
    fresh_until: int = 0
    # Its trainer connected to this dispatcher: its position is known. After a restart a rank
    # that has not (it may never have started) may need any step since the last commit.
    heard: bool = False
    # The latest step this rank committed (its checkpoint); None: none heard by this dispatcher.
    committed: int | None = None


@dataclass(slots=True, kw_only=True)
class RetainedStep:
    """A planned step kept until every rank acknowledged it, so a reconnecting rank gets it again."""

    step: int
    epoch: int
    batch: StepBatch
    plan: object
    messages: list | None  # per rank, all encoded on the first send
    num_samples: int
    nbytes: int  # bytes held: its samples' payloads, then its rank messages once encoded


class Delivery:
    """Trainer slots, the retained steps and the next step to plan."""

    def __init__(self, world_size: int, max_retained_steps: int,
                 max_bytes: float = float("inf")) -> None:
        self.slots = [TrainerSlot(rank=r) for r in range(world_size)]
        self._by_ident: dict[bytes, TrainerSlot] = {}
        self._connected = 0  # slots with an ident: read on every HELLO (O(W) each was O(W^2))
        # Ranks that may have a step to send: only they are looked at on a send, so a pump
        # costs O(ranks that changed), not O(W), at thousands of ranks.
        self._due: set[int] = set()
        self.max_retained_steps = max_retained_steps
        self.max_bytes = max_bytes
        self.retained: deque[RetainedStep] = deque()
        self.next_plan = 0
        # Eviction needs the lowest `received` of all ranks. It is recounted (O(W)) only when the
        # last rank at the old lowest moves up: once per step, not once per acknowledgement.
        self._floor = 0
        self._at_floor = world_size
        self._resumed: dict[int, set[int]] = {}  # resume step -> ranks still at it
        # Start step of ranks without a position -> those not yet past it, and all that started
        # there: the step is kept while some rank of the restart may still come for it.
        self._fresh: dict[int, set[int]] = {}
        self._fresh_joined: dict[int, set[int]] = {}

    def reset(self, step: int) -> None:
        """Deliver from `step` on: retained steps go (they are planned again)."""
        self.retained.clear()
        self.next_plan = step
        for slot in self.slots:
            # A rank already past `step` (its credits say so) keeps its place: lowering it would
            # hold every later step until that rank, which never asks again, acknowledged them.
            slot.next_send = slot.received = max(step, slot.received)
            # A rank gone since it was told the end (BYE) is not sent it again: it would hold
            # `all_received` false for good, and `--exit-when-done` would never exit. One that
            # comes back is rewound (`rewind_slot`), which clears it.
            slot.end_sent = slot.end_sent and slot.ident is None
        self._due = set(range(len(self.slots)))
        self._recount_floor()

    @property
    def lowest(self) -> int:
        """The oldest step a rank can still be sent."""
        return self.retained[0].step if self.retained else self.next_plan

    def has_room(self) -> bool:
        """Whether another step may be planned: fewer than `max_retained_steps` are retained,
        and those hold fewer than `max_bytes` (one step always may be: steps of large inline
        payloads, planned ahead by count alone, held 4 steps' bytes past the credits' bound)."""
        if len(self.retained) >= self.max_retained_steps:
            return False
        return not self.retained or self.held()[1] < self.max_bytes

    def add(self, rs: RetainedStep) -> None:
        assert rs.step == self.next_plan, (rs.step, self.next_plan)
        self.retained.append(rs)
        self.next_plan = rs.step + 1
        self._due = set(range(len(self.slots)))

    def credit(self, slot: TrainerSlot, upto: int, received: int) -> None:
        """A rank's credit: steps below `upto` may be sent; it has received those below `received`."""
        slot.upto = upto
        slot.heard = True
        if received > slot.received:
            self._set_received(slot, received)
        if slot.resumed is not None and upto > slot.resumed_until:
            self._forget_resume(slot)
        if slot.fresh is not None and upto > slot.fresh_until:
            self._forget_fresh(slot)
        self._due.add(slot.rank)

    def resumed_elsewhere(self, slot: TrainerSlot, step: int, heard_since: float) -> TrainerSlot | None:
        """A connected rank, heard from since `heard_since`, that resumed from a checkpoint at
        another step than `step` and has not trained past it: `slot`'s checkpoint and its are
        not of one moment. O(1) while every rank resumes at one step."""
        found = self._live_peer(self._resumed, slot, heard_since, skip=step)
        return None if found is None else found[1]

    def _live_peer(self, registry: dict[int, set[int]], slot: TrainerSlot, heard_since: float,
                   skip: int | None = None) -> tuple[int, TrainerSlot] | None:
        """(step, slot) of a connected rank of `registry` (step -> ranks) other than `slot`,
        heard from since `heard_since`, at a step other than `skip`; None if there is none."""
        for at, ranks in registry.items():
            if at == skip:
                continue
            for rank in ranks:
                other = self.slots[rank]
                if other is not slot and other.ident is not None and other.last_seen >= heard_since:
                    return at, other
        return None

    def mark_resumed(self, slot: TrainerSlot, step: int | None, prefetch: int) -> None:
        """`slot`'s trainer resumed at `step` from a checkpoint (None: it did not); `prefetch`:
        the steps its credits run ahead of its training loop."""
        self._forget_resume(slot)
        if step is not None:
            # Its credit reaches past this once it takes the step after `step`: trained it.
            slot.resumed, slot.resumed_until = step, step + 1 + max(1, prefetch)
            self._resumed.setdefault(step, set()).add(slot.rank)

    def fresh_start(self, slot: TrainerSlot, heard_since: float) -> int | None:
        """The step where a connected rank, heard from since `heard_since`, started without a
        position and has not trained past: ranks restarted together without checkpoints start
        there together. `lowest` alone parted them: the step one took was evicted once the
        others' old processes, still connected, had received it too."""
        found = self._live_peer(self._fresh, slot, heard_since)
        return None if found is None else found[0]

    def mark_fresh(self, slot: TrainerSlot, step: int | None, prefetch: int) -> None:
        """`slot`'s trainer started at `step` without a position (None: it had one); that step
        is kept for the rest of its restart (`evict`) until every rank started there, or those
        that did trained past it."""
        self._forget_fresh(slot)
        if step is None:
            return
        joined = self._fresh_joined.setdefault(step, set())
        joined.add(slot.rank)
        if len(joined) == len(self.slots):  # the whole restart is here: nothing to keep
            for rank in self._fresh.pop(step, ()):
                self.slots[rank].fresh = None
            del self._fresh_joined[step]
            return
        slot.fresh, slot.fresh_until = step, step + 1 + max(1, prefetch)
        self._fresh.setdefault(step, set()).add(slot.rank)

    def _forget_fresh(self, slot: TrainerSlot) -> None:
        if slot.fresh is not None and _unregister(self._fresh, slot.fresh, slot.rank):
            self._fresh_joined.pop(slot.fresh, None)
        slot.fresh = None

    def _forget_resume(self, slot: TrainerSlot) -> None:
        if slot.resumed is not None:
            _unregister(self._resumed, slot.resumed, slot.rank)
        slot.resumed = None

    def rewind_slot(self, slot: TrainerSlot, step: int, prefetch: int) -> None:
        """A (re)connected rank starts at `step` with `prefetch` steps of credit."""
        self._set_received(slot, step)
        slot.next_send = step
        slot.upto = step + max(1, prefetch)
        slot.end_sent = False
        self._due.add(slot.rank)

    def sends(self, encode: Callable[[RetainedStep], list]) -> Iterator[tuple[TrainerSlot, list]]:
        """(slot, frames) of every step a connected rank may be sent now, in order; `encode`
        builds all ranks' messages of a step the first time one of them is needed."""
        first = self.lowest
        due, self._due = self._due, set()
        for rank in sorted(due):
            slot = self.slots[rank]
            if slot.ident is None:
                continue
            while slot.next_send < slot.upto and first <= slot.next_send < self.next_plan:
                rs = self.retained[slot.next_send - first]
                if rs.messages is None:
                    rs.messages = encode(rs)
                    # The messages stand for the samples now (`encode` lets their payloads
                    # go): kept until the step is evicted, they count against
                    # max_buffered_bytes in the samples' place.
                    rs.nbytes = _nbytes(rs.messages)
                yield slot, rs.messages[slot.rank]
                slot.next_send += 1

    def ends_due(self) -> list[TrainerSlot]:
        """Connected ranks that were sent every planned step and not yet END (call once no step
        will ever be planned again)."""
        return [s for s in self.slots if s.ident is not None and not s.end_sent
                and s.next_send >= self.next_plan]

    def _set_received(self, slot: TrainerSlot, received: int) -> None:
        """Move a rank's `received`, keeping (_floor, _at_floor) in O(1): the floor is the
        lowest `received` of all ranks and _at_floor how many sit on it, or 0 when none does any
        more (evict recounts then). No HELLO recounts every rank, so a connect storm at
        thousands of ranks costs O(W), not O(W^2)."""
        if slot.received == self._floor and self._at_floor:
            self._at_floor -= 1
        slot.received = received
        if received < self._floor:
            self._floor, self._at_floor = received, 1
        elif received == self._floor:
            self._at_floor += 1

    def _recount_floor(self) -> None:
        received = [s.received for s in self.slots]
        self._floor = min(received)
        self._at_floor = received.count(self._floor)

    def evict(self) -> None:
        """Forget the retained steps every rank has received."""
        if self._at_floor == 0:
            self._recount_floor()
        floor = min(self._floor, min(self._fresh)) if self._fresh else self._floor
        while self.retained and self.retained[0].step < floor:
            self.retained.popleft()

    def all_received(self, finished_before: bool = False) -> bool:
        """Every rank acknowledged the last step and was told the stream ended, or said BYE
        (it left on purpose: what it did not train, its BYE's `next_step` says, and a done job
        waits for its restart, `Dispatcher._resumable_after_loss`; before, a rank that left
        before the last steps reached it held the exit for good, saying nothing): a trainer
        whose earlier dispatcher sent it END comes back to a restarted one only to commit, its
        position past the steps the restart plans again, and leaves before they end the stream
        again. `finished_before`: the journal's commit
        covers the last step, so a rank this dispatcher never heard from finished with the one
        before it (it said BYE there and will not come back)."""
        return all(s.said_bye or (s.end_sent and s.received >= self.next_plan)
                   or (finished_before and not s.heard) for s in self.slots)

    def connected(self) -> int:
        return self._connected

    def slot_of(self, ident: bytes) -> TrainerSlot | None:
        slot = self._by_ident.get(ident)
        return slot if slot is not None and slot.ident == ident else None

    def connect(self, slot: TrainerSlot, ident: bytes) -> None:
        """`slot`'s rank now speaks from socket `ident` (a reconnect replaces the old one)."""
        if slot.ident is not None:
            self._by_ident.pop(slot.ident, None)
        else:
            self._connected += 1
        slot.ident = ident
        slot.heard = True
        slot.said_bye, slot.left_at, slot.lost = False, None, False
        self._by_ident[ident] = slot

    def disconnect(self, slot: TrainerSlot, *, bye: bool = False) -> None:
        """`slot`'s trainer is gone: it said BYE (`bye`), or was lost or refused."""
        slot.said_bye = bye
        if slot.ident is not None:
            self._by_ident.pop(slot.ident, None)
            self._connected -= 1
        slot.ident = None
        self._forget_resume(slot)
        self._forget_fresh(slot)

    def held(self) -> tuple[int, int]:
        return (sum(rs.num_samples for rs in self.retained),
                sum(rs.nbytes for rs in self.retained))


def _unregister(registry: dict[int, set[int]], step: int, rank: int) -> bool:
    """Take `rank` out of `registry[step]`; True when that left the step without ranks."""
    ranks = registry.get(step)
    if ranks is None:
        return False
    ranks.discard(rank)
    if ranks:
        return False
    del registry[step]
    return True


def _nbytes(messages: list[list]) -> int:
    """Bytes held by a step's rank messages; frames that are views of one buffer count once."""
    seen, total = set(), 0
    for frames in messages:
        for f in frames:
            base = getattr(f, "base", None)
            if base is not None:
                if id(base) not in seen:
                    seen.add(id(base))
                    total += base.nbytes
            else:
                total += memoryview(f).nbytes
    return total
