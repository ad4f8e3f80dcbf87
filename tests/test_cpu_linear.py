"""The CPU layouts of loaded linear layers (``kernels/cpu_linear``): the same products as
``F.linear`` on the weights as loaded, for every row count, and what a loaded model gets."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from epdserve.assets import default_model_dir
from epdserve.kernels import KernelChoice
from epdserve.kernels import cpu_linear as cpu_linear_module
from epdserve.kernels import tiles as tiles_module
from epdserve.kernels.build import KernelBuildError, load_library
from epdserve.kernels.cpu_linear import (
    EXACT_ROWS,
    TOWER_ONEDNN_WEIGHT,
    PackedLinear,
    RowEmbedding,
    RowLinear,
    TileEmbedding,
    TileLinear,
    linears_in_use,
    packing_supported,
    prepare_linears,
    row_bucket,
    tie_head,
)
from epdserve.kernels.ops import TorchOps
from epdserve.kernels.parallel import shares
from epdserve.kernels.rows import MAX_ROWS, MIN_WEIGHT, SWAP_ROWS, RowDot, load_row_dot
from epdserve.kernels.tiles import Engine, TileMatmul, load_amx, load_tiles
from epdserve.models.loader import load_model
from tests.numerics import assert_close_rel

ROWS = (1, 3, 16, 47, 300)  # decode batches, the oneDNN hint, prefill chunks


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.SiLU(), nn.Linear(512, 96, bias=False)).to(dtype).requires_grad_(False)


def test_float32_weights_go_column_major_with_the_same_products() -> None:
    """With the compiled kernels off, float32 weights are stored column-major for MKL."""
    model = _model(torch.float32)
    before = [m.weight.clone() for m in model if isinstance(m, nn.Linear)]
    xs = [torch.randn(n, 256) for n in ROWS]
    want = [model(x) for x in xs]
    prepare_linears(model, torch.float32, torch.device("cpu"), kernels="torch")
    linears = [m for m in model if isinstance(m, nn.Linear)]
    for m, w in zip(linears, before, strict=True):
        assert type(m) is nn.Linear and not m.weight.is_contiguous() and m.weight.t().is_contiguous()
        assert torch.equal(m.weight, w)  # the same values, [out, in] as loaded
    for x, y in zip(xs, want, strict=True):
        assert_close_rel(model(x), y)


def _row_dot() -> RowDot:
    dot = load_row_dot()
    if dot is None:
        pytest.skip("no float32 row kernel here (no compiled kernels, or no AVX2 and FMA)")
    return dot


def test_float32_linears_go_to_the_row_kernel_on_their_weights_as_loaded() -> None:
    """With the kernels on, a large float32 linear outside the media towers is a ``RowLinear``
    on its weight as loaded, with F.linear's products at every row count; a small one, and a
    tower's, stay MKL's ``nn.Linear``, column-major."""
    _row_dot()
    torch.manual_seed(0)

    def part() -> nn.Sequential:  # 256 x 4096 is MIN_WEIGHT elements; 4096 x 96 is under it
        return nn.Sequential(nn.Linear(256, 4096), nn.SiLU(), nn.Linear(4096, 96, bias=False)).requires_grad_(False)

    model = nn.ModuleDict({"language": part(), "visual": part()})
    assert model["language"][0].weight.numel() == MIN_WEIGHT > model["language"][2].weight.numel()
    before = [m.weight.clone() for m in model.modules() if isinstance(m, nn.Linear)]
    xs = [torch.randn(n, 256) for n in ROWS]
    want = [(model["language"](x), model["visual"](x)) for x in xs]
    assert isinstance(prepare_linears(model, torch.float32, torch.device("cpu"), towers=("visual",)), RowDot)
    big, small = model["language"][0], model["language"][2]
    assert type(big) is RowLinear and big.weight.is_contiguous()
    assert type(small) is nn.Linear and small.weight.t().is_contiguous()
    tower = [m for m in model["visual"] if not isinstance(m, nn.SiLU)]
    assert all(type(m) is nn.Linear and m.weight.t().is_contiguous() for m in tower)
    after = [big, small, *tower]
    assert all(torch.equal(m.weight, w) for m, w in zip(after, before, strict=True))
    for x, (y, v) in zip(xs, want, strict=True):
        assert_close_rel(model["language"](x), y)
        assert_close_rel(model["visual"](x), v)
    small_only = _model(torch.float32)  # no weight as large: no row kernel in use
    assert prepare_linears(small_only, torch.float32, torch.device("cpu")) is None


@pytest.mark.parametrize(("k", "n"), [(1536, 8960), (8960, 1536), (37, 70), (31, 5)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_row_kernel_equals_f_linear_at_a_few_rows_and_hands_more_to_it(k: int, n: int, bias: bool) -> None:
    """Up to ``MAX_ROWS`` rows the compiled kernel (a K past or short of its 32-input steps, an N
    that is no multiple of its 64-column groups) within float32 roundings of F.linear; past it,
    MKL, on one thread or several."""
    dot = _row_dot()
    torch.manual_seed(k + n)
    w, b = torch.randn(n, k), (torch.randn(n) if bias else None)
    for m in (1, 2, 3, MAX_ROWS):
        x = torch.randn(m, k)
        assert_close_rel(dot.linear(x, w, b), F.linear(x, w, b), rel=1e-5)
    x = torch.randn(2, 3, k)  # leading dimensions kept
    assert dot.linear(x, w, b).shape == (2, 3, n)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):  # one thread: F.linear; more: MKL's weight @ x.T up to SWAP_ROWS rows
            torch.set_num_threads(t)
            for m in (MAX_ROWS + 1, 2 * MAX_ROWS, SWAP_ROWS, SWAP_ROWS + 1):
                big = torch.randn(m, k)
                y = dot.linear(big, w, b)
                assert y.is_contiguous()
                assert_close_rel(y, F.linear(big, w, b), rel=1e-5)
            big = torch.randn(3, MAX_ROWS, k)[:, 1:]  # leading dimensions kept, rows not contiguous
            assert_close_rel(dot.linear(big, w, b), F.linear(big, w, b), rel=1e-5)
    finally:
        torch.set_num_threads(threads)


def test_a_row_of_the_row_kernel_is_the_same_whatever_shares_its_call() -> None:
    """Each row sums in one order whatever rows share its call and however many threads split
    its columns: a request's logits do not depend on the batch it decodes in, bit for bit."""
    dot = _row_dot()
    torch.manual_seed(3)
    k, n = 1543, 4099
    w, b = torch.randn(n, k), torch.randn(n)
    x = torch.randn(MAX_ROWS, k)
    whole = dot.linear(x, w, b)
    for rows in range(1, MAX_ROWS):
        assert torch.equal(dot.linear(x[:rows], w, b), whole[:rows])
        assert torch.equal(dot.linear(x[rows : rows + 1], w, b), whole[rows : rows + 1])
    threads = torch.get_num_threads()
    try:
        for t in (1, 3):
            torch.set_num_threads(t)
            assert torch.equal(dot.linear(x, w, b), whole)
    finally:
        torch.set_num_threads(threads)


