"""Where a model runs and at what precision: the names every role's config accepts."""

from __future__ import annotations

from types import MappingProxyType
from typing import Literal, get_args

import torch

DType = Literal["float32", "bfloat16", "float16"]
DTYPES: tuple[str, ...] = get_args(DType)
TORCH_DTYPES = MappingProxyType({"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16})


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name``; ValueError naming the choices for anything else."""
    if name not in TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return TORCH_DTYPES[name]


def check_device(device: str) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N``, and usable here; ValueError saying why not otherwise."""
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}") from e
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: this torch build or machine has no CUDA device")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    return dev
