"""KV-aware choice of a language-model worker: send a request where its prompt's prefix is cached.

``PromptBlocks`` names a request's prompt blocks exactly as a worker's block manager will: the
model's chat template, the placeholder runs its prompt layout gives each item's grid, the items'
content uuids (from the encoders, or the router's directory before any encode), and the same block
hash (``common.prefix_hash``); torch-free. An item the router knows nothing of yet ends the named
prefix: the blocks before its placeholders do not depend on it, the ones after do.

``KVIndex`` knows what each worker holds: its last digest (``GET /v1/kv/digest``, polled with the
health probes), plus the prompts routed to it since (a worker caches a prompt's blocks as soon as
it computes them, long before the next digest; a follow-up turn must find them). A worker whose
digest is older than ``stale_s`` has no known blocks: the choice falls back to load.

The choice maximises ``cached prompt tokens - load_tokens x requests outstanding``: a cached
prefix is worth computing elsewhere only while the worker holding it is not much busier.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

from epdserve.api.chat_messages import template_messages
from epdserve.api.kv_digest import KVDigest
from epdserve.api.protocol import ChatRequest
from epdserve.api.tokenizer import FastTokenizer, TooManyTokens
from epdserve.common.prefix_hash import MediaSpan, prefix_hashes
from epdserve.encoder.protocol import EncodedItem
from epdserve.engine.inputs import InputBuilder, MediaInput
from epdserve.media.processor import ProcessorConfig
from epdserve.models.config import ModelConfig
from epdserve.router.pool import Worker

MAX_NOTED_BLOCKS = 1 << 18  # block hashes remembered per worker between digests
BLOCK_THREADS = 2  # threads naming prompts' blocks
_UNKNOWN = "?"  # the uuid of an item not known yet (its blocks are never named)


class Blocks(NamedTuple):
    hashes: list[bytes]  # the prompt's full blocks up to the first unknown item
    item_ends: list[int]  # per media item, the position after its last placeholder
    complete: bool  # every item was known: ``hashes`` names every full block


class PromptBlocks:
    def __init__(self, model_dir: Path) -> None:
        self.builder = InputBuilder(FastTokenizer(model_dir), ModelConfig.from_pretrained(model_dir))
        # prompts are rendered and tokenized here, off the event loop and a few at a time: a burst
        # of long prompts queues here (each bounded by the context length), holding little memory
        self.executor = ThreadPoolExecutor(BLOCK_THREADS, thread_name_prefix="epd-kv-blocks")
        # a video's seconds per temporal patch when the encoder gave none, as the workers take it
        # (Qwen3-VL writes it into the prompt)
        self.second_per_grid = ProcessorConfig.from_pretrained(model_dir).second_per_grid

    def blocks(
        self,
        req: ChatRequest,
        media: list[tuple[str, EncodedItem | None]],
        block_size: int,
        max_tokens: int | None = None,
    ) -> Blocks:
        """The prompt's blocks, given each media item's modality and what is known of it (None:
        not yet known). A prompt over ``max_tokens`` (the context length: the worker will refuse
        it) names no blocks, found out at the cost of counting that many tokens."""
        items = [it for _, it in media]
        inputs = [
            # an item not known yet stands in with any grid its modality takes: only the tokens
            # before it are named
            MediaInput(
                _UNKNOWN, modality, self.builder.layout.smallest_grid(modality), second_per_grid=self._seconds(modality)
            )
            if it is None
            else MediaInput(it.uuid, it.modality, it.grid_thw, second_per_grid=self._seconds(it.modality, it))
            for modality, it in media
        ]
        try:
            prompt = self.builder.build(template_messages(req), inputs, req.chat_template_kwargs, max_tokens)
        except TooManyTokens:
            return Blocks([], [], complete=True)
        spans = [MediaSpan(m.uuid, m.offset, m.end - m.offset) for m in prompt.mm_items]
        hashes = prefix_hashes(prompt.token_ids, spans, block_size)
        unknown = [s.offset for s, it in zip(spans, items, strict=True) if it is None]
        if unknown:
            hashes = hashes[: min(unknown) // block_size]
        return Blocks(hashes, [s.offset + s.length for s in spans], not unknown)

    def _seconds(self, modality: str, item: EncodedItem | None = None) -> float | None:
        """A video's seconds per temporal patch: the encoder's (from the clip's timing), as the
        worker gets it in the item's part; the processor's fps when the encoder gave none."""
        if modality != "video":
            return None
        if item is not None and item.second_per_grid is not None:
            return item.second_per_grid
        return self.second_per_grid


class KVIndex:
    def __init__(self, stale_s: float) -> None:
        self.stale_s = stale_s
        self.block_size = 0  # the workers' (from their digests; 0 until one arrived)
        self._digest: dict[str, tuple[float, set[bytes]]] = {}
        self._noted: dict[str, dict[bytes, float]] = {}

    def update(self, url: str, digest: KVDigest) -> None:
        """A worker's digest arrived: it replaces what was known, and what was noted before it."""
        if self.block_size and digest.block_size != self.block_size:
            raise ValueError(f"worker {url} uses KV blocks of {digest.block_size} tokens, others {self.block_size}")
        self.block_size = digest.block_size
        now = time.monotonic()
        self._digest[url] = (now, digest.hash_set())
        # prompts noted within the last poll may not be in this digest yet: keep those
        noted = self._noted.get(url, {})
        self._noted[url] = {h: t for h, t in noted.items() if now - t < self.stale_s}

    def forget(self, url: str) -> None:
        self._digest.pop(url, None)
        self._noted.pop(url, None)

    def note(self, url: str, hashes: list[bytes]) -> None:
        """The prompt was sent to ``url``: its blocks will be there."""
        noted = self._noted.setdefault(url, {})
        now = time.monotonic()
        for h in hashes:
            noted[h] = now
        while len(noted) > MAX_NOTED_BLOCKS:
            noted.pop(next(iter(noted)))

    def fresh(self, url: str) -> bool:
        at = self._digest.get(url)
        return at is not None and time.monotonic() - at[0] < self.stale_s

    def cached_blocks(self, url: str, hashes: list[bytes]) -> int:
        """How many leading blocks of the prompt the worker holds (0 when its digest is stale)."""
        if not self.fresh(url):
            return 0
        known, noted = self._digest[url][1], self._noted.get(url, {})
        n = 0
        for h in hashes:
            if h not in known and h not in noted:
                break
            n += 1
        return n

    def choose(self, workers: list[Worker], hashes: list[bytes], load_tokens: int) -> tuple[Worker, int] | None:
        """The worker with the best cached-prefix vs load trade-off and its cached tokens; None
        when no worker holds any of the prompt (the caller balances load)."""
        scored = [(self.cached_blocks(w.url, hashes) * self.block_size, w) for w in workers]
        if not scored or max(t for t, _ in scored) == 0:
            return None
        tokens, best = max(scored, key=lambda tw: (tw[0] - load_tokens * tw[1].outstanding, -tw[1].outstanding))
        return best, tokens
