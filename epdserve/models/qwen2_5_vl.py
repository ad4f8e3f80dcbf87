"""Qwen2.5-VL: Qwen2-VL's language model and checkpoint names with a windowed vision tower.

What differs from Qwen2-VL is the tower:

* RMSNorm instead of LayerNorm in the blocks and the merger, and a gated SiLU MLP with biases;
* window attention: most blocks attend only within square windows of
  ``window_size // patch_size // merge`` merged tokens per side (edge windows are smaller), and the
  blocks in ``fullatt_block_indexes`` attend over each whole frame as in Qwen2-VL.

The tower reorders the patches once so that every window is a contiguous run, runs all blocks in
that order, and restores the processor's order after the merger::

    patches (processor order: merge x merge groups in raster order of merged tokens)
      ──window order──► [window 0 | window 1 | ...] per frame, frames and items in order
      ──blocks──► window blocks attend within each window, full blocks within each frame
      ──merger──► one row per merged token, still in window order ──inverse order──► processor order

Frames stay contiguous under the reordering, so the full-attention blocks need no other order.
The language model, weight loading (both checkpoint layouts, ``parts``) and prompt embedding are
Qwen2-VL's (``qwen2_vl``); video positions are in ``qwen2_5_vl_layout``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from epdserve.kernels.ops import LayerOps, TorchOps
from epdserve.models.base import Stages, run_stages
from epdserve.models.config import ConfigError, VisionConfig
from epdserve.models.layers.activation import activation
from epdserve.models.layers.norm import RMSNorm
from epdserve.models.layers.rotary import VisionRotaryEmbedding
from epdserve.models.layers.vision import (
    GridLike,
    PatchEmbed,
    PatchMerger,
    VisionBlock,
    attend_frames,
    check_patches,
    run_block,
)
from epdserve.models.qwen2_vl import Qwen2VLForConditionalGeneration
from epdserve.models.qwen2_vl_layout import grid_list

Grids = list[tuple[int, int, int]]


def window_order(grids: Grids, merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """The order that makes every attention window contiguous, and the windows' lengths.

    Returns (order over merged tokens [sum t*h*w / merge²], patches per window): merged token
    ``order[i]`` (in processor order) is the i-th in window order. ``window`` is the side of a
    window in merged tokens; windows tile each frame from its top-left corner, row by row.
    """
    orders, lengths, offset = [], [], 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        nh, nw = -(-gh // window), -(-gw // window)
        index = torch.arange(t * gh * gw).view(t, gh, gw)
        padded = F.pad(index, (0, nw * window - gw, 0, nh * window - gh), value=-1)
        windows = padded.view(t, nh, window, nw, window).permute(0, 1, 3, 2, 4).reshape(t * nh * nw, -1)
        valid = windows >= 0
        orders.append(windows[valid] + offset)
        lengths += [int(n) * merge * merge for n in valid.sum(1).tolist()]
        offset += t * gh * gw
    return torch.cat(orders), lengths


def frame_lengths(grids: Grids) -> list[int]:
    """Patches per frame: the segments of the full-attention blocks."""
    return [h * w for t, h, w in grids for _ in range(t)]


class Segments:
    """A partition of the rows into consecutive attention segments, batched by length.

    Segments of equal length attend in one batched call: the windows of an image are mostly full
    (one length), its edge windows a few others.
    """

    def __init__(self, lengths: list[int], device: torch.device) -> None:
        starts: dict[int, list[int]] = {}
        offset = 0
        for n in lengths:
            starts.setdefault(n, []).append(offset)
            offset += n
        self.total = offset
        # per length: the row indices [segments, length] of every segment of that length
        self.batches = [
            (torch.tensor(s, device=device)[:, None] + torch.arange(n, device=device)) for n, s in starts.items()
        ]

    @property
    def pairs(self) -> int:
        return sum(rows.shape[0] * rows.shape[1] ** 2 for rows in self.batches)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        """q, k, v [N, heads, D] → [N, heads, D], each row attending within its segment (its
        rows gathered; by ``ops`` where they take it, else SDPA)."""
        out = torch.empty_like(q)
        for rows in self.batches:  # [segments, length]: the segments' rows gathered as frames
            flat = rows.flatten()
            out[rows] = attend_frames(q[flat], k[flat], v[flat], rows.shape[1], ops).view(*rows.shape, *q.shape[1:])
        return out


class GatedVisionMLP(nn.Module):
    """Gated feed-forward with biases (transformers' ``Qwen2_5_VLMLP(bias=True)``)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.embed_dim, config.mlp_hidden_dim)
        self.up_proj = nn.Linear(config.embed_dim, config.mlp_hidden_dim)
        self.down_proj = nn.Linear(config.mlp_hidden_dim, config.embed_dim)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        # (the block passes every MLP the layer ops; this one has no op the kernels fuse)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def vision_rms_norm(size: int) -> nn.Module:
    """The tower's norm: RMSNorm in the blocks and in front of the merger."""
    return RMSNorm(size, eps=1e-6)


class Qwen2_5_VisionTower(nn.Module):
    """The windowed ViT encoder: patches of any number of images/videos → one embedding per merged token."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        window = config.window_size // config.patch_size // config.spatial_merge_size
        if window < 1:
            raise ConfigError(
                f"window_size {config.window_size} is smaller than one merged token "
                f"({config.patch_size * config.spatial_merge_size} pixels)"
            )
        bad = [i for i in config.fullatt_block_indexes if not 0 <= i < config.depth]
        if bad:
            raise ConfigError(f"fullatt_block_indexes {bad} are not blocks of a depth-{config.depth} tower")
        self.config = config
        self.window = window  # side of an attention window, in merged tokens
        self.full_attention = frozenset(config.fullatt_block_indexes)
        self.patch_embed = PatchEmbed(config)
        self.rotary = VisionRotaryEmbedding(config)
        self.blocks = nn.ModuleList(
            VisionBlock(config, norm=vision_rms_norm, mlp=GatedVisionMLP) for _ in range(config.depth)
        )
        self.merger = PatchMerger(config, norm=vision_rms_norm)
        self.ops: LayerOps = TorchOps()  # its runner may swap in the fused CPU kernels (kernels.ops)

    def forward(self, pixel_values: torch.Tensor, grid_thw: GridLike) -> torch.Tensor:
        """pixel_values [P, patch_dim] of n items concatenated, grid_thw [n, 3] in patches
        → [sum t*h*w / merge², out_hidden_size], the items' embeddings concatenated in order."""
        return run_stages(self.stages(pixel_values, grid_thw))

    def stages(self, pixel_values: torch.Tensor, grid_thw: GridLike, within_blocks: bool = False) -> Stages:
        """``forward``, pausing after each block (and within blocks: ``VisionBlock``'s stages)."""
        grids = grid_list(grid_thw)
        check_patches(self.config, pixel_values, grids)
        unit = self.config.spatial_merge_size**2  # patches per merged token: they move together
        order, window_lengths = window_order(grids, self.config.spatial_merge_size, self.window)
        order = order.to(pixel_values.device)

        def windowed(y: torch.Tensor) -> torch.Tensor:
            return y.view(-1, unit, y.shape[-1])[order].view(y.shape)

        x = windowed(self.patch_embed(pixel_values))
        cos, sin = (windowed(y) for y in self.rotary(grids))
        windows = Segments(window_lengths, x.device)
        frames = Segments(frame_lengths(grids), x.device)
        for i, block in enumerate(self.blocks):
            segments = frames if i in self.full_attention else windows
            x = yield from run_block(block, within_blocks, x, cos, sin, segments, self.ops)
            yield
        merged = self.merger(x)
        out = torch.empty_like(merged)
        out[order] = merged  # back to processor order
        return out


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2-VL's model with the windowed tower; the checkpoints name every tensor alike."""

    vision_tower_class = Qwen2_5_VisionTower
