"""Journal: replay state, plan files, torn writes told from corruption, failed writes cut back,
checkpoints that keep disk and restart bounded, skipped keys kept for audits."""

from __future__ import annotations

import errno
import logging
import os
import random
import struct
import zlib

import msgpack
import pytest

from dispatcher_server import journal as journal_module
from dispatcher_server import recordlog
from dispatcher_server.journal import Journal, JournalError, JournalWriteError, SkippedKey, StepEntry
from dispatcher_server.recordlog import MAGIC

HEAD = 16  # magic, length, payload crc, header crc


def _fp(**kw):
    return {"shards": ["a.tar", "b.tar"], "seed": 0, "mode": "deterministic", "global_batch": 8,
            "token_budget": None, **kw}


def _entry(step):
    return StepEntry(step=step, epoch=0, world_size=2, num_samples=8,
                     cursor_after={"base": step + 1}, digest="d", plan={"p": step})


def _big_entry(step: int, plan: dict) -> StepEntry:
    return StepEntry(step=step, epoch=0, world_size=2, num_samples=8,
                     cursor_after={"base": step + 1}, digest=f"d{step}", plan=plan)


def _plan_bytes(directory) -> int:
    return sum(os.path.getsize(os.path.join(directory, f)) for f in journal_module.PLAN_FILES)


def _frames(data: bytes) -> list[tuple[int, int]]:
    """(offset, end) of each record of a journal file in the current layout."""
    out, at = [], 0
    while at < len(data):
        assert data[at:at + 4] == MAGIC
        (length,) = struct.unpack_from("<I", data, at + 4)
        out.append((at, at + HEAD + length))
        at += HEAD + length
    return out


def _state(j: Journal) -> tuple:
    return (j.last_step, j.last_committed, j.num_skipped,
            {s: (e.plan, e.cursor_after) for s, e in j.pending.items()})


def _files(directory) -> dict[str, bytes]:
    return {n: (directory / n).read_bytes() for n in sorted(os.listdir(directory))}


def test_journal_survives_a_torn_record_and_refuses_another_config(tmp_path):
    j = Journal(str(tmp_path), _fp())
    for s in range(3):
        j.record_step(_entry(s))
    j.commit(1)
    j.close()
    cut_short = recordlog.frame({"kind": "commit", "step": 2})[:-3]  # a crash mid-write
    with open(j.path, "ab") as f:
        f.write(cut_short)
    j2 = Journal(str(tmp_path), _fp())
    assert j2.last_committed == 1 and j2.last_step == 2
    assert sorted(j2.pending) == [2] and j2.plan_of(j2.pending[2]) == {"p": 2}  # committed plans dropped
    assert j2.cursor_after(1) == {"base": 2}  # step 1 is committed: read back from the file
    assert j2.read_entry(0).plan == {"p": 0}
    with pytest.raises(JournalError, match="never planned"):
        j2.commit(7)
    with pytest.raises(JournalError, match="knows steps 0..2"):
        j2.cursor_after(8)
    j2.close()
    assert os.path.getsize(j2.path) > 0
    with pytest.raises(JournalError, match="seed: journal has 0, config has 5") as refused:
        Journal(str(tmp_path), _fp(seed=5))
    # The way out it names must work: a new journal directory is a new sequence, from step 0
    # (it said "or use a new journal directory", and trainers resuming there were refused).
    assert "new journal directory and start the trainers without their data state" in str(refused.value)


def test_a_changed_shard_list_is_refused_naming_the_difference(tmp_path):
    """Both lists cut to their first entries looked the same: the refusal says the counts and
    the entries one list has and the other lacks, or the first entry that differs."""
    shards = [f"/data/shard-{i:06d}.tar" for i in range(10)]
    j = Journal(str(tmp_path), _fp(shards=shards))
    j.record_step(_entry(0))
    j.close()
    with pytest.raises(JournalError) as e:
        Journal(str(tmp_path), _fp(shards=shards[:7] + shards[8:]))
    assert "journal has 10 entries, config has 9; config lacks 1: '/data/shard-000007.tar'" in str(e.value)
    with pytest.raises(JournalError) as e:
        Journal(str(tmp_path), _fp(shards=[*shards, "/data/extra.tar"]))
    assert "config adds 1: '/data/extra.tar'" in str(e.value)
    with pytest.raises(JournalError) as e:
        Journal(str(tmp_path), _fp(shards=shards[:4] + [shards[5], shards[4]] + shards[6:]))
    assert ("first difference at entry 4: journal has '/data/shard-000004.tar', config has "
            "'/data/shard-000005.tar'") in str(e.value)


def test_a_changed_field_map_is_refused_naming_the_source_and_kind(tmp_path):
    """Probe: both field maps cut to their first 117 characters looked the same, and the
    change (a later source's image extensions) was cut off."""
    maps = {name: {"image": ["jpg", "png"], "text": ["txt"], "audio": ["wav", "flac"]}
            for name in ("captions", "speech", "chat")}
    j = Journal(str(tmp_path), _fp(field_maps=maps))
    j.record_step(_entry(0))
    j.close()
    changed = {**maps, "chat": {**maps["chat"], "image": ["jpg"]}}
    with pytest.raises(JournalError) as e:
        Journal(str(tmp_path), _fp(field_maps=changed))
    assert "field_maps: chat.image: journal has ['jpg', 'png'], config has ['jpg']" in str(e.value)


def test_uncommitted_plans_are_kept_on_disk_not_in_memory(tmp_path):
    """Each step's plan stayed in memory until a commit: MBs a step at thousands of ranks, so a
    job that checkpoints every thousand steps held GBs. Replays read them back."""
    j = Journal(str(tmp_path), _fp())
    for s in range(5):
        j.record_step(_entry(s))
    assert all(e.plan is None and e.plan_at is not None for e in j.pending.values())
    assert [j.plan_of(j.pending[s]) for s in range(5)] == [{"p": s} for s in range(5)]
    j.close()


def test_journal_drops_committed_plans_and_keeps_a_rewound_steps_plan_until_its_commit(tmp_path):
    j = Journal(str(tmp_path), _fp())
    for s in range(6):
        j.record_step(_entry(s))
    j.commit(3)
    assert sorted(j.pending) == [4, 5]
    j.record_step(_entry(2))  # a rollback re-plans step 2: later steps are superseded
    assert j.last_step == 2 and sorted(j.pending) == [2] and j.plan_of(j.pending[2]) == {"p": 2}
    for s in (3, 4):
        j.record_step(_entry(s))
    j.commit(4)
    assert not j.pending
    j.close()
    reopened = Journal(str(tmp_path), _fp())  # the same state from the file
    assert reopened.last_step == 4 and reopened.last_committed == 4 and not reopened.pending
    assert [reopened.cursor_after(s) for s in range(5)] == [{"base": s} for s in range(1, 6)]
    reopened.close()


def test_journal_plan_files_take_turns_so_disk_and_memory_stay_flat(tmp_path):
    """Plans go to two files used in turn: a full one hands over to the other once none of
    that one's plans is still needed; memory holds only the uncommitted steps."""
    big = {"p": "x" * 2000}
    j = Journal(str(tmp_path), _fp(), fsync=False, plan_file_bytes=20_000)  # ~10 plans a file
    peak = 0
    for s in range(400):
        j.record_step(_big_entry(s, big))
        if s % 10 == 9 and s < 390:
            j.commit(s)
        peak = max(peak, _plan_bytes(tmp_path))
        assert len(j.pending) <= 10
    assert peak < 2 * 20_000 + 2 * 2100  # not 400 plans: ~0.8 MB
    j.record_step(_big_entry(395, {"p": "rewound"}))  # a rollback supersedes 396..399
    j.record_skipped("a.tar", [("k1", "bad_image"), ("k2", "bad_audio")])
    journal_size = os.path.getsize(j.path)
    j.close()
    assert journal_size < 400 * 200  # one small record per step, no plans
    r = Journal(str(tmp_path), _fp(), plan_file_bytes=20_000)
    try:
        assert (r.last_step, r.last_committed, r.num_skipped) == (395, 389, 2)
        assert sorted(r.pending) == list(range(390, 396)) and r.plan_of(r.pending[395]) == {"p": "rewound"}
        assert r.plan_of(r.pending[391]) == big and r.read_entry(391).plan == big
        assert r.read_entry(12).plan is None and r.read_entry(12).digest == "d12"  # file reused
        assert [r.cursor_after(s) for s in range(396)] == [{"base": s + 1} for s in range(396)]
        r.record_step(_entry(396))  # and it goes on appending
        assert r.commit(396) and not r.pending
    finally:
        r.close()


