"""Record files of the journal: each record whole or absent, a torn last write told from corruption.

A record is a 16-byte header (MAGIC, payload length, payload CRC32, CRC32 of those 12 bytes)
and a msgpack payload. The header's own CRC is what lets a reader trust a length that runs
past the end of the file (a torn write) and refuse any other bad byte (corruption).
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from typing import Iterator

import msgpack

log = logging.getLogger("mmdispatch.journal")

MAGIC = b"\x89MJ2"  # its last byte is not 0: no journal before this layout starts with it
HEAD = struct.Struct("<4sIII")  # magic, payload length, payload crc32, crc32 of the 12 bytes before
LEGACY_HEAD = struct.Struct("<II")  # payload length, payload crc32 (journals before MAGIC)


class JournalError(ValueError):
    """The journal cannot be honoured: corrupted, or written for a different configuration."""


class JournalWriteError(OSError):
    """A journal write or fsync failed (disk full, I/O error). Nothing of it was applied and the
    file holds no part of it; the same call may be retried once the cause is gone. `filename`
    is the file, `errno` and `strerror` the operating system's reason."""


class AppendFile:
    """A record file that grows by whole records only: a write or fsync that fails is cut back
    off before it raises JournalWriteError."""

    def __init__(self, path: str, fsync: bool) -> None:
        self.path, self.fsync = path, fsync
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        self.size = os.fstat(self.fd).st_size
        self._cut_owed = False  # a failed cut: the file may be longer than `size`

    def append(self, data: bytes) -> int:
        """Write and fsync `data` at the end; its offset."""
        at = self.size
        try:
            if self._cut_owed:
                self._truncate(at)
            _write_all(self.fd, data)
            if self.fsync:
                os.fsync(self.fd)
        except OSError as e:
            self.cut_back(at)
            raise write_error(e, self.path) from e
        self.size = at + len(data)
        return at

    def cut_back(self, size: int) -> None:
        """Drop everything from `size` on; retried before the next append if it fails now."""
        self.size, self._cut_owed = size, True
        try:
            self._truncate(size)
        except OSError as e:
            log.warning("journal: cannot cut %s back to %d bytes yet (%s)", self.path, size, e)

    def empty(self) -> None:
        try:
            self._truncate(0)
        except OSError as e:
            raise write_error(e, self.path) from e
        self.size = 0

    def _truncate(self, size: int) -> None:
        os.ftruncate(self.fd, size)
        if self.fsync:
            os.fsync(self.fd)
        self._cut_owed = False

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_error(e: OSError, path: str) -> JournalWriteError:
    return JournalWriteError(e.errno, f"journal write failed: {e.strerror or e}", path)


def frame(rec: dict) -> bytes:
    payload = msgpack.packb(rec, use_bin_type=True)
    head = MAGIC + struct.pack("<II", len(payload), zlib.crc32(payload))
    return head + struct.pack("<I", zlib.crc32(head)) + payload


def _decode(payload) -> dict | None:
    try:
        rec = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception:  # msgpack raises several types for bad bytes
        return None
    return rec if isinstance(rec, dict) else None


def read_record(fd: int, offset: int) -> dict | None:
    """The intact record at `offset` (either layout), or None."""
    if os.pread(fd, 4, offset) != MAGIC:
        head = os.pread(fd, LEGACY_HEAD.size, offset)
        if len(head) < LEGACY_HEAD.size:
            return None
        length, crc = LEGACY_HEAD.unpack(head)
        start = offset + LEGACY_HEAD.size
    else:
        head = os.pread(fd, HEAD.size, offset)
        if len(head) < HEAD.size:
            return None
        _, length, crc, head_crc = HEAD.unpack(head)
        if zlib.crc32(head[:12]) != head_crc:
            return None
        start = offset + HEAD.size
    if start + length > os.fstat(fd).st_size:  # a bad length must not allocate gigabytes
        return None
    payload = os.pread(fd, length, start)
    if len(payload) != length or zlib.crc32(payload) != crc:
        return None
    return _decode(payload)


def _corrupt(path: str, at: int, what: str) -> JournalError:
    return JournalError(f"journal {path!r} is corrupted at byte {at} ({what}); it was left as "
                        "it is: restore it from a backup or start a new journal directory")


def scan(data, path: str, start: int = 0) -> Iterator[tuple[int, int, dict]]:
    """(offset, end, record) of each record from `start`; stops at a torn last write (a
    prefix of a record: of its magic, or a checked header whose payload the file cuts short)
    and raises JournalError for anything else that does not check out."""
    at, size = start, len(data)
    while at < size:
        if size - at < HEAD.size:
            if data[at:at + 4] != MAGIC[:size - at]:
                raise _corrupt(path, at, "bytes after the last record that do not start one")
            return
        magic, length, crc, head_crc = HEAD.unpack_from(data, at)
        if magic != MAGIC or zlib.crc32(data[at:at + 12]) != head_crc:
            raise _corrupt(path, at, "record header")
        end = at + HEAD.size + length
        if end > size:
            return
        payload = data[at + HEAD.size:end]
        rec = _decode(payload) if zlib.crc32(payload) == crc else None
        if rec is None:
            raise _corrupt(path, at, "record payload")
        yield at, end, rec
        at = end


def is_legacy(data) -> bool:
    """Whether `data` starts with an intact record of the layout before MAGIC."""
    if len(data) < LEGACY_HEAD.size:
        return False
    length, crc = LEGACY_HEAD.unpack_from(data, 0)
    end = LEGACY_HEAD.size + length
    return end <= len(data) and zlib.crc32(data[LEGACY_HEAD.size:end]) == crc


def legacy_scan(data, path: str) -> Iterator[tuple[int, int, dict]]:
    """Records of a journal from before MAGIC. Its headers carry no check of their own, so a
    bad record is taken for a torn last write only if the file cuts it short and no intact
    record starts anywhere after it."""
    at, size = 0, len(data)
    while at + LEGACY_HEAD.size <= size:
        length, crc = LEGACY_HEAD.unpack_from(data, at)
        end = at + LEGACY_HEAD.size + length
        payload = data[at + LEGACY_HEAD.size:end]
        rec = _decode(payload) if end <= size and zlib.crc32(payload) == crc else None
        if rec is None:
            if end <= size or _legacy_record_after(data, at + 1):
                raise _corrupt(path, at, "record")
            return
        yield at, end, rec
        at = end


def _legacy_record_after(data, start: int) -> bool:
    size = len(data)
    for at in range(start, size - LEGACY_HEAD.size + 1):
        length, crc = LEGACY_HEAD.unpack_from(data, at)
        end = at + LEGACY_HEAD.size + length
        if 0 < length and end <= size and zlib.crc32(data[at + LEGACY_HEAD.size:end]) == crc \
                and "kind" in (_decode(data[at + LEGACY_HEAD.size:end]) or {}):
            return True
    return False
