"""Append-only, fsync'd journal of the dispatcher: config fingerprint, per-step cursor and plan, commits.

Each record (recordlog.py) is a 16-byte header (magic, payload length, payload CRC32, CRC32 of
those 12 bytes) and a msgpack payload, written and fsync'd before a step leaves the dispatcher. At a reopen only
a torn last write is dropped (with a warning): a tail that is a prefix of a record, cut inside
its header's magic or inside a payload whose header checks out. Anything else that does not
check out, anywhere, is corruption: JournalError names the file and byte offset, and the file
is left byte for byte as it was. So is a journal.mmd that lost records the directory's other
files outlived (cut short, emptied, an older copy put back): a plan file with plans of steps
past the one after its newest step, or plans, input rules or skipped keys beside a journal.mmd
missing or empty; resumed, it would silently start the job over from an earlier step. Each plan
carries the plan files' turn (the handovers so far), and each step record its plan's, so plans
written after the newest recorded one are found in either file, in the one handed over to
since, and in the newest plan's own file once it was emptied and written anew. A write or fsync
that fails is cut back off its file and raises JournalWriteError (an OSError); nothing of it is
applied, and the call can be retried.

Disk and restart cost stay bounded however long the run. `journal.mmd` holds the config, one
~180-byte record per step (cursor, digest, where its plan lies) and the commits. Once it passes
`journal_file_bytes` and twice its size after the last checkpoint, a commit rewrites it as a
checkpoint (temp file, fsync, rename, fsync of the directory: a crash leaves the old journal or
the new one): config, commit state, and the records of the steps from the oldest of the last
`keep_commits` commits on. A trainer can resume after any of those commits (or at step 0),
not before. Plans go to two plan files used in turn (`plans-0.mmd`, `plans-1.mmd`): a full one
hands over to the other, emptied first, once none of that one's plans is still needed (until
a commit covers its step). Skipped keys (with their shard index when known) go to
`skipped.mmd`, append-only, never read at a restart (journal.mmd keeps their count and how far
the file is counted); `skipped_keys()` reads them back for audits. A restart therefore reads
journal.mmd, about `journal_file_bytes` (more only while commits lag), the uncommitted
steps' plans and the first plan of each plan file. journal.mmd also keeps, a record each and
carried over checkpoints, the shard positions skipped because no reader could open them and
each shard's copy identity as first read whole, so a restart decides and checks as the run
before it did; and each set of plan settings (micro-batches, capacities, cost model...) a step
was planned under, once, which step records name by digest, so a restart knows the journaled
plans made under other settings. Journals in the layout before the magic are read and rewritten
in this one.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import mmap
import os
from array import array
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple

import msgpack

# JournalError and JournalWriteError are raised by the record layer too; users import them here.
from dispatcher_server.blend import same_setting
from dispatcher_server.files import NotRegularFile, check_regular_file
from dispatcher_server.inputs import INPUTS_FILE
from dispatcher_server.recordlog import (MAGIC, AppendFile, JournalError, JournalWriteError,
                                         frame, is_legacy, legacy_scan, read_record, scan,
                                         write_error)

log = logging.getLogger("mmdispatch.journal")

JOURNAL_FILE = "journal.mmd"
PLAN_FILES = ("plans-0.mmd", "plans-1.mmd")
SKIPPED_FILE = "skipped.mmd"
LOCK_FILE = "lock"  # held (flock) by the dispatcher whose journal it is; holds its pid
#: Fingerprint fields a restore must match; world size is deliberately absent (elastic resume).
FINGERPRINT_FIELDS = ("shards", "seed", "mode", "global_batch", "token_budget")
#: Compared the same way when present (`sources` is absent for one default source).
OPTIONAL_FINGERPRINT_FIELDS = ("shuffle_buffer", "sources")
#: Recorded by journals since they were added, and compared only with a journal that has them
#: (one written before resumes as it did): `field_maps`, each source's field map, which decides
#: what is counted and so which samples are skipped; `shuffle_shards`, which orders them.
RECORDED_FINGERPRINT_FIELDS = ("field_maps", "shuffle_shards")


class _OtherConfig(Exception):
    """The journal's configuration record is another's (a JournalError unless that is all)."""


class SkippedKey(NamedTuple):
    shard: str
    key: str
    reason: str
    index: int | None  # the sample's index in its shard, when the reader said


def settings_id(settings: dict) -> str:
    """The digest a step record names its plan settings by (`Journal.plan_settings`)."""
    text = json.dumps(settings, sort_keys=True, default=repr)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


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
    # the plan files' turn it was written at (`Journal._turn`); None in journals before it was
    # recorded
    plan_turn: int | None = None
    # `settings_id` of the plan settings it was planned under; None in journals before they
    # were recorded
    settings: str | None = None
    # `StepBatch.keys_digest` (the keys alone): a replay over other samples, not only other
    # lengths, is told apart; None in journals before it was kept
    keys: str | None = None


class Journal:
    """The dispatcher's durable state; one instance owns one directory."""

    def __init__(self, directory: str, fingerprint: dict[str, Any], *, fsync: bool = True,
                 plan_file_bytes: int = 64 << 20, journal_file_bytes: int = 1 << 20,
                 keep_commits: int = 8) -> None:
        """`plan_file_bytes`: a plan file this large hands over to the other once that one
        holds no plan still needed. `journal_file_bytes`: journal.mmd this large is checkpointed
        at the next commit. `keep_commits`: steps stay resumable from the oldest of this many
        latest commits on."""
        missing = [f for f in FINGERPRINT_FIELDS if f not in fingerprint]
        if missing:
            raise ValueError(f"journal fingerprint lacks fields {missing}")
        for name, value in (("plan_file_bytes", plan_file_bytes),
                            ("journal_file_bytes", journal_file_bytes),
                            ("keep_commits", keep_commits)):
            if value < 1:
                raise ValueError(f"{name} must be positive, not {value}")
        os.makedirs(directory, exist_ok=True)
        self._lock_fd = _lock(directory)
        self._dir_id = _identity(directory)
        self.directory = directory
        self.path = os.path.join(directory, JOURNAL_FILE)
        self.fsync = fsync
        self.plan_file_bytes = plan_file_bytes
        self.journal_file_bytes = journal_file_bytes
        self.fingerprint = {f: fingerprint.get(f) for f in FINGERPRINT_FIELDS + OPTIONAL_FINGERPRINT_FIELDS}
        self.fingerprint.update({f: fingerprint[f] for f in RECORDED_FINGERPRINT_FIELDS
                                 if f in fingerprint})
        self.last_committed = -1
        #: step -> entry (its plan on disk: `plan_of`), for the steps not covered by a commit
        self.pending: dict[int, StepEntry] = {}
        self._first = 0  # the oldest step whose record journal.mmd keeps
        self._offsets = array("q")  # step - _first -> offset of its record in journal.mmd
        self._commits: deque[int] = deque(maxlen=keep_commits)  # the latest commits, oldest first
        self.num_skipped = 0
        self._skipped_end = 0  # how far skipped.mmd is counted in num_skipped
        #: shard positions (a shard in one epoch) skipped whole because no reader could open
        #: them: a restart skips them again instead of waiting OPEN_RETRY_S anew (skipped.mmd
        #: is never read at a restart, so the decision is kept here, a few bytes a shard)
        self.unopenable: set[int] = set()
        #: shard URL -> the identity of the copy first read whole ({size, headers, reader}):
        #: every later read, by any reader, restart or epoch, must find the same copy
        self.identities: dict[str, dict] = {}
        #: settings_id -> plan settings, for the steps journal.mmd keeps
        self.plan_settings: dict[str, dict] = {}
        self._legacy_skipped: list[tuple[str, list]] = []
        self.records_read = 0  # records read while opening
        self._gen = 0  # the plan file being written
        #: handovers between the plan files so far, written in each plan: a file's first plan
        #: tells whether the file was handed over to after another plan was written, which a
        #: file's bytes alone cannot tell (`_check_nothing_lost`)
        self._turn = 0
        self._last_plan_at: tuple[int, int] | None = None  # where the newest step's plan lies
        self._last_plan_turn: int | None = None  # and at which turn
        self._dir_sync_owed = False
        self._base_size = 0  # journal.mmd's size right after its checkpoint
        self._file: AppendFile | None = None
        self._plans: list[AppendFile] = []
        self._skipped: AppendFile | None = None
        try:
            self._open()
        except JournalWriteError:  # a write failed (disk full): said as such, not as damage
            self.close()
            raise
        except OSError as e:  # a file of it unreadable, or replaced by a directory
            self.close()
            where = e.filename or f"a file in {directory}"
            raise JournalError(f"journal file {where!r} cannot be opened or read "
                               f"({e.strerror or e}): put back the file the journal wrote "
                               "(restore it from a backup), or start a new --journal-dir"
                               ) from None
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        for name in (JOURNAL_FILE, *PLAN_FILES, SKIPPED_FILE):
            check_regular_file(os.path.join(self.directory, name))
        tmp = self.path + ".tmp"
        if os.path.exists(tmp):  # a checkpoint cut short: the journal it was to replace stands
            os.unlink(tmp)
        was = _absence(self.path)
        legacy, cut = self._load()
        # Nothing is written before the plan files are checked: a journal refused there is left
        # as it was (a plan file created empty would be refused as cut short, not missing, next).
        self._check_plans(was)
        self._cut(cut, legacy)
        self._file = AppendFile(self.path, self.fsync)
        self._plans = [AppendFile(os.path.join(self.directory, n), self.fsync) for n in PLAN_FILES]
        self._skipped = AppendFile(os.path.join(self.directory, SKIPPED_FILE), self.fsync)
        if legacy:  # journals before skipped.mmd never wrote one: any is a cut-short migration's
            self._skipped.empty()
        self._count_unindexed_skips()
        if self._file.size == 0:
            self._append({"kind": "config", **self.fingerprint})
        elif legacy:
            self._migrate()

    @property
    def last_step(self) -> int:
        """The newest step recorded (-1 for none)."""
        return self._first + len(self._offsets) - 1

    # -- reading -----------------------------------------------------------------------
    def _load(self) -> tuple[bool, int | None]:
        """Apply the records of journal.mmd: (whether it was written before MAGIC, and is then
        migrated; the size to cut it to, `_cut`: its intact end before a torn last write, 0 for
        another start's configuration alone, None to keep it)."""
        if not os.path.exists(self.path) or os.path.getsize(self.path) == 0:
            return False, None
        with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            legacy = is_legacy(data)
            size = len(data)
            try:
                end = self._apply_all((legacy_scan if legacy else scan)(data, self.path))
            except _OtherConfig as other:
                # Nothing but another start's configuration (one that failed before its first
                # step): no step, commit or skip to resume, so no job to protect.
                if legacy or self.records_read > 1 or self._skips_recorded():
                    raise JournalError(str(other)) from None
                return False, 0
        return legacy, (end if end < size else None)

    def _cut(self, end: int | None, legacy: bool) -> None:
        """Cut journal.mmd to `end` (`_load`), once the journal is known to be resumed."""
        if end is None:
            return
        if end == 0:
            log.info("mmdispatch event=journal_reset journal=%s why='it held only the "
                     "configuration of a start that recorded no step; it now records this one'",
                     self.path)
            # That start's input rules go first: an empty journal.mmd beside them is a lost one.
            inputs = os.path.join(self.directory, INPUTS_FILE)
            if os.path.exists(inputs):
                os.unlink(inputs)
            os.truncate(self.path, 0)
            return
        # A torn write is the prefix of one record: the step, commit or skip being written.
        log.warning("mmdispatch event=journal_torn_write journal=%s dropped_bytes=%d at=%d "
                    "dropped_records=1 last_step=%d last_committed=%d why='a crash cut the "
                    "record being written short'", self.path, os.path.getsize(self.path) - end,
                    end, self.last_step, self.last_committed)
        if not legacy:  # a legacy journal is rewritten whole by its migration
            os.truncate(self.path, end)

    def _skips_recorded(self) -> bool:
        path = os.path.join(self.directory, SKIPPED_FILE)
        return os.path.exists(path) and os.path.getsize(path) > 0

    def _apply_all(self, records: Iterator[tuple[int, int, dict]]) -> int:
        end, other = 0, None
        for at, end, rec in records:
            self.records_read += 1
            if other is not None:  # the journal holds more than another start's configuration
                raise JournalError(str(other))
            try:
                self._apply(rec, at)
            except _OtherConfig as e:
                other = e
                continue
            if rec.get("kind") == "checkpoint" or "kept" in rec:
                self._base_size = end  # its size right after that checkpoint: _maybe_checkpoint
        if other is not None:
            raise other
        return end

    def _apply(self, rec: dict, offset: int) -> None:
        kind = rec.get("kind")
        if kind == "config":
            self._check_config(rec)
        elif kind == "checkpoint":
            self._first = int(rec["first_step"])
            self._offsets = array("q")
            self.pending.clear()
            self.last_committed = int(rec["last_committed"])
            self._commits = deque(rec["commits"], maxlen=self._commits.maxlen)
            self.num_skipped, self._skipped_end = int(rec["num_skipped"]), int(rec["skipped_end"])
            self.unopenable = set(rec.get("unopenable", ()))  # absent in older journals
            self.identities = dict(rec.get("identities", {}))
            self.plan_settings = dict(rec.get("plan_settings", {}))
        elif kind == "step":
            self._apply_step(rec, offset)
        elif kind == "commit":
            step = int(rec["step"])
            if step > self.last_committed:
                self.last_committed = step
                self._commits.append(step)
            # Committed steps are never replayed verbatim: their entries (plans) go.
            for s in [s for s in self.pending if s <= self.last_committed]:
                del self.pending[s]
        elif kind == "unopenable":
            self.unopenable.add(int(rec["pos"]))
        elif kind == "identity":
            self.identities.setdefault(rec["shard"], rec["identity"])
        elif kind == "plan_settings":
            self.plan_settings.setdefault(rec["id"], rec["settings"])
        elif kind == "skipped":
            if "keys" in rec:  # a legacy journal's keys, inline
                self.num_skipped += len(rec["keys"])
                self._legacy_skipped.append((rec["shard"], rec["keys"]))
            else:
                self.num_skipped, self._skipped_end = int(rec["total"]), int(rec["end"])

    def _check_config(self, rec: dict) -> None:
        fields = FINGERPRINT_FIELDS + OPTIONAL_FINGERPRINT_FIELDS + tuple(
            f for f in RECORDED_FINGERPRINT_FIELDS if f in rec)
        theirs = {f: rec.get(f) for f in fields}
        diff = [f for f in fields if not same_setting(f, theirs[f], self.fingerprint.get(f))]
        if diff:
            details = "; ".join(f"{f}: {_difference(theirs[f], self.fingerprint.get(f))}"
                                for f in diff)
            raise _OtherConfig(
                f"cannot resume from journal {self.path!r}: it was written for a different "
                f"configuration ({details}). Restore the original settings to resume: these "
                "settings make another sample sequence, so no position in this one carries "
                "over. To start that sequence anew, give a new journal directory and start "
                "the trainers without their data state (step 0).")

    def _apply_step(self, rec: dict, offset: int) -> None:
        entry = _entry(rec)
        if entry.step > self.last_step + 1:
            raise JournalError(f"journal {self.path!r} records step {entry.step} after step "
                               f"{self.last_step}: it was not written by this dispatcher")
        # A re-planned step supersedes every later one (the run rewound to it). Below the last
        # commit, the trainers rewound to a checkpoint before it: the commits after that
        # checkpoint are of steps that no longer stand, and a restart resumes from it (it
        # resumed past the steps the journal still knew, and refused to start).
        if not rec.get("kept") and entry.step <= self.last_committed:
            self.last_committed = entry.step - 1
            while self._commits and self._commits[-1] >= entry.step:
                self._commits.pop()
        if entry.step < self._first:  # a rewind to step 0, past the checkpointed steps
            self._first, self._offsets = entry.step, array("q")
        else:
            del self._offsets[entry.step - self._first:]
        for later in [s for s in self.pending if s > entry.step]:
            del self.pending[later]
        self._offsets.append(offset)
        self._last_plan_at, self._last_plan_turn = entry.plan_at, entry.plan_turn
        if entry.plan_at is not None:
            self._gen = entry.plan_at[0]
        if not rec.get("kept") and (entry.plan is not None or entry.plan_at is not None):
            entry.cursor_after = pack_cursor(entry.cursor_after)
            self.pending[entry.step] = entry
        else:
            self.pending.pop(entry.step, None)

    def _count_unindexed_skips(self) -> None:
        """Count skipped.mmd's records past what the journal counted (written just before a
        crash cut the journal's record of them)."""
        size = self._skipped.size
        if size < self._skipped_end:
            raise JournalError(f"journal {self._skipped.path!r} is {size} bytes, but the journal "
                               f"counted skipped keys up to byte {self._skipped_end}")
        if size == self._skipped_end:
            return
        with mmap.mmap(self._skipped.fd, 0, access=mmap.ACCESS_READ) as data:
            end = self._skipped_end
            for _, end, rec in scan(data, self._skipped.path, self._skipped_end):
                self.records_read += 1
                self.num_skipped += len(rec["keys"])
        if end < size:
            log.warning("journal: dropping a torn last write (%d bytes at byte %d) of %s",
                        size - end, end, self._skipped.path)
            self._skipped.cut_back(end)
        self._skipped_end = end

    def _check_plans(self, was: str | None) -> None:
        """Read only, before anything is written: every uncommitted step's plan reads back, and
        the plan files hold no plan journal.mmd lost the record of."""
        fds: dict[int, int] = {}
        try:
            for g, name in enumerate(PLAN_FILES):
                try:
                    fds[g] = os.open(os.path.join(self.directory, name), os.O_RDONLY)
                except FileNotFoundError:
                    pass
            self._read_pending_plans(fds)
            turns = {g: _first_turn(fd) for g, fd in fds.items()}
            self._check_nothing_lost(fds, turns, was)
            # The newest turn is the first plan's of the file handed over to last, which may be
            # the file not written on (a crash cut the record of its only plan): plans go on at
            # that turn, so they count as written after it.
            self._turn = max((t for t in turns.values() if t is not None), default=0)
        finally:
            for fd in fds.values():
                os.close(fd)

    def _read_pending_plans(self, fds: dict[int, int]) -> None:
        """Check that every uncommitted step's plan reads back (a replay needs it); they stay
        on disk, read again when replayed (`plan_of`). `fds`: the plan files there are."""
        for entry in self.pending.values():
            if entry.plan is not None or entry.plan_at is None:
                continue
            g, at = entry.plan_at
            if g in fds and _plan_in(fds[g], entry.step, at) is not None:
                continue
            path = os.path.join(self.directory, PLAN_FILES[g])
            if g not in fds:
                steps = [s for s, e in self.pending.items() if e.plan_at and e.plan_at[0] == g]
                why = (f"is missing: it held the plans of uncommitted steps "
                       f"{_span(min(steps), max(steps))}, which a replay needs")
            elif (size := os.fstat(fds[g]).st_size) <= at:
                why = (f"is cut short: it ends at byte {size}, before the plan of uncommitted step "
                       f"{entry.step} (at byte {at}), which a replay needs")
            else:
                why = (f"is corrupted at byte {at}: the plan of uncommitted step {entry.step}, "
                       "which a replay needs, does not read back intact")
            raise JournalError(f"journal {path!r} {why}; restore it from a backup, or start a "
                               "new --journal-dir (and the trainers from step 0)")

    def _check_nothing_lost(self, fds: dict[int, int], turns: dict[int, int | None],
                            was: str | None) -> None:
        """Refuse a journal.mmd that lost records its directory's other files outlived (cut
        short, emptied, an older copy put back): resumed, it would plan the lost steps over
        again, and trainers started afresh would take the epoch from its start. A plan is
        written just before its step's record, so a crash between them leaves a plan of the
        step after the newest record (a crash there at each restart, several plans of it): that
        much follows the journal's last plan legitimately, and no later step. Plans written
        after the newest recorded one lie after it in its file, or in a file handed over to
        since: one whose first plan's turn (`turns`, `_first_turn`) is past that plan's."""
        last, next_ = self.last_step, self.last_step + 1

        def path(name: str) -> str:
            return os.path.join(self.directory, name)

        if last < 0:
            found = [(PLAN_FILES[g], [s for s, _ in _plans_from(fd, 0)]) for g, fd in fds.items()]
            lost = [f"{path(n)!r} holds plans of steps up to {max(s)}" for n, s in found
                    if s and max(s) > next_]
            if was is not None:  # written only once journal.mmd holds a configuration
                lost += [f"{path(n)!r} {what}" for n, what in (
                    (INPUTS_FILE, "holds the input rules of the peers of a job"),
                    (SKIPPED_FILE, "holds skipped keys")) if os.path.exists(path(n))
                         and os.path.getsize(path(n)) > 0]
            if lost:
                raise JournalError(
                    f"journal {self.path!r} {was or 'records no step'}, but " + ", and ".join(lost)
                    + ": journal.mmd lost the records of a job that ran there, and starting anew "
                    "would start that job over from step 0 unnoticed; restore journal.mmd from a "
                    "backup, or start a new --journal-dir (and the trainers from step 0)")
            return
        if self._last_plan_at is None or self._last_plan_at[0] not in fds:
            return  # a plan inline (a journal before plan files), or a plan no longer needed
        g, at = self._last_plan_at
        ours = _plans_from(fds[g], at)
        turn = self._last_plan_turn
        if turn is None and ours and ours[0][0] == last:  # a step record before it carried it
            turn = ours[0][1]
        # A file handed over to after step last's plan holds only later plans, step last's own
        # file too once it was emptied and written again. A plan of the previous layout has no
        # turn (0): in a journal written before plans carried theirs, both files read 0 until
        # the first handover after the upgrade, and neither is compared whole till then (its
        # plans cannot be told from older ones).
        later = {f: [s for s, _ in _plans_from(fd, 0)] for f, fd in fds.items()
                 if turn is not None and (turns.get(f) or 0) > turn}
        rewritten = g in later or (bool(ours) and ours[0][0] != last)
        if g not in later and ours:  # after step last's plan; all of it if another lies there
            later[g] = [s for s, _ in (ours if ours[0][0] != last else ours[1:])]
        later = {f: steps for f, steps in later.items() if steps}
        if not rewritten and all(s <= next_ for steps in later.values() for s in steps):
            return
        commit = f"last commit {self.last_committed}" if self.last_committed >= 0 else "no commit"
        held = ", and ".join(
            f"{path(PLAN_FILES[f])!r} holds {len(steps)} plan{'s' * (len(steps) > 1)} written "
            f"after step {last}'s, of steps up to {max(steps)}"
            for f, steps in sorted(later.items()))
        raise JournalError(
            f"journal {self.path!r} records steps up to {last} ({commit}), but {held}: "
            "journal.mmd lost its later records (cut short, or an older copy put back), or "
            "that plan file came from another copy of the journal, and resuming would plan "
            "those steps again; restore the directory's files together from one backup, or "
            "start a new --journal-dir (and the trainers from step 0)")

    def _read_step(self, step: int) -> dict:
        offset = self._offsets[step - self._first]
        rec = read_record(self._file.fd, offset)
        if rec is None:
            raise JournalError(f"journal {self.path!r}: the record of step {step} at byte "
                               f"{offset} no longer reads back intact")
        return rec

    def plan_of(self, entry: StepEntry) -> dict | None:
        """A pending entry's plan: from its plan file (None if that was reused since: the step
        was committed and a file's worth of plans written after it)."""
        if entry.plan is not None or entry.plan_at is None:
            return entry.plan
        return self._read_plan(entry.step, entry.plan_at)

    def _read_plan(self, step: int, plan_at: tuple[int, int]) -> dict | None:
        """The plan of `step`, or None if its plan file was reused since (the step is committed)."""
        return _plan_in(self._plans[plan_at[0]].fd, step, plan_at[1])

    def _check_known(self, step: int, what: str) -> None:
        if self._first <= step <= self.last_step:
            return
        if self.last_step < 0:
            raise JournalError(f"{what}: the journal in {self.directory!r} holds no step yet (a new "
                               "or emptied journal directory: start the trainers from step 0, or "
                               "give the dispatcher the journal directory of this job)")
        text = f"{what}: the journal knows steps {self._first}..{self.last_step}"
        if step > self.last_step:
            raise JournalError(f"{text}, so the checkpoint is of a later run than this journal "
                               f"in {self.directory!r}: give the dispatcher the --journal-dir "
                               "of the run that wrote the checkpoint")
        if self._first:
            text += (f" (older ones were checkpointed away: resume at step 0 or at steps "
                     f"{self._first + 1}..{self.last_step + 1})")
        raise JournalError(text)

    def cursor_after(self, step: int) -> dict:
        """The cursor after `step`: from memory for a pending step, else from the file."""
        self._check_known(step, f"cannot resume at step {step + 1}")
        entry = self.pending.get(step)
        if entry is not None:
            return unpack_cursor(entry.cursor_after)
        return self._read_step(step)["cursor_after"]

    def record_of(self, step: int) -> StepEntry:
        """A step's record as journaled (its digests; its plan not read), JournalError for a
        step the journal no longer keeps."""
        self._check_known(step, f"cannot read step {step}")
        return _entry(self._read_step(step))

    def read_entry(self, step: int) -> StepEntry:
        """A step's entry as journaled; its plan None once the plan file it was in was reused."""
        self._check_known(step, f"cannot read step {step}")
        entry = _entry(self._read_step(step))
        if entry.plan is None and entry.plan_at is not None:
            entry.plan = self._read_plan(step, entry.plan_at)
        return entry

    def skipped_keys(self) -> Iterator[SkippedKey]:
        """Every skipped key recorded, oldest first (reads skipped.mmd; for audits)."""
        if self._skipped.size == 0:
            return
        with mmap.mmap(self._skipped.fd, 0, access=mmap.ACCESS_READ) as data:
            for _, _, rec in scan(data[:self._skipped.size], self._skipped.path):
                yield from (_skipped_key(rec["shard"], k) for k in rec["keys"])

    # -- writing -----------------------------------------------------------------------
    def _append(self, rec: dict) -> int:
        """Append one record to journal.mmd; its offset."""
        self._sync_dir_if_owed()
        return self._file.append(frame(rec))

    def _plan_file_for_next(self) -> int:
        """The plan file the next plan goes to: the current one, or the other once the current
        one is full and no pending step's plan lies in the other (which is then emptied)."""
        g = self._gen
        other = 1 - g
        if self._plans[g].size < self.plan_file_bytes or self._oldest_plan_file() == other:
            return g
        self._plans[other].empty()
        self._gen, self._turn = other, self._turn + 1
        log.info("journal: plan file %s full (%d bytes), writing %s", PLAN_FILES[g],
                 self._plans[g].size, PLAN_FILES[other])
        return other

    def _oldest_plan_file(self) -> int | None:
        """The plan file of the oldest pending step that has one. `pending` is in the order its
        steps were written (a re-planned step replaces the later ones), and the files take turns
        only once the other holds no pending plan: so the other file holds a pending plan iff
        the oldest one lies in it. O(1) a step however far commits lag."""
        return next((e.plan_at[0] for e in self.pending.values() if e.plan_at is not None), None)

    def _check_directory(self) -> None:
        """Records go to files opened at start: had the directory been removed or replaced
        since, they would land nowhere a restart looks, and commits trainers count on would not
        be durable. Checked before each step, commit and skip record (a stat)."""
        try:
            same = _identity(self.directory) == self._dir_id
        except OSError:
            same = False
        if not same:
            raise JournalWriteError(errno.ENOENT, "the journal directory was removed or replaced "
                                    "while the dispatcher ran", self.directory)

    def record_step(self, entry: StepEntry) -> None:
        """Persist a step's plan, then its cursor; called before any rank receives the step.
        Raises JournalWriteError (nothing recorded) if either write fails."""
        self._check_directory()
        g = self._plan_file_for_next()
        plans = self._plans[g]
        at = plans.append(frame({"step": entry.step, "turn": self._turn, "plan": entry.plan}))
        rec = {"kind": "step", "step": entry.step, "epoch": entry.epoch,
               "world_size": entry.world_size, "cursor_after": entry.cursor_after,
               "num_samples": entry.num_samples, "digest": entry.digest,
               "plan_at": [g, at, self._turn],
               **({"settings": entry.settings} if entry.settings is not None else {}),
               **({"keys": entry.keys} if entry.keys is not None else {})}
        try:
            offset = self._append(rec)
        except JournalWriteError:
            plans.cut_back(at)
            raise
        # The plan stays on disk only: held until a commit, every step's plan would pile up in
        # memory between commits (MBs a step at thousands of ranks).
        self._apply(rec, offset)

    def commit(self, step: int) -> bool:
        """Record that trainers checkpointed `step`; False if it is not newer than the last
        commit. Raises JournalWriteError (nothing committed) if the write fails."""
        if step <= self.last_committed:
            return False
        if step > self.last_step:
            raise JournalError(f"cannot commit step {step}: it was never planned "
                               f"(journal has steps up to {self.last_step})")
        self._check_directory()
        rec = {"kind": "commit", "step": step}
        self._apply(rec, self._append(rec))
        self._maybe_checkpoint()
        return True

    def record_skipped(self, shard: str, skipped: list[tuple]) -> None:
        """Remember bad samples by key, so 'exactly once' has an auditable exception list.
        Entries are (key, reason) or (key, reason, index). Raises JournalWriteError (nothing
        recorded) if a write fails."""
        if not skipped:
            return
        keys = [_skip_entry(s) for s in skipped]
        self._check_directory()
        at = self._skipped.append(frame({"shard": shard, "keys": keys}))
        rec = {"kind": "skipped", "total": self.num_skipped + len(keys), "end": self._skipped.size}
        try:
            offset = self._append(rec)
        except JournalWriteError:
            self._skipped.cut_back(at)
            raise
        self._apply(rec, offset)

    def record_unopenable(self, pos: int, shard: str) -> None:
        """Record that shard position `pos` (shard `shard` in one epoch) was skipped because no
        reader could open it. Raises JournalWriteError (nothing recorded) if the write fails."""
        if pos in self.unopenable:
            return
        self._check_directory()
        rec = {"kind": "unopenable", "pos": pos, "shard": shard}
        self._apply(rec, self._append(rec))

    def record_identity(self, shard: str, identity: dict) -> None:
        """Record the identity of the copy of `shard` first read whole. Raises JournalWriteError
        (nothing recorded) if the write fails."""
        if shard in self.identities:
            return
        self._check_directory()
        rec = {"kind": "identity", "shard": shard, "identity": identity}
        self._apply(rec, self._append(rec))

    def record_plan_settings(self, settings: dict) -> str:
        """Record a set of plan settings unless journal.mmd holds it; its `settings_id`, for
        the step records planned under it. Raises JournalWriteError (nothing recorded) if the
        write fails."""
        key = settings_id(settings)
        if key not in self.plan_settings:
            self._check_directory()
            rec = {"kind": "plan_settings", "id": key, "settings": settings}
            self._apply(rec, self._append(rec))
        return key

    # -- checkpoints -------------------------------------------------------------------
    def _maybe_checkpoint(self) -> None:
        """After a commit: rewrite journal.mmd from the oldest kept commit on, once it is large
        (and twice its size after the last checkpoint, so rewrites cost O(1) a step)."""
        first = self._commits[0]
        if first <= self._first or self._file.size < max(self.journal_file_bytes,
                                                         2 * self._base_size):
            return
        try:
            self._checkpoint(first)
        except JournalWriteError as e:
            log.warning("journal: checkpoint of %s failed (%s); it goes on appending and tries "
                        "again at a later commit", self.path, e)

    def _migrate(self) -> None:
        """Rewrite a journal from before MAGIC in the current layout (its skipped keys move to
        skipped.mmd); nothing is dropped."""
        log.info("journal: rewriting %s in the current record layout", self.path)
        for shard, keys in self._legacy_skipped:
            self._skipped.append(frame({"shard": shard, "keys": keys}))
        self._legacy_skipped = []
        self._skipped_end = self._skipped.size
        self._checkpoint(self._first)

    def _checkpoint(self, first: int) -> None:
        """Replace journal.mmd by: config, checkpoint, the records of steps `first`.. (atomic:
        a crash at any point leaves the old journal or the new one)."""
        steps = [self._kept_record(s) for s in range(first, self.last_step + 1)]
        # Only the settings the kept steps name: those of steps checkpointed away go with them.
        named = {r["settings"] for r in steps if r.get("settings") in self.plan_settings}
        settings = {k: v for k, v in self.plan_settings.items() if k in named}
        records = [{"kind": "config", **self.fingerprint},
                   {"kind": "checkpoint", "first_step": first, "last_committed": self.last_committed,
                    "commits": list(self._commits), "num_skipped": self.num_skipped,
                    "skipped_end": self._skipped_end, "unopenable": sorted(self.unopenable),
                    "identities": self.identities, "plan_settings": settings}]
        records += steps
        frames = [frame(r) for r in records]
        old, self._file = self._file, self._replace_file(b"".join(frames))
        old.close()
        self.plan_settings = settings
        at = len(frames[0]) + len(frames[1])
        self._first, self._offsets = first, array("q")
        for framed in frames[2:]:
            self._offsets.append(at)
            at += len(framed)
        self._base_size = self._file.size
        self._dir_sync_owed = True
        self._sync_dir_if_owed()
        log.info("journal: checkpointed %s at step %d (%d bytes, steps %d..%d)", self.path,
                 self.last_committed, self._base_size, first, self.last_step)

    def _replace_file(self, data: bytes) -> AppendFile:
        """Write `data` to a temp file (fsync'd) renamed over journal.mmd; it, open to append."""
        tmp = self.path + ".tmp"
        if os.path.exists(tmp):
            os.unlink(tmp)
        new = AppendFile(tmp, self.fsync)  # opened before the rename: it follows the file
        try:
            new.append(data)
            os.replace(tmp, self.path)
        except OSError as e:
            new.close()
            if os.path.exists(tmp):
                os.unlink(tmp)
            if isinstance(e, JournalWriteError):
                raise
            raise write_error(e, self.path) from e
        new.path = self.path
        return new

    def _kept_record(self, step: int) -> dict:
        entry = self.pending.get(step)
        if entry is None:
            return {**self._read_step(step), "kept": True}
        return {"kind": "step", "step": step, "kept": False, "epoch": entry.epoch,
                "world_size": entry.world_size, "cursor_after": unpack_cursor(entry.cursor_after),
                "num_samples": entry.num_samples, "digest": entry.digest,
                **({"plan_at": [*entry.plan_at, *([entry.plan_turn] if entry.plan_turn
                                                    is not None else [])]}
                   if entry.plan_at is not None
                   else {"plan": entry.plan}),
                **({"settings": entry.settings} if entry.settings is not None else {}),
                **({"keys": entry.keys} if entry.keys is not None else {})}

    def _sync_dir_if_owed(self) -> None:
        """Make a checkpoint's rename durable before anything is appended to the new file."""
        if not self._dir_sync_owed:
            return
        if self.fsync:
            try:
                fd = os.open(self.directory, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError as e:
                raise write_error(e, self.directory) from e
        self._dir_sync_owed = False

    def close(self) -> None:
        for f in (self._file, *self._plans, self._skipped):
            if f is not None:
                f.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # the lock goes with it
            self._lock_fd = None


def _lock(directory: str) -> int:
    """An exclusive lock on `directory`'s LOCK_FILE, held while the journal is open (two
    dispatchers appending to one journal would interleave their steps); its fd."""
    path = os.path.join(directory, LOCK_FILE)
    try:
        check_regular_file(path)
    except OSError as e:  # not a file, or a link that leads nowhere
        state = f"is {e.strerror}" if isinstance(e, NotRegularFile) else f"cannot be opened ({e.strerror})"
        raise JournalError(f"journal lock file {path!r} {state}: remove it (the dispatcher "
                           "creates it, and holds it while it runs)") from None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:  # not writable by this user, a read-only filesystem
        raise JournalError(f"--journal-dir {directory!r} cannot be written ({e.strerror or e}): "
                           "give a directory the dispatcher can write") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):  # a filesystem without locks
            log.warning("journal: cannot lock %s (%s): nothing keeps a second dispatcher off "
                        "this journal directory", directory, e.strerror or e)
            return fd
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        raise JournalError(f"journal directory {directory!r} is in use by another dispatcher (pid "
                           f"{holder}); one journal serves one dispatcher: stop that one, or give "
                           "this one its own --journal-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _absence(path: str) -> str | None:
    """How journal.mmd is absent before a start ("is missing", "is empty"), or None."""
    if not os.path.exists(path):
        return "is missing"
    return "is empty" if os.path.getsize(path) == 0 else None


def _plan_in(fd: int, step: int, at: int) -> dict | None:
    """The plan of `step` at `at` of a plan file, or None if another record (or none) is there."""
    rec = read_record(fd, at)
    if rec is None or rec.get("step") != step:
        return None
    return rec["plan"]


def _plans_from(fd: int, start: int) -> list[tuple[int, int]]:
    """(step, turn) of the whole plans of a plan file from byte `start` on, in the current
    layout, up to a torn last write or anything else that does not read back (left to
    `plan_of`); turn 0 for a plan written before plans carried theirs."""
    size = os.fstat(fd).st_size
    if size <= start:
        return []
    plans: list[tuple[int, int]] = []
    with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as data:
        if data[start:start + len(MAGIC)] != MAGIC:
            return []
        try:
            for _, _, rec in scan(data, "", start):
                plans.append((int(rec.get("step", -1)), int(rec.get("turn", 0))))
        except JournalError:
            pass
    return plans


def _first_turn(fd: int) -> int | None:
    """The turn of a plan file's first plan (0 if written before plans carried theirs), or None
    for a file with no plan that reads back."""
    rec = read_record(fd, 0)
    return None if rec is None else int(rec.get("turn", 0))


def _span(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}..{last}"


def _identity(directory: str) -> tuple[int, int]:
    st = os.stat(directory)
    return st.st_dev, st.st_ino


def _entry(rec: dict) -> StepEntry:
    """A step record as an entry; records of journals before plan files carried the plan inline
    (and the cursor before the step, which is the previous step's cursor after)."""
    plan_at = rec.get("plan_at")  # [file, offset], and the turn since it was recorded
    turn = plan_at[2] if plan_at is not None and len(plan_at) > 2 else None
    return StepEntry(step=int(rec["step"]), epoch=rec["epoch"], world_size=rec["world_size"],
                     cursor_after=rec["cursor_after"], num_samples=rec["num_samples"],
                     digest=rec["digest"], plan=rec.get("plan"),
                     plan_at=None if plan_at is None else (int(plan_at[0]), int(plan_at[1])),
                     plan_turn=None if turn is None else int(turn),
                     settings=rec.get("settings"), keys=rec.get("keys"))


def _skip_entry(s: tuple) -> list:
    if len(s) not in (2, 3):
        raise ValueError(f"a skipped sample is (key, reason) or (key, reason, index), not {s!r}")
    return list(s)


def _skipped_key(shard: str, k: list) -> SkippedKey:
    return SkippedKey(shard, k[0], k[1], k[2] if len(k) > 2 else None)


def _difference(journal: Any, config: Any) -> str:
    """How a setting differs, said so the difference shows: for two lists (shards, sources)
    their lengths and the entries one has and the other lacks, or the first entry that differs
    (cutting both lists to their first entries hid a change further down)."""
    if isinstance(journal, dict) and isinstance(config, dict):
        diffs = _dict_differences(journal, config)
        if diffs:
            shown = "; ".join(f"{path}: journal has {a}, config has {b}" for path, a, b in diffs[:3])
            return shown + (f"; and {len(diffs) - 3} more" if len(diffs) > 3 else "")
    if not (isinstance(journal, list) and isinstance(config, list)):
        return f"journal has {_short(journal)}, config has {_short(config)}"
    counts = f"journal has {len(journal)} entries, config has {len(config)}"
    theirs, ours = list(map(repr, journal)), list(map(repr, config))
    removed = list((Counter(theirs) - Counter(ours)).elements())
    added = list((Counter(ours) - Counter(theirs)).elements())
    if removed or added:
        parts = [f"{what} {len(items)}: {_few(items)}" for what, items in
                 (("config lacks", removed), ("config adds", added)) if items]
        return f"{counts}; " + "; ".join(parts)
    i = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))
    return (f"{counts}, the same entries in another order; first difference at entry {i}: "
            f"journal has {_short_text(theirs[i]) if i < len(theirs) else 'none'}, config has "
            f"{_short_text(ours[i]) if i < len(ours) else 'none'}")


def _dict_differences(journal: dict, config: dict, path: str = "") -> list[tuple[str, str, str]]:
    """(key path, journal's value, config's value) of every differing leaf of two nested dicts
    (a field map per source: cutting both reprs to their first characters hid which source and
    kind changed); a key one lacks shows as "none"."""
    out = []
    for key in sorted(journal.keys() | config.keys(), key=str):
        where = f"{path}.{key}" if path else str(key)
        a, b = journal.get(key, _NONE), config.get(key, _NONE)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _dict_differences(a, b, where)
        elif a != b:
            out.append((where, "none" if a is _NONE else _short(a), "none" if b is _NONE else _short(b)))
    return out


_NONE = object()  # a key a dict lacks (`_dict_differences`)


def _few(items: list[str], most: int = 3) -> str:
    shown = ", ".join(_short_text(t) for t in items[:most])
    return shown + (f" and {len(items) - most} more" if len(items) > most else "")


def _short_text(text: str) -> str:
    return text if len(text) <= 120 else text[:117] + "..."


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
