"""Keep glibc's malloc from handing big buffers back to the kernel after every use.

A served request allocates and frees several buffers of hundreds of kilobytes (a decoded image,
its resized and normalized copies, a step's activations). glibc serves each from a fresh mmap
and unmaps it on free, so the next request faults every page in again, each fault a trip into
the kernel (measured in docs/benchmarks.md). With the thresholds below such buffers come from the
heap and stay there for reuse; freed memory returns to the kernel once more than ``TRIM_BYTES``
of it sits at the heap's top. Other C libraries have no ``mallopt``: nothing changes there.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

MMAP_THRESHOLD_BYTES = (
    4 << 20
)  # allocations below this come from the heap (larger ones, e.g. a KV cache, stay lazily mapped)
TRIM_BYTES = 64 << 20  # free memory at the heap's top kept before it goes back to the kernel
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def keep_freed_memory() -> bool:
    """Set the thresholds for this process; True where the C library took them (glibc)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_BYTES))
    if not ok:
        log.debug("mallopt refused the allocator thresholds")
    return ok
