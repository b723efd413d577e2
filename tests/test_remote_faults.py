"""Remote shards against servers that misbehave as real ones do: answers 5xx for a while, refuses
access, ignores Range requests (`python -m http.server`), stalls; and S3 without credentials.
Every server runs here on 127.0.0.1 at a random port; no real cloud."""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import re
import shutil
import socket
import threading
import time

import pytest

from pipeline import remote
from pipeline.errors import ErrorStats
from pipeline.reader import ReaderConfig, iter_shard
from pipeline.shards import expand_shards

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

from tests.test_object_storage import moto_s3, send_range, serving  # noqa: E402 - after the skips

pytestmark = pytest.mark.timeout(120)


class _Faulty(http.server.BaseHTTPRequestHandler):
    """Files of `root` with Range support. `answers[name]`: statuses given (one per request,
    HEAD or GET) before the file is served; `stalls`: that many GETs past the first byte send
    100 bytes and then nothing until `release` is set (and the first of them moves the file
    `replace_with`, if set, over the one being read). `requests` counts requests per name."""

    protocol_version = "HTTP/1.1"
    root = ""
    answers: dict[str, list[int]] = {}
    requests: dict[str, int] = {}
    stalls = 0
    replace_with = ""
    release = threading.Event()

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def do_GET(self) -> None:
        self._answer(head=False)

    def _answer(self, head: bool) -> None:
        name = os.path.basename(self.path)
        self.requests[name] = self.requests.get(name, 0) + 1
        pending = self.answers.get(name)
        if pending:
            self.send_response(pending.pop(0))
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        with open(os.path.join(self.root, name), "rb") as f:
            data = f.read()
        lo, body = send_range(self, data)
        if head:
            return
        if self.stalls > 0 and lo > 0:
            type(self).stalls -= 1
            if self.replace_with:  # the object is rewritten while this read waits
                os.replace(self.replace_with, os.path.join(self.root, name))
            self.wfile.write(body[:100])
            self.wfile.flush()
            self.release.wait(60)
            self.close_connection = True
            return
        self.wfile.write(body)


@pytest.fixture()
def faulty(small_shards):
    handler = type("Handler", (_Faulty,), {"root": os.path.dirname(small_shards[0]), "answers": {},
                                           "requests": {}, "stalls": 0,
                                           "release": threading.Event()})
    with serving(handler) as base:
        try:
            yield base, handler
        finally:
            handler.release.set()


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    """Several range requests per shard, quick retries."""
    monkeypatch.setattr(remote, "BLOCK_BYTES", 16 << 10)
    monkeypatch.setattr(remote, "BACKOFF_S", 0.01)
    monkeypatch.setattr(remote, "RETRY_S", 0.5)


def _read(url: str) -> tuple[list[str], ErrorStats]:
    stats = ErrorStats()
    keys = [r.key for r in iter_shard(url, ReaderConfig(keep_members=False), stats=stats)]
    return keys, stats


def _local_keys(path: str) -> list[str]:
    return _read(path)[0]


def test_a_server_busy_at_open_is_retried(small_shards, faulty):
    base, handler = faulty
    name = os.path.basename(small_shards[0])
    handler.answers[name] = [503, 503, 500]  # the first HEAD, its GET fallback, the retry's HEAD
    keys, stats = _read(f"{base}/{name}")
    assert keys == _local_keys(small_shards[0]) and stats.num_errors == 0
    assert handler.answers[name] == []


def test_a_refused_connection_at_open_is_retried_and_named(small_shards, faulty):
    base, _ = faulty
    with serving(_Faulty) as closed:
        pass  # a port nobody listens on any more
    url = f"{closed}/{os.path.basename(small_shards[0])}"
    keys, stats = _read(url)
    assert keys == [] and stats.by_reason == {"open_failed": 1}
    # named once, as the skip's shard, not again in its detail
    assert stats.recent[-1][1] == url and re.search(r"^cannot open: failed \d+ times in", stats.recent[-1][3])


@pytest.mark.parametrize(("status", "says"), [(404, "not found (HTTP 404 Not Found)"),
                                              (403, "access denied (HTTP 403 Forbidden)"),
                                              (401, "access denied (HTTP 401 Unauthorized)")])
