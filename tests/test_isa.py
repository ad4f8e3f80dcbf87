"""The kernels and the engine as a CPU with AVX2 only runs them, on whatever x86-64 CPU runs the
tests: the kernel library is built for x86-64-v3 (AVX2 and FMA; no AVX-512, no AMX) by a compiler
wrapper that puts ``-march=x86-64-v3`` where the build asks for ``-march=native``, and PyTorch is
held to AVX2 (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``). The kernel, resampling, linear-layer,
fused stack and oracle tests then run in that process: every choice of a faster path is made from what
the library and PyTorch report, so this is the path an AVX2-only machine takes."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from epdserve.kernels import build


def _compiler() -> str | None:
    """The compiler the kernel build would use (None: there is none)."""
    try:
        return build._compiler()
    except build.KernelBuildError:
        return None


COMPILER = _compiler()
ROOT = Path(__file__).resolve().parents[1]
# the tests that exercise every kernel and every linear layout, then the engine's greedy tokens
# against transformers' on the embedded checkpoint
SUITES = ("test_kernels.py", "test_resample.py", "test_cpu_linear.py", "test_fused_decoder.py", "test_engine_oracle.py")


pytestmark = pytest.mark.skipif(
    not COMPILER or platform.machine() != "x86_64" or "avx2" not in build._cpu_flags().split(),
    reason="needs a C++ compiler on an x86-64 CPU with AVX2",
)


def _avx2_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a process that builds and runs as an AVX2-only CPU would."""
    calls = tmp_path / "compiler-calls"
    cxx = tmp_path / "cxx-x86-64-v3"
    cxx.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {calls}\n'
        'for a in "$@"; do\n'
        '  shift; [ "$a" = -march=native ] && a=-march=x86-64-v3; set -- "$@" "$a"\n'
        "done\n"
        f'exec {COMPILER} "$@"\n'
    )
    cxx.chmod(0o755)
    env = dict(os.environ)
    env.update(
        CXX=str(cxx),
        EPD_KERNEL_CACHE=str(tmp_path / "kernels"),
        ATEN_CPU_CAPABILITY="avx2",
        ONEDNN_MAX_CPU_ISA="AVX2",
    )
    return env


def test_an_avx2_build_offers_the_avx2_engine_only_and_passes_the_kernel_and_oracle_tests(tmp_path: Path) -> None:
    env = _avx2_env(tmp_path)
    probe = (
        "import torch; from epdserve.kernels.build import load_library; from epdserve.kernels.tiles import load_tiles; "
        "lib = load_library(); print(torch.backends.cpu.get_cpu_capability(), lib.epd_amx_available(), "
        "lib.epd_dot_available(), lib.epd_fma_available(), load_tiles().engine)"
    )
    seen = subprocess.run([sys.executable, "-c", probe], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert seen.returncode == 0, seen.stderr[-3000:]
    # PyTorch at AVX2; the library has neither the tile nor the bfloat16 dot-product engine, so the
    # tile layout is read by the AVX2 engine
    assert seen.stdout.split() == ["AVX2", "0", "0", "1", "avx2"], seen.stdout
    builds = [line for line in (tmp_path / "compiler-calls").read_text().splitlines() if " -o " in f" {line} "]
    assert builds and all("-march=native" in b for b in builds)  # what the build asked for, rewritten

    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(f"tests/{s}" for s in SUITES)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    tail = run.stdout[-4000:]
    assert run.returncode == 0, tail
    assert " passed" in tail and " failed" not in tail, tail
