"""Items placed at their placeholders: reader ids and anchors, planner layout, trainer packing, end to end.

A text's placeholder token (LLaVA's `<image>`) is removed from the ids and the item it stands for
is anchored there: the planner puts its rows after that many text tokens, and the trainer fills
the positions items leave with the text, in order. Without placeholders nothing changes.
"""

from __future__ import annotations

import io
import os

import numpy as np
import pytest

from dispatcher_server.planner import (
    EncoderItems, PlannerConfig, StepInputs, StepPlan, Topology, plan_step, validate,
)
from dispatcher_server.planner.cost import CostModel
from dispatcher_server.planner.types import PlanError
from pipeline.counting import CountingConfig, TextConfig
from pipeline.errors import ErrorPolicy, ErrorStats
from pipeline.reader import ReaderConfig, iter_shard

from tests.servicekit import tar_of

tokenizers = pytest.importorskip("tokenizers")
PLACEHOLDERS = ["<image>", "<audio>", "<video>"]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["Hello world, describe the picture.", "What is in the image? A cat on a mat."] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", *PLACEHOLDERS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("phtok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def png(width: int = 56, height: int = 56) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def reader_config(tokenizer_file: str, **placeholders) -> ReaderConfig:
    text = TextConfig(tokenizer_path=tokenizer_file, **placeholders)
    return ReaderConfig(counting=CountingConfig(text=text), errors=ErrorPolicy(mode="skip"))


def encode(tokenizer_file: str, text: str) -> list[int]:
    return tokenizers.Tokenizer.from_file(tokenizer_file).encode(text, add_special_tokens=False).ids


# -- reader -------------------------------------------------------------------------------------
def test_reader_removes_placeholders_and_anchors_each_item_at_its_own(tmp_path, tokenizer_file):
    texts = {"lead": "<image>\nDescribe.", "mid": "Hello <image> world",
             "two": "A <image> and <image> end", "none": "No placeholder here"}
    members = {"lead": {"jpg": png(), "txt": texts["lead"].encode()},
               "mid": {"png": png(), "txt": texts["mid"].encode()},
               "two": {"0.png": png(), "1.png": png(112, 56), "txt": texts["two"].encode()},
               "none": {"png": png(), "txt": texts["none"].encode()}}
    shard = tar_of(str(tmp_path / "s.tar"), list(members.items()))
    recs = {r.key: r for r in iter_shard(shard, reader_config(tokenizer_file, image_placeholder="<image>"))}
    image_id = tokenizers.Tokenizer.from_file(tokenizer_file).token_to_id("<image>")
    for key, text in texts.items():
        full = encode(tokenizer_file, text)
        rec = recs[key]
        want = [i for i in full if i != image_id]
        assert rec.tokens.ids.tolist() == want and rec.text_len == len(want)
        assert rec.tokens.mask.tolist() == [1] * len(want)
        assert rec.llm_len == rec.text_len + sum(it.llm_len for it in rec.items)
        # the k-th image (member order) at the k-th placeholder: where it stood in the ids
        places = [i for i, t in enumerate(full) if t == image_id]
        assert [it.meta.get("anchor") for it in rec.items] == (places or [None] * len(rec.items))
    assert recs["lead"].items[0].meta["anchor"] == 0
    assert recs["mid"].items[0].meta["anchor"] == len(encode(tokenizer_file, "Hello "))
    assert [it.member for it in recs["two"].items] == ["0.png", "1.png"]


def test_conversation_placeholder_is_removed_from_ids_and_mask(tmp_path, tokenizer_file):
    import json

    turns = [{"role": "user", "content": "<image>\nWhat is in the image?"},
             {"role": "assistant", "content": "A cat on a mat."}]
    shard = tar_of(str(tmp_path / "c.tar"), [("c", {"png": png(), "json": json.dumps(turns).encode()})])
    plain = next(iter_shard(shard, reader_config(tokenizer_file)))
    placed = next(iter_shard(shard, reader_config(tokenizer_file, image_placeholder="<image>")))
    image_id = tokenizers.Tokenizer.from_file(tokenizer_file).token_to_id("<image>")
    at = plain.tokens.ids.tolist().index(image_id)
    keep = np.arange(len(plain.tokens)) != at
    assert placed.tokens.ids.tolist() == plain.tokens.ids[keep].tolist()
    assert placed.tokens.mask.tolist() == plain.tokens.mask[keep].tolist()
    assert placed.items[0].meta["anchor"] == at and placed.text_len == plain.text_len - 1


