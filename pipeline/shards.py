"""Shard lists: expand user specs into shard URLs, split them across nodes and workers, open them.

Specs are local paths, directories, globs, brace ranges (`data-{000..099}.tar`, expanded with
`braceexpand`, the library webdataset itself uses) and webdataset-style URLs (`pipe:CMD`,
`file:PATH`). We do not import webdataset here: its package `__init__` imports torch when torch
is installed, and a data node must never load torch.
"""

from __future__ import annotations

import glob
import io
import logging
import mmap
import os
import re
import shlex
import signal
import stat
import subprocess
from collections.abc import Sequence
from typing import Any, BinaryIO

import braceexpand

from dispatcher_server.protocol import Ref, check_stamp, file_stamp
from pipeline import remote
from pipeline.tario import OTHER_COMPRESSIONS, TarError, gzip_named

log = logging.getLogger("mmdispatch.pipeline")

#: File names a shard may have, in any case (`A.TAR` too); gzip-compressed tars are decompressed
#: while streaming.
SHARD_SUFFIXES: tuple[str, ...] = (".tar", ".tar.gz", ".tgz")
#: Opened without waiting: a FIFO among the shards must be refused, not wait for a writer.
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_GLOB_CHARS = frozenset("*?[")
_READ_BUFFER = 1 << 20
#: `MappedShard.read` returns reads up to this size as bytes (tar headers, short text members:
#: parsed with bytes methods) and longer ones as views of the map.
_SMALL_READ = 4096
_NONZERO = re.compile(rb"[^\0]")


def normalized(url: str) -> str:
    """`url` with its scheme in lower case, as webdataset and fsspec know them: `FILE:x.tar`,
    `Pipe:cat x.tar` and `S3://b/k` are `file:`, `pipe:` and `s3://` URLs. Other URLs as given."""
    for prefix in ("file:", "pipe:"):
        if url[:len(prefix)].lower() == prefix:
            return prefix + url[len(prefix):]
    return remote.normalized(url)


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


def _compression_fix(path: str, local: bool = True) -> str | None:
    """The way on for a tar in a compression readers do not inflate (`x.tar.bz2`), or None."""
    lower = path.lower()
    for suffixes, name, _, unpack, cat in OTHER_COMPRESSIONS:
        if lower.endswith(suffixes):
            quoted = shlex.quote(path)
            fix = (f"decompress it ({unpack} {quoted}) or give it as 'pipe:{cat} {quoted}'" if local
                   else "store it decompressed (.tar) or as .tar.gz")
            return (f"is {name}-compressed, which readers do not inflate (they read "
                    f"{', '.join(SHARD_SUFFIXES)}): {fix}")
    return None


def _check_suffix(path: str, spec: str, local: bool = True) -> None:
    if not is_shard_name(path):
        fix = _compression_fix(path, local)
        if fix is not None:
            raise ValueError(f"shard {path!r} (from spec {spec!r}) {fix}")
        listed = (" (a file listing shards is not read: give the shards as a glob, a {000..099} "
                  "range or their directory, or in a --dataset file)"
                  if path.lower().endswith((".txt", ".lst", ".list"))
                  else f" (a dataset file is given as --dataset {path})"
                  if path.lower().endswith(".toml") else "")
        raise ValueError(f"shard {path!r} (from spec {spec!r}) must end with one of {SHARD_SUFFIXES} "
                         f"(in any case){listed}")


def _file_kind(mode: int) -> str:
    """What a file that is not a regular file is, in words."""
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return "not a regular file"


def _kind_of(path: str) -> str:
    """What `path` is, in words, when it is not a regular file."""
    try:
        return _file_kind(os.stat(path).st_mode)
    except OSError as e:
        return e.strerror or "cannot stat"


def _blocker(path: str) -> str | None:
    """The highest directory above `path` this user may not search (enter), or None."""
    path = os.path.abspath(path)
    found = None
    parent = os.path.dirname(path)
    while parent != path:
        if os.path.isdir(parent) and not os.access(parent, os.X_OK):
            found = parent
        path, parent = parent, os.path.dirname(parent)
    return found


def _denied(what: str, path: str) -> PermissionError:
    """The one-line error for a path this user may not reach, naming the directory that stops it."""
    blocker = _blocker(path)
    where = f" (this user may not enter directory {blocker!r})" if blocker else ""
    return PermissionError(f"{what}: permission denied{where}; give this user read access to the "
                           "shards and search (x) access to the directories above them")


