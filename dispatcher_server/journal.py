"""Append-only, fsync'd journal of the dispatcher: config fingerprint, per-step cursor and plan, commits.

Records are length-prefixed, CRC-checked msgpack, written and fsync'd before a step leaves the
dispatcher, so a crash at any point loses at most a torn last record (dropped on reopen).

Disk and memory stay flat however long the run. `journal.mmd` holds the config, one small
record per step (its cursor, digest and where its plan lies), the commits and the skipped keys.
Plans, the bulk, go to two plan files used in turn (`plans-0.mmd`, `plans-1.mmd`): once the one
being written passes `plan_file_bytes`, the writer switches to the other, truncating it first,
as soon as none of its plans is still needed (a plan is needed until a commit covers its step;
only those replay verbatim after a restart). In memory the journal keeps the entries of the
uncommitted steps and, for every other step, the offset of its record (8 bytes), from which an
older step's cursor is read back when a trainer resumes there.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import zlib
from array import array
from dataclasses import dataclass
from typing import Any, Iterator

import msgpack

log = logging.getLogger("mmdispatch.journal")

_HEAD = struct.Struct("<II")  # payload length, crc32 of payload
JOURNAL_FILE = "journal.mmd"
PLAN_FILES = ("plans-0.mmd", "plans-1.mmd")
#: Fingerprint fields a restore must match; world size is deliberately absent (elastic resume).
FINGERPRINT_FIELDS = ("shards", "seed", "mode", "global_batch", "token_budget")


class JournalError(ValueError):
    """The journal cannot be honoured: corrupted, or written for a different configuration."""


def pack_cursor(cursor: dict) -> bytes:
    """A wire cursor as kept in memory: msgpack bytes, ~15x smaller than the dict."""
    return msgpack.packb(cursor, use_bin_type=True)


def unpack_cursor(packed: bytes) -> dict:
    return msgpack.unpackb(packed, raw=False)


@dataclass(slots=True, kw_only=True)
class StepEntry:
    """A step as journaled. Entries held by `Journal.pending` keep `cursor_after` packed
    (`pack_cursor`); the cursor before a step is the previous step's `cursor_after`."""

    step: int
    epoch: int
    world_size: int
    cursor_after: dict | bytes
    num_samples: int
    digest: str  # hash of the step's sample keys, to catch data that changed under a replay
    plan: dict | None = None
    plan_at: tuple[int, int] | None = None  # (plan file, offset) where the plan was written