def test_placeholder_count_that_matches_no_item_count_skips_the_sample(tmp_path, tokenizer_file):
    samples = [("ok", {"png": png(), "txt": b"Hello <image> world"}),
               ("extra", {"png": png(), "txt": b"<image> and <image>"}),
               ("orphan", {"txt": b"<image> without an image"})]
    shard = tar_of(str(tmp_path / "m.tar"), samples)
    stats = ErrorStats()
    got = [r.key for r in iter_shard(shard, reader_config(tokenizer_file, image_placeholder="<image>"),
                                     stats=stats)]
    assert got == ["ok"]
    assert stats.by_reason == {"placeholder_mismatch": 2}
    messages = [m for _, _, _, m in stats.recent]
    assert any("2 '<image>' placeholders for 1 image members" in m for m in messages)
    assert any("1 '<image>' placeholders for 0 image members" in m for m in messages)


def test_a_placeholder_that_is_not_one_token_is_refused_naming_it(tokenizer_file):
    from pipeline.reader import SampleBuilder

    with pytest.raises(ValueError, match=r"--image-placeholder '<img>' is not an added or special "
                                         r"token of tokenizer 'tokenizer.json'"):
        SampleBuilder(reader_config(tokenizer_file, image_placeholder="<img>"))
    with pytest.raises(ValueError, match=r"--audio-placeholder '<audio>' is not a token of the byte-level"):
        SampleBuilder(ReaderConfig(counting=CountingConfig(text=TextConfig(audio_placeholder="<audio>"))))
    with pytest.raises(ValueError, match="one token for two modalities"):
        TextConfig(image_placeholder="<image>", video_placeholder="<image>")
    with pytest.raises(ValueError, match=r"--image-placeholder \(\[counting\] image_placeholder\) is empty"):
        TextConfig(image_placeholder="")
    # A vocabulary word is one token too, but ordinary text forms it: every one that starts a
    # text would have become an image's slot.
    tok = tokenizers.Tokenizer.from_file(tokenizer_file)
    word = next(w for w in ("What", "Hello", "the", "a", "A")
                if len(tok.encode(w, add_special_tokens=False).ids) == 1)
    with pytest.raises(ValueError, match=f"'{word}' is not an added or special token"):
        SampleBuilder(reader_config(tokenizer_file, image_placeholder=word))


def test_placeholders_with_estimated_text_are_said_to_be_ignored(caplog):
    from pipeline.counting import Counter

    Counter(CountingConfig(text=TextConfig(estimate=True, image_placeholder="<image>")))
    assert "event=placeholders_ignored flags=--image-placeholder" in caplog.text


def test_readers_with_other_placeholders_are_refused_like_another_tokenizer(tokenizer_file):
    from dispatcher_server.inputs import InputRules
    from pipeline.service import input_rules

    def rules(**kw):
        return input_rules(CountingConfig(text=TextConfig(tokenizer_path=tokenizer_file, **kw)))

    session = InputRules()
    assert session.admit("reader 'a'", rules(image_placeholder="<image>")) is None
    assert session.admit("reader 'b'", rules(image_placeholder="<image>")) is None
    why = session.admit("reader 'c'", rules())
    assert why is not None and "placeholders: reader 'c' 'none', reader 'a' 'image=<image>'" in why
    assert "placeholders" not in input_rules(CountingConfig(text=TextConfig(estimate=True)))


# -- planner ------------------------------------------------------------------------------------
def _inputs(text, vision, audio=(), *, anchors=True) -> StepInputs:
    """vision/audio: (sample, llm_len, anchor) per item."""
    def items(rows):
        rows = list(rows)
        col = (lambda k: np.array([r[k] for r in rows], dtype=np.int64)) if rows else \
            (lambda k: np.zeros(0, np.int64))
        return EncoderItems(enc_len=col(1) * 4, llm_len=col(1), sample=col(0),
                            anchor=col(2) if anchors else None)
    text = np.array(text, dtype=np.int64)
    enc = {"vision": items(vision), "audio": items(audio)}
    llm = text + sum(np.bincount(e.sample, weights=e.llm_len, minlength=len(text)).astype(np.int64)
                     for e in enc.values())
    return StepInputs(text_len=text, llm_len=llm, encoders=enc)


def _one_rank_plan(inputs: StepInputs) -> StepPlan:
    S = inputs.num_samples
    return StepPlan(inputs=inputs, topology=Topology(world_size=1, ranks_per_node=1), num_microbatches=1,
                    sample_mb=np.zeros(S, np.int64), sample_rank=np.zeros(S, np.int64),
                    item_rank={p: np.zeros(len(inputs.items(p)), np.int64) for p in ("vision", "audio")},
                    cost=CostModel(), bytes_per_token={"vision": 2, "audio": 2})


