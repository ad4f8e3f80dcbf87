"""Rotary position embeddings: M-RoPE for the language model, 2-D rotary for vision towers.

Neither table is stored in checkpoints: the loader calls ``init_rotary_buffers`` once the model
has real storage.
"""

from __future__ import annotations

import torch
from torch import nn

from epdserve.models.config import TextConfig, VisionConfig


def merge_window_hw(h: int, w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) patch coordinates of one frame in the order the processor emits patches.

    The processor groups the merge x merge patches that the merger folds into one token next to
    each other, so the order is (h/merge, w/merge, merge, merge), not raster order.
    """
    rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
    cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
    return rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()


class VisionRotaryEmbedding(nn.Module):
    """2D rotary embedding: the first half of each head rotates by the patch row, the second by the column."""

    inv_freq: torch.Tensor

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", torch.empty(config.head_dim // 4), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        """(Re)compute the inverse frequencies; they are not stored in checkpoints."""
        if self.inv_freq.is_meta:  # built on the meta device: the loader calls this after to_empty
            return  # (a meta arange would import torch's compiler stack: seconds of startup)
        dim = self.config.head_dim // 2  # rotary width given to each of h and w
        steps = torch.arange(0, dim, 2, dtype=torch.float32, device=self.inv_freq.device)
        self.inv_freq = 1.0 / (self.config.rope_theta ** (steps / dim))

    def forward(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [P, head_dim] in fp32 for all patches of ``grids``, in processor order."""
        merge = self.config.spatial_merge_size
        rows, cols = [], []
        for t, h, w in grids:
            r, c = merge_window_hw(h, w, merge)
            rows.append(r.repeat(t))
            cols.append(c.repeat(t))
        device = self.inv_freq.device
        freq_h = torch.cat(rows).to(device)[:, None].float() * self.inv_freq
        freq_w = torch.cat(cols).to(device)[:, None].float() * self.inv_freq
        half = torch.cat((freq_h, freq_w), dim=-1)
        angles = torch.cat((half, half), dim=-1)
        return angles.cos(), angles.sin()


class MRotaryEmbedding(nn.Module):
    """Multimodal rotary embedding: each frequency pair rotates by one of the (t, h, w) position rows.

    ``mrope_section`` gives each row its number of frequency pairs. Qwen2-VL splits the head_dim/2
    pairs into consecutive groups (group i uses row i % 3); interleaved M-RoPE (Qwen3-VL) cycles
    t, h, w over the low frequencies, pair j using row j % 3 while that row has pairs left, and row
    t for the rest. For text all three rows are equal and this is plain RoPE.
    """

    inv_freq: torch.Tensor
    freq_rows: torch.Tensor

    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        self.config = config
        half = config.head_dim // 2
        self.register_buffer("inv_freq", torch.empty(half), persistent=False)
        self.register_buffer("freq_rows", torch.empty(half, dtype=torch.long), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        """(Re)compute the inverse frequencies and their position rows; they are not in checkpoints."""
        c, device = self.config, self.inv_freq.device
        if self.inv_freq.is_meta:  # see VisionRotaryEmbedding.init_buffers
            return
        steps = torch.arange(0, c.head_dim, 2, dtype=torch.float32, device=device)
        self.inv_freq = 1.0 / (c.rope_theta ** (steps / c.head_dim))
        if c.mrope_interleaved:
            # transformers' apply_interleaved_mrope: pair j is h (j % 3 == 1) or w (j % 3 == 2)
            # while j < 3 * that row's section, t otherwise
            rows = [j % 3 if j % 3 and j < 3 * c.mrope_section[j % 3] else 0 for j in range(c.head_dim // 2)]
        else:
            rows = [i % 3 for i, size in enumerate(c.mrope_section) for _ in range(size)]
        self.freq_rows = torch.tensor(rows, dtype=torch.long, device=device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [3, N] → cos, sin [N, head_dim] in ``dtype``."""
        pos = positions.to(self.inv_freq.device)[self.freq_rows]  # [head_dim/2, N]
        half = pos.T.float() * self.inv_freq
        angles = torch.cat((half, half), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def init_rotary_buffers(model: nn.Module) -> None:
    """Recompute every rotary table of ``model`` (after the loader gave it real storage)."""
    for module in model.modules():
        if isinstance(module, VisionRotaryEmbedding | MRotaryEmbedding):
            module.init_buffers()
