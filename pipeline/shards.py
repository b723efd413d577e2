"""Shard lists: expand user specs into shard URLs, split them across nodes and workers, open them.

Specs are local paths, directories, globs, brace ranges (`data-{000..099}.tar`, expanded with
`braceexpand`, the library webdataset itself uses) and webdataset-style URLs (`pipe:CMD`,
`file:PATH`). We do not import webdataset here: its package `__init__` imports torch when torch
is installed, and a data node must never load torch.
"""

from __future__ import annotations

import glob
import io
import mmap
import os
import signal
import stat
import subprocess
from collections.abc import Sequence
from typing import Any, BinaryIO

import braceexpand

from dispatcher_server.protocol import Ref, check_stamp, file_stamp
from pipeline import remote
from pipeline.tario import TarError, gzip_named

#: File names a shard may have, in any case (`A.TAR` too); gzip-compressed tars are decompressed
#: while streaming.
SHARD_SUFFIXES: tuple[str, ...] = (".tar", ".tar.gz", ".tgz")
_GLOB_CHARS = frozenset("*?[")
_READ_BUFFER = 1 << 20
#: `MappedShard.read` returns reads up to this size as bytes (tar headers, short text members:
#: parsed with bytes methods) and longer ones as views of the map.
_SMALL_READ = 4096


def absolute_url(url: str) -> str:
    """A local shard's path made absolute (a `file:` URL's path too); remote URLs and `pipe:`
    commands as given. What readers and trainers elsewhere open means the same file."""
    if url.startswith("pipe:") or remote.scheme(url):
        return url
    path = _local_path(url)
    return url if path is None else os.path.abspath(path)


def _local_path(url: str) -> str | None:
    """The filesystem path of a local shard URL, or None for `pipe:` URLs."""
    if url.startswith("pipe:"):
        return None
    if url.startswith("file://"):
        return url[len("file://"):]
    if url.startswith("file:"):
        return url[len("file:"):]
    if "://" in url:
        raise ValueError(f"unsupported shard URL {url!r}: use a local path, file:, pipe:, "
                         f"s3://, gs:// or http(s)://")
    return url


def reads_can_wait(url: str) -> bool:
    """Whether a read of shard `url` can wait for long: a `pipe:` command or a remote URL can
    (a command or server that pauses), a local file cannot."""
    return url.startswith("pipe:") or ("://" in url and not url.startswith("file:"))


def is_shard_name(name: str) -> bool:
    """Whether a file name ends with a shard suffix (`SHARD_SUFFIXES`, in any case)."""
    return name.lower().endswith(SHARD_SUFFIXES)


def _check_suffix(path: str, spec: str) -> None:
    if not is_shard_name(path):
        raise ValueError(f"shard {path!r} (from spec {spec!r}) must end with one of {SHARD_SUFFIXES} "
                         f"(in any case)")


def expand_shards(specs: Sequence[str] | str) -> list[str]:
    """Expand shard specs into an ordered list of shard URLs, each listed once.

    Local paths are checked now so a typo fails at startup, naming the path, instead of as a
    skipped shard hours later. Directories expand to their shard files in name order.
    """
    if isinstance(specs, str):
        specs = [specs]
    urls: list[str] = []
    for spec in specs:
        for expanded in braceexpand.braceexpand(spec):
            if remote.scheme(expanded):
                matches = remote.expand(expanded, spec)
                if not matches:
                    raise FileNotFoundError(f"no shard matches {expanded!r} (from spec {spec!r})")
                for url in matches:
                    _check_suffix(url.split("?", 1)[0], spec)
                urls.extend(matches)
                continue
            path = _local_path(expanded)
            if path is None:
                urls.append(expanded)
                continue
            prefix = expanded[: len(expanded) - len(path)]
            if _GLOB_CHARS.intersection(path) and not os.path.isfile(path):  # `a[1].tar` exists: itself
                matches = sorted(p for p in glob.glob(path) if is_shard_name(p))
                if not matches:
                    raise FileNotFoundError(f"no shard file matches {path!r} (from spec {spec!r}); a "
                                            "file whose name holds * ? or [ is named by its exact path")
                urls.extend(prefix + m for m in matches)
            elif os.path.isdir(path):
                matches = sorted(
                    os.path.join(path, name) for name in os.listdir(path) if is_shard_name(name)
                )
                if not matches:
                    raise FileNotFoundError(f"directory {path!r} (from spec {spec!r}) holds no shard files")
                urls.extend(prefix + m for m in matches)
            else:
                if not os.path.exists(path):
                    raise FileNotFoundError(f"shard {path!r} does not exist (from spec {spec!r})")
                _check_suffix(path, spec)
                urls.append(expanded)
    seen: dict[str, str] = {}
    for url in urls:
        name = shard_identity(url)
        if name in seen:
            also = "" if seen[name] == url else f" (also as {seen[name]!r})"
            raise ValueError(f"shard {url!r} is listed more than once{also}; its samples would be "
                             f"read twice")
        seen[name] = url
    return urls


