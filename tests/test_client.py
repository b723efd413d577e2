"""Trainer client: zero-copy decoding, torchrun defaults, DataLoader adapter, reconnects."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from dispatcher_server import protocol as P
from dispatcher_server.batching import Sample, build_batch, rank_message
from dispatcher_server.planner import PlannerConfig, Topology, plan_step
from dispatcher_server.server import Dispatcher
from tests.servicekit import free_port
from tests.test_service import (
    all_keys, client_config, consume, dispatcher, make_config, readers, shards,  # noqa: F401
)
from trainer_client.client import (
    ClientConfig, DispatcherClient, DispatcherDataset, DispatcherError, Step, decode_step,
)


def _tokens(i: int, n: int) -> bytes:
    """Sample i's text as the wire carries it: ids 1000*i + j, then a mask of 1 on odd j."""
    from pipeline.tokenize import TextTokens

    return TextTokens(np.arange(n, dtype=np.int32) + 1000 * i,
                      (np.arange(n) % 2).astype(np.uint8)).to_wire()


def _samples(n: int = 10) -> list[Sample]:
    rng = np.random.default_rng(1)
    out = []
    for i in range(n):
        items, payloads = [], []
        for j in range(int(rng.integers(0, 3))):
            modality = "image" if j % 2 == 0 else "audio"
            enc = int(rng.integers(16, 200))
            items.append(P.ItemHeader(modality, f"{j}.bin", enc, enc // 4, {"j": j}))
            payloads.append(memoryview(bytes([i, j]) * 50))
        text_len = int(rng.integers(1, 40))
        llm = text_len + sum(it.llm_len for it in items)
        out.append(Sample(key=f"s{i}", pos=0, index=i, text_len=text_len, llm_len=llm,
                          tokens=_tokens(i, text_len), items=items, payloads=payloads,
                          nbytes=sum(p.nbytes for p in payloads)))
    return out


def test_each_sample_names_its_source_by_the_names_the_dispatcher_gave():
    """A sample's source is its shard position modulo the number of sources; the STEP carries
    its index and the client names it by WELCOME's list, refusing an index past that list."""
    samples = [s._replace(pos=i % 3) for i, s in enumerate(_samples())]
    plan = plan_step(build_batch(samples).inputs, Topology(world_size=2, ranks_per_node=1),
                     PlannerConfig(num_microbatches=2))
    for rank in range(2):
        msg = P.decode(rank_message(build_batch(samples, 3), plan, step=0, epoch=0, rank=rank,
                                    seq=1))
        for mb in decode_step(msg, sources=["a", "b", "c"]).microbatches:
            assert mb.sources == ["abc"[samples[i].pos] for i in mb.plan.samples.tolist()]
        with pytest.raises(P.ProtocolError, match="source index 2 is not among the 2 sources"):
            decode_step(msg, sources=["a", "b"])
        one = P.decode(rank_message(build_batch(samples), plan, step=0, epoch=0, rank=rank,
                                    seq=1))
        assert {s for mb in decode_step(one).microbatches for s in mb.sources} == {"default"}


def test_decoded_step_is_views_over_the_received_frames():
    samples = _samples()
    batch = build_batch(samples)
    plan = plan_step(batch.inputs, Topology(world_size=2, ranks_per_node=1),
                     PlannerConfig(num_microbatches=2))
    seen_keys = []
    for rank in range(2):
        frames = [bytearray(memoryview(f)) for f in rank_message(batch, plan, step=3, epoch=0,
                                                                 rank=rank, seq=1)]
        msg = P.decode(frames)
        step = decode_step(msg)
        assert (step.step, step.rank, len(step.microbatches)) == (3, rank, 2)
        (data,) = frames[1:]  # v12: one data frame, every micro-batch's arrays, then payloads
        at = 0
        for m, mb in enumerate(step.microbatches):
            ref = plan.rank_microbatch(rank, m)
            np.testing.assert_array_equal(mb.plan.samples, ref.samples)
            assert mb.keys == [samples[i].key for i in ref.samples]
            # Token ids and masks arrive verbatim, one int32 / bool tensor per sample.
            assert [t.dtype for t in mb.text_ids] == [torch.int32] * len(ref.samples)
            assert [t.tolist() for t in mb.text_ids] == [
                [1000 * int(i) + j for j in range(samples[i].text_len)] for i in ref.samples]
            assert [t.tolist() for t in mb.loss_mask] == [
                [j % 2 == 1 for j in range(samples[i].text_len)] for i in ref.samples]
            assert mb.cu_seqlens.tolist() == ref.cu_seqlens.tolist()
            if mb.text_len.numel():
                # The tensor aliases the received frame: writing the frame shows in the tensor.
                before = int(mb.tensors["samples"][0])
                view = np.frombuffer(data, dtype=np.int64, count=1, offset=at)
                view[0] = 12345
                assert int(mb.tensors["samples"][0]) == 12345
                view[0] = before
            at += 8 * sum(msg["microbatches"][m]["arrays"])
            for e in mb.encoders.values():
                for p, item_id, key in zip(e.payloads, e.item_ids.tolist(), e.sample_keys):
                    si, ii = batch.item_refs[e.phase][item_id]
                    assert samples[si].key == key and bytes(p) == bytes(samples[si].payloads[ii])
            if any(p.nbytes for e in mb.encoders.values() for p in e.payloads):
                # Payloads are slices of the received frame, not copies.
                first = next(p for e in mb.encoders.values() for p in e.payloads if p.nbytes)
                old = first[0]
                where = (np.frombuffer(first, np.uint8).ctypes.data
                         - np.frombuffer(data, np.uint8).ctypes.data)
                assert 0 <= where < len(data)
                data[where] ^= 0xFF
                assert first[0] == old ^ 0xFF
            seen_keys += mb.keys
    assert sorted(seen_keys) == sorted(s.key for s in samples)


def test_a_step_past_the_frame_limit_splits_its_data_where_items_end(monkeypatch):
    import dispatcher_server.batching as batching

    samples = _samples()
    batch = build_batch(samples)
    plan = plan_step(batch.inputs, Topology(world_size=2, ranks_per_node=1),
                     PlannerConfig(num_microbatches=2))
    whole = [rank_message(batch, plan, step=0, epoch=0, rank=r, seq=1) for r in range(2)]
    monkeypatch.setattr(batching, "FRAME_LIMIT", 250)  # a 100-byte item, 2 a frame at most
    split = [rank_message(batch, plan, step=0, epoch=0, rank=r, seq=1) for r in range(2)]
    for a, b in zip(whole, split):
        assert len(a) == 2 and len(b) > 3
        assert all(memoryview(f).nbytes <= 250 for f in b[2:])
        got_a, got_b = decode_step(P.decode(a)), decode_step(P.decode(b))
        for ma, mb in zip(got_a.microbatches, got_b.microbatches):
            assert mb.keys == ma.keys and mb.plan.samples.tolist() == ma.plan.samples.tolist()
            assert {p: [bytes(x) for x in e.payloads] for p, e in mb.encoders.items()} == {
                p: [bytes(x) for x in e.payloads] for p, e in ma.encoders.items()}


def test_torchrun_environment_gives_the_defaults(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    c = DispatcherClient("tcp://127.0.0.1:1")
    assert (c.rank, c.world_size, c.local_world_size) == (2, 4, 2)
    assert c.state_dict() == {"next_step": None, "rank": 2, "world_size": 4, "dataset": None}
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK='x'"):
        DispatcherClient("tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="rank=5"):
        DispatcherClient("tcp://127.0.0.1:1", rank=5, world_size=4)


@pytest.mark.parametrize("args,message", [
    ((0, 0), r"world_size=0 must be >= 1"),
    ((-1, 2), r"rank=-1 must be in \[0, world_size=2\)"),
    ((2, 2), r"rank=2 must be in \[0, world_size=2\)"),
    ((0, 2, 0), r"local_world_size=0 must divide world_size=2"),
    ((0, 4, 3), r"local_world_size=3 must divide world_size=4"),
    (("0", 2), r"rank='0' must be an int"),
    ((True, 2), r"rank=True must be an int"),
    ((0, 2.0), r"world_size=2.0 must be an int"),
    ((torch.tensor(False), 2), r"rank=tensor\(False\) must be an int"),
    ((np.int64(2), np.int64(2)), r"rank=2 must be in \[0, world_size=2\)"),
])
def test_an_impossible_topology_is_one_line_naming_the_value(args, message):
    with pytest.raises(ValueError, match=message):
        DispatcherClient("tcp://127.0.0.1:1", *args)


def test_the_topology_takes_integers_as_commit_does():
    """DispatcherClient(address, np.int64(0), ...) was refused ('must be an int') while commit()
    took numpy and tensor integers: a rank read from a numpy array or a torch tensor is one."""
    c = DispatcherClient("tcp://127.0.0.1:1", np.int64(1), torch.tensor(4), np.int32(2))
    assert (c.rank, c.world_size, c.local_world_size) == (1, 4, 2)
    assert all(type(v) is int for v in (c.rank, c.world_size, c.local_world_size))  # msgpack


@pytest.mark.parametrize("setting,message", [
    # zmq polls forever at -1: the client thread missed its connect timeout and the loop waited
    # out step_timeout_s (600 s) before hearing anything
    ({"poll_ms": -1}, r"poll_ms=-1 must be an int >= 1"),
    ({"poll_ms": 0}, r"poll_ms=0 must be an int >= 1"),
    ({"heartbeat_s": float("nan")}, r"heartbeat_s=nan must be a finite number > 0"),
    ({"step_timeout_s": 0}, r"step_timeout_s=0 must be > 0 seconds"),
    ({"fetch_attempts": 0}, r"fetch_attempts >= 1"),
    ({"backoff_min_s": 2.0, "backoff_max_s": 1.0}, r"backoff_min_s \(2.0\) <= backoff_max_s \(1.0\)"),
    ({"prefetch": 0}, r"prefetch must be 1 to 4096, got 0"),
    ({"prefetch": 4097}, r"prefetch must be 1 to 4096, got 4097"),  # the dispatcher refuses it
    # glibc takes the threshold as a C int of bytes: past it, it wraps around
    ({"malloc_keep_mb": 1024}, r"malloc_keep_mb must be from 0 to 1023 .*0 = off\), got 1024"),
    ({"malloc_keep_mb": -1}, r"malloc_keep_mb must be from 0 to 1023 .*got -1"),
])
def test_a_client_setting_that_would_hang_or_spin_is_refused_at_once(setting, message):
    with pytest.raises(ValueError, match=message):
        ClientConfig(**setting)


class _FakeLibc:
    """glibc's mallopt, recorded: (parameter, value) per call."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 1


def test_the_heap_setting_reaches_glibc_once_per_trainer_process(monkeypatch, caplog):
    """A trainer's RSS crept over a long run (glibc keeping freed tensor memory) and it had no
    `--malloc-keep-mb` as serve and read have: the client's setting now reaches mallopt when the
    first client starts, and a later client's other value is ignored with a warning."""
    import dispatcher_server.tuning
    import trainer_client.client as client_module

    libc = _FakeLibc()
    monkeypatch.setattr(dispatcher_server.tuning, "_libc", lambda: libc)
    monkeypatch.setattr(client_module, "_heap_setting", None)  # as in a fresh process
    c = DispatcherClient("tcp://127.0.0.1:1", 0, 1, 1, config=ClientConfig(malloc_keep_mb=8))
    assert libc.calls == []  # a client that is not started leaves the process alone
    try:
        c.start()
        assert libc.calls == [(-3, 8 << 20), (-1, 16 << 20)]  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
        other = DispatcherClient("tcp://127.0.0.1:1", 0, 1, 1, config=ClientConfig(malloc_keep_mb=2))
        other.start()
        other.close()
    finally:
        c.close()
    assert libc.calls == [(-3, 8 << 20), (-1, 16 << 20)]
    assert "event=malloc_keep_ignored malloc_keep_mb=2 applied=8" in caplog.text


def test_a_heap_setting_without_glibc_is_said_to_do_nothing(monkeypatch, caplog):
    import dispatcher_server.tuning
    import trainer_client.client as client_module

    monkeypatch.setattr(dispatcher_server.tuning, "_libc", lambda: None)  # musl, macOS
    monkeypatch.setattr(client_module, "_heap_setting", None)
    DispatcherClient("tcp://127.0.0.1:1", 0, 1, 1, config=ClientConfig(malloc_keep_mb=4)).start().close()
    assert "event=malloc_keep_ignored malloc_keep_mb=4" in caplog.text


def test_a_client_left_at_the_default_heap_setting_calls_no_mallopt(monkeypatch):
    import dispatcher_server.tuning
    import trainer_client.client as client_module

    libc = _FakeLibc()
    monkeypatch.setattr(dispatcher_server.tuning, "_libc", lambda: libc)
    monkeypatch.setattr(client_module, "_heap_setting", None)
    c = DispatcherClient("tcp://127.0.0.1:1", 0, 1, 1).start()
    c.close()
    assert libc.calls == []


def test_the_trainer_hands_its_malloc_keep_mb_to_its_client():
    from trainer_client.train import build_parser, client_config

    parse = build_parser().parse_args
    assert client_config(parse(["--dispatcher", "tcp://d:5556"])).malloc_keep_mb == 0
    assert client_config(parse(["--dispatcher", "tcp://d:5556", "--malloc-keep-mb", "4"])).malloc_keep_mb == 4


def test_load_state_dict_refuses_what_state_dict_did_not_return():
    c = DispatcherClient("tcp://127.0.0.1:1", 0, 1, 1)
    for garbage, message in ((None, "got NoneType"), ([], "got list"),
                             ({"weight": 1, "bias": 2}, "got keys bias, weight: not a Dispatcher"),
                             ({"next_step": True}, "next_step must be a non-negative int")):
        with pytest.raises(ValueError, match=message):
            c.load_state_dict(garbage)
        assert c.state_dict()["next_step"] is None  # nothing half-applied
    c.load_state_dict({})  # no checkpoint yet: start where the dispatcher is
    c.load_state_dict({"next_step": 7, "rank": 3, "world_size": 8, "dataset": None})
    assert c.state_dict()["next_step"] == 7


def test_load_state_dict_takes_a_step_number_as_commit_does():
    """A next_step that went through numpy or torch (np.int64, a 0-d tensor) was refused,
    while commit() took the same value."""
    c = DispatcherClient("tcp://127.0.0.1:1", 0, 1, 1)
    for number in (np.int64(5), torch.tensor(6)):
        c.load_state_dict({"next_step": number})
        assert c.state_dict()["next_step"] == int(number)
        assert type(c.state_dict()["next_step"]) is int  # msgpack packs only int
    for bad in (3.0, torch.tensor(0.5), np.int64(-1)):
        with pytest.raises(ValueError, match="next_step must be a non-negative int"):
            c.load_state_dict({"next_step": bad})


def test_commit_refuses_what_is_not_a_step_number_at_once():
    """A float or string waited out the whole commit timeout (the dispatcher's 'malformed' went
    to a log), and a tensor killed the client thread, which could not send it."""
    c = DispatcherClient("tcp://127.0.0.1:1", 0, 1, 1)
    try:
        for bad in (3.0, "3", True, -1, torch.tensor(0.5), torch.tensor([1, 2])):
            with pytest.raises(ValueError, match=r"commit\(step\) takes a step number >= 0"):
                c.commit(bad, timeout=0.5)
        assert c._thread is None  # refused before the client started
        c.load_state_dict({"next_step": 4})
        with pytest.raises(TimeoutError, match=r"commit\(3\) not acknowledged"):
            c.commit(torch.tensor(3), timeout=0.5)  # an integer tensor is a step number
    finally:
        c.close()


def test_a_commit_waits_for_the_dispatcher_as_long_as_a_step_does():
    """commit() gave up after 30 s while steps wait 600: a dispatcher restarting from its
    journal ended the job at a checkpoint, though it survived between two. It now waits as
    long as a step (step_timeout_s), and its timeout says how to wait longer."""
    c = DispatcherClient("tcp://127.0.0.1:1", 0, 1, 1, config=ClientConfig(step_timeout_s=0.5))
    try:
        c.load_state_dict({"next_step": 4})
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"commit\(3\) not acknowledged .* within 0.5 s: no "
                                               r"dispatcher answered .*commit\(step, timeout=\.\.\.\)"):
            c.commit(3)
        assert time.monotonic() - started < 10
    finally:
        c.close()


def test_commit_refuses_a_step_this_client_did_not_hand_out():
    """Journaled, a commit ahead of the steps taken resumed every rank after steps never
    trained; one past 2**64 killed the client thread inside msgpack."""
    c = DispatcherClient("tcp://127.0.0.1:1", 0, 1, 1)
    try:
        with pytest.raises(ValueError, match=r"commit\(0\): this client has handed out no step yet"):
            c.commit(0, timeout=0.5)
        c.load_state_dict({"next_step": 4})
        for ahead in (4, 2**64):
            with pytest.raises(ValueError, match=rf"commit\({ahead}\): this client has handed "
                                                 r"out steps up to 3"):
                c.commit(ahead, timeout=0.5)
        assert c._thread is None
    finally:
        c.close()


def test_behind_a_consumer_commit_takes_only_steps_its_loop_was_handed():
    """Behind a PrefetchPool (the README's loop) the client hands steps to the pool ahead of the
    loop: a commit of a step the pool held but the loop never got was accepted and journaled,
    the BYE counted it trained, and the restart skipped it untrained (probe)."""
    c = DispatcherClient("tcp://127.0.0.1:1", 0, 1, 1)
    try:
        c.load_state_dict({"next_step": 4})  # the client has handed steps 0..3 to its consumer
        position, holding = [None], [False]
        c.taken_ahead(3, lambda: position[0], lambda: holding[0])
        with pytest.raises(ValueError, match=r"commit\(0\): this client's consumer has handed "
                                             r"its loop no step yet"):
            c.commit(0, timeout=0.5)
        position[0], holding[0] = 2, True  # the loop took steps 0 and 1, and holds step 1
        for ahead in (2, 3):
            with pytest.raises(ValueError, match=rf"commit\({ahead}\): this client's consumer "
                                                 r"has handed its loop steps up to 1"):
                c.commit(ahead, timeout=0.5)
        assert c._thread is None
        c.report_timings(3, [{"llm": [0.1, [3]], "exchange": 0.0}])  # held ahead: not trained
        assert c._trained is None
        c.report_timings(1, [{"llm": [0.1, [3]], "exchange": 0.0}])
        assert c._trained == 1
        with pytest.raises(TimeoutError):  # the held step itself is the loop's to commit
            c.commit(1, timeout=0.5)
    finally:
        c.close()


@pytest.mark.timeout(30)
def test_commit_on_a_closed_or_failed_client_says_so_instead_of_waiting(shards):
    c = DispatcherClient("tcp://127.0.0.1:1", 0, 1, 1)
    c.load_state_dict({"next_step": 4})
    c.start()
    c.close()
    with pytest.raises(RuntimeError, match=r"commit\(3\) on a closed DispatcherClient"):
        c.commit(3, timeout=20)
    with dispatcher(make_config(shards, world_size=2)) as srv:
        c = DispatcherClient(srv.trainer_endpoint, 0, 3, 3, config=client_config())
        c.load_state_dict({"next_step": 4})
        try:
            with pytest.raises(DispatcherError, match="world_size"):
                c.commit(3, timeout=20)  # refused while it waited: the refusal, at once
            with pytest.raises(DispatcherError, match="world_size"):
                c.commit(3, timeout=20)
        finally:
            c.close()


def test_report_timings_refuses_a_record_the_dispatcher_would_refuse():
    """The dispatcher drops malformed timings (keeping the credit they ride on): the caller
    hears why at once, and an unpackable value, which killed the client thread, never leaves."""
    c = DispatcherClient("tcp://127.0.0.1:1", 0, 1, 1)
    for bad in ("garbage", [{"vision": "x"}], [{"llm": [0.1, [np.int64(3)]]}], None):
        with pytest.raises(ValueError, match=r"report_timings\(4\): .*\{phase: \[seconds"):
            c.report_timings(4, bad)
    assert c._commands.empty()
    c.report_timings(np.int64(4), [{"llm": [0.1, [3]], "exchange": 0.0}])
    assert c._commands.get_nowait() == ("timings", {"step": 4, "mb": [{"llm": [0.1, [3]],
                                                                        "exchange": 0.0}]})


def test_dataloader_adapter_yields_steps(shards):
    with dispatcher(make_config(shards, world_size=1, max_steps=4)) as srv, \
            readers(srv.reader_endpoint, 1):
        ds = DispatcherDataset(srv.trainer_endpoint, rank=0, world_size=1, local_world_size=1,
                               config=client_config())
        try:
            loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0)
            steps = [(s.step, len(s.microbatches)) for s in loader]
        finally:
            ds.client.close()
    assert steps == [(0, 2), (1, 2), (2, 2), (3, 2)]


def test_the_dataloader_path_states_the_tokenizer_the_model_s_ids_are_of(shards, tmp_path):
    """`DispatcherDataset(preprocess=...)` stated the image, audio and video rules but never the
    tokenizer: readers started without --tokenizer handed a BPE model UTF-8 byte values as
    ids, silently, where the README's `DispatcherClient(inputs=rules)` was refused (probe)."""
    from trainer_client.prefetch import PrefetchConfig

    with pytest.raises(ValueError, match=r"DispatcherDataset\(preprocess=\.\.\.\) needs tokenizer=: "
                                         r"the tokenizer file"):
        DispatcherDataset("tcp://127.0.0.1:1", preprocess=PrefetchConfig(), rank=0,
                          world_size=1, local_world_size=1)
    with pytest.raises(ValueError, match="give tokenizer= or inputs=, not both"):
        DispatcherDataset("tcp://127.0.0.1:1", tokenizer=None, inputs={}, rank=0, world_size=1,
                          local_world_size=1)
    bpe = tmp_path / "tokenizer.json"
    bpe.write_text('{"model": {"type": "BPE"}}')
    with dispatcher(make_config(shards, world_size=1, max_steps=2)) as srv, \
            readers(srv.reader_endpoint, 1):  # byte-level readers: no --tokenizer
        ds = DispatcherDataset(srv.trainer_endpoint, preprocess=PrefetchConfig(), tokenizer=str(bpe),
                               rank=0, world_size=1, local_world_size=1, config=client_config())
        try:
            with pytest.raises(DispatcherError, match=r"inputs.*tokenizer: rank 0 'sha256:"):
                next(iter(ds))
        finally:
            ds.close()
        ds = DispatcherDataset(srv.trainer_endpoint, preprocess=PrefetchConfig(), tokenizer=None,
                               rank=0, world_size=1, local_world_size=1, config=client_config())
        try:
            assert next(iter(ds)).step == 0
        finally:
            ds.close()


def test_a_dataloader_iterating_a_rewound_dataset_goes_on_from_the_state(shards):
    """A loss-spike rollback: `ds.load_state_dict(saved)` closed the pool the DataLoader's
    iterator was, and that loop died with "next() on a closed PrefetchPool: create a new one
    over its source", a pool its user never made (probe). The same iterator now goes on from
    the saved step, with the same samples."""
    from trainer_client.prefetch import PrefetchConfig

    with dispatcher(make_config(shards, world_size=1, max_steps=8)) as srv, \
            readers(srv.reader_endpoint, 1):
        ds = DispatcherDataset(srv.trainer_endpoint, preprocess=PrefetchConfig(), tokenizer=None,
                               rank=0, world_size=1, local_world_size=1, config=client_config())
        try:
            it = iter(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0))
            keys = {}
            for _ in range(2):
                step = next(it)
                keys[step.step] = [mb.keys for mb in step.microbatches]
            saved = ds.state_dict()
            for _ in range(2):
                step = next(it)
                keys[step.step] = [mb.keys for mb in step.microbatches]
            assert sorted(keys) == [0, 1, 2, 3] and saved["next_step"] == 2
            ds.load_state_dict(saved)
            again = [next(it) for _ in range(2)]
            assert [s.step for s in again] == [2, 3]
            assert [[mb.keys for mb in s.microbatches] for s in again] == [keys[2], keys[3]]
        finally:
            ds.close()


def test_dataloader_default_batch_size_hands_each_step_over_whole(shards):
    """DataLoader's default batch_size=1 collates a list of one step: the step comes out as it
    came, none lost; a batch of several steps is refused naming batch_size=None."""
    with dispatcher(make_config(shards, world_size=1, max_steps=3)) as srv, \
            readers(srv.reader_endpoint, 1):
        ds = DispatcherDataset(srv.trainer_endpoint, rank=0, world_size=1, local_world_size=1,
                               config=client_config())
        try:
            steps = [s for s in torch.utils.data.DataLoader(ds, num_workers=0)]
        finally:
            ds.client.close()
    assert [(type(s), s.step, len(s.microbatches)) for s in steps] == [(Step, i, 2) for i in range(3)]
    with pytest.raises(TypeError, match=r"DataLoader\(batch_size=2\) cannot merge 2 .*"
                                        r"DataLoader\(ds, batch_size=None\)"):
        torch.utils.data.default_collate(steps[:2])


def test_client_survives_a_dispatcher_restart_on_the_same_address(shards, tmp_path):
    ports = free_port(), free_port()
    cfg = make_config(shards, world_size=1, journal_dir=str(tmp_path),
                      reader_bind=f"tcp://127.0.0.1:{ports[0]}",
                      trainer_bind=f"tcp://127.0.0.1:{ports[1]}")
    with dispatcher(make_config(shards, world_size=1)) as srv, readers(srv.reader_endpoint, 1):
        reference = consume(srv.trainer_endpoint, 1)[0]
    got = []
    with readers(f"tcp://127.0.0.1:{ports[0]}", 1):
        srv = Dispatcher(cfg).start()
        client = DispatcherClient(f"tcp://127.0.0.1:{ports[1]}", 0, 1, 1, config=client_config())
        try:
            got += [(s.step, [mb.keys for mb in s.microbatches]) for _, s in zip(range(3), client)]
            srv.stop()  # the client keeps its socket; the new dispatcher does not know it
            srv = Dispatcher(cfg).start()
            got += [(s.step, [mb.keys for mb in s.microbatches]) for s in client]
        finally:
            client.close()
            srv.stop()
    assert got == reference
    assert sorted(k for _, mbs in got for keys in mbs for k in keys) == sorted(all_keys(shards))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("reason", ["halted", "max_epochs"])
def test_a_halted_dispatcher_fails_the_trainer_loop_instead_of_ending_it(reason):
    # A dispatcher that stops on an error (a step it cannot plan, a journal write that failed)
    # sends END with reason "halted": a training loop that took that for the end of the data
    # would exit as if the job were complete, with the rest of the epoch never trained.
    from tests.servicekit import ScriptedRouter
    from trainer_client.client import ClientConfig, DispatcherError

    with ScriptedRouter() as router:
        client = DispatcherClient(router.endpoint, rank=0, world_size=1, local_world_size=1,
                                  config=ClientConfig(heartbeat_s=0.2, timeout_s=5.0,
                                                      step_timeout_s=10.0))
        try:
            it = iter(client.start())
            hello = router.expect(P.HELLO)
            router.welcome(hello, heartbeat_s=0.2, world_size=1, next_step=0, num_microbatches=1)
            why = {"message": "step 0: sample 'giant' fits no capacity"} if reason == "halted" else {}
            router.send(P.END, next_step=0, reason=reason, **why)
            if reason == "halted":  # the trainer's error says why, not only that it halted
                with pytest.raises(DispatcherError, match="halted.*sample 'giant' fits no capacity"):
                    next(it)
            else:
                with pytest.raises(StopIteration):
                    next(it)
        finally:
            client.close()


def test_a_halt_whose_reason_says_how_to_restart_is_not_followed_by_the_same_advice():
    from trainer_client.client import halted_error
    why = ("journal write failed at step 36 ([Errno 28] No space left on device); stopping. Free "
           "the space (or fix the journal directory) and start the dispatcher again: it resumes "
           "from the journal")
    text = str(halted_error(36, why))
    assert text.count("start the dispatcher") == 1 and "resume the trainers from the last commit" in text
    other = str(halted_error(0, "step 0: sample 'giant' fits no capacity"))
    assert "Fix it and restart the dispatcher, then resume from the last commit" in other


@pytest.mark.timeout(60)
def test_a_commit_the_dispatcher_halted_before_answering_fails_with_the_reason():
    """A dispatcher whose journal write failed (disk full) sends END with the reason and exits
    once every rank was told; a rank waiting on commit() then waited out the whole timeout and
    was told 'no dispatcher answered'. The commit fails at once with the reason, and so does
    a later one."""
    import threading

    from tests.servicekit import ScriptedRouter

    why = "journal write failed at step 25 ([Errno 28] No space left on device)"
    with ScriptedRouter() as router:
        client = DispatcherClient(router.endpoint, rank=0, world_size=1, local_world_size=1,
                                  config=ClientConfig(heartbeat_s=0.2, timeout_s=5.0,
                                                      step_timeout_s=30.0))
        try:
            client.load_state_dict({"next_step": 25})
            client.start()
            hello = router.expect(P.HELLO)
            router.welcome(hello, heartbeat_s=0.2, world_size=1, next_step=25, num_microbatches=1)
            raised: list[BaseException] = []

            def commit() -> None:
                try:
                    client.commit(24)
                except BaseException as e:  # noqa: BLE001 - checked below
                    raised.append(e)

            waiter = threading.Thread(target=commit)
            started = time.monotonic()
            waiter.start()
            msg = router.recv()
            while msg is not None and msg.type != P.COMMIT:  # credits may go first
                msg = router.recv()
            assert msg is not None, "no COMMIT"
            router.send(P.END, next_step=25, reason="halted", message=why)
            waiter.join(20)
            assert not waiter.is_alive() and time.monotonic() - started < 10
            (error,) = raised
            assert isinstance(error, DispatcherError) and "No space left on device" in str(error)
            with pytest.raises(DispatcherError, match="No space left on device"):
                client.commit(24, timeout=5)
        finally:
            client.close()


def test_an_address_without_a_transport_is_refused_naming_the_form():
    """'127.0.0.1:5555' got ZeroMQ's 'Invalid argument' from the client thread."""
    with pytest.raises(ValueError, match=r"address '127.0.0.1:5555': an endpoint looks like tcp://HOST:PORT"):
        DispatcherClient("127.0.0.1:5555", 0, 1, 1)


@pytest.mark.timeout(30)
def test_a_closed_or_stopped_client_says_so_instead_of_an_old_error(shards):
    """After a fatal error, load_state_dict was taken without a word (its thread was gone, so
    nothing moved) and next() raised that old error again; after close(), next() and commit()
    raised the last error the client held instead of saying it was closed."""
    with dispatcher(make_config(shards, world_size=2)) as srv:
        c = DispatcherClient(srv.trainer_endpoint, 0, 3, 3, config=client_config())
        try:
            with pytest.raises(DispatcherError, match="world_size"):
                next(c)
            with pytest.raises(RuntimeError, match=r"load_state_dict on a DispatcherClient that "
                                                   r"stopped \(.*world_size.*\): create a new"):
                c.load_state_dict({"next_step": 0})
        finally:
            c.close()
        # report_timings queued the record for the thread that is gone, without a word
        for call in (lambda: next(c), lambda: c.load_state_dict({}), lambda: c.commit(0),
                     lambda: c.report_timings(0, [{"llm": [0.1, [3]], "exchange": 0.0}])):
            with pytest.raises(RuntimeError, match="on a closed DispatcherClient: create a new one"):
                call()


@pytest.mark.timeout(60)
def test_a_loop_waiting_for_a_step_says_so_in_the_trainer_s_log(shards, monkeypatch, caplog):
    """Trainers started without a reader waited silently until step_timeout_s (600 s); only
    the dispatcher's log, elsewhere, said why. The client says it waits, and where to look."""
    import trainer_client.client as client_module

    monkeypatch.setattr(client_module, "WAIT_SAY_S", 0.5)
    monkeypatch.setattr(client_module, "WAIT_SAY_EVERY_S", 1.0)
    caplog.set_level("WARNING", logger="mmdispatch.client")
    with dispatcher(make_config(shards, world_size=1)) as srv:  # no reader
        c = DispatcherClient(srv.trainer_endpoint, 0, 1, 1,
                             config=ClientConfig(heartbeat_s=0.2, timeout_s=1.5, step_timeout_s=2.8))
        try:
            with pytest.raises(TimeoutError):
                next(iter(c))
        finally:
            c.close()
    said = [r.getMessage() for r in caplog.records if "event=waiting_for_step" in r.getMessage()]
    assert 2 <= len(said) <= 3, said  # at 0.5 s, then every 1 s until the timeout
    assert f"rank=0 step=0 dispatcher={srv.trainer_endpoint}" in said[0]
    assert "event=no_readers (start mmdispatch read)" in said[0]
    # Behind a PrefetchPool holding steps its loop has not taken, the loop is not waiting.
    caplog.clear()
    c.taken_ahead(2, position=lambda: 0, holding=lambda: False)
    c._consumed = 2
    c._say_waiting(40.0)
    assert not [r for r in caplog.records if "waiting_for_step" in r.getMessage()]
    c._consumed = 0
    c._say_waiting(40.0)
    assert [r for r in caplog.records if "waiting_for_step" in r.getMessage()]


@pytest.mark.timeout(90)
def test_a_client_whose_rank_another_claimed_hands_out_none_of_the_steps_it_took_ahead(shards, caplog):
    """Probe: a trainer of another job pointed here took over a live rank; the old connection,
    told `replaced`, still handed its loop the two steps it had prefetched, which the new claim
    got again: those steps were trained twice."""
    from trainer_client.prefetch import PrefetchConfig, PrefetchPool

    with dispatcher(make_config(shards, world_size=1, max_steps=12)) as srv, \
            readers(srv.reader_endpoint, 1):
        first = DispatcherClient(srv.trainer_endpoint, 0, 1, 1, config=client_config(prefetch=4))
        pool = PrefetchPool(first, PrefetchConfig(workers=1, ahead=4))
        second = None
        try:
            assert next(pool).step == 0
            deadline = time.monotonic() + 30
            while first._steps.qsize() + pool._ready.qsize() < 2 and time.monotonic() < deadline:
                time.sleep(0.05)  # steps taken ahead, by the client and by the pool
            assert first._steps.qsize() + pool._ready.qsize() >= 2
            second = DispatcherClient(srv.trainer_endpoint, 0, 1, 1, config=client_config())
            with caplog.at_level("WARNING", logger="mmdispatch"):
                second.start()
                while first.superseded() is None and time.monotonic() < deadline:
                    time.sleep(0.05)
                while "rank_taken_over" not in caplog.text and time.monotonic() < deadline:
                    time.sleep(0.05)
            # the new claim is told it took a live rank over: another job's trainer would say so
            assert "event=rank_taken_over" in caplog.text and "held by a live connection" in caplog.text
            with pytest.raises(DispatcherError, match="replaced"):
                next(pool)
            with pytest.raises(DispatcherError, match="replaced"):
                next(first)
            assert next(second).step == 0  # a fresh claim starts after the last commit (none)
        finally:
            pool.close()
            first.close()
            if second is not None:
                second.close()


@pytest.mark.timeout(120)
def test_a_commit_of_a_step_handed_out_before_another_rank_rewound_is_answered(shards, tmp_path):
    """Probe: ranks restarted from one checkpoint, the first ran ahead alone; the second's
    resume rewound the stream, and the first's commit of a step it had been handed, not planned
    again yet, was refused as 'never planned': its trainer died, and the commits of the other
    rank, acknowledged, could later not be resumed from."""
    import threading

    with dispatcher(make_config(shards, world_size=2, journal_dir=str(tmp_path / "j"))) as srv, \
            readers(srv.reader_endpoint, 1):
        first = DispatcherClient(srv.trainer_endpoint, 0, 2, 2, config=client_config(prefetch=6))
        second = None
        try:
            # Both ranks train steps 0..1, commit 1 and leave (BYE), as a job stopping cleanly.
            second = DispatcherClient(srv.trainer_endpoint, 1, 2, 2, config=client_config(prefetch=1))
            for c in (first, second):
                assert [next(c).step for _ in range(2)] == [0, 1]
            first.commit(1, timeout=30)
            first.close()
            second.close()
            # Restarted from that checkpoint, rank 0 comes back first and runs ahead alone.
            first = DispatcherClient(srv.trainer_endpoint, 0, 2, 2, config=client_config(prefetch=4))
            first.load_state_dict({"next_step": 2})
            assert [next(first).step for _ in range(4)] == [2, 3, 4, 5]
            first.commit(3, timeout=30)
            # Rank 1 comes back from the same checkpoint (step 2), before the last commit: the
            # stream is rewound, and planned again only as far as rank 1 takes its steps.
            second = DispatcherClient(srv.trainer_endpoint, 1, 2, 2, config=client_config(prefetch=1))
            second.load_state_dict({"next_step": 2})
            second.start()
            deadline = time.monotonic() + 5  # (the re-plan may pass step 5 unseen: a race)
            while srv.replay.last_step >= 5 and time.monotonic() < deadline:
                time.sleep(0.001)  # the rewind: steps 2.. are planned again from here
            # Sent at once: held until step 5 is planned again, then journaled and answered.
            done: list = []
            committer = threading.Thread(target=lambda: done.append(first.commit(5, timeout=60)))
            committer.start()
            assert [next(second).step for _ in range(4)] == [2, 3, 4, 5]
            committer.join(60)
            assert done == [None] and srv.replay.committed == 5
        finally:
            first.close()
            if second is not None:
                second.close()
