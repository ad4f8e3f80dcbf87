"""How a loaded model's linear layers are laid out for the CPU's matrix libraries.

The checkpoint's ``[out, in]`` weights are right for loading and wrong for a CPU matmul:

- **float32**: MKL multiplies by a row-major ``[out, in]`` weight as a transposed operand, which
  it packs again on every call; stored column-major (the same values, ``weight`` still
  ``[out, in]`` as a transposed view) it is a contiguous ``[in, out]`` matrix and that copy is
  gone. Same kernels, same results.
- **bfloat16 on a CPU with AMX, AVX-512 bfloat16 or AVX2**: the compiled kernels' tile matmul
  (``TileLinear``, ``kernels.tiles``), the weight packed once at load: no per-call setup and
  nothing compiled per row count. With AMX it is at or under oneDNN's time at the row counts
  measured but for one shape at 192 rows and more; with AVX-512 bfloat16 alone it reads the
  weight of a decode step faster than oneDNN and keeps level with it at hundreds of rows; with
  AVX2 alone, where oneDNN has no bfloat16 matmul and PyTorch's reads the weight once per row,
  it reads it once per call (docs/benchmarks.md).
- **bfloat16 in a media tower** (``towers``), where every call multiplies a whole item's
  patches (hundreds of rows): oneDNN's own AMX kernels (``PackedLinear``) once the weight is as
  large as ``TOWER_ONEDNN_WEIGHT`` elements, the compiled tile matmul below that - at hundreds of
  rows oneDNN leads on large weights and trails on small ones (docs/benchmarks.md). Where the
  tile matmul is the AVX2 engine (AVX-512 without its bfloat16 instructions), oneDNN's bfloat16
  matmul converts as it goes and trails the tile matmul at every size, so the tower stays on it.
- **bfloat16 without either, float16**: oneDNN (AVX-512 where the CPU has it) reorders the weight
  into its blocked layout on every call; ``PackedLinear`` does it once, at load, as vLLM's CPU
  backend does. The results equal ``F.linear``'s (``tests/test_cpu_linear.py``).

oneDNN also compiles a kernel for every row count it meets (docs/benchmarks.md), and a serving
engine meets a great many: every prefill step's total differs. ``PackedLinear`` therefore runs
at a bounded set of row counts (``row_bucket``): exact up to 16 rows (decode batches), above that
the input is padded with zero rows to the next bucket and the padding cut off the output. A row's
result does not depend on the rows beside it, so the outputs are the same. Each bucket is
compiled when first met (a few dozen times per linear shape, ever), not at load: every compiled
kernel stays resident, and most buckets are never met.

On other devices the weights stay as loaded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from epdserve.kernels import KernelChoice
from epdserve.kernels.tiles import TileMatmul, load_tiles

BATCH_HINT = 16  # the row count oneDNN picks its blocked layout for (any row count works)
EXACT_ROWS = 16  # row counts up to this run as they are; larger ones are rounded up (row_bucket)
TOWER_ONEDNN_WEIGHT = 1 << 20  # weight elements from which a tower's linear goes to oneDNN


def row_bucket(rows: int) -> int:
    """The row count a matmul of ``rows`` rows runs at: ``rows`` up to ``EXACT_ROWS``, above it
    rounded up to a multiple of 16 (to 256 rows), then of 1/8 of its power of two (at most 12.5%
    padding) — so a few dozen row counts cover every batch up to thousands of rows."""
    if rows <= EXACT_ROWS:
        return rows
    step = max(16, 1 << max(0, (rows - 1).bit_length() - 4))
    return -(-rows // step) * step


def packing_supported(dtype: torch.dtype) -> bool:
    """Whether this CPU and torch build run oneDNN matmuls in ``dtype`` (bf16/fp16 only)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


