"""FieldMap: defaults, strict from_dict/to_dict, and the reader classifying by it."""

from __future__ import annotations

import gzip
import io
import json

import numpy as np
import pytest
import soundfile

from pipeline.fieldmap import KINDS, REFUSED_AUDIO, REFUSED_IMAGE, FieldMap, ignored_label
from pipeline.reader import ReaderConfig, SampleBuilder, iter_shard
from pipeline.errors import ErrorStats
from pipeline.gendata import make_sample
from pipeline.tokenize import ByteTokenizer
from tests.test_pipeline_reader import write_tar


def test_defaults_are_the_suffixes_read_before_the_field_map():
    fm = FieldMap()
    assert fm.image == ("jpg", "jpeg", "png", "webp", "gif", *REFUSED_IMAGE)
    assert fm.audio == ("wav", "flac", "mp3", "ogg", "opus", "oga", "aiff", "aif", *REFUSED_AUDIO)
    assert fm.video == ("mp4", "m4v", "mov", "webm", "mkv", "avi")
    assert fm.text == ("txt", "text") and fm.conversation == ("json",)
    assert ReaderConfig().fields == fm


def test_round_trip_and_hashable_repr_stable():
    fm = FieldMap.from_dict({"image": ["tif", ".PNG"], "text": ["caption"]})
    assert fm.image == ("tif", "png") and fm.text == ("caption",)
    assert fm.audio == FieldMap().audio  # kinds left out keep their defaults
    assert FieldMap.from_dict(fm.to_dict()) == fm
    assert list(fm.to_dict()) == list(KINDS)
    assert hash(fm) == hash(FieldMap.from_dict(fm.to_dict()))
    # The reader's builder cache keys on the config's repr: equal maps, equal reprs.
    assert repr(ReaderConfig(fields=fm)) == repr(ReaderConfig(fields=FieldMap.from_dict(fm.to_dict())))
    assert repr(ReaderConfig(fields=fm)) != repr(ReaderConfig())


def test_an_explicit_kind_takes_an_extension_from_a_default_kind():
    fm = FieldMap.from_dict({"text": ["txt", "json"]})
    assert fm.text == ("txt", "json") and fm.conversation == ()
    assert fm.classify("json") == ("text", "json")


@pytest.mark.parametrize("data, words", [
    ({"picture": ["png"]}, ["unknown kind 'picture'", "image, audio, video, text, conversation"]),
    ({"image": ["png"], "text": ["png"]}, ["'png'", "image", "text"]),
    ({"image": "png"}, ["image", "list of extensions"]),
    ({"image": [3]}, ["image", "strings"]),
    ({"audio": ["wav.gz"]}, ["'wav.gz'"]),
    ({"text": ["gz"]}, ["'gz'"]),
    (["image"], ["mapping"]),
])
def test_from_dict_refuses_with_a_line_naming_the_problem(data, words):
    with pytest.raises(ValueError) as e:
        FieldMap.from_dict(data)
    message = str(e.value)
    assert "\n" not in message
    for w in words:
        assert w in message


def test_constructor_refuses_an_extension_in_two_kinds():
    with pytest.raises(ValueError, match="'mp4' is mapped to both audio and video; map it once"):
        FieldMap(audio=("wav", "mp4"))


def test_classify_and_ignored_labels():
    fm = FieldMap()
    assert fm.classify("0.JPG") == ("image", "jpg")
    assert fm.classify("txt.gz") == ("text", "txt")
    assert fm.classify("json.gz") == ("conversation", "json")
    assert fm.classify("jpg.gz") == (None, "jpg")  # compressed images are payload, not images
    assert fm.classify("cls") == (None, "cls")
    assert [ignored_label(s) for s in ("cls", "0.npy", "npy.gz", "")] == ["cls", "npy", "npy.gz", ""]


def _clip(fmt: str, subtype: str, rate: int) -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, (0.2 * np.sin(np.arange(rate * 2) * 0.05)).astype(np.float32), rate,
                    format=fmt, subtype=subtype)
    return buf.getvalue()


def _m4v() -> bytes:
    """An MP4 as Apple's .m4v (brand M4V), 2 s of 10 fps."""
    av = pytest.importorskip("av")
    buf = io.BytesIO()
    with av.open(buf, "w", format="ipod") as out:
        stream = out.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(20):
            frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), 10 * i, np.uint8), format="rgb24")
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return buf.getvalue()