class Journal:
    """The dispatcher's durable state; one instance owns one directory."""

    def __init__(self, directory: str, fingerprint: dict[str, Any], *, fsync: bool = True,
                 plan_file_bytes: int = 64 << 20) -> None:
        """`plan_file_bytes`: a plan file this large hands over to the other once that one
        holds no plan still needed."""
        missing = [f for f in FINGERPRINT_FIELDS if f not in fingerprint]
        if missing:
            raise ValueError(f"journal fingerprint lacks fields {missing}")
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, JOURNAL_FILE)
        self.fsync = fsync
        if plan_file_bytes < 1:
            raise ValueError(f"plan_file_bytes must be positive, not {plan_file_bytes}")
        self.plan_file_bytes = plan_file_bytes
        self.fingerprint = {f: fingerprint[f] for f in FINGERPRINT_FIELDS}
        self.last_committed = -1
        #: step -> entry (plan included), for the steps not covered by a commit
        self.pending: dict[int, StepEntry] = {}
        self._offsets = array("q")  # step -> offset of its record in journal.mmd
        self.num_skipped = 0
        self._gen = 0  # the plan file being written
        self._size = self._load()
        self._file = open(self.path, "ab")
        self._reader = os.open(self.path, os.O_RDONLY)
        self._plans = [open(os.path.join(directory, name), "ab") for name in PLAN_FILES]
        self._plan_size = [f.seek(0, os.SEEK_END) for f in self._plans]
        self._plan_readers = [os.open(f.name, os.O_RDONLY) for f in self._plans]
        for entry in self.pending.values():
            if entry.plan is None and entry.plan_at is not None:
                entry.plan = self._read_plan(entry.step, entry.plan_at)
                if entry.plan is None:
                    log.warning("journal: the plan of uncommitted step %d is unreadable in %s; "
                                "it will be planned again", entry.step, PLAN_FILES[entry.plan_at[0]])
        if self._size == 0:
            self._append({"kind": "config", **self.fingerprint})

    @property
    def last_step(self) -> int:
        """The newest step recorded (-1 for none)."""
        return len(self._offsets) - 1

    # -- reading -----------------------------------------------------------------------
    def _load(self) -> int:
        """Apply the intact records of journal.mmd; returns its size once a torn tail is cut."""
        if not os.path.exists(self.path) or os.path.getsize(self.path) == 0:
            return 0
        with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            end = 0
            for at, end, rec in _records(data, self.path):
                self._apply(rec, at)
            torn = len(data) - end
        if torn:
            log.warning("journal: dropping a torn last record (%d bytes) of %s", torn, self.path)
            with open(self.path, "r+b") as f:
                f.truncate(end)
        return end

    def _apply(self, rec: dict, offset: int) -> None:
        kind = rec.get("kind")
        if kind == "config":
            theirs = {f: rec.get(f) for f in FINGERPRINT_FIELDS}
            diff = [f for f in FINGERPRINT_FIELDS if theirs[f] != self.fingerprint[f]]
            if diff:
                details = "; ".join(f"{f}: journal has {_short(theirs[f])}, config has "
                                    f"{_short(self.fingerprint[f])}" for f in diff)
                raise JournalError(
                    f"cannot resume from journal {self.path!r}: it was written for a different "
                    f"configuration ({details}). Restore the original settings or use a new "
                    "journal directory.")
        elif kind == "step":
            entry = _entry(rec)
            if entry.step > len(self._offsets):
                raise JournalError(f"journal {self.path!r} records step {entry.step} after step "
                                   f"{self.last_step}: it was not written by this dispatcher")
            # A re-planned step supersedes every later one (the run rewound to it).
            del self._offsets[entry.step:]
            for later in [s for s in self.pending if s > entry.step]:
                del self.pending[later]
            self._offsets.append(offset)
            if entry.plan is not None or entry.plan_at is not None:
                entry.cursor_after = pack_cursor(entry.cursor_after)
                self.pending[entry.step] = entry
                if entry.plan_at is not None:
                    self._gen = entry.plan_at[0]
            else:
                self.pending.pop(entry.step, None)
        elif kind == "commit":
            self.last_committed = max(self.last_committed, int(rec["step"]))
            # Committed steps are never replayed verbatim: their entries (plans) go.
            for s in [s for s in self.pending if s <= self.last_committed]:
                del self.pending[s]
        elif kind == "skipped":
            self.num_skipped += len(rec.get("keys", []))

    @staticmethod
    def _read_record(fd: int, offset: int) -> dict | None:
        head = os.pread(fd, _HEAD.size, offset)
        if len(head) < _HEAD.size:
            return None
        length, crc = _HEAD.unpack(head)
        payload = os.pread(fd, length, offset + _HEAD.size)
        if len(payload) != length or zlib.crc32(payload) != crc:
            return None
        return msgpack.unpackb(payload, raw=False, strict_map_key=False)

    def _read_step(self, step: int) -> dict:
        rec = self._read_record(self._reader, self._offsets[step])
        if rec is None:
            raise JournalError(f"journal {self.path!r}: the record of step {step} at byte "
                               f"{self._offsets[step]} no longer reads back intact")
        return rec

    def _read_plan(self, step: int, plan_at: tuple[int, int]) -> dict | None:
        """The plan of `step`, or None if its plan file was reused since (the step is committed)."""
        rec = self._read_record(self._plan_readers[plan_at[0]], plan_at[1])
        if rec is None or rec.get("step") != step:
            return None
        return rec["plan"]

    def cursor_after(self, step: int) -> dict:
        """The cursor after `step`: from memory for a pending step, else from the file."""
        if not 0 <= step <= self.last_step:
            raise JournalError(f"cannot resume at step {step + 1}: the journal knows steps "
                               f"0..{self.last_step}")
        entry = self.pending.get(step)
        if entry is not None:
            return unpack_cursor(entry.cursor_after)
        return self._read_step(step)["cursor_after"]

    def read_entry(self, step: int) -> StepEntry:
        """A step's entry as journaled; its plan None once the plan file it was in was reused."""
        if not 0 <= step <= self.last_step:
            raise JournalError(f"the journal knows steps 0..{self.last_step}, not {step}")
        entry = _entry(self._read_step(step))
        if entry.plan is None and entry.plan_at is not None:
            entry.plan = self._read_plan(step, entry.plan_at)
        return entry

    # -- writing -----------------------------------------------------------------------
    def _write(self, file, rec: dict) -> int:
        """Append one record to `file` (flushed, fsync'd unless disabled); its length."""
        payload = msgpack.packb(rec, use_bin_type=True)
        file.write(_HEAD.pack(len(payload), zlib.crc32(payload)) + payload)
        file.flush()
        if self.fsync:
            os.fsync(file.fileno())
        return _HEAD.size + len(payload)

    def _append(self, rec: dict) -> int:
        offset = self._size
        self._size += self._write(self._file, rec)
        return offset

    def _plan_file_for_next(self) -> int:
        """The plan file the next plan goes to: the current one, or the other once the current
        one is full and no pending step's plan lies in the other (which is then emptied)."""
        g = self._gen
        other = 1 - g
        if self._plan_size[g] < self.plan_file_bytes or any(
                e.plan_at is not None and e.plan_at[0] == other for e in self.pending.values()):
            return g
        self._plans[other].truncate(0)
        if self.fsync:
            os.fsync(self._plans[other].fileno())
        self._plan_size[other] = 0
        self._gen = other
        log.info("journal: plan file %s full (%d bytes), writing %s", PLAN_FILES[g],
                 self._plan_size[g], PLAN_FILES[other])
        return other

    def record_step(self, entry: StepEntry) -> None:
        """Persist a step's plan, then its cursor; called before any rank receives the step."""
        g = self._plan_file_for_next()
        at = self._plan_size[g]
        self._plan_size[g] += self._write(self._plans[g], {"step": entry.step, "plan": entry.plan})
        rec = {"kind": "step", "step": entry.step, "epoch": entry.epoch,
               "world_size": entry.world_size, "cursor_after": entry.cursor_after,
               "num_samples": entry.num_samples, "digest": entry.digest, "plan_at": [g, at]}
        self._apply(rec, self._append(rec))
        self.pending[entry.step].plan = entry.plan

    def commit(self, step: int) -> bool:
        """Record that trainers checkpointed `step`; False if it is not newer than the last commit."""
        if step <= self.last_committed:
            return False
        if step > self.last_step:
            raise JournalError(f"cannot commit step {step}: it was never planned "
                               f"(journal has steps up to {self.last_step})")
        rec = {"kind": "commit", "step": step}
        self._apply(rec, self._append(rec))
        return True

    def record_skipped(self, shard: str, skipped: list[tuple[str, str]]) -> None:
        """Remember bad samples by key, so 'exactly once' has an auditable exception list."""
        if skipped:
            self._append({"kind": "skipped", "shard": shard, "keys": [list(s) for s in skipped]})
            self.num_skipped += len(skipped)

    def close(self) -> None:
        for f in (self._file, *self._plans):
            if not f.closed:
                f.close()
        for fd in (self._reader, *self._plan_readers):
            if fd is not None:
                os.close(fd)
        self._reader, self._plan_readers = None, []


