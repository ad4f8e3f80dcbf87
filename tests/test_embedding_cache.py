"""The embedding cache: a byte bound that counts the memory its entries hold, and entries copied
into pages of their own (out of the heap the requests' buffers use), freed when evicted."""

from __future__ import annotations

import gc
import mmap
import weakref

import pytest
import torch

from epdserve.cache.embedding_cache import EmbeddingCache
from epdserve.cache.pages import PAGE_BYTES, held_bytes, in_own_pages


def mapped_bytes() -> int:
    """Bytes of this process's anonymous mappings (what ``in_own_pages`` adds and unmaps)."""
    total = 0
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 5:  # no path: anonymous
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                total += hi - lo
    return total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_copy_in_own_pages_is_equal_contiguous_and_not_a_view(dtype: torch.dtype) -> None:
    batch = torch.randn(10, 24).to(dtype)
    part = batch[3:7]
    copy = in_own_pages(part)
    assert copy.dtype == dtype and copy.shape == part.shape and copy.is_contiguous()
    assert torch.equal(copy, part)
    assert copy.untyped_storage().data_ptr() != batch.untyped_storage().data_ptr()
    copy[0, 0] = 7  # its own storage: writable, and the batch does not change
    assert batch[3, 0] != 7
    assert copy.untyped_storage().data_ptr() % PAGE_BYTES == 0  # starts a page


def test_held_bytes_are_whole_pages() -> None:
    assert held_bytes(torch.zeros(1)) == PAGE_BYTES
    assert held_bytes(torch.zeros(PAGE_BYTES // 4, dtype=torch.float32)) == PAGE_BYTES
    assert held_bytes(torch.zeros(PAGE_BYTES // 4 + 1, dtype=torch.float32)) == 2 * PAGE_BYTES
    assert held_bytes(torch.zeros(0)) == 0
    assert in_own_pages(torch.zeros(0, 8)).shape == (0, 8)


def test_freeing_the_copy_unmaps_its_pages() -> None:
    big = 64 * PAGE_BYTES
    gc.collect()
    before = mapped_bytes()
    copy = in_own_pages(torch.ones(big // 4))
    assert mapped_bytes() - before >= big
    gone = weakref.ref(copy)
    del copy
    gc.collect()
    assert gone() is None and mapped_bytes() - before < big


def test_the_cache_charges_whole_pages_and_evicts_the_oldest() -> None:
    entry = in_own_pages(torch.randn(3, 5))  # 60 bytes: one page held
    cache = EmbeddingCache(capacity_bytes=2 * PAGE_BYTES)
    cache.put("a", entry)
    cache.put("b", in_own_pages(torch.randn(3, 5)))
    assert cache.nbytes == 2 * PAGE_BYTES and len(cache) == 2
    cache.put("c", in_own_pages(torch.randn(3, 5)))
    assert "a" not in cache and "b" in cache and "c" in cache and cache.nbytes == 2 * PAGE_BYTES
    cache.put("c", in_own_pages(torch.randn(3, 5)))  # replaced, not counted twice
    assert cache.nbytes == 2 * PAGE_BYTES and len(cache) == 2
    cache.put("huge", in_own_pages(torch.randn(3 * PAGE_BYTES // 4)))  # over the capacity: not kept
    assert "huge" not in cache and cache.nbytes == 2 * PAGE_BYTES
    assert mmap.PAGESIZE == PAGE_BYTES
