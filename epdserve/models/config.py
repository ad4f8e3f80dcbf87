"""Model configuration parsed from a Hugging Face ``config.json`` (Qwen2-VL family).

Two layouts exist in the wild and both are accepted:

* transformers 5: ``text_config`` / ``vision_config`` sub-dicts, rope settings in
  ``text_config["rope_parameters"]`` (``rope_theta``, ``mrope_section``);
* the original hub checkpoints: text fields at the top level, ``rope_theta`` at the top level and
  ``rope_scaling = {"type": "mrope", "mrope_section": [...]}``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epdserve.models.registry import check_architecture

# which halves of the model a process loads: the encoder role needs only "vision", a
# metadata-only prefill/decode role only "language", an aggregated server both
ALL_PARTS: frozenset[str] = frozenset({"vision", "language"})


class ConfigError(ValueError):
    """config.json is missing a field or holds inconsistent values."""


def _get(d: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise ConfigError(f"config.json: missing {where}{key!r}")
    return d[key]


@dataclass(frozen=True)
class VisionConfig:
    """The ViT encoder and its patch merger."""

    depth: int  # number of transformer blocks
    embed_dim: int  # width of the ViT
    num_heads: int  # attention heads of the ViT
    mlp_ratio: float  # MLP width = embed_dim * mlp_ratio
    hidden_act: str  # activation of the block MLPs
    out_hidden_size: int  # width of the merged tokens (= the LM hidden size)
    in_channels: int = 3  # image channels
    patch_size: int = 14  # spatial side of one patch, in pixels
    temporal_patch_size: int = 2  # frames per patch
    spatial_merge_size: int = 2  # the merger folds merge x merge patches into one token
    rope_theta: float = 10000.0  # base of the 2D rotary embedding

    def __post_init__(self) -> None:
        if self.embed_dim % self.num_heads:
            raise ConfigError(f"vision embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}")
        if self.head_dim % 4:
            # h and w each rotate half of the head, in pairs
            raise ConfigError(f"vision head_dim {self.head_dim} must be a multiple of 4")

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def mlp_hidden_dim(self) -> int:
        return int(self.embed_dim * self.mlp_ratio)

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch: channels x frames x pixels."""
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def merged_dim(self) -> int:
        """Width of the merger input: merge x merge neighbouring patches concatenated."""
        return self.embed_dim * self.spatial_merge_size**2

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> VisionConfig:
        rope = d.get("rope_parameters") or {}
        return cls(
            depth=int(_get(d, "depth", "vision_config.")),
            embed_dim=int(_get(d, "embed_dim", "vision_config.")),
            num_heads=int(_get(d, "num_heads", "vision_config.")),
            mlp_ratio=float(d.get("mlp_ratio", 4)),
            hidden_act=str(d.get("hidden_act", "quick_gelu")),
            out_hidden_size=int(_get(d, "hidden_size", "vision_config.")),
            # the original checkpoints spell it in_chans
            in_channels=int(d.get("in_channels", d.get("in_chans", 3))),
            patch_size=int(d.get("patch_size", 14)),
            temporal_patch_size=int(d.get("temporal_patch_size", 2)),
            spatial_merge_size=int(d.get("spatial_merge_size", 2)),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )


@dataclass(frozen=True)
class TextConfig:
    """The decoder-only language model."""

    vocab_size: int  # rows of the embedding and of lm_head
    hidden_size: int  # residual width
    intermediate_size: int  # SwiGLU width
    num_hidden_layers: int  # decoder layers
    num_attention_heads: int  # query heads
    num_key_value_heads: int  # key/value heads (GQA)
    rms_norm_eps: float  # epsilon of every RMSNorm
    rope_theta: float  # base of the rotary embedding
    mrope_section: tuple[int, ...]  # rotary frequency pairs given to the (t, h, w) position rows
    hidden_act: str = "silu"  # activation of the gate projection
    tie_word_embeddings: bool = False  # lm_head shares the embedding matrix
    max_position_embeddings: int = 32768  # longest position the model was trained for

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if sum(self.mrope_section) != self.head_dim // 2:
            raise ConfigError(f"mrope_section {list(self.mrope_section)} must sum to head_dim/2 = {self.head_dim // 2}")

    @property
    def head_dim(self) -> int:
        # Qwen2-VL derives it; a "head_dim" key in config.json is ignored by the reference as well
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], tie_word_embeddings: bool) -> TextConfig:
        rope = d.get("rope_parameters") or {}
        scaling = d.get("rope_scaling") or {}
        section = rope.get("mrope_section", scaling.get("mrope_section"))
        if section is None:
            raise ConfigError("config.json: no mrope_section in rope_parameters or rope_scaling")
        theta = rope.get("rope_theta", d.get("rope_theta"))
        if theta is None:
            raise ConfigError("config.json: no rope_theta in rope_parameters or at the top level")
        return cls(
            vocab_size=int(_get(d, "vocab_size", "text_config.")),
            hidden_size=int(_get(d, "hidden_size", "text_config.")),
            intermediate_size=int(_get(d, "intermediate_size", "text_config.")),
            num_hidden_layers=int(_get(d, "num_hidden_layers", "text_config.")),
            num_attention_heads=int(_get(d, "num_attention_heads", "text_config.")),
            num_key_value_heads=int(d.get("num_key_value_heads", _get(d, "num_attention_heads", "text_config."))),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            mrope_section=tuple(int(s) for s in section),
            hidden_act=str(d.get("hidden_act", "silu")),
            tie_word_embeddings=tie_word_embeddings,
            max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
        )


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model code needs from config.json."""

    architecture: str  # architectures[0], the registry key
    text: TextConfig
    vision: VisionConfig
    image_token_id: int  # placeholder repeated once per merged image token
    video_token_id: int  # placeholder repeated once per merged video token
    vision_start_token_id: int  # precedes every placeholder run in the chat template
    vision_end_token_id: int | None = None  # follows every placeholder run

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        architectures = d.get("architectures") or []
        if not architectures:
            raise ConfigError("config.json: 'architectures' is missing or empty")
        check_architecture(str(architectures[0]))  # before parsing fields another architecture names otherwise
        # the original layout keeps the text fields at the top level
        text = d.get("text_config") or d
        # transformers 5 writes it at both levels; the top level wins, like in transformers
        tie = bool(d.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
        end = d.get("vision_end_token_id")
        return cls(
            architecture=str(architectures[0]),
            text=TextConfig.from_dict(text, tie_word_embeddings=tie),
            vision=VisionConfig.from_dict(_get(d, "vision_config", "")),
            image_token_id=int(_get(d, "image_token_id", "")),
            video_token_id=int(_get(d, "video_token_id", "")),
            vision_start_token_id=int(_get(d, "vision_start_token_id", "")),
            vision_end_token_id=None if end is None else int(end),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json in {model_dir}")
        return cls.from_dict(json.loads(path.read_text()))
