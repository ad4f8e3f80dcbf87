"""Tensors whose memory becomes resident only as it is used."""

from __future__ import annotations

import math

import numpy as np
import torch


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On the CPU its pages come from the kernel's zero pages on first touch
    (``calloc``), so a large KV cache costs resident memory only for the blocks in use; on an
    accelerator it is an ordinary ``torch.zeros``."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
