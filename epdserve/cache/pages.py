"""Tensors in pages of their own, for what a cache keeps long after the request that made it.

An entry copied out of malloc's heap shares that heap with the short-lived buffers of every
request around it (decoded images, pixel tensors, a forward's activations). When the cache evicts
it, it leaves a hole those buffers only partly reuse, while the entries still held keep the pages
around them resident: a process with a full, bounded cache keeps growing for hours. An entry in an
anonymous mapping of its own stays out of the heap, and freeing it unmaps its pages at once.

A zero tensor in pages of its own (a KV cache) is also resident only where it has been written:
from the heap, ``calloc`` may hand out a free chunk that it clears byte by byte.
"""

from __future__ import annotations

import math
import mmap

import torch

PAGE_BYTES = mmap.PAGESIZE


def _whole_pages(nbytes: int) -> int:
    return -(-nbytes // PAGE_BYTES) * PAGE_BYTES


def held_bytes(t: torch.Tensor) -> int:
    """The memory ``t``'s elements take once copied by ``in_own_pages`` (whole pages)."""
    return _whole_pages(t.numel() * t.element_size())


def own_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor in pages mapped for it alone: each page resident only once touched, all
    unmapped when the tensor (its last view) is freed. Never malloc's heap, where a free chunk as
    large would be handed out and cleared byte by byte, every page of it resident. The pages are
    the kernel's base pages, never transparent huge pages: a first write maps the pages it
    covers, not 2 MiB around them."""
    count = math.prod(shape)
    if count == 0:
        return torch.zeros(shape, dtype=dtype)
    # private: a shared anonymous mapping would be shared memory (shmem) the process never needs
    pages = mmap.mmap(-1, _whole_pages(count * dtype.itemsize), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # base pages even where huge pages are the default
        pages.madvise(mmap.MADV_NOHUGEPAGE)
    # the tensor holds a reference to the mapping: the pages live exactly as long as the tensor
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)


def in_own_pages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` that owns its storage: on the CPU, pages mapped for it alone
    (``own_pages``); on an accelerator, a plain copy (its allocator pools)."""
    if t.device.type != "cpu" or t.numel() == 0:
        return t.clone(memory_format=torch.contiguous_format)
    out = own_pages(tuple(t.shape), t.dtype)
    out.copy_(t)
    return out