def _glob_denied(pattern: str, spec: str) -> PermissionError | None:
    """The error for a glob that matched nothing because this user may not reach or list the
    directory it lists, or None."""
    top = os.path.dirname(pattern[: min(pattern.index(c) for c in _GLOB_CHARS.intersection(pattern))]) or "."
    what = f"no shard file can match {pattern!r} (from spec {spec!r})"
    try:
        os.stat(top)
    except PermissionError:
        return _denied(what, top)
    except OSError:
        return None
    if os.path.isdir(top) and not os.access(top, os.R_OK | os.X_OK):
        return PermissionError(f"{what}: permission denied listing directory {top!r}; give this user "
                               "read (r) and search (x) access to it")
    return None


def _listed(spec: str, matches: list[tuple[str, bool]]) -> list[str]:
    """The regular files among a directory's or glob's shard-named `matches` ((path, whether it
    is a regular file)), in name order: a FIFO would stop a reader in open(), a directory named
    `x.tar` fails when read."""
    files, others = [], []
    for m, regular in matches:
        (files if regular else others).append(m)
    if others:
        others.sort()
        log.warning("mmdispatch.pipeline: spec %r: left out %d name(s) that look like shards but "
                    "are not regular files (first: %r, %s)", spec, len(others), others[0],
                    _kind_of(others[0]))
    return sorted(files)


def _refuse_other_compressions(spec: str, matches: list[tuple[str, bool]], local: bool = True) -> None:
    """Refuse a directory's, glob's or object listing's ((path, whether it is a regular file))
    that holds a tar in a compression readers do not inflate, as if it were named alone: left
    out, its samples would be lost without a word when it lies beside plain tars."""
    found = sorted(p for p, regular in matches if regular and _compression_fix(p, local) is not None)
    if found:
        more = f" ({len(found) - 1} more file(s) there are compressed so)" if len(found) > 1 else ""
        raise ValueError(f"shard {found[0]!r} (from spec {spec!r}) {_compression_fix(found[0], local)}{more}")


def _no_match(pattern: str, spec: str, found: list[str], local: bool = True) -> str:
    """What a glob that matched no shard (`found`: what it matched) says, local or remote."""
    return (f"no shard file matches {pattern!r} (from spec {spec!r}); a file whose name holds "
            f"* ? or [ is named by its exact path{_other_compressions(found, local)}")


def _other_compressions(names: list[str], local: bool = True) -> str:
    """A hint naming the first of `names` in a compression readers do not inflate, or ""."""
    for name in names:
        fix = _compression_fix(name, local)
        if fix is not None:
            return f"; {name!r} {fix}"
    return ""


