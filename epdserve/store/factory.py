"""The store backend a ``StoreConfig`` names (by its url's scheme), imported only when used: each is
an optional extra."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from epdserve.store.base import EmbeddingStore
from epdserve.store.config import StoreConfig
from epdserve.store.record import Grid


def open_store(
    config: StoreConfig,
    model_id: str,
    key: bytes,
    rows_of: Callable[[Grid], int] | None,
    width: int,
    dtypes: Iterable[str] = ("float32", "bfloat16", "float16"),
    lend: bool = False,
) -> EmbeddingStore:
    """A client of the configured store (``lend``: this instance adds memory to the store's pool,
    where the backend pools its members' memory)."""
    if config.backend == "mooncake":
        from epdserve.store.mooncake_store import MooncakeStore

        return MooncakeStore(config, model_id, key, rows_of, width, dtypes, lend=lend)
    from epdserve.store.redis_store import RedisStore

    return RedisStore(config, model_id, key, rows_of, width, dtypes)
