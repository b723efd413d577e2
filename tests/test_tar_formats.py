"""Tar dialects and shard names the reader meets in the wild: `pipe:` commands that decompress
themselves, GNU long link targets and sparse files, pax size and linkpath records, and shard
suffixes in upper case. Each test writes tiny real shards into a temporary folder.
"""

from __future__ import annotations

import gzip
import io
import shutil
import subprocess
import tarfile

import pytest

from pipeline.errors import ErrorPolicy, ErrorStats
from pipeline.reader import ReaderConfig, iter_shard
from tests.badcorpus import tar_bytes, tar_header, tar_member

pytestmark = pytest.mark.timeout(60)

_LONG_TARGET = "t" * 150  # over the 100 bytes of a tar header's link field


def _config() -> ReaderConfig:
    return ReaderConfig(errors=ErrorPolicy(mode="skip"))


def _read(url: str, **kwargs) -> tuple[list[str], ErrorStats]:
    stats = ErrorStats()
    keys = [r.key for r in iter_shard(url, _config(), stats=stats, **kwargs)]
    return keys, stats


def _write_tar(path, members, fmt=tarfile.GNU_FORMAT, mode="w") -> None:
    """`members`: (name, bytes) for files, (name, TarInfo type, link target) for links."""
    with tarfile.open(path, mode, format=fmt) as tar:
        for name, *rest in members:
            info = tarfile.TarInfo(name)
            if len(rest) == 1:
                info.size = len(rest[0])
                tar.addfile(info, io.BytesIO(rest[0]))
            else:
                info.type, info.linkname = rest
                tar.addfile(info)


def _texts(*keys: str) -> list[tuple[str, bytes]]:
    return [(f"{k}.txt", f"sample {k}".encode()) for k in keys]


class _Pipe:
    """A pipe-like stream: not seekable, no peek; its first read returns at most `first` bytes
    (as much as the command had written), later ones block for all they ask, as a buffered
    pipe does."""

    def __init__(self, data: bytes, first: int = 1) -> None:
        self._data = io.BytesIO(data)
        self._first: int | None = first

    def read(self, size: int = -1) -> bytes:
        if self._first is not None:
            size, self._first = (self._first if size < 0 else min(size, self._first)), None
        return self._data.read(size)


# --- pipe: commands are inflated by their output's bytes, not their command line


@pytest.mark.parametrize("command", ["gzip -dc {tgz}", "gzip -dc < {tgz}", "cat {tgz}", "cat {tar} | gzip -c",
                                     "cat {tar}"])
def test_a_pipe_is_inflated_when_its_output_is_gzip_whatever_the_command_ends_with(tmp_path, command):
    tar, tgz = tmp_path / "x.tar", tmp_path / "x.tgz"
    _write_tar(tar, _texts("a", "b", "c"))
    tgz.write_bytes(gzip.compress(tar.read_bytes(), mtime=0))
    keys, stats = _read("pipe:" + command.format(tar=tar, tgz=tgz))
    assert keys == ["a", "b", "c"] and stats.num_errors == 0, stats.recent


def test_the_serve_probe_reads_a_pipe_that_decompresses_itself(tmp_path):
    from pipeline.probe import probe_source

    tgz = tmp_path / "x.tgz"
    _write_tar(tgz, _texts("a", "b"), mode="w:gz")
    result = probe_source([f"pipe:gzip -dc {tgz}"], _config())
    assert result.unreadable == [] and result.usable == 1


@pytest.mark.parametrize("first", [1, 2, 1 << 20])
def test_open_decompressed_looks_at_a_pipe_without_losing_bytes(first):
    from pipeline.tario import open_decompressed, tar_members

    plain = tar_bytes(_texts("a", "b"))
    for data in (plain, gzip.compress(plain, mtime=0)):
        stream = open_decompressed(_Pipe(data, first), "pipe:some command x.tar.gz")
        assert list(tar_members(stream)) == _texts("a", "b")
    # Shorter than the gzip magic, and empty: handed back whole.
    assert open_decompressed(_Pipe(b"\x1f"), "pipe:x").read() == b"\x1f"
    assert open_decompressed(_Pipe(b""), "pipe:x").read() == b""
    stream = open_decompressed(_Pipe(b"\x1f\x8cabc"), "pipe:x")
    assert [stream.read(1), stream.read(2), stream.read(5)] == [b"\x1f", b"\x8ca", b"bc"]


