"""Remote shards whose object changes or whose server gives no usable size, is busy or absent:
nothing is read from a version other than the one opened (block reads, reopens, direct
payloads read back by offset), streams without a size resume, busy servers are waited for as
they ask, and a missing backend is refused at start. Servers run here on 127.0.0.1 (a local
http.server, moto's S3 server); no real cloud."""

from __future__ import annotations

import gzip
import hashlib
import http.server
import io
import logging
import os
import re
import tarfile
import time

import pytest
import zmq

from dispatcher_server import protocol as P
from pipeline import remote, shards
from pipeline.errors import ErrorStats
from pipeline.payloads import PayloadCache, PayloadServer
from pipeline.probe import probe_source
from pipeline.reader import ReaderConfig, iter_shard

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

from tests.test_object_storage import moto_s3, send_range, serving  # noqa: E402 - after the skips

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    """Several range requests per shard (a change lands mid-shard), quick retries."""
    monkeypatch.setattr(remote, "BLOCK_BYTES", 16 << 10)
    monkeypatch.setattr(remote, "BACKOFF_S", 0.01)
    monkeypatch.setattr(remote, "RETRY_S", 0.5)


@pytest.fixture()
def versions(small_shards, tmp_path):
    """(old, new): a shard and a new version of it of the same size whose keys all start with
    'new' (a re-run of a data pipeline): only the version can tell them apart."""
    old = small_shards[1]
    new = str(tmp_path / "new.tar")
    with tarfile.open(old) as tin, tarfile.open(new, "w", format=tarfile.USTAR_FORMAT) as tout:
        for m in tin.getmembers():
            data = tin.extractfile(m).read()
            m.name = "new" + m.name[3:]
            tout.addfile(m, io.BytesIO(data))
    assert os.path.getsize(new) == os.path.getsize(old)
    return old, new


def _read(url: str, on_open=None) -> tuple[list[str], ErrorStats]:
    stats = ErrorStats()
    keys = [r.key for r in iter_shard(url, ReaderConfig(keep_members=False), stats=stats, on_open=on_open)]
    return keys, stats


class _Versions(http.server.BaseHTTPRequestHandler):
    """One object `/x.tar` (others: 404): `files[0]` for the first `swap_after` GETs, then `files[1]`, each
    with an ETag of its bytes (HEAD too). `if_match`: answer 412 when If-Match names another
    ETag (as S3, nginx and CDNs do; `http.server` ignores it). `etag_on_get`: GETs carry the
    ETag. `drop_first_after_swap`: the first GET of the new object sends 100 bytes and closes."""

    protocol_version = "HTTP/1.1"
    files: list[str] = []
    swap_after = 2
    if_match = False
    etag_on_get = True
    drop_first_after_swap = False
    gets = 0
    refused = 0

    def log_message(self, *args) -> None:
        pass

    def _object(self) -> tuple[bytes, str]:
        with open(self.files[self.gets >= self.swap_after], "rb") as f:
            data = f.read()
        return data, '"%s"' % hashlib.md5(data).hexdigest()

    def do_HEAD(self) -> None:
        if self.path != "/x.tar":
            self.send_error(404)
            return
        data, etag = self._object()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", etag)
        self.end_headers()

    def do_GET(self) -> None:
        if self.path != "/x.tar":
            self.send_error(404)
            return
        data, etag = self._object()
        cls = type(self)
        cls.gets += 1
        asked = self.headers.get("If-Match")
        if self.if_match and asked and asked != etag:
            cls.refused += 1
            self.send_response(412)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if not self.etag_on_get:
            lo, body = send_range(self, data)
        else:
            lo, body = _send_range_with(self, data, {"ETag": etag})
        if self.drop_first_after_swap and cls.gets == self.swap_after + 1:
            self.wfile.write(body[:100])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(body)