class PackedLinear(nn.Module):
    """A loaded ``nn.Linear`` whose weight lives in oneDNN's blocked layout (inference only:
    ``weight`` keeps the dtype and [out, in] shape but is an opaque oneDNN tensor)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), BATCH_HINT)
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= EXACT_ROWS:  # a decode batch: as it is
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        rows = x.reshape(-1, self.in_features)
        n = rows.shape[0]
        padded = row_bucket(n)
        if padded != n:
            rows = F.pad(rows, (0, 0, 0, padded - n))
        y = torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "none", [], "")
        return y[:n].reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class TileLinear(nn.Module):
    """A loaded bfloat16 ``nn.Linear`` multiplied by the compiled tile matmul (``kernels.tiles``,
    on AMX, AVX-512 bfloat16 or AVX2): ``weight`` holds the tile layout (1-D), packed once at load."""

    def __init__(self, linear: nn.Linear, matmul: TileMatmul) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.matmul = matmul
        self.weight = nn.Parameter(matmul.pack(linear.weight), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul.linear(x, self.weight, self.out_features, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class TileEmbedding(nn.Module):
    """An embedding table that is also the output projection (tied weights), held once, in the
    tile layout: the projection is the tile matmul (a decode step reads the whole table, which
    ``F.linear`` would first lay out again on every call) and a lookup gathers its rows from the
    layout, the same values as the table's. Made by ``tie_head``."""

    def __init__(self, embedding: nn.Embedding, matmul: TileMatmul) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.matmul = matmul
        self.weight = nn.Parameter(matmul.pack(embedding.weight), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if flat.numel():
            low, high = torch.aminmax(flat)
            if int(low) < 0 or int(high) >= self.num_embeddings:
                raise IndexError(f"token ids must be in [0, {self.num_embeddings})")
        return self.matmul.rows(self.weight, flat, self.embedding_dim).reshape(*ids.shape, self.embedding_dim)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., dim] → [..., num_embeddings]: ``F.linear(hidden, table)``."""
        return self.matmul.linear(hidden, self.weight, self.num_embeddings)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


def tie_head(embedding: nn.Embedding, tiles: TileMatmul | None) -> nn.Embedding | TileEmbedding:
    """The tied table of a language model laid out for its projection: a ``TileEmbedding`` where
    ``tiles`` (what ``prepare_linears`` chose for the model's linears; None: none) is the AVX-512
    bfloat16 or the AVX2 engine, else ``embedding`` as it is. (On AMX the tied projection stays
    ``F.linear``: it has not been measured there.)"""
    if tiles is None or tiles.engine == "amx" or embedding.weight.dtype != torch.bfloat16:
        return embedding
    return TileEmbedding(embedding, tiles)


def linears_in_use(dtype: torch.dtype, device: torch.device, tiles: TileMatmul | None) -> str:
    """What ``prepare_linears`` laid a model's linear layers out for, for a role's start-up log."""
    if device.type != "cpu":
        return f"as loaded (PyTorch on {device.type})"
    if tiles is not None:
        return f"the compiled tile matmul, {tiles.engine} engine"
    if packing_supported(dtype):
        return "oneDNN, prepacked"
    if dtype == torch.float32:
        return "MKL, column-major weights"
    return f"PyTorch's {str(dtype).removeprefix('torch.')} matmul"


def prepare_linears(
    model: nn.Module,
    dtype: torch.dtype,
    device: torch.device,
    kernels: KernelChoice = "auto",
    towers: tuple[str, ...] = (),
) -> TileMatmul | None:
    """Lay out every ``nn.Linear`` of a loaded model for the CPU's matmul libraries (above);
    bfloat16 ones go to the compiled tile matmul where the CPU has AMX, AVX-512 bfloat16 or AVX2
    (``kernels`` "auto"), but for the large ones of the submodules named in ``towers`` (media
    towers: many rows per call). Returns that tile matmul, or None where none is used."""
    if device.type != "cpu":
        return None
    tiles = load_tiles() if dtype == torch.bfloat16 and kernels == "auto" else None
    pack = packing_supported(dtype)
    # the linears themselves stay out of the list: each checkpoint weight is freed as soon as its
    # layout replaces it, so loading never holds the weights twice
    parents = [(path, module) for path, module in model.named_modules() if type(module) is not nn.Linear]
    for path, module in parents:
        in_tower = any(path == t or path.startswith(t + ".") for t in towers)
        for name, child in list(module.named_children()):
            if type(child) is not nn.Linear:
                continue
            many_rows = in_tower and child.weight.numel() >= TOWER_ONEDNN_WEIGHT
            if tiles is not None and not (many_rows and pack and tiles.engine != "avx2"):
                setattr(module, name, TileLinear(child, tiles))
            elif pack:
                setattr(module, name, PackedLinear(child))
            elif child.weight.dtype == torch.float32 and child.weight.is_contiguous():
                child.weight = nn.Parameter(child.weight.detach().t().contiguous().t(), requires_grad=False)
    return tiles
