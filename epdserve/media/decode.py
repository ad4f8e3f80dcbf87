"""Decoding client media bytes into RGB PIL images and sampled video frames, under limits.

Sizes are checked from the container header before pixel data is decoded, so a small file that
claims a huge canvas (a decompression bomb) is refused without allocating it. Pillow's own
``Image.MAX_IMAGE_PIXELS`` is a process-wide setting read inside ``Image.open``; it is left
untouched and only acts as a backstop (its bomb error also maps to 413).

A video also reports its timing: the seconds between consecutive *sampled* frames (the mean over
the sampled span), from the file's own clock (GIF/WebP per-frame durations, a container's packet
timestamps), as transformers and vLLM take a video's frame rate from its metadata. A file with no
usable clock (zero or absent durations) reports None, and the caller falls back to the processor's
fps. The value comes from client bytes, so it is bounded: finite, positive, at most
``MAX_SECOND_PER_GRID`` seconds.

Every decode runs under a ``DecodeBudget`` (``media.budget``): only accepted formats are parsed,
frames x canvas is checked from the header, and the decode stops between frames once the item's
pixels or wall-clock time are spent. Whatever a decoder raises on the bytes becomes a MediaError.
"""

from __future__ import annotations

import io
import math
from fractions import Fraction
from typing import NamedTuple

import av
import av.error
from PIL import Image, UnidentifiedImageError

from epdserve.media.budget import DEMUXERS, PILLOW_NAMES, DecodeBudget, check_format, guarded
from epdserve.media.errors import InvalidMedia, MediaTooLarge
from epdserve.media.limits import MAX_SECOND_PER_GRID, MediaLimits
from epdserve.media.processor import sample_frame_indices


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


def _open_image(data: bytes, fmt: str, limits: MediaLimits) -> Image.Image:
    """Open (header only) with the one Pillow plugin of ``fmt``."""
    Image.init()
    name = PILLOW_NAMES[fmt]
    if name not in Image.OPEN:  # WebP may be missing from the build
        raise InvalidMedia(f"This server cannot decode {fmt.upper()} media.")
    try:
        return Image.open(io.BytesIO(data), formats=(name,))
    except Image.DecompressionBombError:
        raise MediaTooLarge(f"The image is too large; at most {limits.max_image_pixels} pixels are accepted.") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        # SyntaxError is how several Pillow plugins report a corrupt header
        raise InvalidMedia(f"The media is not a decodable {fmt.upper()} image.") from None


def decode_image(data: bytes, limits: MediaLimits, budget: DecodeBudget | None = None) -> Image.Image:
    """Decode an image (first frame of animated formats) into an RGB image."""
    if len(data) > limits.max_bytes:
        raise MediaTooLarge(f"Media item exceeds the limit of {limits.max_bytes} bytes.")
    budget = budget or DecodeBudget(limits)
    fmt = check_format(data, limits.image_formats, "image")
    with guarded("image"), _open_image(data, fmt, limits) as img:
        _check_pixels(img.width, img.height, limits, "image")
        budget.charge(img.width * img.height, "image")
        budget.keep(1, img.width, img.height)
        img.load()
        return to_rgb(img)


class Video(NamedTuple):
    """A decoded video: its sampled frames and their timing."""

    frames: list[Image.Image]  # RGB, ``limits.video_frames`` of them (all when the clip has fewer)
    interval_s: float | None  # seconds between consecutive sampled frames; None: the file has no clock


def decode_video(data: bytes, limits: MediaLimits, budget: DecodeBudget | None = None) -> Video:
    """Decode a video and sample ``limits.video_frames`` frames evenly (all when it has fewer).

    Animated GIF/WebP/PNG (and still images, as 1-frame videos) go through Pillow; MP4 and WebM
    through PyAV, each with its one demuxer.
    """
    return _video(data, limits, keep=True, budget=budget)


def video_interval(data: bytes, limits: MediaLimits, budget: DecodeBudget | None = None) -> float | None:
    """``decode_video(data, limits).interval_s`` without converting frames (a container's packets
    are only demuxed): the timing of an item whose embeddings are cached."""
    return _video(data, limits, keep=False, budget=budget).interval_s


def _video(data: bytes, limits: MediaLimits, keep: bool, budget: DecodeBudget | None) -> Video:
    if len(data) > limits.max_bytes:
        raise MediaTooLarge(f"Media item exceeds the limit of {limits.max_bytes} bytes.")
    budget = budget or DecodeBudget(limits)
    # a still image in an accepted image format is a one-frame video
    fmt = check_format(data, tuple(dict.fromkeys(limits.video_formats + limits.image_formats)), "video")
    with guarded("video"):
        if fmt in DEMUXERS:
            return _decode_container(data, DEMUXERS[fmt], limits, keep, budget)
        with _open_image(data, fmt, limits) as img:
            return _decode_animated(img, limits, keep, budget)


def _sampled_interval(starts: list[float], wanted: list[int], first_duration: float) -> float | None:
    """Mean seconds between the ``wanted`` frames, given each frame's start time (``starts``, up to
    the last wanted one); a single frame's is its own duration. None when not finite and positive."""
    n = len(wanted)
    seconds = (starts[wanted[-1]] - starts[wanted[0]]) / (n - 1) if n > 1 else first_duration
    if not math.isfinite(seconds) or seconds <= 0:
        return None
    return min(seconds, MAX_SECOND_PER_GRID)


