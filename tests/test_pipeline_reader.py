"""Reader: grouping, item order, payload, every bad-input case under each error policy, resume."""

from __future__ import annotations

import gzip
import io
import json
import logging
import struct
import tarfile

import numpy as np
import pytest
import soundfile
from PIL import Image

from pipeline.counting import CountingConfig, TextConfig
from pipeline.errors import ErrorPolicy, ErrorStats, SampleError, TooManyErrors
from pipeline.reader import ReaderConfig, iter_samples, iter_shard
from pipeline.shards import expand_shards
from pipeline.tokenize import ByteTokenizer

POLICIES = ("raise", "skip", "warn")


def write_tar(path, members: list[tuple[str, bytes]]) -> str:
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


def jpeg(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (90, 10, 10)).save(out, "JPEG")
    return out.getvalue()


def png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("L", (width, height), 7).save(out, "PNG")
    return out.getvalue()


def wav(seconds: float, rate: int = 8000) -> bytes:
    out = io.BytesIO()
    soundfile.write(out, np.zeros(int(seconds * rate), np.float32), rate, format="WAV")
    return out.getvalue()


def good(key: str) -> list[tuple[str, bytes]]:
    return [(f"{key}.txt", b"hello world, a fine sample")]


def config(mode: str, max_consecutive: int = 100) -> ReaderConfig:
    return ReaderConfig(errors=ErrorPolicy(mode=mode, max_consecutive=max_consecutive))


def test_grouping_item_order_gz_and_payload(tmp_path):
    conv = {"conversations": [{"from": "human", "value": "x" * 40}, {"from": "gpt", "value": "y" * 40}]}
    shard = write_tar(
        tmp_path / "a.tar",
        [
            ("dir/s1.wav", wav(2.0)),
            ("dir/s1.10.jpg", jpeg(280, 280)),
            ("dir/s1.2.jpg", jpeg(56, 56)),
            ("dir/s1.img_0.png", png(560, 280)),
            ("dir/s1.txt.gz", gzip.compress(b"z" * 400)),
            ("dir/s1.cls", b"7"),
            ("dir/s2.json", json.dumps(conv).encode()),
            ("dir/s3.txt", b"abcd" * 3),
            ("noext", b"ignored member"),
        ],
    )
    stats = ErrorStats()
    recs = list(iter_shard(shard, config("raise"), stats=stats))
    assert [r.key for r in recs] == ["dir/s1", "dir/s2", "dir/s3"]
    assert [r.index for r in recs] == [0, 1, 2]
    s1 = recs[0]
    # Images first in natural name order, then audio; whatever the order in the tar.
    assert [it.member for it in s1.items] == ["2.jpg", "10.jpg", "img_0.png", "wav"]
    assert [it.modality for it in s1.items] == ["image", "image", "image", "audio"]
    assert [it.llm_len for it in s1.items] == [4, 100, 200, 50]
    # Byte-level ids by default: one per UTF-8 byte, all training targets.
    assert s1.text_len == 400 and ByteTokenizer.decode(s1.tokens.ids) == "z" * 400
    assert s1.tokens.mask.tolist() == [1] * 400
    assert s1.llm_len == 400 + 4 + 100 + 200 + 50
    assert s1.members["cls"] == b"7" and s1.members["txt.gz"][:2] == b"\x1f\x8b"
    assert s1.modality_mix == "audio+image+text"
    # The conversation through ChatML; only the assistant's content and end marker are targets.
    chat = ("<|im_start|>user\n" + "x" * 40 + "<|im_end|>\n<|im_start|>assistant\n" + "y" * 40
            + "<|im_end|>\n")
    assert ByteTokenizer.decode(recs[1].tokens.ids) == chat and recs[1].text_len == len(chat)
    assert recs[1].tokens.mask.tolist() == [0] * (len(chat) - 51) + [1] * 51 and recs[1].items == []
    assert recs[2].llm_len == 12
    assert stats.num_samples == 3 and stats.num_errors == 0 and stats.ignored_members == {"cls": 1, "": 1}


