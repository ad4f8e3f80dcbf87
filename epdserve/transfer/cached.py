"""Handles on media whose KV the receiving worker already holds: nothing to fetch.

When the language-model worker a router chose holds the KV blocks covering a media item's
placeholders, the router encodes nothing for it and sends a *cached* handle instead: the item's
signed header (what the encoder produced for this content earlier), re-issued by the router with
the cluster's handle key. The worker's core skips every item inside its cached prefix, so it never
reads such a handle — unless those blocks were evicted between the router's choice and the
request's admission. Then the handle is read like a store handle (the shared store, when the
worker has one, may still hold the embeddings) and otherwise fails as ``embeddings_unavailable``:
the router retries with a real encode. A race costs an encode, never a wrong answer.

Torch-free: the router builds these handles.
"""

from __future__ import annotations

from epdserve.transfer import signing
from epdserve.transfer.base import Handle
from epdserve.transfer.header import WireHeader

CACHED_HANDLE = "cached"  # the connector a cached handle names
# what a handle says about its payload: every field of the wire header (DeepStack's levels included)
HEADER_FIELDS: tuple[str, ...] = WireHeader.__struct_fields__


def cached_handle(header: Handle, key: bytes, ttl_s: float) -> Handle:
    """A signed cached handle for the payload ``header`` describes (fields other than the header's
    are dropped: a cached handle locates nothing)."""
    fields = {k: header[k] for k in HEADER_FIELDS if k in header}
    if len(fields) != len(HEADER_FIELDS):
        raise ValueError("a cached handle needs the payload's full header")
    return signing.issue({**fields, "connector": CACHED_HANDLE}, key, ttl_s, signing.new_lease())
