"""Paged attention: the fused CPU kernels' row-wise attention, or PyTorch SDPA (CPU and CUDA).

The KV cache of a layer is two tensors ``[num_blocks, block_size, kv_heads, head_dim]``; a token's
slot is ``block_id * block_size + offset``. The runner keeps every running request's block table
as a row of one int tensor (``BlockTable``), updated as blocks are added, so a step's metadata is
built with tensor ops, not rebuilt per sequence. Per step the runner builds one ``PagedAttention``;
each layer then

  1. writes the new k/v into their slots,
  2. attends: all decode sequences (one new token each) together in one call — the kernels'
     (``kernels.ops``), reading their blocks in place, or one padded SDPA over views of the
     contiguous mirror of their KV (``contiguous_kv``) when the runner keeps one, else over their
     blocks gathered block-wise; no Python loop over sequences per layer. With the kernels, the
     tokens of a short prompt chunk are rows of that same call, each over its causal prefix;
     longer chunks (and every chunk without the kernels) go one sequence at a time through SDPA
     with a causal mask offset by the tokens already cached.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from epdserve.engine.memory import lazy_zeros
from epdserve.kernels.fused import RowWise

if TYPE_CHECKING:
    from epdserve.engine.contiguous_kv import ContiguousDecodeKV, MirrorStep
    from epdserve.kernels.ops import CpuKernelOps


def spans(starts: torch.Tensor, ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For positions ``starts[i] .. ends[i]-1`` of every sequence, concatenated: each position's
    sequence index and the position itself."""
    lens = ends - starts
    seq = torch.repeat_interleave(torch.arange(len(lens), device=starts.device), lens)
    offs = torch.arange(int(lens.sum()), device=starts.device) - torch.repeat_interleave(
        torch.cumsum(lens, 0) - lens, lens
    )
    return seq, starts[seq] + offs


@dataclass(frozen=True)
class PrefillSlice:
    q_start: int  # first row of this sequence in the step's token batch
    q_len: int  # new tokens this step
    ctx_len: int  # cached + new tokens
    row: int  # its row in the block table


@dataclass(frozen=True)
class StepLayout:
    """Where every new token of a step goes and what each sequence attends to."""

    slot_mapping: torch.Tensor  # [N] cache slot of each new token
    prefills: list[PrefillSlice]
    decode_rows: torch.Tensor  # [B] token-batch row of each decode sequence's new token
    decode_table_rows: torch.Tensor  # [B] block-table row of each decode sequence
    decode_ctx: torch.Tensor  # [B] context length (cached + the new token)
    max_decode_ctx: int
    mirror: MirrorStep | None = None  # the decode sequences' rows in the contiguous mirror, if kept
    mirror_src: torch.Tensor | None = None  # [n] cache slots of the tokens copied into the mirror
    decode_only: bool = False  # every token of the step is a decode token (decode_rows is 0..B-1)


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


