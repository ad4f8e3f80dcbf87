"""Tensors whose memory becomes resident only as it is used, and a language-model role's memory
plan at start-up (the accounting itself: ``plan.memory``)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from epdserve.engine.config import EngineConfig, PDRole
from epdserve.models.config import ModelConfig
from epdserve.plan.memory import (
    DTYPE_BYTES,
    MemoryBudgetError,
    RoleMemory,
    available_memory,
    encoder_memory,
    engine_memory,
    format_bytes,
    max_item_patches,
    parameter_count,
)


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On the CPU its pages come from the kernel's zero pages on first touch
    (``calloc``), so a large KV cache costs resident memory only for the blocks in use; on an
    accelerator it is an ordinary ``torch.zeros``."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def plan_engine(model_dir: str | Path, config: EngineConfig, role: PDRole, vision: bool) -> RoleMemory:
    """The memory account of a language-model role about to load ``model_dir`` (nothing loaded
    yet: a configuration that cannot fit is refused before its weights are read), its KV blocks
    sized by the config's budget; MemoryBudgetError when it does not fit the budget or the memory
    free now."""
    from epdserve.kernels.ops import CpuKernelOps, select_ops
    from epdserve.media.processor import ProcessorConfig
    from epdserve.models.precision import torch_dtype

    model = ModelConfig.from_pretrained(model_dir)
    patches = 0
    if model.vision is not None:
        proc = ProcessorConfig.from_pretrained(model_dir)
        patches = max_item_patches(model.vision, proc.max_pixels, proc.video_max_pixels, proc.video_frames)
    # the decode mirror exists only where the fused kernels do not attend (model_runner.ModelRunner)
    ops = select_ops(config.kernels, torch_dtype(config.dtype), torch.device(config.device))
    fused = isinstance(ops, CpuKernelOps) and ops.attends(model.text.head_dim)
    free = available_memory(config.device)
    name = "pd" if role == "both" else role
    mem = engine_memory(
        model,
        role=name,
        dtype=config.dtype,
        block_size=config.block_size,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        max_model_len=config.max_model_len,
        encoder_cache_bytes=config.encoder_cache_bytes,
        item_patches=patches,
        vision=vision,
        decode_mirror=config.contiguous_decode_kv and not fused,
        num_kv_blocks=config.num_kv_blocks,
        kv_cache_memory=config.kv_cache_memory,
        budget=int(config.memory_fraction * free),
    )
    check_free(mem, free)
    return mem


def plan_encoder(
    model_dir: str | Path, dtype: str, device: str, encode_token_budget: int, encoder_cache_bytes: int
) -> RoleMemory:
    """The memory account of an encoder about to load ``model_dir``'s vision tower (an audio
    tower: its weights only); MemoryBudgetError when it does not fit the memory free now."""
    from epdserve.media.processor import ProcessorConfig

    model = ModelConfig.from_pretrained(model_dir)
    if model.vision is None:
        weights = parameter_count(model, frozenset({"vision"})) * DTYPE_BYTES[dtype]
        mem = RoleMemory(role="encoder", weights=weights, encoder_cache=encoder_cache_bytes)
    else:
        proc = ProcessorConfig.from_pretrained(model_dir)
        mem = encoder_memory(
            model,
            dtype=dtype,
            encode_token_budget=encode_token_budget,
            encoder_cache_bytes=encoder_cache_bytes,
            item_patches=max_item_patches(model.vision, proc.max_pixels, proc.video_max_pixels, proc.video_frames),
        )
    check_free(mem, available_memory(device))
    return mem


def check_free(mem: RoleMemory, free: int) -> None:
    """MemoryBudgetError when ``mem`` needs more than the ``free`` bytes there are."""
    if mem.total > free:
        raise MemoryBudgetError(
            f"{mem.role}: needs {format_bytes(mem.total)}, only {format_bytes(free)} free ({mem.line()})"
        )
