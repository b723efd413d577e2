"""Streaming tar member iteration, strict about damage, one `read()` per member and no more copies.

Hand-written instead of `tarfile` because this is the reader's hot path (a header parse per
member) and because `tarfile` silently ends an archive cut inside a header; here any archive
that stops without its end-of-archive block, or has a corrupt header, raises `TarError`.
Handles ustar, GNU long names and pax path records; gzip shards are inflated as a stream.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Callable, Iterator
from typing import BinaryIO, NamedTuple

_BLOCK = 512
_ZERO_BLOCK = bytes(_BLOCK)
_BIG_MEMBER = 64 << 20
_SKIP_CHUNK = 1 << 20
_REGULAR = (b"0", b"\0", b"7")
_META = (b"L", b"x")  # GNU long name, pax extended header: they name the next member
_MAX_META = 1 << 20
_LINKS = (b"1", b"2")  # hard and symbolic links: named members whose bytes are elsewhere
#: devices and FIFOs: named members that hold no bytes at all
_SPECIAL = {b"3": "character device", b"4": "block device", b"6": "FIFO"}
_SKIPPED = (b"5", b"g", b"D", b"V")  # directories, pax globals, GNU dumpdir and volume headers
_GZIP_MAGIC = b"\x1f\x8b"


class TooLarge(NamedTuple):
    """Stands in for the bytes of a member over `max_member_bytes`: read through, not kept."""

    size: int
    limit: int | None  # max_member_bytes (None for members read through unnamed)


class Link(NamedTuple):
    """Stands in for the bytes of a hard or symbolic link member: the name of what it links to
    (tar stores a file linked twice as a link to its first copy)."""

    target: str


class Special(NamedTuple):
    """Stands in for a device or FIFO member: tar records its name and kind, and no bytes."""

    kind: str  # "character device", "block device" or "FIFO"


class TarError(ValueError):
    """The archive is damaged; `reason` is `truncated_tar`, `bad_tar` or (a mapped file that
    changed while read) `shard_changed`."""

    def __init__(self, reason: str, message: str, member: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.member = member  # name of the member being read when the archive failed, if known
        self.dropped_key: str | None = None  # set by readers: the partly read sample they dropped


def _number(field: bytes, offset: int) -> int:
    if field[:1] and field[0] & 0x80:  # GNU base-256 for sizes >= 8 GiB
        return int.from_bytes(field[1:], "big")
    digits = field.rstrip(b"\0 ").lstrip(b" ")
    try:
        return int(digits or b"0", 8)
    except ValueError:
        raise TarError("bad_tar", f"corrupt numeric field {field!r} in header at byte {offset}") from None


def _pax_path(records: bytes, offset: int) -> str | None:
    """The `path` of a pax extended header ("LEN key=value\\n" records), if any.

    Every record is checked: a zero or garbage length would otherwise loop forever or escape
    as a bare ValueError.
    """
    pos = 0
    path = None
    while pos < len(records):
        space = records.find(b" ", pos)
        digits = records[pos:space] if space > pos else b""
        length = int(digits) if digits.isdigit() else 0
        end = pos + length
        if space < 0 or length <= space - pos + 1 or end > len(records) or records[end - 1 : end] != b"\n":
            if not records[pos:].strip(b"\0"):
                break  # NUL padding after the last record, as some writers leave it
            raise TarError("bad_tar", f"corrupt pax record at byte {pos} of the extended header at byte {offset}")
        key, _, value = records[space + 1 : end - 1].partition(b"=")
        if key == b"path":
            path = value.decode("utf-8", "surrogateescape")
        pos = end
    return path


def _read_member(read, size: int) -> bytes:
    """`size` bytes, or fewer at end of stream; a header lying about a huge size cannot make
    us allocate it up front (BufferedReader.read(n) reserves n bytes before reading)."""
    if size <= _BIG_MEMBER:
        return read(size)
    parts = bytearray()
    while len(parts) < size:
        chunk = read(min(_BIG_MEMBER, size - len(parts)))
        if not chunk:
            break
        parts += chunk
    return bytes(parts)


def _skip_member(read, size: int) -> int:
    """Read and drop `size` bytes in bounded chunks; returns how many the stream held."""
    done = 0
    while done < size:
        chunk = read(min(_SKIP_CHUNK, size - done))
        if not chunk:
            break
        done += len(chunk)
    return done


def open_decompressed(stream: BinaryIO, url: str) -> BinaryIO:
    """Wrap `stream` in a gzip inflater when the shard name says it is compressed."""
    if url.endswith((".gz", ".tgz")):
        return gzip.GzipFile(fileobj=stream, mode="rb")  # type: ignore[return-value]
    return stream


def tar_members(
    stream: BinaryIO, max_member_bytes: int | None = None, on_member: Callable[[str, int], None] | None = None
) -> Iterator[tuple[str, bytes | TooLarge | Link | Special]]:
    """Yield (member name, member bytes) for each regular file, in archive order, and
    (name, `Link(target)`) for each hard or symbolic link and (name, `Special(kind)`) for each
    device or FIFO (which hold no bytes).

    A regular member over `max_member_bytes` is read through in 1 MiB chunks and yielded as
    `TooLarge(size, max_member_bytes)` instead of its bytes, so one huge member cannot exhaust memory.
    `on_member(name, data_offset)`, if given, learns where each member's bytes start in the
    (uncompressed) archive just before the member is yielded.
    """
    read = stream.read
    # A mapped shard hands out a member and skips its padding in one call (`MappedShard.take`).
    take = getattr(stream, "take", None)
    offset = 0
    long_name: str | None = None
    name: str | None = None  # the member being read, for errors raised by the decompressor
    try:
        while True:
            name = None
            header = read(_BLOCK)
            if offset == 0 and header.startswith(_GZIP_MAGIC):
                raise TarError("bad_tar", "gzip-compressed bytes where a tar header belongs: name a "
                               "gzip-compressed tar .tar.gz or .tgz, or decompress it")
            if len(header) < _BLOCK:
                if offset == 0 and not header:
                    return  # a zero-byte file: an empty shard, reported as such by the reader
                raise TarError(
                    "truncated_tar",
                    f"archive ends at byte {offset + len(header)} without an end-of-archive block",
                )
            if header == _ZERO_BLOCK:
                return
            stored = _number(header[148:156], offset)
            if stored != sum(header) - sum(header[148:156]) + 8 * 32:
                raise TarError("bad_tar", f"header checksum mismatch at byte {offset}: not a tar, or corrupt")
            size = _number(header[124:136], offset)
            kind = header[156:157]
            if kind in _REGULAR or kind in _LINKS or kind in _SPECIAL:
                if long_name is not None:
                    name, long_name = long_name, None
                else:
                    raw = header[:100].split(b"\0", 1)[0]
                    if header[257:263] == b"ustar\0" and header[345] != 0:
                        raw = header[345:500].split(b"\0", 1)[0] + b"/" + raw
                    name = raw.decode("utf-8", "surrogateescape")
            if name is None and kind in _META and size > _MAX_META:
                raise TarError("bad_tar", f"extended header at byte {offset} declares {size} bytes")
            pad = -size % _BLOCK
            padded = None  # padding bytes present, when read together with the member
            # Members nobody keeps (directories, links, oversized files) are read through, not held.
            if kind in _LINKS:
                present = _skip_member(read, size)
                data: bytes | TooLarge | Link | Special | memoryview = Link(
                    header[157:257].split(b"\0", 1)[0].decode("utf-8", "surrogateescape"))
            elif kind in _SPECIAL:
                present = _skip_member(read, size)
                data = Special(_SPECIAL[kind])
            elif kind not in _META if name is None else max_member_bytes is not None and size > max_member_bytes:
                present = _skip_member(read, size)
                data = TooLarge(size, max_member_bytes)
            elif take is not None:
                data, padded = take(size, pad)
                present = len(data)
            else:
                data = _read_member(read, size)
                present = len(data)
            if present < size:
                raise TarError(
                    "truncated_tar",
                    f"member at byte {offset} declares {size} bytes, archive ends after {present}",
                    name,
                )
            if pad and (len(read(pad)) if padded is None else padded) < pad:
                raise TarError("truncated_tar", f"archive ends inside the padding of member at byte {offset}", name)
            if name is not None:
                if on_member is not None:
                    on_member(name, offset + _BLOCK)
                offset += _BLOCK + size + pad
                yield name, data
                continue
            if kind == b"L":
                long_name = bytes(data).split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            elif kind == b"x":
                long_name = _pax_path(bytes(data), offset) or long_name
            elif kind in _SKIPPED:
                long_name = None  # a long name applies to the very next member only
            else:
                raise TarError("bad_tar", f"unknown tar member type {kind!r} at byte {offset}")
            offset += _BLOCK + size + pad
    except TarError as e:
        if e.member is None:
            e.member = name  # raised by the stream (a mapped file that changed) inside a member
        raise
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        reason = "truncated_tar" if isinstance(e, EOFError) else "bad_tar"
        raise TarError(reason, f"compressed shard at tar byte {offset}: {e}", name) from None
