"""Qwen2-VL: its vision tower, checkpoint name mapping and prompt embedding; the layers are shared.

Data flow of one request::

    pixel patches [P, 1176] ──Qwen2VisionTower──► media embeddings [P/4, H]
                                                          │ spliced at the placeholder tokens
    token ids [N] ──embed_tokens──► embeddings [N, H] ◄───┘
    token ids + grids ──mrope_positions (qwen2_vl_layout)──► positions [3, N]
    embeddings, positions ──Qwen2LanguageModel(attention backend)──► hidden [N, H] ──compute_logits──►

The vision tower and the language model are independent modules so that an encoder process builds
only the first and a prefill/decode process only the second (``Qwen2VLForConditionalGeneration``
takes the set of parts to build). Both are built from ``models.layers``; Qwen2.5-VL and Qwen3-VL
subclass the whole model and swap the tower (and the names their checkpoints spell otherwise).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from epdserve.kernels.ops import LayerOps, TorchOps
from epdserve.models.base import Stages, run_stages
from epdserve.models.config import ALL_PARTS, ModelConfig, VisionConfig
from epdserve.models.layers.decoder import Qwen2LanguageModel
from epdserve.models.layers.rotary import VisionRotaryEmbedding, init_rotary_buffers
from epdserve.models.layers.vision import (
    FrameRuns,
    GridLike,
    PatchEmbed,
    PatchMerger,
    VisionBlock,
    check_patches,
    run_block,
)
from epdserve.models.qwen2_vl_layout import MediaPlaceholderError, grid_list
from epdserve.models.weights import FUSED_PROJECTIONS, load_checkpoint


class Qwen2VisionTower(nn.Module):
    """The ViT encoder: patches of any number of images/videos → one embedding per merged token."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.rotary = VisionRotaryEmbedding(config)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)
        self.ops: LayerOps = TorchOps()  # its runner may swap in the fused CPU kernels (kernels.ops)

    def forward(self, pixel_values: torch.Tensor, grid_thw: GridLike) -> torch.Tensor:
        """pixel_values [P, patch_dim] of n items concatenated, grid_thw [n, 3] in patches
        → [sum t*h*w / merge², out_hidden_size], the items' embeddings concatenated in order."""
        return run_stages(self.stages(pixel_values, grid_thw))

    def stages(self, pixel_values: torch.Tensor, grid_thw: GridLike, within_blocks: bool = False) -> Stages:
        """``forward``, pausing after each block (and within blocks: ``VisionBlock``'s stages)."""
        grids = grid_list(grid_thw)
        check_patches(self.config, pixel_values, grids)
        x = self.patch_embed(pixel_values)
        cos, sin = self.rotary(grids)
        frames = FrameRuns(grids)
        for block in self.blocks:
            x = yield from run_block(block, within_blocks, x, cos, sin, frames, self.ops)
            yield
        return self.merger(x)


# checkpoint prefix → our prefix, first match wins. transformers 5 in memory uses
# model.visual / model.language_model; the hub checkpoints (and transformers' save) use visual / model.
_NAME_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model.visual.", "visual."),
    ("model.language_model.", "language_model."),
    ("visual.", "visual."),
    ("model.", "language_model."),
    ("lm_head.", "language_model.lm_head."),
)


def map_checkpoint_name(name: str) -> tuple[str, int | None] | None:
    """Checkpoint tensor name → (our parameter, row-slice index for fused parameters, else None).

    ``model.layers.0.self_attn.k_proj.bias`` → (``language_model.layers.0.self_attn.qkv_proj.bias``, 1).
    """
    for theirs, ours in _NAME_PREFIXES:
        if name.startswith(theirs):
            parts = (ours + name[len(theirs) :]).split(".")
            if ours.startswith("language_model") and len(parts) >= 3 and parts[-2] in FUSED_PROJECTIONS:
                fused, index = FUSED_PROJECTIONS[parts[-2]]
                return ".".join([*parts[:-2], fused, parts[-1]]), index
            return ".".join(parts), None
    return None


def _flat_patch_kernel(ours: str, tensor: torch.Tensor) -> torch.Tensor:
    """The checkpoint's Conv3d patch kernel as the flat matrix ``PatchEmbed`` multiplies by."""
    return tensor.reshape(tensor.shape[0], -1) if ours == "visual.patch_embed.proj.weight" else tensor


class Qwen2VLForConditionalGeneration(nn.Module):
    """Holds the parts a process needs: ``visual`` (vision tower) and/or ``language_model``."""

    # a later family with Qwen2-VL's language model and checkpoint names swaps only the tower
    vision_tower_class: type[nn.Module] = Qwen2VisionTower

    def __init__(self, config: ModelConfig, parts: frozenset[str] = ALL_PARTS) -> None:
        super().__init__()
        unknown = set(parts) - ALL_PARTS
        if unknown or not parts:
            raise ValueError(f"parts must be a non-empty subset of {sorted(ALL_PARTS)}, got {sorted(parts)}")
        self.config = config
        self.parts = frozenset(parts)
        self.visual = self.vision_tower_class(config.vision_config) if "vision" in parts else None
        self.language_model = Qwen2LanguageModel(config.text) if "language" in parts else None

    @classmethod
    def map_checkpoint_name(cls, name: str) -> tuple[str, int | None] | None:
        """Checkpoint tensor name → (our parameter, fused slice index or None); a later family
        overrides it for the names it spells differently."""
        return map_checkpoint_name(name)

    @classmethod
    def checkpoint_param_name(cls, name: str) -> str | None:
        """Our parameter that checkpoint tensor ``name`` fills (None: not a tensor of this model).

        q/k/v and gate/up tensors fill a slice of a fused parameter (see ``map_checkpoint_name``).
        The result may name a part this instance did not build; the loader skips those.
        """
        mapped = cls.map_checkpoint_name(name)
        return None if mapped is None else mapped[0]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (checkpoint names) into our parameters; returns the names filled
        (``models.weights.load_checkpoint``: q/k/v and gate/up fused here)."""
        return load_checkpoint(self, weights, self.map_checkpoint_name, _flat_patch_kernel)

    def init_buffers(self) -> None:
        """Recompute the buffers that checkpoints do not hold (rotary frequencies)."""
        init_rotary_buffers(self)

    def embed_prompt(
        self,
        input_ids: torch.Tensor,
        image_embeds: torch.Tensor | None = None,
        video_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token embeddings [N, H] with the media embeddings written over their placeholder tokens."""
        if self.language_model is None:
            raise RuntimeError("this model was built without its language part")
        x = self.language_model.embed_tokens(input_ids)
        for token, embeds, kind in (
            (self.config.placeholder("image"), image_embeds, "image"),
            (self.config.placeholder("video"), video_embeds, "video"),
        ):
            mask = input_ids == token
            count = int(mask.sum())
            got = 0 if embeds is None else embeds.shape[0]
            if count != got:
                raise MediaPlaceholderError(f"{count} {kind} placeholder tokens but {got} {kind} embeddings")
            if embeds is not None and count:
                x[mask] = embeds.to(x.dtype)
        return x