def _entry(rec: dict) -> StepEntry:
    """A step record as an entry; records of journals before plan files carried the plan inline
    (and the cursor before the step, which is the previous step's cursor after)."""
    plan_at = rec.get("plan_at")
    return StepEntry(step=int(rec["step"]), epoch=rec["epoch"], world_size=rec["world_size"],
                     cursor_after=rec["cursor_after"], num_samples=rec["num_samples"],
                     digest=rec["digest"], plan=rec.get("plan"),
                     plan_at=None if plan_at is None else (int(plan_at[0]), int(plan_at[1])))


def _records(data, path: str) -> Iterator[tuple[int, int, dict]]:
    """(offset, end, record) of each intact record; stops at a torn last record and raises
    JournalError for corruption anywhere before it."""
    at, size = 0, len(data)
    while at + _HEAD.size <= size:
        length, crc = _HEAD.unpack_from(data, at)
        end = at + _HEAD.size + length
        if end > size or zlib.crc32(data[at + _HEAD.size:end]) != crc:
            if end < size:
                raise JournalError(f"journal {path!r} is corrupted at byte {at}, not only its "
                                   "last record")
            return
        yield at, end, msgpack.unpackb(data[at + _HEAD.size:end], raw=False, strict_map_key=False)
        at = end


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
