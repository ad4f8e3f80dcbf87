"""Pillow's bicubic resize of 8-bit images, bit for bit, in the compiled kernels.

Media preprocessing resizes every image to the size the vision tower takes, and Pillow does it
one sample at a time. ``Resampler.resize`` does the same integer arithmetic eight rows per vector
instruction (``epd_resize_bicubic_u8`` in ``cpu_kernels.cpp``), so its bytes equal the installed
Pillow's ``Image.resize(size, BICUBIC)`` (``tests/test_resample.py``). Which pass runs first
depends on the Pillow version; ``load_resampler`` follows the installed one and checks itself
against it on a few probe images before it is used. Without a compiler, or should the check
ever fail, there is no resampler and callers keep Pillow.
"""

from __future__ import annotations

import ctypes
import logging

import numpy as np
import PIL
from PIL import Image

from epdserve.kernels.build import KernelBuildError, load_library

log = logging.getLogger(__name__)

# (height, width) -> (height, width) probes: each pass alone, both orders of the two, up and down
_PROBES = (((61, 47), (20, 40)), ((47, 61), (40, 20)), ((64, 64), (16, 16)), ((9, 13), (30, 21)), ((40, 9), (40, 3)))


def vertical_first_from(pillow_version: str) -> bool:
    """Whether this Pillow runs the vertical pass first when the height shrinks by more than
    twice what the width does (Pillow 13 on); before, the horizontal pass always ran first."""
    return int(pillow_version.split(".")[0]) >= 13


class Resampler:
    def __init__(self, lib: ctypes.CDLL, vertical_first: bool) -> None:
        """``vertical_first``: follow Pillow 13's choice of the first pass (else: always horizontal)."""
        self.lib = lib
        self.vertical_first = vertical_first

    def resize(self, pixels: np.ndarray, height: int, width: int) -> np.ndarray:
        """``pixels`` [h, w, 1 or 3] uint8 (L or RGB) at ``height`` x ``width``."""
        if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] not in (1, 3):
            raise ValueError(f"expected [h, w, 1 or 3] uint8 pixels, got {pixels.dtype} {pixels.shape}")
        src = np.ascontiguousarray(pixels)
        h, w, c = src.shape
        shrink = h - height
        vertical = self.vertical_first and shrink > 0 and shrink > (w - width) * 2
        out = np.empty((height, width, c), dtype=np.uint8)
        if self.lib.epd_resize_bicubic_u8(src.ctypes.data, h, w, c, out.ctypes.data, height, width, vertical) != 0:
            raise ValueError(f"cannot resize {w}x{h} to {width}x{height}")
        return out

    def agrees_with_pillow(self) -> bool:
        """Whether this resampler gives the installed Pillow's bytes on the probe images."""
        rng = np.random.default_rng(0)
        for (h, w), (oh, ow) in _PROBES:
            pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            want = np.asarray(Image.fromarray(pixels).resize((ow, oh), Image.Resampling.BICUBIC))
            if not np.array_equal(self.resize(pixels, oh, ow), want):
                return False
        return True


def load_resampler() -> Resampler | None:
    """The compiled resampler, or None (use Pillow) when the kernels cannot be built here or do
    not reproduce the installed Pillow."""
    try:
        resampler = Resampler(load_library(), vertical_first_from(PIL.__version__))
    except KernelBuildError as e:
        log.warning("compiled image resize unavailable, using Pillow's: %s", e)
        return None
    if not resampler.agrees_with_pillow():
        log.warning("compiled image resize differs from Pillow %s's; using Pillow's", PIL.__version__)
        return None
    return resampler
