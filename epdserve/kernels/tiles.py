"""bfloat16 matmuls on a weight packed once into the tile layout, in the compiled kernels.

At the row counts of a decode or a short prefill step, most of oneDNN's matmul call is spent
before any arithmetic, it compiles a new kernel (kept resident) for every row count it meets, and
at a few rows it reads the weight at about half the memory bandwidth (docs/benchmarks.md).
``TileMatmul`` packs a weight once into the layout of AMX's tiles (per 16 output columns, input
pairs of 16 columns x 2 inputs) and multiplies any number of rows with no per-call setup and
nothing to compile. Two engines read that one layout:

- ``amx``: AMX tile matmuls (Intel CPUs that have AMX);
- ``avx512``: AVX-512 bfloat16 dot products (AMD Zen 4 and later, Intel Cooper Lake: CPUs with
  AVX-512 bfloat16 but no AMX), a 64-byte load of the packed weight making 16 sums at once;
- ``avx2``: AVX2 float32 multiply-adds on the weight widened in registers (CPUs with neither:
  AVX2 only, as AMD Zen 2 and 3, or AVX-512 without bfloat16, as Intel Skylake to Ice Lake), where
  PyTorch's own bfloat16 matmul reads the weight again for every row and oneDNN has no bfloat16
  kernels.

All three take float32 sums of the same bfloat16 products, add the bias in float32 and round once
to bfloat16 (oneDNN's arithmetic; the order of the sums is each kernel's own). ``load_amx`` gives
the AMX engine and ``load_tiles`` the best engine of this CPU, or None where the CPU, the compiler
or the operating system (which must grant a process AMX's tile registers) allows none; callers
keep PyTorch's matmuls then.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch

from epdserve.kernels.build import KernelBuildError, load_library
from epdserve.kernels.parallel import PARALLEL_WEIGHT, Workers, shares

log = logging.getLogger(__name__)


# a product with fewer multiply-adds than this, and a weight of fewer than PARALLEL_WEIGHT elements,
# runs on the calling thread: handing shares to other threads would cost more than it saves (at a
# few rows reading the weight is the work, so a large weight splits whatever the row count)
PARALLEL_MACS = 1 << 25
BLOCK = 64  # output columns a thread's share is a multiple of: four 16-column blocks (AMX's tiles)


Engine = Literal["amx", "avx512", "avx2"]


class TileMatmul:
    """The compiled matmul on the tile layout, by ``engine``. A large product is split by output
    columns over torch's intra-op thread count (``torch.set_num_threads``; the compiled call lets
    go of the interpreter): the AMX engine's shares run on a small pool of its own, the AVX-512
    and AVX2 ones' on torch's OpenMP threads inside the call. Each column is computed exactly as one call
    would: the result does not depend on the split."""

    def __init__(self, lib, engine: Engine) -> None:
        self.lib, self.engine = lib, engine
        self.workers = Workers(f"epd-{engine}")

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

    @staticmethod
    def rows(packed: torch.Tensor, index: torch.Tensor, in_features: int) -> torch.Tensor:
        """Rows ``index`` (1-D) of the [out, in] weight ``packed`` holds, exactly: per 16 rows, the
        input pairs of 16 rows x 2 values each, the inputs zero-padded to a multiple of 32."""
        blocks = packed.view(-1, -(-in_features // 32) * 16, 16, 2)
        picked = blocks[index // 16, :, index % 16, :]
        return picked.reshape(index.numel(), blocks.shape[1] * 2)[:, :in_features]

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
            threads = self.threads(m, k, out_features)
            if self.engine != "amx":  # splits itself, on torch's own OpenMP threads
                call = self.lib.epd_dot_linear if self.engine == "avx512" else self.lib.epd_fma_linear
                bias_ptr = bias.data_ptr() if bias is not None else None
                status = call(rows.data_ptr(), rows.stride(0), m, k, packed.data_ptr(), out_features, bias_ptr,
                              out.data_ptr(), out_features, threads)  # fmt: skip
                if status != 0:
                    raise RuntimeError(f"the {self.engine} tile matmul refused its operands")
            else:
                self.workers.run(
                    lambda a, b: self._columns(rows, packed, out_features, bias, out, a, b),
                    shares(out_features, threads, BLOCK),
                )
        return out.reshape(*x.shape[:-1], out_features)

    @classmethod
    def threads(cls, m: int, k: int, n: int, count: int | None = None) -> int:
        """The threads a product of [m, k] rows by a [n, k] weight splits over: ``count`` (default
        torch's intra-op count) where it splits (``splits``), else one."""
        if not cls.splits(m, k, n):
            return 1
        return torch.get_num_threads() if count is None else count

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
        """Output columns ``[a, b)`` on AMX (``a`` a multiple of 16): their weight tiles start at
        tile block ``a / 16``, each block holding ceil(k / 32) tiles of 512 elements."""
        m, k = rows.shape
        kb, el = -(-k // 32), packed.element_size()
        w = packed.data_ptr() + a // 16 * kb * 512 * el
        bias_ptr = bias.data_ptr() + a * el if bias is not None else None
        status = self.lib.epd_amx_linear(rows.data_ptr(), rows.stride(0), m, k, w, b - a, bias_ptr,
                                         out.data_ptr() + a * el, n)  # fmt: skip
        if status != 0:
            raise RuntimeError("the amx tile matmul refused its operands")


def _library():
    try:
        return load_library()
    except KernelBuildError as e:
        log.info("no compiled kernels, so no tile matmul: %s", e)
        return None


def load_amx() -> TileMatmul | None:
    """The AMX engine, or None where it cannot run here (no AMX, no compiler, tiles refused)."""
    lib = _library()
    return TileMatmul(lib, "amx") if lib is not None and lib.epd_amx_available() == 1 else None


def load_tiles() -> TileMatmul | None:
    """The AMX engine where it runs, else the AVX-512 bfloat16 one, else the AVX2 one, else None."""
    lib = _library()
    if lib is None:
        return None
    if lib.epd_amx_available() == 1:
        return TileMatmul(lib, "amx")
    if lib.epd_dot_available() == 1:
        return TileMatmul(lib, "avx512")
    return TileMatmul(lib, "avx2") if lib.epd_fma_available() == 1 else None
