"""Activation functions by their config.json names."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from epdserve.models.config import ConfigError


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function config.json calls ``name``; ConfigError for one not supported."""
    if name == "silu":
        return F.silu
    if name == "gelu":
        return F.gelu
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    raise ConfigError(f"unsupported activation {name!r}")
