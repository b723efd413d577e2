"""Append-only, fsync'd journal of the dispatcher: config fingerprint, per-step cursor and plan, commits.

Records are length-prefixed, CRC-checked msgpack, written and fsync'd before a step leaves the
dispatcher, so a crash at any point loses at most a torn last record (dropped on reopen).

Memory stays flat however long the run: the journal holds in memory the entries of the steps
after the last commit (the only ones a restart replays verbatim, plans included) and, for every
other step, only the file offset of its record (8 bytes), from which the cursor of an older step
is read back when a trainer resumes there. Opening a journal whose file is mostly plans no
longer needed (committed or superseded steps) rewrites it first, plans stripped, so the file and
the time to reopen it grow with the steps' cursors, not with their plans.
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
#: Fingerprint fields a restore must match; world size is deliberately absent (elastic resume).
FINGERPRINT_FIELDS = ("shards", "seed", "mode", "global_batch", "token_budget")
#: Reopening rewrites a file of at least COMPACT_MIN_BYTES when at least this share of its step
#: records carry plans no longer needed or were superseded.
COMPACT_STALE_SHARE = 0.5
COMPACT_MIN_BYTES = 1 << 20


class JournalError(ValueError):
    """The journal cannot be honoured: corrupted, or written for a different configuration."""


def pack_cursor(cursor: dict) -> bytes:
    """A wire cursor as kept in memory: msgpack bytes, ~15x smaller than the dict."""
    return msgpack.packb(cursor, use_bin_type=True)


def unpack_cursor(packed: bytes) -> dict:
    return msgpack.unpackb(packed, raw=False)


@dataclass(slots=True, kw_only=True)
class StepEntry:
    """A step as written. Entries held by `Journal.pending` keep `cursor_after` packed
    (`pack_cursor`) and `cursor_before` None: it is the previous step's `cursor_after`."""

    step: int
    epoch: int
    world_size: int
    cursor_before: dict | None
    cursor_after: dict | bytes
    num_samples: int
    digest: str  # hash of the step's sample keys, to catch data that changed under a replay
    plan: dict | None = None


