"""The store backend a ``StoreConfig`` names (by its url's scheme), imported only when used: each is
an optional extra."""

from __future__ import annotations

from epdserve.common.store_config import StoreConfig
from epdserve.store.base import EmbeddingStore
from epdserve.store.record import EntryCheck


def open_store(config: StoreConfig, check: EntryCheck, lend: bool = False) -> EmbeddingStore:
    """A client of the configured store (``lend``: this instance adds memory to the store's pool,
    where the backend pools its members' memory)."""
    if config.backend == "mooncake":
        from epdserve.store.mooncake_store import MooncakeStore

        return MooncakeStore(config, check, lend=lend)
    from epdserve.store.redis_store import RedisStore

    return RedisStore(config, check)
