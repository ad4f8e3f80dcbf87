"""The flags of ``StoreConfig`` (``store.config``): all of them for the encoders, what a reader
needs for the language-model instances."""

from __future__ import annotations

import argparse

STORE = "epdserve.common.store_config:StoreConfig"
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


def store_group(s: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    return s.add_argument_group(
        "shared embedding store",
        "Encoders share what they compute through Redis (pip install 'epdserve[store]'; its password "
        "is read from EPD_STORE_PASSWORD) or Mooncake Store (pip install 'epdserve[mooncake]').",
    )