def test_the_row_kernel_refuses_what_does_not_fit_its_weight() -> None:
    dot = _row_dot()
    w = torch.randn(32, 64)
    with pytest.raises(ValueError, match="float32 rows"):
        dot.linear(torch.randn(2, 63), w)
    with pytest.raises(ValueError, match="float32 rows"):
        dot.linear(torch.randn(2, 64, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="contiguous"):
        dot.linear(torch.randn(2, 64), w.t().contiguous().t())
    with pytest.raises(ValueError, match="bias"):
        dot.linear(torch.randn(2, 64), w, torch.randn(31))
    assert dot.lib.epd_row_linear_f32(None, 0, 0, 64, None, 32, None, None, 32, 1) == -1  # no rows


@pytest.mark.parametrize(
    ("dtype", "kernels"), [(torch.bfloat16, "torch"), (torch.bfloat16, "auto"), (torch.float16, "auto")]
)
def test_half_precision_linears_are_prepacked_where_the_cpu_runs_them(
    dtype: torch.dtype, kernels: KernelChoice
) -> None:
    if not packing_supported(dtype):
        pytest.skip(f"this CPU or torch build has no oneDNN {dtype}")
    model = _model(dtype)
    xs = [torch.randn(n, 256, dtype=dtype) for n in ROWS]
    want = [model(x) for x in xs]
    prepare_linears(model, dtype, torch.device("cpu"), kernels)
    # bfloat16 on a CPU with AMX or AVX-512 bfloat16: the compiled tile matmul, unless the kernels
    # are turned off; else oneDNN
    kind = TileLinear if dtype == torch.bfloat16 and kernels == "auto" and load_tiles() is not None else PackedLinear
    assert [type(m) for m in model] == [kind, nn.SiLU, kind]
    for x, y in zip(xs, want, strict=True):
        got = model(x)
        assert got.dtype == dtype and got.shape == y.shape
        assert_close_rel(got.float(), y.float(), rel=1e-2)  # one bf16/fp16 rounding of the same sums
    three_d = torch.randn(2, 5, 256, dtype=dtype)  # any leading shape, as F.linear takes
    assert_close_rel(model(three_d).float(), model(three_d.reshape(10, 256)).reshape(2, 5, 96).float(), rel=1e-2)


def test_large_linears_of_a_media_tower_go_to_onednn() -> None:
    """A tower multiplies whole items' patches per call: its large linears go to oneDNN's kernels,
    its small ones and every linear outside it stay on the compiled tile matmul."""
    if load_tiles() is None or not packing_supported(torch.bfloat16):
        pytest.skip("needs AMX or AVX-512 bfloat16, and oneDNN bfloat16")
    big = TOWER_ONEDNN_WEIGHT // 512
    torch.manual_seed(0)
    model = (
        nn.ModuleDict(
            {
                "visual": nn.Sequential(nn.Linear(512, big), nn.Linear(big, 8)),
                "language_model": nn.Sequential(nn.Linear(512, big)),
            }
        )
        .to(torch.bfloat16)
        .requires_grad_(False)
    )
    x = torch.randn(300, 512, dtype=torch.bfloat16)
    want = model["visual"](x)
    prepare_linears(model, torch.bfloat16, torch.device("cpu"), towers=("visual",))
    onednn = PackedLinear if load_tiles().engine != "avx2" else TileLinear  # type: ignore[union-attr]
    assert [type(m) for m in model["visual"]] == [onednn, TileLinear]
    assert type(model["language_model"][0]) is TileLinear
    assert_close_rel(model["visual"](x).float(), want.float(), rel=1e-2)


def test_a_tower_stays_on_the_avx2_engine_where_onednn_converts_bfloat16(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU with AVX-512 but not its bfloat16 instructions, oneDNN runs bfloat16 but has no
    kernels of its own for it, and the tile matmul is the AVX2 engine: every linear, a tower's
    large ones too, goes to the tile matmul."""
    avx2 = _engine("avx2")
    if avx2 is None or not packing_supported(torch.bfloat16):
        pytest.skip("needs the AVX2 engine and oneDNN bfloat16")
    monkeypatch.setattr(cpu_linear_module, "load_tiles", lambda: avx2)
    torch.manual_seed(1)
    model = nn.ModuleDict({"visual": nn.Sequential(nn.Linear(512, TOWER_ONEDNN_WEIGHT // 512))}).to(torch.bfloat16)
    x = torch.randn(300, 512, dtype=torch.bfloat16)
    want = model["visual"](x)
    assert prepare_linears(model, torch.bfloat16, torch.device("cpu"), towers=("visual",)) is avx2
    assert type(model["visual"][0]) is TileLinear
    assert_close_rel(model["visual"](x).float(), want.float(), rel=1e-2)


def test_the_start_up_log_names_what_the_linears_run_on() -> None:
    cpu = torch.device("cpu")
    tiles = load_tiles()
    if tiles is not None:
        assert linears_in_use(torch.bfloat16, cpu, tiles) == f"the compiled tile matmul, {tiles.engine} engine"
    assert linears_in_use(torch.float32, cpu, None) == "MKL, column-major weights"
    if (dot := load_row_dot()) is not None:
        want_f32 = "the compiled float32 row kernel for a few rows of the large ones, MKL (column-major) elsewhere"
        assert linears_in_use(torch.float32, cpu, dot) == want_f32
    want = "oneDNN, prepacked" if packing_supported(torch.bfloat16) else "PyTorch's bfloat16 matmul"
    assert linears_in_use(torch.bfloat16, cpu, None) == want  # the kernels turned off
    assert linears_in_use(torch.bfloat16, torch.device("cuda"), None) == "as loaded (PyTorch on cuda)"


def test_each_checkpoint_weight_is_freed_as_its_layout_replaces_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading never holds a model's linear weights twice: by the time a linear is laid out, the
    checkpoint weights of those laid out before it (outside its own parent) are gone."""
    if load_tiles() is None and not packing_supported(torch.bfloat16):
        pytest.skip("this CPU keeps bfloat16 weights as loaded")
    model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)) for _ in range(8)))
    model = model.to(torch.bfloat16)
    checkpoint = [weakref.ref(m.weight) for m in model.modules() if type(m) is nn.Linear]
    alive: list[int] = []
    module = cpu_linear_module
    for cls in (module.TileLinear, module.PackedLinear):
        original = cls.__init__

        def counting(self, linear, *args, _original=original) -> None:  # type: ignore[no-untyped-def]
            alive.append(sum(ref() is not None for ref in checkpoint))
            _original(self, linear, *args)

        monkeypatch.setattr(cls, "__init__", counting)
    prepare_linears(model, torch.bfloat16, torch.device("cpu"))
    # at each layout: the weights not laid out yet, and those of its own parent; none from before
    assert alive == [16 - 2 * (i // 2) for i in range(16)]
    assert all(ref() is None for ref in checkpoint)


def test_other_devices_and_dtypes_keep_the_weights_as_loaded() -> None:
    model = _model(torch.float32)
    weights = [m.weight for m in model if isinstance(m, nn.Linear)]
    prepare_linears(model, torch.float32, torch.device("meta"))  # not a CPU: untouched
    assert [m.weight for m in model if isinstance(m, nn.Linear)] == weights
    assert all(w.is_contiguous() for w in weights)


def test_a_loaded_model_runs_on_the_prepared_layout() -> None:
    model, _ = load_model(default_model_dir(), frozenset({"language"}), torch.float32)
    lm = model.language_model
    linears = [m for m in lm.modules() if isinstance(m, nn.Linear)]  # the embedded model's are small
    assert linears and all(m.weight.t().is_contiguous() for m in linears)
    assert type(lm.embed_tokens) is nn.Embedding
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


def _engine(engine: Engine) -> TileMatmul | None:
    """The tile matmul's ``engine`` where this CPU runs it (a CPU runs every engine its
    instruction set allows: an AMX CPU all three)."""
    if engine == "amx":
        return load_amx()
    try:
        lib = load_library()
    except KernelBuildError:
        return None
    available = lib.epd_dot_available() if engine == "avx512" else lib.epd_fma_available()
    return TileMatmul(lib, engine) if available == 1 else None


def _dot_engine_is_this_cpus() -> bool:
    """Whether this CPU's tile matmul (``load_tiles``) is one of the dot-product engines."""
    tiles = load_tiles()
    return tiles is not None and tiles.engine in ("avx512", "avx2")


@pytest.fixture(scope="module", params=["amx", "avx512", "avx2"])
def tiles(request: pytest.FixtureRequest) -> TileMatmul:
    t = _engine(request.param)
    if t is None:
        pytest.skip(f"no {request.param} tile matmul here (CPU, compiler or operating system)")
    return t


@pytest.fixture(scope="module")
def amx() -> TileMatmul:
    a = load_amx()
    if a is None:
        pytest.skip("no AMX here (CPU, compiler or operating system)")
    return a


@pytest.mark.parametrize(
    ("k", "n", "bias"), [(256, 1536, False), (768, 256, False), (1176, 128, True), (40, 24, True), (37, 33, True)]
)
def test_the_tile_matmul_equals_f_linear_at_any_row_count(tiles: TileMatmul, k: int, n: int, bias: bool) -> None:
    """Whole and partial row blocks, K a multiple of 32 or not (odd too), N a multiple of 16 or not:
    float32 sums of the same products rounded once, so within a bfloat16 rounding of F.linear
    (oneDNN's sums, in their own order)."""
    torch.manual_seed(k + n)
    w = torch.randn(n, k, dtype=torch.bfloat16)
    b = torch.randn(n, dtype=torch.bfloat16) if bias else None
    packed = tiles.pack(w)
    for rows in (1, 5, 16, 17, 46, 64, 300):
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        got = tiles.linear(x, packed, n, b)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        assert_close_rel(got.float(), F.linear(x.float(), w.float(), None if b is None else b.float()), rel=1e-2)
    strided = torch.randn(7, k + 9, dtype=torch.bfloat16)[:, 3 : 3 + k]  # rows with a stride of their own
    assert torch.equal(tiles.linear(strided, packed, n, b), tiles.linear(strided.contiguous(), packed, n, b))
    assert tiles.linear(torch.randn(2, 3, k, dtype=torch.bfloat16), packed, n, b).shape == (2, 3, n)
    assert tiles.linear(torch.empty(0, k, dtype=torch.bfloat16), packed, n, b).shape == (0, n)


@pytest.mark.parametrize(("m", "k", "n", "bias"), [(300, 1536, 8960, False), (1024, 1280, 3 * 1280 + 16, True)])
def test_a_large_amx_matmul_split_over_threads_equals_one_call(
    amx: TileMatmul, m: int, k: int, n: int, bias: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Large enough to be split by output columns over torch's threads (an N that is no multiple
    of the split's 64 columns too): every column exactly as one call computes it."""
    assert m * k * n >= tiles_module.PARALLEL_MACS
    torch.manual_seed(m)
    w, x = torch.randn(n, k, dtype=torch.bfloat16), torch.randn(m, k, dtype=torch.bfloat16)
    b = torch.randn(n, dtype=torch.bfloat16) if bias else None
    packed = amx.pack(w)
    calls: list[tuple[int, int]] = []  # the [start, end) columns of each compiled call
    real = amx._columns
    monkeypatch.setattr(amx, "_columns", lambda *a: calls.append((a[-2], a[-1])) or real(*a))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = amx.linear(x, packed, n, b)
        assert calls == [(0, n)]
        torch.set_num_threads(3)
        split = amx.linear(x, packed, n, b)
    finally:
        torch.set_num_threads(threads)
    parts = sorted(calls[1:])  # the threads end in any order
    assert len(parts) == 3 and parts[0][0] == 0 and parts[-1][1] == n, calls
    assert all(a % 64 == 0 and a == before[1] for (a, _), before in zip(parts[1:], parts, strict=False)), calls
    assert torch.equal(split, one)
    assert shares(100, 8, 64) == [(0, 64), (64, 100)]  # never a share without columns
    assert shares(n, 1, 64) == [(0, n)]


def test_the_tile_matmul_refuses_what_does_not_fit_its_weight(tiles: TileMatmul) -> None:
    packed = tiles.pack(torch.randn(32, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16 rows"):
        tiles.linear(torch.randn(4, 64), packed, 32)  # float32
    with pytest.raises(ValueError, match="bfloat16 rows"):
        tiles.linear(torch.randn(4, 96, dtype=torch.bfloat16), packed, 32)  # another K
    with pytest.raises(ValueError, match="bias"):
        tiles.linear(torch.randn(4, 64, dtype=torch.bfloat16), packed, 32, torch.randn(31, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="2-D bfloat16"):
        tiles.pack(torch.randn(32, 64))


@pytest.mark.parametrize("engine", ["avx512", "avx2"])
@pytest.mark.parametrize(("m", "k", "n"), [(1, 1536, 8960), (300, 1280, 3 * 1280 + 16), (5, 8960, 1536)])
def test_a_dot_product_matmul_split_over_threads_equals_one_call(engine: Engine, m: int, k: int, n: int) -> None:
    """The AVX-512 and AVX2 engines split inside their call, on torch's OpenMP threads: every
    column exactly as one thread computes it, whatever the thread count (an N that is no multiple
    of 64 too)."""
    tiles = _engine(engine)
    if tiles is None:
        pytest.skip(f"no {engine} tile matmul here")
    assert tiles.splits(m, k, n)
    torch.manual_seed(n)
    w, x, b = (torch.randn(*shape, dtype=torch.bfloat16) for shape in ((n, k), (m, k), (n,)))
    packed = tiles.pack(w)
    threads = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(tiles.linear(x, packed, n, b))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("engine", ["avx512", "avx2"])
def test_a_row_is_the_same_whatever_rows_share_its_call(engine: Engine) -> None:
    """The dot-product engines sum each row in one order whatever rows share its pass (one to a
    pass's full count, a ragged last pass, rows widened in more than one chunk): a request's
    logits do not depend on the batch it decodes in, bit for bit."""
    tiles = _engine(engine)
    if tiles is None:
        pytest.skip(f"no {engine} tile matmul here")
    torch.manual_seed(5)
    k, n = 4101, 72  # an odd K past a 64-pair tile boundary; a ragged column block
    w, b = torch.randn(n, k, dtype=torch.bfloat16), torch.randn(n, dtype=torch.bfloat16)
    packed = tiles.pack(w)
    x = torch.randn(263, k, dtype=torch.bfloat16)  # the AVX2 engine widens 252 rows of 4102 per chunk
    whole = tiles.linear(x, packed, n, b)
    for rows in (1, 2, 3, 5, 9):
        assert torch.equal(tiles.linear(x[:rows], packed, n, b), whole[:rows])
    alone = torch.cat([tiles.linear(x[i : i + 1], packed, n, b) for i in range(0, 263, 37)])
    assert torch.equal(alone, whole[0:263:37])
    assert_close_rel(whole.float(), F.linear(x.float(), w.float(), b.float()), rel=1e-2)


def test_a_tied_table_is_held_once_in_the_tile_layout_for_lookups_and_logits() -> None:
    """Where a dot-product engine (AVX-512 bfloat16 or AVX2) is this CPU's tile matmul, a tied
    bfloat16 table becomes a ``TileEmbedding``: lookups
    give exactly the table's rows (any id shape, the last rows of a partial 16-row block too),
    the projection is F.linear's within a bfloat16 rounding, and an id outside the table is an
    IndexError as with nn.Embedding. Elsewhere, in float32 or with the kernels off, the table
    stays as it is."""
    torch.manual_seed(0)
    table = nn.Embedding(1000, 72).to(torch.bfloat16)  # 1000 rows: 62.5 blocks of 16; 72: a ragged K
    assert tie_head(table, None) is table  # the kernels off: no tile matmul
    assert tie_head(nn.Embedding(1000, 72), load_tiles()).__class__ is nn.Embedding  # float32
    tied = tie_head(table, load_tiles())
    if not _dot_engine_is_this_cpus():
        assert tied is table
        pytest.skip("the tied table is laid out only where a dot-product engine is this CPU's tile matmul")
    assert isinstance(tied, TileEmbedding)
    ids = torch.tensor([[0, 15, 16, 999], [998, 992, 500, 1]])
    assert torch.equal(tied(ids), table(ids))
    assert tied(torch.tensor([], dtype=torch.long)).shape == (0, 72)
    hidden = torch.randn(3, 72, dtype=torch.bfloat16)
    assert_close_rel(tied.project(hidden).float(), F.linear(hidden.float(), table.weight.float()), rel=1e-2)
    for bad in (1000, 1007, -1):  # past the table, inside the layout's padding, negative
        with pytest.raises(IndexError):
            tied(torch.tensor([3, bad]))


def test_a_loaded_tied_model_answers_with_its_table_in_the_tile_layout() -> None:
    """The embedded checkpoint ties its table: in bfloat16 with a dot-product engine the table is
    laid out once, and the logits equal those of the kernels turned off within bfloat16 roundings."""
    if not _dot_engine_is_this_cpus():
        pytest.skip("needs a dot-product engine as this CPU's tile matmul")
    tiled, _ = load_model(default_model_dir(), frozenset({"language"}), torch.bfloat16)
    plain, _ = load_model(default_model_dir(), frozenset({"language"}), torch.bfloat16, kernels="torch")
    lm, ref = tiled.language_model, plain.language_model
    assert lm.lm_head is None and isinstance(lm.embed_tokens, TileEmbedding)
    assert type(ref.embed_tokens) is nn.Embedding
    ids = torch.arange(0, lm.config.vocab_size, 7)
    assert torch.equal(lm.embed_tokens(ids), ref.embed_tokens(ids))
    hidden = torch.randn(5, lm.config.hidden_size, dtype=torch.bfloat16)
    assert_close_rel(lm.compute_logits(hidden).float(), ref.compute_logits(hidden).float(), rel=2e-2)


def test_a_tied_float32_table_projects_with_the_row_kernel() -> None:
    """In float32 with the row kernel a large tied table is a ``RowEmbedding``: the same table
    for lookups (an id outside it an IndexError, as nn.Embedding's) and F.linear's logits
    within float32 roundings. A small table, or a bfloat16 one, stays as it is."""
    dot = _row_dot()
    torch.manual_seed(0)
    table = nn.Embedding(MIN_WEIGHT // 72 + 1, 72)  # a ragged K
    tied = tie_head(table, dot)
    assert isinstance(tied, RowEmbedding) and tied.weight.data_ptr() == table.weight.data_ptr()
    ids = torch.tensor([[0, 15, table.num_embeddings - 1], [998, 500, 1]])
    assert torch.equal(tied(ids), table(ids))
    with pytest.raises(IndexError):
        tied(torch.tensor([table.num_embeddings]))
    for rows in (1, 3, MAX_ROWS + 1):
        hidden = torch.randn(rows, 72)
        assert_close_rel(tied.project(hidden), F.linear(hidden, table.weight), rel=1e-5)
    small = nn.Embedding(1000, 72)
    assert tie_head(small, dot) is small
    half = nn.Embedding(MIN_WEIGHT // 72 + 1, 72).to(torch.bfloat16)
    assert tie_head(half, dot) is half
