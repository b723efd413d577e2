"""Issue 7, bad input: every case of the broken-shard corpus under every error policy.

Each broken shard is read followed by a healthy one: under skip/warn exactly the good samples
come out, each failure is counted once with its shard and key (or its shard, for shard-level
faults), and reading goes on; under raise the exception names shard and key. Plus a seeded
mutation fuzz (nothing escapes, nothing is lost silently) and memory bounds for huge members.
"""

from __future__ import annotations

import collections
import gzip
import io
import logging
import os
import random
import tracemalloc

import numpy as np
import pytest
import soundfile
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from pipeline.counting import CountError, Counter, CountingConfig, TextConfig
from pipeline.errors import REASONS, ErrorPolicy, ErrorStats, SampleError, TooManyErrors
from pipeline.reader import ReaderConfig, iter_samples, iter_shard
from tests import badcorpus
from tests.badcorpus import CASE_NAMES, HUGE_TEXT_BYTES, CorpusShard

# Several cases once looped forever; a hang must fail fast, not at the suite's 300 s limit.
pytestmark = pytest.mark.timeout(60)


def _config(mode: str, max_consecutive: int = 100, **kwargs) -> ReaderConfig:
    return ReaderConfig(errors=ErrorPolicy(mode=mode, max_consecutive=max_consecutive), **kwargs)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, CorpusShard]:
    return badcorpus.write_corpus(str(tmp_path_factory.mktemp("badcorpus")))


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> tuple[str, tuple[str, ...]]:
    return badcorpus.write_clean_shard(str(tmp_path_factory.mktemp("clean")), "after")


def test_corpus_covers_the_issue_and_documents_its_reasons(corpus):
    reasons = {c.reason for c in corpus.values()}
    assert reasons - {"ok"} <= set(REASONS)
    # The issue's list: truncated tars, header checksums, zero-length members, gzip garbage,
    # lying or bomb images, impossible audio, non-UTF-8 and huge text, duplicate keys.
    assert {
        "truncated_tar", "bad_tar", "empty_sample", "bad_gzip", "bad_image", "image_too_large",
        "bad_audio", "bad_video", "bad_text", "text_too_large", "duplicate_key", "bad_key", "ok",
    } <= reasons
    assert os.path.getsize(corpus["txt_huge"].path) > HUGE_TEXT_BYTES
    for c in corpus.values():
        # Bad samples sit among good ones, except in the shards unreadable from byte 0.
        assert c.good_keys or c.case in ("tar_gz_not_gzip", "tar_gz_garbage", "tar_gzip_named_tar"), c.case
        assert (c.bad_key is None) == (c.reason == "ok" or c.reason in ("truncated_tar", "bad_tar")), c.case


@pytest.mark.parametrize("mode, map_shards", [("skip", True), ("warn", True), ("skip", False)])
@pytest.mark.parametrize("name", CASE_NAMES)
def test_case_yields_good_samples_counts_the_bad_one_and_reads_on(corpus, clean, caplog, name, mode,
                                                                  map_shards):
    case = corpus[name]
    clean_path, clean_keys = clean
    stats = ErrorStats()
    with caplog.at_level(logging.WARNING, logger="mmdispatch.pipeline"):
        records = list(iter_samples([case.path, clean_path], _config(mode, map_shards=map_shards),
                                    stats=stats))
    assert [r.key for r in records] == [*case.good_keys, *clean_keys]
    assert [r.shard for r in records] == [case.path] * len(case.good_keys) + [clean_path] * len(clean_keys)
    assert stats.num_samples == len(records) and stats.num_shards == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if case.reason == "ok":
        # An archive without end blocks is read whole, and said once (its last sample may be cut).
        unterminated = [case.path in w and "end-of-archive" in w for w in warnings]
        assert stats.num_errors == 0 and unterminated == ([True] if name == "tar_no_end_blocks" else [])
        return
    assert stats.by_reason == {case.reason: 1}
    ((reason, shard, key, message),) = stats.recent
    assert (reason, shard, key) == (case.reason, case.path, case.bad_key)
    # Error records travel to the dispatcher as UTF-8 (msgpack): they must encode.
    message.encode("utf-8")
    if key is None:
        assert "lost" in message  # a shard-level fault says the rest of the shard is gone
    if mode == "warn":
        assert len(warnings) == 1 and case.path in warnings[0]
        # the key is a field of the event line (quoted with escapes where it needs them)
        assert case.bad_key is None or f"key={case.bad_key} " in warnings[0] \
            or f"key={case.bad_key!r} " in warnings[0]
    else:
        assert warnings == []


