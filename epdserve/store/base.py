"""The shared embedding store: one interface, several backends (``redis_store``).

Encoders read through it on a local cache miss (an item another encoder computed is not computed
again) and write what they compute into it. ``claim`` coordinates concurrent misses: of all the
encoders that miss on one item at once, one computes it and the others wait for its entry; a claim
lapses unless its holder renews it, so the death of that encoder costs the waiters one claim TTL,
never the request.

A store that is down, slow or returns garbage is never a request's failure: every method answers
a miss (``get`` → None, ``claim`` → go ahead alone) within the configured timeout, and the
backend stops asking for a while after a failure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from epdserve.store.record import Grid, StoredItem
from epdserve.transfer.header import WireHeader


@dataclass(frozen=True)
class Claim:
    """The answer to ``claim``: compute the item (``won``) or wait for whoever holds it."""

    won: bool
    token: str = ""  # the holder's token ("" when the store could not be asked: compute alone)


@dataclass
class StoreStats:
    hits: int = 0  # entries found and valid
    misses: int = 0  # not found
    rejected: int = 0  # found but failed validation (and deleted)
    writes: int = 0  # entries written
    errors: int = 0  # operations that failed or timed out
    skipped: int = 0  # operations not tried because the store failed recently
    waits: int = 0  # items another encoder was computing when this one needed them
    takeovers: int = 0  # claims taken after the previous holder's lapsed without an entry


class EmbeddingStore(Protocol):
    stats: StoreStats

    async def get(self, uuid: str, rows: int | None = None) -> StoredItem | None:
        """The entry of ``uuid`` if present and valid (``rows``: the row count it must have; by
        default the one the model gives its grid)."""
        ...

    async def put(self, uuid: str, grid_thw: Grid, embeddings: torch.Tensor) -> WireHeader | None:
        """Write an entry; its wire header when written, None when not (too large, store down)."""
        ...

    async def claim(self, uuid: str) -> Claim: ...

    async def renew(self, uuid: str, claim: Claim) -> None: ...

    async def unclaim(self, uuid: str, claim: Claim) -> None: ...

    async def present(self, uuid: str) -> bool:
        """Whether the store holds an entry for ``uuid`` (False when the store cannot say)."""
        ...

    async def claimed(self, uuid: str) -> bool:
        """Whether someone holds a live claim on ``uuid`` (False when the store cannot say)."""
        ...

    @property
    def available(self) -> bool:
        """False while the store is being skipped after a failure."""
        ...

    async def close(self) -> None: ...