def _bad_case(tmp_path, case: str) -> tuple[str, str, int]:
    """(shard path, expected reason, number of good samples readable) for one bad-input case."""
    body = good("a0") + good("a1")
    bomb_ihdr = struct.pack(">IIBBBBB", 100000, 100000, 8, 2, 0, 0, 0)

    def chunk(kind, data):
        import zlib

        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    bomb = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", bomb_ihdr) + chunk(b"IEND", b"")
    lying = bytearray(wav(1.0))
    pos = lying.index(b"data")
    lying[pos + 4 : pos + 8] = struct.pack("<I", 10**9)
    bad_member = {
        "garbage_jpg": ("bad.jpg", b"\xff\xd8 definitely not a jpeg " * 10, "bad_image"),
        "bomb_png": ("bomb.png", bomb, "image_too_large"),
        "lying_wav": ("bad.wav", bytes(lying), "bad_audio"),
        "non_utf8": ("bad.txt", b"caf\xe9 \xff\xfe", "bad_text"),
        "bad_json": ("bad.json", b'{"text": "unterminated', "bad_json"),
    }
    if case in bad_member:
        name, data, reason = bad_member[case]
        return write_tar(tmp_path / f"{case}.tar", [*body, ("b0.txt", b"text ok"), (f"b0.{name}", data), *good("c0")]), reason, 3
    if case == "truncated":
        full = write_tar(tmp_path / "full.tar", [*body, ("b0.txt", b"q" * 5000), *good("c0")])
        data = open(full, "rb").read()
        cut = data.index(b"q" * 100) + 1000  # inside b0's data
        path = tmp_path / "truncated.tar"
        path.write_bytes(data[:cut])
        return str(path), "truncated_tar", 2
    if case == "garbage_tar":
        path = tmp_path / "garbage.tar"
        path.write_bytes(b"\x07" * 4096)
        return str(path), "bad_tar", 0
    if case == "empty_tar":
        return write_tar(tmp_path / "empty.tar", []), "empty_shard", 0
    if case == "zero_bytes":
        path = tmp_path / "zero.tar"
        path.write_bytes(b"")
        return str(path), "empty_shard", 0
    if case == "duplicate_key":
        return write_tar(tmp_path / "dup.tar", [*body, *good("c0"), ("a0.txt", b"again")]), "duplicate_key", 3
    if case == "missing":
        return str(tmp_path / "missing-shard-042.tar"), "open_failed", 0
    raise AssertionError(case)


CASES = (
    "garbage_jpg", "bomb_png", "lying_wav", "non_utf8", "bad_json",
    "truncated", "garbage_tar", "empty_tar", "zero_bytes", "duplicate_key", "missing",
)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mode", POLICIES)
def test_bad_input_under_each_policy(tmp_path, caplog, case, mode):
    shard, reason, num_good = _bad_case(tmp_path, case)
    stats = ErrorStats()
    if mode == "raise":
        with pytest.raises(SampleError) as err:
            list(iter_shard(shard, config(mode), stats=stats))
        assert err.value.reason == reason and err.value.shard == shard
        assert shard in str(err.value)
        assert stats.by_reason == {reason: 1}
        return
    with caplog.at_level(logging.WARNING, logger="mmdispatch.pipeline"):
        recs = list(iter_shard(shard, config(mode), stats=stats))
    assert len(recs) == num_good
    assert stats.num_samples == num_good
    assert stats.num_errors == 1 and stats.by_reason == {reason: 1}
    (got_reason, got_shard, key, message) = stats.recent[-1]
    assert got_reason == reason and got_shard == shard and message
    if case in ("garbage_jpg", "bomb_png", "lying_wav", "non_utf8", "bad_json"):
        assert key == "b0"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    if mode == "warn":
        assert len(warnings) == 1 and shard in warnings[0].getMessage()
    else:
        assert warnings == []


def test_missing_shard_path_named_by_expand(tmp_path):
    missing = str(tmp_path / "missing-shard-042.tar")
    with pytest.raises(FileNotFoundError, match="missing-shard-042.tar"):
        expand_shards([missing])