def test_the_fix_is_named_for_a_gzip_shard_named_tar_and_for_nonadjacent_members(corpus, tmp_path):
    stats = ErrorStats()
    assert list(iter_shard(corpus["tar_gzip_named_tar"].path, _config("skip"), stats=stats)) == []
    ((_, _, _, message),) = stats.recent
    assert "gzip-compressed" in message and ".tar.gz" in message
    # A plain `tar -c` of a directory may split a key's members: the later ones say why.
    path = str(tmp_path / "unsorted.tar")
    with open(path, "wb") as f:
        f.write(badcorpus.tar_bytes([("s0.txt", b"zero"), ("s1.txt", b"one"), ("s0.jpg", badcorpus.jpeg(8, 8))]))
    stats = ErrorStats()
    assert [r.key for r in iter_shard(path, _config("skip"), stats=stats)] == ["s0", "s1"]
    ((reason, _, key, message),) = stats.recent
    assert (reason, key) == ("duplicate_key", "s0") and "adjacent" in message and "--sort=name" in message


@pytest.mark.parametrize("name", CASE_NAMES)
def test_case_under_raise_names_shard_and_key(corpus, name):
    case = corpus[name]
    stats = ErrorStats()
    seen: list[str] = []
    if case.reason == "ok":
        seen = [r.key for r in iter_shard(case.path, _config("raise"), stats=stats)]
        assert seen == list(case.good_keys)
        return
    with pytest.raises(SampleError) as err:
        for record in iter_shard(case.path, _config("raise"), stats=stats):
            seen.append(record.key)
    e = err.value
    assert (e.reason, e.shard, e.key) == (case.reason, case.path, case.bad_key)
    assert case.path in str(e) and case.reason in str(e)
    if case.bad_key is not None:
        assert repr(case.bad_key) in str(e)
    # Samples before the failure came out, then the raise stopped the shard.
    assert seen == list(case.good_keys[: case.num_before_bad])


def test_whole_corpus_in_one_pass(corpus, clean):
    paths = [c.path for c in corpus.values()] + [clean[0]]
    stats = ErrorStats()
    keys = [r.key for r in iter_samples(paths, _config("skip"), stats=stats)]
    assert keys == [k for c in corpus.values() for k in c.good_keys] + list(clean[1])
    expected = collections.Counter(c.reason for c in corpus.values() if c.reason != "ok")
    assert stats.by_reason == expected and stats.num_errors == sum(expected.values())
    assert stats.num_shards == len(paths) and stats.num_samples == len(keys)


def test_ok_cases_count_what_is_there(corpus):
    def only(name):
        (rec,) = [r for r in iter_shard(corpus[name].path, _config("raise")) if r.key.endswith("_bad")]
        return rec

    rec = only("zero_txt_with_image")
    assert rec.text_len == 0 and [it.modality for it in rec.items] == ["image"] and rec.llm_len == rec.items[0].llm_len
    assert only("zero_cls_with_text").members["cls"] == b""
    assert only("jpeg_trailing_bytes").items[0].meta["width"] == 64
    assert only("png_trailing_bytes").items[0].meta["height"] == 48
    assert only("txt_large_ok").text_len == 5 * ((1 << 20) // 5)  # byte-level ids: one per byte


def _pillow_images() -> list[tuple[str, bytes]]:
    rng = np.random.default_rng(11)
    rgb = Image.fromarray(rng.integers(0, 256, (90, 120, 3), dtype=np.uint8))
    variants = [
        ("JPEG", {}), ("JPEG", {"progressive": True}), ("JPEG", {"exif": _exif_with_thumbnail()}),
        ("PNG", {}), ("PNG", {"optimize": True}), ("GIF", {}),
        ("GIF", {"save_all": True, "append_images": [rgb.rotate(90), rgb.rotate(180)], "comment": b"hi"}),
    ]
    out = []
    for fmt, kwargs in variants:
        buf = io.BytesIO()
        rgb.save(buf, fmt, **kwargs)
        out.append((fmt, buf.getvalue()))
    return out


def _exif_with_thumbnail() -> bytes:
    # An EXIF block holding a whole JPEG thumbnail, with its own scan and end marker: a cut
    # main image must not pass for whole because the thumbnail's markers are found.
    thumb = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 0, 0)).save(thumb, "JPEG")
    exif = Image.Exif()
    exif[0x010E] = "thumbnail follows"
    data = exif.tobytes()
    return data + thumb.getvalue()


