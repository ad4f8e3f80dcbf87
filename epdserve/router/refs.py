"""The media parts of a chat request, as the router tracks them: where each sits in the body, and
the encode result (metadata and leases) that replaces it."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from epdserve.encoder.protocol import EncodedItem
from epdserve.media.audio import audio_data_url

MEDIA_TYPES = {"image_url": "image", "video_url": "video", "input_audio": "audio"}


@dataclass
class MediaRef:
    """Where a media part sits in the request body, and its encode result."""

    message: int
    part: int
    modality: str
    url: str  # an input_audio part's as a data:audio/<format> URL
    result: EncodedItem | None = None
    encoder: str = ""  # the encoder that issued ``result``'s lease ("" for a directory hit: no lease)
    directory_key: str | None = None  # its key in the router's media directory (data: URLs)
    from_directory: bool = False  # ``result`` came from the directory, not an encode call
    skipped: bool = False  # not encoded: ``result`` holds a cached handle (the worker holds its KV)
    pixels: dict[str, Any] | None = None  # frontend decode: its pixel handle, for the encode call
    decode_s: float = 0.0  # frontend decode: the router's fetch and decode of it
    raw: bool = False  # sent as it came: the worker encodes it itself (adaptive dispatch)
    patches: int = 0  # adaptive dispatch: the patches it is predicted to have (0: not predicted)

    @property
    def settled(self) -> bool:
        """It has what the worker needs: a result, or it goes raw."""
        return self.raw or self.result is not None

    def content(self) -> dict[str, Any] | None:
        """The content part that replaces the client's, or None to keep the client's (raw)."""
        if self.raw:
            return None
        assert self.result is not None
        return self.result.embeds_part()


def media_refs(body: dict[str, Any]) -> list[MediaRef]:
    refs = []
    for mi, m in enumerate(body.get("messages") or []):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        for pi, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "input_audio":  # a validated request: data and format are there
                url = audio_data_url(part[kind]["data"], part[kind]["format"])
                refs.append(MediaRef(mi, pi, "audio", url))
            elif kind in MEDIA_TYPES:
                refs.append(MediaRef(mi, pi, MEDIA_TYPES[kind], part[kind]["url"]))
    return refs


def with_parts(body: dict[str, Any], refs: list[MediaRef]) -> dict[str, Any]:
    """A copy of ``body`` for a worker: each settled media part replaced by its metadata-only
    part (raw ones kept as the client sent them); the client's body is left as it was."""
    out = copy.copy(body)
    out["messages"] = copy.deepcopy(body["messages"])
    for r in refs:
        part = r.content()
        if part is not None:
            out["messages"][r.message]["content"][r.part] = part
    return out