def shard_identity(url: str) -> str:
    """What a shard URL names, to tell one shard listed twice: a local file's real path (however
    the URL spells it: relative, file:, through a symlink), else the URL itself."""
    path = None if remote.scheme(url) else _local_path(url)
    return os.path.realpath(path) if path is not None else url


def split_shards(
    urls: Sequence[str], *, node_rank: int, num_nodes: int, worker_id: int, num_workers: int
) -> list[str]:
    """The shards one reader worker owns: every shard goes to exactly one (node, worker).

    Round-robin over the flattened worker index keeps per-worker shard counts within one of
    each other. With more workers than shards some workers get none; callers should warn.
    """
    if num_nodes < 1 or not 0 <= node_rank < num_nodes:
        raise ValueError(f"node_rank={node_rank} must be in [0, num_nodes={num_nodes})")
    if num_workers < 1 or not 0 <= worker_id < num_workers:
        raise ValueError(f"worker_id={worker_id} must be in [0, num_workers={num_workers})")
    return list(urls[node_rank * num_workers + worker_id :: num_nodes * num_workers])


class _PipeStream:
    """Read end of a `pipe:` command; a non-zero exit status surfaces as an OSError on close."""

    def __init__(self, url: str, command: str) -> None:
        self.url = url
        self._killed = False
        # Its own process group, so `kill` ends the command's children too (`curl ... | tar`,
        # `cat x; sleep`): one left holding the pipe open would keep a reader waiting.
        self._proc = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE, bufsize=_READ_BUFFER,
                                      start_new_session=True)
        assert self._proc.stdout is not None
        self.stdout = self._proc.stdout

    def read(self, size: int = -1) -> bytes:
        return self.stdout.read(size)

    def kill(self) -> None:
        """End the command and its children now (a reader waiting for bytes gets end of file);
        its exit status, ours, is then no failure of the command's."""
        self._killed = True
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # already gone

    def close(self) -> None:
        self.stdout.close()
        status = self._proc.wait()
        if status != 0 and not self._killed:
            raise OSError(f"shard command {self.url!r} exited with status {status}")

    def __enter__(self) -> _PipeStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class MappedShard:
    """A local uncompressed shard read through a read-only memory map, sequentially.

    `read(n)` returns the next n bytes without copying them: longer reads are read-only
    memoryviews of the map, short ones bytes. Members of a sample then cost no copy and no
    allocation on the data node, and pages nobody looks at (image and audio bodies, which
    counting skips and reference payloads leave on disk) are only mapped, never copied: for
    a local file the page cache is the buffer. Views stay valid after `close()`; the map goes
    when the last one does. Shards must not be truncated while being read (as for any mapped
    file, the kernel then kills the reader with SIGBUS instead of a short read). A read past
    the end of the map checks the file: one that grew since it was mapped (appended to) raises
    `TarError("shard_changed")`, since the archive read would otherwise look truncated.
    """

    def __init__(self, path: str) -> None:
        self._path = path
        with open(path, "rb") as f:
            self.stat = os.fstat(f.fileno())  # the version mapped (stream_stamp)
            size = self.stat.st_size
            # An empty file cannot be mapped; it reads as empty (an empty shard).
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        self._view = memoryview(self._map) if self._map is not None else memoryview(b"")
        self._len = len(self._view)
        self._pos = 0

    def read(self, size: int = -1) -> bytes | memoryview:
        start = self._pos
        end = start + size if size >= 0 else self._len
        if end > self._len:
            self._check_unchanged()
            end = self._len
        self._pos = end
        if end - start <= _SMALL_READ:
            return self._map[start:end] if self._map is not None else b""
        return self._view[start:end]

    def take(self, size: int, pad: int) -> tuple[bytes | memoryview, int]:
        """A tar member's `size` bytes (fewer at end of file) and then its `pad` bytes of
        padding in one step: (data, how many padding bytes the file held)."""
        data = self.read(size)
        start = self._pos
        end = start + pad
        if end > self._len:
            self._check_unchanged()
            end = self._len
        self._pos = end
        return data, end - start

    def _check_unchanged(self) -> None:
        """A read reaches past the map: fine at the end of an unchanged file, which then reads
        short like any stream; a file whose size changed since it was mapped is reported."""
        try:
            now = os.stat(self._path).st_size
        except OSError:
            return  # removed or replaced: the map still holds the file that was opened
        if now != self._len:
            raise TarError("shard_changed", f"shard file is {now} bytes now, {self._len} when "
                           f"it was mapped: it changed while being read")

    def close(self) -> None:
        self._view.release()
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # records still view members: the map is unmapped when they are gone
            self._map = None

    def __enter__(self) -> MappedShard:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_shard(url: str, *, mapped: bool = False) -> BinaryIO:
    """Open a shard URL for sequential binary reading (tar or gzip-compressed tar).

    With `mapped`, a local uncompressed shard is read through a `MappedShard` (members as
    views of the file's pages, no copies); other shards open as streams either way: remote ones
    (`pipeline.remote`) with bounded read-ahead, resumed where a transient failure cut them.
    """
    if remote.scheme(url):
        return remote.RemoteShard(url)  # type: ignore[return-value]
    path = _local_path(url)
    if path is None:
        return _PipeStream(url, url[len("pipe:"):])  # type: ignore[return-value]
    if mapped and not gzip_named(path) and os.path.isfile(path):
        return MappedShard(path)  # type: ignore[return-value]
    return open(path, "rb", buffering=_READ_BUFFER)


