"""Wire protocol: round trips, validation, limits, a fuzzed decoder; order helpers."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatcher_server import protocol as P
from dispatcher_server.tuning import keep_freed_memory
from dispatcher_server.ordering import Cursor, ShardOrder, epoch_order
from dispatcher_server.planner import PlannerConfig, StepInputs, Topology, plan_step
from dispatcher_server.planner.types import EncoderItems
from dispatcher_server.stepwire import pack_step, unpack_microbatch


def _raw(header: dict, *frames) -> list:
    return [msgpack.packb(header, use_bin_type=True), *frames]


def test_round_trip_keeps_fields_and_payloads_without_copies():
    payload = bytearray(b"\x00\x01jpegbytes" * 100)
    tokens = b"\x02" + bytes(range(20)) + b"\xff\x02"  # width 2, 10 ids, then 10 mask bits
    sample = ["k1", 3, 10, 74, tokens, [["image", "jpg", 256, 64, {"width": 32}]]]
    frames = P.encode(P.SAMPLES, seq=7, frames=[payload], assign_id=2, samples=[sample])
    msg = P.decode(frames)
    assert (msg.type, msg.seq, msg["assign_id"]) == (P.SAMPLES, 7, 2)
    # Headers come out as named records with the same values in the same order.
    (got,) = msg["samples"]
    assert isinstance(got, P.SampleHeader) and isinstance(got.items[0], P.ItemHeader)
    assert (got.key, got.index, got.text_len, got.llm_len, got.tokens) == ("k1", 3, 10, 74, tokens)
    width, ids, mask = P.split_tokens(got.tokens, 10)
    assert (width, bytes(ids), bytes(mask)) == (2, tokens[1:21], tokens[21:])
    assert got.items[0] == P.ItemHeader("image", "jpg", 256, 64, {"width": 32})
    assert [list(got[:5]) + [[list(it) for it in got.items]]] == [sample]
    assert bytes(msg.frames[0]) == bytes(payload)
    payload[0] = 0xFF  # the decoded frame is a view over the sender's buffer, not a copy
    assert msg.frames[0][0] == 0xFF


def test_coalesced_samples_slice_one_frame_without_copies():
    members = [b"\x89PNG" * 10, b"", b"RIFFwave" * 7]
    frame = bytearray(b"".join(members))
    samples = [["k1", 0, 3, 13, P.blank_tokens(3), [["image", "png", 40, 10, {}]]],
               ["k2", 1, 2, 2, P.blank_tokens(2, 2), []],
               ["k3", 2, 1, 9, P.blank_tokens(1, 4), [["image", "jpg", 4, 1, {}], ["audio", "wav", 32, 7, {}]]]]
    msg = P.decode(P.encode(P.SAMPLES, frames=[frame], assign_id=1, samples=samples,
                            sizes=[len(m) for m in members]))
    views = P.split_payload(msg.frames[0], msg["sizes"])
    assert [bytes(v) for v in views] == members
    frame[0] = 0  # the slices are views of the received frame
    assert views[0][0] == 0


@pytest.mark.parametrize("sizes,frames", [
    ([3, 4], [b"abcdefgh"]),  # sizes say 7 bytes, the frame holds 8
    ([3], [b"abc"]),  # one size for two items
    ([3, -1], [b"ab"]),  # negative size
    ([3, 4], [b"abcd", b"efg"]),  # frames past one hold whole items: the second spans both
    ([3, 4], [b"abc", b"defg", b""]),  # a frame no item is in
])
def test_coalesced_samples_with_wrong_sizes_are_malformed(sizes, frames):
    samples = [["k", 0, 1, 3, P.blank_tokens(1), [["image", "png", 4, 1, {}], ["image", "png", 4, 1, {}]]]]
    with pytest.raises(P.ProtocolError) as info:
        P.decode(P.encode(P.SAMPLES, frames=frames, assign_id=1, samples=samples, sizes=sizes))
    assert info.value.code == "malformed"


def test_payloads_past_a_frames_limit_travel_in_frames_of_whole_items():
    """A frame over zmq.MAXMSGSIZE makes the receiving socket drop its sender without a word:
    payloads of a message are split into frames within the limit, each item whole in one."""
    members = [b"a" * 5, b"", b"b" * 3, b"c" * 6, b"d" * 2]
    sizes = [len(m) for m in members]
    frames = P.coalesce(members, sizes, limit=8)
    assert [len(f) for f in frames] == [8, 8] and b"".join(frames) == b"".join(members)
    assert P.coalesce(members, sizes, limit=16) == [b"".join(members)]  # the usual case: one
    samples = [["k1", 0, 1, 3, P.blank_tokens(1), [["image", "png", 4, 1, {}], ["image", "png", 4, 1, {}]]],
               ["k2", 1, 1, 3, P.blank_tokens(1), [["image", "png", 4, 1, {}], ["image", "png", 4, 1, {}],
                                                    ["audio", "wav", 4, 1, {}]]]]
    msg = P.decode(P.encode(P.SAMPLES, frames=frames, assign_id=1, samples=samples, sizes=sizes))
    assert [bytes(v) for v in P.split_frames(msg.frames, msg["sizes"])] == members
    reply = P.decode(P.encode(P.PAYLOADS, frames=frames, id=3, sizes=sizes))
    assert [bytes(v) for v in P.item_views(reply.frames, reply["sizes"])] == members


def test_a_step_names_one_source_per_sample():
    mb = {"arrays": [0] * 21, "keys": ["a", "b"], "tokens": [b"", b""], "items": [],
          "payloads": 0, "sizes": [], "sources": np.array([0, 1], P.SOURCE_DTYPE).tobytes()}
    P.decode(P.encode(P.STEP, frames=[b""], step=0, epoch=0, rank=0, world_size=1,
                      microbatches=[mb]))
    for sources in (b"", b"\0\0", [0, 1]):
        with pytest.raises(P.ProtocolError):
            P.decode(P.encode(P.STEP, frames=[b""], step=0, epoch=0, rank=0, world_size=1,
                              microbatches=[{**mb, "sources": sources}]))


def test_step_data_frame_must_match_its_arrays_and_sizes():
    mb = {"arrays": [0] * 21, "keys": [], "tokens": [], "items": [["image", "k", "png", {}]],
          "payloads": 1, "sizes": [5], "sources": b""}
    good = P.decode(P.encode(P.STEP, frames=[b"12345"], step=0, epoch=0, rank=0, world_size=1,
                             microbatches=[mb]))
    assert [(bytes(a), [bytes(p) for p in items]) for a, items in P.microbatch_frames(good)] == [
        (b"", [b"12345"])]
    for frames in ([b"1234"], [], [b"12", b"345"], [b"12345", b""]):
        with pytest.raises(P.ProtocolError):
            P.decode(P.encode(P.STEP, frames=frames, step=0, epoch=0, rank=0, world_size=1,
                              microbatches=[mb]))
    # Every micro-batch's arrays first (8 bytes an entry), then every micro-batch's payloads.
    two = {**mb, "arrays": [1] + [0] * 20, "items": [["image", "k", "png", {}]] * 2,
           "payloads": 2, "sizes": [2, 3]}
    one = {**mb, "arrays": [0, 2] + [0] * 19}
    data = b"A" * 8 + b"B" * 16 + b"12" + b"345" + b"xxxxx"
    split = P.decode(P.encode(P.STEP, frames=[data], step=0, epoch=0, rank=0, world_size=1,
                              microbatches=[two, one]))
    assert [(bytes(a), [bytes(p) for p in items]) for a, items in P.microbatch_frames(split)] == [
        (b"A" * 8, [b"12", b"345"]), (b"B" * 16, [b"xxxxx"])]
    # Past a frame's limit the data is split where an item ends, the arrays whole and first.
    parts = P.decode(P.encode(P.STEP, frames=[data[:26], data[26:29], data[29:]], step=0,
                              epoch=0, rank=0, world_size=1, microbatches=[two, one]))
    assert [[bytes(p) for p in items] for _, items in P.microbatch_frames(parts)] == [
        [b"12", b"345"], [b"xxxxx"]]
    for frames in ([data[:8], data[8:]], [data[:27], data[27:]], [data[:-1]], [data + b"!"]):
        with pytest.raises(P.ProtocolError):
            P.decode(P.encode(P.STEP, frames=frames, step=0, epoch=0, rank=0, world_size=1,
                              microbatches=[two, one]))
    with pytest.raises(P.ProtocolError, match="sizes"):
        P.decode(P.encode(P.STEP, frames=[data], step=0, epoch=0, rank=0, world_size=1,
                          microbatches=[{**two, "sizes": [5]}, one]))


def test_keep_freed_memory_is_off_at_zero():
    assert keep_freed_memory(0) is False


@pytest.mark.parametrize("type_,fields", [
    (P.HELLO, {"role": "trainer", "rank": 1, "world_size": 4, "next_step": None, "prefetch": 2}),
    (P.WELCOME, {"role": "reader", "ack": 1, "heartbeat_s": 0.5}),
    (P.ERROR, {"code": "x", "message": "y"}),
    (P.HEARTBEAT, {}),
    (P.SHARD_ASSIGN, {"assign_id": 1, "shard": "a.tar", "pos": 3, "epoch": 0, "start_index": 5}),
    (P.SHARD_DONE, {"assign_id": 1, "count": 9, "skipped": [P.SkipRecord("k", "bad_image", 3)]}),
    (P.CREDIT, {"upto": 5, "received": 3}),
    (P.END, {"next_step": 4, "reason": "max_epochs"}),
    (P.COMMIT, {"step": 3}),
])
def test_every_type_round_trips(type_, fields):
    msg = P.decode(P.encode(type_, seq=1, **fields))
    assert msg.type == type_ and msg.header == fields


def test_skips_travel_as_named_records_in_samples_and_shard_done():
    skipped = [["k7", "bad_image", 7], ["", "truncated_tar", -1]]
    msg = P.decode(P.encode(P.SAMPLES, frames=[b""], assign_id=1, samples=[], sizes=[],
                            skipped=skipped))
    assert msg["skipped"] == [P.SkipRecord("k7", "bad_image", 7), P.SkipRecord("", "truncated_tar", -1)]
    done = P.decode(P.encode(P.SHARD_DONE, assign_id=1, count=3, skipped=skipped))
    assert [s.index for s in done["skipped"]] == [7, -1]
    with pytest.raises(P.ProtocolError):  # an index is required: a skip says where it was
        P.decode(P.encode(P.SHARD_DONE, assign_id=1, count=3, skipped=[["k", "bad_image"]]))


@pytest.mark.parametrize("header,frames,code", [
    ({"v": P.VERSION, "type": "nope", "seq": 1}, [], "unknown_type"),
    ({"v": P.VERSION + 1, "type": P.HELLO, "seq": 1, "role": "reader"}, [], "version"),
    ({"v": P.VERSION, "type": P.HELLO, "seq": 1}, [], "malformed"),  # missing role
    ({"v": P.VERSION, "type": P.HELLO, "seq": 1, "role": "spy"}, [], "malformed"),
    ({"v": P.VERSION, "type": P.COMMIT, "seq": 1, "step": True}, [], "malformed"),  # bool is no int
    ({"v": P.VERSION, "type": P.COMMIT, "seq": 1, "step": 1, "extra": 0}, [], "malformed"),
    ({"v": P.VERSION, "type": P.COMMIT, "seq": 1, "step": 1}, [b"x"], "malformed"),
    ({"v": P.VERSION, "type": P.SAMPLES, "seq": 1, "assign_id": 1,
      "samples": [["k", 0, 1, 1, b"t" * 5, [["image", "jpg", 1, 1, {}]]]]}, [], "malformed"),
    # 2 text tokens planned but the tokens hold 1 (5 bytes each): a count that is not the ids
    ({"v": P.VERSION, "type": P.SAMPLES, "seq": 1, "assign_id": 1,
      "samples": [["k", 0, 2, 2, b"t" * 5, []]]}, [], "malformed"),
])
def test_decode_rejects_with_a_code(header, frames, code):
    with pytest.raises(P.ProtocolError) as info:
        P.decode(_raw(header, *frames))
    assert info.value.code == code
    if code == "version":
        assert info.value.peer_version == P.VERSION + 1 and f"v{P.VERSION}" in str(info.value)


#: one value of every type msgpack decodes to
_WIRE_VALUES = [True, 0, -3, 1.5, "s", b"b", [1], {"k": 1}, None]


@pytest.mark.parametrize("type_", sorted(P.SCHEMAS))
def test_compiled_schemas_accept_exactly_what_the_schemas_say(type_):
    """decode checks fields against compiled exact-type sets: for every field and every value
    msgpack can yield, a header differing only in that value passes exactly when the schema's
    declared types accept it (`_is`: bool is no int; a float field takes an int)."""
    schema = P.SCHEMAS[type_]
    valid = {n: next(v for v in _WIRE_VALUES if P._is(v, t)) for n, (t, req) in schema.items()
             if req}
    for name, (types, _) in schema.items():
        for value in _WIRE_VALUES:
            try:
                P._check_fields(type_, {**valid, name: value})
                accepted = True
            except P.ProtocolError as e:
                assert f"field {name!r} has type" in str(e)
                accepted = False
            assert accepted == P._is(value, types), (type_, name, value)


def test_unknown_and_missing_fields_are_named():
    with pytest.raises(P.ProtocolError, match="unknown field 'bogus'"):
        P.decode(_raw({"v": P.VERSION, "type": P.COMMIT, "seq": 1, "step": 1, "bogus": 2}))
    with pytest.raises(P.ProtocolError, match="missing field 'step'"):
        P.decode(_raw({"v": P.VERSION, "type": P.COMMIT, "seq": 1}))
    with pytest.raises(P.ProtocolError, match="field 'step' has type bool"):
        P.decode(_raw({"v": P.VERSION, "type": P.COMMIT, "seq": 1, "step": True}))


def test_error_of_another_version_still_decodes():
    msg = P.decode(_raw({"v": 99, "type": P.ERROR, "seq": 0, "code": "c", "message": "m"}))
    assert msg["message"] == "m"


def test_limits_are_enforced():
    limits = P.Limits(max_frames=3, max_header_bytes=64, max_frame_bytes=100, max_message_bytes=200)
    with pytest.raises(P.ProtocolError, match="frames"):
        P.decode(P.encode(P.HEARTBEAT, frames=[b"a"] * 3), limits)
    with pytest.raises(P.ProtocolError, match="header"):
        P.decode(P.encode(P.ERROR, code="x", message="y" * 100), limits)
    with pytest.raises(P.ProtocolError, match="message"):
        P.decode(P.encode(P.HEARTBEAT, frames=[b"a" * 199]), limits)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=4))
def test_fuzz_random_frames_raise_only_protocol_error(frames):
    try:
        P.decode(frames)
    except P.ProtocolError:
        pass


_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(),
                  st.text(max_size=8), st.binary(max_size=8))
_value = st.recursive(_leaf, lambda c: st.one_of(st.lists(c, max_size=4),
                                                 st.dictionaries(st.text(max_size=6), c, max_size=4)),
                      max_leaves=20)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(sorted(P.SCHEMAS)), st.dictionaries(st.text(max_size=12), _value, max_size=5),
       st.lists(st.binary(max_size=16), max_size=3), st.sampled_from([P.VERSION, 0, "1"]))
def test_fuzz_structured_headers_raise_only_protocol_error(type_, fields, frames, version):
    header = {**fields, "v": version, "type": type_, "seq": 1}
    # Also try the real field names with garbage values, which reach the nested validators.
    for h in (header, {**header, **{k: v for k, v in zip(P.SCHEMAS[type_], fields.values())}}):
        try:
            msg = P.decode(_raw(h, *frames))
        except P.ProtocolError:
            continue
        assert msg.type == type_


def _plan(world_size=3, num_microbatches=2):
    rng = np.random.default_rng(0)
    S = 12
    text = rng.integers(1, 50, S)
    owner = np.sort(rng.integers(0, S, 8))
    enc = rng.integers(4, 100, 8)
    llm_items = enc // 4
    llm = text + np.bincount(owner, weights=llm_items, minlength=S).astype(np.int64)
    inputs = StepInputs(text_len=text, llm_len=llm,
                        encoders={"vision": EncoderItems(enc_len=enc, llm_len=llm_items, sample=owner)})
    return plan_step(inputs, Topology(world_size=world_size, ranks_per_node=1),
                     PlannerConfig(num_microbatches=num_microbatches))


def test_microbatch_wire_round_trip_is_exact():
    """Every group of the step's packed buffer unpacks to exactly `rank_microbatch`."""
    for world in (1, 3, 16):
        plan = _plan(world_size=world)
        packed = pack_step(plan)
        for rank in range(world):
            for mb in range(2):
                rmb = plan.rank_microbatch(rank, mb)
                g = mb * world + rank
                back = unpack_microbatch(memoryview(packed.frame(g).tobytes()), packed.lengths[g],
                                         rank=rank, microbatch=mb, world_size=world)
                assert set(back.exchanges) == set(rmb.exchanges)
                for name in ("samples", "sample_offsets", "sample_llm_len", "text_offsets",
                             "text_len"):
                    np.testing.assert_array_equal(getattr(back, name), getattr(rmb, name))
                for phase, ex in rmb.exchanges.items():
                    for name in ("encode_items", "encode_enc_len", "encode_llm_len", "send_tokens",
                                 "recv_items", "recv_llm_len", "recv_offsets", "recv_tokens"):
                        np.testing.assert_array_equal(getattr(back.exchanges[phase], name),
                                                      getattr(ex, name))
    with pytest.raises(P.ProtocolError):
        unpack_microbatch(memoryview(packed.frame(0).tobytes())[:-8], packed.lengths[0], rank=0,
                          microbatch=0, world_size=16)


