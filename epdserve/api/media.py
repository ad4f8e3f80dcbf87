"""Resolve a request's media parts into engine media inputs (shared by the PD and encoder roles).

Raw media (``image_url`` / ``video_url``, inline ``input_audio``) is fetched, decoded, hashed and
preprocessed here, off the event loop. Metadata-only parts (``image_embeds`` / ``video_embeds``)
are resolved by an ``EmbedsResolver`` (the EC-connector consumer) — the pixels never come back.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import TypeVar

import aiohttp

from epdserve.api.errors import BadRequest, from_media_error
from epdserve.api.protocol import EmbedsPart, ImageUrlPart, InputAudioPart, MediaPart, VideoUrlPart
from epdserve.engine.inputs import MediaInput
from epdserve.media.audio import AudioProcessor
from epdserve.media.budget import DecodeBudget, run_decode
from epdserve.media.decode import decode_image, decode_video, video_interval
from epdserve.media.errors import InvalidMedia, MediaError, MediaTooLarge
from epdserve.media.fetch import load_media_bytes
from epdserve.media.hashing import media_uuid
from epdserve.media.limits import MediaLimits
from epdserve.media.processor import VisionProcessor

EmbedsResolver = Callable[[EmbedsPart], Awaitable[MediaInput]]
Hold = Callable[[int], None]  # takes bytes for an item about to be decoded (``media.pending.Reservation.take``)
T = TypeVar("T")


class MediaResolver:
    """Raw media → ``MediaInput`` (pixels + grid + uuid); metadata-only parts via ``embeds``."""

    def __init__(
        self,
        model_id: str,
        processor: VisionProcessor,
        limits: MediaLimits,
        executor: Executor,
        session: aiohttp.ClientSession | None = None,
        embeds: EmbedsResolver | None = None,
        audio: AudioProcessor | None = None,
    ) -> None:
        """``audio``: the audio model's feature extractor (None: audio parts are refused)."""
        self.model_id = model_id
        self.processor = processor
        self.limits = limits
        self.executor = executor
        self.session = session
        self.embeds = embeds
        self.processor_kwargs = processor.config.hash_kwargs(limits.video_frames)
        self.audio = audio
        self.audio_kwargs = dataclasses.asdict(audio.config) if audio is not None else {}

    async def resolve(self, parts: list[MediaPart], hold: Hold | None = None) -> list[MediaInput]:
        """``hold``: told, from the preprocessing thread, what each image or video will hold before
        its pixels are decoded (``process_bytes``)."""
        return list(await asyncio.gather(*(self._one(p, hold) for p in parts)))

    async def resolve_then(
        self,
        parts: list[MediaPart],
        then: Callable[[list[MediaInput]], T],
        executor: Executor,
        hold: Hold | None = None,
    ) -> T:
        """``then(resolved parts)``, run in ``executor`` (``hold``: as ``resolve``'s). A request
        with one image or video (the common case) is decoded, preprocessed and handed to ``then``
        in one executor job: every hop between the event loop and a thread waits for both to be
        free, and under load that wait was most of a request's preprocessing time. Several raw
        items are still processed concurrently, each in its own job."""
        part = parts[0] if len(parts) == 1 else None
        if isinstance(part, ImageUrlPart | VideoUrlPart):
            return await self._url_media(part, lambda item: then([item]), hold)
        media = await self.resolve(parts, hold)
        return await asyncio.get_running_loop().run_in_executor(executor, then, media)

    async def _one(self, part: MediaPart, hold: Hold | None) -> MediaInput:
        if isinstance(part, EmbedsPart):
            if self.embeds is None:
                raise BadRequest("This server does not accept metadata-only media (no EC connector configured).")
            return await self.embeds(part)
        if isinstance(part, InputAudioPart):
            audio = part.input_audio
            try:
                return await run_decode(
                    self.executor, lambda cancelled: self.process_audio(audio.data, audio.format, cancelled)
                )
            except MediaError as e:
                raise from_media_error(e) from None
        return await self._url_media(part, lambda item: item, hold)

    async def _url_media(
        self, part: ImageUrlPart | VideoUrlPart, after: Callable[[MediaInput], T], hold: Hold | None
    ) -> T:
        """An image or video: fetched here, then decoded, preprocessed and passed to ``after`` in
        one executor job."""
        url = part.image_url.url if isinstance(part, ImageUrlPart) else part.video_url.url
        modality = "image" if isinstance(part, ImageUrlPart) else "video"
        try:
            data = await load_media_bytes(url, self.limits, self.session)
            return await run_decode(
                self.executor, lambda cancelled: after(self.process_bytes(modality, data, "", cancelled, hold))
            )
        except MediaError as e:  # the edge: media errors become HTTP errors here
            raise from_media_error(e) from None

    def hash_kwargs(self, modality: str) -> dict:
        """The preprocessing settings an item's uuid covers (``media.hashing``)."""
        return self.audio_kwargs if modality == "audio" else self.processor_kwargs

    def process_bytes(
        self,
        modality: str,
        data: bytes,
        audio_format: str = "",
        cancelled: threading.Event | None = None,
        hold: Hold | None = None,
    ) -> MediaInput:
        """Decode + preprocess (CPU work, runs in the executor); ``audio_format`` is the format
        an audio was declared in ("wav", "flac" or "mp3"); ``cancelled``: set when the request
        is abandoned (the decode stops); ``hold``: told the bytes an image or video will hold
        (``VisionProcessor.footprint``) once its header gives its size, before its pixels are
        decoded; it refuses the item by raising."""
        processor = self.processor

        def reserve(frames: int, width: int, height: int) -> None:
            assert hold is not None
            hold(processor.footprint(modality, frames, width, height))

        budget = DecodeBudget(self.limits, cancelled, reserve=reserve if hold is not None else None)
        if modality == "audio":
            return self._audio(data, audio_format, budget)
        uuid = media_uuid(self.model_id, modality, data, self.processor_kwargs)
        if modality == "image":
            vi, second = self.processor.image(decode_image(data, self.limits, budget)), None
        else:
            video = decode_video(data, self.limits, budget)
            # the clip's own timing (every role derives it from the same bytes the same way)
            vi, second = (
                self.processor.video(video.frames),
                self.processor.config.video_second_per_grid(video.interval_s),
            )
        return MediaInput(uuid, modality, vi.grid_thw, vi.pixel_values, second_per_grid=second)

    def video_second_per_grid(self, data: bytes) -> float:
        """A video's seconds per temporal patch without decoding its frames (an item whose
        embeddings are cached); equals ``process_bytes``'s."""
        return self.processor.config.video_second_per_grid(video_interval(data, self.limits))

    def process_audio(
        self, data_b64: str, declared_format: str, cancelled: threading.Event | None = None
    ) -> MediaInput:
        """Base64 audio → log-mel features (CPU work, runs in the executor)."""
        if self.audio is None:
            raise InvalidMedia("This model takes no audio input.")
        if len(data_b64) // 4 * 3 > self.limits.max_bytes:  # before decoding it
            raise MediaTooLarge(f"The audio is larger than {self.limits.max_bytes} bytes.")
        try:
            data = base64.b64decode(data_b64, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidMedia("input_audio.data is not valid base64.") from None
        return self._audio(data, declared_format, DecodeBudget(self.limits, cancelled))

    def _audio(self, data: bytes, declared_format: str, budget: DecodeBudget) -> MediaInput:
        if self.audio is None:
            raise InvalidMedia("This model takes no audio input.")
        uuid = media_uuid(self.model_id, "audio", data, self.audio_kwargs)
        feats = self.audio.process(data, declared_format, self.limits, budget=budget)
        return MediaInput(uuid, "audio", feats.grid_thw, feats.features)
