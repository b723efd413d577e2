"""The planner's compiled kernels: numba, compiled on first use and cached on disk by numba.

A kernel is a planner loop whose work per element is a few arithmetic operations: as whole-array
numpy each step of it costs a dozen passes over arrays that are mostly not touched, and as plain
Python every element costs an interpreter round. Each kernel exists once, compiled; the Python
around it stays numpy. Kernels take and update numpy arrays only (int64 indices, float64 sizes)
and are pure like the rest of the planner: numba's on-disk cache is numba's, next to the source
or, where that is read-only, under the user's cache directory.
"""

from __future__ import annotations

from collections.abc import Callable

import numba


def kernel(fn: Callable) -> Callable:
    """`fn` compiled in nopython mode, releasing the GIL, cached across processes where numba
    finds a writable cache location (else compiled once per process)."""
    try:
        return numba.njit(cache=True, nogil=True)(fn)
    except RuntimeError:  # no cache location (e.g. a read-only install and no home directory)
        return numba.njit(nogil=True)(fn)