def test_planner_places_anchored_items_among_the_text():
    # anchors are placeholder positions, placeholders counted: sample 0 was written
    # "t t <img> <aud> t t t <img>" (5 text tokens), sample 1 "<img> t t t"
    inputs = _inputs([5, 3], [(0, 3, 2), (0, 2, 7), (1, 2, 0)], [(0, 4, 3)])
    plan = _one_rank_plan(inputs)
    validate(plan, inputs)
    # sample 0 = t t [img 3][aud 4] t t t [img 2] -> 14 positions; sample 1 at 14: [img 2] t t t
    assert plan.sample_offset.tolist() == [0, 14]
    assert plan.item_offset["vision"].tolist() == [2, 12, 14]
    assert plan.item_offset["audio"].tolist() == [5]
    assert plan.text_offset.tolist() == [0, 16]
    # a plan rebuilt from its journaled form keeps the anchors
    again = StepPlan.from_dict(plan.to_dict())
    assert again.item_offset["vision"].tolist() == [2, 12, 14]
    validate(again, inputs)
    # a layout that ignores the anchors is refused by the checker
    plan.item_offset["vision"] = np.array([0, 3, 14])
    plan.item_offset["audio"] = np.array([5])
    plan.text_offset = np.array([9, 16])
    with pytest.raises(PlanError, match="layout convention|order"):
        validate(plan, inputs)


def test_placeholders_side_by_side_keep_the_order_they_were_written_in():
    """`<audio><image> both`: the audio's rows, then the image's, as a processor expands them
    (anchors that counted only the text tokens tied there, and phase order put vision first)."""
    inputs = _inputs([1], [(0, 3, 1)], [(0, 2, 0)])
    plan = _one_rank_plan(inputs)
    validate(plan, inputs)
    assert plan.item_offset["audio"].tolist() == [0] and plan.item_offset["vision"].tolist() == [2]
    assert plan.text_offset.tolist() == [5]
    swapped = _inputs([1], [(0, 3, 0)], [(0, 2, 1)])
    plan = _one_rank_plan(swapped)
    assert plan.item_offset["vision"].tolist() == [0] and plan.item_offset["audio"].tolist() == [3]


def test_anchors_absent_or_minus_one_is_the_default_layout():
    rows_v, rows_a = [(0, 3, -1), (0, 2, -1), (1, 2, -1)], [(0, 4, -1)]
    default = _one_rank_plan(_inputs([5, 3], rows_v, rows_a, anchors=False))
    zeros = _one_rank_plan(_inputs([5, 3], rows_v, rows_a))
    assert default.item_offset["vision"].tolist() == zeros.item_offset["vision"].tolist() == [0, 3, 14]
    assert default.item_offset["audio"].tolist() == zeros.item_offset["audio"].tolist() == [5]
    assert default.text_offset.tolist() == zeros.text_offset.tolist() == [9, 16]
    assert "anchor" not in default.to_dict()["inputs"]["encoders"]["vision"]


def test_solver_plans_anchored_steps_that_validate():
    rng = np.random.default_rng(0)
    S = 40
    text = rng.integers(2, 60, S)
    vis_n = [s % 3 for s in range(S)]
    aud_n = [int(s % 4 == 0) for s in range(S)]
    # distinct places among each sample's text and placeholders; some items unplaced (-1)
    places = [list(rng.choice(text[s] + vis_n[s] + aud_n[s], vis_n[s] + aud_n[s], replace=False))
              for s in range(S)]
    places = [[int(a) if rng.random() < 0.8 else -1 for a in p] for p in places]
    vis = [(s, int(rng.integers(1, 30)), places[s][k]) for s in range(S) for k in range(vis_n[s])]
    aud = [(s, int(rng.integers(1, 20)), places[s][vis_n[s]]) for s in range(S) if aud_n[s]]
    inputs = _inputs(text, vis, aud)
    plan = plan_step(inputs, Topology(world_size=4, ranks_per_node=2), PlannerConfig(num_microbatches=2))
    validate(plan, inputs)
    with pytest.raises(PlanError, match="anchor"):
        bad = _inputs(text, [(0, 3, int(text[0]) + 1)])
        validate(_one_rank_plan(bad), bad)


# -- trainer ------------------------------------------------------------------------------------
def test_pack_llm_inputs_puts_item_rows_at_the_placeholder_and_labels_line_up():
    torch = pytest.importorskip("torch")
    from trainer_client.exchange import pack_llm_inputs
    from trainer_client.model import IGNORE_INDEX, packed_labels

    # sample 0: "a b [img x3] c" ; sample 1: "[img x2] d e"
    inputs = _inputs([3, 2], [(0, 3, 2), (1, 2, 0)])
    rmb = _one_rank_plan(inputs).rank_microbatch(0, 0)
    ids = torch.tensor([11, 12, 13, 14, 15])
    rows = torch.tensor([[-1.0], [-1.0], [-1.0], [-2.0], [-2.0]])
    packed, cu, pos = pack_llm_inputs(rmb, ids[:, None].float(), {"vision": rows})
    assert packed[:, 0].tolist() == [11, 12, -1, -1, -1, 13, -2, -2, 14, 15]
    assert cu.tolist() == [0, 6, 10] and pos.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
    mask = torch.tensor([True, True, False, True, True])
    labels = packed_labels(rmb, ids, mask)
    # position p predicts the text token at p+1: 12 from 11, 13 (masked) from the last image row
    want = [12, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX,
            IGNORE_INDEX, 14, 15, IGNORE_INDEX]
    assert labels.tolist() == want
    labels = packed_labels(rmb, ids)
    assert labels[4].item() == 13 and labels[7].item() == 14


