"""Float comparisons that hold on every x86-64 CPU of this machine kind (AVX2 or AVX-512, Intel or
AMD): two computations of the same value through different kernels or batch shapes differ in the
last bits, by an amount that scales with the values' magnitude, so tolerances are relative."""

from __future__ import annotations

import numpy as np
import torch

REL = 1e-4  # of the largest magnitude: far above kernel noise (~1e-6), far below any real bug (~1)


def assert_close_rel(actual: torch.Tensor | np.ndarray, expected: torch.Tensor | np.ndarray, rel: float = REL) -> None:
    """``max |actual - expected| <= rel * max |expected|`` (and equal shapes)."""
    a = torch.as_tensor(np.asarray(actual) if isinstance(actual, np.ndarray) else actual).double()
    e = torch.as_tensor(np.asarray(expected) if isinstance(expected, np.ndarray) else expected).double()
    assert a.shape == e.shape, f"shapes differ: {tuple(a.shape)} vs {tuple(e.shape)}"
    scale = float(e.abs().max()) if e.numel() else 0.0
    diff = float((a - e).abs().max()) if e.numel() else 0.0
    assert diff <= rel * max(scale, 1e-30), f"max abs diff {diff:.3g} exceeds {rel:g} x max |expected| {scale:.3g}"
