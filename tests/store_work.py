"""What an encoder does with a shared store on a miss, for the store tests of every backend: read
the entry, or claim the item, "compute" it under the renewed claim and write it."""

from __future__ import annotations

import asyncio

import torch

from epdserve.store.base import EmbeddingStore
from epdserve.store.record import StoredItem
from epdserve.store.single_flight import fetch_or_claim, holding


async def encoder_request(store: EmbeddingStore, uuid: str, computed: list[str], result: torch.Tensor) -> torch.Tensor:
    """The embeddings of ``uuid``: from the store, or computed here (``result``, after a 0.3 s
    stand-in for a vision forward; ``uuid`` is appended to ``computed``)."""
    got = await fetch_or_claim(store, uuid, wait_s=10)
    if isinstance(got, StoredItem):
        return got.embeddings
    async with holding(store, uuid, got, renew_s=0.1):
        computed.append(uuid)
        await asyncio.sleep(0.3)
        await store.put(uuid, (1, 4, 4), result)
    return result
