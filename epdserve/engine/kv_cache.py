"""The paged KV cache and the block table that maps each request's positions to its slots.

The KV cache of a layer is two tensors ``[num_blocks, block_size, kv_heads, head_dim]``; a token's
slot is ``block_id * block_size + offset``. The runner keeps every running request's block table
as a row of one int tensor (``BlockTable``), updated as blocks are added, so a step's metadata is
built with tensor ops, not rebuilt per sequence.
"""

from __future__ import annotations

import torch

from epdserve.engine.memory import lazy_zeros


def spans(starts: torch.Tensor, ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For positions ``starts[i] .. ends[i]-1`` of every sequence, concatenated: each position's
    sequence index and the position itself."""
    lens = ends - starts
    seq = torch.repeat_interleave(torch.arange(len(lens), device=starts.device), lens)
    offs = torch.arange(int(lens.sum()), device=starts.device) - torch.repeat_interleave(
        torch.cumsum(lens, 0) - lens, lens
    )
    return seq, starts[seq] + offs


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.block_size = block_size
        self.k = [lazy_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.v = [lazy_zeros(shape, dtype, device) for _ in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def read_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """The KV of the tokens at ``slots`` as rows [tokens, layers x 2 x kv_heads x head_dim]
        (each layer's key, then its value): what a KV connector carries."""
        parts = []
        for k, v in zip(self.k, self.v, strict=True):
            parts.append(k.view(-1, k.shape[2] * k.shape[3]).index_select(0, slots))
            parts.append(v.view(-1, v.shape[2] * v.shape[3]).index_select(0, slots))
        return torch.cat(parts, dim=1)

    def write_rows(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Store rows made by ``read_rows`` (of any instance with this layout) at ``slots``."""
        per = self.k[0].shape[2] * self.k[0].shape[3]
        rows = rows.to(self.k[0].device, self.k[0].dtype)
        for i, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            k.view(-1, per).index_copy_(0, slots, rows[:, 2 * i * per : (2 * i + 1) * per])
            v.view(-1, per).index_copy_(0, slots, rows[:, (2 * i + 1) * per : (2 * i + 2) * per])


class BlockTable:
    """Block ids of the requests the runner has seen, one row each, grown as blocks are added.

    A request's row is rewritten only from the first block that changed: a decode step appends at
    most one block id, so the table costs nothing per step in steady state. A request whose block
    list was replaced (preemption, prefix-cache admission) is rewritten whole."""

    def __init__(self, rows: int, max_blocks: int, device: torch.device) -> None:
        self.device = device
        self.max_blocks = max_blocks
        self.table = torch.zeros((rows, max_blocks), dtype=torch.long, device=device)
        self._rows: dict[str, int] = {}
        self._free: list[int] = list(range(rows - 1, -1, -1))
        self._synced: dict[str, tuple[list[int], int]] = {}  # request id -> (block list object, ids written)

    def row(self, request_id: str, block_ids: list[int]) -> int:
        r = self._rows.get(request_id)
        if r is None:
            if not self._free:
                self._grow()
            r = self._rows[request_id] = self._free.pop()
        seen, n = self._synced.get(request_id, (None, 0))
        if seen is not block_ids or n > len(block_ids):
            n = 0
        if n < len(block_ids):
            self.table[r, n : len(block_ids)] = torch.tensor(block_ids[n:], dtype=torch.long).to(self.device)
        self._synced[request_id] = (block_ids, len(block_ids))
        return r

    def release(self, request_id: str) -> None:
        r = self._rows.pop(request_id, None)
        self._synced.pop(request_id, None)
        if r is not None:
            self._free.append(r)

    def _grow(self) -> None:
        old = self.table.shape[0]
        self.table = torch.cat([self.table, torch.zeros_like(self.table)])
        self._free.extend(range(2 * old - 1, old - 1, -1))

    def slots(self, rows: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, block_size: int) -> torch.Tensor:
        """Slots of positions ``starts[i] .. ends[i]-1`` of each row, concatenated."""
        seq, pos = spans(starts, ends)
        return self.table[rows[seq], pos // block_size] * block_size + pos % block_size
