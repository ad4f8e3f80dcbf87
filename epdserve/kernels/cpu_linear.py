"""How a loaded model's linear layers are laid out for the CPU's matrix libraries.

The checkpoint's ``[out, in]`` weights are right for loading and wrong for a CPU matmul:

- **float32 with the compiled kernels** (AVX2 and FMA): the language model's large linears
  (``rows.MIN_WEIGHT`` elements and more) are ``RowLinear``: a decode step's few rows go to
  the compiled row kernel (``kernels.rows``), which reads the weight as loaded once per call
  at the memory's speed, where MKL's matrix-vector paths read it at a fraction of it; larger
  products go to MKL on the same weight. A large tied output table gets the same kernel
  (``RowEmbedding``). Media towers, whose calls are a whole item's patches, and small weights,
  which a step reads from cache, stay with MKL, laid out as below.
- **float32 otherwise**: MKL multiplies by a row-major ``[out, in]`` weight as a transposed
  operand, which it packs again on every call at a few rows; stored column-major (the same
  values, ``weight`` still ``[out, in]`` as a transposed view) it is a contiguous ``[in, out]``
  matrix and that copy is gone. Same kernels, same results.
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
from epdserve.kernels.rows import MIN_WEIGHT, RowDot, load_row_dot
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


class LaidOutLinear(nn.Module):
    """A loaded ``nn.Linear`` whose weight a subclass lays out for a CPU matmul: the shapes and
    the bias as the linear had them."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class PackedLinear(LaidOutLinear):
    """A loaded ``nn.Linear`` whose weight lives in oneDNN's blocked layout (inference only:
    ``weight`` keeps the dtype and [out, in] shape but is an opaque oneDNN tensor)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), BATCH_HINT)
        self.weight = nn.Parameter(packed, requires_grad=False)

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


class TileLinear(LaidOutLinear):
    """A loaded bfloat16 ``nn.Linear`` multiplied by the compiled tile matmul (``kernels.tiles``,
    on AMX, AVX-512 bfloat16 or AVX2): ``weight`` holds the tile layout (1-D), packed once at load."""

    def __init__(self, linear: nn.Linear, matmul: TileMatmul) -> None:
        super().__init__(linear)
        self.matmul = matmul
        self.weight = nn.Parameter(matmul.pack(linear.weight), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul.linear(x, self.weight, self.out_features, self.bias)


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


class RowLinear(LaidOutLinear):
    """A loaded float32 ``nn.Linear`` whose few-row products run in the compiled row kernel
    (``kernels.rows``) and larger ones in MKL, on the weight as loaded."""

    def __init__(self, linear: nn.Linear, dot: RowDot) -> None:
        super().__init__(linear)
        self.dot = dot
        self.weight = nn.Parameter(linear.weight.detach().contiguous(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype != torch.float32:  # converted after loading (``.to``): as nn.Linear
            return F.linear(x, self.weight, self.bias)
        return self.dot.linear(x, self.weight, self.bias)


class RowEmbedding(nn.Embedding):
    """A float32 embedding table that is also the output projection (tied weights): lookups as
    ``nn.Embedding``'s, the projection by the compiled row kernel. Made by ``tie_head``."""

    def __init__(self, embedding: nn.Embedding, dot: RowDot) -> None:
        super().__init__(embedding.num_embeddings, embedding.embedding_dim, _weight=embedding.weight.detach())
        self.requires_grad_(False)
        self.dot = dot

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., dim] → [..., num_embeddings]: ``F.linear(hidden, table)``."""
        return self.dot.linear(hidden, self.weight)


LinearKernel = TileMatmul | RowDot  # the compiled matmul a model's language-model linears got


def tie_head(embedding: nn.Embedding, kernel: LinearKernel | None) -> nn.Embedding | TileEmbedding | RowEmbedding:
    """The tied table of a language model laid out for its projection: a ``TileEmbedding`` where
    ``kernel`` (what ``prepare_linears`` chose for the model's linears; None: none) is the
    AVX-512 bfloat16 or the AVX2 tile engine, a ``RowEmbedding`` where it is the float32 row
    kernel, else ``embedding`` as it is. (On AMX the tied projection stays ``F.linear``: it has
    not been measured there.)"""
    dtype = embedding.weight.dtype
    if isinstance(kernel, RowDot) and dtype == torch.float32 and embedding.weight.numel() >= MIN_WEIGHT:
        return RowEmbedding(embedding, kernel)
    if isinstance(kernel, TileMatmul) and kernel.engine != "amx" and dtype == torch.bfloat16:
        return TileEmbedding(embedding, kernel)
    return embedding


def linears_in_use(dtype: torch.dtype, device: torch.device, kernel: LinearKernel | None) -> str:
    """What ``prepare_linears`` laid a model's linear layers out for, for a role's start-up log."""
    if device.type != "cpu":
        return f"as loaded (PyTorch on {device.type})"
    if isinstance(kernel, TileMatmul):
        return f"the compiled tile matmul, {kernel.engine} engine"
    if isinstance(kernel, RowDot):
        return "the compiled float32 row kernel for a few rows of the large ones, MKL (column-major) elsewhere"
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
) -> LinearKernel | None:
    """Lay out every ``nn.Linear`` of a loaded model for the CPU's matmul libraries (above);
    with ``kernels`` "auto", bfloat16 ones go to the compiled tile matmul where the CPU has AMX,
    AVX-512 bfloat16 or AVX2, but for the large ones of the submodules named in ``towers`` (media
    towers: many rows per call), and float32 ones outside the towers to the compiled row kernel
    where the CPU has AVX2 and the weight is large (``rows.MIN_WEIGHT``). Returns the compiled
    kernel used, or None where none is."""
    if device.type != "cpu":
        return None
    auto = kernels == "auto"
    tiles = load_tiles() if dtype == torch.bfloat16 and auto else None
    rows = load_row_dot() if dtype == torch.float32 and auto else None
    pack = packing_supported(dtype)
    rows_used = False
    # the linears themselves stay out of the list: each checkpoint weight is freed as soon as its
    # layout replaces it, so loading never holds the weights twice
    parents = [(path, module) for path, module in model.named_modules() if type(module) is not nn.Linear]
    for path, module in parents:
        in_tower = any(path == t or path.startswith(t + ".") for t in towers)
        for name, child in list(module.named_children()):
            if type(child) is not nn.Linear:
                continue
            many_rows = in_tower and child.weight.numel() >= TOWER_ONEDNN_WEIGHT
            float32 = child.weight.dtype == torch.float32
            if tiles is not None and not (many_rows and pack and tiles.engine != "avx2"):
                setattr(module, name, TileLinear(child, tiles))
            elif pack:
                setattr(module, name, PackedLinear(child))
            elif rows is not None and float32 and not in_tower and child.weight.numel() >= MIN_WEIGHT:
                setattr(module, name, RowLinear(child, rows))
                rows_used = True
            elif float32 and child.weight.is_contiguous():  # MKL's: no row kernel, or a tower
                child.weight = nn.Parameter(child.weight.detach().t().contiguous().t(), requires_grad=False)
    return tiles if tiles is not None else (rows if rows_used else None)
