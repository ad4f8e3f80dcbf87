"""The KV of decoding sequences, also kept contiguous: one row per sequence.

The paged cache (``kv_cache.KVCache``) is the source of truth: prefix caching, KV export and
prefill read it. A decode step, though, attends over every decoding sequence's whole context, and
gathering those blocks into one padded batch copies the whole running context on every layer of
every step. This mirror holds each decoding sequence's keys and values at
``[row, kv_head, position, :]`` of one tensor per layer, so the step attends over *views* of its
first rows; per step only the tokens not yet mirrored are copied in (one per sequence in steady
state, the prompt once when a sequence starts decoding). The cost is a second copy of the decoding
sequences' KV, resident only as far as it is used (``memory.lazy_zeros``).

Rows are reassigned every step: a sequence that is not decoding in a step (finished, preempted,
still prefilling) gives its row back, the lowest free row is taken first, and a sequence whose
block list was replaced (preemption, prefix-cache admission) is mirrored again from position 0.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from epdserve.engine.kv_cache import spans
from epdserve.engine.memory import lazy_zeros


@dataclass(frozen=True)
class MirrorStep:
    """What one step's attention needs from the mirror."""

    rows: torch.Tensor  # [B] mirror row of each decode sequence (in the step's decode order)
    used_rows: int  # attention covers rows 0 .. used_rows-1 (rows of no decode sequence are masked)
    span: int  # positions attended: the longest decode context
    mask: torch.Tensor  # [used_rows, 1, 1, span] 0 where a row's position is in its context, else -inf
    starts: torch.Tensor  # [B] first position of each sequence not mirrored yet: copy [start, ctx)
    fill_dst: torch.Tensor  # [n x kv_heads] where each copied (token, kv head) row goes, token-major
    new_only: bool = False  # each sequence copies only its new token (the steady state)
    in_order: bool = False  # decode sequence i has row i, and no other rows are used


class ContiguousDecodeKV:
    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        rows: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        initial_len: int = 512,
    ) -> None:
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device, self.max_len = dtype, device, max_len
        self.rows = rows
        self.capacity = min(max_len, initial_len)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._alloc()
        self._row: dict[str, int] = {}
        self._free: list[int] = list(range(rows))
        self._mirrored: dict[str, tuple[list[int] | None, int]] = {}  # id -> (block list object, positions)

    def _alloc(self) -> None:
        shape = (self.rows, self.kv_heads, self.capacity, self.head_dim)
        self.k = [lazy_zeros(shape, self.dtype, self.device) for _ in range(self.num_layers)]
        self.v = [lazy_zeros(shape, self.dtype, self.device) for _ in range(self.num_layers)]

    def _reshape(self, rows: int, capacity: int) -> None:
        """New storage; every sequence is mirrored again from the paged cache on this step."""
        self.rows, self.capacity = rows, capacity
        self._alloc()
        self._free = sorted(set(range(rows)) - set(self._row.values()))
        self._mirrored = {rid: (None, 0) for rid in self._mirrored}

    def step(self, request_ids: list[str], block_lists: list[list[int]], ctx: list[int]) -> MirrorStep:
        """Rows for this step's decode sequences (context ``ctx[i]`` each, the new token included)
        and the tokens to copy in: positions ``[starts[i], ctx[i])`` of each, in that order."""
        need = max(ctx)
        if need > self.capacity or len(request_ids) > self.rows:
            cap = self.capacity
            while cap < need:
                cap *= 2
            self._reshape(max(self.rows, len(request_ids)), min(cap, self.max_len))
        current = set(request_ids)
        for rid in [r for r in self._row if r not in current]:
            heapq.heappush(self._free, self._row.pop(rid))
            self._mirrored.pop(rid, None)
        rows, starts = [], []
        for rid, blocks, n in zip(request_ids, block_lists, ctx, strict=True):
            row = self._row.get(rid)
            if row is None:
                row = self._row[rid] = heapq.heappop(self._free)
            seen, done = self._mirrored.get(rid, (None, 0))
            rows.append(row)
            starts.append(done if seen is blocks and done <= n else 0)
            self._mirrored[rid] = (blocks, n)
        dev = self.device
        rows_t = torch.tensor(rows, dtype=torch.long).to(dev)
        starts_t = torch.tensor(starts, dtype=torch.long).to(dev)
        ctx_t = torch.tensor(ctx, dtype=torch.long).to(dev)
        used = max(rows) + 1
        row_ctx = torch.ones(used, dtype=torch.long, device=dev)  # a row of no sequence: one (ignored) position
        row_ctx[rows_t] = ctx_t
        outside = torch.arange(need, device=dev)[None, :] >= row_ctx[:, None]
        # an additive mask: SDPA takes it faster than a boolean one on CPU
        mask = torch.zeros(outside.shape, dtype=self.dtype, device=dev).masked_fill_(outside, float("-inf"))
        mask = mask[:, None, None, :]
        seq, pos = spans(starts_t, ctx_t)
        heads = torch.arange(self.kv_heads, device=dev)
        dst = ((rows_t[seq][:, None] * self.kv_heads + heads[None, :]) * self.capacity + pos[:, None]).reshape(-1)
        new_only = all(a == n - 1 for a, n in zip(starts, ctx, strict=True))
        in_order = rows == list(range(len(rows)))
        return MirrorStep(rows_t, used, need, mask, starts_t, dst, new_only, in_order)

    def fill(self, layer: int, step: MirrorStep, k: torch.Tensor, v: torch.Tensor) -> None:
        """Copy the step's tokens in: ``k``/``v`` are [n, kv_heads, head_dim], in ``spans`` order."""
        if len(step.fill_dst):
            self.k[layer].view(-1, self.head_dim).index_copy_(0, step.fill_dst, k.reshape(-1, self.head_dim))
            self.v[layer].view(-1, self.head_dim).index_copy_(0, step.fill_dst, v.reshape(-1, self.head_dim))

    def views(self, layer: int, step: MirrorStep) -> tuple[torch.Tensor, torch.Tensor]:
        """[used_rows, kv_heads, span, head_dim] views of the layer's keys and values (no copy)."""
        return self.k[layer][: step.used_rows, :, : step.span], self.v[layer][: step.used_rows, :, : step.span]

    def forget(self, request_id: str) -> None:
        """The request left the engine."""
        row = self._row.pop(request_id, None)
        self._mirrored.pop(request_id, None)
        if row is not None:
            heapq.heappush(self._free, row)
