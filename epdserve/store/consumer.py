"""Reading store handles on a language-model instance: the entry a handle names, fetched from the
shared store and held to the handle's header (which an encoder of this cluster signed) before use.

A store handle carries no lease: the entry lives as long as the store keeps it. When it is gone
(evicted, expired, the store down) ``get`` raises TransferError, the request is answered 503
``embeddings_unavailable`` and the router encodes the item afresh: a race costs an encode, never
a wrong answer.
"""

from __future__ import annotations

import torch

from epdserve.store.base import EmbeddingStore
from epdserve.store.factory import open_store
from epdserve.store.record import STORE_PURPOSE, EntryCheck
from epdserve.transfer.base import Handle, TransferError
from epdserve.transfer.config import ECConfig
from epdserve.transfer.header import check_same, from_handle, validate


class StoreConsumer:
    def __init__(self, cfg: ECConfig) -> None:
        self._cfg = cfg
        self._stores: dict[tuple[str, int, int], EmbeddingStore] = {}

    def _store(self, model_id: str, width: int, levels: int) -> EmbeddingStore:
        if not self._cfg.store.enabled:
            raise TransferError("this instance has no shared embedding store (--store-url)")
        store = self._stores.get((model_id, width, levels))
        if store is None:
            key = self._cfg.key(STORE_PURPOSE)
            check = EntryCheck(model_id, key, width, dtypes=self._cfg.dtypes, levels=levels)
            store = self._stores[(model_id, width, levels)] = open_store(self._cfg.store, check)
        return store

    async def get(self, handle: Handle, rows: int, width: int, model_id: str, levels: int = 1) -> torch.Tensor:
        header = from_handle(handle)
        validate(header, rows, width, model_id, self._cfg.dtypes, levels)
        item = await self._store(model_id, width, levels).get(header.key, rows=rows)
        if item is None:
            raise TransferError("the embeddings are no longer in the shared store")
        check_same(header, item.header, "the shared store")
        return item.embeddings

    async def release(self, handle: Handle) -> None:
        """Nothing to give back: a store handle is not a lease."""

    async def close(self) -> None:
        stores, self._stores = list(self._stores.values()), {}
        for store in stores:
            await store.close()
