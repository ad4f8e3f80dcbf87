"""Who owns a slab or file a producer left behind: the liveness test behind stale-resource
cleanup at producer start."""

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
