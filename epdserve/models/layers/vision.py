"""The parts of a ViT vision tower the families share: patch embedding, attention within
segments of the patch rows (frames, or Qwen2.5-VL's windows), the pre-norm block and the merger.

A family's tower composes them (``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl``); what a block attends
within is the tower's choice, passed per call as an ``AttentionSegments``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from epdserve.kernels.ops import LayerOps
from epdserve.models.base import Stages
from epdserve.models.config import VisionConfig
from epdserve.models.layers.activation import activation
from epdserve.models.qwen2_vl_layout import MediaPlaceholderError

GridLike = torch.Tensor | Sequence[Sequence[int]]
Grids = list[tuple[int, int, int]]

# the most multiply-adds a block run in stages (an engine's large image, ``engine.vision_slices``)
# does without a pause: its attention in groups of heads, its MLP in groups of rows, within this
STAGE_MACS = 1 << 36


class PatchEmbed(nn.Module):
    """Linear projection of flattened patches.

    The checkpoint stores a Conv3d whose kernel equals its stride and the patch size, applied to
    one patch at a time: that is a matrix product with the flattened kernel, which is cheaper and
    takes the processor's flat patches as they are. The family's ``load_weights`` flattens the
    kernel.
    """

    def __init__(self, config: VisionConfig, bias: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(config.patch_dim, config.embed_dim, bias=bias)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches.to(self.proj.weight.dtype))


def check_patches(c: VisionConfig, pixel_values: torch.Tensor, grids: Grids) -> None:
    """MediaPlaceholderError unless ``pixel_values`` are the flat patches of ``grids``."""
    if pixel_values.ndim != 2 or pixel_values.shape[1] != c.patch_dim:
        raise MediaPlaceholderError(f"pixel_values must be [patches, {c.patch_dim}], got {list(pixel_values.shape)}")
    for t, h, w in grids:
        if t < 1 or h < 1 or w < 1 or h % c.spatial_merge_size or w % c.spatial_merge_size:
            raise MediaPlaceholderError(
                f"grid {(t, h, w)} must be positive with h and w multiples of {c.spatial_merge_size}"
            )
    expected = sum(t * h * w for t, h, w in grids)
    if pixel_values.shape[0] != expected:
        raise MediaPlaceholderError(f"grids describe {expected} patches, pixel_values has {pixel_values.shape[0]}")


class AttentionSegments(Protocol):
    """A partition of a tower's patch rows into the groups that attend among themselves."""

    @property
    def pairs(self) -> int:
        """(query, key) pairs of the attention: each segment's length squared, summed."""
        ...

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        """q, k, v [N, heads, D] → [N, heads * D] (or [N, heads, D]), each row attending within
        its segment, bidirectionally (by ``ops`` where they take it)."""
        ...


def frame_runs(grids: Grids) -> list[tuple[int, int]]:
    """The frames of consecutive items as runs of equal size: (frames, patches per frame) each.
    Attention stays within a frame, so a run is one batched call, however many items it spans."""
    runs: list[tuple[int, int]] = []
    for t, h, w in grids:
        if runs and runs[-1][1] == h * w:
            runs[-1] = (runs[-1][0] + t, h * w)
        else:
            runs.append((t, h * w))
    return runs


class FrameRuns:
    """Attention within each frame of each media item, never across them; the rows are in
    processor order, so every frame is a contiguous run and needs no gather."""

    def __init__(self, grids: Grids) -> None:
        self.runs = frame_runs(grids)

    @property
    def pairs(self) -> int:
        return sum(frames * size * size for frames, size in self.runs)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        outs, start = [], 0
        for frames, size in self.runs:
            # frames of one size (of one item or of consecutive items) attend in one call
            end = start + frames * size
            outs.append(attend_frames(q[start:end], k[start:end], v[start:end], size, ops).flatten(1))
            start = end
        return outs[0] if len(outs) == 1 else torch.cat(outs)


