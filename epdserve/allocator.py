"""Keep glibc's malloc from handing big buffers back to the kernel after every use, and give
what it keeps back now and then.

A served request allocates and frees several buffers of hundreds of kilobytes (a decoded image,
its resized and normalized copies, a step's activations). glibc serves each from a fresh mmap
and unmaps it on free, so the next request faults every page in again, each fault a trip into
the kernel (measured in docs/benchmarks.md). With the thresholds below such buffers come from the
heap and stay there for reuse; freed memory returns to the kernel once more than ``TRIM_BYTES``
of it sits at the heap's top. Other C libraries have no ``mallopt``: nothing changes there.

Kept memory is also what makes a server's resident size creep: requests of many sizes leave free
chunks all over the heaps (one per thread that allocates), the heaps grow around them, and the
pages of those free chunks stay resident. A role server therefore returns the free pages of every
heap every ``RETURN_INTERVAL_S`` (``FreeMemoryReturner``, glibc's ``malloc_trim``): its memory
then follows what it holds, and a buffer reused within the interval still faults no page.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

# allocations below this come from the heap (larger ones, e.g. a KV cache, stay lazily mapped):
# glibc's largest, so that the activations of a real-size model's step are reused, not faulted in
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_BYTES = 64 << 20  # free memory at the heap's top kept before it goes back to the kernel
RETURN_INTERVAL_S = 10.0  # how often a role server gives free heap pages back to the kernel
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_PR_SET_NAME = 15  # prctl: name the calling thread (Linux)


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"))
    except (OSError, TypeError):
        return None


def keep_freed_memory() -> bool:
    """Set the thresholds for this process; True where the C library took them (glibc)."""
    try:
        mallopt = _libc().mallopt  # type: ignore[union-attr]
    except AttributeError:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_BYTES))
    if not ok:
        log.debug("mallopt refused the allocator thresholds")
    return ok


class FreeMemoryReturner:
    """A daemon thread that gives the free pages of every malloc heap back to the kernel every
    ``interval_s`` (glibc's ``malloc_trim(0)``, which takes each heap's lock in turn: other
    threads wait only for the heap they share with it)."""

    def __init__(self, interval_s: float = RETURN_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.returns = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        """Start returning; False where the C library has no ``malloc_trim`` (nothing runs)."""
        try:
            trim = _libc().malloc_trim  # type: ignore[union-attr]
        except AttributeError:
            return False
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
        self._thread = threading.Thread(target=self._run, args=(trim,), name="epd-free-memory", daemon=True)
        self._thread.start()
        return True

    def _run(self, trim: Callable[[int], int]) -> None:
        libc = _libc()
        if libc is not None and hasattr(libc, "prctl"):  # the thread's name where tools see it (top -H, /proc)
            libc.prctl(_PR_SET_NAME, ctypes.c_char_p(b"epd-free-memory"), 0, 0, 0)
        while not self._stop.wait(self.interval_s):
            trim(0)
            self.returns += 1

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
