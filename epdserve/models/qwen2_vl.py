"""Qwen2-VL: the vision tower, the language model, M-RoPE positions and checkpoint name mapping.

Data flow of one request::

    pixel patches [P, 1176] ──Qwen2VisionTower──► media embeddings [P/4, H]
                                                          │ spliced at the placeholder tokens
    token ids [N] ──embed_tokens──► embeddings [N, H] ◄───┘
    token ids + grids ──mrope_positions (qwen2_vl_layout)──► positions [3, N]
    embeddings, positions ──Qwen2LanguageModel(attention backend)──► hidden [N, H] ──compute_logits──►

The vision tower and the language model are independent modules so that an encoder process builds
only the first and a prefill/decode process only the second (``Qwen2VLForConditionalGeneration``
takes the set of parts to build).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from epdserve.kernels.fused import FusedDecoder, LayerWeights, StackShape
from epdserve.kernels.ops import LayerOps, TorchOps, rms_norm
from epdserve.models.base import AttentionBackend, DeepStack
from epdserve.models.config import ALL_PARTS, ConfigError, ModelConfig, TextConfig, VisionConfig
from epdserve.models.cpu_linear import AmxLinear
from epdserve.models.qwen2_vl_layout import MediaPlaceholderError, grid_list

GridLike = torch.Tensor | Sequence[Sequence[int]]


class WeightLoadError(ValueError):
    """A checkpoint tensor has the wrong shape, or a parameter found no tensor."""


def _activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name == "silu":
        return F.silu
    if name == "gelu":
        return F.gelu
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    raise ConfigError(f"unsupported activation {name!r}")


# ---------------------------------------------------------------------------------------------
# vision tower
# ---------------------------------------------------------------------------------------------


def _merge_window_hw(h: int, w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
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
            r, c = _merge_window_hw(h, w, merge)
            rows.append(r.repeat(t))
            cols.append(c.repeat(t))
        device = self.inv_freq.device
        freq_h = torch.cat(rows).to(device)[:, None].float() * self.inv_freq
        freq_w = torch.cat(cols).to(device)[:, None].float() * self.inv_freq
        half = torch.cat((freq_h, freq_w), dim=-1)
        angles = torch.cat((half, half), dim=-1)
        return angles.cos(), angles.sin()


class PatchEmbed(nn.Module):
    """Linear projection of flattened patches.

    The checkpoint stores a Conv3d whose kernel equals its stride and the patch size, applied to
    one patch at a time: that is a matrix product with the flattened kernel, which is cheaper and
    takes the processor's flat patches as they are. ``load_weights`` flattens the kernel.
    """

    def __init__(self, config: VisionConfig, bias: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(config.patch_dim, config.embed_dim, bias=bias)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches.to(self.proj.weight.dtype))


class VisionAttention(nn.Module):
    """Bidirectional attention within each frame of each media item, never across them."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(config.embed_dim, 3 * config.embed_dim, bias=True)
        self.proj = nn.Linear(config.embed_dim, config.embed_dim, bias=True)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        grids: list[tuple[int, int, int]],
        ops: LayerOps,
    ) -> torch.Tensor:
        q, k, v = rotated_qkv(self.qkv(x), self.num_heads, self.head_dim, cos, sin, ops)
        outs, start = [], 0
        for frames, size in frame_runs(grids):
            # frames of one size (of one item or of consecutive items) batch as [frames, heads, size, D]
            end = start + frames * size
            qi, ki, vi = (
                y[start:end].view(frames, size, self.num_heads, self.head_dim).transpose(1, 2) for y in (q, k, v)
            )
            outs.append(F.scaled_dot_product_attention(qi, ki, vi).transpose(1, 2).reshape(frames * size, -1))
            start = end
        return self.proj(outs[0] if len(outs) == 1 else torch.cat(outs))


def rotated_qkv(
    qkv: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor, ops: LayerOps
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [N, heads, D] of a fused projection [N, 3 * heads * D], q and k rotated in float32
    like the reference (bfloat16 angles lose the position of far patches), both in one call."""
    parts = qkv.view(qkv.shape[0], 3, heads, head_dim)
    qk = ops.rotary_f32(parts[:, :2].flatten(1, 2), cos, sin)
    return qk[:, :heads], qk[:, heads:], parts[:, 2]


def frame_runs(grids: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """The frames of consecutive items as runs of equal size: (frames, patches per frame) each.
    Attention stays within a frame, so a run is one batched call, however many items it spans."""
    runs: list[tuple[int, int]] = []
    for t, h, w in grids:
        if runs and runs[-1][1] == h * w:
            runs[-1] = (runs[-1][0] + t, h * w)
        else:
            runs.append((t, h * w))
    return runs


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.embed_dim, config.mlp_hidden_dim)
        self.fc2 = nn.Linear(config.mlp_hidden_dim, config.embed_dim)
        self.act = _activation(config.hidden_act)
        self.quick_gelu = config.hidden_act == "quick_gelu"  # fused by the kernels

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(ops.quick_gelu(h) if self.quick_gelu else self.act(h))


class VisionBlock(nn.Module):
    """Pre-norm transformer block of the ViT."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.embed_dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.embed_dim, eps=1e-6)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        grids: list[tuple[int, int, int]],
        ops: LayerOps,
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, grids, ops)
        return x + self.mlp(self.norm2(x), ops)


