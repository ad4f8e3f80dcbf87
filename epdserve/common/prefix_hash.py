"""The prefix-cache hash of a KV block, computed alike wherever a prompt's blocks are named: by the
block manager that caches them, and by a router choosing the worker that holds them.

A full block's hash chains over the previous block's hash, the block's token ids and the content
hash of every media item whose placeholders fall inside it::

    h[i] = H(h[i-1], tokens[i*B:(i+1)*B], ((uuid, offset), ...))

so the same text with a different image never shares a block. Pure Python, no torch.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import NamedTuple

HASH_BYTES = 16


class MediaSpan(NamedTuple):
    uuid: str
    offset: int  # first placeholder position
    length: int  # placeholders


def block_hash(parent: bytes | None, tokens: Sequence[int], start: int, end: int, media: Sequence[MediaSpan]) -> bytes:
    """The hash of the block holding positions ``start .. end-1`` (``tokens`` are exactly those)."""
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    if parent is not None:
        h.update(parent)
    h.update(array("q", tokens).tobytes())
    for m in media:
        if m.offset < end and m.offset + m.length > start:
            h.update(f"|{m.uuid}@{m.offset}".encode())
    return h.digest()


def prefix_hashes(token_ids: Sequence[int], media: Sequence[MediaSpan], block_size: int) -> list[bytes]:
    """The hashes of every full block of a prompt, in order."""
    out: list[bytes] = []
    for i in range(len(token_ids) // block_size):
        start, end = i * block_size, (i + 1) * block_size
        out.append(block_hash(out[-1] if out else None, token_ids[start:end], start, end, media))
    return out
