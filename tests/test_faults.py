"""Faults while data flows at full rate, each in real processes on loopback and bounded in time.

A reader SIGKILLed mid-shard, the dispatcher SIGKILLed mid-step and restarted from its journal,
a trainer process killed and restarted from its checkpoint, a reader that hangs (SIGSTOP) and a
trainer that stalls. After each, `audit` checks the whole epoch (every key exactly once, the
same steps with M micro-batches on every rank) and the per-rank batches equal an undisturbed
run's, because deterministic mode makes them a function of shards, seed and epoch only.
"""

from __future__ import annotations

import re
import signal
import time

import pytest

from tests import servicekit as K

WORLD, M = K.WORLD, K.M
Stack = K.Stack


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[str]:
    # 2400 samples in 40 shards of 60: a few seconds of full-rate streaming on two cores.
    return K.make_corpus(str(tmp_path_factory.mktemp("faults")), num_copies=40, base_samples=60,
                         base_shards=1)


@pytest.fixture(scope="module")
def keys(corpus) -> list[str]:
    return K.corpus_keys(corpus)


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> dict[int, list]:
    """The undisturbed run every faulty run must reproduce."""
    with Stack(corpus, str(tmp_path_factory.mktemp("ref")), num_readers=2) as st:
        got = K.Trainers(st.ready["trainers"], WORLD).join(60)
    return got


def _resumed_mid_shard(log: str) -> bool:
    """A shard (re)assigned at a start index past 0: only a reassignment after a loss does that."""
    return re.search(r"event=shard_assigned .*start=[1-9]", log) is not None


def test_reader_sigkill_mid_shard(corpus, keys, reference, tmp_path):
    with Stack(corpus, str(tmp_path), num_readers=2, metrics=True) as st:
        trainers = K.Trainers(st.ready["trainers"], WORLD)
        try:
            # Kill every reader at once while samples stream, and start as many replacements. The
            # shard the window's edge lies in was partly received, so one of the dead readers died
            # inside it (killing a single reader can hit one whose shard sat wholly past the window).
            for attempt in range(3):
                K.wait_for(lambda: trainers.progress() >= 40 + 60 * attempt, 30, "streaming")
                victims = [(n, p) for n, p in zip(st.names, st.procs) if p.poll() is None]
                for _, proc in victims:
                    K.kill(proc)
                for i in range(len(victims)):
                    st.add_reader(f"replacement{attempt}-{i}")
                for name, _ in victims:
                    K.wait_for(lambda: f"name={name}/0 why=timeout" in st.log_text(), 10,
                               "the dead readers' heartbeat timeouts")
                try:
                    K.wait_for(lambda: _resumed_mid_shard(st.log_text()), 3)
                    break
                except AssertionError:
                    continue
            assert _resumed_mid_shard(st.log_text()), "no reader died inside a shard"
            got = trainers.join(60)
        finally:
            trainers.close()
    K.audit(got, keys, num_microbatches=M)
    assert got == reference


def test_dispatcher_sigkill_mid_step_restarts_from_journal(corpus, keys, reference, tmp_path):
    with Stack(corpus, str(tmp_path), num_readers=2, fixed_ports=True, journal=True) as st:
        trainers = K.Trainers(st.ready["trainers"], WORLD, commit_every=5)

        def past_a_commit() -> bool:  # steps received past the last commit
            c = trainers.commits
            return bool(c) and max(map(len, trainers.steps.values())) - 1 > c[-1]

        try:
            # Held still (clients heartbeating) once well into the epoch and past a commit, so
            # no commit lands between that check and the kill; a commit that raced the hold
            # lets them go on to the next chance.
            for _ in range(20):
                K.wait_for(lambda: trainers.progress() >= 60 and past_a_commit(), 30,
                           "streaming past a commit")
                trainers.hold()
                if past_a_commit():
                    break
                trainers.release()
            K.kill(st.server)  # no shutdown: the journal is all that survives
            at_kill = {r: len(s) for r, s in trainers.steps.items()}
            committed = trainers.commits[-1]
            # Steps past the last commit were in flight: the restart must replay them verbatim.
            assert max(at_kill.values()) - 1 > committed
            ready = st.start_server()  # same endpoints: trainers and readers reconnect by themselves
            trainers.release()
            assert committed + 1 <= ready["next_step"] <= max(at_kill.values())
            got = trainers.join(60)
        finally:
            trainers.close()
    second_life = st.log_text().split("event=bound")[2]
    assert second_life.count("event=trainer_joined") >= WORLD  # both ranks came back to it
    K.audit(got, keys, num_microbatches=M)
    assert got == reference


def test_trainer_process_killed_and_restarted_from_its_checkpoint(corpus, keys, reference, tmp_path):
    out1, out2 = str(tmp_path / "rank0-a.jsonl"), str(tmp_path / "rank0-b.jsonl")
    with Stack(corpus, str(tmp_path), num_readers=2, journal=True) as st:
        rank1 = K.Trainers(st.ready["trainers"], WORLD, ranks=[1])
        first = second = None
        try:
            # Held after step 51, two past its commit of step 49: the kill below lands with
            # received-but-uncommitted steps however fast data flows (a polled moment between
            # commits was missed when steps came fast).
            first = K.trainer(st.ready["trainers"], 0, WORLD, out1, commit_every=5, hold_after=51,
                              log=str(tmp_path / "t0.log"))
            K.wait_for(lambda: len(K.read_steps(out1)[0]) >= 52, 60,
                       "the trainer process streaming past a commit")
            K.kill(first)
            steps1, commits1, _ = K.read_steps(out1)
            resume = commits1[-1] + 1  # what its checkpoint says
            assert len(steps1) > resume, "nothing after the checkpoint to replay"
            second = K.trainer(st.ready["trainers"], 0, WORLD, out2, next_step=resume,
                               log=str(tmp_path / "t0b.log"))
            assert second.wait(60) == 0
            steps2, _, ended = K.read_steps(out2)
            got = rank1.join(60)
        finally:
            rank1.close()
            K.kill(first)
            K.kill(second)
    assert ended and steps2[0][0] == resume
    # The steps the killed process saw after its checkpoint come back identical.
    assert steps1[resume:] == steps2[:len(steps1) - resume]
    got[0] = steps1[:resume] + steps2
    K.audit(got, keys, num_microbatches=M)
    assert got == reference


