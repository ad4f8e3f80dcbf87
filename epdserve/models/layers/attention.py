"""A decoder layer's attention half: fused q/k/v projection, optional per-head q/k RMSNorm
(Qwen3), M-RoPE; the attention itself is the engine's backend (``models.base.AttentionBackend``)."""

from __future__ import annotations

import torch
from torch import nn

from epdserve.kernels.ops import LayerOps
from epdserve.models.base import AttentionBackend
from epdserve.models.config import TextConfig
from epdserve.models.layers.norm import RMSNorm


class Attention(nn.Module):
    def __init__(self, config: TextConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        # q, k and v in one matmul: at this model size a step is dominated by per-call overhead
        kv = self.num_kv_heads * self.head_dim
        self.shard_sizes = (self.num_heads * self.head_dim, kv, kv)
        self.qkv_proj = nn.Linear(hidden, sum(self.shard_sizes), bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionBackend, ops: LayerOps
    ) -> torch.Tensor:
        n, hq, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        qk = qkv[:, : (hq + hkv) * d].view(n, hq + hkv, d)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :hq]), self.k_norm(qk[:, hq:])), dim=1)
        # q and k rotate in one pass (the same elementwise math, half the calls)
        qk = ops.rotary(qk, cos, sin)
        q, k = qk.split((hq, hkv), dim=1)
        out = attention(self.layer_idx, q, k, qkv[:, (hq + hkv) * d :].view(n, hkv, d))
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))
