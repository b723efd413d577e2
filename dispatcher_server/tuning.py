"""Process tuning for the service processes (dispatcher, readers): heap reuse and garbage collection.

Separate from the wire protocol: these change how a process allocates, not what it says.
A trainer's allocator and GC belong to the training job: its client calls only
`keep_freed_memory`, and only when asked (`ClientConfig.malloc_keep_mb`, off by default).
"""

from __future__ import annotations

import os
import threading
import time


def _libc():
    """glibc through ctypes, or None (another C library, or no ctypes)."""
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True)
    except (OSError, AttributeError):
        return None


def end_with_parent(parent: int, sig: int) -> bool:
    """Have the kernel send `sig` to this process when `parent` dies, SIGKILL included (Linux
    prctl PR_SET_PDEATHSIG); sent at once if it died already. Whether it applied."""
    libc = _libc()
    if libc is None or libc.prctl(1, sig) != 0:  # 1 = PR_SET_PDEATHSIG (linux/prctl.h)
        return False
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)
    return True


def keep_freed_memory(threshold_mb: int) -> bool:
    """Let glibc reuse freed blocks below `threshold_mb` instead of mapping fresh pages each time.

    Coalesced payload frames are MBs each; by default glibc serves them with mmap and unmaps
    them on free, so every frame pays page faults on first write (measured: most of the
    dispatcher's copy and free time). With a fixed mmap threshold and trim threshold the heap
    keeps the pages: RSS stays at the working-set peak, which credits already bound. A trainer
    asks for it for the opposite reason: a small threshold hands each larger decoded tensor back
    to the kernel on free, so a long run's RSS stops creeping, at the price of those page
    faults. Returns whether it applied (glibc only; 0 turns it off).
    """
    libc = _libc()
    if threshold_mb <= 0 or libc is None:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, threshold_mb << 20)
                and libc.mallopt(m_trim_threshold, 2 * threshold_mb << 20))


def relax_gc(young_threshold: int = 50_000) -> None:
    """Collect garbage less often in a service process (dispatcher, reader).

    Their hot loops allocate many short-lived acyclic objects (message headers, per-sample
    lists), which the default young-generation threshold of 700 turns into thousands of
    collections per second, each also walking everything buffered. Freezing what start-up
    created and raising the threshold keeps cycles collected while cutting that work (measured:
    ~10-15% of the dispatcher's non-planning CPU). Not for trainer processes: their GC is theirs.
    """
    import gc

    gc.freeze()
    _, second, third = gc.get_threshold()
    gc.set_threshold(young_threshold, second, third)


def collect_on_a_clock(every_s: float = 30.0) -> threading.Thread:
    """The dispatcher's garbage collection: a full collection every `every_s` seconds (default
    30) from a daemon thread, none triggered by allocation counts.

    The dispatcher holds every buffered and retained sample as Python objects (about a million
    at 2,560 ranks); each step adds and frees a step's worth. Collections by allocation count
    walk those survivors again and again: 40-50 ms of CPU a step at W=2560 (measured with gc
    callbacks in bench.scale), for data that is freed by reference counting anyway. On a clock
    a full collection costs ~0.3 s every 30 s there (~1-2% of its CPU), and cyclic garbage
    (error paths, tracebacks) lives at most `every_s`. Not for trainers or readers.
    """
    import gc

    if every_s <= 0:
        raise ValueError(f"garbage collection interval must be > 0 seconds, got {every_s}")
    gc.freeze()  # what start-up built is never walked again
    gc.disable()

    def run() -> None:
        while True:
            time.sleep(every_s)
            gc.collect()

    thread = threading.Thread(target=run, name="mmdispatch-gc", daemon=True)
    thread.start()
    return thread
