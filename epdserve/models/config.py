"""Model configuration parsed from a Hugging Face ``config.json`` (the Qwen2-VL, Qwen2.5-VL,
Qwen3-VL and Qwen2-Audio families).

The families spell the same things differently; each field's parser says which spelling it takes.
The vision tower's width is ``embed_dim`` in Qwen2-VL (whose ``hidden_size`` is the output width)
and ``hidden_size`` in the later families (which name the output ``out_hidden_size``).

Two layouts of the text fields exist in the wild and both are accepted:

* transformers 5: ``text_config`` / ``vision_config`` sub-dicts, rope settings in
  ``text_config["rope_parameters"]`` (``rope_theta``, ``mrope_section``);
* the original hub checkpoints: text fields at the top level, ``rope_theta`` at the top level and
  ``rope_scaling = {"type": "mrope", "mrope_section": [...]}``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epdserve.models.architectures import check_architecture

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
    mlp_hidden_dim: int  # width of the block MLPs
    hidden_act: str  # activation of the block MLPs
    out_hidden_size: int  # width of the merged tokens (= the LM hidden size)
    in_channels: int = 3  # image channels
    patch_size: int = 14  # spatial side of one patch, in pixels
    temporal_patch_size: int = 2  # frames per patch
    spatial_merge_size: int = 2  # the merger folds merge x merge patches into one token
    rope_theta: float = 10000.0  # base of the 2D rotary embedding
    window_size: int = 0  # Qwen2.5-VL: side of an attention window, in pixels (0: every block attends fully)
    fullatt_block_indexes: tuple[int, ...] = ()  # Qwen2.5-VL: the blocks that attend over the whole item
    tokens_per_second: float = 0.0  # Qwen2.5-VL: temporal rotary positions per second of video
    num_position_embeddings: int = 0  # Qwen3-VL: rows of the learned position table (a square grid)
    deepstack_visual_indexes: tuple[int, ...] = ()  # Qwen3-VL: blocks whose merged output feeds early LM layers

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
    def feature_levels(self) -> int:
        """Rows of features per placeholder token: the merged output plus one per DeepStack level."""
        return 1 + len(self.deepstack_visual_indexes)

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
        if "out_hidden_size" in d:  # Qwen2.5-VL, Qwen3-VL
            width, out = int(_get(d, "hidden_size", "vision_config.")), int(d["out_hidden_size"])
            mlp = int(_get(d, "intermediate_size", "vision_config."))
        else:  # Qwen2-VL
            width, out = int(_get(d, "embed_dim", "vision_config.")), int(_get(d, "hidden_size", "vision_config."))
            mlp = int(width * float(d.get("mlp_ratio", 4)))
        return cls(
            depth=int(_get(d, "depth", "vision_config.")),
            embed_dim=width,
            num_heads=int(_get(d, "num_heads", "vision_config.")),
            mlp_hidden_dim=mlp,
            hidden_act=str(d.get("hidden_act", "quick_gelu")),
            out_hidden_size=out,
            # the original checkpoints spell it in_chans
            in_channels=int(d.get("in_channels", d.get("in_chans", 3))),
            patch_size=int(d.get("patch_size", 14)),
            temporal_patch_size=int(d.get("temporal_patch_size", 2)),
            spatial_merge_size=int(d.get("spatial_merge_size", 2)),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            window_size=int(d.get("window_size", 0)),
            fullatt_block_indexes=tuple(int(i) for i in d.get("fullatt_block_indexes", ())),
            tokens_per_second=float(d.get("tokens_per_second", 0.0)),
            num_position_embeddings=int(d.get("num_position_embeddings", 0)),
            deepstack_visual_indexes=tuple(int(i) for i in d.get("deepstack_visual_indexes", ())),
        )


@dataclass(frozen=True)
class AudioConfig:
    """A Whisper-style audio encoder (Qwen2-Audio): two convolutions, pre-norm blocks, 2x pooling,
    and a projection to the LM width."""

    num_mel_bins: int  # channels of the log-mel input
    d_model: int  # width of the encoder
    encoder_layers: int  # transformer blocks
    encoder_attention_heads: int  # attention heads
    encoder_ffn_dim: int  # width of the block MLPs
    out_hidden_size: int  # width of the projected tokens (= the LM hidden size)
    max_source_positions: int = 1500  # frames after the strided convolution (30 s of audio)
    activation_function: str = "gelu"  # activation of the block MLPs
    scale_embedding: bool = False  # multiply the input by sqrt(d_model)

    def __post_init__(self) -> None:
        if self.d_model % self.encoder_attention_heads:
            raise ConfigError(
                f"audio d_model {self.d_model} is not divisible by encoder_attention_heads "
                f"{self.encoder_attention_heads}"
            )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], out_hidden_size: int) -> AudioConfig:
        return cls(
            num_mel_bins=int(_get(d, "num_mel_bins", "audio_config.")),
            d_model=int(_get(d, "d_model", "audio_config.")),
            encoder_layers=int(_get(d, "encoder_layers", "audio_config.")),
            encoder_attention_heads=int(_get(d, "encoder_attention_heads", "audio_config.")),
            encoder_ffn_dim=int(_get(d, "encoder_ffn_dim", "audio_config.")),
            out_hidden_size=out_hidden_size,
            max_source_positions=int(d.get("max_source_positions", 1500)),
            activation_function=str(d.get("activation_function", "gelu")),
            scale_embedding=bool(d.get("scale_embedding", False)),
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
    explicit_head_dim: int = 0  # Qwen3: head width given in config.json (0: hidden_size / heads)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before the rotation
    mrope_interleaved: bool = False  # Qwen3-VL: frequency pairs cycle t, h, w instead of three blocks
    attention_bias: bool = True  # q/k/v projections have a bias (Qwen2), or not (Qwen3)

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
        # Qwen2 derives it; a "head_dim" key in its config.json is ignored by the reference as well
        return self.explicit_head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], tie_word_embeddings: bool) -> TextConfig:
        rope = d.get("rope_parameters") or {}
        scaling = d.get("rope_scaling") or {}
        qwen3 = str(d.get("model_type", "")).startswith("qwen3")
        heads = int(_get(d, "num_attention_heads", "text_config."))
        head_dim = int(d.get("head_dim") or 0) if qwen3 else 0
        section = rope.get("mrope_section", scaling.get("mrope_section"))
        if section is None:  # a text-only rotary (Qwen2-Audio's LM): one row of positions takes every pair
            section = [(head_dim or int(_get(d, "hidden_size", "text_config.")) // heads) // 2]
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
            explicit_head_dim=head_dim,
            qk_norm=qwen3,
            mrope_interleaved=qwen3 or bool(rope.get("mrope_interleaved", False)),
            attention_bias=bool(d.get("attention_bias", not qwen3)),
        )


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model code needs from config.json."""

    architecture: str  # architectures[0], the registry key
    text: TextConfig
    vision: VisionConfig | None  # None: a model without a vision tower (audio-language)
    image_token_id: int | None  # placeholder repeated once per merged image token
    video_token_id: int | None  # placeholder repeated once per merged video token
    vision_start_token_id: int | None  # precedes every placeholder run in the chat template
    vision_end_token_id: int | None = None  # follows every placeholder run
    audio: AudioConfig | None = None  # the audio encoder of an audio-language model
    audio_token_id: int | None = None  # placeholder repeated once per audio embedding row

    @property
    def modalities(self) -> frozenset[str]:
        """The media kinds a request may carry to this model."""
        kinds = set() if self.vision is None else {"image", "video"}
        return frozenset(kinds | ({"audio"} if self.audio is not None else set()))

    def placeholder(self, modality: str) -> int:
        """The placeholder token of ``modality`` (ValueError for one the model does not take)."""
        token = {"image": self.image_token_id, "video": self.video_token_id, "audio": self.audio_token_id}.get(modality)
        if token is None or modality not in self.modalities:
            raise ValueError(f"this model takes no {modality} input")
        return token

    @property
    def feature_levels(self) -> int:
        """Feature vectors per media embedding row (side by side: width = levels x the LM hidden
        size): 1 + the DeepStack levels of a Qwen3-VL tower, 1 for every other model."""
        return 1 if self.vision is None else self.vision.feature_levels

    @property
    def vision_config(self) -> VisionConfig:
        """The vision tower's config (ValueError for a model without one)."""
        if self.vision is None:
            raise ValueError(f"{self.architecture} has no vision tower")
        return self.vision

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
        text_config = TextConfig.from_dict(text, tie_word_embeddings=tie)
        audio = d.get("audio_config")
        if audio is not None:  # Qwen2-Audio: no vision tower
            return cls(
                architecture=str(architectures[0]),
                text=text_config,
                vision=None,
                image_token_id=None,
                video_token_id=None,
                vision_start_token_id=None,
                audio=AudioConfig.from_dict(audio, out_hidden_size=text_config.hidden_size),
                audio_token_id=int(d.get("audio_token_id", _get(d, "audio_token_index", ""))),
            )
        end = d.get("vision_end_token_id")
        return cls(
            architecture=str(architectures[0]),
            text=text_config,
            vision=VisionConfig.from_dict(_get(d, "vision_config", "")),
            image_token_id=int(_get(d, "image_token_id", "")),
            video_token_id=int(_get(d, "video_token_id", "")),
            vision_start_token_id=int(_get(d, "vision_start_token_id", "")),
            vision_end_token_id=None if end is None else int(end),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        check_model_dir(model_dir)
        path = Path(model_dir) / "config.json"
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON ({e}): restore the checkpoint's config.json") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read {path} ({e})") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{path} holds no JSON object: restore the checkpoint's config.json")
        return cls.from_dict(d)


# a Hugging Face Hub id (owner/name), told apart from a local directory that does not exist
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def check_model_dir(model_dir: str | Path, tokenizer: bool = False) -> None:
    """That ``model_dir`` is a local checkpoint directory (config.json, and with ``tokenizer`` the
    tokenizer files a language-model role reads): one ``ConfigError`` saying what is missing and
    what to do, before any role loads weights. Nothing is downloaded: a Hub id is explained."""
    d = Path(model_dir)
    if not d.is_dir():
        if HUB_ID.match(str(model_dir)) and not d.exists():
            raise ConfigError(
                f"{model_dir} is not a directory here: --model takes a local checkpoint directory, nothing is "
                f"downloaded; fetch it first (hf download {model_dir} --local-dir DIR) and pass --model DIR"
            )
        raise ConfigError(f"{model_dir} is not a directory: --model takes a Hugging Face checkpoint directory")
    if not (d / "config.json").is_file():
        raise ConfigError(f"no config.json in {model_dir}: --model takes a Hugging Face checkpoint directory")
    if tokenizer and not (d / "tokenizer.json").is_file():
        raise ConfigError(
            f"no tokenizer.json in {model_dir}: the checkpoint needs its fast tokenizer (copy tokenizer.json "
            "from the model's Hub repository, or save it with transformers' tokenizer.save_pretrained)"
        )