def expand_shards(specs: Sequence[str] | str) -> list[str]:
    """Expand shard specs into an ordered list of shard URLs, each listed once.

    Local paths are checked now so a typo fails at startup, naming the path, instead of as a
    skipped shard hours later; `~` is expanded. Directories and globs expand to their regular
    shard files in name order (a FIFO would hold a reader in open()); a non-regular file named
    explicitly is refused, and so is a tar in a compression readers do not inflate, named or
    listed.
    """
    if isinstance(specs, str):
        specs = [specs]
    urls: list[str] = []
    for spec in specs:
        for expanded in braceexpand.braceexpand(spec):
            expanded = normalized(expanded)
            if remote.scheme(expanded):
                found = remote.expand(expanded, spec)
                if found == [expanded]:  # named by itself: it must be a shard
                    _check_suffix(remote.object_name(expanded), spec, local=False)
                    urls.append(expanded)
                    continue
                # a listing: other objects beside the shards are left out, as in a directory, but
                # not tars compressed so that readers cannot inflate them
                _refuse_other_compressions(spec, [(remote.object_name(u), True) for u in found], local=False)
                matches = [u for u in found if is_shard_name(remote.object_name(u))]
                if not matches:
                    raise FileNotFoundError(_no_match(expanded, spec, found, local=False))
                urls.extend(matches)
                continue
            path = _local_path(expanded)
            if path is None:
                urls.append(expanded)
                continue
            prefix = expanded[: len(expanded) - len(path)]
            path = os.path.expanduser(path)  # `~/x.tar` as a shell would (quoted, or from a file)
            if _GLOB_CHARS.intersection(path) and not os.path.isfile(path):  # `a[1].tar` exists: itself
                # `**` spans directories, as it does for object storage (fsspec) and shells'
                # globstar: one level only took a quarter of a nested dataset, silently.
                found = [(p, os.path.isfile(p)) for p in glob.glob(path, recursive=True)]
                _refuse_other_compressions(spec, found)
                matches = _listed(spec, [(p, regular) for p, regular in found if is_shard_name(p)])
                if not matches:
                    denied = _glob_denied(path, spec)
                    if denied is not None:
                        raise denied
                    raise FileNotFoundError(_no_match(path, spec, found))
                urls.extend(prefix + m for m in matches)
                continue
            try:
                st = os.stat(path)
            except PermissionError:
                raise _denied(f"shard {path!r} (from spec {spec!r})", path) from None
            except (FileNotFoundError, NotADirectoryError):
                tilde = "; '~' is expanded only at the start of a path" if "/~" in path else ""
                raise FileNotFoundError(f"shard {path!r} does not exist (from spec {spec!r}){tilde}") from None
            except OSError as e:
                raise OSError(f"shard {path!r} (from spec {spec!r}): {e.strerror}") from None
            if stat.S_ISDIR(st.st_mode):
                try:
                    with os.scandir(path) as listing:  # file kinds without a stat per entry
                        entries = [(e.path, e.is_file()) for e in listing]
                except PermissionError:
                    raise PermissionError(f"directory {path!r} (from spec {spec!r}): permission denied "
                                          "listing it; give this user read (r) and search (x) access "
                                          "to it") from None
                _refuse_other_compressions(spec, entries)
                matches = _listed(spec, [(p, regular) for p, regular in entries if is_shard_name(p)])
                if not matches:
                    tomls = sorted(p for p, regular in entries if regular and p.endswith(".toml"))
                    nested = (f"; it holds {tomls[0]!r}: a dataset file is given as --dataset "
                              f"{tomls[0]}" if tomls
                              else f"; its subdirectories are not listed: give "
                              f"'{os.path.join(path, '**', '*.tar')}' for the shards under it"
                              if any(os.path.isdir(p) for p, _ in entries) else "")
                    raise FileNotFoundError(f"directory {path!r} (from spec {spec!r}) holds no "
                                            f"shard files{nested}")
                urls.extend(prefix + m for m in matches)
            elif stat.S_ISREG(st.st_mode):
                _check_suffix(path, spec)
                urls.append(prefix + path)
            else:
                raise ValueError(f"shard {path!r} (from spec {spec!r}) is {_file_kind(st.st_mode)}, not a "
                                 "regular file: a reader would wait on it; name tar files")
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
    """What a shard URL names, to tell one shard listed twice: a local file's device and inode
    (however the URL spells it: relative, file:, through a symlink or a hard link), else its
    real path, else the URL itself."""
    path = None if remote.scheme(url) else _local_path(url)
    if path is None:
        return url
    try:
        st = os.stat(path)
    except OSError:
        return os.path.realpath(path)
    return f"inode {st.st_dev}:{st.st_ino}"


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
        with open_regular(path, 0) as f:
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

    def seek(self, pos: int) -> int:
        """Read on from byte `pos` (a walk resumed at a sample's offset)."""
        self._pos = pos
        return pos

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

    def skip_zeros(self, block: int) -> int:
        """Move past the whole `block`-sized blocks of zeros from here (a tar's end-of-archive
        blocks and padding), or to the end if only zeros follow; returns the bytes passed. One
        scan of the map, up to the first other byte."""
        if self._map is None:
            return 0
        found = _NONZERO.search(self._map, self._pos)
        end = self._len if found is None else self._pos + (found.start() - self._pos) // block * block
        passed, self._pos = end - self._pos, end
        return passed

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


def _nonblocking(path: str, flags: int) -> int:
    return os.open(path, flags | _NONBLOCK)


def _not_regular(mode: int) -> OSError:
    return OSError(f"not a regular file ({_file_kind(mode)}); shards must be tar files")


def open_regular(path: str, buffering: int = _READ_BUFFER) -> BinaryIO:
    """Open a local shard file, refusing (OSError) anything but a regular file without opening
    it: open() of a FIFO waits for a writer, on the reader's main thread, for ever. (Opened
    without waiting all the same, and checked again: it may be replaced in between.)"""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise _not_regular(mode)
    f = open(path, "rb", buffering=buffering, opener=_nonblocking)
    try:
        mode = os.fstat(f.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(mode)
        if _NONBLOCK:
            os.set_blocking(f.fileno(), True)
    except BaseException:
        f.close()
        raise
    return f  # type: ignore[return-value]


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
    if mapped and not gzip_named(path):
        return MappedShard(path)  # type: ignore[return-value]
    return open_regular(path)


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
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | _NONBLOCK)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(f"shard {url!r} is not a regular file ({_file_kind(st.st_mode)})")
            check_stamp(Ref(url.encode("utf-8", "surrogateescape"), offset, size, stamp),
                        st.st_size, st.st_mtime_ns)
            data = os.pread(fd, size, offset)
        finally:
            os.close(fd)
    if len(data) != size:
        raise OSError(f"shard {url!r} holds {len(data)} of the {size} bytes at offset {offset}: "
                      f"changed on disk or in storage since it was read?")
    return data
