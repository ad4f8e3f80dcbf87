"""The flags of ``MediaLimits`` (``media.limits``) every role offers."""

from __future__ import annotations

from epdserve.config_flags import Flag

MEDIA = "epdserve.media.limits:MediaLimits"
MEDIA_FLAGS = (
    "allowed_media_domains",
    Flag("allow_private_addresses", "--allow-private-media"),
    Flag("fetch_timeout_s", "--media-fetch-timeout"),
    "max_audio_seconds",
    Flag("decode_timeout_s", "--media-decode-timeout"),
    "max_decode_pixels",
    "max_video_seconds",
    "image_formats",
    "video_formats",
    "audio_formats",
)
