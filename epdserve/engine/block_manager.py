"""Paged KV-cache blocks: allocation, reference counts and prefix caching.

A full block's hash (``prefix_hash``) chains over the previous block's hash, the block's token ids
and the content hash of every media item whose placeholders fall inside it, so the same text with
a different image never shares a block. Free blocks keep their hash and
stay reusable until they are evicted (least recently freed first); a request's tail blocks are
freed first so prefixes outlive suffixes.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from epdserve.common.prefix_hash import MediaSpan, block_hash
from epdserve.engine.request import Request


class PrefixMatch(NamedTuple):
    block_ids: list[int]
    num_tokens: int


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        # blocks ever handed out: a freed block goes to the back of the queue, so the never-used
        # ones come first, in id order, and this is also the highest id handed out + 1
        self.touched = 0
        self.hits = 0  # prefix-cache statistics (tokens)
        self.queries = 0

    # ---- hashing -----------------------------------------------------------------------------
    def _block_hash(self, req: Request, index: int, parent: bytes | None) -> bytes:
        start, end = index * self.block_size, (index + 1) * self.block_size
        media = [MediaSpan(it.uuid, it.offset, it.end - it.offset) for it in req.mm_items]
        return block_hash(parent, req.token_ids(start, end), start, end, media)

    def _hashes_upto(self, req: Request, num_tokens: int) -> list[bytes]:
        """Hashes of the request's full blocks among its first ``num_tokens`` tokens (memoised)."""
        n_full = num_tokens // self.block_size
        while len(req.block_hashes) < n_full:
            parent = req.block_hashes[-1] if req.block_hashes else None
            req.block_hashes.append(self._block_hash(req, len(req.block_hashes), parent))
        return req.block_hashes[:n_full]

    # ---- allocation --------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def match_prefix(self, req: Request, count: bool = True) -> PrefixMatch:
        """Cached blocks for the longest prefix of the request's tokens (at least one token is left
        to compute, so the step that finishes the prompt produces logits). ``count=False``: a look
        ahead that leaves the hit statistics alone."""
        if not self.enable_prefix_caching:
            return PrefixMatch([], 0)
        blocks = []
        for h in self._hashes_upto(req, req.num_tokens - 1):
            bid = self.cached.get(h)
            if bid is None:
                break
            blocks.append(bid)
        if count:
            self.queries += req.num_tokens
            self.hits += len(blocks) * self.block_size
        return PrefixMatch(blocks, len(blocks) * self.block_size)

    def take_cached(self, req: Request, match: PrefixMatch) -> None:
        for bid in match.block_ids:
            if self.ref_count[bid] == 0:
                self.free_queue.pop(bid, None)
            self.ref_count[bid] += 1
        req.block_ids = list(match.block_ids)
        req.num_computed_tokens = match.num_tokens
        req.num_cached_tokens = match.num_tokens

    def blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        total = req.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(req.block_ids))

    def allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Grow the request's block table to hold ``num_new_tokens`` more tokens; False if full."""
        need = self.blocks_needed(req, num_new_tokens)
        if need > self.num_free:
            return False
        for _ in range(need):
            bid, _ = self.free_queue.popitem(last=False)
            self.touched = max(self.touched, bid + 1)
            h = self.block_hash[bid]
            if h is not None:  # evict its cached content
                if self.cached.get(h) == bid:
                    del self.cached[h]
                self.block_hash[bid] = None
            self.ref_count[bid] = 1
            req.block_ids.append(bid)
        return True

    def commit(self, req: Request) -> None:
        """Register the request's newly completed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        for i, h in enumerate(self._hashes_upto(req, req.num_computed_tokens)):
            bid = req.block_ids[i]
            if self.block_hash[bid] is None:
                self.block_hash[bid] = h
                self.cached.setdefault(h, bid)

    def free(self, req: Request) -> None:
        for bid in reversed(req.block_ids):
            self.ref_count[bid] -= 1
            if self.ref_count[bid] == 0:
                self.free_queue[bid] = None
        req.block_ids = []

    def digest(self) -> bytes:
        """The hashes of every block the prefix cache can serve (in use or free but not yet
        evicted), concatenated: what a router matches a prompt's blocks against."""
        return b"".join(self.cached)

    def check_integrity(self) -> None:
        """Invariants, for tests and idle-time checks: every block is either referenced or free."""
        for bid in range(self.num_blocks):
            in_free = bid in self.free_queue
            if (self.ref_count[bid] == 0) != in_free:
                raise RuntimeError(f"block {bid}: ref {self.ref_count[bid]} but free={in_free}")
        for h, bid in self.cached.items():
            if self.block_hash[bid] != h:
                raise RuntimeError(f"cached hash of block {bid} is stale")

    def reset_prefix_cache(self) -> None:
        for h, bid in list(self.cached.items()):
            self.block_hash[bid] = None
            del self.cached[h]