def test_a_missing_or_forbidden_object_fails_at_once_saying_why(small_shards, faulty, status, says):
    base, handler = faulty
    name = os.path.basename(small_shards[0])
    handler.answers[name] = [status] * 10
    url = f"{base}/{name}"
    keys, stats = _read(url)
    assert keys == [] and stats.by_reason == {"open_failed": 1}
    assert stats.recent[-1][1] == url and stats.recent[-1][3].startswith(f"cannot open: {says}")
    assert handler.requests[name] == 2  # fsspec's HEAD and its GET fallback, no retry


class _NoRanges(http.server.SimpleHTTPRequestHandler):
    """`python -m http.server`: a Range request gets the whole file with status 200. GET number
    `drop_at` of a file sends only its first half and closes the connection."""

    drop_at = 0
    gets = 0

    def log_message(self, *args) -> None:
        pass

    def copyfile(self, source, outputfile) -> None:
        type(self).gets += 1
        if self.gets == self.drop_at:
            outputfile.write(source.read(os.fstat(source.fileno()).st_size // 2))
            outputfile.flush()
            self.close_connection = True
            return
        super().copyfile(source, outputfile)


@pytest.mark.parametrize("drop_at", [0, 3])
def test_a_server_that_ignores_range_requests_is_read_as_a_stream(small_shards, drop_at):
    handler = type("Handler", (_NoRanges,), {"drop_at": drop_at, "gets": 0})
    with serving(functools.partial(handler, directory=os.path.dirname(small_shards[0]))) as base:
        path = small_shards[0]
        keys, stats = _read(f"{base}/{os.path.basename(path)}")
        assert stats.num_errors == 0, stats.recent
        assert keys == _local_keys(path)  # after a drop too: read again up to the byte reached
        assert handler.gets >= drop_at


def test_a_server_that_stalls_once_is_read_on_after_the_read_timeout(small_shards, faulty, monkeypatch):
    monkeypatch.setattr(remote, "READ_TIMEOUT_S", 0.5)
    base, handler = faulty
    handler.stalls = 1
    keys, stats = _read(f"{base}/{os.path.basename(small_shards[1])}")
    assert stats.num_errors == 0 and handler.stalls == 0
    assert keys == _local_keys(small_shards[1])  # resumed at the byte reached: none lost, none twice


def test_a_server_that_stalls_for_good_is_given_up_naming_the_url(small_shards, faulty, monkeypatch):
    monkeypatch.setattr(remote, "READ_TIMEOUT_S", 0.5)
    base, handler = faulty
    handler.stalls = 10**6
    url = f"{base}/{os.path.basename(small_shards[0])}"
    keys, stats = _read(url)  # aiohttp's own limit would wait 5 minutes a try
    assert stats.by_reason == {"shard_failed": 1}
    assert re.search(rf"shard {re.escape(repr(url))}: failed \d+ times", stats.recent[-1][3])
    assert "timed out" in stats.recent[-1][3]
    assert len(keys) < len(_local_keys(small_shards[0]))


def test_a_shard_given_up_by_its_reader_is_tried_no_more(small_shards, faulty, monkeypatch):
    monkeypatch.setattr(remote, "READ_TIMEOUT_S", 0.5)
    base, handler = faulty
    handler.stalls = 10**6
    shard = remote.RemoteShard(f"{base}/{os.path.basename(small_shards[0])}", retry_s=10**6)
    failed: list[BaseException] = []

    def read_all() -> None:
        try:
            while shard.read(4096):
                pass
        except OSError as e:
            failed.append(e)

    reading = threading.Thread(target=read_all, daemon=True)
    reading.start()
    reading.join(1.5)  # a few timed-out tries
    assert reading.is_alive() and not failed
    shard.kill()  # what ReadAhead.close does to a stalled shard's stream
    reading.join(30)
    assert not reading.is_alive(), "the shard was retried after the reader gave up on it"
    assert "given up at byte" in str(failed[0])


def test_an_object_replaced_while_read_is_reported_not_spliced(small_shards, tmp_path, monkeypatch):
    monkeypatch.setattr(remote, "READ_TIMEOUT_S", 0.5)
    shutil.copy(small_shards[2], tmp_path / "a.tar")
    shutil.copy(small_shards[1], tmp_path / "b.tar")  # another size
    handler = type("Handler", (_Faulty,), {"root": str(tmp_path), "answers": {}, "requests": {},
                                           "stalls": 1, "replace_with": str(tmp_path / "b.tar"),
                                           "release": threading.Event()})
    with serving(handler) as base:
        try:
            keys, stats = _read(f"{base}/a.tar")
        finally:
            handler.release.set()
    assert stats.by_reason == {"shard_changed": 1}, stats.recent
    assert "it was replaced while being read" in stats.recent[-1][3]
    assert keys == _local_keys(small_shards[2])[:len(keys)]  # what came before the change, only


@pytest.mark.timeout(120)
def test_s3_without_credentials_fails_at_once_naming_the_fix(small_shards, monkeypatch):
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    import boto3
    import s3fs

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                              aws_secret_access_key="testing", region_name="us-east-1")
        client.create_bucket(Bucket="data")
        client.upload_file(small_shards[0], "data", "a.tar")
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                  "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                  "AWS_WEB_IDENTITY_TOKEN_FILE"):
            monkeypatch.delenv(k, raising=False)
        for k, v in {"AWS_ENDPOINT_URL": endpoint, "AWS_DEFAULT_REGION": "us-east-1",
                     "AWS_EC2_METADATA_DISABLED": "true",  # never ask a metadata server
                     "AWS_SHARED_CREDENTIALS_FILE": os.devnull, "AWS_CONFIG_FILE": os.devnull}.items():
            monkeypatch.setenv(k, v)
        s3fs.S3FileSystem.clear_instance_cache()
        keys, stats = _read("s3://data/a.tar")
        assert keys == [] and stats.by_reason == {"open_failed": 1}
        detail = stats.recent[-1][3]
        assert stats.recent[-1][1] == "s3://data/a.tar"
        assert detail.startswith("cannot open: Unable to locate credentials (set AWS_ACCESS_KEY_ID")
        assert "failed" not in detail  # not retried: no backoff can find credentials
        with pytest.raises(ValueError, match=r"^shard spec 's3://data/\*\.tar': listing 's3://data/\*\.tar' "
                                             r"failed: Unable to locate credentials \(set AWS_ACCESS_KEY_ID"):
            expand_shards("s3://data/*.tar")
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()


def test_a_missing_backend_is_one_line_naming_the_package(monkeypatch):
    import fsspec

    def no_gcsfs(url, **kw):
        raise ImportError("Install gcsfs to access Google Storage")  # as fsspec words it

    monkeypatch.setattr(fsspec.core, "url_to_fs", no_gcsfs)
    with pytest.raises(ValueError) as e:
        remote.filesystem("gs://bucket/a.tar")
    assert str(e.value) == ("shard 'gs://bucket/a.tar' needs gcsfs (gcsfs is not installed): "
                            "pip install 'mmdispatch[cloud]'")


class _LoginPage(http.server.BaseHTTPRequestHandler):
    """Answers every shard with a sign-in page and status 200, as a proxy or portal does."""

    page = b"<!DOCTYPE html><html><body>Please sign in</body></html>"

    def do_HEAD(self):
        self._head()

    def do_GET(self):
        self._head()
        self.wfile.write(self.page)

    def _head(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(self.page)))
        self.end_headers()

    def log_message(self, *args):
        pass