def test_local_files_are_still_judged_by_name(tmp_path):
    """A misnamed file is reported with the fix, not silently inflated (its name also decides
    whether it is mapped and has member offsets)."""
    plain = tar_bytes(_texts("a"))
    gz_named_tar = tmp_path / "zipped.tar"
    gz_named_tar.write_bytes(gzip.compress(plain, mtime=0))
    keys, stats = _read(str(gz_named_tar))
    assert keys == [] and stats.by_reason == {"bad_tar": 1} and ".tar.gz" in stats.recent[-1][3]
    tar_named_gz = tmp_path / "plain.tar.gz"
    tar_named_gz.write_bytes(plain)
    keys, stats = _read(str(tar_named_gz))
    assert keys == [] and stats.by_reason == {"bad_tar": 1} and "Not a gzipped file" in stats.recent[-1][3]


def test_a_zip_named_tar_is_named_for_what_it_is(tmp_path):
    """A ZIP archive named .tar was "corrupt numeric field b'00\\x0000000'" (probe)."""
    import zipfile

    path = tmp_path / "x.tar"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("a.txt", "a caption")
    keys, stats = _read(str(path))
    assert keys == [] and stats.by_reason == {"bad_tar": 1}
    assert stats.recent[-1][3].startswith("a ZIP archive, not a tar: readers read tar shards")


@pytest.mark.parametrize("compression,cat", [("bzip2", "bzcat"), ("xz", "xzcat"), ("zstd", "zstdcat")])
def test_a_tar_compressed_so_that_readers_do_not_inflate_it_named_tar_is_named_for_what_it_is(
        tmp_path, compression, cat):
    """A .tar.bz2 (xz, zstd) named .tar was "corrupt numeric field b'R\\xe7QoN...' in header at
    byte 0": it is named for its compression and the way on, as gzip bytes named .tar are."""
    import bz2
    import lzma
    import os

    plain = tar_bytes([("a.txt", os.urandom(2048).hex().encode())])  # compresses past one block
    packed = {"bzip2": bz2.compress, "xz": lzma.compress,
              "zstd": lambda data: b"\x28\xb5\x2f\xfd" + os.urandom(1024)}[compression](plain)
    path = tmp_path / "packed.tar"
    path.write_bytes(packed)
    for url in (str(path), f"pipe:cat {path}"):
        keys, stats = _read(url)
        assert keys == [] and stats.by_reason == {"bad_tar": 1}
        said = stats.recent[-1][3]
        assert f"{compression}-compressed bytes where a tar header belongs" in said and f"pipe:{cat}" in said
    # Shorter than one tar block (a tiny tar compressed): named the same, not "an unterminated tar".
    path.write_bytes(packed[:100])
    keys, stats = _read(str(path))
    assert keys == [] and f"{compression}-compressed bytes where" in stats.recent[-1][3]


# --- GNU long link targets ('K') and sparse files ('S'), pax size and linkpath records


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
@pytest.mark.parametrize("link_type", [tarfile.SYMTYPE, tarfile.LNKTYPE])
def test_a_long_link_target_skips_only_the_link_sample(tmp_path, fmt, link_type):
    from pipeline.tario import Link, tar_members

    path = tmp_path / "longlink.tar"
    _write_tar(path, [*_texts("a"), ("b.txt", link_type, _LONG_TARGET), *_texts("c", "d")], fmt=fmt)
    with open(path, "rb") as f:
        members = list(tar_members(f))
    assert members == [*_texts("a"), ("b.txt", Link(_LONG_TARGET)), *_texts("c", "d")]
    keys, stats = _read(str(path))
    assert keys == ["a", "c", "d"] and stats.by_reason == {"link_member": 1}
    assert _LONG_TARGET in stats.recent[-1][3]


