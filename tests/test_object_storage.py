"""Shards on HTTP and S3 (`pipeline.remote`): read as local shards are, resumed where a dropped
connection cut them, refused in one line where a payload mode cannot use them. Every server is
started here on 127.0.0.1 (a Range-serving HTTP server, moto's S3 server); no real cloud."""

from __future__ import annotations

import http.server
import logging
import os
import re
import threading
from collections import Counter
from contextlib import contextmanager

import pytest

from pipeline import remote
from pipeline.errors import ErrorPolicy, ErrorStats
from pipeline.reader import ReaderConfig, iter_shard
from pipeline.shards import expand_shards
from tests.test_reference_payloads import _contents
from tests.test_service import all_keys, consume, dispatcher, make_config, readers, shards  # noqa: F401

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")


def send_range(handler: http.server.BaseHTTPRequestHandler, data: bytes) -> tuple[int, bytes]:
    """Answer `handler`'s request for `data`, honouring its Range header: status and headers
    sent; (the offset of the first byte, the body still to write)."""
    lo, hi = 0, len(data) - 1
    m = re.match(r"bytes=(\d+)-(\d*)", handler.headers.get("Range", ""))
    if m:
        lo, hi = int(m.group(1)), min(hi, int(m.group(2) or hi))
    body = data[lo:hi + 1]
    handler.send_response(206 if m else 200)
    handler.send_header("Content-Length", str(len(body)))
    handler.send_header("Content-Range", f"bytes {lo}-{hi}/{len(data)}")
    handler.send_header("Accept-Ranges", "bytes")
    handler.end_headers()
    return lo, body


class _Shards(http.server.BaseHTTPRequestHandler):
    """Files of `root` with Range support; `drops[name]` GETs of a file end after `cut` bytes;
    `gets` lists (name, bytes asked for) of every GET."""

    root = ""
    drops: dict[str, int] = {}
    cut = 0
    gets: list[str] = []

    def log_message(self, *args) -> None:
        pass

    def _file(self) -> bytes | None:
        name = os.path.basename(self.path.split("?")[0])
        if name.startswith("loop"):  # redirects to itself, for ever
            self.send_response(302)
            self.send_header("Location", self.path)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        path = os.path.join(self.root, name)
        if not os.path.isfile(path):
            self.send_error(404)
            return None
        with open(path, "rb") as f:
            return f.read()

    def do_HEAD(self) -> None:
        data = self._file()
        if data is not None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()

    def do_GET(self) -> None:
        data = self._file()
        if data is None:
            return
        name = os.path.basename(self.path)
        lo, body = send_range(self, data)
        self.gets.append((name, len(body)))
        if self.drops.get(name, 0) > 0 and lo > 0:  # a drop mid-shard, after the first block
            self.drops[name] -= 1
            self.wfile.write(body[:self.cut])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)
            return
        self.wfile.write(body)


