"""Limits on client-supplied media: sizes, pixels, frames, fetch policy and items per prompt."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

# Most seconds of video one temporal patch may stand for (a video's timing comes from client bytes
# or a client's ``video_embeds``; Qwen2.5-VL's positions grow with it): far beyond any real clip's
# sampled frame spacing.
MAX_SECOND_PER_GRID: Final = 3600.0

# the formats VLM clients send, each told from its leading bytes (``media.formats``); any other is refused
IMAGE_FORMATS: Final = ("png", "jpeg", "webp", "gif", "bmp")
VIDEO_FORMATS: Final = ("gif", "webp", "mp4", "webm")
AUDIO_FORMATS: Final = ("wav", "flac", "mp3")


@dataclass(frozen=True)
class MediaLimits:
    """What the API edge accepts from clients before any media reaches a model."""

    max_bytes: int = 20 * 1024 * 1024  # largest encoded media item (data URL payload or HTTP body)
    max_image_pixels: int = 4096 * 4096  # largest width*height of an image or video frame (decompression bombs)
    max_video_frames: int = 3600  # most frames a video may contain (bounds decode work)
    max_video_seconds: float = 3600.0  # longest video accepted, by its own clock
    max_decode_pixels: int = 4096 * 4096 * 128  # most pixels decoding one item may produce: frames decoded x canvas
    decode_timeout_s: float = 15.0  # wall-clock limit for decoding one media item; the decode stops when it is spent
    image_formats: tuple[str, ...] = IMAGE_FORMATS  # image formats accepted (png jpeg webp gif bmp)
    video_formats: tuple[str, ...] = VIDEO_FORMATS  # video formats accepted (gif webp mp4 webm)
    audio_formats: tuple[str, ...] = AUDIO_FORMATS  # audio formats accepted (wav flac mp3)
    video_frames: int = 4  # frames sampled evenly from each video
    fetch_timeout_s: float = 10.0  # wall-clock limit for fetching one http(s) media URL, redirects included
    max_redirects: int = 3  # redirects followed per fetch (each hop is re-checked)
    allow_private_addresses: bool = False  # allow fetching from private/loopback/link-local/reserved addresses
    allowed_media_domains: tuple[str, ...] = field(default=())  # host names allowed for http(s) media; empty = any
    max_images_per_prompt: int = 8  # image items (URLs and embeds) per request; 0 disables images
    max_videos_per_prompt: int = 2  # video items (URLs and embeds) per request; 0 disables videos
    max_audios_per_prompt: int = 2  # audio items (inline and embeds) per request; 0 disables audio
    max_audio_seconds: float = 30.0  # longest audio accepted (an encoder's window may be shorter: Whisper's is 30 s)
    min_audio_sample_rate: int = 8000  # lowest sample rate accepted, in Hz
    max_audio_sample_rate: int = 192000  # highest sample rate accepted, in Hz (bounds the resampling work)

    def __post_init__(self) -> None:
        positive = {
            "max_bytes": self.max_bytes,
            "max_image_pixels": self.max_image_pixels,
            "max_video_frames": self.max_video_frames,
            "max_video_seconds": self.max_video_seconds,
            "max_decode_pixels": self.max_decode_pixels,
            "decode_timeout_s": self.decode_timeout_s,
            "video_frames": self.video_frames,
            "fetch_timeout_s": self.fetch_timeout_s,
            "max_audio_seconds": self.max_audio_seconds,
            "min_audio_sample_rate": self.min_audio_sample_rate,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"MediaLimits.{name} must be positive, got {value!r}")
        for name, count in (
            ("max_redirects", self.max_redirects),
            ("max_images_per_prompt", self.max_images_per_prompt),
            ("max_videos_per_prompt", self.max_videos_per_prompt),
            ("max_audios_per_prompt", self.max_audios_per_prompt),
        ):
            if count < 0:
                raise ValueError(f"MediaLimits.{name} must be >= 0, got {count}")
        if self.max_audio_sample_rate < self.min_audio_sample_rate:
            raise ValueError(
                f"MediaLimits.max_audio_sample_rate {self.max_audio_sample_rate} is below "
                f"min_audio_sample_rate {self.min_audio_sample_rate}"
            )
        for name, known in (
            ("image_formats", IMAGE_FORMATS),
            ("video_formats", VIDEO_FORMATS),
            ("audio_formats", AUDIO_FORMATS),
        ):
            formats = tuple(f.strip().lower() for f in getattr(self, name))
            unknown = sorted(set(formats) - set(known))
            if unknown:
                raise ValueError(f"MediaLimits.{name}: unknown {', '.join(unknown)}; known: {', '.join(known)}")
            object.__setattr__(self, name, formats)
        # host names compare case-insensitively and without a trailing root dot
        object.__setattr__(
            self, "allowed_media_domains", tuple(d.strip().rstrip(".").lower() for d in self.allowed_media_domains)
        )

    def max_items(self, modality: str) -> int:
        """Items of ``modality`` ("image", "video" or "audio") allowed in one prompt."""
        if modality == "image":
            return self.max_images_per_prompt
        if modality == "video":
            return self.max_videos_per_prompt
        if modality == "audio":
            return self.max_audios_per_prompt
        return 0

    def domain_allowed(self, host: str) -> bool:
        return not self.allowed_media_domains or host.rstrip(".").lower() in self.allowed_media_domains
