"""How an engine attends its decode tokens: chosen once, when the engine starts, here only.

::

    the kernels build here (CPU, float32/bfloat16) and take the model's head size?
      ├─ yes: every layer the plain Qwen2 shape, its matmuls packed for one tile engine?
      │         ├─ yes ─► fused stack: all layers in one call (kernels.fused) on the steps whose
      │         │         every token attends row by row, the per-layer kernels on the others
      │         │         (and, on AMX, on all steps when torch has more than one thread and the
      │         │         matmuls are large enough to split over them: FusedDecoder.preferred)
      │         └─ no ──► per-layer kernels: KV write and row-wise attention reading the paged
      │                   cache in place (kernels.ops)
      └─ no ──► torch: PyTorch SDPA over views of a contiguous mirror of the decoding sequences'
                KV (contiguous_kv), refreshed with the tokens it lacks each step

Prompt chunks go through SDPA on every path, but for the short ones the kernels take row by row
(``attends_chunk``). The step-level choice (fused stack or not) is the model's: it runs the stack
when it has one, the step carries no DeepStack levels, and the backend offers ``row_wise``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from epdserve.engine.contiguous_kv import ContiguousDecodeKV
from epdserve.engine.kv_cache import KVCache
from epdserve.kernels.fused import FusedDecoder
from epdserve.kernels.ops import CpuKernelOps, LayerOps

if TYPE_CHECKING:
    from epdserve.engine.config import EngineConfig
    from epdserve.models.layers.decoder import Qwen2LanguageModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodePath:
    """The chosen path: ``kernels`` set for the kernel paths (``fused`` too for the fused stack),
    ``mirror`` set for the torch path."""

    kernels: CpuKernelOps | None = None
    fused: FusedDecoder | None = None
    mirror: ContiguousDecodeKV | None = None

    @property
    def name(self) -> str:
        if self.fused is not None:
            return "fused stack"
        return "per-layer kernels" if self.kernels is not None else "torch"

    def attends_chunk(self, q_len: int, ctx_len: int) -> bool:
        """Whether a prompt chunk of ``q_len`` new tokens over ``ctx_len`` attends row by row
        (the kernels, where SDPA's fixed cost would dominate) rather than through SDPA."""
        return self.kernels is not None and self.kernels.attends_chunk(q_len, ctx_len)


def choose_decode_path(
    lm: Qwen2LanguageModel,
    ops: LayerOps,
    kv: KVCache,
    config: EngineConfig,
    dtype: torch.dtype,
    device: torch.device,
) -> DecodePath:
    """The path for a language model whose layers run ``ops``; a fused stack is handed to the
    model (``lm.fused``), which runs it on the steps it fits."""
    tc = lm.config
    if isinstance(ops, CpuKernelOps) and ops.attends(tc.head_dim):
        stack = lm.fused_layers()
        fused = None
        if stack is not None:
            engine, layers = stack
            fused = FusedDecoder(ops.lib, engine, lm.stack_shape(), layers, lm.norm.weight, kv.k, kv.v)
        lm.fused = fused
        path = DecodePath(kernels=ops, fused=fused)
    else:
        mirror = ContiguousDecodeKV(
            tc.num_hidden_layers,
            tc.num_key_value_heads,
            tc.head_dim,
            config.max_num_seqs,
            config.max_model_len,
            dtype,
            device,
        )
        path = DecodePath(mirror=mirror)
    log.info("decode attention: %s", path.name)
    return path
