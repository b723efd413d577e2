"""The dispatcher's block paths against a per-sample reference, on random inputs.

SAMPLES messages are taken in as one block each, and the assembler's `fill` moves whole runs of a shard's
buffer into the step being filled. Here a real `Dispatcher` (loopback sockets, no peers) is fed
random messages through `_on_samples` / `_on_shard_done` and pumped; its planned steps must be
exactly what taking one sample at a time gives: `global_batch`, token-budget cuts, epoch ends,
deterministic and arrival order, bad samples skipped by key, duplicates ignored, and the
buffered-bytes accounting back to zero at the end.
"""

from __future__ import annotations

import logging
import os
import random

import pytest

from dispatcher_server import protocol as P
from dispatcher_server.config import BatchConfig, FlowConfig, ServerConfig
from dispatcher_server.journal import JournalError
from dispatcher_server.readerpool import Assignment, Reader
from dispatcher_server.planner import PlannerConfig
from dispatcher_server.server import Dispatcher, Fatal


def _corpus(rng: random.Random, num_shards: int, epochs: int) -> dict[int, list[dict]]:
    """Per global position, its samples (the same shard contents in every epoch)."""
    shards = []
    for shard in range(num_shards):
        samples = []
        for index in range(rng.randint(0, 12)):
            items = [["image" if rng.random() < 0.6 else "audio", f"{j}.bin", rng.randint(4, 90),
                      rng.randint(1, 20), {}] for j in range(rng.randint(0, 2))]
            text_len = rng.randint(1, 30)
            llm_len = text_len + sum(it[3] for it in items)
            bad = rng.random() < 0.05
            samples.append({"key": f"s{shard}-{index}", "index": index, "text_len": text_len,
                            "llm_len": llm_len + (1 if bad else 0), "items": items, "bad": bad,
                            "payloads": [bytes([index % 251]) * rng.randint(0, 40) for _ in items]})
        shards.append(samples)
    return {e * num_shards + i: shards[i] for e in range(epochs) for i in range(num_shards)}


def _message(dispatcher: Dispatcher, assign_id: int, samples: list[dict], coalesced: bool):
    headers = [[s["key"], s["index"], s["text_len"], s["llm_len"], P.blank_tokens(s["text_len"]), s["items"]]
               for s in samples]
    payloads = [p for s in samples for p in s["payloads"]]
    if coalesced:
        frames = P.encode(P.SAMPLES, frames=[b"".join(payloads)], assign_id=assign_id,
                          samples=headers, sizes=[len(p) for p in payloads])
    else:
        frames = P.encode(P.SAMPLES, frames=payloads, assign_id=assign_id, samples=headers)
    return P.decode(frames, dispatcher.config.limits)