def test_journal_keeps_every_uncommitted_plan_when_commits_stall(tmp_path):
    j = Journal(str(tmp_path), _fp(), fsync=False, plan_file_bytes=20_000)
    for s in range(60):  # no commit: no plan file can be reused, they grow
        j.record_step(_big_entry(s, {"p": f"{s:04d}" * 500}))
    assert _plan_bytes(tmp_path) > 60 * 2000
    j.close()
    r = Journal(str(tmp_path), _fp(), fsync=False, plan_file_bytes=20_000)
    try:
        assert [r.plan_of(r.pending[s]) for s in range(60)] == [{"p": f"{s:04d}" * 500} for s in range(60)]
        r.commit(59)
        r.record_step(_big_entry(60, {"p": "after"}))  # the full file hands over to the other,
        sizes = [os.path.getsize(tmp_path / f) for f in journal_module.PLAN_FILES]
        assert min(sizes) < 200 and r.plan_of(r.pending[60]) == {"p": "after"}  # emptied first
        for s in range(61, 75):  # and at the next turn the backlog's file is emptied too
            r.record_step(_big_entry(s, {"p": f"{s:04d}" * 500}))
            r.commit(s)
        assert _plan_bytes(tmp_path) < 2 * (20_000 + 2100)
    finally:
        r.close()


def test_the_plan_file_still_needed_is_found_from_the_oldest_pending_step(tmp_path):
    """Whether the other plan file still holds a pending plan is read off the oldest pending
    step (O(1) however far commits lag): the same answer as looking through every pending step,
    through random runs of steps, rewinds, commits and reopens."""
    rng = random.Random(7)
    j = Journal(str(tmp_path), _fp(), fsync=False, plan_file_bytes=6_000)  # ~3 plans a file
    seen = set()
    try:
        step = 0
        for i in range(600):
            j.record_step(_big_entry(step, {"p": "x" * 2000}))
            if rng.random() < 0.1 and step > j.last_committed + 1:  # a rewind re-plans a step
                step = rng.randint(j.last_committed + 1, step)
            else:
                step += 1
            if rng.random() < 0.15 and j.last_step > j.last_committed:
                j.commit(rng.randint(j.last_committed + 1, j.last_step))
            if i % 97 == 96:
                j.close()
                j = Journal(str(tmp_path), _fp(), fsync=False, plan_file_bytes=6_000)
                step = j.last_step + 1
            other = 1 - j._gen
            every = any(e.plan_at is not None and e.plan_at[0] == other for e in j.pending.values())
            assert (j._oldest_plan_file() == other) == every
            seen.add(every)
        assert seen == {True, False}  # both answers came up
    finally:
        j.close()


# -- journals in the layout before MAGIC ----------------------------------------------------
def _legacy_record(rec: dict) -> bytes:
    payload = msgpack.packb(rec, use_bin_type=True)
    return recordlog.LEGACY_HEAD.pack(len(payload), zlib.crc32(payload)) + payload


def _legacy_journal() -> list[bytes]:
    old = [{"kind": "config", **_fp()}]
    old += [{"kind": "step", "step": s, "epoch": 0, "world_size": 2, "cursor_before": {"base": s},
             "cursor_after": {"base": s + 1}, "num_samples": 8, "digest": "d", "plan": {"p": s}}
            for s in range(4)]
    old += [{"kind": "commit", "step": 1},
            {"kind": "skipped", "shard": "a.tar", "keys": [["k1", "bad_image"]]}]
    return [_legacy_record(r) for r in old]


def test_journal_written_with_inline_plans_still_opens(tmp_path):
    """Journals written before plan files held each plan (and the cursor before the step)
    inside the step record, in the layout before MAGIC: they load, are rewritten in the current
    layout (skipped keys moved to skipped.mmd), and new steps go on in the current format."""
    (tmp_path / journal_module.JOURNAL_FILE).write_bytes(b"".join(_legacy_journal()))
    j = Journal(str(tmp_path), _fp(), fsync=False)
    try:
        assert sorted(j.pending) == [2, 3] and j.plan_of(j.pending[3]) == {"p": 3}
        assert j.cursor_after(1) == {"base": 2} and j.read_entry(0).plan == {"p": 0}
        assert list(j.skipped_keys()) == [SkippedKey("a.tar", "k1", "bad_image", None)]
        j.record_step(_entry(4))
        assert j.read_entry(4).plan == {"p": 4} and j.cursor_after(4) == {"base": 5}
    finally:
        j.close()
    assert (tmp_path / journal_module.JOURNAL_FILE).read_bytes()[:4] == MAGIC
    r = Journal(str(tmp_path), _fp(), fsync=False)
    try:
        assert (r.last_step, r.last_committed, r.num_skipped, sorted(r.pending)) == (4, 1, 1, [2, 3, 4])
        assert [r.cursor_after(s) for s in range(5)] == [{"base": s + 1} for s in range(5)]
        assert list(r.skipped_keys()) == [SkippedKey("a.tar", "k1", "bad_image", None)]
    finally:
        r.close()


def test_a_legacy_journal_with_a_bad_length_in_the_middle_is_refused_untouched(tmp_path):
    """The issue's reproduction, on the layout before MAGIC: a length that runs past the end
    of the file is not a torn write while intact records follow it."""
    records = _legacy_journal()
    data = bytearray(b"".join(records))
    at = sum(map(len, records[:3]))
    data[at + 2] ^= 0x01  # the length's third byte: its end now lies far past the file's
    path = tmp_path / journal_module.JOURNAL_FILE
    path.write_bytes(bytes(data))
    with pytest.raises(JournalError, match=f"corrupted at byte {at}"):
        Journal(str(tmp_path), _fp())
    assert path.read_bytes() == bytes(data)


def test_a_legacy_journal_cut_short_at_its_end_opens_without_its_last_record(tmp_path):
    records = _legacy_journal()
    (tmp_path / journal_module.JOURNAL_FILE).write_bytes(b"".join(records)[:-3])
    j = Journal(str(tmp_path), _fp(), fsync=False)
    try:  # the skipped record was the one cut short
        assert (j.last_step, j.last_committed, j.num_skipped) == (3, 1, 0)
        assert sorted(j.pending) == [2, 3] and not list(j.skipped_keys())
    finally:
        j.close()


# -- torn writes and corruption -------------------------------------------------------------
def _written(tmp_path) -> bytes:
    """A journal of 10 records: config, steps 0..5, the commit of 1, a skipped record, the
    commit of 3."""
    j = Journal(str(tmp_path), _fp(), fsync=False)
    for s in range(6):
        j.record_step(_entry(s))
    j.commit(1)
    j.record_skipped("a.tar", [("k", "bad_image", 4)])
    j.commit(3)
    j.close()
    return (tmp_path / journal_module.JOURNAL_FILE).read_bytes()


@pytest.mark.parametrize("which", ["first", "middle", "last"])
@pytest.mark.parametrize("byte", [0, 4, 6, 8, 12, HEAD, -1], ids=[
    "magic", "length-low", "length-high", "crc", "header-crc", "payload-first", "payload-last"])