class Journal:
    """The dispatcher's durable state; one instance owns one directory."""

    def __init__(self, directory: str, fingerprint: dict[str, Any], *, fsync: bool = True) -> None:
        missing = [f for f in FINGERPRINT_FIELDS if f not in fingerprint]
        if missing:
            raise ValueError(f"journal fingerprint lacks fields {missing}")
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.path = os.path.join(directory, JOURNAL_FILE)
        self.fsync = fsync
        self.fingerprint = {f: fingerprint[f] for f in FINGERPRINT_FIELDS}
        self._file = None
        self._reader: int | None = None
        self._load()
        if self._size >= COMPACT_MIN_BYTES and self._stale >= COMPACT_STALE_SHARE * len(self._offsets):
            self._compact()
            self._load()
        self._file = open(self.path, "ab")
        if self._size == 0:
            self._append({"kind": "config", **self.fingerprint})
        self._reader = os.open(self.path, os.O_RDONLY)

    # -- state ---------------------------------------------------------------------------
    def _clear(self) -> None:
        self.last_committed = -1
        #: step -> entry, for the steps recorded since the last commit (their plans replay)
        self.pending: dict[int, StepEntry] = {}
        self._offsets = array("q")  # step -> file offset of its record
        self.num_skipped = 0
        self._size = 0  # bytes of valid records in the file
        self._stale = 0  # step records a compaction would drop or strip of their plans

    @property
    def last_step(self) -> int:
        """The newest step recorded (-1 for none)."""
        return len(self._offsets) - 1

    # -- reading -----------------------------------------------------------------------
    def _load(self) -> None:
        self._clear()
        if not os.path.exists(self.path) or os.path.getsize(self.path) == 0:
            return
        with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            end, superseded = 0, 0
            planned = bytearray()  # step -> 1 if its record carries a plan
            for at, end, rec in _records(data, self.path):
                self._apply(rec, at)
                if rec.get("kind") == "step":
                    superseded += len(planned) - rec["step"]
                    del planned[rec["step"]:]
                    planned.append(rec.get("plan") is not None)
            torn = len(data) - end
        if torn:
            log.warning("journal: dropping a torn last record (%d bytes) of %s", torn, self.path)
            with open(self.path, "r+b") as f:
                f.truncate(end)
        self._size = end
        # Records a compaction would drop or strip: superseded ones, plans no longer pending.
        self._stale = superseded + sum(planned) - len(self.pending)

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
            step = int(rec["step"])
            if step > len(self._offsets):
                raise JournalError(f"journal {self.path!r} records step {step} after step "
                                   f"{self.last_step}: it was not written by this dispatcher")
            # A re-planned step supersedes every later one (the run rewound to it).
            del self._offsets[step:]
            for later in [s for s in self.pending if s > step]:
                del self.pending[later]
            self._offsets.append(offset)
            if rec.get("plan") is not None:
                entry = StepEntry(**{k: v for k, v in rec.items() if k != "kind"})
                entry.cursor_before, entry.cursor_after = None, pack_cursor(entry.cursor_after)
                self.pending[step] = entry
            else:
                self.pending.pop(step, None)
        elif kind == "commit":
            self.last_committed = max(self.last_committed, int(rec["step"]))
            # Committed steps are never replayed verbatim: their entries (plans) go.
            for s in [s for s in self.pending if s <= self.last_committed]:
                del self.pending[s]
        elif kind == "skipped":
            self.num_skipped += len(rec.get("keys", []))

    def _read(self, step: int) -> dict:
        """The record of `step` as written, read back from the file."""
        offset = self._offsets[step]
        head = os.pread(self._reader, _HEAD.size, offset)
        length, crc = _HEAD.unpack(head)
        payload = os.pread(self._reader, length, offset + _HEAD.size)
        if len(payload) != length or zlib.crc32(payload) != crc:
            raise JournalError(f"journal {self.path!r}: the record of step {step} at byte "
                               f"{offset} no longer reads back intact")
        return msgpack.unpackb(payload, raw=False, strict_map_key=False)

    def cursor_after(self, step: int) -> dict:
        """The cursor after `step`: from memory for a pending step, else from the file."""
        if not 0 <= step <= self.last_step:
            raise JournalError(f"cannot resume at step {step + 1}: the journal knows steps "
                               f"0..{self.last_step}")
        entry = self.pending.get(step)
        if entry is not None:
            return unpack_cursor(entry.cursor_after)
        return self._read(step)["cursor_after"]

    def cursor_before(self, step: int, initial: dict) -> dict:
        """The cursor at which `step` starts: after step-1, or `initial` for step 0."""
        return initial if step == 0 else self.cursor_after(step - 1)

    def read_entry(self, step: int) -> StepEntry:
        """A step's entry as written (its plan too, whether or not it is still pending)."""
        if not 0 <= step <= self.last_step:
            raise JournalError(f"the journal knows steps 0..{self.last_step}, not {step}")
        rec = self._read(step)
        return StepEntry(**{k: v for k, v in rec.items() if k != "kind"})

    # -- writing -----------------------------------------------------------------------
    def _append(self, rec: dict) -> int:
        payload = msgpack.packb(rec, use_bin_type=True)
        offset = self._size
        self._file.write(_HEAD.pack(len(payload), zlib.crc32(payload)) + payload)
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())
        self._size += _HEAD.size + len(payload)
        return offset

    def record_step(self, entry: StepEntry) -> None:
        """Persist a step's cursor and plan; called before any rank receives the step."""
        rec = {"kind": "step", **_entry_dict(entry)}
        self._apply(rec, self._append(rec))

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

    def _compact(self) -> None:
        """Rewrite the file with what it means, not its history: the config, the last commit,
        every step (plans only where still pending) and the skipped keys; atomically."""
        tmp = self.path + ".compact"
        before = self._size
        with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data, \
                open(tmp, "wb") as out:
            def put(rec: dict) -> None:
                payload = msgpack.packb(rec, use_bin_type=True)
                out.write(_HEAD.pack(len(payload), zlib.crc32(payload)) + payload)

            put({"kind": "config", **self.fingerprint})
            if self.last_committed >= 0:
                put({"kind": "commit", "step": self.last_committed})
            for step, offset in enumerate(self._offsets):
                _, _, rec = next(_records(data, self.path, offset))
                if step not in self.pending:
                    rec["plan"] = None
                put(rec)
            for _, _, rec in _records(data, self.path):
                if rec.get("kind") == "skipped":
                    put(rec)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.path)
        _fsync_dir(self.directory)
        log.info("journal: compacted %s from %d to %d bytes", self.path, before,
                 os.path.getsize(self.path))

    def close(self) -> None:
        if self._file is not None and not self._file.closed:
            self._file.close()
        if self._reader is not None:
            os.close(self._reader)
            self._reader = None


def _records(data, path: str, start: int = 0) -> Iterator[tuple[int, int, dict]]:
    """(offset, end, record) of each intact record from `start`; stops at a torn last record
    and raises JournalError for corruption anywhere before it."""
    at, size = start, len(data)
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


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _entry_dict(entry: StepEntry) -> dict:
    return {"step": entry.step, "epoch": entry.epoch, "world_size": entry.world_size,
            "cursor_before": entry.cursor_before, "cursor_after": entry.cursor_after,
            "num_samples": entry.num_samples, "digest": entry.digest, "plan": entry.plan}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
