"""Media a role holds until its vision tower has run over them, bounded in bytes.

Pixels are the largest thing a request makes a role hold, and the cheapest for a client to make:
a 10 KB PNG of one colour becomes a float32 patch tensor of 70 MB at a 4,000-token image, held
until the tower reaches it, behind everything queued before it. Counting requests or items does not
bound that. A role takes the bytes of each item before it holds it, and gives them back once the
tower has run over it (or the item is dropped). An item that would take the role past its bound is
refused, and its request gets 429 with Retry-After: a burst of large images waits at its clients
instead of growing the role past its memory account. With nothing held, any one item is let
through, so the largest item the processor allows is always served; a request without pixels
(text, embeddings) takes nothing and is never refused.

    take(n) ──► held + n ≤ bound, nothing held, or n = 0 ──► Pending (n counted) ──► release()
            └─► otherwise: PendingFull (nothing counted)      (``common.byte_bound``)

An item is counted from before its pixels are decoded: a ``Reservation`` takes what decoding and
preprocessing it will hold at most (its decoded frames, their resized copies and its patches), from
the preprocessing thread as soon as the item's header gives its size, and is settled to the
patches once they are made. So items in preprocessing are within the bound too, however many
threads preprocess, and an item past it is refused before any of its pixels are decoded.
Thread-safe.
"""

from __future__ import annotations

import threading

from epdserve.common.byte_bound import BoundFull, ByteBound, Held

PENDING_MEDIA_BYTES = 512 << 20  # the default bound of the media a role holds for its tower

Pending = Held  # one item's (or one request's) bytes in a ``PendingMedia``


class PendingFull(BoundFull):
    """Holding one more item would take the role past its bound; the caller should retry later."""


class PendingMedia(ByteBound):
    """The bytes of media a role holds for its vision tower, and their bound."""

    Full = PendingFull

    def __init__(self, limit: int) -> None:
        super().__init__(limit, "media already wait for the vision tower")


class ReservationClosed(RuntimeError):
    """A take for a reservation already settled or closed: its request is gone or done."""


class Reservation:
    """What one item's or one request's media may hold while it is preprocessed, taken from the
    preprocessing threads (``take``, once per item, as soon as its size is known) and then settled
    to the patches it holds for the tower. ``close`` gives back whatever it holds; a take after it
    (a thread still preprocessing for a request that was abandoned) raises ``ReservationClosed``."""

    def __init__(self, pending: PendingMedia) -> None:
        self._pending = pending
        self._taken: list[Pending] = []
        self._closed = False
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> None:
        """Hold ``nbytes`` more until ``settle`` or ``close``; PendingFull past the bound."""
        with self._lock:
            if self._closed:
                raise ReservationClosed("the media's request is no longer preprocessed")
            self._taken.append(self._pending.take(nbytes))

    def settle(self, nbytes: int) -> Pending:
        """Hold ``nbytes`` (the patches made) in place of what was taken, counted whatever is held
        now: they were within the bound already. Nothing taken (the size was not known before the
        patches were made): an ordinary take, refused past the bound."""
        taken = self._end()
        if not taken:
            return self._pending.take(nbytes)
        held = self._pending.take(nbytes, bounded=False)
        for t in taken:
            t.release()
        return held

    def close(self) -> None:
        for t in self._end():
            t.release()

    def _end(self) -> list[Pending]:
        """Take no more; what was taken, for the caller to give back."""
        with self._lock:
            self._closed = True
            taken, self._taken = self._taken, []
        return taken
