"""Qwen3-VL: its vision tower with DeepStack, and Qwen2-VL's language model in its Qwen3 form.

Data flow of one request::

    pixel patches [P, 1536] ──Qwen3VisionTower──► features [P/4, levels * H]
        = merger(last block) | deepstack_merger_0(block i0) | deepstack_merger_1(block i1) | ...
                                     │ the first H columns are spliced at the placeholder tokens,
                                     │ level k ≥ 1 is added to the placeholder rows after LM layer k-1
    token ids ──embed_tokens──► embeddings ──Qwen2LanguageModel(..., deepstack)──► hidden

The tower differs from Qwen2-VL's in its patch embedding (with a bias), a learned position table
(a square grid, bilinearly resampled to each item's grid) added to the patch embeddings, gelu-tanh
MLPs named ``linear_fc1/linear_fc2``, and the DeepStack mergers. The language model is
``layers.decoder.Qwen2LanguageModel`` with the options Qwen3 sets in ``TextConfig``: per-head q/k
RMSNorm, an explicit head_dim, no q/k/v bias and interleaved M-RoPE.

One tensor per media item carries every feature level side by side, so whatever moves embeddings
(EC connectors, caches, stores) moves Qwen3-VL's unchanged; the wire header says how many levels a
payload holds (``transfer.header``) and the engine splits them (``engine.model_runner``).
"""

from __future__ import annotations

import torch
from torch import nn

from epdserve.kernels.ops import LayerOps, TorchOps
from epdserve.models.base import Stages, run_stages
from epdserve.models.config import VisionConfig
from epdserve.models.layers.rotary import VisionRotaryEmbedding, merge_window_hw
from epdserve.models.layers.vision import FrameRuns, GridLike, PatchEmbed, VisionBlock, check_patches, run_block
from epdserve.models.qwen2_vl import Qwen2VLForConditionalGeneration
from epdserve.models.qwen2_vl_layout import MediaPlaceholderError, grid_list


class Qwen3PatchMerger(nn.Module):
    """Folds each merge x merge window of patches into one LM token. The main merger normalizes
    each patch before the fold, the DeepStack mergers the folded vector (``postshuffle``)."""

    def __init__(self, config: VisionConfig, postshuffle: bool) -> None:
        super().__init__()
        self.merged_dim = config.merged_dim
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(config.merged_dim if postshuffle else config.embed_dim, eps=1e-6)
        self.linear_fc1 = nn.Linear(config.merged_dim, config.merged_dim)
        self.act = nn.GELU()
        self.linear_fc2 = nn.Linear(config.merged_dim, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.merged_dim)) if self.postshuffle else self.norm(x).view(-1, self.merged_dim)
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3VisionTower(nn.Module):
    """The ViT encoder: patches of any number of items → [tokens, feature_levels * H] per merged
    token, the merger's output followed by each DeepStack level's."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        if config.num_position_embeddings < 1:
            raise MediaPlaceholderError("Qwen3-VL's vision config needs num_position_embeddings")
        self.config = config
        self.side = round(config.num_position_embeddings**0.5)  # the learned table is side x side
        self.patch_embed = PatchEmbed(config, bias=True)
        # given its weight, Embedding skips its random init (see Qwen2LanguageModel)
        n = config.num_position_embeddings
        self.pos_embed = nn.Embedding(n, config.embed_dim, _weight=torch.empty(n, config.embed_dim))
        self.rotary = VisionRotaryEmbedding(config)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = Qwen3PatchMerger(config, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3PatchMerger(config, postshuffle=True) for _ in config.deepstack_visual_indexes
        )
        self.ops: LayerOps = TorchOps()  # its runner may swap in the fused CPU kernels (kernels.ops)

    def position_embeddings(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """The learned table resampled to each grid (bilinear, corners aligned: transformers'
        ``fast_pos_embed_interpolate``), [P, embed_dim] in fp32, in processor order."""
        side, merge, device = self.side, self.config.spatial_merge_size, self.pos_embed.weight.device
        table = self.pos_embed.weight.float()
        out = []
        for t, h, w in grids:
            rows, cols = merge_window_hw(h, w, merge)
            taps = []
            for index, size in ((rows, h), (cols, w)):
                src = index.to(device, torch.float32) * (side - 1) / max(size - 1, 1)
                lo = src.floor()
                frac = src - lo
                lo_i = lo.long()
                hi_i = (lo_i + 1).clamp(max=side - 1)
                taps.append((lo_i, hi_i, frac))
            (r0, r1, fr), (c0, c1, fc) = taps
            emb = (
                table[r0 * side + c0] * ((1 - fr) * (1 - fc))[:, None]
                + table[r0 * side + c1] * ((1 - fr) * fc)[:, None]
                + table[r1 * side + c0] * (fr * (1 - fc))[:, None]
                + table[r1 * side + c1] * (fr * fc)[:, None]
            )
            out.append(emb.repeat(t, 1))
        return torch.cat(out)

    def forward(self, pixel_values: torch.Tensor, grid_thw: GridLike) -> torch.Tensor:
        """pixel_values [P, patch_dim] of n items concatenated, grid_thw [n, 3] in patches
        → [sum t*h*w / merge², feature_levels * out_hidden_size], the items' rows in order."""
        return run_stages(self.stages(pixel_values, grid_thw))

    def stages(self, pixel_values: torch.Tensor, grid_thw: GridLike, within_blocks: bool = False) -> Stages:
        """``forward``, pausing after each block (and within blocks: ``VisionBlock``'s stages)."""
        grids = grid_list(grid_thw)
        check_patches(self.config, pixel_values, grids)
        x = self.patch_embed(pixel_values)
        x = x + self.position_embeddings(grids).to(x.dtype)
        cos, sin = self.rotary(grids)
        levels: list[torch.Tensor] = []
        taps = self.config.deepstack_visual_indexes
        frames = FrameRuns(grids)
        for i, block in enumerate(self.blocks):
            x = yield from run_block(block, within_blocks, x, cos, sin, frames, self.ops)
            if i in taps:
                levels.append(self.deepstack_merger_list[taps.index(i)](x))
            yield
        return torch.cat([self.merger(x), *levels], dim=1)


class Qwen3VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen3-VL's parts: ``visual`` (its tower, DeepStack levels in the output's width) and/or
    ``language_model`` (which takes the DeepStack levels in its forward)."""

    vision_tower_class = Qwen3VisionTower

    @classmethod
    def map_checkpoint_name(cls, name: str) -> tuple[str, int | None] | None:
        mapped = super().map_checkpoint_name(name)
        if mapped is not None and mapped[0].startswith("visual.blocks.") and ".mlp.linear_fc" in mapped[0]:
            # the blocks are Qwen2-VL's (fc1/fc2); only their MLP's names differ
            return mapped[0].replace(".mlp.linear_fc", ".mlp.fc"), mapped[1]
        return mapped
