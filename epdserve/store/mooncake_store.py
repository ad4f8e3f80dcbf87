"""The embedding store on Mooncake Store (``mooncake://<master host>:<rpc port>``).

Each instance's store client joins the master's pool in peer-to-peer handshake mode (no metadata
server), encoders lending ``segment_bytes`` of their memory to it and readers none. Mooncake
bounds the pool's memory and evicts when it fills; it has no per-entry TTL and no credential, so
its network must be trusted-only (docs/security.md) and everything read from it is checked like any
other untrusted input (``record``: MAC, identity, shape, checksum).

The client's calls block (and take seconds when the master is gone), so they run on a small thread
pool of their own, bounded by ``timeout_s`` like every store call. Joining starts when the member
is made; until it is done an encoder's calls are misses (it computes alone), never a wait, while a
reader (a language-model instance, made on its first store handle) waits for its first join up
to ``READER_FIRST_JOIN_S`` and for a later one up to ``timeout_s``: a miss there would cost the
request its embeddings. Mooncake keeps the first value written to a key, which makes claims: a
claimant writes ``<token> <deadline>`` and has the claim when reading the key back gives its own
token. A claim is renewed and released by overwriting it (with a later, or a past, deadline); one
whose deadline passed is anyone's to take. Mooncake has no compare-and-set and a write may read
back late on another member, so a claim is confirmed by reading it again after a short settle;
two members racing for one item can still both win (the claims cut duplicates, they do not exclude
them): that costs a duplicate encode, never a wrong entry.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from epdserve.common.store_config import StoreConfig
from epdserve.store.base import Claim
from epdserve.store.packed import PackedStore
from epdserve.store.record import EntryCheck

T = TypeVar("T")
LOCAL_BUFFER_BYTES = 16 << 20  # the client's own transfer buffer
MAX_CLAIM_BYTES = 64
CLAIM_SETTLE_S = 0.01
CLAIM_SETTLE_TRIES = 10
CLAIM_CONFIRM_S = 0.05
READER_FIRST_JOIN_S = 5.0  # how long a reader's first call waits for its join (import, master handshake)


class MooncakeError(RuntimeError):
    """A Mooncake call failed (the master is unreachable, the client could not join)."""


class MooncakeStore(PackedStore):
    errors = (MooncakeError, OSError, TimeoutError)

    def __init__(self, config: StoreConfig, check: EntryCheck, lend: bool = False) -> None:
        """``lend``: this member (an encoder) lends ``segment_bytes`` of memory to the pool."""
        super().__init__(config, check)
        self._master = config.url.removeprefix("mooncake://")
        self._segment = config.segment_bytes if lend else 0
        self._reader = not lend  # its first call waits for the join (an encoder's is a miss)
        self._waited_first_join = False  # a reader waited for its first join (later ones: timeout_s)
        self._client: Any = None
        self._setup_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="epd-mooncake")
        # joining takes from milliseconds to seconds: it starts now, and calls made before it is
        # done answer as misses instead of waiting for it
        self._join: Future[Any] = self._pool.submit(self._store)

    async def _call(self, what: str, op: Callable[[], Awaitable[T]], default: T) -> T:
        if self._client is None:
            join = self._join
            if not join.done() and self._reader:  # the first join may take an import and a handshake
                await self.wait_joined(self.config.timeout_s if self._waited_first_join else READER_FIRST_JOIN_S)
                self._waited_first_join = True
            if not join.done():
                self.stats.skipped += 1
                return default
            if join.exception() is not None:
                if self.available:  # a failed join counts once, then is retried after down_s
                    self._join = self._pool.submit(self._store)
                    return await super()._call(what, lambda: asyncio.wrap_future(join), default)
                self.stats.skipped += 1
                return default
        return await super()._call(what, op, default)

    async def wait_joined(self, timeout_s: float) -> bool:
        """Whether this member joined the store within ``timeout_s`` (tests, tools)."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.wrap_future(self._join), timeout_s)
        return self._client is not None

    def _store(self) -> Any:
        """The joined client (joining on first use, on a pool thread)."""
        with self._setup_lock:
            if self._client is None:
                try:
                    from mooncake.store import MooncakeDistributedStore  # the optional extra
                except ImportError as e:
                    raise MooncakeError(f"Mooncake is not installed (pip install 'epdserve[mooncake]'): {e}") from e
                client = MooncakeDistributedStore()
                cfg = self.config
                rc = client.setup(
                    cfg.local_host,
                    "P2PHANDSHAKE",
                    self._segment,
                    LOCAL_BUFFER_BYTES,
                    cfg.protocol,
                    cfg.device,
                    self._master,
                )
                if rc != 0:
                    raise MooncakeError(f"could not join the Mooncake store at {self._master} (code {rc})")
                self._client = client
            return self._client

    async def _run(self, op: Callable[[Any], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: op(self._store()))

    async def _read(self, key: str) -> bytes | None:
        value = await self._run(lambda c: c.get(key))
        return bytes(value) if value else None

    async def _write(self, key: str, value: bytes) -> bool:
        return await self._run(lambda c: c.put(key, value)) == 0  # not written: full (a miss later)

    async def _delete(self, key: str) -> None:
        await self._run(lambda c: c.remove(key))

    async def _exists(self, key: str) -> bool:
        return await self._run(lambda c: c.is_exist(key)) == 1

    # ---- claims ------------------------------------------------------------------------------
    async def _claim_value(self, key: str) -> tuple[str, float] | None:
        """The claim's token and deadline as stored (anything malformed reads as none)."""
        raw = await self._call("claimed", lambda: self._read(key), None)
        if raw is None or len(raw) > MAX_CLAIM_BYTES:
            return None
        try:
            token, deadline = raw.decode("ascii").split(" ")
            return token, float(deadline)
        except (UnicodeDecodeError, ValueError):
            return None

    async def _holder(self, key: str) -> tuple[str, float] | None:
        """The claim's token and deadline, if it names a live one."""
        value = await self._claim_value(key)
        return value if value is not None and value[1] > time.time() else None

    async def _set_claim(self, key: str, token: str, deadline: float, fresh: bool) -> bool:
        value = f"{token} {deadline:.3f}".encode()
        write = (lambda c: c.put(key, value)) if fresh else (lambda c: c.upsert(key, value))
        return await self._call("claim", lambda: self._run(write), None) == 0

    async def claim(self, uuid: str) -> Claim:
        key = self._prefix + "claim:" + uuid
        if not self.available:
            self.stats.skipped += 1
            return Claim(True)  # no store to coordinate through: compute alone
        value = await self._claim_value(key)
        if value is not None and value[1] > time.time():
            return Claim(False)
        if value is not None and value[1] == 0.0:
            # its holder finished: the entry it wrote may not read back yet. Seen now, the caller
            # finds it; never seen (the holder failed), this member claims the item
            for _ in range(CLAIM_SETTLE_TRIES):
                if await self.present(uuid):
                    return Claim(False)
                await asyncio.sleep(CLAIM_SETTLE_S)
        token = secrets.token_hex(16)
        exists = await self._call("claim", lambda: self._exists(key), False)
        await self._set_claim(key, token, time.time() + self.config.claim_ttl_s, fresh=not exists)
        held = await self._holder(key)
        for _ in range(CLAIM_SETTLE_TRIES):
            if held is not None or not self.available:
                break
            # a write of the claim (ours, or another member's that made ours fail) may not read
            # back yet: look again before going alone
            await asyncio.sleep(CLAIM_SETTLE_S)
            held = await self._holder(key)
        if held is None:  # the store failed between the calls, or nobody can say: compute alone
            return Claim(True)
        if held[0] != token:
            return Claim(False)
        # two members' first writes can both read back as their own for a moment (Mooncake has no
        # compare-and-set): the claim is ours if it still is once the writes have settled
        await asyncio.sleep(CLAIM_CONFIRM_S)
        held = await self._holder(key)
        return Claim(True, token) if held is None or held[0] == token else Claim(False)

    async def renew(self, uuid: str, claim: Claim) -> None:
        if claim.token:
            key = self._prefix + "claim:" + uuid
            await self._set_claim(key, claim.token, time.time() + self.config.claim_ttl_s, fresh=False)

    async def unclaim(self, uuid: str, claim: Claim) -> None:
        if claim.token:
            key = self._prefix + "claim:" + uuid
            held = await self._holder(key)
            if held is not None and held[0] == claim.token:
                await self._set_claim(key, claim.token, 0.0, fresh=False)

    async def claimed(self, uuid: str) -> bool:
        return await self._holder(self._prefix + "claim:" + uuid) is not None

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None and self.available:  # leaving a dead master would block for seconds
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    asyncio.get_running_loop().run_in_executor(self._pool, client.close), self.config.timeout_s
                )
        self._pool.shutdown(wait=False)
