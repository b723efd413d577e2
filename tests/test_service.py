"""Dispatcher + readers + trainer clients over real loopback sockets: delivery, order, failures.

The dispatcher and readers run as threads here (fast); tests about processes (killed readers,
dispatcher restarts) live in test_service_process.py. Helpers below are shared with it.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
import zlib
from contextlib import contextmanager

import msgpack
import pytest
import zmq

from dispatcher_server import protocol as P
from dispatcher_server.config import BatchConfig, FlowConfig, LivenessConfig, ServerConfig
from dispatcher_server.ordering import ShardOrder
from dispatcher_server.planner import PlannerConfig
from dispatcher_server.server import Dispatcher
from pipeline.gendata import generate
from pipeline.reader import ReaderConfig, iter_samples
from pipeline.service import ReaderServiceConfig, ReaderWorker
from trainer_client.client import ClientConfig, DispatcherClient, DispatcherError

from tests.servicekit import tar_of

NUM_SAMPLES, NUM_SHARDS = 90, 6


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[str]:
    return generate(str(tmp_path_factory.mktemp("svc")), num_samples=NUM_SAMPLES,
                    num_shards=NUM_SHARDS, seed=3)


def all_keys(shards: list[str]) -> list[str]:
    return [r.key for r in iter_samples(shards)]


def make_config(shards, *, world_size=3, global_batch=8, num_microbatches=2, **kw) -> ServerConfig:
    flow = kw.pop("flow", FlowConfig(max_buffered_samples=256, num_inflight_shards=3, credit_batch=8))
    return ServerConfig(
        shuffle_buffer=kw.pop("shuffle_buffer", 0), shards=list(shards), world_size=world_size,
        batch=BatchConfig(global_batch=global_batch),
        planner=kw.pop("planner", PlannerConfig(num_microbatches=num_microbatches)), flow=flow,
        liveness=kw.pop("liveness", LivenessConfig(heartbeat_s=0.2, timeout_s=1.5, poll_ms=20)),
        journal_fsync=False, **kw)


@contextmanager
def readers(endpoint: str, num: int, **kw):
    """`num` reader workers as threads; stopped and joined on exit."""
    stop = threading.Event()
    workers = [ReaderWorker(ReaderServiceConfig(dispatcher=endpoint, name=f"r{i}", batch=8,
                                                timeout_s=1.5, **kw)) for i in range(num)]
    threads = [threading.Thread(target=w.run, args=(stop,), daemon=True) for w in workers]
    for t in threads:
        t.start()
    try:
        yield workers
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        assert not any(t.is_alive() for t in threads), "a reader thread did not stop"


@contextmanager
def dispatcher(config: ServerConfig):
    server = Dispatcher(config).start()
    try:
        yield server
    finally:
        server.stop()


def client_config(**kw) -> ClientConfig:
    return ClientConfig(heartbeat_s=0.2, timeout_s=1.5, step_timeout_s=30, **kw)


def consume(endpoint: str, world_size: int, *, max_steps: int | None = None, states=None,
            ranks=None, commit_at: int | None = None, record=None, **client_kw) -> dict[int, list]:
    """Run one client per rank in threads; per rank a list of `record(step)` per step, by
    default (step, [keys per micro-batch])."""
    out: dict[int, list] = {}
    errors: list[BaseException] = []
    ranks = range(world_size) if ranks is None else ranks

    def train(rank: int) -> None:
        try:
            client = DispatcherClient(endpoint, rank, world_size, world_size,
                                      config=client_config(**client_kw))
            if states is not None:
                client.load_state_dict(states[rank])
            got = []
            try:
                for step in client:
                    got.append(record(step) if record is not None else
                               (step.step, [mb.keys for mb in step.microbatches]))
                    if step.step == commit_at:
                        client.commit(step.step)
                    if max_steps is not None and len(got) >= max_steps:
                        break
            finally:
                client.close()
            out[rank] = got
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            errors.append(e)

    threads = [threading.Thread(target=train, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a trainer thread hung"
    return out


def flat_keys(per_rank: dict[int, list]) -> list[str]:
    return [k for steps in per_rank.values() for _, mbs in steps for keys in mbs for k in keys]


def test_full_epoch_exactly_once_across_ranks(shards):
    with dispatcher(make_config(shards)) as srv, readers(srv.reader_endpoint, 2):
        got = consume(srv.trainer_endpoint, 3)
    keys = flat_keys(got)
    assert sorted(keys) == sorted(all_keys(shards))  # every sample once, none twice
    steps = [[s for s, _ in got[r]] for r in range(3)]
    assert steps[0] == steps[1] == steps[2] == list(range(-(-NUM_SAMPLES // 8)))
    for r in range(3):
        for _, mbs in got[r]:
            assert len(mbs) == 2  # exactly M micro-batches for every rank, every step
    # No rank sees the whole batch: per step the ranks' key sets are disjoint.
    for i in range(len(steps[0])):
        per_rank = [sum(got[r][i][1], []) for r in range(3)]
        assert sum(map(len, per_rank)) == len(set().union(*per_rank))
        assert max(map(len, per_rank)) < sum(map(len, per_rank))


def test_arrival_mode_is_exactly_once_too(shards):
    with dispatcher(make_config(shards, mode="arrival", world_size=2)) as srv, \
            readers(srv.reader_endpoint, 3):
        got = consume(srv.trainer_endpoint, 2)
    assert sorted(flat_keys(got)) == sorted(all_keys(shards))


def test_deterministic_order_does_not_depend_on_reader_count(shards):
    runs = []
    for num_readers in (1, 3):
        with dispatcher(make_config(shards, seed=11, max_epochs=2)) as srv, \
                readers(srv.reader_endpoint, num_readers):
            runs.append(consume(srv.trainer_endpoint, 3))
    assert runs[0] == runs[1]
    keys = flat_keys(runs[0])
    assert len(keys) == 2 * NUM_SAMPLES and sorted(set(keys)) == sorted(all_keys(shards))
    # Each epoch's steps follow that epoch's shard order: step 0 of epoch e holds only keys of
    # the first shard of epoch e's permutation.
    order = ShardOrder(shards, seed=11, max_epochs=2)
    steps_per_epoch = -(-NUM_SAMPLES // 8)
    for epoch in range(2):
        step_keys = {k for r in runs[0] for s, mbs in runs[0][r] if s == epoch * steps_per_epoch
                     for keys in mbs for k in keys}
        first_shard = {rec.key for rec in iter_samples([order.url(epoch * NUM_SHARDS)])}
        assert len(step_keys) == 8 and step_keys <= first_shard


def _text_shard(path, name: str, n: int) -> str:
    import io
    import tarfile

    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(n):
            data = f"{name} sample {i}".encode()
            info = tarfile.TarInfo(f"{name}{i:05d}.txt")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


@pytest.mark.timeout(60)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("credit_batch", [8, 32])
def test_a_blend_of_more_sources_than_reader_slots_is_served_whole(tmp_path, caplog, credit_batch,
                                                                   monkeypatch):
    """One reader holds two shards; three sources each need their head read at once. Readers
    full of two sources' shards, stopped at their buffer caps, left the third unread: no step
    was ever planned. A starving head now takes back the shard with the most buffered, also
    where a shard's cap (20 samples here) is below a credit batch (32)."""
    from dispatcher_server import server
    from dispatcher_server.config import Source

    monkeypatch.setattr(server, "SLOTS_WARN_AFTER_S", 0.0)  # this run is shorter than the wait

    sources = [Source(name=n, shards=[_text_shard(tmp_path / f"{n}.tar", n, 90)]) for n in "abc"]
    keys = {f"{n}{i:05d}" for n in "abc" for i in range(90)}
    flow = FlowConfig(max_buffered_samples=120, num_inflight_shards=3, credit_batch=credit_batch)

    def run(num_readers: int) -> list[str]:
        config = make_config([], world_size=2, global_batch=12, max_epochs=1, sources=sources,
                             flow=flow)
        assert (config.shard_cap < credit_batch) == (credit_batch == 32)
        with dispatcher(config) as srv, readers(srv.reader_endpoint, num_readers):
            got = consume(srv.trainer_endpoint, 2)
        return [k for r in sorted(got) for _, mbs in got[r] for mb in mbs for k in mb]

    one = run(1)
    assert sorted(one) == sorted(keys)  # every key once
    said = [r.message for r in caplog.records if "event=blend_short_of_reader_slots" in r.message]
    assert len(said) == 1 and "sources=3 reader_slots=2" in said[0], said
    assert run(3) == one  # deterministic: the order does not depend on the readers


