"""Shards on object storage and HTTP (`s3://`, `gs://`, `http(s)://`), through fsspec.

A remote shard is read front to back like a local one, with bounded memory: fsspec's read-ahead
cache holds one block (`BLOCK_BYTES`) beyond what the tar reader asked for; over HTTP and S3,
bytes count as progress (`RemoteShard.on_bytes`, a reader's stall watch) as they arrive within a
block's request, so a slow server that keeps sending is not taken for a stalled one (GCS counts
a block once it has arrived: gcsfs reads an answer whole, on a session its files share).
Transient failures (a dropped or refused connection, no byte for `READ_TIMEOUT_S`, an HTTP
5xx, 408 or 429) are retried with capped exponential backoff, or after the server's
`Retry-After`, for up to
`RETRY_S` seconds: the file is reopened and read on from the byte offset reached, so a shard cut
mid-way loses and repeats nothing. Each block is a request of its own, so every one must come
from the version of the object first opened (its ETag, else S3 VersionId or Last-Modified: sent
as If-Match where the store takes it, and compared on every answer and reopen); an object
replaced meanwhile is reported as `shard_changed`, never spliced. Missing objects, refused or
missing credentials and other 4xx answers fail at once, saying which. Every error names the URL.
An HTTP server that ignores Range requests (`python -m http.server`) or gives no size (chunked,
Content-Encoding) is read as one stream instead of block by block. `read_range` reads one member
back by offset (direct payloads, on a reader's cache miss), from the version its reader read.

Credentials and endpoints come from the environment each library reads: for S3 the usual
`AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` / `AWS_PROFILE`, and `AWS_ENDPOINT_URL` for an
S3-compatible store (MinIO, Ceph, a local test server); for GCS `GOOGLE_APPLICATION_CREDENTIALS`.
fsspec, s3fs, gcsfs and aiohttp (HTTP) come with the `[cloud]` extra and are imported only
when a remote URL is used.
"""

from __future__ import annotations

import email.utils
import hashlib
import logging
import time
from typing import Any

from pipeline.tario import TarError

log = logging.getLogger("mmdispatch.remote")

#: URL schemes read through fsspec, and the package each one needs.
REMOTE_SCHEMES = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "http": "aiohttp", "https": "aiohttp"}
#: fsspec read-ahead block: what a reader holds of a remote shard beyond the current member.
BLOCK_BYTES = 4 << 20
#: How long a read that keeps failing is retried, from its first failure, before the shard is
#: given up: long enough to ride out a server restart or a short network outage, short enough
#: that a shard gone for good is reported while the job still runs.
RETRY_S = 60.0
#: The same for a member read back by `read_range` for a trainer (direct payloads): the same
#: outage is ridden out, the reader telling the trainer it is still at work meanwhile
#: (`pipeline.payloads.KEEPALIVE_S`; the trainer waits on it up to `FetchConfig.busy_max_s`).
#: A read-back that gave up after 3 s made the trainer's attempts fail within 7 s of a short
#: outage that a streaming read rode out. Read-backs run on their own threads, not the payload one.
READ_BACK_RETRY_S = RETRY_S
#: The first backoff, doubled each retry up to BACKOFF_MAX_S.
BACKOFF_S = 0.5
BACKOFF_MAX_S = 8.0
#: A server's Retry-After is waited for, up to this long (and never past RETRY_S).
RETRY_AFTER_MAX_S = 30.0
#: An HTTP read (or connect) that gets no byte for this long fails and is retried, as botocore's
#: own read timeout does for S3; aiohttp alone would wait 5 minutes a try on a server that stalls.
READ_TIMEOUT_S = 60.0
#: HTTP answers that say "not now": retried. Other 4xx answers are the request's fault: not retried.
_RETRY_STATUS = frozenset({408, 425, 429})
#: Exceptions (by class name: the libraries are optional) meaning no credentials were found.
_NO_CREDENTIALS = frozenset({"NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError"})
#: Fields of an object's info that name its version, best first (HTTP headers, s3fs, gcsfs).
_VERSION_FIELDS = ("ETag", "etag", "VersionId", "generation", "Last-Modified", "LastModified", "updated")