def test_a_ranks_frames_lie_together_micro_batch_0_first():
    """STEP's data frame starts with the rank's M groups in one piece (`rank_frame`)."""
    for world, m in ((1, 1), (3, 2), (16, 3)):
        plan = _plan(world_size=world, num_microbatches=m)
        packed = pack_step(plan)
        assert packed.rank_starts[0] == 0 and packed.rank_starts[-1] == len(packed.buffer)
        for rank in range(world):
            groups = [packed.frame(mb * world + rank) for mb in range(m)]
            np.testing.assert_array_equal(packed.rank_frame(rank), np.concatenate(groups))
            assert [len(g) for g in groups] == [sum(packed.lengths[mb * world + rank])
                                                for mb in range(m)]


def test_encode_packs_exactly_from_many_threads_at_once():
    """`encode` reuses one packer per thread: headers packed at once on several threads, and
    one after a header that could not be packed, are exactly msgpack's."""
    import threading

    import msgpack

    with pytest.raises(TypeError):
        P.encode(P.HEARTBEAT, note=object())
    assert P.encode(P.HEARTBEAT, seq=3)[0] == msgpack.packb(
        {"v": P.VERSION, "type": P.HEARTBEAT, "seq": 3}, use_bin_type=True)
    wrong = []

    def run(t: int) -> None:
        for i in range(2_000):
            keys = [f"t{t}-{i}-{j}" * (i % 7) for j in range(i % 5)]
            got = P.encode(P.CREDIT, seq=i, upto=t * i, received=i, keys=keys)[0]
            want = msgpack.packb({"v": P.VERSION, "type": P.CREDIT, "seq": i, "upto": t * i,
                                  "received": i, "keys": keys}, use_bin_type=True)
            if got != want:
                wrong.append((t, i))

    threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not wrong and not any(th.is_alive() for th in threads)


