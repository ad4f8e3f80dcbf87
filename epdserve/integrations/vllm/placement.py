"""Where a pinned vLLM instance runs: its engine (the engine core and the model worker it starts)
on the cores ``up`` plans for a language-model worker's engine, its HTTP front end (the API
server: parsing, multimodal preprocessing, detokenization, streaming) on the cores the plan gives
workers' front ends, beside the encoders, as epdserve's own workers are placed.

vLLM starts its engine core from the API server's process, and a child keeps its parent's cores,
so all of vLLM starts on the engine's cores and only the API server's process moves, once
/health answers: by then the engine core has started and stays where it is. Only the process the
wrapper started moves; with several API servers (``--api-server-count``) they are children of it
and stay with the engine. vLLM- and torch-free: the wrapper imports it.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from epdserve.engine.config import cpu_list
from epdserve.launcher import wait_healthy

PASSES = 3  # a thread started while we move the others keeps its creator's cores: look again


def front_end_cpus(spec: str) -> list[int]:
    """The wrapper's ``--front-end-cpus``: a core list as ``--engine-cpus`` takes it, not empty."""
    cpus = list(cpu_list(spec))
    if not cpus:
        raise ValueError("an empty core list")
    return cpus


def move_process(pid: int, cpus: Sequence[int]) -> int:
    """Put every thread of ``pid`` on ``cpus``; how many threads are there now (0: it is gone).
    OSError when the kernel refuses the cores (none of them allowed here)."""
    for _ in range(PASSES):
        try:
            tids = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
        except OSError:
            return 0
        moved = 0
        for tid in tids:
            try:
                if set(os.sched_getaffinity(tid)) != set(cpus):
                    os.sched_setaffinity(tid, cpus)
                    moved += 1
            except ProcessLookupError:
                continue  # the thread ended meanwhile
        if not moved:
            return len(tids)
    return len(tids)


def front_end_to(
    child: subprocess.Popen, cpus: Sequence[int], url: str, timeout: float, say: Callable[[str], None]
) -> None:
    """Once vLLM (``child``, the API server) answers /health at ``url``, move it to ``cpus``, and
    say so in one line. A vLLM that never comes up is left where it is, to the supervisor."""
    try:
        wait_healthy(url, child, timeout)
        threads = move_process(child.pid, cpus)
    except (RuntimeError, TimeoutError):
        return  # it exited or never answered: the role fails its start, as without us
    except OSError as e:
        say(f"front end stays on the engine's cores: {e}")
        return
    if threads:
        say(f"front end (pid {child.pid}, {threads} threads) on cores {','.join(map(str, cpus))}")