def _decode_animated(img: Image.Image, limits: MediaLimits, keep: bool, budget: DecodeBudget) -> Video:
    _check_pixels(img.width, img.height, limits, "video frame")
    # the frame count comes from walking the frame headers, without decoding pixels
    total = int(getattr(img, "n_frames", 1))
    if total > limits.max_video_frames:
        raise MediaTooLarge(f"The video has {total} frames; at most {limits.max_video_frames} are accepted.")
    wanted = sample_frame_indices(total, limits.video_frames)
    wanted_set = set(wanted)
    # each frame is composed on the whole canvas, however small the frame itself is
    canvas = img.width * img.height
    budget.plan(wanted[-1] + 1, img.width, img.height, "video")
    if keep:
        budget.keep(len(wanted), img.width, img.height)
    frames, starts, durations = [], [0.0], []
    # every frame up to the last wanted one: its duration is part of the later frames' times
    # (seeking decodes the frames in between anyway)
    for i in range(wanted[-1] + 1):
        budget.charge(canvas, "video")
        img.seek(i)
        img.load()  # WebP reports a frame's duration once it is loaded
        durations.append(max(0.0, float(img.info.get("duration") or 0)) / 1000)
        starts.append(starts[-1] + durations[-1])
        if starts[-1] > limits.max_video_seconds:
            raise MediaTooLarge(f"The video is longer than {limits.max_video_seconds:g} s.")
        if keep and i in wanted_set:
            frames.append(to_rgb(img))
    return Video(frames, _sampled_interval(starts, wanted, durations[0]))


def _decode_container(data: bytes, demuxer: str, limits: MediaLimits, keep: bool, budget: DecodeBudget) -> Video:
    try:
        total, starts, first_duration = _count_video_packets(data, demuxer, limits, budget)
        wanted = sample_frame_indices(total, limits.video_frames)
        interval = _sampled_interval(starts, wanted, first_duration) if starts else None
        if not keep:
            return Video([], interval)
        last_wanted = wanted[-1]
        frames: list[Image.Image] = []
        last = None
        with av.open(io.BytesIO(data), mode="r", format=demuxer) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            ctx = stream.codec_context
            if ctx.width and ctx.height:
                budget.plan(last_wanted + 1, ctx.width, ctx.height, "video")
                budget.keep(len(wanted), ctx.width, ctx.height)
            wanted_set = set(wanted)
            for i, frame in enumerate(container.decode(stream)):
                if i >= limits.max_video_frames:
                    raise MediaTooLarge(f"The video has more than {limits.max_video_frames} frames.")
                _check_pixels(frame.width, frame.height, limits, "video frame")
                budget.keep(len(wanted), frame.width, frame.height)  # a header without the size: the first frame's
                budget.charge(frame.width * frame.height, "video")
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
    return Video([to_rgb(f) for f in frames], interval)


def _count_video_packets(
    data: bytes, demuxer: str, limits: MediaLimits, budget: DecodeBudget
) -> tuple[int, list[float], float]:
    """Frames of the first video stream, counted from packets without decoding them, with their
    start times in presentation order (frame i is the i-th decoded; empty when a packet has no
    timestamp) and the first one's duration, in seconds."""
    with av.open(io.BytesIO(data), mode="r", format=demuxer) as container:
        if not container.streams.video:
            raise InvalidMedia("The media has no video stream.")
        stream = container.streams.video[0]
        ctx = stream.codec_context
        if ctx.width and ctx.height:
            _check_pixels(ctx.width, ctx.height, limits, "video frame")
        if stream.frames > limits.max_video_frames:  # the header's count, when it has one
            raise MediaTooLarge(
                f"The video has {stream.frames} frames; at most {limits.max_video_frames} are accepted."
            )
        if container.duration is not None and container.duration / av.time_base > limits.max_video_seconds:
            raise MediaTooLarge(f"The video is longer than {limits.max_video_seconds:g} s.")
        count = 0
        stamps: list[tuple[int, int]] = []  # (pts, duration) in time_base units
        timed = True
        for packet in container.demux(stream):
            if packet.size:
                count += 1
                if count % 64 == 0:  # demuxing is cheap, but a file may hold many packets
                    budget.check("video")
                if count > limits.max_video_frames:
                    raise MediaTooLarge(f"The video has more than {limits.max_video_frames} frames.")
                timed = timed and packet.pts is not None
                if timed:
                    stamps.append((int(packet.pts), int(packet.duration or 0)))  # type: ignore[arg-type]
        base = stream.time_base
    if count == 0:
        raise InvalidMedia("The video contains no frames.")
    if not timed or base is None:
        return count, [], 0.0
    stamps.sort()  # decode order → presentation order
    tb = Fraction(base)
    if float((stamps[-1][0] - stamps[0][0]) * tb) > limits.max_video_seconds:
        raise MediaTooLarge(f"The video is longer than {limits.max_video_seconds:g} s.")
    return count, [float(pts * tb) for pts, _ in stamps], float(stamps[0][1] * tb)
