"""bfloat16 matmuls on AMX tiles (Intel CPUs that have AMX), in the compiled kernels.

At the row counts of a decode or a short prefill step, most of oneDNN's AMX matmul call is spent
before any arithmetic, and it compiles a new kernel (kept resident) for every row count it meets
(docs/benchmarks.md). ``AmxMatmul`` packs a weight once into the tile layout and
multiplies any number of rows with no per-call setup and nothing to compile: float32 sums of the
same bfloat16 products, the bias added in float32, one rounding to bfloat16 (oneDNN's arithmetic;
the order of the sums is the kernel's own). ``load_amx`` gives None where the CPU, the compiler or
the operating system (which must grant a process the tile registers) does not allow it; callers
keep oneDNN then.
"""

from __future__ import annotations

import logging

import torch

from epdserve.kernels.build import KernelBuildError, load_library
from epdserve.kernels.parallel import PARALLEL_WEIGHT, Workers, shares

log = logging.getLogger(__name__)


# a product with fewer multiply-adds than this, and a weight of fewer than PARALLEL_WEIGHT elements,
# runs on the calling thread: handing shares to other threads would cost more than it saves (at a
# few rows reading the weight is the work, so a large weight splits whatever the row count)
PARALLEL_MACS = 1 << 25
BLOCK = 64  # output columns a thread's share is a multiple of: the kernel's four 16-column tiles


class AmxMatmul:
    """The compiled AMX matmul. A large product is split by output columns over torch's
    intra-op threads (``torch.set_num_threads``; the compiled call lets go of the interpreter),
    each column computed exactly as one call would: the result does not depend on the split."""

    def __init__(self, lib) -> None:
        self.lib = lib
        self.workers = Workers("epd-amx")

    @staticmethod
    def packed_size(out_features: int, in_features: int) -> int:
        """Elements of a packed weight: one 16 x 32 tile per 16 outputs and 32 inputs."""
        return -(-out_features // 16) * -(-in_features // 32) * 512

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """A [out, in] bfloat16 weight in the tile layout (1-D)."""
        if weight.dtype != torch.bfloat16 or weight.dim() != 2:
            raise ValueError(f"expected a 2-D bfloat16 weight, got {weight.dtype} {tuple(weight.shape)}")
        w = weight.detach().contiguous()
        n, k = w.shape
        out = torch.empty(self.packed_size(n, k), dtype=torch.bfloat16)
        self.lib.epd_amx_pack(w.data_ptr(), n, k, out.data_ptr())
        return out

    def linear(
        self, x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x @ weight.T + bias`` for x [..., in] bfloat16 and ``packed = pack(weight)``."""
        k = x.shape[-1]
        if x.dtype != torch.bfloat16 or packed.numel() != self.packed_size(out_features, k):
            raise ValueError(f"x must be bfloat16 rows of the packed weight's {k} inputs")
        if bias is not None and (bias.dtype != torch.bfloat16 or bias.numel() != out_features):
            raise ValueError(f"bias must be {out_features} bfloat16 values")
        rows = x.reshape(-1, k)
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        m = rows.shape[0]
        out = torch.empty((m, out_features), dtype=torch.bfloat16)
        if m:
            if bias is not None:
                bias = bias.contiguous()
            threads = torch.get_num_threads() if self.splits(m, k, out_features) else 1
            self.workers.run(
                lambda a, b: self._columns(rows, packed, out_features, bias, out, a, b),
                shares(out_features, threads, BLOCK),
            )
        return out.reshape(*x.shape[:-1], out_features)

    @staticmethod
    def splits(m: int, k: int, n: int) -> bool:
        """Whether a product of [m, k] rows by a [n, k] weight is split over torch's threads."""
        return m * k * n >= PARALLEL_MACS or k * n >= PARALLEL_WEIGHT

    def _columns(
        self,
        rows: torch.Tensor,
        packed: torch.Tensor,
        n: int,
        bias: torch.Tensor | None,
        out: torch.Tensor,
        a: int,
        b: int,
    ) -> None:
        """Output columns ``[a, b)`` (``a`` a multiple of 16): their weight tiles start at tile
        block ``a / 16``, each block holding ceil(k / 32) tiles of 512 elements."""
        m, k = rows.shape
        kb, el = -(-k // 32), packed.element_size()
        w = packed.data_ptr() + a // 16 * kb * 512 * el
        bias_ptr = bias.data_ptr() + a * el if bias is not None else None
        status = self.lib.epd_amx_linear(rows.data_ptr(), rows.stride(0), m, k, w, b - a, bias_ptr,
                                         out.data_ptr() + a * el, n)  # fmt: skip
        if status != 0:
            raise RuntimeError("the AMX matmul refused its operands")


def load_amx() -> AmxMatmul | None:
    """The AMX matmul, or None where it cannot run here (no AMX, no compiler, tiles refused)."""
    try:
        lib = load_library()
    except KernelBuildError as e:
        log.info("no compiled kernels, so no AMX matmul: %s", e)
        return None
    return AmxMatmul(lib) if lib.epd_amx_available() == 1 else None
