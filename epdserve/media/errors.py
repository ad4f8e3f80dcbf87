"""Why a media item could not be used: the media layer's own errors, free of HTTP.

The API edge maps each kind to its status (``api.errors.from_media_error``): invalid → 400,
too large → 413, timed out → 504, each with its ``code``, so that a router reading another
instance's answer knows the request's own media failed, not the instance.
"""

from __future__ import annotations


class MediaError(Exception):
    """The client's media item is unusable; fails that request only."""

    code = "invalid_media"  # the error code of its API answer

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else type(self).__name__


class InvalidMedia(MediaError):
    """Malformed, undecodable, refused (address, domain, scheme) or unfetchable media."""


class MediaTooLarge(MediaError):
    """The media exceeds a configured size limit (bytes, pixels, frames, decode work or time)."""

    code = "media_too_large"


class MediaTimeout(MediaError):
    """Fetching the media took longer than the configured limit."""

    code = "media_timeout"


# the codes of answers about a request's own media, never about the instance that gave them
MEDIA_CODES = frozenset({MediaError.code, MediaTooLarge.code, MediaTimeout.code})