_GLOB_CHARS = frozenset("*?[")
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError)


def scheme(url: str) -> str | None:
    """The remote scheme of `url` (`s3`, `gs`, `gcs`, `http`, `https`), else None."""
    head, sep, _ = url.partition("://")
    return head.lower() if sep and head.lower() in REMOTE_SCHEMES else None


def normalized(url: str) -> str:
    """`url` with its remote scheme in lower case (schemes are case-insensitive, fsspec knows
    only `s3`, `http`...): `S3://b/k` and `s3://b/k` are one shard. Other URLs as given."""
    head, sep, rest = url.partition("://")
    return f"{head.lower()}://{rest}" if sep and head.lower() in REMOTE_SCHEMES else url


def object_name(url: str) -> str:
    """The object a remote URL names: an HTTP URL without its query; an S3 or GCS key whole
    (a `?` in a key is part of it)."""
    return url.split("?", 1)[0] if _is_http(url) else url


def _is_http(url: str) -> bool:
    return scheme(url) in ("http", "https")


def filesystem(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, path) of a remote URL; ValueError naming the missing package."""
    url = normalized(url)
    try:
        import fsspec

        if _is_http(url):
            import aiohttp

            limits = aiohttp.ClientTimeout(total=None, sock_connect=READ_TIMEOUT_S, sock_read=READ_TIMEOUT_S)
            return fsspec.core.url_to_fs(url, client_kwargs={"timeout": limits})
        return fsspec.core.url_to_fs(url)
    except ImportError as e:
        package = REMOTE_SCHEMES.get(scheme(url) or "", "fsspec")
        # fsspec's own ImportError for a missing backend has no `name`, only a sentence
        raise ValueError(f"shard {url!r} needs {package} ({e.name or package} is not installed): "
                         f"pip install 'mmdispatch[cloud]'") from None


def expand(url: str, spec: str) -> list[str]:
    """The shard URLs one (brace-expanded) remote spec names: a glob on S3 or GCS lists the
    bucket; HTTP has no listing, so its URLs are given one by one or as {a..b} ranges. Every
    URL's backend is loaded here, so a missing package refuses the spec at start, not in a
    reader hours later."""
    url = normalized(url)
    if not _GLOB_CHARS.intersection(object_name(url)):  # a query is HTTP's, not a key's
        filesystem(url)
        return [url]
    if _is_http(url):
        raise ValueError(f"shard spec {spec!r}: an HTTP server cannot be listed, so {url!r} "
                         f"cannot be globbed; list the URLs or use a {{000..099}} range")
    fs, pattern = filesystem(url)
    try:
        # An object whose key holds *, ? or [ is named by itself first, as a local file is.
        if fs.isfile(pattern):
            return [url]
        found = sorted(fs.glob(pattern))
        bucket = pattern.split("/", 1)[0]
        missing = not found and not fs.exists(bucket)
    except Exception as e:  # noqa: BLE001 - any listing failure is one line naming the spec
        raise ValueError(f"shard spec {spec!r}: listing {url!r} failed: {diagnose(e)[1]}") from None
    if missing:  # a store lists a missing bucket as empty: a typo, or another endpoint or account
        raise ValueError(f"shard spec {spec!r}: listing {url!r} failed: the bucket {bucket!r} "
                         "does not exist (check its name, and the endpoint and account the "
                         "credentials are for)")
    prefix = url.split("://", 1)[0] + "://"
    return [prefix + p for p in found]


def _cause(error: BaseException) -> BaseException:
    """The exception that says what happened: fsspec's HTTP filesystem reports any failure to
    open a URL (a 404, a 503, a refused connection) as FileNotFoundError chaining aiohttp's
    error; s3fs's error handling fails with IndexError on an OSError of one argument (a read
    that timed out), which it was handling."""
    chained = error.__cause__
    if isinstance(error, FileNotFoundError) and (
            isinstance(chained, TimeoutError) or type(chained).__module__.startswith("aiohttp.")):
        return chained
    context = error.__context__
    if isinstance(error, IndexError) and isinstance(context, OSError):
        return context
    return error


class TLSError(OSError):
    """A TLS failure no retry mends (an untrusted certificate, no TLS on the port)."""


#: What `diagnose` raises for a shard that fails for good whoever asks again: the object is
#: missing, access is denied, or TLS cannot be set up (serve's start-up probe refuses these).
NOT_RETRYABLE = (FileNotFoundError, PermissionError, TLSError)


def diagnose(error: BaseException) -> tuple[type[OSError] | None, str]:
    """What a failed open or read means: (the OSError to raise at once, or None when a retry may
    help; what went wrong, in words, on one line: it ends up in a log line or a table cell)."""
    permanent, said = _diagnose(error)
    return permanent, " ".join(said.split())


def _malformed(cause: BaseException) -> bool:
    """aiohttp could not parse the answer (a bad status line, broken headers): it reports that as
    a ClientResponseError with status 400 though the server sent no status at all."""
    parsed = cause.__cause__
    return parsed is not None and "HttpProcessingError" in {c.__name__ for c in type(parsed).__mro__}


def _diagnose(error: BaseException) -> tuple[type[OSError] | None, str]:
    cause = _cause(error)
    names = {c.__name__ for c in type(cause).__mro__}
    status = getattr(cause, "status", None)
    if "TooManyRedirects" in names:  # a ClientResponseError with no status (HTTP 0)
        return OSError, "too many redirects (the server redirects in a loop): check the URL"
    if "ClientResponseError" in names and _malformed(cause):
        return OSError, (f"the answer is not valid HTTP ({getattr(cause, 'message', '') or cause}): "
                         "is an HTTP server listening at that host and port?")
    if "ClientResponseError" in names and isinstance(status, int):
        said = f"HTTP {status} {getattr(cause, 'message', '') or ''}".strip()
        if status >= 500 or status in _RETRY_STATUS:
            return None, said
        if status in (401, 403):
            return PermissionError, f"access denied ({said}): check the credentials or the URL's signature"
        if status in (404, 410):
            return FileNotFoundError, f"not found ({said})"
        return OSError, said
    tls = _tls_problem(cause, names)
    if tls is not None:
        return TLSError, tls
    if names & _NO_CREDENTIALS:
        return PermissionError, (f"{cause} (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
                                 f"AWS_PROFILE, for s3://; GOOGLE_APPLICATION_CREDENTIALS for gs://)")
    if isinstance(cause, FileNotFoundError):
        return FileNotFoundError, f"not found ({cause})"
    if isinstance(cause, PermissionError):
        return PermissionError, f"access denied ({cause}): check the credentials"
    if isinstance(cause, _PERMANENT):
        return type(cause), str(cause)
    if isinstance(error, IndexError) and cause is not error:
        return None, f"read timed out ({cause})" if str(cause) else "read timed out"
    if isinstance(cause, ValueError) and not type(cause).__module__.startswith("aiohttp"):
        # fsspec's word for a request it cannot make (a seek in a stream): the same every try
        return OSError, f"{type(cause).__name__}: {cause}"
    said = str(cause) or ("timed out" if isinstance(cause, TimeoutError) else "")
    return None, f"{type(cause).__name__}: {said}" if said else type(cause).__name__


def _tls_problem(cause: BaseException, names: set[str]) -> str | None:
    """What a TLS failure that no retry mends means, in words: a certificate this machine does
    not trust (self-signed, a private CA), or a handshake the server cannot make (https:// to
    a plain-HTTP port). None if `cause` is no TLS error, or one that a dropped connection
    causes (an EOF or reset mid-handshake: retried as any other)."""
    inner = getattr(cause, "certificate_error", None) or getattr(cause, "os_error", None) or cause
    inner_names = names | {c.__name__ for c in type(inner).__mro__}
    said = str(cause)
    if inner_names & {"SSLCertVerificationError", "ClientConnectorCertificateError", "CertificateError"} \
            or "CERTIFICATE_VERIFY_FAILED" in said:
        return (f"TLS certificate not trusted ({said}): trust the server's CA (its PEM file in "
                "SSL_CERT_FILE for https://, AWS_CA_BUNDLE for s3://), or use http://")
    if not inner_names & {"SSLError", "ClientSSLError"}:
        return None
    if inner_names & {"SSLEOFError", "SSLZeroReturnError", "SSLSyscallError"} or "EOF" in said \
            or "reset" in said.lower():
        return None
    return (f"TLS handshake failed ({said}): does the server speak TLS on that port? use "
            "http:// for a plain-HTTP server (in the URL, or in AWS_ENDPOINT_URL for s3://), else "
            "check its TLS setup")


def retry_after(error: BaseException) -> float | None:
    """Seconds a server asked to wait before the next try (`Retry-After`, in seconds or as a
    date), from an aiohttp or botocore error anywhere in `error`'s chain; None if none."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        headers = getattr(e, "headers", None)
        if headers is None:  # botocore's ClientError keeps the answer's headers in `response`
            headers = ((getattr(e, "response", None) or {}).get("ResponseMetadata") or {}).get("HTTPHeaders")
        value = None
        if headers:
            value = headers.get("Retry-After") or headers.get("retry-after")
        if value:
            value = value.strip()
            if value.isdigit():
                return float(value)
            try:
                return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
            except (TypeError, ValueError, OverflowError):
                return None
        e = e.__cause__ or e.__context__
    return None


