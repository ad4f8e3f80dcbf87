"""float32 matmuls of a few rows on the weight as loaded, in the compiled kernels.

A decode step multiplies one row per running sequence by every weight of the language model, so
its time is the time to read the weights. MKL's float32 matrix-vector paths read them well under
the memory's speed and barely faster on a second thread (docs/benchmarks.md). ``RowDot`` runs
products of up to ``MAX_ROWS`` rows in the compiled kernels (AVX2 and FMA): each output is a dot
product over one contiguous row of the ``[out, in]`` weight, which stays in cache while every
pair of rows passes over it, so a call reads the weight once, front to back, split by output
columns over torch's intra-op threads. Larger products go to MKL on the same weight: up to
``SWAP_ROWS`` rows on more than one thread as ``weight @ x.T``, which MKL spreads over its
threads far better than ``F.linear`` of a few rows (docs/benchmarks.md), with the rows padded with
zeros to a multiple of ``SWAP_ALIGN``: MKL's product over a number of columns that is not one
leaves its fast path; beyond that, or on one thread, as ``F.linear``. Only weights of
``MIN_WEIGHT`` elements or more are given to it: a decode step reads those from memory.

A row's sums run in one order whatever rows share its call and however the columns are split,
so a row's result does not depend on its batch.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from epdserve.kernels.build import KernelBuildError, load_library

log = logging.getLogger(__name__)

MAX_ROWS = 16  # products of more rows go to MKL
SWAP_ROWS = 256  # products of up to this many rows on several threads are MKL's weight @ x.T
SWAP_ALIGN = 16  # ... over this multiple of rows, padded with zeros
SPLIT_WEIGHT = 1 << 16  # weight elements from which a call is split over torch's threads
# weight elements from which a linear (or a tied table) is given to the row kernel: a smaller
# weight is read from cache, not memory, and MKL's per-call path keeps level with the kernel
# there, while its larger products are faster on MKL's own layout (column-major)
MIN_WEIGHT = 1 << 20


class RowDot:
    """``x @ weight.T + bias`` in float32, the compiled kernel for up to ``MAX_ROWS`` rows."""

    def __init__(self, lib) -> None:
        self.lib = lib

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` for float32 x [..., in] and a contiguous float32
        weight [out, in]."""
        n, k = weight.shape
        if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.shape[-1] != k:
            raise ValueError(f"x must be float32 rows of the float32 weight's {k} inputs")
        if not weight.is_contiguous():
            raise ValueError("the weight must be contiguous [out, in]")
        if bias is not None and (bias.dtype != torch.float32 or bias.numel() != n):
            raise ValueError(f"bias must be {n} float32 values")
        rows = x.reshape(-1, k)
        m = rows.shape[0]
        if m > MAX_ROWS or m == 0:
            if MAX_ROWS < m <= SWAP_ROWS and torch.get_num_threads() > 1:
                return _by_weight_rows(rows, weight, bias).reshape(*x.shape[:-1], n)
            return F.linear(x, weight, bias)
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        if bias is not None:
            bias = bias.contiguous()
        out = torch.empty((m, n), dtype=torch.float32)
        threads = torch.get_num_threads() if n * k >= SPLIT_WEIGHT else 1
        status = self.lib.epd_row_linear_f32(rows.data_ptr(), rows.stride(0), m, k, weight.data_ptr(), n,
                                             bias.data_ptr() if bias is not None else None, out.data_ptr(), n,
                                             threads)  # fmt: skip
        if status != 0:
            raise RuntimeError("the float32 row kernel refused its operands")
        return out.reshape(*x.shape[:-1], n)


def _by_weight_rows(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(rows, weight, bias)`` computed as ``(weight @ rows.T).T``, contiguous, over
    the rows padded with zeros to a multiple of ``SWAP_ALIGN``."""
    m = rows.shape[0]
    padded = -(-m // SWAP_ALIGN) * SWAP_ALIGN
    if padded != m:
        grown = rows.new_zeros(padded, rows.shape[1])
        grown[:m] = rows
        rows = grown
    t = torch.mm(weight, rows.t()) if bias is None else torch.addmm(bias.unsqueeze(1), weight, rows.t())
    return t[:, :m].t().contiguous()


def load_row_dot() -> RowDot | None:
    """The row kernel, or None where the compiled kernels or AVX2 and FMA are missing here."""
    try:
        lib = load_library()
    except KernelBuildError as e:
        log.info("no compiled kernels, so no float32 row kernel: %s", e)
        return None
    return RowDot(lib) if lib.epd_fma_available() == 1 else None
