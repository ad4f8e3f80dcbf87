"""The compiled bicubic resize (``kernels.resample``): the installed Pillow's bytes for any size,
shrinking or growing, grey or RGB, with either order of Pillow's two passes; and a processor that
uses it gives the same patches as one that uses Pillow."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from epdserve.kernels import resample
from epdserve.kernels.resample import Resampler, load_resampler, vertical_first_from
from epdserve.media.processor import ProcessorConfig, VisionProcessor

BICUBIC = Image.Resampling.BICUBIC


@pytest.fixture(scope="module")
def resampler() -> Resampler:
    r = load_resampler()
    if r is None:
        pytest.skip("the kernels do not build here (no C++ compiler)")
    return r


def _sizes(n: int, seed: int) -> list[tuple[int, int, int, int]]:
    rng = np.random.default_rng(seed)
    fixed = [(448, 448, 112, 112), (1, 1, 28, 28), (7, 100, 2, 28), (100, 7, 28, 2), (333, 999, 84, 196)]
    return fixed + [tuple(int(v) for v in (*rng.integers(1, 400, 2), *rng.integers(1, 240, 2))) for _ in range(n)]


@pytest.mark.parametrize("channels", [3, 1])
def test_equals_the_installed_pillow_byte_for_byte(resampler: Resampler, channels: int) -> None:
    rng = np.random.default_rng(channels)
    for h, w, oh, ow in _sizes(60, channels):
        pixels = rng.integers(0, 256, (h, w, channels), dtype=np.uint8)
        img = Image.fromarray(pixels if channels == 3 else pixels[:, :, 0])
        want = np.asarray(img.resize((ow, oh), BICUBIC)).reshape(oh, ow, channels)
        assert np.array_equal(resampler.resize(pixels, oh, ow), want), (h, w, oh, ow)


def test_follows_either_pass_order(resampler: Resampler) -> None:
    """Pillow before 13 always resamples rows first; from 13, columns first when the height
    shrinks by more than twice what the width does. Each single pass is Pillow's own, so the
    two orders are checked against Pillow's passes composed by hand."""
    rng = np.random.default_rng(7)
    for vertical_first in (False, True):
        r = Resampler(resampler.lib, vertical_first)
        for h, w, oh, ow in [(100, 7, 28, 2), (300, 40, 30, 35), (64, 80, 60, 20), (90, 90, 30, 30)]:
            pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            img = Image.fromarray(pixels)
            shrink = h - oh
            if vertical_first and shrink > 0 and shrink > (w - ow) * 2:
                want = img.resize((w, oh), BICUBIC).resize((ow, oh), BICUBIC)
            else:
                want = img.resize((ow, h), BICUBIC).resize((ow, oh), BICUBIC)
            assert np.array_equal(r.resize(pixels, oh, ow), np.asarray(want)), (vertical_first, h, w, oh, ow)


def test_pillow_versions_choose_the_order() -> None:
    assert not vertical_first_from("12.1.0")
    assert vertical_first_from("13.0.0") and vertical_first_from("14.2")


def test_a_resampler_that_disagrees_with_pillow_is_not_used(
    resampler: Resampler, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert resampler.agrees_with_pillow()
    installed = vertical_first_from(Image.__version__)
    monkeypatch.setattr(resample, "vertical_first_from", lambda version: not installed)  # the wrong order
    assert load_resampler() is None


def test_refuses_what_it_cannot_resize(resampler: Resampler) -> None:
    with pytest.raises(ValueError, match="uint8"):
        resampler.resize(np.zeros((4, 4, 3), dtype=np.float32), 2, 2)
    with pytest.raises(ValueError, match="1 or 3"):
        resampler.resize(np.zeros((4, 4, 4), dtype=np.uint8), 2, 2)
    with pytest.raises(ValueError, match="cannot resize"):
        resampler.resize(np.zeros((4, 4, 3), dtype=np.uint8), 0, 2)


def test_a_processor_with_it_gives_pillows_patches(resampler: Resampler) -> None:
    rng = np.random.default_rng(3)
    pillow, compiled = VisionProcessor(ProcessorConfig()), VisionProcessor(ProcessorConfig(), resampler)
    for h, w in [(448, 448), (95, 301), (56, 56), (1000, 120)]:
        img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        a, b = pillow.image(img), compiled.image(img)
        assert a.grid_thw == b.grid_thw and np.array_equal(a.pixel_values, b.pixel_values)
        assert np.array_equal(np.asarray(pillow.resized_image(img)), np.asarray(compiled.resized_image(img)))
    grey = Image.fromarray(rng.integers(0, 256, (60, 80), dtype=np.uint8))  # converted to RGB first
    assert np.array_equal(pillow.image(grey).pixel_values, compiled.image(grey).pixel_values)
