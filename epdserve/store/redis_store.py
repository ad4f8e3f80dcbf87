"""The embedding store on Redis (``redis://``), with its password and ACL user.

Keys are ``epd:ec:v1:<model id>:<uuid>`` for entries (the uuid already hashes the model, modality,
content and processor settings; the model id keeps two deployments on one Redis apart) and the
same with ``claim:`` for claims. Entries carry a TTL and Redis evicts by its own policy
(``maxmemory`` with ``allkeys-lru`` bounds the memory; see docs/deploy). Every call is bounded by
``timeout_s``; a failure marks the store down for ``down_s``, during which calls answer at once as
a miss. Claims are released and renewed only by their holder (compare-and-delete/expire scripts).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import redis.asyncio as aioredis
import torch

from epdserve.store.base import Claim, StoreStats
from epdserve.store.config import StoreConfig
from epdserve.store.record import Grid, StoredItem, pack, unpack
from epdserve.transfer.base import TransferError
from epdserve.transfer.header import WireHeader

log = logging.getLogger(__name__)
T = TypeVar("T")

_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
_UNCLAIM = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


def _no_rows(grid: Grid) -> int:
    raise TransferError("this store client reads entries only with their expected row count")


class RedisStore:
    def __init__(
        self,
        config: StoreConfig,
        model_id: str,
        key: bytes,
        rows_of: Callable[[Grid], int] | None,
        width: int,
        dtypes: Iterable[str] = ("float32", "bfloat16", "float16"),
    ) -> None:
        self.config = config
        self.model_id = model_id
        self._key = key
        self._rows_of = rows_of or _no_rows
        self._width = width
        self._dtypes = tuple(dtypes)
        self.stats = StoreStats()
        self._down_until = 0.0
        self._prefix = f"epd:ec:v1:{model_id}:"
        self._redis = aioredis.Redis.from_url(
            config.url,
            username=config.username or None,
            password=config.password or None,
            socket_timeout=config.timeout_s,
            socket_connect_timeout=config.timeout_s,
            retry_on_timeout=False,
        )

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
        except (aioredis.RedisError, OSError, TimeoutError) as e:
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
        value: Any = await self._call("get", lambda: self._redis.get(self._prefix + uuid), None)
        if value is None:
            self.stats.misses += 1
            return None
        rows_of = self._rows_of if rows is None else (lambda _grid: rows)
        try:
            item = unpack(bytes(value), uuid, self.model_id, self._key, rows_of, self._width, self._dtypes)
        except TransferError as e:
            self.stats.rejected += 1
            log.warning("embedding store entry for %s rejected: %s", uuid, e)
            await self._call("delete", lambda: self._redis.delete(self._prefix + uuid), 0)
            return None
        self.stats.hits += 1
        return item

    async def put(self, uuid: str, grid_thw: Grid, embeddings: torch.Tensor) -> WireHeader | None:
        if embeddings.numel() * embeddings.element_size() > self.config.max_item_bytes:
            return None
        value, header = pack(uuid, self.model_id, grid_thw, embeddings, self._key)
        ttl_ms = int(self.config.ttl_s * 1000)
        ok = await self._call("put", lambda: self._redis.set(self._prefix + uuid, value, px=ttl_ms), None)
        if not ok:
            return None
        self.stats.writes += 1
        return header

    async def claim(self, uuid: str) -> Claim:
        token = secrets.token_hex(16)
        ttl_ms = int(self.config.claim_ttl_s * 1000)
        won: Any = await self._call(
            "claim", lambda: self._redis.set(self._prefix + "claim:" + uuid, token, nx=True, px=ttl_ms), "down"
        )
        if won == "down":
            return Claim(True)  # no store to coordinate through: compute alone
        return Claim(True, token) if won else Claim(False)

    async def renew(self, uuid: str, claim: Claim) -> None:
        if claim.token:
            ttl_ms = str(int(self.config.claim_ttl_s * 1000))
            key = self._prefix + "claim:" + uuid
            await self._call("renew", lambda: self._redis.eval(_RENEW, 1, key, claim.token, ttl_ms), 0)  # type: ignore[no-untyped-call]

    async def unclaim(self, uuid: str, claim: Claim) -> None:
        if claim.token:
            key = self._prefix + "claim:" + uuid
            await self._call("unclaim", lambda: self._redis.eval(_UNCLAIM, 1, key, claim.token), 0)  # type: ignore[no-untyped-call]

    async def present(self, uuid: str) -> bool:
        return bool(await self._call("present", lambda: self._redis.exists(self._prefix + uuid), 0))

    async def claimed(self, uuid: str) -> bool:
        return bool(await self._call("claimed", lambda: self._redis.exists(self._prefix + "claim:" + uuid), 0))

    async def close(self) -> None:
        await self._redis.aclose()
