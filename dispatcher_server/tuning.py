"""Process tuning for the service processes (dispatcher, readers): heap reuse and GC thresholds.

Separate from the wire protocol: these change how a process allocates, not what it says.
Trainer processes never call them; their allocator and GC belong to the training job.
"""

from __future__ import annotations


def keep_freed_memory(threshold_mb: int) -> bool:
    """Let glibc reuse freed blocks below `threshold_mb` instead of mapping fresh pages each time.

    Coalesced payload frames are MBs each; by default glibc serves them with mmap and unmaps
    them on free, so every frame pays page faults on first write (measured: most of the
    dispatcher's copy and free time). With a fixed mmap threshold and trim threshold the heap
    keeps the pages: RSS stays at the working-set peak, which credits already bound. Returns
    whether it applied (glibc only; 0 turns it off).
    """
    if threshold_mb <= 0:
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, threshold_mb << 20)
                    and libc.mallopt(m_trim_threshold, 2 * threshold_mb << 20))
    except (OSError, AttributeError):
        return False


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

