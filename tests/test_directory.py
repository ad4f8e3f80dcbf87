"""The router's media directory: keyed by data: URL content only, entries only with a store
handle that has not (nearly) expired, bounded LRU, and in-flight encodes others can wait for."""

from __future__ import annotations

import asyncio
import time

from epdserve.encoder.protocol import EncodedItem
from epdserve.router.directory import EXPIRY_MARGIN_S, MediaDirectory, content_key


def item(uuid: str, expires_in: float | None = 60.0) -> EncodedItem:
    store = None if expires_in is None else {"connector": "store", "expires_at": time.time() + expires_in, "k": uuid}
    return EncodedItem(
        uuid=uuid,
        modality="image",
        grid_thw=(1, 4, 4),
        num_embeddings=4,
        dtype="float32",
        shape=(4, 8),
        ec_handle={"connector": "shm", "lease": uuid},
        more_handles=[{"connector": "shm", "lease": uuid + "-2"}],
        store_handle=store,
        status="computed",
    )


def test_keys_name_content_of_data_urls_only() -> None:
    a = content_key("image", "data:image/png;base64,AAAA")
    assert a is not None and a == content_key("image", "data:image/png;base64,AAAA")
    assert a != content_key("video", "data:image/png;base64,AAAA")
    assert a != content_key("image", "data:image/png;base64,AAAB")
    assert content_key("image", "https://example.com/cat.png") is None


def test_entries_hold_the_store_handle_never_a_lease_and_expire() -> None:
    d = MediaDirectory(max_entries=2)
    d.record("k0", item("u0", expires_in=None))  # no store entry: nothing to remember
    assert d.lookup("k0") is None and len(d) == 0
    d.record("k1", item("u1"))
    got = d.lookup("k1")
    assert got is not None and got.ec_handle == got.store_handle and got.more_handles == []
    d.record("k2", item("u2", expires_in=EXPIRY_MARGIN_S / 2))  # about to expire: not used
    assert d.lookup("k2") is None and len(d) == 1
    d.record("k3", item("u3"))
    d.record("k4", item("u4"))  # bounded: the least recently used (k1) goes
    assert d.lookup("k1") is None and d.lookup("k4") is not None and d.hits == 2
    d.forget("k4")
    assert d.lookup("k4") is None


def test_an_encode_in_flight_can_be_awaited() -> None:
    async def main() -> None:
        d = MediaDirectory(max_entries=4)
        assert d.in_flight("k") is None
        d.begin("k")
        fut = d.in_flight("k")
        assert fut is not None and not fut.done()
        d.record("k", item("u"))
        d.end("k")
        await asyncio.wait_for(fut, 1)
        assert d.in_flight("k") is None and d.lookup("k") is not None

    asyncio.run(main())
