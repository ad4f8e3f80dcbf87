"""The fused CPU kernels against the PyTorch ops they replace (float32 and bfloat16), their
decode attention against SDPA over the same paged cache, and how the library is built: cached per
machine, never loaded from a directory others may write, and PyTorch ops when it cannot be built."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from epdserve.kernels import build
from epdserve.kernels.build import KernelBuildError, load_library
from epdserve.kernels.ops import CpuKernelOps, TorchOps, select_ops
from tests.numerics import assert_close_rel

COMPILER = shutil.which("g++") or shutil.which("c++") or os.environ.get("CXX")
needs_compiler = pytest.mark.skipif(not COMPILER, reason="no C++ compiler on this machine")
CPU = torch.device("cpu")
# bfloat16 results are compared after the same rounding points: one bfloat16 step apart at most
REL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


@pytest.fixture(scope="module")
def kernels() -> CpuKernelOps:
    if not COMPILER:
        pytest.skip("no C++ compiler on this machine")
    ops = select_ops("auto", torch.float32, CPU)
    assert isinstance(ops, CpuKernelOps), "a compiler is here: the kernels must build"
    return ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_elementwise_kernels_equal_the_torch_ops(kernels: CpuKernelOps, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    ref = TorchOps()
    rows, hidden, heads, d, inter = 7, 96, 6, 16, 80
    x = torch.randn(rows, hidden).to(dtype)
    delta = torch.randn(rows, hidden).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    x_ref, x_k = x.clone(), x.clone()
    assert_close_rel(
        kernels.add_rms_norm(x_k, delta, w, 1e-6).float(), ref.add_rms_norm(x_ref, delta, w, 1e-6).float(), REL[dtype]
    )
    assert torch.equal(x_k, x_ref)  # the residual stream gained delta in place, identically
    assert_close_rel(
        kernels.add_rms_norm(x_k, None, w, 1e-6).float(), ref.add_rms_norm(x_ref, None, w, 1e-6).float(), REL[dtype]
    )

    # rotary over a strided view (q and k heads inside a wider qkv row), as the model passes it
    qkv = torch.randn(rows, (heads + 2) * d).to(dtype)
    angles = torch.randn(rows, d // 2).float() * 3
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    view = qkv[:, : heads * d].view(rows, heads, d)
    rest = qkv[:, heads * d :].clone()
    want = ref.rotary(view.clone(), cos, sin)
    got = kernels.rotary(view, cos, sin)
    assert got.data_ptr() == qkv.data_ptr()  # in place
    assert_close_rel(got.float(), want.float(), REL[dtype])
    assert torch.equal(qkv[:, heads * d :], rest)  # the rest of the row untouched

    gate_up = (3 * torch.randn(rows, 2 * inter)).to(dtype)
    assert_close_rel(kernels.silu_mul(gate_up).float(), ref.silu_mul(gate_up).float(), REL[dtype])

    # a vision tower's rotary: q and k of a fused qkv [N, 3, heads, D] in one call, computed in
    # float32 by float32 angles and rounded once: PyTorch's result bit for bit, in place
    fused = torch.randn(rows, 3, heads, d).to(dtype)
    far = torch.randn(rows, d // 2) * 500  # far patches: large angles
    cos32, sin32 = torch.cat([far.cos()] * 2, -1), torch.cat([far.sin()] * 2, -1)
    v_before = fused[:, 2].clone()
    qk = fused[:, :2].flatten(1, 2)
    want = ref.rotary_f32(qk.clone(), cos32, sin32)
    got = kernels.rotary_f32(qk, cos32, sin32)
    assert got.data_ptr() == fused.data_ptr() and torch.equal(got, want)
    assert torch.equal(fused[:, 2], v_before)

    h = (4 * torch.randn(rows, inter)).to(dtype)
    assert_close_rel(kernels.quick_gelu(h).float(), ref.quick_gelu(h).float(), REL[dtype])


def _exp_like_the_kernels(x: torch.Tensor) -> torch.Tensor:
    """The kernels' e^x in float32, one IEEE operation at a time in their order (Cody-Waite
    reduction, Cephes' polynomial, the power of two from its exponent bits)."""
    x = x.clamp(-87.3, 88.7)
    n = torch.floor(x * 1.44269504088896341 + 0.5)
    r = x - n * 0.693359375 + n * 2.12194440e-4
    p = torch.full_like(x, 1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * r + c
    p = p * r * r + r + 1.0
    return p * ((n.to(torch.int32) + 127) << 23).view(torch.float32)


def test_bfloat16_activations_are_the_scalar_formula_bit_for_bit(kernels: CpuKernelOps) -> None:
    """Whatever lanes a CPU runs them on (and at any ragged length), quick GELU and
    SiLU-and-multiply in bfloat16 compute the same float32 operations, rounded where PyTorch
    rounds, as one element at a time would."""
    torch.manual_seed(6)

    def rnd(y: torch.Tensor) -> torch.Tensor:
        return y.to(torch.bfloat16).float()

    for n in (1, 15, 64, 77, 1000):
        x = (torch.randn(3, n) * torch.tensor([1.0, 20.0, 300.0])[:, None]).to(torch.bfloat16)
        xf = x.float()
        a = rnd(xf * 1.702)
        want = (xf * rnd(1.0 / (1.0 + _exp_like_the_kernels(-a)))).to(torch.bfloat16)
        assert torch.equal(kernels.quick_gelu(x), want)
        gate_up = torch.cat([x, x.flip(1) * 0.5], 1)
        g, u = gate_up.float().chunk(2, 1)
        want = (rnd(g / (1.0 + _exp_like_the_kernels(-g))) * u).to(torch.bfloat16)
        assert torch.equal(kernels.silu_mul(gate_up), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_elementwise_calls_split_over_threads_equal_one_call(
    kernels: CpuKernelOps, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call over enough elements is split over torch's threads (the kernel's own OpenMP spans);
    every element is computed as one call computes it, over strided rows too."""
    from epdserve.kernels import ops as ops_module

    monkeypatch.setattr(ops_module, "PARALLEL_ELEMENTS", 1000)
    torch.manual_seed(1)
    h = (4 * torch.randn(37, 211)).to(dtype)  # ragged: no share boundary falls on a row
    wide = (3 * torch.randn(37, 2 * 211 + 5)).to(dtype)
    gate_up = wide[:, : 2 * 211]  # rows a stride apart
    threads = torch.get_num_threads()
    spans: list[int] = []  # the thread count each call hands the kernel
    for name in ("epd_quick_gelu", "epd_silu_mul"):
        real = getattr(kernels.lib, name)
        monkeypatch.setattr(kernels.lib, name, lambda *args, real=real: spans.append(args[-1]) or real(*args))
    try:
        torch.set_num_threads(1)
        one = kernels.quick_gelu(h), kernels.silu_mul(gate_up)
        torch.set_num_threads(3)
        split = kernels.quick_gelu(h), kernels.silu_mul(gate_up)
    finally:
        torch.set_num_threads(threads)
    assert spans == [1, 1, 3, 3]
    for a, b in zip(one, split, strict=True):
        assert torch.equal(a, b)


def test_kernels_refuse_a_layout_they_cannot_read(kernels: CpuKernelOps) -> None:
    x = torch.randn(8, 4)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.silu_mul(x.t())  # rows whose elements are not contiguous
    with pytest.raises(ValueError, match="rows of 4"):
        kernels.add_rms_norm(x, x[:3], torch.ones(4), 1e-6)  # a delta shorter than x
    with pytest.raises(ValueError, match="bfloat16"):
        kernels.add_rms_norm(x.bfloat16(), None, torch.ones(4), 1e-6)  # a float32 weight read as bfloat16
    kv = x.view(8, 1, 4)
    cache = torch.zeros(2, 2, 1, 4)  # 4 slots
    with pytest.raises(ValueError, match="int64"):
        kernels.write_kv(kv, kv, cache, cache.clone(), torch.arange(8, dtype=torch.int32))
    with pytest.raises(ValueError, match="outside the cache"):
        kernels.write_kv(kv[:2], kv[:2], cache, cache.clone(), torch.tensor([3, 4]))
    assert not cache.any()  # checked before anything was written
    t = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    q, out, table = torch.randn(2, 2, 4), torch.zeros(2, 2, 4), t([[0, 1]])
    for rows, table_rows, ctx, bad_table in [
        ([2], [0], [3], table),  # no such query row
        ([0], [1], [3], table),  # no such block-table row
        ([0], [0], [5], table),  # longer than the table holds
        ([0], [0], [3], t([[0, 7]])),  # a block id outside the cache
    ]:
        with pytest.raises(ValueError, match="out of range"):
            kernels.decode_attention(q, t(rows), cache, cache, bad_table, t(table_rows), t(ctx), out)
    assert not out.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [16, 64, 128])  # a generic head size and the two the kernel unrolls
def test_decode_attention_reads_the_paged_cache_as_sdpa_over_the_gathered_context(
    kernels: CpuKernelOps, dtype: torch.dtype, d: int
) -> None:
    torch.manual_seed(1)
    blocks, bs, hkv, hq = 64, 4, 2, 6
    k_cache, v_cache = torch.zeros(blocks, bs, hkv, d, dtype=dtype), torch.zeros(blocks, bs, hkv, d, dtype=dtype)
    ctx = [1, 5, 13, 29]
    perm = torch.randperm(blocks).tolist()  # blocks scattered over the cache
    table = torch.zeros(6, 10, dtype=torch.long)
    table_rows = [4, 0, 2, 5]  # block-table rows in another order than the batch
    for b, n in enumerate(ctx):
        ids = [perm.pop() for _ in range(-(-n // bs))]
        table[table_rows[b], : len(ids)] = torch.tensor(ids)
        slots = torch.tensor([ids[t // bs] * bs + t % bs for t in range(n)])
        kernels.write_kv(torch.randn(n, hkv, d).to(dtype), torch.randn(n, hkv, d).to(dtype), k_cache, v_cache, slots)
    q_rows = [3, 0, 5, 1]  # decode rows among other (prefill) rows of the step
    q = torch.randn(6, hq, d).to(dtype)
    out = torch.full((6, hq, d), 7.0, dtype=dtype)
    t = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    kernels.decode_attention(q, t(q_rows), k_cache, v_cache, table, t(table_rows), t(ctx), out)
    for b, n in enumerate(ctx):
        ids = table[table_rows[b]]
        slots = torch.tensor([int(ids[i // bs]) * bs + i % bs for i in range(n)])
        k = k_cache.view(-1, hkv, d)[slots].float().transpose(0, 1)  # [hkv, n, d]
        v = v_cache.view(-1, hkv, d)[slots].float().transpose(0, 1)
        qb = q[q_rows[b]].float().view(hkv, hq // hkv, d)
        want = F.scaled_dot_product_attention(qb, k, v).reshape(hq, d)
        assert_close_rel(out[q_rows[b]].float(), want, REL[dtype])
    untouched = sorted(set(range(6)) - set(q_rows))
    assert (out[untouched] == 7.0).all()  # rows of no decode sequence are left alone


def _frame_kernel(kernels: CpuKernelOps) -> bool:
    """Whether this CPU runs the compiled frame attention (AVX-512 bfloat16, no AMX)."""
    return kernels.lib.epd_dot_available() == 1 and kernels.lib.epd_amx_available() != 1


def _frames_by_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int) -> torch.Tensor:
    """float32 SDPA within each frame of n rows: [frames · n, heads, D]."""
    rows, heads, d = q.shape
    qf, kf, vf = (y.float().reshape(rows // n, n, heads, d).transpose(1, 2) for y in (q, k, v))
    return F.scaled_dot_product_attention(qf, kf, vf).transpose(1, 2).reshape(rows, heads, d)


@pytest.mark.parametrize(("frames", "n", "heads", "d"), [(1, 256, 4, 80), (3, 67, 2, 64), (2, 129, 3, 128)])
def test_frame_attention_attends_within_each_frame_as_sdpa(
    kernels: CpuKernelOps, frames: int, n: int, heads: int, d: int
) -> None:
    torch.manual_seed(2)
    # q and k of one fused projection, as a tower's rows hold them: rows with a stride
    qkv = (3 * torch.randn(frames * n, 3, heads, d)).to(torch.bfloat16)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    out = kernels.frame_attention(q, k, v, n)
    if not _frame_kernel(kernels):
        assert out is None  # no AVX-512 bfloat16, or AMX: the tower keeps SDPA
        return
    assert out is not None and out.dtype == torch.bfloat16
    want = _frames_by_sdpa(q, k, v, n)
    assert_close_rel(out.float(), want, REL[torch.bfloat16])
    # about as close to float32 as PyTorch's own bfloat16 SDPA comes
    theirs = F.scaled_dot_product_attention(*(y.reshape(frames, n, heads, d).transpose(1, 2) for y in (q, k, v)))
    theirs = theirs.transpose(1, 2).reshape(frames * n, heads, d).float()
    assert float((out.float() - want).abs().max()) <= 2 * float((theirs - want).abs().max())
    # heads laid out apart from their columns (a transposed view) are read as their values
    apart = [y.transpose(0, 1).contiguous().transpose(0, 1) for y in (q, k, v)]
    assert torch.equal(kernels.frame_attention(*apart, n), out)


@pytest.mark.parametrize(
    ("nq", "nk", "heads", "kv_heads", "d"), [(97, 97, 6, 2, 128), (65, 203, 4, 1, 64), (128, 131, 2, 2, 80)]
)
def test_causal_attention_of_a_prompt_chunk_equals_sdpa_over_its_prefix(
    kernels: CpuKernelOps, nq: int, nk: int, heads: int, kv_heads: int, d: int
) -> None:
    torch.manual_seed(4)
    q = (3 * torch.randn(nq, heads, d)).to(torch.bfloat16)
    # keys and values of one projection, as a whole prompt's hold them: rows with a stride
    kv = (3 * torch.randn(nk, 2, kv_heads, d)).to(torch.bfloat16)
    k, v = kv[:, 0], kv[:, 1]
    out = kernels.causal_attention(q, k, v)
    if not _frame_kernel(kernels):
        assert out is None
        return
    assert out is not None
    # the chunk's query i sits at position nk - nq + i: it sees keys 0..nk - nq + i
    seen = torch.arange(nk)[None, :] <= (torch.arange(nq) + nk - nq)[:, None]
    want = F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None],
        k.float().transpose(0, 1)[None],
        v.float().transpose(0, 1)[None],
        attn_mask=seen,
        enable_gqa=True,
    )[0].transpose(0, 1)
    assert_close_rel(out.float(), want, REL[torch.bfloat16])
    with pytest.raises(ValueError, match="at least q's rows"):
        kernels.causal_attention(q, k[: nq - 1], v[: nq - 1])


def test_frame_attention_on_several_threads_equals_one(kernels: CpuKernelOps) -> None:
    if not _frame_kernel(kernels):
        pytest.skip("the frame attention runs on AVX-512 bfloat16 without AMX")
    torch.manual_seed(3)
    q, k, v = (torch.randn(2 * 100, 4, 64).to(torch.bfloat16) for _ in range(3))
    # six query heads on two KV heads: four threads split each KV head's run of query heads,
    # and each packs the keys and values it reads
    cq = torch.randn(70, 6, 128).to(torch.bfloat16)
    ck, cv = (torch.randn(90, 2, 128).to(torch.bfloat16) for _ in range(2))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.frame_attention(q, k, v, 100), kernels.causal_attention(cq, ck, cv)
        torch.set_num_threads(4)
        four = kernels.frame_attention(q, k, v, 100), kernels.causal_attention(cq, ck, cv)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, four, strict=True):
        assert a is not None and b is not None
        assert torch.equal(a, b)  # each (frame, head) is computed whole by one thread


def test_frame_attention_leaves_what_it_does_not_take_to_sdpa(kernels: CpuKernelOps) -> None:
    x = torch.randn(128, 2, 80)
    assert kernels.frame_attention(x, x, x, 128) is None  # float32
    b = x.to(torch.bfloat16)
    assert kernels.frame_attention(b, b, b, 32) is None  # frames too short to gain
    odd = torch.randn(128, 2, 48).to(torch.bfloat16)
    assert kernels.frame_attention(odd, odd, odd, 128) is None  # a head size it does not unroll
    assert TorchOps().frame_attention(b, b, b, 128) is None
    if _frame_kernel(kernels):
        with pytest.raises(ValueError, match="frames of 100 rows"):
            kernels.frame_attention(b, b, b, 100)  # 128 rows are no whole number of frames


@pytest.fixture
def small_source(tmp_path: Path) -> Path:
    """A C++ source with the ABI entry points of the real one and nothing else: the cache,
    locking and rebuild tests build it for real with the same compiler and flags, in a fraction
    of the time the kernels take (the real library is built by the test after this fixture)."""
    source = tmp_path / "small_kernels.cpp"
    source.write_text(
        f'extern "C" {{ int epd_kernels_abi() {{ return {build.ABI}; }} '
        f"int epd_layer_pointers() {{ return {build.POINTERS_PER_LAYER}; }} }}\n"
    )
    return source


@needs_compiler
def test_the_library_is_built_once_per_machine_and_reused(tmp_path: Path) -> None:
    """The real kernel source: built into the cache, reused from it, loaded with the numbers
    Python expects (the other cache tests build a small source through the same code)."""
    first = build.library_path(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert build.library_path(tmp_path) == first and first.stat().st_mtime_ns == stamp
    real = load_library(tmp_path)
    assert (real.epd_kernels_abi(), real.epd_layer_pointers()) == (build.ABI, build.POINTERS_PER_LAYER)
    assert first.stat().st_mtime_ns == stamp  # loading did not rebuild it either
    assert not list(tmp_path.glob("*.tmp"))  # nothing half-written left behind


@needs_compiler
@pytest.mark.parametrize(
    ("exports", "says"),
    [
        (
            f"int epd_kernels_abi() {{ return {build.ABI + 1}; }} int epd_layer_pointers() {{ return {build.POINTERS_PER_LAYER}; }}",
            "ABI",
        ),
        (
            f"int epd_kernels_abi() {{ return {build.ABI}; }} int epd_layer_pointers() {{ return {build.POINTERS_PER_LAYER + 1}; }}",
            "pointers per layer",
        ),
        (f"int epd_kernels_abi() {{ return {build.ABI}; }}", "not a build of this kernel source"),
    ],
)
def test_a_library_that_disagrees_on_the_abi_is_refused(tmp_path: Path, exports: str, says: str) -> None:
    """The C++ source and Python each define the ABI and the stack's pointers per layer once; a
    library whose numbers differ from Python's is refused before any call (the real build agrees:
    test_the_library_is_built_once_per_machine_and_reused)."""
    source = tmp_path / "other.cpp"
    source.write_text(f'extern "C" {{ {exports} }}')
    lib_path = tmp_path / "other.so"
    subprocess.run([COMPILER, "-shared", "-fPIC", "-o", str(lib_path), str(source)], check=True, timeout=120)
    with pytest.raises(KernelBuildError, match=says):
        build.check_abi(ctypes.CDLL(str(lib_path)), lib_path)


@needs_compiler
def test_roles_starting_together_build_one_library(tmp_path: Path, small_source: Path) -> None:
    """Processes that start at once (the roles of one machine) each build and install a whole
    file under the one cached name: one library, nothing half-written, all of them load it."""
    cache = tmp_path / "cache"
    start = time.time() + 2  # all begin building at the same moment, after their imports
    code = (
        "import time; from pathlib import Path; from epdserve.kernels.build import open_library; "
        f"time.sleep(max(0.0, {start} - time.time())); "
        f"assert open_library(Path({str(cache)!r}), Path({str(small_source)!r})).epd_kernels_abi() == {build.ABI}"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(3)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    assert len(list(cache.glob("*.so"))) == 1 and not list(cache.glob("*.tmp"))


@needs_compiler
def test_a_cache_directory_others_may_write_is_not_used(
    tmp_path: Path, small_source: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    path = build.library_path(shared, source=small_source)
    assert path.parent != shared and not list(shared.iterdir())
    assert path.parent.stat().st_mode & 0o077 == 0  # a private directory instead
    shutil.rmtree(path.parent)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where that one-off build goes
    assert build.open_library(shared, small_source).epd_kernels_abi() == build.ABI
    assert not list(tmp_path.glob("epd-kernels-*"))  # loaded, then removed: nothing left per start


def test_without_a_compiler_the_engine_runs_the_torch_ops(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(KernelBuildError):
        build.library_path(tmp_path)
    assert type(select_ops("auto", torch.float32, CPU)) is TorchOps
    assert type(select_ops("torch", torch.float32, CPU)) is TorchOps
    assert type(select_ops("auto", torch.float16, CPU)) is TorchOps  # no float16 kernels


@needs_compiler
def test_a_corrupt_cached_library_is_rebuilt_once(
    tmp_path: Path, small_source: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    path = build.library_path(cache, source=small_source)
    path.write_bytes(b"\x7fELF truncated")  # a half-written or foreign file under the cached name
    with caplog.at_level(logging.WARNING, logger="epdserve.kernels.build"):
        assert build.open_library(cache, small_source).epd_kernels_abi() == build.ABI
    assert "rebuilding" in caplog.text
    assert path.stat().st_size > 1000 and len(list(cache.glob("*.so"))) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="epdserve.kernels.build"):
        assert build.open_library(cache, small_source).epd_kernels_abi() == build.ABI  # then used, without a word
    assert not caplog.text


@needs_compiler
@pytest.mark.parametrize("layout", ["symlinked leaf", "world-writable parent", "symlinked library"])
def test_an_unsafe_cache_is_not_used_and_says_how_to_fix_it(
    tmp_path: Path, small_source: Path, layout: str, caplog: pytest.LogCaptureFixture
) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    cache = real
    if layout == "symlinked leaf":
        cache = tmp_path / "link"
        cache.symlink_to(real)
    elif layout == "world-writable parent":
        shared = tmp_path / "shared"
        shared.mkdir()
        shared.chmod(0o777)  # anyone could rename the private directory below away and plant another
        cache = shared / "cache"
        cache.mkdir(mode=0o700)
    else:
        other = tmp_path / "other.so"
        other.write_bytes(b"not ours to load")
        built = build.library_path(real, source=small_source)
        built.unlink()
        built.symlink_to(other)
    with caplog.at_level(logging.WARNING, logger="epdserve.kernels.build"):
        path = build.library_path(cache, source=small_source)
    if layout == "symlinked library":
        assert path.parent == real and not path.is_symlink() and "rebuilding" in caplog.text
        assert other.read_bytes() == b"not ours to load"
        return
    assert path.parent != cache and not list(cache.iterdir())
    assert "chmod 700" in caplog.text and build.CACHE_ENV in caplog.text
    shutil.rmtree(path.parent)


@needs_compiler
def test_a_compiler_without_an_openmp_runtime_still_builds(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, small_source: Path
) -> None:
    """A compiler that refuses ``-fopenmp`` (clang without libomp) builds without it: the
    kernels then split nothing over threads, but they load."""
    calls = tmp_path / "calls"
    cxx = tmp_path / "cxx-without-openmp"
    cxx.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {calls}\n'
        'for a in "$@"; do [ "$a" = -fopenmp ] && { echo "unsupported option -fopenmp" >&2; exit 1; }; done\n'
        f'exec {COMPILER} "$@"\n'
    )
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    assert build.open_library(tmp_path / "cache", small_source).epd_kernels_abi() == build.ABI
    builds = [line.split() for line in calls.read_text().splitlines() if "-o" in line.split()]
    assert len(builds) == 2 and "-fopenmp" in builds[0] and "-fopenmp" not in builds[1], builds
    assert "-fopenmp-simd" in builds[1]