class PagedAttention:
    """The ``AttentionBackend`` for one engine step."""

    def __init__(
        self,
        cache: KVCache,
        table: BlockTable,
        layout: StepLayout,
        mirror: ContiguousDecodeKV | None = None,
        kernels: CpuKernelOps | None = None,
    ) -> None:
        """``kernels``: write KV and attend decode tokens with the fused CPU kernels, which read
        the paged cache in place (no mirror, no gather)."""
        self.cache = cache
        self.layout = layout
        self.table = table
        self.mirror = mirror if layout.mirror is not None and kernels is None else None
        self.kernels = kernels
        bs = cache.block_size
        self.num_decodes = len(layout.decode_rows)
        if self.num_decodes and self.mirror is None and kernels is None:
            nb = -(-layout.max_decode_ctx // bs)
            self.decode_blocks = table.table[layout.decode_table_rows, :nb].reshape(-1)  # [B*nb]
            self.decode_span = nb * bs
            span = torch.arange(nb * bs, device=table.device)
            self.decode_mask = (span[None, :] < layout.decode_ctx[:, None])[:, None, None, :]
            # the gathered blocks of every layer land in these two buffers (no allocation per layer)
            per_block = bs * cache.k[0].shape[2] * cache.k[0].shape[3]
            self._gathered = [
                torch.empty((len(self.decode_blocks), per_block), dtype=cache.k[0].dtype, device=table.device)
                for _ in range(2)
            ]
        self.prefill_blocks = [table.table[s.row, : -(-s.ctx_len // bs)] for s in layout.prefills]
        self.row_wise = (
            RowWise(  # every token is a decode row, in order (decode_rows is 0..N-1)
                layout.slot_mapping.contiguous(),
                table.table.contiguous(),
                layout.decode_table_rows.contiguous(),
                layout.decode_ctx.contiguous(),
            )
            if kernels is not None and layout.decode_only
            else None
        )

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        lay = self.layout
        k, v = k.to(kc.dtype), v.to(vc.dtype)
        if self.kernels is not None:
            self.kernels.write_kv(k, v, kc, vc, lay.slot_mapping)
            if lay.decode_only:
                return self._decode_in_place(q, kc, vc, q.new_empty(q.shape))
        else:
            flat_k, flat_v = kc.view(-1, *kc.shape[2:]), vc.view(-1, *vc.shape[2:])
            flat_k.index_copy_(0, lay.slot_mapping, k)
            flat_v.index_copy_(0, lay.slot_mapping, v)
            if self.mirror is not None and lay.decode_only:
                return self._decode_mirrored(layer, q, k, v, flat_k, flat_v)
        out = torch.empty_like(q)
        gqa = q.shape[1] != k.shape[1]
        per_block = kc.shape[1] * kc.shape[2] * kc.shape[3]
        # index_select over whole blocks: about twice as fast on CPU as advanced indexing by slot
        block_k, block_v = kc.view(kc.shape[0], per_block), vc.view(vc.shape[0], per_block)
        hkv, d = kc.shape[2], kc.shape[3]
        for s, blocks in zip(lay.prefills, self.prefill_blocks, strict=True):
            qs = q[s.q_start : s.q_start + s.q_len].transpose(0, 1)  # [H, q, D]
            if s.q_len == s.ctx_len:  # whole sequence in this step: no cache read needed
                ks = k[s.q_start : s.q_start + s.q_len].transpose(0, 1)
                vs = v[s.q_start : s.q_start + s.q_len].transpose(0, 1)
                # 4-D, not 3-D: only a batched call takes PyTorch's flash kernel on CPU (3-D falls
                # back to the unfused math path; docs/benchmarks.md)
                o = F.scaled_dot_product_attention(qs[None], ks[None], vs[None], is_causal=True, enable_gqa=gqa)[0]
            else:
                ks = block_k.index_select(0, blocks).view(-1, hkv, d)[: s.ctx_len].transpose(0, 1).to(q.dtype)
                vs = block_v.index_select(0, blocks).view(-1, hkv, d)[: s.ctx_len].transpose(0, 1).to(q.dtype)
                # query i sits at absolute position ctx_len - q_len + i
                qpos = torch.arange(s.ctx_len - s.q_len, s.ctx_len, device=q.device)[:, None]
                mask = torch.arange(s.ctx_len, device=q.device)[None, :] <= qpos
                o = F.scaled_dot_product_attention(qs[None], ks[None], vs[None], attn_mask=mask, enable_gqa=gqa)[0]
            out[s.q_start : s.q_start + s.q_len] = o.transpose(0, 1)
        if self.num_decodes:
            # Grouped-query decode: the query heads sharing a KV head become that head's query rows
            # ([B, Hkv, group, D]; one position, so no causal mask within them): half the cost of
            # SDPA's own GQA path on CPU, and no copy of K/V per query head.
            b, hq = self.num_decodes, q.shape[1]
            if self.kernels is not None:
                return self._decode_in_place(q, kc, vc, out)
            if self.mirror is not None:
                out[lay.decode_rows] = self._decode_mirrored(layer, q, k, v, flat_k, flat_v)
                return out
            qd = q[lay.decode_rows].view(b, hkv, hq // hkv, d)
            shape = (b, self.decode_span, hkv, d)
            gk, gv = self._gathered
            torch.index_select(block_k, 0, self.decode_blocks, out=gk)
            torch.index_select(block_v, 0, self.decode_blocks, out=gv)
            kd = gk.view(shape).transpose(1, 2).to(q.dtype)  # [B, Hkv, L, D]
            vd = gv.view(shape).transpose(1, 2).to(q.dtype)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=self.decode_mask)
            out[lay.decode_rows] = o.reshape(b, hq, d)
        return out

    def _decode_in_place(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The kernels' decode attention into the decode rows of ``out`` (other rows untouched)."""
        assert self.kernels is not None
        lay = self.layout
        self.kernels.decode_attention(
            q, lay.decode_rows, kc, vc, self.table.table, lay.decode_table_rows, lay.decode_ctx, out
        )
        return out

    def _decode_mirrored(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flat_k: torch.Tensor, flat_v: torch.Tensor
    ) -> torch.Tensor:
        """Decode attention over views of the mirror, for the decode rows of the step: copy in the
        tokens it lacks (the new ones, and a prompt once), then one SDPA over its first rows; rows
        of no decode sequence get a zero query and are dropped. In the steady state (only decode
        tokens, one new token each, sequence i on row i) no gather or scatter is left."""
        lay, mirror = self.layout, self.mirror
        assert mirror is not None and lay.mirror is not None and lay.mirror_src is not None
        step = lay.mirror
        if not step.new_only:
            k, v = flat_k.index_select(0, lay.mirror_src), flat_v.index_select(0, lay.mirror_src)
        elif not lay.decode_only:
            k, v = k[lay.decode_rows], v[lay.decode_rows]
        mirror.fill(layer, step, k, v)
        hq, d = q.shape[1], q.shape[2]
        hkv = mirror.kv_heads
        kd, vd = mirror.views(layer, step)
        if lay.decode_only and step.in_order:
            o = F.scaled_dot_product_attention(q.reshape(-1, hkv, hq // hkv, d), kd, vd, attn_mask=step.mask)
            return o.reshape(-1, hq, d)
        qd = q.new_zeros((step.used_rows, hq, d))
        qd[step.rows] = q[lay.decode_rows]
        o = F.scaled_dot_product_attention(qd.view(step.used_rows, hkv, hq // hkv, d), kd, vd, attn_mask=step.mask)
        return o.reshape(step.used_rows, hq, d)[step.rows]