def _decodes(data: bytes) -> bool:
    try:
        with Image.open(io.BytesIO(data)) as im:
            for frame in range(getattr(im, "n_frames", 1)):
                im.seek(frame)
                im.load()
    except Exception:
        return False
    return True


def test_image_framing_checks_accept_whole_files_and_refuse_undecodable_cuts():
    counter = Counter(CountingConfig())
    for fmt, data in _pillow_images():
        assert counter.image(data)[2]["format"] == fmt  # no false alarm on any whole file
        for cut in (len(data) // 5, len(data) // 2, len(data) - 40):
            if not _decodes(data[:cut]):  # what a trainer could not decode is never accepted
                with pytest.raises(CountError) as err:
                    counter.image(data[:cut])
                assert err.value.reason == "bad_image", (fmt, cut)


def _shard_fault_copies(tmp_path, count: int) -> list[str]:
    """`count` shards that each fail whole (not gzip although named .tar.gz)."""
    paths = []
    for i in range(count):
        out = tmp_path / f"copy{i}"
        out.mkdir()
        paths.append(badcorpus.write_case(str(out), "tar_gz_not_gzip").path)
    return paths


@pytest.mark.parametrize("mode", ["skip", "warn"])
def test_consecutive_failures_across_shards_stop_the_reader(tmp_path, clean, mode):
    broken = _shard_fault_copies(tmp_path, 3)
    stats = ErrorStats()
    with pytest.raises(TooManyErrors, match="3 consecutive") as err:
        list(iter_samples(broken, _config(mode, max_consecutive=2), stats=stats))
    assert broken[2] in str(err.value) and stats.by_reason == {"bad_tar": 3}
    # A good sample in between resets the run: two failures, a healthy shard, one more.
    stats = ErrorStats()
    urls = [*broken[:2], clean[0], broken[2]]
    keys = [r.key for r in iter_samples(urls, _config(mode, max_consecutive=2), stats=stats)]
    assert keys == list(clean[1]) and stats.by_reason == {"bad_tar": 3}


def test_consecutive_failures_count_bad_samples_across_a_shard_boundary(tmp_path):
    from tests.badcorpus import jpeg, tar_bytes

    bad_tail = tmp_path / "tail.tar"
    bad_tail.write_bytes(tar_bytes([("a.txt", b"fine"), ("b.jpg", b""), ("c.wav", b"")]))
    bad_head = tmp_path / "head.tar"
    bad_head.write_bytes(tar_bytes([("d.png", b"\x89PNG"), ("e.jpg", jpeg(20, 20)[:100]), ("f.txt", b"ok")]))
    with pytest.raises(TooManyErrors, match="4 consecutive"):
        list(iter_samples([str(bad_tail), str(bad_head)], _config("skip", max_consecutive=3)))
    stats = ErrorStats()
    urls = [str(bad_tail), str(bad_head)]
    keys = [r.key for r in iter_samples(urls, _config("skip", max_consecutive=4), stats=stats)]
    assert keys == ["a", "f"] and stats.by_reason == {"bad_image": 3, "bad_audio": 1}


def test_huge_text_is_rejected_before_decoding(corpus):
    case = corpus["txt_huge"]
    stats = ErrorStats()
    tracemalloc.start()
    try:
        keys = [r.key for r in iter_shard(case.path, _config("skip"), stats=stats)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert keys == list(case.good_keys) and stats.by_reason == {"text_too_large": 1}
    assert "max_text_bytes" in stats.recent[-1][3]
    # The member's bytes are held once; decoding them would add another 50 MiB.
    assert peak < HUGE_TEXT_BYTES * 1.2


def test_huge_text_is_counted_when_the_limit_allows_it(corpus):
    config = _config("raise", counting=CountingConfig(text=TextConfig(max_text_bytes=HUGE_TEXT_BYTES * 2)))
    (rec,) = [r for r in iter_shard(corpus["txt_huge"].path, config) if r.key.endswith("_bad")]
    assert rec.text_len == len(rec.tokens) == HUGE_TEXT_BYTES  # byte-level ids: one per byte


def test_member_over_max_member_bytes_is_read_through_not_held(tmp_path):
    from tests.badcorpus import tar_bytes

    big = 8 << 20
    path = tmp_path / "big.tar"
    path.write_bytes(tar_bytes([("a.txt", b"fine"), ("b.bin", bytes(big)), ("b.txt", b"caption"), ("c.txt", b"ok")]))
    stats = ErrorStats()
    tracemalloc.start()
    try:
        recs = list(iter_shard(str(path), _config("skip", max_member_bytes=1 << 20), stats=stats))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [(r.key, r.index) for r in recs] == [("a", 0), ("c", 2)]  # indices stay stable
    assert stats.by_reason == {"member_too_large": 1} and stats.recent[-1][2] == "b"
    assert str(big) in stats.recent[-1][3]
    assert peak < 4 << 20
    with pytest.raises(ValueError, match="max_member_bytes=0"):
        ReaderConfig(max_member_bytes=0)


def _fuzz_base() -> tuple[bytes, list[str], list[int]]:
    """A mixed shard, its keys, and where each member's bytes start (media headers live there)."""
    from tests.badcorpus import jpeg, png, tar_bytes, wav

    flac = io.BytesIO()
    soundfile.write(flac, np.zeros(8000, np.float32), 8000, format="FLAC")
    members = [
        ("s0.txt", b"plain caption " * 20),
        ("s1.jpg", jpeg(48, 32)), ("s1.txt", b"an image"),
        ("s2.wav", wav(0.5)), ("s2.json", b'{"text": "a clip"}'),
        ("s3.png", png(30, 60)), ("s3.flac", flac.getvalue()),
        ("s4.txt.gz", gzip.compress(b"zipped words " * 50, mtime=0)),
        ("s5.txt", b"last one"),
    ]
    starts, pos = [], 0
    for _name, data in members:
        starts.append(pos + 512)
        pos += 512 + len(data) + -len(data) % 512
    return tar_bytes(members), ["s0", "s1", "s2", "s3", "s4", "s5"], starts


def test_mutated_shards_never_crash_and_never_lose_silently(tmp_path):
    """300 seeded mutants (cuts, byte flips, overwritten member headers) of a good mixed shard."""
    base, keys, starts = _fuzz_base()
    rng = random.Random(7)
    path = tmp_path / "mutant.tar"
    outcomes = collections.Counter()
    for trial in range(300):
        data = bytearray(base)
        kind = trial % 3
        if kind == 0:
            del data[rng.randrange(1, len(data)) :]
        elif kind == 1:
            for _ in range(rng.randint(1, 3)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        else:  # same length, so the tar framing holds and the damage reaches the member
            start = rng.choice(starts) + rng.randrange(48)
            run = rng.randint(1, 16)
            data[start : start + run] = rng.randbytes(run)
        path.write_bytes(bytes(data))
        stats = ErrorStats()
        recs = list(iter_shard(str(path), _config("skip", max_consecutive=1000), stats=stats))
        got = [r.key for r in recs]
        assert set(got) <= set(keys) and len(set(got)) == len(got), (trial, got)
        assert [r.index for r in recs] == sorted(r.index for r in recs)
        if len(got) < len(keys):
            assert stats.num_errors >= 1, (trial, got)
        for reason, _shard, key, message in stats.recent:
            assert reason in REASONS
            (key or "").encode("utf-8")
            message.encode("utf-8")
        outcomes.update(stats.by_reason)
    # The mutations reached tar framing, media headers and text alike.
    assert {"truncated_tar", "bad_tar"} <= set(outcomes) and len(outcomes) >= 4, outcomes


def test_pax_path_of_a_directory_does_not_rename_the_next_member():
    import tarfile

    from pipeline.tario import tar_members

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("d" * 120)  # long enough to need a pax path record
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
        info = tarfile.TarInfo("k.txt")  # short: no pax header of its own
        info.size = 5
        tar.addfile(info, io.BytesIO(b"hello"))
    # Before the fix the directory's pax path leaked onto k.txt, whose sample was then lost.
    assert list(tar_members(io.BytesIO(buf.getvalue()))) == [("k.txt", b"hello")]


def test_pax_records_followed_by_nul_padding_are_accepted():
    from pipeline.tario import tar_members
    from tests.badcorpus import tar_bytes, tar_member

    record = b"path=long/name.txt\n"
    record = b"%d " % (len(record) + 3) + record  # the length counts its own 2 digits and space
    archive = tar_member("PaxHeader", record + bytes(20), kind=b"x") + tar_bytes([("short.txt", b"x")])
    assert list(tar_members(io.BytesIO(archive))) == [("long/name.txt", b"x")]


def test_extended_header_declaring_a_huge_name_is_refused(tmp_path):
    from tests.badcorpus import tar_bytes, tar_header

    path = tmp_path / "longname.tar"
    path.write_bytes(tar_bytes([("a.txt", b"ok")], end=False) + tar_header(b"././@LongLink", 1 << 30, kind=b"L"))
    stats = ErrorStats()
    assert [r.key for r in iter_shard(str(path), _config("skip"), stats=stats)] == []
    assert stats.by_reason == {"bad_tar": 1} and "extended header" in stats.recent[-1][3]
    assert "from key 'a'" in stats.recent[-1][3]  # the dropped pending sample is named


def test_size_limits_are_command_line_options():
    import argparse

    from pipeline.reader import add_reader_arguments, reader_config_from_args

    parser = argparse.ArgumentParser()
    add_reader_arguments(parser)
    config = reader_config_from_args(parser.parse_args(["--max-text-bytes", "5", "--max-member-bytes", "7"]))
    assert (config.counting.text.max_text_bytes, config.max_member_bytes) == (5, 7)
    defaults = reader_config_from_args(parser.parse_args([]))
    assert defaults == ReaderConfig()


@settings(max_examples=300, deadline=None)
@given(records=st.one_of(
    st.binary(max_size=120),
    st.lists(st.tuples(st.integers(-3, 60), st.binary(max_size=30)), max_size=4).map(
        lambda rs: b"".join(b"%d path=%s\n" % (n, v) for n, v in rs)
    ),
))
def test_pax_records_fuzz_never_hang_nor_escape(records):
    from pipeline.tario import TarError, tar_members
    from tests.badcorpus import tar_bytes, tar_member

    archive = tar_member("PaxHeader", records, kind=b"x") + tar_bytes([("k.txt", b"x")])
    try:
        members = list(tar_members(io.BytesIO(archive)))
    except TarError as e:
        assert e.reason == "bad_tar"
    else:
        assert [data for _name, data in members] == [b"x"]


def test_sample_over_max_sample_bytes_is_not_held(tmp_path):
    from tests.badcorpus import tar_bytes

    # One key for 200 members of 64 KiB: without a cap the whole shard would sit in one sample.
    path = tmp_path / "onekey.tar"
    path.write_bytes(tar_bytes(
        [("a.txt", b"fine"), *[(f"k.{i}.bin", bytes(64 << 10)) for i in range(200)], ("k.txt", b"x"), ("c.txt", b"ok")]
    ))
    stats = ErrorStats()
    tracemalloc.start()
    try:
        recs = list(iter_shard(str(path), _config("skip", max_sample_bytes=1 << 20), stats=stats))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [(r.key, r.index) for r in recs] == [("a", 0), ("c", 2)]
    assert stats.by_reason == {"sample_too_large": 1} and stats.recent[-1][2] == "k"
    assert peak < 4 << 20  # 12.5 MiB of members went by
    with pytest.raises(ValueError, match="max_sample_bytes=0"):
        ReaderConfig(max_sample_bytes=0)


def test_concatenated_gzip_text_is_counted_whole():
    from pipeline.counting import gunzip

    two = gzip.compress(b"a" * 400, mtime=0) + gzip.compress(b"b" * 400, mtime=0)
    assert gunzip(two + bytes(8), 1 << 20) == b"a" * 400 + b"b" * 400  # NUL padding tolerated
    for bad, reason in ((two + b"junk", "bad_gzip"), (two[:-5], "bad_gzip")):
        with pytest.raises(CountError) as err:
            gunzip(bad, 1 << 20)
        assert err.value.reason == reason
    with pytest.raises(CountError) as err:
        gunzip(two, 600)  # the limit covers all members together
    assert err.value.reason == "text_too_large"
