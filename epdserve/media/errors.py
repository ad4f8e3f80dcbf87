"""Why a media item could not be used: the media layer's own errors, free of HTTP.

The API edge maps each kind to its status (``api.errors.from_media_error``): invalid → 400,
too large → 413, timed out → 504.
"""

from __future__ import annotations


class MediaError(Exception):
    """The client's media item is unusable; fails that request only."""

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else type(self).__name__


class InvalidMedia(MediaError):
    """Malformed, undecodable, refused (address, domain, scheme) or unfetchable media."""


class MediaTooLarge(MediaError):
    """The media exceeds a configured size limit (bytes, pixels, frames)."""


class MediaTimeout(MediaError):
    """Fetching the media took longer than the configured limit."""
