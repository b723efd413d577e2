"""Streaming tar member iteration, strict about damage, one `read()` per member and no more copies.

Hand-written instead of `tarfile` because this is the reader's hot path (a header parse per
member) and because `tarfile` silently ends an archive cut inside a header; here an archive cut
inside a header or member, or with a corrupt header, raises `TarError`. One that ends exactly
after a member, without its end-of-archive blocks (a writer killed or never closed), ends
there, as it does for webdataset, and says so (`on_unterminated`): its last member is whole.
End-of-archive blocks end the archive only where nothing but zeros follows them: as `tar
--ignore-zeros` reads it, a header after them continues it (`cat a.tar b.tar`), and other bytes
there raise `TarError`. Headers whose checksum is the signed-byte sum (old writers) are taken,
as by `tarfile` and GNU tar.
Handles ustar, GNU long names and link targets, pax path, linkpath and size records; sparse
files (GNU or pax) are named and read through, not expanded. gzip shards are inflated as a stream:
a file is gzip when its name says so (any case), a `pipe:` command's output when its bytes do.
"""

from __future__ import annotations

import gzip
import hashlib
import struct
import zlib
from collections.abc import Callable, Iterator
from typing import BinaryIO, NamedTuple

_BLOCK = 512
_ZERO_BLOCK = bytes(_BLOCK)
_BIG_MEMBER = 64 << 20
_SKIP_CHUNK = 1 << 20
_REGULAR = (b"0", b"\0", b"7")
_META = (b"L", b"K", b"x")  # GNU long name and long link target, pax extended header: about the next member
_MAX_META = 1 << 20
_LINKS = (b"1", b"2")  # hard and symbolic links: named members whose bytes are elsewhere
_SPARSE = "sparse file (not supported: write shards without tar --sparse)"
#: devices and FIFOs (no bytes at all) and GNU sparse files (bytes kept as a map of holes): named
#: members with no bytes a sample could use
_SPECIAL = {b"3": "character device", b"4": "block device", b"6": "FIFO", b"S": _SPARSE}
_NAMED = (*_REGULAR, *_LINKS, *_SPECIAL)
_SKIPPED = (b"5", b"g", b"D", b"V")  # directories, pax globals, GNU dumpdir and volume headers
#: headers about the members after them, as named in a message about one no member follows
_HEADERS = {b"x": "pax extended header", b"g": "pax global header", b"L": "GNU long name header",
            b"K": "GNU long link header"}
_GZIP_MAGIC = b"\x1f\x8b"
_GZIP_SUFFIXES = (".gz", ".tgz")


class Compression(NamedTuple):
    """A tar compression readers do not inflate, and the way on for a file in it."""
    suffixes: tuple[str, ...]
    name: str
    magic: bytes  # its stream's first bytes
    unpack: str  # decompresses a file in place
    cat: str  # writes it decompressed, for a `pipe:` shard


OTHER_COMPRESSIONS = (
    Compression((".tar.bz2", ".tbz2", ".tbz", ".tb2"), "bzip2", b"BZh", "bunzip2 -k", "bzcat"),
    Compression((".tar.xz", ".txz"), "xz", b"\xfd7zXZ\x00", "unxz -k", "xzcat"),
    Compression((".tar.zst", ".tar.zstd", ".tzst"), "zstd", b"\x28\xb5\x2f\xfd", "unzstd", "zstdcat"),
    Compression((".tar.lz4",), "lz4", b"\x04\x22\x4d\x18", "unlz4", "lz4cat"),
)
_MAX_DIGITS = 20  # a pax length or size past this is garbage (and int() refuses 4300 digits)
_SIGNED = struct.Struct("148b8x356b")  # a header's bytes as signed, less its checksum field


class TooLarge(NamedTuple):
    """Stands in for the bytes of a member over `max_member_bytes`: read through, not kept."""

    size: int
    limit: int | None  # max_member_bytes (None for members read through unnamed)


