"""Metadata-only media on the language-model side: fetch embeddings through the EC connector.

The request carries only the grid, the content uuid and a connector handle. The placeholder count
follows from the grid; the embeddings are fetched (and validated against that count and the
model's embedding width) while the request is still outside the engine, so a slow or failed fetch
never stalls the running batch — it fails only its own request, with 503.
"""

from __future__ import annotations

import contextlib
import time

from epdserve.api.errors import BadRequest, Unavailable
from epdserve.api.protocol import ImageEmbedsPart, VideoEmbedsPart
from epdserve.engine.inputs import MediaInput
from epdserve.transfer.base import ECConsumer, TransferError


class ConnectorEmbeds:
    """An ``EmbedsResolver`` backed by an EC consumer."""

    def __init__(self, consumer: ECConsumer, model_id: str, width: int, merge_size: int) -> None:
        self.consumer = consumer
        self.model_id = model_id
        self.width = width
        self.merge = merge_size
        self.bytes = 0  # statistics for /metrics
        self.seconds = 0.0
        self.failures = 0

    async def __call__(self, part: ImageEmbedsPart | VideoEmbedsPart) -> MediaInput:
        if isinstance(part, ImageEmbedsPart):
            modality, grid = "image", part.image_embeds.image_grid_thw
        else:
            modality, grid = "video", part.video_embeds.video_grid_thw
        t, h, w = grid
        if h % self.merge or w % self.merge:
            raise BadRequest(f"{modality}_grid_thw {list(grid)}: h and w must be multiples of {self.merge}.")
        if part.ec_handle is None:
            raise BadRequest(f"A metadata-only {modality} item needs an ec_handle.")
        rows = t * h * w // (self.merge * self.merge)
        t0 = time.perf_counter()
        try:
            emb = await self.consumer.get(part.ec_handle, rows, self.width, self.model_id)
        except (TransferError, KeyError, TypeError, ValueError) as e:
            self.failures += 1
            raise Unavailable(f"Embeddings for {modality} {part.uuid} are unavailable: {e}") from None
        finally:
            # a failed release is harmless: the producer reclaims the handle after its TTL
            with contextlib.suppress(TransferError, KeyError, TypeError, ValueError, OSError):
                await self.consumer.release(part.ec_handle)
        self.seconds += time.perf_counter() - t0
        self.bytes += emb.numel() * emb.element_size()
        return MediaInput(part.uuid, modality, (t, h, w), embeddings=emb)
