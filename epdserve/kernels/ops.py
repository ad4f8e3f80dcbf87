"""The elementwise work of a decoder layer and the paged decode attention, behind one interface.

``TorchOps`` is the PyTorch arithmetic the model has always run; ``CpuKernelOps`` does the same
with the fused kernels of ``cpu_kernels.cpp`` (fewer, larger calls: the same operations and
rounding points, summed in another order, so results agree to float tolerance, not bit for bit).
``select_ops`` picks one for an engine: the kernels on a CPU, in float32 or bfloat16, when they
build; PyTorch otherwise.

Layout contracts (checked, a tensor that breaks one is a programming error): rows are the first
dimension with any stride, everything after it contiguous; the KV cache is
``[blocks, block_size, kv_heads, head_dim]``; a block table is ``[rows, max_blocks]`` int64.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Protocol

import torch
import torch.nn.functional as F

from epdserve.kernels import KernelChoice
from epdserve.kernels.build import KernelBuildError, load_library
from epdserve.kernels.parallel import Workers

log = logging.getLogger(__name__)

_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}
CHUNK_ROWS_BUDGET = 64 * 1024  # new tokens x context of a prefill chunk the row-wise attention takes
PARALLEL_ELEMENTS = 1 << 18  # an elementwise call smaller than this runs on the calling thread
FRAME_HEAD_DIMS = (64, 80, 128)  # head sizes the compiled frame attention takes
FRAME_MIN_ROWS = 64  # shorter frames stay with SDPA, whose fixed cost is no larger there


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` [N, heads, D] rotated by cos/sin [N, D] (broadcast over heads), rotate-half style."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalized in float32 and scaled in the input dtype, as the model was trained."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class LayerOps(Protocol):
    """What a decoder layer computes besides its matmuls and attention."""

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``x += delta`` (in place, when given), then ``rms_norm(x, weight, eps)``."""
        ...

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` [N, heads, D] rotated by cos/sin [N, D]; may rotate ``x`` in place."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU: ``silu(gate) * up`` of the halves of each row of ``gate_up``."""
        ...

    def rotary_f32(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` [N, heads, D] rotated in float32 by float32 cos/sin [N, D] and rounded to its
        dtype once (a vision tower's rotation); may rotate ``x`` in place."""
        ...

    def quick_gelu(self, x: torch.Tensor) -> torch.Tensor:
        """``x * sigmoid(1.702 * x)`` (a vision MLP's activation)."""
        ...

    def frame_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int) -> torch.Tensor | None:
        """q, k, v [frames · n, heads, D]: each row attends over the n rows of its frame
        (bidirectionally, scaled by D^-0.5) → [frames · n, heads, D]; None where these ops do not
        take the shapes (the caller runs SDPA)."""
        ...


class TorchOps:
    """The layer's elementwise ops as PyTorch calls."""

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        if delta is not None:
            x.add_(delta)
        return rms_norm(x, weight, eps)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rotary(x, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotary_f32(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rotary(x.float(), cos, sin).to(x.dtype)

    def quick_gelu(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)

    def frame_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int) -> torch.Tensor | None:
        return None


def _rows(t: torch.Tensor, width: int) -> int:
    """The row stride of a CPU tensor whose rows (dim 0) each hold ``width`` contiguous elements."""
    shape = t.shape
    if t.is_contiguous() and t.numel() == shape[0] * width and t.device.type == "cpu":
        return width
    strides = t.stride()
    expected = 1
    for size, stride in zip(reversed(shape[1:]), reversed(strides[1:]), strict=True):
        if size != 1 and stride != expected:
            break
        expected *= size
    else:
        if expected == width and t.device.type == "cpu":
            return strides[0]
    raise ValueError(f"kernel operand must be CPU rows of {width} contiguous elements, got {tuple(shape)}")


def _like(t: torch.Tensor, dtype: torch.dtype, rows: int, width: int) -> None:
    """``t`` has ``dtype`` and at least ``rows`` rows of ``width`` (what a kernel will read)."""
    if t.dtype != dtype or (t.shape[0] if t.dim() > 1 else 1) < rows or t.numel() < rows * width:
        raise ValueError(f"kernel operand must be {dtype} with {rows} rows of {width}, got {t.dtype} {tuple(t.shape)}")
    if t.dim() > 1:
        _rows(t, width)


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype, hkv: int, d: int) -> None:
    for cache in (k_cache, v_cache):
        if cache.dtype != dtype or cache.dim() != 4 or cache.shape[2:] != (hkv, d) or not cache.is_contiguous():
            raise ValueError(f"the KV cache must be contiguous [blocks, block_size, {hkv}, {d}] of {dtype}")
    if v_cache.shape != k_cache.shape or k_cache.device.type != "cpu":
        raise ValueError("the K and V caches must be CPU tensors of one shape")


