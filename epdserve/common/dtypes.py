"""Where a model runs and at what precision: the names every role's config accepts.

Checking a name needs no torch (a front end validates its config, and starts its engine core,
before importing it); ``torch_dtype`` and ``TORCH_DTYPES`` import torch on first use.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Literal, get_args

import numpy as np

if TYPE_CHECKING:
    import torch

DType = Literal["float32", "bfloat16", "float16"]
DTYPES: tuple[str, ...] = get_args(DType)
_DEVICE_RE = re.compile(r"cpu|cuda(:\d+)?")
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
_BF16_EXPONENT = 0x7F80  # all exponent bits set: infinity or NaN


def all_finite(raw: bytes, name: str) -> bool:
    """Whether the little-endian ``name`` values in ``raw`` are all finite (numpy, no torch;
    bfloat16 is read through its bits)."""
    check_dtype(name)
    if name == "bfloat16":
        bits = np.frombuffer(raw, dtype="<u2")
        return not bool(((bits & _BF16_EXPONENT) == _BF16_EXPONENT).any())
    return bool(np.isfinite(np.frombuffer(raw, dtype="<f4" if name == "float32" else "<f2")).all())


def check_dtype(name: str) -> str:
    """``name`` if it is a dtype every role accepts; ValueError naming the choices otherwise."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name``; ValueError naming the choices for anything else."""
    return __getattr__("TORCH_DTYPES")[check_dtype(name)]  # type: ignore[no-any-return]


def __getattr__(name: str) -> Any:
    if name == "TORCH_DTYPES":
        from types import MappingProxyType

        import torch

        table = MappingProxyType({"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16})
        globals()["TORCH_DTYPES"] = table
        return table
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_device(device: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``, and usable here; ValueError saying why not otherwise.
    (Only a CUDA device needs torch to check.)"""
    if not _DEVICE_RE.fullmatch(device):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: this torch build or machine has no CUDA device")
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    return device
