"""The flags of ``StoreConfig`` (``store.config``): all of them for the encoders, what a reader
needs for the language-model instances."""

from __future__ import annotations

STORE = "epdserve.store.config:StoreConfig"
STORE_PREFIX = "--store-"
STORE_FLAGS = (
    "url",
    "username",
    "ttl_s",
    "max_item_bytes",
    "timeout_s",
    "down_s",
    "claim_ttl_s",
    "wait_s",
    "local_host",
    "segment_bytes",
    "protocol",
    "device",
)
STORE_CONSUMER_FLAGS = ("url", "username", "timeout_s", "local_host", "protocol", "device")
