"""Skipped samples reach the dispatcher, every one, as they happen; a changed shard never kills
a reader. The reader runs for real against a scripted ROUTER (tests.servicekit.ScriptedRouter);
every receive has a timeout.
"""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
import threading
from contextlib import contextmanager

import pytest

from dispatcher_server import protocol as P
from pipeline.errors import ErrorPolicy, ErrorStats, SampleError
from pipeline.reader import ReaderConfig, iter_shard
from pipeline.service import ReaderServiceConfig, ReaderWorker
from tests.servicekit import ScriptedRouter, good_and_bad, tar_of


def _config(mode: str = "skip") -> ReaderConfig:
    return ReaderConfig(errors=ErrorPolicy(mode=mode))


@contextmanager
def _reader(router: ScriptedRouter, *, mode: str = "skip", batch: int = 8):
    """A ReaderWorker thread, welcomed by `router`; yields (worker, errors raised by run)."""
    stop, errors = threading.Event(), []
    worker = ReaderWorker(ReaderServiceConfig(dispatcher=router.endpoint, name="r", batch=batch,
                                              prefetch_shards=0, timeout_s=5.0,
                                              reader=_config(mode)))

    def run() -> None:
        try:
            worker.run(stop)
        except BaseException as e:  # noqa: BLE001 - checked by the test
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        router.welcome(router.expect(P.HELLO))
        router.expect(P.SHARD_REQUEST)
        yield worker, errors
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive(), "the reader did not stop"


def _read_shard(router: ScriptedRouter, shard: str, *, start_index: int = 0,
                credits: int = 1000) -> list[P.Message]:
    """Assign `shard`, grant credits, and return every SAMPLES message up to its SHARD_DONE."""
    router.send(P.SHARD_ASSIGN, assign_id=1, shard=shard, pos=0, epoch=0, start_index=start_index)
    router.send(P.CREDIT, assign_id=1, samples=credits)
    got = []
    while True:
        msg = router.recv(10.0)
        assert msg is not None, "the reader stopped sending before SHARD_DONE"
        if msg.type in (P.SAMPLES, P.SHARD_DONE):
            got.append(msg)
        if msg.type == P.SHARD_DONE:
            return got


def _skips(messages: list[P.Message]) -> list[P.SkipRecord]:
    return [s for m in messages for s in m.get("skipped", [])]


def test_iter_shard_hands_every_skip_to_its_sink_with_its_index(tmp_path):
    shard = tar_of(str(tmp_path / "s.tar"), good_and_bad([("good", 20), ("bad", 80), ("good", 20)]))
    got, stats = [], ErrorStats()
    records = list(iter_shard(shard, _config(), stats=stats,
                              on_skip=lambda e, i: got.append((e.key, e.reason, i))))
    assert len(records) == 40
    assert got == [(f"{i:06d}", "bad_image", i) for i in range(20, 100)]
    assert stats.num_errors == 80


def test_a_run_of_80_bad_samples_reports_all_80_keys_with_their_indices(tmp_path):
    shard = tar_of(str(tmp_path / "s.tar"), good_and_bad([("good", 20), ("bad", 80), ("good", 20)]))
    with ScriptedRouter() as router, _reader(router) as (_, errors):
        messages = _read_shard(router, shard)
    assert not errors
    assert _skips(messages) == [P.SkipRecord(f"{i:06d}", "bad_image", i) for i in range(20, 100)]
    sent = [s.index for m in messages if m.type == P.SAMPLES for s in m["samples"]]
    assert sent == [*range(20), *range(100, 120)]
    assert messages[-1]["count"] == 40


def test_skips_travel_with_the_first_sample_after_them_not_at_the_end(tmp_path):
    # Killed once past the bad run, a reader must already have reported it: the skips arrive
    # in the message carrying sample 40 (the first good one after them) or earlier.
    shard = tar_of(str(tmp_path / "s.tar"), good_and_bad([("good", 10), ("bad", 30), ("good", 300)]))
    with ScriptedRouter() as router, _reader(router, batch=16) as (_, errors):
        messages = _read_shard(router, shard)
    assert not errors
    carrier = next(n for n, m in enumerate(messages) if m.type == P.SAMPLES
                   and any(s.index == 40 for s in m["samples"]))
    assert _skips(messages[:carrier + 1]) == [P.SkipRecord(f"{i:06d}", "bad_image", i)
                                             for i in range(10, 40)]
    assert _skips(messages[carrier + 1:]) == []  # and never again