@pytest.mark.timeout(60)
def test_take_backs_while_readers_join_are_not_called_too_few_slots(tmp_path, caplog, monkeypatch):
    """The workers of one `read --workers N` join one by one: the first alone is short of slots
    for a blend and a shard is taken back, but that is no advice to start more readers (it was
    said once, then held for the whole job). Only take-backs SLOTS_WARN_AFTER_S after the last
    reader joined say so."""
    from dispatcher_server import server
    from dispatcher_server.config import Source

    taken = []
    victim = server.Dispatcher._starved_head_victim

    def spy(self, *args):
        chosen = victim(self, *args)
        taken.append(chosen is not None)
        return chosen
    monkeypatch.setattr(server.Dispatcher, "_starved_head_victim", spy)
    sources = [Source(name=n, shards=[_text_shard(tmp_path / f"{n}.tar", n, 90)]) for n in "abc"]
    flow = FlowConfig(max_buffered_samples=120, num_inflight_shards=3, credit_batch=8)
    config = make_config([], world_size=2, global_batch=12, max_epochs=1, sources=sources, flow=flow)
    with dispatcher(config) as srv, readers(srv.reader_endpoint, 1):
        got = consume(srv.trainer_endpoint, 2)
    assert sum(len(mb) for r in got for _, mbs in got[r] for mb in mbs) == 270
    assert any(taken), "no shard was taken back: the test did not reach the warning's path"
    assert "short_of_reader_slots" not in caplog.text


@pytest.mark.timeout(120)
def test_blocks_mixing_more_shards_than_reader_slots_are_served_whole_in_one_order(tmp_path, caplog,
                                                                                  monkeypatch):
    """--shuffle-shards 4 with one reader of two slots: the shard a block waits on takes back
    the shard with the most buffered (which resumes where it stopped), so every key comes
    once, in the order four readers give, and steps hold samples of several shards."""
    from dispatcher_server import server

    monkeypatch.setattr(server, "SLOTS_WARN_AFTER_S", 0.0)  # this run is shorter than the wait
    shard_list = [_text_shard(tmp_path / f"s{i}.tar", f"s{i}-", 60) for i in range(6)]
    keys = {f"s{i}-{j:05d}" for i in range(6) for j in range(60)}
    flow = FlowConfig(max_buffered_samples=200, num_inflight_shards=2, credit_batch=8)

    def run(num_readers: int) -> list[list[str]]:
        config = make_config(shard_list, world_size=2, global_batch=12, max_epochs=1,
                             shuffle_buffer=24, shuffle_shards=4, flow=flow)
        with dispatcher(config) as srv, readers(srv.reader_endpoint, num_readers):
            got = consume(srv.trainer_endpoint, 2)
        steps: dict[int, list[str]] = {}
        for r in sorted(got):
            for step, mbs in got[r]:
                steps.setdefault(step, []).extend(k for mb in mbs for k in mb)
        return [sorted(steps[s]) for s in sorted(steps)]

    one = run(1)
    assert sorted(k for step in one for k in step) == sorted(keys)  # every key once
    assert "shuffle_blocks_of_one_shard" not in caplog.text
    said = [r.message for r in caplog.records if "event=short_of_reader_slots" in r.message]
    assert len(said) == 1 and "shards_read_together=4 reader_slots=2" in said[0], said
    assert sum(len({k.split("-")[0] for k in step}) >= 3 for step in one) >= len(one) // 2
    assert run(4) == one  # deterministic: the steps do not depend on the readers


def test_shuffle_blocks_drawn_from_one_shard_each_are_said_once(tmp_path, caplog):
    """Shards larger than the shuffle block, pulled one after another: each block, so each
    step, holds one shard; the dispatcher says so once, naming --shuffle-shards."""
    shard_list = [_text_shard(tmp_path / f"s{i}.tar", f"s{i}-", 60) for i in range(4)]
    config = make_config(shard_list, world_size=2, global_batch=12, max_epochs=1,
                         shuffle_buffer=24)
    with caplog.at_level(logging.WARNING, logger="mmdispatch"), dispatcher(config) as srv, \
            readers(srv.reader_endpoint, 1):
        consume(srv.trainer_endpoint, 2)
    said = [r.message for r in caplog.records if "event=shuffle_blocks_of_one_shard" in r.message]
    assert len(said) == 1 and "--shuffle-shards N" in said[0] and "source=default" in said[0]


@pytest.mark.timeout(120)
def test_each_source_whose_blocks_hold_one_shard_is_named_with_a_fix_that_fits_it(tmp_path, caplog):
    """In a blend, the warning named the first source it found (a source of one shard of 3
    samples, shuffled whole: nothing to fix, and --shuffle-shards cannot apply) and none other.
    Each source whose full blocks come from one shard is now named once; one of a single shard
    is told to write more shards."""
    from dispatcher_server.config import Source

    tiny = [_text_shard(tmp_path / "tiny.tar", "t", 3)]
    giant = [_text_shard(tmp_path / "giant.tar", "g", 200)]
    mix = [_text_shard(tmp_path / f"m{i}.tar", f"m{i}-", 60) for i in range(4)]
    config = make_config([], sources=[Source(name="tiny", shards=tiny, weight=1.0),
                                      Source(name="giant", shards=giant, weight=6.0),
                                      Source(name="mix", shards=mix, weight=6.0)],
                         world_size=2, global_batch=12, max_epochs=None, max_steps=30,
                         shuffle_buffer=130)  # blocks by weight: tiny 10 (its whole shard), 60
    with caplog.at_level(logging.WARNING, logger="mmdispatch"), dispatcher(config) as srv, \
            readers(srv.reader_endpoint, 2):
        consume(srv.trainer_endpoint, 2)
    said = {m.split("source=")[1].split()[0]: m for m in
            (r.message for r in caplog.records if "event=shuffle_blocks_of_one_shard" in r.message)}
    assert sorted(said) == ["giant", "mix"], said
    assert "--shuffle-shards N draws" in said["mix"]
    assert "write it as several shards" in said["giant"]