class Link(NamedTuple):
    """Stands in for the bytes of a hard or symbolic link member: the name of what it links to
    (tar stores a file linked twice as a link to its first copy)."""

    target: str


class Special(NamedTuple):
    """Stands in for a device or FIFO member (tar records its name and kind, and no bytes) or a
    sparse file (its bytes are a map of holes, read through, not expanded)."""

    kind: str  # "character device", "block device", "FIFO" or a sparse file (`_SPARSE`)


class TarError(ValueError):
    """The archive is damaged; `reason` is `truncated_tar`, `bad_tar` or (a mapped file that
    changed while read) `shard_changed`. `after_end`: every member before the damage was read
    whole: it lies past end-of-archive blocks, or is an extended header that no member follows
    (then `member` is the name that header gives the member it was written for, if it gives one:
    that member's sample is not whole)."""

    def __init__(self, reason: str, message: str, member: str | None = None, *, after_end: bool = False) -> None:
        super().__init__(message)
        self.reason = reason
        self.member = member  # name of the member being read when the archive failed, if known
        self.after_end = after_end
        self.dropped_key: str | None = None  # set by readers: the partly read sample they dropped


class CopyIdentity:
    """A shard copy's identity, built as its tar is walked: a digest of every 512-byte header
    block (the name, size, mode and time of each member, so a copy written otherwise differs)
    and the tar bytes walked. One hash update per member; member bytes are not hashed (a copy
    that differs only inside a member's bytes, at the same sizes, passes). `complete` once the
    walk reached the archive's end: only then is it the whole copy's."""

    __slots__ = ("_hash", "size", "complete")

    def __init__(self) -> None:
        self._hash = hashlib.blake2b(digest_size=8)
        self.size = 0
        self.complete = False

    def add(self, header: bytes) -> None:
        self._hash.update(header)

    def finish(self, size: int) -> None:
        self.size, self.complete = size, True

    def to_wire(self) -> dict:
        """SHARD_DONE's `identity` field."""
        return {"size": self.size, "headers": self._hash.hexdigest()}


def valid_header(block: bytes | memoryview) -> bool:
    """Whether `block` is a whole tar header block with a right checksum (not an end-of-archive
    block): what a walk resumed at a sample's offset must find there."""
    block = bytes(block)
    if len(block) != _BLOCK or block == _ZERO_BLOCK:
        return False
    try:
        return _checksum_ok(block, 0)
    except TarError:
        return False


def _checksum_ok(header: bytes, offset: int) -> bool:
    """Whether a header block's stored checksum is the sum of its bytes (its checksum field read
    as spaces), unsigned as POSIX says or signed as old writers summed them; TarError if the
    field is not a number."""
    stored = _number(header[148:156], offset)
    if stored == sum(header) - sum(header[148:156]) + 8 * 32:
        return True
    # Only a header with bytes >= 0x80 (a non-ASCII name) has two sums: computed on failure alone.
    return stored == sum(_SIGNED.unpack(header)) + 8 * 32


def _refuse_compressed(header: bytes) -> None:
    """TarError naming the compression of a file whose first bytes are a compressed stream's
    readers do not inflate (a .tar.bz2 named .tar): its bytes are no tar header's, and a
    "corrupt numeric field" would not say why."""
    for c in OTHER_COMPRESSIONS:
        if header.startswith(c.magic):
            raise TarError("bad_tar", f"{c.name}-compressed bytes where a tar header belongs, which "
                           f"readers do not inflate: decompress it ({c.unpack}) or give it as "
                           f"'pipe:{c.cat} FILE'")
    if header.startswith((b"PK\x03\x04", b"PK\x05\x06")):  # a local file header; an empty ZIP
        raise TarError("bad_tar", "a ZIP archive, not a tar: readers read tar shards; write the "
                       "samples into a tar (webdataset's TarWriter, or unzip and tar --sort=name)")


