"""What every store backend shares: entries packed and checked by ``record``, and every call to
the backend bounded in time and skipped for a while after a failure.

A backend supplies raw byte operations on keys (``_read``, ``_write``, ``_delete``, ``_exists``)
and its claims; this class turns them into the ``EmbeddingStore`` contract: a failing or slow
backend answers a miss within ``timeout_s`` and is not asked again for ``down_s``; an entry that
does not verify is counted, deleted and answered as a miss.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import torch

from epdserve.common.store_config import StoreConfig
from epdserve.store.base import StoreStats
from epdserve.store.record import EntryCheck, Grid, StoredItem, pack, unpack
from epdserve.transfer.base import TransferError
from epdserve.transfer.header import WireHeader

log = logging.getLogger(__name__)
T = TypeVar("T")


def _no_rows(grid: Grid) -> int:
    raise TransferError("this store client reads entries only with their expected row count")


class PackedStore:
    errors: tuple[type[BaseException], ...] = (OSError, TimeoutError)  # what a backend call may raise

    def __init__(self, config: StoreConfig, check: EntryCheck) -> None:
        self.config = config
        self.check = check
        self.model_id = check.model_id
        self.stats = StoreStats()
        self._down_until = 0.0
        self._prefix = f"epd:ec:v1:{check.model_id}:"

    # ---- the backend's part ------------------------------------------------------------------
    async def _read(self, key: str) -> bytes | None:
        raise NotImplementedError

    async def _write(self, key: str, value: bytes) -> bool:
        raise NotImplementedError

    async def _delete(self, key: str) -> None:
        raise NotImplementedError

    async def _exists(self, key: str) -> bool:
        raise NotImplementedError

    # ---- shared ------------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    async def _call(self, what: str, op: Callable[[], Awaitable[T]], default: T) -> T:
        """``op`` within the timeout; ``default`` (and the store marked down) when it fails."""
        if not self.available:
            self.stats.skipped += 1
            return default
        try:
            return await asyncio.wait_for(op(), self.config.timeout_s)
        except self.errors as e:
            self.stats.errors += 1
            self._down_until = time.monotonic() + self.config.down_s
            log.warning(
                "embedding store %s failed (%s: %s); encoders compute alone for %.0f s",
                what,
                type(e).__name__,
                e,
                self.config.down_s,
            )
            return default

    async def get(self, uuid: str, rows: int | None = None) -> StoredItem | None:
        value = await self._call("get", lambda: self._read(self._prefix + uuid), None)
        if value is None:
            self.stats.misses += 1
            return None
        c = self.check
        rows_of = (c.rows_of or _no_rows) if rows is None else (lambda _grid: rows)
        try:
            item = unpack(value, uuid, c.model_id, c.key, rows_of, c.width, c.dtypes, c.levels)
        except TransferError as e:
            self.stats.rejected += 1
            log.warning("embedding store entry for %s rejected: %s", uuid, e)
            await self._call("delete", lambda: self._delete(self._prefix + uuid), None)
            return None
        self.stats.hits += 1
        return item

    async def put(self, uuid: str, grid_thw: Grid, embeddings: torch.Tensor) -> WireHeader | None:
        if embeddings.numel() * embeddings.element_size() > self.config.max_item_bytes:
            return None
        value, header = pack(uuid, self.model_id, grid_thw, embeddings, self.check.key, self.check.levels)
        if not await self._call("put", lambda: self._write(self._prefix + uuid, value), False):
            return None
        self.stats.writes += 1
        return header

    async def present(self, uuid: str) -> bool:
        return await self._call("present", lambda: self._exists(self._prefix + uuid), False)