class PatchMerger(nn.Module):
    """Folds each merge x merge window of patches (adjacent rows in processor order) into one LM token."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.merged_dim = config.merged_dim
        self.ln_q = nn.LayerNorm(config.embed_dim, eps=1e-6)
        # a Sequential only so that the parameter names equal the checkpoint's (mlp.0, mlp.2)
        self.mlp = nn.Sequential(
            nn.Linear(config.merged_dim, config.merged_dim),
            nn.GELU(),
            nn.Linear(config.merged_dim, config.out_hidden_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged_dim))


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
        grids = grid_list(grid_thw)
        check_patches(self.config, pixel_values, grids)
        x = self.patch_embed(pixel_values)
        cos, sin = self.rotary(grids)
        for block in self.blocks:
            x = block(x, cos, sin, grids, self.ops)
        return self.merger(x)


def check_patches(c: VisionConfig, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> None:
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


# ---------------------------------------------------------------------------------------------
# language model
# ---------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


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


class Attention(nn.Module):
    """q/k/v projections, per-head q/k RMSNorm (Qwen3) and M-RoPE; the attention itself is the
    engine's backend."""

    def __init__(self, config: TextConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        # q, k and v in one matmul: at this model size a step is dominated by per-call overhead
        kv = self.num_kv_heads * self.head_dim
        self.shard_sizes = (self.num_heads * self.head_dim, kv, kv)
        self.qkv_proj = nn.Linear(hidden, sum(self.shard_sizes), bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionBackend, ops: LayerOps
    ) -> torch.Tensor:
        n, hq, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        qk = qkv[:, : (hq + hkv) * d].view(n, hq + hkv, d)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :hq]), self.k_norm(qk[:, hq:])), dim=1)
        # q and k rotate in one pass (the same elementwise math, half the calls)
        qk = ops.rotary(qk, cos, sin)
        q, k = qk.split((hq, hkv), dim=1)
        out = attention(self.layer_idx, q, k, qkv[:, (hq + hkv) * d :].view(n, hkv, d))
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        # gate and up in one matmul (see Attention)
        self.shard_sizes = (config.intermediate_size, config.intermediate_size)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = _activation(config.hidden_act)

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act is F.silu:
            return self.down_proj(ops.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: TextConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionBackend,
        ops: LayerOps,
    ) -> torch.Tensor:
        """The residual stream ``x`` gains the previous layer's ``delta`` (in place); returns this
        layer's MLP output, which the next layer (or the final norm) adds in the same call as its
        norm."""
        a, m = self.input_layernorm, self.post_attention_layernorm
        attn = self.self_attn(ops.add_rms_norm(x, delta, a.weight, a.eps), cos, sin, attention, ops)
        return self.mlp(ops.add_rms_norm(x, attn, m.weight, m.eps), ops)