# -- end to end ---------------------------------------------------------------------------------
def test_serve_read_and_client_pack_items_at_their_placeholders(tmp_path, tokenizer_file):
    torch = pytest.importorskip("torch")
    from tests.test_service import client_config, dispatcher, make_config, readers
    from trainer_client.client import DispatcherClient
    from trainer_client.exchange import pack_llm_inputs

    texts = {"lead": "<image>\nDescribe.", "mid": "Hello <image> world"}
    shard = tar_of(str(tmp_path / "e.tar"), [(k, {"png": png(), "txt": t.encode()}) for k, t in texts.items()])
    reader = reader_config(tokenizer_file, image_placeholder="<image>")
    got = {}
    with dispatcher(make_config([shard], world_size=1, global_batch=2, num_microbatches=1)) as srv, \
            readers(srv.reader_endpoint, 1, reader=reader):
        client = DispatcherClient(srv.trainer_endpoint, 0, 1, 1, config=client_config())
        try:
            for step in client:
                for mb in step.microbatches:
                    vision = mb.plan.exchanges["vision"]
                    lens = vision.recv_llm_len.tolist()
                    # each received item's rows carry -(its index + 1)
                    rows = torch.cat([torch.full((n, 1), -(k + 1.0)) for k, n in enumerate(lens)])
                    text = torch.cat(mb.text_ids).float()[:, None]
                    packed, cu, _ = pack_llm_inputs(mb.plan, text, {"vision": rows})
                    seq = packed[:, 0].long().tolist()
                    for k, key in enumerate(mb.keys):
                        got[key] = seq[int(cu[k]):int(cu[k + 1])]
        finally:
            client.close()
    n = 4  # a 56x56 image: 16 patches, 4 LLM tokens
    assert got["lead"] == [got["lead"][0]] * n + encode(tokenizer_file, "\nDescribe.")
    assert got["mid"][:len(encode(tokenizer_file, "Hello "))] == encode(tokenizer_file, "Hello ")
    hello = len(encode(tokenizer_file, "Hello "))
    assert got["mid"] == (encode(tokenizer_file, "Hello ") + [got["mid"][hello]] * n
                          + encode(tokenizer_file, " world"))
    assert got["lead"][0] < 0 and got["mid"][hello] < 0 and got["lead"][0] != got["mid"][hello]
    assert os.path.getsize(shard) > 0


# -- dispatcher ---------------------------------------------------------------------------------
def test_dispatcher_builds_anchor_arrays_from_item_meta_and_refuses_bad_anchors():
    from dispatcher_server.batching import Sample, build_batch, header_problem
    from dispatcher_server.protocol import ANCHOR, ItemHeader

    def sample(key, text_len, metas):
        items = [ItemHeader("image", f"{k}.png", 16, 4, m) for k, m in enumerate(metas)]
        return Sample(key=key, pos=0, index=0, text_len=text_len, llm_len=text_len + 4 * len(items),
                      tokens=b"", items=items, payloads=[b"x"] * len(items), nbytes=len(items))

    plain = build_batch([sample("a", 5, [{}, {}]), sample("b", 3, [{}])])
    assert plain.inputs.encoders["vision"].anchor is None
    placed = build_batch([sample("a", 5, [{ANCHOR: 2}, {ANCHOR: 5}]), sample("b", 3, [{}])])
    assert placed.inputs.encoders["vision"].anchor.tolist() == [2, 5, -1]
    assert placed.digest() != plain.digest()  # a journaled plan replays only over the same places
    two = [ItemHeader("image", "png", 16, 4, {ANCHOR: 3}), ItemHeader("image", "png", 16, 4, {ANCHOR: 3})]
    assert header_problem(5, 13, two) == "invalid_header"  # one placeholder each
    items = [ItemHeader("image", "png", 16, 4, {ANCHOR: 6})]
    assert header_problem(5, 9, items) == "invalid_header"
    assert header_problem(5, 9, [ItemHeader("image", "png", 16, 4, {ANCHOR: 5})]) is None
    assert header_problem(5, 9, [ItemHeader("image", "png", 16, 4, {ANCHOR: "1"})]) == "invalid_header"
