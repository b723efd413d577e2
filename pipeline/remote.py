"""Shards on object storage and HTTP (`s3://`, `gs://`, `http(s)://`), through fsspec.

A remote shard is read front to back like a local one, with bounded memory: fsspec's read-ahead
cache holds one block (`BLOCK_BYTES`) beyond what the tar reader asked for. Transient failures
(a dropped or refused connection, no byte for `READ_TIMEOUT_S`, an HTTP 5xx, 408 or 429) are
retried with exponential backoff: the file is reopened and read on from the byte offset reached,
so a shard cut mid-way loses and repeats nothing (an object replaced meanwhile, seen by its size,
is reported as `shard_changed`). Missing objects, refused or missing credentials and other
4xx answers fail at once, saying which. Every error names the URL. An HTTP server that ignores
Range requests (`python -m http.server`) is read as one stream instead of block by block.
`read_range` reads one member back by offset (direct payloads, on a reader's cache miss).

Credentials and endpoints come from the environment each library reads: for S3 the usual
`AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` / `AWS_PROFILE`, and `AWS_ENDPOINT_URL` for an
S3-compatible store (MinIO, Ceph, a local test server); for GCS `GOOGLE_APPLICATION_CREDENTIALS`.
fsspec, s3fs, gcsfs and aiohttp (HTTP) come with the `[cloud]` extra and are imported only
when a remote URL is used.
"""

from __future__ import annotations

import time
from typing import Any

from pipeline.tario import TarError

#: URL schemes read through fsspec, and the package each one needs.
REMOTE_SCHEMES = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "http": "aiohttp", "https": "aiohttp"}
#: fsspec read-ahead block: what a reader holds of a remote shard beyond the current member.
BLOCK_BYTES = 4 << 20
#: Tries of one read (the first and the retries), and the first backoff, doubled each retry.
TRIES = 5
BACKOFF_S = 0.5
#: An HTTP read (or connect) that gets no byte for this long fails and is retried, as botocore's
#: own read timeout does for S3; aiohttp alone would wait 5 minutes a try on a server that stalls.
READ_TIMEOUT_S = 60.0
#: HTTP answers that say "not now": retried. Other 4xx answers are the request's fault: not retried.
_RETRY_STATUS = frozenset({408, 425, 429})
#: Exceptions (by class name: the libraries are optional) meaning no credentials were found.
_NO_CREDENTIALS = frozenset({"NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError"})

_GLOB_CHARS = frozenset("*?[")
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError)


def scheme(url: str) -> str | None:
    """The remote scheme of `url` (`s3`, `gs`, `gcs`, `http`, `https`), else None."""
    head, sep, _ = url.partition("://")
    return head.lower() if sep and head.lower() in REMOTE_SCHEMES else None


def filesystem(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, path) of a remote URL; ValueError naming the missing package."""
    try:
        import fsspec

        if scheme(url) in ("http", "https"):
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
    bucket; HTTP has no listing, so its URLs are given one by one or as {a..b} ranges."""
    path = url.split("?", 1)[0]
    if not _GLOB_CHARS.intersection(path):
        return [url]
    if scheme(url) in ("http", "https"):
        raise ValueError(f"shard spec {spec!r}: an HTTP server cannot be listed, so {url!r} "
                         f"cannot be globbed; list the URLs or use a {{000..099}} range")
    fs, pattern = filesystem(url)
    try:
        found = sorted(fs.glob(pattern))
    except Exception as e:  # noqa: BLE001 - any listing failure is one line naming the spec
        raise ValueError(f"shard spec {spec!r}: listing {url!r} failed: {diagnose(e)[1]}") from None
    prefix = url.split("://", 1)[0] + "://"
    return [prefix + p for p in found]


