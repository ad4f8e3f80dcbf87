"""A whole decoder stack in one call of the compiled kernels (bfloat16, on the tile matmul).

A decode step of a small model spends most of its time between kernels: every layer makes a dozen
Python and PyTorch calls around its matmuls, norms, rotation and attention. ``FusedDecoder`` makes
the same kernel calls, in the same order and with the same operands, from C++: one call per step
for all layers, with outputs bit for bit those of the layer-by-layer path. It runs the steps whose
every new token attends row by row over the paged cache (``RowWise``: decode tokens and short
prompt chunks); the engine takes the layer-by-layer path for the others. Its matmuls are those of
the engine the layers' weights were packed for (``kernels.tiles``): AMX's on the calling thread,
the AVX-512 and AVX2 ones' split over torch's threads as the layer-by-layer path splits them.
Threads on cores borrowed from idle roles (``kernels.lending``) are handed back between layers,
as the layer-by-layer path hands them back: the kernel reads the lenders' flags on the core board.

The weights and the KV cache are fixed tensors: their addresses go into one table when the
decoder is built, after every size and layout was checked; each call checks the step's own
operands, and the kernel checks every cache index before it reads or writes through it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import NamedTuple

import torch

from epdserve.kernels.build import POINTERS_PER_LAYER
from epdserve.kernels.lending import CoreLender
from epdserve.kernels.tiles import Engine, TileMatmul

ENGINE_CODES: dict[Engine, int] = {"amx": 0, "avx512": 1, "avx2": 2}  # epd_decoder_stack's ``engine``


class StackShape(NamedTuple):
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float


class LayerWeights(NamedTuple):
    """One decoder layer's tensors as the kernel reads them (the matmul weights in the tile layout)."""

    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # packed [(heads + 2 kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None  # [(heads + 2 kv_heads) * head_dim]
    o: torch.Tensor  # packed [hidden, heads * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # packed [2 * intermediate, hidden]
    down: torch.Tensor  # packed [hidden, intermediate]


class RowWise(NamedTuple):
    """A step whose every new token attends row by row: the query of the step's row r attends
    positions 0..ctx[r]-1 of block-table row ``table_rows[r]``, after its k/v went to ``slots[r]``."""

    slots: torch.Tensor  # int64 [N]
    table: torch.Tensor  # int64 [rows, max_blocks]
    table_rows: torch.Tensor  # int64 [N]
    ctx: torch.Tensor  # int64 [N]


def _check(t: torch.Tensor, numel: int, what: str) -> None:
    if t.dtype != torch.bfloat16 or not t.is_contiguous() or t.numel() != numel or t.device.type != "cpu":
        raise ValueError(f"{what} must be {numel} contiguous bfloat16 CPU values, got {t.dtype} {tuple(t.shape)}")


