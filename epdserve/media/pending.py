"""Preprocessed media a role holds until its vision tower has run over them, bounded in bytes.

Pixels are the largest thing a request makes a role hold, and the cheapest for a client to make:
a 10 KB PNG of one colour becomes a float32 patch tensor of 70 MB at a 4,000-token image, held
until the tower reaches it, behind everything queued before it. Counting requests or items does not
bound that. A role takes the bytes of each item it has preprocessed before it holds it, and gives
them back once the tower has run over it (or the item is dropped). An item that would take the
role past its bound is refused, and its request gets 429 with Retry-After: a burst of large images
waits at its clients instead of growing the role past its memory account. With nothing held, any
one item is let through, so the largest item the processor allows is always served; a request
without pixels (text, embeddings) takes nothing and is never refused.

    take(n) ──► held + n ≤ bound, nothing held, or n = 0 ──► Pending (n counted) ──► release()
            └─► otherwise: PendingFull (nothing counted)

Used from one event loop: ``take`` and ``release`` are not thread-safe.
"""

from __future__ import annotations

from types import TracebackType

from epdserve.common.units import format_bytes

PENDING_MEDIA_BYTES = 512 << 20  # the default bound of a role's preprocessed media awaiting its tower


class PendingFull(RuntimeError):
    """Holding one more item would take the role past its bound; the caller should retry later."""


class PendingMedia:
    """The bytes of preprocessed media a role holds for its vision tower, and their bound."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"the bound of pending media must be at least 1 byte, got {limit}")
        self.limit = limit
        self.held = 0  # bytes counted now
        self.refused = 0  # takes refused so far

    def take(self, nbytes: int) -> Pending:
        """Count ``nbytes`` until the returned ``Pending`` is released; PendingFull past the bound."""
        if nbytes < 0:
            raise ValueError(f"cannot hold {nbytes} bytes")
        if nbytes and self.held and self.held + nbytes > self.limit:
            self.refused += 1
            raise PendingFull(
                f"{format_bytes(self.held)} of preprocessed media already wait for the vision tower "
                f"(at most {format_bytes(self.limit)})"
            )
        self.held += nbytes
        return Pending(self, nbytes)


class Pending:
    """One item's (or one request's) bytes in a ``PendingMedia``; released once, then inert."""

    def __init__(self, owner: PendingMedia, nbytes: int) -> None:
        self._owner: PendingMedia | None = owner
        self.nbytes = nbytes

    def release(self) -> None:
        if self._owner is not None:
            self._owner.held -= self.nbytes
            self._owner = None

    def __enter__(self) -> Pending:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.release()