def test_a_flipped_bit_anywhere_is_corruption_not_a_torn_write(tmp_path, which, byte):
    data = bytearray(_written(tmp_path))
    frames = _frames(bytes(data))
    at, end = frames[{"first": 0, "middle": len(frames) // 2, "last": -1}[which]]
    data[end - 1 if byte == -1 else at + byte] ^= 0x04
    path = tmp_path / journal_module.JOURNAL_FILE
    path.write_bytes(bytes(data))
    with pytest.raises(JournalError, match=f"journal '{path}' is corrupted at byte {at} "):
        Journal(str(tmp_path), _fp())
    assert path.read_bytes() == bytes(data)  # left as it was, byte for byte


def test_a_final_record_cut_at_any_byte_is_dropped_and_the_rest_kept(tmp_path, caplog):
    data = _written(tmp_path)
    path = tmp_path / journal_module.JOURNAL_FILE
    at, end = _frames(data)[-1]  # the commit of step 3
    for cut in range(at + 1, end):
        path.write_bytes(data[:cut])
        with caplog.at_level(logging.WARNING, "mmdispatch.journal"):
            caplog.clear()
            j = Journal(str(tmp_path), _fp(), fsync=False)
        try:
            assert (j.last_step, j.last_committed, sorted(j.pending)) == (5, 1, [2, 3, 4, 5])
            assert (f"event=journal_torn_write journal={path} dropped_bytes={cut - at} at={at} "
                    "dropped_records=1 last_step=5 last_committed=1") in caplog.text
            assert path.read_bytes() == data[:at]  # cut off, and nothing else changed
            assert j.commit(3)  # appending goes on from the intact end
        finally:
            j.close()
        r = Journal(str(tmp_path), _fp(), fsync=False)
        assert (r.last_step, r.last_committed, sorted(r.pending)) == (5, 3, [4, 5])
        r.close()


def test_a_tail_that_does_not_start_a_record_is_corruption(tmp_path):
    data = _written(tmp_path) + b"\x40\x00\x00\x00garbage"
    path = tmp_path / journal_module.JOURNAL_FILE
    path.write_bytes(data)
    with pytest.raises(JournalError, match=f"corrupted at byte {len(data) - 11} "):
        Journal(str(tmp_path), _fp())
    assert path.read_bytes() == data


def test_a_pending_steps_corrupt_plan_is_refused_naming_the_plan_file(tmp_path):
    j = Journal(str(tmp_path), _fp(), fsync=False)
    for s in range(3):
        j.record_step(_entry(s))
    j.commit(0)
    g, at = j.pending[2].plan_at
    j.close()
    plans = tmp_path / journal_module.PLAN_FILES[g]
    data = bytearray(plans.read_bytes())
    data[at + HEAD + 1] ^= 0x01
    plans.write_bytes(bytes(data))
    with pytest.raises(JournalError, match=f"plans-{g}.mmd' is corrupted at byte {at}: the plan "
                                           "of uncommitted step 2, which a replay needs, does not "
                                           "read back intact; restore it from a backup"):
        Journal(str(tmp_path), _fp())
    assert plans.read_bytes() == bytes(data)


def test_a_missing_or_cut_short_plan_file_is_named_so_and_left_as_it_was(tmp_path):
    """A deleted plans-0.mmd was refused as 'corrupted at byte N', and the start created it
    empty, so the next start said the same of an empty file."""
    j = Journal(str(tmp_path), _fp(), fsync=False)
    for s in range(4):
        j.record_step(_entry(s))
    j.commit(1)
    at = j.pending[3].plan_at[1]
    j.close()
    plans = tmp_path / journal_module.PLAN_FILES[0]
    data = plans.read_bytes()
    plans.unlink()
    for _ in range(2):
        with pytest.raises(JournalError) as e:
            Journal(str(tmp_path), _fp())
        assert str(e.value) == (
            f"journal '{plans}' is missing: it held the plans of uncommitted steps 2..3, which a "
            "replay needs; restore it from a backup, or start a new --journal-dir (and the "
            "trainers from step 0)")
        assert not plans.exists()
    plans.write_bytes(data[:at])
    with pytest.raises(JournalError, match=f"'{plans}' is cut short: it ends at byte {at}, "
                                           f"before the plan of uncommitted step 3 \\(at byte {at}\\)"):
        Journal(str(tmp_path), _fp())


def _run(directory, steps: int = 10, commit_every: int = 3) -> None:
    j = Journal(str(directory), _fp(), fsync=False)
    for s in range(steps):
        j.record_step(_entry(s))
        if s % commit_every == commit_every - 1:
            j.commit(s)
    j.close()


@pytest.mark.parametrize("how", ["half", "config-only", "empty", "missing"])
def test_a_journal_that_lost_records_its_plan_files_outlived_is_refused(tmp_path, how):
    """journal.mmd cut in the middle opened at an earlier step (the cut taken for a torn last
    write), and emptied or removed it started a new job at step 0: fresh trainers would have
    taken the epoch over, silently. Refused naming what each file knows, files untouched."""
    _run(tmp_path)
    path = tmp_path / journal_module.JOURNAL_FILE
    data = path.read_bytes()
    frames = _frames(data)
    if how == "half":
        path.write_bytes(data[:len(data) // 2])
    elif how == "config-only":
        path.write_bytes(data[:frames[0][1]])
    elif how == "empty":
        path.write_bytes(b"")
    else:
        path.unlink()
    before = _files(tmp_path)
    with pytest.raises(JournalError) as e:
        Journal(str(tmp_path), _fp())
    text = str(e.value)
    plans = tmp_path / journal_module.PLAN_FILES[0]
    if how == "half":
        last = max(int(r["step"]) for r in _records(data[:len(data) // 2]) if r["kind"] == "step")
        assert text.startswith(f"journal '{path}' records steps up to {last} (last commit ")
        assert f"but '{plans}' holds {9 - last} plans written after step {last}'s, of steps up to 9" in text
    else:
        state = {"config-only": "records no step", "empty": "is empty", "missing": "is missing"}[how]
        assert text.startswith(f"journal '{path}' {state}, but '{plans}' holds plans of steps up to 9")
    assert "backup, or start a new --journal-dir (and the trainers from step 0)" in text
    assert "\n" not in text
    assert _files(tmp_path) == before  # nothing cut, created or rewritten


def _records(data: bytes) -> list[dict]:
    out = []
    for at, end in _frames(data):
        if end > len(data):
            break
        out.append(msgpack.unpackb(data[at + HEAD:end], raw=False))
    return out


@pytest.mark.parametrize("file", ["inputs.json", journal_module.SKIPPED_FILE])
def test_an_emptied_journal_beside_its_jobs_input_rules_or_skipped_keys_is_refused(tmp_path, file):
    j = Journal(str(tmp_path), _fp(), fsync=False)
    j.record_skipped("a.tar", [("k", "bad_image", 4)])
    j.close()
    (tmp_path / "inputs.json").write_text('{"tokenizer": "t1"}')
    if file == "inputs.json":
        (tmp_path / journal_module.SKIPPED_FILE).unlink()
    else:
        (tmp_path / "inputs.json").unlink()
    (tmp_path / journal_module.JOURNAL_FILE).write_bytes(b"")
    with pytest.raises(JournalError, match=f"journal '{tmp_path / journal_module.JOURNAL_FILE}' "
                                           f"is empty, but '{tmp_path / file}' holds "):
        Journal(str(tmp_path), _fp())
    # Beside a journal that holds a configuration, they are a job that planned no step yet.
    (tmp_path / journal_module.JOURNAL_FILE).write_bytes(recordlog.frame({"kind": "config", **_fp()}))
    Journal(str(tmp_path), _fp()).close()


def test_a_crash_between_a_plan_and_its_record_still_opens_after_every_restart(tmp_path,
                                                                                monkeypatch):
    """The one step of slack a crash leaves: the plan of the step after the newest record is
    written, its record is not (cut short). Again at the next restart: two plans of that step.
    After a rewind, the superseded steps' plans lie before the newest one's and do not count."""
    _run(tmp_path, steps=6)
    for attempt in range(2):
        j = Journal(str(tmp_path), _fp(), fsync=False)
        assert j.last_step == 5
        with monkeypatch.context() as m:
            _fail(m, "write", journal_module.JOURNAL_FILE, _Crash())
            with pytest.raises(_Crash):
                j.record_step(_entry(6))
        j.close()
    j = Journal(str(tmp_path), _fp(), fsync=False)
    j.record_step(_entry(6))
    j.commit(6)
    j.record_step(_entry(4))  # a rewind: plans of steps 5 and 6 lie before step 4's
    j.close()
    j = Journal(str(tmp_path), _fp(), fsync=False)
    assert j.last_step == 4 and j.plan_of(j.pending[4]) == {"p": 4}
    j.close()
    with open(tmp_path / journal_module.PLAN_FILES[0], "ab") as f:  # one plan past the slack
        f.write(recordlog.frame({"step": 6, "plan": {"p": 6}}))
    with pytest.raises(JournalError, match="records steps up to 4 \\(last commit 3\\), but .* "
                                           "holds 1 plan written after step 4's, of steps up to 6"):
        Journal(str(tmp_path), _fp())


def _run_past_handovers(directory, steps: int) -> list[tuple[int, int]]:
    """A run whose plan files hand over every ~3 plans: (the last step of a file's turn, the
    file handed over to) at each handover."""
    j = Journal(str(directory), _fp(), fsync=False, plan_file_bytes=6_000)
    handovers = []
    for s in range(steps):
        g = j._gen
        j.record_step(_big_entry(s, {"p": "x" * 2000}))
        if j._gen != g:
            handovers.append((s - 1, j._gen))
        j.commit(s)
    j.close()
    return handovers


def _cut_after_step(path, step: int) -> None:
    """Cut journal.mmd right after the record of `step` and the commits that follow it."""
    data = path.read_bytes()
    cut = None
    for (_, end), rec in zip(_frames(data), _records(data)):
        if rec["kind"] == "step" and rec["step"] == step:
            cut = end
        elif cut is not None and rec["kind"] == "commit" and rec["step"] <= step:
            cut = end
        elif cut is not None:
            break
    path.write_bytes(data[:cut])


def test_a_journal_cut_where_the_plans_moved_to_the_other_file_is_refused(tmp_path):
    """Cut right after the last step whose plan lies in the file that handed over, journal.mmd
    had lost nothing that file showed, and the later plans lay in the other file, which was
    not compared: the job resumed from an earlier step, silently. Each plan carries the plan
    files' turn, so the other file's later plans are told from its older ones."""
    handovers = _run_past_handovers(tmp_path, steps=41)
    last, handed = handovers[-1]
    assert len(handovers) > 5 and 40 - last >= 2  # more than the one plan of slack
    _cut_after_step(tmp_path / journal_module.JOURNAL_FILE, last)
    before = _files(tmp_path)
    with pytest.raises(JournalError) as e:
        Journal(str(tmp_path), _fp(), plan_file_bytes=6_000)
    assert str(e.value) == (
        f"journal '{tmp_path / journal_module.JOURNAL_FILE}' records steps up to {last} (last "
        f"commit {last}), but '{tmp_path / journal_module.PLAN_FILES[handed]}' holds {40 - last} "
        f"plans written after step {last}'s, of steps up to 40: journal.mmd lost its later "
        "records (cut short, or an older copy put back), or that plan file came from another "
        "copy of the journal, and resuming would plan those steps again; restore the "
        "directory's files together from one backup, or start a new --journal-dir (and the "
        "trainers from step 0)")
    assert _files(tmp_path) == before  # nothing cut, created or rewritten


@pytest.mark.parametrize("back", [2, 3, 4])
def test_a_journal_cut_before_its_plan_file_was_written_again_is_refused(tmp_path, back):
    """Cut further back, the newest recorded plan's own file was since handed over to again,
    emptied and written anew: where that left it shorter than the plan's offset, nothing was
    compared and the job resumed from an earlier step. The step record keeps the turn its
    plan was written at, so both files are known to hold only later plans."""
    handovers = _run_past_handovers(tmp_path, steps=41)
    last, _ = handovers[-back]
    _cut_after_step(tmp_path / journal_module.JOURNAL_FILE, last)
    before = _files(tmp_path)
    with pytest.raises(JournalError) as e:
        Journal(str(tmp_path), _fp(), plan_file_bytes=6_000)
    text = str(e.value)
    assert text.startswith(f"journal '{tmp_path / journal_module.JOURNAL_FILE}' records steps up "
                           f"to {last} (last commit {last}), but '{tmp_path}/plans-")
    assert f"written after step {last}'s, of steps up to 40: journal.mmd lost" in text
    assert _files(tmp_path) == before


def test_a_checkpoint_keeps_the_turn_of_the_uncommitted_steps_plans(tmp_path):
    j = _checkpoint_ready(tmp_path)
    assert j.commit(9)  # checkpointed: steps 10..59 are kept from memory
    j.close()
    steps = [r for r in _records((tmp_path / journal_module.JOURNAL_FILE).read_bytes())
             if r["kind"] == "step"]
    assert steps and all(len(r["plan_at"]) == 3 for r in steps)


def test_a_crash_at_a_handover_leaves_one_plan_of_slack_in_the_other_file(tmp_path, monkeypatch):
    """The plan of the step after the newest record can be the first of the file handed over
    to: that journal opens, after every such restart. Started again with a larger plan-file
    limit, the dispatcher writes on in the file it was writing, after that plan: a rewind below
    its step then opens too (the plans written on carry the newest turn, not their file's)."""
    _run_past_handovers(tmp_path, steps=41)
    j = Journal(str(tmp_path), _fp(), fsync=False, plan_file_bytes=6_000)
    step = j.last_step + 1
    while j._plans[j._gen].size < 6_000:  # fill the file: the next plan hands over
        j.record_step(_big_entry(step, {"p": "x" * 2000}))
        j.commit(step)
        step += 1
    g = j._gen
    j.close()
    for attempt in range(2):
        j = Journal(str(tmp_path), _fp(), fsync=False, plan_file_bytes=6_000)
        assert j.last_step == step - 1
        with monkeypatch.context() as m:
            _fail(m, "write", journal_module.JOURNAL_FILE, _Crash())
            with pytest.raises(_Crash):
                j.record_step(_big_entry(step, {"p": "x" * 2000}))
        assert j._gen == 1 - g  # the plan went to the file handed over to
        j.close()
    j = Journal(str(tmp_path), _fp(), fsync=False, plan_file_bytes=1 << 20)
    for s in (step, step + 1):
        j.record_step(_big_entry(s, {"p": "x" * 2000}))
        j.commit(s)
    assert j._gen == g  # not full under the larger limit
    # A rewind: the plan of `step` in the other file is of a step past it, and older.
    j.record_step(_big_entry(step - 2, {"p": "rewound"}))
    j.close()
    j = Journal(str(tmp_path), _fp(), fsync=False, plan_file_bytes=1 << 20)
    assert j.last_step == step - 2 and j.plan_of(j.pending[step - 2]) == {"p": "rewound"}
    j.close()


def test_a_journal_from_before_plans_carried_their_turn_opens_and_is_checked_after_a_handover(
        tmp_path, monkeypatch):
    """Plans written before they carried the plan files' turn read as turn 0 in both files, so
    the other file cannot be told later and is not compared: such a journal cut where the plans
    moved opens as it did. From the first handover after the upgrade on, it is compared."""
    def before(rec: dict) -> bytes:  # neither plans nor step records carry a turn
        rec = {k: v for k, v in rec.items() if k != "turn"}
        if "plan_at" in rec:
            rec["plan_at"] = rec["plan_at"][:2]
        return recordlog.frame(rec)

    with monkeypatch.context() as m:
        m.setattr(journal_module, "frame", before)
        last, _ = _run_past_handovers(tmp_path, steps=41)[-1]
    assert "turn" not in _records((tmp_path / journal_module.PLAN_FILES[0]).read_bytes())[0]
    _cut_after_step(tmp_path / journal_module.JOURNAL_FILE, last)
    j = Journal(str(tmp_path), _fp(), fsync=False, plan_file_bytes=6_000)
    assert j.last_step == last  # as before: it resumes after the cut
    g = j._gen
    for s in (last + 1, last + 2):
        j.record_step(_big_entry(s, {"p": "x" * 2000}))
        j.commit(s)
    assert j._gen == 1 - g  # the first plan after the upgrade handed over, as turn 1
    j.close()
    _cut_after_step(tmp_path / journal_module.JOURNAL_FILE, last)
    with pytest.raises(JournalError, match=f"records steps up to {last} \\(last commit {last}\\), "
                                           f"but .* holds 2 plans written after step {last}'s, of "
                                           f"steps up to {last + 2}"):
        Journal(str(tmp_path), _fp(), plan_file_bytes=6_000)


def test_skipped_file_tail_torn_is_dropped_and_corrupt_is_refused(tmp_path):
    j = Journal(str(tmp_path), _fp(), fsync=False)
    j.record_skipped("a.tar", [("k1", "bad_image")])
    j.close()
    skipped = tmp_path / journal_module.SKIPPED_FILE
    intact = skipped.read_bytes()
    extra = recordlog.frame({"shard": "b.tar", "keys": [["k2", "bad_audio", 7]]})
    skipped.write_bytes(intact + extra[:-1])  # a crash cut the write of a second one
    r = Journal(str(tmp_path), _fp(), fsync=False)
    assert r.num_skipped == 1 and skipped.read_bytes() == intact
    r.close()
    bad = bytearray(extra)
    bad[HEAD + 2] ^= 0x01
    skipped.write_bytes(intact + bytes(bad))
    with pytest.raises(JournalError, match=f"skipped.mmd' is corrupted at byte {len(intact)} "):
        Journal(str(tmp_path), _fp())
    assert skipped.read_bytes() == intact + bytes(bad)


# -- failed writes --------------------------------------------------------------------------
class _Crash(BaseException):
    """The process dies here: nothing after it runs, not even exception handlers."""


def _fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def _fail(m: pytest.MonkeyPatch, call: str, name: str, exc: BaseException | None = None) -> None:
    """Make os.<call> fail (ENOSPC, after writing half for a write) on the file called `name`."""
    exc = exc or OSError(errno.ENOSPC, "No space left on device")
    real = getattr(os, call)

    def hit(target) -> bool:
        path = target if isinstance(target, str) else _fd_path(target)
        return os.path.basename(path) == name

    def failing(*args):
        if not hit(args[0]):
            return real(*args)
        if call == "write":
            real(args[0], args[1][:len(args[1]) // 2])
        raise exc

    m.setattr(os, call, failing)


_WRITES = {
    "step-plan": ("record_step", journal_module.PLAN_FILES[0]),
    "step-record": ("record_step", journal_module.JOURNAL_FILE),
    "commit": ("commit", journal_module.JOURNAL_FILE),
    "skipped-keys": ("record_skipped", journal_module.SKIPPED_FILE),
    "skipped-record": ("record_skipped", journal_module.JOURNAL_FILE),
}


def _do(j: Journal, op: str):
    if op == "record_step":
        return j.record_step(_entry(4))
    if op == "commit":
        return j.commit(3)
    return j.record_skipped("a.tar", [("k9", "bad_image", 9)])


@pytest.mark.parametrize("call", ["write", "fsync"])
@pytest.mark.parametrize("where", sorted(_WRITES))
def test_a_failed_write_leaves_no_partial_record_and_applies_nothing(tmp_path, monkeypatch,
                                                                     where, call):
    op, name = _WRITES[where]
    j = Journal(str(tmp_path), _fp())
    for s in range(4):
        j.record_step(_entry(s))
    j.commit(1)
    before, files = _state(j), _files(tmp_path)
    with monkeypatch.context() as m:
        _fail(m, call, name)
        with pytest.raises(JournalWriteError) as info:
            _do(j, op)
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(tmp_path / name)
    assert "No space left on device" in str(info.value)
    assert _state(j) == before and _files(tmp_path) == files  # nothing applied, nothing left
    _do(j, op)  # space freed: the same write goes through
    after = _state(j)
    assert after != before
    j.close()
    r = Journal(str(tmp_path), _fp())
    try:
        assert _state(r) == after
        assert r.num_skipped == (1 if op == "record_skipped" else 0)
        assert [k.key for k in r.skipped_keys()] == (["k9"] if op == "record_skipped" else [])
    finally:
        r.close()


def test_a_failed_cut_back_is_retried_before_the_next_write(tmp_path, monkeypatch):
    j = Journal(str(tmp_path), _fp())
    j.record_step(_entry(0))
    size = os.path.getsize(j.path)
    with monkeypatch.context() as m:
        _fail(m, "write", journal_module.JOURNAL_FILE)
        _fail(m, "ftruncate", journal_module.JOURNAL_FILE, OSError(errno.EIO, "I/O error"))
        with pytest.raises(JournalWriteError):
            j.commit(0)
    assert os.path.getsize(j.path) > size  # half a record is still there
    assert j.commit(0)
    j.close()
    r = Journal(str(tmp_path), _fp())
    assert (r.last_step, r.last_committed) == (0, 0)
    r.close()


# -- skipped keys ---------------------------------------------------------------------------
def test_skipped_keys_keep_their_index_and_are_not_read_at_restart(tmp_path):
    j = Journal(str(tmp_path), _fp(), fsync=False)
    j.record_skipped("a.tar", [("k1", "bad_image"), ("k2", "bad_audio", 17)])
    for n in range(500):
        j.record_skipped("b.tar", [(f"b{n}", "bad_image", n)])
    j.close()
    r = Journal(str(tmp_path), _fp(), fsync=False)
    try:
        assert r.num_skipped == 502
        keys = list(r.skipped_keys())
        assert keys[:3] == [SkippedKey("a.tar", "k1", "bad_image", None),
                            SkippedKey("a.tar", "k2", "bad_audio", 17),
                            SkippedKey("b.tar", "b0", "bad_image", 0)]
        assert [k.key for k in keys[2:]] == [f"b{n}" for n in range(500)]
        assert r.records_read == 502  # config and 501 counts: not the keys
    finally:
        r.close()
    r = Journal(str(tmp_path), _fp(), fsync=False)
    try:
        with pytest.raises(ValueError, match="not \\('k',\\)"):
            r.record_skipped("a.tar", [("k",)])
    finally:
        r.close()


def test_skipped_keys_written_just_before_a_crash_are_counted(tmp_path, monkeypatch):
    j = Journal(str(tmp_path), _fp())
    j.record_skipped("a.tar", [("k1", "bad_image", 1)])
    with monkeypatch.context() as m:
        _fail(m, "write", journal_module.JOURNAL_FILE, _Crash())
        with pytest.raises(_Crash):  # the keys are in skipped.mmd, their count is not
            j.record_skipped("a.tar", [("k2", "bad_image", 2), ("k3", "bad_image", 3)])
    j.close()
    r = Journal(str(tmp_path), _fp())  # the half count record is a torn write: dropped
    assert r.num_skipped == 3 and [k.key for k in r.skipped_keys()] == ["k1", "k2", "k3"]
    r.record_skipped("a.tar", [("k4", "bad_image", 4)])
    r.close()
    r = Journal(str(tmp_path), _fp())
    assert r.num_skipped == 4
    r.close()


# -- checkpoints ----------------------------------------------------------------------------
def test_a_long_run_keeps_journal_size_and_restart_reads_bounded(tmp_path):
    """50,000 steps, a commit every 20, a restart every 2,100 steps: journal.mmd stays under a
    bound however long the run, every restart reads a bounded number of records, and every step
    still resumable gives the cursor it had."""
    limit, keep = 64 << 10, 4

    def reopen() -> Journal:
        return Journal(str(tmp_path), _fp(), fsync=False, plan_file_bytes=32 << 10,
                       journal_file_bytes=limit, keep_commits=keep)

    j, peak, most_read = reopen(), 0, 0
    for s in range(50_000):
        j.record_step(_entry(s))
        if s % 20 == 19:
            j.commit(s)
            peak = max(peak, os.path.getsize(j.path))
        if s % 2_100 == 2_099:
            j.close()
            j = reopen()
            most_read = max(most_read, j.records_read)
    j.record_step(_entry(50_000))
    j.close()
    assert peak < limit + 20 * 200  # the threshold plus the records of one commit interval
    assert 300 < most_read < limit // 100  # not up to 50,000 step records (~110 bytes each here)
    assert _plan_bytes(tmp_path) < 2 * (32 << 10) + 2 * 200
    r = reopen()
    try:
        assert (r.last_step, r.last_committed, sorted(r.pending)) == (50_000, 49_999, [50_000])
        oldest = 49_999 - 20 * (keep - 1)  # the oldest of the last `keep` commits
        for s in range(oldest, 50_001):
            assert r.cursor_after(s) == {"base": s + 1}
        with pytest.raises(JournalError, match=r"checkpointed away: resume at step 0 or at steps"):
            r.cursor_after(100)
    finally:
        r.close()


def _checkpoint_ready(tmp_path) -> Journal:
    """60 steps, no commit yet: the next commit (of step 9) checkpoints journal.mmd."""
    j = Journal(str(tmp_path), _fp(), journal_file_bytes=4096, keep_commits=2)
    for s in range(60):
        j.record_step(_entry(s))
    assert os.path.getsize(j.path) > 4096
    return j


def _checkpointed_state(j: Journal, old: bool) -> None:
    assert (j.last_step, j.last_committed, sorted(j.pending)) == (59, 9, list(range(10, 60)))
    assert [j.cursor_after(s) for s in range(9, 60)] == [{"base": s + 1} for s in range(9, 60)]
    assert all(j.plan_of(j.pending[s]) == {"p": s} for s in range(10, 60))
    if old:
        assert j.cursor_after(3) == {"base": 4}
    else:
        with pytest.raises(JournalError, match="knows steps 9..59"):
            j.cursor_after(3)


def test_a_checkpoint_keeps_the_state_and_shrinks_the_file(tmp_path):
    j = _checkpoint_ready(tmp_path)
    size = os.path.getsize(j.path)
    assert j.commit(9)
    assert os.path.getsize(j.path) < size
    _checkpointed_state(j, old=False)
    j.record_step(_entry(60))
    j.close()
    r = Journal(str(tmp_path), _fp())
    try:
        assert r.last_step == 60 and r.cursor_after(60) == {"base": 61}
        assert r.records_read == 2 + 51 + 1  # config, checkpoint, steps 9..59, step 60
    finally:
        r.close()


def test_a_reopened_journal_checkpoints_at_twice_its_size_after_the_last_checkpoint(tmp_path, caplog):
    """Reopened, journal.mmd's size right after its checkpoint was forgotten (the line that
    noted it was unreachable): the next commits rewrote it at once, as if it had outgrown
    journal_file_bytes, instead of at twice its checkpointed size (O(1) a step)."""
    import logging

    j = _checkpoint_ready(tmp_path)
    assert j.commit(9)  # checkpointed: steps 9..59 kept, more than half journal_file_bytes
    assert os.path.getsize(j.path) > 4096 // 2
    j.close()
    r = Journal(str(tmp_path), _fp(), journal_file_bytes=4096, keep_commits=2)
    try:
        caplog.clear()  # the first checkpoint's line, where an earlier test left INFO on
        with caplog.at_level(logging.INFO, logger="mmdispatch.journal"):
            r.record_step(_entry(60))
            assert r.commit(10) and r.commit(11)
        assert not [m for m in caplog.messages if "checkpointed" in m], caplog.messages
    finally:
        r.close()


def test_a_rewind_below_the_last_commit_takes_the_commits_of_the_steps_taken_again(tmp_path):
    """Trainers at step 150 (commit 149) rewound to their checkpoint of step 29: the commits of
    steps 32 and 35 taken again were refused as older than 149, and a dispatcher restarted on
    the journal resumed at step 150, past the steps it knew (30..37), and refused to start."""
    j = Journal(str(tmp_path), _fp(), fsync=False)
    for s in range(150):
        j.record_step(_entry(s))
    assert j.commit(149)
    for s in range(30, 38):  # the steps from the checkpoint on, planned again
        j.record_step(_entry(s))
    assert j.last_committed == 29 and j.commit(32) and j.commit(35)
    j.close()
    r = Journal(str(tmp_path), _fp(), fsync=False)
    try:
        assert (r.last_step, r.last_committed, sorted(r.pending)) == (37, 35, [36, 37])
        assert r.cursor_after(35) == {"base": 36}  # where a restarted dispatcher goes on
    finally:
        r.close()


def test_a_rewind_to_step_0_past_a_checkpoint_starts_the_steps_over(tmp_path):
    j = _checkpoint_ready(tmp_path)
    assert j.commit(9)
    j.record_step(_entry(0))  # every rank resumed at step 0 (always possible)
    assert (j.last_step, sorted(j.pending)) == (0, [0]) and j.cursor_after(0) == {"base": 1}
    j.record_step(_entry(1))
    j.close()
    r = Journal(str(tmp_path), _fp())
    try:
        # the commit of step 9 no longer stands: a restart resumes at step 0's replay
        assert (r.last_step, r.last_committed, sorted(r.pending)) == (1, -1, [0, 1])
        assert [r.cursor_after(s) for s in (0, 1)] == [{"base": 1}, {"base": 2}]
    finally:
        r.close()


_STAGES = {  # a checkpoint's stages: the os call and the file it fails on
    "temp-write": ("write", journal_module.JOURNAL_FILE + ".tmp"),
    "temp-fsync": ("fsync", journal_module.JOURNAL_FILE + ".tmp"),
    "rename": ("replace", journal_module.JOURNAL_FILE + ".tmp"),
    "dir-fsync": ("fsync", None),  # the directory
}


@pytest.mark.parametrize("stage", sorted(_STAGES))
def test_a_crash_at_any_checkpoint_stage_leaves_a_journal_that_opens_right(tmp_path, monkeypatch,
                                                                          stage):
    call, name = _STAGES[stage]
    j = _checkpoint_ready(tmp_path)
    with monkeypatch.context() as m:
        _fail(m, call, name or tmp_path.name, _Crash())
        with pytest.raises(_Crash):
            j.commit(9)
    j.close()
    r = Journal(str(tmp_path), _fp())
    try:
        _checkpointed_state(r, old=stage != "dir-fsync")  # the rename had happened or not
        assert not os.path.exists(r.path + ".tmp")
    finally:
        r.close()


@pytest.mark.parametrize("stage", sorted(_STAGES))
def test_a_failed_checkpoint_keeps_the_commit_and_is_tried_again(tmp_path, monkeypatch, stage):
    call, name = _STAGES[stage]
    j = _checkpoint_ready(tmp_path)
    with monkeypatch.context() as m:
        _fail(m, call, name or tmp_path.name)
        assert j.commit(9)  # durable before the checkpoint; its failure is only logged
    _checkpointed_state(j, old=stage != "dir-fsync")
    assert not os.path.exists(j.path + ".tmp")
    j.record_step(_entry(60))  # after a failed directory fsync, synced again first
    assert j.commit(19)
    j.close()
    r = Journal(str(tmp_path), _fp())
    try:
        assert (r.last_step, r.last_committed, sorted(r.pending)) == (60, 19, list(range(20, 61)))
        with pytest.raises(JournalError, match="knows steps 9..60"):
            r.cursor_after(3)  # the second commit's checkpoint went through
    finally:
        r.close()


def test_a_rewind_behind_a_verbatim_replay_keeps_the_journal_contiguous(tmp_path):
    """A restarted dispatcher: one rank asks for step 8 first (replayed verbatim, not journaled
    again), then another for step 6, which is committed and so planned anew: that supersedes
    the journaled 7..9. Their verbatim replays must be journaled again, or step 10 would follow
    step 6 in the journal and the dispatcher would stop (seen in the dispatcher-kill fault test)."""
    from dispatcher_server.replay import ReplaySource

    j = Journal(str(tmp_path), _fp())
    for step in range(10):
        j.record_step(_entry(step))
    j.commit(6)
    j.close()

    class Plan:
        def __init__(self, step):
            self.step = step

        def to_dict(self):
            return {"p": self.step}

    r = ReplaySource(Journal(str(tmp_path), _fp()), world_size=2)

    def plan_step(step: int) -> None:
        journaled, mismatch = r.journaled_plan(step, "d")
        assert not mismatch
        entry = StepEntry(step=step, epoch=0, world_size=2, num_samples=8,
                          cursor_after={"base": step + 1}, digest="d")
        r.record(entry, Plan(step), verbatim=journaled is not None)

    r.reset(8)
    plan_step(8)  # verbatim: the journal holds it
    r.reset(6)
    for step in range(6, 12):  # 6 anew (committed, no plan kept), 7..9 verbatim, 10.. anew
        plan_step(step)
    assert r.journal.last_step == 11
    r.journal.close()
    reopened = Journal(str(tmp_path), _fp())  # and the file reads back whole
    assert reopened.last_step == 11 and set(range(7, 12)) <= set(reopened.pending)
    reopened.close()


def test_one_journal_serves_one_dispatcher_and_a_removed_directory_stops_every_write(tmp_path):
    import shutil

    where = tmp_path / "j"
    j = Journal(str(where), _fp())
    with pytest.raises(JournalError, match=rf"in use by another dispatcher \(pid {os.getpid()}\)"):
        Journal(str(where), _fp())
    j.record_step(_entry(0))
    shutil.rmtree(where)  # records would go to unlinked files: commits nobody could resume from
    for write in (lambda: j.record_step(_entry(1)), lambda: j.commit(0),
                  lambda: j.record_skipped("a.tar", [("k", "bad_image", 3)])):
        with pytest.raises(JournalWriteError, match="removed or replaced"):
            write()
    where.mkdir()  # another directory at the same path is not the journal either
    with pytest.raises(JournalWriteError, match="removed or replaced"):
        j.record_step(_entry(1))
    j.close()
    again = Journal(str(where), _fp())  # the lock left with the closed journal
    with pytest.raises(JournalError, match="holds no step yet"):
        again.cursor_after(5)  # a trainer resuming at step 6 is told the journal is new
    again.close()


def test_a_changed_field_map_is_refused_and_a_journal_from_before_field_maps_resumes(tmp_path):
    audio = {"news": {"audio": ["wav", "flac"]}}
    j = Journal(str(tmp_path / "new"), _fp(field_maps=audio))
    j.record_step(_entry(0))
    j.close()
    with pytest.raises(JournalError, match=r"field_maps: news.audio: journal has \[.wav., .flac.\], "
                                           r"config has \[.wav.\]"):
        Journal(str(tmp_path / "new"), _fp(field_maps={"news": {"audio": ["wav"]}}))
    with pytest.raises(JournalError, match="field_maps"):
        Journal(str(tmp_path / "new"), _fp(field_maps={}))  # the readers' default map now
    Journal(str(tmp_path / "new"), _fp(field_maps={"news": {"audio": ["wav", "flac"]}})).close()
    Journal(str(tmp_path / "old"), _fp()).close()  # written before journals recorded field maps
    Journal(str(tmp_path / "old"), _fp(field_maps=audio)).close()


def test_a_journal_from_before_length_digests_replays_by_its_keys(tmp_path):
    """Steps journaled with the keys-only digest still replay verbatim over the same keys (and
    not over others); new digests cover the counted lengths too."""
    from dispatcher_server.replay import OTHER_LENGTHS, ReplaySource

    j = Journal(str(tmp_path), _fp(), fsync=False)
    for s in (0, 1):
        j.record_step(StepEntry(step=s, epoch=0, world_size=2, num_samples=8,
                                cursor_after={"base": s + 1}, digest=f"keys{s}", plan={"p": s}))
    r = ReplaySource(j, world_size=2)
    try:
        r.reset(0)
        assert r.journaled_plan(0, "2:new", lambda: "keys0") == ({"p": 0}, "")
        # Journals that old kept no keys of their own: other keys are planned anew, as before.
        assert r.journaled_plan(1, "2:new", lambda: "other") == (None, OTHER_LENGTHS)
    finally:
        j.close()


def test_a_journal_that_keeps_keys_tells_other_samples_from_other_lengths(tmp_path):
    from dispatcher_server.replay import OTHER_LENGTHS, OTHER_SAMPLES, ReplaySource

    j = Journal(str(tmp_path), _fp(), fsync=False)
    for s in (0, 1, 2):
        j.record_step(StepEntry(step=s, epoch=0, world_size=2, num_samples=8, keys=f"keys{s}",
                                cursor_after={"base": s + 1}, digest=f"2:d{s}", plan={"p": s}))
    j.close()
    j = Journal(str(tmp_path), _fp(), fsync=False)  # kept across a reopen
    r = ReplaySource(j, world_size=2)
    try:
        r.reset(0)
        assert j.pending[1].keys == "keys1"
        assert r.journaled_plan(0, "2:d0", lambda: "keys0") == ({"p": 0}, "")
        assert r.journaled_plan(1, "2:other", lambda: "keys1") == (None, OTHER_LENGTHS)
        assert r.journaled_plan(2, "2:other", lambda: "other") == (None, OTHER_SAMPLES)
    finally:
        j.close()


def test_a_rewind_before_the_last_commit_checks_the_committed_steps_taken_again(tmp_path):
    """Probe: trainers restored from a checkpoint older than the last commit, with readers
    that since skip other samples, were handed the committed steps taken again with other
    samples, unchecked: committed plans leave the replay list. They are checked against their
    journal records (and planned anew, as before); the uncommitted ones replay as journaled."""
    from dispatcher_server.replay import OTHER_LENGTHS, OTHER_SAMPLES, ReplaySource

    j = Journal(str(tmp_path), _fp(), fsync=False)
    for s in range(6):
        j.record_step(StepEntry(step=s, epoch=0, world_size=2, num_samples=8, keys=f"keys{s}",
                                cursor_after={"base": s + 1}, digest=f"2:d{s}", plan={"p": s}))
    r = ReplaySource(j, world_size=2)
    try:
        assert r.commit(3)
        r.reset(1)  # the checkpoint of step 0
        assert r.journaled_plan(1, "2:d1", lambda: "keys1") == (None, "")  # alike: planned anew
        assert r.journaled_plan(2, "2:other", lambda: "other") == (None, OTHER_SAMPLES)
        assert r.journaled_plan(3, "2:other", lambda: "keys3") == (None, OTHER_LENGTHS)
        assert r.journaled_plan(4, "2:d4", lambda: "keys4") == ({"p": 4}, "")  # not committed
        r.reset(5)  # a later rewind past the commit: nothing committed is taken again
        assert r.journaled_plan(5, "2:d5", lambda: "keys5") == ({"p": 5}, "")
    finally:
        j.close()


def test_a_resume_past_every_planned_step_names_the_journal_of_that_run(tmp_path):
    """A checkpoint of a later run than the journal (or than a dispatcher without one) asked
    to 'resume further back', or named no fix at all."""
    from dispatcher_server.replay import ReplaySource

    j = Journal(str(tmp_path), _fp(), fsync=False)
    try:
        for s in range(4):
            j.record_step(_entry(s))
        with pytest.raises(JournalError, match=r"step 6: the journal knows steps 0\.\.3, so the "
                                               r"checkpoint is of a later run .* --journal-dir of the run"):
            ReplaySource(j, world_size=2).cursor_before(6)
    finally:
        j.close()
    r = ReplaySource(None, world_size=2)
    for s in range(4):
        r.record(_entry(s), None, verbatim=False)
    with pytest.raises(JournalError, match=r"planned steps up to 3 only, .* another run .* --journal-dir"):
        r.cursor_before(6)
    assert r.cursor_before(3) == {"base": 3}


def test_a_journal_holding_only_another_starts_configuration_records_this_one(tmp_path, caplog):
    """A start that failed before its first step (a port in use, a typo in a flag) left its
    configuration behind; the corrected start has nothing to resume and is not refused. Once
    the journal holds a step or a skipped key, another configuration is refused as before."""
    Journal(str(tmp_path / "a"), _fp(seed=1)).close()
    (tmp_path / "a" / "inputs.json").write_text("{}")  # its peers' rules
    with caplog.at_level("INFO", logger="mmdispatch"):
        j = Journal(str(tmp_path / "a"), _fp(seed=2))
    assert "recorded no step" in caplog.text
    # Removed before journal.mmd is emptied: a crash between the two left an empty journal
    # beside input rules, which reads as a journal that lost its records.
    assert not (tmp_path / "a" / "inputs.json").exists()
    j.record_step(_entry(0))
    j.close()
    j = Journal(str(tmp_path / "a"), _fp(seed=2))
    assert j.last_step == 0 and sorted(j.pending) == [0]
    j.close()
    with pytest.raises(JournalError, match="seed: journal has 2, config has 1"):
        Journal(str(tmp_path / "a"), _fp(seed=1))
    j = Journal(str(tmp_path / "b"), _fp(seed=1))
    j.record_skipped("/d/s0.tar", [("k0", "bad_image", 0)])
    j.close()
    with pytest.raises(JournalError, match="seed: journal has 1, config has 2"):
        Journal(str(tmp_path / "b"), _fp(seed=2))


def test_a_restart_on_the_journal_holds_peers_to_the_jobs_input_rules(tmp_path):
    """The first peers' input rules are kept beside the journal: readers restarted with another
    tokenizer or other placeholders were admitted after a dispatcher restart (nothing to compare
    with), and every replayed step was planned anew instead of replayed. A new job forgets them."""
    from dispatcher_server.inputs import INPUTS_FILE, InputRules

    rules = InputRules()
    rules.keep_beside(str(tmp_path), resume=False)
    assert rules.admit("reader 'a'", {"tokenizer": "t1", "placeholders": "image=<image>"}) is None
    again = InputRules()
    again.keep_beside(str(tmp_path), resume=True)
    why = again.admit("reader 'b'", {"tokenizer": "t1", "placeholders": "none"})
    assert why is not None and "placeholders: reader 'b' 'none', this job's journal 'image=<image>'" in why
    assert str(tmp_path / INPUTS_FILE) in why  # the way to go on by the new rules
    # ... only for rules that keep the same samples: removing it after a --max-seq-len change
    # trained committed samples again and others never (shuffle blocks hold the kept samples)
    assert "keep and skip the same samples" in why and "start a new job" in why
    assert again.admit("rank 0", {"tokenizer": "t1"}) is None
    fresh = InputRules()
    fresh.keep_beside(str(tmp_path), resume=False)  # a new job in the directory
    assert fresh.admit("reader 'c'", {"placeholders": "none"}) is None


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_input_rules_replaced_by_a_directory_or_a_pipe_are_refused_naming_them(tmp_path, kind):
    """Probe: inputs.json replaced by a named pipe blocked the dispatcher's start for good,
    with no line (opening a FIFO waits for a writer)."""
    from dispatcher_server.inputs import INPUTS_FILE, InputRules

    path = tmp_path / INPUTS_FILE
    path.mkdir() if kind == "directory" else os.mkfifo(path)
    with pytest.raises(ValueError) as got:
        InputRules().keep_beside(str(tmp_path), resume=True)
    said = "a directory" if kind == "directory" else "a named pipe"
    assert f"{path} is unreadable ({said}, not a regular file): remove it" in str(got.value)


def test_a_lock_file_that_is_a_symlink_loop_is_said_as_such(tmp_path):
    """Probe: 'journal lock file ... is Too many levels of symbolic links'."""
    lock = tmp_path / journal_module.LOCK_FILE
    os.symlink(lock, lock)
    with pytest.raises(JournalError) as got:
        Journal(str(tmp_path), _fp())
    assert (f"'{lock}' cannot be opened (Too many levels of symbolic links): remove it"
            in str(got.value)), got.value


def test_unopenable_shards_survive_a_reopen_and_a_checkpoint(tmp_path):
    """Shard positions skipped because no reader could open them are a decision a restart must
    keep (skipped.mmd is never read then): journaled, and carried over a checkpoint."""
    j = Journal(str(tmp_path), _fp(), fsync=False)
    j.record_unopenable(3, "/data/shard-3.tar")
    j.record_unopenable(3, "/data/shard-3.tar")  # once is enough
    j.close()
    j = Journal(str(tmp_path), _fp(), fsync=False)
    assert j.unopenable == {3}
    j._checkpoint(j._first)
    j.close()
    assert Journal(str(tmp_path), _fp(), fsync=False).unopenable == {3}


def test_plan_settings_are_recorded_once_and_survive_a_reopen_and_a_checkpoint(tmp_path):
    """Each step names the plan settings it was planned under, so a restart knows which
    journaled plans were made under others; a checkpoint keeps the settings its steps name."""
    j = Journal(str(tmp_path), _fp(), fsync=False)
    two, four = {"num_microbatches": 2}, {"num_microbatches": 4}
    for step, settings in ((0, two), (1, two), (2, four)):
        entry = _entry(step)
        entry.settings = j.record_plan_settings(settings)
        j.record_step(entry)
    records = j.records_read
    j.close()
    j = Journal(str(tmp_path), _fp(), fsync=False)
    assert j.records_read - records == 1 + 2 + 3  # the config, each settings once, the steps
    assert [j.plan_settings[j.pending[s].settings] for s in range(3)] == [two, two, four]
    assert j.commit(1)
    j._checkpoint(2)  # step 2 alone is kept: the settings only steps 0-1 named go
    j.close()
    j = Journal(str(tmp_path), _fp(), fsync=False)
    try:
        assert list(j.plan_settings.values()) == [four]
        assert j.plan_settings[j.pending[2].settings] == four
        assert j.read_entry(2).settings == j.pending[2].settings
    finally:
        j.close()


def test_a_changed_shuffle_shards_is_refused_both_ways_and_a_journal_from_before_resumes(tmp_path):
    """`--shuffle-shards` orders the sample sequence, but the journal's check left it out: a
    resume under another value went on with another sequence, as docs/datasets.md says it
    must not. Journals now record it (the default 1 too); one without it predates the check."""
    for was, now in ((1, 2), (2, 1), (2, 3)):
        where = str(tmp_path / f"j{was}{now}")
        j = Journal(where, _fp(shuffle_shards=was))
        j.record_step(_entry(0))
        j.close()
        with pytest.raises(JournalError, match=rf"shuffle_shards: journal has {was}, config has {now}"):
            Journal(where, _fp(shuffle_shards=now))
        Journal(where, _fp(shuffle_shards=was)).close()
    Journal(str(tmp_path / "old"), _fp()).close()  # written before journals recorded it
    Journal(str(tmp_path / "old"), _fp(shuffle_shards=2)).close()


@pytest.mark.parametrize("kind", ["directory", "fifo"])
@pytest.mark.parametrize("name", [journal_module.JOURNAL_FILE, *journal_module.PLAN_FILES,
                                  journal_module.SKIPPED_FILE])
def test_a_journal_file_replaced_by_a_directory_or_a_pipe_is_refused_naming_it_and_the_fix(
        tmp_path, name, kind):
    """Probe: serve said `error: [Errno 21] Is a directory`, without the path for a plan file
    and without a fix for any; then 'a file in DIR' for a plan file; and a plan file replaced
    by a named pipe blocked start-up for good, silent (opening a FIFO waits for a writer)."""
    j = Journal(str(tmp_path), _fp())
    j.record_step(_entry(0))
    j.close()
    path = tmp_path / name
    path.unlink()
    path.mkdir() if kind == "directory" else os.mkfifo(path)
    with pytest.raises(JournalError) as got:
        Journal(str(tmp_path), _fp())
    message = str(got.value)
    said = "a directory" if kind == "directory" else "a named pipe"
    assert f"'{path}'" in message and f"({said}, not a regular file)" in message, message
    assert "start a new --journal-dir" in message


def test_a_lock_file_replaced_by_a_directory_is_named_not_the_directory_s_permissions(tmp_path):
    """Probe: the refusal said '--journal-dir ... cannot be written', which it could."""
    Journal(str(tmp_path), _fp()).close()
    lock = tmp_path / journal_module.LOCK_FILE
    lock.unlink()
    lock.mkdir()
    with pytest.raises(JournalError) as got:
        Journal(str(tmp_path), _fp())
    message = str(got.value)
    assert f"'{lock}' is a directory, not a regular file: remove it" in message, message
    assert "cannot be written" not in message


def test_a_write_failing_as_the_journal_opens_stays_a_write_error(tmp_path, monkeypatch):
    """A file that cannot be opened is refused as damage to put back; a write that fails as a
    fresh journal starts (a full disk) is not damage, and stays the write error it is."""
    def full(self, record):
        raise JournalWriteError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Journal, "_append", full)
    with pytest.raises(JournalWriteError) as got:
        Journal(str(tmp_path), _fp())
    assert not isinstance(got.value, JournalError) and "restore" not in str(got.value)