def _reference_steps(order: list[dict], num_shards: int, global_batch: int,
                     budget: int | None) -> list[list[str]]:
    """Steps from taking one sample at a time: full batch, token budget, never across epochs."""
    steps: list[list[str]] = []
    acc: list[dict] = []
    tokens = 0
    for s in order:
        if acc and (len(acc) == global_batch
                    or (budget is not None and tokens + s["llm_len"] > budget)
                    or s["pos"] // num_shards != acc[0]["pos"] // num_shards):
            steps.append([a["key"] for a in acc])
            acc, tokens = [], 0
        acc.append(s)
        tokens += s["llm_len"]
    if acc:
        steps.append([a["key"] for a in acc])
    return steps


@pytest.mark.parametrize("seed", range(24))
def test_block_paths_plan_the_per_sample_steps(seed):
    rng = random.Random(seed)
    num_shards, epochs = rng.randint(1, 4), rng.randint(1, 3)
    mode = rng.choice(["deterministic", "arrival"])
    global_batch = rng.choice([1, 3, 7, 16])
    budget = rng.choice([None, 40, 150])
    corpus = _corpus(rng, num_shards, epochs)
    config = ServerConfig(
        shuffle_buffer=0, shards=[f"/data/shard-{i}.tar" for i in range(num_shards)], world_size=1,
        batch=BatchConfig(global_batch=global_batch, token_budget=budget),
        planner=PlannerConfig(num_microbatches=1), mode=mode, max_epochs=epochs,
        flow=FlowConfig(max_buffered_samples=10_000, num_inflight_shards=rng.randint(1, 3)))
    if not any(not s["bad"] for samples in corpus.values() for s in samples):
        # Every epoch would yield nothing: the dispatcher ends the job instead of looping.
        d = Dispatcher(config)
        try:
            with pytest.raises(Fatal, match="yielded no usable sample"):
                _feed_everything(d, corpus)
        finally:
            d._close()
        return
    d = Dispatcher(config)
    try:
        reader = Reader(ident=b"r", name="r", last_seen=0.0)
        d.readers[reader.ident] = reader
        sent = {pos: 0 for pos in corpus}
        arrived: list[dict] = []  # accepted samples, in the order the dispatcher received them
        skipped: list[tuple[str, str]] = []
        steps: list[list[str]] = []
        consumed: dict[int, int] = {}  # pos -> one past the last index planned or being filled
        for _ in range(10_000):
            d._pump()
            for rs in d.retained:
                if rs.step >= len(steps):
                    steps.append([s.key for s in rs.batch.samples])
                    consumed.update((s.pos, s.index + 1) for s in rs.batch.samples)
            # The cursor (what a resume starts from) counts exactly the samples taken.
            pending = {**consumed, **{s.pos: s.index + 1 for s in d.assembler.acc}}
            for p in d.progress:
                assert d.assembler.cursor.start_index(p) == pending.get(p, 0)
            for slot in d.slots:
                d.delivery.credit(slot, slot.upto, received=d.next_plan)  # all acknowledged: evicted
            if d.finished():
                break
            open_ = [p for p, pr in d.progress.items() if not pr.reader_done]
            if not open_:
                continue  # the window moved during this pump: the next one opens shards
            pos = rng.choice(open_)
            a = Assignment(id=d.pool.next_id, pos=pos, reader=reader.ident, credits=1_000)
            d.pool.next_id += 1
            d.pool.assignments[a.id], d.progress[pos].assignment = a, a.id
            reader.assignments.append(a)
            todo = corpus[pos][sent[pos]:sent[pos] + rng.randint(1, 6)]
            batch = [dict(s) for s in todo]
            if sent[pos] and rng.random() < 0.2:  # a duplicate of the last sample sent: ignored
                batch.insert(0, dict(corpus[pos][sent[pos] - 1]))
            if batch:
                d._on_samples(reader, _message(d, a.id, batch, rng.random() < 0.7))
            for s in todo:
                if s["bad"]:
                    skipped.append((s["key"], "invalid_llm_len"))
                else:
                    arrived.append({**s, "pos": pos})
            sent[pos] += len(todo)
            if sent[pos] == len(corpus[pos]):
                d._on_shard_done(reader, P.decode(P.encode(P.SHARD_DONE, assign_id=a.id,
                                                           count=a.received, skipped=[])))
            else:
                d._release(reader, a)
            # Bytes accounting is exact after every message and every fill.
            for prog in d.progress.values():
                assert prog.nbytes == sum(s.nbytes for s in prog.buffer)
            assert d.assembler.acc_bytes == sum(s.nbytes for s in d.assembler.acc)
            assert sum(n for _, n in d.assembler.arrival) == (sum(len(p.buffer) for p in d.progress.values())
                                                    if mode == "arrival" else 0)
        else:
            pytest.fail("the stream did not finish")
        order = (arrived if mode == "arrival"
                 else sorted(arrived, key=lambda s: (s["pos"], s["index"])))
        assert steps == _reference_steps(order, num_shards, global_batch, budget)
        assert d.skipped == skipped
        assert (not d.assembler.acc and d.assembler.acc_bytes == 0 and not d.progress
                and not d.assembler.arrival)
        assert d.assembler.samples_seen == len(arrived)
    finally:
        d._close()


def _feed_everything(d: Dispatcher, corpus: dict[int, list[dict]]) -> None:
    """Every open shard delivered whole and done, pumping in between, until the job ends."""
    reader = Reader(ident=b"r", name="r", last_seen=0.0)
    d.readers[reader.ident] = reader
    for _ in range(1_000):
        d._pump()
        if d.finished():
            return
        for pos in [p for p, pr in d.progress.items() if not pr.reader_done]:
            a = Assignment(id=d.pool.next_id, pos=pos, reader=reader.ident, credits=1_000)
            d.pool.next_id += 1
            d.pool.assignments[a.id], d.progress[pos].assignment = a, a.id
            reader.assignments.append(a)
            if corpus[pos]:
                d._on_samples(reader, _message(d, a.id, [dict(s) for s in corpus[pos]], True))
            d._on_shard_done(reader, P.decode(P.encode(P.SHARD_DONE, assign_id=a.id,
                                                       count=a.received, skipped=[])))


def test_retained_step_messages_count_against_the_byte_bound():
    """A rank's STEP message copies its items' payloads and is kept until every rank acked the
    step: it holds the step's bytes in the samples' place (their payloads are let go, so no
    byte is held twice) and counts against max_buffered_bytes until eviction."""
    from dispatcher_server.assembler import ITEM_HELD_BYTES

    config = ServerConfig(
        shuffle_buffer=0, shards=["/data/shard-0.tar"], world_size=1, batch=BatchConfig(global_batch=4),
        planner=PlannerConfig(num_microbatches=1), max_epochs=1,
        flow=FlowConfig(max_buffered_samples=1_000, max_buffered_bytes=100_000,
                        num_inflight_shards=1, credit_batch=4))
    d = Dispatcher(config)
    try:
        reader = Reader(ident=b"r", name="r", last_seen=0.0)
        d.readers[reader.ident] = reader
        d._on_reader(reader.ident, P.decode(P.encode(P.SHARD_REQUEST)), 0.0)
        d._pump()
        (a,) = reader.assignments
        samples = [{"key": f"k{i}", "index": i, "text_len": 5, "llm_len": 9,
                    "items": [["image", "jpg", 16, 4, {}]], "payloads": [bytes([i]) * 1000]}
                   for i in range(4)]
        d._on_samples(reader, _message(d, a.id, samples[:1], True))  # one outstanding at first
        d._pump()
        d._on_samples(reader, _message(d, a.id, samples[1:], True))
        samples_bytes = 4 * (P.tokens_size(5, 1) + 1000 + ITEM_HELD_BYTES)  # tokens, payload, item
        assert d._gauges().nbytes == samples_bytes
        slot = d.slots[0]
        d.delivery.connect(slot, b"t")
        slot.upto = 10  # a connected rank with credit: the step is sent
        d._pump()
        (rs,) = d.retained
        message_bytes = sum(memoryview(f).nbytes for f in rs.messages[0])
        assert message_bytes > 4 * 1000  # the coalesced payload copy
        # The message stands for the samples: their payloads are let go, so each byte counts once.
        assert rs.nbytes == message_bytes == d._gauges().nbytes
        assert not rs.batch.samples and not rs.batch.item_payloads
        d.delivery.credit(slot, slot.upto, received=1)  # acknowledged: evicted, nothing held
        d._pump()
        assert not d.retained and d._gauges().nbytes == 0
    finally:
        d._close()


def _fed_dispatcher(global_batch: int, journal_dir: str | None = None, before_feed=None,
                    longer: int = 0, prefix: str = "k", **flow) -> Dispatcher:
    """A one-rank dispatcher of one shard whose reader delivered all 8 samples and whose rank 0
    is connected with credits for 10 steps; `before_feed(d)` runs first (after a restart).
    `longer`: text tokens each sample counts beyond the usual (a reader counting otherwise)."""
    d = Dispatcher(ServerConfig(
        shuffle_buffer=0, shards=["/data/shard-0.tar"], world_size=1, batch=BatchConfig(global_batch=global_batch),
        planner=PlannerConfig(num_microbatches=1), max_epochs=1, journal_dir=journal_dir,
        journal_fsync=False, flow=FlowConfig(max_buffered_samples=1_000, num_inflight_shards=1,
                                             credit_batch=8, **flow)))
    try:
        if before_feed is not None:
            before_feed(d)
        reader = Reader(ident=b"r", name="r", last_seen=0.0)
        d.readers[reader.ident] = reader
        d._on_reader(reader.ident, P.decode(P.encode(P.SHARD_REQUEST)), 0.0)
        d._pump()
        (a,) = reader.assignments
        samples = [{"key": f"{prefix}{i}", "index": i, "text_len": 5 + i + longer, "llm_len": 9 + i + longer,
                    "items": [["image", "jpg", 16, 4, {}]], "payloads": [b"x" * 10]} for i in range(8)]
        # One sample first: until a sample's size is known, one sample is outstanding in all.
        d._on_samples(reader, _message(d, a.id, samples[:1], True))
        d._pump()
        d._on_samples(reader, _message(d, a.id, samples[1:], True))
        d.delivery.connect(d.slots[0], b"t")
        d.slots[0].upto = 10
    except BaseException:
        d._close()
        raise
    return d


def _serve_steps(d: Dispatcher, n: int) -> None:
    """Plan steps 0..n-1, rank 0 acknowledging each."""
    for acked in range(1, n + 1):
        d._pump()
        d.delivery.credit(d.slots[0], d.slots[0].upto, received=acked)
    d._pump()


def test_a_journaled_step_replayed_with_other_samples_stops_the_job_naming_why(tmp_path):
    """Readers that keep other samples after a restart (rules that skip others, changed shards)
    refill the shuffle blocks otherwise: a journaled step came back with other keys and was
    planned anew like one counted otherwise, and the resumed job trained committed samples
    again and others never. Other keys now stop the job; other lengths are still planned anew."""
    from dispatcher_server.server import Fatal

    d = _fed_dispatcher(4, str(tmp_path))
    try:
        _serve_steps(d, 2)
        assert d.journal.read_entry(0).keys is not None
    finally:
        d._close()
    d = _fed_dispatcher(4, str(tmp_path), prefix="other")
    try:
        with pytest.raises(Fatal, match=r"journaled step 0 comes back with other samples"):
            d._pump()
    finally:
        d._close()


def test_a_commit_after_a_restart_leaves_the_steps_to_replay_intact(tmp_path):
    """After a restart, one rank may commit a step another rank still needs replayed: the
    journal then drops that plan, and the replay must still send the journaled one."""
    def run(commit_first: bool) -> tuple[list, float, int]:
        """Plan steps 0 and 1 of one shard: (their journaled plans, replay mismatches, bytes
        the journal grew by while serving them)."""
        # A rank ahead of the others checkpointed step 1 before anything was replayed.
        d = _fed_dispatcher(4, str(tmp_path), (lambda d: d.journal.commit(1)) if commit_first else None)
        try:
            size = os.path.getsize(d.journal.path)
            _serve_steps(d, 2)
            plans = [d.journal.read_entry(s).plan for s in (0, 1)]
            mismatches = d.metrics.registry.get_sample_value(
                "mmdispatch_errors_total", {"kind": "replay_mismatch"}) or 0
            return plans, mismatches, os.path.getsize(d.journal.path) - size
        finally:
            d._close()

    plans, _, grew = run(False)  # plans steps 0 and 1 and journals them
    assert all(p is not None for p in plans) and grew > 0
    # Restarted from the journal, a commit of step 1 arrives before steps 0 and 1 are replayed:
    # they are replayed verbatim from the journaled plans, so nothing new is journaled (before
    # the fix: a crash on the dropped plan; planning them again would journal them again).
    _, mismatches, grew = run(True)
    assert mismatches == 0 and grew == 0


def test_a_step_whose_samples_count_otherwise_after_a_restart_is_planned_anew(tmp_path):
    """Readers restarted with other counting rules (or tokenizer) send the same keys with other
    lengths: the journaled plan would not fit them (a trainer failed on every replay of it), so
    the step is planned anew from what arrived, and the mismatch is counted."""
    d = _fed_dispatcher(4, str(tmp_path))
    try:
        _serve_steps(d, 2)
        journaled = d.journal.read_entry(0).plan
    finally:
        d._close()
    for longer, replanned in ((0, False), (3, True)):
        d = _fed_dispatcher(4, str(tmp_path), longer=longer)
        try:
            d._pump()
            step0 = next(rs for rs in d.retained if rs.step == 0)
            mismatches = d.metrics.registry.get_sample_value(
                "mmdispatch_errors_total", {"kind": "replay_mismatch"}) or 0
            assert mismatches == (2 if replanned else 0)  # both journaled steps
            assert (step0.plan.to_dict() != journaled) == replanned
            assert step0.batch.inputs.text_len.tolist() == [5 + i + longer for i in range(4)]
        finally:
            d._close()


def test_replaying_a_journaled_step_keeps_the_steps_after_it_committable(tmp_path):
    """After a restart the slowest rank sets the replay point; a faster rank still commits
    steps past it, which the journal must still know while the replay catches up."""
    d = _fed_dispatcher(2, str(tmp_path))
    try:
        _serve_steps(d, 4)  # plan and journal steps 0..3
        assert d.journal.last_step == 3
    finally:
        d._close()
    d = _fed_dispatcher(2, str(tmp_path), max_retained_steps=1)  # restarted: replays step 0
    try:
        d._pump()
        assert [rs.step for rs in d.retained] == [0]
        assert d.journal.commit(3)  # a rank that had step 3 checkpointed it
        assert d.journal.last_step == 3
    finally:
        d._close()


def test_without_a_journal_only_cursors_from_the_last_commit_on_are_kept():
    """No journal: the dispatcher keeps a packed cursor per step, and drops the ones before a
    commit (memory flat over a long run); resuming before it is refused with the reason."""
    d = _fed_dispatcher(2)
    try:
        _serve_steps(d, 4)
        assert sorted(d.replay.cursors) == [0, 1, 2, 3]
        assert d.replay.cursor_before(3) == {"base": 0, "partial": [[0, 6]], "done": []}
        assert d.replay.commit(2)
        assert sorted(d.replay.cursors) == [2, 3]
        assert d.replay.cursor_before(3)["partial"] == [[0, 6]]
        with pytest.raises(JournalError, match="from the last commit on .*--journal-dir"):
            d.replay.cursor_before(2)
    finally:
        d._close()


def test_the_stream_is_done_only_once_every_rank_has_its_last_step_and_left():
    """`--exit-when-done` leaves after done(): END queued behind steps a rank has not read yet
    must not count (the exit dropped them, and the rank reconnected to nobody until its step
    timeout: seen in bench.stream)."""
    d = _fed_dispatcher(4)
    try:
        _serve_steps(d, 0)
        (reader,) = d.readers.values()
        (a,) = reader.assignments
        d._on_reader(reader.ident, P.decode(P.encode(P.SHARD_DONE, assign_id=a.id, count=8,
                                                     skipped=[])), 0.0)
        d._pump()
        slot = d.slots[0]
        assert d.finished() and d.next_plan == 2 and slot.end_sent  # both steps and END queued
        assert not d.done()
        d._on_trainer(slot.ident, P.decode(P.encode(P.CREDIT, upto=12, received=1)), 0.0)
        assert not d.done()
        d._on_trainer(slot.ident, P.decode(P.encode(P.CREDIT, upto=12, received=2)), 0.0)
        # Every step received, but the rank may still be training on them and commit later (the
        # demo's trainers did, to a dispatcher already gone): done once it has left.
        assert not d.done()
        d._on_trainer(slot.ident, P.decode(P.encode(P.COMMIT, step=1)), 0.0)
        assert d.replay.committed == 1 and not d.done()
        d._on_trainer(slot.ident, P.decode(P.encode(P.BYE)), 0.0)
        assert d.done()
    finally:
        d._close()


def _one_shard_two_losses() -> ServerConfig:
    """One shard, one rank, steps of 4, and a sample skipped after 2 readers lost at it."""
    from dispatcher_server.config import LivenessConfig

    return ServerConfig(
        shuffle_buffer=0, shards=["/data/shard-0.tar"], world_size=1, batch=BatchConfig(global_batch=4),
        planner=PlannerConfig(num_microbatches=1), max_epochs=1,
        liveness=LivenessConfig(max_shard_losses=2),
        flow=FlowConfig(max_buffered_samples=1_000, num_inflight_shards=1, credit_batch=4))


def test_readers_lost_while_waiting_for_credit_skip_nothing():
    """Readers killed while they waited for credit (trainers paused) were counted as taken
    down by the shard's next sample: after max_shard_losses a good sample was skipped."""
    d = Dispatcher(_one_shard_two_losses())
    try:
        for i in range(3):
            reader = Reader(ident=b"r%d" % i, name=f"r{i}", last_seen=0.0)
            d.readers[reader.ident] = reader
            d._on_reader(reader.ident, P.decode(P.encode(P.SHARD_REQUEST)), 0.0)
            d._pump()
            (a,) = reader.assignments
            a.credits = 0  # it sent every sample it was granted; the trainers are behind
            d._drop_reader(reader, "timeout")
        assert d.skipped == [] and d.progress[0].next_index == 0
    finally:
        d._close()


def test_a_sample_that_takes_down_every_reader_is_skipped_after_max_shard_losses():
    """Readers lost in a row at the same sample of a shard: after `max_shard_losses` that sample
    is skipped (readers_lost, by shard and index) and the next reader starts after it; a loss
    after progress starts the count again."""
    d = Dispatcher(_one_shard_two_losses())
    samples = [{"key": f"k{i}", "index": i, "text_len": 5, "llm_len": 5, "items": [], "payloads": []}
               for i in range(6)]

    def reader_on_the_shard(name: str) -> tuple[Reader, Assignment]:
        reader = Reader(ident=name.encode(), name=name, last_seen=0.0)
        d.readers[reader.ident] = reader
        d._on_reader(reader.ident, P.decode(P.encode(P.SHARD_REQUEST)), 0.0)
        d._pump()
        (a,) = reader.assignments
        return reader, a

    try:
        r, a = reader_on_the_shard("r0")
        d._on_samples(r, _message(d, a.id, samples[:1], True))  # one outstanding at first
        d._pump()
        d._on_samples(r, _message(d, a.id, samples[1:2], True))
        d._drop_reader(r, "timeout")  # lost at index 2 (first loss there)
        r, a = reader_on_the_shard("r1")
        d._on_samples(r, _message(d, a.id, samples[2:3], True))
        d._drop_reader(r, "timeout")  # progress was made: lost at index 3, count starts again
        assert d.skipped == []
        r, a = reader_on_the_shard("r2")
        d._drop_reader(r, "bye")  # a clean leave is no loss
        r, a = reader_on_the_shard("r3")
        d._drop_reader(r, "timeout")  # second loss in a row at index 3: skipped
        assert d.skipped == [("/data/shard-0.tar#3", "readers_lost")]
        r, a = reader_on_the_shard("r4")
        assert d.pool.assignments[a.id].pos == a.pos and d.progress[a.pos].next_index == 4
        d._on_samples(r, _message(d, a.id, samples[4:], True))
        d._on_shard_done(r, P.decode(P.encode(P.SHARD_DONE, assign_id=a.id, count=a.received,
                                               skipped=[])))
        for _ in range(5):
            d._pump()
        planned = [k for rs in d.retained for k in rs.batch.keys]
        assert planned == ["k0", "k1", "k2", "k4", "k5"]  # k3 alone is skipped; none is lost
    finally:
        d._close()


def test_steps_without_a_commit_are_gauged_and_warned_of_once(tmp_path, monkeypatch, caplog):
    """Trainers that never commit make the dispatcher keep every step's replay history (plans
    on disk with a journal, cursors in memory): the gauge shows the lag and one line says so."""
    import dispatcher_server.server as server

    monkeypatch.setattr(server, "COMMITS_LAG_STEPS", 3)
    d = _fed_dispatcher(1, str(tmp_path))
    try:
        with caplog.at_level(logging.WARNING, logger="mmdispatch"):
            _serve_steps(d, 6)
        assert d.replay.last_step == 7  # planned ahead of the acknowledgements: all 8 samples
        assert d.metrics.uncommitted_steps._value.get() == 8  # steps 0..7, no commit yet
        lines = [r.getMessage() for r in caplog.records if "event=commits_lag" in r.getMessage()]
        assert len(lines) == 1 and "steps=3 last_commit=-1" in lines[0]
        assert "client.commit(step)" in lines[0]
        assert d.replay.commit(4)
        d._check_commits_lag(7)
        assert d.metrics.uncommitted_steps._value.get() == 3
    finally:
        d._close()
