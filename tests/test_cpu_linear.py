"""The CPU layouts of loaded linear layers (``models/cpu_linear``): the same products as
``F.linear`` on the weights as loaded, for every row count, and what a loaded model gets."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from epdserve.assets import default_model_dir
from epdserve.kernels.ops import TorchOps
from epdserve.models.cpu_linear import (
    EXACT_ROWS,
    PackedLinear,
    packing_supported,
    prepare_linears,
    row_bucket,
)
from epdserve.models.loader import load_model
from tests.numerics import assert_close_rel

ROWS = (1, 3, 16, 47, 300)  # decode batches, the oneDNN hint, prefill chunks


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.SiLU(), nn.Linear(512, 96, bias=False)).to(dtype).requires_grad_(False)


def test_float32_weights_go_column_major_with_the_same_products() -> None:
    model = _model(torch.float32)
    before = [m.weight.clone() for m in model if isinstance(m, nn.Linear)]
    xs = [torch.randn(n, 256) for n in ROWS]
    want = [model(x) for x in xs]
    prepare_linears(model, torch.float32, torch.device("cpu"))
    linears = [m for m in model if isinstance(m, nn.Linear)]
    for m, w in zip(linears, before, strict=True):
        assert type(m) is nn.Linear and not m.weight.is_contiguous() and m.weight.t().is_contiguous()
        assert torch.equal(m.weight, w)  # the same values, [out, in] as loaded
    for x, y in zip(xs, want, strict=True):
        assert_close_rel(model(x), y)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_linears_are_prepacked_where_the_cpu_runs_them(dtype: torch.dtype) -> None:
    if not packing_supported(dtype):
        pytest.skip(f"this CPU or torch build has no oneDNN {dtype}")
    model = _model(dtype)
    xs = [torch.randn(n, 256, dtype=dtype) for n in ROWS]
    want = [model(x) for x in xs]
    prepare_linears(model, dtype, torch.device("cpu"))
    assert [type(m) for m in model] == [PackedLinear, nn.SiLU, PackedLinear]
    for x, y in zip(xs, want, strict=True):
        got = model(x)
        assert got.dtype == dtype and got.shape == y.shape
        assert_close_rel(got.float(), y.float(), rel=1e-2)  # one bf16/fp16 rounding of the same sums
    three_d = torch.randn(2, 5, 256, dtype=dtype)  # any leading shape, as F.linear takes
    assert_close_rel(model(three_d).float(), model(three_d.reshape(10, 256)).reshape(2, 5, 96).float(), rel=1e-2)


def test_other_devices_and_dtypes_keep_the_weights_as_loaded() -> None:
    model = _model(torch.float32)
    weights = [m.weight for m in model if isinstance(m, nn.Linear)]
    prepare_linears(model, torch.float32, torch.device("meta"))  # not a CPU: untouched
    assert [m.weight for m in model if isinstance(m, nn.Linear)] == weights
    assert all(w.is_contiguous() for w in weights)


def test_a_loaded_model_runs_on_the_prepared_layout() -> None:
    model, _ = load_model(default_model_dir(), frozenset({"language"}), torch.float32)
    lm = model.language_model
    linears = [m for m in lm.modules() if isinstance(m, nn.Linear)]
    assert linears and all(m.weight.t().is_contiguous() for m in linears)
    if packing_supported(torch.bfloat16):
        packed, _ = load_model(default_model_dir(), frozenset({"language"}), torch.bfloat16)
        assert not [m for m in packed.modules() if type(m) is nn.Linear]
        layer = packed.language_model.layers[0].mlp
        x = torch.randn(4, lm.config.hidden_size, dtype=torch.bfloat16)
        ref = lm.layers[0].mlp.to(torch.bfloat16)
        ops = TorchOps()
        assert_close_rel(layer(x, ops).float(), ref(x, ops).float(), rel=2e-2)


def test_row_buckets_are_few_and_cover_every_batch() -> None:
    buckets = sorted({row_bucket(rows) for rows in range(1, 8193)})
    assert len(buckets) < 80  # a few dozen kernels for any batch up to thousands of rows
    assert buckets[:EXACT_ROWS] == list(range(1, EXACT_ROWS + 1))  # decode batches run as they are
    for rows in range(1, 8193):
        b = row_bucket(rows)
        assert rows <= b <= rows * 1.125 + 15 and b in buckets


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_padded_row_counts_give_exactly_the_unpadded_products(dtype: torch.dtype) -> None:
    if not packing_supported(dtype):
        pytest.skip(f"this CPU or torch build has no oneDNN {dtype}")
    model = _model(dtype)
    packed = PackedLinear(model[0])
    for rows in (17, 33, 47, 300):  # padded to 32, 48, 48 and 320 rows
        x = torch.randn(rows, 256, dtype=dtype)
        got = packed(x)
        assert got.shape == (rows, 512)
        assert torch.equal(got, packed(torch.cat([x, torch.zeros(row_bucket(rows) - rows, 256, dtype=dtype)]))[:rows])
        assert_close_rel(got.float(), model[0](x).float(), rel=1e-2)
