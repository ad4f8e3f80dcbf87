"""Qwen2-Audio: the Whisper-style audio encoder with its projector, and the Qwen2 language model.

Data flow of one request::

    log-mel frames [F, mels] ──Qwen2AudioTower──► audio embeddings [tokens, H]
                                                          │ spliced at the <|AUDIO|> tokens
    token ids [N] ──embed_tokens──► embeddings [N, H] ◄───┘
    embeddings, 1-D positions ──Qwen2LanguageModel(attention backend)──► hidden [N, H] ──compute_logits──►

The encoder follows transformers' ``Qwen2AudioEncoder``: conv1 (kernel 3) + GELU, conv2 (kernel 3,
stride 2) + GELU, learned positions, pre-LayerNorm blocks (k_proj without bias), a 2x average
pool, a final LayerNorm, then the projector to the LM width. transformers pads every item to the
30 s window and masks the padded frames as attention keys; here each item carries only its valid
frames plus the two its convolutions read past them (``qwen2_audio_layout.encoder_frames``), and
the items of one forward are padded to the longest of them. The valid rows are the same.

The language model is Qwen2-VL's with a single rotary section, which is plain RoPE (all position
rows equal). The model's parts are those of every family: ``"vision"`` names the media encoder,
here the audio tower (so the encoder role, ``--no-vision-tower`` and metadata-only loading work
unchanged), and ``"language"`` the language model.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from epdserve.models.config import ALL_PARTS, AudioConfig, ModelConfig
from epdserve.models.layers.activation import activation
from epdserve.models.layers.decoder import Qwen2LanguageModel
from epdserve.models.layers.rotary import init_rotary_buffers
from epdserve.models.layers.vision import GridLike
from epdserve.models.qwen2_audio_layout import audio_tokens, check_grid, encoder_frames
from epdserve.models.qwen2_vl import map_checkpoint_name
from epdserve.models.qwen2_vl_layout import MediaPlaceholderError, grid_list
from epdserve.models.weights import load_checkpoint


class AudioAttention(nn.Module):
    """Bidirectional attention over one item's frames; padded frames are masked as keys."""

    def __init__(self, config: AudioConfig) -> None:
        super().__init__()
        self.num_heads = config.encoder_attention_heads
        self.head_dim = config.d_model // self.num_heads
        d = config.d_model
        self.q_proj = nn.Linear(d, d, bias=True)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=True)
        self.out_proj = nn.Linear(d, d, bias=True)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """x [B, S, d], key_mask bool [B, 1, 1, S] (True: a valid frame) → [B, S, d]."""
        b, s, _ = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)

        # scale q before the product, as the reference does (the order changes the rounding)
        q = heads(self.q_proj(x) * self.head_dim**-0.5)
        out = F.scaled_dot_product_attention(q, heads(self.k_proj(x)), heads(self.v_proj(x)), key_mask, scale=1.0)
        return self.out_proj(out.transpose(1, 2).reshape(b, s, -1))


class AudioBlock(nn.Module):
    """Pre-LayerNorm transformer block of the audio encoder."""

    def __init__(self, config: AudioConfig) -> None:
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(config.d_model)
        self.self_attn = AudioAttention(config)
        self.final_layer_norm = nn.LayerNorm(config.d_model)
        self.fc1 = nn.Linear(config.d_model, config.encoder_ffn_dim)
        self.fc2 = nn.Linear(config.encoder_ffn_dim, config.d_model)
        self.act = activation(config.activation_function)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), key_mask)
        x = x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))
        if x.dtype == torch.float16:  # as the reference: keep fp16 activations finite
            bound = torch.finfo(x.dtype).max - 1000
            x = x.clamp(-bound, bound)
        return x