def _ignores_ranges(error: BaseException) -> bool:
    """fsspec's HTTP file says the server answered a Range request with the whole object."""
    return isinstance(error, ValueError) and "support range requests" in str(error)


def _expired(error: BaseException) -> bool:
    """The store refused a read because the object is no longer the version opened: s3fs's
    (or fsspec's) FileExpired, an HTTP 412 Precondition Failed, or an aiohttp 412 that fsspec
    reported as FileNotFoundError."""
    for e in (error, error.__cause__):
        if e is None:
            continue
        if "FileExpired" in {c.__name__ for c in type(e).__mro__}:
            return True
        if type(e).__module__.startswith("aiohttp") and getattr(e, "status", None) == 412:
            return True
    return False


def _version(info: dict) -> tuple[str, str] | None:
    """(field, value) naming the version of an object from its info, or None if it has none."""
    for name in _VERSION_FIELDS:
        value = info.get(name)
        if value:
            return name, str(value)
    return None


#: Shards already warned about as reporting no version (once per shard and process: every
#: block and every read-back opens the object again).
_UNVERSIONED: set[str] = set()


def _warn_unversioned(url: str) -> None:
    """Say once per shard that a store reporting no version (no ETag, VersionId or
    Last-Modified) leaves a replacement of the same size undetectable: read on, it would splice
    two objects into one archive."""
    if url in _UNVERSIONED:
        return
    _UNVERSIONED.add(url)
    from dispatcher_server.cliopts import redact

    log.warning("mmdispatch event=shard_unversioned shard=%s reason=%r", redact(url),
                "the store reports no version (no ETag or Last-Modified): a replacement of the same "
                "size while the job reads it cannot be detected, and would be read as this shard; "
                "leave shards in place while a job reads them, or serve them with ETags")