@pytest.mark.timeout(120)
def test_ranks_restarted_without_state_start_at_one_step_while_old_processes_take_steps(shards):
    """A job restarted before its first checkpoint, while its old processes are still
    connected: each new rank started at the oldest step not yet received by every rank, and an
    old rank still acknowledging steps moved that on between two new ranks' joins, so they
    trained different steps together (then hung). The step the first one started at is now
    kept for, and given to, the others of its restart."""
    cfg = make_config(shards, world_size=2, global_batch=4, num_microbatches=1)
    clients = []

    def client(rank: int) -> DispatcherClient:
        clients.append(DispatcherClient(srv.trainer_endpoint, rank, 2, 2, config=client_config()))
        return clients[-1]
    with dispatcher(cfg) as srv, readers(srv.reader_endpoint, 1):
        try:
            old0, old1 = iter(client(0)), iter(client(1))
            assert [next(old0).step for _ in range(2)] == [0, 1]
            assert [next(old1).step for _ in range(4)] == [0, 1, 2, 3]  # ahead, as prefetch allows
            new0 = iter(client(0))  # replaces rank 0's old process
            first = next(new0).step  # the oldest step rank 0's old process had not received

            def old_rank_runs_on() -> None:  # acknowledging the steps after `first` as it goes
                try:
                    for _ in old1:
                        pass
                except Exception:  # noqa: BLE001 - replaced, or closed at the end
                    pass
            threading.Thread(target=old_rank_runs_on, daemon=True).start()
            time.sleep(1.0)  # its credits arrive: `first` would be evicted, and more
            new1 = iter(client(1))
            assert next(new1).step == first
            assert next(new0).step == next(new1).step == first + 1
        finally:
            for c in clients:
                c.close()


def test_client_restart_resumes_where_its_state_says(shards):
    cfg = make_config(shards, world_size=2)
    with dispatcher(cfg) as srv, readers(srv.reader_endpoint, 2):
        reference = consume(srv.trainer_endpoint, 2)
    with dispatcher(cfg) as srv, readers(srv.reader_endpoint, 2):
        first = consume(srv.trainer_endpoint, 2, max_steps=4)
        states = {r: {"next_step": 4, "rank": r, "world_size": 2} for r in range(2)}
        second = consume(srv.trainer_endpoint, 2, states=states)
    for r in range(2):
        assert first[r] + second[r] == reference[r]


@pytest.mark.timeout(60)
def test_ranks_restored_from_different_checkpoints_are_both_stopped_naming_the_steps(shards):
    """Rank 1 from a checkpoint at step 2, rank 0 from one at step 4: each got its own steps,
    so their collectives paired step 4's plan with step 2's and nobody was told."""
    cfg = make_config(shards, world_size=2)
    with dispatcher(cfg) as srv, readers(srv.reader_endpoint, 2):
        consume(srv.trainer_endpoint, 2, max_steps=5)
        late = DispatcherClient(srv.trainer_endpoint, 1, 2, 2, config=client_config())
        early = DispatcherClient(srv.trainer_endpoint, 0, 2, 2, config=client_config())
        try:
            late.load_state_dict({"next_step": 2, "rank": 1, "world_size": 2})
            assert next(late).step == 2
            early.load_state_dict({"next_step": 4, "rank": 0, "world_size": 2})
            with pytest.raises(DispatcherError, match=r"rank 0 resumes at step 4 but rank 1 "
                               r"resumed at step 2: .*Restore every rank from one checkpoint"):
                next(early)
            with pytest.raises(DispatcherError, match="restored from different checkpoints"):
                for _ in range(10):  # the steps it held already, then the refusal
                    next(late)
        finally:
            late.close()
            early.close()
        # One checkpoint for both, as a restart of the whole job brings: served as usual.
        states = {r: {"next_step": 3, "rank": r, "world_size": 2} for r in range(2)}
        again = consume(srv.trainer_endpoint, 2, states=states, max_steps=2)
    assert [s for s, _ in again[0]] == [s for s, _ in again[1]] == [3, 4]


@pytest.mark.timeout(60)
def test_ranks_restored_from_different_checkpoints_are_stopped_also_behind_a_prefetch_pool(shards):
    """As above, with the README's loop: a PrefetchPool takes steps from the client ahead of
    the loop, so rank 1's credits passed its resume step at once while it still waited in
    step 2, and rank 0, restored at step 4 a moment later, was accepted: each trained its own
    steps, paired in every collective. The client says what its pool takes ahead."""
    from trainer_client.prefetch import PrefetchConfig, PrefetchPool

    cfg = make_config(shards, world_size=2)
    with dispatcher(cfg) as srv, readers(srv.reader_endpoint, 2):
        consume(srv.trainer_endpoint, 2, max_steps=6)
        late = DispatcherClient(srv.trainer_endpoint, 1, 2, 2, config=client_config())
        early = DispatcherClient(srv.trainer_endpoint, 0, 2, 2, config=client_config())
        late.load_state_dict({"next_step": 2, "rank": 1, "world_size": 2})
        pool = PrefetchPool(late, PrefetchConfig(workers=1, kind="thread", ahead=4))
        try:
            assert next(pool).step == 2  # and the loop waits in step 2, its pool filling
            deadline = time.monotonic() + 10
            while late._consumed < 5 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert late._consumed >= 5, "the pool took no steps ahead"
            time.sleep(0.5)  # its credits reach the dispatcher
            early.load_state_dict({"next_step": 4, "rank": 0, "world_size": 2})
            with pytest.raises(DispatcherError, match=r"rank 0 resumes at step 4 but rank 1 "
                               r"resumed at step 2"):
                next(early)
        finally:
            pool.close()
            late.close()
            early.close()

def _left_at(srv, rank: int = 0) -> int | None:
    """The `next_step` of rank `rank`'s BYE, once the dispatcher has it."""
    slot = srv.delivery.slots[rank]
    deadline = time.monotonic() + 10
    while not slot.said_bye and time.monotonic() < deadline:
        time.sleep(0.02)
    assert slot.said_bye, "no BYE"
    return slot.left_at


@pytest.mark.timeout(90)
def test_a_loop_that_leaves_a_step_in_hand_says_it_did_not_finish_that_step(shards):
    """A SIGTERM (SystemExit), a KeyboardInterrupt or an error raised while the loop trains
    step s said BYE with next_step s + 1, as if s were trained: in the job's last step the
    dispatcher took the job as done and exited, leaving a restart from the checkpoint no
    dispatcher to resume from. The client told the two apart by an exception in flight as it
    closed, and so still said s + 1 when the error had been handled before `close()` (`except`
    then `finally`), or when another thread closed it. Now a loop that never asked past step s
    (an exception, handled or not; a `break`) says next_step s, unless it committed s or
    reported its timings: then s was trained."""
    from trainer_client.prefetch import PrefetchConfig, PrefetchPool

    def client(at):
        c = DispatcherClient(srv.trainer_endpoint, 0, 1, 1, config=client_config())
        if at is not None:
            c.load_state_dict({"next_step": at})
        return c

    with dispatcher(make_config(shards, world_size=1)) as srv, readers(srv.reader_endpoint, 1):
        with pytest.raises(SystemExit):
            with client(None) as c:
                for step in c:
                    if step.step == 1:
                        raise SystemExit(143)  # what the SIGTERM handler raises mid-step
        assert _left_at(srv) == 1
        c = client(1)
        with pytest.raises(KeyboardInterrupt):
            try:
                with PrefetchPool(c, PrefetchConfig(workers=1, ahead=2)) as pool:
                    assert next(pool).step == 1
                    assert next(pool).step == 2
                    raise KeyboardInterrupt
            finally:
                c.close()  # in the same exception's finally: the pool's position, less its step
        assert _left_at(srv) == 2
        c = client(2)
        try:
            for step in c:
                raise ValueError("an error in step 2, handled before the client closes")
        except ValueError:
            pass
        finally:
            c.close()
        assert _left_at(srv) == 2
        c = client(2)
        pool = PrefetchPool(c, PrefetchConfig(workers=1, ahead=2))
        try:
            for step in pool:
                raise KeyboardInterrupt
        except KeyboardInterrupt:
            pass
        closer = threading.Thread(target=c.close)  # closed from another thread
        closer.start()
        closer.join(20)
        pool.close()
        assert _left_at(srv) == 2
        c = client(2)
        for step in c:
            break  # before training it
        c.close()
        assert _left_at(srv) == 2
        for trained in ("report_timings", "commit"):  # a commit forgets the steps before
            c = client(2)
            for step in c:
                c.commit(step.step) if trained == "commit" else c.report_timings(step.step, [])
                break  # its step limit, after training it
            c.close()
            assert _left_at(srv) == 3, trained