def _gnu_sparse(name: bytes, stored: bytes, extensions: int) -> bytes:
    """A GNU 'S' member holding `stored` bytes, with `extensions` sparse map blocks after its header."""
    header = bytearray(tar_header(name, len(stored), kind=b"S"))
    header[257:265] = b"ustar  \0"  # the GNU magic, under which bytes 345.. are not a name prefix
    header[386:398] = b"%011o\0" % 4096  # first map entry: offset 4096, `stored` bytes
    header[398:410] = b"%011o\0" % len(stored)
    header[482] = 1 if extensions else 0
    header[483:495] = b"%011o\0" % (4096 + len(stored))  # the file's size with its holes
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    blocks = []
    for i in range(extensions):
        block = bytearray(512)
        block[504] = 1 if i < extensions - 1 else 0
        blocks.append(bytes(block))
    return bytes(header) + b"".join(blocks) + stored + bytes(-len(stored) % 512)


@pytest.mark.parametrize("extensions", [0, 2])
def test_a_gnu_sparse_member_skips_its_sample_and_the_shard_reads_on(tmp_path, extensions):
    from pipeline.tario import Special, tar_members

    archive = (tar_bytes(_texts("a"), end=False) + _gnu_sparse(b"b.txt", b"tail\n", extensions)
               + tar_bytes(_texts("c")))
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:  # what tar itself makes of it
        assert tar.getnames() == ["a.txt", "b.txt", "c.txt"]
    members = list(tar_members(io.BytesIO(archive)))
    assert [n for n, _ in members] == ["a.txt", "b.txt", "c.txt"] and members[2] == _texts("c")[0]
    assert isinstance(members[1][1], Special) and "sparse" in members[1][1].kind
    path = tmp_path / "sparse.tar"
    path.write_bytes(archive)
    keys, stats = _read(str(path))
    assert keys == ["a", "c"] and stats.by_reason == {"special_member": 1}
    assert "sparse" in stats.recent[-1][3] and "--sparse" in stats.recent[-1][3]


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs GNU tar")
@pytest.mark.parametrize("fmt", ["gnu", "posix"])
def test_tar_sparse_shards_keep_their_other_samples(tmp_path, fmt):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("first sample\n")
    with open(src / "b.txt", "wb") as f:
        f.truncate(1 << 20)
        f.seek(1 << 20)
        f.write(b"tail\n")
    (src / "c.txt").write_text("third\n")
    shard = tmp_path / "sparse.tar"
    subprocess.run(["tar", "--sparse", f"--format={fmt}", "-cf", str(shard), "a.txt", "b.txt", "c.txt"],
                   cwd=src, check=True)
    keys, stats = _read(str(shard))
    assert keys == ["a", "c"] and stats.by_reason == {"special_member": 1}
    assert "'b.txt'" in stats.recent[-1][3] and "sparse" in stats.recent[-1][3]


def _pax(*records: bytes) -> bytes:
    body = b""
    for record in records:
        line = b" " + record + b"\n"
        n = len(line) + 1
        while n != len(line) + len(str(n)):  # the length counts its own digits
            n = len(line) + len(str(n))
        body += b"%d" % n + line
    return tar_member("PaxHeader", body, kind=b"x")


@pytest.mark.parametrize("mapped", [False, True])
def test_a_pax_size_record_overrides_the_header_size(tmp_path, mapped):
    from pipeline.shards import MappedShard
    from pipeline.tario import tar_members

    # A member over 8 GiB keeps its size in pax only: the header field then holds 0.
    archive = (_pax(b"size=11") + tar_header(b"k.txt", 0) + b"hello world" + bytes(512 - 11)
               + tar_bytes(_texts("n")))
    path = tmp_path / "paxsize.tar"
    path.write_bytes(archive)
    with tarfile.open(path) as tar:  # what tar itself makes of it
        assert [(m.name, m.size) for m in tar] == [("k.txt", 11), ("n.txt", 8)]
    with MappedShard(str(path)) if mapped else open(path, "rb") as f:
        assert [(n, bytes(d)) for n, d in tar_members(f)] == [("k.txt", b"hello world"), *_texts("n")]


@pytest.mark.parametrize("records", [[b"size=12x"], [b"size=" + b"9" * 40], [b"path=a", b"size="]])
def test_a_corrupt_pax_size_is_a_bad_tar(records):
    from pipeline.tario import TarError, tar_members

    archive = _pax(*records) + tar_bytes(_texts("k"))
    with pytest.raises(TarError, match="corrupt pax size") as err:
        list(tar_members(io.BytesIO(archive)))
    assert err.value.reason == "bad_tar"


