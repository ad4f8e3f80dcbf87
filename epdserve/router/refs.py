"""The media parts of a chat request, as the router tracks them: where each sits in the body, and
the encode result (metadata and leases) that replaces it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from epdserve.encoder.protocol import EncodedItem

MEDIA_TYPES = {"image_url": "image", "video_url": "video"}


@dataclass
class MediaRef:
    """Where a media part sits in the request body, and its encode result."""

    message: int
    part: int
    modality: str
    url: str
    result: EncodedItem | None = None
    encoder: str = ""  # the encoder that issued ``result``'s lease ("" for a directory hit: no lease)
    directory_key: str | None = None  # its key in the router's media directory (data: URLs)
    from_directory: bool = False  # ``result`` came from the directory, not an encode call
    skipped: bool = False  # not encoded: ``result`` holds a cached handle (the worker holds its KV)


def media_refs(body: dict[str, Any]) -> list[MediaRef]:
    refs = []
    for mi, m in enumerate(body.get("messages") or []):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        for pi, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in MEDIA_TYPES:
                refs.append(MediaRef(mi, pi, MEDIA_TYPES[kind], part[kind]["url"]))
    return refs
