"""The planner's compiled kernels: numba, compiled on first use and cached on disk by numba.

A kernel is a planner loop whose work per element is a few arithmetic operations: as whole-array
numpy each step of it costs a dozen passes over arrays that are mostly not touched, and as plain
Python every element costs an interpreter round. Each kernel exists once, compiled; the Python
around it stays numpy. Kernels take and update numpy arrays only (int64 indices, float64 sizes)
and are pure like the rest of the planner: numba's on-disk cache is numba's, next to the source
or, where that is read-only, under the user's cache directory.

numba (and LLVM under it: ~110 MB of RSS, ~0.4 s) is imported on a kernel's first call, not on
import: trainers import the planner's types and never plan, so they never load it. The first call
of each kernel in a process loads its machine code from the cache, or compiles it (~2-3 s each)
on a machine that has not run it yet; `warm_up` does that before a service starts serving.
"""

from __future__ import annotations

import functools
from collections.abc import Callable


class _Kernel:
    """A kernel before its first call: then it compiles `fn` (and first every kernel that `fn`
    calls, so that numba sees compiled callees) and puts the compiled function in its place in
    the module."""

    def __init__(self, fn: Callable) -> None:
        functools.update_wrapper(self, fn)
        self.py_func = fn
        self._compiled: Callable | None = None

    def compiled(self) -> Callable:
        if self._compiled is None:
            import numba

            g = self.py_func.__globals__
            for name in self.py_func.__code__.co_names:
                if isinstance(g.get(name), _Kernel):
                    g[name] = g[name].compiled()
            try:
                self._compiled = numba.njit(cache=True, nogil=True)(self.py_func)
            except RuntimeError:  # no cache location (a read-only install, no home directory)
                self._compiled = numba.njit(nogil=True)(self.py_func)
            if g.get(self.py_func.__name__) is self:
                g[self.py_func.__name__] = self._compiled
        return self._compiled

    def __call__(self, *args):
        return self.compiled()(*args)


_KERNELS: list[_Kernel] = []


def kernel(fn: Callable) -> Callable:
    """`fn` as a kernel: compiled in nopython mode on its first call, releasing the GIL, cached
    across processes where numba finds a writable cache location (else compiled per process)."""
    k = _Kernel(fn)
    _KERNELS.append(k)
    return k


def not_run() -> list[str]:
    """The kernels no call in this process has reached yet, from Python or from another kernel
    (module.name): `warm_up` leaves none."""
    return [f"{k.py_func.__module__}.{k.__name__}" for k in _KERNELS if k._compiled is None]
