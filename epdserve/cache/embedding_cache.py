"""A byte-bounded LRU cache of vision embeddings keyed by media uuid.

Entries are charged the whole pages they take (``cache.pages``): callers store copies made by
``in_own_pages``, so the bound is what the cache holds in memory.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from epdserve.cache.pages import held_bytes


class EmbeddingCache:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self.nbytes = 0
        self._items: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> torch.Tensor | None:
        t = self._items.get(key)
        if t is None:
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return t

    def put(self, key: str, value: torch.Tensor) -> None:
        size = held_bytes(value)
        if size > self.capacity:
            return
        old = self._items.pop(key, None)
        if old is not None:
            self.nbytes -= held_bytes(old)
        self._items[key] = value
        self.nbytes += size
        while self.nbytes > self.capacity:
            _, evicted = self._items.popitem(last=False)
            self.nbytes -= held_bytes(evicted)

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)
