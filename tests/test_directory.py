"""The router's media directory: keyed by data: URL content only; what an item is (uuid, grid,
the signed header, never a lease) for every encoded item, store hits only with a store handle
that has not (nearly) expired; bounded LRU; in-flight encodes others can wait for."""

from __future__ import annotations

import asyncio
import time

from epdserve.encoder.protocol import EncodedItem
from epdserve.router.directory import EXPIRY_MARGIN_S, MediaDirectory, content_key
from epdserve.transfer.cached import HEADER_FIELDS
from epdserve.transfer.header import WireHeader


def item(uuid: str, expires_in: float | None = 60.0) -> EncodedItem:
    store = None if expires_in is None else {"connector": "store", "expires_at": time.time() + expires_in, "k": uuid}
    return EncodedItem(
        uuid=uuid,
        modality="image",
        grid_thw=(1, 4, 4),
        num_embeddings=4,
        dtype="float32",
        shape=(4, 8),
        ec_handle={"connector": "shm", "lease": uuid, "mac": "m", "key": uuid, "checksum": "c", "nbytes": 128},
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
    d.record("k0", item("u0", expires_in=None))  # no store entry: known, but no hit
    assert d.lookup("k0") is None and len(d) == 1
    known = d.known("k0")
    assert known is not None and known.uuid == "u0" and known.more_handles == []
    assert known.ec_handle == {"key": "u0", "checksum": "c", "nbytes": 128}  # the header: no lease, no MAC
    d.record("k1", item("u1"))
    got = d.lookup("k1")
    assert got is not None and got.ec_handle == got.store_handle and got.more_handles == []
    d.record("k2", item("u2", expires_in=EXPIRY_MARGIN_S / 2))  # about to expire: not used
    assert d.lookup("k2") is None and d.known("k2") is not None and len(d) == 2
    d.record("k3", item("u3"))
    d.record("k4", item("u4"))  # bounded: the least recently used go
    assert d.lookup("k1") is None and d.known("k1") is None and d.lookup("k4") is not None and d.hits == 2
    d.forget("k4")  # the store lost it: no more hits, still known
    assert d.lookup("k4") is None and d.known("k4") is not None


def test_the_header_fields_are_the_wire_headers() -> None:
    assert WireHeader.__struct_fields__ == HEADER_FIELDS


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
