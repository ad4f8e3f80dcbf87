"""The contiguous mirror of decoding sequences' KV: decode attention over its views (and the fused
kernels' attention over the paged cache in place) equals SDPA over each sequence's context read
from the paged cache, step after step, while sequences join, leave, are preempted (a new block
list) and outgrow the mirror's capacity; and its memory is resident only as far as it is used."""

from __future__ import annotations

import inspect
import os
import random
import subprocess
import sys

import numpy as np
import torch
import torch.nn.functional as F

from epdserve.engine.attention import PagedAttention, StepLayout
from epdserve.engine.contiguous_kv import ContiguousDecodeKV
from epdserve.engine.decode_path import DecodePath
from epdserve.engine.kv_cache import BlockTable, KVCache
from epdserve.engine.memory import lazy_zeros
from epdserve.kernels.ops import CpuKernelOps, select_ops

BS, HKV, HQ, D, LAYERS = 4, 2, 4, 8, 2
CPU = torch.device("cpu")


class World:
    def __init__(self, seed: int) -> None:
        ops = select_ops("auto", torch.float32, CPU)
        self.kernels = ops if isinstance(ops, CpuKernelOps) else None
        self.rng = random.Random(seed)
        torch.manual_seed(seed)
        self.cache = KVCache(LAYERS, 256, BS, HKV, D, torch.float32, CPU)
        self.table = BlockTable(2, 64, CPU)
        self.mirror = ContiguousDecodeKV(LAYERS, HKV, D, 3, 200, torch.float32, CPU, initial_len=8)
        self.free = list(range(256))
        self.rng.shuffle(self.free)
        self.seqs: dict[str, tuple[list[int], int]] = {}  # id -> (blocks, tokens in cache)
        self.seen: set[tuple[bool, bool]] = set()  # (new_only, in_order) of the steps taken

    def admit(self, rid: str, prompt: int) -> None:
        """A sequence whose prompt KV is already in the paged cache (as after its prefill)."""
        blocks = [self.free.pop() for _ in range(-(-prompt // BS))]
        table_row = self.table.row(rid, blocks)
        slots = self.table.slots(torch.tensor([table_row]), torch.tensor([0]), torch.tensor([prompt]), BS)
        for layer in range(LAYERS):
            self.cache.k[layer].view(-1, HKV, D)[slots] = torch.randn(prompt, HKV, D)
            self.cache.v[layer].view(-1, HKV, D)[slots] = torch.randn(prompt, HKV, D)
        self.seqs[rid] = (blocks, prompt)

    def leave(self, rid: str) -> None:
        blocks, _ = self.seqs.pop(rid)
        self.free.extend(blocks)
        self.table.release(rid)
        self.mirror.forget(rid)

    def decode_step(self, ids: list[str]) -> None:
        """One decode token for each of ``ids``: both attention paths, compared on every layer."""
        ctx = []
        for rid in ids:
            blocks, n = self.seqs[rid]
            if n % BS == 0:
                blocks.append(self.free.pop())
            self.seqs[rid] = (blocks, n + 1)
            ctx.append(n + 1)
        rows = [self.table.row(rid, self.seqs[rid][0]) for rid in ids]
        t = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
        step = self.mirror.step(ids, [self.seqs[r][0] for r in ids], ctx)
        base = dict(
            slot_mapping=self.table.slots(t(rows), t([c - 1 for c in ctx]), t(ctx), BS),
            prefills=[],
            decode_rows=t(list(range(len(ids)))),
            decode_table_rows=t(rows),
            decode_ctx=t(ctx),
            max_decode_ctx=max(ctx),
        )
        self.seen.add((step.new_only, step.in_order))
        src = self.table.slots(t(rows), step.starts, t(ctx), BS)
        # the step's tokens are all decode tokens; told so or not, the mirror must give the same
        torch_path = DecodePath(mirror=self.mirror)
        paths = [
            PagedAttention(
                self.cache, self.table, StepLayout(**base, mirror=step, mirror_src=src, decode_only=known), torch_path
            )
            for known in (True, False)
        ]
        if self.kernels is not None:  # and the fused kernels' attention, reading the paged cache in place
            paths.append(
                PagedAttention(self.cache, self.table, StepLayout(**base, decode_only=True), DecodePath(self.kernels))
            )
        for layer in range(LAYERS):
            q, k, v = torch.randn(len(ids), HQ, D), torch.randn(len(ids), HKV, D), torch.randn(len(ids), HKV, D)
            got = [attention(layer, q, k, v) for attention in paths]  # each writes the same k/v to the cache
            want = self.dense(layer, q, [self.seqs[r][0] for r in ids], ctx)
            for out in got:
                torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)

    def dense(self, layer: int, q: torch.Tensor, block_lists: list[list[int]], ctx: list[int]) -> torch.Tensor:
        """Each sequence's query [HQ, D] over its whole context, read slot by slot from the paged
        cache (no mirror, no kernels): the oracle."""
        outs = []
        for i, (blocks, n) in enumerate(zip(block_lists, ctx, strict=True)):
            pos = torch.arange(n)
            slots = torch.tensor(blocks)[pos // BS] * BS + pos % BS
            k, v = (c[layer].view(-1, HKV, D)[slots].transpose(0, 1) for c in (self.cache.k, self.cache.v))
            k, v = k.repeat_interleave(HQ // HKV, dim=0), v.repeat_interleave(HQ // HKV, dim=0)  # [HQ, n, D]
            outs.append(F.scaled_dot_product_attention(q[i][:, None], k, v)[:, 0])
        return torch.stack(outs)


def test_mirrored_decode_attention_equals_sdpa_over_the_paged_context() -> None:
    w = World(0)
    for i in range(3):
        w.admit(f"s{i}", w.rng.randrange(1, 12))
    live = 3
    for step in range(60):
        ids = list(w.seqs)
        w.rng.shuffle(ids)
        skipped = ids.pop() if len(ids) > 1 and step % 7 == 3 else None  # not decoding this step
        w.decode_step(ids)
        if step % 9 == 4:  # one leaves, another joins and takes the freed row
            w.leave(w.rng.choice(list(w.seqs)))
            w.admit(f"s{live}", w.rng.randrange(1, 20))
            live += 1
        if step % 13 == 6 and skipped in w.seqs:  # preempted and readmitted: a new block list
            w.leave(skipped)
            w.admit(skipped, w.rng.randrange(1, 20))
    assert w.mirror.capacity > 8  # the longest context outgrew the initial capacity
    # the walk took the steady-state path (new tokens only, rows in order) and the general ones
    assert {(True, True), (True, False), (False, False)} <= w.seen
    assert max(n for _, n in w.seqs.values()) <= w.mirror.capacity


def test_a_row_of_a_sequence_that_stopped_decoding_is_reused_first() -> None:
    m = ContiguousDecodeKV(1, HKV, D, 4, 64, torch.float32, CPU)
    a, b, c = [0], [1], [2]
    first = m.step(["a", "b"], [a, b], [3, 5])
    assert first.rows.tolist() == [0, 1] and first.starts.tolist() == [0, 0]
    second = m.step(["b", "c"], [b, c], [6, 2])  # a stopped decoding: c takes row 0
    assert second.rows.tolist() == [1, 0]
    assert second.starts.tolist() == [5, 0]  # b copies only its new token, c its whole context
    assert second.used_rows == 2 and second.mask.shape == (2, 1, 1, 6)
    assert (second.mask[0, 0, 0] == 0).tolist() == [True, True, False, False, False, False]
    third = m.step(["b", "c"], [[7], c], [3, 3])  # b's block list was replaced: mirrored again
    assert third.starts.tolist() == [0, 2]


def resident_mb(t: torch.Tensor) -> float:
    """The resident memory of ``t``'s own pages (/proc/self/pagemap: bit 63 of a page's entry is
    set while it is in memory), not the whole process's, which other threads of a test worker
    may grow meanwhile."""
    page = os.sysconf("SC_PAGE_SIZE")
    first, end = t.data_ptr() // page, -(-(t.data_ptr() + t.numel() * t.element_size()) // page)
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read((end - first) * 8), dtype=np.uint64)
    return int(((entries >> np.uint64(63)) & np.uint64(1)).sum()) * page / 2**20


def test_lazy_zeros_are_zero_and_resident_only_where_touched() -> None:
    t = lazy_zeros((64, 1024, 1024), torch.float32, CPU)  # 256 MiB
    assert resident_mb(t) < 32
    t[3, 5, 7] = 1.5
    # one base page, not a transparent huge page (2 MiB) around the element
    assert resident_mb(t) * 2**20 == os.sysconf("SC_PAGE_SIZE")
    assert t.dtype == torch.float32 and float(t[3].sum()) == 1.5 and float(t[0].abs().sum()) == 0.0
    assert lazy_zeros((2, 3), torch.bfloat16, CPU).dtype == torch.bfloat16
    assert lazy_zeros((0, 3), torch.float32, CPU).shape == (0, 3)
    row = t[3]
    del t
    assert float(row.sum()) == 1.5  # a view keeps the memory


_HEAP_HOLDS_A_FREE_CHUNK = f"""
import os, numpy as np, torch
from epdserve.allocator import keep_freed_memory
from epdserve.engine.memory import lazy_zeros
{inspect.getsource(resident_mb)}
assert keep_freed_memory()
blocks = [np.ones(16 << 20, dtype=np.uint8) for _ in range(24)]  # from the heap, every page written
del blocks[:-1]  # a free chunk of 368 MiB below one still in use: the heap keeps it
print(resident_mb(lazy_zeros((64, 1024, 1024), torch.float32, torch.device("cpu"))))
"""


def test_lazy_zeros_take_fresh_pages_where_malloc_keeps_a_large_free_chunk() -> None:
    """A role server keeps freed buffers in malloc's heap (``allocator.keep_freed_memory``); a
    KV cache allocated after a large free there must still be resident only where touched
    (calloc would hand it the free chunk, cleared byte by byte). In a process of its own: the
    allocator's settings are process-wide."""
    out = subprocess.run([sys.executable, "-c", _HEAP_HOLDS_A_FREE_CHUNK], capture_output=True, text=True,
                         timeout=120, check=True)  # fmt: skip
    assert float(out.stdout.strip().splitlines()[-1]) < 32
