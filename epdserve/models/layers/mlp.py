"""A decoder layer's feed-forward half: SwiGLU (or another gated activation)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from epdserve.kernels.ops import LayerOps
from epdserve.models.config import TextConfig
from epdserve.models.layers.activation import activation


class MLP(nn.Module):
    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        # gate and up in one matmul (see attention.Attention)
        self.shard_sizes = (config.intermediate_size, config.intermediate_size)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act is F.silu:
            return self.down_proj(ops.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)
