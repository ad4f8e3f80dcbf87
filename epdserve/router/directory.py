"""The router's directory of media the cluster already holds, and of media being encoded now.

Entries are keyed by content: the modality and the bytes of a ``data:`` URL (an ``http(s)`` URL
names content that may change, so it always goes to an encoder, whose own store lookup still
saves the forward). An entry is an encode result without its leases: what the item *is* (uuid,
grid, the signed header of its embeddings), which names its KV blocks before any encode, and, when
the encoders share a store, its *store handle*: a signed reference to the item's entry in the
shared store, which any language-model instance with the store can read. A store-backed hit skips
the encode call entirely; a stale one (evicted from the store meanwhile) makes the worker answer
``embeddings_unavailable``, and the router forgets the entry and encodes afresh.

In-flight tracking is per content key: of N concurrent requests for one item that no entry
covers, one encodes it and the others wait for its result, then read the directory; if that
encode fails (its encoder died), the next waiter encodes instead.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict

import msgspec

from epdserve.encoder.protocol import EncodedItem
from epdserve.transfer.cached import HEADER_FIELDS

EXPIRY_MARGIN_S = 5.0  # an entry whose store handle expires sooner than this is not used


def content_key(modality: str, url: str) -> str | None:
    """The directory key of a media part, or None for content the router cannot identify."""
    if not url.startswith("data:"):
        return None
    return hashlib.sha256(modality.encode() + b"\0" + url.encode()).hexdigest()


class MediaDirectory:
    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[str, EncodedItem] = OrderedDict()
        self._inflight: dict[str, asyncio.Future[None]] = {}
        self.hits = 0
        self.waits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, key: str) -> EncodedItem | None:
        """An encode result for ``key`` whose handle is the store handle (no lease to give back)."""
        item = self._entries.get(key)
        if item is None or item.store_handle is None:
            return None
        expires = item.store_handle.get("expires_at")
        if not isinstance(expires, int | float) or expires - EXPIRY_MARGIN_S < time.time():
            self._entries[key] = msgspec.structs.replace(item, store_handle=None)
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return msgspec.structs.replace(item, ec_handle=item.store_handle)

    def known(self, key: str) -> EncodedItem | None:
        """What the item of ``key`` is (its ``ec_handle`` is only the signed header: no lease)."""
        item = self._entries.get(key)
        if item is not None:
            self._entries.move_to_end(key)
        return item

    def record(self, key: str, item: EncodedItem) -> None:
        if self.max_entries <= 0:
            return
        header = {k: item.ec_handle[k] for k in HEADER_FIELDS if k in item.ec_handle}
        self._entries[key] = msgspec.structs.replace(item, ec_handle=header, more_handles=[])
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def forget(self, key: str) -> None:
        """The store no longer holds the item of ``key`` (what it is stays known)."""
        item = self._entries.get(key)
        if item is not None:
            self._entries[key] = msgspec.structs.replace(item, store_handle=None)

    def in_flight(self, key: str) -> asyncio.Future[None] | None:
        """The encode of ``key`` that is running now, if any."""
        return self._inflight.get(key)

    def begin(self, key: str) -> None:
        """This caller encodes ``key`` now; others wait for ``end``."""
        self._inflight[key] = asyncio.get_running_loop().create_future()

    def end(self, key: str) -> None:
        fut = self._inflight.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_result(None)