def test_a_shard_file_whose_name_holds_glob_characters_is_named_by_its_path(tmp_path):
    shard = write_tar(tmp_path / "shard[1].tar", good("a"))
    assert expand_shards([shard]) == [shard]
    with pytest.raises(FileNotFoundError, match=r"named by its exact path"):
        expand_shards([str(tmp_path / "shard[2].tar")])


def test_an_unexpected_counting_error_skips_that_sample_and_logs_its_traceback_once(
        tmp_path, monkeypatch, caplog):
    from pipeline.reader import SampleBuilder

    shard = write_tar(tmp_path / "s.tar", [*good("a"), *good("b"), *good("c"), *good("d")])
    build = SampleBuilder.build

    def defective(self, key, members, shard, index, unused=None):  # a bug some samples reach
        if key in ("b", "c"):
            raise ZeroDivisionError("a defect")
        return build(self, key, members, shard, index, unused)

    monkeypatch.setattr(SampleBuilder, "build", defective)
    stats = ErrorStats()
    with caplog.at_level(logging.ERROR, logger="mmdispatch.pipeline"):
        keys = [r.key for r in iter_shard(shard, config("skip"), stats=stats)]
    assert keys == ["a", "d"] and stats.by_reason == {"count_failed": 2}
    assert [(r, k) for r, _, k, _ in stats.recent] == [("count_failed", "b"), ("count_failed", "c")]
    assert "ZeroDivisionError: a defect" in stats.recent[0][3]
    logged = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(logged) <= 1 and all(r.exc_info for r in logged)  # once per process and error type
    with pytest.raises(SampleError, match="count_failed"):
        list(iter_shard(shard, config("raise")))


def test_json_without_a_text_field_is_tallied_beside_the_ignored_members(tmp_path):
    from collections import Counter

    shard = write_tar(tmp_path / "s.tar", [
        ("a.jpg", jpeg(32, 32)), ("a.json", b'{"prompt": "describe", "response": "red"}'),
        ("b.json", b'{"url": "http://x"}'), ("b.txt", b"a caption"),
        ("c.json", b'{"prompt": "only metadata here"}'),
        ("d.json", b'{"caption": "counted"}')])
    stats, ignored = ErrorStats(), Counter()
    records = list(iter_shard(shard, config("skip"), stats=stats, ignored=ignored))
    assert [r.key for r in records] == ["a", "b", "d"]
    assert records[0].text_len == 0 and records[1].text_len > 0 and records[2].text_len > 0
    assert ignored == {"json (no text field)": 3} and stats.ignored_members == ignored
    ((reason, _, key, message),) = stats.recent
    assert (reason, key) == ("empty_sample", "c") and "--json-field" in message
    # With the field named, the same JSON is text.
    named = ReaderConfig(counting=CountingConfig(text=TextConfig(json_fields=("prompt",))))
    texts = {r.key: r.text_len for r in iter_shard(shard, named)}
    assert list(texts) == ["a", "b", "c"] and all(texts.values())


def test_a_shard_whose_samples_hold_no_text_beside_text_less_json_is_said_once(
        tmp_path, caplog, monkeypatch):
    """Probe: OBELICS-style documents (images and a JSON of `texts`) trained as their images
    alone, on no token, with only an INFO tally to tell; the reference trainer ran to its end
    at loss 0.0."""
    import pipeline.reader as reader_module

    monkeypatch.setattr(reader_module, "_TEXTLESS_SAID", [])
    doc = b'{"texts": ["A cat", null, "sits."], "images": [null, "u", null]}'
    shards = [write_tar(tmp_path / f"o{i}.tar", [(f"d{i}{k}.1.jpg", jpeg(32, 32)) if j == 0 else
                                                  (f"d{i}{k}.json", doc)
                                                  for k in range(3) for j in range(2)])
              for i in range(2)]
    with caplog.at_level(logging.WARNING, logger="mmdispatch"):
        records = [r for url in shards for r in iter_shard(url, config("skip"))]
    assert len(records) == 6 and not any(r.text_len for r in records)
    said = [r.getMessage() for r in caplog.records if "samples_without_text" in r.getMessage()]
    assert len(said) == 1 and f"shard={shards[0]} samples=3" in said[0], said
    assert "members='json (no text field)'" in said[0] and "--json-field" in said[0]
    captioned = write_tar(tmp_path / "c.tar", [("e.jpg", jpeg(32, 32)), ("e.json", doc),
                                               ("e.txt", b"a caption")])
    monkeypatch.setattr(reader_module, "_TEXTLESS_SAID", [])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mmdispatch"):
        assert [r.text_len > 0 for r in iter_shard(captioned, config("skip"))] == [True]
    assert "samples_without_text" not in caplog.text  # metadata JSON beside a caption


