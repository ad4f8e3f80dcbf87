"""Paged attention on CPU with PyTorch SDPA.

The KV cache of a layer is two flat tensors ``[num_blocks * block_size, kv_heads, head_dim]``; a
token's slot is ``block_id * block_size + offset``. Per step the runner builds one
``PagedAttention`` with the slots of every scheduled sequence; each layer then

  1. writes the new k/v into their slots,
  2. attends: decode-only sequences (one new token) together in one padded SDPA call, prefill
     chunks one sequence at a time with a causal mask offset by the tokens already cached.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SeqSlice:
    q_start: int  # first row of this sequence in the step's token batch
    q_len: int  # new tokens this step
    ctx_len: int  # cached + new tokens
    slots: torch.Tensor  # [ctx_len] slot of every context token


class KVCache:
    def __init__(
        self, num_layers: int, num_slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        shape = (num_slots, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class PagedAttention:
    """The ``AttentionBackend`` for one engine step."""

    def __init__(self, cache: KVCache, seqs: list[SeqSlice], device: torch.device) -> None:
        self.cache = cache
        self.slot_mapping = torch.cat([s.slots[s.ctx_len - s.q_len :] for s in seqs]).to(device)
        self.prefills = [s for s in seqs if s.q_len > 1 or s.ctx_len == 1]
        decodes = [s for s in seqs if not (s.q_len > 1 or s.ctx_len == 1)]
        self.decode_rows = torch.tensor([s.q_start for s in decodes], dtype=torch.long, device=device)
        if decodes:
            max_ctx = max(s.ctx_len for s in decodes)
            pad = torch.zeros((len(decodes), max_ctx), dtype=torch.long)
            mask = torch.zeros((len(decodes), max_ctx), dtype=torch.bool)
            for i, s in enumerate(decodes):
                pad[i, : s.ctx_len] = s.slots
                mask[i, : s.ctx_len] = True
            self.decode_slots = pad.to(device)
            self.decode_mask = mask[:, None, None, :].to(device)
        self.num_decodes = len(decodes)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        kc.index_copy_(0, self.slot_mapping, k.to(kc.dtype))
        vc.index_copy_(0, self.slot_mapping, v.to(vc.dtype))
        out = torch.empty_like(q)
        gqa = q.shape[1] != k.shape[1]
        for s in self.prefills:
            qs = q[s.q_start : s.q_start + s.q_len].transpose(0, 1)  # [H, q, D]
            if s.q_len == s.ctx_len:  # whole sequence in this step: no cache read needed
                ks = k[s.q_start : s.q_start + s.q_len].transpose(0, 1)
                vs = v[s.q_start : s.q_start + s.q_len].transpose(0, 1)
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa)
            else:
                ks = kc[s.slots].transpose(0, 1).to(q.dtype)
                vs = vc[s.slots].transpose(0, 1).to(q.dtype)
                # query i sits at absolute position ctx_len - q_len + i
                qpos = torch.arange(s.ctx_len - s.q_len, s.ctx_len)[:, None]
                mask = torch.arange(s.ctx_len)[None, :] <= qpos
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask.to(q.device), enable_gqa=gqa)
            out[s.q_start : s.q_start + s.q_len] = o.transpose(0, 1)
        if self.num_decodes:
            qd = q[self.decode_rows][:, :, None, :]  # [B, H, 1, D]
            kd = kc[self.decode_slots].transpose(1, 2).to(q.dtype)  # [B, Hkv, L, D]
            vd = vc[self.decode_slots].transpose(1, 2).to(q.dtype)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=self.decode_mask, enable_gqa=gqa)
            out[self.decode_rows] = o[:, :, 0, :]
        return out