def test_a_shard_rewritten_smaller_is_reported_and_finished_and_the_reader_goes_on(tmp_path):
    shard = tar_of(str(tmp_path / "s.tar"), good_and_bad([("good", 20)]))
    with ScriptedRouter() as router, _reader(router) as (worker, errors):
        (done,) = _read_shard(router, shard, start_index=77)  # read before, at 77 samples or more
        assert done.type == P.SHARD_DONE and done["count"] == 0
        assert done["skipped"] == [P.SkipRecord("", "shard_changed", -1)]
        router.expect(P.SHARD_REQUEST)  # alive and asking for more
        messages = _read_shard(router, shard)  # and still reads
    assert not errors
    assert sum(len(m["samples"]) for m in messages if m.type == P.SAMPLES) == 20


def test_under_errors_raise_a_changed_shard_stops_the_reader_naming_shard_and_reason(tmp_path):
    shard = tar_of(str(tmp_path / "s.tar"), good_and_bad([("good", 20)]))
    with ScriptedRouter() as router:
        with _reader(router, mode="raise") as (worker, errors):
            router.send(P.SHARD_ASSIGN, assign_id=1, shard=shard, pos=0, epoch=0, start_index=77)
            router.send(P.CREDIT, assign_id=1, samples=10)
            # Why first, naming the shard and the way on; then it leaves, so the dispatcher
            # hears both at once.
            why = router.expect(P.ERROR)
            assert why["code"] == P.READER_STOPPED and shard in why["message"]
            assert "shard_changed" in why["message"] and "--errors skip" in why["message"]
            router.expect(P.BYE)
        assert len(errors) == 1 and isinstance(errors[0], SampleError)
        assert "shard_changed" in str(errors[0]) and shard in str(errors[0])
        # `mmdispatch read` says the same in one line and exits non-zero.
        proc = subprocess.Popen([sys.executable, "-m", "mmdispatch.cli", "read", "--dispatcher",
                                 router.endpoint, "--errors", "raise", "--prefetch-shards", "0"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            router.welcome(router.expect(P.HELLO, 30.0))
            router.expect(P.SHARD_REQUEST)
            router.send(P.SHARD_ASSIGN, assign_id=1, shard=shard, pos=0, epoch=0, start_index=77)
            router.send(P.CREDIT, assign_id=1, samples=10)
            _, err = proc.communicate(timeout=30)
        finally:
            proc.kill()
            proc.wait(10)
    lines = [ln for ln in err.splitlines() if "mmdispatch read:" in ln]
    assert proc.returncode == 1 and "Traceback" not in err
    assert len(lines) == 1 and "shard_changed" in lines[0] and shard in lines[0]
    assert "--errors skip" in lines[0]  # the way on, on the reader's own line too


@pytest.mark.parametrize("mapped", [True, False])
def test_appending_to_a_shard_being_read_is_not_called_a_truncated_tar(tmp_path, mapped):
    path = tar_of(str(tmp_path / "s.tar"), good_and_bad([("good", 30)]))
    stats = ErrorStats()
    records = iter_shard(path, ReaderConfig(errors=ErrorPolicy(mode="skip"), map_shards=mapped),
                         stats=stats)
    keys = [next(records).key]  # the shard is open (and mapped) now
    extra = b"y" * 30_000  # members past the mapped length
    with tarfile.open(path, "a", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(30, 34):
            info = tarfile.TarInfo(f"{i:06d}.txt")
            info.size = len(extra)
            tar.addfile(info, io.BytesIO(extra))
    keys += [r.key for r in records]
    assert "truncated_tar" not in stats.by_reason
    # Every sample complete before the change is read; what the map cannot hold is reported
    # as a change, and so are the appended bytes a buffered stream reads past the end-of-archive
    # blocks it had read before the append (not as a damaged shard).
    assert keys[:30] == [f"{i:06d}" for i in range(30)]
    assert stats.by_reason == {"shard_changed": 1}
    assert mapped or "changed while being read (appended to or rewritten)" in stats.recent[0][3]


# -- with a real dispatcher ----------------------------------------------------------------------
def test_skips_survive_a_reader_killed_past_the_bad_run(tmp_path):
    from dispatcher_server.config import FlowConfig
    from tests import servicekit as K
    from tests.test_service import consume, dispatcher, flat_keys, make_config

    samples = good_and_bad([("good", 10), ("bad", 30), ("good", 300)])
    shard = tar_of(str(tmp_path / "s.tar"), samples)
    bad = sorted(k for k, m in samples if "jpg" in m)
    flow = FlowConfig(max_buffered_samples=64, num_inflight_shards=1, credit_batch=8)
    with dispatcher(make_config([shard], world_size=1, global_batch=8, flow=flow)) as srv:
        received = lambda: srv.metrics.registry.get_sample_value("mmdispatch_samples_in_total") or 0
        first = K.reader(srv.reader_endpoint, name="first", log=str(tmp_path / "first.log"))
        try:
            K.wait_for(lambda: received() >= 20, 60, "the reader passing the bad run")
        finally:
            K.kill(first)  # SIGKILL: no SHARD_DONE will ever come from it
        assert sorted(k for k, _ in srv.skipped) == bad  # already reported, as they happened
        second = K.reader(srv.reader_endpoint, name="second", log=str(tmp_path / "second.log"))
        try:
            got = consume(srv.trainer_endpoint, 1)
        finally:
            K.kill(second)
        skipped = list(srv.skipped)
    assert sorted(flat_keys(got)) == sorted(k for k, m in samples if "txt" in m)
    assert sorted(k for k, _ in skipped) == bad and {r for _, r in skipped} == {"bad_image"}


def test_a_stopped_reader_leaves_the_dispatcher_at_once_not_by_timeout(tmp_path):
    from dispatcher_server.config import LivenessConfig
    from tests import servicekit as K
    from tests.test_service import dispatcher, make_config

    shard = tar_of(str(tmp_path / "s.tar"), good_and_bad([("good", 20)]))
    live = LivenessConfig(heartbeat_s=0.2, timeout_s=30.0, poll_ms=20)
    with dispatcher(make_config([shard], world_size=1, liveness=live)) as srv:
        stop = threading.Event()
        worker = ReaderWorker(ReaderServiceConfig(dispatcher=srv.reader_endpoint, name="r",
                                                  timeout_s=30.0))
        thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
        thread.start()
        try:
            K.wait_for(lambda: len(srv.readers) == 1, 20, "the reader joining")
        finally:
            stop.set()
            thread.join(10)
        K.wait_for(lambda: len(srv.readers) == 0, 3, "the dispatcher dropping the reader (BYE)")


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # its stop
@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_a_reader_its_error_policy_stops_stops_the_job_with_its_line(tmp_path, mode):
    """Under --errors raise (a bad sample), or past --max-consecutive-errors (a run of them),
    a reader stops; the dispatcher stops the job with that reader's line, instead of handing
    the shard to the next reader (which stops the same way) and waiting on readers that are gone."""
    from tests import servicekit as K
    from tests.test_service import dispatcher, make_config, readers
    from trainer_client.client import ClientConfig, DispatcherClient, DispatcherError

    shard = tar_of(str(tmp_path / "s.tar"), good_and_bad([("good", 30), ("bad", 3), ("good", 30)]))
    policy = ErrorPolicy(mode=mode, max_consecutive=2)
    with dispatcher(make_config([shard], world_size=1)) as srv:
        with readers(srv.reader_endpoint, 2, reader=ReaderConfig(errors=policy)):
            K.wait_for(lambda: srv.fatal is not None, 30, "the dispatcher stopping the job")
            # A trainer connecting after the stop gets the steps planned before it, then is
            # told the reader's line; then the dispatcher exits.
            client = DispatcherClient(srv.trainer_endpoint, 0, 1, 1,
                                      config=ClientConfig(heartbeat_s=0.2, timeout_s=5.0))
            try:
                with pytest.raises(DispatcherError, match="halted.*bad_image"):
                    for _ in client.start():
                        pass
            finally:
                client.close()
            K.wait_for(lambda: not srv._thread.is_alive(), 10, "the dispatcher's loop ending")
    assert "reader 'r" in srv.fatal and shard in srv.fatal and "bad_image" in srv.fatal
    fix = "--errors skip" if mode == "raise" else "--max-consecutive-errors"
    assert fix in srv.fatal and "--journal-dir" in srv.fatal


def test_a_local_copy_other_than_the_one_read_first_is_reported_before_any_sample(tmp_path):
    """The dispatcher names the copy another node read first (SHARD_ASSIGN `identity`): a
    reader whose mapped copy differs reports its own identity with no sample (the dispatcher
    then stops the job before a step carries any of it); the same copy is read as usual."""
    shard = tar_of(str(tmp_path / "s.tar"), good_and_bad([("good", 12)]))
    with ScriptedRouter() as router, _reader(router) as (_, errors):
        first = _read_shard(router, shard)[-1]["identity"]
        router.expect(P.SHARD_REQUEST)
        router.send(P.SHARD_ASSIGN, assign_id=2, shard=shard, pos=0, epoch=1, start_index=0,
                    identity=first)
        router.send(P.CREDIT, assign_id=2, samples=1000)
        assert router.expect(P.SAMPLES)["assign_id"] == 2  # the same copy: read
        while (msg := router.expect_any((P.SAMPLES, P.SHARD_DONE))).type != P.SHARD_DONE:
            pass
        assert msg["identity"] == first and msg["count"] == 12
        router.expect(P.SHARD_REQUEST)
        tar_of(shard, good_and_bad([("good", 11), ("bad", 1)]))  # this node's copy, rewritten
        router.send(P.SHARD_ASSIGN, assign_id=3, shard=shard, pos=0, epoch=2, start_index=0,
                    identity=first)
        router.send(P.CREDIT, assign_id=3, samples=1000)
        done = router.expect(P.SHARD_DONE)  # no SAMPLES before it
        assert done["assign_id"] == 3 and done["count"] == 0 and done["skipped"] == []
        assert done["identity"] != first
    assert not errors


def test_a_readers_hello_names_its_node_so_readers_of_one_host_share_its_copies():
    """Two `read` processes of one host are named host:pid (their logs must differ), so the
    name cannot say they read the same files: the HELLO says the host, and the dispatcher walks
    a copy to check it only when another node read the shard first."""
    import os

    stop = threading.Event()
    with ScriptedRouter() as router:
        worker = ReaderWorker(ReaderServiceConfig(dispatcher=router.endpoint, name="host:123/0",
                                                  timeout_s=5.0, reader=_config()))
        thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
        thread.start()
        try:
            hello = router.expect(P.HELLO)
        finally:
            stop.set()
            thread.join(10)
    assert hello["name"] == "host:123/0" and hello["node"] == os.uname().nodename


def test_a_copy_that_cannot_be_mapped_is_not_opened_to_be_checked(tmp_path):
    """Only a local mapped copy is walked before it is read: a `pipe:` shard's command ran (and
    a remote one would be requested) only for its stream to be dropped unread."""
    from pipeline.reader import mapped_copy_identity

    shard = tar_of(str(tmp_path / "s.tar"), good_and_bad([("good", 3)]))
    ran = tmp_path / "ran"
    assert mapped_copy_identity(f"pipe:touch {ran} && cat {shard}") is None
    assert not ran.exists(), "the pipe: command ran"
    assert mapped_copy_identity(shard)["size"] > 0


def test_skip_lines_are_structured_so_json_logs_carry_their_fields(caplog):
    """A reader's skip warning and its digest of later skips are event lines: under
    --log-format json their reason, shard, key and counts are fields, not prose."""
    import json
    import logging

    from dispatcher_server.cliopts import JsonFormatter
    from pipeline.errors import SkipDigest

    stats, policy = ErrorStats(), ErrorPolicy(mode="warn")
    digest = SkipDigest(every_s=3600)
    with caplog.at_level(logging.WARNING, logger="mmdispatch.pipeline"):
        stats.handle(SampleError("bad_image", "s3://b/x 1.tar", "k 7",
                                 "shard 's3://b/x 1.tar': not a JPEG"), policy)
        stats.handle(SampleError("bad_image", "s3://b/x 1.tar", "k 8", "not a JPEG"), policy)
        stats.handle(SampleError("empty_shard", "e.tar", None, "no samples"), policy)
        digest.note("bad_image", "s3://b/x 1.tar")
        digest.note("bad_image", "s3://b/x 1.tar")
        ours = digest.flush()  # the process-wide digest may flush a line of its own meanwhile
    lines = [json.loads(JsonFormatter().format(r)) for r in caplog.records]
    first = [line for line in lines if line.get("event") == "sample_skipped"]
    assert [(x["reason"], x["shard"], x.get("key")) for x in first] == [
        ("bad_image", "s3://b/x 1.tar", "k 7"), ("empty_shard", "e.tar", None)]
    assert first[0]["detail"] == "not a JPEG"  # the shard is its own field, not said twice
    assert first[0]["more"] == "counted, not logged"
    (summary,) = [json.loads(JsonFormatter().format(r)) for r in caplog.records
                  if r.getMessage() == ours]
    assert summary["count"] == 2 and "bad_image=2 (s3://b/x 1.tar 2)" in summary["reasons"]


def test_long_texts_go_in_as_many_messages_as_their_tokens_need_none_lost(tmp_path, monkeypatch):
    """Text tokens travel in a SAMPLES header, which the dispatcher refuses whole past its
    limit: a batch of long texts (40 of 3 MiB under the default limits) lost every sample of
    such a message. Each message now stops before the sample that would pass its budget, and a
    sample too long to fit any message is skipped as text_too_large, naming it. The limits are
    scaled down here (tokens of 1 KiB per message) to keep the shard small."""
    import pipeline.service as service

    monkeypatch.setattr(service, "_MAX_TOKEN_BYTES", 1024)
    monkeypatch.setattr(service, "_MAX_SAMPLE_TOKEN_BYTES", 3000)
    texts = [("a" * 400).encode()] * 9 + [b"b" * 4000] + [("c" * 900).encode()] * 3
    shard = tar_of(str(tmp_path / "s.tar"), [(f"{i:06d}", {"txt": t}) for i, t in enumerate(texts)])
    with ScriptedRouter() as router, _reader(router, batch=32) as (_, errors):
        messages = _read_shard(router, shard)
    assert not errors
    batches = [[s.index for s in m["samples"]] for m in messages if m.type == P.SAMPLES]
    assert [i for b in batches for i in b] == [*range(9), 10, 11, 12]  # in order, each once
    for b in batches:  # within the budget, or one sample alone
        assert len(b) == 1 or sum(len(texts[i]) + 1 + (len(texts[i]) + 7) // 8 for i in b) <= 1024
    assert max(len(b) for b in batches) == 2  # 400-byte texts two a message, not all nine
    assert _skips(messages) == [P.SkipRecord("000009", "text_too_large", 9)]
    assert messages[-1]["count"] == 12


def test_a_reader_of_a_dispatcher_says_a_shard_it_cannot_open_is_reported_not_skipped(caplog):
    """A reader that could not open a shard logged `sample_skipped reason=open_failed` while
    the dispatcher gave the shard to another reader that read it whole: an operator counting
    skips in data-node logs counted samples delivered as lost (probe). A reader of a
    dispatcher says it reported the shard; a standalone read still says it skipped it."""
    import logging

    from pipeline.service import _Assignment

    error = SampleError("open_failed", "/d/s0.tar", None, "cannot open: [Errno 2] No such file")
    with caplog.at_level(logging.WARNING):
        _Assignment(id=1, shard="/d/s0.tar", records=None, ref_path=None).stats.handle(
            error, ErrorPolicy())
        reported = caplog.text
        caplog.clear()
        ErrorStats().handle(error, ErrorPolicy())
    assert "event=shard_open_failed" in reported and "another reader reads it" in reported
    assert "sample_skipped" not in reported and "No such file" in reported
    assert "event=sample_skipped reason=open_failed" in caplog.text
