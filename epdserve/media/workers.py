"""How many threads a role gives media work (decoding, resizing, normalizing) by default.

One per core the role's process may run on, less the cores its engine core computes on when they
are among them: more threads than free cores only interleave a burst's images — each then
finishes later than it would in turn — and take the GIL from the event loop and the model
between their C calls (docs/benchmarks.md, "Kernels and step times").
"""

from __future__ import annotations

import os
from collections.abc import Collection


def media_threads(configured: int, engine_cores: Collection[int] = (), engine_threads: int = 0) -> int:
    """``configured`` when set (> 0); else the free cores of this process (at least one).

    ``engine_cores``: where a worker's engine core is pinned (empty: unpinned, it may run anywhere);
    ``engine_threads``: its compute threads (0: no engine beside this process, as an encoder)."""
    if configured:
        return configured
    mine = os.sched_getaffinity(0)
    taken = len(mine & set(engine_cores)) if engine_cores else engine_threads
    return max(1, len(mine) - taken)
