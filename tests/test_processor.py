"""Our Qwen2-VL preprocessing equals transformers' image processor; videos share its layout."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from epdserve.media.processor import ProcessorConfig, VisionProcessor, sample_frame_indices, smart_resize
from epdserve.shapes import ShapesWorld
from tests.numerics import assert_close_rel


@pytest.fixture(scope="module")
def ours() -> VisionProcessor:
    return VisionProcessor(ProcessorConfig())


def test_matches_transformers_image_processor(ours: VisionProcessor) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    ref = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112)
    world = ShapesWorld(21)
    images = [world.scene().render() for _ in range(12)]
    images += [Image.new("RGB", (300, 50), (1, 2, 3)), Image.new("RGB", (20, 30), (9, 9, 9))]
    for img in images:
        r = ref(images=[img], return_tensors="np")
        o = ours.image(img)
        assert tuple(r["image_grid_thw"][0]) == o.grid_thw
        assert_close_rel(o.pixel_values, r["pixel_values"])


def test_token_counts_for_spec_sizes(ours: VisionProcessor) -> None:
    # 84 px -> 6x6 patches -> 9 tokens; 112 px and larger squares are capped at 112x112 -> 16 tokens
    assert ours.image(Image.new("RGB", (84, 84))).grid_thw == (1, 6, 6)
    assert ours.image(Image.new("RGB", (168, 168))).grid_thw == (1, 8, 8)


def test_video_groups_frames_in_time(ours: VisionProcessor) -> None:
    frames = ShapesWorld(2).video().frames()
    v = ours.video(frames)
    t, h, w = v.grid_thw
    assert t == 2 and v.pixel_values.shape == (t * h * w, 3 * 2 * 14 * 14)
    # a "video" of one frame repeated is exactly that frame as an image
    still = ours.video([frames[0], frames[0]])
    np.testing.assert_array_equal(still.pixel_values, ours.image(frames[0]).pixel_values)
    # an odd number of frames is padded with the last frame
    assert ours.video(frames[:3]).grid_thw[0] == 2


def test_smart_resize_rejects_extreme_aspect() -> None:
    with pytest.raises(ValueError):
        smart_resize(10, 3000, 28, 56 * 56, 112 * 112)


def test_frame_sampling() -> None:
    assert sample_frame_indices(3, 4) == [0, 1, 2]
    assert sample_frame_indices(10, 4) == [0, 3, 6, 9]


@pytest.mark.parametrize("size", [(448, 448), (300, 50), (1000, 1700)])
def test_the_footprint_bounds_what_preprocessing_holds(size: tuple[int, int]) -> None:
    """``footprint`` (what a role reserves for an item before decoding it) covers the arrays
    preprocessing makes at their peak (traced; the decoded frames are Pillow's and counted apart)
    and the patches it settles to."""
    import tracemalloc

    processor = VisionProcessor(ProcessorConfig(max_pixels=1 << 20, video_max_pixels=1 << 18))
    rng = np.random.default_rng(0)
    width, height = size
    frames = [Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)) for _ in range(3)]
    for modality, run in (("image", lambda: processor.image(frames[0])), ("video", lambda: processor.video(frames))):
        kept = 1 if modality == "image" else len(frames)
        tracemalloc.start()
        out = run()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        footprint = processor.footprint(modality, kept, width, height)
        assert out.pixel_values.nbytes <= peak <= footprint - 6 * width * height * kept