def test_a_pax_record_length_of_thousands_of_digits_is_a_bad_tar():
    from pipeline.tario import TarError, tar_members

    archive = tar_member("PaxHeader", b"9" * 5000 + b" path=x\n", kind=b"x") + tar_bytes(_texts("k"))
    with pytest.raises(TarError, match="corrupt pax record") as err:
        list(tar_members(io.BytesIO(archive)))
    assert err.value.reason == "bad_tar"



# --- extended headers that no member follows (a writer stopped between a header and its member)

_HEADLESS = {  # each describes a member of a sample after "b", or every member after it ("g")
    "pax": (lambda: _pax(b"path=c.txt"), "pax extended header"),
    "pax without a path": (lambda: _pax(b"mtime=1.5"), "pax extended header"),
    "pax global": (lambda: tar_member("GlobalHead", _pax(b"comment=x")[512:].rstrip(b"\0"), kind=b"g"),
                   "pax global header"),
    "GNU long name": (lambda: tar_member("././@LongLink", b"c" * 120 + b".txt\0", kind=b"L"),
                      "GNU long name header"),
    "GNU long link": (lambda: tar_member("././@LongLink", b"t" * 120 + b"\0", kind=b"K"),
                      "GNU long link header"),
}


@pytest.mark.parametrize("header", list(_HEADLESS))
@pytest.mark.parametrize("end, name, map_shards", [
    ("blocks", "x.tar", True), ("blocks", "x.tar", False), ("blocks", "x.tar.gz", False),
    ("blocks and an appended tar", "x.tar", True), ("eof", "x.tar", True), ("eof", "x.tar", False),
])
def test_an_extended_header_no_member_follows_is_reported_after_every_sample_before_it(
        tmp_path, header, end, name, map_shards):
    """GNU tar lists such a tar quietly, dropping the header; tarfile refuses it (ReadError).
    The reader reads every sample before it, then names the shard and the header's byte."""
    make, kind = _HEADLESS[header]
    whole = tar_bytes(_texts("a", "b"), end=False)
    archive = whole + make() + {"blocks": bytes(1024), "eof": b"",
                                "blocks and an appended tar": bytes(1024) + tar_bytes(_texts("z"))}[end]
    path = tmp_path / name
    path.write_bytes(gzip.compress(archive, mtime=0) if name.endswith(".gz") else archive)
    with pytest.raises(tarfile.ReadError):
        tarfile.open(fileobj=io.BytesIO(archive)).getmembers()
    if shutil.which("tar") and not name.endswith(".gz"):
        listed = subprocess.run(["tar", "-tf", str(path)], capture_output=True, text=True, check=True)
        assert listed.stdout.split() == ["a.txt", "b.txt"] and not listed.stderr
    stats = ErrorStats()
    config = ReaderConfig(errors=ErrorPolicy(mode="skip"), map_shards=map_shards)
    keys = [r.key for r in iter_shard(str(path), config, stats=stats)]
    reason = "truncated_tar" if end == "eof" else "bad_tar"
    assert keys == ["a", "b"] and stats.by_reason == {reason: 1}, stats.recent
    ((_, shard, key, message),) = stats.recent
    assert shard == str(path) and key is None
    lead = (f"archive ends at byte {len(archive)} after the" if end == "eof"
            else f"end-of-archive blocks at byte {len(whole) + len(make())} follow the")
    assert f"{lead} {kind} at byte {len(whole)}, not a member it describes" in message
    assert "after key 'b'; every sample before them was read" in message


@pytest.mark.parametrize("end", [bytes(1024), b""])
def test_an_extended_header_naming_a_member_of_the_last_sample_drops_that_sample_by_key(tmp_path, end):
    """The long name says the lost member was the last sample's: that sample is not whole."""
    path = tmp_path / "x.tar"
    path.write_bytes(tar_bytes(_texts("a", "b"), end=False)
                     + tar_member("././@LongLink", b"b." + b"j" * 120 + b"\0", kind=b"L") + end)
    keys, stats = _read(str(path))
    assert keys == ["a"] and sum(stats.by_reason.values()) == 1, stats.recent
    assert "samples from index 1 from key 'b' on are lost" in stats.recent[0][3]