def diagnose(error: BaseException) -> tuple[type[OSError] | None, str]:
    """What a failed open or read means: (the OSError to raise at once, or None when a retry may
    help; what went wrong, in words).

    fsspec's HTTP filesystem reports any failure to open a URL (a 404, a 503, a refused
    connection) as FileNotFoundError; the aiohttp error it chains says which it was.
    """
    cause = error
    chained = error.__cause__
    if isinstance(error, FileNotFoundError) and (
            isinstance(chained, TimeoutError) or type(chained).__module__.startswith("aiohttp.")):
        cause = chained
    names = {c.__name__ for c in type(cause).__mro__}
    status = getattr(cause, "status", None)
    if "TooManyRedirects" in names:  # a ClientResponseError with no status (HTTP 0)
        return OSError, "too many redirects (the server redirects in a loop): check the URL"
    if "ClientResponseError" in names and isinstance(status, int):
        said = f"HTTP {status} {getattr(cause, 'message', '') or ''}".strip()
        if status >= 500 or status in _RETRY_STATUS:
            return None, said
        if status in (401, 403):
            return PermissionError, f"access denied ({said}): check the credentials or the URL's signature"
        if status in (404, 410):
            return FileNotFoundError, f"not found ({said})"
        return OSError, said
    if names & _NO_CREDENTIALS:
        return PermissionError, (f"{cause} (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
                                 f"AWS_PROFILE, for s3://; GOOGLE_APPLICATION_CREDENTIALS for gs://)")
    if isinstance(cause, FileNotFoundError):
        return FileNotFoundError, f"not found ({cause})"
    if isinstance(cause, PermissionError):
        return PermissionError, f"access denied ({cause}): check the credentials"
    if isinstance(cause, _PERMANENT):
        return type(cause), str(cause)
    said = str(cause) or ("timed out" if isinstance(cause, TimeoutError) else "")
    return None, f"{type(cause).__name__}: {said}" if said else type(cause).__name__


def _ignores_ranges(error: BaseException) -> bool:
    """fsspec's HTTP file says the server answered a Range request with the whole object."""
    return isinstance(error, ValueError) and "support range requests" in str(error)


class RemoteShard:
    """A remote shard opened for sequential reading, resumed at the offset reached after a
    transient failure (up to `tries` tries per read, backoff from `backoff_s`, doubling)."""

    def __init__(self, url: str, *, tries: int | None = None, backoff_s: float | None = None,
                 block_bytes: int | None = None, start: int = 0, read_ahead: bool = True) -> None:
        self.url = url
        self.tries = TRIES if tries is None else tries
        self.backoff_s = BACKOFF_S if backoff_s is None else backoff_s
        self.block_bytes = BLOCK_BYTES if block_bytes is None else block_bytes
        self.cache_type = "readahead" if read_ahead else "none"  # none: each read one request
        self.fs, self.path = filesystem(url)
        self.pos = start
        self.size: int | None = None
        self.streaming = False  # the server ignores Range requests: read as one stream
        self._killed = False
        self._file: Any = None
        self._with_retries(self._open)

    def _open(self) -> None:
        if self.streaming:
            self._file = self.fs.open(self.path, "rb", block_size=0)
            done = 0
            while done < self.pos:  # no seeking in a stream: read up to the byte reached
                chunk = self._file.read(min(1 << 20, self.pos - done))
                if not chunk:
                    raise ConnectionError(f"stream ended at byte {done} on the way to {self.pos}")
                done += len(chunk)
            return
        self._file = self.fs.open(self.path, "rb", block_size=self.block_bytes, cache_type=self.cache_type)
        size = getattr(self._file, "size", None)
        if self.size is not None and size is not None and size != self.size:
            # Reading on at the byte reached would splice two objects into one archive.
            raise TarError("shard_changed", f"the object is {size} bytes now, {self.size} when it "
                           f"was opened: it was replaced while being read")
        self.size = size
        if self.pos:
            self._file.seek(self.pos)

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
            data = b"".join(parts)
        short = size > 0 and len(data) < size and self.size is not None and self.pos + len(data) < self.size
        if short:  # the object is longer: the connection ended early
            raise ConnectionError(f"read {len(data)} of {size} bytes at {self.pos} of {self.size}")
        self.pos += len(data)
        return data

    def _with_retries(self, call):
        last = ""
        attempt = 0
        while attempt < self.tries:
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            if self._killed:
                raise OSError(f"shard {self.url!r}: given up at byte {self.pos} (last: {last})")
            try:
                return call()
            except TarError:  # the object changed: reopening again would not mend it
                self._drop()
                raise
            except Exception as e:  # noqa: BLE001 - network libraries raise many kinds
                self._drop()
                if _ignores_ranges(e) and not self.streaming:
                    self.streaming = True  # not a failure: the same try, read another way
                    continue
                permanent, last = diagnose(e)
                if permanent is not None:
                    raise permanent(f"shard {self.url!r}: {last}") from None
                attempt += 1
        raise OSError(f"shard {self.url!r}: failed {self.tries} times at byte {self.pos} (last: {last})")

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


def read_range(url: str, offset: int, size: int) -> bytes:
    """Up to `size` bytes at `offset` of the remote shard `url` (fewer where the object ends),
    with RemoteShard's retries: one ranged request for exactly those bytes (a server that
    ignores ranges is read as a stream up to `offset`). Called by `shards.read_range`."""
    with RemoteShard(url, start=offset, block_bytes=max(1, size), read_ahead=False) as shard:
        return shard.read(size)