def _number(field: bytes, offset: int) -> int:
    if field[:1] and field[0] & 0x80:  # GNU base-256 for sizes >= 8 GiB
        return int.from_bytes(field[1:], "big")
    digits = field.rstrip(b"\0 ").lstrip(b" ")
    try:
        return int(digits or b"0", 8)
    except ValueError:
        raise TarError("bad_tar", f"corrupt numeric field {field!r} in header at byte {offset}") from None


def _pax_records(records: bytes, offset: int) -> dict[bytes, bytes]:
    """The records of a pax extended header ("LEN key=value\\n"), by key.

    Every record is checked: a zero or garbage length would otherwise loop forever or escape
    as a bare ValueError.
    """
    pos = 0
    found: dict[bytes, bytes] = {}
    while pos < len(records):
        space = records.find(b" ", pos)
        digits = records[pos:space] if space > pos else b""
        length = int(digits) if digits.isdigit() and len(digits) <= _MAX_DIGITS else 0
        end = pos + length
        if space < 0 or length <= space - pos + 1 or end > len(records) or records[end - 1 : end] != b"\n":
            if not records[pos:].strip(b"\0"):
                break  # NUL padding after the last record, as some writers leave it
            raise TarError("bad_tar", f"corrupt pax record at byte {pos} of the extended header at byte {offset}")
        key, _, value = records[space + 1 : end - 1].partition(b"=")
        found[key] = value
        pos = end
    return found


class _Next:
    """What GNU long name/link headers and pax headers say about the next member; each applies
    to the very next member only."""

    __slots__ = ("name", "link", "size", "sparse")

    def __init__(self) -> None:
        self.name: str | None = None
        self.link: str | None = None
        self.size: int | None = None  # pax `size`: members over 8 GiB may carry theirs only here
        self.sparse = False  # pax GNU.sparse.* records: the member's bytes are a sparse map

    def add_pax(self, records: bytes, offset: int) -> None:
        found = _pax_records(records, offset)
        path = found.get(b"GNU.sparse.name", found.get(b"path"))
        if path is not None:
            self.name = path.decode("utf-8", "surrogateescape")
        if b"linkpath" in found:
            self.link = found[b"linkpath"].decode("utf-8", "surrogateescape")
        size = found.get(b"size")
        if size is not None:
            if not size.isdigit() or len(size) > _MAX_DIGITS:
                raise TarError("bad_tar", f"corrupt pax size {size[:40]!r} in the extended header at byte {offset}")
            self.size = int(size)
        self.sparse = self.sparse or any(key.startswith(b"GNU.sparse.") for key in found)


_NOTHING = _Next()  # no extended header pending: shared, never changed (one member, no allocation)


def _header_name(header: bytes) -> str:
    raw = header[:100].split(b"\0", 1)[0]
    if header[257:263] == b"ustar\0" and header[345] != 0:
        raw = header[345:500].split(b"\0", 1)[0] + b"/" + raw
    return raw.decode("utf-8", "surrogateescape")


def _gnu_string(data: bytes | memoryview) -> str:
    return bytes(data).split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _sparse_extensions(read, header: bytes, offset: int) -> int:
    """Read through the extension blocks a GNU sparse header announces (its 4 map slots were too
    few); returns how many bytes they took."""
    taken = 0
    more = header[482]
    while more:
        block = read(_BLOCK)
        if len(block) < _BLOCK:
            raise TarError("truncated_tar", f"archive ends inside the sparse map of member at byte {offset}")
        taken += _BLOCK
        more = block[504]
    return taken


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


def gzip_named(url: str) -> bool:
    """Whether shard `url` is named as a gzip-compressed tar (`.tar.gz`, `.tgz`, in any case; a
    remote URL's `?query` aside, as for the shard suffix check)."""
    remote = "://" in url and not url.startswith("file:")
    return (url.split("?", 1)[0] if remote else url).lower().endswith(_GZIP_SUFFIXES)