def _send_range_with(handler, data: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    """send_range with more headers (its own end_headers comes after them)."""
    end = handler.end_headers
    handler.end_headers = lambda: ([handler.send_header(k, v) for k, v in headers.items()], end())
    try:
        return send_range(handler, data)
    finally:
        handler.end_headers = end


@pytest.mark.parametrize("server", ["ignores_if_match", "honours_if_match", "etag_on_reopen_only"])
def test_an_http_object_replaced_between_block_reads_is_not_spliced(versions, server):
    """Same size, so only the version tells: the next block's answer (its ETag, or the 412 a
    server gives for If-Match) or the reopen after a drop (HEAD's ETag) stops the shard."""
    old, new = versions
    handler = type("Handler", (_Versions,), {
        "files": [old, new], "gets": 0, "refused": 0, "if_match": server == "honours_if_match",
        "etag_on_get": server != "etag_on_reopen_only",
        "drop_first_after_swap": server == "etag_on_reopen_only"})
    with serving(handler) as base:
        keys, stats = _read(f"{base}/x.tar")
    assert stats.by_reason == {"shard_changed": 1}, stats.recent
    detail = stats.recent[-1][3]
    assert f"shard '{base}/x.tar': it was replaced while being read (opened as ETag" in detail
    assert keys and not [k for k in keys if k.startswith("new")]
    assert keys == _read(old)[0][:len(keys)]
    if server == "honours_if_match":
        assert handler.refused == 1 and "HTTP 412" in detail


@pytest.fixture()
def s3(monkeypatch):
    with moto_s3(monkeypatch) as client:
        yield client


def test_an_s3_object_replaced_while_read_is_reported_not_spliced(versions, s3, caplog):
    """s3fs reads each block with IfMatch; the store's refusal (FileExpired) is the change,
    not a failure to retry (a retry reopened the new object at the byte reached)."""
    old, new = versions
    s3.upload_file(old, "data", "x.tar")
    read = [0]

    class Replacing:  # the object is replaced once the first blocks have been read
        def __init__(self, stream):
            self.stream = stream

        def read(self, n=-1):
            data = self.stream.read(n)
            read[0] += len(data)
            if read[0] > 40_000 and read[0] - len(data) <= 40_000:
                s3.upload_file(new, "data", "x.tar")
            return data

        def __getattr__(self, name):
            return getattr(self.stream, name)

    with caplog.at_level(logging.WARNING, logger="mmdispatch.remote"):
        keys, stats = _read("s3://data/x.tar", on_open=Replacing)
    assert stats.by_reason == {"shard_changed": 1}, stats.recent
    assert not [r for r in caplog.records if "event=shard_retry" in r.getMessage()]
    assert "shard 's3://data/x.tar': it was replaced while being read" in stats.recent[-1][3]
    assert keys and not [k for k in keys if k.startswith("new")]


def _first_member(path: str) -> tuple[int, int]:
    record = next(r for r in iter_shard(path, ReaderConfig(), spans=True) if r.spans)
    return next(iter(record.spans.values()))


def test_direct_payloads_of_an_s3_object_replaced_since_counted_are_refused(versions, s3):
    """A reader's cache miss reads the member back by offset: from the version its reader read
    (the reference's stamp), never from the object now there."""
    old, new = versions
    s3.upload_file(old, "data", "x.tar")
    url = "s3://data/x.tar"
    with shards.open_shard(url) as stream:
        stamp = shards.stream_stamp(stream)
    assert stamp != 0
    offset, size = _first_member(old)
    with open(old, "rb") as f:
        f.seek(offset)
        expected = f.read(size)
    assert shards.read_range(url, offset, size, stamp) == expected
    s3.upload_file(new, "data", "x.tar")
    with pytest.raises(OSError, match=rf"^shard {re.escape(repr(url))} changed in storage since "
                                      r"its reader read it \(replaced: now ETag"):
        shards.read_range(url, offset, size, stamp)


def test_direct_payloads_of_an_http_object_replaced_since_counted_are_refused(versions):
    old, new = versions
    handler = type("Handler", (_Versions,), {"files": [old, new], "gets": 0, "swap_after": 10**6})
    with serving(handler) as base:
        url = f"{base}/x.tar"
        with shards.open_shard(url) as stream:
            stamp = shards.stream_stamp(stream)
        offset, size = _first_member(old)
        assert stamp != 0 and len(shards.read_range(url, offset, size, stamp)) == size
        handler.swap_after = 0
        with pytest.raises(OSError, match="changed in storage since its reader read it"):
            shards.read_range(url, offset, size, stamp)


class _NoSize(http.server.BaseHTTPRequestHandler):
    """Servers that give no usable size: `chunked` answers GETs without Content-Length
    (chunked transfer) and HEAD with 405, `gzip` with Content-Encoding: gzip; neither honours
    Range. GET number `drop_at` of the shard stops half-way (chunked: without the last chunk)."""

    protocol_version = "HTTP/1.1"
    path_ = ""
    mode = "chunked"
    drop_at = 0
    gets = 0

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        if self.mode == "chunked":
            self.send_response(405)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = self._body()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Encoding", "gzip")
        self.end_headers()

    def _body(self) -> bytes:
        with open(self.path_, "rb") as f:
            data = f.read()
        return gzip.compress(data, mtime=0) if self.mode == "gzip" else data

    def do_GET(self) -> None:
        type(self).gets += 1
        body = self._body()
        cut = self.gets == self.drop_at
        self.send_response(200)
        if self.mode == "gzip":
            self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[:len(body) // 2] if cut else body)
        else:
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(0, len(body) // 2 if cut else len(body), 8192):
                chunk = body[i:i + 8192]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            if not cut:
                self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
        if cut:
            self.close_connection = True


@pytest.mark.parametrize("mode", ["chunked", "gzip"])
def test_a_server_that_gives_no_size_is_read_as_a_stream_and_resumed(small_shards, mode):
    path = small_shards[0]
    handler = type("Handler", (_NoSize,), {"path_": path, "mode": mode, "gets": 0, "drop_at": 0})
    with serving(handler) as base:
        url = f"{base}/x.tar"
        keys, stats = _read(url)
        assert stats.num_errors == 0, stats.recent
        assert keys == _read(path)[0]
        handler.drop_at = handler.gets + 1  # the next read is cut half-way: resumed, none lost
        keys, stats = _read(url)
        assert stats.num_errors == 0, stats.recent
        assert keys == _read(path)[0] and handler.gets > handler.drop_at
        offset, size = _first_member(path)
        with open(path, "rb") as f:
            f.seek(offset)
            expected = f.read(size)
        started = time.monotonic()
        assert shards.read_range(url, offset, size) == expected  # direct mode's cache miss
        assert time.monotonic() - started < 5  # no retries on the way


def test_a_request_fsspec_cannot_make_is_not_retried():
    """ValueError from fsspec (a seek in a stream) fails the same way every try."""
    permanent, said = remote.diagnose(ValueError("Cannot seek streaming HTTP file"))
    assert permanent is OSError and "Cannot seek" in said


class _Busy(http.server.BaseHTTPRequestHandler):
    """Range-serving `path_`; ranged GETs past byte 0 answer 503 with `Retry-After: retry_after`
    until `busy_until` (time.monotonic()); `times` records when each GET came."""

    protocol_version = "HTTP/1.1"
    path_ = ""
    busy_until = 0.0
    retry_after = "1"
    times: list[float] = []

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(os.path.getsize(self.path_)))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()

    def do_GET(self) -> None:
        self.times.append(time.monotonic())
        if not self.headers.get("Range", "bytes=0-").startswith("bytes=0-") and \
                time.monotonic() < self.busy_until:
            self.send_response(503)
            if self.retry_after:
                self.send_header("Retry-After", self.retry_after)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        with open(self.path_, "rb") as f:
            _, body = send_range(self, f.read())
        self.wfile.write(body)


@pytest.mark.parametrize(("retry_after", "busy_s"), [("1", 2.5), ("", 1.5)])
def test_a_server_busy_for_a_while_is_waited_for_as_it_asks(small_shards, monkeypatch, caplog,
                                                            retry_after, busy_s):
    """Seconds of 503 cost nothing (the retries have a time budget, not a try count: without
    Retry-After, 1.5 s of 0.01 s backoff doubling is more than 5 tries), a server's Retry-After
    spaces them; each retry is one log line naming the shard."""
    monkeypatch.setattr(remote, "RETRY_S", 10.0)
    path = small_shards[0]
    handler = type("Handler", (_Busy,), {"path_": path, "times": [], "retry_after": retry_after,
                                         "busy_until": time.monotonic() + busy_s})
    with serving(handler) as base, caplog.at_level(logging.WARNING, logger="mmdispatch.remote"):
        url = f"{base}/x.tar"
        keys, stats = _read(url)
    assert stats.num_errors == 0, stats.recent
    assert keys == _read(path)[0]
    retries = [r.getMessage() for r in caplog.records if "event=shard_retry" in r.getMessage()]
    assert retries and all(f"shard={url} " in m and "HTTP 503" in m for m in retries)
    assert "attempt=1 " in retries[0]
    if retry_after:
        gaps = [b - a for a, b in zip(handler.times, handler.times[1:])]
        assert sum(g >= 0.9 for g in gaps) >= 2, gaps  # Retry-After: 1, not 0.01 s backoff
        assert "wait_s=1.0" in retries[0]
    else:
        assert len(retries) > 5


def test_a_read_back_for_a_trainer_rides_out_an_outage_as_a_shard_read_does(small_shards, monkeypatch):
    """Probe: direct mode's read-back gave up after 3 s of retries, and a trainer's 4 attempts
    after about 7 s: a 10-second object-store outage killed the trainer, where the docs promise
    that an outage under a minute loses nothing (a streaming read rides it out). The reader
    keeps the trainer waiting with heartbeats meanwhile; a store gone for longer is answered
    with the error after `READ_BACK_RETRY_S`."""
    assert remote.READ_BACK_RETRY_S >= 60  # a streaming read's minute (the tests shorten RETRY_S)
    path = small_shards[0]
    with open(path, "rb") as f:
        want = f.read()[1024:1124]
    handler = type("Handler", (_Busy,), {"path_": path, "times": [], "retry_after": "",
                                         "busy_until": time.monotonic() + 5})
    with serving(handler) as base:
        assert shards.read_range(f"{base}/x.tar", 1024, 100) == want  # past 5 s of 503s
    assert sum(t < handler.busy_until for t in handler.times) > 2  # it was refused, and retried
    monkeypatch.setattr(remote, "READ_BACK_RETRY_S", 2.0)
    handler = type("Handler", (_Busy,), {"path_": path, "times": [], "retry_after": "",
                                         "busy_until": time.monotonic() + 600})
    with serving(handler) as base:
        started = time.monotonic()
        with pytest.raises(OSError, match=rf"^shard '{base}/x.tar': failed \d+ times in .*HTTP 503"):
            shards.read_range(f"{base}/x.tar", 1024, 100)
    assert time.monotonic() - started < 2.0 + 8


def test_retry_after_is_read_in_seconds_or_as_a_date():
    import aiohttp
    from email.utils import formatdate

    def error(value: str) -> Exception:
        return aiohttp.ClientResponseError(None, (), status=503, headers={"Retry-After": value})

    assert remote.retry_after(error("7")) == 7.0
    assert 25 < remote.retry_after(error(formatdate(time.time() + 30, usegmt=True))) <= 30
    assert remote.retry_after(error("soon")) is None and remote.retry_after(ValueError()) is None


def test_a_missing_backend_refuses_every_remote_url_at_start(monkeypatch, small_shards):
    """Not only globs: a brace range of gs:// URLs too, and the probe of such a URL notes it."""
    import fsspec

    real = fsspec.core.url_to_fs

    def no_gcsfs(url, **kw):
        if url.startswith("gs://"):
            raise ImportError("Install gcsfs to access Google Storage")  # as fsspec words it
        return real(url, **kw)

    monkeypatch.setattr(fsspec.core, "url_to_fs", no_gcsfs)
    with pytest.raises(ValueError, match=r"^shard 'gs://bucket/x-000\.tar' needs gcsfs \(gcsfs is "
                                         r"not installed\): pip install 'mmdispatch\[cloud\]'$"):
        shards.expand_shards("gs://bucket/x-{000..003}.tar")
    result = probe_source(["gs://bucket/x-000.tar", small_shards[0]], ReaderConfig())
    assert result.unreadable and "needs gcsfs" in result.unreadable[0][1]
    assert result.samples > 0  # the next shard was probed


def test_an_s3_read_timeout_is_named_not_an_index_error():
    """s3fs's error handling indexes `args[1]` of the OSError a timed-out read raises."""
    try:
        try:
            raise OSError("Read timeout on endpoint URL: 'http://s3/x.tar'")
        except OSError as ex:
            ex.args[1]  # what s3fs's S3File._fetch_range does  # noqa: B018
    except IndexError as e:
        error = e
    permanent, said = remote.diagnose(error)
    assert permanent is None  # retried
    assert said == "read timed out (Read timeout on endpoint URL: 'http://s3/x.tar')"


def test_a_failed_read_back_is_logged_once_per_shard(small_shards, caplog):
    """A direct-mode reader that cannot read a member back answers each trainer with the
    reason and says it in its own log once per shard, not once per member or never."""
    handler = type("Handler", (_Versions,), {"files": [small_shards[0]] * 2, "gets": 0})
    with serving(handler) as base:
        url = f"{base}/gone.tar"
        server = PayloadServer("tcp://127.0.0.1:0", cache=PayloadCache(0))
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        try:
            server.servable = frozenset({url.encode()})
            sock.connect(server.endpoint)
            with caplog.at_level(logging.WARNING, logger="mmdispatch.payloads"):
                for i in range(3):
                    ref = P.pack_ref(url.encode(), 512 * i, 10, 0)
                    sock.send_multipart(P.encode(P.FETCH, frames=[ref], id=i, sizes=[len(ref)]))
                    assert sock.poll(20_000), "no answer"
                    answer = P.decode(sock.recv_multipart(copy=False))
                    assert answer.type == P.ERROR and "not found" in answer["message"]
        finally:
            sock.close(linger=0)
            ctx.term()
            server.close()
    lines = [r.getMessage() for r in caplog.records if "event=payload_read_failed" in r.getMessage()]
    assert len(lines) == 1 and f"shard={url} " in lines[0] and "not found" in lines[0], lines


def test_a_failed_fetch_names_shards_without_their_credentials_and_a_reason_once(small_shards):
    """Direct mode: a shard URL's password and token reach neither the reader's ERROR answer
    nor the trainer's FetchError, and a reason every try gave is said once, not per try."""
    from trainer_client.fetch import FetchConfig, FetchError, PayloadFetcher

    handler = type("Handler", (_Versions,), {"files": [small_shards[0]] * 2, "gets": 0})
    with serving(handler) as base:
        url = base.replace("http://", "http://bob:pw123@") + "/gone.tar?token=TOK123"
        server = PayloadServer("tcp://127.0.0.1:0", cache=PayloadCache(0))
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        fetcher = None
        try:
            server.servable = frozenset({url.encode()})
            ref = P.pack_ref(url.encode(), 0, 10, 0)
            sock.connect(server.endpoint)
            sock.send_multipart(P.encode(P.FETCH, frames=[ref], id=1, sizes=[len(ref)]))
            assert sock.poll(20_000), "no answer"
            answer = P.decode(sock.recv_multipart(copy=False))
            assert answer.type == P.ERROR and "not found" in answer["message"]
            assert "pw123" not in answer["message"] and "TOK123" not in answer["message"]

            reader = P.ReaderEndpoint(server.endpoint, "")
            msg = _one_item_step(ref, reader)
            fetcher = PayloadFetcher(decode=lambda m, f: f, out=None, config=FetchConfig(
                timeout_s=20, attempts=3, backoff_min_s=0.01, backoff_max_s=0.05))
            fetcher.readers = [reader]
            with pytest.raises(FetchError) as caught:
                fetcher.fetch(msg)
        finally:
            if fetcher is not None:
                fetcher.close()
            sock.close(linger=0)
            ctx.term()
            server.close()
    said = str(caught.value)
    assert "pw123" not in said and "TOK123" not in said, said
    assert "bob:***@" in said and "token=***" in said, said
    assert said.count("not found") == 1 and "(3 tries, the same each time)" in said, said


def test_a_shard_error_that_names_its_url_is_not_prefixed_with_it_again():
    from pipeline.errors import SampleError

    url = "http://127.0.0.1:1/x.tar"
    error = SampleError("shard_failed", url, None, f"shard {url!r}: failed 3 times")
    assert str(error) == f"shard_failed: shard {url!r}: failed 3 times"


def test_a_store_reporting_no_version_is_warned_about_once_per_shard(small_shards, monkeypatch, caplog):
    """No ETag and no Last-Modified: a same-size replacement mid-read cannot be told apart and
    was spliced in silence. Said once per shard (not per block or read-back), credentials hidden."""
    from tests.test_object_storage import _Shards

    monkeypatch.setattr(remote, "_UNVERSIONED", set())
    handler = type("Handler", (_Shards,), {"root": os.path.dirname(small_shards[0]), "drops": {},
                                           "cut": 100, "gets": []})
    names = [os.path.basename(p) for p in small_shards[:2]]
    with serving(handler) as base, caplog.at_level(logging.WARNING, logger="mmdispatch.remote"):
        base = base.replace("http://", "http://bob:pw123@")
        for name in names:
            keys, stats = _read(f"{base}/{name}")
            assert keys and stats.num_errors == 0
        offset, size = _first_member(small_shards[0])
        for _ in range(2):
            shards.read_range(f"{base}/{names[0]}", offset, size)
    assert len([g for g in handler.gets if g[0] == names[0]]) > 2  # several blocks, read twice
    lines = [r.getMessage() for r in caplog.records if "event=shard_unversioned" in r.getMessage()]
    shown = base.replace("pw123", "***")
    assert [line.split()[2] for line in lines] == [f"shard={shown}/{n}" for n in names], lines
    assert "cannot be detected" in lines[0] and "pw123" not in "".join(lines)


def test_a_versioned_object_is_not_warned_about(versions, monkeypatch, caplog):
    monkeypatch.setattr(remote, "_UNVERSIONED", set())
    handler = type("Handler", (_Versions,), {"files": [versions[0]] * 2, "gets": 0, "swap_after": 10**9})
    with serving(handler) as base, caplog.at_level(logging.WARNING, logger="mmdispatch.remote"):
        keys, _ = _read(f"{base}/x.tar")
    assert keys and not [r for r in caplog.records if "shard_unversioned" in r.getMessage()]


def test_a_slow_read_back_that_makes_progress_does_not_fail_the_trainer(small_shards, monkeypatch):
    """Direct mode, cache miss, a store slower than the trainer's timeout: the reader said
    nothing until it had the bytes, the trainer gave up on it every try and died with a
    FetchError. The reader's HEARTBEATs while it reads keep the trainer waiting."""
    from pipeline import payloads
    from trainer_client.fetch import FetchConfig, PayloadFetcher

    monkeypatch.setattr(payloads, "KEEPALIVE_S", 0.2)

    class _Slow(_Versions):
        def do_GET(self) -> None:
            time.sleep(2.0)  # four of the trainer's timeouts
            super().do_GET()

    handler = type("Handler", (_Slow,), {"files": [small_shards[0]] * 2, "gets": 0, "swap_after": 10**9})
    offset, size = _first_member(small_shards[0])
    with open(small_shards[0], "rb") as f:
        f.seek(offset)
        member = f.read(size)
    with serving(handler) as base:
        url = f"{base}/x.tar"
        server = PayloadServer("tcp://127.0.0.1:0", cache=PayloadCache(0))
        server.servable = frozenset({url.encode()})
        reader = P.ReaderEndpoint(server.endpoint, "")
        ref = P.pack_ref(url.encode(), offset, size, 0)
        msg = _one_item_step(ref, reader)
        fetcher = PayloadFetcher(decode=lambda m, f: f, out=None, config=FetchConfig(
            timeout_s=0.5, attempts=2, backoff_min_s=0.01, backoff_max_s=0.05))
        try:
            fetcher.readers = [reader]
            (views,) = fetcher.fetch(msg)
        finally:
            fetcher.close()
            server.close()
    assert bytes(views[0]) == member and fetcher.num_retries == 0


def _one_item_step(ref: bytes, reader) -> P.Message:
    """A decoded STEP of one micro-batch holding one image item, `ref`, held by `reader`."""
    return P.decode(P.encode(P.STEP, frames=[ref], step=0, epoch=0, rank=0, world_size=1,
                             readers=[list(reader)], microbatches=[
                                 {"arrays": [], "keys": [], "tokens": [], "payloads": 1,
                                  "items": [["image", "k", "k.jpg", {}]],
                                  "sizes": [len(ref)], "sources": b"", P.HOLDERS: [0]}]))