def test_an_empty_text_member_beside_media_is_tallied_as_an_empty_json_field_is(tmp_path):
    """Probe: a FLAC with a 0-byte .txt transcript (a silence segment) was delivered with no
    text and no line anywhere, while the same emptiness in a JSON was tallied."""
    from collections import Counter

    shard = write_tar(tmp_path / "s.tar", [("a.jpg", jpeg(32, 32)), ("a.txt", b""),
                                           ("b.jpg", jpeg(32, 32)), ("b.txt", b"a caption"),
                                           ("c.txt", b""),
                                           # a 0-byte JSON (a writer killed mid-way) alike: it
                                           # dropped the image as bad_json (probe)
                                           ("d.jpg", jpeg(32, 32)), ("d.json", b"")])
    stats, ignored = ErrorStats(), Counter()
    records = list(iter_shard(shard, config("skip"), stats=stats, ignored=ignored))
    assert [(r.key, r.text_len > 0) for r in records] == [("a", False), ("b", True), ("d", False)]
    # a's and c's (c skipped as empty_sample), d's
    assert ignored == {"txt (empty)": 2, "json (empty)": 1}
    ((reason, _, key, message),) = stats.recent
    assert (reason, key) == ("empty_sample", "c") and "text member 'txt' is empty" in message


def test_json_with_its_text_field_empty_or_of_a_wrong_type_says_so(tmp_path):
    from collections import Counter

    shard = write_tar(tmp_path / "s.tar", [
        ("cap.json", b'{"caption": ""}'), ("conv.json", b'{"conversations": []}'), ("nul.json", b'{"text": null}'),
        ("img.jpg", jpeg(32, 32)), ("img.json", b'{"caption": "", "url": "http://x"}'),
        ("num.json", b'{"caption": 5}'), ("obj.json", b'{"messages": {"role": "user"}}'), ("top.json", b"5"),
        ("ok.json", b'{"caption": "fine"}')])
    stats, ignored = ErrorStats(), Counter()
    records = list(iter_shard(shard, config("skip"), stats=stats, ignored=ignored))
    assert [r.key for r in records] == ["img", "ok"]
    assert ignored == {"json (empty text field)": 4}  # present, but no text: not "no text field"
    got = {key: (reason, message) for reason, _, key, message in stats.recent}
    for key, field, value in (("cap", "caption", '""'), ("conv", "conversations", "[]"), ("nul", "text", "null")):
        reason, message = got[key]
        assert reason == "empty_sample" and f"JSON 'json' field '{field}' is empty ({value})" in message
        assert "holds none of the text fields" not in message and "--json-field" not in message
    assert got["num"] == ("bad_json", "member 'json' field 'caption' holds a number (5), expected text or turns")
    assert got["obj"][1] == "member 'json' field 'messages' holds an object, expected text or turns"
    assert got["top"][1] == "member 'json' holds a number (5), expected an object or a list of turns"


