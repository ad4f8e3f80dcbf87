"""The embedding store on Redis (``redis://``), with its password and ACL user.

Keys are ``epd:ec:v1:<model id>:<uuid>`` for entries (the uuid already hashes the model, modality,
content and processor settings; the model id keeps two deployments on one Redis apart) and the
same with ``claim:`` for claims. Entries carry a TTL and Redis evicts by its own policy
(``maxmemory`` with ``allkeys-lru`` bounds the memory; see docs/deploy). Every call is bounded by
``timeout_s``; a failure marks the store down for ``down_s``, during which calls answer at once as
a miss. Claims are released and renewed only by their holder (compare-and-delete/expire scripts).
"""

from __future__ import annotations

import secrets
from typing import Any

import redis.asyncio as aioredis

from epdserve.common.store_config import StoreConfig
from epdserve.store.base import Claim
from epdserve.store.packed import PackedStore
from epdserve.store.record import EntryCheck

_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
_UNCLAIM = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


class RedisStore(PackedStore):
    errors = (aioredis.RedisError, OSError, TimeoutError)

    def __init__(self, config: StoreConfig, check: EntryCheck) -> None:
        super().__init__(config, check)
        self._redis = aioredis.Redis.from_url(
            config.url,
            username=config.username or None,
            password=config.password or None,
            socket_timeout=config.timeout_s,
            socket_connect_timeout=config.timeout_s,
            retry_on_timeout=False,
        )

    async def _read(self, key: str) -> bytes | None:
        value: Any = await self._redis.get(key)
        return None if value is None else bytes(value)

    async def _write(self, key: str, value: bytes) -> bool:
        return bool(await self._redis.set(key, value, px=int(self.config.ttl_s * 1000)))

    async def _delete(self, key: str) -> None:
        await self._redis.delete(key)

    async def _exists(self, key: str) -> bool:
        return bool(await self._redis.exists(key))

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

    async def claimed(self, uuid: str) -> bool:
        return bool(await self._call("claimed", lambda: self._redis.exists(self._prefix + "claim:" + uuid), 0))

    async def close(self) -> None:
        await self._redis.aclose()
