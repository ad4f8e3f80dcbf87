"""Splitting one compiled call over torch's intra-op threads.

Most compiled kernels split a large call themselves, over the process's OpenMP threads (torch's
own), given a thread count from ``Workers.threads``. The AMX tile matmul runs single-threaded
and is called through ctypes, which lets go of the interpreter for the call: a large call is cut
into shares (output columns), the calling thread runs the first and a small pool the others.
Either way every share is computed exactly as in one call, so the result does not depend on the
split or the thread count.

``threads_for`` is how many threads a model's engine or tower gets when the operator leaves it to
the server: every core the process may run on where its weights are large enough to split (reading
such a weight is most of a step's work, at any row count), else one.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

# a weight of this many elements is worth reading on several threads at once, whatever the rows
PARALLEL_WEIGHT = 1 << 20


def threads_for(model: torch.nn.Module, cores: int | None = None) -> int:
    """Intra-op threads for ``model``: ``cores`` (default: the cores this process may run on) when
    a weight outside its embedding tables has ``PARALLEL_WEIGHT`` elements or more, else one (the
    products of a small model cost less than handing their shares to other threads)."""
    if cores is None:
        cores = affinity_cores()
    tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    large = any(p.numel() >= PARALLEL_WEIGHT and id(p) not in tables for p in model.parameters())
    return max(1, cores) if large else 1


def affinity_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def shares(n: int, parts: int, align: int) -> list[tuple[int, int]]:
    """``[start, end)`` spans covering ``range(n)`` for up to ``parts`` threads, each start a
    multiple of ``align`` (the last span takes the ragged end)."""
    blocks = -(-n // align)
    parts = max(1, min(parts, blocks))
    bounds = [min(n, blocks * i // parts * align) for i in range(parts + 1)]
    return [(a, b) for a, b in itertools.pairwise(bounds) if a < b]


class Workers:
    """Runs the shares of one call over up to ``torch.get_num_threads()`` threads."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._pool: ThreadPoolExecutor | None = None
        self._size = 0

    @staticmethod
    def threads(work: int, least: int) -> int:
        """Threads for a call of ``work`` units: one below ``least`` (handing shares to other
        threads would cost more than it saves), else torch's intra-op thread count."""
        return torch.get_num_threads() if work >= least else 1

    def run(self, fn: Callable[[int, int], None], spans: list[tuple[int, int]]) -> None:
        """``fn(start, end)`` for every span: the first on this thread, the others on the pool."""
        if len(spans) <= 1:
            for a, b in spans:
                fn(a, b)
            return
        pool = self._executor(len(spans) - 1)
        futures = [pool.submit(fn, a, b) for a, b in spans[1:]]
        fn(*spans[0])
        for f in futures:
            f.result()

    def _executor(self, workers: int) -> ThreadPoolExecutor:
        if self._pool is None or self._size < workers:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self._pool, self._size = ThreadPoolExecutor(workers, thread_name_prefix=self._prefix), workers
        return self._pool
