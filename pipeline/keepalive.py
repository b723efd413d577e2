"""A hook that long header walks call, so that a reader's session heartbeats through them.

A local shard is counted in the reader's session thread (`pipeline.readahead`). A clip whose
header alone takes seconds to walk (every packet of a 4-hour MKV, every frame of a long MP3)
held its heartbeats back past the dispatcher's liveness timeout: the dispatcher dropped a healthy
reader and, after three such losses, abandoned a good sample. The session installs its
heartbeat for its own thread; walks call `alive()` every few thousand steps. Other threads
(read-ahead threads, `inspect`) have no hook installed and pay one attribute lookup.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

_local = threading.local()

#: Steps of a walk between two calls of `alive` (a mask: every 4096th).
EVERY = 4095


def install(beat: Callable[[], None] | None) -> None:
    """Call `beat` from `alive()` in this thread (None: no more)."""
    _local.beat = beat


def alive() -> None:
    """A long walk in this thread goes on: the hook installed here, if any, may heartbeat."""
    beat = getattr(_local, "beat", None)
    if beat is not None:
        beat()