@pytest.mark.timeout(90)
def test_a_client_s_bye_says_where_its_loop_stopped_not_where_it_read_to(shards):
    """A SIGTERM'd trainer (or a loop that breaks) said the same BYE as one that trained every
    step: with the END already prefetched, `serve --exit-when-done` took the job as done and
    exited with steps after the last commit untrained. The BYE now says the step after the last
    the loop took: the client's, or its PrefetchPool's (whose steps read ahead are untrained),
    whichever is closed first."""
    from trainer_client.prefetch import PrefetchConfig, PrefetchPool

    left_at = _left_at
    with dispatcher(make_config(shards, world_size=1)) as srv, readers(srv.reader_endpoint, 1):
        c = DispatcherClient(srv.trainer_endpoint, 0, 1, 1, config=client_config())
        assert [next(c).step for _ in range(2)] == [0, 1]
        c.close()
        assert left_at(srv) == 1  # step 1 in hand, neither committed nor timed: untrained
        for pool_first in (True, False):
            c = DispatcherClient(srv.trainer_endpoint, 0, 1, 1, config=client_config())
            c.load_state_dict({"next_step": 2})
            pool = PrefetchPool(c, PrefetchConfig(workers=1, ahead=4))
            assert next(pool).step == 2
            deadline = time.monotonic() + 10
            while c._consumed < 5 and time.monotonic() < deadline:
                time.sleep(0.02)  # the pool reads ahead of the loop
            assert c._consumed >= 5
            for closing in ((pool, c) if pool_first else (c, pool)):
                closing.close()
            assert left_at(srv) == 2  # the pool's loop holds step 2: untrained
        c = DispatcherClient(srv.trainer_endpoint, 0, 1, 1, config=client_config())
        c.load_state_dict({"next_step": 3})
        steps = [s.step for s in c]  # to the end of the stream
        c.close()
        assert left_at(srv) == steps[-1] + 1 == srv.next_plan


def test_a_reader_says_once_that_it_connected(shards, caplog):
    """It was silent from start to end: an operator could not tell it had reached anyone."""
    caplog.set_level(logging.INFO, logger="mmdispatch")
    with dispatcher(make_config(shards, world_size=1, max_steps=1)) as srv, \
            readers(srv.reader_endpoint, 1):
        consume(srv.trainer_endpoint, 1)
    said = [r.message for r in caplog.records if "event=reader_connected" in r.message]
    assert len(said) == 1 and srv.reader_endpoint in said[0] and "name=r0" in said[0], said


def test_version_mismatch_gets_an_error_naming_both_versions(shards):
    with dispatcher(make_config(shards, world_size=1)) as srv:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        try:
            sock.connect(srv.trainer_endpoint)
            sock.send(msgpack.packb({"v": P.VERSION + 41, "type": P.HELLO, "seq": 1,
                                     "role": "trainer", "rank": 0, "world_size": 1}))
            assert sock.poll(5000), "no answer to a hello of another version"
            msg = P.decode(sock.recv_multipart())
        finally:
            sock.close(linger=0)
    assert msg.type == P.ERROR and msg["code"] == "version"
    assert f"v{P.VERSION + 41}" in msg["message"] and f"v{P.VERSION}" in msg["message"]


def test_wrong_world_size_is_refused_clearly(shards):
    with dispatcher(make_config(shards, world_size=2)) as srv:
        client = DispatcherClient(srv.trainer_endpoint, 0, 3, 3, config=client_config())
        try:
            with pytest.raises(Exception, match="world_size=3.*world_size=2"):
                next(client)
        finally:
            client.close()


def test_oversized_and_malformed_messages_leave_the_server_serving(shards):
    limits = P.Limits(max_frame_bytes=1 << 20)
    cfg = make_config(shards, world_size=1, limits=limits, max_steps=3)
    with dispatcher(cfg) as srv, readers(srv.reader_endpoint, 1):
        ctx = zmq.Context.instance()
        bad = ctx.socket(zmq.DEALER)
        try:
            bad.connect(srv.trainer_endpoint)
            bad.send_multipart([P.encode(P.HEARTBEAT)[0], b"x" * (2 << 20)])  # refused by socket
            bad.close(linger=500)
            bad = ctx.socket(zmq.DEALER)
            bad.connect(srv.trainer_endpoint)
            bad.send(b"\xc1 definitely not msgpack")
            assert bad.poll(5000)
            answer = P.decode(bad.recv_multipart())
            bad.send_multipart(P.encode(P.HELLO, role="trainer", rank=0, world_size=1) + [b"extra"])
            assert bad.poll(5000)
            answer2 = P.decode(bad.recv_multipart())
        finally:
            bad.close(linger=0)
        got = consume(srv.trainer_endpoint, 1)
        errors = {s.labels["kind"]: s.value for m in srv.metrics.registry.collect()
                  if m.name == "mmdispatch_errors" for s in m.samples if s.name.endswith("_total")}
    assert answer.type == P.ERROR and answer["code"] == "malformed"
    assert answer2.type == P.ERROR and "payload" in answer2["message"]
    assert [s for s, _ in got[0]] == [0, 1, 2]
    assert errors.get("malformed", 0) >= 2


def _png_of(idat_bytes: int) -> bytes:
    """A PNG whose framing is whole (what readers check) around `idat_bytes` of image data."""
    ihdr = b"IHDR" + struct.pack(">IIBBBBB", 64, 64, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + ihdr + struct.pack(">I", zlib.crc32(ihdr))
            + struct.pack(">I", idat_bytes) + b"IDAT" + bytes(idat_bytes) + b"\0\0\0\0"
            + b"\x00\x00\x00\x00IEND\xaeB`\x82")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("payloads", ["inline", "direct"])
