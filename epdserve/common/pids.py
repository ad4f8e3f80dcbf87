"""Whether a process is alive on this host: behind the cleanup of what a dead producer left
behind (slabs, files) and the core board's reclaiming of a killed role's slot."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (a zombie counts as alive)."""
    if pid <= 0:
        # kill(0) and kill(-n) address process groups, never a single owner
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    return True
