"""Whole-file writes that a crash cannot tear: the old file or the new one, never half."""

from __future__ import annotations

import os


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