@contextmanager
def serving(handler):
    """`handler` served on 127.0.0.1 (a thread per request) for the block: its base URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def moto_s3(monkeypatch):
    """moto's S3 server on 127.0.0.1 for the block, the environment pointing boto3 and s3fs at
    it, and a bucket `data`: a boto3 client."""
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    import boto3
    import s3fs

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    for k, v in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
                 "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    s3fs.S3FileSystem.clear_instance_cache()
    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket="data")
    try:
        yield client
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()


@pytest.fixture()
def http_server(shards):
    handler = type("Handler", (_Shards,), {"root": os.path.dirname(shards[0]), "drops": {},
                                           "cut": 100, "gets": []})
    with serving(handler) as base:
        yield base, handler


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    """Several range requests per shard (so a drop lands mid-shard), quick retries."""
    monkeypatch.setattr(remote, "BLOCK_BYTES", 16 << 10)
    monkeypatch.setattr(remote, "BACKOFF_S", 0.01)
    monkeypatch.setattr(remote, "RETRY_S", 0.5)


def _keys(urls, **kw):
    return [r.key for u in urls for r in iter_shard(u, ReaderConfig(keep_members=False), **kw)]


def test_http_shards_read_as_the_local_files_do_and_resume_after_a_drop(shards, http_server):
    base, handler = http_server
    urls = expand_shards(base + "/" + "{" + ",".join(os.path.basename(s) for s in shards[:3]) + "}")
    assert urls == [f"{base}/{os.path.basename(s)}" for s in shards[:3]]
    assert _keys(urls) == _keys(shards[:3])
    name = os.path.basename(shards[1])
    handler.drops[name] = 2  # two GETs past the first block end early: retried, resumed
    stats = ErrorStats()
    assert _keys(urls, stats=stats) == _keys(shards[:3])
    assert stats.num_errors == 0 and handler.drops[name] == 0


@pytest.mark.timeout(60)
def test_a_server_that_always_drops_gives_one_error_naming_the_url(shards, http_server):
    base, handler = http_server
    url = f"{base}/{os.path.basename(shards[0])}"
    handler.drops[os.path.basename(shards[0])] = 10**6
    stats = ErrorStats()
    got = _keys([url], stats=stats)
    assert 0 < len(got) < len(_keys(shards[:1]))  # the first block's samples came through
    (reason, shard, _, detail) = stats.recent[-1]
    assert shard == url and re.search(rf"shard {re.escape(repr(url))}: failed \d+ times in [\d.]+ s", detail)
    with pytest.raises(Exception, match=re.escape(url)):  # --errors raise: the same line, raised
        list(iter_shard(url, ReaderConfig(keep_members=False, errors=ErrorPolicy(mode="raise"))))


def test_tars_joined_with_cat_read_whole_over_http_and_bytes_after_the_end_are_named(tmp_path):
    from tests.test_tar_layouts import _JOINED_KEYS, _joined

    _joined(tmp_path, "joined.tar")
    _, data = _joined(tmp_path, "tail.tar", tail=b"appended notes")
    handler = type("Handler", (_Shards,), {"root": str(tmp_path), "drops": {}, "cut": 0, "gets": []})
    with serving(handler) as base:
        assert _keys([f"{base}/joined.tar"]) == _JOINED_KEYS  # past 16 KiB: over several range requests
        stats = ErrorStats()
        records = list(iter_shard(f"{base}/tail.tar", ReaderConfig(errors=ErrorPolicy(mode="skip")), stats=stats))
    assert [r.key for r in records] == _JOINED_KEYS and stats.by_reason == {"bad_tar": 1}
    assert f"non-zero bytes at byte {len(data) - 14}, after the end-of-archive" in stats.recent[0][3]


def test_a_redirect_loop_is_named_as_one_not_as_http_0(http_server):
    base, _ = http_server
    url = f"{base}/loop-000.tar"
    stats = ErrorStats()
    assert _keys([url], stats=stats) == []
    (reason, shard, _, detail) = stats.recent[-1]
    assert shard == url and "too many redirects" in detail and "HTTP 0" not in detail, detail


@pytest.mark.parametrize("as_json", [True, False])
def test_inspect_hides_url_credentials_in_its_tables_and_json(http_server, capsys, monkeypatch, as_json):
    from mmdispatch.cli import main

    monkeypatch.setenv("COLUMNS", "400")  # no URL folded across lines in the table
    base, _ = http_server
    url = base.replace("://", "://alice:hunter2@") + "/missing-000.tar?X-Amz-Signature=SECRETSIG&token=SECRETTOK"
    assert main(["inspect", *(["--json"] if as_json else []), url]) == 1
    out = capsys.readouterr().out
    assert "missing-000.tar" in out and "X-Amz-Signature=***" in out and "alice:***@" in out, out
    assert not {"hunter2", "SECRETSIG", "SECRETTOK"} & set(re.findall(r"\w+", out)), out


def test_http_specs_that_cannot_work_are_one_line(http_server):
    base, _ = http_server
    with pytest.raises(ValueError, match="cannot be globbed; list the URLs or use a"):
        expand_shards(base + "/*.tar")
    with pytest.raises(ValueError, match="must end with one of"):
        expand_shards(base + "/notes.txt")


def test_http_shards_are_served_inline_and_direct_and_refused_by_reference(shards, http_server):
    """Direct payloads of remote shards: trainers get byte for byte what inline delivers, from
    the readers' caches, or with no cache from a ranged read of the object per item; two GETs
    of one object are cut mid-way there and retried."""
    base, handler = http_server
    urls = [f"{base}/{os.path.basename(s)}" for s in shards]
    with dispatcher(make_config(urls, world_size=2)) as srv, readers(srv.reader_endpoint, 2):
        inline = consume(srv.trainer_endpoint, 2, record=_contents)
    assert sorted(k for got in inline.values() for step in got for _, keys, *_ in step
                  for k in keys) == sorted(all_keys(shards))
    for cache_mb in (None, 0):
        kw = {} if cache_mb is None else {"payload_cache_mb": cache_mb}
        handler.gets.clear()
        if cache_mb == 0:
            handler.drops[os.path.basename(shards[0])] = 2
        with dispatcher(make_config(urls, world_size=2, payloads="direct")) as srv, \
                readers(srv.reader_endpoint, 2, **kw) as workers:
            direct = consume(srv.trainer_endpoint, 2, record=_contents)
            missed = sum(w.payload_server.num_missed for w in workers)
        assert direct == inline, f"payload cache {cache_mb} MB"
        items = sum(len(items) for got in inline.values() for step in got for *_, enc in step
                    for items in enc.values())
        assert missed == (items if cache_mb == 0 else 0)
        if cache_mb == 0:  # every item one ranged GET of exactly its bytes
            sizes = Counter(len(b) for got in inline.values() for step in got for *_, enc in step
                            for items_ in enc.values() for _, _, b in items_)
            assert not sizes - Counter(n for _, n in handler.gets)
            assert handler.drops[os.path.basename(shards[0])] == 0  # both cuts came and went
    with pytest.raises(ValueError, match=rf"--payloads reference needs shards on a filesystem the "
                                         rf"trainers mount; {re.escape(repr(urls[0]))} is remote "
                                         r"storage \(use --payloads direct"):
        make_config(urls, world_size=1, payloads="reference")


@pytest.fixture()
def s3(monkeypatch, shards):
    with moto_s3(monkeypatch) as client:
        for s in shards:
            client.upload_file(s, "data", f"train/{os.path.basename(s)}")
        client.put_object(Bucket="data", Key="train/README.txt", Body=b"not a shard")
        yield "s3://data/train"


@pytest.mark.timeout(120)
def test_s3_globs_list_the_bucket_and_read_as_the_local_files_do(shards, s3):
    urls = expand_shards(s3 + "/*.tar")
    assert urls == [f"{s3}/{os.path.basename(s)}" for s in sorted(shards)]
    assert _keys(urls) == _keys(sorted(shards))
    with pytest.raises(FileNotFoundError, match=r"no shard file matches 's3://data/train/val-\*\.tar'"):
        expand_shards(s3 + "/val-*.tar")
    stats = ErrorStats()
    assert _keys([s3 + "/missing.tar"], stats=stats) == []
    assert stats.by_reason["open_failed"] == 1 and stats.recent[-1][1] == s3 + "/missing.tar"
    assert stats.recent[-1][3].startswith("cannot open: not found")


@pytest.mark.timeout(120)
def test_an_s3_glob_in_a_bucket_that_does_not_exist_says_so(shards, s3):
    """Probe: it said "no shard file matches ...; a file whose name holds * ? or [ is named by
    its exact path", hiding the missing bucket that a plain URL there names."""
    from pipeline.shards import expand_shards

    with pytest.raises(ValueError, match=r"listing 's3://no-such-bucket/train/\*\.tar' failed: the "
                                         r"bucket 'no-such-bucket' does not exist"):
        expand_shards(["s3://no-such-bucket/train/*.tar"])


