"""Reference attention backends for one sequence, without paging.

``DenseCausalAttention`` attends over exactly the tokens of the call (a whole prompt);
``DenseKVCache`` keeps each layer's keys and values so that a sequence can be prefilled and then
decoded token by token. Both are the oracle for the engine's paged backend and serve tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [N, Hq, D] for the last N of the T tokens in k/v [T, Hkv, D] → [N, Hq, D], causal."""
    n, t = q.shape[0], k.shape[0]
    # query i sits at absolute index t - n + i and may see keys up to there (bottom-right aligned)
    mask = torch.ones(n, t, dtype=torch.bool, device=q.device).tril(diagonal=t - n)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, enable_gqa=True
    )
    return out.transpose(0, 1)


class DenseCausalAttention:
    """All tokens of one sequence in a single call; nothing is kept between calls."""

    row_wise = None  # attends every token itself: no fused stack

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _attend(q, k, v)


class DenseKVCache:
    """One sequence whose keys/values grow with every call (prefill, then decode steps)."""

    def __init__(self) -> None:
        self._keys: dict[int, torch.Tensor] = {}
        self._values: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        """Tokens cached so far (per layer; all layers see the same tokens)."""
        return 0 if not self._keys else next(iter(self._keys.values())).shape[0]

    row_wise = None  # attends every token itself: no fused stack

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if layer in self._keys:
            k = torch.cat((self._keys[layer], k))
            v = torch.cat((self._values[layer], v))
        self._keys[layer], self._values[layer] = k, v
        return _attend(q, k, v)
