"""Append-only, fsync'd journal of the dispatcher: config fingerprint, per-step cursor and plan, commits.

Records are length-prefixed, CRC-checked msgpack, written and fsync'd before a step leaves the
dispatcher, so a crash at any point loses at most a torn last record (dropped on reopen). The
journal keeps cursors for every step (small) but plans only for steps after the last commit,
which are the only ones a restart replays verbatim.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import msgpack

log = logging.getLogger("mmdispatch.journal")

_HEAD = struct.Struct("<II")  # payload length, crc32 of payload
JOURNAL_FILE = "journal.mmd"
#: Fingerprint fields a restore must match; world size is deliberately absent (elastic resume).
FINGERPRINT_FIELDS = ("shards", "seed", "mode", "global_batch", "token_budget")


class JournalError(ValueError):
    """The journal cannot be honoured: corrupted, or written for a different configuration."""


def pack_cursor(cursor: dict) -> bytes:
    """A wire cursor as kept in memory per step: msgpack bytes, ~15x smaller than the dict
    (a journal holds one per step of the run)."""
    return msgpack.packb(cursor, use_bin_type=True)


def unpack_cursor(packed: bytes) -> dict:
    return msgpack.unpackb(packed, raw=False)


@dataclass(slots=True, kw_only=True)
class StepEntry:
    """A step as written. In `Journal.steps` the cursors are kept packed (`pack_cursor`) and
    `cursor_before` is None: it is the previous step's `cursor_after`."""

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
        self.path = os.path.join(directory, JOURNAL_FILE)
        self.fsync = fsync
        self.fingerprint = {f: fingerprint[f] for f in FINGERPRINT_FIELDS}
        self.last_committed = -1
        self.steps: dict[int, StepEntry] = {}
        self._last_step = -1  # the newest step recorded
        self._oldest_plan = 0  # no step below this holds a plan
        self.num_skipped = 0
        records = self._load()
        self._file = open(self.path, "ab")
        if not records:
            self._append({"kind": "config", **self.fingerprint})

    # -- reading -----------------------------------------------------------------------
    def _load(self) -> list[dict]:
        if not os.path.exists(self.path):
            return []
        with open(self.path, "rb") as f:
            data = f.read()
        records, at = [], 0
        while at < len(data):
            if at + _HEAD.size > len(data):
                break
            length, crc = _HEAD.unpack_from(data, at)
            end = at + _HEAD.size + length
            if end > len(data) or zlib.crc32(data[at + _HEAD.size:end]) != crc:
                if end < len(data):
                    raise JournalError(f"journal {self.path!r} is corrupted at byte {at}, "
                                       "not only its last record")
                break
            records.append(msgpack.unpackb(data[at + _HEAD.size:end], raw=False,
                                           strict_map_key=False))
            at = end
        if at < len(data):
            log.warning("journal: dropping a torn last record (%d bytes) of %s", len(data) - at, self.path)
            with open(self.path, "r+b") as f:
                f.truncate(at)
        for rec in records:
            self._apply(rec)
        return records

    def _apply(self, rec: dict) -> None:
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
            entry = StepEntry(**{k: v for k, v in rec.items() if k != "kind"})
            entry.cursor_before, entry.cursor_after = None, pack_cursor(entry.cursor_after)
            if entry.step <= self._last_step:
                # A re-planned step supersedes every later one (the run rewound to it).
                for later in [s for s in self.steps if s > entry.step]:
                    del self.steps[later]
            self.steps[entry.step] = entry
            self._last_step = entry.step
            if entry.plan is not None:
                self._oldest_plan = min(self._oldest_plan, entry.step)
        elif kind == "commit":
            self.last_committed = max(self.last_committed, int(rec["step"]))
            # Committed steps are never replayed verbatim: drop their plans. Only the steps
            # since the last drop are visited (a scan of every step would grow with the run).
            for s in range(self._oldest_plan, self.last_committed + 1):
                e = self.steps.get(s)
                if e is not None:
                    e.plan = None
            self._oldest_plan = max(self._oldest_plan, self.last_committed + 1)
        elif kind == "skipped":
            self.num_skipped += len(rec.get("keys", []))

    # -- writing -----------------------------------------------------------------------
    def _append(self, rec: dict) -> None:
        payload = msgpack.packb(rec, use_bin_type=True)
        self._file.write(_HEAD.pack(len(payload), zlib.crc32(payload)) + payload)
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())

    def record_step(self, entry: StepEntry) -> None:
        """Persist a step's cursor and plan; called before any rank receives the step."""
        self._append({"kind": "step", **_entry_dict(entry)})
        self._apply({"kind": "step", **_entry_dict(entry)})

    def commit(self, step: int) -> bool:
        """Record that trainers checkpointed `step`; False if it is not newer than the last commit."""
        if step <= self.last_committed:
            return False
        if step not in self.steps:
            raise JournalError(f"cannot commit step {step}: it was never planned "
                               f"(journal has steps up to {max(self.steps, default=-1)})")
        self._append({"kind": "commit", "step": step})
        self._apply({"kind": "commit", "step": step})
        return True

    def record_skipped(self, shard: str, skipped: list[tuple[str, str]]) -> None:
        """Remember bad samples by key, so 'exactly once' has an auditable exception list."""
        if skipped:
            self._append({"kind": "skipped", "shard": shard, "keys": [list(s) for s in skipped]})
            self.num_skipped += len(skipped)

    def cursor_before(self, step: int, initial: dict) -> dict:
        """The cursor at which `step` starts: after step-1, or `initial` for step 0."""
        if step == 0:
            return initial
        prev = self.steps.get(step - 1)
        if prev is None:
            raise JournalError(
                f"cannot resume at step {step}: the journal knows steps "
                f"{min(self.steps, default=0)}..{max(self.steps, default=-1)}")
        return unpack_cursor(prev.cursor_after)

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def _entry_dict(entry: StepEntry) -> dict:
    return {"step": entry.step, "epoch": entry.epoch, "world_size": entry.world_size,
            "cursor_before": entry.cursor_before, "cursor_after": entry.cursor_after,
            "num_samples": entry.num_samples, "digest": entry.digest, "plan": entry.plan}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