def test_payloads_past_a_frames_limit_reach_the_trainer_and_items_past_it_are_skipped(tmp_path, payloads):
    """A zmq frame over the receiver's MAXMSGSIZE (256 MiB) makes its socket drop the sender
    without a word: a reader's SAMPLES or a rank's micro-batch of large media cycled the reader
    until its shard was given up as readers_lost. Payloads now travel in frames within the
    limit; an item larger than a frame (a raised --max-member-bytes, or --preprocess-on
    datanode) is skipped by its reader, naming it."""
    big = 150 << 20
    sizes = {"k0": 10, "k1": big, "k2": big, "k3": 10}
    shard = tar_of(str(tmp_path / "big.tar"), [
        *[(k, {"png": _png_of(n), "txt": b"a cat"}) for k, n in sizes.items()],
        ("huge", {"png": _png_of(300 << 20), "txt": b"a whale"})])
    cfg = make_config([shard], world_size=1, global_batch=4, num_microbatches=1, max_epochs=1,
                      payloads=payloads, flow=FlowConfig(max_buffered_samples=64, num_inflight_shards=1, credit_batch=8,
                                      max_buffered_bytes=2 << 30))

    def record(step):
        (mb,) = step.microbatches
        return {k: memoryview(p).nbytes for k, p in zip(mb.encoders["vision"].sample_keys,
                                                        mb.encoders["vision"].payloads)}
    with dispatcher(cfg) as srv, readers(srv.reader_endpoint, 1,
                                         reader=ReaderConfig(max_member_bytes=400 << 20)):
        got = consume(srv.trainer_endpoint, 1, max_steps=1, record=record)
        skipped = [s.value for m in srv.metrics.registry.collect()
                   if m.name == "mmdispatch_samples_skipped" for s in m.samples
                   if s.name.endswith("_total")]
    assert got[0] == [{k: len(_png_of(n)) for k, n in sizes.items()}]
    assert skipped == [1]


def test_slow_trainer_bounds_the_dispatcher_memory(shards):
    flow = FlowConfig(max_buffered_samples=48, num_inflight_shards=2, max_retained_steps=2,
                      credit_batch=4)
    cfg = make_config(shards, world_size=2, global_batch=8, flow=flow)
    peak = 0
    with dispatcher(cfg) as srv, readers(srv.reader_endpoint, 2):
        fast = DispatcherClient(srv.trainer_endpoint, 0, 2, 2, config=client_config(prefetch=1))
        slow = DispatcherClient(srv.trainer_endpoint, 1, 2, 2, config=client_config(prefetch=1))
        try:
            slow_steps = [next(slow).step]
            fast_steps = [next(fast).step for _ in range(3)]
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:  # the slow rank stalls: nothing may grow
                held = srv.metrics.registry.get_sample_value("mmdispatch_buffered_samples")
                peak = max(peak, held)
                time.sleep(0.02)
            # slow consumed 1 step and holds 1 prefetched: at most max_retained more are planned
            assert srv.next_plan <= 2 + flow.max_retained_steps
            rest = threading.Thread(target=lambda: fast_steps.extend(s.step for s in fast))
            rest.start()
            slow_steps += [s.step for s in slow]
            rest.join(30)
        finally:
            fast.close()
            slow.close()
    assert 0 < peak <= flow.max_buffered_samples
    assert slow_steps == fast_steps == list(range(len(fast_steps)))


def test_metrics_are_served_over_http(shards, caplog):
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def scrape(srv) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics.port}/metrics", timeout=5) as r:
            return r.read().decode()
    with caplog.at_level(logging.INFO, logger="mmdispatch"), \
            dispatcher(make_config(shards, world_size=2, max_steps=3, metrics_port=port)) as srv, \
            readers(srv.reader_endpoint, 1):
        consume(srv.trainer_endpoint, 2, commit_at=1)
        text = scrape(srv)
        for _ in range(100):  # the commit's gauge is set just after its answer left
            if "mmdispatch_uncommitted_steps 1.0" in text:
                break
            time.sleep(0.02)
            text = scrape(srv)
    assert "mmdispatch_steps_served_total 3.0" in text
    assert 'mmdispatch_peers_connected{role="reader"} 1.0' in text
    assert "mmdispatch_plan_ms_count 3.0" in text
    assert 'mmdispatch_imbalance_max_over_mean{phase="llm"}' in text
    # A commit lowers the planned-but-uncommitted count (it was only set when a step was planned).
    assert "mmdispatch_uncommitted_steps 1.0" in text
    # One source (--shards) is counted as 'default' (it had no samples planned by source).
    assert 'mmdispatch_source_samples_total{source="default"} 24.0' in text
    assert sorted(r.getMessage() for r in caplog.records if "trainer_left" in r.getMessage()) == [
        "mmdispatch event=trainer_left rank=0 why=bye next_step=3",
        "mmdispatch event=trainer_left rank=1 why=bye next_step=3"]