class _Prepended:
    """A stream whose first bytes were read to look at them, handed out again first."""

    def __init__(self, head: bytes, stream: BinaryIO) -> None:
        self._head = head
        self._stream = stream

    def read(self, size: int = -1) -> bytes:
        if not self._head:
            return self._stream.read(size)
        if size < 0:
            data, self._head = self._head + self._stream.read(), b""
            return data
        data, self._head = self._head[:size], self._head[size:]
        return data + self._stream.read(size - len(data)) if len(data) < size else data


def _not_gzip(head: bytes, url: str) -> str:
    """Why a file named as gzip is not read, with the fix (gzip's own words kept)."""
    suffix = next(s for s in (".tar.gz", ".tgz", ".gz") if url.lower().endswith(s))
    tar = valid_header(head)
    if tar:
        return f"Not a gzipped file, though named {suffix}: it is a plain tar; rename it .tar"
    return (f"Not a gzipped file, though named {suffix} (first bytes {head[:8]!r}): rename it .tar "
            f"if it is a plain tar, or check how it was written")


def open_decompressed(stream: BinaryIO, url: str) -> BinaryIO:
    """Wrap `stream` in a gzip inflater when the shard is compressed.

    A file (local or remote) is gzip when its name says so: its name then also decides how it
    is mapped and whether its members have file offsets, and a misnamed one is reported (a
    plain tar named .tar.gz as such: `TarError` from its first block). A
    `pipe:` command's output is gzip when its first bytes are: the command line's last word
    says nothing about what it writes (`zcat x.tgz` writes a plain tar).
    """
    if url.startswith("pipe:"):
        head = b""
        while len(head) < len(_GZIP_MAGIC):
            chunk = stream.read(len(_GZIP_MAGIC) - len(head))
            if not chunk:
                break
            head += chunk
        stream = _Prepended(head, stream)  # type: ignore[assignment]
        compressed = head == _GZIP_MAGIC
    else:
        compressed = gzip_named(url)
    if compressed and not url.startswith("pipe:"):
        head = stream.read(_BLOCK)
        if head and not head.startswith(_GZIP_MAGIC):
            raise TarError("bad_tar", _not_gzip(head, url))
        stream = _Prepended(head, stream)  # type: ignore[assignment]
    if compressed:
        return gzip.GzipFile(fileobj=stream, mode="rb")  # type: ignore[return-value]
    return stream


def _past_end(stream, read, offset: int) -> tuple[bytes, int]:
    """After an end-of-archive block, the next block holding other bytes than zeros and its
    offset, or (b"", offset of the end of the stream) when zeros run to it. A mapped shard finds
    it with one scan of its bytes (`MappedShard.skip_zeros`); a stream reads its blocks, which
    for a whole archive are tar's padding of its last record (under 10 KiB as tar writes it)."""
    skip = getattr(stream, "skip_zeros", None)
    if skip is not None:
        offset += skip(_BLOCK)
    while True:
        block = read(_BLOCK)
        if len(block) == _BLOCK and block == _ZERO_BLOCK:
            offset += _BLOCK
            continue
        if len(block) < _BLOCK and not bytes(block).strip(b"\0"):
            return b"", offset + len(block)  # zeros to the end, whole blocks or not
        return bytes(block), offset


def _headless(kind: bytes, offset: int, after: _Next, reason: str, lead: str) -> TarError:
    """The error for extended headers that no member follows, the first of them at `offset`:
    every member before them was read whole; the one they were written for, named when they
    name it, is lost."""
    header = _HEADERS[kind]
    return TarError(reason, f"{lead} {header} at byte {offset}, not a member it describes "
                    "(its writer stopped between them?)", after.name, after_end=True)