def test_an_empty_text_member_or_an_empty_list_of_turns_is_named(tmp_path):
    """A 0-byte .txt or a JSON `[]` was only "no countable text ... among members ['txt']",
    while an empty JSON field was named: each is named too."""
    shard = write_tar(tmp_path / "s.tar", [
        ("none.txt", b""), ("bom.txt", b"\xef\xbb\xbf"), ("top.json", b"[]"), ("ok.txt", b"fine")])
    stats = ErrorStats()
    assert [r.key for r in iter_shard(shard, config("skip"), stats=stats)] == ["ok"]
    got = {key: (reason, message) for reason, _, key, message in stats.recent}
    assert got["none"][0] == got["top"][0] == "empty_sample"
    assert got["none"][1].endswith("among members ['txt']; text member 'txt' is empty")
    assert got["top"][1].endswith("among members ['json']; JSON 'json' is an empty list")
    assert got["bom"][1].endswith("; text member 'txt' is empty")  # a byte-order mark says nothing


def test_library_messages_name_the_member_not_a_buffer_address(tmp_path):
    shard = write_tar(tmp_path / "s.tar", [("a.jpg", b"junk"), *good("a"), ("b.mp3", b"\x00junk" * 9),
                                           *good("b")])
    stats = ErrorStats()
    list(iter_shard(shard, config("skip"), stats=stats))
    messages = [m for _, _, _, m in stats.recent]
    assert len(messages) == 2 and not any("BytesIO" in m or "0x" in m for m in messages), messages


def test_consecutive_failure_limit(tmp_path):
    members = [(f"k{i}.jpg", b"garbage") for i in range(5)]
    shard = write_tar(tmp_path / "bad.tar", members)
    with pytest.raises(TooManyErrors, match="3 consecutive"):
        list(iter_shard(shard, config("skip", max_consecutive=2)))
    # Successes in between reset the run.
    mixed = write_tar(tmp_path / "mixed.tar", [m for i, m in enumerate(members) for m in (m, *good(f"g{i}"))])
    stats = ErrorStats()
    assert len(list(iter_shard(mixed, config("skip", max_consecutive=2), stats=stats))) == 5
    assert stats.by_reason == {"bad_image": 5}


def test_start_index_resumes_mid_shard(small_shards):
    shard = small_shards[0]
    full = list(iter_shard(shard))
    assert len(full) > 5
    for start in (0, 1, 5, len(full)):
        tail = list(iter_shard(shard, start_index=start))
        assert [(r.key, r.index, r.llm_len) for r in tail] == [(r.key, r.index, r.llm_len) for r in full[start:]]
    # Fewer samples than the resume point: not the file that was read, reported as such.
    with pytest.raises(SampleError, match="shard_changed.*resumes at sample"):
        list(iter_shard(shard, config("raise"), start_index=len(full) + 1))
    stats = ErrorStats()
    assert list(iter_shard(shard, config("skip"), start_index=len(full) + 1, stats=stats)) == []
    assert stats.by_reason == {"shard_changed": 1}


def test_start_index_counts_failed_samples(tmp_path):
    shard = write_tar(tmp_path / "s.tar", [*good("a"), ("b.jpg", b"junk"), *good("c"), *good("d")])
    all_ok = [(r.key, r.index) for r in iter_shard(shard, config("skip"))]
    assert all_ok == [("a", 0), ("c", 2), ("d", 3)]
    assert [(r.key, r.index) for r in iter_shard(shard, config("skip"), start_index=2)] == [("c", 2), ("d", 3)]


def test_small_shards_read_clean(small_shards):
    from tests.conftest import SMALL_NUM_SAMPLES

    stats = ErrorStats()
    recs = list(iter_samples(small_shards, config("raise"), stats=stats))
    assert len(recs) == SMALL_NUM_SAMPLES == stats.num_samples
    assert len({r.key for r in recs}) == len(recs)
    for r in recs:
        assert r.llm_len == r.text_len + sum(it.llm_len for it in r.items) > 0
        for it in r.items:
            assert it.member in r.members and it.enc_len >= it.llm_len > 0
    assert {"text", "image+text"} <= {r.modality_mix for r in recs}
    assert any(len([i for i in r.items if i.modality == "image"]) > 1 for r in recs)
    assert any(i.modality == "audio" for r in recs for i in r.items)