def test_an_html_page_served_for_a_shard_is_named_as_one():
    """It read as a cut archive ('archive ends at byte 45'), which sends the user looking for
    a broken shard instead of a URL that needs signing in."""
    with serving(_LoginPage) as base:
        keys, stats = _read(f"{base}/x.tar")
    assert keys == [] and stats.num_errors == 1
    assert "the server sent text/html" in stats.recent[-1][3], stats.recent


def _self_signed(tmp_path) -> tuple[str, str]:
    """(certificate, key) PEM files of a self-signed certificate for 127.0.0.1."""
    pytest.importorskip("cryptography")
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_file), str(key_file)


@pytest.mark.parametrize("server", ["self_signed", "plain_http"])
def test_a_tls_failure_fails_at_once_naming_it_and_the_fix(small_shards, tmp_path, monkeypatch, server):
    """An untrusted certificate, or https:// to a port that speaks plain HTTP, is no network
    blip: it was retried for a minute as one. It fails at the first try, saying what to do."""
    import ssl

    monkeypatch.setattr(remote, "RETRY_S", 30.0)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler,
                                directory=os.path.dirname(small_shards[0]))
    handler.log_message = lambda *a: None
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    if server == "self_signed":
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(*_self_signed(tmp_path))
        httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"https://127.0.0.1:{httpd.server_address[1]}/{os.path.basename(small_shards[0])}"
    try:
        started = time.monotonic()
        keys, stats = _read(url)
        elapsed = time.monotonic() - started
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert keys == [] and stats.by_reason == {"open_failed": 1}
    said = stats.recent[-1][3]
    assert elapsed < 5 and not re.search(r"failed \d+ times", said), said  # no retries
    if server == "self_signed":
        assert said.startswith("cannot open: TLS certificate not trusted (") and "SSL_CERT_FILE" in said, said
    else:
        assert said.startswith("cannot open: TLS handshake failed (") and "use http://" in said, said