class FusedDecoder:
    def __init__(
        self,
        lib: ctypes.CDLL,
        engine: Engine,
        shape: StackShape,
        layers: Sequence[LayerWeights],
        final_norm: torch.Tensor,
        k_cache: Sequence[torch.Tensor],
        v_cache: Sequence[torch.Tensor],
    ) -> None:
        h, hq, hkv, d, inter = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.intermediate
        if hkv < 1 or hq % hkv or d % 8 or len(k_cache) != len(layers) or len(v_cache) != len(layers):
            raise ValueError("unsupported attention shape, or not one K and one V cache per layer")
        qkvw = (hq + 2 * hkv) * d
        size = TileMatmul.packed_size
        self.lib, self.engine, self.shape = lib, engine, shape
        self.blocks, self.block_size = k_cache[0].shape[0], k_cache[0].shape[1]
        rows = []
        for i, (w, kc, vc) in enumerate(zip(layers, k_cache, v_cache, strict=True)):
            _check(w.input_norm, h, f"layer {i} input norm")
            _check(w.post_norm, h, f"layer {i} post-attention norm")
            _check(w.qkv, size(qkvw, h), f"layer {i} packed qkv")
            if w.qkv_bias is not None:
                _check(w.qkv_bias, qkvw, f"layer {i} qkv bias")
            _check(w.o, size(h, hq * d), f"layer {i} packed o")
            _check(w.gate_up, size(2 * inter, h), f"layer {i} packed gate_up")
            _check(w.down, size(h, inter), f"layer {i} packed down")
            for cache in (kc, vc):
                _check(cache, self.blocks * self.block_size * hkv * d, f"layer {i} KV cache")
            bias = w.qkv_bias.data_ptr() if w.qkv_bias is not None else 0
            ptrs = (w.input_norm, w.qkv, bias, w.o, w.post_norm, w.gate_up, w.down, kc, vc)
            rows.append([p if isinstance(p, int) else p.data_ptr() for p in ptrs])
        _check(final_norm, h, "final norm")
        self.table = torch.tensor(rows, dtype=torch.int64).reshape(len(layers), POINTERS_PER_LAYER)
        self.matmuls = ((h, qkvw), (hq * d, h), (h, 2 * inter), (inter, h))  # (k, n) in StackMatmul's order
        # AMX's stack runs on one thread; matmuls this large split over torch's threads layer by layer
        self.splits = engine == "amx" and any(TileMatmul.splits(1, k, n) for k, n in self.matmuls)
        self._threads: dict[tuple[int, int], torch.Tensor] = {}  # (rows, threads) -> ``threads``
        self.lender: CoreLender | None = None  # this role's seat on a core board, if it borrows cores
        # the tensors whose addresses the table holds stay alive as long as it does
        self._held = (list(layers), list(k_cache), list(v_cache))
        self.final_norm = final_norm

    def preferred(self) -> bool:
        """Whether the stack is the faster path for a row-wise step now: always where its matmuls
        split themselves (AVX-512, AVX2); on AMX, on one thread, or with more only when its
        matmuls are too small to split (``TileMatmul.splits``), since the layer-by-layer path reads
        a large weight on every thread at once."""
        return not self.splits or torch.get_num_threads() == 1

    def threads(self, rows: int, count: int | None = None) -> torch.Tensor:
        """The threads each of a layer's matmuls splits over at ``rows`` rows with ``count``
        threads (default: torch's): as many as ``TileLinear`` would give it layer by layer (AMX:
        one), kept per (rows, count)."""
        key = (rows, torch.get_num_threads() if count is None else count)
        if key not in self._threads:
            counts = [1 if self.engine == "amx" else TileMatmul.threads(rows, k, n, key[1]) for k, n in self.matmuls]
            self._threads[key] = torch.tensor(counts, dtype=torch.int64)
        return self._threads[key]

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: RowWise) -> torch.Tensor:
        """x [N, hidden] (the embeddings; overwritten: the residual stream) → final-normed hidden
        [N, hidden]; cos/sin [N, head_dim]."""
        s = self.shape
        n = x.shape[0]
        _check(x, n * s.hidden, "x")
        _check(cos, n * s.head_dim, "cos")
        _check(sin, n * s.head_dim, "sin")
        for name, t in (
            ("slots", step.slots),
            ("table_rows", step.table_rows),
            ("ctx", step.ctx),
        ):
            if t.dtype != torch.int64 or not t.is_contiguous() or t.numel() != n:
                raise ValueError(f"{name} must be {n} contiguous int64 values")
        table = step.table
        if table.dtype != torch.int64 or not table.is_contiguous() or table.dim() != 2:
            raise ValueError("the block table must be a contiguous int64 matrix")
        out = torch.empty_like(x)
        threads = self.threads(n)
        loan = self.lender.loan if self.lender is not None else None
        own = self.threads(n, loan.own) if loan is not None else threads
        status = self.lib.epd_decoder_stack(
            ENGINE_CODES[self.engine],
            threads.data_ptr(),
            own.data_ptr(),
            loan.flags.data_ptr() if loan is not None else None,
            loan.flags.numel() if loan is not None else 0,
            self.table.data_ptr(),
            self.table.shape[0],
            s.hidden,
            s.heads,
            s.kv_heads,
            s.head_dim,
            s.intermediate,
            s.eps,
            s.head_dim**-0.5,
            x.data_ptr(),
            n,
            self.final_norm.data_ptr(),
            out.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            step.slots.data_ptr(),
            self.blocks,
            self.block_size,
            table.data_ptr(),
            table.shape[1],
            table.shape[0],
            step.table_rows.data_ptr(),
            step.ctx.data_ptr(),
        )
        if status < 0:
            raise ValueError(
                f"a KV slot, block-table row, context length or block id is out of range (or no {self.engine} here)"
            )
        if status and self.lender is not None:  # the cores were handed back: the rest of the step without them
            self.lender.refresh()
        return out
