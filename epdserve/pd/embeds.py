"""Metadata-only media on the language-model side: embeddings by connector handle, or inline.

The request carries only the grid, the content uuid and either a connector handle (from the
router's authenticated internal call; ``protocol.check_embeds_trust`` has already refused handles
from anyone else) or inline data (a client's own embeddings, where ``--enable-mm-embeds`` allows
them). The placeholder count follows from the grid; the embeddings are fetched (and validated
against that count and the model's embedding width) while the request is still outside the
engine, so a slow or failed fetch never stalls the running batch — it fails only its own request:
400 for a handle that does not verify, 503 (code ``embeddings_unavailable``, which the router
retries with a fresh encode) for embeddings that are gone. Client-facing messages name no internal
path, host or port; the details go to the log.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import logging
import time

import numpy as np
import torch

from epdserve.api.errors import EMBEDS_UNAVAILABLE, BadRequest, Unavailable
from epdserve.api.protocol import ChatRequest, ImageEmbedsPart, VideoEmbedsPart, embeds_of
from epdserve.engine.inputs import MediaInput
from epdserve.models.precision import TORCH_DTYPES
from epdserve.transfer.base import ECConsumer, InvalidHandle, TransferError

log = logging.getLogger(__name__)


class ConnectorEmbeds:
    """An ``EmbedsResolver`` backed by an EC consumer (handles) and inline decoding (data)."""

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
        rows = t * h * w // (self.merge * self.merge)
        embeds = embeds_of(part)
        if embeds.data is not None:
            emb, uuid = self._inline(modality, grid, embeds.data, embeds.dtype, rows)
            return MediaInput(uuid, modality, (t, h, w), embeddings=emb)
        if part.ec_handle is None:
            raise BadRequest(f"A metadata-only {modality} item needs an ec_handle or inline data.")
        if part.ec_handle.get("key") != part.uuid:
            # the uuid keys the prefix cache: it must be the one the producer signed
            await self._release(part)
            raise BadRequest(f"The ec_handle of {modality} {part.uuid} is not valid: it names other content.")
        t0 = time.perf_counter()
        try:
            emb = await self.consumer.get(part.ec_handle, rows, self.width, self.model_id)
        except InvalidHandle as e:
            self.failures += 1
            log.warning("refused an ec_handle for %s %s: %s", modality, part.uuid, e)
            raise BadRequest(f"The ec_handle of {modality} {part.uuid} is not valid: {e}") from None
        except (TransferError, KeyError, TypeError, ValueError) as e:
            self.failures += 1
            log.warning("embeddings for %s %s unavailable: %s", modality, part.uuid, e)
            raise Unavailable(
                f"Embeddings for {modality} {part.uuid} are unavailable.", code=EMBEDS_UNAVAILABLE
            ) from None
        finally:
            await self._release(part)
        self.seconds += time.perf_counter() - t0
        self.bytes += emb.numel() * emb.element_size()
        return MediaInput(part.uuid, modality, (t, h, w), embeddings=emb)

    def _inline(self, modality: str, grid: tuple[int, int, int], data: str, dtype: str, rows: int):
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise BadRequest(f"Inline {modality} embeddings are not valid base64.") from None
        torch_dtype = TORCH_DTYPES[dtype]
        expected = rows * self.width * torch_dtype.itemsize
        if len(raw) != expected:
            raise BadRequest(
                f"Inline {modality} embeddings hold {len(raw)} bytes; grid {list(grid)} needs {rows} rows of "
                f"{self.width} {dtype} values ({expected} bytes)."
            )
        emb = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy()).view(torch_dtype).reshape(rows, self.width)
        if not torch.isfinite(emb).all():
            raise BadRequest(f"Inline {modality} embeddings contain NaN or infinite values.")
        # The uuid keys the prefix cache, so it comes from the content, never from the client: a
        # client naming another image's uuid must not share (or poison) that image's cached blocks.
        digest = hashlib.sha256(f"{self.model_id}|{modality}|{list(grid)}|{dtype}|".encode() + raw).hexdigest()
        return emb, f"inline-{digest}"

    async def _release(self, part: ImageEmbedsPart | VideoEmbedsPart) -> None:
        # a failed release is harmless: the producer reclaims the lease after its TTL
        if part.ec_handle is not None:
            with contextlib.suppress(TransferError, KeyError, TypeError, ValueError, OSError):
                await self.consumer.release(part.ec_handle)

    async def release_all(self, req: ChatRequest) -> None:
        """Give back every handle of a request that will not run (rejected or abandoned)."""
        for part in req.media_parts():
            if isinstance(part, ImageEmbedsPart | VideoEmbedsPart):
                await self._release(part)