class CpuKernelOps:
    """The same ops through the fused C++ kernels (float32 and bfloat16 CPU tensors)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        # the frame attention runs on AVX-512 bfloat16 without AMX, where it was measured to beat
        # SDPA; with AMX, PyTorch's own attention may reach the tiles, and keeps the work
        self._attention_kernel = lib.epd_dot_available() == 1 and lib.epd_amx_available() != 1

    @staticmethod
    def supports(dtype: torch.dtype, device: torch.device) -> bool:
        return device.type == "cpu" and dtype in _DTYPE_CODE

    @staticmethod
    def attends(head_dim: int) -> bool:
        """Whether ``decode_attention`` takes this head size (its rows are read 8 lanes at a time)."""
        return head_dim % 8 == 0

    @staticmethod
    def attends_chunk(q_len: int, ctx_len: int) -> bool:
        """Whether a prefill chunk of ``q_len`` new tokens (``ctx_len`` with those cached) is
        attended row by row by ``decode_attention`` — each new token over its causal prefix in the
        cache — rather than by one SDPA call: for short chunks, where SDPA's fixed cost dominates;
        its matrix products win on long ones."""
        return q_len * ctx_len <= CHUNK_ROWS_BUDGET

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        rows, n = x.shape
        _like(weight, x.dtype, 1, n)
        if delta is not None:
            _like(delta, x.dtype, rows, n)
        out = torch.empty((rows, n), dtype=x.dtype)
        sd = _rows(delta, n) if delta is not None else 0
        self.lib.epd_add_rms_norm(
            _DTYPE_CODE[x.dtype],
            x.data_ptr(),
            _rows(x, n),
            delta.data_ptr() if delta is not None else None,
            sd,
            weight.data_ptr(),
            out.data_ptr(),
            n,
            rows,
            n,
            eps,
        )
        return out

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self._rotate(self.lib.epd_rotary, x, cos, sin, x.dtype)

    def rotary_f32(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self._rotate(self.lib.epd_rotary_f32, x, cos, sin, torch.float32)

    @staticmethod
    def _rotate(kernel, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, angles: torch.dtype) -> torch.Tensor:
        """``x`` [N, heads, D] rotated in place by ``kernel`` with cos/sin [N, D] of ``angles``."""
        rows, heads, d = x.shape
        _like(cos, angles, rows, d)
        _like(sin, angles, rows, d)
        if sin.stride() != cos.stride() or d % 2:
            raise ValueError("cos and sin must share a layout, and head_dim be even")
        kernel(
            _DTYPE_CODE[x.dtype],
            x.data_ptr(),
            _rows(x, heads * d),
            heads,
            d,
            cos.data_ptr(),
            sin.data_ptr(),
            _rows(cos, d),
            rows,
        )
        return x

    def quick_gelu(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        n = x.numel()
        self.lib.epd_quick_gelu(
            _DTYPE_CODE[x.dtype], x.data_ptr(), out.data_ptr(), n, Workers.threads(n, PARALLEL_ELEMENTS)
        )
        return out

    def frame_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int) -> torch.Tensor | None:
        """The compiled attention of ``epd_frame_attention`` (bfloat16; CPUs with AVX-512
        bfloat16 and no AMX), every row of a frame seeing all of it."""
        if not self._attends(q, n):
            return None
        if q.shape[0] % n or k.shape != q.shape or v.shape != q.shape:
            raise ValueError(f"q, k and v must be alike, frames of {n} rows; got {q.shape}, {k.shape}, {v.shape}")
        return self._attend(q, k, v, q.shape[0] // n, causal=False)

    def causal_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
        """A prompt chunk's attention by the same kernel: q [nq, heads, D] the chunk's last rows
        of the nk keys and values k, v [nk, kv_heads, D] (heads a multiple of kv_heads), query i
        seeing the first nk − nq + i + 1 of them → [nq, heads, D]; None where the kernel does not
        take the shapes (the caller runs SDPA)."""
        if not self._attends(q, q.shape[0]):
            return None
        if k.shape != v.shape or k.shape[0] < q.shape[0] or k.shape[2] != q.shape[2] or q.shape[1] % k.shape[1]:
            raise ValueError(f"k and v must be alike, at least q's rows, heads dividing q's; got {k.shape}, {v.shape}")
        return self._attend(q, k, v, 1, causal=True)

    def _attends(self, q: torch.Tensor, rows: int) -> bool:
        return (
            self._attention_kernel
            and q.dtype == torch.bfloat16
            and q.shape[2] in FRAME_HEAD_DIMS
            and rows >= FRAME_MIN_ROWS
        )

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, frames: int, causal: bool) -> torch.Tensor:
        """q [frames · nq, heads, D] against k, v [frames · nk, kv_heads, D]: rows whose heads'
        columns are contiguous are read in place at their own stride (views of a fused
        projection), others copied so first; the kernel packs each frame's keys and values for a
        KV head itself."""
        rows, heads, d = q.shape
        nq, nk, kv_heads = rows // frames, k.shape[0] // frames, k.shape[1]
        if k.dtype != q.dtype or v.dtype != q.dtype:
            raise ValueError(f"q, k and v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
        q, k, v = (t if t.stride(2) == 1 and t.stride(1) == d else t.contiguous() for t in (q, k, v))
        out = torch.empty((rows, heads, d), dtype=q.dtype)
        status = self.lib.epd_frame_attention(
            q.data_ptr(),
            _rows(q, heads * d),
            k.data_ptr(),
            _rows(k, kv_heads * d),
            v.data_ptr(),
            _rows(v, kv_heads * d),
            out.data_ptr(),
            heads * d,
            frames,
            nq,
            nk,
            heads,
            kv_heads,
            d,
            d**-0.5,
            int(causal),
            torch.get_num_threads(),
        )
        if status:
            raise ValueError(f"the attention kernel refused {frames} frames of {nq} x {nk} rows, {heads} heads of {d}")
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        rows, two_n = gate_up.shape
        if two_n % 2:
            raise ValueError("gate_up must hold two halves")
        n = two_n // 2
        out = torch.empty((rows, n), dtype=gate_up.dtype)
        self.lib.epd_silu_mul(
            _DTYPE_CODE[gate_up.dtype],
            gate_up.data_ptr(),
            _rows(gate_up, two_n),
            out.data_ptr(),
            n,
            rows,
            n,
            Workers.threads(rows * n, PARALLEL_ELEMENTS),
        )
        return out

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """k, v [N, kv_heads, D] into the cache at ``slots`` [N] (int64)."""
        rows, hkv, d = k.shape
        w = hkv * d
        if slots.dtype != torch.int64 or not slots.is_contiguous() or len(slots) != rows:
            raise ValueError("slots must be contiguous int64, one per row")
        _check_cache(k_cache, v_cache, k.dtype, hkv, d)
        if v.dtype != k.dtype:
            raise ValueError("k and v must have one dtype")
        status = self.lib.epd_write_kv(
            _DTYPE_CODE[k.dtype],
            k.data_ptr(),
            _rows(k, w),
            v.data_ptr(),
            _rows(v, w),
            w,
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            slots.data_ptr(),
            rows,
            k_cache.shape[0] * k_cache.shape[1],
        )
        if status:
            raise ValueError("a KV slot is outside the cache")

    def decode_attention(
        self,
        q: torch.Tensor,
        q_rows: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        table: torch.Tensor,
        table_rows: torch.Tensor,
        ctx: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """For each decode sequence b: its query row ``q_rows[b]`` of q [N, Hq, D] attends over
        positions 0..ctx[b]-1 of the paged cache (block table row ``table_rows[b]``); the result
        goes to the same row of ``out`` [N, Hq, D]."""
        n, hq, d = q.shape
        blocks, bs, hkv, _ = k_cache.shape
        _check_cache(k_cache, v_cache, q.dtype, hkv, d)
        for t in (q_rows, table_rows, ctx):
            if t.dtype != torch.int64 or not t.is_contiguous() or len(t) != len(q_rows):
                raise ValueError("q_rows, table_rows and ctx must be contiguous int64 of one length")
        if table.dtype != torch.int64 or not table.is_contiguous() or table.dim() != 2:
            raise ValueError("the block table must be a contiguous int64 matrix")
        if out.dtype != q.dtype or out.shape != q.shape:
            raise ValueError("out must be like q")
        status = self.lib.epd_decode_attention(
            _DTYPE_CODE[q.dtype],
            q.data_ptr(),
            _rows(q, hq * d),
            q_rows.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            blocks,
            table.data_ptr(),
            table.shape[1],
            table.shape[0],
            table_rows.data_ptr(),
            ctx.data_ptr(),
            len(q_rows),
            n,
            hq,
            hkv,
            d,
            bs,
            d**-0.5,
            out.data_ptr(),
            _rows(out, hq * d),
        )
        if status:
            raise ValueError("a decode row, block-table row, context length or block id is out of range")


def kernels_in_use(ops: LayerOps, choice: KernelChoice, dtype: torch.dtype, device: torch.device) -> str:
    """Which ops ``select_ops`` chose, and why, for a role's start-up line."""
    if isinstance(ops, CpuKernelOps):
        return "fused (C++ built for this CPU)"
    if choice == "torch":
        return "torch (--kernels torch)"
    if not CpuKernelOps.supports(dtype, device):
        return f"torch (no fused kernels for {str(dtype).removeprefix('torch.')} on {device.type})"
    return "torch (the fused kernels did not build: see the warning above)"


def select_ops(choice: KernelChoice, dtype: torch.dtype, device: torch.device) -> LayerOps:
    """The ops an engine runs with (``choice`` "torch" forces PyTorch)."""
    if choice == "torch" or not CpuKernelOps.supports(dtype, device):
        return TorchOps()
    try:
        return CpuKernelOps(load_library())
    except KernelBuildError as e:
        log.warning("fused CPU kernels unavailable, using PyTorch ops: %s", e)
        return TorchOps()