@pytest.mark.parametrize(("status", "says"), [(404, "not found (HTTP 404 Not Found)")])
def test_serve_refuses_a_remote_shard_missing_in_one_line(small_shards, faulty, status, says):
    """A missing local path was refused at start, a missing object only warned about ("not
    probed") and left to the readers, whose job then stopped on an empty epoch naming no URL."""
    import subprocess
    import sys

    base, handler = faulty
    good, bad = (os.path.basename(p) for p in small_shards[:2])
    handler.answers[f"{bad}?token=TOK123"] = [status] * 10  # the handler's name keeps the query
    url = base.replace("http://", "http://bob:pw123@") + f"/{bad}?token=TOK123"
    shown = base.replace("http://", "http://bob:***@") + f"/{bad}?token=***"
    # the good shard first: its usable sample ends the read; the next one is still looked at
    proc = subprocess.run(
        [sys.executable, "-m", "mmdispatch.cli", "serve", "--shards", f"{base}/{good}", url,
         "--world-size", "1", "--global-batch", "4", "--probe-timeout-s", "20"],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "READY" not in proc.stdout, proc.stdout + proc.stderr
    # (the good shard's server gives no ETag: a warning says so, once)
    lines = [line for line in proc.stderr.strip().splitlines() if "event=shard_unversioned" not in line]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"mmdispatch serve: error: source 'default': shard '{shown}' cannot "
                               f"be read: {says}"), lines[0]
    assert "leave the shard out" in lines[0] and "pw123" not in lines[0] and "TOK123" not in lines[0]


def test_a_shard_failing_for_a_while_is_not_refused_by_the_probe(small_shards, faulty):
    """Only what no retry mends refuses a source: a server busy at start is the readers' to ride out."""
    from pipeline.probe import probe_source, refusal

    base, handler = faulty
    name = os.path.basename(small_shards[0])
    handler.answers[name] = [503] * 1000
    result = probe_source([f"{base}/{name}"], ReaderConfig())
    assert result.unreadable and not result.missing and refusal(result) is None


def test_a_shard_denied_to_the_dispatchers_host_is_left_to_the_readers(small_shards, faulty):
    """Access denied may be this host's credentials alone (readers may hold others): not a
    refusal, unlike an object that does not exist anywhere."""
    from pipeline.probe import probe_source, refusal

    base, handler = faulty
    good, bad = (os.path.basename(p) for p in small_shards[:2])
    handler.answers[bad] = [403] * 10
    result = probe_source([f"{base}/{good}", f"{base}/{bad}"], ReaderConfig())
    assert result.usable and not result.missing and refusal(result) is None
    handler.answers[bad] = [404] * 10
    result = probe_source([f"{base}/{good}", f"{base}/{bad}"], ReaderConfig())
    assert result.missing and "not found" in refusal(result)


def test_a_stall_timeout_shorter_than_remote_retries_is_warned_of_once(caplog):
    """A --stall-timeout under a remote read's retry time turned one transient hang into the
    rest of the shard lost (shard_stalled), with no word about the mismatch."""
    import logging

    from pipeline import remote
    from pipeline.service import ReaderServiceConfig, ReaderWorker

    def warnings_for(stall_s: float, shards: list[str]) -> list[str]:
        caplog.clear()
        worker = ReaderWorker(ReaderServiceConfig(dispatcher="tcp://127.0.0.1:1", name="r",
                                                  stall_s=stall_s))
        with caplog.at_level(logging.WARNING, logger="mmdispatch"):
            for shard in shards:
                worker._check_stall_timeout(shard)
        return [r.getMessage() for r in caplog.records if "stall_timeout_short" in r.getMessage()]

    short = remote.RETRY_S / 2
    said = warnings_for(short, ["http://h/a.tar", "s3://b/c.tar", "http://h/d.tar"])
    assert len(said) == 1 and f"stall_timeout_s={short:g}" in said[0] and "raise --stall-timeout" in said[0]
    assert warnings_for(short, ["/data/a.tar", "pipe:cat a.tar"]) == []
    assert warnings_for(remote.RETRY_S * 2, ["http://h/a.tar"]) == []