def test_an_s3_key_with_glob_characters_is_named_by_itself(shards, s3):
    """`br[1].tar` matched no glob (its [1] is a character class); an object of exactly that
    key is taken first, as a local file of that name is."""
    import boto3

    boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"]).upload_file(
        shards[0], "data", "train/odd/br[1].tar")
    url = s3 + "/odd/br[1].tar"
    assert expand_shards(url) == [url]
    assert _keys([url]) == _keys([shards[0]])
    with pytest.raises(FileNotFoundError, match="no shard file matches"):
        expand_shards(s3 + "/odd/br[2].tar")


@pytest.mark.timeout(120)
def test_s3_keys_holding_a_question_mark_and_globs_over_other_objects(shards, s3):
    """A `?` in an S3 key is the key's (only HTTP has a query); a glob leaves out objects that
    are no shards (a README), as a local glob does, and refuses, as it does, when none is left."""
    import boto3

    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    client.upload_file(shards[0], "data", "train/q/a?b.tar")
    client.upload_file(shards[1], "data", "train/q/c.tar")
    client.put_object(Bucket="data", Key="train/q/README.md", Body=b"not a shard")
    url = s3 + "/q/a?b.tar"
    assert expand_shards(url) == [url]
    assert _keys([url]) == _keys([shards[0]])
    assert expand_shards(s3 + "/q/*") == [url, s3 + "/q/c.tar"]
    with pytest.raises(FileNotFoundError, match=r"no shard file matches 's3://data/train/q/\*\.md' "
                                                r"\(from spec .*\); a file whose name holds"):
        expand_shards(s3 + "/q/*.md")
    with pytest.raises(ValueError, match="must end with one of"):
        expand_shards(s3 + "/q/README.md")  # named by itself: refused, as a local file is
    # a tar compressed so that readers cannot inflate it is no README: left out, its samples
    # would be lost, so the listing is refused naming it, as a local directory's is
    client.upload_file(shards[1], "data", "train/z/c.tar")
    client.put_object(Bucket="data", Key="train/z/d.tar.zst", Body=b"(\xb5/\xfd")
    with pytest.raises(ValueError, match=r"d\.tar\.zst.*zstd-compressed.*store it decompressed"):
        expand_shards(s3 + "/z/*")


