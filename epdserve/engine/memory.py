"""Tensors whose memory becomes resident only as it is used, and a language-model role's memory
plan at start-up (the accounting itself: ``epdserve.memory``)."""

from __future__ import annotations

from pathlib import Path

import torch

from epdserve.cache.pages import own_pages
from epdserve.engine.config import EngineConfig, PDRole
from epdserve.memory import (
    MemoryBudgetError,
    RoleMemory,
    account_encoder,
    account_engine,
    available_memory,
    check_free,
)
from epdserve.models.config import ModelConfig

__all__ = ["MemoryBudgetError", "fused_attention", "lazy_zeros", "plan_encoder", "plan_engine"]


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor: on the CPU in pages of its own (``cache.pages.own_pages``), so a large KV
    cache costs resident memory only for the blocks in use; on an accelerator an ordinary
    ``torch.zeros``. The pages are base pages: a block's first write maps the pages it covers,
    where a huge page would map and clear 2 MiB of a layer's cache at once, on every layer, in
    the step that first reaches it (docs/memory.md)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return own_pages(shape, dtype)


def plan_engine(
    model_dir: str | Path, config: EngineConfig, role: PDRole, vision: bool, connector: int = 0
) -> RoleMemory:
    """The memory account of a language-model role about to load ``model_dir`` (nothing loaded
    yet: a configuration that cannot fit is refused before its weights are read), its KV blocks
    sized by the config's budget; ``connector``: what its KV connector's producer holds (a
    prefill's). MemoryBudgetError when it does not fit the budget or the memory free now."""
    free = available_memory(config.device)
    fused = fused_attention(model_dir, config)
    mem = account_engine(model_dir, config, "pd" if role == "both" else role, vision, fused, free, connector)
    check_free(mem, free)
    return mem


def fused_attention(model_dir: str | Path, config: EngineConfig) -> bool:
    """Whether the fused kernels attend in an engine of ``config`` (no decode mirror): taken to
    build where supported (a failed build falls back to the mirror, uncounted)."""
    from epdserve.common.dtypes import torch_dtype
    from epdserve.kernels.ops import CpuKernelOps

    # the decode mirror exists only where the fused kernels do not attend (model_runner.ModelRunner)
    head_dim = ModelConfig.from_pretrained(model_dir).text.head_dim
    supported = CpuKernelOps.supports(torch_dtype(config.dtype), torch.device(config.device))
    return config.kernels != "torch" and supported and CpuKernelOps.attends(head_dim)


def plan_encoder(
    model_dir: str | Path,
    dtype: str,
    device: str,
    encode_token_budget: int,
    encoder_cache_bytes: int,
    pending: int,
    bodies: int,
    connector: int = 0,
) -> RoleMemory:
    """The memory account of an encoder about to load ``model_dir``'s media tower (``pending``: the
    bound of its media waiting for the tower, ``bodies`` of the request bodies it holds,
    ``connector`` what its EC connector's producer holds); MemoryBudgetError when it does not fit
    the memory free now."""
    mem = account_encoder(model_dir, dtype, encode_token_budget, encoder_cache_bytes, pending, bodies, connector)
    check_free(mem, available_memory(device))
    return mem
