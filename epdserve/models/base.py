"""Interfaces between model code and the engine.

The model never sees paging: each attention layer hands its projected q/k/v to an
``AttentionBackend`` supplied per step by the engine's model runner, which writes k/v into the
paged cache and attends over each sequence's context.
"""

from __future__ import annotations

from typing import Protocol

import torch


class AttentionBackend(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [N, Hq, D], k/v: [N, Hkv, D] for the N new tokens of this step (all sequences
        concatenated, in scheduling order, positional rotation already applied).
        Returns the attention output [N, Hq, D] (causal within each sequence, over its cached
        context plus the new tokens)."""
        ...
