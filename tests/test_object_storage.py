"""Shards on HTTP and S3 (`pipeline.remote`): read as local shards are, resumed where a dropped
connection cut them, refused in one line where a payload mode cannot use them. Every server is
started here on 127.0.0.1 (a Range-serving HTTP server, moto's S3 server); no real cloud."""

from __future__ import annotations

import http.server
import os
import re
import threading

import pytest

from pipeline import remote
from pipeline.errors import ErrorPolicy, ErrorStats
from pipeline.reader import ReaderConfig, iter_shard
from pipeline.shards import expand_shards
from tests.test_service import all_keys, consume, dispatcher, flat_keys, make_config, readers, shards  # noqa: F401

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
    """Files of `root` with Range support; `drops[name]` GETs of a file end after `cut` bytes."""

    root = ""
    drops: dict[str, int] = {}
    cut = 0
    gets: list[str] = []

    def log_message(self, *args) -> None:
        pass

    def _file(self) -> bytes | None:
        path = os.path.join(self.root, os.path.basename(self.path.split("?")[0]))
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
        self.gets.append(name)
        lo, body = send_range(self, data)
        if self.drops.get(name, 0) > 0 and lo > 0:  # a drop mid-shard, after the first block
            self.drops[name] -= 1
            self.wfile.write(body[:self.cut])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)
            return
        self.wfile.write(body)


@pytest.fixture()
def http_server(shards):
    handler = type("Handler", (_Shards,), {"root": os.path.dirname(shards[0]), "drops": {},
                                           "cut": 100, "gets": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    """Several range requests per shard (so a drop lands mid-shard), quick retries."""
    monkeypatch.setattr(remote, "BLOCK_BYTES", 16 << 10)
    monkeypatch.setattr(remote, "BACKOFF_S", 0.01)


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
    assert shard == url and f"shard {url!r}: failed {remote.TRIES} times" in detail
    with pytest.raises(Exception, match=re.escape(url)):  # --errors raise: the same line, raised
        list(iter_shard(url, ReaderConfig(keep_members=False, errors=ErrorPolicy(mode="raise"))))


def test_http_specs_that_cannot_work_are_one_line(http_server):
    base, _ = http_server
    with pytest.raises(ValueError, match="cannot be globbed; list the URLs or use a"):
        expand_shards(base + "/*.tar")
    with pytest.raises(ValueError, match="must end with one of"):
        expand_shards(base + "/notes.txt")


def test_a_dispatcher_serves_http_shards_inline_and_refuses_them_by_reference(shards, http_server):
    base, _ = http_server
    urls = [f"{base}/{os.path.basename(s)}" for s in shards]
    with dispatcher(make_config(urls, world_size=2)) as srv, readers(srv.reader_endpoint, 2):
        got = consume(srv.trainer_endpoint, 2)
    assert sorted(flat_keys(got)) == sorted(all_keys(shards))
    for mode in ("reference", "direct"):
        with pytest.raises(ValueError, match=rf"payloads='{mode}' needs shards on .*{re.escape(urls[0])}"
                                             r".* is remote storage \(use payloads='inline'\)"):
            make_config(urls, world_size=1, payloads=mode)


@pytest.fixture()
def s3(monkeypatch, shards):
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    import boto3

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    for k, v in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
                 "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket="data")
    for s in shards:
        client.upload_file(s, "data", f"train/{os.path.basename(s)}")
    client.put_object(Bucket="data", Key="train/README.txt", Body=b"not a shard")
    try:
        yield "s3://data/train"
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()


@pytest.mark.timeout(120)
def test_s3_globs_list_the_bucket_and_read_as_the_local_files_do(shards, s3):
    urls = expand_shards(s3 + "/*.tar")
    assert urls == [f"{s3}/{os.path.basename(s)}" for s in sorted(shards)]
    assert _keys(urls) == _keys(sorted(shards))
    with pytest.raises(FileNotFoundError, match=r"no shard matches 's3://data/train/val-\*\.tar'"):
        expand_shards(s3 + "/val-*.tar")
    stats = ErrorStats()
    assert _keys([s3 + "/missing.tar"], stats=stats) == []
    assert stats.by_reason["open_failed"] == 1 and "s3://data/train/missing.tar" in stats.recent[-1][3]
