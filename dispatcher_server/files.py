"""Whole-file writes that a crash cannot tear: the old file or the new one, never half."""

from __future__ import annotations

import errno
import os
import stat


def replace_file(path: str, data: bytes, *, durable: bool = True) -> None:
    """Write `data` as `path`: into a temporary file beside it, renamed over `path`. `durable`
    syncs the file before the rename and its directory after, so the new one survives a
    power loss once this returns. A write that fails leaves no temporary file behind."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass  # never created, or already renamed
        raise
    if durable:
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class NotRegularFile(OSError):
    """A path that is there but is not a regular file (`check_regular_file`)."""


def check_regular_file(path: str) -> None:
    """NotRegularFile naming `path` where it is there but not a regular file (a directory is
    refused by open() without its name, and opening a FIFO blocks until something writes to
    it); OSError where it cannot be looked at (a loop of links)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return  # missing (or a dangling link): each file's absence is judged where it is read
    if not stat.S_ISREG(mode):
        kind = ("a directory" if stat.S_ISDIR(mode) else "a named pipe" if stat.S_ISFIFO(mode)
                else "a socket" if stat.S_ISSOCK(mode) else "a device")
        raise NotRegularFile(errno.EINVAL, f"{kind}, not a regular file", path)