def test_default_suffixes_of_the_formats_counted_are_counted_and_decode_as_counted(tmp_path):
    """.opus, .oga, .aiff/.aif and .m4v members were ignored by default, though their formats
    (Ogg Opus/Vorbis, AIFF, MP4) are counted and decoded."""
    from pipeline.preprocess import PreprocessConfig, preprocess_item

    members = [("k.opus", _clip("OGG", "OPUS", 48000)), ("k.oga", _clip("OGG", "VORBIS", 44100)),
               ("k.aiff", _clip("AIFF", "PCM_16", 44100)), ("k.aif", _clip("AIFF", "PCM_16", 16000)),
               ("k.m4v", _m4v()), ("k.txt", b"clips")]
    assert members[4][1][4:12] == b"ftypM4V "
    stats = ErrorStats()
    (rec,) = list(iter_shard(write_tar(tmp_path / "a.tar", members), ReaderConfig(), stats=stats))
    assert not stats.ignored_members and not stats.by_reason
    kinds = {it.member: it.modality for it in rec.items}
    assert kinds == {"opus": "audio", "oga": "audio", "aiff": "audio", "aif": "audio", "m4v": "video"}
    for it in rec.items:
        rows = preprocess_item(it.modality, rec.members[it.member], PreprocessConfig(), enc_len=it.enc_len,
                               key=rec.key, member=it.member, meta=it.meta)
        assert rows.shape[0] == it.enc_len > 0, it.member
    assert {it.member: it.enc_len for it in rec.items if it.modality == "audio"} == dict.fromkeys(
        ("opus", "oga", "aiff", "aif"), 100)  # 2 s at 50 encoder frames/s


def test_reader_classifies_by_the_field_map(tmp_path):
    sample = make_sample(4, 0)  # some real image/audio/text members
    image_suffix = next(s for s in sample if s in ("jpg", "png"))
    members = [("k0.pic", sample[image_suffix]), ("k0.caption", b"a caption of some words"),
               ("k0.cls", b"3"), ("k1.txt", b"plain text here"), ("k1.json", json.dumps({"text": "hi"}).encode())]
    shard = write_tar(tmp_path / "a.tar", members)
    default_stats = ErrorStats()
    recs = list(iter_shard(shard, ReaderConfig(), stats=default_stats))
    # Default map: pic, caption and cls unmapped, so k0 has nothing usable; k1 reads.
    assert [r.key for r in recs] == ["k1"]
    assert default_stats.by_reason == {"empty_sample": 1}
    assert default_stats.ignored_members == {"pic": 1, "caption": 1, "cls": 1}
    (reason, _, key, message), = default_stats.recent  # the skip says what to map
    assert key == "k0" and "no kind of the field map names 'caption', 'cls', 'pic'" in message

    fm = FieldMap.from_dict({"image": ["pic"], "text": ["txt", "caption"], "conversation": []})
    stats = ErrorStats()
    recs = list(iter_shard(shard, ReaderConfig(fields=fm), stats=stats))
    assert [r.key for r in recs] == ["k0", "k1"]
    assert [it.member for it in recs[0].items] == ["pic"]
    assert ByteTokenizer.decode(recs[0].tokens.ids) == "a caption of some words"
    assert ByteTokenizer.decode(recs[1].tokens.ids) == "plain text here"  # json now ignored
    assert stats.ignored_members == {"cls": 1, "json": 1}


@pytest.mark.parametrize(("member", "data", "says"), [
    ("m4a", b"\0\0\0\x20ftypM4A \0\0\0\0" + bytes(64), "this is an MP4/M4A container"),
    ("aac", b"\xff\xf1\x50\x80" + bytes(64), "this is raw AAC (ADTS)"),
    ("bmp", b"BM" + bytes(4) + bytes(4) + bytes(64), "this is BMP"),
    ("tiff", b"II*\0" + bytes(64), "this is TIFF"),
    ("heic", b"\0\0\0\x18ftypheic" + bytes(64), "this is HEIC"),
])
def test_media_in_formats_not_decoded_refuse_their_sample_naming_the_format(tmp_path, member, data, says):
    """A transcript beside its .m4a clip (or a caption beside a .bmp) trained as text alone: the
    suffix was no kind's, so the member was ignored, counted at INFO, and the docs' "refused
    naming the container" was true only after mapping it."""
    shard = write_tar(tmp_path / "a.tar", [(f"k.{member}", data), ("k.txt", b"the words said")])
    stats = ErrorStats()
    assert list(iter_shard(shard, ReaderConfig(), stats=stats)) == []
    assert not stats.ignored_members
    (reason, _, key, message), = stats.recent
    assert key == "k" and reason in ("bad_audio", "bad_image") and says in message, message
    assert "convert it" in message
    # Mapped away by the user, the member is ignored again and the text trains.
    kind = "audio" if member in REFUSED_AUDIO else "image"
    mapped = ReaderConfig(fields=FieldMap.from_dict({kind: ["wav" if kind == "audio" else "jpg"]}))
    (rec,) = list(iter_shard(shard, mapped, stats=ErrorStats()))
    assert rec.items == []