# --- shard suffixes in any case


def _upper_case_shards(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    _write_tar(d / "A.TAR", _texts("a"))
    _write_tar(d / "b.tar", _texts("b"))
    _write_tar(d / "C.TGZ", _texts("c"), mode="w:gz")
    _write_tar(d / "D.Tar.Gz", _texts("d"), mode="w:gz")
    (d / "notes.TXT").write_text("not a shard")
    return d


def test_upper_case_suffixes_are_shards_in_globs_directories_and_paths(tmp_path):
    from pipeline.shards import expand_shards

    d = _upper_case_shards(tmp_path)
    names = ["A.TAR", "C.TGZ", "D.Tar.Gz", "b.tar"]
    assert expand_shards(str(d)) == [str(d / n) for n in names]
    assert expand_shards(str(d / "*.TAR")) == [str(d / "A.TAR")]
    assert expand_shards(str(d / "*")) == [str(d / n) for n in names]
    assert expand_shards(f"file:{d / 'C.TGZ'}") == [f"file:{d / 'C.TGZ'}"]
    with pytest.raises(ValueError, match="notes.TXT.*must end with one of.*a file listing shards is not read"):
        expand_shards(str(d / "notes.TXT"))  # a list of shards, as some loaders take: said so


@pytest.mark.parametrize("map_shards", [True, False])
def test_upper_case_shards_are_read_and_mapped_as_their_lower_case_twins(tmp_path, map_shards):
    from pipeline.shards import MappedShard, open_shard

    d = _upper_case_shards(tmp_path)
    config = ReaderConfig(errors=ErrorPolicy(mode="skip"), map_shards=map_shards)
    for name, key in (("A.TAR", "a"), ("C.TGZ", "c"), ("D.Tar.Gz", "d")):
        stats = ErrorStats()
        assert [r.key for r in iter_shard(str(d / name), config, stats=stats)] == [key], stats.recent
        with open_shard(str(d / name), mapped=True) as stream:
            assert isinstance(stream, MappedShard) == (name == "A.TAR")


def test_gzip_names_in_any_case_and_a_remote_query_aside():
    from pipeline.tario import gzip_named

    assert all(gzip_named(u) for u in ("a.tar.gz", "A.TGZ", "file:/d/B.Tar.Gz", "https://h/a.tgz?sig=x.tar",
                                       "s3://b/k/A.TAR.GZ"))
    assert not any(gzip_named(u) for u in ("a.tar", "A.TAR", "https://h/a.tar?name=x.tgz"))


def test_member_offsets_of_a_gzip_shard_are_refused_not_made_up(tmp_path):
    """Payloads by reference read members at file offsets; an inflated stream has none."""
    import gzip

    from pipeline.tario import TarError, tar_members

    path = tmp_path / "C.TGZ"
    _write_tar(path, _texts("c"), mode="w:gz")
    with pytest.raises(ValueError, match="spans need an uncompressed shard"):
        _read(str(path), spans=True)  # the reader refuses before reading
    with gzip.open(path) as inflated, pytest.raises(TarError, match="send its payloads inline"):
        next(tar_members(inflated, on_member=lambda name, at: None))


def test_payload_modes_refuse_a_gzip_shard_named_in_any_case():
    """Reference and direct payloads point at file offsets, which a gzip shard's members have
    none of: `.TGZ` (and a remote `.tar.gz?sig=...`) passed the start-up check."""
    from dispatcher_server import protocol as P
    from pipeline.reader import iter_shard

    for url in ("/data/A.TGZ", "/data/b.Tar.Gz"):
        with pytest.raises(ValueError, match="needs uncompressed tars"):
            P.reference_path(url)
        with pytest.raises(ValueError, match="spans need an uncompressed shard"):
            next(iter_shard(url, spans=True))
    with pytest.raises(ValueError, match="needs uncompressed tars"):
        P.reference_path("https://host/c.tar.gz?sig=abc", "direct")
    assert P.reference_path("https://host/c.tar?x=.tgz", "direct") == "https://host/c.tar?x=.tgz"
