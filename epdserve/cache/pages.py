"""Tensors in pages of their own, for what a cache keeps long after the request that made it.

An entry copied out of malloc's heap shares that heap with the short-lived buffers of every
request around it (decoded images, pixel tensors, a forward's activations). When the cache evicts
it, it leaves a hole those buffers only partly reuse, while the entries still held keep the pages
around them resident: a process with a full, bounded cache keeps growing for hours. An entry in an
anonymous mapping of its own stays out of the heap, and freeing it unmaps its pages at once.
"""

from __future__ import annotations

import mmap

import torch

PAGE_BYTES = mmap.PAGESIZE


def held_bytes(t: torch.Tensor) -> int:
    """The memory ``t``'s elements take once copied by ``in_own_pages`` (whole pages)."""
    nbytes = t.numel() * t.element_size()
    return -(-nbytes // PAGE_BYTES) * PAGE_BYTES


def in_own_pages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` that owns its storage: on the CPU, pages mapped for it alone
    (unmapped when the copy is freed); on an accelerator, a plain copy (its allocator pools)."""
    if t.device.type != "cpu" or t.numel() == 0:
        return t.clone(memory_format=torch.contiguous_format)
    # private: a shared anonymous mapping would be shared memory (shmem) the process never needs
    pages = mmap.mmap(-1, held_bytes(t), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # the tensor holds a reference to the mapping: the pages live exactly as long as the tensor
    out = torch.frombuffer(pages, dtype=t.dtype, count=t.numel()).view(t.shape)
    out.copy_(t)
    return out
