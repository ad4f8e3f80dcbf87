"""Paged attention for one engine step, on the decode path the engine chose (``decode_path``).

Per step the runner builds one ``PagedAttention``; each layer then

  1. writes the new k/v into their slots of the paged cache (``kv_cache``),
  2. attends: all decode rows together in one call — the kernels', reading their blocks in place
     (with the kernels, the tokens of a short prompt chunk are rows of that same call, each over
     its causal prefix), or one padded SDPA over views of the contiguous mirror of the decoding
     sequences' KV (``contiguous_kv``); no Python loop over sequences per layer. The other
     prompt chunks go one sequence at a time through SDPA with a causal mask offset by the
     tokens already cached.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from epdserve.engine.kv_cache import BlockTable, KVCache
from epdserve.kernels.fused import RowWise

if TYPE_CHECKING:
    from epdserve.engine.contiguous_kv import MirrorStep
    from epdserve.engine.decode_path import DecodePath


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
    mirror: MirrorStep | None = None  # the decode sequences' rows in the contiguous mirror (torch path)
    mirror_src: torch.Tensor | None = None  # [n] cache slots of the tokens copied into the mirror
    decode_only: bool = False  # every token of the step is a decode token (decode_rows is 0..B-1)


class PagedAttention:
    """The ``AttentionBackend`` for one engine step."""

    def __init__(self, cache: KVCache, table: BlockTable, layout: StepLayout, path: DecodePath) -> None:
        self.cache = cache
        self.layout = layout
        self.table = table
        self.kernels = path.kernels
        self.mirror = path.mirror if layout.mirror is not None and path.kernels is None else None
        self.num_decodes = len(layout.decode_rows)
        if self.num_decodes and self.kernels is None and self.mirror is None:
            raise ValueError("decode rows on the torch path need the step's rows in the mirror (layout.mirror)")
        bs = cache.block_size
        self.prefill_blocks = [table.table[s.row, : -(-s.ctx_len // bs)] for s in layout.prefills]
        self.row_wise = (
            RowWise(  # every token is a decode row, in order (decode_rows is 0..N-1)
                layout.slot_mapping.contiguous(),
                table.table.contiguous(),
                layout.decode_table_rows.contiguous(),
                layout.decode_ctx.contiguous(),
            )
            if self.kernels is not None and layout.decode_only
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
            kc.view(-1, *kc.shape[2:]).index_copy_(0, lay.slot_mapping, k)
            vc.view(-1, *vc.shape[2:]).index_copy_(0, lay.slot_mapping, v)
            if lay.decode_only:
                return self._decode_mirrored(layer, q, k, v, kc, vc)
        out = torch.empty_like(q)
        self._prefill(q, k, v, kc, vc, out)
        if self.num_decodes:
            if self.kernels is not None:
                return self._decode_in_place(q, kc, vc, out)
            out[lay.decode_rows] = self._decode_mirrored(layer, q, k, v, kc, vc)
        return out

    def _prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, out: torch.Tensor
    ) -> None:
        """Each prompt chunk's attention over its sequence so far, one sequence at a time, into
        its rows of ``out``: the kernels' where they take it, else SDPA."""
        gqa = q.shape[1] != k.shape[1]
        per_block = kc.shape[1] * kc.shape[2] * kc.shape[3]
        # index_select over whole blocks: about twice as fast on CPU as advanced indexing by slot
        block_k, block_v = kc.view(kc.shape[0], per_block), vc.view(vc.shape[0], per_block)
        hkv, d = kc.shape[2], kc.shape[3]
        for s, blocks in zip(self.layout.prefills, self.prefill_blocks, strict=True):
            rows = slice(s.q_start, s.q_start + s.q_len)
            whole = s.q_len == s.ctx_len  # whole sequence in this step: no cache read needed
            if whole:
                ks, vs = k[rows], v[rows]
            else:
                ks = block_k.index_select(0, blocks).view(-1, hkv, d)[: s.ctx_len].to(q.dtype)
                vs = block_v.index_select(0, blocks).view(-1, hkv, d)[: s.ctx_len].to(q.dtype)
            fused = self.kernels.causal_attention(q[rows], ks, vs) if self.kernels is not None else None
            if fused is not None:
                out[rows] = fused
                continue
            qs, ks, vs = q[rows].transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1)  # [H, n, D]
            if whole:
                # 4-D, not 3-D: only a batched call takes PyTorch's flash kernel on CPU (3-D falls
                # back to the unfused math path; docs/benchmarks.md)
                o = F.scaled_dot_product_attention(qs[None], ks[None], vs[None], is_causal=True, enable_gqa=gqa)[0]
            else:
                # query i sits at absolute position ctx_len - q_len + i
                qpos = torch.arange(s.ctx_len - s.q_len, s.ctx_len, device=q.device)[:, None]
                mask = torch.arange(s.ctx_len, device=q.device)[None, :] <= qpos
                o = F.scaled_dot_product_attention(qs[None], ks[None], vs[None], attn_mask=mask, enable_gqa=gqa)[0]
            out[rows] = o.transpose(0, 1)

    def _decode_in_place(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The kernels' decode attention into the decode rows of ``out`` (other rows untouched)."""
        assert self.kernels is not None
        lay = self.layout
        self.kernels.decode_attention(
            q, lay.decode_rows, kc, vc, self.table.table, lay.decode_table_rows, lay.decode_ctx, out
        )
        return out

    def _decode_mirrored(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor
    ) -> torch.Tensor:
        """Decode attention over views of the mirror, for the decode rows of the step: copy in the
        tokens it lacks (the new ones, and a prompt once), then one SDPA over its first rows; rows
        of no decode sequence get a zero query and are dropped. In the steady state (only decode
        tokens, one new token each, sequence i on row i) no gather or scatter is left.

        Grouped-query: the query heads sharing a KV head become that head's query rows
        ([B, Hkv, group, D]; one position, so no causal mask within them): half the cost of
        SDPA's own GQA path on CPU, and no copy of K/V per query head."""
        lay, mirror = self.layout, self.mirror
        assert mirror is not None and lay.mirror is not None and lay.mirror_src is not None
        step = lay.mirror
        if not step.new_only:
            flat_k, flat_v = kc.view(-1, *kc.shape[2:]), vc.view(-1, *vc.shape[2:])
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