def test_keep_members_false_drops_bytes(small_shards):
    recs = list(iter_shard(small_shards[0], ReaderConfig(keep_members=False)))
    assert recs and all(r.members == {} for r in recs)


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT])
def test_tar_members_match_tarfile(tmp_path, fmt):
    from pipeline.tario import tar_members

    long_dir = "d" * 90 + "/" + "e" * 60 if fmt != tarfile.USTAR_FORMAT else "d" * 90
    members = [(f"{long_dir}/k{i}.{'txt' if i % 2 else 'bin'}", bytes([i]) * (i * 300)) for i in range(6)]
    path = tmp_path / "t.tar"
    with tarfile.open(path, "w", format=fmt) as tar:
        info = tarfile.TarInfo("adir")
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with open(path, "rb") as f:
        assert list(tar_members(f)) == members


def test_header_lying_about_huge_size_fails_without_allocating(tmp_path):
    import tracemalloc

    from pipeline.tario import TarError, tar_members

    info = tarfile.TarInfo("k.txt")
    info.size = 1 << 40  # 1 TiB declared, 100 bytes present
    data = info.tobuf(format=tarfile.GNU_FORMAT) + b"x" * 100
    tracemalloc.start()
    try:
        with pytest.raises(TarError, match="declares") as err:
            list(tar_members(io.BytesIO(data)))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert err.value.reason == "truncated_tar" and err.value.member == "k.txt"
    assert peak < 256 << 20


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT])
def test_mapped_shard_yields_the_same_members_as_views(tmp_path, fmt):
    from pipeline.shards import MappedShard
    from pipeline.tario import tar_members

    long_dir = "d" * 90 + "/" + "e" * 60 if fmt != tarfile.USTAR_FORMAT else "d" * 90
    members = [(f"{long_dir}/k{i}.bin", bytes([i]) * (i * 3000)) for i in range(6)]
    path = str(tmp_path / "t.tar")
    with tarfile.open(path, "w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with MappedShard(path) as shard:
        got = list(tar_members(shard))
    # Equal bytes; long members are read-only views of the map that outlive close().
    assert [(n, bytes(d)) for n, d in got] == members
    views = [d for _, d in got if len(d) > 4096]
    assert views and all(isinstance(d, memoryview) and d.readonly for d in views)
    assert bytes(views[-1]) == members[-1][1]


def test_mapped_and_streamed_reads_give_identical_records(small_shards):
    def records(map_shards):
        out = []
        for r in iter_samples(small_shards, ReaderConfig(map_shards=map_shards)):
            out.append((r.key, r.index, r.items, r.text_len, r.tokens.to_wire(),
                        {k: bytes(v) for k, v in r.members.items()}))
        return out

    mapped, streamed = records(True), records(False)
    assert mapped == streamed and len(mapped) > 10


def test_empty_and_truncated_files_read_through_the_map_fail_as_streams_do(tmp_path):
    empty = tmp_path / "empty.tar"
    empty.write_bytes(b"")
    full = write_tar(tmp_path / "full.tar", good("a") + [("b.txt", b"x" * 9000)] + good("c"))
    cut = tmp_path / "cut.tar"
    cut.write_bytes(open(full, "rb").read()[:2000])  # inside b.txt
    for map_shards in (True, False):
        stats = ErrorStats()
        cfg = ReaderConfig(errors=ErrorPolicy(mode="skip"), map_shards=map_shards)
        keys = [r.key for r in iter_samples([str(empty), str(cut), full], cfg, stats=stats)]
        assert keys == ["a", "a", "b", "c"]
        assert stats.by_reason == {"empty_shard": 1, "truncated_tar": 1}
        cut_line = next(r[3] for r in stats.recent if r[0] == "truncated_tar")
        assert "declares 9000 bytes but the archive ends" in cut_line and "bytes into it" in cut_line


@pytest.mark.parametrize("start_index", [0, 1])
def test_a_shards_identity_tells_copies_apart_over_its_whole_walk(tmp_path, start_index):
    """Two nodes' copies of one shard: the same bytes give the same identity, whichever sample
    a reader starts at (a shard taken over is walked whole); other members or sizes another.
    Complete only once the archive's end was read."""
    from pipeline.tario import CopyIdentity

    def identity(path, start=start_index) -> CopyIdentity:
        ident = CopyIdentity()
        list(iter_shard(path, start_index=start, identity=ident))
        return ident

    one = [("a.txt", b"hello"), ("b.txt", b"world"), ("c.txt", b"again")]
    first = identity(write_tar(tmp_path / "one.tar", one), 0)
    same = identity(write_tar(tmp_path / "same.tar", one))
    other = identity(write_tar(tmp_path / "other.tar", one[:2] + [("c.txt", b"changed")]))
    assert first.complete and same.complete
    assert same.to_wire() == first.to_wire() and other.to_wire() != first.to_wire()
    cut = CopyIdentity()
    next(iter_shard(str(tmp_path / "one.tar"), identity=cut))  # a walk stopped midway
    assert not cut.complete


def _mixed_format_tar(path, members: list[tuple[str, bytes, int]]) -> str:
    """A tar of (name, bytes, tarfile format) members, each header written in its own format:
    pax (a long or non-ASCII name takes a pax header), GNU (a long name takes a longname
    member) or ustar, as archives written by several tools hold them."""
    out = bytearray()
    for name, data, fmt in members:
        info = tarfile.TarInfo(name)
        info.size, info.mtime = len(data), 1_700_000_000
        out += info.tobuf(fmt, "utf-8", "surrogateescape")
        out += data + bytes(-len(data) % 512)
    out += bytes(1024)
    with open(path, "wb") as f:
        f.write(out)
    return str(path)


def _resume_corpus(tmp_path) -> str:
    long_dir = "d" * 120  # past ustar's 100-character name: a pax or GNU longname header
    pax, gnu, ustar = tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT
    return _mixed_format_tar(tmp_path / "mixed.tar", [
        ("a.txt", b"first sample", ustar),
        (f"{long_dir}/b.txt", b"pax long name", pax),
        (f"{long_dir}/b.json", b'{"caption": "meta"}', pax),
        ("c.jpg", b"not an image", ustar),  # skipped: bad_image
        (f"{long_dir}/e.txt", b"gnu long name", gnu),
        (f"{long_dir}/e.xyz", b"an ignored member", gnu),
        ("._f.txt", b"a macOS AppleDouble file", ustar),  # ignored, between two samples
        ("f.txt", b"after a dot file", ustar),
        ("g\u00e9.txt", b"non-ascii name, pax", pax),
        ("h.jpg", b"", ustar),  # skipped: bad_image
        ("i.txt", b"last but one", gnu),
        ("j.txt", b"last", ustar),
    ])


@pytest.mark.parametrize("mapped", [True, False])
def test_a_shard_resumed_at_an_offset_reads_as_resumed_at_its_index(tmp_path, mapped):
    """Resume points (`resume_points`): every sample says where the next one begins (its first
    header block, pax and GNU longname headers included), skipped ones too; a walk started at
    such an offset, numbering from that index, yields exactly the records and skips of a walk
    of the shard from byte 0 resumed at the index, references' file offsets included."""
    shard = _resume_corpus(tmp_path)
    base = ReaderConfig(errors=ErrorPolicy(mode="skip"), map_shards=mapped)
    next_at: dict[int, int] = {}
    skips: list = []

    def heard(error, index, at=None):
        skips.append((error.key, error.reason, index))
        next_at[index] = at

    full = list(iter_shard(shard, base, spans=True, resume_points=True, on_skip=heard))
    for rec in full:
        next_at[rec.index] = rec.next_at
    assert [r.key for r in full] == ["a", "d" * 120 + "/b", "d" * 120 + "/e", "f", "g\u00e9", "i", "j"]
    assert [s[1:] for s in skips] == [("bad_image", 2), ("bad_image", 6)]
    assert sorted(next_at) == list(range(9))
    data = open(shard, "rb").read()
    # each offset is a header block: b's pax header, e's GNU longname, the end of the archive
    assert data[next_at[0] + 156:next_at[0] + 157] == b"x"
    assert data[next_at[2] + 156:next_at[2] + 157] == b"L"
    assert next_at[8] == len(data) - 1024 and data[next_at[8]:] == bytes(1024)

    def walk(**kw):
        got_skips: list = []
        recs = list(iter_shard(shard, base, spans=True, on_skip=lambda e, i: got_skips.append(
            (e.key, e.reason, i)), **kw))
        return ([(r.key, r.index, r.text_len, r.llm_len, bytes(r.tokens.ids), r.spans,
                  {k: bytes(v) for k, v in r.members.items()}) for r in recs], got_skips)

    for index in range(9):  # the last: the archive's end, where nothing is left to read
        start = index + 1
        from_offset = walk(start_index=start, offset=next_at[index])
        assert from_offset == walk(start_index=start), start
        assert bool(from_offset[0] or from_offset[1]) == (index < 8)


def test_a_walk_from_an_offset_starts_there_and_says_no_identity(tmp_path, monkeypatch):
    """A resumed walk reads no header before its offset (so costs nothing for the samples
    before it), and, not walking the whole copy, leaves the shard's identity incomplete."""
    import pipeline.reader as reader
    from pipeline.tario import CopyIdentity

    shard = _resume_corpus(tmp_path)
    base = ReaderConfig(errors=ErrorPolicy(mode="skip"))
    recs = list(iter_shard(shard, base, resume_points=True))
    f = next(r for r in recs if r.key == "f")
    starts, walked = [], []
    real = reader.tar_members

    def spy(stream, *args, **kw):
        starts.append(kw.get("start", 0))
        for name, data in real(stream, *args, **kw):
            walked.append(name)
            yield name, data
    monkeypatch.setattr(reader, "tar_members", spy)
    whole, part = CopyIdentity(), CopyIdentity()
    list(iter_shard(shard, base, start_index=f.index, identity=whole))
    assert whole.complete and walked[0] == "a.txt"
    walked.clear()
    got = list(iter_shard(shard, base, start_index=f.index + 1, offset=f.next_at, identity=part))
    assert starts[-1] == f.next_at and walked[0] == "g\u00e9.txt" and not part.complete
    assert [r.key for r in got] == ["g\u00e9", "i", "j"]


def test_an_offset_holding_no_header_walks_the_shard_from_its_start(tmp_path, caplog):
    """An offset where no tar header lies (the file changed, a stale offset) is logged and the
    shard walked from byte 0: the same samples, none lost or repeated."""
    shard = _resume_corpus(tmp_path)
    base = ReaderConfig(errors=ErrorPolicy(mode="skip"))
    recs = list(iter_shard(shard, base, resume_points=True))
    want = [(r.key, r.index) for r in recs[2:]]
    for bad in (recs[1].next_at + 7, recs[1].next_at + 512, 10 ** 9):
        with caplog.at_level(logging.WARNING, logger="mmdispatch"):
            got = [(r.key, r.index) for r in iter_shard(shard, base, start_index=recs[1].index + 1,
                                                          offset=bad)]
        assert got == want, bad
    assert caplog.text.count("event=resume_offset_refused") == 3
    # zeros inside a member (silence) are not the archive's end: more bytes follow them
    quiet = write_tar(tmp_path / "quiet.tar", [("a.txt", b"one"), ("a.bin", bytes(4096)),
                                               ("b.txt", b"two")])
    at = 512 * 3  # a.txt's header and block, a.bin's header: the zeros of a.bin
    assert [(r.key, r.index) for r in iter_shard(quiet, base, start_index=1, offset=at)] == [("b", 1)]
    assert caplog.text.count("event=resume_offset_refused") == 4
    # a gzip shard is not read at an offset: walked from its start, as resumed by index
    gz = tmp_path / "mixed.tar.gz"
    gz.write_bytes(gzip.compress(open(shard, "rb").read()))
    assert [(r.key, r.index) for r in iter_shard(str(gz), base, resume_points=True)] == \
        [(r.key, r.index) for r in recs]
    assert all(r.next_at == -1 for r in iter_shard(str(gz), base, resume_points=True))
    assert [(r.key, r.index) for r in iter_shard(str(gz), base, start_index=recs[1].index + 1,
                                                 offset=recs[1].next_at)] == want
