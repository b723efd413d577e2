"""Tars and shard lists as users make them: macOS tars (AppleDouble `._k.jpg` members and
`.DS_Store`), archives whose writer never wrote the end blocks, tars joined with `cat`, headers
with old writers' signed checksums, a shard listed twice through a hard link, FIFOs and
directories named like shards, empty sources, and the one-line messages for the mistakes around
them. Samples are compared with webdataset's where it reads the tar.
"""

from __future__ import annotations

import gzip
import io
import logging
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import threading

import pytest
from PIL import Image

from pipeline.errors import ErrorPolicy, ErrorStats
from pipeline.probe import probe_source, refusal
from pipeline.reader import DOT_FILE, ReaderConfig, iter_shard, mapped_copy_identity, split_name
from pipeline.shards import expand_shards

pytestmark = pytest.mark.timeout(120)

_APPLEDOUBLE = b"\x00\x05\x16\x07\x00\x02\x00\x00" + bytes(74)  # what bsdtar writes for ._k


def _jpeg() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 24), (200, 10, 10)).save(buf, format="JPEG")
    return buf.getvalue()


def _write(path, members, fmt=tarfile.USTAR_FORMAT) -> str:
    with tarfile.open(path, "w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


def _config(**kwargs) -> ReaderConfig:
    return ReaderConfig(errors=ErrorPolicy(mode="skip"), **kwargs)


def _read(url: str, **kwargs) -> tuple[list, ErrorStats]:
    stats = ErrorStats()
    return list(iter_shard(url, _config(**kwargs), stats=stats)), stats


def _webdataset(url: str) -> list[tuple[str, list[str]]]:
    """(key, member suffixes) of each sample webdataset yields."""
    wds = pytest.importorskip("webdataset")
    return [(s["__key__"], sorted(k for k in s if not k.startswith("__")))
            for s in wds.WebDataset(url, shardshuffle=False, empty_check=False)]


# -- 1. macOS tars --------------------------------------------------------------------------------

def _mac_members(prefix: str, n: int = 3) -> list[tuple[str, bytes]]:
    """As bsdtar on macOS writes a folder: `.DS_Store`, and `._k.x` before each `k.x`."""
    members = [(f"{prefix}.DS_Store", b"Bud1" + bytes(60))]
    for i in range(n):
        for ext, data in (("jpg", _jpeg()), ("txt", f"caption {i}".encode())):
            members += [(f"{prefix}._{i:03d}.{ext}", _APPLEDOUBLE), (f"{prefix}{i:03d}.{ext}", data)]
    return members


@pytest.mark.parametrize("map_shards", [True, False])
def test_a_macos_tar_keeps_every_sample_whole_and_counts_its_dot_files(tmp_path, map_shards):
    url = _write(tmp_path / "mac.tar", _mac_members("./"))
    records, stats = _read(url, map_shards=map_shards)
    got = [(r.key, sorted(r.members)) for r in records]
    assert got == [(f"./{i:03d}", ["jpg", "txt"]) for i in range(3)]
    assert got == _webdataset(url)
    assert all({it.modality for it in r.items} == {"image"} and r.text_len > 0 for r in records)
    assert stats.num_errors == 0 and stats.ignored_members == {DOT_FILE: 7}


def test_dot_files_in_a_named_folder_belong_to_no_sample(tmp_path):
    """webdataset's regex gives `dir/._000.jpg` the key `dir/` (a sample of junk between two
    halves of `dir/000`); a dot file has no key here, wherever it sits."""
    url = _write(tmp_path / "macdir.tar", _mac_members("photos/"))
    records, stats = _read(url)
    assert [(r.key, sorted(r.members)) for r in records] == [(f"photos/{i:03d}", ["jpg", "txt"]) for i in range(3)]
    assert stats.num_errors == 0 and stats.ignored_members == {DOT_FILE: 7}
    assert split_name("a/.hidden.txt") is None and split_name(".x") is None
    assert split_name("a.b/c.txt") == ("a.b/c", "txt") and split_name("a/b..txt") == ("a/b", ".txt")


def test_the_probe_counts_dot_files_and_finds_the_samples(tmp_path):
    url = _write(tmp_path / "mac.tar", _mac_members("./"))
    result = probe_source([url], ReaderConfig())
    # .DS_Store, ._000.jpg, ._000.txt, and ._001.jpg read before 001.jpg ends sample 000
    assert result.usable == 1 and not result.refused and result.ignored == {DOT_FILE: 4}
    # Among unusable samples, the refusal suggests mapping a suffix, never the dot files.
    labels = _write(tmp_path / "maclabels.tar", [(n.replace(".jpg", ".cls").replace(".txt", ".npy"), d)
                                                 for n, d in _mac_members("./")])
    line = refusal(probe_source([labels], ReaderConfig()))
    assert "found suffixes cls, npy;" in line and "dot file" not in line


# -- 2. archives without end-of-archive blocks ---------------------------------------------------

def _unterminated(tmp_path, name: str = "noeof.tar") -> tuple[str, bytes]:
    """A 3-member ustar tar whose trailing zero blocks are gone (its writer was killed)."""
    whole = (tmp_path / "whole.tar")
    _write(whole, [(f"{i}.txt", f"text {i}".encode()) for i in range(3)])
    data = whole.read_bytes()
    cut = data.rstrip(b"\0")
    cut += bytes(-len(cut) % 512)  # the last member's padding stays
    assert len(cut) == 3 * 1024
    path = tmp_path / name
    path.write_bytes(gzip.compress(cut) if name.endswith(".gz") else cut)
    return str(path), cut


@pytest.mark.parametrize("map_shards", [True, False])
@pytest.mark.parametrize("name", ["noeof.tar", "noeof.tar.gz"])
def test_an_archive_without_end_blocks_yields_its_last_sample_and_warns_once(tmp_path, caplog, map_shards, name):
    url, _ = _unterminated(tmp_path, name)
    with caplog.at_level(logging.WARNING, logger="mmdispatch.pipeline"):
        records, stats = _read(url, map_shards=map_shards)
    assert [r.key for r in records] == ["0", "1", "2"] == [k for k, _ in _webdataset(url)]
    assert stats.num_errors == 0
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert url in warning and "end-of-archive" in warning and "'2' may be incomplete" in warning


@pytest.mark.parametrize("where, keys", [("member", ["0", "1"]), ("padding", ["0", "1"]), ("header", ["0"])])
def test_an_archive_cut_inside_a_member_or_header_is_still_truncated(tmp_path, where, keys):
    whole = _write(tmp_path / "whole.tar", [(f"{i}.txt", f"text {i} ".encode() * 100) for i in range(3)])
    data = open(whole, "rb").read()
    last = data.index(b"2.txt\0")  # the last member's header; its 800 bytes, then 224 of padding
    cut = {"member": last + 512 + 400, "padding": last + 512 + 900, "header": last + 100}[where]
    path = tmp_path / f"cut-{where}.tar"
    path.write_bytes(data[:cut])
    records, stats = _read(str(path))
    # Cut inside a header, the member's name is unknown: the pending sample may go on there.
    assert [r.key for r in records] == keys and stats.by_reason == {"truncated_tar": 1}
    assert f"samples from index {len(keys)}" in stats.recent[0][3]


# -- 2b. tars joined with cat, bytes after the end ------------------------------------------------

def _joined(tmp_path, name: str = "joined.tar", tail: bytes = b"", image: bytes = b"") -> tuple[str, bytes]:
    """`cat a.tar b.tar` (as tarfile writes them: each padded to a 10 KiB record), then `tail`;
    with `image`, each sample has it as its jpg too."""
    def members(prefix: str, word: str, n: int) -> list[tuple[str, bytes]]:
        jpg = [[(f"{prefix}{i}.jpg", image)] if image else [] for i in range(n)]
        return [m for i in range(n) for m in (*jpg[i], (f"{prefix}{i}.txt", f"{word} {i}".encode() * (i + 1) * 40))]

    a = _write(tmp_path / "a.tar", members("a", "first", 3))
    b = _write(tmp_path / "b.tar", members("b", "second", 2))
    data = open(a, "rb").read() + open(b, "rb").read() + tail
    path = tmp_path / name
    path.write_bytes(gzip.compress(open(a, "rb").read()) + gzip.compress(open(b, "rb").read() + tail)
                     if name.endswith(".gz") else data)
    return str(path), data


_JOINED_KEYS = ["a0", "a1", "a2", "b0", "b1"]


@pytest.mark.parametrize("name, map_shards", [("joined.tar", True), ("joined.tar", False), ("joined.tar.gz", False),
                                              ("pipe", False)])
def test_tars_joined_with_cat_are_read_whole_as_tar_ignore_zeros_reads_them(tmp_path, name, map_shards):
    url, _ = _joined(tmp_path, "joined.tar" if name == "pipe" else name)
    if name == "pipe":
        url = f"pipe:cat {url}"
    records, stats = _read(url, map_shards=map_shards)
    assert [r.key for r in records] == _JOINED_KEYS and stats.num_errors == 0
    assert [r.members["txt"] for r in records] == [f"{'first' if k[0] == 'a' else 'second'} {k[1]}".encode()
                                                   * (int(k[1]) + 1) * 40 for k in _JOINED_KEYS]
    if shutil.which("tar") and name == "joined.tar":
        listed = subprocess.run(["tar", "-tif", url], capture_output=True, text=True, check=True).stdout.split()
        assert [n.removesuffix(".txt") for n in listed] == _JOINED_KEYS


@pytest.mark.parametrize("map_shards", [True, False])
def test_joined_tars_keep_member_offsets_resume_points_and_a_whole_identity(tmp_path, map_shards):
    url, data = _joined(tmp_path, image=_jpeg())
    config = _config(map_shards=map_shards)
    records = list(iter_shard(url, config, spans=True, resume_points=True))
    assert [r.key for r in records] == _JOINED_KEYS
    for r in records:  # reference and direct payloads read these byte ranges back
        (offset, size), = r.spans.values()
        assert data[offset:offset + size] == r.members["jpg"] == _jpeg()
        assert data[offset - 512:offset].startswith(f"{r.key}.jpg".encode())
    # Resumed at the second tar's first sample (where the first ends, past its zero blocks)...
    second = records[2].next_at
    assert data[second:second + 512].startswith(b"b0.jpg") and second > data.index(bytes(1024))
    resumed = list(iter_shard(url, config, start_index=3, offset=second, resume_points=True))
    assert [r.key for r in resumed] == _JOINED_KEYS[3:]
    # ...and at the end, which holds only zeros: nothing more, nothing again.
    end = records[-1].next_at
    assert not data[end:].strip(b"\0")
    assert list(iter_shard(url, config, start_index=5, offset=end, resume_points=True)) == []
    identity = mapped_copy_identity(url)
    assert identity is not None and identity["size"] == end


@pytest.mark.parametrize("name, map_shards", [("tail.tar", True), ("tail.tar", False), ("tail.tar.gz", False)])
def test_only_zeros_after_the_end_end_the_archive_quietly(tmp_path, caplog, name, map_shards):
    url, _ = _joined(tmp_path, name, tail=bytes(100 << 10) + bytes(100))  # not even whole blocks
    with caplog.at_level(logging.WARNING, logger="mmdispatch.pipeline"):
        records, stats = _read(url, map_shards=map_shards)
    assert [r.key for r in records] == _JOINED_KEYS and stats.num_errors == 0 and not caplog.records


@pytest.mark.parametrize("tail", [b"appended notes", bytes(4096) + b"\x01" + bytes(600), b"\x01" * 512 * 3])
@pytest.mark.parametrize("name, map_shards", [("bad.tar", True), ("bad.tar", False), ("bad.tar.gz", False)])
def test_other_bytes_after_the_end_are_a_bad_tar_and_every_sample_before_is_kept(tmp_path, name, map_shards, tail):
    url, data = _joined(tmp_path, name, tail=tail)
    records, stats = _read(url, map_shards=map_shards)
    assert [r.key for r in records] == _JOINED_KEYS and stats.by_reason == {"bad_tar": 1}
    ((_, shard, key, message),) = stats.recent
    where = len(data) - len(tail) + len(tail) - len(tail.lstrip(b"\0"))
    assert shard == url and key is None
    assert f"non-zero bytes at byte {where}, after the end-of-archive blocks at byte " in message
    assert "every sample before them was read" in message


@pytest.mark.parametrize("after, reason", [(b"NOTGZIPDATA", "bad_tar"), ("cut", "truncated_tar")])
def test_a_gzip_stream_that_fails_past_the_end_keeps_every_sample_before(tmp_path, after, reason):
    """Trailing junk after a gzip shard (gzip -t: "trailing garbage ignored"), or a second gzip
    part cut short (`cat a.tar.gz b.tar.gz`, b cut): the error is past the end, and the first
    tar's last sample, whole before it, is kept."""
    a = _write(tmp_path / "a.tar", [(f"a{i}.txt", f"first {i}".encode()) for i in range(3)])
    data = gzip.compress(open(a, "rb").read())
    if after == "cut":
        after = gzip.compress(open(a, "rb").read())[:15]
    path = tmp_path / "tail.tar.gz"
    path.write_bytes(data + after)
    records, stats = _read(str(path))
    assert [r.key for r in records] == ["a0", "a1", "a2"] and stats.by_reason == {reason: 1}
    ((_, _, key, message),) = stats.recent
    assert key is None and "after the end-of-archive blocks" in message
    assert "every sample before them was read" in message


def test_signed_checksums_of_old_writers_are_taken_as_tarfile_and_gnu_tar_take_them(tmp_path):
    url = _write(tmp_path / "signed.tar", [("a0.txt", b"first"), ("caf\u00e9.txt", b"signed"), ("a2.txt", b"after")])
    data = bytearray(open(url, "rb").read())
    header = data[1024:1536]
    signed = 256 + sum(struct.unpack("148b8x356b", bytes(header)))
    assert signed != 256 + sum(header) - sum(header[148:156])  # the name's bytes >= 0x80 differ
    data[1024 + 148:1024 + 156] = b"%06o\0 " % signed
    (tmp_path / "signed.tar").write_bytes(bytes(data))
    assert tarfile.open(url).getnames() == ["a0.txt", "caf\u00e9.txt", "a2.txt"]
    for map_shards in (True, False):
        records, stats = _read(url, map_shards=map_shards)
        assert [r.key for r in records] == ["a0", "caf\u00e9", "a2"] and stats.num_errors == 0
    data[1024 + 148:1024 + 156] = b"%06o\0 " % (signed + 1)  # neither sum: still refused
    (tmp_path / "signed.tar").write_bytes(bytes(data))
    records, stats = _read(url)
    assert [r.key for r in records] == [] and stats.by_reason == {"bad_tar": 1}
    assert "header checksum mismatch at byte 1024" in stats.recent[0][3]


# -- 3. one shard through a hard link ------------------------------------------------------------

def test_a_shard_listed_through_a_hard_link_is_refused(tmp_path):
    (tmp_path / "many").mkdir()
    shard = _write(tmp_path / "many" / "000.tar", [("a.txt", b"x")])
    os.link(shard, tmp_path / "hard000.tar")
    with pytest.raises(ValueError, match=r"hard000.tar' is listed more than once \(also as .*many/000.tar"):
        expand_shards([shard, str(tmp_path / "hard000.tar")])
    with pytest.raises(ValueError, match="listed more than once"):
        expand_shards([str(tmp_path / "many"), str(tmp_path / "hard000.tar")])


# -- 4. FIFOs and directories named like shards --------------------------------------------------

@pytest.fixture()
def odd_dir(tmp_path):
    d = tmp_path / "dir"
    d.mkdir()
    good = [_write(d / f"{i:03d}.tar", [(f"{i}.txt", b"x")]) for i in (0, 1)]
    os.mkfifo(d / "002.tar")
    (d / "003.tar").mkdir()
    return d, good


def test_listings_and_globs_hold_regular_files_only(odd_dir, caplog):
    d, good = odd_dir
    with caplog.at_level(logging.WARNING, logger="mmdispatch.pipeline"):
        assert expand_shards(str(d)) == good
        assert expand_shards(str(d / "*.tar")) == good
    assert all("left out 2" in r.getMessage() and "002.tar" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match=r"002.tar' \(from spec .*\) is a FIFO, not a regular file"):
        expand_shards(str(d / "002.tar"))


@pytest.mark.parametrize("map_shards", [True, False])
def test_a_fifo_that_reaches_a_reader_is_open_failed_without_waiting(odd_dir, map_shards):
    d, _ = odd_dir
    out: list = []
    # A reader blocked in open() would never finish this thread (no writer ever comes).
    worker = threading.Thread(target=lambda: out.append(_read(str(d / "002.tar"), map_shards=map_shards)),
                              daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "the reader waits on the FIFO"
    for name, kind in (("002.tar", "a FIFO"), ("003.tar", "a directory")):
        records, stats = _read(str(d / name), map_shards=map_shards)
        assert records == [] and stats.by_reason == {"open_failed": 1}
        assert f"cannot open: not a regular file ({kind})" in stats.recent[0][3]


# -- 5. an empty source is refused at start ------------------------------------------------------

@pytest.fixture()
def empties(tmp_path) -> list[str]:
    with tarfile.open(tmp_path / "empty.tar", "w"):
        pass
    (tmp_path / "zero.tar").write_bytes(b"")
    key_only = _write(tmp_path / "keyonly.tar", [("__key__", b"abc")])
    return [str(tmp_path / "empty.tar"), str(tmp_path / "zero.tar"), key_only]


def test_the_probe_refuses_a_source_whose_shards_hold_no_sample(tmp_path, empties):
    for shards in ([u] for u in empties):
        result = probe_source(shards, ReaderConfig())
        line = refusal(result)
        assert result.empty and line is not None and "holds no sample" in line and shards[0] in line
    assert "only members with no sample key: (no suffix) 1" in refusal(probe_source(empties, ReaderConfig()))


def test_the_probe_refuses_no_source_it_did_not_read_whole(tmp_path, empties):
    # More shards than the probe reads: the unread ones may hold samples.
    many = [shutil.copy(empties[0], tmp_path / f"e{i}.tar") for i in range(5)]
    assert refusal(probe_source([str(p) for p in many], ReaderConfig())) is None
    missing = str(tmp_path / "missing.tar")
    assert refusal(probe_source([empties[0], missing], ReaderConfig())) is None
    cut = tmp_path / "cut.tar"
    cut.write_bytes(b"\x01" * 700)  # unreadable: the readers report it
    assert refusal(probe_source([empties[0], str(cut)], ReaderConfig())) is None
    # A shard command that fails by itself proves nothing either.
    assert refusal(probe_source([empties[0], "pipe:exit 3"], ReaderConfig())) is None


@pytest.mark.timeout(90)
def test_serve_refuses_an_empty_source_in_one_line(empties):
    proc = subprocess.run(
        [sys.executable, "-m", "mmdispatch.cli", "serve", "--shards", empties[0], "--world-size", "1",
         "--global-batch", "4"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "READY" not in proc.stdout
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("mmdispatch serve: error: source 'default' (shards ") and "holds no sample" in line


# -- 6. messages -----------------------------------------------------------------------------------

def test_a_tilde_in_a_spec_is_the_home_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    shard = _write(tmp_path / "a.tar", [("a.txt", b"x")])
    assert expand_shards("~/a.tar") == [shard]
    assert expand_shards("file:~/a.tar") == [f"file:{shard}"]
    assert expand_shards("~/*.tar") == [shard]
    with pytest.raises(FileNotFoundError, match="'~' is expanded only at the start of a path"):
        expand_shards(str(tmp_path / "~" / "a.tar"))


def test_a_plain_tar_named_tar_gz_is_told_to_be_renamed(tmp_path):
    plain = tmp_path / "plain.tar.gz"
    _write(plain, [("a.txt", b"x")])
    records, stats = _read(str(plain))
    assert records == [] and stats.by_reason == {"bad_tar": 1}
    assert "named .tar.gz: it is a plain tar; rename it .tar" in stats.recent[0][3]
    other = tmp_path / "junk.tgz"
    other.write_bytes(b"PK\x03\x04" + bytes(600))
    _, stats = _read(str(other))
    assert "though named .tgz (first bytes b'PK\\x03\\x04" in stats.recent[0][3]


@pytest.mark.parametrize("name, cat", [("a.tar.bz2", "bzcat"), ("a.tar.xz", "xzcat"), ("a.TAR.ZST", "zstdcat")])
def test_other_compressions_say_the_way_on(tmp_path, name, cat):
    path = tmp_path / name
    path.write_bytes(b"")
    with pytest.raises(ValueError, match=rf"compressed, which readers do not inflate .*decompress it .* "
                                         rf"'pipe:{cat} {path}'"):
        expand_shards(str(path))
    alone = rf"^shard '{path}' \(from spec '{{spec}}'\) is \w+-compressed, .*'pipe:{cat} {path}'$"
    for spec in (str(tmp_path), str(tmp_path / "*")):
        with pytest.raises(ValueError, match=alone.format(spec=re.escape(spec))):
            expand_shards(spec)
    # Beside plain tars, it is refused the same way: never left out, its samples lost unsaid.
    _write(tmp_path / "plain.tar", [("a.txt", b"x")])
    for spec in (str(tmp_path), str(tmp_path / "*"), str(tmp_path / "*.*")):
        with pytest.raises(ValueError, match=alone.format(spec=re.escape(spec))):
            expand_shards(spec)
    assert expand_shards(str(tmp_path / "*.tar")) == [str(tmp_path / "plain.tar")]  # not matched: not named


def test_non_utf8_names_are_escaped_once(tmp_path):
    path = tmp_path / "latin1.tar"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT, encoding="utf-8", errors="surrogateescape") as tar:
        for name in ("caf\udce9.txt", "ok.txt"):
            info = tarfile.TarInfo(name)
            info.size = 2
            tar.addfile(info, io.BytesIO(b"hi"))
    records, stats = _read(str(path))
    assert [r.key for r in records] == ["ok"]
    ((reason, _, key, message),) = stats.recent
    assert (reason, key) == ("bad_key", "caf\\xe9")
    assert message == "member name 'caf\\xe9.txt' is not UTF-8"  # one backslash, as repr(b'caf\xe9')


def _as_nobody(code: str) -> subprocess.CompletedProcess | None:
    """Run `code` in a Python as an unprivileged user (root passes every permission check)."""
    cmd = [sys.executable, "-c", code]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            return None
        cmd = [setpriv, "--reuid=nobody", "--regid=nogroup", "--clear-groups", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_shard_this_user_cannot_reach_says_permission_denied():
    base = tempfile.mkdtemp(prefix="mmd-perm-")
    try:
        os.chmod(base, 0o755)
        for name, mode in (("closed", 0o700), ("unlisted", 0o311)):
            os.mkdir(os.path.join(base, name))
            _write(os.path.join(base, name, "a.tar"), [("a.txt", b"x")])
            os.chmod(os.path.join(base, name), mode)
        specs = [f"{base}/closed/a.tar", f"{base}/closed/*.tar", f"{base}/closed", f"{base}/unlisted",
                 f"{base}/unlisted/*.tar"]
        code = ("import sys\nfrom pipeline.shards import expand_shards\n"
                f"for spec in {specs!r}:\n"
                "    try:\n        expand_shards(spec)\n        print('expanded', spec)\n"
                "    except OSError as e:\n        print(type(e).__name__, e)\n")
        proc = _as_nobody(code)
        if proc is None or "Permission" not in proc.stdout + proc.stderr and proc.returncode:
            pytest.skip(f"cannot run as an unprivileged user: {proc and proc.stderr[-300:]}")
        lines = proc.stdout.strip().splitlines()
        assert len(lines) == len(specs), proc.stdout + proc.stderr
        assert all(line.startswith("PermissionError ") and "permission denied" in line for line in lines), lines
        assert f"may not enter directory '{base}/closed'" in lines[0] and "does not exist" not in lines[0]
        assert f"listing directory '{base}/closed'" in lines[1]
        assert f"directory '{base}/unlisted' (from spec" in lines[3]
        assert "[Errno" not in proc.stdout
    finally:
        for name in ("closed", "unlisted"):
            if os.path.isdir(os.path.join(base, name)):
                os.chmod(os.path.join(base, name), 0o700)
        shutil.rmtree(base)
