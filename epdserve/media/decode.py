"""Decoding client media bytes into RGB PIL images and sampled video frames, under limits.

Sizes are checked from the container header before pixel data is decoded, so a small file that
claims a huge canvas (a decompression bomb) is refused without allocating it. Pillow's own
``Image.MAX_IMAGE_PIXELS`` is a process-wide setting read inside ``Image.open``; it is left
untouched and only acts as a backstop (its bomb error also maps to 413).
"""

from __future__ import annotations

import io

import av
import av.error
from PIL import Image, UnidentifiedImageError

from epdserve.media.errors import InvalidMedia, MediaTooLarge
from epdserve.media.limits import MediaLimits
from epdserve.media.processor import sample_frame_indices

# Image formats decoded by Pillow when a video is expected (animated ones and stills as 1-frame
# videos); anything else goes to PyAV, which also keeps Pillow's MPEG stub from claiming video.
_PILLOW_VIDEO_FORMATS = ("GIF", "WEBP", "PNG", "JPEG", "BMP", "TIFF")


def to_rgb(img: Image.Image) -> Image.Image:
    """RGB copy of ``img``; transparency is composited on white, as transformers' ``convert_to_rgb``."""
    if img.mode == "RGB":
        return img.copy()
    if img.mode in ("RGBA", "LA", "PA") or "transparency" in img.info:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def _check_pixels(width: int, height: int, limits: MediaLimits, what: str) -> None:
    if width <= 0 or height <= 0:
        raise InvalidMedia(f"The {what} has an empty size {width}x{height}.")
    if width * height > limits.max_image_pixels:
        raise MediaTooLarge(
            f"The {what} is {width}x{height} = {width * height} pixels; at most {limits.max_image_pixels} are accepted."
        )


def _open_image(data: bytes, limits: MediaLimits, formats: tuple[str, ...] | None = None) -> Image.Image | None:
    """Open (header only) with Pillow; None when Pillow does not recognise the format."""
    if formats is not None:
        Image.init()
        formats = tuple(f for f in formats if f in Image.OPEN)  # WebP may be missing from the build
    try:
        img = Image.open(io.BytesIO(data), formats=formats)
    except Image.DecompressionBombError:
        raise MediaTooLarge(f"The image is too large; at most {limits.max_image_pixels} pixels are accepted.") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        # SyntaxError is how several Pillow plugins report a corrupt header
        return None
    return img


def decode_image(data: bytes, limits: MediaLimits) -> Image.Image:
    """Decode an image (first frame of animated formats) into an RGB image."""
    if len(data) > limits.max_bytes:
        raise MediaTooLarge(f"Media item exceeds the limit of {limits.max_bytes} bytes.")
    img = _open_image(data, limits)
    if img is None:
        raise InvalidMedia("The media is not a decodable image.")
    with img:
        _check_pixels(img.width, img.height, limits, "image")
        try:
            img.load()
            return to_rgb(img)
        except Image.DecompressionBombError:
            raise MediaTooLarge(f"The image exceeds {limits.max_image_pixels} pixels.") from None
        except (OSError, ValueError, SyntaxError, EOFError) as e:
            raise InvalidMedia(f"The image could not be decoded: {e}") from None


def decode_video(data: bytes, limits: MediaLimits) -> list[Image.Image]:
    """Decode a video and sample ``limits.video_frames`` frames evenly (all when it has fewer).

    Animated GIF/WebP/PNG (and still images, as 1-frame videos) go through Pillow; MP4, WebM and
    other containers through PyAV.
    """
    if len(data) > limits.max_bytes:
        raise MediaTooLarge(f"Media item exceeds the limit of {limits.max_bytes} bytes.")
    img = _open_image(data, limits, _PILLOW_VIDEO_FORMATS)
    if img is not None:
        with img:
            return _decode_animated(img, limits)
    return _decode_container(data, limits)


def _decode_animated(img: Image.Image, limits: MediaLimits) -> list[Image.Image]:
    _check_pixels(img.width, img.height, limits, "video frame")
    try:
        total = int(getattr(img, "n_frames", 1))
        if total > limits.max_video_frames:
            raise MediaTooLarge(f"The video has {total} frames; at most {limits.max_video_frames} are accepted.")
        frames = []
        for i in sample_frame_indices(total, limits.video_frames):
            img.seek(i)
            frames.append(to_rgb(img))
    except Image.DecompressionBombError:
        raise MediaTooLarge(f"The video frame exceeds {limits.max_image_pixels} pixels.") from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        raise InvalidMedia(f"The animated image could not be decoded: {e}") from None
    return frames


def _decode_container(data: bytes, limits: MediaLimits) -> list[Image.Image]:
    try:
        total = _count_video_packets(data, limits)
        wanted = sample_frame_indices(total, limits.video_frames)
        last_wanted = wanted[-1]
        frames: list[Image.Image] = []
        last = None
        with av.open(io.BytesIO(data), mode="r") as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            wanted_set = set(wanted)
            for i, frame in enumerate(container.decode(stream)):
                if i >= limits.max_video_frames:
                    raise MediaTooLarge(f"The video has more than {limits.max_video_frames} frames.")
                _check_pixels(frame.width, frame.height, limits, "video frame")
                last = frame
                if i in wanted_set:
                    frames.append(frame.to_image())
                if i >= last_wanted:
                    break
            # packet counts can exceed decodable frames (e.g. a truncated tail); keep the count predictable
            if last is not None and len(frames) < len(wanted):
                tail = last.to_image()
                frames.extend(tail.copy() for _ in range(len(wanted) - len(frames)))
    except (av.error.FFmpegError, OSError, ValueError, IndexError) as e:
        raise InvalidMedia(f"The media is not a decodable video: {e}") from None
    if not frames:
        raise InvalidMedia("The video contains no decodable frames.")
    return [to_rgb(f) for f in frames]


def _count_video_packets(data: bytes, limits: MediaLimits) -> int:
    """Frames of the first video stream, counted from packets without decoding them."""
    with av.open(io.BytesIO(data), mode="r") as container:
        if not container.streams.video:
            raise InvalidMedia("The media has no video stream.")
        stream = container.streams.video[0]
        ctx = stream.codec_context
        if ctx.width and ctx.height:
            _check_pixels(ctx.width, ctx.height, limits, "video frame")
        count = 0
        for packet in container.demux(stream):
            if packet.size:
                count += 1
                if count > limits.max_video_frames:
                    raise MediaTooLarge(f"The video has more than {limits.max_video_frames} frames.")
    if count == 0:
        raise InvalidMedia("The video contains no frames.")
    return count
