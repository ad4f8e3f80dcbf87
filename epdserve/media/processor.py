"""Qwen2-VL preprocessing: smart resize, normalize and patchify images and videos.

Images follow transformers' ``Qwen2VLImageProcessorPil`` exactly (same resize, same patch layout),
so our outputs equal the reference processor's; videos use the same code with ``temporal_patch_size``
frames per temporal group, which keeps serving free of torchvision.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from epdserve.kernels.resample import Resampler
from epdserve.media.limits import MAX_SECOND_PER_GRID


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Target (height, width): multiples of ``factor``, area within bounds, aspect kept."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio must be below 200, got {max(height, width) / min(height, width):.1f}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


# Bytes per pixel of a kept frame as decoded and as its RGB copy (``media.decode.to_rgb``); one
# more frame's worth covers the conversion in progress (RGBA as decoded, composited on white).
DECODED_BYTES_PER_PIXEL = 6


@dataclass(frozen=True)
class VisionInput:
    """Patches of one media item and its grid (t, h, w) in patches."""

    pixel_values: np.ndarray  # (t*h*w, C*temporal_patch*patch*patch) float32
    grid_thw: tuple[int, int, int]


@dataclass(frozen=True)
class ProcessorConfig:
    """Preprocessing settings (read from preprocessor_config.json)."""

    min_pixels: int = 56 * 56  # smallest resized area
    max_pixels: int = 112 * 112  # largest resized area (images)
    video_max_pixels: int = 112 * 112  # largest resized area per video frame
    patch_size: int = 14  # ViT patch side
    temporal_patch_size: int = 2  # frames per temporal patch
    merge_size: int = 2  # spatial merge of the patch merger
    image_mean: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
    rescale_factor: float = 1 / 255
    video_frames: int = 4  # frames sampled from a video
    video_fps: float = 2.0  # frame rate of sampled video frames when the file has no timing of its own

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def second_per_grid(self) -> float:
        """Seconds of video one temporal patch spans (transformers' ``second_per_grid_ts``) when
        the video has no timing of its own: its sampled frames stand for ``video_fps``."""
        return self.temporal_patch_size / self.video_fps

    def video_second_per_grid(self, interval_s: float | None) -> float:
        """Seconds one temporal patch spans for a video whose sampled frames are ``interval_s``
        apart (``media.decode.Video``; None: ``second_per_grid``), at most ``MAX_SECOND_PER_GRID``."""
        if interval_s is None:
            return self.second_per_grid
        return min(self.temporal_patch_size * interval_s, MAX_SECOND_PER_GRID)

    def hash_kwargs(self, video_frames: int) -> dict[str, int]:
        """The settings an item's content hash covers (``media.hashing``): every role that hashes
        media (encoders, language-model workers, a router that decodes) takes them from here."""
        return {
            "min_pixels": self.min_pixels,
            "max_pixels": self.max_pixels,
            "video_max_pixels": self.video_max_pixels,
            "video_frames": video_frames,
            "patch_size": self.patch_size,
            "temporal_patch_size": self.temporal_patch_size,
            "merge_size": self.merge_size,
        }

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ProcessorConfig:
        d = Path(model_dir)
        pp = json.loads((d / "preprocessor_config.json").read_text())
        size = pp.get("size") or {}
        min_pixels = int(pp.get("min_pixels", size.get("shortest_edge", cls.min_pixels)))
        max_pixels = int(pp.get("max_pixels", size.get("longest_edge", cls.max_pixels)))
        video_max, frames, fps = max_pixels, cls.video_frames, cls.video_fps
        vp_path = d / "video_preprocessor_config.json"
        if vp_path.exists():
            vp = json.loads(vp_path.read_text())
            vsize = vp.get("size") or {}
            video_max = int(vp.get("max_pixels", vsize.get("longest_edge", video_max)))
            frames = int(vp.get("num_frames") or frames)
            fps = float(vp.get("fps") or fps)
        return cls(
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            video_max_pixels=video_max,
            patch_size=int(pp.get("patch_size", cls.patch_size)),
            temporal_patch_size=int(pp.get("temporal_patch_size", cls.temporal_patch_size)),
            merge_size=int(pp.get("merge_size", cls.merge_size)),
            image_mean=tuple(pp.get("image_mean", cls.image_mean)),  # type: ignore[arg-type]
            image_std=tuple(pp.get("image_std", cls.image_std)),  # type: ignore[arg-type]
            rescale_factor=float(pp.get("rescale_factor", cls.rescale_factor)),
            video_frames=frames,
            video_fps=fps,
        )


class VisionProcessor:
    """Turns PIL images and frame lists into patch arrays for the vision tower."""

    def __init__(self, config: ProcessorConfig, resampler: Resampler | None = None) -> None:
        """``resampler``: the compiled resize (``kernels.resample``), whose bytes equal Pillow's;
        None resizes with Pillow."""
        self.config = config
        self.resampler = resampler
        self._mean = np.asarray(config.image_mean, dtype=np.float32)[:, None]  # per channel of a patch row
        self._std = np.asarray(config.image_std, dtype=np.float32)[:, None]

    def _resized_pixels(self, img: Image.Image, max_pixels: int) -> np.ndarray:
        """The image as RGB pixels [h, w, 3] (uint8) at the size the vision tower takes."""
        c = self.config
        img = img if img.mode == "RGB" else img.convert("RGB")
        h, w = smart_resize(img.height, img.width, c.factor, c.min_pixels, max_pixels)
        if (h, w) == (img.height, img.width):
            return np.asarray(img)
        if self.resampler is not None:
            return self.resampler.resize(np.asarray(img), h, w)
        return np.asarray(img.resize((w, h), resample=Image.Resampling.BICUBIC))

    def is_resized(self, height: int, width: int, modality: str) -> bool:
        """Whether a frame of this size is left as it is (``image``/``video`` do not resize it
        again): a frame from ``resized_image``/``resized_video`` almost always is; only extreme
        aspect ratios can round to a size the next call would change."""
        c = self.config
        max_pixels = c.max_pixels if modality == "image" else c.video_max_pixels
        return smart_resize(height, width, c.factor, c.min_pixels, max_pixels) == (height, width)

    def _patchify(self, frames: np.ndarray) -> VisionInput:
        """frames: (T, H, W, C) RGB pixels (uint8), T a multiple of temporal_patch_size. The float32
        patches are made once, cast as they are gathered and normalized in place, so that preprocessing
        holds little more than its result (the reference's order: rescale, then normalize)."""
        c = self.config
        t, h, w, ch = frames.shape
        ps, m, tp = c.patch_size, c.merge_size, c.temporal_patch_size
        gt, gh, gw = t // tp, h // ps, w // ps
        x = frames.reshape(gt, tp, gh // m, m, ps, gw // m, m, ps, ch)
        x = x.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)  # gt, rows, cols of merge groups, m, m, C, tp, ps, ps
        flat = np.empty((gt * gh * gw, ch * tp * ps * ps), dtype=np.float32)
        flat.reshape(x.shape)[...] = x
        rows = flat.reshape(-1, ch, tp * ps * ps)
        rows *= np.float32(c.rescale_factor)
        rows -= self._mean
        rows /= self._std
        return VisionInput(flat, (gt, gh, gw))

    def footprint(self, modality: str, frames: int, width: int, height: int) -> int:
        """Bytes that decoding and preprocessing an item of ``frames`` kept frames of ``width`` x
        ``height`` hold at most: the frames as decoded (``DECODED_BYTES_PER_PIXEL``, and one more
        in conversion), their resized RGB copies (a video's twice: the frames and their stack) and
        the float32 patches."""
        c = self.config
        max_pixels = c.max_pixels if modality == "image" else c.video_max_pixels
        h, w = smart_resize(height, width, c.factor, c.min_pixels, max_pixels)
        padded = -(-frames // c.temporal_patch_size) * c.temporal_patch_size
        resized = 3 * h * w * (frames if modality == "image" else 2 * padded)
        return DECODED_BYTES_PER_PIXEL * width * height * (frames + 1) + resized + padded * 3 * h * w * 4

    def resized_image(self, img: Image.Image) -> Image.Image:
        """The RGB image at the size the vision tower sees it (``image`` without normalizing):
        what a router that decodes media hands an encoder."""
        return Image.fromarray(self._resized_pixels(img, self.config.max_pixels))

    def resized_video(self, frames: list[Image.Image]) -> list[Image.Image]:
        """The RGB frames at the size the vision tower sees them (``video`` without normalizing)."""
        return [Image.fromarray(f) for f in self._video_pixels(frames)]

    def _video_pixels(self, frames: list[Image.Image]) -> list[np.ndarray]:
        """Each frame's RGB pixels at the size of the first's (the vision tower's size for it)."""
        if not frames:
            raise ValueError("a video needs at least one frame")
        c = self.config
        first = frames[0].convert("RGB")
        h, w = smart_resize(first.height, first.width, c.factor, c.min_pixels, c.video_max_pixels)
        return [
            self._resized_pixels(f.convert("RGB").resize((w, h)) if f.size != first.size else f, c.video_max_pixels)
            for f in frames
        ]

    def image(self, img: Image.Image) -> VisionInput:
        arr = self._resized_pixels(img, self.config.max_pixels)
        return self._patchify(np.broadcast_to(arr[None], (self.config.temporal_patch_size, *arr.shape)))

    def video(self, frames: list[Image.Image]) -> VisionInput:
        c = self.config
        arrs = self._video_pixels(frames)
        while len(arrs) % c.temporal_patch_size:
            arrs.append(arrs[-1])  # pad with the last frame, as the reference does
        return self._patchify(np.stack(arrs))


def largest_footprint(config: ProcessorConfig, max_image_pixels: int, video_frames: int) -> int:
    """``VisionProcessor.footprint`` of the largest item a role takes: an image, or a video of
    ``video_frames`` frames (0: none), on a canvas of ``max_image_pixels`` (``MediaLimits``) that
    resizes to the processor's largest size."""
    side = math.isqrt(max_image_pixels)
    processor = VisionProcessor(config)
    image = processor.footprint("image", 1, side, side)
    return max(image, processor.footprint("video", video_frames, side, side) if video_frames else 0)


def sample_frame_indices(total: int, count: int) -> list[int]:
    """Evenly spaced frame indices (all frames when there are fewer than ``count``)."""
    if total <= count:
        return list(range(total))
    return [min(total - 1, round(i * (total - 1) / (count - 1))) for i in range(count)] if count > 1 else [0]
