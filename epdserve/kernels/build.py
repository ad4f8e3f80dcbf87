"""Compile ``cpu_kernels.cpp`` for this machine and load it (ctypes).

The library is built with the CPU's own instruction set (``-march=native``), so its file name
carries a hash of the source, the compiler, the flags and the CPU's feature flags: a cache that
moves to another machine (a home directory, a container layer) is rebuilt, never run on the wrong
CPU. A library loaded from the cache runs as this process, so the cache must be ours alone: the
directory (``$EPD_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/epdserve/kernels``) and every directory
above it are owned by this user or root and writable by nobody else (an ancestor may be a sticky
root-owned one like /tmp), and neither the directory nor the library is a symbolic link. Otherwise
a WARNING says how to fix it and the build goes to a private temporary directory (every start).
A cached library that does not load or reports another ABI (a truncated or foreign file) is
rebuilt once, with a WARNING; only if the rebuilt one fails too does the engine fall back to torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
# The two numbers Python and the C++ source must agree on, defined once on each side and checked
# at load (``load_library``): the ABI of the signatures below (epd_kernels_abi()) and the length
# of a layer's row in the fused stack's pointer table (epd_layer_pointers(), LP_COUNT).
ABI = 18
POINTERS_PER_LAYER = 9
# -fopenmp: the compiled matmuls (but AMX's), the attention and the large elementwise kernels
# split their work on the OpenMP runtime the process already runs, torch's (GCC's libgomp, loaded
# by soname before this library); a compiler whose OpenMP runtime is missing builds without it
# (NO_OPENMP), and those kernels then run on one thread
FLAGS = (
    "-O3",
    "-march=native",
    "-mprefer-vector-width=512",
    "-ffp-contract=off",
    "-fno-trapping-math",
    "-fno-math-errno",
    "-fopenmp",
    "-fPIC",
    "-shared",
    "-std=c++17",
)
NO_OPENMP = tuple("-fopenmp-simd" if f == "-fopenmp" else f for f in FLAGS)


_TEMP_PREFIX = "epd-kernels-"  # a private one-off build directory, when the cache cannot be used


class KernelBuildError(RuntimeError):
    """The kernels could not be built or loaded here (the reason is in the message)."""


CACHE_ENV = "EPD_KERNEL_CACHE"  # the cache directory, when set


def default_cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "epdserve" / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if not cxx:
        raise KernelBuildError("no C++ compiler found (install g++ or set CXX)")
    return cxx


_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


def _unsafe_dir(path: Path) -> str | None:
    """Why a library in ``path`` could be replaced by someone else (None: it cannot). ``path`` is
    made (private) if it does not exist."""
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = path.lstat()
    except OSError as e:
        return f"cannot create it ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if st.st_uid != os.getuid():
        return "it belongs to another user"
    if st.st_mode & _OTHERS_WRITE:
        return "others may write to it"
    for parent in Path(os.path.realpath(path)).parents:  # whoever can rename a parent can swap it
        try:
            pst = parent.stat()
        except OSError as e:
            return f"cannot inspect {parent} ({e.strerror})"
        if pst.st_uid not in (0, os.getuid()):
            return f"{parent} belongs to another user"
        if pst.st_mode & _OTHERS_WRITE and not (pst.st_mode & stat.S_ISVTX and pst.st_uid == 0):
            return f"others may write to {parent}"
    for link in (path, *path.parents):  # a link on the way may be retargeted by its owner
        with contextlib.suppress(OSError):
            lst = link.lstat()
            if stat.S_ISLNK(lst.st_mode) and lst.st_uid not in (0, os.getuid()):
                return f"{link} is a symbolic link of another user"
    return None


def _private_file(path: Path) -> bool:
    """``path`` is a plain file of ours nobody else may write (not a link to one)."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & _OTHERS_WRITE


