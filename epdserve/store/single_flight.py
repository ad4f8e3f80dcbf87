"""One computation per item across encoders, through the store.

``fetch_or_claim`` answers an item's entry if the store has it, or a claim to compute it: when
another encoder holds the claim, it waits for that encoder's entry, and takes the claim over when
it lapses without one (that encoder died or failed). ``holding`` keeps a won claim alive while the
caller computes and gives it back when the caller is done, whatever happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from epdserve.store.base import Claim, EmbeddingStore
from epdserve.store.record import StoredItem

POLL_S = 0.02


async def fetch_or_claim(store: EmbeddingStore, uuid: str, wait_s: float, missed: bool = False) -> StoredItem | Claim:
    """The entry of ``uuid``, or a claim to compute it; ``missed``: the caller has just looked for
    the entry and found none (the first look is skipped)."""
    deadline = time.monotonic() + wait_s
    waited = False
    while True:
        item = None if missed else await store.get(uuid)
        missed = False
        if item is not None:
            return item
        claim = await store.claim(uuid)
        if claim.won:
            if claim.token:  # its holder may have written the entry and let go since our miss
                item = await store.get(uuid)
                if item is not None:
                    await store.unclaim(uuid, claim)
                    return item
            if waited:
                store.stats.takeovers += 1
            return claim
        if not waited:
            store.stats.waits += 1
            waited = True
        while await store.claimed(uuid):  # someone is computing it: wait for the entry
            if time.monotonic() > deadline:
                return Claim(True)  # waited long enough: compute alone, coordinated with nobody
            await asyncio.sleep(POLL_S)
            item = await store.get(uuid)
            if item is not None:
                return item
        # the claim is gone: its entry is in the store now, or its holder gave up or died


@contextlib.asynccontextmanager
async def holding(store: EmbeddingStore, uuid: str, claim: Claim, renew_s: float) -> AsyncIterator[None]:
    """Renew ``claim`` every ``renew_s`` while the body runs; release it afterwards."""

    async def renew() -> None:
        while True:
            await asyncio.sleep(renew_s)
            await store.renew(uuid, claim)

    task = asyncio.create_task(renew()) if claim.token else None
    try:
        yield
    finally:
        if task is not None:
            task.cancel()
        await store.unclaim(uuid, claim)