@pytest.mark.timeout(120)
def test_an_upper_case_scheme_names_the_same_shard(shards, s3, http_server):
    base, _ = http_server
    name = os.path.basename(shards[0])
    assert expand_shards("HTTP" + base[4:] + "/" + name) == [f"{base}/{name}"]
    assert _keys(["HTTP" + base[4:] + "/" + name]) == _keys([shards[0]])  # fsspec knows "http" only
    assert expand_shards("S3" + s3[2:] + "/*.tar") == expand_shards(s3 + "/*.tar")
    assert _keys(["S3" + s3[2:] + "/" + name]) == _keys([shards[0]])
    with pytest.raises(ValueError, match="listed more than once"):
        expand_shards([f"{base}/{name}", "Http" + base[4:] + "/" + name])


@pytest.mark.timeout(120)
def test_s3_shards_serve_direct_payloads_read_back_by_range(shards, s3):
    """Direct mode on S3 with no reader cache: every item a ranged GET of its object, and the
    trainers get what an inline run of the local files delivers."""
    with dispatcher(make_config(shards, world_size=2)) as srv, readers(srv.reader_endpoint, 2):
        inline = consume(srv.trainer_endpoint, 2, record=_contents)
    urls = [f"{s3}/{os.path.basename(s)}" for s in shards]
    with dispatcher(make_config(urls, world_size=2, payloads="direct")) as srv, \
            readers(srv.reader_endpoint, 2, payload_cache_mb=0) as workers:
        direct = consume(srv.trainer_endpoint, 2, record=_contents)
        missed = sum(w.payload_server.num_missed for w in workers)
    assert direct == inline and missed > 0


def test_object_storage_libraries_log_only_warnings_unless_debug(capsys):
    """botocore said 'Found credentials in environment variables.' on every reader's start."""
    from dispatcher_server.cliopts import setup_logging

    root = logging.getLogger()
    level = root.level
    try:
        setup_logging("text", "INFO")
        logging.getLogger("botocore.credentials").info("Found credentials in environment variables.")
        logging.getLogger("botocore.credentials").warning("credentials expire soon")
        logging.getLogger("mmdispatch.reader").info("mmdispatch event=ours")
        setup_logging("text", "DEBUG")
        logging.getLogger("s3fs").debug("s3fs at debug")
    finally:
        for handler in [h for h in root.handlers if getattr(h, "mmdispatch", False)]:
            root.removeHandler(handler)
        root.setLevel(level)
    err = capsys.readouterr().err
    assert "Found credentials" not in err
    assert "credentials expire soon" in err and "event=ours" in err and "s3fs at debug" in err