def test_hung_reader_is_detected_and_its_shard_reassigned(corpus, keys, reference, tmp_path):
    with Stack(corpus, str(tmp_path), num_readers=2) as st:
        trainers = K.Trainers(st.ready["trainers"], WORLD)
        try:
            K.wait_for(lambda: trainers.progress() >= 50, 30, "streaming")
            st.procs[0].send_signal(signal.SIGSTOP)  # alive, socket open, silent
            K.wait_for(lambda: "name=r0/0 why=timeout" in st.log_text(), 10,
                       "heartbeat timeout of the hung reader")
            st.add_reader("replacement")
            got = trainers.join(60)
        finally:
            trainers.close()
    K.audit(got, keys, num_microbatches=M)
    assert got == reference


def test_stalled_trainer_applies_backpressure_with_bounded_dispatcher_rss(corpus, keys, reference,
                                                                            tmp_path):
    # Bytes bound well under the corpus (~80 MB): without backpressure the dispatcher would
    # buffer the rest of the epoch while rank 1 sleeps.
    bound = 8 << 20
    with Stack(corpus, str(tmp_path), num_readers=2, metrics=True,
               extra=["--max-buffered-bytes", str(bound)]) as st:
        trainers = K.Trainers(st.ready["trainers"], WORLD, prefetch=1)
        try:
            K.wait_for(lambda: trainers.progress() >= 30, 30, "streaming")
            trainers.pause[1].set()
            time.sleep(1.0)  # let the pipeline fill up to its bounds
            pid = st.server.pid
            rss0 = K.rss_bytes(pid)
            m0 = K.scrape(st.metrics_port)
            peak_rss, peak_held = rss0, 0.0
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:
                peak_rss = max(peak_rss, K.rss_bytes(pid))
                peak_held = max(peak_held, K.scrape(st.metrics_port)["mmdispatch_buffered_samples"])
                time.sleep(0.1)
            m1 = K.scrape(st.metrics_port)
            stalled_at = len(trainers.steps[1])
            trainers.pause[1].clear()
            got = trainers.join(60)
        finally:
            trainers.close()
    # Backpressure: while rank 1 sleeps nothing new is planned or read...
    assert m1["mmdispatch_steps_served_total"] == m0["mmdispatch_steps_served_total"]
    assert m1["mmdispatch_samples_in_total"] == m0["mmdispatch_samples_in_total"]
    assert m1["mmdispatch_steps_served_total"] <= stalled_at + 1 + 3  # prefetch + retained
    # ...and what is held stays within the configured bounds, in the gauges and in RSS.
    assert 0 < peak_held <= 96
    assert m1["mmdispatch_buffered_bytes"] <= bound + 64 * 40_000  # one message may overshoot
    assert peak_rss - rss0 < 16 << 20, f"dispatcher RSS grew {(peak_rss - rss0) >> 20} MiB"
    K.audit(got, keys, num_microbatches=M)
    assert got == reference


def test_service_keeps_serving_past_bad_shards_and_names_them(tmp_path):
    """Whole broken shards among good ones, through `serve` and `read` processes: the epoch
    completes, what is readable is delivered once, and every loss is reported by shard."""
    from pipeline.errors import ErrorPolicy
    from pipeline.reader import ReaderConfig, iter_shard

    corpus = K.make_corpus(str(tmp_path / "good"), num_copies=2, base_samples=40, base_shards=4)
    good, victim = corpus[:7], corpus[7]
    truncated, garbage, empty = (str(tmp_path / n) for n in ("trunc.tar", "garbage.tar", "empty.tar"))
    with open(victim, "rb") as f:
        data = f.read()
    with open(truncated, "wb") as f:
        f.write(data[:len(data) // 2 + 100])  # cut inside a member
    with open(garbage, "wb") as f:
        f.write(bytes(range(256)) * 40)
    open(empty, "wb").close()
    shards = good[:3] + [truncated] + good[3:6] + [garbage, empty] + good[6:]
    readable = [r.key for s in shards for r in iter_shard(
        s, ReaderConfig(errors=ErrorPolicy(mode="skip")))]
    assert len(K.corpus_keys(good)) < len(readable) < len(K.corpus_keys(corpus))  # half lost
    with Stack(shards, str(tmp_path), num_readers=1, metrics=True) as st:
        trainers = K.Trainers(st.ready["trainers"], WORLD)
        try:
            got = trainers.join(60)
        finally:
            trainers.close()
        skipped_total = K.scrape(st.metrics_port)["mmdispatch_samples_skipped_total"]
        log = st.log_text()
    K.audit(got, readable, num_microbatches=M)
    assert sorted(k for r in got for _, mbs in got[r] for mb in mbs for k in mb) == sorted(readable)
    assert skipped_total >= 3
    for bad in (truncated, garbage, empty):  # each loss is reported, naming the shard
        assert re.search(rf"event=sample_skipped shard={re.escape(bad)} .*reason=\w+", log), bad
