"""The replay source: what the dispatcher remembers of planned steps, durable or not.

With a journal, every step's cursor and plan are persisted before any rank sees the step, and
the uncommitted steps replay verbatim after a restart or a rewind: those journaled under the
world size and plan settings in force; the others are planned anew from the same samples, so a
restart with more micro-batches or a lower capacity (after running out of memory) gets them.
Without one, only the cursors after the last commit are kept in memory (a rewind within the run
still works, a restart starts over). Both refuse a commit of a step never planned, the same way.
"""

from __future__ import annotations

from collections.abc import Callable

from dispatcher_server.batching import DIGEST_PREFIX
from dispatcher_server.journal import (Journal, JournalError, StepEntry, pack_cursor,
                                       settings_id, unpack_cursor)
from dispatcher_server.planner.plan import StepPlan


#: Why a journaled plan was not replayed (`ReplaySource.journaled_plan`).
OTHER_LENGTHS = "lengths"
OTHER_SAMPLES = "samples"


class ReplaySource:
    """Cursors before each step, the plans to replay, and commits."""

    def __init__(self, journal: Journal | None, world_size: int,
                 plan_settings: dict | None = None) -> None:
        """`plan_settings`: what plans depend on besides their samples and the world size
        (`ServerConfig.plan_settings`), recorded with every step journaled."""
        self.journal = journal
        self.world_size = world_size
        self.plan_settings = plan_settings or {}
        self.settings = settings_id(self.plan_settings)
        # Without a journal: step -> cursor after it, packed, from the last commit on.
        self.cursors: dict[int, bytes] = {}
        self.committed = journal.last_committed if journal is not None else -1
        self.replay: dict[int, StepEntry] = {}
        # A rewind before the last commit: the committed steps taken again, (first, last), whose
        # journal records their samples are checked against (`journaled_plan`)
        self.recheck: tuple[int, int] | None = None
        self._as_journaled: dict[int, str | None] = {}  # step replayed verbatim -> its settings
        self.took: dict[int, list] = {}  # arrival mode: step -> its journaled `took` runs
        # Shard positions skipped as unopenable (the journal's, across restarts): a rewind or a
        # restart re-plans the steps after them without them, as they were planned.
        self.unopenable: set[int] = set(journal.unopenable) if journal is not None else set()
        # shard URL -> the identity of its copy first read whole (the journal's, across restarts)
        self.identities: dict[str, dict] = dict(journal.identities) if journal is not None else {}
        #: (first step, how its settings differ) of the journaled steps planned anew because
        #: they were planned under another world size or other plan settings; None: none is
        self.anew = self._planned_otherwise()

    @property
    def last_step(self) -> int:
        """The newest step planned (-1 for none)."""
        if self.journal is not None:
            return self.journal.last_step
        return max(self.cursors, default=self.committed)

    def cursor_before(self, step: int) -> dict | None:
        """The assembler's position before `step` (its wire form; None: the very start)."""
        if step == 0:
            return None
        if self.journal is not None:
            return self.journal.cursor_after(step - 1)
        if step - 1 not in self.cursors and not self.cursors:
            raise JournalError(f"cannot resume at step {step}: without a journal the dispatcher "
                               "knows no step before its first one (it restarted, or planned none "
                               "yet); run it with --journal-dir to resume trainers' checkpoints, "
                               "or trainers that keep running while it restarts")
        if step - 1 > max(self.cursors):
            raise JournalError(f"cannot resume at step {step}: this dispatcher has planned steps "
                               f"up to {max(self.cursors)} only, so that position (a checkpoint, "
                               "or trainers that kept running while it restarted) comes from "
                               "another run of it; run the dispatcher with --journal-dir to "
                               "resume across its restarts")
        if step - 1 not in self.cursors:
            raise JournalError(f"cannot resume at step {step}: without a journal the dispatcher "
                               f"knows the steps from the last commit on "
                               f"({min(self.cursors, default=0)}..{max(self.cursors, default=-1)}); "
                               "run it with --journal-dir to resume further back")
        return unpack_cursor(self.cursors[step - 1])

    def resumable(self, step: int) -> bool:
        """Whether delivery can start again at `step` (its cursor is known)."""
        try:
            self.cursor_before(step)
        except JournalError:
            return False
        return True

    def took_from(self, step: int) -> list | None:
        """Arrival mode: per source, the pull sequence the recorded steps from `step` on extended
        (their `took` runs, in order); None when there are none (deterministic mode, or nothing
        recorded past `step`). A rewind takes the same samples in that order, so the steps it
        re-plans are the ones trainers saw. Also kept per step for `took_of`."""
        out, self.took = None, {}
        while True:
            if self.journal is not None:
                entry = self.journal.pending.get(step)
                packed = None if entry is None else entry.cursor_after
            else:
                packed = self.cursors.get(step)
            took = None if packed is None else unpack_cursor(packed).get("took")
            if took is None:
                return out
            self.took[step] = took
            out = [[] for _ in took] if out is None else out
            for runs, more in zip(out, took):
                runs.extend(more)
            step += 1

    def took_of(self, step: int) -> list | None:
        """The `took` runs of a step replayed as journaled (see `took_from`)."""
        return self.took.pop(step, None)

    def records(self, step: int, *, verbatim: bool) -> bool:
        """Whether `record` writes `step` (a verbatim replay of a journaled step is not)."""
        return self.journal is None or not verbatim or step > self.journal.last_step

    def reset(self, step: int) -> None:
        """Steps from `step` on are delivered again: journaled plans of theirs replay verbatim
        (those planned as this dispatcher plans, `journaled_plan`)."""
        self.replay, self._as_journaled = {}, {}
        # A rewind to a checkpoint before the last commit: the trainers' commits from here on
        # are of the steps taken again (the journal moves its commit back as it records them).
        # Those steps are planned anew, but checked against their records first: readers that
        # keep or skip other samples since would hand them out with other samples unnoticed.
        self.recheck = (step, self.committed) if self.journal is not None else None
        self.committed = min(self.committed, step - 1)
        if self.journal is not None:
            # A dict of its own: a commit arriving before a step is replayed (a rank ahead of
            # another) drops the journal's entries up to it, and the step must still replay.
            self.replay = {s: e for s, e in self.journal.pending.items()
                           if s >= step and (e.plan is not None or e.plan_at is not None)}

    def journaled_plan(self, step: int, digest: str,
                       keys_digest: Callable[[], str] | None = None) -> tuple[dict | None, str]:
        """(plan to replay or None, why a journaled plan was dropped: "" when none was,
        `OTHER_LENGTHS` when the step's samples were counted otherwise, `OTHER_SAMPLES` when
        its samples are others than journaled (journals that keep `keys`)). A journal written
        before digests covered lengths is compared by `keys_digest()`. A step
        journaled under another world size or other plan settings is planned anew (None) from
        the same samples: its plan would break the settings in force (a capacity lowered after
        running out of memory)."""
        entry = self.replay.pop(step, None)
        if entry is None:
            return None, self._rechecked(step, digest, keys_digest)
        mismatch = _mismatch(entry, digest, keys_digest)
        if mismatch:
            return None, mismatch
        if not self._planned_alike(entry):
            return None, ""
        self._as_journaled[step] = entry.settings
        return self.journal.plan_of(entry), ""

    def _rechecked(self, step: int, digest: str, keys_digest: Callable[[], str] | None) -> str:
        """How a committed step taken again (a rewind before the last commit) differs from its
        journal record ("" when alike, or when the journal keeps it no more): it is planned
        anew either way, as the journal moves its commit back."""
        if self.recheck is None or not self.recheck[0] <= step <= self.recheck[1]:
            return ""
        try:
            entry = self.journal.record_of(step)
        except JournalError:
            return ""
        return _mismatch(entry, digest, keys_digest)

    def _planned_alike(self, entry: StepEntry) -> bool:
        """Whether a journaled step was planned under the world size and plan settings in
        force (a journal from before settings were recorded is taken to be)."""
        return entry.world_size == self.world_size and entry.settings in (None, self.settings)

    def _planned_otherwise(self) -> tuple[int, list[str]] | None:
        """The first uncommitted journaled step planned under another world size or other
        plan settings, and how they differ from those in force (`anew`)."""
        if self.journal is None:
            return None
        entry = next((e for s, e in sorted(self.journal.pending.items())
                      if (e.plan is not None or e.plan_at is not None)
                      and not self._planned_alike(e)), None)
        if entry is None:
            return None
        diff = [] if entry.world_size == self.world_size else [
            f"world_size: journal {entry.world_size}, now {self.world_size}"]
        if entry.settings not in (None, self.settings):
            theirs = self.journal.plan_settings.get(entry.settings)
            diff += (["plan settings (not in the journal)"] if theirs is None
                     else setting_differences(theirs, self.plan_settings))
        return entry.step, diff

    def record(self, entry: StepEntry, plan: StepPlan, *, verbatim: bool) -> None:
        """Remember a planned step before it is sent (OSError if the journal cannot)."""
        settings = self._as_journaled.pop(entry.step, self.settings) if verbatim else self.settings
        if self.journal is None:
            self.cursors[entry.step] = pack_cursor(entry.cursor_after)
        elif self.records(entry.step, verbatim=verbatim):
            # A verbatim replay is journaled already: recording it again would supersede the
            # journaled steps after it, which ranks ahead of the others may be committing. Unless
            # an earlier step planned anew superseded it: then it is journaled again, or the
            # journal's steps would not follow one another. Verbatim, it keeps the settings it
            # was planned under: those in force, or None (a journal from before they were kept).
            entry.plan = plan.to_dict()
            if settings is not None:
                entry.settings = self.journal.record_plan_settings(self.plan_settings)
            self.journal.record_step(entry)

    def commit(self, step: int) -> bool:
        """Record that trainers checkpointed `step`; False if not newer than the last commit.
        JournalError for a step never planned."""
        if step <= self.committed:
            return False
        if step > self.last_step:
            raise JournalError(f"cannot commit step {step}: it was never planned "
                               f"(the dispatcher has planned steps up to {self.last_step})")
        if self.journal is not None:
            self.journal.commit(step)
        else:
            # Steps before a commit are never resumed from: their cursors go.
            for s in [s for s in self.cursors if s < step]:
                del self.cursors[s]
        self.committed = step
        return True

    def record_unopenable(self, pos: int, url: str) -> None:
        """Remember that shard position `pos` was skipped because no reader could open it
        (OSError if the journal cannot)."""
        if self.journal is not None:
            self.journal.record_unopenable(pos, url)
        self.unopenable.add(pos)

    def record_identity(self, url: str, identity: dict) -> None:
        """Remember the identity of the copy of shard `url` first read whole (OSError if the
        journal cannot)."""
        if self.journal is not None:
            self.journal.record_identity(url, identity)
        self.identities.setdefault(url, identity)

    def record_skipped(self, url: str, skipped: list) -> None:
        """Journal skipped samples ((key, reason, index) records) for the audit."""
        if self.journal is not None and skipped:
            self.journal.record_skipped(url, skipped)


def _mismatch(entry: StepEntry, digest: str, keys_digest: Callable[[], str] | None) -> str:
    """How a step's samples differ from its journal record `entry`: "" when alike,
    `OTHER_SAMPLES`, or `OTHER_LENGTHS`. A record written before digests covered lengths is
    compared by `keys_digest()`."""
    if not entry.digest.startswith(DIGEST_PREFIX) and keys_digest is not None:
        digest = keys_digest()
    if entry.digest == digest:
        return ""
    if entry.keys is not None and keys_digest is not None and entry.keys != keys_digest():
        return OTHER_SAMPLES
    return OTHER_LENGTHS


def setting_differences(journal: dict, now: dict) -> list[str]:
    """'name: journal X, now Y' for each plan setting that differs, nested ones by dotted name
    (`cost.llm.a`), so the line names what changed rather than a whole cost model."""
    theirs, ours = _flat(journal), _flat(now)
    return [f"{k}: journal {theirs.get(k)!r}, now {ours.get(k)!r}"
            for k in sorted(theirs.keys() | ours.keys()) if theirs.get(k) != ours.get(k)]


def _flat(settings: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in settings.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + str(k)] = v
    return out