def _same_etag(a: str, b: str) -> bool:
    """Weak comparison: a server may mark the ETag of one representation weak in some answers."""
    return a.removeprefix("W/") == b.removeprefix("W/")


class _PinnedSession:
    """The aiohttp session of fsspec's HTTP file, as that file uses it (`await session.get()`),
    refusing an answer from another version than the one opened. If-Match already asks the
    server to refuse; a server that ignores it would otherwise hand out the next block of a
    replaced object, read at the old offsets."""

    def __init__(self, session: Any, shard: RemoteShard) -> None:
        self._session = session
        self._shard = shard

    def get(self, url: str, **kwargs):
        return self._get(url, **kwargs)

    async def _get(self, url: str, **kwargs):
        answer = await self._session.get(url, **kwargs)
        try:
            self._shard._check_answer(answer.status, answer.headers)
        except BaseException:
            answer.release()
            raise
        answer.content = _Arriving(answer.content, self._shard.progressed)
        return answer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)


class _Arriving:
    """An aiohttp answer's body stream that calls `progress` as each piece of it arrives: a
    block is one request (read whole by fsspec), and a slow server still sends while it lasts.
    Read whole, it gathers the pieces as aiohttp's own `read()` does: no extra copy."""

    def __init__(self, stream: Any, progress: Any) -> None:
        self._stream, self._progress = stream, progress

    async def read(self, n: int = -1) -> bytes:
        if n >= 0:
            data = await self._stream.read(n)
            self._progress()
            return data
        parts = []
        while chunk := await self._stream.readany():
            parts.append(chunk)
            self._progress()
        return b"".join(parts)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _ArrivingS3:
    """The S3 filesystem as one s3fs file sees it (`S3File.fs`): its GetObject answers' bodies
    call `progress` as their bytes arrive. s3fs reads a block as one GetObject whose body it
    reads whole; botocore's body reads the aiohttp stream wrapped here, so its length check
    and error translation stay. Per file, not patched into the filesystem: fsspec shares one
    instance among every shard (and read-back) of a process."""

    def __init__(self, fs: Any, progress: Any) -> None:
        self._fs, self._progress = fs, progress

    async def _call_s3(self, method: str, *args, **kwargs):
        answer = await self._fs._call_s3(method, *args, **kwargs)
        raw = getattr(answer.get("Body") if isinstance(answer, dict) else None, "raw_stream", None)
        # aiobotocore's aiohttp body; its httpx one has no such stream (progress per block then)
        if method == "get_object" and hasattr(getattr(raw, "content", None), "readany"):
            raw.content = _Arriving(raw.content, self._progress)
        return answer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)