def library_path(cache_dir: Path | None = None, rebuild: bool = False, source: Path = SOURCE) -> Path:
    """Where this machine's build of ``source`` lives (built if it is not there yet, or
    ``rebuild``); KernelBuildError if it cannot be built."""
    cxx = _compiler()
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"{cxx} --version failed: {e}") from None
    key = hashlib.sha256()
    for part in (source.read_bytes(), version.encode(), " ".join(FLAGS).encode(), _cpu_flags().encode()):
        key.update(part)
        key.update(b"\0")
    directory = cache_dir or default_cache_dir()
    unsafe = _unsafe_dir(directory)
    if unsafe is not None:
        log.warning(
            "kernel cache %s is not safe to load code from (%s): building in a temporary directory at every "
            "start instead. Fix: chmod 700 %s (and no directory above it writable by others), or set %s "
            "to a private directory",
            directory, unsafe, directory, CACHE_ENV,
        )  # fmt: skip
        directory = Path(tempfile.mkdtemp(prefix=_TEMP_PREFIX))
    path = directory / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if not rebuild and _private_file(path):
        return path
    if os.path.lexists(path) and not rebuild:
        log.warning("kernel library %s is not a private file of ours: rebuilding it", path)
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".so.tmp")
    os.close(fd)
    try:
        for flags in (FLAGS, NO_OPENMP):
            done = subprocess.run([cxx, *flags, "-o", tmp, str(source)], capture_output=True, text=True, timeout=300)
            if done.returncode == 0:
                break
        if done.returncode != 0:
            raise KernelBuildError(f"{cxx} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, path)  # atomic: processes building at once each install a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def check_abi(lib: ctypes.CDLL, path: Path) -> None:
    """KernelBuildError unless ``lib`` was built from a source that agrees with ``ABI`` and
    ``POINTERS_PER_LAYER`` (a build from another version of the source is never called)."""
    try:
        abi, pointers = lib.epd_kernels_abi(), lib.epd_layer_pointers()
    except AttributeError as e:  # a library from before these exports
        raise KernelBuildError(f"{path} is not a build of this kernel source: {e}") from None
    if (abi, pointers) != (ABI, POINTERS_PER_LAYER):
        raise KernelBuildError(
            f"{path} has ABI {abi} with {pointers} pointers per layer; this epdserve expects ABI {ABI} "
            f"with {POINTERS_PER_LAYER} (rebuild: remove the file, or change the source and bump both sides)"
        )


def _open(path: Path, name: str) -> ctypes.CDLL:
    """The library at ``path`` (loaded as ``name``), checked to be of this module's ABI."""
    try:
        lib = ctypes.CDLL(name)
    except OSError as e:
        raise KernelBuildError(f"cannot load {path}: {e}") from None
    finally:
        if path.parent.name.startswith(_TEMP_PREFIX):  # a one-off build: loaded (or not), it can go
            shutil.rmtree(path.parent, ignore_errors=True)
    check_abi(lib, path)
    return lib


def open_library(cache_dir: Path | None = None, source: Path = SOURCE) -> ctypes.CDLL:
    """The build of ``source``, checked to be of this module's ABI; KernelBuildError if
    unavailable. A cached library that fails to load or is of another ABI is rebuilt once."""
    path = library_path(cache_dir, source=source)
    try:
        lib = _open(path, str(path))
    except KernelBuildError as e:
        if path.parent.name.startswith(_TEMP_PREFIX):
            raise
        log.warning("%s; rebuilding it", e)
        path = library_path(cache_dir, rebuild=True, source=source)
        # the dynamic loader hands back a library already loaded under the same name: the
        # rebuilt file is loaded under another spelling of its path
        lib = _open(path, f"{path.parent}/./{path.name}")
    return lib


def load_library(cache_dir: Path | None = None) -> ctypes.CDLL:
    """The built kernel library with its functions' signatures set; KernelBuildError if
    unavailable (see ``open_library``)."""
    lib = open_library(cache_dir)
    p, i64, f32, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    # engine, threads, own threads, the lenders' flags and their count; the layers' table and shape;
    # the step's rows, cache and block table
    stack = [c_int, p, p, p, i64, p, *[i64] * 6, f32, f32, p, i64, *[p] * 5, i64, i64, p, i64, i64, p, p]
    signatures = {
        "epd_add_rms_norm": [c_int, p, i64, p, i64, p, p, i64, i64, i64, f32],
        "epd_rotary": [c_int, p, i64, i64, i64, p, p, i64, i64],
        "epd_rotary_f32": [c_int, p, i64, i64, i64, p, p, i64, i64],
        "epd_quick_gelu": [c_int, p, p, i64, i64],
        "epd_amx_available": [],
        "epd_amx_pack": [p, i64, i64, p],
        "epd_amx_linear": [p, i64, i64, i64, p, i64, p, p, i64],
        "epd_dot_available": [],
        "epd_dot_linear": [p, i64, i64, i64, p, i64, p, p, i64, i64],
        "epd_fma_available": [],
        "epd_fma_linear": [p, i64, i64, i64, p, i64, p, p, i64, i64],
        "epd_row_linear_f32": [p, i64, i64, i64, p, i64, p, p, i64, i64],
        "epd_silu_mul": [c_int, p, i64, p, i64, i64, i64, i64],
        "epd_write_kv": [c_int, p, i64, p, i64, i64, p, p, p, i64, i64],
        "epd_decode_attention": [c_int, p, i64, p, p, p, i64, p, i64, i64, p, p, *[i64] * 6, f32, p, i64],
        "epd_resize_bicubic_u8": [p, i64, i64, i64, p, i64, i64, c_int],
        "epd_frame_attention": [p, i64, p, i64, p, i64, p, i64, i64, i64, i64, i64, i64, i64, f32, c_int, i64],
        "epd_decoder_stack": stack,
    }
    checked = {  # return 0, or -1 for an index out of range or sizes refused (the AMX ones: 1/0, 0/-1)
        "epd_write_kv",
        "epd_decode_attention",
        "epd_resize_bicubic_u8",
        "epd_amx_available",
        "epd_amx_linear",
        "epd_dot_available",
        "epd_dot_linear",
        "epd_fma_available",
        "epd_fma_linear",
        "epd_row_linear_f32",
        "epd_decoder_stack",
        "epd_frame_attention",
    }
    for name, args in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, (c_int if name in checked else None)
    return lib
