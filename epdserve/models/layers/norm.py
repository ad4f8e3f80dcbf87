"""RMSNorm with a learned scale (the arithmetic is ``kernels.ops.rms_norm``, shared with the kernels)."""

from __future__ import annotations

import torch
from torch import nn

from epdserve.kernels.ops import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