class RemoteShard:
    """A remote shard opened for sequential reading, resumed at the offset reached after a
    transient failure (retried for up to `retry_s` seconds, backoff from `backoff_s`, doubling),
    from the version of the object first opened only."""

    def __init__(self, url: str, *, retry_s: float | None = None, backoff_s: float | None = None,
                 block_bytes: int | None = None, start: int = 0, read_ahead: bool = True) -> None:
        self.url = url = normalized(url)
        self.retry_s = RETRY_S if retry_s is None else retry_s
        self.backoff_s = BACKOFF_S if backoff_s is None else backoff_s
        self.block_bytes = BLOCK_BYTES if block_bytes is None else block_bytes
        self.cache_type = "readahead" if read_ahead else "none"  # none: each read one request
        self.fs, self.path = filesystem(url)
        self.pos = start
        self.size: int | None = None
        self.version: tuple[str, str] | None = None  # (field, value) as first opened
        self.mimetype: str | None = None  # an HTTP answer's Content-Type (a tar error names it)
        self.streaming = False  # no ranges or no size: read as one stream
        self._opened = False  # the version was taken (by the first open that got an answer)
        self._killed = False
        self._file: Any = None
        #: Called whenever bytes of the shard arrive, also within one block's request (a reader's
        #: stall watch, `ReadAhead.watch`): a slow server that keeps sending is not stalled.
        self.on_bytes: Any = None
        self._with_retries(self._open)

    @property
    def stamp(self) -> int:
        """The version first opened as 63 bits, never 0 (`protocol.Ref.stamp`: what a reference
        read back by `read_range` must match); 0 for an object that reports no version."""
        if self.version is None:
            return 0
        digest = hashlib.blake2b(f"{self.version[0]}:{self.version[1]}".encode(), digest_size=8).digest()
        return (int.from_bytes(digest, "little") >> 1) or 1

    def _changed(self, now: str) -> TarError:
        # Reading on at the byte reached would splice two objects into one archive.
        return TarError("shard_changed", f"shard {self.url!r}: it was replaced while being read "
                        f"(opened as {self._was()}; now {now}): nothing is read from the new object")

    def _was(self) -> str:
        return f"{self.version[0]} {self.version[1]}" if self.version else f"{self.size} bytes"

    def _pin(self, info: dict) -> None:
        """Take the object's version at the first open; at a reopen, refuse another one."""
        size = info.get("size")
        if self.size is not None and size is not None and size != self.size:
            raise self._changed(f"{size} bytes")
        if not self._opened:
            self.version = _version(info)
            self._opened = True
            if self.version is None:
                _warn_unversioned(self.url)
        elif self.version is not None:
            now = info.get(self.version[0])
            if now is not None and not _same_etag(str(now), self.version[1]):
                raise self._changed(f"{self.version[0]} {now}")
        self.size = size if size is not None else self.size

    def _check_answer(self, status: int, headers: Any) -> None:
        """An HTTP answer to a read is of the version opened (If-Match refused: 412)."""
        if status == 412:
            raise self._changed("another version: HTTP 412 Precondition Failed")
        if self.version is not None and self.version[0] in ("ETag", "Last-Modified"):
            now = headers.get(self.version[0])
            if now is not None and not _same_etag(now, self.version[1]):
                raise self._changed(f"{self.version[0]} {now}")

    def _conditions(self) -> dict:
        """Request headers that make an HTTP server refuse (412) a read of another version."""
        if self.version is None:
            return {}
        name, value = self.version
        if name == "ETag" and not value.startswith("W/"):  # If-Match compares strong ETags only
            return {"headers": {"If-Match": value}}
        if name == "Last-Modified":
            return {"headers": {"If-Unmodified-Since": value}}
        return {}

    def _open(self) -> None:
        if _is_http(self.url):
            self._open_http()
            return
        # The listing a glob left in fsspec's cache may be older than the object now there.
        self.fs.invalidate_cache(self.path)
        self._file = self.fs.open(self.path, "rb", block_size=self.block_bytes, cache_type=self.cache_type)
        if scheme(self.url) == "s3":
            self._file.fs = _ArrivingS3(self._file.fs, self.progressed)
        # s3fs reads every block with IfMatch on the ETag of these details (FileExpired if not)
        self._pin({**getattr(self._file, "details", {}), "size": getattr(self._file, "size", None)})
        if self.pos:
            self._file.seek(self.pos)

    def _open_http(self) -> None:
        info = self.fs.info(self.path)
        self._pin(info)
        self.mimetype = info.get("mimetype") or self.mimetype
        if info.get("size") is None or info.get("partial") is False:
            self.streaming = True  # chunked or content-encoded (no size), or no ranges: no seeking
        if not self.streaming:
            self._file = self.fs.open(self.path, "rb", block_size=self.block_bytes,
                                      cache_type=self.cache_type, size=info["size"], **self._conditions())
            self._file.session = _PinnedSession(self._file.session, self)
            if self.pos:
                self._file.seek(self.pos)
            return
        self._file = self.fs.open(self.path, "rb", block_size=0, size=info.get("size"),
                                  **self._conditions())
        self._check_answer(self._file.r.status, self._file.r.headers)
        done = 0
        while done < self.pos:  # no seeking in a stream: read up to the byte reached
            chunk = self._file.read(min(1 << 20, self.pos - done))
            if not chunk:
                raise ConnectionError(f"stream ended at byte {done} on the way to {self.pos}")
            done += len(chunk)

    def progressed(self) -> None:
        if self.on_bytes is not None:
            self.on_bytes()

    def seek(self, pos: int) -> int:
        """Read on from byte `pos` (a walk resumed at a sample's offset): a ranged read of an
        object that takes them; a stream (no ranges, no size) is opened again and read up to it."""
        if self._file is not None and not self.streaming:
            self._file.seek(pos)
        elif pos != self.pos:
            self._drop()
        self.pos = pos
        return pos

    def read(self, size: int = -1) -> bytes:
        return self._with_retries(lambda: self._read_once(size))

    def _read_once(self, size: int) -> bytes:
        if self._file is None:
            self._open()
        data = self._file.read(size)
        if self.streaming and 0 < len(data) < size:  # a stream hands out what has arrived
            parts = [data]
            while (got := sum(map(len, parts))) < size and (chunk := self._file.read(size - got)):
                parts.append(chunk)
                self.progressed()
            data = b"".join(parts)
        short = size > 0 and len(data) < size and self.size is not None and self.pos + len(data) < self.size
        if short:  # the object is longer: the connection ended early
            raise ConnectionError(f"read {len(data)} of {size} bytes at {self.pos} of {self.size}")
        self.pos += len(data)
        return data

    def _with_retries(self, call):
        last = ""
        attempt = 0
        deadline = None
        while True:
            if self._killed:
                raise OSError(f"shard {self.url!r}: given up at byte {self.pos} (last: {last})")
            try:
                return call()
            except TarError:  # the object changed: reopening again would not mend it
                self._drop()
                raise
            except Exception as e:  # noqa: BLE001 - network libraries raise many kinds
                self._drop()
                if _expired(e):
                    raise self._changed("another version: the store refuses to read the one opened") from None
                if _ignores_ranges(e) and not self.streaming:
                    self.streaming = True  # not a failure: the same try, read another way
                    continue
                permanent, last = diagnose(e)
                if permanent is not None:
                    raise permanent(f"shard {self.url!r}: {last}") from None
                attempt += 1
                now = time.monotonic()
                deadline = now + self.retry_s if deadline is None else deadline
                wait = min(self.backoff_s * 2 ** (attempt - 1), BACKOFF_MAX_S)
                asked = retry_after(e)
                if asked is not None:
                    wait = max(wait, min(asked, RETRY_AFTER_MAX_S))
                if now + wait > deadline:
                    raise OSError(f"shard {self.url!r}: failed {attempt} times in "
                                  f"{now - deadline + self.retry_s:.1f} s at byte {self.pos} "
                                  f"(last: {last})") from None
                log.warning("mmdispatch event=shard_retry shard=%s byte=%d attempt=%d wait_s=%.1f "
                            "reason=%r", self.url, self.pos, attempt, wait, last)
                time.sleep(wait)

    def _drop(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            try:
                f.close()
            except Exception:  # noqa: BLE001 - the connection is being discarded anyway
                pass

    def kill(self) -> None:
        """Try no more: a reader that gave up on this shard (`ReadAhead.close`, after its
        --stall-timeout) would otherwise leave a thread retrying it for minutes. A read under
        way ends at its own timeout and raises."""
        self._killed = True

    def close(self) -> None:
        self._drop()

    def __enter__(self) -> RemoteShard:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_range(url: str, offset: int, size: int, stamp: int = 0) -> bytes:
    """Up to `size` bytes at `offset` of the remote shard `url` (fewer where the object ends),
    with RemoteShard's retries for `READ_BACK_RETRY_S`: one ranged request for exactly those
    bytes (a server that ignores ranges or gives no size is read as a stream up to `offset`).
    OSError naming the shard if the object is no longer the version `stamp`
    (`RemoteShard.stamp`; 0: not checked) its reader read. Called by `shards.read_range`."""
    with RemoteShard(url, start=offset, block_bytes=max(1, size), read_ahead=False,
                     retry_s=READ_BACK_RETRY_S) as shard:
        if stamp and shard.stamp != stamp:
            raise OSError(f"shard {url!r} changed in storage since its reader read it (replaced: "
                          f"now {shard._was()}): its bytes at the reader's offsets are others; "
                          "leave shards in place while a job reads them")
        return shard.read(size)
