"""The decoder layer and the language model built from it (every family's, Qwen2 and Qwen3 forms).

Tokens of all scheduled sequences are concatenated along one axis ([N, H]); which token attends
to which is the attention backend's business.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from epdserve.kernels.cpu_linear import LinearKernel, RowEmbedding, TileEmbedding, TileLinear, tie_head
from epdserve.kernels.fused import FusedDecoder, LayerWeights, StackShape
from epdserve.kernels.ops import LayerOps, TorchOps
from epdserve.kernels.tiles import Engine
from epdserve.models.base import AttentionBackend, DeepStack
from epdserve.models.config import TextConfig
from epdserve.models.layers.attention import Attention
from epdserve.models.layers.mlp import MLP
from epdserve.models.layers.norm import RMSNorm
from epdserve.models.layers.rotary import MRotaryEmbedding


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
    """The decoder: embeddings in, final-normed hidden states out; logits on request."""

    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        self.config = config
        # given its weight, Embedding skips its random init (on the meta device that init would
        # import torch's compiler stack: seconds of startup); the checkpoint fills it anyway
        self.embed_tokens: nn.Embedding | TileEmbedding = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = MRotaryEmbedding(config)
        self.ops: LayerOps = TorchOps()  # the engine may swap in the fused CPU kernels (kernels.ops)
        # and the whole stack in one call, for row-wise steps (set by engine.decode_path only)
        self.fused: FusedDecoder | None = None
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
        stack = self.fused
        if stack is not None and stack.preferred() and deepstack is None and attention.row_wise is not None:
            return stack(inputs_embeds.clone(memory_format=torch.contiguous_format), cos, sin, attention.row_wise)
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

    def fused_layers(self) -> tuple[Engine, list[LayerWeights]] | None:
        """The tile engine and the layers' tensors for a ``FusedDecoder``; None when a layer is not
        the plain Qwen2 shape it runs (per-head q/k norms, an activation other than SiLU, biases
        past q/k/v) or its matmuls are not all packed for one tile engine."""
        out: list[LayerWeights] = []
        engines: set[Engine] = set()
        for module in self.layers:
            layer = cast(DecoderLayer, module)
            attn, mlp = layer.self_attn, layer.mlp
            qkv, o, gate_up, down = attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj
            linears = (qkv, o, gate_up, down)
            if not all(isinstance(m, TileLinear) for m in linears):
                return None
            engines |= {cast(TileLinear, m).matmul.engine for m in linears}
            if attn.q_norm is not None or mlp.act is not F.silu or any(m.bias is not None for m in (o, gate_up, down)):
                return None
            bias = qkv.bias.detach() if qkv.bias is not None else None
            norms = layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()
            out.append(LayerWeights(norms[0], qkv.weight, bias, o.weight, norms[1], gate_up.weight, down.weight))
        if len(engines) != 1:
            return None
        return engines.pop(), out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, H] → logits [M, vocab]; pass only the rows that are sampled."""
        if self.lm_head is not None:
            return self.lm_head(hidden)
        if isinstance(self.embed_tokens, (TileEmbedding, RowEmbedding)):
            return self.embed_tokens.project(hidden)
        return F.linear(hidden, self.embed_tokens.weight)

    def lay_out_tied_head(self, kernel: LinearKernel | None) -> None:
        """A tied table in the layout its projection reads fastest with the compiled matmul the
        model's linears got (``tie_head``)."""
        if self.lm_head is None and isinstance(self.embed_tokens, nn.Embedding):
            self.embed_tokens = tie_head(self.embed_tokens, kernel)