def test_a_conversation_member_under_any_suffix_is_parsed_as_json(tmp_path):
    turns = {"conversations": [{"from": "human", "value": "x" * 40}, {"from": "gpt", "value": "y" * 40}]}
    fm = FieldMap.from_dict({"conversation": ["chat"]})
    builder = SampleBuilder(ReaderConfig(fields=fm))
    rec = builder.build("k", {"chat": json.dumps(turns).encode(), "chat.gz": gzip.compress(
        json.dumps({"text": "zz"}).encode())}, "s", 0)
    chat = ("<|im_start|>user\n" + "x" * 40 + "<|im_end|>\n<|im_start|>assistant\n" + "y" * 40
            + "<|im_end|>\n")
    assert ByteTokenizer.decode(rec.tokens.ids) == chat + "zz" and rec.text_len == len(chat) + 2
    # The same bytes under a plain-text suffix are text, not a conversation.
    plain = SampleBuilder(ReaderConfig()).build("k", {"txt": json.dumps(turns).encode()}, "s", 0)
    assert ByteTokenizer.decode(plain.tokens.ids) == json.dumps(turns)


def test_json_mapped_as_text_is_read_for_its_text_field():
    """Probe: `text = ["json"]` (the kind named text, for captions in key.json) trained every
    JSON member verbatim: braces, keys and URLs."""
    builder = SampleBuilder(ReaderConfig(fields=FieldMap.from_dict({"text": ["txt", "json"]})))
    rec = builder.build("k", {"json": json.dumps({"caption": "a red car", "url": "http://x"}).encode()}, "s", 0)
    assert ByteTokenizer.decode(rec.tokens.ids) == "a red car"


def test_an_empty_text_member_does_not_shadow_a_json_caption():
    """Probe: a 0-byte .txt beside key.json {"caption": ...} trained the image on no text (the
    caption counts only where no text member holds the text; an empty one holds none)."""
    builder = SampleBuilder(ReaderConfig())
    caption = json.dumps({"caption": "the real caption"}).encode()
    rec = builder.build("k", {"txt": b"", "json": caption}, "s", 0)
    assert ByteTokenizer.decode(rec.tokens.ids) == "the real caption"
    rec = builder.build("k", {"txt": b" \n", "json": caption}, "s", 0)  # white space alone: blank
    assert ByteTokenizer.decode(rec.tokens.ids) == "the real caption"
    rec = builder.build("k", {"txt": b"said", "json": caption}, "s", 0)  # a text member: once
    assert ByteTokenizer.decode(rec.tokens.ids) == "said"
    # Inside one JSON, a field of white space holds no text either: the next field counts.
    rec = builder.build("k", {"json": json.dumps({"text": " ", "caption": "a dog"}).encode()}, "s", 0)
    assert ByteTokenizer.decode(rec.tokens.ids) == "a dog"


def test_several_text_members_joined_are_said_once(caplog):
    """Probe: COCO-style key.0.txt...key.2.txt captions trained as one run-on text, unsaid."""
    from pipeline import reader

    reader._JOINED_SAID.clear()
    builder = SampleBuilder(ReaderConfig())
    members = {"0.txt": b"A cat.", "1.txt": b"A kitten.", "2.txt": b"Feline."}
    with caplog.at_level("WARNING", logger="mmdispatch"):
        for key in ("a", "b"):
            rec = builder.build(key, members, "shard-0.tar", 0)
            assert ByteTokenizer.decode(rec.tokens.ids) == "A cat.A kitten.Feline."
        builder.build("c", {"json": json.dumps([{"role": "user", "content": "hi"},
                                                {"role": "assistant", "content": "yo"}]).encode(),
                            "txt": b"more"}, "shard-0.tar", 0)  # conversation + text: documented
    said = [r.getMessage() for r in caplog.records if "text_members_joined" in r.getMessage()]
    assert len(said) == 1 and "key=a" in said[0] and "members=0.txt,1.txt,2.txt" in said[0], said


def test_video_members_follow_the_field_map(tmp_path):
    shard = write_tar(tmp_path / "v.tar", [("k.mp4", b"\0\0\0\x18ftypisom"), ("k.txt", b"words")])
    stats = ErrorStats()
    assert list(iter_shard(shard, ReaderConfig(), stats=stats)) == []  # a video, not a valid one
    assert stats.by_reason == {"bad_video": 1} and stats.ignored_members == {}
    stats = ErrorStats()
    recs = list(iter_shard(shard, ReaderConfig(fields=FieldMap(video=())), stats=stats))
    assert len(recs) == 1 and recs[0].items == [] and stats.ignored_members == {"mp4": 1}