class Qwen2LanguageModel(nn.Module):
    """The decoder: embeddings in, final-normed hidden states out; logits on request.

    Tokens of all scheduled sequences are concatenated along one axis ([N, H]); which token
    attends to which is the attention backend's business.
    """

    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        self.config = config
        # given its weight, Embedding skips its random init (on the meta device that init would
        # import torch's compiler stack: seconds of startup); the checkpoint fills it anyway
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = MRotaryEmbedding(config)
        self.ops: LayerOps = TorchOps()  # the engine may swap in the fused CPU kernels (kernels.ops)
        self.fused: FusedDecoder | None = None  # and the whole stack in one call, for row-wise steps
        # tied: logits use the embedding matrix, so there is no separate parameter to load
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionBackend,
        deepstack: DeepStack | None = None,
    ) -> torch.Tensor:
        """inputs_embeds [N, H], positions [3, N] (M-RoPE rows t, h, w) → final-normed hidden [N, H].

        ``deepstack`` (Qwen3-VL): the output of layer l gains ``features[l]`` at ``rows``, for the
        first ``len(features)`` layers (transformers' ``_deepstack_process``)."""
        if positions.shape != (3, inputs_embeds.shape[0]):
            raise ValueError(f"positions must be [3, {inputs_embeds.shape[0]}], got {list(positions.shape)}")
        cos, sin = self.rotary(positions, inputs_embeds.dtype)
        if self.fused is not None and deepstack is None and attention.row_wise is not None:
            return self.fused(inputs_embeds.clone(memory_format=torch.contiguous_format), cos, sin, attention.row_wise)
        ops = self.ops
        x = inputs_embeds.clone()  # the residual stream, updated in place
        delta: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            delta = layer(x, delta, cos, sin, attention, ops)
            if deepstack is not None and i < deepstack.features.shape[0]:
                x.add_(delta)
                delta = None
                x[deepstack.rows] += deepstack.features[i].to(x.dtype)
        return ops.add_rms_norm(x, delta, self.norm.weight, self.norm.eps)

    def stack_shape(self) -> StackShape:
        c = self.config
        return StackShape(
            c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size, c.rms_norm_eps
        )

    def fused_layers(self) -> list[LayerWeights] | None:
        """The layers' tensors for a ``FusedDecoder``; None when a layer is not the plain
        Qwen2 shape it runs (per-head q/k norms, an activation other than SiLU, biases past q/k/v)
        or its matmuls are not packed for AMX."""
        out: list[LayerWeights] = []
        for module in self.layers:
            layer = cast(DecoderLayer, module)
            attn, mlp = layer.self_attn, layer.mlp
            qkv, o, gate_up, down = attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj
            if not (
                isinstance(qkv, AmxLinear)
                and isinstance(o, AmxLinear)
                and isinstance(gate_up, AmxLinear)
                and isinstance(down, AmxLinear)
            ):
                return None
            if attn.q_norm is not None or mlp.act is not F.silu or any(m.bias is not None for m in (o, gate_up, down)):
                return None
            bias = qkv.bias.detach() if qkv.bias is not None else None
            norms = layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()
            out.append(LayerWeights(norms[0], qkv.weight, bias, o.weight, norms[1], gate_up.weight, down.weight))
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, H] → logits [M, vocab]; pass only the rows that are sampled."""
        return F.linear(hidden, self.embed_tokens.weight) if self.lm_head is None else self.lm_head(hidden)


_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _map_checkpoint_name(name: str) -> tuple[str, int | None] | None:
    """Checkpoint tensor name → (our parameter, row-slice index for fused parameters, else None).

    ``model.layers.0.self_attn.k_proj.bias`` → (``language_model.layers.0.self_attn.qkv_proj.bias``, 1).
    """
    for theirs, ours in _NAME_PREFIXES:
        if name.startswith(theirs):
            parts = (ours + name[len(theirs) :]).split(".")
            if ours.startswith("language_model") and len(parts) >= 3 and parts[-2] in _FUSED:
                fused, index = _FUSED[parts[-2]]
                return ".".join([*parts[:-2], fused, parts[-1]]), index
            return ".".join(parts), None
    return None


# ---------------------------------------------------------------------------------------------
# the whole model and its checkpoint
# ---------------------------------------------------------------------------------------------

# checkpoint prefix → our prefix, first match wins. transformers 5 in memory uses
# model.visual / model.language_model; the hub checkpoints (and transformers' save) use visual / model.
_NAME_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model.visual.", "visual."),
    ("model.language_model.", "language_model."),
    ("visual.", "visual."),
    ("model.", "language_model."),
    ("lm_head.", "language_model.lm_head."),
)


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
        return _map_checkpoint_name(name)

    @classmethod
    def checkpoint_param_name(cls, name: str) -> str | None:
        """Our parameter that checkpoint tensor ``name`` fills (None: not a tensor of this model).

        q/k/v and gate/up tensors fill a slice of a fused parameter (see ``_map_checkpoint_name``).
        The result may name a part this instance did not build; the loader skips those.
        """
        mapped = cls.map_checkpoint_name(name)
        return None if mapped is None else mapped[0]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (checkpoint names) into our parameters; returns the names filled.

        q/k/v and gate/up projections are stored separately in checkpoints and fused here: each
        checkpoint tensor fills its row slice of the fused parameter, which counts as loaded once
        every slice has arrived.
        """
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        shards: dict[str, set[int]] = {}
        for name, tensor in weights:
            mapped = self.map_checkpoint_name(name)
            if mapped is None or mapped[0] not in params:
                continue
            ours, index = mapped
            if index is not None:
                target = ours
                sizes = modules[target.rsplit(".", 2)[0]].shard_sizes
                part = params[target].narrow(0, sum(sizes[:index]), sizes[index])
                if tensor.shape != part.shape:
                    raise WeightLoadError(f"{name}: checkpoint shape {list(tensor.shape)}, model {list(part.shape)}")
                part.copy_(tensor)
                shards.setdefault(target, set()).add(index)
                if len(shards[target]) == len(sizes):
                    loaded.add(target)
                continue
            param = params[ours]
            if ours == "visual.patch_embed.proj.weight":
                tensor = tensor.reshape(tensor.shape[0], -1)  # Conv3d kernel → flat, see PatchEmbed
            if tensor.shape != param.shape:
                raise WeightLoadError(f"{name}: checkpoint shape {list(tensor.shape)}, model {list(param.shape)}")
            param.copy_(tensor)
            loaded.add(ours)
        return loaded

    def init_buffers(self) -> None:
        """Recompute the buffers that checkpoints do not hold (rotary frequencies)."""
        for module in self.modules():
            if isinstance(module, VisionRotaryEmbedding | MRotaryEmbedding):
                module.init_buffers()

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