def stream_stamp(stream: Any) -> int:
    """The version an opened shard stream reads, as a reference's stamp: `protocol.file_stamp`
    of a local file, `RemoteShard.stamp` of a remote object (its ETag or version as first
    opened; 0 if the store reports none); 0 for a pipe."""
    if isinstance(stream, remote.RemoteShard):
        return stream.stamp
    st = getattr(stream, "stat", None)  # a MappedShard's, taken as it was mapped
    if not isinstance(st, os.stat_result):
        try:
            st = os.fstat(stream.fileno())
        except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
            return 0
    return file_stamp(st.st_size, st.st_mtime_ns) if stat.S_ISREG(st.st_mode) else 0


def read_range(url: str, offset: int, size: int, stamp: int = 0) -> bytes:
    """`size` bytes at `offset` of the shard `url`: a local uncompressed tar, or a remote one by a
    ranged request (see protocol.reference_path). The one place payloads are read by offset
    (`direct` mode). OSError naming the shard if it holds fewer, or if the file or object is no
    longer the version `stamp` (`stream_stamp`; 0: not checked) its reader read."""
    if remote.scheme(url):
        data = remote.read_range(url, offset, size, stamp)
    else:
        path = _local_path(url)
        if path is None:
            raise ValueError(f"shard {url!r} is a stream: it has no offsets to read at")
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            st = os.fstat(fd)
            check_stamp(Ref(url.encode("utf-8", "surrogateescape"), offset, size, stamp),
                        st.st_size, st.st_mtime_ns)
            data = os.pread(fd, size, offset)
        finally:
            os.close(fd)
    if len(data) != size:
        raise OSError(f"shard {url!r} holds {len(data)} of the {size} bytes at offset {offset}: "
                      f"changed on disk or in storage since it was read?")
    return data