class _Trickle(http.server.BaseHTTPRequestHandler):
    """Files of `root` with Range support, each answer sent steadily but slowly: `piece` bytes
    every `pause` seconds."""

    protocol_version = "HTTP/1.1"
    root = ""
    piece = 8 << 10
    pause = 0.03

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        with open(os.path.join(self.root, os.path.basename(self.path)), "rb") as f:
            send_range(self, f.read())

    def do_GET(self) -> None:
        with open(os.path.join(self.root, os.path.basename(self.path)), "rb") as f:
            _, body = send_range(self, f.read())
        for at in range(0, len(body), self.piece):
            self.wfile.write(body[at:at + self.piece])
            self.wfile.flush()
            time.sleep(self.pause)


def test_a_slow_server_that_keeps_sending_is_not_given_up_as_stalled(small_shards, monkeypatch):
    """A block (one request) takes 0.5 s to arrive, longer than the stall timeout, but bytes
    arrive every 0.03 s: `--stall-timeout` counts seconds without a byte, so nothing is lost."""
    from pipeline.inspect import records_of

    monkeypatch.setattr(remote, "BLOCK_BYTES", 128 << 10)
    path = small_shards[1]
    handler = type("Handler", (_Trickle,), {"root": os.path.dirname(path)})
    stats = ErrorStats()
    with serving(handler) as base:
        records = records_of(f"{base}/{os.path.basename(path)}", ReaderConfig(keep_members=False),
                             stats, stall_s=0.25)
        keys = [r.key for r in records]
    assert stats.by_reason == {} and keys == _local_keys(path)



@contextlib.contextmanager
def _trickling(target: tuple[str, int], piece: int = 8 << 10, pause: float = 0.03):
    """A TCP proxy on 127.0.0.1 to `target` for the block, passing requests on at once and
    answers steadily but slowly, `piece` bytes every `pause` seconds: its endpoint URL."""
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def pump(src: socket.socket, dst: socket.socket, slow: bool) -> None:
        with contextlib.suppress(OSError):
            while not done.is_set() and (data := src.recv(piece)):
                dst.sendall(data)
                if slow:
                    time.sleep(pause)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def accept() -> None:
        with contextlib.suppress(OSError):
            while not done.is_set():
                client, _ = listener.accept()
                server = socket.create_connection(target)
                for args in ((client, server, False), (server, client, True)):
                    threading.Thread(target=pump, args=args, daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        done.set()
        listener.close()


@pytest.mark.timeout(120)
def test_a_slow_s3_server_that_keeps_sending_is_not_given_up_as_stalled(small_shards, monkeypatch):
    """As over HTTP: S3 answers of 270 KB/s, a block (one GetObject) taking a second, longer
    than the stall timeout, are read whole: bytes count as they arrive, not per block."""
    from urllib.parse import urlsplit

    import s3fs

    from pipeline.inspect import records_of

    monkeypatch.setattr(remote, "BLOCK_BYTES", 256 << 10)
    path = small_shards[1]
    assert os.path.getsize(path) > 2 * remote.BLOCK_BYTES
    with moto_s3(monkeypatch) as client:
        client.upload_file(path, "data", "slow.tar")
        moto = urlsplit(os.environ["AWS_ENDPOINT_URL"])
        with _trickling((moto.hostname, moto.port)) as endpoint:
            monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
            s3fs.S3FileSystem.clear_instance_cache()
            # The client is made once per process (a second on a busy machine), not per read:
            # made here, it is not taken for a stall of the shard.
            remote.filesystem("s3://data/slow.tar")[0].info("data/slow.tar")
            stats = ErrorStats()
            records = records_of("s3://data/slow.tar", ReaderConfig(keep_members=False), stats, stall_s=0.5)
            keys = [r.key for r in records]
    assert stats.by_reason == {} and keys == _local_keys(path), stats.recent


class _NotHttp(http.server.BaseHTTPRequestHandler):
    """Answers every request with a line that is not HTTP."""

    def log_message(self, *args) -> None:
        pass

    def handle(self) -> None:
        self.rfile.readline()
        self.wfile.write(b"garbage\r\n\r\n")


def test_a_malformed_answer_is_one_line_claiming_no_status():
    """aiohttp reports an unparsable answer as an HTTP 400 with a message over several lines."""
    with serving(_NotHttp) as base:
        url = f"{base}/shard-000000.tar"
        keys, stats = _read(url)
    assert keys == [] and stats.by_reason == {"open_failed": 1}
    detail = stats.recent[-1][3]
    assert "\n" not in detail and "400" not in detail and "not valid HTTP" in detail, detail