class Qwen2AudioTower(nn.Module):
    """The audio encoder and its projector: log-mel frames of any number of items → one LM-width
    embedding per placeholder token."""

    def __init__(self, config: AudioConfig) -> None:
        super().__init__()
        self.config = config
        d = config.d_model
        self.conv1 = nn.Conv1d(config.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        # given its weight, Embedding skips its random init (see Qwen2LanguageModel.embed_tokens)
        self.embed_positions = nn.Embedding(
            config.max_source_positions, d, _weight=torch.empty(config.max_source_positions, d)
        )
        self.layers = nn.ModuleList(AudioBlock(config) for _ in range(config.encoder_layers))
        self.layer_norm = nn.LayerNorm(d)
        self.projector = nn.Linear(d, config.out_hidden_size, bias=True)
        self.embed_scale = d**0.5 if config.scale_embedding else 1.0

    def item_frames(self, grid_thw: GridLike) -> list[tuple[int, int]]:
        """(valid frames, frames carried) of each item; MediaPlaceholderError for a bad grid."""
        out = []
        for grid in grid_list(grid_thw):
            try:
                frames = check_grid(grid, self.config)
            except ValueError as e:
                raise MediaPlaceholderError(str(e)) from None
            out.append((frames, encoder_frames(frames, self.config)))
        return out

    def forward(self, features: torch.Tensor, grid_thw: GridLike) -> torch.Tensor:
        """features [sum of frames carried, num_mel_bins] of n items concatenated (frames along
        rows), grid_thw [n, 3] = (1, valid frames, 1) per item → [sum of audio_tokens, out_hidden_size]."""
        c = self.config
        frames = self.item_frames(grid_thw)
        if features.ndim != 2 or features.shape[1] != c.num_mel_bins:
            raise MediaPlaceholderError(
                f"audio features must be [frames, {c.num_mel_bins}], got {list(features.shape)}"
            )
        carried = [n for _, n in frames]
        if features.shape[0] != sum(carried):
            raise MediaPlaceholderError(
                f"grids describe {sum(carried)} log-mel frames, features have {features.shape[0]}"
            )
        # items padded with zeros to the longest: a convolution pads each item's end with zeros too
        x = nn.utils.rnn.pad_sequence(list(features.split(carried)), batch_first=True)
        x = x.to(self.conv1.weight.dtype).transpose(1, 2)  # [B, mels, F]
        x = F.gelu(self.conv1(x))
        x = F.gelu(self.conv2(x)).transpose(1, 2)  # [B, S, d]
        s = x.shape[1]
        x = x * self.embed_scale + self.embed_positions.weight[:s]
        valid = torch.tensor([(n - 1) // 2 + 1 for n, _ in frames], device=x.device)
        key_mask = (torch.arange(s, device=x.device) < valid[:, None])[:, None, None, :]
        for layer in self.layers:
            x = layer(x, key_mask)
        x = F.avg_pool1d(x.transpose(1, 2), 2, 2).transpose(1, 2)
        x = self.projector(self.layer_norm(x))
        return torch.cat([x[i, : audio_tokens(n)] for i, (n, _) in enumerate(frames)])


# checkpoint prefix → our prefix for the audio part; the hub checkpoints (and transformers' save)
# use audio_tower / multi_modal_projector, transformers 5 in memory adds a "model." in front
_AUDIO_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model.audio_tower.", "audio."),
    ("audio_tower.", "audio."),
    ("model.multi_modal_projector.linear.", "audio.projector."),
    ("multi_modal_projector.linear.", "audio.projector."),
)
# the language model's hub spelling → Qwen2-VL's, whose mapping (with q/k/v and gate/up fusing) applies
_LM_PREFIXES: tuple[tuple[str, str], ...] = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model.language_model."),
    ("model.", "model."),
    ("lm_head.", "lm_head."),
)


def _map_name(name: str) -> tuple[str, int | None] | None:
    """Checkpoint tensor name → (our parameter, fused slice index or None), None when not ours."""
    for theirs, ours in _AUDIO_PREFIXES:
        if name.startswith(theirs):
            return ours + name[len(theirs) :], None
    for theirs, ours in _LM_PREFIXES:
        if name.startswith(theirs):
            return map_checkpoint_name(ours + name[len(theirs) :])
    return None


class Qwen2AudioForConditionalGeneration(nn.Module):
    """Holds the parts a process needs: ``audio`` (the audio tower, built for the part "vision",
    the media encoder) and/or ``language_model``. ``visual`` is always None."""

    visual: None = None

    def __init__(self, config: ModelConfig, parts: frozenset[str] = ALL_PARTS) -> None:
        super().__init__()
        unknown = set(parts) - ALL_PARTS
        if unknown or not parts:
            raise ValueError(f"parts must be a non-empty subset of {sorted(ALL_PARTS)}, got {sorted(parts)}")
        if config.audio is None or config.audio_token_id is None:
            raise ValueError(f"{config.architecture}: config.json has no audio_config or audio token")
        self.config = config
        self.parts = frozenset(parts)
        self.audio = Qwen2AudioTower(config.audio) if "vision" in parts else None
        self.language_model = Qwen2LanguageModel(config.text) if "language" in parts else None

    @staticmethod
    def checkpoint_param_name(name: str) -> str | None:
        """Our parameter that checkpoint tensor ``name`` fills (None: not a tensor of this model)."""
        mapped = _map_name(name)
        return None if mapped is None else mapped[0]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into our parameters; returns the names filled (a fused q/k/v or
        gate/up parameter once all its slices arrived: ``models.weights.load_checkpoint``)."""
        return load_checkpoint(self, weights, _map_name)

    def init_buffers(self) -> None:
        """Recompute the buffers that checkpoints do not hold (rotary frequencies)."""
        init_rotary_buffers(self)

    def encoder(self, modality: str) -> nn.Module | None:
        """The loaded encoder of ``modality`` (None: not loaded, or not a modality of this model)."""
        return self.audio if modality == "audio" else None

    def embed_prompt(self, input_ids: torch.Tensor, audio_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings [N, H] with the audio embeddings written over the <|AUDIO|> tokens."""
        if self.language_model is None:
            raise RuntimeError("this model was built without its language part")
        x = self.language_model.embed_tokens(input_ids)
        mask = input_ids == self.config.placeholder("audio")
        count, got = int(mask.sum()), 0 if audio_embeds is None else audio_embeds.shape[0]
        if count != got:
            raise MediaPlaceholderError(f"{count} audio placeholder tokens but {got} audio embeddings")
        if audio_embeds is not None and count:
            x[mask] = audio_embeds.to(x.dtype)
        return x