def attend_frames(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int, ops: LayerOps) -> torch.Tensor:
    """q, k, v [frames · n, heads, D], each run of n rows a frame → [frames · n, heads, D], every row
    attending over its frame: by ``ops`` where they take it, else SDPA over [frames, heads, n, D]."""
    fused = ops.frame_attention(q, k, v, n)
    if fused is not None:
        return fused
    rows, heads, d = q.shape
    qf, kf, vf = (y.reshape(rows // n, n, heads, d).transpose(1, 2) for y in (q, k, v))
    return F.scaled_dot_product_attention(qf, kf, vf).transpose(1, 2).reshape(rows, heads, d)


def rotated_qkv(
    qkv: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor, ops: LayerOps
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [N, heads, D] of a fused projection [N, 3 * heads * D], q and k rotated in float32
    like the reference (bfloat16 angles lose the position of far patches), both in one call."""
    parts = qkv.view(qkv.shape[0], 3, heads, head_dim)
    qk = ops.rotary_f32(parts[:, :2].flatten(1, 2), cos, sin)
    return qk[:, :heads], qk[:, heads:], parts[:, 2]


class VisionAttention(nn.Module):
    """Bidirectional attention within the segments it is given (frames or windows)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(config.embed_dim, 3 * config.embed_dim, bias=True)
        self.proj = nn.Linear(config.embed_dim, config.embed_dim, bias=True)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: AttentionSegments, ops: LayerOps
    ) -> torch.Tensor:
        q, k, v = rotated_qkv(self.qkv(x), self.num_heads, self.head_dim, cos, sin, ops)
        return self.proj(segments.attend(q, k, v, ops).reshape(x.shape[0], -1))


class VisionMLP(nn.Module):
    """fc1, activation, fc2 (Qwen2-VL's and, renamed, Qwen3-VL's)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.embed_dim, config.mlp_hidden_dim)
        self.fc2 = nn.Linear(config.mlp_hidden_dim, config.embed_dim)
        self.act = activation(config.hidden_act)
        self.quick_gelu = config.hidden_act == "quick_gelu"  # fused by the kernels

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(ops.quick_gelu(h) if self.quick_gelu else self.act(h))


def layer_norm(size: int) -> nn.Module:
    """The towers' LayerNorm (Qwen2-VL, Qwen3-VL)."""
    return nn.LayerNorm(size, eps=1e-6)


class VisionBlock(nn.Module):
    """Pre-norm transformer block of the ViT; the norm and MLP are the family's."""

    def __init__(
        self,
        config: VisionConfig,
        norm: Callable[[int], nn.Module] = layer_norm,
        mlp: Callable[[VisionConfig], nn.Module] = VisionMLP,
    ) -> None:
        super().__init__()
        self.norm1 = norm(config.embed_dim)
        self.norm2 = norm(config.embed_dim)
        self.attn = VisionAttention(config)
        self.mlp = mlp(config)
        self.row_macs = 3 * config.embed_dim * config.mlp_hidden_dim  # the MLP's per row, gated or not

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        segments: AttentionSegments,
        ops: LayerOps,
        staged: bool = False,
    ) -> torch.Tensor | Stages:
        """The block's output; ``staged``: the same as ``Stages`` that pause within the block, its
        attention and MLP in parts of ``STAGE_MACS`` at most (through ``__call__``, so that the
        hooks on the block still run before it)."""
        if staged:
            return self._stages(x, cos, sin, segments, ops)
        x = x + self.attn(self.norm1(x), cos, sin, segments, ops)
        return x + self.mlp(self.norm2(x), ops)

    def _stages(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: AttentionSegments, ops: LayerOps
    ) -> Stages:
        a, rows = self.attn, x.shape[0]
        q, k, v = rotated_qkv(a.qkv(self.norm1(x)), a.num_heads, a.head_dim, cos, sin, ops)
        v = v.contiguous()  # held across pauses: v's rows alone, not the whole fused projection
        per_head = 2 * segments.pairs * a.head_dim
        # a group of heads within the bound, but of a head per thread at least: the attention of a
        # frame spreads over its heads
        fewest = min(a.num_heads, torch.get_num_threads())
        divisors = [g for g in range(1, a.num_heads + 1) if a.num_heads % g == 0]
        within = [g for g in divisors if g * per_head <= STAGE_MACS]
        group = max([min(g for g in divisors if g >= fewest), *within])
        heads = []
        for h in range(0, a.num_heads, group):
            yield
            heads.append(
                segments.attend(q[:, h : h + group], k[:, h : h + group], v[:, h : h + group], ops).reshape(rows, -1)
            )
        x = x + a.proj(torch.cat(heads, dim=1))
        del q, k, v, heads  # not held across the MLP's pauses
        step = max(1, STAGE_MACS // self.row_macs)
        out = torch.empty_like(x)
        for r in range(0, rows, step):
            yield
            part = x[r : r + step]
            out[r : r + step] = part + self.mlp(self.norm2(part), ops)
        return out


def run_block(block: nn.Module, within: bool, *args: object) -> Stages:
    """``block`` on ``args`` as stages: pausing within it (``within``), else in one call."""
    if within:
        return (yield from block(*args, staged=True))
    return block(*args)


class PatchMerger(nn.Module):
    """Folds each merge x merge window of patches (adjacent rows in processor order) into one LM token."""

    def __init__(self, config: VisionConfig, norm: Callable[[int], nn.Module] = layer_norm) -> None:
        super().__init__()
        self.merged_dim = config.merged_dim
        self.ln_q = norm(config.embed_dim)
        # a Sequential only so that the parameter names equal the checkpoint's (mlp.0, mlp.2)
        self.mlp = nn.Sequential(
            nn.Linear(config.merged_dim, config.merged_dim),
            nn.GELU(),
            nn.Linear(config.merged_dim, config.out_hidden_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged_dim))
