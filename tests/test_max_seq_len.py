"""A sample's length limit: --max-seq-len N with --over-length skip|truncate.

A sample longer than N LLM tokens (text plus every item's) is skipped as `too_long`, or under
`truncate` keeps its text's first tokens, as HF's right-side truncation: items are never cut nor
dropped (a cut that would fall in or before one skips the sample), and a cut that leaves no
trained token skips it too. Readers holding samples to another length are refused in one job.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dispatcher_server.planner import validate
from dispatcher_server.protocol import ANCHOR
from pipeline.counting import CountingConfig, TextConfig, item_ends, kept_text_len
from pipeline.errors import ErrorPolicy, ErrorStats
from pipeline.reader import ReaderConfig, iter_shard
from pipeline.records import Item

from tests.servicekit import tar_of
from tests.test_placeholders import _inputs, _one_rank_plan, encode, png, tokenizer_file  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
IMAGE_LLM = 4  # a 56x56 image: 16 patches, 4 LLM tokens


def config(limit: int | None = None, policy: str = "skip", **text) -> ReaderConfig:
    text = TextConfig(max_seq_len=limit, over_length=policy, **text)
    return ReaderConfig(counting=CountingConfig(text=text), errors=ErrorPolicy(mode="skip"))


def read(shard: str, cfg: ReaderConfig) -> tuple[dict, ErrorStats]:
    stats = ErrorStats()
    return {r.key: r for r in iter_shard(shard, cfg, stats=stats)}, stats


def messages(stats: ErrorStats) -> dict[str, str]:
    """key -> message of each skipped sample."""
    return {key: msg for _, _, key, msg in stats.recent}


# -- plain text ---------------------------------------------------------------------------------
@pytest.fixture
def text_shard(tmp_path) -> str:
    return tar_of(str(tmp_path / "t.tar"), [("long", {"txt": b"abcdefghij" * 3}),  # 30 byte-level ids
                                           ("short", {"txt": b"0123456789"})])


def test_plain_text_over_the_limit_is_skipped_naming_its_length_the_limit_and_the_fix(text_shard):
    whole, _ = read(text_shard, config())
    got, stats = read(text_shard, config(20))
    assert list(got) == ["short"] and stats.by_reason == {"too_long": 1}
    assert got["short"].tokens.ids.tolist() == whole["short"].tokens.ids.tolist()
    why = messages(stats)["long"]
    assert "30 LLM tokens, over --max-seq-len 20" in why and "--over-length truncate" in why
    assert stats.num_truncated == 0


def test_plain_text_truncated_keeps_its_first_tokens_and_is_counted(text_shard):
    whole, _ = read(text_shard, config())
    got, stats = read(text_shard, config(20, "truncate"))
    long = got["long"]
    assert long.tokens.ids.tolist() == whole["long"].tokens.ids[:20].tolist()
    assert long.tokens.mask.tolist() == [1] * 20
    assert long.text_len == long.llm_len == 20 and long.truncated == 10
    assert got["short"].truncated == 0 and got["short"].text_len == 10
    assert stats.num_errors == 0 and stats.num_truncated == 1
    assert stats.as_dict()["num_truncated"] == 1


def test_a_limit_every_sample_fits_changes_nothing(text_shard):
    whole, _ = read(text_shard, config())
    for policy in ("skip", "truncate"):
        got, stats = read(text_shard, config(30, policy))
        assert stats.num_errors == stats.num_truncated == 0
        for key, rec in whole.items():
            assert got[key].tokens.ids.tolist() == rec.tokens.ids.tolist()
            assert (got[key].text_len, got[key].llm_len, got[key].truncated) == (rec.text_len, rec.llm_len, 0)


def test_estimated_text_is_skipped_or_clipped_on_counts(text_shard):
    whole, _ = read(text_shard, config(estimate=True))
    assert whole["long"].text_len > 3  # ~4 ASCII characters a token
    assert whole["short"].text_len == 3
    got, stats = read(text_shard, config(3, estimate=True))
    assert list(got) == ["short"] and stats.by_reason == {"too_long": 1}
    got, stats = read(text_shard, config(3, "truncate", estimate=True))
    assert got["long"].text_len == got["long"].llm_len == 3 and len(got["long"].tokens) == 0
    assert got["short"].truncated == 0 and stats.num_truncated == 1


# -- conversations: the loss mask ---------------------------------------------------------------
def test_a_truncated_conversation_keeps_its_mask_prefix_or_is_skipped_with_no_trained_token(tmp_path):
    turns = [{"role": "user", "content": "Tell me a long story about a cat and a mat."},
             {"role": "assistant", "content": "Once upon a time."}]
    quiet = [{"role": "user", "content": "Only context here, nothing to answer. " * 4}]
    shard = tar_of(str(tmp_path / "c.tar"), [("chat", {"json": json.dumps(turns).encode()}),
                                            ("quiet", {"json": json.dumps(quiet).encode()})])
    whole, _ = read(shard, config())
    chat = whole["chat"]
    first = int(chat.tokens.mask.argmax())  # the first assistant (trained) token
    assert 0 < first < chat.text_len and not whole["quiet"].tokens.mask.any()

    got, stats = read(shard, config(first + 3, "truncate"))
    kept = got["chat"]
    assert kept.tokens.ids.tolist() == chat.tokens.ids[:first + 3].tolist()
    assert kept.tokens.mask.tolist() == chat.tokens.mask[:first + 3].tolist()
    assert kept.tokens.mask.sum() == 3
    # a conversation that trains on nothing anyway is truncated like any other text
    assert got["quiet"].tokens.ids.tolist() == whole["quiet"].tokens.ids[:first + 3].tolist()
    assert stats.num_errors == 0 and stats.num_truncated == 2

    got, stats = read(shard, config(first, "truncate"))  # the cut falls before the answer
    assert "chat" not in got and stats.by_reason == {"too_long": 1}
    why = messages(stats)["chat"]
    assert f"keeps {first} text tokens, none of its trained ones" in why and "--max-seq-len" in why


# -- items before the text ----------------------------------------------------------------------
def test_items_before_the_text_are_never_cut(tmp_path):
    shard = tar_of(str(tmp_path / "i.tar"), [("pic", {"png": png(), "txt": b"a caption of 30 bytes, or so.."})])
    whole, _ = read(shard, config())
    pic = whole["pic"]
    assert pic.items[0].llm_len == IMAGE_LLM and pic.llm_len == IMAGE_LLM + 30

    got, stats = read(shard, config(20, "truncate"))
    rec = got["pic"]
    assert rec.llm_len == 20 and rec.text_len == 20 - IMAGE_LLM and rec.items[0].llm_len == IMAGE_LLM
    assert rec.tokens.ids.tolist() == pic.tokens.ids[:20 - IMAGE_LLM].tolist()
    assert stats.num_truncated == 1

    got, stats = read(shard, config(IMAGE_LLM - 1, "truncate"))  # the cut falls inside the image
    assert not got and "inside image member 'png' (its LLM tokens 0 to 4)" in messages(stats)["pic"]
    got, stats = read(shard, config(IMAGE_LLM, "truncate"))  # the image alone: no text to learn
    assert not got and "none of its trained ones" in messages(stats)["pic"]
    got, stats = read(shard, config(20))
    assert not got and stats.by_reason == {"too_long": 1}


# -- placeholders -------------------------------------------------------------------------------
def test_item_ends_match_the_planner_layout():
    """`item_ends` (the reader's arithmetic) against where the planner puts each item."""
    rng = np.random.default_rng(5)
    for _ in range(50):
        text = int(rng.integers(0, 12))
        num_v, num_a = int(rng.integers(0, 3)), int(rng.integers(0, 3))
        placed = rng.random(num_v + num_a) < 0.7  # the others come before the text
        # placeholder positions among the text and the placeholders themselves
        places = iter(rng.choice(text + placed.sum(), placed.sum(), replace=False).tolist())
        anchors = [next(places) if p else -1 for p in placed]
        llm = [int(n) for n in rng.integers(1, 9, num_v + num_a)]
        rows_v = [(0, llm[k], anchors[k]) for k in range(num_v)]
        rows_a = [(0, llm[k], anchors[k]) for k in range(num_v, num_v + num_a)]
        inputs = _inputs([text], rows_v, rows_a)
        plan = _one_rank_plan(inputs)
        validate(plan, inputs)
        planned = [int(o) + n for o, n in zip(plan.item_offset["vision"], llm[:num_v])]
        planned += [int(o) + n for o, n in zip(plan.item_offset["audio"], llm[num_v:])]
        items = [Item(modality="image" if k < num_v else "audio", member=f"m{k}", enc_len=1, llm_len=n,
                      meta={ANCHOR: a} if a >= 0 else {}) for k, (n, a) in enumerate(zip(llm, anchors))]
        assert item_ends(items) == planned, (text, anchors, llm)


def test_kept_text_len_refuses_a_cut_before_an_anchored_item():
    # "t t [img 3] t t t t t": the image at text position 2 ends at 5
    items = [Item(modality="image", member="png", enc_len=12, llm_len=3, meta={ANCHOR: 2})]
    assert kept_text_len(7, items, 10, "truncate") == 7
    assert kept_text_len(7, items, 8, "truncate") == 5
    assert kept_text_len(7, items, 5, "truncate") == 2
    for limit, where in ((4, "inside"), (2, "before")):
        with pytest.raises(Exception, match=f"cut would fall {where} image member 'png'"):
            kept_text_len(7, items, limit, "truncate")


def test_placeholders_truncate_after_and_refuse_inside_or_before_the_item(tmp_path, tokenizer_file):
    text = "What is in the image? <image> A cat on a mat. Hello world, describe the picture."
    shard = tar_of(str(tmp_path / "p.tar"), [("p", {"png": png(), "txt": text.encode()})])
    marks = {"tokenizer_path": tokenizer_file, "image_placeholder": "<image>"}
    whole, _ = read(shard, config(**marks))
    rec = whole["p"]
    at = rec.items[0].meta[ANCHOR]  # text tokens before the image (the only placeholder)
    assert at >= 3 and rec.text_len - at >= 4, (at, rec.text_len)
    end = at + IMAGE_LLM

    limit = end + 2  # the cut falls after the image: two text tokens follow it
    got, stats = read(shard, config(limit, "truncate", **marks))
    cut = got["p"]
    assert cut.llm_len == limit and cut.text_len == at + 2 and cut.truncated == rec.text_len - at - 2
    assert cut.tokens.ids.tolist() == rec.tokens.ids[:at + 2].tolist()
    assert cut.items[0].meta[ANCHOR] == at <= cut.text_len  # the image still stands in the text
    assert item_ends(cut.items) == [end] and stats.num_truncated == 1
    got, _ = read(shard, config(end, "truncate", **marks))  # right after it: it ends the sequence
    assert got["p"].text_len == at and got["p"].items[0].meta[ANCHOR] == got["p"].text_len

    for limit, where in ((end - 1, "inside"), (at, "before"), (at - 2, "before")):
        got, stats = read(shard, config(limit, "truncate", **marks))
        assert not got and stats.by_reason == {"too_long": 1}, limit
        assert f"cut would fall {where} image member 'png'" in messages(stats)["p"], limit


def test_two_placeholders_with_the_cut_between_them_skip_the_sample(tmp_path, tokenizer_file):
    text = "A <image> and <image> Hello world, describe the picture."
    shard = tar_of(str(tmp_path / "two.tar"), [("two", {"0.png": png(), "1.png": png(), "txt": text.encode()})])
    marks = {"tokenizer_path": tokenizer_file, "image_placeholder": "<image>"}
    rec = read(shard, config(**marks))[0]["two"]
    first, second = item_ends(rec.items)
    got, stats = read(shard, config(first + 1, "truncate", **marks))
    assert not got and "image member '1.png'" in messages(stats)["two"]
    got, _ = read(shard, config(second + 1, "truncate", **marks))
    assert got["two"].llm_len == second + 1
    assert all(it.meta[ANCHOR] - k <= got["two"].text_len for k, it in enumerate(got["two"].items))


# -- the input rule -----------------------------------------------------------------------------
def test_readers_holding_samples_to_another_length_are_refused_like_another_tokenizer():
    from dispatcher_server.inputs import InputRules
    from pipeline.service import input_rules

    def rules(**kw):
        return input_rules(CountingConfig(text=TextConfig(**kw)))

    assert rules()["max_seq_len"] == "none"
    session = InputRules()
    assert session.admit("reader 'a'", rules(max_seq_len=4096)) is None
    assert session.admit("reader 'b'", rules(max_seq_len=4096, over_length="skip")) is None
    for other, shown in (({"max_seq_len": 2048}, "'2048 skip'"), ({}, "'none'"),
                         ({"max_seq_len": 4096, "over_length": "truncate"}, "'4096 truncate'")):
        why = session.admit("reader 'c'", rules(**other))
        assert why is not None and f"max_seq_len: reader 'c' {shown}, reader 'a' '4096 skip'" in why
    assert "max_seq_len" not in input_rules(CountingConfig(text=TextConfig(estimate=True, max_seq_len=8)))


def test_readers_skipping_samples_past_other_limits_are_refused():
    """Probe: readers with another --max-member-bytes (--max-text-bytes, --max-header-pixels)
    joined one job: two identical runs skipped 12 and 7 samples, whichever reader read which
    shard, and differed at every step. The limits are input rules, as --max-seq-len is."""
    from dispatcher_server.inputs import InputRules
    from pipeline.counting import AudioConfig, ImageConfig
    from pipeline.service import input_rules

    ours = input_rules(CountingConfig(), max_member_bytes=1 << 20)
    session = InputRules()
    assert session.admit("reader 'a'", ours) is None
    assert session.admit("reader 'b'", dict(ours)) is None
    for other, shown in (
            (input_rules(CountingConfig(), max_member_bytes=1 << 10), "max_member_bytes: reader 'c' 1024"),
            (input_rules(CountingConfig(text=TextConfig(max_text_bytes=99)), max_member_bytes=1 << 20),
             "max_text_bytes: reader 'c' 99"),
            (input_rules(CountingConfig(image=ImageConfig(max_header_pixels=10**6)), max_member_bytes=1 << 20),
             "max_header_pixels: reader 'c' 1000000"),
            (input_rules(CountingConfig(audio=AudioConfig(max_duration_s=60.0)), max_member_bytes=1 << 20),
             "max_clip_seconds: reader 'c' 60.0"),
            # probe: readers with another --json-field trained shard by shard on other fields
            (input_rules(CountingConfig(text=TextConfig(json_fields=("caption",))), max_member_bytes=1 << 20),
             "json_fields: reader 'c' 'caption', reader 'a' 'text,caption,conversations,messages'")):
        why = session.admit("reader 'c'", other)
        assert why is not None and shown in why, why


# -- the command line ---------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("args,words", [
    (["--max-seq-len", "0"], ["--max-seq-len 0", ">= 1"]),
    (["--max-seq-len", "-5"], ["--max-seq-len -5", ">= 1"]),
    (["--max-seq-len", "4k"], ["--max-seq-len", "'4k'"]),
    (["--over-length", "truncate"], ["--over-length 'truncate' needs --max-seq-len", "drop --over-length"]),
    (["--over-length", "cut"], ["'cut'", "skip", "truncate"]),
    (["--config", "{over_length.toml}"], ["--over-length 'truncate' needs --max-seq-len"]),
])
def test_a_bad_length_setting_is_one_line_naming_it(text_shard, tmp_path, args, words):
    settings = tmp_path / "over_length.toml"
    settings.write_text('[counting]\nover_length = "truncate"\n')
    argv = [a.replace("{over_length.toml}", str(settings)) for a in args]
    out = subprocess.run([sys.executable, "-m", "mmdispatch.cli", "inspect", *argv, text_shard],
                         cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    lines = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and "usage:" not in out.stderr, out.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_inspect_reports_truncated_samples(text_shard, capsys):
    from mmdispatch.cli import main

    assert main(["inspect", "--json", "--max-seq-len", "20", "--over-length", "truncate", text_shard]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["errors"]["num_truncated"] == 1 and report["samples"]["llm_len"]["max"] == 20
    assert main(["inspect", "--max-seq-len", "20", "--over-length", "truncate", text_shard]) == 0
    assert "samples truncated to --max-seq-len: 1" in " ".join(capsys.readouterr().out.split())


# -- end to end ---------------------------------------------------------------------------------
@pytest.mark.timeout(90)
def test_trainers_receive_samples_of_at_most_the_limit(tmp_path, caplog):
    pytest.importorskip("torch")
    import logging

    from tests.test_service import client_config, dispatcher, make_config, readers
    from trainer_client.client import DispatcherClient

    limit = 16
    samples = [("long", {"txt": b"The quick brown fox jumps over the lazy dog."}),
               ("pic", {"png": png(), "txt": b"a caption longer than the limit allows"}),
               ("short", {"txt": b"tiny"}),
               ("tight", {"png": png(), "txt": b"fits"})]
    shard = tar_of(str(tmp_path / "e.tar"), samples)
    whole, _ = read(shard, config())
    caplog.set_level(logging.INFO, logger="mmdispatch.server")
    got = {}
    with dispatcher(make_config([shard], world_size=1, global_batch=2, num_microbatches=1)) as srv, \
            readers(srv.reader_endpoint, 1, reader=config(limit, "truncate")):
        client = DispatcherClient(srv.trainer_endpoint, 0, 1, 1, config=client_config())
        try:
            for step in client:
                for mb in step.microbatches:
                    for k, key in enumerate(mb.keys):
                        got[key] = (int(mb.sample_llm_len[k]), mb.text_ids[k].tolist(),
                                    mb.loss_mask[k].tolist())
        finally:
            client.close()
        truncated = srv.metrics.registry.get_sample_value("mmdispatch_samples_truncated_total",
                                                          {"source": "default"})
    assert sorted(got) == sorted(whole)
    for key, (llm_len, ids, mask) in got.items():
        rec = whole[key]
        assert llm_len <= limit and llm_len == min(rec.llm_len, limit), key
        assert ids == rec.tokens.ids[:len(ids)].tolist() and len(ids) == llm_len - rec.llm_len + rec.text_len
        assert mask == [True] * len(ids)
    assert len(got["long"][1]) == limit and len(got["pic"][1]) == limit - IMAGE_LLM
    assert got["short"][1] == whole["short"].tokens.ids.tolist()
    assert truncated == 2
    lines = [r.getMessage() for r in caplog.records if "event=samples_truncated" in r.getMessage()]
    assert len(lines) == 1 and "samples=2" in lines[0] and "source=default" in lines[0]