def test_microbatch_wire_size_does_not_grow_with_the_world():
    """Per-peer token counts travel as pairs: a rank's frame holds O(its items), not O(W)."""
    sizes = {}
    for world in (4, 64, 1024):
        packed = pack_step(_plan(world_size=world, num_microbatches=1))
        sizes[world] = max(len(packed.frame(g)) for g in range(4))
    assert sizes[1024] <= sizes[4] * 2, sizes
    with pytest.raises(P.ProtocolError, match="planned for world"):
        unpack_microbatch(memoryview(packed.frame(0).tobytes()), packed.lengths[0], rank=0,
                          microbatch=0, world_size=2)


def test_epoch_order_is_a_seeded_permutation():
    a = epoch_order(50, seed=1, epoch=0)
    assert sorted(a) == list(range(50))
    assert a == epoch_order(50, seed=1, epoch=0)
    assert a != epoch_order(50, seed=1, epoch=1) and a != epoch_order(50, seed=2, epoch=0)
    order = ShardOrder([f"s{i}.tar" for i in range(5)], seed=3, max_epochs=2)
    assert order.end == 10 and order.epoch_of(7) == 1 and order.epoch_end(7) == 10
    assert sorted(order.url(p) for p in range(5, 10)) == sorted(order.shards)


def test_cursor_consume_finish_and_wire():
    c = Cursor()
    c.consume(0, 4)
    c.finish(1)
    assert (c.base, c.start_index(0), c.is_open(1)) == (0, 5, False)
    c.finish(0)
    assert c.base == 2 and not c.done and not c.partial
    c.consume(3, 0)
    assert Cursor.from_wire(c.to_wire()) == c
