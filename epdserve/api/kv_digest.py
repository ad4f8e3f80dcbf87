"""``GET /v1/kv/digest`` (internal): which prompt blocks a language-model worker's prefix cache
holds, for a router that sends each request where its prefix is cached.

    ← {"version": 1, "model": "shapes-qwen2vl", "block_size": 16, "hashes": "<base64>"}

``hashes`` is the concatenation of the cached blocks' hashes (``common.prefix_hash``, 16 bytes
each), in no particular order.
"""

from __future__ import annotations

from typing import Final

import msgspec

from epdserve.common.prefix_hash import HASH_BYTES

KV_DIGEST_VERSION: Final = 1
MAX_DIGEST_BYTES: Final = 64 << 20  # a router refuses a larger digest


class KVDigest(msgspec.Struct, kw_only=True):
    model: str
    block_size: int
    hashes: bytes
    version: int = KV_DIGEST_VERSION

    def hash_set(self) -> set[bytes]:
        """The hashes, checked: whole 16-byte hashes only."""
        if len(self.hashes) % HASH_BYTES:
            raise ValueError("a KV digest holds whole hashes only")
        return {self.hashes[i : i + HASH_BYTES] for i in range(0, len(self.hashes), HASH_BYTES)}


def decode_digest(raw: bytes) -> KVDigest:
    """A worker's digest (router side); ValueError for another version or a malformed one."""
    try:
        d = msgspec.json.decode(raw, type=KVDigest)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ValueError(f"malformed KV digest: {e}") from None
    if d.version != KV_DIGEST_VERSION:
        raise ValueError(f"KV digest version {d.version}, expected {KV_DIGEST_VERSION}")
    if d.block_size < 1:
        raise ValueError("KV digest with a non-positive block size")
    return d