def test_bad_samples_are_reported_by_key_not_lost(tmp_path):
    import io
    import tarfile

    from dispatcher_server.journal import Journal
    from pipeline.gendata import make_sample

    path = str(tmp_path / "bad.tar")
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(12):
            members = make_sample(7, i) if i not in (2, 9) else {"jpg": b"not an image", "txt": b"x"}
            for suffix, data in members.items():
                info = tarfile.TarInfo(f"{i:08d}.{suffix}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    journal = str(tmp_path / "journal")
    with dispatcher(make_config([path], world_size=2, global_batch=4, journal_dir=journal)) as srv, \
            readers(srv.reader_endpoint, 1):
        got = consume(srv.trainer_endpoint, 2)
        skipped = list(srv.skipped)
    assert sorted(flat_keys(got)) == [f"{i:08d}" for i in range(12) if i not in (2, 9)]
    assert skipped == [("00000002", "bad_image"), ("00000009", "bad_image")]
    fp = make_config([path], world_size=2, global_batch=4).fingerprint()
    j = Journal(journal, fp)
    try:
        assert j.num_skipped == 2
    finally:
        j.close()


def test_serve_settings_come_from_toml_and_flags(tmp_path, shards):
    import argparse

    from mmdispatch import serve

    toml = tmp_path / "d.toml"
    toml.write_text(f'[serve]\nshards = {list(shards)!r}\nworld_size = 4\nglobal_batch = 32\nseed = 3\n'
                    'mode = "arrival"\n'.replace("'", '"'))
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    help_text = parser.format_help()
    for dest, (type_, default, _) in serve.OPTIONS.items():
        assert "--" + dest.replace("_", "-") in help_text
        assert type_ is bool or default is None or f"(default: {default})" in " ".join(help_text.split())
    values = serve.resolve(parser.parse_args(["--config", str(toml), "--seed", "8"]))
    cfg = serve.build_config(values)
    assert (cfg.world_size, cfg.batch.global_batch, cfg.seed, cfg.mode) == (4, 32, 8, "arrival")
    assert cfg.shards == list(shards) and cfg.planner.num_microbatches == 1
    toml.write_text('[serve]\nworld_size = 2\nbogus = 1\n')
    with pytest.raises(ValueError, match="bogus"):
        serve.resolve(parser.parse_args(["--config", str(toml)]))
    with pytest.raises(ValueError, match="--shards or --dataset is required"):
        serve.resolve(parser.parse_args(["--world-size", "2", "--global-batch", "4"]))


@pytest.mark.parametrize("flags, warned", [
    (["--world-size", "8", "--global-batch", "4"], True),  # M defaults to 1: 4 ranks empty
    (["--world-size", "8", "--global-batch", "4", "--num-microbatches", "1"], True),
    (["--world-size", "4", "--global-batch", "4"], False),
    (["--world-size", "8", "--global-batch", "4", "--microbatch-token-budget", "100"], False),
])
def test_empty_microbatches_are_warned_whether_or_not_m_is_typed(shards, caplog, flags, warned):
    import argparse
    import logging

    from mmdispatch import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    values = serve.resolve(parser.parse_args(["--shards", shards[0], *flags]))
    with caplog.at_level(logging.WARNING):
        serve.build_config(values)
    assert ("event=empty_microbatches" in caplog.text) is warned, caplog.text


def test_empty_microbatches_warning_names_the_fix(shards, caplog):
    """serve --world-size 2 --global-batch 4 --num-microbatches 4: 2 empty micro-batches per
    rank every step; the warning says which settings end that."""
    import argparse
    import logging

    from mmdispatch import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    values = serve.resolve(parser.parse_args(["--shards", shards[0], "--world-size", "2",
                                              "--global-batch", "4", "--num-microbatches", "4"]))
    with caplog.at_level(logging.WARNING):
        serve.build_config(values)
    (line,) = [r.getMessage() for r in caplog.records if "empty_microbatches" in r.getMessage()]
    assert "--global-batch 8 or --num-microbatches 2" in line, line
    assert "token-budget" not in line
    caplog.clear()
    # A token budget cuts steps shorter still: a larger global batch alone may change nothing.
    values = serve.resolve(parser.parse_args(["--shards", shards[0], "--world-size", "2",
                                              "--global-batch", "4", "--num-microbatches", "4",
                                              "--token-budget", "100"]))
    with caplog.at_level(logging.WARNING):
        serve.build_config(values)
    (line,) = [r.getMessage() for r in caplog.records if "empty_microbatches" in r.getMessage()]
    assert "with a --token-budget that holds 8 samples" in line, line


def test_step_log_records_every_planned_step(shards, tmp_path):
    import json

    path = tmp_path / "steps.jsonl"
    with dispatcher(make_config(shards, world_size=2, max_steps=3, step_log=str(path))) as srv, \
            readers(srv.reader_endpoint, 1):
        consume(srv.trainer_endpoint, 2)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(r["num_samples"] == 8 and r["world_size"] == 2 for r in records)
    assert len({r["dataset"] for r in records}) == 1  # the job's id: report merges no two jobs
    with dispatcher(make_config(shards, world_size=2, max_steps=1, step_log=str(path), seed=9)) as srv, \
            readers(srv.reader_endpoint, 1):
        consume(srv.trainer_endpoint, 2)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 4 and records[-1]["dataset"] != records[0]["dataset"]


def test_a_reader_sending_unplannable_samples_cannot_break_the_dispatcher(shards):
    def recv(sock, type_):
        while True:
            assert sock.poll(5000), f"no {type_} from the dispatcher"
            msg = P.decode(sock.recv_multipart())
            if msg.type == type_:
                return msg

    with dispatcher(make_config(shards[:1], world_size=1)) as srv:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        try:
            sock.connect(srv.reader_endpoint)
            sock.send_multipart(P.encode(P.HELLO, seq=1, role="reader", name="rogue"))
            recv(sock, P.WELCOME)
            sock.send_multipart(P.encode(P.SHARD_REQUEST, seq=2))
            assign = recv(sock, P.SHARD_ASSIGN)
            recv(sock, P.CREDIT)
            bad = [["k-smell", 0, 1, 5, P.blank_tokens(1), [["smell", "nose", 3, 4, {}]]],
                   ["k-len", 1, 1, 99, P.blank_tokens(1), []]]
            # one at a time: until a sample's size is known, one sample is granted in all
            for seq, sample in enumerate(bad, 3):
                if seq > 3:
                    recv(sock, P.CREDIT)
                sock.send_multipart(P.encode(P.SAMPLES, seq=seq, frames=[b"x"] if sample[5] else [],
                                             assign_id=assign["assign_id"], samples=[sample]))
            sock.send_multipart(P.encode(P.BYE, seq=5))
            time.sleep(0.3)
        finally:
            sock.close(linger=0)
        assert srv._thread.is_alive()
        assert srv.skipped == [("k-smell", "invalid_header"), ("k-len", "invalid_llm_len")]
        with readers(srv.reader_endpoint, 1):  # the shard is finished by an honest reader
            got = consume(srv.trainer_endpoint, 1)
    expected = all_keys(shards[:1])
    assert sorted(flat_keys(got)) == sorted(expected[2:])  # indices 0, 1 were consumed as bad


def test_peers_counting_by_other_rules_are_refused_naming_the_rule(shards, tmp_path):
    from pipeline.counting import CountingConfig, ImageConfig
    from pipeline.reader import ReaderConfig
    from pipeline.service import FatalReaderError, ReaderWorker, input_rules

    with dispatcher(make_config(shards, world_size=1)) as srv:
        ours = input_rules(CountingConfig(), max_member_bytes=ReaderConfig().max_member_bytes)
        client = DispatcherClient(srv.trainer_endpoint, 0, 1, 1, config=client_config(),
                                  inputs={**ours, "image.patch_size": 16})
        with readers(srv.reader_endpoint, 1):  # the default rules state the session's first
            deadline = time.monotonic() + 10
            while not srv.inputs.rules and time.monotonic() < deadline:
                time.sleep(0.02)
            assert srv.inputs.rules == ours
            try:
                with pytest.raises(Exception, match=r"image\.patch_size: rank 0 16, reader 'r0' 14"):
                    next(client)
            finally:
                client.close()
        # A data node with another pixel budget is refused too, and stops: the error is fatal.
        other = ReaderConfig(counting=CountingConfig(image=ImageConfig(max_pixels=256 * 256)))
        worker = ReaderWorker(ReaderServiceConfig(dispatcher=srv.reader_endpoint, name="odd",
                                                  reader=other, timeout_s=1.5))
        # r0, which stated the session's rules, has left: the line says only a restart changes them.
        deadline = time.monotonic() + 10
        while srv.pool.readers and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not srv.pool.readers
        with pytest.raises(FatalReaderError, match=r"image\.max_pixels: reader 'odd' 65536, reader 'r0'"
                                                   r".* reader 'r0' left, .* until the dispatcher "
                                                   r"restarts: restart it once every peer agrees"):
            worker.run()
        # Another tokenizer: the line names hashes, and the reader adds its own file (probe).
        from pipeline.counting import TextConfig
        from pipeline.gendata import write_tokenizer

        tok = write_tokenizer(str(tmp_path), shards[:1])
        other = ReaderConfig(counting=CountingConfig(text=TextConfig(tokenizer_path=tok)))
        worker = ReaderWorker(ReaderServiceConfig(dispatcher=srv.reader_endpoint, name="tok",
                                                  reader=other, timeout_s=1.5))
        with pytest.raises(FatalReaderError, match=r"tokenizer: reader 'tok' 'sha256:.*\(this "
                                                   r"reader's --tokenizer: .*tokenizer.json\)$"):
            worker.run()
        # Agreeing peers, and peers stating nothing, are admitted.
        assert srv.inputs.admit("rank 0", ours) is None and srv.inputs.admit("rank 0", None) is None
        # A rule stated by a peer still connected gives no restart advice.
        why = srv.inputs.admit("rank 0", {**ours, "image.patch_size": 16}, lambda: {"reader 'r0'"})
        assert "image.patch_size" in why and "restart" not in why


def test_a_peer_at_the_other_endpoint_is_told_which_endpoint_it_wants(shards):
    with dispatcher(make_config(shards[:1], world_size=1)) as srv:
        for endpoint, role, want in ((srv.trainer_endpoint, "reader", "serve --reader-bind"),
                                     (srv.reader_endpoint, "trainer", "serve --trainer-bind")):
            sock = zmq.Context.instance().socket(zmq.DEALER)
            try:
                sock.connect(endpoint)
                sock.send_multipart(P.encode(P.HELLO, seq=1, role=role, name="lost", rank=0,
                                             world_size=1))
                assert sock.poll(5000)
                msg = P.decode(sock.recv_multipart())
            finally:
                sock.close(linger=0)
            assert msg.type == P.ERROR and msg["code"] == "role"
            assert f"role {role!r} connected to the" in msg["message"] and want in msg["message"]


@pytest.mark.timeout(120)
def test_a_closed_prefetch_pool_gives_its_prepared_steps_back_to_the_client(shards):
    """A PrefetchPool closed with steps prepared ahead dropped them: the client had handed
    them out, so a second pool over the same client went on after them and they were lost."""
    from trainer_client.prefetch import PrefetchConfig, PrefetchPool

    cfg = make_config(shards, world_size=1, max_epochs=1)
    with dispatcher(cfg) as srv, readers(srv.reader_endpoint, 2):
        client = DispatcherClient(srv.trainer_endpoint, 0, 1, 1, config=client_config())
        try:
            with PrefetchPool(client, PrefetchConfig(workers=2, ahead=4)) as pool:
                first = [next(pool).step for _ in range(2)]
                deadline = time.monotonic() + 20
                while pool._ready.qsize() < 2 and time.monotonic() < deadline:
                    time.sleep(0.02)  # the feeder takes steps ahead of the loop
                assert pool._ready.qsize() >= 2
                assert pool.state_dict()["next_step"] == 2
            assert client.state_dict()["next_step"] == 2
            with PrefetchPool(client, PrefetchConfig(workers=2)) as pool:
                rest = [step.step for step in pool]
        finally:
            client.close()
    assert first + rest == list(range(NUM_SAMPLES // 8 + 1))  # every step once, in order


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rewind", ["client", "pool"])
def test_a_rewind_under_an_open_prefetch_pool_serves_the_rewound_steps_next(shards, rewind):
    """client.load_state_dict(saved) while a PrefetchPool over the client was open: the pool
    handed out the steps it had prepared ahead (5-9) before the rewound ones (3...). Either
    load_state_dict now drops them, and the next step is the saved one."""
    from trainer_client.prefetch import PrefetchConfig, PrefetchPool

    cfg = make_config(shards, world_size=1, max_epochs=1)
    with dispatcher(cfg) as srv, readers(srv.reader_endpoint, 2):
        client = DispatcherClient(srv.trainer_endpoint, 0, 1, 1, config=client_config())
        try:
            with PrefetchPool(client, PrefetchConfig(workers=2, ahead=4)) as pool:
                first = {}
                for step in pool:
                    first[step.step] = step
                    if step.step == 1:
                        saved = pool.state_dict()
                    if step.step == 3:
                        break
                deadline = time.monotonic() + 20
                while pool._ready.qsize() < 2 and time.monotonic() < deadline:
                    time.sleep(0.02)  # the feeder takes steps ahead of the loop
                assert pool._ready.qsize() >= 2
                (client if rewind == "client" else pool).load_state_dict(saved)
                assert pool.state_dict()["next_step"] == 2
                again = [next(pool) for _ in range(4)]
        finally:
            client.close()
    assert [s.step for s in again] == [2, 3, 4, 5]
    for step in again[:2]:  # the same steps, with their inputs prepared
        assert _step_keys(step) == _step_keys(first[step.step])
        assert all(mb.inputs is not None for mb in step.microbatches)


def _step_keys(step) -> list[list[str]]:
    return [list(mb.keys) for mb in step.microbatches]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("via", ["client", "pool"])
def test_a_rewind_after_the_end_arrived_serves_the_rewound_steps_not_the_old_end(shards, via):
    """load_state_dict only queues the rewind for the client thread: an END (and steps) already
    in the client's queue were taken by the next `__next__` as the end of the rewound stream,
    which then yielded nothing instead of steps 1... Deliveries carry the rewind they follow."""
    from trainer_client.prefetch import PrefetchConfig, PrefetchPool

    last = NUM_SAMPLES // 8  # steps 0..last, then END
    cfg = make_config(shards, world_size=1, max_epochs=1)
    with dispatcher(cfg) as srv, readers(srv.reader_endpoint, 2):
        # Credit for every step: the client's queue fills up to the END, a pool's feeder or not.
        client = DispatcherClient(srv.trainer_endpoint, 0, 1, 1, config=client_config(prefetch=16))
        pool = PrefetchPool(client, PrefetchConfig(workers=1, ahead=4)) if via == "pool" else None
        source = pool if pool is not None else client
        try:
            first = [next(source) for _ in range(3)]
            deadline = time.monotonic() + 20
            while (client._steps.qsize() != last + 2 - client._consumed
                   and time.monotonic() < deadline):
                time.sleep(0.02)  # the steps after those taken, and the END
            assert client._steps.qsize() == last + 2 - client._consumed
            source.load_state_dict({"next_step": 1})
            again = [step for step in source]
        finally:
            if pool is not None:
                pool.close()
            client.close()
    assert [s.step for s in again] == list(range(1, last + 1))
    for step in again[:2]:
        assert _step_keys(step) == _step_keys(first[step.step])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["pool.close", "dataset.load_state_dict"])
def test_a_pool_closed_while_its_feeder_waits_for_a_step_leaves_that_step_to_the_client(
        shards, how):
    """Rank 0's pool feeder waits in the client's __next__ for step 1, which rank 1 (not there
    yet) holds back. close() gave up on it after 5 s and the feeder, left behind, took step 1
    once it came and dropped it: rank 0's next loop began at step 2, one step off its peer's
    collectives. A DispatcherDataset closes its pool on every load_state_dict, so a rewind lost
    the step too."""
    from trainer_client.client import DispatcherDataset
    from trainer_client.prefetch import PrefetchConfig, PrefetchPool

    cfg = make_config(shards, world_size=2, max_epochs=1)
    with dispatcher(cfg) as srv, readers(srv.reader_endpoint, 2):
        prefetch = PrefetchConfig(workers=1, ahead=20)
        if how == "pool.close":
            client = DispatcherClient(srv.trainer_endpoint, 0, 2, 2, config=client_config())
            source = PrefetchPool(client, prefetch)
        else:
            source = DispatcherDataset(srv.trainer_endpoint, preprocess=prefetch, tokenizer=None, rank=0,
                                       world_size=2, local_world_size=2, config=client_config())
        try:
            first = next(iter(source)).step
            client = source.client if how != "pool.close" else client
            taken, deadline = None, time.monotonic() + 20
            while taken != client._consumed and time.monotonic() < deadline:
                taken = client._consumed
                time.sleep(1)  # the feeder takes what rank 0 alone gets, then waits for more
            assert first == 0 and taken == client._consumed and client._steps.empty()
            assert taken < NUM_SAMPLES // 8  # it waits for a step rank 1 holds back
            if how == "pool.close":
                source.close()
                rest = client
            else:
                source.load_state_dict(dict(source.state_dict(), next_step=1))
                rest = source
            peer = {}
            thread = threading.Thread(target=lambda: peer.update(consume(
                srv.trainer_endpoint, 2, ranks=[1])), daemon=True)
            thread.start()
            got = [step.step for step in rest]
            thread.join(60)
        finally:
            source.close()
            client.close()
    assert got == [s for s, _ in peer[1]][1:] == list(range(1, NUM_SAMPLES // 8 + 1))


def test_a_reader_leaving_with_no_shard_says_no_shards_field(tmp_path, caplog):
    shard_list = [_text_shard(tmp_path / "s0.tar", "s0-", 16)]
    config = make_config(shard_list, world_size=1, global_batch=8, max_epochs=1)
    with caplog.at_level(logging.INFO, logger="mmdispatch"):
        with dispatcher(config) as srv:
            with readers(srv.reader_endpoint, 1):
                consume(srv.trainer_endpoint, 1)
            deadline = time.monotonic() + 10
            while "event=reader_left" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
    left = [r.getMessage() for r in caplog.records if "event=reader_left" in r.getMessage()]
    assert left and not any("shards=None" in m for m in left), left


@pytest.mark.timeout(120)
def test_a_dispatcher_restarted_from_its_journal_inside_mixed_shuffle_blocks_serves_the_same_steps(tmp_path):
    """--shuffle-shards 3: a dispatcher stopped after step 3 (committed) and started again from
    its journal, with trainers resuming at step 4, serves the steps an undisturbed run serves."""
    shard_list = [_text_shard(tmp_path / f"s{i}.tar", f"s{i}-", 50) for i in range(5)]
    flow = FlowConfig(max_buffered_samples=256, num_inflight_shards=3, credit_batch=8)

    def config(journal=None):
        return make_config(shard_list, world_size=2, global_batch=10, max_epochs=1,
                           shuffle_buffer=30, shuffle_shards=3, flow=flow, journal_dir=journal)

    with dispatcher(config()) as srv, readers(srv.reader_endpoint, 2):
        whole = consume(srv.trainer_endpoint, 2)
    journal = str(tmp_path / "journal")
    with dispatcher(config(journal)) as srv, readers(srv.reader_endpoint, 1):
        head = consume(srv.trainer_endpoint, 2, max_steps=4, commit_at=3)
    states = {r: {"next_step": 4, "rank": r, "world_size": 2} for r in range(2)}
    with dispatcher(config(journal)) as srv, readers(srv.reader_endpoint, 3):
        tail = consume(srv.trainer_endpoint, 2, states=states)
    for r in range(2):
        assert head[r] + tail[r] == whole[r]
    keys = flat_keys(whole)
    assert sorted(keys) == sorted(f"s{i}-{j:05d}" for i in range(5) for j in range(50))


@pytest.mark.timeout(60)
def test_a_shard_taken_back_is_resumed_at_the_byte_offset_its_reader_reached(tmp_path, monkeypatch):
    """A blend of three sources with one reader: shards are taken back and given again at the
    sample next due. Readers say where that sample begins (SAMPLES `resume`), the dispatcher
    hands it back with the shard (SHARD_ASSIGN `offset`), and the next walk of the shard starts
    there, at that sample's first header, instead of re-reading the shard from byte 0. Every
    key arrives exactly once."""
    import pipeline.reader as reader
    import pipeline.service as service
    from dispatcher_server.config import Source

    assigned, walks = [], []
    real_iter, real_members = service.iter_shard, reader.tar_members

    def iter_spy(url, config, **kw):
        assigned.append((url, kw["start_index"], kw.get("offset")))
        return real_iter(url, config, **kw)

    def members_spy(stream, *args, **kw):
        walk = {"start": kw.get("start", 0), "first": None}
        walks.append(walk)
        for name, data in real_members(stream, *args, **kw):
            walk["first"] = walk["first"] or name
            yield name, data
    monkeypatch.setattr(service, "iter_shard", iter_spy)
    monkeypatch.setattr(reader, "tar_members", members_spy)
    sources = [Source(name=n, shards=[_text_shard(tmp_path / f"{n}.tar", n, 90)]) for n in "abc"]
    flow = FlowConfig(max_buffered_samples=120, num_inflight_shards=3, credit_batch=8)
    config = make_config([], world_size=2, global_batch=12, max_epochs=1, sources=sources, flow=flow)
    with dispatcher(config) as srv, readers(srv.reader_endpoint, 1):
        got = consume(srv.trainer_endpoint, 2)
    keys = [k for r in got for _, mbs in got[r] for mb in mbs for k in mb]
    assert sorted(keys) == sorted(f"{n}{i:05d}" for n in "abc" for i in range(90))  # once each
    resumed = [(url, start, offset) for url, start, offset in assigned if start > 0]
    assert resumed, "no shard was taken back and given again: the test missed its path"
    assert all(offset is not None for _, _, offset in resumed), resumed
    for url, start, offset in resumed:
        # USTAR, one 512-byte header and one block of data per sample: sample i is at 1024 * i
        assert offset == 1024 * start
        walk = next(w for w in walks if w["start"] == offset)
        name = url.rsplit("/", 1)[1][0]
        # a reader taken back after its last sample, unheard finishing: the archive's end
        assert walk["first"] == (f"{name}{start:05d}.txt" if start < 90 else None)
    # no walk from byte 0 but those of shards given from their first sample
    assert sum(w["start"] == 0 for w in walks) == sum(start == 0 for _, start, _ in assigned)


@pytest.mark.timeout(120)
def test_serve_exits_1_saying_so_when_no_job_resumed_its_untrained_steps(shards, monkeypatch,
                                                                          capsys, request):
    """Probe: after the 5 minutes of waiting_for_resume with no resume, serve ended with
    `event=stopped reason=done` and status 0, and an orchestrator took the job as finished with
    its last step untrained. It now ends with reason=resume_wait_over, the steps, and status 1."""
    import logging
    import signal

    import dispatcher_server.server as server_module
    from mmdispatch.cli import main
    from tests.servicekit import free_port

    monkeypatch.setattr(server_module, "LOST_RANK_GRACE_S", 1.0)
    ports = [free_port(), free_port()]
    trained: list[int] = []

    def peers() -> None:
        endpoint = f"tcp://127.0.0.1:{ports[1]}"
        with readers(f"tcp://127.0.0.1:{ports[0]}", 1):
            c = DispatcherClient(endpoint, 0, 1, 1, config=client_config(connect_timeout_s=30))
            for step in c:
                if step.step == 2:
                    break  # its own step limit, before training step 2
                trained.append(step.step)
            c.close()
            time.sleep(3)  # the readers stay while the dispatcher waits for a resume

    thread = threading.Thread(target=peers, daemon=True)
    thread.start()
    logging.getLogger("mmdispatch").setLevel(logging.INFO)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # serve sets its own
        previous = signal.getsignal(sig)
        request.addfinalizer(lambda sig=sig, previous=previous: signal.signal(sig, previous))
    code = main(["serve", "--shards", *shards[:1], "--world-size", "1", "--global-batch", "5",
                 "--shuffle-buffer", "0", "--exit-when-done", "--heartbeat", "0.2",
                 "--timeout", "1.5", "--reader-bind", f"tcp://127.0.0.1:{ports[0]}",
                 "--trainer-bind", f"tcp://127.0.0.1:{ports[1]}"])
    thread.join(30)
    err = capsys.readouterr().err
    assert trained == [0, 1]
    assert code == 1, err
    assert "event=waiting_for_resume steps=0-2" in err, err
    assert "event=stopped reason=resume_wait_over untrained_steps=0-2" in err, err