def tar_members(
    stream: BinaryIO, max_member_bytes: int | None = None, on_member: Callable[[str, int], None] | None = None,
    *, on_unterminated: Callable[[int], None] | None = None, identity: CopyIdentity | None = None,
    start: int = 0, at: list[int] | None = None,
) -> Iterator[tuple[str, bytes | TooLarge | Link | Special]]:
    """Yield (member name, member bytes) for each regular file, in archive order, and
    (name, `Link(target)`) for each hard or symbolic link and (name, `Special(kind)`) for each
    device, FIFO or sparse file (which hold no bytes a sample could use).

    A regular member over `max_member_bytes` is read through in 1 MiB chunks and yielded as
    `TooLarge(size, max_member_bytes)` instead of its bytes, so one huge member cannot exhaust memory.
    `on_member(name, data_offset)`, if given, learns where each member's bytes start in the
    archive file, just before the member is yielded; a gzip inflater has no such offsets and
    raises `TarError`. An archive that ends right after a member's padding, without its
    end-of-archive blocks, ends there and calls `on_unterminated(bytes read)` if given; one cut
    anywhere else raises `TarError("truncated_tar")`. End-of-archive blocks end it where only
    zeros follow them to the stream's end; a valid header after them continues it (tars joined
    with `cat`, read as `tar --ignore-zeros` reads them), other bytes raise `TarError("bad_tar",
    after_end=True)` once every member before them was yielded. So do extended headers (pax,
    pax global, GNU long name or link) that no member follows: `bad_tar` where end-of-archive
    blocks follow them, `truncated_tar` where the stream ends. `identity`, if given, digests
    each header block as it is read and is finished at the archive's end.

    `start` is the file offset of the stream's first byte (a walk resumed at a member's header,
    see `valid_header`): offsets given and raised stay file offsets. `at`, if given, holds in
    `at[0]` where the member just yielded begins: the first header block after the previous
    member yielded (its GNU long name or pax headers, and any directory entry between, included);
    after the archive's end, the end's offset, and -1 once the walk failed (a sample's start is
    its first member's: a reader resumes a shard there, `reader.iter_shard(offset=...)`).
    """
    if on_member is not None and isinstance(stream, gzip.GzipFile):
        raise TarError("bad_tar", "member offsets asked of a gzip-compressed shard: they are not file "
                       "offsets (decompress it, or send its payloads inline)")
    read = stream.read
    # A mapped shard hands out a member and skips its padding in one call (`MappedShard.take`).
    take = getattr(stream, "take", None)
    offset = chain = start  # chain: where the headers of the next member yielded begin
    after = _NOTHING  # what extended headers said about the next member
    pending, pending_kind = -1, b""  # the first extended (or pax global) header since the last member
    name: str | None = None  # the member being read, for errors raised by the decompressor
    try:
        while True:
            name = None
            header = read(_BLOCK)
            if offset == 0:  # a compressed stream named .tar, however short
                if header.startswith(_GZIP_MAGIC):
                    raise TarError("bad_tar", "gzip-compressed bytes where a tar header belongs: name a "
                                   "gzip-compressed tar .tar.gz or .tgz, or decompress it")
                _refuse_compressed(header)
            if len(header) < _BLOCK:
                if not header and pending >= 0:
                    raise _headless(pending_kind, pending, after,
                                    "truncated_tar", f"archive ends at byte {offset} after the")
                if not header:
                    # At a member boundary: a zero-byte file (offset 0, an empty shard, reported
                    # as such by the reader), or an archive whose writer never wrote its end.
                    if offset and on_unterminated is not None:
                        on_unterminated(offset)
                    if identity is not None:
                        identity.finish(offset)
                    if at is not None:
                        at[0] = offset
                    return
                raise TarError(
                    "truncated_tar",
                    f"archive ends at byte {offset + len(header)} without an end-of-archive block",
                )
            if header == _ZERO_BLOCK:
                end = offset
                if pending >= 0:
                    # Raised before the blocks past the end are read: whatever follows (zeros,
                    # an appended tar), the header names no member of it. GNU tar drops it
                    # without a word; a writer that stopped between it and its member may have
                    # left a sample short, so it is named, as tarfile refuses it.
                    raise _headless(pending_kind, pending, after,
                                    "bad_tar", f"end-of-archive blocks at byte {end} follow the")
                try:
                    header, offset = _past_end(stream, read, offset + _BLOCK)
                except (EOFError, gzip.BadGzipFile, zlib.error) as e:
                    # a gzip shard's stream past the end (trailing junk, a cut or damaged
                    # appended part): every member before it was read whole
                    reason = "truncated_tar" if isinstance(e, EOFError) else "bad_tar"
                    raise TarError(reason, f"compressed shard after the end-of-archive blocks at tar "
                                   f"byte {end}: {e}", after_end=True) from None
                if not header:
                    if identity is not None:
                        identity.finish(end)
                    if at is not None:
                        at[0] = end
                    return
                if not valid_header(header):
                    first = offset + len(header) - len(header.lstrip(b"\0"))
                    raise TarError("bad_tar", f"non-zero bytes at byte {first}, after the end-of-archive "
                                   f"blocks at byte {end}, are not a tar header (a damaged shard, or other "
                                   "data appended to it?)", after_end=True)
                chain = offset  # another archive appended (`cat a.tar b.tar`): read on, as tar -i
            if identity is not None:
                identity.add(header)
            if not _checksum_ok(header, offset):
                raise TarError("bad_tar", f"header checksum mismatch at byte {offset}: not a tar, or corrupt")
            size = _number(header[124:136], offset)
            kind = header[156:157]
            if kind in _META:
                if size > _MAX_META:
                    raise TarError("bad_tar", f"extended header at byte {offset} declares {size} bytes")
            elif after.size is not None:
                size = after.size
            special = _SPECIAL.get(kind) or (_SPARSE if after.sparse and kind in _REGULAR else None)
            extensions = 0  # bytes of GNU sparse map blocks between the header and the member's bytes
            if kind in _NAMED:
                name = after.name if after.name is not None else _header_name(header)
                if kind == b"S":
                    extensions = _sparse_extensions(read, header, offset)
            pad = -size % _BLOCK
            padded = None  # padding bytes present, when read together with the member
            # Members nobody keeps (directories, links, oversized files) are read through, not held.
            if kind in _LINKS:
                present = _skip_member(read, size)
                target = after.link if after.link is not None else _gnu_string(header[157:257])
                data: bytes | TooLarge | Link | Special | memoryview = Link(target)
            elif special is not None:
                present = _skip_member(read, size)
                data = Special(special)
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
                    f"member at byte {offset} declares {size} bytes but the archive ends {present} bytes into it",
                    name,
                )
            if pad and (len(read(pad)) if padded is None else padded) < pad:
                raise TarError("truncated_tar", f"archive ends inside the padding of member at byte {offset}", name)
            if name is not None:
                pending = -1
                if on_member is not None:
                    on_member(name, offset + _BLOCK + extensions)
                if at is not None:
                    at[0] = chain
                offset += _BLOCK + extensions + size + pad
                chain = offset
                after = _NOTHING
                yield name, data
                continue
            if pending < 0 and (kind in _META or kind == b"g"):
                pending, pending_kind = offset, kind
            elif kind not in _META and kind != b"g":
                pending = -1  # a directory entry: the headers were about it
            if kind in _META and after is _NOTHING:
                after = _Next()
            if kind == b"L":
                after.name = _gnu_string(data)  # type: ignore[arg-type]
            elif kind == b"K":
                after.link = _gnu_string(data)  # type: ignore[arg-type]
            elif kind == b"x":
                after.add_pax(bytes(data), offset)  # type: ignore[arg-type]
            elif kind in _SKIPPED:
                after = _NOTHING
            else:
                raise TarError("bad_tar", f"unknown tar member type {kind!r} at byte {offset}")
            offset += _BLOCK + size + pad
    except TarError as e:
        if at is not None:
            at[0] = -1  # no sample's start is known past a failure
        if e.member is None:
            e.member = name  # raised by the stream (a mapped file that changed) inside a member
        raise
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        if at is not None:
            at[0] = -1
        reason = "truncated_tar" if isinstance(e, EOFError) else "bad_tar"
        raise TarError(reason, f"compressed shard at tar byte {offset}: {e}", name) from None
