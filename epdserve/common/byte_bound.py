"""A bound in bytes on what a role holds at once: holders take their bytes before they hold them
and give them back when done; a take past the bound is refused, except when nothing is held (one
holder is always let through, however large). A holder whose bytes arrive a piece at a time
grows its count as they do, under the same rule (no one else holding lets it through). Thread-safe.

    take(n) ──► held + n ≤ bound, nothing held, or n = 0 ──► Held (n counted) ──► release()
            └─► otherwise: ``Full`` (nothing counted)            └─► grow(m): the same rule
"""

from __future__ import annotations

import threading
from types import TracebackType
from typing import ClassVar

from epdserve.common.units import format_bytes

MAX_INFLIGHT_BODY_BYTES = 256 << 20  # the default bound of a role's request bodies, their copies counted (api.bodies)


class BoundFull(RuntimeError):
    """Holding more would take the role past its bound; the caller should retry later."""


class ByteBound:
    """The bytes a role holds of one kind, and their bound; ``what`` names them in a refusal."""

    Full: ClassVar[type[BoundFull]] = BoundFull  # what a refused take raises

    def __init__(self, limit: int, what: str) -> None:
        if limit < 1:
            raise ValueError(f"a bound in bytes must be at least 1, got {limit}")
        self.limit = limit
        self.what = what
        self.held = 0  # bytes counted now
        self.refused = 0  # takes refused so far
        self._lock = threading.Lock()

    def take(self, nbytes: int, bounded: bool = True) -> Held:
        """Count ``nbytes`` until the returned ``Held`` is released; ``Full`` past the bound
        (``bounded=False``: counted whatever is held)."""
        held = Held(self, 0)
        self._count(held, nbytes, bounded)
        return held

    def _count(self, holder: Held, nbytes: int, bounded: bool) -> None:
        """Count ``nbytes`` more for ``holder``; ``Full`` past the bound while others hold bytes."""
        if nbytes < 0:
            raise ValueError(f"cannot hold {nbytes} bytes")
        with self._lock:
            others = self.held - holder.nbytes
            if bounded and nbytes and others and self.held + nbytes > self.limit:
                self.refused += 1
                raise self.Full(f"{format_bytes(self.held)} of {self.what} (at most {format_bytes(self.limit)})")
            self.held += nbytes
            holder.nbytes += nbytes

    def _give(self, nbytes: int) -> None:
        with self._lock:
            self.held -= nbytes


class Held:
    """One holder's bytes in a ``ByteBound``; released once, then inert."""

    def __init__(self, owner: ByteBound, nbytes: int) -> None:
        self._owner: ByteBound | None = owner
        self.nbytes = nbytes

    def grow(self, nbytes: int) -> None:
        """Hold ``nbytes`` more (bytes that have arrived since); ``Full`` past the bound while
        others hold bytes (what this holder held stays counted until it is released)."""
        if self._owner is None:
            raise ValueError("a released holder cannot grow")
        self._owner._count(self, nbytes, True)

    def release(self) -> None:
        owner, self._owner = self._owner, None
        if owner is not None:
            owner._give(self.nbytes)

    def __enter__(self) -> Held:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.release()
